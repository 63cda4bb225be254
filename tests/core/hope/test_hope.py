"""Hope self-modifying memories (SPEC §3.2): chunked == the package's independent per-token twin
``nested_jax.core.hope.reference`` (values and gradients), chunk semantics, linear chunk update ==
gated delta rule, one test per ablation flag."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.associative.forms import gated_delta_recurrent
from nested_jax.core.dgd import dgd_update
from nested_jax.core.hope.chunk import hope_chunked
from nested_jax.core.hope.linear import hope_linear_chunk_update
from nested_jax.core.hope.reference import hope_reference
from nested_jax.core.hope.state import (
    HopeMemories,
    HopeReadout,
    HopeState,
    MLPMemory,
    hope_init_state,
)
from nested_jax.core.hope.token import hope_decode_step, hope_recurrent
from nested_jax.rules import HopeRule

B, T, H, D, HID = 2, 6, 2, 4, 3
TOL = 2e-5


def _setup(adaptive_q=False, seed=0, t=T):
    ks = jax.random.split(jax.random.PRNGKey(seed), 16)
    names = list(HopeMemories._fields[:5]) + (["q"] if adaptive_q else [])
    mems = HopeMemories(
        **{
            n: MLPMemory(
                0.2 * jax.random.normal(ks[i], (H, D, HID)),
                0.2 * jax.random.normal(ks[i + 6], (H, HID, D)),
            )
            for i, n in enumerate(names)
        }
    )
    ro = HopeReadout(
        jax.random.normal(ks[12], (H, D)),
        jnp.full((H,), -1.0),  # η ≈ 0.27: keeps decay=False runs finite at T=6
        jax.random.normal(ks[13], (H, D)),
        jnp.full((H,), 1.0),
    )
    x = jax.random.normal(ks[14], (B, t, H, D))
    q = jax.random.normal(ks[15], (B, t, H, D))
    return mems, ro, x, q


def _ref(x, q, mems, ro, momentum=False, segment_ids=None, **fields):
    """The twin's ``(o, final memories as a dict name -> (w1, w2))`` under
    ``HopeRule(momentum=momentum, **fields)``."""
    st = hope_init_state(mems, x.shape[0], momentum=momentum)
    rule = HopeRule(momentum=momentum, **fields)
    o, st_ref = hope_reference(x, q, ro, initial_state=st, rule=rule, segment_ids=segment_ids)
    names = [n for n in HopeMemories._fields if getattr(mems, n) is not None]
    return o, {n: tuple(getattr(st_ref.memories, n)) for n in names}


def _ours(x, q, mems, ro, momentum=False, **fields):
    return _jit_ours(HopeRule(momentum=momentum, **fields))(x, q, mems, ro)


@functools.cache
def _jit_ours(rule):
    """One compiled hope_chunked per rule, shared by the tests (CPU time budget)."""

    def f(x, q, mems, ro):
        st = hope_init_state(mems, x.shape[0], momentum=rule.momentum)
        return hope_chunked(x, q, ro, initial_state=st, rule=rule)

    return jax.jit(f)


def _close(a, b, tol=TOL):
    """Max abs error ≤ tol relative to the reference's scale (SPEC §0)."""
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(b).all() and np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())), rtol=0)


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"momentum": True, "momentum_coef": 0.7},
        pytest.param(
            {"adaptive_q": True, "step": "paper", "stop_gradient_targets": True, "decay": False},
            marks=pytest.mark.slow,
        ),
        pytest.param({"dgd": False, "inner_k": False, "inner_v": False}, marks=pytest.mark.slow),
    ],
)
def test_chunk1_equals_reference_values(flags):
    mems, ro, x, q = _setup(adaptive_q=flags.get("adaptive_q", False))
    o, st = _ours(x, q, mems, ro, **flags)
    o_ref, m_ref = _ref(x, q, mems, ro, **flags)
    _close(o, o_ref)
    for n, (w1, w2) in m_ref.items():
        _close(getattr(st.memories, n).w1, w1)
        _close(getattr(st.memories, n).w2, w2)
    o_rec, _ = hope_recurrent(
        x,
        q,
        ro,
        initial_state=hope_init_state(mems, B, momentum=flags.get("momentum", False)),
        rule=HopeRule(**flags),
    )
    _close(o_rec, o, 1e-6)


