"""HOLA core (SPEC §5): block-causal top-w cache, cache read, decode == forward, gate → GDN."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.associative.forms import gated_delta_chunked
from nested_jax.core.hola.cache import _block_read, read_blocks
from nested_jax.core.hola.decode import (
    HolaReadParams,
    HolaState,
    hola_decode_step,
    init_hola_state,
)
from nested_jax.core.hola.forward import gdn_residuals, hola_forward, hola_scores
from nested_jax.core.hola.reference import hola_reference
from nested_jax.rules import HolaRule

B, T, H, K, V = 2, 37, 2, 6, 5  # T = 4 full blocks of C = 8 plus 5 tokens
C, W = 8, 4


def _l2(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed=0, T=T, K=K, V=V):
    rng = np.random.default_rng(seed)
    f = np.float32
    return dict(
        q=_l2(rng.normal(size=(B, T, H, K))).astype(f),
        k=_l2(rng.normal(size=(B, T, H, K))).astype(f),
        v=rng.normal(size=(B, T, H, V)).astype(f),
        g=-rng.uniform(0.01, 0.5, size=(B, T, H)).astype(f),
        beta=rng.uniform(0.0, 1.0, size=(B, T, H)).astype(f),
    )


def make_params(seed=1, gate=None):
    rng = np.random.default_rng(seed)
    f = np.float32
    return dict(
        gamma_q=rng.uniform(0.5, 2.0, size=(H, K)).astype(f),
        gamma_k=rng.uniform(0.5, 2.0, size=(H, K)).astype(f),
        sink_logit=rng.normal(size=(H,)).astype(f),
        gate_logit=(rng.normal(size=(H,)) if gate is None else np.full((H,), gate)).astype(f),
    )


SEQ = ("q", "k", "v", "g", "beta")
PAR = ("gamma_q", "gamma_k", "sink_logit", "gate_logit")


def read_params(p):
    """The parameter dict as the one ``HolaReadParams`` the HOLA forms take."""
    return HolaReadParams(*[p[n] for n in PAR])


@functools.cache
def _fwd(eviction="beta_e", read_norm="rmsnorm", window=W, block_size=C):
    rule = HolaRule(window=window, block_size=block_size, eviction=eviction, read_norm=read_norm)
    return jax.jit(functools.partial(hola_forward, rule=rule, chunk_size=16))


def forward(x, p, eviction="beta_e", read_norm="rmsnorm", initial_state=None, **kw):
    args = [x[n] for n in SEQ]
    return _fwd(eviction, read_norm, **kw)(*args, read_params(p), initial_state=initial_state)


@functools.cache
def _step(eviction, read_norm, window, block_size):
    rule = HolaRule(window=window, block_size=block_size, eviction=eviction, read_norm=read_norm)
    return jax.jit(functools.partial(hola_decode_step, rule=rule))


def decode(state, x, p, eviction="beta_e", read_norm="rmsnorm"):
    step = _step(eviction, read_norm, state.cache_k.shape[2], state.block_k.shape[2])
    outs = []
    for t in range(x["q"].shape[1]):
        o_t, state = step(state, *[x[n][:, t] for n in SEQ], read_params(p))
        outs.append(o_t)
    return np.stack(outs, axis=1), state


_gdn = jax.jit(functools.partial(gated_delta_chunked, chunk_size=16))


@functools.cache
def _scores(eviction):
    return jax.jit(functools.partial(hola_scores, eviction=eviction))


def scores(x, eviction="beta_e"):
    return np.asarray(_scores(eviction)(x["k"], x["v"], x["g"], x["beta"]))


def topw(m, end, window=W):
    """Brute force: [B][H] lists of the top-w positions < end by fixed score, ties → earlier."""
    return [
        [sorted(range(end), key=lambda j: (-m[b, j, h], j))[:window] for h in range(H)]
        for b in range(B)
    ]


def split(x, a, b):
    return {key: val[:, a:b] for key, val in x.items()}


def reference(x, p, eviction="beta_e", read_norm="rmsnorm"):
    rule = HolaRule(window=W, block_size=C, eviction=eviction, read_norm=read_norm)
    return hola_reference(*[x[n] for n in SEQ], read_params(p), rule=rule)


def assert_states_close(a, b, atol=2e-5):
    for name, xa, xb in zip(HolaState._fields, a, b, strict=True):
        xa, xb = np.asarray(xa), np.asarray(xb)
        assert xa.shape == xb.shape and xa.dtype == xb.dtype, name
        if xa.dtype.kind in "biu":
            np.testing.assert_array_equal(xa, xb, err_msg=name)
        else:
            np.testing.assert_allclose(xa, xb, atol=atol, rtol=1e-5, err_msg=name)


def cache_positions(state):
    """[B][H] lists of the cache's valid positions, in stored order."""
    pos, val = np.asarray(state.cache_pos), np.asarray(state.cache_valid)
    return [[list(pos[b, h][val[b, h]]) for h in range(H)] for b in range(B)]


