"""HOLA cache path (SPEC §5): the softmax read, the top-w merge and the block scans.

The scores and the block-parallel forward are in :mod:`nested_jax.core.hola.forward`; the state,
the decode step and the per-token form in :mod:`nested_jax.core.hola.decode`.
Shapes: heads-major ``[B, H, N, D]`` inside the scans; ``C`` block size, ``w`` window.
Everything here is f32.

Two block scans:

- :func:`cache_blocks` — one stream, blocks aligned to absolute positions ``[nC, (n+1)C)``,
  continuing an optional state (``hola_forward`` without ``segment_ids``).
- :func:`cache_blocks_packed` — a packed row (SPEC §0 packed sequences): every document keeps its
  own block grid and its own cache, so each document gets exactly the outputs (and gradients) it
  would get alone. The rule is written out in its docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.scan import cast_like, zeros_typed

__all__ = [
    "read_normalize",
    "attend",
    "merge_top_w",
    "merge_order",
    "read_blocks",
    "cache_blocks",
    "doc_starts",
    "cache_blocks_packed",
]

_EPS = 1e-6
_F32 = jnp.float32
_INT_MAX = jnp.iinfo(jnp.int32).max


# --------------------------------------------------------------------------------------------------
# Cache read and merge (shared by the forward, the packed forward and the decode step)
# --------------------------------------------------------------------------------------------------


def read_normalize(x, gamma, read_norm):
    """``x [B, H, N, D]``, ``gamma [H, D]``."""
    if read_norm == "l2":
        return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _EPS)
    y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + _EPS)
    return y * gamma.astype(_F32)[None, :, None, :]


def attend(qn, ck_n, cv, c_mask, bk_n, bv, b_mask, sink, cache_scale):
    """Softmax read over ``[cache ‖ block ‖ sink]``.

    ``qn [B,H,Q,K]``; ``ck_n [B,H,w,K]``, ``cv [B,H,w,V]``, ``c_mask [B,H,w]``; ``bk_n [B,H,C,K]``,
    ``bv [B,H,C,V]``, ``b_mask [B,H,Q,C]`` (causal × filled); ``sink [H]``.
    Returns ``(o [B,H,Q,V], p_cache [B,H,Q,w], p_block [B,H,Q,C])``.
    """
    w = ck_n.shape[2]
    lc = jnp.einsum("bhqk,bhjk->bhqj", qn, ck_n) * cache_scale
    lb = jnp.einsum("bhqk,bhjk->bhqj", qn, bk_n) * cache_scale
    lc = jnp.where(c_mask[:, :, None, :], lc, -jnp.inf)
    lb = jnp.where(b_mask, lb, -jnp.inf)
    # typed like the logits (sharded like them on an Explicit mesh): concatenate needs one type
    ls = sink.astype(_F32)[None, :, None, None] + zeros_typed(lc[..., :1])
    # The sink column is always present, so no row is fully masked (no NaN).
    p = jax.nn.softmax(jnp.concatenate([lc, lb, ls], axis=-1), axis=-1)
    pc, pb = p[..., :w], p[..., w:-1]
    o = jnp.einsum("bhqj,bhjv->bhqv", pc, cv) + jnp.einsum("bhqj,bhjv->bhqv", pb, bv)
    return o, pc, pb


def _signless_zero(x):
    """``x`` with −0.0 replaced by +0.0, so a float sort does not split ties by sign. ``lax.top_k``
    compares in the total order (−0.0 < +0.0; ``lax.sort``'s comparator already equates them), and
    ``x + 0.0`` is no fix under ``jit``: XLA's simplifier drops the addition (measured)."""
    return jnp.where(x == 0, 0.0, x)


def merge_top_w(cache, blk, window, eviction):
    """Top-``window`` of ``cache ∪ block`` (SPEC §5); each is ``(k, v, score, pos, valid)``, entries
    on axis 2 (``cache`` ``w`` entries, ``blk`` the block's ``C``).

    Order key: score descending (``recency``: position descending), then position ascending; invalid
    entries last. The ``window`` entries come out in that order (the *selection order*), invalid
    ones zeroed (``pos = −1``). Selection is not differentiated; the gathers pass gradients to the
    chosen k, v.

    Without a full sort (every eviction but ``cumulative_attention``): one ``lax.top_k`` of the
    ``w + C`` primary keys (score, or position for ``recency``; invalid → −∞). ``top_k`` breaks
    ties by the lower index and returns keys descending, ties by index. This equals the 2-key order
    because of an invariant of every caller (the forward, the packed forward, the decode step):

    - the cache is stored in selection order (it is a previous output of this function): among its
      valid entries, equal scores stand in position-ascending order;
    - the block's entries stand in position order, and every block position follows every cache
      position (the cache holds earlier blocks only);
    - the scores are fixed at insertion, so the stored order of the cache is still its order now.

    Hence, among equal keys, lower index ⇔ earlier position, SPEC §5's tie rule, and top_k's
    output order is the selection order. −0.0 is mapped to +0.0 first (``top_k`` compares floats
    in the total order, where −0.0 < +0.0; see :func:`_signless_zero`). Valid scores are never −∞
    (magnitudes ≥ 0), so invalid entries (−∞) come last; among invalid entries the choice is
    immaterial (they are zeroed). ``recency`` keys are the positions relative to the largest valid
    one, ``p − max p`` in f32: distinct and exact while a merge's valid positions lie within
    ``2²⁴`` of each other (they lie within ``w + C``); f32 ``top_k`` is also faster than int32 on
    XLA:CPU. ``cumulative_attention`` breaks the invariant (cache scores grow after insertion, so
    equal current masses need not stand in position order): it keeps the exact 2-key ``lax.sort``
    of all ``w + C`` candidates.
    """
    k, v, s, p, val = (jnp.concatenate([a, b], axis=2) for a, b in zip(cache, blk, strict=True))
    sel = merge_order(s, p, val, window, eviction)
    take = lambda x: jnp.take_along_axis(x, sel, axis=2)  # noqa: E731
    take_d = lambda x: jnp.take_along_axis(x, sel[..., None], axis=2)  # noqa: E731
    nval = take(val)
    return (
        jnp.where(nval[..., None], take_d(k), 0.0),
        jnp.where(nval[..., None], take_d(v), 0.0),
        jnp.where(nval, take(s), 0.0),
        jnp.where(nval, take(p), -1),
        nval,
    )


def merge_order(s, p, val, window, eviction):
    """The indices ``[..., window]`` of the candidates :func:`merge_top_w` keeps, in selection
    order.

    ``s, p, val [..., w + C]``: scores, positions and validity of ``cache ‖ block`` (the cache
    first, in selection order; the block in position order). ``lax.top_k`` except for
    ``cumulative_attention`` (the 2-key sort); :func:`merge_top_w` states why this is exact.
    """
    if eviction == "cumulative_attention":
        primary = jnp.where(val, -_signless_zero(lax.stop_gradient(s)), jnp.inf)
        secondary = jnp.where(val, p, _INT_MAX)
        idx = lax.broadcasted_iota(jnp.int32, val.shape, val.ndim - 1)
        idx = idx + zeros_typed(p, dtype=jnp.int32)
        _, _, order = lax.sort((primary, secondary, idx), dimension=-1, num_keys=2)
        return order[..., :window]
    if eviction == "recency":
        top = jnp.max(jnp.where(val, p, 0), axis=-1, keepdims=True)
        key = (p - top).astype(_F32)
    else:
        key = _signless_zero(lax.stop_gradient(s))
    return lax.top_k(jnp.where(val, key, -jnp.inf), window)[1]


# --------------------------------------------------------------------------------------------------
# One stream: blocks on absolute positions, continuing a state
# --------------------------------------------------------------------------------------------------


def cache_blocks(
    q, k, v, scores, gamma_q, gamma_k, sink, state0, lead, W, C, eviction, read_norm, cs, read=None
):
    """Cache path over blocks.

    Returns ``(o_cache [B,T,H,V], cache 5-tuple, (block_k, block_v, block_score))``. Tokens are laid
    on "slots" aligned to absolute block boundaries: slot ``s`` is position ``pos0 − r + s`` with
    ``r = pos0 % C``. With an initial state (``lead``), slots ``[0, r)`` hold its block buffer (keys
    only; their queries were answered earlier) and the new tokens start at slot ``r``.

    ``read`` (optional; not for ``cumulative_attention``, whose merges need the reads' masses):
    the two-phase form. A scan of merges alone (indices, no reads; scores are fixed at insertion)
    gives every block's cache ``A_{n−1}``; the caches are gathered from ``[initial cache ‖ slots]``
    into one ``[B, H, n, w, ·]`` stack and ``read`` computes every block's read at once, with
    :func:`read_blocks`'s contract (``ops.hola`` passes the Pallas kernel). The same selections,
    the same values up to the read's rounding; gradients reach the chosen tokens through the gather.
    """
    if read is not None and eviction != "cumulative_attention":
        return _cache_blocks_two_phase(
            q, k, v, scores, gamma_q, gamma_k, sink, state0, lead, W, C, eviction, read_norm, cs,
            read,
        )  # fmt: skip
    B, T, H, K = q.shape
    V = v.shape[-1]
    pos0 = state0.pos
    r, n_blocks = _slot_grid(pos0, lead, T, C)
    L = n_blocks * C

    buf = (state0.block_k, state0.block_v, state0.block_score) if lead else (None, None, None)
    qs = _to_blocks(q, None, r, n_blocks, C)
    ks = _to_blocks(k, buf[0], r, n_blocks, C)
    vs = _to_blocks(v, buf[1], r, n_blocks, C)
    ss = _to_blocks(lax.stop_gradient(scores), buf[2], r, n_blocks, C)
    filled, is_query, abs_pos = _slot_flags(pos0, r, T, n_blocks, C)
    body = _stream_block_fn(gamma_q, gamma_k, sink, W, C, eviction, read_norm, cs)
    cache, (o_blocks, s_blocks) = lax.scan(
        body, _cache0(state0), (qs, ks, vs, ss, filled, is_query, abs_pos)
    )
    # [n, B, H, C, V] -> [B, L, H, V] -> the T query slots.
    o = jnp.moveaxis(o_blocks, 0, 1).transpose(0, 1, 3, 2, 4).reshape(B, L, H, V)
    o = lax.dynamic_slice_in_dim(o, r, T, axis=1)
    return o, cache, _unfinished_block(ks, vs, s_blocks, r + T, n_blocks, C)


def _slot_grid(pos0, lead, T, C):
    """``(r, n_blocks)``: the first new token's slot and the number of blocks of the slots."""
    if lead:
        return pos0 % C, -(-(C + T) // C)
    return jnp.zeros((), jnp.int32), -(-T // C)


def _slot_flags(pos0, r, T, n_blocks, C):
    """``(filled, is_query, abs_pos)``, each ``[n, C]``: a slot holds a token (buffer or new), a
    new token (a query of this call), and its absolute position."""
    slot = jnp.arange(n_blocks * C, dtype=jnp.int32)
    filled = (slot < r + T).reshape(n_blocks, C)
    is_query = ((slot >= r) & (slot < r + T)).reshape(n_blocks, C)
    abs_pos = (pos0 - r + slot).reshape(n_blocks, C)
    return filled, is_query, abs_pos


def _cache0(state0):
    """The state's cache 5-tuple, k, v and scores in f32."""
    return (
        state0.cache_k.astype(_F32),
        state0.cache_v.astype(_F32),
        state0.cache_score.astype(_F32),
        state0.cache_pos,
        state0.cache_valid,
    )


def _cache_blocks_two_phase(
    q, k, v, scores, gamma_q, gamma_k, sink, state0, lead, W, C, eviction, read_norm, cs, read
):
    """:func:`cache_blocks` with ``read``: merges first, then all reads at once (its docstring).

    Candidates of block ``n``'s merge are indexed into the table ``[initial cache (w) ‖ slots
    (n·C)]``: the cache's entry ``i`` by its table index, the block's slot ``j`` by ``w + nC + j``.
    """
    B, T, H, K = q.shape
    pos0 = state0.pos
    r, n_blocks = _slot_grid(pos0, lead, T, C)
    L = n_blocks * C
    buf = (state0.block_k, state0.block_v, state0.block_score) if lead else (None, None, None)
    qh = _to_slots(q, None, r, L, C)  # [B, H, L, ·]
    kh = _to_slots(k, buf[0], r, L, C)
    vh = _to_slots(v, buf[1], r, L, C)
    ss = _to_blocks(lax.stop_gradient(scores), buf[2], r, n_blocks, C)  # [n, B, H, C]
    filled, _, abs_pos = _slot_flags(pos0, r, T, n_blocks, C)
    ck0, cv0, cs0, cp0, cval0 = _cache0(state0)
    src0 = jnp.arange(W, dtype=jnp.int32) + zeros_typed(cp0, dtype=jnp.int32)

    def body(carry, xs):
        c_s, c_p, c_val, c_src = carry
        sb, fb, pb, n = xs
        blk_p = pb + zeros_typed(sb, dtype=jnp.int32)
        blk_val = fb | zeros_typed(sb, dtype=bool)
        blk_src = W + n * C + jnp.arange(C, dtype=jnp.int32) + zeros_typed(sb, dtype=jnp.int32)
        cand = [jnp.concatenate(x, axis=2) for x in
                ((c_s, sb), (c_p, blk_p), (c_val, blk_val), (c_src, blk_src))]  # fmt: skip
        sel = merge_order(cand[0], cand[1], cand[2], W, eviction)
        n_s, n_p, n_val, n_src = (jnp.take_along_axis(x, sel, axis=2) for x in cand)
        merged = (jnp.where(n_val, n_s, 0.0), jnp.where(n_val, n_p, -1), n_val, n_src)
        new = tuple(jnp.where(fb[-1], m, o_) for m, o_ in zip(merged, carry, strict=True))
        return new, (c_src, c_val)

    steps = jnp.arange(n_blocks, dtype=jnp.int32)
    (c_s, c_p, c_val, c_src), (srcs, vals) = lax.scan(
        body, (cs0, cp0, cval0, src0), (ss, filled, abs_pos, steps)
    )
    table_k = jnp.concatenate([ck0, kh], axis=2)  # [B, H, w + L, K]
    table_v = jnp.concatenate([cv0, vh], axis=2)
    srcs = jnp.moveaxis(srcs, 0, 2)  # [B, H, n, w]
    vals = jnp.moveaxis(vals, 0, 2)
    ck = _gather_entries(table_k, srcs, vals)  # [B, H, n, w, K]: A_{n−1} of every block
    cv = _gather_entries(table_v, srcs, vals)
    o = read(qh, kh, vh, ck, cv, vals, filled, gamma_q, gamma_k, sink, read_norm, cs)
    o = lax.dynamic_slice_in_dim(jnp.swapaxes(o, 1, 2), r, T, axis=1)  # [B, T, H, V]
    cache = (
        _gather_entries(table_k, c_src, c_val),
        _gather_entries(table_v, c_src, c_val),
        c_s,
        c_p,
        c_val,
    )
    blocks = lambda x: jnp.moveaxis(x.reshape(B, H, n_blocks, C, -1), 2, 0)  # noqa: E731
    return o, cache, _unfinished_block(blocks(kh), blocks(vh), ss, r + T, n_blocks, C)


def _gather_entries(table, src, valid):
    """``table [B, H, N, D]`` rows at ``src [B, H, ...]`` (zero where not ``valid``):
    ``[B, H, ..., D]``."""
    B, H = src.shape[:2]
    flat = src.reshape(B, H, -1, 1)
    x = jnp.take_along_axis(table, flat, axis=2).reshape(src.shape + table.shape[3:])
    return jnp.where(valid[..., None], x, 0.0)


def _block_read(qb, kb, vb, ck, cv, cval, fb, gamma_q, gamma_k, sink, read_norm, cs):
    """One block's read over ``[A_{n−1} ‖ block slots ≤ t that are filled ‖ sink]``
    (:func:`attend` after :func:`read_normalize`): ``qb, kb [B, H, C, K]``, ``vb [B, H, C, V]``,
    the cache ``ck [B, H, w, K]``, ``cv [B, H, w, V]``, ``cval [B, H, w]``, ``fb bool [C]``.
    Returns :func:`attend`'s ``(o, p_cache, p_block)``."""
    B, H, C = qb.shape[:3]
    b_mask = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool)) & fb[None, :], (B, H, C, C))
    return attend(
        read_normalize(qb, gamma_q, read_norm), read_normalize(ck, gamma_k, read_norm), cv, cval,
        read_normalize(kb, gamma_k, read_norm), vb, b_mask, sink, cs,
    )  # fmt: skip


