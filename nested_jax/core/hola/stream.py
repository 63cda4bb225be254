"""HOLA cache path of one stream (SPEC §5): blocks on absolute positions, continuing a state.

:func:`cache_blocks` is the cache half of ``hola_forward`` without ``segment_ids``: a ``lax.scan``
over blocks ``[nC, (n+1)C)`` of absolute positions carrying the persistent cache ``A``; block
``n``'s queries read ``[A_{n−1} ‖ block (causal) ‖ sink]`` (:mod:`nested_jax.core.hola.cache`),
then ``A_n = top-w(A_{n−1} ∪ block n)``. With ``read`` it runs in two phases (the merges, then
one read of every block). Packed rows are :mod:`nested_jax.core.hola.packed`. Shapes:
heads-major ``[B, H, N, D]`` inside the scans; ``C`` block size, ``w`` window; f32.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from nested_jax.core.hola.cache import _block_read, merge_order, merge_top_w
from nested_jax.core.scan import zeros_typed

__all__ = ["cache_blocks"]

_F32 = jnp.float32


def cache_blocks(q, k, v, scores, params, state0, *, lead, rule, cache_scale, read=None):
    """Cache path of one stream over blocks (SPEC §5).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; scores: ``[B, T, H]`` fixed insertion scores
        (zeros for ``cumulative_attention``, positions for ``recency``).
      params: ``HolaReadParams`` (``γ_q, γ_k``, the sink logit; the gate is not read here).
      state0: the ``HolaState`` continued (its cache, block buffer and ``pos``).
      lead: whether ``state0`` is a given state (its block buffer fills the first slots) rather
        than the empty one.
      rule: ``HolaRule`` (``window``, ``block_size``, ``eviction``, ``read_norm``).
      cache_scale: the cache logit scale (resolved: a float).
      read: optional every-block read (below).

    Returns ``(o_cache [B,T,H,V], cache 5-tuple, (block_k, block_v, block_score))``. Tokens are laid
    on "slots" aligned to absolute block boundaries: slot ``s`` is position ``pos0 − r + s`` with
    ``r = pos0 % C``. With an initial state (``lead``), slots ``[0, r)`` hold its block buffer (keys
    only; their queries were answered earlier) and the new tokens start at slot ``r``.

    ``read`` (optional; not for ``cumulative_attention``, whose merges need the reads' masses):
    the two-phase form. A scan of merges alone (indices, no reads; scores are fixed at insertion)
    gives every block's cache ``A_{n−1}``; the caches are gathered from ``[initial cache ‖ slots]``
    into one ``[B, H, n, w, ·]`` stack and ``read`` computes every block's read at once, with
    ``cache.read_blocks``'s contract (``ops.hola`` passes the Pallas kernel). The same selections,
    the same values up to the read's rounding; gradients reach the chosen tokens through the gather.
    """
    if read is not None and rule.eviction != "cumulative_attention":
        return _cache_blocks_two_phase(
            q, k, v, scores, params, state0, lead, rule, cache_scale, read
        )
    C = rule.block_size
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
    body = _stream_block_fn(params, rule, cache_scale)
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


def _cache_blocks_two_phase(q, k, v, scores, params, state0, lead, rule, cache_scale, read):
    """:func:`cache_blocks` with ``read``: merges first, then all reads at once (its docstring).

    Candidates of block ``n``'s merge are indexed into the table ``[initial cache (w) ‖ slots
    (n·C)]``: the cache's entry ``i`` by its table index, the block's slot ``j`` by ``w + nC + j``.
    """
    W, C = rule.window, rule.block_size
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
        sel = merge_order(cand[0], cand[1], cand[2], W, rule.eviction)
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
    o = read(qh, kh, vh, (ck, cv, vals), filled, params, rule.read_norm, cache_scale)
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


def _stream_block_fn(params, rule, cache_scale):
    """The scan body of :func:`cache_blocks`: one block ``n`` reads ``[A_{n-1} ‖ block (causal,
    filled slots) ‖ sink]``, then a complete block is merged, ``A_n = top-w(A_{n-1} ∪ block)``."""
    cumulative = rule.eviction == "cumulative_attention"

    def body(cache, xs):
        qb, kb, vb, sb, fb, iq, pb = xs
        ck, cv, cscore, cpos, cval = cache
        o, pc, pb_ = _block_read(
            qb, kb, vb, (ck, cv, cval), fb, params, rule.read_norm, cache_scale
        )
        if cumulative:
            # Only this call's queries add mass; buffer tokens already hold earlier queries' mass.
            wq = iq.astype(_F32)[None, None, :, None]
            cscore = cscore + lax.stop_gradient(jnp.sum(pc * wq, axis=2))
            sb = sb + lax.stop_gradient(jnp.sum(pb_ * wq, axis=2))
        # [C] -> [B, H, C] typed like the block scores (their shardings on an Explicit mesh)
        pos_b = pb + zeros_typed(sb, dtype=jnp.int32)
        val_b = fb | zeros_typed(sb, dtype=bool)
        old = (ck, cv, cscore, cpos, cval)
        merged = merge_top_w(old, (kb, vb, sb, pos_b, val_b), rule.window, rule.eviction)
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
