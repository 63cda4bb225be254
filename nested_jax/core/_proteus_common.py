"""Shared machinery of the Proteus-wrapped memories (SPEC §4): validation, static spans.

Private to ``core/proteus_gdn.py``, ``core/proteus_titans.py`` and ``core/proteus_hope.py``;
the public :func:`proteus_spans` is re-exported by ``core/proteus_memory.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from nested_jax.core.proteus import proteus_active_blocks, proteus_block_len

__all__ = ["proteus_spans"]


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


def _run_spans_unrolled(span_fn, open_fn, state, seq, spans, e):
    """Static loop over spans: ``span_fn(state, xs, active)`` while blocks are locked, then
    ``open_fn(state, xs)`` on the fully open tail. Returns ``(concatenated outputs, state)``."""
    outs = []
    for a, b, active in spans:
        xs = tuple(x[:, a:b] for x in seq)
        o, state = open_fn(state, xs) if active == e else span_fn(state, xs, active)
        outs.append(o)
    return jnp.concatenate(outs, axis=1), state
