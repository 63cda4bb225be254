"""Proteus-wrapped memories (SPEC §4): GDN and Titans, step / recurrent / chunked.

Checks: a float64 NumPy reference of SPEC §4 written from the equations (own block split and
schedule), the locked-coordinate invariant bit for bit at every t, E = 1 and "beyond N" being the
backbone itself (same jaxpr, same bits), chunked = recurrent (values and gradients) with chunks
straddling Δ-boundaries, and streaming with a position offset t0.
"""

from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.associative.forms import (
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
)
from nested_jax.core.associative.proteus import (
    proteus_gated_delta_chunked,
    proteus_gated_delta_recurrent,
    proteus_gated_delta_step,
)
from nested_jax.core.proteus import proteus_active_blocks, proteus_spans
from nested_jax.core.titans.chunk import titans_mlp_chunked
from nested_jax.core.titans.linear import (
    TitansLinearState,
    titans_linear_chunked,
    titans_linear_recurrent,
    titans_linear_step,
)
from nested_jax.core.titans.mlp import titans_mlp_recurrent, titans_mlp_step
from nested_jax.core.titans.net import TitansMLPState
from nested_jax.core.titans.proteus import (
    proteus_titans_linear_chunked,
    proteus_titans_linear_recurrent,
    proteus_titans_linear_step,
    proteus_titans_mlp_chunked,
    proteus_titans_mlp_recurrent,
    proteus_titans_mlp_step,
)
from nested_jax.rules import ProteusRule, TitansRule

# --------------------------------------------------------------------------------------------------
# Independent schedule (SPEC §4, written again here on purpose)
# --------------------------------------------------------------------------------------------------


def ref_open(t, N, E, D):
    """bool [D]: coordinates of the first k(t) blocks; blocks of ⌊D/E⌋, remainder in the last."""
    delta = max(1, N // E)
    k = min(E, 1 + (t - 1) // delta)
    per = D // E
    block = np.minimum(np.arange(D) // per, E - 1)
    return block < k


# --------------------------------------------------------------------------------------------------
# GDN
# --------------------------------------------------------------------------------------------------


def gdn_inputs(B=2, T=37, H=2, K=10, V=6, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, K)).astype(np.float32)
    k = rng.normal(size=(B, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, V)).astype(np.float32)
    g = -rng.uniform(0.05, 0.5, size=(B, T, H)).astype(np.float32)  # decay on
    beta = rng.uniform(0.2, 0.9, size=(B, T, H)).astype(np.float32)
    S0 = rng.normal(size=(B, H, K, V)).astype(np.float32)  # nonzero, so decay of locked rows shows
    return q, k, v, g, beta, S0


def ref_proteus_gdn(q, k, v, g, beta, S0, N, E, t0):
    """float64 SPEC §4 over SPEC §1 GDN, per batch row with its own t0; returns (o, states)."""
    q, k, v, g, beta, S = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, S0))
    B, T, H, K = q.shape
    t0 = np.broadcast_to(np.asarray(t0), (B,))
    o = np.zeros(v.shape)
    states = np.zeros((T, *S.shape))
    S = S.copy()
    for b in range(B):
        for i in range(T):
            m = ref_open(int(t0[b]) + i + 1, N, E, K)
            for h in range(H):
                St = np.where(m[:, None], S[b, h], 0.0)  # gated memory g ⊙ S
                a = np.exp(g[b, i, h])
                kk = k[b, i, h]
                cand = a * St + beta[b, i, h] * np.outer(kk, v[b, i, h] - a * St.T @ kk)
                S[b, h] = np.where(m[:, None], cand, S[b, h])  # locked rows: untouched
                o[b, i, h] = np.where(m[:, None], S[b, h], 0.0).T @ (q[b, i, h] * K**-0.5)
            states[i, b] = S[b]
    return o, states


N60 = dict(schedule=ProteusRule(blocks=4, context_len=60))  # Δ = 15: chunks of 16 straddle all
OFF60 = ProteusRule(blocks=1, context_len=60)  # E = 1: the plain backbone
E4N8 = ProteusRule(blocks=4, context_len=8)
CHUNK4 = TitansRule(memory_chunk=4)
rec = jax.jit(proteus_gated_delta_recurrent, static_argnames=("schedule", "t0"))
chk = jax.jit(proteus_gated_delta_chunked, static_argnames=("schedule", "t0", "chunk_size"))


