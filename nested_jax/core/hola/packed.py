"""HOLA cache path of a packed row (SPEC §5 per document, SPEC §0 packed sequences).

Every document keeps its own block grid (counted from its first token) and its own cache (empty at
its start, holding only its tokens), so each document gets exactly the outputs and gradients it
would get alone: :func:`cache_blocks_packed`, whose docstring writes the rule out (derivation in
``hola/README.md`` §5). :func:`doc_starts` gives each token's document start and position. The
read and merge are :mod:`nested_jax.core.hola.cache`'s; one stream is
:mod:`nested_jax.core.hola.stream`. Shapes: heads-major ``[B, H, N, D]`` inside the scan; f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.hola.cache import merge_top_w, read_normalize
from nested_jax.core.scan import cast_like

__all__ = ["doc_starts", "cache_blocks_packed"]

_F32 = jnp.float32
_INT_MAX = jnp.iinfo(jnp.int32).max


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


def cache_blocks_packed(q, k, v, scores, D, p, params, *, rule, cache_scale):
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
      params: ``HolaReadParams`` (``γ_q, γ_k [H, K]``, the sink logit ``[H]``; the gate is not
        read here).
      rule: ``HolaRule`` (``window``, ``block_size``, ``eviction``, ``read_norm``).
      cache_scale: the cache logit scale (resolved: a float).

    Returns:
      ``(o_cache [B, T, H, V], cache 5-tuple, (block_k, block_v, block_score), pos)``: the cache
      and block buffer (``HolaState`` fields) of each row's last document as if it had run alone,
      and ``pos`` = the length of row 0's last document (``HolaState.pos`` is shared by the
      batch, so the state continues every row's last document only when those lengths agree).
    """
    W, C = rule.window, rule.block_size
    B, T, H, _ = q.shape
    n = -(-T // C)
    xs = _packed_scan_inputs(q, k, v, scores, D, p, C)
    body = _packed_block_fn(params, rule, cache_scale)
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
    if rule.eviction == "cumulative_attention":
        # final masses: block m's come out of step m + 1, the last block's are carried
        s = jnp.concatenate([s_prev[1:], s_last[None]], axis=0)
        scores = jnp.transpose(s, (1, 0, 3, 2)).reshape(B, n * C, H)[:, :T]
    return (o, *_last_document_state(k, v, scores, D, p, cache, rule))


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


def _packed_block_fn(params, rule, cs):
    """The scan body of :func:`cache_blocks_packed` (one row block; see its docstring)."""
    W, C, eviction, read_norm = rule.window, rule.block_size, rule.eviction, rule.read_norm
    gamma_q, gamma_k, sink = params.gamma_q, params.gamma_k, params.sink_logit
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


def _last_document_state(k, v, scores, D, p, cache, rule):
    """Cache and block buffer of each row's last document as if it had run alone.

    The carried cache holds that document's ``A`` as of its last boundary before ``T`` (or an
    earlier document's: then empty). If the document ends on a block boundary (``L_d ≡ 0 mod C``)
    its last block ``[T − C, T)`` is merged now, as the unpacked scan does; otherwise the buffer
    holds its last ``L_d mod C`` tokens in slots ``0..``.
    """
    W, C = rule.window, rule.block_size
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
        merged = merge_top_w(own, blk, W, rule.eviction)
        own = _select_rows(r == 0, merged, own)
    idx = T - r[:, None] + slot[None]
    keep = (slot[None] < r[:, None])[:, None]  # [B, 1, C]
    buf = (
        jnp.where(keep[..., None], gather(kf, idx), 0.0),
        jnp.where(keep[..., None], gather(vf, idx), 0.0),
        jnp.where(keep, gather(sf, idx), 0.0),
    )
    return own, buf, L_d[0].astype(jnp.int32)
