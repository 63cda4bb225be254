"""The Titans neural memory behind one door: sequence form, decode step, state helpers (SPEC §2).

Layers call these functions, never a core form directly, so the implementation is a config value
(``TitansOptions.memory_impl``). It is never switched silently: an ``impl`` that cannot run raises
``ValueError``.

- ``"chunked"``: ``core.titans_mlp.titans_mlp_chunked`` with chunks of ``spec.chunk`` (surprises
  at the chunk start, dual-form reads; the training default).
- ``"recurrent"``: the per-token ground truth ``titans_mlp_recurrent`` (``spec.chunk`` is ignored;
  decoding is the chunk-1 rule).
- ``"pallas"``: the seam for ``pallas_kernels/<op>``; no kernel yet, so it raises ``ValueError``.

Both run the Proteus schedule when ``spec.proteus.blocks > 1`` (SPEC §4) and packed rows with an
exact reset (``segment_ids``). The composition lives in :mod:`nested_jax.core.titans_memory`;
:class:`TitansMemorySpec` holds the static options (frozen, hashable). Re-exported for layers:
the state types (``TitansMLPState``, ``MemoryCache``), ``titans_mlp_init_weights`` (the learned
``M_0``), ``titans_mlp_state`` (``(M_0, 0)`` over the batch) and ``titans_mlp_apply`` (the read
``M*(z)`` without update).
"""

from __future__ import annotations

from nested_jax.core import titans_memory as _tm
from nested_jax.core.checks import require_initial_state
from nested_jax.core.titans_memory import MemoryCache, TitansMemorySpec, titans_memory_start
from nested_jax.core.titans_mlp import (
    TitansMLPState,
    titans_mlp_apply,
    titans_mlp_init_weights,
    titans_mlp_state,
)
from nested_jax.ops._impl import check_impl as _check_impl
from nested_jax.ops._state import pin_head_state

__all__ = [
    "TitansMemorySpec",
    "TitansMLPState",
    "MemoryCache",
    "titans_memory",
    "titans_memory_step",
    "titans_memory_init_cache",
    "titans_memory_start",
    "titans_mlp_init_weights",
    "titans_mlp_state",
    "titans_mlp_apply",
]


def _recurrent(op: str, impl: str) -> bool:
    """Validates ``impl`` for ``op`` and says whether it is the per-token rule."""
    _check_impl(op, impl)
    return impl == "recurrent"


def titans_memory(
    q, k, v, theta, eta, alpha, *, spec: TitansMemorySpec,
    initial_state: TitansMLPState | None = None, segment_ids=None,
    reset_state: TitansMLPState | None = None, impl: str = "chunked",
):  # fmt: skip
    """Titans memory over a row, SPEC §2 (Proteus-gated when ``spec.proteus.blocks > 1``, §4).

    ``S_t = η_t S_{t-1} − θ_t ∇ℓ(M; k_t, v_t)``, ``M_t = (1 − α_t) M_{t-1} + S_t``,
    ``y_t = M_t(q_t)`` (``M_{t-1}`` with ``spec.read_before_write``), ``ℓ = ½‖M(k) − v‖²``.

    Args:
      q, k, v: ``[B, T, H, D]``; theta, eta, alpha: ``[B, T, H]``.
      spec: :class:`TitansMemorySpec`.
      initial_state: ``TitansMLPState`` with ``W_l, S_l [B, H, d_l, d_{l+1}]``
        (``titans_mlp_state(weights, B)``); required (None raises ``ValueError``: the memory
        has no zero state).
      segment_ids: optional ``[B, T]`` int (packed rows): every document start resets the state
        to ``reset_state`` (default ``initial_state``) and restarts the chunk grid; with Proteus the
        schedule follows the row position and the locked coordinates reset too.
      reset_state: the state of a document start.
      impl: ``"chunked"`` | ``"recurrent"`` (``"pallas"``: ValueError).

    Returns:
      ``(y [B, T, H, D], final TitansMLPState f32)``; the state's leaves pinned to ``("batch",
      "heads", …)`` (``ops._state``).
    """
    recurrent = _recurrent("titans_memory", impl)
    state = require_initial_state("titans_memory", initial_state, "titans_mlp_state(weights, B)")
    y, final = _tm.titans_memory_sequence(
        q, k, v, theta, eta, alpha, spec=spec, initial_state=state, recurrent=recurrent,
        segment_ids=segment_ids, reset_state=reset_state,
    )  # fmt: skip
    return y, pin_head_state(final)


def titans_memory_step(
    state: MemoryCache, q, k, v, theta, eta, alpha, *, spec: TitansMemorySpec,
    initial_weights: tuple, commit=None, impl: str = "chunked",
):  # fmt: skip
    """One decode token, equal to row ``t`` of :func:`titans_memory` (chunks aligned at 0).

    The cache holds ``(M, S)`` at the current chunk start and the chunk's tokens; the step re-runs
    the chunk over the buffer and commits the state when the chunk is full (SPEC §2).

    Args:
      state: the decode state, a :class:`MemoryCache` from :func:`titans_memory_init_cache` with
        the same ``impl``.
      q, k, v: ``[B, H, D]``; theta, eta, alpha: ``[B, H]``.
      spec: :class:`TitansMemorySpec`.
      initial_weights: the learned ``M_0``, tuple of ``[H, d_l, d_{l+1}]`` (a fresh cache starts
        from it).
      commit: optional bool scalar: close the chunk after this token (the caller guarantees it is
        then full; MAC segment ends).
      impl: ``"chunked"`` | ``"recurrent"`` (``"pallas"``: ValueError).

    Returns:
      ``(y [B, H, D] f32, cache)``.
    """
    recurrent = _recurrent("titans_memory_step", impl)
    return _tm.titans_memory_step(
        state, q, k, v, theta, eta, alpha, spec=spec, initial_weights=initial_weights,
        recurrent=recurrent, commit=commit,
    )  # fmt: skip


def titans_memory_init_cache(
    spec: TitansMemorySpec, batch_size: int, num_heads: int, *, impl: str = "chunked"
) -> MemoryCache:
    """Empty decode cache at position 0 (placeholder weights, replaced by ``M_0`` on the first
    step; :func:`titans_memory_start`). Buffers ``[B, b, H, D]`` with ``b = spec.chunk``
    (``1`` for ``impl="recurrent"``).

    Raises:
      ValueError: ``spec.per_chunk_gates`` (cannot decode), Proteus with ``b ∤ Δ`` (SPEC §4), or
        an ``impl`` that cannot run.
    """
    recurrent = _recurrent("titans_memory_init_cache", impl)
    return _tm.titans_memory_init_cache(spec, batch_size, num_heads, recurrent=recurrent)
