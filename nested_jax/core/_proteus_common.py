"""Shared machinery of the Proteus-wrapped memories (SPEC §4): validation, static spans.

Private to ``core/associative/proteus.py``, ``core/titans/proteus.py`` and
``core/hope/proteus.py``; the public :func:`proteus_spans` is exported by ``nested_jax.core``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from nested_jax.core.proteus import (
    proteus_active_blocks,
    proteus_block_len,
    proteus_gated_update,
)
from nested_jax.core.scan import segment_starts

__all__ = ["proteus_spans", "run_proteus_spans", "run_proteus_spans_packed"]


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_schedule(fn: str, context_len, num_blocks) -> tuple[int, int]:
    for name, x in (("context_len", context_len), ("num_blocks", num_blocks)):
        if not _is_int(x) or x < 1:
            raise ValueError(f"{fn}: {name} must be a positive Python int, got {x!r}")
    return int(context_len), int(num_blocks)


def _check_blocked(fn: str, name: str, size: int, num_blocks: int) -> None:
    if size < num_blocks:
        raise ValueError(
            f"{fn}: {name} ({size}) must be >= num_blocks ({num_blocks}) so that no block is empty"
        )


def _check_static_t0(fn: str, t0) -> int:
    if not _is_int(t0) or t0 < 0:
        raise ValueError(
            f"{fn}: t0 must be a non-negative Python int (the chunked form splits time statically;"
            f" use the recurrent form for a traced position), got {t0!r}"
        )
    return int(t0)


def _check_t0(fn: str, t0, B: int, name: str = "t0", low: int = 0) -> None:
    """``t0``: a Python int ``≥ low`` or an integer array ``[]`` / ``[B]`` (maybe traced)."""
    if _is_int(t0):
        if t0 < low:
            raise ValueError(f"{fn}: {name} must be >= {low}, got {t0}")
        return
    shape = getattr(t0, "shape", None)
    if shape not in ((), (B,)) or not jnp.issubdtype(t0.dtype, jnp.integer):
        raise ValueError(
            f"{fn}: {name} must be an int or an integer array of shape [] or [B] = [{B}], got "
            f"{getattr(t0, 'dtype', type(t0).__name__)} {shape}"
        )


def _check_silent_at_zero(fn: str, activation: Callable) -> None:
    """Refuses ``σ(0) ≠ 0``: hidden-unit blocks need a locked (zeroed) unit to output 0."""
    with jax.ensure_compile_time_eval():
        at0 = float(activation(jnp.zeros((), jnp.float32)))
    if at0 != 0.0:
        raise ValueError(
            f"{fn}: activation must satisfy σ(0) = 0 (got {at0}) so that locked hidden units "
            "of the gated memory are silent (SPEC §4 hidden-unit blocks)"
        )


def _positions(t0, B: int):
    """Checked ``t0`` → int32 ``[B]``."""
    return jnp.broadcast_to(jnp.asarray(t0, jnp.int32), (B,))


def _statically_open(t0, context_len: int, num_blocks: int) -> bool:
    """True when every position of the call has all blocks open, known at trace time."""
    if num_blocks == 1:
        return True
    return _is_int(t0) and proteus_active_blocks(int(t0) + 1, context_len, num_blocks) == num_blocks


def proteus_spans(length: int, t0: int, context_len: int, num_blocks: int):
    """Static split of local positions ``[0, length)`` into spans of constant ``k(t)`` (SPEC §4).

    ``k`` steps up at absolute ``t = jΔ + 1`` (``j = 1 … E−1``), i.e. before local index
    ``i = jΔ − t0``; after ``(E−1)Δ`` tokens every block is open for good.

    Args:
      length: number of tokens ``T`` of the call (``≥ 0``).
      t0: tokens already seen before the call (``≥ 0``, Python int).
      context_len: ``N``.
      num_blocks: ``E``.

    Returns:
      list of ``(start, end, k)`` Python ints, contiguous, covering ``[0, length)`` (empty when
      ``length == 0``); ``k`` is the number of open blocks on ``[start, end)``.
    """
    fn = "proteus_spans"
    n, e = _check_schedule(fn, context_len, num_blocks)
    if not _is_int(length) or length < 0:
        raise ValueError(f"{fn}: length must be a non-negative int, got {length!r}")
    t0 = _check_static_t0(fn, t0)
    delta = proteus_block_len(n, e)
    cuts = [j * delta - t0 for j in range(1, e) if 0 < j * delta - t0 < length]
    edges = [0, *cuts, int(length)] if length > 0 else []
    return [
        (a, b, proteus_active_blocks(t0 + a + 1, n, e))
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]


def _zero_where(mask, x):
    return jnp.where(mask, x, jnp.zeros((), x.dtype))


def _span_groups(spans, e: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive locked spans of one length form a group (one ``lax.scan``); the rest (a first
    or last span of another length, the fully open tail) stand alone."""
    groups: list[list[tuple[int, int, int]]] = []
    for span in spans:
        a, b, k = span
        last = groups[-1][-1] if groups else None
        if last is not None and k < e and last[2] < e and last[1] - last[0] == b - a:
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


