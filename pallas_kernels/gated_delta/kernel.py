"""Pallas TPU kernels of the chunked gated delta rule, forward and backward (SPEC §1; derivation
``nested_jax/core/associative/README.md`` §2, backward §3, resets §4).

One grid step is one chunk of ``C`` tokens of one (batch, head) row; the grid is
``(B·H "parallel", N "arbitrary")`` so the chunks of a row run in order on one core and the
``[K, V]`` state lives in an f32 VMEM scratch between them. Per chunk, with the incoming state
``S``, the restart state ``s0`` and the per-token scalars prepared by ``ops._token_scalars``
(lane-dense ``[len(SCALARS), C]`` per chunk; their columns are formed in the kernel)::

    Γ_ij = e^{b_i − b_j} [j ≤ i] [z_i = z_j]                 (decays on the same-segment mask)
    A    = strict_tril(diag(β) (K Kᵀ) ⊙ Γ)
    T    = (I + A)^{-1}                                     (forward substitution over rows, f32)
    U    = T diag(β) (V − diag(d) K S − diag(d0) K s0)      (= Ũ − W S − W0 s0 of the WY form)
    O    = diag(d) Q S + diag(d0) Q s0 + (Q Kᵀ ⊙ Γ) U
    S'   = d_C S + d0_C s0 + (K ⊙ kdec)ᵀ U

``d`` is the carried state's coefficient per token (``e^{b}``, zero after an in-chunk segment
start), ``d0`` the restart state's (``e^{b}`` from the segment start, zero before it) and
``kdec_j = Γ_{C, j}``. The ``W``/``Ũ`` pair of ``core/wy.py`` is folded into one solve applied to
the state-corrected right-hand side, the same product re-associated
(core/associative/README.md §2, eq. 2).

The backward kernel walks the same grid with the chunks reversed, ``G = ∂L/∂S_{n+1}`` in VMEM, and
recomputes ``Γ, T, U`` of each chunk from the inputs and the chunk-start state the forward saved
(``save_states``): ``dU = Pᵀ dO + (K ⊙ kdec) G``, ``dY = Tᵀ dU``, ``dA = −strict_tril(dY Uᵀ)``,
``∂L/∂S_n = d_C G + (Q ⊙ d)ᵀ dO − (K ⊙ d)ᵀ diag(β) dY``; the cotangents of the per-token
scalars (``b`` through ``Γ``, ``β``, ``d``, ``d0``, ``kdec``) come out per token and ``ops`` maps
them to ``g`` and ``β`` by autodiff of the O(T) preparation.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nested_jax.core.wy import chunk_flops
from pallas_kernels.common import chunk_specs, chunked_pallas_call

__all__ = ["SCALARS", "gated_delta_fwd_call", "gated_delta_bwd_call"]

# Per-token scalars, one row each: [BH, N, len(SCALARS), C], the chunk's tokens on the lanes. (A
# token-major [BH, Tp, 6] layout puts 6 values on the 128 lanes of every tile row: 21× padding
# in HBM, which made the f32 forward need more memory than XLA's.)
SCALARS = ("b", "z", "beta", "d", "d0", "kdec")

_F32 = jnp.float32
_NN = (((1,), (0,)), ((), ()))  # A @ B
_NT = (((1,), (1,)), ((), ()))  # A @ Bᵀ
_TN = (((0,), (0,)), ((), ()))  # Aᵀ @ B


def _dot(a, b, dims=_NN):
    """f32-accumulated product; f32 operands at full precision (HIGHEST), narrower ones as they
    are (their products are exact in f32), whatever ``jax_default_matmul_precision`` says."""
    both_f32 = a.dtype == _F32 and b.dtype == _F32
    precision = lax.Precision.HIGHEST if both_f32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _unit_lower_inverse(A):
    """``(I + A)^{-1}`` of a strictly lower ``A [C, C]`` (f32) by forward substitution over rows,
    ``X_i = e_i − Σ_{j<i} A_ij X_j``: step ``i`` subtracts ``A_i X`` with ``A_i`` row ``i`` of ``A``
    (other rows zero), so rows ``j < i`` are final when row ``i`` is formed. No powers of A."""
    C = A.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    eye = (row == col).astype(_F32)

    def body(i, X):
        return X - _dot(jnp.where(row == i, A, 0.0), X)

    return lax.fori_loop(1, C, body, eye)


def _as_column(row, diagonal):
    """``[1, C] → [C, 1]`` without a transpose: the diagonal of the row broadcast over ``[C, C]``,
    summed over the lanes (exact: one nonzero term per row)."""
    return jnp.sum(jnp.where(diagonal, row, 0.0), axis=1, keepdims=True)


def _as_row(column, diagonal):
    """``[C, 1] → [1, C]``, the inverse of :func:`_as_column` (a sum over the sublanes)."""
    return jnp.sum(jnp.where(diagonal, column, 0.0), axis=0, keepdims=True)


def _chunk(q, k, scalars, scale):
    """The state-free quantities of one chunk shared by both kernels: the per-token columns
    ``{name: [C, 1]}`` (from the rows ``scalars [len(SCALARS), C]``), ``Γ``, ``Q̂Kᵀ`` (scaled),
    ``KKᵀ``, ``A``'s strict mask and ``T = (I + A)^{-1}``."""
    C = q.shape[0]
    ii = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    jj = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    r = {name: scalars[i : i + 1, :] for i, name in enumerate(SCALARS)}
    c = {name: _as_column(row, ii == jj) for name, row in r.items()}
    mask = (jj <= ii) & (c["z"] == r["z"])
    # exponent ≤ 0 on the mask for g ≤ 0; masked entries are an exact zero, never exp(−inf)
    gamma = jnp.where(mask, jnp.exp(jnp.where(mask, c["b"] - r["b"], 0.0)), 0.0)
    kk = _dot(k, k, _NT)  # operands in the input dtype, f32 accumulation
    qk = _dot(q, k, _NT) * scale
    strict = jj < ii
    T = _unit_lower_inverse(jnp.where(strict, c["beta"] * kk * gamma, 0.0))
    return c, gamma, qk, kk, strict, T