# --------------------------------------------------------------------------------------------------
# Scores and the brute-force reference
# --------------------------------------------------------------------------------------------------


def test_gdn_residuals_match_recurrence_awkward_sizes():
    """WY/UT residual pass == explicit recurrence e_t = v_t − α_t S_{t-1}ᵀ k_t (T=45, C=16)."""
    Tl, Kl, Vl = 45, 12, 10
    x = make_inputs(3, T=Tl, K=Kl, V=Vl)
    x["beta"][0, 5] = 0.0  # β = 0 must still give e (not Δ/β)
    rng = np.random.default_rng(4)
    S0 = rng.normal(size=(B, H, Kl, Vl)).astype(np.float32) * 0.3
    fn = jax.jit(functools.partial(gdn_residuals, chunk_size=16))
    e, S_T = fn(x["k"], x["v"], x["g"], x["beta"], initial_state=S0)
    S = S0.astype(np.float64)
    e_ref = np.zeros((B, Tl, H, Vl))
    for t in range(Tl):
        a = np.exp(x["g"][:, t])[..., None, None]
        kt, vt, bt = x["k"][:, t], x["v"][:, t], x["beta"][:, t]
        et = vt - np.einsum("bhk,bhkv->bhv", kt, a * S)
        S = a * S + bt[..., None, None] * kt[..., :, None] * et[..., None, :]
        e_ref[:, t] = et
    np.testing.assert_allclose(np.asarray(e), e_ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(S_T), S, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("eviction", ["beta_e", "recency", "cumulative_attention"])
def test_forward_matches_bruteforce_reference(eviction):
    """Block-parallel forward == token-by-token float64 HOLA (outputs, state, cache membership)."""
    x, p = make_inputs(), make_params()
    o, st = forward(x, p, eviction)
    ref = reference(x, p, eviction)
    np.testing.assert_allclose(np.asarray(o), ref["o"], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(st.S), ref["S"], atol=2e-5, rtol=1e-5)
    assert cache_positions(st) == ref["caches"][-1]
    assert int(st.pos) == T
    if eviction == "beta_e":
        np.testing.assert_allclose(scores(x, eviction), ref["score"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [5, 6])
def test_forward_matches_reference_odd_and_even_blocks(block_size):
    """An odd block size reads each block's causal square whole, an even one in halves
    (``cache._block_read_split``): both == the float64 reference, a partial last block included."""
    x, p = make_inputs(seed=4), make_params(seed=5)
    rule = HolaRule(window=3, block_size=block_size)
    o, _ = hola_forward(*[x[n] for n in SEQ], read_params(p), rule=rule, chunk_size=16)
    ref = hola_reference(*[x[n] for n in SEQ], read_params(p), rule=rule)
    np.testing.assert_allclose(np.asarray(o), ref["o"], atol=2e-5, rtol=1e-5)


def test_split_block_read_equals_whole_square_with_gradients():
    """``read_blocks`` (halves, even C) == every block read whole by ``_block_read``: values and
    gradients of q, k, v, the cache and the read parameters, with unfilled slots at both ends."""
    n, C, Wc = 3, 6, 4
    rng = np.random.default_rng(7)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    qh, kh, vh = f(B, H, n * C, K), f(B, H, n * C, K), f(B, H, n * C, V)
    ck, cv = f(B, H, n, Wc, K), f(B, H, n, Wc, V)
    cval = rng.uniform(size=(B, H, n, Wc)) < 0.7
    filled = np.ones((n, C), bool)
    filled[0, :2] = False  # a stream that starts inside its first block
    filled[-1, 4:] = False  # and ends inside its last
    params = read_params(make_params(seed=8))

    def whole(qh, kh, vh, ck, cv, params):
        blocks = lambda x: x.reshape(B, H, n, C, x.shape[-1])  # noqa: E731
        one = lambda q, k, v, c, fb: _block_read(q, k, v, c, fb, params, "rmsnorm", 0.4)[0]  # noqa: E731
        o = jax.vmap(one, in_axes=(2, 2, 2, 2, 0), out_axes=2)(
            blocks(qh), blocks(kh), blocks(vh), (ck, cv, cval), filled
        )
        return o.reshape(B, H, n * C, -1)

    def split(qh, kh, vh, ck, cv, params):
        return read_blocks(qh, kh, vh, (ck, cv, cval), filled, params, "rmsnorm", 0.4)

    args = (qh, kh, vh, ck, cv, params)
    np.testing.assert_allclose(split(*args), whole(*args), atol=1e-6, rtol=1e-6)
    w = f(B, H, n * C, V)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)) * w)  # noqa: E731
    g_split = jax.grad(loss(split), argnums=range(6))(*args)
    g_whole = jax.grad(loss(whole), argnums=range(6))(*args)
    for a, b in zip(jax.tree.leaves(g_split), jax.tree.leaves(g_whole), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eviction,read_norm", [("e", "rmsnorm"), ("beta_v", "rmsnorm"),
                                                ("beta_e", "l2")])  # fmt: skip
