"""The Hope memory rule behind one door: sequence form, decoding, state helpers (SPEC §3.2, §4).

Layers call these functions, never a core form directly, so the implementation is a config value
(``ModelConfig.impl``). It is never switched silently: an ``impl`` that cannot run raises
``ValueError`` naming the op.

- ``"chunked"``: ``core.hope.chunk.hope_chunked`` with the rule's two chunk sizes (SPEC §3.2
  Decision; the training default); with Proteus ``core.hope.proteus.proteus_hope_chunked`` /
  ``proteus_hope_packed`` (SPEC §4).
- ``"recurrent"``: the per-token twin ``core.hope.reference.hope_reference`` at the **same** chunk
  sizes (snapshots refreshed at ``t % C = 0``), i.e. the same function computed token by token
  with ``jax.grad`` inner gradients: Hope's independent ground truth, slow, equal to
  ``"chunked"`` to float rounding (not bit for bit). With Proteus it runs span by span exactly
  like the chunked form. Not ``core.hope.token.hope_recurrent``: that is ``hope_chunked`` with chunk
  sizes 1, a different rule unless the rule's sizes are 1. The twin has no truncated backprop
  (``rule.grad_horizon > 0`` raises) and does not read ``rule.remat*`` or ``rule.chunk_updates``
  (they only schedule the same values). The twin returns momenta iff ``rule.momentum``, so
  ``initial_state`` must hold momenta exactly then.

Every op takes the rule whole (``rule=``, a :class:`HopeRule`; the layer passes its
``HopeOptions``, which is one) and hands it on unchanged to the core form it runs.
- ``"pallas"``: the MLP-memory rule has no kernel, so it raises ``ValueError``; a chunk of a
  *linear* Hope memory (:func:`hope_linear_chunk`, a gated delta rule, SPEC §3.2) runs on the
  gated delta kernel ``pallas_kernels/gated_delta``.

Decoding (:func:`hope_decode`) has one form for ``"chunked"`` and ``"recurrent"`` alike: the
per-token ``hope_decode_step`` (one token of the chunked form, snapshots and position carried),
which equals the sequence form row by row.

Also importable from here for layers (defined in core and :mod:`nested_jax.rules`, so not in
``__all__``): the types ``HopeRule``, ``HopeMemories``, ``HopeReadout``, ``HopeState``,
``MLPMemory``, ``HopeDecodeState``, ``hope_init_state`` (learned memories over the batch, zero
momenta) and ``hope_decode_state`` (the decode state at position 0). :func:`check_hope_decode`
is the Proteus decode condition, for ``init_cache``.
"""

from __future__ import annotations

import functools

from nested_jax.core.checks import require_initial_state
from nested_jax.core.hope.chunk import hope_chunked
from nested_jax.core.hope.decode import HopeDecodeState, check_proteus_decode_chunks
from nested_jax.core.hope.decode import hope_decode as _hope_decode
from nested_jax.core.hope.decode import hope_decode_state as hope_decode_state
from nested_jax.core.hope.linear import hope_linear_chunk_update
from nested_jax.core.hope.proteus import proteus_hope_chunked, proteus_hope_packed
from nested_jax.core.hope.reference import hope_reference
from nested_jax.core.hope.state import HopeMemories, HopeReadout, HopeState, check_rule
from nested_jax.core.hope.state import MLPMemory as MLPMemory
from nested_jax.core.hope.state import hope_init_state as hope_init_state
from nested_jax.ops._impl import check_impl as _check_impl
from nested_jax.ops._state import pin_head_state
from nested_jax.ops.linear import gated_delta
from nested_jax.rules import HopeRule, ProteusRule

__all__ = [
    "hope_memories",
    "hope_decode",
    "check_hope_decode",
    "hope_linear_chunk",
]

_NO_PROTEUS = ProteusRule()  # the default schedule: E = 1, the plain memories


