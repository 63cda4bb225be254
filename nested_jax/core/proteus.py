"""Proteus: incremental memory activation — block schedules and gated read/write (SPEC §4).

Memory coordinates are split into ``E`` contiguous blocks (matrix memory ``S [.., K, V]``: blocks
of key rows; MLP memory: blocks of hidden units, i.e. rows of ``W_2`` and columns of ``W_1`` for
``M(z) = z + W_1 σ(W_2 z)``). With training context ``N`` and 1-based position ``t``::

    Δ = max(1, ⌊N/E⌋),   k(t) = min(E, 1 + ⌊(t−1)/Δ⌋),   g_t = 1 on the first k(t) blocks
    M^{(g)}_{t-1} = g_t ⊙ M_{t-1};   y_t = Read(M^{(g)}_{t-1}, q_t)
    M_t = g_t ⊙ Write(M^{(g)}_{t-1}) + (1 − g_t) ⊙ M_{t-1}
    invariant: (1 − g_t) ⊙ M_t = (1 − g_t) ⊙ M_{t-1}     (write, decay and momentum alike)

Beyond ``N`` the schedule stays fully open (``k = E``; ``Δ`` is never stretched). ``E = 1`` is the
plain backbone (every mask is all ones). :class:`ProteusRule` holds ``(E, N)`` as one frozen value
(built from the ``model.proteus`` config section; ops take it as ``rule``, the Proteus-wrapped
Titans and GDN forms as ``schedule``); the functions of this module keep plain
``(context_len, num_blocks)`` ints.

**Block split** (when ``E`` does not divide the size ``D`` of the blocked axis): every block has
``⌊D/E⌋`` coordinates and the *last* block absorbs the remainder (the paper's reading,
``d = dim/E`` with the remainder in the last block). ``D ≥ E`` is required so no block is empty.

The write is merged with ``jnp.where`` on the mask, so locked coordinates keep their exact bits (no
``0·x`` arithmetic: a locked ``inf``/``nan`` stays itself and active values are not rounded).

The span runners every Proteus-wrapped memory shares (:func:`proteus_spans`,
:func:`run_proteus_spans`, :func:`run_proteus_spans_packed`, and their argument checks) close the
module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nested_jax.core.checks import check_positive_int
from nested_jax.core.scan import segment_starts
from nested_jax.rules import ProteusRule

__all__ = [
    "proteus_block_len",
    "proteus_active_blocks",
    "proteus_chunk_constant",
    "proteus_block_ids",
    "proteus_block_mask",
    "proteus_key_mask",
    "proteus_hidden_mask",
    "proteus_mlp_masks",
    "proteus_gate",
    "proteus_gated_update",
    "proteus_gated_step",
    "proteus_spans",
    "run_proteus_spans",
    "run_proteus_spans_packed",
]


def proteus_block_len(context_len: int, num_blocks: int) -> int:
    """``Δ = max(1, ⌊N/E⌋)``: positions per newly opened block (SPEC §4).

    Args:
      context_len: training context ``N`` (positive int).
      num_blocks: ``E`` (positive int).

    Returns:
      ``Δ`` as a Python int.
    """
    n = check_positive_int("context_len", context_len)
    e = check_positive_int("num_blocks", num_blocks)
    return max(1, n // e)


def proteus_active_blocks(t, context_len: int, num_blocks: int):
    """Number of open blocks ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` (SPEC §0.1, §4).

    Example: ``N = 8192, E = 16`` gives ``Δ = 512``; ``t = 1…512 → 1``, ``513 → 2``, ``4096 → 8``,
    ``7680 → 15``, ``7681 → 16`` and every ``t > N`` stays at 16 (fully open).

    Args:
      t: 1-based position, a Python int (``t ≥ 1``) or an integer array of any shape (positions
        ``≤ 0`` are not validated inside ``jit`` and give ``k ≤ 0``, i.e. nothing open).
      context_len: ``N``.
      num_blocks: ``E``.

    Returns:
      ``k(t)``: a Python int for a Python int ``t``, otherwise an int32 array shaped like ``t``.
    """
    delta = proteus_block_len(context_len, num_blocks)
    if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
        if t < 1:
            raise ValueError(f"t is 1-based and must be >= 1, got {t}")
        return min(num_blocks, 1 + (int(t) - 1) // delta)
    t = jnp.asarray(t)
    if not jnp.issubdtype(t.dtype, jnp.integer):
        raise ValueError(f"t must be an integer position (1-based), got dtype {t.dtype}")
    return jnp.minimum(num_blocks, 1 + (t.astype(jnp.int32) - 1) // delta)


def proteus_chunk_constant(chunk_size: int, context_len: int, num_blocks: int) -> bool:
    """Whether ``k(t)`` is constant inside every chunk of ``chunk_size`` positions (static check).

    Chunks cover positions ``nC+1 … nC+C``; ``k`` steps up at ``t = jΔ + 1`` for ``j = 1 … E−1``, so
    the mask is chunk-constant iff every ``jΔ`` is a multiple of ``C`` (e.g. when ``C`` divides
    ``Δ``, or ``E = 1``). Chunked forms can then use one mask per chunk; otherwise they must split
    the chunk or mask per position.

    Args:
      chunk_size: ``C``.
      context_len: ``N``.
      num_blocks: ``E``.

    Returns:
      Python bool.
    """
    c = check_positive_int("chunk_size", chunk_size)
    delta = proteus_block_len(context_len, num_blocks)
    return all((j * delta) % c == 0 for j in range(1, num_blocks))


def proteus_block_ids(size: int, num_blocks: int) -> np.ndarray:
    """Block index of every coordinate of a blocked axis of length ``size`` (static, numpy).

    Blocks are contiguous with ``⌊size/E⌋`` coordinates each; the last block absorbs the remainder.

    Args:
      size: length ``D`` of the blocked axis (``D ≥ E``).
      num_blocks: ``E``.

    Returns:
      int32 numpy array ``[D]`` with values in ``[0, E)``, non-decreasing.
    """
    d = check_positive_int("size", size)
    e = check_positive_int("num_blocks", num_blocks)
    if d < e:
        raise ValueError(f"size ({d}) must be >= num_blocks ({e}) so that no block is empty")
    per = d // e
    return np.minimum(np.arange(d) // per, e - 1).astype(np.int32)


def proteus_block_mask(active, size: int, num_blocks: int, dtype=jnp.float32):
    """Mask of the first ``active`` blocks over an axis of length ``size``.

    Args:
      active: number of open blocks ``k``, int or integer array ``[...]``.
      size: length ``D`` of the blocked axis.
      num_blocks: ``E``.
      dtype: mask dtype (``bool`` or a float dtype; 1 = open).

    Returns:
      ``[..., D]`` mask, 1 on coordinates of blocks ``< k``.
    """
    ids = jnp.asarray(proteus_block_ids(size, num_blocks))
    active = jnp.asarray(active)
    return (ids < active[..., None]).astype(dtype)


def proteus_key_mask(t, context_len: int, num_blocks: int, key_dim: int, dtype=jnp.float32):
    """Key-row mask ``g_t`` of a matrix memory ``S [.., K, V]`` at position ``t`` (SPEC §4).

    Apply it to a state as ``mask[..., :, None]`` (rows of ``S`` are keys; the read ``o = Sᵀ q``
    then only sees open rows).

    Args:
      t: 1-based position(s), int or integer array ``[...]``.
      context_len: training context ``N``.
      num_blocks: ``E``.
      key_dim: ``K`` (``≥ E``).
      dtype: mask dtype.

    Returns:
      ``[..., K]`` mask.
    """
    return proteus_block_mask(
        proteus_active_blocks(t, context_len, num_blocks), key_dim, num_blocks, dtype
    )


def proteus_hidden_mask(t, context_len: int, num_blocks: int, hidden_dim: int, dtype=jnp.float32):
    """Hidden-unit mask of an MLP memory at position ``t`` (SPEC §4); same split as the key mask.

    Args:
      t: 1-based position(s), int or integer array ``[...]``.
      context_len: ``N``.
      num_blocks: ``E``.
      hidden_dim: number of hidden units ``h`` (``≥ E``).
      dtype: mask dtype.

    Returns:
      ``[..., h]`` mask (also the mask of a hidden bias ``b_2 [.., h]``).
    """
    return proteus_block_mask(
        proteus_active_blocks(t, context_len, num_blocks), hidden_dim, num_blocks, dtype
    )


def proteus_mlp_masks(t, context_len: int, num_blocks: int, hidden_dim: int, dtype=jnp.float32):
    """Masks for the two weights of ``M(z) = z + W_1 σ(W_2 z)`` (SPEC §3.2, §4).

    ``W_1 [.., d_out, h]`` is blocked on its columns, ``W_2 [.., h, d_in]`` on its rows.

    Args:
      t: 1-based position(s), int or integer array ``[...]``.
      context_len: ``N``.
      num_blocks: ``E``.
      hidden_dim: ``h``.
      dtype: mask dtype.

    Returns:
      ``(mask_w1 [..., 1, h], mask_w2 [..., h, 1])``, broadcastable against ``W_1`` and ``W_2``.
    """
    m = proteus_hidden_mask(t, context_len, num_blocks, hidden_dim, dtype)
    return m[..., None, :], m[..., :, None]


def proteus_gate(state, mask):
    """Gated read state ``M^{(g)} = g ⊙ M`` (SPEC §4): locked coordinates read as zero.

    Args:
      state: an array or pytree of arrays (e.g. ``S [B, H, K, V]``).
      mask: one mask broadcastable to every leaf (e.g. ``key_mask[..., :, None]``), or a pytree of
        masks with the structure of ``state`` (e.g. the two :func:`proteus_mlp_masks`); ``None``
        = all open (returns ``state``).

    Returns:
      pytree like ``state``; a locked coordinate is ``0`` (``jnp.where``, not a product, so a locked
      ``inf`` does not become ``nan``).
    """
    if mask is None:
        return state
    masks = _mask_tree(state, mask)
    return jax.tree.map(lambda x, m: jnp.where(m != 0, x, jnp.zeros((), x.dtype)), state, masks)


def proteus_gated_update(prev, candidate, mask):
    """Merge a candidate write so that locked coordinates keep their previous bits (SPEC §4).

    ``M_t = where(g_t, M_cand, M_{t-1})``, hence ``(1 − g_t) ⊙ M_t = (1 − g_t) ⊙ M_{t-1}``
    exactly. Apply it to every stored state (memory, momentum, …) after computing the candidate from
    the gated state, so that the write, the decay and the momentum all stay off locked coordinates.

    Args:
      prev: previous state, an array or pytree (e.g. ``(M, S)`` of Titans, each ``[B, H, K, V]``).
      candidate: the ungated next state, same structure, shapes and dtypes.
      mask: one mask broadcastable to every leaf, or a pytree of masks like ``prev``; ``None`` = all
        open (returns ``candidate``).

    Returns:
      the merged state, structured like ``prev``.
    """
    if jax.tree.structure(prev) != jax.tree.structure(candidate):
        raise ValueError(
            "candidate must have the structure of prev: "
            f"{jax.tree.structure(candidate)} vs {jax.tree.structure(prev)}"
        )
    if mask is None:
        return candidate
    masks = _mask_tree(prev, mask)

    def merge(p, c, m):
        if p.shape != c.shape:
            raise ValueError(f"candidate leaf has shape {c.shape}, expected prev's {p.shape}")
        return jnp.where(m != 0, c, p)

    return jax.tree.map(merge, prev, candidate, masks)


def proteus_gated_step(step_fn: Callable[..., tuple[Any, Any]], state, mask, *args, **kwargs):
    """One gated token step: read and write on ``g ⊙ M``, then merge (SPEC §4).

    ``(y, cand) = step_fn(proteus_gate(state, mask), *args, **kwargs)`` followed by
    ``proteus_gated_update(state, cand, mask)``. Any ``*_step(state, ...) -> (out, new_state)``
    (SPEC §0) can be wrapped. The output is whatever ``step_fn`` reads from the gated state: for a
    rule that reads *after* its write (GDN: ``o_t = S_tᵀ q_t``), also gate the query
    (``key_mask ⊙ q_t`` equals reading ``g ⊙ S_t`` for key-row masks).

    ``E = 1``: an all-ones mask gives the backbone's values, but ``where`` changes XLA's fusion, so
    results can differ in the last ulp; pass ``mask=None`` (static) when ``num_blocks == 1`` to run
    ``step_fn`` untouched, which makes ``E = 1`` equal to the backbone bit for bit.

    Args:
      step_fn: ``(state, *args, **kwargs) -> (output, new_state)``.
      state: current state (array or pytree).
      mask: as in :func:`proteus_gated_update`, or ``None`` for no gating (E = 1).
      *args: forwarded to ``step_fn``.
      **kwargs: forwarded to ``step_fn``.

    Returns:
      ``(output, new_state)`` with locked coordinates of ``new_state`` equal to ``state``'s.
    """
    out, cand = step_fn(proteus_gate(state, mask), *args, **kwargs)
    return out, proteus_gated_update(state, cand, mask)


def _mask_tree(tree, mask):
    if isinstance(mask, (jax.Array, np.ndarray, bool, int, float)):
        return jax.tree.map(lambda _: mask, tree)
    treedef = jax.tree.structure(tree)
    try:
        leaves = treedef.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"mask must be one array or a pytree with the structure of the state ({treedef})"
        ) from e
    return jax.tree.unflatten(treedef, leaves)


# --------------------------------------------------------------------------------------------------
# Shared machinery of the Proteus-wrapped memories (associative, titans and hope `proteus.py`):
# validation and static spans.


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_schedule_rule(fn: str, schedule) -> tuple[int, int]:
    """``schedule`` must be a :class:`ProteusRule` (it checks its own fields); returns
    ``(context_len, blocks)`` = ``(N, E)``. ``E = 1`` (off) may leave ``N`` unset (0)."""
    if not isinstance(schedule, ProteusRule):
        raise ValueError(
            f"{fn}: schedule must be a ProteusRule(blocks, context_len), got {schedule!r}"
        )
    return schedule.context_len, schedule.blocks


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
    sees what a separate call with ``t0 = p`` from ``reset_state`` sees, as far as the memory call
    gives a document starting mid-span what it gets alone (a chunked memory whose chunk grid does
    not restart at the document's start does not: Hope off its grid).

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