def test_other_scores_and_l2_read_match_reference(eviction, read_norm):
    """‖e‖ and β‖v‖ scores, and the unit-L2 read: scores and decoding == float64 reference. (The
    forward's cache pipeline is shared by all fixed-score evictions and is checked with β‖e‖.)"""
    x, p = make_inputs(), make_params()
    ref = reference(x, p, eviction, read_norm)
    if eviction != "beta_e":
        np.testing.assert_allclose(scores(x, eviction), ref["score"], atol=2e-5, rtol=1e-5)
    od, sd = decode(init_hola_state(B, H, K, V, W, C), x, p, eviction, read_norm)
    np.testing.assert_allclose(od, ref["o"], atol=2e-5, rtol=1e-5)
    assert cache_positions(sd) == ref["caches"][-1]


def _sparse_beta(x, seed):
    """β = 0 except on ~1 token in 8: most scores are exactly 0, so top-w meets many exact ties."""
    y = dict(x)
    keep = np.random.default_rng(seed).uniform(size=x["beta"].shape) < 0.125
    y["beta"] = np.where(keep, x["beta"], 0.0).astype(np.float32)
    return y


@pytest.mark.parametrize("eviction,ties", [("beta_e", False), ("beta_e", True),
                                           ("cumulative_attention", False)])  # fmt: skip
def test_streaming_blocks_and_cache_after_each_block(eviction, ties):
    """Seven calls of 5 tokens (splits inside blocks) then 2 decode steps == one call over all 37,
    and the carried cache after blocks 1..4 is the brute-force global top-w by fixed score (ties →
    earlier position)."""
    x, p = make_inputs(10), make_params()
    if ties:
        x = _sparse_beta(x, 20)
    o, st = forward(x, p, eviction)
    m = scores(x)
    outs, state = [], init_hola_state(B, H, K, V, W, C)
    for a in range(0, 35, 5):
        o_part, state = forward(split(x, a, a + 5), p, eviction, initial_state=state)
        outs.append(np.asarray(o_part))
        n_blocks = (a + 5) // C
        if eviction == "beta_e" and n_blocks > 0:
            if ties:
                assert np.sum(m[:, : n_blocks * C] == 0) > n_blocks * C  # ties really happen
            assert cache_positions(state) == topw(m, n_blocks * C), a
    o_dec, state = decode(state, split(x, 35, T), p, eviction)
    outs.append(o_dec)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(o), atol=2e-5, rtol=1e-5)
    assert_states_close(state, st)
    if eviction == "cumulative_attention":  # incremental rule: compare with the reference
        assert cache_positions(st) == reference(x, p, eviction)["caches"][-1]


