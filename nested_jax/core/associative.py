"""Linear associative memories: linear attention, delta rule, gated delta rule (SPEC §1).

Every rule has three forms with one meaning (SPEC §0):

- ``*_step``: one token, ``(state, q_t, k_t, v_t, ...) -> (o_t, new_state)``, per-token arrays
  ``[B, H, D]``;
- ``*_recurrent``: ``lax.scan`` of the step over time, the ground truth;
- ``*_chunked``: the WY/UT chunk form (derivation in ``core/README.md``), parallel inside chunks
  of size ``C`` and sequential across chunks.

Per head, with column vectors, ``S ∈ R^{K×V}`` and ``α_t = exp(g_t)``::

    linear attention   S_t = α_t S_{t-1} + k_t v_tᵀ                         (α_t = 1 when g is None)
    delta rule         S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ
    gated delta (GDN)  S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ
    read               o_t = S_tᵀ (scale · q_t)

GDN is FLA's ``naive_recurrent_gated_delta_rule`` (decay first, then the residual write).
Shapes: ``q, k`` ``[B, T, H, K]``; ``v`` ``[B, T, H, V]``; ``g, beta`` ``[B, T, H]``; states
``[B, H, K, V]``. ``scale`` defaults to ``K ** -0.5``. All accumulation is in f32; outputs take
``v``'s dtype, final states are f32.

Packed sequences: with ``segment_ids [B, T]`` (integer), the state is reset to ``initial_state``
(zero when ``None``) before the first token of every segment after the first, i.e. at every
``t > 0`` with ``segment_ids[:, t] != segment_ids[:, t - 1]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "linear_attention_step",
    "linear_attention_recurrent",
    "linear_attention_chunked",
    "delta_rule_step",
    "delta_rule_recurrent",
    "delta_rule_chunked",
    "gated_delta_step",
    "gated_delta_recurrent",
    "gated_delta_chunked",
]


# --------------------------------------------------------------------------------------------------
# Validation (trace time; shapes are static)
# --------------------------------------------------------------------------------------------------


def _check_float(name: str, x) -> None:
    if not jnp.issubdtype(
        jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, jnp.floating
    ):
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")


def _validate_seq(
    fn: str,
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    segment_ids,
    chunk_size=None,
):
    """Checks a sequence call; returns ``(B, T, H, K, V)``; ValueError names the bad argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or x.ndim != 4:
            shape = getattr(x, "shape", None)
            raise ValueError(
                f"{fn}: {name} must have shape [B, T, H, D] (rank 4), got shape {shape}"
            )
        _check_float(name, x)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{fn}: k must have shape [B, T, H, K] = {q.shape} like q, got {k.shape}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(
            f"{fn}: v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {v.shape}"
        )
    V = v.shape[3]
    for name, x in (("g", g), ("beta", beta)):
        if x is None:
            continue
        if not hasattr(x, "shape") or x.shape != (B, T, H):
            shape = getattr(x, "shape", None)
            raise ValueError(
                f"{fn}: {name} must have shape [B, T, H] = [{B}, {T}, {H}], got {shape}"
            )
        _check_float(name, x)
    if initial_state is not None:
        if not hasattr(initial_state, "shape") or initial_state.shape != (B, H, K, V):
            shape = getattr(initial_state, "shape", None)
            raise ValueError(
                f"{fn}: initial_state must have shape [B, H, K, V] = "
                f"[{B}, {H}, {K}, {V}], got {shape}"
            )
        _check_float("initial_state", initial_state)
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape") or segment_ids.shape != (B, T):
            shape = getattr(segment_ids, "shape", None)
            raise ValueError(f"{fn}: segment_ids must have shape [B, T] = [{B}, {T}], got {shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(
                f"{fn}: segment_ids must have an integer dtype, got {segment_ids.dtype}"
            )
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    return B, T, H, K, V


