"""Proteus-wrapped Hope memories: hidden-unit blocks of every MLP memory (SPEC §3.2, §4).

Every memory of a ``HopeState`` (``k, v, η, α, memory`` and the optional ``q``) is a residual MLP
``M(z) = z + W_1 σ(W_2 z)`` with ``w1 [B, H, D, h]`` and ``w2 [B, H, h, D]``. Its Proteus blocks
are hidden units: columns of ``w1`` (last axis) and rows of ``w2`` (axis −2), split into ``E``
contiguous blocks (remainder in the last block, ``core/proteus.py``). All memories share one
schedule, and their momenta are gated like their weights. With training context ``N``,
``Δ = max(1, ⌊N/E⌋)`` and the 1-based absolute position ``t = t0 + i + 1`` of local token ``i``::

    M^{(g)}_{t-1} = g_t ⊙ M_{t-1}                     (every memory and momentum)
    (o_t, cand)   = hope_step(M^{(g)}_{t-1}, x_t, q_t)  (read o_t = M^{(g)}_{memory,t-1}(q_t),
                                                        then projections, targets, DGD writes)
    M_t           = where(g_t, cand, M_{t-1})          # locked coordinates keep their bits

So the projections ``k, v, η, α`` (and ``q`` with ``adaptive_q``), the self-generated targets, the
read and the write all use the gated memories. With ``σ(0) = 0`` (SiLU default, GELU, tanh, ReLU;
anything else is refused) a locked hidden unit of ``M^{(g)}`` is silent: ``σ(W_2 z)`` is 0 there
and ``W_1``'s column is 0, so it contributes nothing to any output, its DGD input ``σ(W_2 k)`` and
signal ``σ'(W_2 k) ⊙ (W_1ᵀ e)`` are 0, and the candidate's locked coordinates are exactly 0
(``α·0`` decay, ``μ·0`` momentum, zero write). The ``where`` then restores the previous bits.

Forms (SPEC §0):

- :func:`proteus_hope_step`: one token at position ``t`` (int or integer array ``[]``/``[B]``).
- :func:`proteus_hope_recurrent`: ``lax.scan`` of the step (ground truth; ``t0`` may be traced).
- :func:`proteus_hope_chunked`: static ``t0``. The mask is constant between Δ-boundaries, so time
  is split into static spans (``proteus_spans``); each span is one ``hope_chunked`` call from the
  gated state (locked coordinates stay exactly 0 inside it, so every token sees ``M^{(g)}``) and
  the locked coordinates are put back with ``where``. **The chunk grid (both chunk sizes)
  restarts at every Δ-boundary**: chunk-start snapshots are taken inside one mask. With both chunk
  sizes 1 this is the recurrent form; when the chunk sizes divide ``Δ`` and ``t0`` the grid is
  the global one. Spans of one length run as one ``lax.scan`` (``run_proteus_spans``); they are
  grouped by length, never padded: a Hope padding token is not a no-op (its decay ``α`` acts).
- :func:`proteus_hope_packed`: packed rows (``segment_ids``) at row positions ``1 … T``; the
  schedule follows the row position and a document start resets the whole state, locked
  coordinates included (``run_proteus_spans_packed``, the Titans layer's decision).

Every form takes the Hope rule whole as ``rule`` (:class:`~nested_jax.rules.HopeRule`) and the
schedule as ``schedule`` (:class:`~nested_jax.rules.ProteusRule`: ``E = blocks``,
``N = context_len``). Both span forms take ``backbone``: ``hope_chunked`` (default) or a function
with its arguments (``backbone(x, q, readout, initial_state=, rule=, segment_ids=,
initial_memories=, activation=)``), e.g. the per-token twin
``core.hope.reference.hope_reference``, run span by span the same way.

Static dispatch: ``E == 1``, or a static ``t0`` with every position of the call past the
last opening (``k(t0 + 1) = E``), calls the plain backbone, so the result is the backbone's bit for
bit. The per-document forms (step / recurrent / chunked) take no ``segment_ids``: positions
would have to restart per document; :func:`proteus_hope_packed` keeps row positions instead.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import require_initial_state
from nested_jax.core.hope.chunk import hope_chunked
from nested_jax.core.hope.state import (
    HOPE_STATE_CONSTRUCTOR,
    HopeMemories,
    HopeState,
    MLPMemory,
    check_rule,
)
from nested_jax.core.hope.token import hope_recurrent, hope_step
from nested_jax.core.proteus import (
    _check_blocked,
    _check_schedule,
    _check_silent_at_zero,
    _check_static_t0,
    _check_t0,
    _is_int,
    _positions,
    _statically_open,
    proteus_active_blocks,
    proteus_block_ids,
    proteus_gate,
    proteus_gated_update,
    proteus_spans,
    run_proteus_spans,
    run_proteus_spans_packed,
)
from nested_jax.rules import HopeRule, ProteusRule

__all__ = [
    "proteus_hope_masks",
    "proteus_hope_step",
    "proteus_hope_recurrent",
    "proteus_hope_chunked",
    "proteus_hope_packed",
]


def proteus_hope_masks(state: HopeState, active, num_blocks: int):
    """Open coordinates of every weight and momentum of a Hope state (SPEC §4, hidden units).

    Args:
      state: ``HopeState`` with ``w1 [B, H, D, h]``, ``w2 [B, H, h, D]`` per memory (each
        memory's own ``h ≥ E``).
      active: number of open blocks, a Python int or an integer array ``[B]``.
      num_blocks: ``E``.

    Returns:
      a pytree shaped like ``state`` (``None`` where it has ``None``) whose leaves are bool masks:
      ``w1``: ``[1, h]`` (static ``active``) or ``[B, 1, 1, h]``; ``w2``: ``[h, 1]`` or
      ``[B, 1, h, 1]``; broadcastable to the weights.
    """

    def masks(mem: MLPMemory) -> MLPMemory:
        h = mem.w1.shape[-1]
        ids = proteus_block_ids(h, num_blocks)
        if _is_int(active):
            m = ids < active  # numpy [h]: static masks stay constants
            return MLPMemory(m[None, :], m[:, None])
        m = jnp.asarray(ids) < active[:, None]  # [B, h]
        return MLPMemory(m[:, None, None, :], m[:, None, :, None])

    return jax.tree.map(masks, state, is_leaf=lambda x: isinstance(x, MLPMemory))


def _check_hope(fn: str, x, state, rule, schedule, per_token: bool):
    """Shared checks; returns ``(N, E, B)``. The backbone validates the rest (q, readout, shapes).
    The state's argument is ``state`` for the step, ``initial_state`` for the sequence forms."""
    check_rule(fn, rule)
    if not isinstance(schedule, ProteusRule):
        raise ValueError(f"{fn}: schedule must be a ProteusRule, got {schedule!r}")
    sname = "state" if per_token else "initial_state"
    if not per_token:
        require_initial_state(fn, state, HOPE_STATE_CONSTRUCTOR)
    n, e = _check_schedule(fn, schedule.context_len, schedule.blocks)
    rank, shape = (3, "[B, H, D]") if per_token else (4, "[B, T, H, D]")
    name = "x_t" if per_token else "x"
    if getattr(x, "ndim", None) != rank:
        raise ValueError(f"{fn}: {name} must have shape {shape}, got {getattr(x, 'shape', None)}")
    if not isinstance(state, HopeState) or not isinstance(state.memories, HopeMemories):
        raise ValueError(f"{fn}: {sname} must be a HopeState (hope_init_state), got {type(state)}")
    for mname in HopeMemories._fields:
        mem = getattr(state.memories, mname)
        if mem is None:
            continue
        if not isinstance(mem, MLPMemory) or getattr(mem.w1, "ndim", None) != 4:
            raise ValueError(
                f"{fn}: {sname}.memories.{mname} must be an MLPMemory with w1 [B, H, D, h] (use "
                "hope_init_state to add the batch axis)"
            )
        _check_blocked(fn, f"hidden size h of {sname}.memories.{mname}", mem.w1.shape[-1], e)
    return n, e, x.shape[0]


def _gated(fn_name, state, active, e, activation, call):
    """``call(M^{(g)}) -> (out, cand)``, then the locked coordinates of ``cand`` are restored."""
    _check_silent_at_zero(fn_name, activation)
    tree = proteus_hope_masks(state, active, e)
    out, cand = call(proteus_gate(state, tree))
    return out, proteus_gated_update(state, cand, tree)


def proteus_hope_step(
    state: HopeState,
    x_t,
    q_t,
    readout,
    *,
    t,
    schedule: ProteusRule,
    rule: HopeRule = HopeRule(),
    activation: Callable = jax.nn.silu,
):
    """One Hope token with Proteus hidden-unit blocks at 1-based position ``t`` (SPEC §3.2, §4).

    ``(o_t, cand) = hope_step(g_t ⊙ M_{t-1}, x_t, q_t)``, ``M_t = where(g_t, cand, M_{t-1})`` on
    every memory's ``w1`` (columns), ``w2`` (rows) and momenta.

    Args:
      state: ``HopeState`` (``hope_init_state``), weights ``[B, H, ...]``.
      x_t, q_t: ``[B, H, D]`` (``q_t`` ignored, may be None, with ``rule.adaptive_q``).
      readout: ``HopeReadout`` of ``M_η``, ``M_α``.
      t: 1-based absolute position, a Python int ``≥ 1`` or an integer array ``[]`` / ``[B]``.
      schedule: the :class:`~nested_jax.rules.ProteusRule` ``(E = blocks, N = context_len)``,
        ``N ≥ 1`` (every hidden size ``h ≥ E``).
      rule: the :class:`~nested_jax.rules.HopeRule`, as ``hope_step`` reads it.
      activation: the memories' ``σ``; must have ``σ(0) = 0``.

    Returns:
      ``(o_t [B, H, D], new HopeState)``.
    """
    fn = "proteus_hope_step"
    n, e, B = _check_hope(fn, x_t, state, rule, schedule, True)
    _check_t0(fn, t, B, name="t (1-based)", low=1)

    def step(s):
        return hope_step(s, x_t, q_t, readout, rule=rule, activation=activation)

    if _statically_open(t - 1 if _is_int(t) else t, n, e):
        return step(state)
    active = proteus_active_blocks(_positions(t, B), n, e)
    return _gated(fn, state, active, e, activation, step)


def proteus_hope_recurrent(
    x,
    q,
    readout,
    *,
    schedule: ProteusRule,
    initial_state: HopeState | None = None,
    t0=0,
    rule: HopeRule = HopeRule(),
    activation: Callable = jax.nn.silu,
):
    """Hope with Proteus hidden-unit blocks, token by token (SPEC §3.2, §4; ground truth).

    ``lax.scan`` of :func:`proteus_hope_step` at positions ``t = t0 + 1 … t0 + T``.

    Args:
      x: memory inputs ``[B, T, H, D]``; q: ``W_q x`` ``[B, T, H, D]`` (ignored, may be None, with
        ``rule.adaptive_q``).
      readout: as :func:`proteus_hope_step`.
      schedule: the :class:`~nested_jax.rules.ProteusRule` ``(E, N)``.
      initial_state: ``HopeState`` (``hope_init_state(memories, B)``), weights ``[B, H, ...]``;
        required (None raises ``ValueError``).
      t0: tokens already seen: a Python int (static; enables the fully-open dispatch) or an integer
        array ``[]`` / ``[B]`` (traced, e.g. ragged decoding).
      rule, activation: as :func:`proteus_hope_step`.

    Returns:
      ``(o [B, T, H, D], final HopeState)``.
    """
    fn = "proteus_hope_recurrent"
    state = initial_state
    n, e, B = _check_hope(fn, x, state, rule, schedule, False)
    _check_t0(fn, t0, B)
    if _statically_open(t0, n, e):
        return hope_recurrent(x, q, readout, initial_state=state, rule=rule, activation=activation)
    _check_silent_at_zero(fn, activation)
    qs = x if rule.adaptive_q else q
    if qs is None or getattr(qs, "shape", None) != x.shape:
        raise ValueError(
            f"{fn}: q must have shape [B, T, H, D] = {x.shape} (adaptive_q=False), got "
            f"{getattr(qs, 'shape', None)}"
        )
    pos0 = _positions(t0, B)

    def body(st, xs):
        i, x_t, q_t = xs
        active = proteus_active_blocks(pos0 + i + 1, n, e)
        o_t, st = _gated(
            fn, st, active, e, activation,
            lambda s: hope_step(s, x_t, q_t, readout, rule=rule, activation=activation),
        )  # fmt: skip
        return st, o_t

    tm = lambda a: jnp.moveaxis(jnp.asarray(a), 1, 0)  # noqa: E731
    st, o = lax.scan(body, state, (jnp.arange(x.shape[1], dtype=jnp.int32), tm(x), tm(qs)))
    return jnp.moveaxis(o, 0, 1), st


def proteus_hope_chunked(
    x,
    q,
    readout,
    *,
    schedule: ProteusRule,
    initial_state: HopeState | None = None,
    t0: int = 0,
    rule: HopeRule = HopeRule(),
    activation: Callable = jax.nn.silu,
    backbone: Callable = hope_chunked,
):
    """Chunk-wise Hope with Proteus hidden-unit blocks (SPEC §3.2 chunk Decision, §4).

    Each span of constant mask ``g`` (``proteus_spans``) is one ``hope_chunked`` call from
    ``g ⊙ M`` (weights and momenta), after which the locked coordinates are restored with
    ``where``; a fully open span is a plain call. Both chunk grids restart at every Δ-boundary, so
    chunk sizes 1 equal :func:`proteus_hope_recurrent`, and chunk sizes dividing ``Δ`` and ``t0``
    give the global grid.

    Args:
      x, q: as :func:`proteus_hope_recurrent`.
      readout: as :func:`proteus_hope_step`.
      schedule: the :class:`~nested_jax.rules.ProteusRule` ``(E, N)``.
      initial_state: as :func:`proteus_hope_recurrent` (required).
      t0: tokens already seen (static Python int ``≥ 0``).
      rule: the :class:`~nested_jax.rules.HopeRule` of ``hope_chunked`` (chunk sizes, flags,
        ``grad_horizon``, ``remat``, ...).
      activation: the memories' ``σ`` (``σ(0) = 0``).
      backbone: the function run on every span, ``hope_chunked`` or one with its arguments and
        returns (e.g. the twin ``hope_reference``, whose chunk grid restarts at every call too).

    Returns:
      ``(o [B, T, H, D], final HopeState)``.
    """
    fn = "proteus_hope_chunked"
    state = initial_state
    n, e, _ = _check_hope(fn, x, state, rule, schedule, False)
    t0 = _check_static_t0(fn, t0)
    kw = dict(rule=rule, activation=activation)
    spans = proteus_spans(x.shape[1], t0, n, e)
    if _statically_open(t0, n, e) or not spans:
        return backbone(x, q, readout, initial_state=state, **kw)
    _check_silent_at_zero(fn, activation)
    # validates q, readout and the state's shapes once, with the backbone's messages
    jax.eval_shape(lambda x1, q1, s, r: backbone(x1, q1, r, initial_state=s, **kw), x[:, :1],
                   None if q is None else q[:, :1], state, readout)  # fmt: skip
    adaptive_q = rule.adaptive_q
    seq = (x,) if adaptive_q else (x, q)

    def call(s, xs):
        return backbone(xs[0], None if adaptive_q else xs[1], readout, initial_state=s, **kw)

    def span_fn(s, xs, active):
        return _gated(fn, s, active, e, activation, lambda g: call(g, xs))

    return run_proteus_spans(span_fn, call, state, seq, spans, e)


def proteus_hope_packed(
    x,
    q,
    readout,
    *,
    schedule: ProteusRule,
    segment_ids,
    initial_state: HopeState | None = None,
    rule: HopeRule = HopeRule(),
    activation: Callable = jax.nn.silu,
    backbone: Callable = hope_chunked,
):
    """Proteus Hope on packed rows, the schedule at **row** positions ``1 … T`` (SPEC §3.2, §4).

    The spans of :func:`proteus_hope_chunked` at ``t0 = 0`` (chunk grids restart at every
    Δ-boundary), with ``segment_ids`` passed to the backbone. A document start returns the
    **whole** state, locked coordinates included, to ``initial_state``
    (``run_proteus_spans_packed``), so nothing of the previous document leaks through a
    coordinate that opens later. A document starting at row position ``p`` gets what
    :func:`proteus_hope_chunked` with ``t0 = p`` from ``initial_state`` gives it when ``p`` lies
    on the backbone's chunk grids (always with chunk sizes 1); off the grid its first chunk is cut
    short as :func:`~nested_jax.core.hope.chunk.hope_chunked` describes. Inside a locked span the
    backbone's own reset target is the gated ``g ⊙ initial_state.memories`` (its open
    coordinates; the locked ones are put back after).

    Args:
      x, q: as :func:`proteus_hope_chunked`.
      readout: ``HopeReadout``; schedule: the :class:`~nested_jax.rules.ProteusRule` ``(E, N)``.
      segment_ids: int ``[B, T]`` document ids (a change of id starts a document).
      initial_state: the row's start ``HopeState``, which every document start also restores
        (e.g. the learned initial memories and zero momenta); required.
      rule, activation, backbone: as :func:`proteus_hope_chunked`.

    Returns:
      ``(o [B, T, H, D], final HopeState)``.
    """
    fn = "proteus_hope_packed"
    state = initial_state
    n, e, _ = _check_hope(fn, x, state, rule, schedule, False)
    if jnp.shape(segment_ids) != x.shape[:2]:
        raise ValueError(
            f"{fn}: segment_ids must have shape [B, T]={x.shape[:2]}, got {jnp.shape(segment_ids)}"
        )
    kw = dict(rule=rule, activation=activation)
    spans = proteus_spans(x.shape[1], 0, n, e)
    if _statically_open(0, n, e) or not spans:
        return backbone(x, q, readout, initial_state=state, segment_ids=segment_ids, **kw)
    _check_silent_at_zero(fn, activation)
    adaptive_q = rule.adaptive_q
    reset = state

    def call(st, xs, seg, init):
        q_in = None if adaptive_q else xs[1]
        return backbone(
            xs[0], q_in, readout, initial_state=st, segment_ids=seg, initial_memories=init, **kw
        )

    def span_fn(st, xs, seg, active):
        tree = proteus_hope_masks(st, active, e)
        out, cand = call(proteus_gate(st, tree), xs, seg, proteus_gate(reset, tree).memories)
        return out, proteus_gated_update(st, cand, tree)

    def open_fn(st, xs, seg):
        return call(st, xs, seg, reset.memories)

    def masks_of(active):
        return proteus_hope_masks(state, active, e)

    seq = (x,) if adaptive_q else (x, q)
    return run_proteus_spans_packed(
        span_fn, open_fn, masks_of, state, reset, seq, segment_ids, spans, e
    )
