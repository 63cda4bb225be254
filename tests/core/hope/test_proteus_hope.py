"""Proteus-wrapped Hope memories (SPEC §3.2, §4): step / recurrent / chunked.

Checks: a float64 NumPy reference written from the equations (own schedule, own Hope chunk rule
with the grid restarting at Δ-boundaries), the locked-coordinate invariant bit for bit at every t
on every memory's weights and momenta (momentum and decay on), E = 1 and "beyond N" being the
backbone itself (same jaxpr, same bits), chunked (chunk sizes 1) = recurrent in values and
gradients across Δ-boundaries, and the argument checks.
"""

import dataclasses
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.hope.chunk import hope_chunked
from nested_jax.core.hope.proteus import (
    proteus_hope_chunked,
    proteus_hope_recurrent,
    proteus_hope_step,
)
from nested_jax.core.hope.state import HopeMemories, HopeReadout, HopeState, MLPMemory
from nested_jax.core.hope.token import hope_recurrent, hope_step
from nested_jax.rules import HopeRule, ProteusRule

B, H, D, HID = 2, 2, 6, 10  # E = 4 hidden blocks of 2, 2, 2, 4 units (remainder in the last)
N48 = ProteusRule(blocks=4, context_len=48)  # Δ = 12
MU = 0.5
RULE = HopeRule(momentum=True, momentum_coef=MU)  # decay is on by default
NAMES = ("k", "v", "eta", "alpha", "memory")

# --------------------------------------------------------------------------------------------------
# Independent float64 reference (SPEC §3.2 + §4)
# --------------------------------------------------------------------------------------------------


