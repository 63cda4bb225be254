"""Hope decoding: the cached token loop, plain or under the Proteus schedule (SPEC §3.2, §4).

A decode state (:class:`HopeDecodeState`, built by :func:`hope_decode_state`) is the running
``HopeState`` (memories and momenta), the chunk-start snapshots of both groups (``HopeMemories``)
and the number ``n`` of tokens seen. Token ``i`` of a call sits at 0-based position ``n + i``
(chunks aligned at 0) and is one :func:`hope_decode_step`::

    (o_t, S_t, snap_t) = hope_decode_step(S_{t−1}, x_t, q_t, snap_{t−1}, n + i)

so a cached call (a prefill too) equals :func:`hope_chunked` row by row. With Proteus
(``E = num_blocks > 1``, SPEC §4) every token is gated by the mask ``g_t`` of its 1-based position
``t = n + i + 1``::

    (o_t, cand, snap_t) = hope_decode_step(g_t ⊙ S_{t−1}, x_t, q_t, snap_{t−1}, n + i)
    S_t = where(g_t, cand, S_{t−1})                      # locked coordinates keep their bits

which equals ``proteus_hope_chunked`` only when both chunk sizes divide ``Δ = N // E``: the
sequence form restarts its chunk grid at every Δ-boundary, the decode grid is global
(:func:`check_proteus_decode_chunks`). The Hope rule and the Proteus schedule come whole, as
``rule`` (:class:`~nested_jax.rules.HopeRule`) and ``schedule``
(:class:`~nested_jax.rules.ProteusRule`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nested_jax.core.checks import require_initial_state
from nested_jax.core.hope.proteus import proteus_hope_masks
from nested_jax.core.hope.state import (
    HopeMemories,
    HopeReadout,
    HopeState,
    check_rule,
    hope_init_state,
)
from nested_jax.core.hope.token import hope_decode_step
from nested_jax.core.proteus import (
    _check_silent_at_zero,
    proteus_active_blocks,
    proteus_block_len,
    proteus_chunk_constant,
    proteus_gate,
    proteus_gated_update,
)
from nested_jax.rules import HopeRule, ProteusRule

__all__ = ["HopeDecodeState", "hope_decode_state", "check_proteus_decode_chunks", "hope_decode"]


class HopeDecodeState(NamedTuple):
    """What :func:`hope_decode` carries from one call to the next (SPEC §3.2); a pytree.

    Attributes:
      state: the running ``HopeState`` (memories and momenta), weights ``[B, H, ...]``.
      snapshot: ``HopeMemories`` shaped like ``state.memories``: each group's chunk-start
        snapshot (read only inside a chunk; any value at ``n = 0``).
      n: int32 scalar, tokens seen (the 0-based position of the next token).
    """

    state: HopeState
    snapshot: HopeMemories
    n: jax.Array


def hope_decode_state(
    memories: HopeMemories, batch_size: int, *, momentum: bool = False, dtype=jnp.float32
) -> HopeDecodeState:
    """The decode state at position 0: ``hope_init_state(memories, B)``, its memories as the
    snapshot, ``n = 0``.

    Args:
      memories: learned ``HopeMemories`` (``w1 [H, D, h]``, ``w2 [H, h, D]``, or already
        ``[B, ...]``).
      batch_size: ``B``.
      momentum: add zero momenta (needed when the rule has ``momentum``).
      dtype: state dtype (f32 or wider).

    Returns:
      ``HopeDecodeState`` with weights ``[B, H, ...]``.
    """
    st = hope_init_state(memories, batch_size, momentum=momentum, dtype=dtype)
    return HopeDecodeState(st, st.memories, jnp.zeros((), jnp.int32))


def check_proteus_decode_chunks(
    rule: HopeRule, schedule: ProteusRule, *, owner: str = "rule"
) -> None:
    """Raises unless decoding under Proteus equals the sequence form (SPEC §4).

    ``proteus_hope_chunked`` restarts both chunk grids every ``Δ = N // E`` tokens, while
    decoding keeps one grid aligned at position 0; the two agree iff every Δ-boundary is a chunk
    boundary of both groups (``proteus_chunk_constant``). ``E = 1`` always passes.

    Args:
      rule: the ``HopeRule`` (its ``chunk_memory``, ``chunk_other``).
      schedule: the ``ProteusRule`` ``(E = blocks, N = context_len)``.
      owner: the prefix of the message (``"HopeOptions"`` from the layer's config).
    """
    if not schedule.enabled:
        return
    context_len, num_blocks = schedule.context_len, schedule.blocks
    delta = proteus_block_len(context_len, num_blocks)
    for name in ("chunk_memory", "chunk_other"):
        chunk = getattr(rule, name)
        if not proteus_chunk_constant(chunk, context_len, num_blocks):
            raise ValueError(
                f"{owner}.{name}: decoding with Proteus needs the chunk size to divide "
                f"the block length Δ = context_len // blocks = {delta} (the forward's "
                f"chunk grid restarts every Δ tokens), got {chunk}"
            )


def hope_decode(
    x,
    q,
    readout: HopeReadout,
    *,
    rule: HopeRule = HopeRule(),
    schedule: ProteusRule = ProteusRule(),
    initial_state: HopeDecodeState | None = None,
    initial_memories: HopeMemories | None = None,
    activation: Callable = jax.nn.silu,
):
    """``T`` cached Hope tokens at positions ``n … n + T − 1`` (SPEC §3.2; Proteus SPEC §4).

    A ``lax.scan`` of :func:`hope_decode_step` (module docstring); with ``schedule.blocks > 1``
    each token reads and writes ``g_t ⊙ S`` and the locked coordinates keep their bits.

    Args:
      x: memory inputs ``[B, T, H, D]``; q: ``W_q x`` ``[B, T, H, D]`` (None with
        ``rule.adaptive_q``).
      readout: ``HopeReadout`` of ``M_η``, ``M_α``.
      rule: the :class:`~nested_jax.rules.HopeRule` (chunk sizes and flags; ``grad_horizon``,
        ``remat*`` and ``chunk_updates`` change nothing here).
      schedule: the :class:`~nested_jax.rules.ProteusRule` ``(E, N)``; the default ``E = 1`` is no
        Proteus. With ``E > 1`` both chunk sizes must divide ``Δ = N // E``.
      initial_state: :class:`HopeDecodeState` ``(state, snapshot, n)``: the running ``HopeState``
        (weights ``[B, H, ...]``), the chunk-start snapshots (``HopeMemories`` shaped like
        ``state.memories``) and the int32 scalar ``n`` of tokens seen before this call. Required
        (:func:`hope_decode_state` builds the one at position 0; None raises ``ValueError``).
      initial_memories: optional ``HopeMemories`` ``[H, ...]``: where ``n == 0`` the call starts
        from ``hope_init_state(initial_memories)`` instead of ``initial_state.state`` (a cache
        built before the parameters were known holds placeholders).
      activation: the memories' ``σ`` (``σ(0) = 0`` with Proteus).

    Returns:
      ``(o [B, T, H, D], HopeDecodeState(new state, new snapshot, n + T))``.
    """
    rule = check_rule("hope_decode", rule)
    if not isinstance(schedule, ProteusRule):
        raise ValueError(f"hope_decode: schedule must be a ProteusRule, got {schedule!r}")
    ds = require_initial_state("hope_decode", initial_state, "hope_decode_state(memories, B)")
    if not isinstance(ds, tuple) or len(ds) != 3:
        raise ValueError(
            "hope_decode: initial_state must be a HopeDecodeState(state, snapshot, n), got "
            f"{type(ds).__name__}"
        )
    state, snapshot, n = ds
    b = x.shape[0]
    if initial_memories is not None:
        fresh = hope_init_state(initial_memories, b, momentum=rule.momentum)
        started = n > 0
        state = jax.tree.map(lambda c, f: jnp.where(started, c, f), state, fresh)
    step = functools.partial(hope_decode_step, readout=readout, rule=rule, activation=activation)
    gated = schedule.enabled
    if gated:
        check_proteus_decode_chunks(rule, schedule)
        _check_silent_at_zero("hope_decode", activation)

    def body(carry, inp):
        st, snap, i = carry
        x_t, q_t = inp
        if gated:  # the mask of position i + 1 (SPEC §4)
            active = proteus_active_blocks(
                jnp.full((b,), i + 1), schedule.context_len, schedule.blocks
            )
            tree = proteus_hope_masks(st, active, schedule.blocks)
            # The snapshots need no gate: they are taken from the gated state at chunk starts,
            # and the mask is constant inside a chunk (the chunk sizes divide Δ).
            o_t, new, snap = step(proteus_gate(st, tree), x_t, q_t, snap, i)
            st = proteus_gated_update(st, new, tree)
        else:
            o_t, st, snap = step(st, x_t, q_t, snap, i)
        return (st, snap, i + 1), o_t

    # adaptive_q: q is unused, x stands in so the scan has one input structure
    qs = jnp.moveaxis(x if q is None else q, 1, 0)
    (state, snapshot, n), out = jax.lax.scan(
        body, (state, snapshot, n), (jnp.moveaxis(x, 1, 0), qs)
    )
    return jnp.moveaxis(out, 0, 1), HopeDecodeState(state, snapshot, n)