def _backbone(op: str, impl: str, rule: HopeRule):
    """Validates ``impl`` for ``op`` and returns the sequence function it names."""
    _check_impl(op, impl)
    if impl == "chunked":
        return hope_chunked
    if rule.grad_horizon:
        raise ValueError(
            f"{op}: impl='recurrent' (the per-token twin hope_reference) has no truncated "
            f"backprop; got rule.grad_horizon={rule.grad_horizon} (use impl='chunked' or 0)"
        )
    return hope_reference


def _check_proteus(op: str, proteus: ProteusRule) -> ProteusRule:
    """Returns ``proteus`` after checking it is a :class:`ProteusRule` (``ValueError`` names it)."""
    if not isinstance(proteus, ProteusRule):
        raise ValueError(f"{op}: proteus must be a ProteusRule, got {proteus!r}")
    return proteus


def hope_memories(
    x, q, readout: HopeReadout, *, rule: HopeRule, initial_state: HopeState | None = None,
    proteus: ProteusRule = _NO_PROTEUS, segment_ids=None, impl: str = "chunked",
):  # fmt: skip
    """Hope's self-modifying memories over a row (SPEC §3.2; Proteus SPEC §4).

    Per token, from the chunk-start snapshots ``M̄_□`` of each group (chunks aligned at 0)::

        k_t = norm(M̄_k(x_t)),  v_t = M̄_v(x_t),  η_t, α_t = σ(w ᵀ M̄_{η,α}(x_t) + b),  q_t = norm(q_t)
        o_t = M_{memory,t−1}(q_t)                       (read before write, running weights)
        M_□ ← DGD step on ½‖M̄_□(k_t) − M̄_□(v_t)‖²      (with retention α_t, momentum μ)

    With ``proteus.blocks = E > 1`` every memory and momentum is gated by the hidden-unit mask
    ``g_t`` of its 1-based row position ``t`` (``M_t = where(g_t, Write(g_t ⊙ M_{t−1}),
    M_{t−1})``; both chunk grids restart at every Δ-boundary). Packed rows (``segment_ids``):
    a document start resets the memories to ``initial_state.memories`` and the momenta to zero;
    with Proteus the schedule keeps the row position and the whole state (locked coordinates too)
    resets to ``initial_state``.

    Args:
      x: memory inputs ``[B, T, H, D]``; q: ``W_q x`` ``[B, T, H, D]`` (None with
        ``rule.adaptive_q``).
      readout: ``HopeReadout`` of ``M_η``, ``M_α``.
      rule: the :class:`HopeRule` (chunk sizes, ablation flags, ``grad_horizon``, ``remat``;
        a ``HopeOptions`` is one), passed on whole.
      initial_state: ``HopeState`` (``hope_init_state(memories, B)``), weights ``[B, H, ...]``;
        also the state every document of a packed row starts from. Required (None raises
        ``ValueError``: Hope's memories have no zero state).
      proteus: the Proteus schedule, a :class:`ProteusRule` ``(E, N)`` (``E = 1``, the default:
        no Proteus).
      segment_ids: optional int ``[B, T]`` document ids of packed rows.
      impl: ``"chunked"`` | ``"recurrent"`` (``"pallas"``: ValueError); module docstring.

    Returns:
      ``(o [B, T, H, D] f32, final HopeState)``; the state's leaves pinned to ``("batch",
      "heads", …)`` (``ops._state``).
    """
    rule = check_rule("hope_memories", rule)
    backbone = _backbone("hope_memories", impl, rule)
    proteus = _check_proteus("hope_memories", proteus)
    state = require_initial_state("hope_memories", initial_state, "hope_init_state(memories, B)")
    if not proteus.enabled:
        o, final = backbone(x, q, readout, initial_state=state, rule=rule, segment_ids=segment_ids)
    else:
        kw = dict(initial_state=state, rule=rule, schedule=proteus, backbone=backbone)
        if segment_ids is None:
            o, final = proteus_hope_chunked(x, q, readout, t0=0, **kw)
        else:
            o, final = proteus_hope_packed(x, q, readout, segment_ids=segment_ids, **kw)
    return o, pin_head_state(final)


