"""M3 (SPEC §3.5) against an independent float64 numpy implementation; optax's usual contract."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nested_jax.optim.m3 import M3State, default_m3_mask, m3, newton_schulz, scale_by_m3

COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = {"w": (6, 4), "stack": (3, 5, 7), "b": (5,)}


# ------------------------------------------------------------------------------------------------
# Independent reference (float64 numpy, one matrix at a time, written from SPEC §3.5)
# ------------------------------------------------------------------------------------------------


def np_ns(G, steps=5, coeffs=COEFFS, eps=1e-8):
    if G.ndim < 2:
        return G.copy()  # scale_by_m3's documented choice for vectors: no orthogonalisation
    a, b, c = coeffs
    out = np.empty_like(G)
    for idx in np.ndindex(*G.shape[:-2]):
        X = G[idx]
        tall = X.shape[0] > X.shape[1]
        if tall:
            X = X.T
        X = X / (np.sqrt((X * X).sum()) + eps)
        for _ in range(steps):
            A = X @ X.T
            X = a * X + b * (A @ X) + c * (A @ A @ X)
        out[idx] = X.T if tall else X
    return out


def np_rms_direction(o, v, eps, rho):
    """``normalize="rms"`` per matrix (last two axes; whole leaf for ndim < 2), from the module
    docstring: ``D = o / (√V / RMS(√V) + ε)``, direction ``ρ D / RMS(D)``."""
    if o.ndim < 2:
        o, v = o[None], v[None]
        return np_rms_direction(o, v, eps, rho)[0]
    out = np.empty_like(o)
    for idx in np.ndindex(*o.shape[:-2]):
        nu = np.sqrt(v[idx]) / np.sqrt(v[idx].mean())
        d = o[idx] / (nu + eps)
        out[idx] = rho * d / np.sqrt((d * d).mean())
    return out


def np_unit(M):
    if M.ndim < 2:
        return M.copy()
    n = np.sqrt((M * M).sum(axis=(-2, -1), keepdims=True))
    return M / np.where(n > 0, n, 1.0)


class RefM3:
    """Algorithm 1 per leaf; ``ema=True`` is the documented non-paper option; ``rho`` (a float)
    switches to the documented ``normalize="rms"`` variant with ``target_rms = rho``."""

    def __init__(
        self, shape, b1=0.9, b2=0.999, b3=0.9, alpha=1.0, eps=1e-8, k=3, ema=False, rho=None
    ):
        z = lambda: np.zeros(shape, np.float64)
        self.m1, self.m2, self.v, self.B, self.o2 = z(), z(), z(), z(), z()
        self.t = 0
        self.hp = (b1, b2, b3, alpha, eps, k, ema)
        self.rho = rho
        # the variant orthogonalises M / ‖M‖_F (NS's ε then acts at unit scale)
        self.ns = np_ns if rho is None else (lambda M: np_ns(np_unit(M)))

    def step(self, g):
        b1, b2, b3, alpha, eps, k, ema = self.hp
        g = np.asarray(g, np.float64)
        self.t += 1
        if ema:
            self.m1 = b1 * self.m1 + (1 - b1) * g
            self.v = b2 * self.v + (1 - b2) * g * g
            v = self.v / (1 - b2**self.t)
        else:
            self.m1 = self.m1 + b1 * g
            self.v = self.v + b2 * g * g
            v = self.v
        self.B = self.B + g
        o1 = self.ns(self.m1)
        if self.rho is None:
            u = (o1 + alpha * self.o2) / (np.sqrt(v) + eps)
        else:
            u = np_rms_direction(o1 + alpha * self.o2, v, eps, self.rho)
        if self.t % k == 0:
            self.m2 = b3 * self.m2 + (1 - b3) * self.B / k if ema else self.m2 + b3 * self.B
            self.B = np.zeros_like(self.B)
            self.o2 = self.ns(self.m2)
        return u


class RefAdamW:
    def __init__(self, shape, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
        self.mu, self.nu, self.t = np.zeros(shape), np.zeros(shape), 0
        self.hp = (lr, b1, b2, eps, wd)

    def step(self, g, p):
        lr, b1, b2, eps, wd = self.hp
        self.t += 1
        self.mu = b1 * self.mu + (1 - b1) * g
        self.nu = b2 * self.nu + (1 - b2) * g * g
        mh, nh = self.mu / (1 - b1**self.t), self.nu / (1 - b2**self.t)
        return -lr * (mh / (np.sqrt(nh) + eps) + wd * p)


def _grads(steps, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [
        {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(steps)
    ]


def _assert_close(got, want, rtol=2e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=rtol * scale, rtol=rtol)


# ------------------------------------------------------------------------------------------------


def test_newton_schulz_matches_reference_batched_and_tall():
    rng = np.random.default_rng(0)
    for shape in [(5, 7), (7, 5), (3, 5, 7), (2, 2, 6, 4)]:
        G = rng.normal(size=shape).astype(np.float32)
        _assert_close(jax.jit(newton_schulz)(G), np_ns(G.astype(np.float64)), rtol=1e-4)
    np.testing.assert_array_equal(newton_schulz(jnp.zeros((3, 4))), 0.0)
    # NS roughly orthogonalises: singular values pushed into ~[0.5, 1.5] (Muon's quintic)
    s = np.linalg.svd(np.asarray(newton_schulz(rng.normal(size=(16, 32)))), compute_uv=False)
    assert s.min() > 0.4 and s.max() < 1.6
    with pytest.raises(ValueError, match="^G "):
        newton_schulz(jnp.ones(3))


@pytest.mark.parametrize("accumulate", ["additive", "ema"])
def test_scale_by_m3_matches_independent_reference(accumulate):
    ema = accumulate == "ema"
    tx = scale_by_m3(slow_every=3, accumulate=accumulate)
    refs = {k: RefM3(s, k=3, ema=ema) for k, s in SHAPES.items()}
    grads = _grads(7)
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t, g in enumerate(grads, start=1):
        u, state = update(g, state)
        for k in SHAPES:
            _assert_close(u[k], refs[k].step(g[k]))
        assert int(state.count) == t
        # slow buffer is emptied exactly at the slow steps
        emptied = all(np.all(np.asarray(b) == 0) for b in jax.tree.leaves(state.slow_buffer))
        assert emptied == (t % 3 == 0)
    assert isinstance(state, M3State)
    # the slow direction really entered the last steps (guards against a dead O2 branch)
    assert np.abs(np.asarray(state.o2["w"])).max() > 0


# ------------------------------------------------------------------------------------------------
# normalize="rms": the scale-invariant variant (module docstring; not the paper's)
# ------------------------------------------------------------------------------------------------


def _run(tx, grads, c=1.0, params=None):
    """Updates of ``tx`` over ``grads`` with every gradient multiplied by ``c`` (f32)."""
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()} if params is None else params
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for g in grads:
        u, state = update(jax.tree.map(lambda x: x * np.float32(c), g), state, params)
        out.append(jax.tree.map(np.asarray, u))
    return out


@pytest.mark.parametrize("accumulate", ["additive", "ema"])
def test_rms_variant_matches_independent_reference(accumulate):
    ema = accumulate == "ema"
    tx = scale_by_m3(slow_every=3, accumulate=accumulate, normalize="rms", target_rms=0.3)
    refs = {k: RefM3(s, k=3, ema=ema, rho=0.3) for k, s in SHAPES.items()}
    for t, u in enumerate(_run(tx, _grads(7, seed=12))):
        for k in SHAPES:
            _assert_close(u[k], refs[k].step(_grads(7, seed=12)[t][k].astype(np.float64)))
        # every matrix (each slice of the stack) and the vector have RMS exactly ρ
        for x in (u["w"], *u["stack"], u["b"]):
            np.testing.assert_allclose(np.sqrt(np.mean(np.square(x))), 0.3, rtol=1e-5)


@pytest.mark.parametrize("accumulate", ["additive", "ema"])
def test_rms_variant_is_invariant_to_gradient_scale(accumulate):
    """g → c·g for every step (7 steps, slow steps at 3 and 6): the variant's update is unchanged,
    Algorithm 1's (the default) is multiplied by 1/c."""
    grads = _grads(7, seed=13)
    rms = scale_by_m3(slow_every=3, accumulate=accumulate, normalize="rms")
    base = _run(rms, grads)
    for c in (1e-3, 1e3):
        for u, u0 in zip(_run(rms, grads, c), base, strict=True):
            for k in SHAPES:
                _assert_close(u[k], u0[k], rtol=1e-5)
    for c in (2.0**-10, 2.0**10):  # exact scalings: bit-for-bit
        for u, u0 in zip(_run(rms, grads, c), base, strict=True):
            for k in SHAPES:
                np.testing.assert_array_equal(u[k], u0[k])
    # the paper's direction is not invariant: on matrices the step scales like 1/|g| (vectors are
    # not orthogonalised, M/√V is invariant there up to ε)
    paper = scale_by_m3(slow_every=3, accumulate=accumulate)
    p_base = _run(paper, grads)
    for u, u0 in zip(_run(paper, grads, 1e-3), p_base, strict=True):
        for k in ("w", "stack"):
            assert not np.allclose(u[k], u0[k], rtol=1e-2)
            np.testing.assert_allclose(
                u[k], 1e3 * u0[k], rtol=1e-2, atol=1e-2 * np.abs(u0[k]).max()
            )