# --------------------------------------------------------------------------------------------------
# Causality and decoding
# --------------------------------------------------------------------------------------------------


def test_block_causal_perturbation():
    """Changing all inputs after t0 (including huge scores) leaves outputs at ≤ t0 unchanged."""
    x, p = make_inputs(7), make_params()
    o, _ = forward(x, p)
    o = np.asarray(o)
    rng = np.random.default_rng(8)
    for t0 in (0, 7, 8, 20, 35):
        y = {key: val.copy() for key, val in x.items()}
        y["q"][:, t0 + 1 :] = _l2(rng.normal(size=y["q"][:, t0 + 1 :].shape))
        y["k"][:, t0 + 1 :] = _l2(rng.normal(size=y["k"][:, t0 + 1 :].shape))
        y["v"][:, t0 + 1 :] = 50.0 * rng.normal(size=y["v"][:, t0 + 1 :].shape)  # would win top-w
        y["beta"][:, t0 + 1 :] = 1.0
        y["g"][:, t0 + 1 :] = -0.01
        o2 = np.asarray(forward(y, p)[0])
        np.testing.assert_allclose(o2[:, : t0 + 1], o[:, : t0 + 1], atol=1e-6, rtol=0)
        assert np.abs(o2[:, t0 + 1 :] - o[:, t0 + 1 :]).max() > 1e-2


@pytest.mark.parametrize("eviction", ["beta_e", "cumulative_attention"])
def test_decode_equals_forward(eviction):
    """Token-by-token decoding over 4 block boundaries (T=37, C=8, w=4) == forward (o and state)."""
    x, p = make_inputs(9), make_params()
    o, st = forward(x, p, eviction)
    od, sd = decode(init_hola_state(B, H, K, V, W, C), x, p, eviction)
    np.testing.assert_allclose(od, np.asarray(o), atol=2e-5, rtol=1e-5)
    assert_states_close(sd, st)


def test_forward_state_then_decode_and_state_size_constant():
    """Interleaved forward(0:5), forward(5:10), decode(10:11), forward(11:16) (ends exactly on a
    block boundary: merge, empty buffer), decode(16:37) == forward(0:37); state shapes/bytes never
    depend on T."""
    x, p = make_inputs(11), make_params()
    o, st = forward(x, p)
    s0 = init_hola_state(B, H, K, V, W, C)
    o1, s1 = forward(split(x, 0, 5), p, initial_state=s0)
    o2, s2 = forward(split(x, 5, 10), p, initial_state=s1)
    o3, s3 = decode(s2, split(x, 10, 11), p)
    o4, s4 = forward(split(x, 11, 16), p, initial_state=s3)
    assert int(s4.pos) == 2 * C and not np.any(np.asarray(s4.block_k))
    o5, s5 = decode(s4, split(x, 16, T), p)
    parts = [np.asarray(a) for a in (o1, o2, o3, o4, o5)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), np.asarray(o), atol=2e-5, rtol=1e-5)
    assert_states_close(s5, st)

    chex.assert_trees_all_equal_shapes_and_dtypes(s0, s1, s2, s3, s4, s5, st)
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(st))
    per_head_floats = K * V + (W + C) * (K + V) + W + C  # S, cache + buffer k/v, scores
    assert nbytes == B * H * (4 * per_head_floats + W * (4 + 1)) + 4  # + positions, flags, pos


# --------------------------------------------------------------------------------------------------
# Ablations, gate limit, gradients
# --------------------------------------------------------------------------------------------------