def hope_decode(
    x, q, readout: HopeReadout, *, rule: HopeRule, initial_state: HopeDecodeState | None = None,
    proteus: ProteusRule = _NO_PROTEUS, initial_memories: HopeMemories | None = None,
    impl: str = "chunked",
):  # fmt: skip
    """``T`` cached tokens at positions ``n … n + T − 1``, equal to :func:`hope_memories` row by
    row (SPEC §3.2; with Proteus each token is gated by the mask of position ``n + i + 1``, §4).

    Args:
      x, q: ``[B, T, H, D]`` as :func:`hope_memories` (a prefill or single tokens).
      readout, rule, proteus: as :func:`hope_memories`; with Proteus both chunk sizes must
        divide ``Δ = N // E`` (:func:`check_hope_decode`).
      initial_state: :class:`HopeDecodeState` ``(state, snapshot, n)``: the running
        ``HopeState``, the chunk-start snapshots (``HopeMemories``, shapes of
        ``state.memories``) and the int32 scalar ``n`` of tokens seen. Required
        (:func:`hope_decode_state` builds the one at position 0).
      initial_memories: optional learned memories ``[H, ...]``: a call at ``n = 0`` starts from
        ``hope_init_state(initial_memories)`` instead of ``initial_state.state`` (cache
        placeholders).
      impl: ``"chunked"`` | ``"recurrent"`` (both the per-token step; ``"pallas"``: ValueError).

    Returns:
      ``(o [B, T, H, D] f32, HopeDecodeState(new state, new snapshot, n + T))``.
    """
    _check_impl("hope_decode", impl)
    rule = check_rule("hope_decode", rule)
    proteus = _check_proteus("hope_decode", proteus)
    return _hope_decode(
        x, q, readout, rule=rule, schedule=proteus, initial_state=initial_state,
        initial_memories=initial_memories,
    )  # fmt: skip


def check_hope_decode(
    rule: HopeRule, *, proteus: ProteusRule = _NO_PROTEUS, owner: str = "rule"
) -> None:
    """Raises ``ValueError`` (prefixed ``owner.<field>``) unless decoding equals the sequence form
    under Proteus: both chunk sizes must divide ``Δ = N // E`` (SPEC §4; no condition for
    ``E = 1``)."""
    proteus = _check_proteus("check_hope_decode", proteus)
    check_proteus_decode_chunks(rule, proteus, owner=owner)


def hope_linear_chunk(
    M0, k, v_hat, alpha, eta, *, rule: HopeRule = HopeRule(), chunk_size: int = 64,
    impl: str = "chunked",
):  # fmt: skip
    """One Hope chunk of a linear memory, SPEC §3.2:
    ``M_t = M_{t−1}(α_t I − γ_t k_t k_tᵀ) − γ_t (M_0 k_t − v̂_t) k_tᵀ`` (signals at the
    chunk-start ``M_0``), as §1's gated delta rule
    (:func:`nested_jax.core.hope.linear.hope_linear_chunk_update`).

    Args:
      M0: ``[B, H, V, K]``; k: ``[B, T, H, K]``; v_hat: ``[B, T, H, V]``; alpha, eta:
        ``[B, T, H]``.
      rule: the :class:`HopeRule`, passed on whole: its ``step`` (``"exact"`` | ``"paper"``, SPEC
        §3.1); it must be the plain DGD step (no momentum, no softclamp, eq. 88's target).
      chunk_size: the gated delta rule's WY chunk (``"pallas"``: a multiple of 8).
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (the gated delta kernel), as
        :func:`nested_jax.ops.linear.gated_delta`.

    Returns:
      ``M_T`` ``[B, H, V, K]`` f32.
    """
    _check_impl("hope_linear_chunk", impl, ("chunked", "recurrent", "pallas"))
    backbone = functools.partial(gated_delta, impl=impl)
    return hope_linear_chunk_update(
        M0, k, v_hat, alpha, eta, rule=rule, chunk_size=chunk_size, backbone=backbone
    )
