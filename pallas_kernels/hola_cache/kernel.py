"""Pallas TPU kernels of HOLA's cache read (SPEC §5), forward and backward.

One grid step reads one tile of ``bq`` queries of block ``n`` of one (batch, head) row; the
grid is ``(B·H, n blocks, C/bq tiles)``. The caches ``A_{n−1}`` of all blocks are inputs (computed
before by a scan of merges, ``core.hola.stream.cache_blocks(read=)``), so blocks are independent:
the forward grid is parallel on all three axes. Per tile, :func:`tile_read` computes::

    q̃ = N_q(q),  k̃ = N_k(k),  c̃ = N_k(c_k)                     (read_normalize, per row)
    L_c = cs · q̃ c̃ᵀ  [bq, w]   (−∞ where the entry is invalid)
    L_b = cs · q̃ k̃ᵀ  [bq, C]   (−∞ unless slot j ≤ query slot t and slot j is filled)
    m   = max(L_c, L_b, s_h)    (row max, not differentiated)
    o   = (e^{L_c − m} c_v + e^{L_b − m} v) / (Σ e^{L_c − m} + Σ e^{L_b − m} + e^{s_h − m})

the softmax over ``[A_{n−1} ‖ block (causal, filled) ‖ sink]`` with the sink's value zero. The
backward kernel is the ``jax.vjp`` of the same :func:`tile_read` per tile (the forward
recomputed, nothing saved but the inputs): the query tile's gradient is its own block, the block's
keys and values, the cache entries and the parameters accumulate over the tiles of a block (the
tile axis is "arbitrary").

Layouts (heads-major, ``BH = B·H``; ``C`` and ``w`` padded to multiples of 8 by ``ops.py``):
``q, k [BH, n·C, K]``, ``v [BH, n·C, V]``, ``ck [BH, n·w, K]``, ``cv [BH, n·w, V]``, the cache
validity ``cmask [BH, n, 1, w]`` and the filled slots ``fmask [n, 1, C]`` as f32 0/1 rows, and the
parameters ``par [BH, 3, K]``: rows ``γ_q``, ``γ_k`` and the sink logit (on every lane).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import chunked_pallas_call

__all__ = ["tile_read", "hola_cache_fwd_call", "hola_cache_bwd_call"]

_F32 = jnp.float32
_EPS = 1e-6  # as core.hola.cache.read_normalize
_NT = (((1,), (1,)), ((), ()))  # A @ Bᵀ
_NN = (((1,), (0,)), ((), ()))  # A @ B


def _dot(a, b, dims=_NN):
    """f32 product at full precision (HIGHEST), whatever ``jax_default_matmul_precision`` says."""
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=_F32)


def _normalize(x, gamma, read_norm):
    """``x [N, D]``, ``gamma [1, D]``: ``core.hola.cache.read_normalize`` of one row block."""
    if read_norm == "l2":
        return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + _EPS)
    return x * lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + _EPS) * gamma


def tile_read(q, k, v, ck, cv, cmask, fmask, par, q0, *, read_norm, cache_scale):
    """One query tile's cache read (module docstring), pure ``jnp``.

    Args:
      q: ``[bq, K]`` the tile's queries, at block slots ``q0 … q0 + bq − 1``.
      k: ``[C, K]``, v: ``[C, V]`` the block's slots; ck: ``[w, K]``, cv: ``[w, V]`` ``A_{n−1}``.
      cmask: ``[1, w]``, fmask: ``[1, C]`` f32 (1 = valid entry / filled slot).
      par: ``[3, K]`` f32 (``γ_q``, ``γ_k``, the sink logit on every lane).
      q0: the tile's first slot (int scalar); read_norm, cache_scale: the rule's.

    Returns:
      ``o [bq, V]`` f32.
    """
    bq, C, w = q.shape[0], k.shape[0], ck.shape[0]
    gq, gk = par[0:1, :], par[1:2, :]
    lane0 = lax.broadcasted_iota(jnp.int32, (1, par.shape[1]), 1) == 0
    sink = jnp.sum(jnp.where(lane0, par[2:3, :], 0.0), axis=1, keepdims=True)  # [1, 1]
    qn = _normalize(q.astype(_F32), gq, read_norm)
    kn = _normalize(k.astype(_F32), gk, read_norm)
    cn = _normalize(ck.astype(_F32), gk, read_norm)
    lc = _dot(qn, cn, _NT) * cache_scale
    lb = _dot(qn, kn, _NT) * cache_scale
    rows = q0 + lax.broadcasted_iota(jnp.int32, (bq, C), 0)
    cols = lax.broadcasted_iota(jnp.int32, (bq, C), 1)
    lb = jnp.where((cols <= rows) & (fmask > 0), lb, -jnp.inf)
    lc = jnp.where(jnp.broadcast_to(cmask > 0, (bq, w)), lc, -jnp.inf)
    m = jnp.maximum(jnp.max(lc, axis=1, keepdims=True), jnp.max(lb, axis=1, keepdims=True))
    m = lax.stop_gradient(jnp.maximum(m, sink))  # finite: the sink is always there
    pc = jnp.exp(lc - m)
    pb = jnp.exp(lb - m)
    den = jnp.sum(pc, axis=1, keepdims=True) + jnp.sum(pb, axis=1, keepdims=True)
    den = den + jnp.exp(sink - m)
    return (_dot(pc, cv.astype(_F32)) + _dot(pb, v.astype(_F32))) / den


def _specs(n_q, bq, C, w, K):
    """Block specs over the grid ``(BH, n, n_q)``."""
    sq = pl.Squeezed()
    return {
        "q_tile": lambda D: pl.BlockSpec((sq, bq, D), lambda h, n, j: (h, n * n_q + j, 0)),
        "block": lambda D: pl.BlockSpec((sq, C, D), lambda h, n, j: (h, n, 0)),
        "cache": lambda D: pl.BlockSpec((sq, w, D), lambda h, n, j: (h, n, 0)),
        "cmask": pl.BlockSpec((sq, sq, 1, w), lambda h, n, j: (h, n, 0, 0)),
        "fmask": pl.BlockSpec((sq, 1, C), lambda h, n, j: (n, 0, 0)),
        "par": pl.BlockSpec((sq, 3, K), lambda h, n, j: (h, 0, 0)),
        "dpar": pl.BlockSpec((sq, sq, 3, K), lambda h, n, j: (h, n, 0, 0)),
    }


def _fwd_kernel(q_ref, k_ref, v_ref, ck_ref, cv_ref, cm_ref, fm_ref, par_ref, o_ref, *, bq, **kw):
    q0 = pl.program_id(2) * bq
    o = tile_read(
        q_ref[...], k_ref[...], v_ref[...], ck_ref[...], cv_ref[...], cm_ref[...], fm_ref[...],
        par_ref[...], q0, **kw,
    )  # fmt: skip
    o_ref[...] = o.astype(o_ref.dtype)


def _bwd_kernel(q_ref, k_ref, v_ref, ck_ref, cv_ref, cm_ref, fm_ref, par_ref, do_ref,
                dq_ref, dk_ref, dv_ref, dck_ref, dcv_ref, dpar_ref, *, bq, **kw):  # fmt: skip
    """The ``jax.vjp`` of :func:`tile_read`; the block's ``dk, dv``, the cache's ``dck, dcv`` and
    ``dpar`` stay in VMEM over the block's tiles (same block index) and accumulate."""
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _():
        for r in (dk_ref, dv_ref, dck_ref, dcv_ref, dpar_ref):
            r[...] = jnp.zeros(r.shape, _F32)

    cm, fm = cm_ref[...], fm_ref[...]

    def fwd(q, k, v, ck, cv, par):
        return tile_read(q, k, v, ck, cv, cm, fm, par, j * bq, **kw)

    primals = tuple(r[...].astype(_F32) for r in (q_ref, k_ref, v_ref, ck_ref, cv_ref, par_ref))
    _, vjp = jax.vjp(fwd, *primals)
    dq, dk, dv, dck, dcv, dpar = vjp(do_ref[...].astype(_F32))
    dq_ref[...] = dq
    dk_ref[...] += dk
    dv_ref[...] += dv
    dck_ref[...] += dck
    dcv_ref[...] += dcv
    dpar_ref[...] += dpar