def ref_open(t, N, E, h):
    """bool [h]: hidden units of the first k(t) blocks; blocks of ⌊h/E⌋, remainder in the last."""
    k = min(E, 1 + (t - 1) // max(1, N // E))
    return np.minimum(np.arange(h) // (h // E), E - 1) < k


def _sig(a):
    return 1.0 / (1.0 + np.exp(-a))


def _silu(a):
    return a * _sig(a)


def _dsilu(a):
    s = _sig(a)
    return s * (1.0 + a * (1.0 - s))


def _apply(w1, w2, z):
    return z + w1 @ _silu(w2 @ z)


def _l2(z):
    return z / np.sqrt(np.sum(z * z) + 1e-6)


def ref_proteus_hope(x, q, state, ro, N, E, t0, c_mem=1, c_other=1):
    """Per (b, h): chunk-start snapshots of the *gated* memories, restarted at every Δ-boundary;
    running weights gated at every token; DGD (exact γ) with momentum μ and retention α; locked
    coordinates restored. Returns ``(o, {name: (w1, w2)}, {name: (s1, s2)})``."""
    x, q = np.asarray(x, np.float64), np.asarray(q, np.float64)
    W = {n: [np.array(w, np.float64) for w in getattr(state.memories, n)] for n in NAMES}
    S = {n: [np.array(s, np.float64) for s in getattr(state.momentum, n)] for n in NAMES}
    ew, eb, aw, ab = (np.asarray(r, np.float64) for r in ro)
    Bn, T, Hn, _ = x.shape
    t0 = np.broadcast_to(np.asarray(t0), (Bn,))
    o = np.zeros(x.shape)
    for b in range(Bn):
        for h in range(Hn):
            kprev = start = None
            snap = {}
            for i in range(T):
                t = int(t0[b]) + i + 1
                m = ref_open(t, N, E, HID)
                mc, mr = m[None, :], m[:, None]  # w1 [D, h] columns, w2 [h, D] rows

                def gate(n, m=m, b=b, h=h):
                    w1, w2 = W[n][0][b, h], W[n][1][b, h]
                    return np.where(m[None, :], w1, 0.0), np.where(m[:, None], w2, 0.0)

                kk = min(E, 1 + (t - 1) // max(1, N // E))
                if kk != kprev:
                    kprev, start = kk, i
                if (i - start) % c_other == 0:  # projection memories' chunk start
                    snap.update({n: gate(n) for n in NAMES if n != "memory"})
                if (i - start) % c_mem == 0:  # M_memory's chunk start
                    snap["memory"] = gate("memory")
                xi = x[b, i, h]
                k = _l2(_apply(*snap["k"], xi))
                v = _apply(*snap["v"], xi)
                eta = _sig(ew[h] @ _apply(*snap["eta"], xi) + eb[h])
                alpha = _sig(aw[h] @ _apply(*snap["alpha"], xi) + ab[h])
                o[b, i, h] = _apply(*gate("memory"), _l2(q[b, i, h]))  # read before write
                for n in NAMES:
                    s1, s2 = snap[n]
                    a = s2 @ k
                    e = k + s1 @ _silu(a) - _apply(s1, s2, v)
                    signals = ((_silu(a), e), (k, _dsilu(a) * (s1.T @ e)))  # (input, signal)
                    for j, ((xin, g), msk) in enumerate(zip(signals, (mc, mr), strict=True)):
                        Wg = np.where(msk, W[n][j][b, h], 0.0)
                        Sg = np.where(msk, S[n][j][b, h], 0.0)
                        gamma = eta / (1.0 + eta * xin @ xin)
                        u = MU * Sg - gamma * (np.outer(Wg @ xin, xin) + np.outer(g, xin))
                        W[n][j][b, h] = np.where(msk, alpha * Wg + u, W[n][j][b, h])
                        S[n][j][b, h] = np.where(msk, u, S[n][j][b, h])
    return o, W, S


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def setup(T=29, seed=0, B=B):
    rng = np.random.default_rng(seed)
    f = lambda *s, c=1.0: (c * rng.normal(size=s)).astype(np.float32)  # noqa: E731
    mems = HopeMemories(
        **{n: MLPMemory(f(B, H, D, HID, c=0.3), f(B, H, HID, D, c=0.3)) for n in NAMES}
    )
    moms = HopeMemories(
        **{n: MLPMemory(f(B, H, D, HID, c=0.05), f(B, H, HID, D, c=0.05)) for n in NAMES}
    )
    # η ≈ 0.12, α ≈ 0.88: strong enough decay that a decayed locked coordinate would show
    ro = HopeReadout(
        f(H, D), np.full((H,), -2.0, np.float32), f(H, D), np.full((H,), 2.0, np.float32)
    )
    return HopeState(mems, moms), ro, f(B, T, H, D), f(B, T, H, D)


def _leaves_with_masks(state, t):
    """(leaf, open-mask) pairs over every memory's w1, w2 and momenta at position t."""
    m = ref_open(t, 48, 4, HID)
    out = []
    for tree in (state.memories, state.momentum):
        for n in NAMES:
            w1, w2 = getattr(tree, n)
            out += [(np.asarray(w1), m[None, :]), (np.asarray(w2), m[:, None])]
    return out


STATIC = ("schedule", "t0", "rule")
rec = jax.jit(proteus_hope_recurrent, static_argnames=STATIC)
chk = jax.jit(proteus_hope_chunked, static_argnames=STATIC)


def _chunks(c_mem, c_other=1):
    """:data:`RULE` with the chunk sizes ``(c_mem, c_other)``."""
    return dataclasses.replace(RULE, chunk_memory=c_mem, chunk_other=c_other)


def _close_state(st, W, S, tol=2e-5):
    for n in NAMES:
        for j in range(2):
            np.testing.assert_allclose(getattr(st.memories, n)[j], W[n][j], rtol=tol, atol=tol)
            np.testing.assert_allclose(getattr(st.momentum, n)[j], S[n][j], rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


def test_recurrent_matches_reference_and_ragged_t0():
    st, ro, x, q = setup(T=20)
    o, new = rec(
        x, q, ro, initial_state=st, t0=5, schedule=N48, rule=RULE
    )  # positions 6..25: blocks 1, 2, 3 open
    o_ref, W, S = ref_proteus_hope(x, q, st, ro, 48, 4, 5)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    _close_state(new, W, S)
    # traced per-row positions: row 0 starts fresh, row 1 crosses into the fully open range
    t0 = jnp.array([0, 30], jnp.int32)
    o2, new2 = jax.jit(partial(proteus_hope_recurrent, schedule=N48, rule=RULE))(
        x, q, ro, initial_state=st, t0=t0
    )
    o_ref2, W2, S2 = ref_proteus_hope(x, q, st, ro, 48, 4, np.array([0, 30]))
    np.testing.assert_allclose(o2, o_ref2, rtol=2e-5, atol=2e-5)
    _close_state(new2, W2, S2)


def test_locked_coordinates_bit_identical_every_step():
    st, ro, x, q = setup(T=29)
    T0 = 5

    @jax.jit
    def run(state):
        def body(s, xs):
            i, x_t, q_t = xs
            _, s = proteus_hope_step(s, x_t, q_t, ro, t=T0 + i + 1, schedule=N48, rule=RULE)
            return s, s

        tm = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731
        return jax.lax.scan(body, state, (jnp.arange(x.shape[1]), tm(x), tm(q)))[1]

    states = run(st)
    n_locked = 0
    for i in range(x.shape[1]):
        prev = st if i == 0 else jax.tree.map(lambda a, i=i: a[i - 1], states)
        cur = jax.tree.map(lambda a, i=i: a[i], states)
        for (a, m), (b, _) in zip(
            _leaves_with_masks(cur, T0 + i + 1), _leaves_with_masks(prev, T0 + i + 1), strict=True
        ):
            locked = np.broadcast_to(~m, a.shape[-2:])
            np.testing.assert_array_equal(a[..., locked], b[..., locked])  # write, decay, momentum
            assert not np.allclose(a[..., ~locked], b[..., ~locked])  # open coordinates do move
            n_locked += locked.sum()
    assert n_locked > 0
    # the step form is the recurrent form
    _, new = rec(x, q, ro, initial_state=st, t0=T0, schedule=N48, rule=RULE)
    last = jax.tree.map(lambda a: a[-1], states)
    chex.assert_trees_all_close(last, new, rtol=1e-6, atol=1e-6)


def _same_jaxpr(f, g, *args):
    return str(jax.make_jaxpr(f)(*args)) == str(jax.make_jaxpr(g)(*args))


def test_single_block_and_beyond_context_are_the_backbone():
    st, ro, x, q = setup(T=7)
    one = ProteusRule(blocks=1, context_len=48)
    chunks = _chunks(2, 4)
    for kw in (dict(schedule=one, t0=3), dict(schedule=N48, t0=36)):
        assert _same_jaxpr(
            lambda x, q, r, s, kw=kw: proteus_hope_recurrent(
                x, q, r, initial_state=s, rule=RULE, **kw
            ),
            lambda x, q, r, s: hope_recurrent(x, q, r, initial_state=s, rule=RULE),
            x, q, ro, st,
        )  # fmt: skip
        assert _same_jaxpr(
            lambda x, q, r, s, kw=kw: proteus_hope_chunked(
                x, q, r, initial_state=s, rule=chunks, **kw
            ),
            lambda x, q, r, s: hope_chunked(x, q, r, initial_state=s, rule=chunks),
            x, q, ro, st,
        )  # fmt: skip
    assert _same_jaxpr(
        lambda *a: proteus_hope_step(*a, t=2, schedule=one, rule=RULE),
        lambda *a: hope_step(*a, rule=RULE),
        st, x[:, 0], q[:, 0], ro,
    )  # fmt: skip
    # and the bits, compiled separately
    o1, s1 = chk(x, q, ro, initial_state=st, t0=3, schedule=one, rule=_chunks(2))
    o0, s0 = jax.jit(partial(hope_chunked, rule=_chunks(2)))(x, q, ro, initial_state=st)
    np.testing.assert_array_equal(o1, o0)
    chex.assert_trees_all_equal(s1, s0)
    # beyond N with a traced position (no static dispatch): the backbone's values
    o2, s2 = jax.jit(partial(proteus_hope_recurrent, schedule=N48, rule=RULE))(
        x, q, ro, initial_state=st, t0=jnp.int32(40)
    )
    o3, s3 = jax.jit(partial(hope_recurrent, rule=RULE))(x, q, ro, initial_state=st)
    np.testing.assert_allclose(o2, o3, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(s2, s3, rtol=1e-6, atol=1e-6)


def _grads(fn, st, ro, x, q, **kw):
    rng = np.random.default_rng(3)
    wo = rng.normal(size=x.shape).astype(np.float32)
    ws = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), st)

    def loss(x, q, st, ro):
        o, new = fn(x, q, ro, initial_state=st, **kw)
        tree = sum(
            jnp.sum(a * b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ws), strict=True)
        )
        return jnp.sum(o * wo) + tree, (o, new)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, q, st, ro)


@pytest.mark.slow  # test_conformance.py: chunk_size_one[proteus_hope], values and grads
def test_chunked_unit_chunks_equal_recurrent_values_and_grads():
    st, ro, x, q = setup(T=18, B=1)
    kw = dict(t0=8, schedule=N48, rule=RULE)  # positions 9..26: spans 4, 12, 2 (blocks 1, 2, 3)
    (_, (o_r, s_r)), g_r = _grads(proteus_hope_recurrent, st, ro, x, q, **kw)
    (_, (o_c, s_c)), g_c = _grads(proteus_hope_chunked, st, ro, x, q, **kw)
    np.testing.assert_allclose(o_c, o_r, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves((s_c, g_c)), jax.tree.leaves((s_r, g_r)), strict=True):
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale)
    # the gradient of locked initial coordinates is the pass-through of the final-state weight
    assert float(np.abs(np.asarray(g_c[2].memories.memory.w1)[..., -4:]).max()) > 0