def test_the_default_rule_is_the_papers_per_token_rule():
    """``HopeRule()`` is the plain rule of SPEC §3.2 (per token, no momentum, no bounds, no
    remat, the token-by-token updates), and ``hope_chunked`` with its default rule equals the
    twin ``hope_reference`` with its default rule."""
    paper = dict(chunk_memory=1, chunk_other=1, dgd=True, dgd_target="gradient", step="exact",
                 momentum=False, decay=True, inner_k=True, inner_v=True, inner_q=True,
                 adaptive_q=False, stop_gradient_targets=False, grad_horizon=0, remat=False,
                 chunk_updates="scan", eta_max=1.0, grad_clip=0.0)  # fmt: skip
    assert {n: getattr(HopeRule(), n) for n in paper} == paper
    mems, ro, x, q = _setup(seed=3)
    st = hope_init_state(mems, B)
    o, final = jax.jit(lambda x, q: hope_chunked(x, q, ro, initial_state=st))(x, q)
    o_ref, final_ref = hope_reference(x, q, ro, initial_state=st)
    _close(o, o_ref)
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(final_ref), strict=True):
        _close(a, b)
    assert final.momentum is None and final_ref.momentum is None


@pytest.mark.parametrize(
    "cm,co",
    [
        (2, 4),
        (3, 1),
        pytest.param(1, 2, marks=pytest.mark.slow),
        pytest.param(4, 4, marks=pytest.mark.slow),
    ],
)
def test_chunked_equals_reference_with_snapshots(cm, co):
    """T=6 is not a multiple of 4: the padded tail must not touch the final state."""
    mems, ro, x, q = _setup()
    o, st = _ours(x, q, mems, ro, chunk_memory=cm, chunk_other=co)
    o_ref, m_ref = _ref(x, q, mems, ro, chunk_memory=cm, chunk_other=co)
    _close(o, o_ref)
    for n, (w1, w2) in m_ref.items():
        _close(getattr(st.memories, n).w1, w1)
        _close(getattr(st.memories, n).w2, w2)
    # chunking is a real approximation: it differs from per-token Hope
    o1, _ = _ours(x, q, mems, ro)
    assert float(jnp.abs(o1 - o).max()) > 1e-4


@pytest.mark.parametrize(
    "chunks", [{}, pytest.param({"chunk_memory": 2, "chunk_other": 1}, marks=pytest.mark.slow)]
)
def test_chunked_equals_reference_gradients(chunks):
    mems, ro, x, q = _setup(seed=1)
    x, q = x[:, :4], q[:, :4]  # 4 tokens keep the eager reference's backward pass cheap
    r = jax.random.normal(jax.random.PRNGKey(7), x.shape)

    def loss_ours(x, q, mems, ro):
        o, st = _ours(x, q, mems, ro, momentum=True, momentum_coef=0.5, **chunks)
        return jnp.sum(o * r) + jnp.sum(st.memories.memory.w1) + jnp.sum(st.memories.k.w2**2)

    def loss_ref(x, q, mems, ro):
        o, m = _ref(x, q, mems, ro, momentum=True, momentum_coef=0.5, **chunks)
        return jnp.sum(o * r) + jnp.sum(m["memory"][0]) + jnp.sum(m["k"][1] ** 2)

    g_ours = jax.jit(jax.grad(loss_ours, argnums=(0, 1, 2, 3)))(x, q, mems, ro)
    g_ref = (jax.grad(loss_ref, argnums=(0, 1, 2, 3)))(x, q, mems, ro)
    flat_o, flat_r = jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)
    assert len(flat_o) == len(flat_r)
    for a, b in zip(flat_o, flat_r, strict=True):
        _close(a, b, 1e-4)
    assert all(float(jnp.abs(a).max()) > 0 for a in flat_o)  # gradients flow through the writes


# T = 13: not a multiple of 2 or 4. Row 0: documents start at 5 and 6 (mid-chunk, twice in one
# chunk of 4); row 1: at 8 (a chunk start of both groups).
TWIN_T = 13
TWIN_SEG = np.array([[0] * 5 + [1] + [2] * 7, [7] * 8 + [9] * 5], np.int32)