def test_rms_variant_m3_matrices_invariant_and_lr_scaled():
    """Through m3(): the M3 leaves of the update are −lr · (direction + wd · θ), invariant to c."""
    rng = np.random.default_rng(14)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = _grads(5, seed=15)
    tx = m3(0.01, slow_every=2, normalize="rms", weight_decay=0.1)
    ref = scale_by_m3(slow_every=2, normalize="rms")
    base, ref_u = _run(tx, grads, params=params), _run(ref, grads, params=params)
    for u, r in zip(base, ref_u, strict=True):
        for k in ("w", "stack"):  # matrices; "b" is AdamW's
            _assert_close(u[k], -0.01 * (r[k] + 0.1 * params[k]), rtol=1e-5)
    for c in (1e-3, 1e3):
        for u, u0 in zip(_run(tx, grads, c, params=params), base, strict=True):
            for k in ("w", "stack"):
                _assert_close(u[k], u0[k], rtol=1e-5)


def test_rms_variant_zero_gradients_stay_finite():
    """An all-zero matrix gradient (0/0 inside the normalisations) gives a zero update, not NaN;
    the other leaves are unaffected."""
    grads = _grads(4, seed=16)
    for g in grads:
        g["w"] = np.zeros_like(g["w"])
    out = _run(scale_by_m3(slow_every=2, normalize="rms"), grads)
    for u in out:
        chex.assert_tree_all_finite(u)
        np.testing.assert_array_equal(u["w"], 0.0)
        np.testing.assert_allclose(np.sqrt(np.mean(np.square(u["b"]))), 0.2, rtol=1e-5)