def read_blocks(qh, kh, vh, ck, cv, cval, filled, gamma_q, gamma_k, sink, read_norm, cs):
    """Every block's cache read at once (SPEC §5), the contract of ``cache_blocks(read=)``.

    Block ``n`` holds the slots ``[nC, (n+1)C)``; its query at slot ``t`` reads
    ``[A_{n−1} ‖ block slots ≤ t that are filled ‖ sink]`` (:func:`attend`).

    Args:
      qh, kh: ``[B, H, L, K]``; vh: ``[B, H, L, V]`` f32 slots (``L = n·C``).
      ck: ``[B, H, n, w, K]``; cv: ``[B, H, n, w, V]``; cval: ``bool [B, H, n, w]`` (``A_{n−1}``).
      filled: ``bool [n, C]``; gamma_q, gamma_k: ``[H, K]``; sink: ``[H]``.
      read_norm, cs: the read normalisation and the logit scale.

    Returns:
      ``o [B, H, L, V]`` f32.
    """
    B, H, L, K = qh.shape
    n, C = filled.shape

    def one(q, k, v, c_k, c_v, c_val, fb):
        read = _block_read(q, k, v, c_k, c_v, c_val, fb, gamma_q, gamma_k, sink, read_norm, cs)
        return read[0]

    blocks = lambda x: x.reshape(B, H, n, C, x.shape[-1])  # noqa: E731
    o = jax.vmap(one, in_axes=(2, 2, 2, 2, 2, 2, 0), out_axes=2)(
        blocks(qh), blocks(kh), blocks(vh), ck, cv, cval, filled
    )
    return o.reshape(B, H, L, -1)