# Unoptimised XLA backend (as in test_titans.py): compile time dominates, f32 either way.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _value_and_vjp(fn, args, cotangent, **kw):
    """``fn(*args, **kw)`` and its VJP with ``cotangent``, one call compiled with FAST_COMPILE."""

    def run(args, cotangent):
        out, pull = jax.vjp(lambda *a: fn(*a, **kw), *args)
        return out, pull(cotangent)

    return jax.jit(run).lower(args, cotangent).compile(FAST_COMPILE)(args, cotangent)


@pytest.mark.parametrize(
    "cm,co,momentum,packed",
    [
        pytest.param(4, 2, False, True, id="c4,2-packed"),
        pytest.param(4, 2, True, False, id="c4,2-momentum", marks=pytest.mark.slow),
        pytest.param(1, 1, True, True, id="c1-momentum-packed", marks=pytest.mark.slow),
        pytest.param(1, 1, False, False, id="c1", marks=pytest.mark.slow),
    ],
)  # two fwd+bwd compiles per case (15-30 s CPU), so one case by default; chunk size 1 against the
# twin by default: test_chunk1_equals_reference_values, test_chunked_equals_reference_gradients
def test_package_twin_equals_chunked_values_and_gradients(cm, co, momentum, packed):
    """The package twin (``core.hope.reference``: a per-token scan with ``jax.grad`` inner
    gradients, no code shared with ``hope_chunked``) == ``hope_chunked`` at chunk sizes 1 and
    (chunk_memory=4, chunk_other=2), T=13: outputs, final memories and momenta, and the VJP of all
    of them w.r.t. x, q, the initial memories (and momenta) and the readout."""
    mems, ro, x, q = _setup(seed=5, t=TWIN_T)
    st = hope_init_state(mems, B, momentum=momentum)
    rule = HopeRule(chunk_memory=cm, chunk_other=co, momentum=momentum, momentum_coef=0.6)
    kw = dict(rule=rule)
    if packed:
        kw["segment_ids"] = jnp.asarray(TWIN_SEG)
    args = (x, q, ro, st)  # the state is the keyword initial_state; last here for the VJP

    def seq(fn):
        return lambda x, q, ro, st, **kw: fn(x, q, ro, initial_state=st, **kw)

    out_shape = jax.eval_shape(lambda *a: seq(hope_reference)(*a, **kw), *args)
    rng = np.random.default_rng(11)
    ct = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), out_shape)
    out_c, g_c = _value_and_vjp(seq(hope_chunked), args, ct, **kw)
    out_r, g_r = _value_and_vjp(seq(hope_reference), args, ct, **kw)
    assert jax.tree.structure(out_c) == jax.tree.structure(out_r)
    for a, b in zip(jax.tree.leaves(out_c), jax.tree.leaves(out_r), strict=True):
        _close(a, b)  # measured ≈ 1e-7
    flat_c, flat_r = jax.tree.leaves(g_c), jax.tree.leaves(g_r)
    assert len(flat_c) == len(flat_r) == len(jax.tree.leaves(args))
    for a, b in zip(flat_c, flat_r, strict=True):
        _close(a, b)  # measured ≈ 3e-7
    # gradients reach the initial memories through every write
    assert all(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g_c[3].memories))


def test_causality():
    mems, ro, x, q = _setup()
    o, _ = _ours(x, q, mems, ro, chunk_memory=2, chunk_other=4)
    o2, _ = _ours(
        x.at[:, 4:].add(1.0), q.at[:, 4:].add(1.0), mems, ro, chunk_memory=2, chunk_other=4
    )
    _close(o[:, :4], o2[:, :4], 0)
    assert float(jnp.abs(o[:, 4:] - o2[:, 4:]).max()) > 1e-4


# ------------------------------------------------ linear memories == gated delta rule


# one compiled kernel per step rule, shared by the linear tests (same shapes)
_kernel = jax.jit(hope_linear_chunk_update, static_argnames=("rule", "chunk_size"))
LB, LT, LH, LK, LV = 2, 7, 3, 5, 6