def _validate_step(fn: str, state, q_t, k_t, v_t, g_t, beta_t):
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if not hasattr(x, "shape") or x.ndim != 3:
            shape = getattr(x, "shape", None)
            raise ValueError(f"{fn}: {name} must have shape [B, H, D] (rank 3), got shape {shape}")
        _check_float(name, x)
    B, H, K = q_t.shape
    if k_t.shape != q_t.shape:
        raise ValueError(
            f"{fn}: k_t must have shape [B, H, K] = {q_t.shape} like q_t, got {k_t.shape}"
        )
    if v_t.shape[:2] != (B, H):
        raise ValueError(f"{fn}: v_t must have shape [B, H, V] = [{B}, {H}, V], got {v_t.shape}")
    V = v_t.shape[2]
    for name, x in (("g_t", g_t), ("beta_t", beta_t)):
        if x is None:
            continue
        if not hasattr(x, "shape") or x.shape != (B, H):
            shape = getattr(x, "shape", None)
            raise ValueError(f"{fn}: {name} must have shape [B, H] = [{B}, {H}], got {shape}")
        _check_float(name, x)
    if not hasattr(state, "shape") or state.shape != (B, H, K, V):
        shape = getattr(state, "shape", None)
        raise ValueError(
            f"{fn}: state must have shape [B, H, K, V] = [{B}, {H}, {K}, {V}], got {shape}"
        )
    _check_float("state", state)


def _scale(scale, K):
    return K**-0.5 if scale is None else scale


# --------------------------------------------------------------------------------------------------
# Step forms
# --------------------------------------------------------------------------------------------------


def _step_math(S, q_t, k_t, v_t, g_t, beta_t, scale, delta: bool):
    """One token of the general rule in f32: S [B,H,K,V], tokens [B,H,D], gates [B,H]."""
    f32 = jnp.float32
    q_t, k_t, v_t = q_t.astype(f32) * scale, k_t.astype(f32), v_t.astype(f32)
    if g_t is not None:
        S = jnp.exp(g_t.astype(f32))[..., None, None] * S
    if delta:
        err = v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S)
        write = beta_t.astype(f32)[..., None] * err
    else:
        write = v_t
    S = S + k_t[..., :, None] * write[..., None, :]
    o_t = jnp.einsum("bhk,bhkv->bhv", q_t, S)
    return o_t, S


def linear_attention_step(state, q_t, k_t, v_t, g_t=None, *, scale=None):
    """One token of (gated) linear attention (SPEC §1).

    ``S_t = α_t S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale · q_t)``.

    Args:
      state: ``[B, H, K, V]`` previous state ``S_{t-1}``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``.
      g_t: optional ``[B, H]`` log decay (``α_t = exp(g_t)``); ``None`` means no decay.
      scale: multiplies ``q_t``; default ``K ** -0.5``.

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, new_state [B, H, K, V] f32)``.
    """
    _validate_step("linear_attention_step", state, q_t, k_t, v_t, g_t, None)
    S = state.astype(jnp.float32)
    o, S = _step_math(S, q_t, k_t, v_t, g_t, None, _scale(scale, q_t.shape[-1]), delta=False)
    return o.astype(v_t.dtype), S


def delta_rule_step(state, q_t, k_t, v_t, beta_t, *, scale=None):
    """One token of the delta rule (SPEC §1): ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``.

    Args:
      state: ``[B, H, K, V]``; q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; beta_t: ``[B, H]``.
      scale: multiplies ``q_t``; default ``K ** -0.5``.

    Returns:
      ``(o_t [B, H, V], new_state [B, H, K, V] f32)`` with ``o_t = S_tᵀ (scale · q_t)``.
    """
    _validate_step("delta_rule_step", state, q_t, k_t, v_t, None, beta_t)
    S = state.astype(jnp.float32)
    o, S = _step_math(S, q_t, k_t, v_t, None, beta_t, _scale(scale, q_t.shape[-1]), delta=True)
    return o.astype(v_t.dtype), S