def test_spans_match_schedule():
    for T, t0, N, E in [
        (37, 5, 60, 4),
        (100, 0, 64, 4),
        (10, 200, 64, 4),
        (7, 3, 5, 16),
        (1, 0, 8, 2),
    ]:
        spans = proteus_spans(T, t0, N, E)
        ks = np.asarray(proteus_active_blocks(jnp.arange(t0 + 1, t0 + T + 1), N, E))
        assert spans[0][0] == 0 and spans[-1][1] == T
        for (a, b, kk), nxt in zip(spans, spans[1:] + [None], strict=True):
            assert (ks[a:b] == kk).all() and b > a
            if nxt is not None:
                assert nxt[0] == b and nxt[2] > kk  # maximal spans: k changes at every cut
    assert proteus_spans(0, 3, 8, 2) == []
    assert proteus_spans(37, 5, 60, 4) == [(0, 10, 1), (10, 25, 2), (25, 37, 3)]


def test_gdn_recurrent_matches_reference_with_ragged_t0():
    q, k, v, g, beta, S0 = gdn_inputs()
    o, S = rec(q, k, v, g, beta, initial_state=S0, t0=5, **N60)
    o_ref, st_ref = ref_proteus_gdn(q, k, v, g, beta, S0, 60, 4, 5)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(S, st_ref[-1], rtol=1e-5, atol=1e-5)
    # traced per-batch positions (ragged decoding): row 0 starts fresh, row 1 is past N
    t0 = jnp.array([0, 70], jnp.int32)
    o2, S2 = jax.jit(partial(proteus_gated_delta_recurrent, **N60))(
        q, k, v, g, beta, initial_state=S0, t0=t0
    )
    o_ref2, st_ref2 = ref_proteus_gdn(q, k, v, g, beta, S0, 60, 4, np.array([0, 70]))
    np.testing.assert_allclose(o2, o_ref2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(S2, st_ref2[-1], rtol=1e-5, atol=1e-5)


def test_gdn_locked_rows_bit_identical_every_step():
    q, k, v, g, beta, S0 = gdn_inputs()
    K = q.shape[-1]

    @jax.jit
    def run(S, t0):
        def body(S, xs):
            i, *tok = xs
            o, S = proteus_gated_delta_step(S, *tok, t=t0 + i + 1, **N60)
            return S, (o, S)

        tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
        return jax.lax.scan(body, S, (jnp.arange(q.shape[1]), *map(tm, (q, k, v, g, beta))))[1]

    o, states = run(jnp.asarray(S0), jnp.int32(5))
    states = np.asarray(states)
    prev = np.concatenate([S0[None], states[:-1]])
    n_locked = 0
    for i in range(q.shape[1]):
        m = ref_open(5 + i + 1, 60, 4, K)
        np.testing.assert_array_equal(states[i][..., ~m, :], prev[i][..., ~m, :])
        assert not np.allclose(states[i][..., m, :], prev[i][..., m, :])  # open rows do move
        n_locked += (~m).sum()
    assert n_locked > 0  # the check above was not vacuous
    # the step form is the recurrent form
    o_rec, S_rec = rec(q, k, v, g, beta, initial_state=S0, t0=5, **N60)
    np.testing.assert_allclose(jnp.moveaxis(o, 0, 1), o_rec, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(states[-1], S_rec, rtol=1e-6, atol=1e-6)
    # chunked: rows still locked at the end of the call keep the initial bits (t = 42 → 3 blocks)
    _, S_chk = chk(q, k, v, g, beta, initial_state=S0, t0=5, chunk_size=16, **N60)
    locked = ~ref_open(5 + q.shape[1], 60, 4, K)
    assert locked.sum() == 4
    np.testing.assert_array_equal(np.asarray(S_chk)[..., locked, :], S0[..., locked, :])


def _same_jaxpr(f, g, *args):
    return str(jax.make_jaxpr(f)(*args)) == str(jax.make_jaxpr(g)(*args))


def test_gdn_single_block_and_beyond_context_are_the_backbone():
    q, k, v, g, beta, S0 = gdn_inputs(T=20)
    args = (q, k, v, g, beta, S0)
    for kw in (dict(schedule=OFF60, t0=7), dict(**N60, t0=45)):
        # E = 1, or every position past the last opening ((E−1)Δ = 45): the plain function
        assert _same_jaxpr(
            lambda *a, kw=kw: proteus_gated_delta_recurrent(*a[:5], initial_state=a[5], **kw),
            lambda *a: gated_delta_recurrent(*a[:5], initial_state=a[5]),
            *args,
        )
        assert _same_jaxpr(
            lambda *a, kw=kw: proteus_gated_delta_chunked(
                *a[:5], initial_state=a[5], chunk_size=16, **kw
            ),
            lambda *a: gated_delta_chunked(*a[:5], initial_state=a[5], chunk_size=16),
            *args,
        )
    tok = tuple(x[:, 0] for x in (q, k, v, g, beta))
    assert _same_jaxpr(
        lambda S, *a: proteus_gated_delta_step(S, *a, t=3, schedule=OFF60),
        gated_delta_step,
        S0,
        *tok,
    )
    # and the bits, compiled separately
    o1, s1 = rec(*args[:5], initial_state=S0, t0=7, schedule=OFF60)
    o0, s0 = jax.jit(gated_delta_recurrent)(*args[:5], initial_state=S0)
    np.testing.assert_array_equal(o1, o0)
    np.testing.assert_array_equal(s1, s0)
    # beyond N with a traced position (no static dispatch): the same values as the backbone
    o2, s2 = jax.jit(partial(proteus_gated_delta_recurrent, **N60))(
        *args[:5], initial_state=S0, t0=jnp.int32(60)
    )
    np.testing.assert_allclose(o2, o0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s2, s0, rtol=1e-6, atol=1e-6)


def _loss_and_grads(fn, q, k, v, g, beta, S0, **kw):
    rng = np.random.default_rng(7)
    wo = rng.normal(size=v.shape).astype(np.float32)
    ws = rng.normal(size=S0.shape).astype(np.float32)

    def loss(*a):
        o, S = fn(*a[:5], initial_state=a[5], **kw)
        return jnp.sum(o * wo) + jnp.sum(S * ws), (o, S)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
        q, k, v, g, beta, S0
    )


def test_gdn_chunked_equals_recurrent_values_and_grads():
    q, k, v, g, beta, S0 = gdn_inputs(T=37)
    kw = dict(t0=5, **N60)  # spans 10, 15, 12 with chunks of 16: every chunk straddles a boundary
    (_, (o_r, s_r)), gr = _loss_and_grads(proteus_gated_delta_recurrent, q, k, v, g, beta, S0, **kw)
    (_, (o_c, s_c)), gc = _loss_and_grads(
        proteus_gated_delta_chunked, q, k, v, g, beta, S0, chunk_size=16, **kw
    )
    np.testing.assert_allclose(o_c, o_r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-4, atol=1e-4)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "S0"), gc, gr, strict=True):
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale, err_msg=name)
    # locked rows of S0 pass straight through: gradient of the final state only
    K = q.shape[-1]
    locked = ~ref_open(5 + 37, 60, 4, K)
    rng = np.random.default_rng(7)
    rng.normal(size=v.shape)
    ws = rng.normal(size=S0.shape).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(gc[5])[..., locked, :], ws[..., locked, :])


