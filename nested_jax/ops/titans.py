"""The Titans neural memory behind one door: sequence form, decode step, state helpers (SPEC §2).

Layers call these functions, never a core form directly, so the implementation is a config value
(``TitansOptions.memory_impl``). It is never switched silently: an ``impl`` that cannot run raises
``ValueError``.

- ``"chunked"``: ``core.titans.chunk.titans_mlp_chunked`` with chunks of
  ``spec.rule.memory_chunk`` (surprises at the chunk start, dual-form reads; the training
  default).
- ``"recurrent"``: the per-token ground truth ``titans_mlp_recurrent`` (``memory_chunk`` is
  ignored; decoding is the chunk-1 rule).
- ``"pallas"``: the matrix memory (``L_M = 1``) by ``pallas_kernels/titans_linear`` with chunks of
  ``memory_chunk`` (a multiple of 8): the same rule as ``"chunked"`` (values and gradients), the
  Mosaic kernel in a program lowered for TPU (an ahead-of-time compile on a CPU host included),
  the Pallas interpreter on any other platform, and inside a mesh one kernel call per (batch,
  heads) shard (``ops._pallas``). An MLP memory (``L_M ≥ 2``) or Proteus raises ``ValueError``
  in every function here (the kernel covers only the plain matrix memory). Decoding
  (``titans_memory_step``) with ``impl="pallas"`` is the chunked decode path: the same chunk rule
  on the buffered chunk, so it equals rows of the pallas sequence form.

Chunked and recurrent run the Proteus schedule when ``spec.proteus.blocks > 1`` (SPEC §4); all
three run packed rows with an exact reset (``segment_ids``). The composition lives in
:mod:`nested_jax.core.titans.memory`; its ``TitansMemorySpec`` holds the static options (frozen,
hashable): the memory's ``dims``, the rule (a ``TitansRule``, which every form receives whole)
and the Proteus schedule. Importable from here for layers (``__all__`` lists the three ops
defined here): ``TitansMemorySpec``, ``TitansRule``, the state types (``TitansMLPState``,
``MemoryCache``), ``titans_memory_start``, ``titans_mlp_init_weights`` (the learned ``M_0``),
``titans_mlp_state`` (``(M_0, 0)`` over the batch) and ``titans_mlp_apply`` (the read ``M*(z)``
without update).
"""

from __future__ import annotations

import functools

from nested_jax.core.checks import require_initial_state
from nested_jax.core.titans import memory as _tm
from nested_jax.core.titans.memory import MemoryCache, TitansMemorySpec
from nested_jax.core.titans.memory import titans_memory_start as titans_memory_start
from nested_jax.core.titans.mlp import titans_mlp_apply as titans_mlp_apply
from nested_jax.core.titans.mlp import titans_mlp_init_weights as titans_mlp_init_weights
from nested_jax.core.titans.mlp import titans_mlp_state as titans_mlp_state
from nested_jax.core.titans.net import TitansMLPState
from nested_jax.ops._impl import check_impl as _check_impl
from nested_jax.ops._pallas import pallas_per_shard
from nested_jax.ops._state import pin_head_state
from nested_jax.rules import TitansRule as TitansRule
from pallas_kernels.titans_linear import titans_linear_pallas as _titans_linear_pallas

__all__ = [
    "titans_memory",
    "titans_memory_step",
    "titans_memory_init_cache",
]


def _recurrent(op: str, impl: str, spec: TitansMemorySpec) -> bool:
    """Validates ``impl`` for ``op`` (and ``spec`` for ``"pallas"``) and says whether it is the
    per-token rule (``"pallas"`` decodes by the chunked path, the same chunk rule)."""
    _check_impl(op, impl, ("chunked", "recurrent", "pallas"))
    if impl == "pallas":
        _check_pallas_spec(op, spec)
    return impl == "recurrent"


def _check_pallas_spec(op: str, spec: TitansMemorySpec) -> None:
    """``impl="pallas"`` has a kernel for the plain matrix memory only (every op refuses the
    rest, so a config never runs one form in training and another in decoding)."""
    if spec.n_layers != 1:
        raise ValueError(
            f"{op}: impl='pallas' covers only the matrix memory (L_M = 1, "
            f"TitansOptions.memory_layers=1), got spec.dims={spec.dims} (L_M = {spec.n_layers})"
        )
    if spec.proteus.enabled:
        raise ValueError(
            f"{op}: impl='pallas' covers only the plain matrix memory, not Proteus "
            f"(spec.proteus.blocks = {spec.proteus.blocks} > 1); use impl='chunked'"
        )


_SEQ = ("batch", None, "heads", None)  # q, k, v, y: [B, T, H, D]
_GATE = ("batch", None, "heads")
_HEAD_STATE = ("batch", "heads", None, None)
_PALLAS_LOGICAL = {
    **{n: _SEQ for n in ("q", "k", "v")},
    **{n: _GATE for n in ("theta", "eta", "alpha")},
    **{n: _HEAD_STATE for n in ("m0", "s0", "reset_m", "reset_s")},
    "segment_ids": ("batch", None),
}


