"""Hope token by token: the decode step and the per-token forms of the chunked rule (SPEC §3.2).

- :func:`hope_decode_step`: one token of :func:`~nested_jax.core.hope.chunk.hope_chunked` at a given
  0-based position, carrying the chunk-start snapshots (the decode form; the loop over a call is
  ``core.hope.decode.hope_decode``).
- :func:`hope_step` / :func:`hope_recurrent`: ``hope_chunked`` with both chunk sizes 1, one token
  and a ``lax.scan`` over tokens. They share ``hope_chunked``'s code; Hope's independent ground
  truth is the twin ``nested_jax.core.hope.reference.hope_reference``.

These forms reuse the chunk helpers of :mod:`nested_jax.core.hope.chunk`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import require_initial_state
from nested_jax.core.hope.chunk import _chunk_body, _chunked, _validate
from nested_jax.core.hope.state import (
    HOPE_STATE_CONSTRUCTOR,
    HopeMemories,
    HopeReadout,
    HopeState,
    _names,
    check_rule,
)
from nested_jax.rules import HopeRule

__all__ = ["hope_decode_step", "hope_step", "hope_recurrent"]


def _per_token(rule: HopeRule) -> HopeRule:
    """``rule`` with a token as its own chunk: chunk sizes 1, the token-by-token updates, no
    truncated backprop or remat (one token has nothing to cut or recompute); the fields of the
    rule are kept."""
    return dataclasses.replace(
        rule, chunk_memory=1, chunk_other=1, grad_horizon=0, remat=False, remat_every=0,
        remat_levels=2, chunk_updates="scan",
    )  # fmt: skip


def _refresh_snapshots(memories: HopeMemories, snapshot: HopeMemories, index, rule: HopeRule):
    """Each group's chunk-start snapshot: the running ``memories`` where ``index`` (scalar or
    ``[B]``) is a multiple of the group's chunk size, else the carried ``snapshot``."""

    def refresh(c, new, old):
        r = (index % c) == 0
        return jnp.where(r.reshape(r.shape + (1,) * (new.ndim - r.ndim)), new, old)

    snap = {}
    for n in _names(memories):
        c = rule.chunk_memory if n == "memory" else rule.chunk_other
        snap[n] = jax.tree.map(
            functools.partial(refresh, c), getattr(memories, n), getattr(snapshot, n)
        )
    return HopeMemories(**snap)


def hope_decode_step(
    state: HopeState,
    x_t,
    q_t,
    snapshot: HopeMemories,
    index,
    readout: HopeReadout,
    *,
    rule: HopeRule = HopeRule(),
    activation: Callable = jax.nn.silu,
):
    """One token of :func:`hope_chunked` (SPEC §3.2), for decoding: equal to row ``index``.

    The chunked form needs, besides the running state, the chunk-start snapshots of each group.
    With ``index`` the 0-based position of this token (chunks aligned at 0), a group's snapshot is
    refreshed from the running state when ``index`` is a multiple of its chunk size; then the token
    is one in-order step of :func:`hope_chunked`'s chunk body with those snapshots.

    Args:
      state: running ``HopeState``, weights ``[B, H, ...]``.
      x_t, q_t: ``[B, H, D]`` (``q_t`` ignored, may be None, when ``rule.adaptive_q``).
      snapshot: ``HopeMemories`` of the same structure: the chunk-start snapshots (read only where
        ``index`` is not a multiple of the group's chunk size; any value at ``index = 0``).
      index: int scalar or ``[B]``: the token's position.
      readout: ``HopeReadout``.
      rule: the :class:`~nested_jax.rules.HopeRule` of :func:`hope_chunked` (its chunk sizes and
        fields; ``grad_horizon``, ``remat*`` and ``chunk_updates`` change nothing here).
      activation: the memories' ``σ``.

    Returns:
      ``(o_t [B, H, D], new HopeState, new snapshot)``.
    """
    rule = check_rule("hope_decode_step", rule)
    x_t = jnp.asarray(x_t)
    if x_t.ndim != 3:
        raise ValueError(f"x_t must have shape [B, H, D], got {x_t.shape}")
    qq = None if (q_t is None or rule.adaptive_q) else jnp.asarray(q_t)[:, None]
    x = x_t[:, None]
    B = _validate(x, qq, state, readout, rule)[0]
    if not isinstance(snapshot, HopeMemories) or jax.tree.map(jnp.shape, snapshot) != jax.tree.map(
        jnp.shape, state.memories
    ):
        raise ValueError(
            "snapshot must be a HopeMemories with the shapes of state.memories, got "
            f"{jax.tree.map(jnp.shape, snapshot)}"
        )
    index = jnp.asarray(index)
    if index.shape not in ((), (B,)):
        raise ValueError(f"index must be a scalar or have shape [B]={(B,)}, got {index.shape}")
    snapshot = _refresh_snapshots(state.memories, snapshot, index, rule)
    x = jnp.asarray(x, jnp.promote_types(x.dtype, jnp.float32))
    qq = x if rule.adaptive_q else jnp.asarray(qq, x.dtype)
    o, state = _chunk_body(
        state,
        snapshot._replace(memory=None),
        snapshot.memory,
        x,
        qq,
        jnp.ones((B, 1), bool),
        readout,
        rule=rule,
        act=activation,
    )
    return o[:, 0], state, snapshot


