"""Pallas TPU kernels of the chunked Titans matrix memory, forward and backward (SPEC §2 with
``L_M = 1``; the chunk rule of ``nested_jax.core.titans.chunk``).

One grid step is one chunk of ``C`` tokens of one (batch, head) row; the grid is
``(B·H "parallel", N "arbitrary")`` so the chunks of a row run in order on one core and the
``[K, V]`` states live in f32 VMEM scratch between them. Per chunk, with the chunk-start memory
``M⁰`` and momentum ``S⁰`` (packed rows: also the anchor ``Wᵃ`` and the reset state
``(Mⁱ, Sⁱ)``), :func:`chunk_math` computes::

    E   = K W − V                       (errors at each token's anchor W: M⁰, or with packed rows
                                         Wᵃ / W_r / Mⁱ, see below)
    θ̃_j = θ_j · c·tanh(n_j/c)/n_j       (grad_clip = c; n_j = ‖k_j‖‖e_j‖; θ̃ = θ without it)
    U   = diag(θ̃) E
    O   = Σ_m diag(r_m) Q m − (D_read ⊙ Q Kᵀ) U                   (dual-form reads)
    M¹  = Σ_m w_m m − (K ⊙ d_fin)ᵀ U,   S¹ = Σ_m s_m m − (K ⊙ p_fin)ᵀ U

``m`` runs over ``(M⁰, S⁰)`` (plus ``(Mⁱ, Sⁱ)`` with packed rows). The gate coefficients (``r_m``
per token, ``D_read [C, C]``, the final-row coefficients ``w_m, s_m`` and rows ``d_fin, p_fin``)
are the cumulative products of ``core.titans.chunk.chunk_coefficients`` with resets folded into the
gates, computed outside the kernel by ``ops._coefficient_tables`` (exact products, no division)
and read here as lane-dense rows ``[len(scalar_names), C]`` plus ``D_read`` per chunk.

Packed rows (``segment_ids``; every document keeps its own chunk grid, as the core does): a token
past a reset in this chunk takes its error at ``Mⁱ``; a token at or after a document-local chunk
start at offset ``r > 0`` (``mid``) at ``W_r = Σ_m x_m m − (K ⊙ d_r)ᵀ diag(θ̃ᵃ) Eᵃ`` (the state
after the chunk's first ``r`` tokens, whose errors ``Eᵃ`` are at ``Wᵃ``); the others at ``Wᵃ``
(``M⁰`` where a document-local chunk starts with this chunk, ``b0``). The next anchor is ``Mⁱ``
after a reset here, else ``W_r``, else ``Wᵃ``.

The backward kernel walks the grid with the chunks reversed and ``(∂L/∂M, ∂L/∂S[, ∂L/∂Wᵃ])`` of
the next chunk's start in VMEM; each chunk is the ``jax.vjp`` of the same :func:`chunk_math` at
the chunk-start states the forward saved (``save_states``), so one function defines both
directions. ``grad_horizon`` zeroes the carried cotangents entering a chunk that starts at a
positive multiple of it (the core's ``stop_gradient`` of the carry).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nested_jax.core.dgd import softclamp_factor
from pallas_kernels.common import chunk_specs, chunked_pallas_call

__all__ = ["scalar_names", "chunk_math", "titans_linear_fwd_call", "titans_linear_bwd_call"]

_F32 = jnp.float32
_NN = (((1,), (0,)), ((), ()))  # A @ B
_NT = (((1,), (1,)), ((), ()))  # A @ Bᵀ
_TN = (((0,), (0,)), ((), ()))  # Aᵀ @ B

_PLAIN = ("M0", "S0")
_PACKED = ("M0", "S0", "Mi", "Si")


def _mats(packed: bool) -> tuple[str, ...]:
    return _PACKED if packed else _PLAIN


def scalar_names(packed: bool) -> tuple[str, ...]:
    """Rows of the per-chunk scalar block ``[len, C]``.

    Per token (lanes = tokens): ``theta``; ``r_<m>`` read coefficient of state ``m``; ``d_fin``,
    ``p_fin`` the final row of ``D`` and ``P^η``; packed: ``d_r`` (row ``r`` of ``D``), ``after``
    (past a reset), ``mid`` (at or after the local chunk start ``r``, before any reset). Per
    chunk (the value repeated on every lane): ``w_<m>``, ``s_<m>`` the final coefficients of ``m``
    in ``M`` and ``S``; packed: ``x_<m>`` (in ``W_r``), ``has_r``, ``has_i``, ``b0``.
    """
    mats = _mats(packed)
    names = ["theta", *(f"r_{m}" for m in mats), "d_fin", "p_fin"]
    names += [f"w_{m}" for m in mats] + [f"s_{m}" for m in mats]
    if packed:
        names += ["d_r", "after", "mid", *(f"x_{m}" for m in mats), "has_r", "has_i", "b0"]
    return tuple(names)


def _dot(a, b, dims=_NN):
    """f32 product at full precision (HIGHEST), whatever ``jax_default_matmul_precision`` says."""
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=_F32)


def chunk_math(q, k, v, sc, dread, states, *, packed: bool, grad_clip):
    """One chunk of one (batch, head) row (module docstring), pure ``jnp``.

    Args:
      q, k: ``[C, K]``; v: ``[C, V]`` (any float dtype; computed in f32).
      sc: ``[len(scalar_names(packed)), C]`` f32; dread: ``[C, C]`` f32 (``D_read``).
      states: ``(M⁰, S⁰)`` or, packed, ``(M⁰, S⁰, Wᵃ, Mⁱ, Sⁱ)``, each ``[K, V]`` f32.
      packed: segment_ids are present; grad_clip: softclamp ``c`` or None.

    Returns:
      ``(o [C, V], M¹, S¹)`` f32, plus the next anchor ``Wᵃ`` when packed.
    """
    C = q.shape[0]
    names = scalar_names(packed)
    ii = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    jj = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    diag = ii == jj
    lane0 = lax.broadcasted_iota(jnp.int32, (1, C), 1) == 0
    row = {n: sc[i : i + 1, :] for i, n in enumerate(names)}

    def col(n):  # [1, C] → [C, 1] without a transpose: one nonzero term per row
        return jnp.sum(jnp.where(diag, row[n], 0.0), axis=1, keepdims=True)

    def one(n):  # the chunk scalar on lane 0, as [1, 1]
        return jnp.sum(jnp.where(lane0, row[n], 0.0), axis=1, keepdims=True)

    qf, kf, vf = (x.astype(_F32) for x in (q, k, v))
    if packed:
        M0, S0, Wa, Mi, Si = states
        st = {"M0": M0, "S0": S0, "Mi": Mi, "Si": Si}
        anchor = jnp.where(one("b0") > 0, M0, Wa)
    else:
        M0, S0 = states
        st = {"M0": M0, "S0": S0}
        anchor = M0
    theta = col("theta")
    ksq = jnp.sum(kf * kf, axis=1, keepdims=True)

    def rate(E):  # θ̃ = θ · softclamp(‖k‖²‖e‖²) (the core's order of the product)
        if not grad_clip:
            return theta
        return theta * softclamp_factor(ksq * jnp.sum(E * E, axis=1, keepdims=True), grad_clip)

    E = _dot(kf, anchor) - vf
    th = rate(E)
    if packed:
        Wr = -_dot(kf * (col("d_r") * th), E, _TN)
        for m, s in st.items():
            Wr = Wr + one(f"x_{m}") * s
        Er = _dot(kf, Wr) - vf
        Ei = _dot(kf, st["Mi"]) - vf
        E = jnp.where(col("after") > 0, Ei, jnp.where(col("mid") > 0, Er, E))
        th = rate(E)
    U = th * E
    o = -_dot(dread * _dot(qf, kf, _NT), U)
    M1 = -_dot(kf * col("d_fin"), U, _TN)
    S1 = -_dot(kf * col("p_fin"), U, _TN)
    for m, s in st.items():
        o = o + col(f"r_{m}") * _dot(qf, s)
        M1 = M1 + one(f"w_{m}") * s
        S1 = S1 + one(f"s_{m}") * s
    if not packed:
        return o, M1, S1
    Wa1 = jnp.where(one("has_i") > 0, st["Mi"], jnp.where(one("has_r") > 0, Wr, anchor))
    return o, M1, S1, Wa1


def _n_carried(packed):
    return 3 if packed else 2  # (M, S[, Wᵃ])


def _fwd_kernel(*refs, packed, grad_clip, save):
    """Refs: ``q, k [C, K]``, ``v [C, V]``, ``sc``, ``dread``, ``m0, s0 [K, V]`` (packed:
    ``mi, si``); outputs ``o [C, V]``, ``m_fin, s_fin`` (saved: the chunk-start ``M, S[, Wᵃ]``);
    scratch: the carried ``M, S[, Wᵃ]``."""
    nc = _n_carried(packed)
    q_ref, k_ref, v_ref, sc_ref, dread_ref, m0_ref, s0_ref, *rest = refs
    if packed:
        mi_ref, si_ref, *rest = rest
    o_ref, mfin_ref, sfin_ref, *rest = rest
    saved = rest[:nc] if save else []
    scr = rest[-nc:]
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        scr[0][...] = m0_ref[...].astype(_F32)
        scr[1][...] = s0_ref[...].astype(_F32)
        if packed:
            scr[2][...] = m0_ref[...].astype(_F32)  # the first anchor is the initial memory

    carried = [r[...] for r in scr]
    for ref, x in zip(saved, carried, strict=False):  # nothing saved without save_states
        ref[...] = x
    states = tuple(carried) + ((mi_ref[...], si_ref[...]) if packed else ())
    o, *nxt = chunk_math(
        q_ref[...], k_ref[...], v_ref[...], sc_ref[...], dread_ref[...], states,
        packed=packed, grad_clip=grad_clip,
    )  # fmt: skip
    o_ref[...] = o.astype(o_ref.dtype)
    for ref, x in zip(scr, nxt, strict=True):
        ref[...] = x

    @pl.when(n == pl.num_programs(1) - 1)
    def _():
        mfin_ref[...] = nxt[0]
        sfin_ref[...] = nxt[1]


def _bwd_kernel(*refs, packed, grad_clip, chunk, horizon):
    """Reverse of one chunk: ``jax.vjp`` of :func:`chunk_math` at the saved chunk-start states.

    Refs: ``q, k, v, sc, dread``, the saved ``M, S[, Wᵃ]``, (packed: ``mi, si``), ``do [C, V]``,
    ``dm_fin, ds_fin``; outputs ``dq, dk, dv, dsc, ddread`` (f32), ``dm0, ds0`` (packed: ``dmi,
    dsi``); scratch: the carried cotangents (``dM, dS[, dWᵃ]``) and, packed, ``∂L/∂(Mⁱ, Sⁱ)`` so
    far."""
    nc = _n_carried(packed)
    q_ref, k_ref, v_ref, sc_ref, dread_ref, *rest = refs
    saved, rest = rest[:nc], rest[nc:]
    if packed:
        mi_ref, si_ref, *rest = rest
    do_ref, dmfin_ref, dsfin_ref, *rest = rest
    dq_ref, dk_ref, dv_ref, dsc_ref, ddread_ref, dm0_ref, ds0_ref, *rest = rest
    if packed:
        dmi_ref, dsi_ref, *rest = rest
    g_scr, acc_scr = rest[:nc], rest[nc:]
    n = pl.program_id(1)
    last = pl.num_programs(1) - 1

    @pl.when(n == 0)
    def _():
        g_scr[0][...] = dmfin_ref[...]
        g_scr[1][...] = dsfin_ref[...]
        for r in list(g_scr[2:]) + list(acc_scr):
            r[...] = jnp.zeros(r.shape, _F32)

    fixed = (mi_ref[...], si_ref[...]) if packed else ()

    def fwd(q, k, v, sc, dread, *states):
        return chunk_math(q, k, v, sc, dread, states, packed=packed, grad_clip=grad_clip)

    primals = (
        q_ref[...].astype(_F32), k_ref[...].astype(_F32), v_ref[...].astype(_F32), sc_ref[...],
        dread_ref[...], *(r[...] for r in saved), *fixed,
    )  # fmt: skip
    _, vjp = jax.vjp(fwd, *primals)
    grads = vjp((do_ref[...].astype(_F32), *(r[...] for r in g_scr)))
    dq, dk, dv, dsc, ddread, *dstates = grads
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv
    dsc_ref[...] = dsc
    ddread_ref[...] = ddread
    carried = dstates[:nc]
    if horizon:  # the forward chunk index is last − n; cut the carry at positive multiples
        c = last - n
        cut = jnp.logical_and(lax.rem(c * chunk, horizon) == 0, c > 0)
        carried = [jnp.where(cut, jnp.zeros_like(g), g) for g in carried]
    for ref, g in zip(g_scr, carried, strict=True):
        ref[...] = g
    if packed:
        acc_scr[0][...] = acc_scr[0][...] + dstates[nc]
        acc_scr[1][...] = acc_scr[1][...] + dstates[nc + 1]

    @pl.when(n == last)
    def _():
        # the first chunk's anchor is the initial memory itself
        dm0_ref[...] = carried[0] + (carried[2] if packed else 0.0)
        ds0_ref[...] = carried[1]
        if packed:
            dmi_ref[...] = acc_scr[0][...]
            dsi_ref[...] = acc_scr[1][...]


def _per_chunk(ns, chunk):
    """The per-chunk inputs: the ``ns`` scalar rows and the ``[C, C]`` read coefficients."""
    return {"scalars": (ns, chunk), "dread": (chunk, chunk)}


def titans_linear_fwd_call(
    q, k, v, sc, dread, m0, s0, reset=None, *, chunk, grad_clip, interpret, save_states=False
):
    """The forward ``pallas_call``.

    Args:
      q, k: ``[BH, Tp, K]``; v: ``[BH, Tp, V]`` (``Tp`` a multiple of ``chunk``).
      sc: ``[BH, N, len(scalar_names(packed)), chunk]`` f32; dread: ``[BH, N, chunk, chunk]`` f32.
      m0, s0: ``[BH, K, V]`` f32 initial memory and momentum.
      reset: None, or ``(mi, si)`` ``[BH, K, V]`` f32 the reset state (packed rows).
      chunk: ``C``; grad_clip: softclamp or None; interpret: the Pallas interpreter;
      save_states: also return the chunk-start ``M, S[, Wᵃ]`` (the backward's residuals).

    Returns:
      ``(o [BH, Tp, V] in v's dtype, m_fin, s_fin [BH, K, V] f32)``, plus the saved states
      ``[BH, N, K, V]`` f32 (2, or 3 when packed) when ``save_states``.
    """
    packed = reset is not None
    BH, Tp, K = q.shape
    V = v.shape[-1]
    N = Tp // chunk
    nc = _n_carried(packed)
    sp = chunk_specs(N, chunk, K, V, False, _per_chunk(sc.shape[2], chunk))
    in_specs = [sp["tok"](K), sp["tok"](K), sp["tok"](V), sp["scalars"], sp["dread"]]
    in_specs += [sp["state"]] * (4 if packed else 2)
    out_specs = [sp["tok"](V), sp["state"], sp["state"]] + [sp["states"]] * (nc * save_states)
    out_shape = [((BH, Tp, V), v.dtype), ((BH, K, V), _F32), ((BH, K, V), _F32)]
    out_shape += [((BH, N, K, V), _F32)] * (nc * save_states)
    kernel = functools.partial(_fwd_kernel, packed=packed, grad_clip=grad_clip, save=save_states)
    scratch = [pltpu.VMEM((K, V), _F32)] * nc
    args = (q, k, v, sc, dread, m0, s0, *(reset or ()))
    return chunked_pallas_call(
        kernel, (BH, N), in_specs, out_specs, out_shape, scratch, interpret, "titans_linear_fwd",
        *args, flops=BH * N * chunk_math_flops(chunk, K, V),
    )  # fmt: skip


def titans_linear_bwd_call(
    q, k, v, sc, dread, states, reset, do, dm_fin, ds_fin, *, chunk, grad_clip, horizon, interpret
):
    """The backward ``pallas_call``: the chunks in reverse order, cotangents of the carried
    states in VMEM.

    Args:
      q, k, v, sc, dread, reset, chunk, grad_clip, interpret: as in ``titans_linear_fwd_call``.
      states: the saved chunk-start states (``M, S[, Wᵃ]``, each ``[BH, N, K, V]`` f32).
      do: ``[BH, Tp, V]`` output cotangent; dm_fin, ds_fin: ``[BH, K, V]`` f32 final-state
        cotangents.
      horizon: ``grad_horizon`` in tokens (0 = off; a multiple of ``chunk``).

    Returns:
      ``(dq, dk [BH, Tp, K], dv [BH, Tp, V], dsc, ddread, dm0, ds0)`` f32 (packed: then ``dmi,
      dsi``).
    """
    packed = reset is not None
    BH, Tp, K = q.shape
    V = v.shape[-1]
    N = Tp // chunk
    nc = _n_carried(packed)
    ns = sc.shape[2]
    sp = chunk_specs(N, chunk, K, V, True, _per_chunk(ns, chunk))
    tok = sp["tok"]
    in_specs = [tok(K), tok(K), tok(V), sp["scalars"], sp["dread"]] + [sp["states"]] * nc
    in_specs += [sp["state"]] * (2 if packed else 0) + [tok(V), sp["state"], sp["state"]]
    out_specs = [tok(K), tok(K), tok(V), sp["scalars"], sp["dread"]]
    out_specs += [sp["state"]] * (4 if packed else 2)
    out_shape = [
        ((BH, Tp, K), _F32),
        ((BH, Tp, K), _F32),
        ((BH, Tp, V), _F32),
        ((BH, N, ns, chunk), _F32),
        ((BH, N, chunk, chunk), _F32),
    ] + [((BH, K, V), _F32)] * (4 if packed else 2)
    kernel = functools.partial(
        _bwd_kernel, packed=packed, grad_clip=grad_clip, chunk=chunk, horizon=horizon
    )
    scratch = [pltpu.VMEM((K, V), _F32)] * (nc + (2 if packed else 0))
    args = (q, k, v, sc, dread, *states, *(reset or ()), do, dm_fin, ds_fin)
    # each chunk: the forward chunk_math again, then its VJP (about twice its products)
    return chunked_pallas_call(
        kernel, (BH, N), in_specs, out_specs, out_shape, scratch, interpret, "titans_linear_bwd",
        *args, flops=3 * BH * N * chunk_math_flops(chunk, K, V),
    )  # fmt: skip


def chunk_math_flops(C: int, K: int, V: int) -> float:
    """Matmul FLOPs of one :func:`chunk_math` without packed rows (multiply-add = 2): the errors
    ``K W`` 2CKV, the reads ``Q m`` of both states 4CKV and ``(D ⊙ Q Kᵀ) U`` 2C²(K+V), the two
    state updates ``(K ⊙ d)ᵀ U`` 4CKV."""
    return float(10 * C * K * V + 2 * C * C * (K + V))