def _fwd_kernel(q_ref, k_ref, v_ref, scalars_ref, s0_ref, *refs, scale, restart):
    """One chunk of one (batch, head) row; refs are ``q, k [C, K]``, ``v [C, V]``,
    ``scalars [len(SCALARS), C]``, ``s0 [K, V]``, outputs ``o [C, V]``,
    ``sfin [K, V]`` (and, when saved, ``sn [K, V]`` the state entering the chunk), scratch
    ``s_scr [K, V]`` f32 (the state entering this chunk)."""
    o_ref, sfin_ref, *sn_ref, s_scr = refs
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        s_scr[...] = s0_ref[...].astype(_F32)

    q, k = q_ref[...], k_ref[...]
    C = q.shape[0]
    c, gamma, qk, _, _, T = _chunk(q, k, scalars_ref[...], scale)
    d, d0 = c["d"], c["d0"]

    S = s_scr[...]
    if sn_ref:
        sn_ref[0][...] = S
    qf, kf = q.astype(_F32) * scale, k.astype(_F32)
    rhs = v_ref[...].astype(_F32) - _dot(kf * d, S)
    o = _dot(qf * d, S)
    s_next = d[C - 1 :, :] * S
    if restart:
        s0 = s0_ref[...].astype(_F32)
        rhs = rhs - _dot(kf * d0, s0)
        o = o + _dot(qf * d0, s0)
        s_next = s_next + d0[C - 1 :, :] * s0
    U = _dot(T, c["beta"] * rhs)
    o_ref[...] = (o + _dot(qk * gamma, U)).astype(o_ref.dtype)
    s_next = s_next + _dot(kf * c["kdec"], U, _TN)
    s_scr[...] = s_next

    @pl.when(n == pl.num_programs(1) - 1)
    def _():
        sfin_ref[...] = s_next


def _rowdot(a, b):
    return jnp.sum(a * b, axis=1, keepdims=True)


