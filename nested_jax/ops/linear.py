"""The linear-memory rules behind one door: linear attention, delta rule, gated delta (SPEC §1).

Layers call these functions, never a core form directly, so switching implementation is a config
value. The implementation is never switched silently (not on sequence length, not on mode): an
``impl`` value that cannot run raises ``ValueError``.

- ``"chunked"``: the WY/UT chunk form of ``nested_jax.core.associative`` (the training default).
- ``"recurrent"``: the per-token ``lax.scan`` ground truth (``chunk_size`` is ignored).
- ``"pallas"``: ``pallas_kernels/gated_delta`` for ``gated_delta`` and ``delta_rule`` (``g = 0``),
  with ``chunk_size`` as its chunk and the Pallas interpreter off TPU; ``linear_attention`` has no
  kernel yet and raises ``ValueError``. This module is the kernels' only importer.

The single-token steps (``*_step``) are the decode forms; ``proteus_key_rows`` is the Proteus
key-row gate of the linear rules (SPEC §4), which turns each rule into its Proteus form; its
schedule is a :class:`ProteusRule` (``ProteusOptions.rule()``), re-exported here for layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nested_jax.core import associative as _assoc
from nested_jax.core.associative import delta_rule_step, gated_delta_step, linear_attention_step
from nested_jax.core.proteus import ProteusRule, proteus_active_blocks, proteus_block_ids
from nested_jax.ops._impl import check_impl as _check_impl
from nested_jax.ops._state import pin_head_state
from pallas_kernels.gated_delta import BlockSizes as _GdnBlocks
from pallas_kernels.gated_delta import gated_delta_pallas as _gated_delta_pallas

__all__ = [
    "linear_attention",
    "delta_rule",
    "gated_delta",
    "linear_attention_step",
    "delta_rule_step",
    "gated_delta_step",
    "proteus_key_rows",
    "ProteusRule",
]


def _dispatch(op: str, impl: str, args: tuple, chunk_size: int, **kw):
    """Routes ``op`` to ``core.associative.<op>_recurrent`` or ``<op>_chunked`` by ``impl``; the
    final state ``[B, H, K, V]`` comes back pinned to ``("batch", "heads", None, None)``.
    ``impl="pallas"`` routes the delta rules to ``pallas_kernels.gated_delta``."""
    if impl == "pallas" and op in ("gated_delta", "delta_rule"):
        o, state = _pallas_delta(op, args, chunk_size, **kw)
        return o, pin_head_state(state)
    _check_impl(op, impl)
    if impl == "recurrent":
        o, state = getattr(_assoc, f"{op}_recurrent")(*args, **kw)
    else:
        o, state = getattr(_assoc, f"{op}_chunked")(*args, chunk_size=chunk_size, **kw)
    return o, pin_head_state(state)


def _pallas_delta(op: str, args: tuple, chunk_size: int, **kw):
    """The Pallas gated delta kernel (``delta_rule``: ``g = 0``); interpreted off TPU."""
    if op == "delta_rule":
        q, k, v, beta = args
        args = (q, k, v, jnp.zeros(beta.shape, jnp.float32), beta)
    return _gated_delta_pallas(
        *args,
        block_sizes=_GdnBlocks(chunk=chunk_size),
        interpret=jax.default_backend() != "tpu",
        **kw,
    )


def linear_attention(
    q,
    k,
    v,
    g=None,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """(Gated) linear attention, SPEC §1.

    ``S_t = α_t S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: optional ``[B, T, H]`` log decay.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``.
      segment_ids: optional ``[B, T]`` int (state resets at segment starts).
      chunk_size: chunk length for ``impl="chunked"``.
      impl: ``"chunked"`` | ``"recurrent"`` (``"pallas"`` not yet available: ValueError).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "linear_attention",
        impl,
        (q, k, v, g),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )


def delta_rule(
    q,
    k,
    v,
    beta,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """Delta rule, SPEC §1.

    ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      scale, initial_state, segment_ids, chunk_size: as in ``linear_attention``.
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (``chunk_size`` a multiple of 8).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "delta_rule",
        impl,
        (q, k, v, beta),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )


def gated_delta(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """Gated delta rule (GDN), SPEC §1: ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      scale, initial_state, segment_ids, chunk_size: as in ``linear_attention``.
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (``chunk_size`` a multiple of 8).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "gated_delta",
        impl,
        (q, k, v, g, beta),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )


def proteus_key_rows(q, k, positions, *, rule: ProteusRule):
    """Proteus key-row gate of the linear rules (SPEC §4): ``(g_t ⊙ q_t, g_t ⊙ k_t)``.

    ``g_t`` opens the first ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` of ``E = rule.blocks`` contiguous
    blocks of key rows at the 1-based position ``t = positions + 1`` (``Δ = ⌊N/E⌋``,
    ``N = rule.context_len``). With a state that starts at zero (and resets to zero), running a
    linear rule on the gated ``q, k`` is its Proteus form (``nested_jax.layers.deltanet`` says why).

    Args:
      q, k: ``[B, T, H, K]``; positions: int ``[B, T]`` 0-based.
      rule: :class:`ProteusRule` (``E ≤ K``); ``E = 1`` returns ``q, k`` themselves (no gate).

    Returns:
      ``(q, k)`` with locked key rows set to zero, same shapes and dtypes.
    """
    if not rule.enabled:
        return q, k
    b, t, _, kd = q.shape
    active = proteus_active_blocks(positions + 1, rule.context_len, rule.blocks)  # [B, T]
    ids = jnp.asarray(proteus_block_ids(kd, rule.blocks))
    is_open = (ids < active[..., None])[:, :, None, :]  # [B, T, 1, K]
    zero = jnp.zeros((), q.dtype)
    return jnp.where(is_open, q, zero), jnp.where(is_open, k, zero)