def test_rms_variant_under_inject_hyperparams():
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    grads = _grads(5, seed=17)
    tx = optax.inject_hyperparams(m3)(learning_rate=0.02, slow_every=3, normalize="rms")
    chex.clear_trace_counter()  # chex keys trace counts by definition site, across tests
    fn = jax.jit(chex.assert_max_traces(tx.update, n=1))  # raises when traced a second time
    state, s_first = tx.init(params), None
    want = _run(m3(0.02, slow_every=3, normalize="rms"), grads, params=params)
    for g, w in zip(grads, want, strict=True):
        s_first = state if s_first is None else s_first
        u, state = fn(g, state, params)
        for k in SHAPES:
            _assert_close(u[k], w[k], rtol=1e-5)
    # target_rms is a traced hyperparameter: doubling it doubles the M3 leaves' update
    s_two = s_first._replace(hyperparams={**s_first.hyperparams, "target_rms": jnp.float32(0.4)})
    u1, _ = fn(grads[0], s_first, params)
    u2, _ = fn(grads[0], s_two, params)
    np.testing.assert_allclose(u2["w"], 2 * np.asarray(u1["w"]), rtol=1e-5)
    np.testing.assert_allclose(u2["b"], u1["b"], rtol=1e-6)  # AdamW's leaf is not M3's


def test_rms_variant_toy_regression_trains():
    """The toy 2-layer regression of issue 13 (bench.optim.toy_regression, 300 steps): the
    variant at AdamW-range rates decreases the loss substantially (Algorithm 1 at 3e-3 does not
    train there); with EMA momenta it gets close to AdamW / Muon."""
    from nested_jax.bench.optim import toy_regression

    init, (rms, rms_ema) = toy_regression([("m3_rms", 3e-3), ("m3_rms_ema", 1e-2)])
    assert 1.0 < init < 2.0
    assert rms < 0.4 * init, (init, rms)
    assert rms_ema < 0.02 * init, (init, rms_ema)


