"""Titans neural memory (SPEC §2, §0.1): chunked == recurrent == slow chunk rule; mechanisms."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.titans import reference as ref
from nested_jax.core.titans.chunk import titans_mlp_chunked, titans_pool_gates
from nested_jax.core.titans.linear import (
    TitansLinearState,
    titans_linear_chunked,
    titans_linear_recurrent,
    titans_linear_step,
)
from nested_jax.core.titans.mlp import (
    titans_mlp_apply,
    titans_mlp_recurrent,
    titans_mlp_state,
    titans_mlp_step,
)
from nested_jax.core.titans.net import TitansMLPState
from nested_jax.rules import TitansRule

TOL = 1e-4  # SPEC §0: f32 max abs error relative to the output scale
CHUNK4 = TitansRule(memory_chunk=4)
# Unoptimised XLA backend: compile time dominates these tests and halves with it; numerics are f32
# either way. Only the temp-memory test compiles with the defaults (it measures the real program).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


_COMPILED = {}


def _run(fn, *args, **kwargs):
    """``jax.jit(fn)(*args, **kwargs)`` compiled with ``FAST_COMPILE``, cached; keyword arguments
    holding arrays are traced, the others are static."""
    is_arr = lambda v: any(isinstance(x, jax.Array) for x in jax.tree.leaves(v))  # noqa: E731
    dyn = {k: v for k, v in kwargs.items() if is_arr(v)}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in dyn))
    leaves, tree = jax.tree.flatten((args, dyn))
    key = (fn, static, tree, tuple((x.shape, x.dtype) for x in leaves))
    if key not in _COMPILED:
        f = jax.jit(lambda a, d: fn(*a, **d, **dict(static)))
        _COMPILED[key] = f.lower(args, dyn).compile(FAST_COMPILE)
    return _COMPILED[key](args, dyn)


def _close(a, b, tol=TOL, what=""):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.max(np.abs(b))))
    err = float(np.max(np.abs(a - b))) / scale
    assert err <= tol, f"{what}: max rel err {err:.3g} > {tol}"


def _rng(seed):
    return np.random.default_rng(seed)


def _normal(seed, shape, scale=1.0):
    # numpy RNG: jax.random would compile threefry for every shape (seconds each on a loaded CPU).
    return jnp.asarray(scale * _rng(seed).standard_normal(shape), jnp.float32)


def _inputs(seed, B, T, H, K, V, *, alpha_max=0.3):
    """Unit-norm q, k (as the layer gives them), O(1) v, gates in (0, 1), momentum and decay on."""
    r = _rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(r.standard_normal((B, T, H, K)))
    k = unit(r.standard_normal((B, T, H, K)))
    v = r.standard_normal((B, T, H, V))
    theta = r.uniform(0.05, 0.9, (B, T, H))
    eta = r.uniform(0.05, 0.95, (B, T, H))
    alpha = r.uniform(0.01, alpha_max, (B, T, H))
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, theta, eta, alpha))


def _mlp_state(seed, B, H, dims, momentum_scale=0.1):
    pairs = enumerate(zip(dims[:-1], dims[1:], strict=True))
    w = tuple(_normal(seed + i, (H, a, b), a**-0.5) for i, (a, b) in pairs)
    st = titans_mlp_state(w, B)
    mom = tuple(_normal(seed + 100 + i, s.shape, momentum_scale) for i, s in enumerate(st.momentum))
    return TitansMLPState(st.weights, mom)


def _grads(fn, args, seed=123):
    """Outputs and the gradient of a random linear functional of every output (one jitted VJP)."""
    shapes = jax.eval_shape(fn, *args)
    leaves, tree = jax.tree.flatten(shapes)
    cots = jax.tree.unflatten(tree, [_normal(seed + i, x.shape) for i, x in enumerate(leaves)])

    def run(args, cots):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cots)

    return _run(run, args, cots)


def _assert_tree_close(a, b, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert x.shape == y.shape, f"{what}[{i}]: {x.shape} vs {y.shape}"
        _close(x, y, what=f"{what}[{i}]")


# --------------------------------------------------------------------------------------------------
# chunk size 1 == per-token recurrence (values and gradients), L_M = 1 and 2
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # test_conformance.py: titans_linear chunk 1 == recurrent, values and grads
def test_linear_chunk1_equals_recurrent_values_and_grads():
    B, T, H, K, V = 2, 37, 1, 20, 12
    rbw = True  # the MLP test below covers the default read order
    x = _inputs(0, B, T, H, K, V)
    M0 = _normal(9, (B, H, K, V), 0.2)
    S0 = _normal(10, (B, H, K, V), 0.1)

    def rec(q, k, v, th, et, al, M, S):
        return titans_linear_recurrent(
            q, k, v, th, et, al, initial_state=TitansLinearState(M, S),
            rule=TitansRule(read_before_write=rbw),
        )  # fmt: skip

    def chk(q, k, v, th, et, al, M, S):
        return titans_linear_chunked(
            q, k, v, th, et, al, initial_state=TitansLinearState(M, S),
            rule=TitansRule(memory_chunk=1, read_before_write=rbw),
        )  # fmt: skip

    args = (*x, M0, S0)
    (o_r, s_r), g_r = _grads(rec, args)
    (o_c, s_c), g_c = _grads(chk, args)
    assert o_c.shape == (B, T, H, V) and s_c.M.shape == (B, H, K, V)
    _close(o_c, o_r, what="o")
    _assert_tree_close(s_c, s_r, "state")
    _assert_tree_close(g_c, g_r, "grad(q,k,v,theta,eta,alpha,M0,S0)")


@pytest.mark.slow  # test_conformance.py: titans_mlp chunk 1 == recurrent, values and grads
def test_mlp_chunk1_equals_recurrent_values_and_grads():
    B, T, H, D, hid = 2, 37, 2, 12, 20
    x = _inputs(1, B, T, H, D, D)
    st = _mlp_state(3, B, H, (D, hid, D))  # L_M = 2, residual (auto since K == V)

    # the layers' softclamp (TitansOptions.grad_clip) keeps this memory finite at θ up to 0.9
    def rec(st, *a):
        return titans_mlp_recurrent(*a, initial_state=st, rule=TitansRule(grad_clip=10.0))

    def chk(st, *a):
        rule = TitansRule(memory_chunk=1, grad_clip=10.0)
        return titans_mlp_chunked(*a, initial_state=st, rule=rule)

    (y_r, st_r), g_r = _grads(rec, (st, *x))
    (y_c, st_c), g_c = _grads(chk, (st, *x))
    _close(y_c, y_r, what="y")
    _assert_tree_close(st_c, st_r, "state")
    _assert_tree_close(g_c, g_r, "grad(state0,q,k,v,theta,eta,alpha)")


def test_recurrent_equals_independent_per_token_reference():
    """The scan forms equal a loop that materialises the weights and uses jax.grad (L_M = 1, 2)."""
    B, T, H, K, V = 1, 19, 2, 8, 6
    x = _inputs(2, B, T, H, K, V)
    st = _mlp_state(4, B, H, (K, 10, V))  # K != V: no residual
    rbw = TitansRule(read_before_write=True)
    y, st_r = _run(titans_mlp_recurrent, *x, initial_state=st, rule=rbw)
    y_ref, (w_ref, s_ref) = _run(ref.per_token_rule, *x, initial_state=st, rule=rbw)
    _close(y, y_ref, what="mlp y")
    _assert_tree_close((st_r.weights, st_r.momentum), (w_ref, s_ref), "mlp state")

    M0, S0 = st.weights[0][..., :V], st.momentum[0][..., :V]
    o, s = _run(titans_linear_recurrent, *x, initial_state=TitansLinearState(M0, S0))
    o_ref, (w_ref, s_ref) = _run(ref.per_token_rule, *x, initial_state=((M0,), (S0,)))
    _close(o, o_ref, what="linear o")
    _assert_tree_close((s.M, s.S), (w_ref[0], s_ref[0]), "linear state")


# --------------------------------------------------------------------------------------------------
# chunked == slow chunk rule (gradients at chunk start), b ∈ {4, 16}, T not a multiple of b
# --------------------------------------------------------------------------------------------------


# L1-4, L2-4: test_conformance.py (titans_linear, titans_mlp == twin at chunk 4) in the default run
@pytest.mark.parametrize(
    ("layers", "b"),
    [
        pytest.param(1, 4, marks=pytest.mark.slow),
        pytest.param(2, 4, marks=pytest.mark.slow),
        (2, 16),
    ],
    ids=["L1-4", "L2-4", "L2-16"],
)
def test_chunked_matches_slow_chunk_rule_values_and_grads(layers, b):
    B, T, H, K, V, hid = 1, (23 if b == 4 else 37), 2, 12, 12, 16
    rbw = b == 16  # cover both read orders without doubling the compile time
    x = _inputs(5, B, T, H, K, V)
    dims = (K, V) if layers == 1 else (K, hid, V)
    st = _mlp_state(7, B, H, dims)
    residual = layers >= 2
    rule = TitansRule(memory_chunk=b, read_before_write=rbw)

    def fast(st, *a):
        if layers == 1:
            o, s = titans_linear_chunked(
                *a, initial_state=TitansLinearState(st.weights[0], st.momentum[0]), rule=rule
            )
            return o, (s.M,), (s.S,)
        y, s = titans_mlp_chunked(*a, initial_state=st, rule=rule)
        return y, s.weights, s.momentum

    def slow(st, *a):
        y, (w, m) = ref.chunk_rule(*a, initial_state=st, rule=rule, residual=residual)
        return y, w, m

    out_f, g_f = _grads(fast, (st, *x))
    out_s, g_s = _grads(slow, (st, *x))
    _assert_tree_close(out_f, out_s, "values (y, W, S)")
    _assert_tree_close(g_f, g_s, "grads (state0, q, k, v, theta, eta, alpha)")


@pytest.mark.parametrize("layers", [3, 4])
def test_deep_memories_match_slow_chunk_rule(layers):
    """L_M = 3, 4 with varied hidden sizes, SiLU vs GELU, clip binding, residual on (K == V)."""
    B, T, H, D = 1, 21, 1, 6
    x = _inputs(11, B, T, H, D, D)
    x = (x[0], x[1], 3.0 * x[2], *x[3:])  # large values so the softclamp binds
    dims = (D, 9, 7, D) if layers == 3 else (D, 9, 7, 5, D)
    act = "silu" if layers == 3 else "gelu"
    st = _mlp_state(13, B, H, dims)
    rule = TitansRule(memory_chunk=8, activation=act, grad_clip=0.5)
    y, s = _run(titans_mlp_chunked, *x, initial_state=st, rule=rule)
    y_ref, (w_ref, s_ref) = _run(ref.chunk_rule, *x, initial_state=st, residual=True, rule=rule)
    _close(y, y_ref, what="y")
    _assert_tree_close((s.weights, s.momentum), (w_ref, s_ref), "state")
    # The clip binds here (otherwise this test would not pin it): the first surprise is > 0.5.
    w0 = [w[0, 0] for w in st.weights]
    act_fn = jax.nn.silu if layers == 3 else jax.nn.gelu
    u = ref.surprise(w0, x[1][0, 0, 0], x[2][0, 0, 0], act_fn, True, 0.0)
    assert float(jnp.sqrt(sum(jnp.sum(g**2) for g in u))) > 2 * 0.5


def test_per_chunk_gates_equal_pooled_gates_in_slow_rule():
    B, T, H, K, V = 2, 13, 1, 6, 5
    q, k, v, th, et, al = _inputs(17, B, T, H, K, V)
    M0 = 0.3 * _normal(0, (B, H, K, V))
    pooled_rule = TitansRule(memory_chunk=4, per_chunk_gates=True)
    o, s = _run(titans_linear_chunked, q, k, v, th, et, al, initial_state=M0, rule=pooled_rule)
    pooled = [titans_pool_gates(g, 4) for g in (th, et, al)]
    np.testing.assert_allclose(pooled[0][:, 12], th[:, 12])  # the 1-token last chunk keeps its gate
    np.testing.assert_allclose(pooled[1][:, 5], et[:, 4:8].mean(1), rtol=1e-6)
    init = ((M0,), (jnp.zeros_like(M0),))
    o_ref, (w_ref, _) = _run(
        ref.chunk_rule, q, k, v, *pooled, initial_state=init, rule=TitansRule(memory_chunk=4)
    )
    _close(o, o_ref, what="o")
    _close(s.M, w_ref[0], what="M")
    # the twin pools the gates itself, chunk by chunk
    o_twin, _ = _run(ref.chunk_rule, q, k, v, th, et, al, initial_state=init, rule=pooled_rule)
    _close(o_twin, o_ref, what="twin's pooled o")


# --------------------------------------------------------------------------------------------------
# Mechanisms
# --------------------------------------------------------------------------------------------------


def _one_token(seed, B=2, H=2, K=6, V=6):
    x = _inputs(seed, B, 1, H, K, V)
    return tuple(a[:, 0] for a in x)


def test_alpha_one_erases_memory():
    """α_t = 1: M_t = S_t (the old memory is gone); with θ = η = 0 as well the memory is 0."""
    q, k, v, th, et, _ = _one_token(20)
    B, H, K, V = 2, 2, 6, 6
    M = _normal(1, (B, H, K, V))
    S = _normal(2, (B, H, K, V))
    ones = jnp.ones((B, H))
    _, st = _run(titans_linear_step, TitansLinearState(M, S), q, k, v, th, et, ones)
    np.testing.assert_array_equal(st.M, st.S)
    mst = _mlp_state(3, B, H, (K, 8, V), momentum_scale=1.0)
    _, mnew = _run(titans_mlp_step, mst, q, k, v, th, et, ones)
    for w, s in zip(mnew.weights, mnew.momentum, strict=True):
        np.testing.assert_array_equal(w, s)
    # Erase at t0: outputs after t0 do not depend on anything before (initial memory included).
    # Chunked: t0 must end a chunk (inside a chunk, surprises are taken at the chunk-start memory).
    T = 14
    for fn, t0 in (
        (titans_linear_recurrent, 6),
        (functools.partial(titans_linear_chunked, rule=TitansRule(memory_chunk=4)), 7),
    ):
        x = list(_inputs(21, 1, T, 1, K, V))
        for i, val in ((3, 0.0), (4, 0.0), (5, 1.0)):  # theta, eta, alpha at t0
            x[i] = x[i].at[:, t0].set(val)
        M0 = _normal(3, (1, 1, K, V))
        o1, s1 = _run(fn, *x, initial_state=M0)
        x2 = [a.at[:, :t0].multiply(-2.0) if i < 3 else a for i, a in enumerate(x)]
        o2, s2 = _run(fn, *x2, initial_state=5.0 * M0)
        assert float(jnp.max(jnp.abs(o1[:, :t0] - o2[:, :t0]))) > 1e-2  # the past did change
        np.testing.assert_array_equal(o1[:, t0], 0.0)  # M_t0 = 0
        np.testing.assert_allclose(o1[:, t0:], o2[:, t0:], atol=1e-6)
        np.testing.assert_allclose(s1.M, s2.M, atol=1e-6)


def test_eta_zero_removes_momentum():
    """η = 0: S_t = −θ_t u_t whatever S_{t-1} was (step and chunked, linear and MLP)."""
    q, k, v, th, _, al = _one_token(30)
    B, H, K, V = 2, 2, 6, 6
    zero = jnp.zeros((B, H))
    M = 0.5 * _normal(1, (B, H, K, V))
    S = _normal(2, (B, H, K, V))
    _, st = _run(titans_linear_step, TitansLinearState(M, S), q, k, v, th, zero, al)
    u = k[..., :, None] * (jnp.einsum("bhk,bhkv->bhv", k, M) - v)[..., None, :]
    np.testing.assert_allclose(st.S, -th[..., None, None] * u, atol=1e-6)
    one = [a[:, None] for a in (q, k, v, th, zero, al)]
    _, st_c = _run(titans_linear_chunked, *one, initial_state=TitansLinearState(M, S), rule=CHUNK4)
    np.testing.assert_allclose(st_c.S, -th[..., None, None] * u, atol=1e-6)

    mst = _mlp_state(3, B, H, (K, 8, V), momentum_scale=1.0)
    _, mnew = _run(titans_mlp_step, mst, q, k, v, th, zero, al)
    ug = jax.grad(lambda w: 0.5 * jnp.sum((titans_mlp_apply(w, k[:, None])[:, 0] - v) ** 2))(
        mst.weights
    )
    for s, g in zip(mnew.momentum, ug, strict=True):
        np.testing.assert_allclose(s, -th[..., None, None] * g, atol=1e-6)


@pytest.mark.parametrize("layers", [1, 2])
def test_theta_zero_leaves_memory_unchanged(layers):
    """θ = 0 with η = 0, α = 0: M_T = M_0 and y_t = M_0(q_t), recurrent and chunked."""
    B, T, H, D = 2, 11, 2, 6
    q, k, v, th, et, al = _inputs(40, B, T, H, D, D)
    zero = jnp.zeros_like(th)
    dims = (D, D) if layers == 1 else (D, 8, D)
    st = _mlp_state(5, B, H, dims, momentum_scale=0.0)
    for fn in (titans_mlp_recurrent, functools.partial(titans_mlp_chunked, rule=CHUNK4)):
        y, new = _run(fn, q, k, v, zero, zero, zero, initial_state=st)
        for w0, w in zip(st.weights, new.weights, strict=True):
            np.testing.assert_allclose(w, w0, atol=1e-7)
        np.testing.assert_allclose(y, titans_mlp_apply(st.weights, q), atol=1e-6)
    if layers == 1:  # the SPEC §0.1 linear API too
        o, s = _run(titans_linear_chunked, q, k, v, zero, zero, zero, initial_state=st.weights[0])
        np.testing.assert_allclose(s.M, st.weights[0], atol=1e-7)
        np.testing.assert_allclose(o, titans_mlp_apply(st.weights, q), atol=1e-6)


@pytest.mark.parametrize("layers", [1, 2])
def test_repeated_pair_is_recalled(layers):
    """Writing one (k, v) pair again and again makes the memory return v for k."""
    B, T, H, D = 1, 160, 2, 8
    q, k, v, *_ = _inputs(50, B, 1, H, D, D)
    k = jnp.repeat(k, T, axis=1)
    v = jnp.repeat(v, T, axis=1)
    g = lambda val: jnp.full((B, T, H), val)  # noqa: E731
    if layers == 1:
        o, s = _run(titans_linear_chunked, k, k, v, g(0.3), g(0.5), g(0.01), rule=CHUNK4)
        recall = jnp.einsum("bhk,bhkv->bhv", k[:, 0], s.M)
    else:
        st = _mlp_state(6, B, H, (D, 16, D), momentum_scale=0.0)
        o, s = _run(titans_mlp_recurrent, k, k, v, g(0.1), g(0.5), g(0.0), initial_state=st)
        recall = titans_mlp_apply(s.weights, k[:, :1])[:, 0]
    err0 = float(jnp.linalg.norm(o[:, 0] - v[:, 0]))
    err = float(jnp.linalg.norm(recall - v[:, 0]))
    assert err < 0.02 * float(jnp.linalg.norm(v[:, 0])) and err < 0.05 * err0, (err, err0)
    _close(o[:, -1], v[:, -1], tol=0.02, what="last read")


@pytest.mark.parametrize("rbw", [False, True], ids=["read_after", "read_before"])
def test_causality(rbw):
    """Perturbing every input from t0 on (mid-chunk) leaves outputs before t0 unchanged; with
    read_before_write, y_t0 does not depend on (k, v, gates) at t0 either."""
    B, T, H, D, t0 = 1, 23, 2, 6, 10
    x = _inputs(60, B, T, H, D, D)
    st = _mlp_state(8, B, H, (D, 8, D))
    kw = dict(rule=TitansRule(memory_chunk=8, read_before_write=rbw))
    y1, _ = _run(titans_mlp_chunked, *x, initial_state=st, **kw)
    x2 = [a.at[:, t0:].multiply(0.5) for a in x]
    y2, _ = _run(titans_mlp_chunked, *x2, initial_state=st, **kw)
    np.testing.assert_array_equal(y1[:, :t0], y2[:, :t0])
    assert float(jnp.max(jnp.abs(y1[:, t0:] - y2[:, t0:]))) > 1e-3
    x3 = [a if i == 0 else a.at[:, t0].multiply(0.5) for i, a in enumerate(x)]
    y3, _ = _run(titans_mlp_chunked, *x3, initial_state=st, **kw)
    same = np.allclose(y1[:, t0], y3[:, t0], atol=1e-6)
    assert same == rbw


@pytest.mark.parametrize("layers", [1, 2])
def test_decode_with_anchor_equals_chunked(layers):
    """Prefill with the chunked form over whole chunks, then decode token by token with the
    surprise at the chunk-start weights (``anchor``): equals one chunked call over everything."""
    B, T, H, D, b, prefill = 1, 19, 2, 6, 4, 8
    x = _inputs(100, B, T, H, D, D)
    st = _mlp_state(9, B, H, (D, D) if layers == 1 else (D, 8, D))
    rule = TitansRule(memory_chunk=b)
    if layers == 1:
        lin0 = TitansLinearState(st.weights[0], st.momentum[0])
        y_full, s_full = _run(titans_linear_chunked, *x, initial_state=lin0, rule=rule)
        full_w = (s_full.M,)
        _, state = _run(
            titans_linear_chunked, *(a[:, :prefill] for a in x), initial_state=lin0, rule=rule
        )
        step, get_w = titans_linear_step, lambda s: s.M
    else:
        y_full, s_full = _run(titans_mlp_chunked, *x, initial_state=st, rule=rule)
        full_w = s_full.weights
        _, state = _run(
            titans_mlp_chunked, *(a[:, :prefill] for a in x), initial_state=st, rule=rule
        )
        step, get_w = titans_mlp_step, lambda s: s.weights

    def dec(state, anchor, *xt):
        return step(state, *xt, anchor=anchor)

    ys = []
    for t in range(prefill, T):
        if t % b == 0:
            anchor = get_w(state)
        y, state = _run(dec, state, anchor, *(a[:, t] for a in x))
        ys.append(y)
    _close(jnp.stack(ys, 1), y_full[:, prefill:], what="decoded y")
    _assert_tree_close(jax.tree.leaves(get_w(state)), list(jax.tree.leaves(full_w)), "state")


def test_softclamp_bounds_each_write():
    """With grad_clip=c the first write has ‖S_1‖_F ≤ θ c even for a huge surprise."""
    q, k, v, th, et, al = _one_token(70)
    M = jnp.zeros((2, 2, 6, 6))
    _, st = _run(titans_linear_step, M, q, k, 1e4 * v, th, et, al, rule=TitansRule(grad_clip=2.0))
    norms = jnp.linalg.norm(st.S, axis=(-2, -1))
    assert bool(jnp.all(norms <= 2.0 * th + 1e-4)) and bool(jnp.all(norms > 1.9 * th))


def test_bf16_inputs_keep_f32_state():
    x = [a.astype(jnp.bfloat16) for a in _inputs(80, 1, 9, 1, 4, 4)]
    o, s = _run(titans_linear_chunked, *x, rule=CHUNK4)
    assert o.dtype == jnp.bfloat16 and s.M.dtype == jnp.float32 and s.S.dtype == jnp.float32
    st = _mlp_state(1, 1, 1, (4, 8, 4))
    y, ms = _run(titans_mlp_chunked, *x, initial_state=st, rule=CHUNK4)
    assert y.dtype == jnp.bfloat16 and all(w.dtype == jnp.float32 for w in ms.weights)


# --------------------------------------------------------------------------------------------------
# Packed sequences (segment_ids, SPEC §0)
# --------------------------------------------------------------------------------------------------


def _segments(T, last=20):
    """Row 0: resets at 6 and 7 (two in one chunk of 4); row 1: at 8 (a chunk start) and last."""
    seg = np.zeros((2, T), np.int32)
    seg[0, 6:], seg[0, 7:] = 1, 2
    seg[1, 8:], seg[1, last:] = 1, 2
    return jnp.asarray(seg)


def _separate_segments(st, seg, *a, chunk_size, per_chunk_gates=False):
    """Reference for packed rows: every segment of every row run alone from the initial state
    through the slow chunk rule (its own chunk grid), outputs concatenated; the final state is
    that of the row's last segment."""
    seg = np.asarray(seg)
    ys, ws, ss = [], [], []
    for r in range(seg.shape[0]):
        starts = np.flatnonzero(seg[r, 1:] != seg[r, :-1]) + 1
        cuts = [0, *(int(t) for t in starts), seg.shape[1]]
        row = lambda x, r=r: x[r : r + 1]  # noqa: E731
        parts = []
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            y, (w, s_) = ref.chunk_rule(
                *(row(x)[:, lo:hi] for x in a),
                initial_state=(tuple(map(row, st.weights)), tuple(map(row, st.momentum))),
                rule=TitansRule(memory_chunk=chunk_size, per_chunk_gates=per_chunk_gates),
                residual=True,
            )  # fmt: skip
            parts.append(y)
        ys.append(jnp.concatenate(parts, 1))
        ws.append(w)
        ss.append(s_)
    cat = lambda xs: tuple(jnp.concatenate(x, 0) for x in zip(*xs, strict=True))  # noqa: E731
    return jnp.concatenate(ys, 0), cat(ws), cat(ss)