def _bwd_kernel(
    q_ref, k_ref, v_ref, scalars_ref, s0_ref, sn_ref, do_ref, dsfin_ref,
    dq_ref, dk_ref, dv_ref, dscalars_ref, ds0_ref,
    g_scr, acc0_scr, *, scale, restart,
):  # fmt: skip
    """Reverse of one chunk (core/associative/README.md §3 in this kernel's form). ``sn`` is
    the saved state entering the chunk, ``do [C, V]`` the output cotangent, ``g_scr`` holds
    ``G = ∂L/∂S_{n+1}`` (``dsfin`` at the last chunk) and ``acc0_scr`` the restart state's
    gradient so far. Outputs ``dq, dk [C, K]``, ``dv [C, V]`` f32, ``dscalars [len(SCALARS), C]``
    (cotangents of the per-token scalars; ``ops`` maps them to ``g`` and ``β``) and ``ds0``."""
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        g_scr[...] = dsfin_ref[...]
        acc0_scr[...] = jnp.zeros_like(acc0_scr)

    q, k = q_ref[...], k_ref[...]
    C = q.shape[0]
    c, gamma, qk, kk, strict, T = _chunk(q, k, scalars_ref[...], scale)
    beta, d, d0, kdec = c["beta"], c["d"], c["d0"], c["kdec"]
    last = lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1
    qf, kf = q.astype(_F32) * scale, k.astype(_F32)
    S, G, dO = sn_ref[...], g_scr[...], do_ref[...].astype(_F32)
    states = [(S, d)] + ([(s0_ref[...].astype(_F32), d0)] if restart else [])

    # forward recomputation: R = V − Σ (K ⊙ d) S, U = T diag(β) R
    R = v_ref[...].astype(_F32)
    for St, dt in states:
        R = R - _dot(kf * dt, St)
    U = _dot(T, beta * R)

    P = qk * gamma
    dU = _dot(P, dO, _TN) + _dot(kf * kdec, G)
    dY = _dot(T, dU, _TN)  # Y = diag(β) R, U = T Y
    dR = beta * dY
    dA = jnp.where(strict, -_dot(dY, U, _NT), 0.0)
    dbeta = _rowdot(dY, R) + _rowdot(dA * kk, gamma)
    dkk = dA * beta * gamma
    dP = _dot(dO, U, _NT)
    dqk = dP * gamma
    E = (dP * qk + dA * beta * kk) * gamma  # ∂L/∂b through Γ_ij = e^{b_i − b_j}
    dUG = _dot(U, G, _NT)  # ∂L/∂(K ⊙ kdec)
    dq = _dot(dqk, k)
    dk = _dot(dqk, qf, _TN) + _dot(dkk, k) + _dot(dkk, k, _TN) + dUG * kdec
    dd = []
    dS_prev = []
    for St, dt in states:
        dQd, dKd = _dot(dO, St, _NT), -_dot(dR, St, _NT)
        dq = dq + dQd * dt
        dk = dk + dKd * dt
        tail = jnp.where(last, jnp.sum(St * G), 0.0)  # the state's coefficient at the chunk end
        dd.append(_rowdot(dQd, qf) + _rowdot(dKd, kf) + tail)
        dS_prev.append(dt[C - 1 :, :] * G + _dot(qf * dt, dO, _TN) - _dot(kf * dt, dR, _TN))

    dq_ref[...] = dq * scale
    dk_ref[...] = dk
    dv_ref[...] = dR
    columns = {  # per-token cotangents [C, 1] of the scalars' columns
        "b": jnp.sum(E, axis=1, keepdims=True),
        "beta": dbeta,
        "d": dd[0],
        "d0": dd[1] if restart else None,
        "kdec": _rowdot(dUG, kf),
    }
    diagonal = lax.broadcasted_iota(jnp.int32, (C, C), 0) == lax.broadcasted_iota(
        jnp.int32, (C, C), 1
    )
    rows = {n: _as_row(col, diagonal) for n, col in columns.items() if col is not None}
    rows["b"] = rows["b"] - jnp.sum(E, axis=0, keepdims=True)  # b's row use in Γ (e^{−b_j})
    sub = lax.broadcasted_iota(jnp.int32, (len(SCALARS), C), 0)
    dscalars = jnp.zeros((len(SCALARS), C), _F32)
    for i, name in enumerate(SCALARS):
        if name in rows:
            dscalars = jnp.where(sub == i, rows[name], dscalars)
    dscalars_ref[...] = dscalars

    g_scr[...] = dS_prev[0]
    if restart:
        acc0_scr[...] = acc0_scr[...] + dS_prev[1]

    @pl.when(n == pl.num_programs(1) - 1)
    def _():
        ds0_ref[...] = dS_prev[0] + acc0_scr[...]