def test_alpha_zero_ignores_slow_momentum():
    grads = _grads(5, seed=3)
    outs = {}
    for alpha in (0.0, 1.0):
        tx = scale_by_m3(alpha=alpha, slow_every=2)
        s = tx.init(grads[0])
        update = jax.jit(tx.update)
        for g in grads:
            u, s = update(g, s)
        outs[alpha] = u["w"]
    ref = RefM3(SHAPES["w"], alpha=0.0, k=2)
    for g in grads:
        want = ref.step(g["w"])
    _assert_close(outs[0.0], want)
    assert not np.allclose(outs[0.0], outs[1.0])


def test_m3_alias_matches_reference_with_adam_for_vectors():
    lr, wd = 0.01, 0.1
    tx = m3(lr, slow_every=3, weight_decay=wd)
    rng = np.random.default_rng(5)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    ref_params = {k: v.astype(np.float64) for k, v in params.items()}
    refs = {"w": RefM3(SHAPES["w"]), "stack": RefM3(SHAPES["stack"])}
    adam = RefAdamW(SHAPES["b"], lr, wd=wd)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in _grads(7, seed=6):
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
        want = {k: -lr * (refs[k].step(g[k]) + wd * ref_params[k]) for k in refs}
        want["b"] = adam.step(g["b"].astype(np.float64), ref_params["b"])
        for k in SHAPES:
            _assert_close(u[k], want[k])
            ref_params[k] = ref_params[k] + want[k]
    for k in SHAPES:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-5)


def test_default_mask_sends_embeddings_and_vectors_to_adam():
    params = {
        "embed": {"embedding": jnp.zeros((10, 4))},
        "block": {"w": jnp.zeros((4, 4)), "scale": jnp.zeros(4)},
        "tok_embeddings": jnp.zeros((10, 4)),
        "stacked": jnp.zeros((2, 4, 4)),
    }
    assert default_m3_mask(params) == {
        "embed": {"embedding": False},
        "block": {"w": True, "scale": False},
        "tok_embeddings": False,
        "stacked": True,
    }
    # a custom mask routes an embedding to M3 (its state then holds M3 moments for it)
    tx = m3(0.1, m3_mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    state = tx.init(params)
    m3_state = state.inner_states["m3"].inner_state[0]
    assert m3_state.m1["embed"]["embedding"].shape == (10, 4)


@pytest.mark.parametrize("factory", ["scale_by_m3", "m3"])
def test_jits_once_across_slow_and_fast_steps(factory):
    tx = scale_by_m3(slow_every=3) if factory == "scale_by_m3" else m3(0.01, slow_every=3)
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    state = tx.init(params)
    chex.clear_trace_counter()  # chex keys trace counts by definition site, across tests
    fn = jax.jit(chex.assert_max_traces(tx.update, n=1))  # raises when traced a second time
    for g in _grads(7, seed=7):
        _, state = fn(g, state, params)
    assert fn._cache_size() == 1


def test_bf16_params_keep_dtype():
    params = {k: jnp.ones(s, jnp.bfloat16) for k, s in SHAPES.items()}
    grads = [jax.tree.map(lambda x: x.astype(jnp.bfloat16), g) for g in _grads(4, seed=8)]
    for tx in (m3(0.01, slow_every=2), scale_by_m3(slow_every=2)):
        state = tx.init(params)
        update = jax.jit(tx.update)
        for g in grads:
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
        chex.assert_tree_all_finite(params)
    # moments stay f32 by default; state_dtype=None keeps the parameter dtype, also when the
    # hyperparameters are injected as f32 arrays (which would otherwise promote the state)
    assert scale_by_m3().init(params).v["w"].dtype == jnp.float32
    for tx in (
        scale_by_m3(state_dtype=None),
        optax.inject_hyperparams(scale_by_m3, hyperparam_dtype=jnp.float32)(
            state_dtype=None, slow_every=2
        ),
    ):
        state = tx.init(params)
        update = jax.jit(tx.update)
        for g in grads:
            u, state = update(g, state)
        inner = getattr(state, "inner_state", state)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(inner)[1:])
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))