def test_gdn_chunked_from_zero_state_equals_recurrent_values_and_grads():
    """No initial_state: the chunked form needs no injection tokens (locked rows stay 0)."""
    q, k, v, g, beta, _ = gdn_inputs(T=37)
    rng = np.random.default_rng(5)
    wo = rng.normal(size=v.shape).astype(np.float32)
    ws = rng.normal(size=(2, 2, 10, 6)).astype(np.float32)

    def grads(fn, **kw):
        def loss(*a):
            o, S = fn(*a, t0=5, **N60, **kw)
            return jnp.sum(o * wo) + jnp.sum(S * ws), (o, S)

        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(
            q, k, v, g, beta
        )

    (_, (o_r, s_r)), gr = grads(proteus_gated_delta_recurrent)
    for c in (16, 5):
        (_, (o_c, s_c)), gc = grads(proteus_gated_delta_chunked, chunk_size=c)
        np.testing.assert_allclose(o_c, o_r, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(s_c, s_r, rtol=1e-4, atol=1e-4)
        for name, a, b in zip(("q", "k", "v", "g", "beta"), gc, gr, strict=True):
            scale = max(1.0, float(np.abs(b).max()))
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale, err_msg=name)
        locked = ~ref_open(5 + 37, 60, 4, 10)
        assert not np.asarray(s_c)[..., locked, :].any()  # still the zero start, bit for bit