def gated_delta_fwd_call(
    q, k, v, scalars, s0, *, chunk, scale, restart, interpret, save_states=False
):
    """The forward ``pallas_call``.

    Args:
      q, k: ``[BH, Tp, K]``; v: ``[BH, Tp, V]`` (``Tp`` a multiple of ``chunk``).
      scalars: ``[BH, N, len(SCALARS), chunk]`` f32 per-token scalars (``ops._token_scalars``).
      s0: ``[BH, K, V]`` f32 initial (and restart) state.
      chunk: ``C``; scale: query scale; restart: whether ``s0`` re-enters at segment starts
        (segment_ids with an initial state); interpret: run the Pallas interpreter;
        save_states: also return the chunk-start states (the backward's residuals).

    Returns:
      ``(o [BH, Tp, V] in v's dtype, final_state [BH, K, V] f32)``, plus
      ``states [BH, N, K, V]`` f32 when ``save_states``.
    """
    BH, Tp, K = q.shape
    V = v.shape[-1]
    N = Tp // chunk
    sp = chunk_specs(N, chunk, K, V, False, {"scalars": (len(SCALARS), chunk)})
    out_specs = [sp["tok"](V), sp["state"]] + ([sp["states"]] if save_states else [])
    out_shape = [((BH, Tp, V), v.dtype), ((BH, K, V), _F32)]
    out_shape += [((BH, N, K, V), _F32)] if save_states else []
    kernel = functools.partial(_fwd_kernel, scale=float(scale), restart=restart)
    in_specs = [sp["tok"](K), sp["tok"](K), sp["tok"](V), sp["scalars"]]
    return chunked_pallas_call(
        kernel, (BH, N), in_specs + [sp["state"]], out_specs, out_shape,
        [pltpu.VMEM((K, V), _F32)], interpret, "gated_delta_fwd", q, k, v, scalars, s0,
        flops=BH * N * chunk_flops(chunk, K, V, backward=False), transcendentals=BH * Tp * chunk,
    )  # fmt: skip


def gated_delta_bwd_call(
    q, k, v, scalars, s0, states, do, dsfin, *, chunk, scale, restart, interpret
):
    """The backward ``pallas_call``: the chunks in reverse order with ``∂L/∂S`` in VMEM.

    Args:
      q, k, v, scalars, s0, chunk, scale, restart, interpret: as in ``gated_delta_fwd_call``.
      states: ``[BH, N, K, V]`` f32 chunk-start states saved by the forward.
      do: ``[BH, Tp, V]`` output cotangent; dsfin: ``[BH, K, V]`` f32 final-state cotangent.

    Returns:
      ``(dq, dk [BH, Tp, K], dv [BH, Tp, V], dscalars [BH, N, len(SCALARS), C],
      ds0 [BH, K, V])``, all f32.
    """
    BH, Tp, K = q.shape
    V = v.shape[-1]
    N = Tp // chunk
    sp = chunk_specs(N, chunk, K, V, True, {"scalars": (len(SCALARS), chunk)})
    tok = sp["tok"]
    in_specs = [tok(K), tok(K), tok(V), sp["scalars"], sp["state"], sp["states"]]
    in_specs += [tok(V), sp["state"]]
    out_specs = [tok(K), tok(K), tok(V), sp["scalars"], sp["state"]]
    out_shape = [
        ((BH, Tp, K), _F32),
        ((BH, Tp, K), _F32),
        ((BH, Tp, V), _F32),
        ((BH, N, len(SCALARS), chunk), _F32),
        ((BH, K, V), _F32),
    ]
    kernel = functools.partial(_bwd_kernel, scale=float(scale), restart=restart)
    scratch = [pltpu.VMEM((K, V), _F32), pltpu.VMEM((K, V), _F32)]
    args = (q, k, v, scalars, s0, states, do, dsfin)
    # the backward recomputes the chunk's forward stages, then runs the VJP
    flops = BH * N * (chunk_flops(chunk, K, V, backward=True))
    return chunked_pallas_call(
        kernel, (BH, N), in_specs, out_specs, out_shape, scratch, interpret, "gated_delta_bwd",
        *args, flops=flops, transcendentals=BH * Tp * chunk,
    )  # fmt: skip
