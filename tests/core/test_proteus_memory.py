"""Proteus-wrapped memories (SPEC §4): GDN and Titans, step / recurrent / chunked.

Checks: a float64 NumPy reference of SPEC §4 written from the equations (own block split and
schedule), the locked-coordinate invariant bit for bit at every t, E = 1 and "beyond N" being the
backbone itself (same jaxpr, same bits), chunked = recurrent (values and gradients) with chunks
straddling Δ-boundaries, and streaming with a position offset t0.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.associative import (
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
)
from nested_jax.core.proteus import proteus_active_blocks
from nested_jax.core.proteus_memory import (
    proteus_gated_delta_chunked,
    proteus_gated_delta_recurrent,
    proteus_gated_delta_step,
    proteus_spans,
)

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


N60 = dict(context_len=60, num_blocks=4)  # Δ = 15: chunks of 16 straddle every boundary
rec = jax.jit(proteus_gated_delta_recurrent, static_argnames=("context_len", "num_blocks", "t0"))
chk = jax.jit(
    proteus_gated_delta_chunked, static_argnames=("context_len", "num_blocks", "t0", "chunk_size")
)


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
    for kw in (dict(context_len=60, num_blocks=1, t0=7), dict(context_len=60, num_blocks=4, t0=45)):
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
        lambda S, *a: proteus_gated_delta_step(S, *a, t=3, context_len=60, num_blocks=1),
        gated_delta_step,
        S0,
        *tok,
    )
    # and the bits, compiled separately
    o1, s1 = rec(*args[:5], initial_state=S0, t0=7, context_len=60, num_blocks=1)
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


def test_gdn_long_call_with_open_tail_and_streaming():
    q, k, v, g, beta, S0 = gdn_inputs(B=1, T=100, H=1, K=8, V=5, seed=3)
    kw = dict(context_len=64, num_blocks=4)  # Δ = 16 = chunk: partial spans 16, 16, 16; tail 52
    o_r, s_r = rec(q, k, v, g, beta, initial_state=S0, t0=0, **kw)
    o_ref, st_ref = ref_proteus_gdn(q, k, v, g, beta, S0, 64, 4, 0)
    np.testing.assert_allclose(o_r, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s_r, st_ref[-1], rtol=1e-5, atol=1e-5)
    o_c, s_c = chk(q, k, v, g, beta, initial_state=S0, t0=0, chunk_size=16, **kw)
    np.testing.assert_allclose(o_c, o_r, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-4, atol=1e-4)
    # streaming: [0, 37) then [37, 100) carrying the state equals one call (both forms)
    T1 = 37
    first = tuple(x[:, :T1] for x in (q, k, v, g, beta))
    second = tuple(x[:, T1:] for x in (q, k, v, g, beta))
    for fn, extra in ((rec, {}), (chk, dict(chunk_size=16))):
        o1, s1 = fn(*first, initial_state=S0, t0=0, **extra, **kw)
        o2, s2 = fn(*second, initial_state=s1, t0=T1, **extra, **kw)
        np.testing.assert_allclose(np.concatenate([o1, o2], 1), o_r, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(s2, s_r, rtol=1e-4, atol=1e-4)
        # rows still locked after the first part (t = 37: 3 blocks) kept their bits
        np.testing.assert_array_equal(np.asarray(s1)[..., 6:, :], S0[..., 6:, :])


def test_gdn_errors():
    q, k, v, g, beta, S0 = gdn_inputs(B=1, T=5, H=1, K=3, V=2)
    with pytest.raises(ValueError, match="key dim K"):
        proteus_gated_delta_recurrent(q, k, v, g, beta, context_len=8, num_blocks=4)
    q, k, v, g, beta, S0 = gdn_inputs(B=1, T=5, H=1, K=8, V=2)
    with pytest.raises(ValueError, match="t0"):
        proteus_gated_delta_chunked(q, k, v, g, beta, context_len=8, num_blocks=4, t0=jnp.int32(3))
    with pytest.raises(ValueError, match="t0"):
        proteus_gated_delta_recurrent(q, k, v, g, beta, context_len=8, num_blocks=4, t0=-1)
    with pytest.raises(ValueError, match="t0"):
        proteus_gated_delta_recurrent(
            q, k, v, g, beta, context_len=8, num_blocks=4, t0=jnp.zeros((3,), jnp.int32)
        )
    with pytest.raises(ValueError, match="context_len"):
        proteus_gated_delta_chunked(q, k, v, g, beta, context_len=8.0, num_blocks=4)
    with pytest.raises(ValueError, match="initial_state"):
        proteus_gated_delta_chunked(
            q, k, v, g, beta, context_len=8, num_blocks=4, initial_state=S0[..., :1]
        )
    with pytest.raises(ValueError, match="beta"):
        proteus_gated_delta_recurrent(q, k, v, g, beta[:, :2], context_len=8, num_blocks=4)
    with pytest.raises(ValueError, match="t "):
        proteus_gated_delta_step(
            S0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], t=0, context_len=8, num_blocks=4
        )