def test_recency_equals_sliding_window_attention():
    """recency == masked softmax over {last w tokens of earlier blocks} ∪ causal block ∪ sink."""
    x, p = make_inputs(12), make_params(gate=np.inf)  # σ(+∞) = 1: o − o_GDN = o_cache
    o, _ = forward(x, p, "recency")
    o_gdn, _ = _gdn(*[x[n] for n in SEQ])  # == HOLA at σ = 0 (next test)
    o_cache = np.asarray(o, np.float64) - np.asarray(o_gdn, np.float64)

    def rms(a, gamma):
        return gamma * a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-6)

    qn = rms(x["q"].astype(np.float64), p["gamma_q"][None, None])
    kn = rms(x["k"].astype(np.float64), p["gamma_k"][None, None])
    t, j = np.arange(T)[:, None], np.arange(T)[None, :]
    start = (t // C) * C
    mask = (j <= t) & (j >= np.maximum(start - W, 0))  # window of w before the block + block
    logits = np.einsum("bthk,bjhk->bhtj", qn, kn) * K**-0.5
    logits = np.where(mask, logits, -np.inf)
    sink = np.broadcast_to(p["sink_logit"].astype(np.float64)[None, :, None, None], (B, H, T, 1))
    full = np.concatenate([logits, sink], -1)
    prob = np.exp(full - full.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    expect = np.einsum("bhtj,bjhv->bthv", prob[..., :T], x["v"].astype(np.float64))
    np.testing.assert_allclose(o_cache, expect, atol=2e-5, rtol=1e-5)


def test_gate_minus_inf_equals_gated_delta_exactly():
    """σ(−∞) = 0: HOLA's output is bitwise the GDN output (same inputs, same chunked call)."""
    x, p = make_inputs(13), make_params(gate=-np.inf)
    o, st = forward(x, p)
    o_gdn, S_gdn = _gdn(*[x[n] for n in SEQ])
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_gdn))
    np.testing.assert_array_equal(np.asarray(st.S), np.asarray(S_gdn))


@functools.cache
def _grads():
    """Gradients of Σ r ⊙ o w.r.t. every input and parameter (one compiled program)."""

    def hola_loss(x, p, r):
        return jnp.sum(r * forward(x, p)[0])

    return jax.jit(jax.grad(hola_loss, argnums=(0, 1)))


def test_gradients_finite_and_only_through_selected_entries():
    """All gradients finite and non-zero. Loss on the queries of block 3 only: the cache-path part
    (gradient at the model's gate minus gradient at σ = 0, where only the GDN path remains) is
    non-zero for k, v of A_2 entries, zero for every other past token, and zero for g, β everywhere
    (they reach the cache only through the stop-gradient scores)."""
    hola_grad = _grads()
    x, p = make_inputs(16), make_params()
    rng = np.random.default_rng(17)
    r = rng.normal(size=(B, T, H, V)).astype(np.float32)
    gx, gp = hola_grad(x, p, r)
    for name, gval in list(gx.items()) + list(gp.items()):
        assert np.all(np.isfinite(np.asarray(gval))) and np.abs(np.asarray(gval)).max() > 0, name

    r3 = np.zeros_like(r)
    r3[:, 3 * C : 4 * C] = r[:, 3 * C : 4 * C]
    gx, _ = hola_grad(x, p, r3)
    gx0, _ = hola_grad(x, dict(p, gate_logit=np.full((H,), -np.inf, np.float32)), r3)
    cache_part = {n: np.asarray(gx[n], np.float64) - np.asarray(gx0[n], np.float64) for n in SEQ}
    tol = 1e-5 * max(np.abs(np.asarray(gx[n])).max() for n in SEQ)
    assert np.abs(cache_part["g"]).max() < tol and np.abs(cache_part["beta"]).max() < tol
    selected = topw(scores(x), 3 * C)
    for b in range(B):
        for h in range(H):
            for j in range(3 * C):
                size = max(np.abs(cache_part[n][b, j, h]).max() for n in ("k", "v"))
                if j in selected[b][h]:
                    assert size > 1e3 * tol, (b, h, j)
                else:
                    assert size < tol, (b, h, j)


