"""SPEC §1: the WY/UT chunk stages of ``core/wy.py``, each against a direct dense formula.

``kkt`` / ``solve_tril`` / ``w_u`` against their matrix definitions (``jnp.linalg.inv`` of the unit
lower triangular matrix), ``state_pass`` and ``chunk_output`` against a per-token gated delta loop
(the states at chunk boundaries and every output), and ``wy_delta_core``'s hand-written VJP against
autodiff of the same stages: values and gradients. Tiny sizes, awkward chunk lengths (C = 3, 5, 37).
f32 tolerance: max abs error ≤ 1e-4 · max(1, max |reference|).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.scan import from_head_chunks, to_head_chunks
from nested_jax.core.wy import chunk_output, kkt, solve_tril, state_pass, w_u, wy_delta_core

TOL = 1e-4


def _close(got, ref, tol=TOL):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * max(1.0, np.abs(ref).max()))


def _grad(f, argnums=0):
    # jit: one compile per gradient instead of one eager dispatch (and compile) per operation
    return jax.jit(jax.grad(f, argnums))


def _tree_close(got, ref, tol=TOL):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        _close(a, b, tol)


def _seq(seed, T=9, H=2, K=4, V=3):
    """One sequence per head, time-major ``[T, H, ·]`` (unit keys, ``g ≤ 0``, ``β ∈ (0, 1)``)."""
    rng = np.random.default_rng(seed)
    f = np.float32
    k = rng.normal(size=(T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(
        q=jnp.asarray(rng.normal(size=(T, H, K)), f),
        k=jnp.asarray(k, f),
        v=jnp.asarray(rng.normal(size=(T, H, V)), f),
        g=jnp.asarray(-rng.uniform(0.05, 0.5, size=(T, H)), f),
        beta=jnp.asarray(rng.uniform(0.1, 0.9, size=(T, H)), f),
        S0=jnp.asarray(rng.normal(size=(H, K, V)), f),
    )


def _chunks(x, C):
    """``[T, H, ...]`` (T a multiple of C) → ``[N, H, C, ...]``, the stages' chunk-major layout."""
    x = x.reshape(x.shape[0] // C, C, *x.shape[1:])
    return jnp.swapaxes(x, 1, 2)


def _decays(g, C):
    """``Γ [N, H, C, C]`` and ``d [N, H, C]`` of a chunked log decay (README §1, no resets)."""
    b = jnp.cumsum(_chunks(g, C), axis=-1)
    causal = jnp.tril(jnp.ones((C, C), bool))
    gamma = jnp.where(
        causal, jnp.exp(jnp.where(causal, b[..., :, None] - b[..., None, :], 0.0)), 0.0
    )
    return gamma, jnp.exp(b)


def _token_loop(q, k, v, g, beta, S0):
    """Gated delta rule token by token (SPEC §1): all states ``S_t``, outputs ``o_t = S_tᵀ q_t``."""
    S, states, outs = S0, [], []
    for t in range(q.shape[0]):
        S = jnp.exp(g[t])[:, None, None] * S
        err = v[t] - jnp.einsum("hk,hkv->hv", k[t], S)
        S = S + beta[t][:, None, None] * k[t][:, :, None] * err[:, None, :]
        states.append(S)
        outs.append(jnp.einsum("hk,hkv->hv", q[t], S))
    return jnp.stack(states), jnp.stack(outs)


def _stages(q, k, v, g, beta, S0, C):
    """The five stages composed under plain autodiff: ``(O [N, H, C, V], S_n, S_final)``."""
    Q, K, V, bc = _chunks(q, C), _chunks(k, C), _chunks(v, C), _chunks(beta, C)
    gamma, d = _decays(g, C)
    T = solve_tril(kkt(K, bc, gamma))
    W, U = w_u(K, V, bc, d, T=T)
    S_final, S_n, U_n = state_pass(W, U, K * gamma[..., -1, :][..., None], d[..., -1], S0)
    return chunk_output(Q, K, gamma, d, S_n, U_n), S_n, S_final


def _strict_lower(rng, shape, scale=0.3):
    return jnp.asarray(np.tril(scale * rng.normal(size=shape), -1), np.float32)


# ----- kkt --------------------------------------------------------------------------------------


def test_kkt_is_the_weighted_strict_gram():
    x = _seq(0)
    C = 3
    K, bc = _chunks(x["k"], C), _chunks(x["beta"], C)
    gamma, _ = _decays(x["g"], C)
    k64, b64, gam64 = (np.asarray(a, np.float64) for a in (K, bc, gamma))
    ref = np.zeros(gamma.shape)
    for i in range(C):
        for j in range(i):
            ref[..., i, j] = (
                b64[..., i] * np.sum(k64[..., i, :] * k64[..., j, :], -1) * gam64[..., i, j]
            )
    _close(jax.jit(kkt)(K, bc, gamma), ref)

    def dense(K, bc, gamma):
        strict = jnp.tril(jnp.ones((C, C)), -1)
        return bc[..., :, None] * jnp.einsum("...ik,...jk->...ij", K, K) * gamma * strict

    w = jnp.asarray(np.random.default_rng(1).normal(size=gamma.shape), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(w * f(*a))  # noqa: E731
    _tree_close(
        _grad(loss(kkt), argnums=(0, 1, 2))(K, bc, gamma),
        _grad(loss(dense), argnums=(0, 1, 2))(K, bc, gamma),
    )


# ----- solve_tril -------------------------------------------------------------------------------


@pytest.mark.parametrize("C", [5, 16, 37, 40])  # forward substitution; blockwise doubling odd/even
def test_solve_tril_is_the_inverse(C):
    rng = np.random.default_rng(C)
    A = _strict_lower(rng, (2, C, C))
    eye = jnp.eye(C)
    ref = np.linalg.inv(np.eye(C) + np.asarray(A, np.float64))
    T = jax.jit(solve_tril)(A)
    _close(T, ref)
    np.testing.assert_array_equal(np.triu(np.asarray(T), 1), 0)

    # the custom VJP equals autodiff of the dense inverse on A's strictly lower support
    w = jnp.asarray(rng.normal(size=A.shape), jnp.float32)
    got = _grad(lambda A: jnp.sum(w * solve_tril(A)))(A)
    dense = _grad(lambda A: jnp.sum(w * jnp.linalg.inv(eye + A)))(A)
    _close(got, jnp.tril(dense, -1))


@pytest.mark.parametrize("C", [5, 37])
def test_solve_tril_with_rhs_is_inverse_times_rhs(C):
    rng = np.random.default_rng(C + 1)
    A = _strict_lower(rng, (2, C, C))
    R = jnp.asarray(rng.normal(size=(2, C, 3)), jnp.float32)
    eye = jnp.eye(C)
    _close(
        jax.jit(solve_tril)(A, R),
        np.linalg.inv(np.eye(C) + np.asarray(A, np.float64)) @ np.asarray(R),
    )
    w = jnp.asarray(rng.normal(size=R.shape), jnp.float32)
    got = _grad(lambda A, R: jnp.sum(w * solve_tril(A, R)), argnums=(0, 1))(A, R)
    dense = _grad(lambda A, R: jnp.sum(w * (jnp.linalg.inv(eye + A) @ R)), argnums=(0, 1))(A, R)
    _close(jnp.tril(got[0], -1), jnp.tril(dense[0], -1))
    _close(got[1], dense[1])
    # only the strictly lower triangle is read
    noise = jnp.triu(jnp.asarray(rng.normal(size=A.shape), jnp.float32))
    np.testing.assert_array_equal(solve_tril(A + noise, R), solve_tril(A, R))


def test_solve_tril_lowers_to_xla_operations_only():
    # on CPU lax.linalg.triangular_solve is a LAPACK call whose batch-parallel kernel can wait
    # forever for its thread pool (docs/RESULTS.md): the solve must not lower to it
    A = _strict_lower(np.random.default_rng(0), (250, 4, 4))
    R = jnp.ones((250, 4, 8))
    for fn in (lambda A: solve_tril(A), lambda A: solve_tril(A, R)):
        text = jax.jit(jax.grad(lambda A, fn=fn: jnp.sum(fn(A)))).lower(A).as_text()
        assert "triangular_solve" not in text and "trsm" not in text


# ----- w_u --------------------------------------------------------------------------------------


def test_w_u_from_inverse_or_solve():
    rng = np.random.default_rng(7)
    C, K, V = 5, 4, 3
    A = _strict_lower(rng, (2, C, C))
    k = jnp.asarray(rng.normal(size=(2, C, K)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, C, V)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, size=(2, C)), jnp.float32)
    d = jnp.asarray(rng.uniform(0.3, 1.0, size=(2, C)), jnp.float32)
    eye = jnp.eye(C)

    def dense(A, k, v, beta, d):
        Tinv = jnp.linalg.inv(eye + A)
        return Tinv @ (k * (beta * d)[..., None]), Tinv @ (v * beta[..., None])

    args = (A, k, v, beta, d)
    ref = jax.jit(dense)(*args)
    via_T = lambda A, *x: w_u(*x, T=solve_tril(A))  # noqa: E731
    via_A = lambda A, *x: w_u(*x, A=A)  # noqa: E731
    ws = [jnp.asarray(rng.normal(size=r.shape), jnp.float32) for r in ref]

    def loss(f):
        return lambda *a: sum(jnp.sum(w * y) for w, y in zip(ws, f(*a), strict=True))

    g_ref = _grad(loss(dense), argnums=tuple(range(5)))(*args)
    for f in (via_T, via_A):
        _tree_close(jax.jit(f)(*args), ref)
        g = _grad(loss(f), argnums=tuple(range(5)))(*args)
        _close(jnp.tril(g[0], -1), jnp.tril(g_ref[0], -1))
        _tree_close(g[1:], g_ref[1:])
    with pytest.raises(ValueError, match="exactly one"):
        w_u(k, v, beta, d)


# ----- state_pass and chunk_output against the per-token loop -----------------------------------


@pytest.mark.parametrize("C", [3, 9])
def test_state_pass_and_output_match_token_loop(C):
    x = _seq(3)
    states, outs = jax.jit(_token_loop)(**x)
    O, S_n, S_final = jax.jit(_stages, static_argnames="C")(**x, C=C)
    # S_n: the state entering chunk n, i.e. after token nC − 1 (S0 for n = 0)
    _close(S_n, jnp.concatenate([x["S0"][None], states[C - 1 : -1 : C]]))
    _close(S_final, states[-1])
    _close(O, _chunks(outs, C))

    ws = jnp.asarray(np.random.default_rng(4).normal(size=states[-1].shape), jnp.float32)
    wo = jnp.asarray(np.random.default_rng(5).normal(size=outs.shape), jnp.float32)

    def loss_stages(x):
        O, _, S = _stages(**x, C=C)
        return jnp.sum(ws * S) + jnp.sum(_chunks(wo, C) * O)

    def loss_loop(x):
        states, outs = _token_loop(**x)
        return jnp.sum(ws * states[-1]) + jnp.sum(wo * outs)

    _tree_close(_grad(loss_stages)(x), _grad(loss_loop)(x))


def test_state_pass_linear_attention_and_bias_match_chunk_loop():
    # W = None: no error term (U_n = Ũ_n); bias_n is added to S_{n+1}
    rng = np.random.default_rng(9)
    N, H, C, K, V = 3, 2, 4, 3, 2
    U, kd = (jnp.asarray(rng.normal(size=(N, H, C, D)), jnp.float32) for D in (V, K))
    W = jnp.asarray(rng.normal(size=(N, H, C, K)), jnp.float32) * 0.3
    dl = jnp.asarray(rng.uniform(0.3, 1.0, size=(N, H)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(N, H, K, V)), jnp.float32)
    S0 = jnp.asarray(rng.normal(size=(H, K, V)), jnp.float32)

    def chunk_loop(W, U, kd, dl, S0, bias):
        S, starts, Us = S0, [], []
        for n in range(N):
            U_n = U[n] if W is None else U[n] - W[n] @ S
            starts.append(S)
            Us.append(U_n)
            S = dl[n][:, None, None] * S + jnp.swapaxes(kd[n], -1, -2) @ U_n
            S = S if bias is None else S + bias[n]
        return S, jnp.stack(starts), jnp.stack(Us)

    def loss(f, args):
        """A nonlinear functional of all three results, as a function of the non-None args."""
        idx = [i for i, a in enumerate(args) if a is not None]

        def fn(*live):
            full = list(args)
            for i, a in zip(idx, live, strict=True):
                full[i] = a
            S, starts, Us = f(*full)
            return jnp.sum(S**2) + jnp.sum(jnp.sin(starts)) + jnp.sum(jnp.cos(Us))

        return fn, [args[i] for i in idx]

    for args in (
        (None, U, kd, dl, S0, None),
        (W, U, kd, dl, S0, bias),
        (None, U, kd, dl, S0, bias),
    ):
        _tree_close(jax.jit(state_pass)(*args), jax.jit(chunk_loop)(*args))
        (f_got, live), (f_ref, _) = loss(state_pass, args), loss(chunk_loop, args)
        argnums = tuple(range(len(live)))
        _tree_close(_grad(f_got, argnums)(*live), _grad(f_ref, argnums)(*live))


def test_chunk_output_is_the_dense_formula():
    rng = np.random.default_rng(11)
    H, C, K, V = 2, 5, 4, 3
    q, k = (jnp.asarray(rng.normal(size=(H, C, K)), jnp.float32) for _ in range(2))
    gamma, d = _decays(jnp.asarray(-rng.uniform(0.05, 0.5, size=(C, H)), jnp.float32), C)
    gamma, d = gamma[0], d[0]
    S = jnp.asarray(rng.normal(size=(H, K, V)), jnp.float32)
    U = jnp.asarray(rng.normal(size=(H, C, V)), jnp.float32)
    q64, k64, g64, d64, S64, U64 = (np.asarray(a, np.float64) for a in (q, k, gamma, d, S, U))
    ref = np.zeros((H, C, V))
    for i in range(C):  # o_i = d_i S_nᵀ q_i + Σ_{j≤i} Γ_ij (q_i·k_j) u_j
        ref[:, i] = d64[:, i, None] * np.einsum("hk,hkv->hv", q64[:, i], S64)
        for j in range(i + 1):
            w = g64[:, i, j] * np.sum(q64[:, i] * k64[:, j], -1)
            ref[:, i] += w[:, None] * U64[:, j]
    _close(jax.jit(chunk_output)(q, k, gamma, d, S, U), ref)

    def dense(q, k, gamma, d, S, U):
        return d[..., None] * jnp.einsum("hck,hkv->hcv", q, S) + jnp.einsum(
            "hij,hij,hjv->hiv", gamma, jnp.einsum("hik,hjk->hij", q, k), U
        )

    args = (q, k, gamma, d, S, U)
    wo = jnp.asarray(rng.normal(size=ref.shape), jnp.float32)
    _tree_close(
        _grad(lambda *a: jnp.sum(wo * chunk_output(*a)), argnums=tuple(range(6)))(*args),
        _grad(lambda *a: jnp.sum(wo * dense(*a)), argnums=tuple(range(6)))(*args),
    )


# ----- the composed core and its hand-written VJP -----------------------------------------------


def _core_args(seed, T, C, reset_chunk=None):
    """One row of ``wy_delta_core``'s arguments (no batch axis): ``q, k, v [T, H, ·]``,
    ``β, d [N, H, C]``, ``Γ [N, H, C, C]``, ``S0``; with ``reset_chunk`` a document starts at
    position 2 of that chunk (Γ masked across it, the carried state cut after it)."""
    x = _seq(seed, T=T)
    gamma, d = _decays(x["g"], C)
    if reset_chunk is not None:
        seg = (jnp.arange(C) >= 2).astype(jnp.int32)
        gamma = gamma.at[reset_chunk].multiply((seg[:, None] == seg[None, :]).astype(jnp.float32))
        d = d.at[reset_chunk].multiply((seg == 0).astype(jnp.float32))
    return x["q"], x["k"], x["v"], _chunks(x["beta"], C), gamma, d, x["S0"]


def test_wy_delta_core_vjp_matches_autodiff_of_the_stages():
    C = 5
    # the core takes q, k, v time-major [B, N·C, H, ·] (it slices each chunk itself), the decays
    # chunk-major [N, B, H, ·], and returns O time-major: a batch of two rows, one with a reset
    rows = (_core_args(21, 15, C, reset_chunk=1), _core_args(23, 15, C))
    batch_axis = (0, 0, 0, 1, 1, 1, 0)
    columns = zip(*rows, strict=True)
    args = tuple(jnp.stack(a, axis=ax) for a, ax in zip(columns, batch_axis, strict=True))

    def autodiff(q, k, v, bc, gamma, d, S0, writes=False):
        Q, K, V = (to_head_chunks(a, C) for a in (q, k, v))
        W, U = w_u(K, V, bc, d, T=solve_tril(kkt(K, bc, gamma)))
        S_final, S_n, U_n = state_pass(W, U, K * gamma[..., -1, :][..., None], d[..., -1], S0)
        out = (from_head_chunks(chunk_output(Q, K, gamma, d, S_n, U_n)), S_final)
        return out + ((from_head_chunks(U_n),) if writes else ())

    rng = np.random.default_rng(22)
    for writes in (False, True):  # with the writes U as a third, differentiable output
        core = lambda *a, w=writes: wy_delta_core(*a, w)  # noqa: E731  (static, positional)
        reference = functools.partial(autodiff, writes=writes)
        ref = jax.jit(reference)(*args)
        _tree_close(jax.jit(core)(*args), ref)  # the primal
        _tree_close(jax.jit(lambda *a, f=core: jax.vjp(f, *a)[0])(*args), ref)  # VJP's forward
        weights = [jnp.asarray(rng.normal(size=r.shape), jnp.float32) for r in ref]

        def loss(f, weights=weights):
            return lambda *a: sum(jnp.sum(w * o) for w, o in zip(weights, f(*a), strict=True))

        _tree_close(
            _grad(loss(core), argnums=tuple(range(7)))(*args),
            _grad(loss(reference), argnums=tuple(range(7)))(*args),
        )