def _layout(q, v, cmask, block, bq):
    """Sizes, block specs and the input specs both calls share: ``(BH, L, K, V, n, w, n_q, specs,
    in_specs)`` for the inputs ``q, k, v, ck, cv, cmask, fmask, par``."""
    BH, L, K = q.shape
    V = v.shape[-1]
    n, w = cmask.shape[1], cmask.shape[3]
    n_q = block // bq
    sp = _specs(n_q, bq, block, w, K)
    in_specs = [sp["q_tile"](K), sp["block"](K), sp["block"](V), sp["cache"](K), sp["cache"](V),
                sp["cmask"], sp["fmask"], sp["par"]]  # fmt: skip
    return BH, L, K, V, n, w, n_q, sp, in_specs


def hola_cache_fwd_call(
    q, k, v, ck, cv, cmask, fmask, par, *, block, bq, read_norm, cache_scale, interpret
):
    """The forward ``pallas_call``.

    Args:
      q, k: ``[BH, n·C, K]``; v: ``[BH, n·C, V]``; ck: ``[BH, n·w, K]``; cv: ``[BH, n·w, V]``;
      cmask: ``[BH, n, 1, w]`` f32; fmask: ``[n, 1, C]`` f32; par: ``[BH, 3, K]`` f32.
      block: ``C``; bq: queries per grid step (divides ``C``; both multiples of 8);
      read_norm, cache_scale: the rule's; interpret: the Pallas interpreter.

    Returns:
      ``o [BH, n·C, V]`` f32.
    """
    BH, L, K, V, n, w, n_q, sp, in_specs = _layout(q, v, cmask, block, bq)
    kernel = functools.partial(_fwd_kernel, bq=bq, read_norm=read_norm, cache_scale=cache_scale)
    flops, exps = read_cost(BH * L, block, w, K, V)
    return chunked_pallas_call(
        kernel, (BH, n, n_q), in_specs, [sp["q_tile"](V)], [((BH, L, V), _F32)], (), interpret,
        "hola_cache_fwd", q, k, v, ck, cv, cmask, fmask, par,
        semantics=("parallel", "parallel", "parallel"), flops=flops, transcendentals=exps,
    )[0]  # fmt: skip


