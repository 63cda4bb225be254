"""The WY/UT chunk algebra of the delta rules, as named stages (SPEC §1).

Derivation: ``core/associative/README.md`` §2 (forward) and §3 (the hand-written VJP).

Per head, chunk ``n`` of ``C`` tokens, incoming state ``S_n ∈ R^{K×V}``, ``Γ_ij = e^{b_i − b_j}``
on the causal (same-segment) mask and 0 elsewhere, ``d`` the coefficient of the carried state for
each token (``e^{b}``; see README §4 for resets), ``Q`` already scaled::

    kkt           A   = strict_tril(diag(β) (K Kᵀ) ⊙ Γ)                  [..., C, C]
    solve_tril    T   = (I + A)^{-1}                                       [..., C, C]
    w_u           W   = T diag(β ⊙ d) K,   Ũ = T diag(β) V                 [..., C, K | V]
    state_pass    U_n = Ũ_n − W_n S_n,   S_{n+1} = d_C S_n + (K ⊙ Γ_{C,:}ᵀ)ᵀ U_n   (scan over n)
    chunk_output  O   = diag(d) Q S_n + (Q Kᵀ ⊙ Γ) U_n                    [..., C, V]

This is FLA's split (``chunk_scaled_dot_kkt`` → ``solve_tril`` → ``recompute_w_u`` →
``chunk_fwd_h`` → ``chunk_fwd_o``): each stage is a pure function of arrays, the seam where a
Pallas kernel can replace it. The stages take one chunk ``[..., C, ·]`` or all of them chunk-major
``[N, B, H, C, ·]`` (``scan.to_head_chunks``); ``...`` is any leading shape. ``wy_delta_core``
composes the stages for the delta rules with a hand-written VJP (README §3); the special cases
(linear attention: no ``W``; restarts from a non-zero initial state: a second incoming state)
compose them in ``associative._chunked`` under plain autodiff. HOLA's forward-only residual pass
(``hola.gdn_residuals``) runs ``w_u`` (solve form) and ``state_step`` chunk by chunk; the Proteus
GDN runs through ``associative.gated_delta_chunked``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.scan import from_head_chunks, zeros_typed

__all__ = [
    "kkt",
    "solve_tril",
    "w_u",
    "state_pass",
    "state_step",
    "chunk_of",
    "chunk_output",
    "wy_delta_core",
    "chunk_flops",
]


def chunk_flops(C: int, K: int, V: int, backward: bool = True) -> float:
    """Matmul FLOPs of one chunk of one head of the stages below, forward (and with
    ``backward`` the hand-written VJP); multiply-add = 2, elementwise work not counted::

        forward   [Q;K]Kᵀ 4C²K + inverse (2/3)C³ + T[βK|βV] 2C²(K+V) + state 4CKV + O 2CKV + 2C²V
        backward  4C²V + 12CKV + 4C²(K+V) + 8C²K

    The count behind ``bench core``'s GFLOP/s and the Pallas kernels' ``CostEstimate``.
    """
    fwd = 4 * C * C * K + (2 / 3) * C**3 + 2 * C * C * (K + V) + 6 * C * K * V + 2 * C * C * V
    bwd = 4 * C * C * V + 12 * C * K * V + 4 * C * C * (K + V) + 8 * C * C * K
    return float(fwd + (bwd if backward else 0.0))


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


# --------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------


def kkt(k, beta, gamma):
    """The β- and decay-weighted key Gram of a chunk (SPEC §1):
    ``A = strict_tril(diag(β) (K Kᵀ) ⊙ Γ)``.

    Args:
      k: ``[..., C, K]`` keys of one chunk.
      beta: ``[..., C]`` write strengths.
      gamma: ``[..., C, C]`` pairwise decays ``Γ`` (zero off the mask).

    Returns:
      ``[..., C, C]`` strictly lower triangular.
    """
    return jnp.tril(beta[..., :, None] * (k @ _mT(k)) * gamma, -1)


_BASE = 16  # blocks of at most this size are inverted by forward substitution


def _forward_substitution(A):
    """``(I + A)^{-1}`` for strictly lower ``A [..., c, c]`` (small c), one row at a time:
    ``X_i = e_i − Σ_{j<i} A_ij X_j``. Exact up to rounding and stable (no powers of A); a
    ``fori_loop`` keeps the compiled program small."""
    c = A.shape[-1]
    eye = jnp.eye(c, dtype=A.dtype) + zeros_typed(A)  # the loop carry: typed like A (scan.py)

    def row(i, X):
        a_i = lax.dynamic_slice_in_dim(A, i, 1, axis=-2)  # zero at columns ≥ i
        x_i = lax.dynamic_slice_in_dim(eye, i, 1, axis=-2) - a_i @ X
        return lax.dynamic_update_slice_in_dim(X, x_i, i, axis=-2)

    return lax.fori_loop(1, c, row, eye)


def _tri_inverse(A):
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
        T11, T22 = _tri_inverse(jnp.stack([A11, A22]))
    else:
        T11, T22 = _tri_inverse(A11), _tri_inverse(A22)
    T21 = -(T22 @ (A21 @ T11))
    top = jnp.concatenate([T11, zeros_typed(T11[..., :1], T11.shape[:-1] + (C - h,))], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([T21, T22], axis=-1)], axis=-2)


@jax.custom_vjp
def _inverse(A):
    return _tri_inverse(A)


def _inverse_fwd(A):
    X = _tri_inverse(A)
    return X, X


def _inverse_bwd(X, dX):
    # d(M^{-1}) = −M^{-1} dM M^{-1}  ⇒  dA = −Xᵀ dX Xᵀ on A's strictly lower support
    return (-jnp.tril(_mT(X) @ dX @ _mT(X), -1),)


_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def solve_tril(A, rhs=None):
    """The unit lower-triangular solve of the WY/UT form (SPEC §1): ``(I + A)^{-1}`` or
    ``(I + A)^{-1} R``.

    The inverse ``T`` by blockwise doubling (README §2; stable in f32, never powers of A), with
    the VJP ``dA = −strict_tril(Tᵀ dT Tᵀ)``; with ``rhs``, the product ``T R``. Only XLA
    operations: on CPU ``lax.linalg.triangular_solve`` is a LAPACK call whose batch-parallel
    kernel can wait forever for the thread pool it runs in, and at larger C it is also the slower
    (docs/RESULTS.md, "wy.solve_tril").

    Args:
      A: ``[..., C, C]``; only its strictly lower triangle is read.
      rhs: optional ``[..., C, M]``.

    Returns:
      ``[..., C, C]`` unit lower triangular ``T``, or ``[..., C, M]``.
    """
    T = _inverse(jnp.tril(A, -1))
    return T if rhs is None else T @ rhs


def w_u(k, v, beta, d, *, T=None, A=None):
    """The WY/UT transform (SPEC §1): ``W = T diag(β ⊙ d) K``, ``Ũ = T diag(β) V``, ``T = (I+A)⁻¹``.

    Independent of the state. Give either the inverse ``T = solve_tril(A)`` (two products; what
    ``wy_delta_core`` saves for its backward) or ``A`` (one forward-substitution solve for both
    right-hand sides).

    Args:
      k: ``[..., C, K]``; v: ``[..., C, V]``; beta, d: ``[..., C]``.
      T: ``[..., C, C]`` ``(I + A)^{-1}``; A: ``[..., C, C]`` strictly lower (exactly one of them).

    Returns:
      ``(W [..., C, K], Ũ [..., C, V])``.
    """
    if (T is None) == (A is None):
        raise ValueError("w_u: give exactly one of T (the inverse) and A")
    rk, rv = k * (beta * d)[..., None], v * beta[..., None]
    if T is not None:
        return T @ rk, T @ rv
    Y = solve_tril(A, jnp.concatenate([rk, rv], axis=-1))
    return Y[..., : k.shape[-1]], Y[..., k.shape[-1] :]


def state_pass(W, U, k_dec, d_last, S0, bias=None):
    """The sequential pass over chunks (SPEC §1), a ``lax.scan`` carrying only the state::

        U_n = Ũ_n − W_n S_n,     S_{n+1} = d_C S_n + k_decᵀ U_n (+ bias_n)

    with ``k_dec = K ⊙ Γ_{C,:}ᵀ`` (each key decayed to the chunk end) and ``d_C`` the carried
    state's coefficient at the chunk end.

    Args:
      W: ``[N, ..., C, K]``, or ``None`` for linear attention (no error term: ``U_n = Ũ_n``).
      U: ``[N, ..., C, V]`` ``Ũ``.
      k_dec: ``[N, ..., C, K]``; d_last: ``[N, ...]``.
      S0: ``[..., K, V]`` the state entering chunk 0.
      bias: optional ``[N, ..., K, V]`` added to ``S_{n+1}`` (a restart from the initial state,
        README §4).

    Returns:
      ``(S_N [..., K, V], S_n [N, ..., K, V] the chunk-start states, U_n [N, ..., C, V])``.
    """

    def body(S, xs):
        W_n, U_n, kd_n, dl_n, b_n = xs
        S_next, U_n = state_step(S, W_n, U_n, kd_n, dl_n, b_n)
        return S_next, (S if W_n is None else (S, U_n))

    S_final, ys = lax.scan(body, S0, (W, U, k_dec, d_last, bias))
    S_starts, U_n = (ys, U) if W is None else ys
    return S_final, S_starts, U_n


def state_step(S, W_n, U_n, kd_n, dl_n, b_n=None):
    """One chunk of ``state_pass``: ``(S_{n+1}, U_n)`` from ``S = S_n`` (arguments as there, one
    chunk each: ``W_n [..., C, K]`` or None, ``U_n [..., C, V]``, ``kd_n [..., C, K]``,
    ``dl_n [...]``, ``b_n [..., K, V]`` or None)."""
    if W_n is not None:
        U_n = U_n - W_n @ S
    S_next = dl_n[..., None, None] * S + _mT(kd_n) @ U_n
    if b_n is not None:
        S_next = S_next + b_n
    return S_next, U_n


def chunk_output(q, k, gamma, d, S_starts, U):
    """Chunk outputs (SPEC §1): ``O = diag(d) Q S_n + (Q Kᵀ ⊙ Γ) U_n`` — the inter-chunk read of
    the carried state plus causal attention inside the chunk.

    Args:
      q, k: ``[..., C, K]`` (q scaled); gamma: ``[..., C, C]``; d: ``[..., C]``.
      S_starts: ``[..., K, V]`` chunk-start states; U: ``[..., C, V]`` writes ``U_n``.

    Returns:
      ``[..., C, V]``.
    """
    P = (q @ _mT(k)) * gamma  # formed first: the order autodiff sums q's cotangents in
    return (q * d[..., None]) @ S_starts + P @ U


# --------------------------------------------------------------------------------------------------
# The delta-rule chunk core with a hand-written VJP
# --------------------------------------------------------------------------------------------------
#
# ``wy_delta_core`` takes the per-token inputs in the caller's time-major layout ``[B, N·C, H, ·]``
# and the per-token decays chunk-major: β and dc ``[N, B, H, C]``, Γ ``[N, B, H, C, C]`` (decays
# e^{b_i − b_j} on the causal same-segment mask, zero elsewhere; dc the coefficient of the carried
# state for token i, e^{b_i}, zeroed after an in-chunk reset). It never transposes q, k, v: each
# chunk is sliced out inside the scan (the transposing passes, not the stages, were what a
# forward batched over all chunks spent its extra time on; timings in docs/RESULTS.md). Both
# passes run chunk by chunk. The forward saves only the chunk-start states S_n; the backward is one
# reverse scan that recomputes the chunk's stages from q, k, v and S_n and runs the state
# recurrence backwards (core/associative/README.md §3). Per chunk, its operands stay in cache: on
# XLA:CPU that was as fast as or faster than the backward batched over all chunks from saved
# products at D = 128, with about a third of the temporaries (docs/RESULTS.md).


def _rowdot(a, b):
    # Row-wise dot products as an einsum: on XLA:CPU a fused multiply+reduce over the last axis
    # lowers to a reduction far slower than the equivalent dot.
    return jnp.einsum("...ij,...ij->...i", a, b)


def chunk_of(x, n, C):
    """Chunk ``n`` (traced or static) of a time-major ``x [B, N·C, H, D]`` as ``[B, H, C, D]``:
    one chunk sliced out inside a scan, with no transposing pass over the whole array."""
    return jnp.swapaxes(lax.dynamic_slice_in_dim(x, n * C, C, axis=1), 1, 2)


def _forward_by_chunk(q, k, v, beta, gamma, dc, S_init, keep_states=False, keep_writes=False):
    """The five stages chunk by chunk in one scan, each chunk sliced out of the time-major inputs.

    Returns ``(O [B, N·C, H, V], S_final, U, S_n)``: with ``keep_writes`` the writes ``U``
    time-major ``[B, N·C, H, V]`` (else None), with ``keep_states`` the chunk-start states
    ``S_n [N, B, H, K, V]`` (what the backward saves; else None)."""
    C = gamma.shape[-1]

    def step(S, xs):
        n, b_n, g_n, d_n = xs
        Q, K, V = (chunk_of(x, n, C) for x in (q, k, v))
        W, Ut = w_u(K, V, b_n, d_n, T=solve_tril(kkt(K, b_n, g_n)))
        S_next, U = state_step(S, W, Ut, K * g_n[..., -1, :][..., None], d_n[..., -1])
        ys = {"O": chunk_output(Q, K, g_n, d_n, S, U)}
        if keep_states:
            ys["S"] = S
        if keep_writes:
            ys["U"] = U
        return S_next, ys

    S_final, ys = lax.scan(step, S_init, (jnp.arange(gamma.shape[0]), beta, gamma, dc))
    U = from_head_chunks(ys["U"]) if keep_writes else None
    return from_head_chunks(ys["O"]), S_final, U, ys.get("S")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def wy_delta_core(q, k, v, beta, gamma, dc, S_init, writes=False):
    """The delta-rule chunk form (SPEC §1): ``kkt → solve_tril → w_u → state_pass → chunk_output``.

    All five stages run chunk by chunk in one scan that slices each chunk out of the time-major
    inputs. Differentiated, the forward also keeps the chunk-start states, and a hand-written VJP
    runs one reverse scan that recomputes each chunk's stages and runs the state recurrence
    backwards (core/associative/README.md §3): memory ``O(T·D + (T/C)·K·V)``, no ``O(T·C)``
    products saved.

    Args:
      q: ``[B, N·C, H, K]`` scaled queries, time-major; k: ``[B, N·C, H, K]``;
        v: ``[B, N·C, H, V]``.
      beta: ``[N, B, H, C]``; gamma: ``[N, B, H, C, C]`` ``Γ``; dc: ``[N, B, H, C]`` coefficient
        of the carried state per token (chunk-major, ``scan.to_head_chunks``).
      S_init: ``[B, H, K, V]``.
      writes: static bool (passed positionally): also return the writes ``U`` (rows
        ``Δ_t = β_t e_t``, ``e_t = v_t − α_t S_{t−1}ᵀ k_t``), differentiable like the rest.

    Returns:
      ``(O [B, N·C, H, V], S_final [B, H, K, V])``, then ``U [B, N·C, H, V]`` with ``writes``.
    """
    O, S_final, U, _ = _forward_by_chunk(q, k, v, beta, gamma, dc, S_init, keep_writes=writes)
    return (O, S_final) + ((U,) if writes else ())


def _wy_core_fwd(q, k, v, beta, gamma, dc, S_init, writes):
    O, S_final, U, S_n = _forward_by_chunk(
        q, k, v, beta, gamma, dc, S_init, keep_states=True, keep_writes=writes
    )
    return (O, S_final) + ((U,) if writes else ()), (q, k, v, beta, gamma, dc, S_n)


def _chunk_grads(G, Q, K, V, beta, gamma, dc, S, dO, dU_out=None):
    """The VJP of one chunk (README §3), its stages recomputed from ``Q, K, V`` and ``S = S_n``.

    ``G = ∂L/∂S_{n+1}``; chunk arrays ``[B, H, C, ·]``, ``gamma [B, H, C, C]``, ``S [B, H, K, V]``;
    ``dU_out``: the cotangent of the returned writes ``U_n`` (None: not returned).
    Returns ``(∂L/∂S_n, (dQ, dK, dV, dβ, dΓ, d dc))``."""
    KK, QK = K @ _mT(K), Q @ _mT(K)
    T = solve_tril(kkt(K, beta, gamma))
    W, Ut = w_u(K, V, beta, dc, T=T)
    U = Ut - W @ S
    kdec = gamma[..., -1, :]
    P = QK * gamma
    # the reverse state recurrence
    dU = _mT(P) @ dO + (K * kdec[..., None]) @ G
    if dU_out is not None:
        dU = dU + dU_out
    dS = dc[..., -1][..., None, None] * G + _mT(Q * dc[..., None]) @ dO - _mT(W) @ dU
    # the chunk's own stages
    dQdc = dO @ _mT(S)
    dP = dO @ _mT(U)
    dKdec = U @ _mT(G)
    TT = _mT(T)
    dRk, dRv = TT @ -(dU @ _mT(S)), TT @ dU  # dR = Tᵀ [dW | dŨ], dW = −dU Sᵀ
    # dA = −Tᵀ dY Rᵀ Tᵀ = −dR Yᵀ with Y = [W | Ũ], on A's strictly lower support
    dA = -jnp.tril(dRk @ _mT(W) + dRv @ _mT(Ut), -1)

    rk = _rowdot(dRk, K)
    dbeta = dc * rk + _rowdot(dRv, V) + _rowdot(dA, KK * gamma)
    ddc = beta * rk + _rowdot(dQdc, Q)
    ddc = ddc.at[..., -1].add(jnp.einsum("...kv,...kv->...", S, G))
    dKK = dA * gamma * beta[..., :, None]
    dQK = dP * gamma
    dgamma = dA * KK * beta[..., :, None] + dP * QK
    dgamma = dgamma.at[..., -1, :].add(_rowdot(dKdec, K))
    dK = (dKK + _mT(dKK)) @ K + _mT(dQK) @ Q
    dK = dK + dRk * (beta * dc)[..., None] + dKdec * kdec[..., None]
    dQ = dQK @ K + dQdc * dc[..., None]
    return dS, (dQ, dK, dRv * beta[..., None], dbeta, dgamma, ddc)


def _wy_core_bwd(writes, res, cts):
    q, k, v, beta, gamma, dc, S_n = res
    dO, dS_final = cts[:2]
    ct_chunks = (q, k, v, dO) + ((cts[2],) if writes else ())  # sliced chunk by chunk
    C = gamma.shape[-1]

    def step(G, xs):
        n, b_n, g_n, d_n, S = xs
        Q, K, V, dO_n, *dU_n = (chunk_of(x, n, C) for x in ct_chunks)
        return _chunk_grads(G, Q, K, V, b_n, g_n, d_n, S, dO_n, *dU_n)

    xs = (jnp.arange(gamma.shape[0]), beta, gamma, dc, S_n)
    dS_init, (dQ, dK, dV, dbeta, dgamma, ddc) = lax.scan(step, dS_final, xs, reverse=True)
    dQ, dK, dV = (from_head_chunks(x) for x in (dQ, dK, dV))
    return dQ, dK, dV, dbeta, dgamma, ddc, dS_init


wy_delta_core.defvjp(_wy_core_fwd, _wy_core_bwd)