# test_conformance.py packed[titans_mlp]: starts at 6, 7 (in one chunk), 12, one-token documents
@pytest.mark.slow
def test_segment_ids_chunked_equals_separate_segments_values_and_grads():
    """Packed rows: each segment gets exactly a separate run (own chunk grid, reset to the initial
    state incl. momentum), wherever it starts: row 0 has two resets in one chunk (6 and 7, both
    mid-chunk), row 1 one at a chunk start (8) and one mid-chunk (13)."""
    B, T, H, D, b = 2, 15, 1, 6, 4
    x = _inputs(110, B, T, H, D, D)
    st = _mlp_state(11, B, H, (D, 8, D))
    seg = _segments(T, last=13)

    def fast(st, *a):
        y, s = titans_mlp_chunked(
            *a, initial_state=st, rule=TitansRule(memory_chunk=b), segment_ids=seg
        )
        return y, s.weights, s.momentum

    def slow(st, *a):
        return _separate_segments(st, seg, *a, chunk_size=b)

    out_f, g_f = _grads(fast, (st, *x))
    out_s, g_s = _grads(slow, (st, *x))
    _assert_tree_close(out_f, out_s, "values (y, W, S)")
    _assert_tree_close(g_f, g_s, "grads (state0, q, k, v, theta, eta, alpha)")