@functools.partial(jax.jit, static_argnames="step")
def _direct_linear(M0, k, v_hat, alpha, eta, step):
    M = M0
    M0k = jnp.einsum("bhvk,bthk->bthv", M0, k)
    for t in range(k.shape[1]):
        M = dgd_update(M, k[:, t], M0k[:, t] - v_hat[:, t], eta[:, t], alpha[:, t], step=step)
    return M


@pytest.mark.parametrize("step", ["exact", "paper"])
def test_linear_chunk_update_equals_dgd_loop(step):
    ks = jax.random.split(jax.random.PRNGKey(3), 6)
    Bl, Tl, Hl, K, V = LB, LT, LH, LK, LV
    M0 = jax.random.normal(ks[0], (Bl, Hl, V, K))
    k = jax.random.normal(ks[1], (Bl, Tl, Hl, K)) * 0.6
    v = jax.random.normal(ks[2], (Bl, Tl, Hl, K))
    v_hat = jnp.einsum("bhvk,bthk->bthv", M0, v)  # self-generated targets M0 v
    alpha = jax.nn.sigmoid(jax.random.normal(ks[3], (Bl, Tl, Hl)) + 2.0)
    eta = 2.0 * jax.nn.sigmoid(jax.random.normal(ks[4], (Bl, Tl, Hl)))  # β = γ/α may exceed 1
    got = _kernel(M0, k, v_hat, alpha, eta, rule=HopeRule(step=step), chunk_size=4)
    _close(got, _direct_linear(M0, k, v_hat, alpha, eta, step), 1e-4)
    # arbitrary targets too
    vh2 = jax.random.normal(ks[5], (Bl, Tl, Hl, V))
    got2 = _kernel(M0, k, vh2, alpha, eta, rule=HopeRule(step=step), chunk_size=4)
    _close(got2, _direct_linear(M0, k, vh2, alpha, eta, step), 1e-4)