def _long_gdn():
    q, k, v, g, beta, S0 = gdn_inputs(B=1, T=100, H=1, K=8, V=5, seed=3)
    kw = dict(schedule=ProteusRule(blocks=4, context_len=64))  # Δ = 16 = chunk: spans 16 ×3, 52
    return (q, k, v, g, beta), S0, kw


def test_gdn_long_call_with_open_tail():
    seq, S0, kw = _long_gdn()
    o_r, s_r = rec(*seq, initial_state=S0, t0=0, **kw)
    o_ref, st_ref = ref_proteus_gdn(*seq, S0, 64, 4, 0)
    np.testing.assert_allclose(o_r, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s_r, st_ref[-1], rtol=1e-5, atol=1e-5)
    o_c, s_c = chk(*seq, initial_state=S0, t0=0, chunk_size=16, **kw)
    np.testing.assert_allclose(o_c, o_r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-4, atol=1e-4)


# the chunked form's t0 is also covered (t0 = 5) by the chunked = recurrent test
@pytest.mark.parametrize("form", ["recurrent", pytest.param("chunked", marks=pytest.mark.slow)])
def test_gdn_streaming_with_offset(form):
    """[0, 37) then [37, 100) carrying the state equals one call."""
    seq, S0, kw = _long_gdn()
    o_r, s_r = rec(*seq, initial_state=S0, t0=0, **kw)
    fn = rec if form == "recurrent" else partial(chk, chunk_size=16)
    T1 = 37
    o1, s1 = fn(*(x[:, :T1] for x in seq), initial_state=S0, t0=0, **kw)
    o2, s2 = fn(*(x[:, T1:] for x in seq), initial_state=s1, t0=T1, **kw)
    np.testing.assert_allclose(np.concatenate([o1, o2], 1), o_r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s2, s_r, rtol=1e-4, atol=1e-4)
    # rows still locked after the first part (t = 37: 3 blocks of 2 rows open) kept their bits
    np.testing.assert_array_equal(np.asarray(s1)[..., 6:, :], S0[..., 6:, :])


def test_gdn_errors():
    q, k, v, g, beta, S0 = gdn_inputs(B=1, T=5, H=1, K=3, V=2)
    with pytest.raises(ValueError, match="key dim K"):
        proteus_gated_delta_recurrent(q, k, v, g, beta, schedule=E4N8)
    q, k, v, g, beta, S0 = gdn_inputs(B=1, T=5, H=1, K=8, V=2)
    with pytest.raises(ValueError, match="t0"):
        proteus_gated_delta_chunked(q, k, v, g, beta, schedule=E4N8, t0=jnp.int32(3))
    with pytest.raises(ValueError, match="t0"):
        proteus_gated_delta_recurrent(q, k, v, g, beta, schedule=E4N8, t0=-1)
    with pytest.raises(ValueError, match="t0"):
        proteus_gated_delta_recurrent(
            q, k, v, g, beta, schedule=E4N8, t0=jnp.zeros((3,), jnp.int32)
        )
    with pytest.raises(ValueError, match=r"^ProteusRule\.context_len: must be an int"):
        proteus_gated_delta_chunked(q, k, v, g, beta, schedule=ProteusRule(4, 8.0))
    with pytest.raises(ValueError, match=r"^proteus_gated_delta_chunked: schedule must be a Prot"):
        proteus_gated_delta_chunked(q, k, v, g, beta, schedule=(4, 8))
    with pytest.raises(ValueError, match="initial_state"):
        proteus_gated_delta_chunked(q, k, v, g, beta, schedule=E4N8, initial_state=S0[..., :1])
    with pytest.raises(ValueError, match="beta"):
        proteus_gated_delta_recurrent(q, k, v, g, beta[:, :2], schedule=E4N8)
    with pytest.raises(ValueError, match="t "):
        proteus_gated_delta_step(
            S0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], t=0, schedule=E4N8
        )