def gated_delta_step(state, q_t, k_t, v_t, g_t, beta_t, *, scale=None):
    """One token of the gated delta rule (SPEC §1, FLA's naive recurrent GDN).

    ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale · q_t)``,
    ``α_t = e^{g_t}``.

    Args:
      state: ``[B, H, K, V]``; q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; g_t, beta_t: ``[B, H]``.
      scale: multiplies ``q_t``; default ``K ** -0.5``.

    Returns:
      ``(o_t [B, H, V], new_state [B, H, K, V] f32)``.
    """
    _validate_step("gated_delta_step", state, q_t, k_t, v_t, g_t, beta_t)
    S = state.astype(jnp.float32)
    o, S = _step_math(S, q_t, k_t, v_t, g_t, beta_t, _scale(scale, q_t.shape[-1]), delta=True)
    return o.astype(v_t.dtype), S


# --------------------------------------------------------------------------------------------------
# Recurrent forms (ground truth)
# --------------------------------------------------------------------------------------------------


def _segment_resets(segment_ids, T):
    """``[B, T]`` bool: True where the state must be reset before processing token t."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    # The first token never resets; built from the batch size so T = 1 (no pairs) works too.
    first = jnp.zeros((segment_ids.shape[0], 1), bool)
    return jnp.concatenate([first, change], axis=1)


def _recurrent(q, k, v, g, beta, scale, initial_state, segment_ids, delta: bool):
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = jnp.float32
    s0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    scale = _scale(scale, K)

    def tm(x):  # time-major so lax.scan walks over T
        return None if x is None else jnp.moveaxis(x, 1, 0)

    resets = None if segment_ids is None else tm(_segment_resets(segment_ids, T))

    def body(S, xs):
        q_t, k_t, v_t, g_t, b_t, r_t = xs
        if r_t is not None:
            S = jnp.where(r_t[:, None, None, None], s0, S)
        o_t, S = _step_math(S, q_t, k_t, v_t, g_t, b_t, scale, delta)
        return S, o_t

    S, o = lax.scan(body, s0, (tm(q), tm(k), tm(v), tm(g), tm(beta), resets))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


def linear_attention_recurrent(
    q, k, v, g=None, *, scale=None, initial_state=None, segment_ids=None
):
    """(Gated) linear attention by a scan over tokens (SPEC §1; ground truth).

    ``S_t = α_t S_{t-1} + k_t v_tᵀ`` (``α_t = e^{g_t}``, or 1 when ``g`` is None),
    ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: optional ``[B, T, H]`` log decay (≤ 0).
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    _validate_seq("linear_attention_recurrent", q, k, v, g, None, initial_state, segment_ids)
    return _recurrent(q, k, v, g, None, scale, initial_state, segment_ids, delta=False)


def delta_rule_recurrent(q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None):
    """Delta rule (DeltaNet) by a scan over tokens (SPEC §1; ground truth).

    ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    _validate_seq("delta_rule_recurrent", q, k, v, None, beta, initial_state, segment_ids)
    return _recurrent(q, k, v, None, beta, scale, initial_state, segment_ids, delta=True)


def gated_delta_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None):
    """Gated delta rule (GDN) by a scan over tokens (SPEC §1; FLA's naive GDN; ground truth).

    ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale·q_t)``,
    ``α_t = e^{g_t}``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    _validate_seq("gated_delta_recurrent", q, k, v, g, beta, initial_state, segment_ids)
    return _recurrent(q, k, v, g, beta, scale, initial_state, segment_ids, delta=True)


# --------------------------------------------------------------------------------------------------
# Chunked (WY/UT) forms
# --------------------------------------------------------------------------------------------------


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


_BASE = 16  # blocks of at most this size are inverted by forward substitution