def test_works_under_inject_hyperparams():
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    grads = _grads(5, seed=9)
    tx = optax.inject_hyperparams(m3)(learning_rate=0.02, slow_every=3)
    plain = m3(0.02, slow_every=3)
    s_inj, s_plain = tx.init(params), plain.init(params)
    chex.clear_trace_counter()  # chex keys trace counts by definition site, across tests
    fn = jax.jit(chex.assert_max_traces(tx.update, n=1))  # raises when traced a second time
    plain_update = jax.jit(plain.update)
    for g in grads:
        u_inj, s_inj = fn(g, s_inj, params)
        u_plain, s_plain = plain_update(g, s_plain, params)
        for k in SHAPES:
            _assert_close(u_inj[k], u_plain[k], rtol=1e-5)
    # change the learning rate in the state: same compiled function, updates scale with it
    s_half = s_inj._replace(
        hyperparams={**s_inj.hyperparams, "learning_rate": 0.5 * s_inj.hyperparams["learning_rate"]}
    )
    g = grads[0]
    u_full, _ = fn(g, s_inj, params)
    u_half, _ = fn(g, s_half, params)
    for k in SHAPES:
        np.testing.assert_allclose(u_half[k], 0.5 * np.asarray(u_full[k]), rtol=1e-5, atol=1e-8)
    # the scale_by_m3 transform alone too (slow_every, ns_steps become traced hyperparameters)
    tx2 = optax.inject_hyperparams(scale_by_m3)(slow_every=3)
    s2 = tx2.init(params)
    ref = RefM3(SHAPES["w"], k=3)
    update2 = jax.jit(tx2.update)
    for g in grads:
        u2, s2 = update2(g, s2)
        _assert_close(u2["w"], ref.step(g["w"]))


SHARD_SHAPES = {"w": (16, 8), "stack": (2, 8, 16), "b": (8,)}
SPECS = {"w": P("x", None), "stack": P(None, None, "x"), "b": P("x")}