def hope_step(
    state: HopeState,
    x_t,
    q_t,
    readout: HopeReadout,
    *,
    rule: HopeRule = HopeRule(),
    activation: Callable = jax.nn.silu,
):
    """One exact Hope token (SPEC §3.2): read ``o_t = M_{memory,t−1}(q_t)``, then write memories.

    Args:
      state: ``HopeState`` (``hope_init_state``), weights ``[B, H, ...]``.
      x_t, q_t: ``[B, H, D]`` (``q_t`` ignored when ``rule.adaptive_q``).
      readout: as in :func:`hope_chunked`.
      rule: the :class:`~nested_jax.rules.HopeRule`; its fields apply, its chunk sizes and
        backprop knobs do not (a token is its own chunk).
      activation: the memories' ``σ``.

    Returns:
      ``(o_t [B, H, D], new HopeState)``.
    """
    rule = check_rule("hope_step", rule)
    x_t = jnp.asarray(x_t)
    if x_t.ndim != 3:
        raise ValueError(f"x_t must have shape [B, H, D], got {x_t.shape}")
    qq = None if q_t is None else jnp.asarray(q_t)[:, None]
    _validate(x_t[:, None], qq, state, readout, rule)
    o, st = _chunked(x_t[:, None], qq, state, readout, _per_token(rule), activation, None, None)
    return o[:, 0], st


def hope_recurrent(
    x,
    q,
    readout: HopeReadout,
    *,
    initial_state: HopeState | None = None,
    rule: HopeRule = HopeRule(),
    activation: Callable = jax.nn.silu,
):
    """``lax.scan`` of :func:`hope_step` over time: exact per-token Hope (SPEC §3.2).

    :func:`hope_step` is one token of :func:`hope_chunked` (both chunk sizes 1), so this form shares
    its code and is not an independent check of it. The independent ground truth is the reference
    twin :func:`nested_jax.core.hope.reference.hope_reference` (a per-token loop written from SPEC
    §3.2, inner gradients by ``jax.grad``), which the tests compare with :func:`hope_chunked` on
    values and gradients at chunk sizes 1 and (4, 2).

    Args/Returns: as :func:`hope_chunked` with both chunk sizes 1 (``initial_state`` required:
    ``hope_init_state(memories, B)``); the chunk sizes and backprop knobs of ``rule`` do not
    apply, as in :func:`hope_step`.
    """
    rule = check_rule("hope_recurrent", rule)
    state = require_initial_state("hope_recurrent", initial_state, HOPE_STATE_CONSTRUCTOR)
    x = jnp.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"x must have shape [B, T, H, D], got {x.shape}")
    _validate(x, q, state, readout, rule, name="initial_state")
    qs = x if rule.adaptive_q else jnp.asarray(q)

    def body(st, inp):
        x_t, q_t = inp
        o_t, st = hope_step(st, x_t, q_t, readout, rule=rule, activation=activation)
        return st, o_t

    state, o = lax.scan(body, state, (jnp.moveaxis(x, 1, 0), jnp.moveaxis(qs, 1, 0)))
    return jnp.moveaxis(o, 0, 1), state
