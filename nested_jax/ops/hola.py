"""HOLA behind the one door: gated delta state + persistent exact top-w KV cache (SPEC §5).

Per head (``α_t = exp(g_t)``, ``d = K``; ``nested_jax.core.hola.forward`` states every decision)::

    e_t = v_t − α_t S_{t-1}ᵀ k_t ;  S_t = α_t S_{t-1} + β_t k_t e_tᵀ ;  m_t = β_t ‖e_t‖
    A_n = top-w by m over (A_{n-1} ∪ tokens of block n)
    o_t = S_tᵀ (scale · q_t) + σ(λ_h) Σ_{j∈V_t} softmax_j(cache_scale · q̃_tᵀ k̃_j) v_j
    V_t = A_{n-1} ∪ {tokens of block n at positions ≤ t} ∪ {null sink}

Layers call :func:`hola` (a sequence, or a prefill continuing a state) and :func:`hola_step` (one
decoded token), never a core form. ``impl`` picks the form and is never switched silently:

- ``"chunked"`` (default, training): ``core.hola.forward.hola_forward``, the block-parallel form
  (WY/UT chunks for the state path, a ``lax.scan`` over blocks of ``block_size`` tokens for the
  cache). Packed rows (``segment_ids``) run here.
- ``"recurrent"``: ``core.hola.decode.hola_recurrent``, ``hola_decode_step`` in a ``lax.scan``
  over tokens: the exact per-token GDN recurrence and cache, equal to ``"chunked"`` up to float
  rounding, values and gradients (tested). One stream: ``segment_ids`` raise ``ValueError``;
  ``chunk_size`` is ignored. The numpy twin ``core.hola.reference.hola_reference`` is *not* an
  ``impl``: it is float64 numpy with no gradients and no state, a test oracle only.
- ``"pallas"``: ``hola_forward`` with its state path ``(o_state, S_T)`` run by the Pallas gated
  delta kernel (``ops.linear.gated_delta(..., impl="pallas")``: ``pallas_kernels/gated_delta``,
  interpreted off TPU, ``chunk_size`` its chunk, a multiple of 8) and, for one stream
  (no ``segment_ids``) with an eviction other than ``"cumulative_attention"``, its cache read by
  the Pallas cache-read kernel (``pallas_kernels/hola_cache``): the cache path runs in two phases
  (``core.hola.stream.cache_blocks(read=)``: a scan of the top-w merges alone gives every block's
  ``A_{n−1}``, then one kernel reads all blocks). Packed rows and ``"cumulative_attention"``
  (whose merges need the reads' masses) keep the XLA block scan of ``"chunked"`` for the cache
  path, silently: that is the whole routing. The insertion-score residual pass stays XLA. Values
  and gradients equal ``"chunked"`` to f32 rounding (tested).

:func:`hola_step` has a single form (``core.hola.decode.hola_decode_step``): it continues any
sequence form token by token, so it takes every ``impl`` alike (a layer passes its own ``impl``);
one token has no chunk to parallelise, so ``"pallas"`` runs the same XLA step, as
``ops.gated_delta_step`` does for the GDN layers.

Both take the static options as one frozen :class:`HolaRule` (``rule=``; a ``HolaOptions``, the
``model.hola`` config section, is one) and the four learnable per-head arrays as one
:class:`HolaReadParams`, and pass both on whole to the core form. ``chunk_size`` (the WY/UT chunk
of the state path, ``model.chunk_size`` in a config) is a plain keyword of :func:`hola`, as of
``gated_delta``. ``HolaRule``, ``HolaReadParams``, ``HolaState``, ``init_hola_state``,
``EVICTIONS`` and ``READ_NORMS`` stay importable from here (``nested_jax.ops`` lists the rule and
the parameters), so a layer or a config imports HOLA from here only.
"""

from __future__ import annotations

from nested_jax.core.hola.decode import HolaReadParams as HolaReadParams
from nested_jax.core.hola.decode import HolaState as HolaState
from nested_jax.core.hola.decode import hola_decode_step, hola_recurrent
from nested_jax.core.hola.decode import init_hola_state as init_hola_state
from nested_jax.core.hola.forward import HolaKernels, hola_forward
from nested_jax.ops._impl import check_impl as _check_impl
from nested_jax.ops._pallas import pallas_per_shard
from nested_jax.ops._state import pin_head_state
from nested_jax.ops.linear import pallas_gated_delta
from nested_jax.rules import EVICTIONS as EVICTIONS
from nested_jax.rules import READ_NORMS as READ_NORMS
from nested_jax.rules import HolaRule as HolaRule
from pallas_kernels.hola_cache import hola_cache_read_pallas as _hola_cache_read_pallas

__all__ = ["hola", "hola_step"]