def test_per_chunk_gates_on_packed_rows_pool_each_document_chunk():
    """With per-chunk gates a document pools its gates over its own chunks (from its first
    token), as it does alone: documents starting at 6, 7 (mid-chunk), 8 and 13."""
    B, T, H, D, b = 2, 15, 1, 6, 4
    x = _inputs(112, B, T, H, D, D)
    st = _mlp_state(12, B, H, (D, 8, D))
    seg = _segments(T, last=13)
    rule = TitansRule(memory_chunk=b, per_chunk_gates=True)
    y, s = _run(titans_mlp_chunked, *x, initial_state=st, rule=rule, segment_ids=seg)
    y_ref, w_ref, s_ref = _separate_segments(st, seg, *x, chunk_size=b, per_chunk_gates=True)
    _assert_tree_close((y, s.weights, s.momentum), (y_ref, w_ref, s_ref), "values (y, W, S)")


def test_segment_ids_reset_state_and_grad_horizon():
    """``reset_state`` is the reset target (not the carried start state); ``grad_horizon`` keeps
    values, cuts the gradient of early inputs on later outputs, and must be a chunk multiple."""
    B, T, H, D, b = 2, 15, 1, 6, 4
    x = _inputs(111, B, T, H, D, D)
    st, st_r = _mlp_state(21, B, H, (D, 8, D)), _mlp_state(22, B, H, (D, 8, D))
    seg = _segments(T, last=13)
    rule = TitansRule(memory_chunk=b)
    y, _ = _run(
        titans_mlp_chunked, *x, initial_state=st, rule=rule, segment_ids=seg, reset_state=st_r
    )
    st_r1 = jax.tree.map(lambda a: a[1:], st_r)
    y_ref, _ = _run(titans_mlp_chunked, *(a[1:, 8:13] for a in x), initial_state=st_r1, rule=rule)
    _close(y[1:, 8:13], y_ref, what="segment [8, 13) from reset_state")
    y_rec, _ = _run(titans_mlp_recurrent, *x, initial_state=st, segment_ids=seg, reset_state=st_r)
    y_ref, _ = _run(titans_mlp_recurrent, *(a[1:, 8:13] for a in x), initial_state=st_r1)
    _close(y_rec[1:, 8:13], y_ref, what="recurrent segment [8, 13) from reset_state")
    for fn in (titans_mlp_chunked, titans_mlp_recurrent):

        def last_out(k0, fn=fn, n=0):
            k = x[1].at[:, 0].set(k0)
            cut = TitansRule(memory_chunk=b, grad_horizon=n)
            return fn(x[0], k, *x[2:], initial_state=st, rule=cut)[0][:, -1].sum()

        g_cut = jax.grad(functools.partial(last_out, n=8))(x[1][:, 0])
        g_full = jax.grad(last_out)(x[1][:, 0])
        assert float(jnp.abs(g_cut).max()) == 0.0 and float(jnp.abs(g_full).max()) > 0.0
        y_cut = fn(*x, initial_state=st, rule=TitansRule(memory_chunk=b, grad_horizon=8))[0]
        _close(y_cut, fn(*x, initial_state=st, rule=rule)[0], tol=1e-6, what="horizon values")
    with pytest.raises(ValueError, match=r"rule\.grad_horizon must be a multiple of rule\.memory"):
        titans_mlp_chunked(*x, initial_state=st, rule=TitansRule(memory_chunk=4, grad_horizon=6))