def _to_slots(x, buf, r, L, C):
    """``x [B, T, H, ...]`` on the slots ``[r, r + T)`` of ``L`` (slots ``[0, C)`` first filled
    from the buffer ``buf [B, H, C, ...]`` unless None; the rest zero), heads-major f32
    ``[B, H, L, ...]``."""
    B = x.shape[0]
    # typed like x (its batch / head shardings on an Explicit mesh) so the update below matches
    out = zeros_typed(x[:, :1], (B, L) + x.shape[2:], _F32)
    if buf is not None:
        out = out.at[:, :C].set(jnp.moveaxis(buf.astype(_F32), 2, 1))
    start = (jnp.zeros((), jnp.int32), r) + (jnp.zeros((), jnp.int32),) * (x.ndim - 2)
    return jnp.moveaxis(lax.dynamic_update_slice(out, x.astype(_F32), start), 1, 2)


def _to_blocks(x, buf, r, n_blocks, C):
    """``x [B, T, H, ...]`` on the slots ``[r, r + T)`` of ``n_blocks · C`` (slots ``[0, C)``
    first filled from the buffer ``buf [B, H, C, ...]`` unless None; the rest zero), as f32
    blocks ``[n, B, H, C, ...]``."""
    x = _to_slots(x, buf, r, n_blocks * C, C)
    x = x.reshape(x.shape[:2] + (n_blocks, C) + x.shape[3:])
    return jnp.moveaxis(x, 2, 0)