# --------------------------------------------------------------------------------------------------
# Titans (L_M = 1 matrix memory and L_M = 2 MLP memory), momentum and decay on
# --------------------------------------------------------------------------------------------------


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _silu_grad(x):
    s = 1.0 / (1.0 + np.exp(-x))
    return s * (1.0 + x * (1.0 - s))


def ref_masks(t, N, E, dims):
    """Open coordinates of every weight at position t: L = 1 key rows; L ≥ 2 hidden units (a
    middle weight is open where both of its units are)."""
    L = len(dims) - 1
    if L == 1:
        return [np.broadcast_to(ref_open(t, N, E, dims[0])[:, None], dims)]
    hid = [ref_open(t, N, E, d) for d in dims[1:-1]]
    out = []
    for i in range(L):
        rows = hid[i - 1] if i > 0 else np.ones(dims[i], bool)
        cols = hid[i] if i < L - 1 else np.ones(dims[i + 1], bool)
        out.append(rows[:, None] & cols[None, :])
    return out


def ref_grad(W, k, v, residual):
    """∇ of ½‖M(k) − v‖² for M(z) = Wᵀz (L = 1) or z + W1ᵀ silu(W0ᵀ z) (L = 2)."""
    if len(W) == 1:
        return [np.outer(k, W[0].T @ k - v)]
    h = W[0].T @ k
    err = W[1].T @ _silu(h) + (k if residual else 0.0) - v
    d0 = (W[1] @ err) * _silu_grad(h)
    return [np.outer(k, d0), np.outer(_silu(h), err)]


def ref_read(W, q, residual):
    if len(W) == 1:
        return W[0].T @ q
    return W[1].T @ _silu(W[0].T @ q) + (q if residual else 0.0)