def hola(
    q,
    k,
    v,
    g,
    beta,
    params: HolaReadParams,
    *,
    rule: HolaRule,
    initial_state: HolaState | None = None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """HOLA over a sequence (SPEC §5): ``o_t = S_tᵀ (scale·q_t) + σ(λ_h) · o_cache,t``.

    Args:
      q, k: ``[B, T, H, K]`` (unit-norm in the layers); v: ``[B, T, H, V]``.
      g: ``[B, T, H]`` log decay; beta: ``[B, T, H]`` in ``[0, 1]``.
      params: :class:`HolaReadParams`: ``gamma_q, gamma_k [H, K]`` cache-read RMSNorm scales
        (unused for ``read_norm="l2"``), ``sink_logit [H]`` (the sink's value is zero) and
        ``gate_logit [H]`` (the gate ``λ_h``).
      rule: :class:`HolaRule` (cache capacity ``w``, block length ``C``, eviction, read norm, the
        two scales), passed on whole.
      initial_state: optional ``HolaState`` to continue (same ``B, H, K, V`` and the rule's
        ``w, C``).
      segment_ids: optional ``int [B, T]`` packed documents (``"chunked"`` and ``"pallas"``; not
        with ``initial_state``).
      chunk_size: chunk length of the WY/UT state path and residual pass (``"chunked"`` and
        ``"pallas"``, which needs a multiple of 8; ``"recurrent"`` has no chunks).
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (the state path by the Pallas kernel;
        the cache read too for one stream and an eviction other than ``cumulative_attention``).

    Returns:
      ``(o [B, T, H, V] in v's dtype, HolaState)``.
    """
    _check_impl("hola", impl, ("chunked", "recurrent", "pallas"))
    if impl == "recurrent":
        if segment_ids is not None:
            raise ValueError(
                "hola: impl='recurrent' runs one stream and takes no segment_ids; use "
                "impl='chunked' for packed rows"
            )
        o, state = hola_recurrent(q, k, v, g, beta, params, rule=rule, initial_state=initial_state)
    else:
        kernels = HolaKernels()
        if impl == "pallas":
            kernels = HolaKernels(state_path=pallas_gated_delta, cache_read=_pallas_cache_read)
        o, state = hola_forward(
            q, k, v, g, beta, params, rule=rule, initial_state=initial_state,
            segment_ids=segment_ids, chunk_size=chunk_size, kernels=kernels,
        )  # fmt: skip
    return o, pin_head_state(state)


_BH = ("batch", "heads")
_CACHE_READ_LOGICAL = {
    "qh": (*_BH, None, None),
    "kh": (*_BH, None, None),
    "vh": (*_BH, None, None),
    "ck": (*_BH, None, None, None),
    "cv": (*_BH, None, None, None),
    "cval": (*_BH, None, None),
    "filled": (None, None),
    "gamma_q": ("heads", None),
    "gamma_k": ("heads", None),
    "sink": ("heads",),
}


def _pallas_cache_read(qh, kh, vh, cache, filled, params, read_norm, cache_scale):
    """``core.hola.cache.read_blocks``'s contract by the Pallas cache-read kernel: Mosaic in a
    program lowered for TPU, the interpreter elsewhere, one call per (batch, heads) shard under a
    mesh (the read is independent per batch row and head)."""
    ck, cv, cval = cache

    def kernel(interpret, **ops):
        o = _hola_cache_read_pallas(
            **ops, read_norm=read_norm, cache_scale=cache_scale, interpret=interpret
        )
        return (o,)

    operands = dict(
        qh=qh, kh=kh, vh=vh, ck=ck, cv=cv, cval=cval, filled=filled, gamma_q=params.gamma_q,
        gamma_k=params.gamma_k, sink=params.sink_logit,
    )  # fmt: skip
    out_shape = qh.shape[:3] + vh.shape[3:]
    (o,) = pallas_per_shard(
        kernel, operands, _CACHE_READ_LOGICAL, ((*_BH, None, None),), (out_shape,)
    )
    return o


def hola_step(
    state: HolaState,
    q_t,
    k_t,
    v_t,
    g_t,
    beta_t,
    params: HolaReadParams,
    *,
    rule: HolaRule,
    impl: str = "chunked",
):
    """One decoded HOLA token (SPEC §5); token by token it equals :func:`hola` over the sequence.

    The token's write and score go to the block buffer slot ``pos % C``; the read sees
    ``A_{n-1}`` ∪ the filled buffer ∪ sink; a completed block is merged (top-w) into the cache.

    Args:
      state: ``HolaState`` (from ``init_hola_state`` or a previous call); its cache and block
        buffer must have the rule's ``window`` and ``block_size`` entries.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; g_t, beta_t: ``[B, H]``.
      params, rule: as in :func:`hola`, passed on whole.
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (one step form for all three).

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, new HolaState)``.
    """
    _check_impl("hola_step", impl, ("chunked", "recurrent", "pallas"))
    return hola_decode_step(state, q_t, k_t, v_t, g_t, beta_t, params, rule=rule)