def test_segment_ids_reset_to_initial_state():
    """A segment gives what a separate call on it gives (recurrent and chunked, the chunked one
    also for segments starting mid-chunk); memory_chunk=1 == recurrent."""
    B, T, H, D, b = 2, 23, 2, 6, 4
    x = _inputs(120, B, T, H, D, D)
    seg = _segments(T)
    M0 = _normal(12, (B, H, D, D), 0.3)
    init = TitansLinearState(M0, _normal(13, (B, H, D, D), 0.1))
    o_r, s_r = _run(titans_linear_recurrent, *x, initial_state=init, segment_ids=seg)
    chunk1 = TitansRule(memory_chunk=1)
    o_1, s_1 = _run(titans_linear_chunked, *x, initial_state=init, segment_ids=seg, rule=chunk1)
    _close(o_1, o_r, what="chunk 1 vs recurrent o")
    _assert_tree_close(s_1, s_r, "chunk 1 vs recurrent state")
    rule = TitansRule(memory_chunk=b)
    o_c, s_c = _run(titans_linear_chunked, *x, initial_state=init, segment_ids=seg, rule=rule)
    part = [a[1:, 8:20] for a in x]
    init1 = TitansLinearState(M0[1:], init.S[1:])
    o_sep, _ = _run(titans_linear_recurrent, *part, initial_state=init1)
    _close(o_r[1:, 8:20], o_sep, what="recurrent segment [8, 20)")
    o_sep, _ = _run(titans_linear_chunked, *part, initial_state=init1, rule=rule)
    _close(o_c[1:, 8:20], o_sep, what="chunked segment [8, 20)")
    _, s_sep = _run(titans_linear_recurrent, *(a[1:, 20:] for a in x), initial_state=init1)
    _close(s_r.M[1:], s_sep.M, what="final M of the last segment")
    part = [a[:1, 7:] for a in x]  # row 0: the segment starting mid-chunk at 7
    init0 = TitansLinearState(M0[:1], init.S[:1])
    o_sep, s_sep = _run(titans_linear_chunked, *part, initial_state=init0, rule=rule)
    _close(o_c[:1, 7:], o_sep, what="chunked segment [7, 23) (mid-chunk start)")
    _close(s_c.M[:1], s_sep.M, what="chunked final M of row 0")
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\]"):
        titans_linear_chunked(*x, segment_ids=seg[:, :5])