def _forward_substitution(A):
    """``(I + A)^{-1}`` for strictly lower ``A [..., c, c]`` (small c), one row at a time:
    ``X_i = e_i − Σ_{j<i} A_ij X_j``. Exact up to rounding and stable (no powers of A); a
    ``fori_loop`` keeps the compiled program small."""
    c = A.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(c, dtype=A.dtype), A.shape)

    def row(i, X):
        a_i = lax.dynamic_slice_in_dim(A, i, 1, axis=-2)  # zero at columns ≥ i
        x_i = lax.dynamic_slice_in_dim(eye, i, 1, axis=-2) - a_i @ X
        return lax.dynamic_update_slice_in_dim(X, x_i, i, axis=-2)

    return lax.fori_loop(1, c, row, eye)


def _tri_inverse_impl(A):
    """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]`` by blockwise doubling.

    ``[[L11, 0], [L21, L22]]^{-1} = [[T11, 0], [−T22 L21 T11, T22]]`` with ``T11, T22`` inverted
    recursively (both halves batched together when C is even) down to forward substitution on
    blocks of ≤ 16. Only products of inverses of unit triangular blocks appear, never powers of A.
    """
    C = A.shape[-1]
    if C <= _BASE:
        return _forward_substitution(A)
    h = C // 2
    A11, A21, A22 = A[..., :h, :h], A[..., h:, :h], A[..., h:, h:]
    if C % 2 == 0:
        T11, T22 = _tri_inverse_impl(jnp.stack([A11, A22]))
    else:
        T11, T22 = _tri_inverse_impl(A11), _tri_inverse_impl(A22)
    T21 = -(T22 @ (A21 @ T11))
    top = jnp.concatenate([T11, jnp.zeros(T11.shape[:-1] + (C - h,), A.dtype)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([T21, T22], axis=-1)], axis=-2)


@jax.custom_vjp
def _tri_inverse(A):
    return _tri_inverse_impl(A)


def _tri_inverse_fwd(A):
    X = _tri_inverse_impl(A)
    return X, X


def _tri_inverse_bwd(X, dX):
    # d(M^{-1}) = −M^{-1} dM M^{-1}  ⇒  dA = −Xᵀ dX Xᵀ on A's strictly lower support
    return (-jnp.tril(_mT(X) @ dX @ _mT(X), -1),)


_tri_inverse.defvjp(_tri_inverse_fwd, _tri_inverse_bwd)