def test_gradients_exactly_zero_for_unselected_when_state_is_inert():
    """β = 0 freezes the state path (S = 0), so k, v gradients come from the cache read alone and
    are exactly zero for past tokens outside A_2 (all scores are 0: ties pick the earliest w)."""
    hola_grad = _grads()
    x, p = make_inputs(18), make_params()
    x["beta"] = np.zeros_like(x["beta"])
    r = np.zeros((B, T, H, V), np.float32)
    r[:, 3 * C : 4 * C] = np.random.default_rng(19).normal(size=(B, C, H, V))
    gx, _ = hola_grad(x, p, r)
    gk, gv = np.asarray(gx["k"]), np.asarray(gx["v"])
    assert np.all(np.abs(gv[:, :W]).max(-1) > 0) and np.all(np.abs(gk[:, :W]).max(-1) > 0)
    assert np.all(gk[:, W : 3 * C] == 0) and np.all(gv[:, W : 3 * C] == 0)
    assert np.all(gk[:, 4 * C :] == 0) and np.all(gv[:, 4 * C :] == 0)  # the future: causal


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def test_validation_errors_name_the_argument():
    x, p = make_inputs(), make_params()
    args = [x[n] for n in SEQ] + [p[n] for n in PAR]
    rule = HolaRule(window=W, block_size=C)

    def call(i=None, val=None, **kw):
        a = list(args)
        if i is not None:
            a[i] = val
        return hola_forward(*a[:5], HolaReadParams(*a[5:]), **{"rule": rule, **kw})

    with pytest.raises(ValueError, match="q must have shape"):
        call(0, x["q"][0])
    with pytest.raises(ValueError, match="v must have shape"):
        call(2, x["v"][:, :3])
    with pytest.raises(ValueError, match="beta must have shape"):
        call(4, x["beta"][..., :1])
    with pytest.raises(ValueError, match="gamma_q must have shape"):
        call(5, p["gamma_q"][:, :2])
    with pytest.raises(ValueError, match="sink_logit must have shape"):
        call(7, p["sink_logit"][None])
    with pytest.raises(ValueError, match=r"^HolaRule\.eviction: unknown 'lru'"):
        HolaRule(eviction="lru")
    with pytest.raises(ValueError, match=r"^HolaRule\.read_norm: unknown 'layernorm'"):
        HolaRule(read_norm="layernorm")
    with pytest.raises(ValueError, match=r"^HolaRule\.window: must be a positive int"):
        HolaRule(window=0)
    with pytest.raises(ValueError, match=r"^hola_forward: rule must be a HolaRule, got dict"):
        call(rule=dict(window=W, block_size=C))
    with pytest.raises(ValueError, match=r"^hola_forward: params must be a HolaReadParams"):
        hola_forward(*args[:5], tuple(args[5:]), rule=rule)
    with pytest.raises(ValueError, match=r"^hola_forward: initial_state holds window=5"):
        call(initial_state=init_hola_state(B, H, K, V, W + 1, C))
    with pytest.raises(ValueError, match=r"^hola_forward: initial_state.S must have shape"):
        call(initial_state=init_hola_state(B, H, K + 1, V, W, C))
    s = init_hola_state(B, H, K, V, W, C)
    with pytest.raises(ValueError, match="k_t must have shape"):
        hola_decode_step(s, x["q"][:, 0], x["k"][:, 0, :1], x["v"][:, 0], x["g"][:, 0],
                         x["beta"][:, 0], read_params(p), rule=rule)  # fmt: skip
    with pytest.raises(ValueError, match="params.gate_logit must have shape"):
        bad = read_params(p)._replace(gate_logit=p["gate_logit"][:1])
        hola_decode_step(s, *[x[n][:, 0] for n in SEQ], bad, rule=rule)
    with pytest.raises(ValueError, match=r"^hola_decode_step: state holds window=4, block_size=8"):
        hola_decode_step(s, *[x[n][:, 0] for n in SEQ], read_params(p))  # the default rule