def _shard_tx(factory):
    return {
        "scale_by_m3": lambda: scale_by_m3(slow_every=2),
        "m3": lambda: m3(0.01, slow_every=2),
        "m3_rms": lambda: m3(0.01, slow_every=2, normalize="rms"),
    }[factory]()


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("factory", ["scale_by_m3", "m3", "m3_rms"])
def test_state_shards_like_params(axis_type, factory):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
    tx = _shard_tx(factory)
    with jax.set_mesh(mesh):
        params = {
            k: jax.device_put(jnp.ones(s), NamedSharding(mesh, SPECS[k]))
            for k, s in SHARD_SHAPES.items()
        }
        grads = [
            {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in g.items()}
            for g in _grads(3, seed=10, shapes=SHARD_SHAPES)
        ]
        state = jax.jit(tx.init)(params)
        update = jax.jit(tx.update)
        states, ups = [state], []
        for g in grads:  # steps 1..3 include a slow step (2)
            u, state = update(g, state, params)
            states.append(state)
            ups.append(u)
    # same values as on one device
    host = lambda t: jax.tree.map(lambda x: np.asarray(jax.device_get(x)), t)
    want = _run(_shard_tx(factory), host(grads), params=host(params))
    for got, w in zip(ups, want, strict=True):
        for k in SHARD_SHAPES:
            _assert_close(np.asarray(got[k]), w[k], rtol=1e-5)

    def m3_state(s):
        return s if factory == "scale_by_m3" else s.inner_states["m3"].inner_state[0]

    checked = 0
    for s in states:
        ms = m3_state(s)
        for field in ("m1", "v", "m2", "slow_buffer", "o2"):
            for k, p in params.items():
                leaf = getattr(ms, field)[k]
                if isinstance(leaf, optax.MaskedNode):
                    continue
                assert leaf.sharding.is_equivalent_to(p.sharding, p.ndim), (field, k)
                checked += 1
    assert checked >= (3 if factory == "scale_by_m3" else 2) * 5 * 4
    for k, p in params.items():
        assert u[k].sharding.is_equivalent_to(p.sharding, p.ndim), k


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"accumulate": "mean"}, "accumulate"),
        ({"slow_every": 0}, "slow_every"),
        ({"slow_every": 2.5}, "slow_every"),
        ({"ns_steps": -1}, "ns_steps"),
        ({"ns_coeffs": (1.0, 2.0)}, "ns_coeffs"),
        ({"normalize": "l2"}, "normalize"),
        ({"normalize": None}, "normalize"),
        ({"target_rms": 0.0}, "target_rms"),
        ({"target_rms": -0.2}, "target_rms"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        scale_by_m3(**kwargs)


def test_config_factory():
    from types import SimpleNamespace

    from nested_jax.optim import m3_from_config

    cfg = SimpleNamespace(
        weight_decay=0.1,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        extra={"slow_every": 3, "ns_coeffs": [3.4445, -4.775, 2.0315]},
    )
    tx = m3_from_config(cfg, optax.constant_schedule(0.01))
    ref = m3(
        0.01,
        slow_every=3,
        weight_decay=0.1,
        adam_b2=0.95,
        weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
    )
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    s, rs = tx.init(params), ref.init(params)
    upd, rupd = jax.jit(tx.update), jax.jit(ref.update)
    for g in _grads(4, seed=11):
        u, s = upd(g, s, params)
        ru, rs = rupd(g, rs, params)
    for k in SHAPES:
        np.testing.assert_allclose(u[k], ru[k], rtol=1e-6)
    with pytest.raises(ValueError, match=r"optimizer.extra: unknown m3 option\(s\) \['lr'\]"):
        m3_from_config(SimpleNamespace(**{**vars(cfg), "extra": {"lr": 1.0}}), 0.01)
    # the scale-invariant variant is selected by optimizer.extra; a bad value names the key
    rms = m3_from_config(
        SimpleNamespace(**{**vars(cfg), "extra": {"normalize": "rms", "target_rms": 0.3}}), 0.01
    )
    ref = m3(
        0.01,
        normalize="rms",
        target_rms=0.3,
        weight_decay=0.1,
        adam_b2=0.95,
        weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
    )
    g3 = _grads(3, seed=18)
    for u, r in zip(_run(rms, g3, params=params), _run(ref, g3, params=params), strict=True):
        for k in SHAPES:
            np.testing.assert_allclose(u[k], r[k], rtol=1e-6)
    with pytest.raises(ValueError, match="^optimizer.extra.normalize must be one of"):
        m3_from_config(SimpleNamespace(**{**vars(cfg), "extra": {"normalize": "l2"}}), 0.01)


def test_training_config_selects_rms_variant():
    from nested_jax.train.config import load_config
    from nested_jax.train.optimizer import build_optimizer

    cfg = load_config(
        [], ["optimizer.name=m3", "optimizer.extra={normalize: rms, target_rms: 0.3}"]
    )
    tx, _ = build_optimizer(cfg.optimizer, 10)
    params = {k: jnp.ones(s) for k, s in SHAPES.items()}
    u = _run(tx, _grads(2, seed=19), params=params)[-1]
    chex.assert_tree_all_finite(u)
    bad = load_config([], ["optimizer.name=m3", "optimizer.extra={normalize: nope}"])
    with pytest.raises(ValueError, match="normalize"):
        build_optimizer(bad.optimizer, 10)


def test_config_adam_lr_scale_runs_the_adam_branch_at_a_multiple_of_the_m3_rate():
    from types import SimpleNamespace

    from nested_jax.optim import m3_from_config

    cfg = SimpleNamespace(
        weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8, extra={"adam_lr_scale": 30.0}
    )
    sched = optax.linear_schedule(1e-4, 2e-4, 10)
    tx = m3_from_config(cfg, sched)
    params = {"w": jnp.ones((4, 6)), "bias": jnp.ones((6,))}
    ref_adam = optax.adamw(lambda step: 30.0 * sched(step), 0.9, 0.95, 1e-8, weight_decay=0.0)
    ref_m3 = m3_from_config(SimpleNamespace(**{**vars(cfg), "extra": {}}), sched)
    s, sa, sm = tx.init(params), ref_adam.init({"bias": params["bias"]}), ref_m3.init(params)
    for g in _grads(3, seed=5, shapes={"w": (4, 6), "bias": (6,)}):
        u, s = tx.update(g, s, params)
        ua, sa = ref_adam.update({"bias": g["bias"]}, sa, {"bias": params["bias"]})
        um, sm = ref_m3.update(g, sm, params)
        np.testing.assert_allclose(u["bias"], ua["bias"], rtol=1e-6)  # Adam at 30x the schedule
        np.testing.assert_allclose(u["w"], um["w"], rtol=1e-6)  # the M3 matrices are unchanged
    for bad in (0, -1.0, "big", True):
        with pytest.raises(ValueError, match=r"optimizer.extra.adam_lr_scale must be a number > 0"):
            m3_from_config(SimpleNamespace(**{**vars(cfg), "extra": {"adam_lr_scale": bad}}), sched)