def test_gated_delta_rule_is_a_linear_hope_chunk():
    """The other way: any GDN run (k, v, g, β) is a Hope linear chunk with α = e^g,
    γ = αβ (η = γ/(1 − γ‖k‖²)) and targets v̂ = M_0 k + v/α."""
    ks = jax.random.split(jax.random.PRNGKey(4), 5)
    Bl, Tl, Hl, K, V = LB, LT, LH, LK, LV
    k = jax.random.normal(ks[0], (Bl, Tl, Hl, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[1], (Bl, Tl, Hl, V))
    g = -jax.nn.softplus(jax.random.normal(ks[2], (Bl, Tl, Hl)))
    beta = 0.8 * jax.nn.sigmoid(jax.random.normal(ks[3], (Bl, Tl, Hl)))
    S0 = jax.random.normal(ks[4], (Bl, Hl, K, V))
    _, S = gated_delta_recurrent(k, k, v, g, beta, initial_state=S0)
    M0 = jnp.swapaxes(S0, -1, -2)
    alpha = jnp.exp(g)
    gamma = alpha * beta
    eta = gamma / (1.0 - gamma)  # ‖k‖ = 1
    v_hat = jnp.einsum("bhvk,bthk->bthv", M0, k) + v / alpha[..., None]
    _close(_direct_linear(M0, k, v_hat, alpha, eta, "exact"), jnp.swapaxes(S, -1, -2), 1e-4)
    got = _kernel(M0, k, v_hat, alpha, eta, rule=HopeRule(), chunk_size=4)
    _close(got, jnp.swapaxes(S, -1, -2), 1e-4)


# ---------------------------------------------------------------- ablation flags


def _moved(st0, st1, n):
    a, b = getattr(st0.memories, n), getattr(st1.memories, n)
    return float(jnp.abs(a.w1 - b.w1).max() + jnp.abs(a.w2 - b.w2).max()) > 1e-6


@pytest.mark.parametrize("flag", ["inner_k", "inner_v", "inner_q"])
def test_inner_flags_freeze_only_their_memory(flag):
    adaptive_q = flag == "inner_q"
    mems, ro, x, q = _setup(adaptive_q=adaptive_q)
    st0 = hope_init_state(mems, B)
    rule = HopeRule(adaptive_q=adaptive_q, chunk_other=2)
    _, on = hope_chunked(x, q, ro, initial_state=st0, rule=rule)
    off_rule = dataclasses.replace(rule, **{flag: False})
    _, off = hope_chunked(x, q, ro, initial_state=st0, rule=off_rule)
    name = flag.split("_")[1]
    assert _moved(st0, on, name)
    assert not _moved(st0, off, name)
    for n in HopeMemories._fields:
        if n != name and getattr(mems, n) is not None:
            assert _moved(st0, off, n), n


def test_dgd_false_is_plain_gd_with_retention():
    """One token by hand: W_new = α W − η g xᵀ (no W x xᵀ term) vs DGD's α W − γ(W x + g) xᵀ."""
    mems, ro, x, q = _setup()
    x1, q1 = x[:, :1], q[:, :1]
    st0 = hope_init_state(mems, B)
    _, gd = hope_chunked(x1, q1, ro, initial_state=st0, rule=HopeRule(dgd=False))
    _, dg = hope_chunked(x1, q1, ro, initial_state=st0)
    act = jax.nn.silu
    m = lambda mm, z: (
        z + jnp.einsum("bhdk,bhk->bhd", mm.w1, act(jnp.einsum("bhkd,bhd->bhk", mm.w2, z)))
    )  # noqa: E731
    M = st0.memories
    k = m(M.k, x1[:, 0])
    k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    v = m(M.v, x1[:, 0])
    eta = jax.nn.sigmoid(jnp.einsum("bhd,hd->bh", m(M.eta, x1[:, 0]), ro.eta_w) + ro.eta_b)
    alpha = jax.nn.sigmoid(jnp.einsum("bhd,hd->bh", m(M.alpha, x1[:, 0]), ro.alpha_w) + ro.alpha_b)
    W1, W2 = M.memory
    s = act(jnp.einsum("bhkd,bhd->bhk", W2, k))
    e = m(M.memory, k) - m(M.memory, v)
    expected = (
        alpha[..., None, None] * W1 - eta[..., None, None] * e[..., :, None] * s[..., None, :]
    )
    _close(gd.memories.memory.w1, expected, 1e-5)
    gamma = eta / (1 + eta * jnp.sum(s * s, -1))
    W1s = jnp.einsum("bhdk,bhk->bhd", W1, s)
    expected_dgd = (
        alpha[..., None, None] * W1
        - gamma[..., None, None] * (W1s + e)[..., :, None] * s[..., None, :]
    )
    _close(dg.memories.memory.w1, expected_dgd, 1e-5)
    # and over a sequence it equals the reference's plain GD
    o, st = _ours(x, q, mems, ro, dgd=False, chunk_memory=2)
    o_ref, _ = _ref(x, q, mems, ro, dgd=False, chunk_memory=2)
    _close(o, o_ref)


def test_decay_false_gives_unit_retention():
    mems, ro, x, q = _setup()
    ro2 = ro._replace(alpha_w=-ro.alpha_w, alpha_b=ro.alpha_b - 2.0)
    # decay=False: M_α's readout (hence α) no longer matters ...
    o_off, _ = _ours(x, q, mems, ro, decay=False)
    o_off2, _ = _ours(x, q, mems, ro2, decay=False)
    _close(o_off, o_off2, 0)
    # ... and it is α = 1: an α readout saturated at 1 (bias +1e4) with decay on gives the same run
    o_one, _ = _ours(x, q, mems, ro._replace(alpha_w=0 * ro.alpha_w, alpha_b=ro.alpha_b + 1e4))
    _close(o_off, o_one, 1e-6)
    # with decay the α readout does matter
    o_on, _ = _ours(x, q, mems, ro)
    o_on2, _ = _ours(x, q, mems, ro2)
    assert float(jnp.abs(o_on - o_on2).max()) > 1e-4


def test_momentum_flag():
    mems, ro, x, q = _setup()
    o_plain, st_plain = _ours(x, q, mems, ro)
    o_mu0, st_mu0 = _ours(x, q, mems, ro, momentum=True, momentum_coef=0.0)
    _close(o_mu0, o_plain, 1e-6)
    _close(st_mu0.memories.memory.w1, st_plain.memories.memory.w1, 1e-6)
    o_mu, st_mu = _ours(x, q, mems, ro, momentum=True, momentum_coef=0.9)
    # momenta start at zero: the first write (read at t=1) is identical, later ones differ
    _close(o_mu[:, :2], o_plain[:, :2], 1e-6)
    assert float(jnp.abs(o_mu[:, 2:] - o_plain[:, 2:]).max()) > 1e-4
    assert isinstance(st_mu, HopeState) and st_mu.momentum is not None
    assert st_plain.momentum is None


# ---------------------------------------------------------------- validation


def test_bad_shapes_raise_naming_the_argument():
    mems, ro, x, q = _setup()
    st = hope_init_state(mems, B)
    with pytest.raises(ValueError, match="x must"):
        hope_chunked(x[0], q, ro, initial_state=st)
    with pytest.raises(ValueError, match="q must"):
        hope_chunked(x, q[:, :, :, :3], ro, initial_state=st)
    with pytest.raises(ValueError, match=r"^HopeRule\.chunk_memory"):
        hope_chunked(x, q, ro, initial_state=st, rule=HopeRule(chunk_memory=3, chunk_other=2))
    with pytest.raises(ValueError, match=r"^HopeRule\.chunk_other"):
        hope_chunked(x, q, ro, initial_state=st, rule=HopeRule(chunk_other=0))
    with pytest.raises(ValueError, match=r"^hope_chunked: rule must be a HopeRule, got dict"):
        hope_chunked(x, q, ro, initial_state=st, rule={"chunk_memory": 2})
    with pytest.raises(ValueError, match="readout.eta_w"):
        hope_chunked(x, q, ro._replace(eta_w=ro.eta_w[:, :2]), initial_state=st)
    with pytest.raises(ValueError, match="state.memories.v.w2"):
        bad = st.memories._replace(v=MLPMemory(st.memories.v.w1, st.memories.v.w2[..., :2]))
        hope_chunked(x, q, ro, initial_state=st._replace(memories=bad))
    with pytest.raises(ValueError, match="state.memories.q"):
        hope_chunked(x, None, ro, initial_state=st, rule=HopeRule(adaptive_q=True))
    with pytest.raises(ValueError, match="state.momentum"):
        hope_chunked(x, q, ro, initial_state=st, rule=HopeRule(momentum=True))
    # Hope's memories have no zero state: a missing initial_state names the constructor
    for fn in (hope_chunked, hope_recurrent, hope_reference):
        with pytest.raises(ValueError, match=r"initial_state: .*hope_init_state\(memories, B\)"):
            fn(x, q, ro)
    with pytest.raises(ValueError, match="memories.k.w1"):
        hope_init_state(mems._replace(k=MLPMemory(mems.k.w1[0], mems.k.w2)), B)
    M0 = jnp.zeros((1, 2, 3, 4))
    k = jnp.zeros((1, 5, 2, 4))
    with pytest.raises(ValueError, match="v_hat"):
        hope_linear_chunk_update(
            M0, k, jnp.zeros((1, 5, 2, 4)), jnp.ones((1, 5, 2)), jnp.ones((1, 5, 2))
        )
    with pytest.raises(ValueError, match="alpha"):
        hope_linear_chunk_update(
            M0, k, jnp.zeros((1, 5, 2, 3)), jnp.ones((1, 5)), jnp.ones((1, 5, 2))
        )
    # the gated delta form computes the plain DGD step only
    with pytest.raises(ValueError, match=r"^hope_linear_chunk_update: rule\.momentum must be"):
        hope_linear_chunk_update(
            M0, k, jnp.zeros((1, 5, 2, 3)), jnp.ones((1, 5, 2)), jnp.ones((1, 5, 2)),
            rule=HopeRule(momentum=True),
        )  # fmt: skip


@pytest.mark.slow
def test_stop_gradient_targets_changes_only_gradients():
    mems, ro, x, q = _setup()
    o, st = _ours(x, q, mems, ro)
    o_sg, st_sg = _ours(x, q, mems, ro, stop_gradient_targets=True)
    _close(o_sg, o, 0)
    _close(st_sg.memories.memory.w1, st.memories.memory.w1, 0)

    def loss(mems, sg):
        return jnp.sum(_ours(x, q, mems, ro, stop_gradient_targets=sg)[0] ** 2)

    g, g_sg = jax.grad(loss)(mems, False), jax.grad(loss)(mems, True)
    diff = max(
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_sg), strict=True)
    )
    assert diff > 1e-6