def ref_proteus_titans(W0, S0, q, k, v, th, et, al, N, E, t0, chunk=1, rbw=False):
    """float64 SPEC §2 + §4, per (b, h). Gradients are taken at the gated weights of the chunk
    start, chunks restart at every Δ-boundary (chunk = 1: the exact per-token recurrence)."""
    W0 = [np.asarray(w, np.float64) for w in W0]
    S0 = [np.asarray(s, np.float64) for s in S0]
    q, k, v, th, et, al = (np.asarray(x, np.float64) for x in (q, k, v, th, et, al))
    B, T, H, K = q.shape
    dims = (K, *(w.shape[-1] for w in W0))
    residual = len(W0) == 2 and K == v.shape[-1]
    y = np.zeros(v.shape)
    Wf = [w.copy() for w in W0]
    Sf = [s.copy() for s in S0]
    for b in range(B):
        for h in range(H):
            W = [w[b, h].copy() for w in W0]
            S = [s[b, h].copy() for s in S0]
            start, kprev = 0, None
            for i in range(T):
                t = t0 + i + 1
                ms = ref_masks(t, N, E, dims)
                kk = min(E, 1 + (t - 1) // max(1, N // E))
                if kk != kprev or (i - start) % chunk == 0:
                    if kk != kprev:
                        start, kprev = i, kk
                    Wc = [np.where(m, w, 0.0) for m, w in zip(ms, W, strict=True)]  # grad point
                u = ref_grad(Wc, k[b, i, h], v[b, i, h], residual)
                Wold = [np.where(m, w, 0.0) for m, w in zip(ms, W, strict=True)]
                S = [np.where(m, et[b, i, h] * s - th[b, i, h] * g, s)
                     for m, s, g in zip(ms, S, u, strict=True)]  # fmt: skip
                W = [np.where(m, (1 - al[b, i, h]) * w + s, w)
                     for m, w, s in zip(ms, W, S, strict=True)]  # fmt: skip
                Wread = Wold if rbw else [np.where(m, w, 0.0) for m, w in zip(ms, W, strict=True)]
                y[b, i, h] = ref_read(Wread, q[b, i, h], residual)
            for lst, new in ((Wf, W), (Sf, S)):
                for j, x in enumerate(new):
                    lst[j][b, h] = x
    return y, Wf, Sf


def titans_inputs(L, B=2, T=37, H=2, seed=0):
    """L = 1: K = 10, V = 6. L ≥ 2: K = V = 8 (residual memory), hidden 10 (blocks 2, 2, 2, 4)
    and, for L = 3, 12."""
    rng = np.random.default_rng(seed)
    K, V = (10, 6) if L == 1 else (8, 8)
    q = rng.normal(size=(B, T, H, K)).astype(np.float32)
    k = rng.normal(size=(B, T, H, K)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, V)).astype(np.float32)
    th = rng.uniform(0.05, 0.3, size=(B, T, H)).astype(np.float32)
    et = rng.uniform(0.5, 0.95, size=(B, T, H)).astype(np.float32)  # momentum on
    al = rng.uniform(0.01, 0.2, size=(B, T, H)).astype(np.float32)  # decay on
    dims = {1: (K, V), 2: (K, 10, V), 3: (K, 10, 12, V)}[L]
    W = tuple(
        (rng.normal(size=(B, H, a, b)) * a**-0.5).astype(np.float32)
        for a, b in zip(dims[:-1], dims[1:], strict=True)
    )
    S = tuple((0.1 * rng.normal(size=w.shape)).astype(np.float32) for w in W)  # momentum ≠ 0
    return TitansMLPState(W, S), (q, k, v, th, et, al)


mlp_rec = jax.jit(proteus_titans_mlp_recurrent, static_argnames=("schedule", "t0", "rule"))


@pytest.mark.parametrize("L", [1, 2])
def test_titans_recurrent_matches_reference_and_streams(L):
    st, seq = titans_inputs(L)
    for rbw in (True, False):
        rule = TitansRule(read_before_write=rbw)
        y, new = mlp_rec(*seq, initial_state=st, t0=5, rule=rule, **N60)
        y_ref, W_ref, S_ref = ref_proteus_titans(st.weights, st.momentum, *seq, 60, 4, 5, rbw=rbw)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(
            (*new.weights, *new.momentum), (*W_ref, *S_ref), rtol=1e-5, atol=1e-5
        )
    # streaming: [0, 20) then [20, 37) carrying the state equals one call (y, new: rbw = False)
    y1, s1 = mlp_rec(*(x[:, :20] for x in seq), initial_state=st, t0=5, **N60)
    y2, s2 = mlp_rec(*(x[:, 20:] for x in seq), initial_state=s1, t0=25, **N60)
    np.testing.assert_allclose(np.concatenate([y1, y2], 1), y, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(s2, new, rtol=1e-6, atol=1e-6)
    if L == 1:  # the matrix-memory API is the same memory
        y_lin, lin = jax.jit(partial(proteus_titans_linear_recurrent, t0=5, **N60))(
            *seq, initial_state=TitansLinearState(st.weights[0], st.momentum[0])
        )
        np.testing.assert_allclose(y_lin, y, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lin.M, new.weights[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("L", [1, 2, 3])
def test_titans_locked_coordinates_bit_identical_every_step(L):
    st, seq = titans_inputs(L)
    dims = (seq[0].shape[-1], *(w.shape[-1] for w in st.weights))

    @jax.jit
    def run(state):
        def body(s, xs):
            i, *tok = xs
            if L == 1:
                y, s = proteus_titans_linear_step(s, *tok, t=5 + i + 1, **N60)
            else:
                y, s = proteus_titans_mlp_step(s, *tok, t=5 + i + 1, **N60)
            return s, s

        tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
        return jax.lax.scan(body, state, (jnp.arange(37), *map(tm, seq)))[1]

    init = TitansLinearState(st.weights[0], st.momentum[0]) if L == 1 else st
    states = run(init)
    leaves = [np.asarray(x) for x in jax.tree.leaves(states)]  # each [T, B, H, d, d']
    firsts = [np.asarray(x) for x in jax.tree.leaves(init)]
    n_locked = 0
    for i in range(37):
        ms = ref_masks(5 + i + 1, 60, 4, dims)
        for j, (x, x0) in enumerate(zip(leaves, firsts, strict=True)):
            m = ms[j % len(ms)]  # leaves: weights then momenta
            prev = x0 if i == 0 else x[i - 1]
            np.testing.assert_array_equal(x[i][..., ~m], prev[..., ~m])  # momentum and decay too
            assert not np.allclose(x[i][..., m], prev[..., m])
            n_locked += (~m).sum()
    assert n_locked > 0


def _titans_grads(fn, st, seq, **kw):
    rng = np.random.default_rng(11)
    wy = rng.normal(size=seq[2].shape).astype(np.float32)
    ws = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), st)

    def loss(state, *xs):
        y, new = fn(state, *xs, **kw)
        tree = sum(
            jnp.sum(a * b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ws), strict=True)
        )
        return jnp.sum(y * wy) + tree, (y, new)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))(st, *seq)