# --------------------------------------------------------------------------------------------------
# Memory: no per-chunk gradient stacks; temp memory linear in T
# --------------------------------------------------------------------------------------------------


def _temp_bytes(T, remat_every=1):
    B, H, D, hid, b = 1, 2, 16, 32, 16
    st = _mlp_state(0, B, H, (D, hid, D))
    x = _inputs(0, B, T, H, D, D)
    rule = TitansRule(memory_chunk=b, remat_every=remat_every)

    def loss(st, *a):
        y, s = titans_mlp_chunked(*a, initial_state=st, rule=rule)
        return jnp.sum(y**2) + sum(jnp.sum(w) for w in s.weights)

    f = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).lower(st, *x)
    # FAST_COMPILE gives the same temp sizes as the default pipeline here (checked: 577,112 and
    # 1,778,456 bytes at T = 256 and 1024 both ways) in half the compile time.
    return f.compile(FAST_COMPILE).memory_analysis().temp_size_in_bytes


def test_chunked_fwd_bwd_temp_memory_is_linear_in_T():
    """Only the carried (W, S) per chunk is saved for the backward pass: ×4 tokens ≈ ×3 bytes."""
    small, large = _temp_bytes(256), _temp_bytes(1024)
    assert large <= 5 * small, (small, large)