# ---------------------------------------------------------------- packed rows, decoding, horizon

SEG = np.array([[1, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 6]], np.int32)  # starts mid-chunk and at 5


def _ref_packed(x, q, mems, ro, seg, cm, co, momentum=False, **flags):
    """The per-token twin with resets: at a document start the running memories (and momenta) and
    every snapshot become the initial memories; snapshots are refreshed from the running memories
    at multiples of each group's chunk size."""
    seg = jnp.asarray(seg)
    return _ref(x, q, mems, ro, momentum, chunk_memory=cm, chunk_other=co, segment_ids=seg, **flags)


def test_packed_rows_reset_to_initial_memories():
    """hope_chunked(segment_ids) == the per-token reference with resets (chunks 4 and 2, with
    momentum); a later document of a row does not see the earlier one."""
    mems, ro, x, q = _setup()
    flags = dict(momentum=True, momentum_coef=0.5)
    seg = jnp.asarray(SEG)

    rule = HopeRule(chunk_memory=4, chunk_other=2, **flags)

    @jax.jit
    def run(x, q, seg):
        st = hope_init_state(mems, x.shape[0], momentum=True)
        return hope_chunked(x, q, ro, initial_state=st, rule=rule, segment_ids=seg)

    o, st = run(x, q, seg)
    o_ref, m_ref = _ref_packed(x, q, mems, ro, SEG, 4, 2, **flags)
    _close(o, o_ref)
    for n, (w1, w2) in m_ref.items():
        _close(getattr(st.memories, n).w1, w1)
        _close(getattr(st.memories, n).w2, w2)
    # documents are isolated: another first document leaves row 0's second document unchanged
    o_other, _ = run(x.at[0, :3].add(1.0), q.at[0, :3].add(1.0), seg)
    _close(o_other[0, 3:], o[0, 3:], 1e-6)
    assert float(jnp.abs(o_other[0, :3] - o[0, :3]).max()) > 1e-4
    # no document start: identical to the plain call
    o_plain, _ = _ours(x, q, mems, ro, chunk_memory=4, chunk_other=2, **flags)
    o_same, _ = run(x, q, jnp.ones_like(seg))
    _close(o_same, o_plain, 1e-6)