def hola_cache_bwd_call(
    q, k, v, ck, cv, cmask, fmask, par, do, *, block, bq, read_norm, cache_scale, interpret
):
    """The backward ``pallas_call`` (inputs as :func:`hola_cache_fwd_call`, ``do [BH, n·C, V]``).

    Returns:
      ``(dq, dk [BH, n·C, K], dv [BH, n·C, V], dck [BH, n·w, K], dcv [BH, n·w, V],
      dpar [BH, n, 3, K])`` f32 (``dpar`` per block; the caller sums over ``n``).
    """
    BH, L, K, V, n, w, n_q, sp, in_specs = _layout(q, v, cmask, block, bq)
    in_specs = [*in_specs, sp["q_tile"](V)]  # dO, tiled like the queries
    out_specs = [sp["q_tile"](K), sp["block"](K), sp["block"](V), sp["cache"](K), sp["cache"](V),
                 sp["dpar"]]  # fmt: skip
    out_shape = [((BH, L, K), _F32), ((BH, L, K), _F32), ((BH, L, V), _F32),
                 ((BH, n * w, K), _F32), ((BH, n * w, V), _F32), ((BH, n, 3, K), _F32)]  # fmt: skip
    kernel = functools.partial(_bwd_kernel, bq=bq, read_norm=read_norm, cache_scale=cache_scale)
    flops, exps = read_cost(BH * L, block, w, K, V)
    # per tile: the read again, then its VJP (about twice its products)
    return chunked_pallas_call(
        kernel, (BH, n, n_q), in_specs, out_specs, out_shape, (), interpret, "hola_cache_bwd",
        q, k, v, ck, cv, cmask, fmask, par, do, semantics=("parallel", "parallel", "arbitrary"),
        flops=3 * flops, transcendentals=exps,
    )  # fmt: skip


def read_cost(queries: int, C: int, w: int, K: int, V: int) -> tuple[float, float]:
    """``(matmul FLOPs, exponentials)`` of :func:`tile_read` over ``queries`` queries: the logits
    against the ``w`` cache entries and the ``C`` block slots, ``2(w + C)K`` each, and the
    weighted values ``2(w + C)V``; one exponential per logit."""
    return float(queries * 2 * (w + C) * (K + V)), float(queries * (w + C))