def _stream_block_fn(gamma_q, gamma_k, sink, W, C, eviction, read_norm, cs):
    """The scan body of :func:`cache_blocks`: one block ``n`` reads ``[A_{n-1} ‖ block (causal,
    filled slots) ‖ sink]``, then a complete block is merged, ``A_n = top-w(A_{n-1} ∪ block)``."""
    cumulative = eviction == "cumulative_attention"

    def body(cache, xs):
        qb, kb, vb, sb, fb, iq, pb = xs
        ck, cv, cscore, cpos, cval = cache
        o, pc, pb_ = _block_read(
            qb, kb, vb, ck, cv, cval, fb, gamma_q, gamma_k, sink, read_norm, cs
        )  # fmt: skip
        if cumulative:
            # Only this call's queries add mass; buffer tokens already hold earlier queries' mass.
            wq = iq.astype(_F32)[None, None, :, None]
            cscore = cscore + lax.stop_gradient(jnp.sum(pc * wq, axis=2))
            sb = sb + lax.stop_gradient(jnp.sum(pb_ * wq, axis=2))
        # [C] -> [B, H, C] typed like the block scores (their shardings on an Explicit mesh)
        pos_b = pb + zeros_typed(sb, dtype=jnp.int32)
        val_b = fb | zeros_typed(sb, dtype=bool)
        old = (ck, cv, cscore, cpos, cval)
        merged = merge_top_w(old, (kb, vb, sb, pos_b, val_b), W, eviction)
        complete = fb[-1]  # a block is merged only once all of its C positions have been seen
        new = tuple(jnp.where(complete, m, o_) for m, o_ in zip(merged, old, strict=True))
        return new, (o, sb)

    return body