def test_decode_steps_equal_chunked():
    """hope_decode_step from index 0 (snapshot and position carried) == hope_chunked row by row,
    crossing chunk ends of both groups (chunk_memory=2, chunk_other=4, T=6, momentum)."""
    mems, ro, x, q = _setup(seed=2)
    flags = dict(momentum=True, momentum_coef=0.5)
    o, st = _ours(x, q, mems, ro, chunk_memory=2, chunk_other=4, **flags)
    st_d = hope_init_state(mems, B, momentum=True)
    snap = jax.tree.map(jnp.zeros_like, st_d.memories)  # never read at index 0
    rule = HopeRule(chunk_memory=2, chunk_other=4, **flags)
    step = jax.jit(functools.partial(hope_decode_step, readout=ro, rule=rule))
    outs = []
    for t in range(T):
        o_t, st_d, snap = step(st_d, x[:, t], q[:, t], snap, jnp.int32(t))
        outs.append(o_t)
    _close(jnp.stack(outs, 1), o, 1e-5)
    _close(st_d.memories.memory.w1, st.memories.memory.w1, 1e-5)
    _close(st_d.momentum.k.w2, st.momentum.k.w2, 1e-5)


def test_grad_horizon_keeps_values_and_cuts_gradients():
    """Horizon 2: the last token's loss has no gradient w.r.t. inputs before the last cut (t = 4);
    without a horizon gradients reach t = 0 (the gradient tests above)."""
    mems, ro, x, q = _setup()

    def loss(x):
        st = hope_init_state(mems, B)
        rule = HopeRule(chunk_memory=2, chunk_other=2, grad_horizon=2)
        o, _ = hope_chunked(x, q, ro, initial_state=st, rule=rule)
        return jnp.sum(o[:, -1] ** 2), o

    (_, o2), g2 = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    o0, _ = _ours(x, q, mems, ro, chunk_memory=2, chunk_other=2)
    _close(o2, o0, 1e-6)
    _close(g2[:, :4], jnp.zeros_like(g2[:, :4]), 0)
    assert float(jnp.abs(g2[:, 4:]).max()) > 1e-6