def _lin(fn):
    """The matrix-memory API with the state as the first argument (for ``_titans_grads``)."""

    def call(state, *xs, **kw):
        y, new = fn(*xs, initial_state=TitansLinearState(*state), **kw)
        return y, (new.M, new.S)

    return call


def _mlp(fn):
    """The MLP API with the state as the first argument (for ``_titans_grads``)."""

    def call(state, *xs, **kw):
        return fn(*xs, initial_state=state, **kw)

    return call


@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize(
    ("t0", "B", "T"),
    [
        (5, 1, 25),  # spans 10, 15: each its own call
        (0, 2, 40),  # spans 15, 15, 10: the two 15s run as one scan with a traced mask
    ],
)
def test_titans_chunked_equals_recurrent_and_reference(L, t0, B, T):
    """L = 1 through the matrix-memory API, L = 2 through the MLP API."""
    st, seq = titans_inputs(L, B=B, T=T)
    if L == 1:
        st0 = (st.weights[0], st.momentum[0])
        rec_fn = _lin(proteus_titans_linear_recurrent)
        chk_fn = _lin(proteus_titans_linear_chunked)
    else:
        st0 = st
        rec_fn, chk_fn = _mlp(proteus_titans_mlp_recurrent), _mlp(proteus_titans_mlp_chunked)
    kw = dict(t0=t0, **N60)
    (_, (y_r, s_r)), g_r = _titans_grads(rec_fn, st0, seq, **kw)
    # memory_chunk = 1 is the recurrence (remat only changes what the backward pass recomputes)
    chunk1 = TitansRule(memory_chunk=1, remat=False)
    (_, (y_c, s_c)), g_c = _titans_grads(chk_fn, st0, seq, rule=chunk1, **kw)
    np.testing.assert_allclose(y_c, y_r, rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves((s_c, g_c)), jax.tree.leaves((s_r, g_r)), strict=True):
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale)
    # chunks of 4 inside each span: gradients at (gated) chunk starts, as the reference does it
    y4, s4 = jax.jit(partial(chk_fn, rule=CHUNK4, **kw))(st0, *seq)
    y_ref, W_ref, S_ref = ref_proteus_titans(st.weights, st.momentum, *seq, 60, 4, t0, chunk=4)
    np.testing.assert_allclose(y4, y_ref, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(
        jax.tree.leaves(s4), jax.tree.leaves((W_ref, S_ref)), rtol=1e-5, atol=1e-5
    )
    # coordinates still locked at the end of the call (2 or 3 blocks) kept their initial bits
    dims = (seq[0].shape[-1], *(w.shape[-1] for w in st.weights))
    ms = ref_masks(t0 + T, 60, 4, dims)
    for j, (a, b) in enumerate(zip(jax.tree.leaves(s4), jax.tree.leaves(st0), strict=True)):
        m = ms[j % len(ms)]
        assert (~m).any()
        np.testing.assert_array_equal(np.asarray(a)[..., ~m], b[..., ~m])


def test_titans_single_block_and_beyond_context_are_the_backbone():
    st, seq = titans_inputs(2, B=1, T=12)
    lin0 = TitansLinearState(st.weights[0][..., :8], st.momentum[0][..., :8])
    lin_seq = seq  # K = V = 8: a square matrix memory
    for kw in (dict(schedule=OFF60, t0=7), dict(**N60, t0=45)):
        assert _same_jaxpr(
            lambda s, *a, kw=kw: proteus_titans_mlp_recurrent(*a, initial_state=s, **kw),
            lambda s, *a: titans_mlp_recurrent(*a, initial_state=s), st, *seq,
        )  # fmt: skip
        assert _same_jaxpr(
            lambda s, *a, kw=kw: proteus_titans_mlp_chunked(
                *a, initial_state=s, rule=CHUNK4, **kw
            ),
            lambda s, *a: titans_mlp_chunked(*a, initial_state=s, rule=CHUNK4), st, *seq,
        )  # fmt: skip
        assert _same_jaxpr(
            lambda s, *a, kw=kw: proteus_titans_linear_recurrent(*a, initial_state=s, **kw),
            lambda s, *a: titans_linear_recurrent(*a, initial_state=s), lin0, *lin_seq,
        )  # fmt: skip
        assert _same_jaxpr(
            lambda s, *a, kw=kw: proteus_titans_linear_chunked(*a, initial_state=s, **kw),
            lambda s, *a: titans_linear_chunked(*a, initial_state=s), lin0, *lin_seq,
        )  # fmt: skip
    tok = tuple(x[:, 0] for x in seq)
    assert _same_jaxpr(
        lambda s, *a: proteus_titans_mlp_step(s, *a, t=46, **N60),
        titans_mlp_step, st, *tok,
    )  # fmt: skip
    assert _same_jaxpr(
        lambda s, *a: proteus_titans_linear_step(s, *a, t=2, schedule=OFF60),
        titans_linear_step, lin0, *tok,
    )  # fmt: skip
    # beyond N with a traced position: the backbone's values
    y, s = jax.jit(partial(proteus_titans_mlp_recurrent, **N60))(
        *seq, initial_state=st, t0=jnp.int32(60)
    )
    y0, s0 = jax.jit(titans_mlp_recurrent)(*seq, initial_state=st)
    np.testing.assert_allclose(y, y0, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(s, s0, rtol=1e-6, atol=1e-6)


def test_titans_errors():
    st, seq = titans_inputs(2, B=1, T=4)
    with pytest.raises(ValueError, match="activation"):
        sigmoid = TitansRule(activation="sigmoid")
        proteus_titans_mlp_recurrent(*seq, initial_state=st, rule=sigmoid, **N60)
    with pytest.raises(ValueError, match="hidden"):
        proteus_titans_mlp_chunked(*seq, initial_state=st, schedule=ProteusRule(16, 60))
    with pytest.raises(ValueError, match=r"^proteus_titans_mlp_chunked: rule must be a TitansRule"):
        proteus_titans_mlp_chunked(*seq, initial_state=st, rule=ProteusRule(4, 60), **N60)
    st1, seq1 = titans_inputs(1, B=1, T=4)
    with pytest.raises(ValueError, match="residual"):
        proteus_titans_mlp_recurrent(*seq1, initial_state=st1, residual=True, **N60)
    with pytest.raises(ValueError, match="state"):
        proteus_titans_mlp_recurrent(*seq, initial_state=st.weights, **N60)
    with pytest.raises(ValueError, match=r"initial_state: .*titans_mlp_state\(weights, B\)"):
        proteus_titans_mlp_chunked(*seq, **N60)
    with pytest.raises(ValueError, match="t0"):
        proteus_titans_linear_chunked(*seq1, t0=jnp.int32(1), **N60)
    with pytest.raises(ValueError, match="theta"):
        proteus_titans_linear_recurrent(*seq1[:3], seq1[3][:, :1], *seq1[4:], **N60)