def _chunk(x, C):
    """``[B, T, H, ...]`` (T a multiple of C) → ``[N, B, H, C, ...]``."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // C, C, H, *x.shape[3:])
    return jnp.swapaxes(jnp.moveaxis(x, 1, 0), 2, 3)


def _unchunk(x):
    """``[N, B, H, C, ...]`` → ``[B, N·C, H, ...]``."""
    N, B, H, C = x.shape[:4]
    x = jnp.moveaxis(jnp.swapaxes(x, 2, 3), 0, 1)
    return x.reshape(B, N * C, H, *x.shape[4:])


def _pad_time(x, Tp):
    T = x.shape[1]
    if Tp == T:
        return x
    return jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))


def _rowdot(a, b):
    # Row-wise dot products as an einsum: on XLA:CPU a fused multiply+reduce over the last axis
    # lowers to a reduction ~30x slower than the equivalent dot (measured here).
    return jnp.einsum("...ij,...ij->...i", a, b)


# ---- the delta-rule chunk core with a hand-written VJP ---------------------------------------
#
# Arrays are chunk-major ``[N, B, H, C, ·]``. Inputs: Q (scaled), K, V, β [N,B,H,C], Γ [N,B,H,C,C]
# (decays e^{b_i − b_j} on the causal same-segment mask, zero elsewhere), dc [N,B,H,C] (coefficient
# of the carried state for token i: e^{b_i}, zeroed after an in-chunk reset) and S_init [B,H,K,V].
# The backward recomputes nothing expensive: it reuses T, W, Ũ, QKᵀ, KKᵀ, the chunk-start states
# S_n and U_n saved by the forward, and runs the state recurrence backwards (core/README.md §2).


def _wy_forward(Q, K, V, beta, gamma, dc, S_init):
    KT = _mT(K)
    QK, KK = Q @ KT, K @ KT
    QK_KK = (QK, KK)
    A = jnp.tril(beta[..., :, None] * KK * gamma, -1)
    T = _tri_inverse(A)
    W = T @ (K * (beta * dc)[..., None])
    Ut = T @ (V * beta[..., None])
    Kdec = K * gamma[..., -1, :][..., None]  # K ⊙ e^{b_C − b_j}
    dl = dc[..., -1]

    def body(S, xs):
        W_n, Ut_n, Kdec_n, dl_n = xs
        U_n = Ut_n - W_n @ S
        return dl_n[..., None, None] * S + _mT(Kdec_n) @ U_n, (S, U_n)

    S_final, (S_n, U) = lax.scan(body, S_init, (W, Ut, Kdec, dl))
    P = QK * gamma
    O = (Q * dc[..., None]) @ S_n + P @ U
    return O, S_final, (T, W, Ut, QK_KK, S_n, U)


@jax.custom_vjp
def _wy_core(Q, K, V, beta, gamma, dc, S_init):
    O, S_final, _ = _wy_forward(Q, K, V, beta, gamma, dc, S_init)
    return O, S_final


def _wy_core_fwd(Q, K, V, beta, gamma, dc, S_init):
    O, S_final, saved = _wy_forward(Q, K, V, beta, gamma, dc, S_init)
    return (O, S_final), (Q, K, V, beta, gamma, dc) + saved


def _wy_core_bwd(res, cts):
    Q, K, V, beta, gamma, dc, T, W, Ut, QK_KK, S_n, U = res
    dO, dS_final = cts
    QK, KK = QK_KK
    kdec = gamma[..., -1, :]
    Kdec = K * kdec[..., None]
    dl = dc[..., -1]
    P = QK * gamma
    Qdc = Q * dc[..., None]

    # Reverse state recurrence: dU_n = Pᵀ dO_n + Kdec G, dS_n = dl G + Qdcᵀ dO_n − W_nᵀ dU_n,
    # with G = dS_{n+1}. The dO terms are batched over all chunks first.
    Xp = _mT(P) @ dO
    Yq = _mT(Qdc) @ dO

    def body(G, xs):
        Xp_n, Yq_n, Kdec_n, W_n, dl_n = xs
        dU_n = Xp_n + Kdec_n @ G
        dS = dl_n[..., None, None] * G + Yq_n - _mT(W_n) @ dU_n
        return dS, (dU_n, G)

    dS_init, (dU, G) = lax.scan(body, dS_final, (Xp, Yq, Kdec, W, dl), reverse=True)

    dQdc = dO @ _mT(S_n)
    dP = dO @ _mT(U)
    dKdec = U @ _mT(G)
    ddl = jnp.einsum("...kv,...kv->...", S_n, G)
    dW = -(dU @ _mT(S_n))
    TT = _mT(T)
    dRk, dRv = TT @ dW, TT @ dU  # dR = Tᵀ [dW | dŨ]
    # dA = −Tᵀ dY Rᵀ Tᵀ = −dR Yᵀ with Y = [W | Ũ], on A's strictly lower support
    dA = -jnp.tril(dRk @ _mT(W) + dRv @ _mT(Ut), -1)

    rk = _rowdot(dRk, K)
    dbeta = dc * rk + _rowdot(dRv, V) + _rowdot(dA, KK * gamma)
    ddc = beta * rk + _rowdot(dQdc, Q)
    ddc = ddc.at[..., -1].add(ddl)
    dV = dRv * beta[..., None]

    dKK = dA * gamma * beta[..., :, None]
    dQK = dP * gamma
    dgamma = dA * KK * beta[..., :, None] + dP * QK
    dgamma = dgamma.at[..., -1, :].add(_rowdot(dKdec, K))

    dKKs = dKK + _mT(dKK)
    dK = dKKs @ K + _mT(dQK) @ Q
    dK = dK + dRk * (beta * dc)[..., None] + dKdec * kdec[..., None]
    dQ = dQK @ K + dQdc * dc[..., None]
    return dQ, dK, dV, dbeta, dgamma, ddc, dS_init


_wy_core.defvjp(_wy_core_fwd, _wy_core_bwd)


def _chunked(q, k, v, g, beta, scale, initial_state, segment_ids, C, delta: bool):
    """Shared chunk form (core/README.md). Padding tokens have k = v = 0, g = 0, β = 0, so they
    neither write nor decay the state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = jnp.float32
    N = -(-T // C)
    Tp = N * C
    scale = _scale(scale, K)
    Q = _chunk(_pad_time(q.astype(f32) * scale, Tp), C)  # [N, B, H, C, K]
    Kc = _chunk(_pad_time(k.astype(f32), Tp), C)
    Vc = _chunk(_pad_time(v.astype(f32), Tp), C)  # [N, B, H, C, V]
    s0 = None if initial_state is None else initial_state.astype(f32)

    causal = jnp.tril(jnp.ones((C, C), bool))
    if segment_ids is not None:
        resets = _pad_time(_segment_resets(segment_ids, T), Tp)  # [B, Tp]
        z = _chunk(jnp.cumsum(resets, axis=1)[:, :, None], C)  # [N, B, 1, C] global segment index
        mask = causal & (z[..., :, None] == z[..., None, :])  # same segment and j ≤ i
        # m_i = 1 while no reset happened in this chunk up to i: those tokens see the carried state.
        m = (jnp.cumsum(_chunk(resets[:, :, None], C), axis=-1) == 0).astype(f32)
    else:
        mask, m = causal, None

    # Decays are only ever exponentiated on the mask, where b_i − b_j ≤ 0 for g ≤ 0: no overflow,
    # and the masked-out entries get an exact zero (and a zero gradient), never exp(−inf).
    if g is not None:
        gc = _chunk(_pad_time(g.astype(f32), Tp), C)  # [N, B, H, C]
        b = jnp.cumsum(gc, axis=-1)
        diff = b[..., :, None] - b[..., None, :]
        gamma = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)  # [N, B, H, C, C]
        # log decay from the (segment-local) chunk start to i: Σ_{j ≤ i, same segment} g_j
        logd = b if segment_ids is None else jnp.sum(jnp.where(mask, gc[..., None, :], 0.0), -1)
        d = jnp.exp(logd)  # [N, B, H, C]
    else:
        gamma = jnp.broadcast_to(mask, (N, B, H, C, C)).astype(f32)
        d = jnp.ones((N, B, H, C), f32)
    d_carry = d if m is None else d * m  # coefficient of the carried state for token i
    reset_to_s0 = m is not None and s0 is not None
    init = jnp.zeros((B, H, K, V), f32) if s0 is None else s0

    if delta:
        bc = _chunk(_pad_time(beta.astype(f32), Tp), C)  # [N, B, H, C]
        if not reset_to_s0:
            O, S_final = _wy_core(Q, Kc, Vc, bc, gamma, d_carry, init)
            return _unchunk(O)[:, :T].astype(v.dtype), S_final

    # Linear attention, and the delta rules when a segment restarts from a non-zero initial state:
    # plain autodiff of the same chunk algebra, with the s0 restart as a second incoming state
    # (coefficient d ⊙ (1 − m), see core/README.md).
    kdec = gamma[..., -1, :]  # e^{b_C − b_j} restricted to the last token's segment
    d_last = d_carry[..., -1]  # [N, B, H]
    Kdec = Kc * kdec[..., None]
    if delta:
        kk = Kc @ _mT(Kc)
        A = jnp.tril(bc[..., :, None] * kk * gamma, -1)
        Tinv = _tri_inverse(A)
        W = Tinv @ (Kc * (bc * d_carry)[..., None])  # [N, B, H, C, K]
        Ut = Tinv @ (Vc * bc[..., None])  # [N, B, H, C, V]
        if reset_to_s0:
            W0 = Tinv @ (Kc * (bc * d * (1.0 - m))[..., None])
            Ut = Ut - W0 @ s0
    else:
        W, Ut = None, Vc

    if reset_to_s0:
        reset_bias = (d[..., -1] * (1.0 - m[..., -1]))[..., None, None] * s0  # [N, B, H, K, V]
    else:
        reset_bias = None

    def body(S, xs):
        if delta:
            W_n, Ut_n, Kdec_n, dl_n, rb_n = xs
            U_n = Ut_n - W_n @ S
        else:
            Ut_n, Kdec_n, dl_n, rb_n = xs
            U_n = Ut_n
        S_next = dl_n[..., None, None] * S + _mT(Kdec_n) @ U_n
        if rb_n is not None:
            S_next = S_next + rb_n
        return S_next, ((S, U_n) if delta else S)

    xs = (W, Ut, Kdec, d_last, reset_bias) if delta else (Ut, Kdec, d_last, reset_bias)
    S_final, ys = lax.scan(body, init, xs)
    S_starts, U = ys if delta else (ys, Ut)

    P = (Q @ _mT(Kc)) * gamma
    O = (Q * d_carry[..., None]) @ S_starts + P @ U
    if reset_to_s0:
        O = O + (Q * (d * (1.0 - m))[..., None]) @ s0
    o = _unchunk(O)[:, :T]
    return o.astype(v.dtype), S_final


