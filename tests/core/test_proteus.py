"""Proteus schedule, masks and the locked-coordinate invariant (SPEC §4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.associative.forms import gated_delta_step
from nested_jax.core.proteus import (
    proteus_active_blocks,
    proteus_block_ids,
    proteus_block_len,
    proteus_block_mask,
    proteus_chunk_constant,
    proteus_gate,
    proteus_gated_step,
    proteus_gated_update,
    proteus_hidden_mask,
    proteus_key_mask,
    proteus_mlp_masks,
)

WORKED = [(1, 1), (2, 1), (512, 1), (513, 2), (1024, 2), (1025, 3), (4096, 8), (7680, 15),
          (7681, 16), (8192, 16), (8193, 16), (20000, 16)]  # fmt: skip


@pytest.mark.parametrize("t, k", WORKED)
def test_worked_example_int(t, k):
    assert proteus_block_len(8192, 16) == 512
    assert proteus_active_blocks(t, 8192, 16) == k


def test_worked_example_array_and_jit():
    ts = np.array([t for t, _ in WORKED], np.int32)
    want = np.array([k for _, k in WORKED])
    got = jax.jit(proteus_active_blocks, static_argnums=(1, 2))(ts, 8192, 16)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.int32
    # the whole range 1..512 is one block, and the schedule is non-decreasing
    full = np.asarray(proteus_active_blocks(jnp.arange(1, 20001), 8192, 16))
    assert (full[:512] == 1).all() and full[512] == 2
    assert (np.diff(full) >= 0).all() and full.max() == 16


def test_single_block_always_open_and_tiny_context():
    assert all(proteus_active_blocks(t, 8192, 1) == 1 for t in (1, 100, 8192, 10**6))
    # N < E: Δ = 1, one new block per position
    assert proteus_block_len(5, 16) == 1
    assert [proteus_active_blocks(t, 5, 16) for t in (1, 2, 5, 16, 17)] == [1, 2, 5, 16, 16]


def test_schedule_errors():
    with pytest.raises(ValueError, match="^t "):
        proteus_active_blocks(0, 8192, 16)
    with pytest.raises(ValueError, match="context_len"):
        proteus_active_blocks(1, 0, 16)
    with pytest.raises(ValueError, match="num_blocks"):
        proteus_active_blocks(1, 8192, 0)
    with pytest.raises(ValueError, match="^t "):
        proteus_active_blocks(jnp.ones(3), 8192, 16)  # float positions


def test_block_split_remainder_goes_to_last_block():
    np.testing.assert_array_equal(proteus_block_ids(8, 4), [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(proteus_block_ids(10, 4), [0, 0, 1, 1, 2, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(proteus_block_ids(5, 1), [0] * 5)
    with pytest.raises(ValueError, match="size"):
        proteus_block_ids(3, 4)
    m = proteus_block_mask(jnp.array([0, 1, 3, 4]), 10, 4)
    np.testing.assert_array_equal(m.sum(-1), [0, 2, 6, 10])


def test_key_and_mlp_masks():
    # K = 10, E = 4, N = 8 → Δ = 2: t = 3 opens 2 blocks = first 4 keys
    m = proteus_key_mask(3, 8, 4, 10)
    np.testing.assert_array_equal(m, [1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    # beyond the training context everything is open
    np.testing.assert_array_equal(proteus_key_mask(100, 8, 4, 10), np.ones(10))
    ts = jnp.arange(1, 10)
    mb = proteus_key_mask(ts, 8, 4, 10, dtype=bool)
    assert mb.shape == (9, 10) and mb.dtype == jnp.bool_
    np.testing.assert_array_equal(mb.sum(-1), [2, 2, 4, 4, 6, 6, 10, 10, 10])
    np.testing.assert_array_equal(proteus_hidden_mask(ts, 8, 4, 10), mb.astype(np.float32))
    w1m, w2m = proteus_mlp_masks(3, 8, 4, 10)
    assert w1m.shape == (1, 10) and w2m.shape == (10, 1)
    W1 = jnp.ones((6, 10))  # [d_out, h]: columns are hidden units
    W2 = jnp.ones((10, 6))  # [h, d_in]: rows are hidden units
    np.testing.assert_array_equal((W1 * w1m).sum(0), [6, 6, 6, 6, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal((W2 * w2m).sum(1), [6, 6, 6, 6, 0, 0, 0, 0, 0, 0])


def test_gate_and_update_keep_locked_bits():
    prev = jnp.array([[1.0, jnp.inf], [jnp.nan, 2.0]])
    cand = jnp.array([[5.0, 6.0], [7.0, 8.0]])
    mask = jnp.array([1.0, 0.0])[:, None]  # row 0 open, row 1 locked
    out = proteus_gated_update(prev, cand, mask)
    np.testing.assert_array_equal(out[0], cand[0])
    assert np.isnan(out[1, 0]) and out[1, 1] == 2.0  # a locked nan stays nan (no 0·x arithmetic)
    gated = proteus_gate(prev, mask)
    np.testing.assert_array_equal(gated, [[1.0, np.inf], [0.0, 0.0]])
    # pytree states with a pytree of masks
    st = {"a": jnp.ones((2, 3)), "b": jnp.ones((3, 2))}
    masks = {"a": jnp.array([1.0, 0.0, 0.0])[None, :], "b": jnp.array([1.0, 0.0, 0.0])[:, None]}
    new = proteus_gated_update(st, jax.tree.map(lambda x: 3 * x, st), masks)
    np.testing.assert_array_equal(new["a"], [[3, 1, 1], [3, 1, 1]])
    np.testing.assert_array_equal(new["b"], [[3, 3], [1, 1], [1, 1]])
    with pytest.raises(ValueError, match="candidate"):
        proteus_gated_update(st, {"a": st["a"]}, masks)
    with pytest.raises(ValueError, match="mask"):
        proteus_gated_update(st, st, {"c": 1.0})


def _gdn_inputs(T=24, B=2, H=2, K=8, V=5, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(T, B, H, K)).astype(np.float32)
    k = rng.normal(size=(T, B, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(T, B, H, V)).astype(np.float32)
    g = -rng.uniform(0.05, 0.5, size=(T, B, H)).astype(np.float32)  # decay on
    beta = rng.uniform(0.2, 0.9, size=(T, B, H)).astype(np.float32)
    S0 = rng.normal(size=(B, H, K, V)).astype(np.float32)  # nonzero so decay would show
    return q, k, v, g, beta, S0


def _proteus_gdn(q, k, v, g, beta, S0, context_len, num_blocks, gate_single_block=False):
    """GDN with Proteus on key rows; GDN reads after its write, so the read uses g ⊙ q."""
    K = q.shape[-1]

    def body(S, inp):
        t, q_t, k_t, v_t, g_t, b_t = inp
        if num_blocks == 1 and not gate_single_block:
            # static short-circuit: E = 1 runs the backbone step untouched
            o, S_new = proteus_gated_step(gated_delta_step, S, None, q_t, k_t, v_t, g_t, b_t)
            return S_new, (o, S_new)
        key_mask = proteus_key_mask(t, context_len, num_blocks, K)  # [K]
        o, S_new = proteus_gated_step(
            gated_delta_step, S, key_mask[:, None], q_t * key_mask, k_t, v_t, g_t, b_t
        )
        return S_new, (o, S_new)

    ts = jnp.arange(1, q.shape[0] + 1)
    _, (o, states) = jax.lax.scan(body, jnp.asarray(S0), (ts, q, k, v, g, beta))
    return o, states


def test_gated_delta_rule_invariant_every_step():
    q, k, v, g, beta, S0 = _gdn_inputs()
    N, E, K = 16, 4, q.shape[-1]  # Δ = 4: all 4 blocks open from t = 13
    o, states = jax.jit(_proteus_gdn, static_argnums=(6, 7))(q, k, v, g, beta, S0, N, E)
    states = np.asarray(states)
    prev = np.concatenate([S0[None], states[:-1]])
    for t in range(1, q.shape[0] + 1):
        km = np.asarray(proteus_key_mask(t, N, E, K)).astype(bool)
        # locked key rows are bit-identical to their previous value (despite decay g < 0)
        np.testing.assert_array_equal(states[t - 1][..., ~km, :], prev[t - 1][..., ~km, :])
        # the read sees only open rows of the new state
        want_o = np.einsum("bhkv,bhk->bhv", states[t - 1] * km[:, None], q[t - 1] * K**-0.5)
        np.testing.assert_allclose(o[t - 1], want_o, rtol=1e-5, atol=1e-5)
        if t <= 12:
            assert (~km).any()  # the check above was not vacuous
        else:
            assert km.all()
    # open rows moved (the write happened)
    assert not np.array_equal(states[0][..., :2, :], S0[..., :2, :])


def test_single_block_equals_backbone_bit_for_bit():
    q, k, v, g, beta, S0 = _gdn_inputs(seed=1)
    o1, s1 = _proteus_gdn(q, k, v, g, beta, S0, 16, 1)

    def body(S, inp):
        o, S = gated_delta_step(S, *inp)
        return S, (o, S)

    _, (o0, s0) = jax.lax.scan(body, jnp.asarray(S0), (q, k, v, g, beta))
    np.testing.assert_array_equal(o1, o0)
    np.testing.assert_array_equal(s1, s0)
    # an all-ones mask gives the same values (XLA may fuse the selects differently: last-ulp only)
    o2, s2 = _proteus_gdn(q, k, v, g, beta, S0, 16, 1, gate_single_block=True)
    np.testing.assert_allclose(o2, o0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s2, s0, rtol=1e-6, atol=1e-6)


def _titans_step(state, k_t, v_t, theta, eta, alpha):
    """Linear memory with momentum and decay: S ← ηS − θ∇, M ← (1 − α)M + S, ∇ = k(Mᵀk − v)ᵀ."""
    M, S = state
    grad = k_t[:, None] * (M.T @ k_t - v_t)[None, :]
    S = eta * S - theta * grad
    M = (1.0 - alpha) * M + S
    return M.T @ k_t, (M, S)


@pytest.mark.parametrize("gate_all_states", [True, False])
def test_invariant_with_momentum_and_decay(gate_all_states):
    rng = np.random.default_rng(2)
    K, V, T, N, E = 8, 3, 20, 16, 4
    M = jnp.asarray(rng.normal(size=(K, V)), jnp.float32)
    S = jnp.asarray(rng.normal(size=(K, V)), jnp.float32)
    ks = rng.normal(size=(T, K)).astype(np.float32)
    vs = rng.normal(size=(T, V)).astype(np.float32)
    state = (M, S)
    violated = False
    for t in range(1, T + 1):
        km = proteus_key_mask(t, N, E, K)[:, None]
        if gate_all_states:
            _, new = proteus_gated_step(
                _titans_step, state, km, ks[t - 1], vs[t - 1], 0.1, 0.9, 0.05
            )
        else:
            # the naive variant masks only the gradient: decay and momentum still move locked rows
            _, cand = _titans_step(proteus_gate(state, km), ks[t - 1], vs[t - 1], 0.1, 0.9, 0.05)
            new = (
                cand[0] * km + (1 - km) * (1 - 0.05) * state[0],
                cand[1] * km + (1 - km) * 0.9 * state[1],
            )
        locked = ~np.asarray(km[:, 0]).astype(bool)
        for a, b in zip(new, state, strict=True):
            same = np.array_equal(np.asarray(a)[locked], np.asarray(b)[locked])
            violated |= not same
        state = new
    assert violated != gate_all_states


@pytest.mark.parametrize(
    "C, N, E",
    [(64, 8192, 16), (512, 8192, 16), (100, 8192, 16), (7, 20, 3), (5, 21, 4), (3, 30, 1)],
)
def test_chunk_constant_matches_brute_force(C, N, E):
    ts = np.arange(1, 2 * N + C + 1)
    k = np.asarray(proteus_active_blocks(jnp.asarray(ts), N, E))
    chunks = k[: (len(k) // C) * C].reshape(-1, C)
    brute = bool((chunks == chunks[:, :1]).all())
    assert proteus_chunk_constant(C, N, E) == brute