def test_remat_every_keeps_values_and_gradients():
    """Storing every n-th chunk's carry (and ⌈√N⌉ with 0) recomputes the same chunks: values and
    gradients equal those of every carry stored, on packed rows with a gradient horizon too."""
    B, T, H, D, b = 2, 21, 1, 6, 4  # 6 chunks, the last one short; blocks of 3 (√), and 5 + 1
    x = _inputs(7, B, T, H, D, D)
    st = _mlp_state(8, B, H, (D, 8, D))
    seg = _segments(T, last=17)  # a document starting off the chunk grid

    def run(every, horizon):
        rule = TitansRule(memory_chunk=b, remat_every=every, grad_horizon=horizon, grad_clip=1.0)
        return _grads(
            lambda st, *a: titans_mlp_chunked(*a, initial_state=st, rule=rule, segment_ids=seg),
            (st, *x),
        )

    for horizon in (0, 8):
        want = run(1, horizon)
        for every in (0, 5):
            _assert_tree_close(run(every, horizon), want, f"remat_every={every} h={horizon}")


def test_remat_every_stores_fewer_chunk_carries():
    """64 chunks: ⌈√64⌉ = 8 per block stores 8 block carries + 8 inside one block, not 64; at
    least half of the 48 carries' bytes (weights and momenta of both layers, f32) are saved."""
    every, sqrt = _temp_bytes(1024), _temp_bytes(1024, remat_every=0)
    carry = 2 * (16 * 32 + 32 * 16) * 2 * 4  # (W, S) × both layers × H = 2 heads × f32
    assert every - sqrt >= 0.5 * 48 * carry, (every, sqrt)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_value_error_naming_the_argument():
    q, k, v, th, et, al = _inputs(90, 2, 5, 2, 4, 3)
    with pytest.raises(ValueError, match=r"theta must have shape \[B, T, H\]"):
        titans_linear_recurrent(q, k, v, th[..., None], et, al)
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, H, V\]"):
        titans_linear_chunked(q, k, v[:, :4], th, et, al)
    with pytest.raises(ValueError, match=r"k must have shape"):
        titans_linear_chunked(q, k[..., :3], v, th, et, al)
    with pytest.raises(ValueError, match=r"initial_state.M must have shape \[B, H, K, V\]"):
        titans_linear_chunked(q, k, v, th, et, al, initial_state=jnp.zeros((2, 2, 3, 4)))
    with pytest.raises(ValueError, match=r"^TitansRule\.memory_chunk: must be an int >= 1"):
        titans_linear_chunked(q, k, v, th, et, al, rule=TitansRule(memory_chunk=0))
    with pytest.raises(ValueError, match=r"^TitansRule\.grad_clip: must be a float >= 0"):
        titans_linear_recurrent(q, k, v, th, et, al, rule=TitansRule(grad_clip=-1.0))
    with pytest.raises(ValueError, match=r"^titans_linear_chunked: rule must be a TitansRule"):
        titans_linear_chunked(q, k, v, th, et, al, rule={"memory_chunk": 4})
    with pytest.raises(ValueError, match=r"q_t must have shape \[B, H, D\]"):
        titans_linear_step(
            jnp.zeros((2, 2, 4, 3)), q, k[:, 0], v[:, 0], th[:, 0], et[:, 0], al[:, 0]
        )
    st = _mlp_state(0, 2, 2, (4, 8, 3))
    with pytest.raises(
        ValueError, match=r"initial_state.weights\[1\] must have shape \[2, 2, 8, 3\]"
    ):
        bad = TitansMLPState((st.weights[0], st.weights[1][..., :2]), st.momentum)
        titans_mlp_chunked(q, k, v, th, et, al, initial_state=bad)
    with pytest.raises(ValueError, match=r"initial_state.momentum\[0\] must have shape"):
        bad = TitansMLPState(st.weights, (st.momentum[0][:1], st.momentum[1]))
        titans_mlp_recurrent(q, k, v, th, et, al, initial_state=bad)
    with pytest.raises(ValueError, match="residual=True needs K == V"):
        titans_mlp_chunked(q, k, v, th, et, al, initial_state=st, residual=True)
    # the MLP memory has no zero state: a missing initial_state names the constructor
    for fn in (titans_mlp_chunked, titans_mlp_recurrent, ref.chunk_rule, ref.per_token_rule):
        with pytest.raises(ValueError, match=r"initial_state: .*titans_mlp_state\(weights, B\)"):
            fn(q, k, v, th, et, al)