def _pallas_kernel(q, k, v, theta, eta, alpha, m0, s0, segment_ids=None, reset_m=None,
                   reset_s=None, *, spec: TitansMemorySpec, interpret: bool):  # fmt: skip
    """The kernel on one shard: ``(y, M, S)``."""
    reset = None if reset_m is None else (reset_m, reset_s)
    y, (M, S) = _titans_linear_pallas(
        q, k, v, theta, eta, alpha, initial_state=(m0, s0), rule=spec.rule,
        segment_ids=segment_ids, reset_state=reset, interpret=interpret,
    )  # fmt: skip
    return y, M, S


def _pallas_memory(q, k, v, theta, eta, alpha, *, spec, state, segment_ids, reset_state):
    """The matrix memory by ``pallas_kernels.titans_linear`` (``L_M = 1``, no Proteus: checked by
    :func:`_recurrent`), one call per (batch, heads) shard of the mesh in context
    (``ops._pallas.pallas_per_shard``)."""
    B, T, H, _ = q.shape
    K, V = spec.dims
    reset = (None, None) if reset_state is None else (reset_state.weights[0],
                                                      reset_state.momentum[0])  # fmt: skip
    operands = dict(
        q=q, k=k, v=v, theta=theta, eta=eta, alpha=alpha, m0=state.weights[0],
        s0=state.momentum[0], segment_ids=segment_ids, reset_m=reset[0], reset_s=reset[1],
    )  # fmt: skip
    kernel = functools.partial(_pallas_kernel, spec=spec)
    y, M, S = pallas_per_shard(
        kernel, operands, _PALLAS_LOGICAL, (_SEQ, _HEAD_STATE, _HEAD_STATE),
        ((B, T, H, V), (B, H, K, V), (B, H, K, V)),
    )  # fmt: skip
    return y, TitansMLPState((M,), (S,))


def titans_memory(
    q, k, v, theta, eta, alpha, *, spec: TitansMemorySpec,
    initial_state: TitansMLPState | None = None, segment_ids=None,
    reset_state: TitansMLPState | None = None, impl: str = "chunked",
):  # fmt: skip
    """Titans memory over a row, SPEC §2 (Proteus-gated when ``spec.proteus.blocks > 1``, §4).

    ``S_t = η_t S_{t-1} − θ_t ∇ℓ(M; k_t, v_t)``, ``M_t = (1 − α_t) M_{t-1} + S_t``,
    ``y_t = M_t(q_t)`` (``M_{t-1}`` with ``spec.rule.read_before_write``), ``ℓ = ½‖M(k) − v‖²``.

    Args:
      q, k, v: ``[B, T, H, D]``; theta, eta, alpha: ``[B, T, H]``.
      spec: ``TitansMemorySpec(dims, rule, proteus)``; ``spec.rule`` (a ``TitansRule``, e.g. a
        config's ``TitansOptions``) reaches the core form whole.
      initial_state: ``TitansMLPState`` with ``W_l, S_l [B, H, d_l, d_{l+1}]``
        (``titans_mlp_state(weights, B)``); required (None raises ``ValueError``: the memory
        has no zero state).
      segment_ids: optional ``[B, T]`` int (packed rows): every document start resets the state
        to ``reset_state`` (default ``initial_state``) and restarts the chunk grid; with Proteus the
        schedule follows the row position and the locked coordinates reset too.
      reset_state: the state of a document start.
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (``L_M = 1`` without Proteus,
        ``memory_chunk`` a multiple of 8; module docstring).

    Returns:
      ``(y [B, T, H, D], final TitansMLPState f32)``; the state's leaves pinned to ``("batch",
      "heads", …)`` (``ops._state``).
    """
    recurrent = _recurrent("titans_memory", impl, spec)
    state = require_initial_state("titans_memory", initial_state, "titans_mlp_state(weights, B)")
    if impl == "pallas":
        y, final = _pallas_memory(
            q, k, v, theta, eta, alpha, spec=spec, state=state, segment_ids=segment_ids,
            reset_state=reset_state,
        )  # fmt: skip
        return y, pin_head_state(final)
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
      spec: ``TitansMemorySpec``, as :func:`titans_memory`.
      initial_weights: the learned ``M_0``, tuple of ``[H, d_l, d_{l+1}]`` (a fresh cache starts
        from it).
      commit: optional bool scalar: close the chunk after this token (the caller guarantees it is
        then full; MAC segment ends).
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (decodes by the chunked path: the
        same chunk rule as the kernel).

    Returns:
      ``(y [B, H, D] f32, cache)``.
    """
    recurrent = _recurrent("titans_memory_step", impl, spec)
    return _tm.titans_memory_step(
        state, q, k, v, theta, eta, alpha, spec=spec, initial_weights=initial_weights,
        recurrent=recurrent, commit=commit,
    )  # fmt: skip


def titans_memory_init_cache(
    spec: TitansMemorySpec, batch_size: int, num_heads: int, *, impl: str = "chunked"
) -> MemoryCache:
    """Empty decode cache at position 0 (placeholder weights, replaced by ``M_0`` on the first
    step; ``titans_memory_start``). Buffers ``[B, b, H, D]`` with ``b = spec.rule.memory_chunk``
    (``1`` for ``impl="recurrent"``).

    Raises:
      ValueError: ``spec.rule.per_chunk_gates`` (cannot decode), Proteus with ``b ∤ Δ`` (SPEC
        §4), or an ``impl`` that cannot run.
    """
    recurrent = _recurrent("titans_memory_init_cache", impl, spec)
    return _tm.titans_memory_init_cache(spec, batch_size, num_heads, recurrent=recurrent)