def linear_attention_chunked(
    q, k, v, g=None, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64
):
    """(Gated) linear attention in chunk form (SPEC §1; equals ``linear_attention_recurrent``).

    Inside a chunk: ``O = (Q ⊙ d) S_n + (Q Kᵀ ⊙ Γ) V``, ``S_{n+1} = d_C S_n + (K ⊙ Γ_{C,:})ᵀ V``
    (``Γ_ij = e^{b_i − b_j}`` for j ≤ i, ``b`` the in-chunk cumulative log decay, ``d = e^{b}``).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: optional ``[B, T, H]`` log decay.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.
      chunk_size: chunk length C (> 0); T need not be a multiple of C.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    _validate_seq(
        "linear_attention_chunked", q, k, v, g, None, initial_state, segment_ids, chunk_size
    )
    return _chunked(q, k, v, g, None, scale, initial_state, segment_ids, chunk_size, delta=False)


def delta_rule_chunked(
    q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64
):
    """Delta rule in WY/UT chunk form (SPEC §1; equals ``delta_rule_recurrent``).

    See ``gated_delta_chunked`` with ``g = 0``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      scale, initial_state, segment_ids, chunk_size: as in ``gated_delta_chunked``.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    _validate_seq("delta_rule_chunked", q, k, v, None, beta, initial_state, segment_ids, chunk_size)
    return _chunked(q, k, v, None, beta, scale, initial_state, segment_ids, chunk_size, delta=True)


def gated_delta_chunked(
    q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64
):
    """Gated delta rule in WY/UT chunk form (SPEC §1; equals ``gated_delta_recurrent``).

    Per chunk (derivation in core/README.md): ``A = strict_tril(diag(β) K Kᵀ ⊙ Γ)``,
    ``T = (I + A)^{-1}`` (blockwise doubling over forward substitution; never powers of A),
    ``W = T diag(β e^{b}) K``, ``Ũ = T diag(β) V``; sequentially over chunks ``U_n = Ũ − W S_n``,
    ``S_{n+1} = e^{b_C} S_n + (K ⊙ e^{b_C − b})ᵀ U_n``; then
    ``O = (Q ⊙ e^{b}) S_n + (Q Kᵀ ⊙ Γ) U_n``.
    Gradients: a hand-written VJP that runs the state recurrence backwards (README §2); segment
    resets fold into the masks of Γ (README §3).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.
      chunk_size: chunk length C (> 0); T need not be a multiple of C.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    _validate_seq("gated_delta_chunked", q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    return _chunked(q, k, v, g, beta, scale, initial_state, segment_ids, chunk_size, delta=True)