def test_packed_and_decode_validation():
    mems, ro, x, q = _setup()
    st = hope_init_state(mems, B)
    with pytest.raises(ValueError, match="segment_ids"):
        hope_chunked(x, q, ro, initial_state=st, segment_ids=jnp.zeros((B, T - 1), jnp.int32))
    with pytest.raises(ValueError, match=r"^HopeRule\.grad_horizon"):
        hope_chunked(x, q, ro, initial_state=st, rule=HopeRule(chunk_memory=2, grad_horizon=3))
    with pytest.raises(ValueError, match="initial_memories"):
        bad = mems._replace(k=MLPMemory(mems.k.w1[:, :2], mems.k.w2))
        hope_chunked(
            x,
            q,
            ro,
            initial_state=st,
            segment_ids=jnp.zeros((B, T), jnp.int32),
            initial_memories=bad,
        )
    with pytest.raises(ValueError, match="snapshot"):
        hope_decode_step(st, x[:, 0], q[:, 0], mems, 0, ro)
    with pytest.raises(ValueError, match="index"):
        hope_decode_step(st, x[:, 0], q[:, 0], st.memories, jnp.zeros((3,), jnp.int32), ro)
    with pytest.raises(ValueError, match="x_t"):
        hope_decode_step(st, x[:, :2], q[:, 0], st.memories, 0, ro)


@pytest.mark.slow  # eight fwd+bwd compiles per form (~50 s CPU)
@pytest.mark.parametrize("chunk_updates", ["scan", "parallel"])
def test_remat_keeps_no_per_token_weights(chunk_updates):
    """Compile-only check of the fwd+bwd temp memory (XLA ``memory_analysis``): with ``remat`` the
    backward stores states per group of chunks, not per token — added bytes per added token stay
    well below one memory state (chunks of 8), and per added chunk far below storing every chunk's
    carry; without it they exceed one state per token."""
    mems, ro, _, _ = _setup()
    state_bytes = 5 * 2 * B * H * D * HID * 4

    def slope(remat, c=8, lengths=(32, 64), remat_every=0):
        tb = []
        for t in lengths:
            z = jnp.ones((B, t, H, D))

            def loss(mems, x):
                st = hope_init_state(mems, B)
                rule = HopeRule(chunk_memory=c, chunk_other=c, remat=remat,
                                remat_every=remat_every, chunk_updates=chunk_updates)  # fmt: skip
                o, _ = hope_chunked(x, x, ro, initial_state=st, rule=rule)
                return jnp.sum(o**2)

            comp = jax.jit(jax.grad(loss)).lower(mems, z).compile()
            tb.append(comp.memory_analysis().temp_size_in_bytes)
        return (tb[1] - tb[0]) / (lengths[1] - lengths[0]) / state_bytes

    assert slope(True) < 0.5
    assert slope(False) > 1.0
    # Only every ⌈√N⌉-th chunk carry is stored: from 16 to 64 chunks of 4 the saved carries grow
    # by 8. The chunk's checkpoint also keeps its token-sized products for every chunk
    # (CHUNK_RESIDUAL), about 0.6 of a state per chunk at these tiny widths (D = 4, h = 3), so the
    # bytes per added chunk are compared with storing every carry (remat_every = 1: several
    # times more per chunk, in both forms).
    per_chunk = lambda every: 4 * slope(True, c=4, lengths=(64, 256), remat_every=every)  # noqa: E731
    assert per_chunk(0) < 0.25 * per_chunk(1)