def run_proteus_spans(span_fn, open_fn, state, seq, spans, num_blocks: int):
    """Runs a memory span by span under the Proteus schedule (SPEC §4).

    ``span_fn(state, xs, active) -> (out, state)`` runs one span of constant mask whose ``active``
    blocks are open (a Python int, or an int32 array ``[B]`` inside a scan), ``open_fn(state, xs)``
    the fully open tail. Consecutive locked spans of one length (all spans ``Δ`` long but the first
    and the last of a call, in general) run as one ``lax.scan`` with a traced ``active``, so the
    program holds one span body instead of up to ``E`` copies. Measured on the tiny Titans LMM
    with E = 16 (LM fwd+bwd, T = N = 128, batch 16, 2 loaded CPU cores, separate processes):
    compile 58 s → 21 s, step 2.13 s → 1.67 s (E = 1: 12 s, 1.10 s). A padding token is not a
    no-op in Titans or Hope (decay and momentum still act), hence the grouping by length instead
    of padding every span to one length.

    Args:
      span_fn, open_fn: as above; ``xs`` is ``seq`` cut to the span (``[B, span, ...]`` each).
      state: the memory state (a pytree; ``span_fn`` must return it with the same structure).
      seq: tuple of arrays ``[B, T, ...]``.
      spans: ``proteus_spans(T, t0, N, E)``.
      num_blocks: ``E``.

    Returns:
      ``(out [B, T, ...], final state)``: the span outputs concatenated along time.
    """
    outs = []
    for group in _span_groups(spans, num_blocks):
        a, b, active = group[0]
        if len(group) > 1:
            out, state = _scan_spans(span_fn, state, seq, a, b - a, [k for *_, k in group])
        elif active == num_blocks:
            out, state = open_fn(state, tuple(x[:, a:b] for x in seq))
        else:
            out, state = span_fn(state, tuple(x[:, a:b] for x in seq), active)
        outs.append(out)
    return jnp.concatenate(outs, axis=1), state


def run_proteus_spans_packed(
    span_fn, open_fn, masks_of, state, reset_state, seq, segment_ids, spans, num_blocks: int
):
    """:func:`run_proteus_spans` on packed rows, with the schedule at **row** positions (SPEC §4).

    A document start returns the **whole** state, locked coordinates included, to
    ``reset_state`` (so nothing of the previous document leaks through a coordinate that opens
    later): at a span start the state is reset before the span; for a start inside a span the
    memory call resets the open coordinates itself (it gets ``segment_ids``) and the locked ones
    are taken from ``reset_state`` afterwards. A document starting at row position ``p`` thus
    sees exactly what a separate call with ``t0 = p`` from ``reset_state`` sees.

    Args:
      span_fn: ``(state, xs, seg, active) -> (out, state)``: one span of constant mask, locked
        coordinates kept (``proteus_gated_update``); ``seg`` is the span's ``segment_ids``.
      open_fn: ``(state, xs, seg) -> (out, state)``: the fully open tail.
      masks_of: ``active -> mask tree`` of the state (``proteus_gated_update``'s ``mask``).
      state, reset_state: pytrees of ``[B, ...]`` arrays, one structure.
      seq, spans, num_blocks: as :func:`run_proteus_spans`.
      segment_ids: int ``[B, T]``.

    Returns:
      ``(out [B, T, ...], final state)``.
    """
    starts = segment_starts(segment_ids)  # never at 0

    def pick(flag, a, b):  # per batch row: a where flag [B] else b
        row = lambda x: flag.reshape(-1, *[1] * (x.ndim - 1))  # noqa: E731
        return jax.tree.map(lambda x, y: jnp.where(row(x), x, y), a, b)

    def split(part):
        *xs, seg, start = part
        return tuple(xs), seg, start

    def open_packed(st, part):
        xs, seg, start = split(part)
        return open_fn(pick(start[:, 0], reset_state, st), xs, seg)

    def span_packed(st, part, active):
        xs, seg, start = split(part)
        out, new = span_fn(pick(start[:, 0], reset_state, st), xs, seg, active)
        restarted = proteus_gated_update(reset_state, new, masks_of(active))
        return out, pick(jnp.any(start[:, 1:], axis=1), restarted, new)

    seq = (*seq, segment_ids, starts)
    return run_proteus_spans(span_packed, open_packed, state, seq, spans, num_blocks)


def _scan_spans(span_fn, state, seq, start: int, length: int, actives: list[int]):
    """``len(actives)`` spans of ``length`` tokens from ``start``, as one ``lax.scan``."""
    n, batch = len(actives), seq[0].shape[0]

    def split(x):  # [B, n·L, ...] → [n, B, L, ...]
        x = x[:, start : start + n * length]
        return jnp.moveaxis(x.reshape(batch, n, length, *x.shape[2:]), 1, 0)

    def body(carry, inp):
        xs, active = inp
        out, carry = span_fn(carry, xs, active)
        return carry, out

    ks = jnp.broadcast_to(jnp.asarray(actives, jnp.int32)[:, None], (n, batch))
    state, out = jax.lax.scan(body, state, (tuple(split(x) for x in seq), ks))
    out = jnp.moveaxis(out, 0, 1)  # [n, B, L, ...] → [B, n, L, ...]
    return out.reshape(batch, n * length, *out.shape[3:]), state