@pytest.mark.parametrize("c_mem,c_other,t0", [(4, 2, 0), (3, 6, 12)])
def test_chunked_matches_reference_with_snapshots(c_mem, c_other, t0):
    """Chunk sizes dividing Δ = 12 and t0: the global grid; spans with 1..4 blocks open."""
    st, ro, x, q = setup(T=30)
    o, new = chk(x, q, ro, initial_state=st, t0=t0, schedule=N48, rule=_chunks(c_mem, c_other))
    o_ref, W, S = ref_proteus_hope(x, q, st, ro, 48, 4, t0, c_mem=c_mem, c_other=c_other)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    _close_state(new, W, S)
    if t0 == 0:  # last hidden block still locked at t = 30: its initial bits are kept
        for (a, m), (b, _) in zip(
            _leaves_with_masks(new, 30), _leaves_with_masks(st, 30), strict=True
        ):
            locked = np.broadcast_to(~m, a.shape[-2:])
            assert locked.any()
            np.testing.assert_array_equal(a[..., locked], b[..., locked])


def test_bad_inputs_raise_naming_the_argument():
    st, ro, x, q = setup(T=4)
    with pytest.raises(ValueError, match="hidden size"):
        proteus_hope_recurrent(
            x, q, ro, initial_state=st, schedule=ProteusRule(blocks=16, context_len=48)
        )
    with pytest.raises(ValueError, match="activation"):
        proteus_hope_chunked(x, q, ro, initial_state=st, activation=jax.nn.sigmoid, schedule=N48)
    with pytest.raises(ValueError, match="t0"):
        proteus_hope_chunked(x, q, ro, initial_state=st, t0=jnp.int32(2), schedule=N48)
    with pytest.raises(ValueError, match="t0"):
        proteus_hope_recurrent(
            x, q, ro, initial_state=st, t0=jnp.zeros((3,), jnp.int32), schedule=N48
        )
    with pytest.raises(ValueError, match=r"^ProteusRule\.context_len"):
        proteus_hope_recurrent(
            x, q, ro, initial_state=st, schedule=ProteusRule(blocks=4, context_len=48.0)
        )
    with pytest.raises(ValueError, match=r"^proteus_hope_recurrent: schedule must be a Proteus"):
        proteus_hope_recurrent(x, q, ro, initial_state=st, schedule=(4, 48))
    with pytest.raises(ValueError, match=r"^proteus_hope_chunked: rule must be a HopeRule"):
        proteus_hope_chunked(x, q, ro, initial_state=st, schedule=N48, rule={"momentum": True})
    with pytest.raises(ValueError, match="x must"):
        proteus_hope_chunked(x[0], q, ro, initial_state=st, schedule=N48)
    with pytest.raises(ValueError, match="q must"):
        proteus_hope_chunked(x, q[:, :2], ro, initial_state=st, schedule=N48)
    with pytest.raises(ValueError, match="state"):
        proteus_hope_recurrent(x, q, ro, initial_state=st.memories, schedule=N48)
    with pytest.raises(ValueError, match=r"initial_state: .*hope_init_state\(memories, B\)"):
        proteus_hope_chunked(x, q, ro, schedule=N48)
    with pytest.raises(TypeError, match="segment_ids"):  # packed rows: proteus_hope_packed
        proteus_hope_chunked(
            x, q, ro, initial_state=st, segment_ids=jnp.zeros((B, 4), jnp.int32), schedule=N48
        )
    with pytest.raises(ValueError, match="t "):
        proteus_hope_step(st, x[:, 0], q[:, 0], ro, t=0, schedule=N48)
