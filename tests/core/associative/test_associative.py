"""SPEC §0–§1: linear attention, delta rule and gated delta rule in step / recurrent / chunked form.

Chunked == recurrent (values, final state and gradients w.r.t. every input) at awkward sizes,
every recurrent rule == the float64 twin ``associative/reference.py`` (GDN: FLA's naive loop),
property tests and input validation. f32 tolerance: max abs error ≤ 1e-4 · max(1, max |reference|).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.associative import forms as A
from nested_jax.core.associative.reference import associative_reference
from nested_jax.core.wy import solve_tril

TOL = 1e-4
RULES = ("linear_attention", "delta_rule", "gated_delta")
SHAPE = (1, 40, 2, 8, 6)  # B, T, H, K, V shared by the property tests (compiled ops are reused)


def _data(seed, B, T, H, K, V, *, segments=False):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, K)).astype(np.float32)
    k = rng.normal(size=(B, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the layers feed unit-norm keys (SPEC §1)
    v = rng.normal(size=(B, T, H, V)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, size=(B, T, H)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(B, T, H)).astype(np.float32)
    s0 = rng.normal(size=(B, H, K, V)).astype(np.float32)
    seg = None
    if segments:
        # a reset in most chunks, including at position 0 of a chunk and two adjacent resets
        starts = rng.uniform(size=(B, T)) < 0.06
        starts[:, [j for j in (16, 17, 64) if j < T]] = True
        seg = np.cumsum(starts, axis=1).astype(np.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta), s0, seg


def _call(rule, form, x, *, s0=None, seg=None, chunk_size=None, scale=None):
    fn = getattr(A, f"{rule}_{form}")
    kw = dict(initial_state=s0, segment_ids=seg, scale=scale)
    if form == "chunked":
        kw["chunk_size"] = chunk_size
    if rule == "linear_attention":
        return fn(x["q"], x["k"], x["v"], x["g"], **kw)
    if rule == "delta_rule":
        return fn(x["q"], x["k"], x["v"], x["beta"], **kw)
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


@functools.partial(jax.jit, static_argnames=("rule", "form", "chunk_size"))
def _value_and_grads(x, s0, seg, wo, ws, *, rule, form, chunk_size=None):
    """Outputs, final state, and gradients of a random linear functional of both."""

    def loss(x, s0):
        o, S = _call(rule, form, x, s0=s0, seg=seg, chunk_size=chunk_size)
        return jnp.sum(o * wo) + jnp.sum(S * ws), (o, S)

    (_, (o, S)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, s0)
    return o, S, grads


# Test programs are tiny: compile them with LLVM optimisations off (≈2.5x faster compiles here).
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _run_value_and_grads(x, s0, seg, wo, ws, **static):
    lowered = _value_and_grads.lower(x, s0, seg, wo, ws, **static)
    return lowered.compile(_FAST_COMPILE)(x, s0, seg, wo, ws)


def _assert_close(got, ref, what):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, what
    err = np.max(np.abs(got - ref)) if got.size else 0.0
    bound = TOL * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


# Awkward sizes (SPEC §0): T ∈ {1, 63, 200}, D ∈ {60, 100} (K ≠ V too), chunk 16 and 64, with and
# without initial state and segment resets, H = 1. The default set covers every value and every code
# path (custom-VJP core, resets to a non-zero initial state, T < C); the full cross product is slow.
CASES = [
    # T, K, V, C, initial state, segments
    (63, 60, 100, 16, False, True),
    (200, 100, 60, 64, True, False),
    (200, 60, 60, 16, True, True),
    (1, 100, 100, 64, True, True),  # T = 1 with segment_ids (no token pairs) once broke the resets
]
SLOW_CASES = [
    (T, K, V, C, i, s)
    for T in (1, 63, 200)
    for K, V in ((60, 100), (100, 60))
    for C in (16, 64)
    for i in (False, True)
    for s in (False, True)
    if (T, K, V, C, i, s) not in CASES
]


def _case_id(c):
    return f"T{c[0]}-K{c[1]}-V{c[2]}-C{c[3]}-s0{c[4]:d}-seg{c[5]:d}"


def _params():
    # default run: GDN at large K, V with an initial state, and T = 1 with segment ids. The
    # conformance suite (tests/core/test_conformance.py) checks chunked == recurrent for every
    # rule at a small size, values and gradients, with and without resets and initial state (both
    # reset paths); the rest of this grid runs with -m slow
    fast = {("gated_delta", CASES[1]), ("gated_delta", CASES[3])}
    out = []
    for r in RULES:
        for c in CASES + SLOW_CASES:
            marks = () if (r, c) in fast else (pytest.mark.slow,)
            out.append(pytest.param(r, *c, id=f"{r}-{_case_id(c)}", marks=marks))
    return out


@pytest.mark.parametrize("rule,T,K,V,C,init,segs", _params())
def test_chunked_equals_recurrent(rule, T, K, V, C, init, segs):
    B, H = 2, 1
    x, s0, seg = _data(T + K + C, B, T, H, K, V, segments=segs)
    rng = np.random.default_rng(0)
    wo = rng.normal(size=(B, T, H, V)).astype(np.float32)
    ws = rng.normal(size=(B, H, K, V)).astype(np.float32)
    s0 = s0 if init else None
    ref = _run_value_and_grads(x, s0, seg, wo, ws, rule=rule, form="recurrent")
    got = _run_value_and_grads(x, s0, seg, wo, ws, rule=rule, form="chunked", chunk_size=C)
    _assert_close(got[0], ref[0], "o")
    _assert_close(got[1], ref[1], "final state")
    for name in x:
        _assert_close(got[2][0][name], ref[2][0][name], f"d{name}")
    if init:
        _assert_close(got[2][1], ref[2][1], "d initial_state")


@pytest.mark.slow  # test_conformance.py: chunk size 1 == recurrent, every rule
@pytest.mark.parametrize("rule", RULES)
def test_chunk_size_one_equals_recurrent(rule):
    x, s0, seg = _data(1, 1, 37, 2, 8, 12, segments=True)
    o_r, S_r = _call(rule, "recurrent", x, s0=s0, seg=seg)
    o_c, S_c = jax.jit(lambda x: _call(rule, "chunked", x, s0=s0, seg=seg, chunk_size=1))(x)
    _assert_close(o_c, o_r, "o")
    _assert_close(S_c, S_r, "S")


def _twin(rule, x, s0, seg=None, scale=None):
    gates = dict(g=x["g"] if rule != "delta_rule" else None,
                 beta=x["beta"] if rule != "linear_attention" else None)  # fmt: skip
    return associative_reference(x["q"], x["k"], x["v"], **gates, kind=rule, scale=scale,
                                 initial_state=s0, segment_ids=seg)  # fmt: skip


def test_gdn_recurrent_matches_the_float64_twin():
    x, s0, _ = _data(3, 2, 29, 2, 6, 5)
    scale = 0.37
    o, S = A.gated_delta_recurrent(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=s0
    )
    o_n, S_n = _twin("gated_delta", x, s0, scale=scale)
    np.testing.assert_allclose(o, o_n, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(S, S_n, atol=2e-5, rtol=1e-5)
    # default scale is K ** -0.5
    o_d, _ = A.gated_delta_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=s0)
    o_n, _ = _twin("gated_delta", x, s0, scale=6**-0.5)
    np.testing.assert_allclose(o_d, o_n, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rule", RULES)
def test_recurrent_matches_the_float64_twin_on_packed_rows(rule):
    """Every rule, from a non-zero state, with segment resets (adjacent ones at 16 and 17)."""
    x, s0, seg = _data(11, 2, 21, 2, 5, 3, segments=True)
    o, S = _call(rule, "recurrent", x, s0=s0, seg=seg)
    o_n, S_n = _twin(rule, x, s0, seg)
    _assert_close(o, o_n, "o")
    _assert_close(S, S_n, "S")


def test_the_twin_checks_its_arguments():
    x, _, _ = _data(0, 1, 3, 1, 2, 2)
    with pytest.raises(ValueError, match="kind must be one of"):
        associative_reference(x["q"], x["k"], x["v"], kind="gdn")
    with pytest.raises(ValueError, match="beta: required"):
        associative_reference(x["q"], x["k"], x["v"], x["g"], kind="gated_delta")
    with pytest.raises(ValueError, match=r"g: expected \[B, T, H\]"):
        associative_reference(x["q"], x["k"], x["v"], x["g"][..., None], x["beta"])


@pytest.mark.slow  # test_conformance.py: the step scanned == recurrent, every rule
@pytest.mark.parametrize("rule", RULES)
def test_step_form_iterates_to_recurrent(rule):
    x, s0, _ = _data(4, 2, 9, 3, 5, 4)
    o_ref, S_ref = _call(rule, "recurrent", x, s0=s0)
    step = getattr(A, f"{rule}_step")
    S, outs = jnp.asarray(s0), []
    for t in range(9):
        xt = {n: a[:, t] for n, a in x.items()}
        if rule == "linear_attention":
            o_t, S = step(S, xt["q"], xt["k"], xt["v"], xt["g"])
        elif rule == "delta_rule":
            o_t, S = step(S, xt["q"], xt["k"], xt["v"], xt["beta"])
        else:
            o_t, S = step(S, xt["q"], xt["k"], xt["v"], xt["g"], xt["beta"])
        outs.append(o_t)
    np.testing.assert_allclose(jnp.stack(outs, 1), o_ref, atol=1e-6)
    np.testing.assert_allclose(S, S_ref, atol=1e-6)


def _writes_loop(x, s0, seg):
    """``Δ_t = β_t (v_t − α_t S_{t−1}ᵀ k_t)`` token by token in float64 (SPEC §1), the state
    restarting from ``s0`` (zero when None) at every segment start."""
    k, v, g, beta = (np.asarray(x[n], np.float64) for n in ("k", "v", "g", "beta"))
    B, T, H, K = k.shape
    start = np.zeros((B, H, K, v.shape[-1])) if s0 is None else np.asarray(s0, np.float64)
    out = np.zeros(v.shape)
    for b in range(B):
        S = start[b].copy()
        for t in range(T):
            if seg is not None and t > 0 and seg[b, t] != seg[b, t - 1]:
                S = start[b].copy()
            S = np.exp(g[b, t])[:, None, None] * S
            delta = beta[b, t][:, None] * (v[b, t] - np.einsum("hk,hkv->hv", k[b, t], S))
            S = S + np.einsum("hk,hv->hkv", k[b, t], delta)
            out[b, t] = delta
    return out


@pytest.mark.parametrize("init,segs", [(False, False), (True, False), (False, True), (True, True)])
def test_gated_delta_writes_are_the_residual_writes(init, segs):
    """``gated_delta_chunked_writes``: the same output and state as ``gated_delta_chunked`` and
    the writes ``β_t e_t`` of the recurrence (both chunk-form branches: the core, and the
    restart from a non-zero initial state at segment starts)."""
    x, s0, seg = _data(11, 2, 37, 2, 6, 5, segments=segs)
    s0 = s0 if init else None
    kw = dict(initial_state=s0, segment_ids=seg, chunk_size=8)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, S, writes = jax.jit(lambda *a: A.gated_delta_chunked_writes(*a, **kw))(*args)
    o_ref, S_ref = jax.jit(lambda *a: A.gated_delta_chunked(*a, **kw))(*args)
    _assert_close(o, o_ref, "output")
    _assert_close(S, S_ref, "final state")
    _assert_close(writes, _writes_loop(x, s0, seg), "writes")


def test_segment_reset_equals_separate_runs():
    x, s0, _ = _data(5, *SHAPE)
    seg = np.array([[3] * 14 + [9] * 16 + [3] * 10], np.int32)  # ids may repeat; a change resets
    o, S = A.gated_delta_recurrent(**x, initial_state=s0, segment_ids=seg)
    for lo, hi in ((0, 14), (14, 30), (30, 40)):
        part = {n: a[:, lo:hi] for n, a in x.items()}
        o_p, S_p = A.gated_delta_recurrent(**part, initial_state=s0)
        np.testing.assert_allclose(o[:, lo:hi], o_p, atol=1e-6)
    np.testing.assert_allclose(S, S_p, atol=1e-6)
    chunked = jax.jit(functools.partial(A.gated_delta_chunked, chunk_size=16))
    o_c, S_c = chunked(**x, initial_state=s0, segment_ids=seg)
    _assert_close(o_c, o, "o chunked")
    _assert_close(S_c, S, "S chunked")


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_beta_zero_state_only_decays(form):
    x, s0, _ = _data(6, *SHAPE)
    x["beta"] = np.zeros_like(x["beta"])
    o, S = _call("gated_delta", form, x, s0=s0, chunk_size=16, scale=1.0)
    decay = np.exp(np.cumsum(x["g"].astype(np.float64), axis=1))  # [B, T, H]
    np.testing.assert_allclose(S, decay[:, -1, :, None, None] * s0, atol=1e-5, rtol=1e-5)
    expect = decay[..., None] * np.einsum("bthk,bhkv->bthv", x["q"], s0)
    np.testing.assert_allclose(o, expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_zero_gate_is_plain_delta_rule(form):
    x, s0, _ = _data(7, *SHAPE)
    x["g"] = np.zeros_like(x["g"])
    o1, S1 = _call("gated_delta", form, x, s0=s0, chunk_size=16)
    o2, S2 = _call("delta_rule", form, x, s0=s0, chunk_size=16)
    _assert_close(o1, o2, "o")
    _assert_close(S1, S2, "S")


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_orthonormal_keys_beta_one_exact_recall(form):
    K, V, T = 16, 5, 12
    rng = np.random.default_rng(8)
    basis = np.linalg.qr(rng.normal(size=(K, K)))[0].astype(np.float32)
    keys = basis[:T]
    # the last two writes overwrite keys 0 and 1 with new values: the delta rule replaces them
    keys = np.concatenate([keys, keys[:2]])[None, :, None]  # [1, T + 2, 1, K]
    vals = rng.normal(size=(1, T + 2, 1, V)).astype(np.float32)
    x = dict(
        q=keys,
        k=keys,
        v=vals,
        g=np.zeros((1, T + 2, 1), np.float32),
        beta=np.ones((1, T + 2, 1), np.float32),
    )
    o, S = _call("gated_delta", form, x, chunk_size=4, scale=1.0)
    recalled = np.einsum("jk,kv->jv", keys[0, :T, 0], S[0, 0])
    expect = np.concatenate([vals[0, T:, 0], vals[0, 2:T, 0]])
    np.testing.assert_allclose(recalled, expect, atol=1e-5)
    # reading with the key just written returns the value just written
    np.testing.assert_allclose(o, vals, atol=1e-5)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_causality(rule, form):
    x, s0, seg = _data(9, *SHAPE, segments=True)
    t0 = 21  # mid-chunk for C = 16
    o1, _ = _call(rule, form, x, s0=s0, seg=seg, chunk_size=16)
    y = {n: a.copy() for n, a in x.items()}
    rng = np.random.default_rng(1)
    for n in ("q", "k", "v"):
        y[n][:, t0 + 1 :] += rng.normal(size=y[n][:, t0 + 1 :].shape).astype(np.float32)
    y["g"][:, t0 + 1 :] -= 0.3
    y["beta"][:, t0 + 1 :] = 1.0 - y["beta"][:, t0 + 1 :]
    seg2 = seg.copy()
    seg2[:, t0 + 1 :] += 5
    o2, _ = _call(rule, form, y, s0=s0, seg=seg2, chunk_size=16)
    np.testing.assert_array_equal(np.asarray(o1)[:, : t0 + 1], np.asarray(o2)[:, : t0 + 1])
    assert not np.allclose(np.asarray(o1)[:, t0 + 1 :], np.asarray(o2)[:, t0 + 1 :])


def test_dtypes_bf16_inputs_f32_state():
    x, s0, _ = _data(10, 1, 33, 2, 8, 8)
    xb = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
    o, S = A.gated_delta_chunked(**xb, chunk_size=16)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    o_r, S_r = A.gated_delta_recurrent(**xb)
    assert o_r.dtype == jnp.bfloat16 and S_r.dtype == jnp.float32
    np.testing.assert_allclose(S, S_r, atol=1e-4)


@pytest.mark.parametrize("C", [64, 37])
def test_triangular_inverse_stable_in_f32(C):
    # Correlated unit keys with β = 1: A = strict_tril(K Kᵀ) has entries near 1, where a power
    # series in A would blow up like binomial coefficients; the blockwise inverse must not.
    rng = np.random.default_rng(13)
    base = rng.normal(size=(1, 16))
    k = base + 0.05 * rng.normal(size=(C, 16))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    a = np.tril(k @ k.T, -1)
    batch = np.stack([a, 0.5 * a, np.zeros_like(a)]).astype(np.float32)
    got = np.asarray(jax.jit(solve_tril)(batch))
    ref = np.linalg.inv(np.eye(C) + batch.astype(np.float64))
    np.testing.assert_allclose(got, ref, atol=1e-4 * max(1.0, np.abs(ref).max()))
    np.testing.assert_array_equal(np.triu(got, 1), 0)


# ----- input validation --------------------------------------------------------------------


def _good():
    x, s0, seg = _data(12, 2, 10, 3, 4, 5, segments=True)
    return x, s0, seg


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda x, s, sg: x.update(q=x["q"][0]), r"q must have shape \[B, T, H, D\]"),
        (lambda x, s, sg: x.update(k=x["k"][:, :7]), r"k must have shape \[B, T, H, K\]"),
        (lambda x, s, sg: x.update(k=x["k"][..., :3]), r"k must have shape"),
        (lambda x, s, sg: x.update(v=x["v"][:, :, :2]), r"v must have shape \[B, T, H, V\]"),
        (lambda x, s, sg: x.update(g=x["g"][:, :9]), r"g must have shape \[B, T, H\]"),
        (lambda x, s, sg: x.update(beta=x["beta"][..., None]), r"beta must have shape"),
        (lambda x, s, sg: x.update(q=x["q"].astype(np.int32)), r"q must have a floating dtype"),
        (lambda x, s, sg: x.update(beta=x["beta"] > 0), r"beta must have a floating dtype"),
    ],
)
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_bad_inputs_raise(mutate, match, form):
    x, s0, seg = _good()
    mutate(x, s0, seg)
    with pytest.raises(ValueError, match=match):
        _call("gated_delta", form, x, chunk_size=4)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_bad_state_and_segments_raise(form):
    x, s0, seg = _good()
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, H, K, V\]"):
        _call("delta_rule", form, x, s0=s0[:, :, :2], chunk_size=4)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\]"):
        _call("linear_attention", form, x, seg=seg[:, :5], chunk_size=4)
    with pytest.raises(ValueError, match="segment_ids must have an integer dtype"):
        _call("gated_delta", form, x, seg=seg.astype(np.float32), chunk_size=4)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_chunk_size_raises(bad):
    x, _, _ = _good()
    for rule in RULES:
        with pytest.raises(ValueError, match="chunk_size"):
            _call(rule, "chunked", x, chunk_size=bad)


def test_bad_step_inputs_raise():
    x, s0, _ = _good()
    xt = {n: a[:, 0] for n, a in x.items()}
    with pytest.raises(ValueError, match=r"state must have shape \[B, H, K, V\]"):
        A.gated_delta_step(s0[0], xt["q"], xt["k"], xt["v"], xt["g"], xt["beta"])
    with pytest.raises(ValueError, match=r"q_t must have shape \[B, H, D\]"):
        A.delta_rule_step(s0, x["q"], xt["k"], xt["v"], xt["beta"])
    with pytest.raises(ValueError, match=r"g_t must have shape \[B, H\]"):
        A.linear_attention_step(s0, xt["q"], xt["k"], xt["v"], x["g"])
