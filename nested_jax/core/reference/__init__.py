"""Reference twins: the plain, slow, obviously-correct form of each fast path, for tests and users.

A reference twin computes what a fast (chunked, fused, hand-differentiated) core function computes,
written again from the SPEC text and sharing no code path with it: token-by-token loops, weights
materialised after every token, inner gradients from ``jax.grad`` instead of hand-derived signals,
explicit visible sets and softmaxes. Each fast path is tested against its twin, as
flash-linear-attention keeps ``naive.py`` beside ``chunk.py``. Twins favour clarity over speed; use
them at small sizes.

- :mod:`nested_jax.core.titans.reference` (SPEC §2): ``chunk_rule`` / ``per_token_rule``, the twins
  of ``titans_linear_*`` and ``titans_mlp_*`` (``jax``, differentiable).
- :mod:`nested_jax.core.reference.hola` (SPEC §5): ``hola_reference``, the twin of ``hola_forward``
  (float64 numpy, values and cache contents; no gradients).

Twins import only ``numpy``, ``jax`` and (as argument types) NamedTuples of ``nested_jax.core``.
"""
