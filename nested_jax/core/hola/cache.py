"""HOLA cache read and merge (SPEC §5): the softmax read and the top-w merge.

The block scans that use them are in :mod:`nested_jax.core.hola.stream` (one stream, blocks on
absolute positions) and :mod:`nested_jax.core.hola.packed` (packed rows, one block grid and one
cache per document); the decode step (:mod:`nested_jax.core.hola.decode`) uses them token by
token. Shapes: heads-major ``[B, H, N, D]``; ``C`` block size, ``w`` window. Everything here is
f32.

- :func:`read_normalize`, :func:`attend`, :func:`attend_parts`:
  ``o = Σ_{j∈V} softmax_j(cache_scale · q̃ᵀ k̃_j) v_j`` over ``[cache ‖ block ‖ sink]``.
- :func:`merge_top_w`, :func:`merge_order`: ``A_n = top-w(A_{n−1} ∪ block n)``, ties → earlier.
- :func:`read_blocks`: every block's read at once, the contract of ``stream.cache_blocks(read=)``
  (``ops.hola`` passes the Pallas kernel of ``pallas_kernels/hola_cache`` instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.scan import zeros_typed

__all__ = [
    "read_normalize",
    "attend",
    "attend_parts",
    "merge_top_w",
    "merge_order",
    "read_blocks",
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
    o, (p_cache, p_block) = attend_parts(
        qn, ((ck_n, cv, c_mask[:, :, None, :]), (bk_n, bv, b_mask)), sink, cache_scale
    )
    return o, p_cache, p_block


def attend_parts(qn, parts, sink, cache_scale):
    """One softmax read over ``[part_1 ‖ … ‖ part_m ‖ sink]``, taken in its parts.

    ``qn [B,H,Q,K]``; each part is ``(k_n [B,H,J,K], v [B,H,J,V], mask)`` with ``mask`` bool,
    broadcastable to ``[B,H,Q,J]`` (False: not read); ``sink [H]``. Returns
    ``(o [B,H,Q,V], probabilities [B,H,Q,J] per part)``.
    """
    logits = [
        jnp.where(mask, jnp.einsum("bhqk,bhjk->bhqj", qn, k_n) * cache_scale, -jnp.inf)
        for k_n, _, mask in parts
    ]
    # typed like the logits (sharded like them on an Explicit mesh), to combine with them
    ls = sink.astype(_F32)[None, :, None, None] + zeros_typed(logits[0][..., :1])
    # No concatenated [Q, ΣJ + 1] logits and no slices of them, forward or backward (faster:
    # docs/RESULTS.md, "Timings behind constants of the core"). The sink column is always present,
    # so no row is fully masked (no NaN); the shift m is a constant of the softmax (its gradient
    # cancels), held fixed.
    m = ls
    for lp in logits:
        m = jnp.maximum(m, jnp.max(lp, axis=-1, keepdims=True))
    m = lax.stop_gradient(m)
    exps = [jnp.exp(lp - m) for lp in logits]
    z = jnp.exp(ls - m) + sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
    o = sum(jnp.einsum("bhqj,bhjv->bhqv", e, v) for e, (_, v, _) in zip(exps, parts, strict=True))
    return o / z, [e / z for e in exps]


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
# Every block's read at once
# --------------------------------------------------------------------------------------------------


def _block_read(qb, kb, vb, cache, fb, params, read_norm, cache_scale):
    """One block's read over ``[A_{n−1} ‖ block slots ≤ t that are filled ‖ sink]``
    (:func:`attend` after :func:`read_normalize`): ``qb, kb [B, H, C, K]``, ``vb [B, H, C, V]``,
    ``cache = (ck [B, H, w, K], cv [B, H, w, V], cval bool [B, H, w])``, ``fb bool [C]``;
    ``params``: a ``HolaReadParams`` (``γ_q, γ_k``, the sink logit). Returns :func:`attend`'s
    ``(o, p_cache, p_block)``."""
    ck, cv, cval = cache
    B, H, C = qb.shape[:3]
    b_mask = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool)) & fb[None, :], (B, H, C, C))
    return attend(
        read_normalize(qb, params.gamma_q, read_norm),
        read_normalize(ck, params.gamma_k, read_norm), cv, cval,
        read_normalize(kb, params.gamma_k, read_norm), vb, b_mask, params.sink_logit, cache_scale,
    )  # fmt: skip


def _block_read_split(qb, kb, vb, cache, fb, params, read_norm, cache_scale):
    """:func:`_block_read`'s output ``o`` alone, with the block's causal square in halves.

    The queries of the first half read the first half of the block (causal); those of the second
    half read the first half whole and the second half causally. Three of the four ``[C/2, C/2]``
    squares of the block's logits are computed instead of the whole ``[C, C]`` (half of which is
    masked); the same softmax (:func:`attend_parts`). Faster forward and backward on XLA:CPU
    (docs/RESULTS.md, "Timings behind constants of the core"). ``C`` even.
    """
    ck, cv, cval = cache
    c = qb.shape[2] // 2
    qn = read_normalize(qb, params.gamma_q, read_norm)
    kn = read_normalize(kb, params.gamma_k, read_norm)
    cache_part = (read_normalize(ck, params.gamma_k, read_norm), cv, cval[:, :, None, :])
    causal = jnp.tril(jnp.ones((c, c), bool))
    first, second = slice(0, c), slice(c, 2 * c)
    whole = lambda half: (kn[:, :, half], vb[:, :, half], fb[half][None, None, None, :])  # noqa: E731
    diagonal = lambda half: (kn[:, :, half], vb[:, :, half], causal & fb[half][None, :])  # noqa: E731
    sink = params.sink_logit
    o_first, _ = attend_parts(qn[:, :, first], (cache_part, diagonal(first)), sink, cache_scale)
    o_second, _ = attend_parts(
        qn[:, :, second], (cache_part, whole(first), diagonal(second)), sink, cache_scale
    )
    return jnp.concatenate([o_first, o_second], axis=2)


def read_blocks(qh, kh, vh, cache, filled, params, read_norm, cache_scale):
    """Every block's cache read at once (SPEC §5), the contract of ``cache_blocks(read=)``.

    Block ``n`` holds the slots ``[nC, (n+1)C)``; its query at slot ``t`` reads
    ``[A_{n−1} ‖ block slots ≤ t that are filled ‖ sink]`` (:func:`attend`; an even ``C`` in the
    halves of :func:`_block_read_split`).

    Args:
      qh, kh: ``[B, H, L, K]``; vh: ``[B, H, L, V]`` f32 slots (``L = n·C``).
      cache: ``(ck [B, H, n, w, K], cv [B, H, n, w, V], cval bool [B, H, n, w])``, every
        block's ``A_{n−1}``.
      filled: ``bool [n, C]``.
      params: ``HolaReadParams``: ``gamma_q, gamma_k [H, K]``, ``sink_logit [H]`` (the gate is
        not read here).
      read_norm, cache_scale: the read normalisation and the logit scale.

    Returns:
      ``o [B, H, L, V]`` f32.
    """
    B, H, L, K = qh.shape
    n, C = filled.shape

    def one(q, k, v, blk_cache, fb):
        if C % 2 == 0:
            return _block_read_split(q, k, v, blk_cache, fb, params, read_norm, cache_scale)
        return _block_read(q, k, v, blk_cache, fb, params, read_norm, cache_scale)[0]

    blocks = lambda x: x.reshape(B, H, n, C, x.shape[-1])  # noqa: E731
    o = jax.vmap(one, in_axes=(2, 2, 2, 2, 0), out_axes=2)(
        blocks(qh), blocks(kh), blocks(vh), cache, filled
    )
    return o.reshape(B, H, L, -1)