def _unfinished_block(ks, vs, s_blocks, end, n_blocks, C):
    """The block buffer after slot ``end``: the unfinished last block's keys, values and final
    scores (empty when ``end`` is a multiple of ``C``), ``[B, H, C, ...]``."""
    last = jnp.minimum(end // C, n_blocks - 1)
    n_fill = end % C
    keep = jnp.arange(C) < n_fill
    bk = jnp.where(keep[None, None, :, None], ks[last], 0.0)
    bv = jnp.where(keep[None, None, :, None], vs[last], 0.0)
    bs = jnp.where(keep[None, None, :], s_blocks[last], 0.0)
    return bk, bv, bs


# --------------------------------------------------------------------------------------------------
# Packed rows: every document keeps its own block grid and its own cache
# --------------------------------------------------------------------------------------------------


def doc_starts(segment_ids):
    """``(D, p)``, both ``int32 [B, T]``: the row index where each token's document starts and the
    token's position inside its document (``t = D_t + p_t``). A document starts at ``t = 0`` and at
    every ``t`` with ``segment_ids[:, t] != segment_ids[:, t − 1]`` (SPEC §0)."""
    B, T = segment_ids.shape
    t = jnp.arange(T, dtype=jnp.int32)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    start = jnp.concatenate([jnp.ones((B, 1), bool), change], axis=1)
    D = lax.cummax(jnp.where(start, t[None, :], 0), axis=1)
    return D, t[None, :] - D


def _masked_logits(qn, kn, mask, cache_scale):
    """``qn [B,H,Q,K]``, ``kn [B,H,N,K]``, ``mask`` broadcastable to ``[B,H,Q,N]``."""
    logits = jnp.einsum("bhqk,bhjk->bhqj", qn, kn) * cache_scale
    return jnp.where(mask, logits, -jnp.inf)


def _softmax_groups(logits, sink):
    """One softmax over the concatenated key groups ``logits`` (each ``[B,H,Q,N_i]``) and the sink
    column; returns the groups' probabilities (the sink's is dropped). The sink is always present,
    so no row is fully masked (no NaN)."""
    ls = jnp.broadcast_to(sink.astype(_F32)[None, :, None, None], logits[0].shape[:3] + (1,))
    p = jax.nn.softmax(jnp.concatenate([*logits, ls], axis=-1), axis=-1)
    out, i = [], 0
    for lg in logits:
        out.append(p[..., i : i + lg.shape[-1]])
        i += lg.shape[-1]
    return out


def cache_blocks_packed(
    q, k, v, scores, D, p, gamma_q, gamma_k, sink, W, C, eviction, read_norm, cs
):
    """Cache path of a packed row (SPEC §5 per document, SPEC §0 packed sequences).

    Document ``d`` starts at row index ``D``; its token at row index ``t`` has document position
    ``p_t = t − D``, document block ``⌊p_t/C⌋`` and block start ``s_t = D + C⌊p_t/C⌋``. The query
    at ``t`` reads exactly what it would read if its document ran alone::

        V_t = A_d(s_t) ∪ {j : D_j = D_t, s_t ≤ j ≤ t} ∪ {sink}
        A_d(s) = top-w by score over {j : D_j = D_t, j < s}, merged block by block
                 (A_d(D + (m+1)C) = top-w(A_d(D + mC) ∪ {D + mC ≤ j < D + (m+1)C}); ties → earlier)

    so an earlier document's entries are never read and never compete for a later document's
    slots, and a document's cache starts empty.

    Implementation: a ``lax.scan`` over row blocks ``[nC, (n+1)C)``. A document block can start
    inside a row block, so the in-block keys of a row block are its own ``C`` tokens and the
    previous row block's (``2C`` keys, masked by ``D_j = D_t`` and ``s_t ≤ j ≤ t``). Every cache
    entry carries the document ``D`` it belongs to. A row block holds at most one document-block
    boundary ``β`` (``p_β > 0``, ``p_β ≡ 0 mod C``: only the document that covers the row block's
    first slot can reach one); there the carried cache ``A_old`` (that document's, or an earlier
    one's: filtered by ``D``) is merged with the document's tokens ``[β − C, β)`` into ``A_new``.
    Queries before ``β`` read ``A_old``, queries from ``β`` on read ``A_new``, both masked by
    ``D``: one softmax over ``[A_old ‖ A_new ‖ previous block ‖ block ‖ sink]``. With
    ``cumulative_attention`` the queries before ``β`` add their attention mass before the merge
    (a first softmax without ``A_new``, equal to theirs) and the others after it.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; scores: ``[B, T, H]`` fixed insertion scores
        (zeros for ``cumulative_attention``; document positions for ``recency``).
      D, p: ``int32 [B, T]`` from :func:`doc_starts`.
      gamma_q, gamma_k: ``[H, K]``; sink: ``[H]``; W, C: window and block size; eviction,
        read_norm: as in ``hola_forward``; cs: cache logit scale.

    Returns:
      ``(o_cache [B, T, H, V], cache 5-tuple, (block_k, block_v, block_score), pos)``: the cache
      and block buffer (``HolaState`` fields) of each row's last document as if it had run alone,
      and ``pos`` = the length of row 0's last document (``HolaState.pos`` is shared by the
      batch, so the state continues every row's last document only when those lengths agree).
    """
    B, T, H, _ = q.shape
    n = -(-T // C)
    xs = _packed_scan_inputs(q, k, v, scores, D, p, C)
    body = _packed_block_fn(gamma_q, gamma_k, sink, W, C, eviction, read_norm, cs)
    cache0 = (
        jnp.zeros((B, H, W) + k.shape[3:], _F32),
        jnp.zeros((B, H, W) + v.shape[3:], _F32),
        jnp.zeros((B, H, W), _F32),
        jnp.full((B, H, W), -1, jnp.int32),
        jnp.zeros((B, H, W), bool),
        jnp.full((B, H, W), -1, jnp.int32),
    )
    # the carry is updated from the inputs' rows: typed like them (jax.shard_map, Explicit meshes)
    rows = k[:, :1].sum(1)[..., 0]  # [B, H]
    carry0 = jax.tree.map(lambda a: cast_like(a, rows), (cache0, jnp.zeros((B, H, C), _F32)))
    (cache, s_last), (o, s_prev) = lax.scan(body, carry0, xs)
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, n * C, H, -1)[:, :T]
    if eviction == "cumulative_attention":
        # final masses: block m's come out of step m + 1, the last block's are carried
        s = jnp.concatenate([s_prev[1:], s_last[None]], axis=0)
        scores = jnp.transpose(s, (1, 0, 3, 2)).reshape(B, n * C, H)[:, :T]
    return (o, *_last_document_state(k, v, scores, D, p, cache, W, C, eviction))


def _packed_scan_inputs(q, k, v, scores, D, p, C):
    """The per-row-block inputs of :func:`cache_blocks_packed`'s scan, ``n = ⌈T/C⌉`` blocks:
    queries ``[n, B, H, C, K]``; keys, values of (previous block ‖ block) ``[n, B, H, 2C, ·]``;
    the block's scores ``[n, B, H, C]``; ``D, p`` of (previous ‖ block) ``[n, B, 2C]``; each
    query's document-block start ``s_t``, its document-block boundary flag and whether it is a real
    token ``[n, B, C]``; the row block's first row index ``[n]``."""
    B, T = D.shape
    n = -(-T // C)
    pad = n * C - T

    def slots(x, fill):  # [B, T, ...] -> [n + 1, B, C, ...]: an empty block in front, padding
        x = jnp.pad(x, [(0, 0), (C, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape((B, n + 1, C) + x.shape[2:]), 1, 0)

    def heads(x):  # [n + 1, B, C, H, ...] -> [n + 1, B, H, C, ...]
        return jnp.swapaxes(x, 2, 3)

    def pairs(x, axis):  # [n + 1, ...] -> [n, ...]: (previous block ‖ block) along axis
        return jnp.concatenate([x[:-1], x[1:]], axis=axis)

    ks = heads(slots(k.astype(_F32), 0.0))
    vs = heads(slots(v.astype(_F32), 0.0))
    return (
        heads(slots(q.astype(_F32), 0.0))[1:],
        pairs(ks, 3),
        pairs(vs, 3),
        heads(slots(lax.stop_gradient(scores).astype(_F32), 0.0))[1:],
        pairs(slots(D, -1), 2),  # padding belongs to no document
        pairs(slots(p, 0), 2),
        slots(D + (p // C) * C, _INT_MAX)[1:],  # s_t of each query (padding reads nothing)
        slots((p > 0) & (p % C == 0), False)[1:],  # document-block boundaries
        slots(jnp.ones((B, T), bool), False)[1:],  # real queries
        jnp.arange(n, dtype=jnp.int32) * C,
    )


def _packed_block_fn(gamma_q, gamma_k, sink, W, C, eviction, read_norm, cs):
    """The scan body of :func:`cache_blocks_packed` (one row block; see its docstring)."""
    cumulative = eviction == "cumulative_attention"
    sg = lax.stop_gradient

    def body(carry, xs):
        (ck, cv, csc, cp, cval, cdoc), s_prev = carry
        qb, kk, vv, s_cur, Dk, pk, s_q, bnd, is_q, row0 = xs
        B, H = qb.shape[:2]
        Dq = Dk[:, C:]
        rows_q = row0 + jnp.arange(C, dtype=jnp.int32)
        rows_k = row0 - C + jnp.arange(2 * C, dtype=jnp.int32)
        has_b = jnp.any(bnd, axis=-1)
        b_idx = jnp.argmax(bnd, axis=-1)
        beta = jnp.where(has_b, row0 + b_idx, _INT_MAX)  # [B]
        D_beta = jnp.where(has_b, jnp.take_along_axis(Dq, b_idx[:, None], 1)[:, 0], -2)
        pre = rows_q[None, :] < beta[:, None]  # [B, C]: reads A_old
        s_tok = jnp.concatenate([s_prev, s_cur], axis=-1)  # [B, H, 2C]

        qn = read_normalize(qb, gamma_q, read_norm)
        m_old = cval[:, :, None, :] & (cdoc[:, :, None, :] == Dq[:, None, :, None])
        m_old = m_old & pre[:, None, :, None]  # [B, H, C, w]: own document, before β
        l_old = _masked_logits(qn, read_normalize(ck, gamma_k, read_norm), m_old, cs)
        m_tok = (
            (Dk[:, None, :] == Dq[:, :, None])
            & (rows_k[None, None, :] >= s_q[:, :, None])
            & (rows_k[None, None, :] <= rows_q[None, :, None])
        )
        l_tok = _masked_logits(qn, read_normalize(kk, gamma_k, read_norm), m_tok[:, None], cs)
        if cumulative:  # the queries before β add their mass before the merge
            p_old, p_tok = _softmax_groups([l_old, l_tok], sink)
            w_pre = (is_q & pre).astype(_F32)[:, None, :, None]
            csc = csc + sg(jnp.sum(p_old * w_pre, axis=2))
            s_tok = s_tok + sg(jnp.sum(p_tok * w_pre, axis=2))

        # A_new = top-w(A_old of β's document ∪ its tokens [β − C, β)); β's document only.
        in_win = (Dk == D_beta[:, None]) & (rows_k[None, :] >= beta[:, None] - C)
        in_win = in_win & (rows_k[None, :] < beta[:, None])
        bh = lambda a: jnp.broadcast_to(a[:, None], (B, H, 2 * C))  # noqa: E731
        cand = (kk, vv, s_tok, bh(pk), bh(in_win))
        old = (ck, cv, csc, cp, cval & (cdoc == D_beta[:, None, None]))
        nk, nv, ns, npos, nval = merge_top_w(old, cand, W, eviction)
        ndoc = jnp.where(nval, D_beta[:, None, None], -1)
        m_new = nval[:, :, None, :] & (ndoc[:, :, None, :] == Dq[:, None, :, None])
        l_new = _masked_logits(
            qn, read_normalize(nk, gamma_k, read_norm), m_new & ~pre[:, None, :, None], cs
        )
        p_old, p_new, p_tok = _softmax_groups([l_old, l_new, l_tok], sink)
        o = sum(
            jnp.einsum("bhqj,bhjv->bhqv", pr, x)
            for pr, x in ((p_old, cv), (p_new, nv), (p_tok, vv))
        )
        if cumulative:  # the queries from β on (A_old is masked for them)
            w_post = (is_q & ~pre).astype(_F32)[:, None, :, None]
            ns = ns + sg(jnp.sum(p_new * w_post, axis=2))
            s_tok = s_tok + sg(jnp.sum(p_tok * w_post, axis=2))

        new = (nk, nv, ns, npos, nval, ndoc)
        cache = _select_rows(has_b, new, (ck, cv, csc, cp, cval, cdoc))
        return (cache, s_tok[..., C:]), (o, s_tok[..., :C])

    return body


def _select_rows(pick, a, b):
    """Per batch row (``pick [B]``), the cache tuple ``a`` or ``b`` (leaves ``[B, H, w, ...]``)."""
    return tuple(
        jnp.where(pick.reshape((-1,) + (1,) * (x.ndim - 1)), x, y)
        for x, y in zip(a, b, strict=True)
    )


def _last_document_state(k, v, scores, D, p, cache, W, C, eviction):
    """Cache and block buffer of each row's last document as if it had run alone.

    The carried cache holds that document's ``A`` as of its last boundary before ``T`` (or an
    earlier document's: then empty). If the document ends on a block boundary (``L_d ≡ 0 mod C``)
    its last block ``[T − C, T)`` is merged now, as the unpacked scan does; otherwise the buffer
    holds its last ``L_d mod C`` tokens in slots ``0..``.
    """
    B, T, H, _ = k.shape
    D_last = D[:, -1]
    L_d = T - D_last  # [B]
    r = L_d % C
    ck, cv, csc, cp, cval, cdoc = cache
    cval = cval & (cdoc == D_last[:, None, None])
    own = (
        jnp.where(cval[..., None], ck, 0.0),
        jnp.where(cval[..., None], cv, 0.0),
        jnp.where(cval, csc, 0.0),
        jnp.where(cval, cp, -1),
        cval,
    )

    def gather(x, idx):  # x [B, T, H, ...], idx [B, C] -> [B, H, C, ...]
        idx = jnp.clip(idx, 0, T - 1).reshape((B, C) + (1,) * (x.ndim - 2))
        return jnp.swapaxes(jnp.take_along_axis(x, idx, axis=1), 1, 2)

    kf, vf, sf = k.astype(_F32), v.astype(_F32), lax.stop_gradient(scores).astype(_F32)
    slot = jnp.arange(C, dtype=jnp.int32)
    if T >= C:  # a last document of length ≥ C may end on a boundary
        idx = jnp.broadcast_to(T - C + slot, (B, C))
        last = jnp.broadcast_to((r == 0)[:, None, None], (B, H, C))
        pos_b = jnp.broadcast_to(jnp.take_along_axis(p, idx, axis=1)[:, None], (B, H, C))
        blk = (gather(kf, idx), gather(vf, idx), gather(sf, idx), pos_b, last)
        merged = merge_top_w(own, blk, W, eviction)
        own = _select_rows(r == 0, merged, own)
    idx = T - r[:, None] + slot[None]
    keep = (slot[None] < r[:, None])[:, None]  # [B, 1, C]
    buf = (
        jnp.where(keep[..., None], gather(kf, idx), 0.0),
        jnp.where(keep[..., None], gather(vf, idx), 0.0),
        jnp.where(keep, gather(sf, idx), 0.0),
    )
    return own, buf, L_d[0].astype(jnp.int32)
