"""Accumulate over a period, apply at its boundary (nested_jax.core.periods, SPEC §3.3) against
plain Python loops over the steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.periods import (
    accumulate,
    apply_at_boundary,
    clear_at_boundary,
    period_boundary,
    reset_to_slower,
    select_at_boundary,
)


def test_period_boundary_is_count_mod_period_for_int_and_array_periods():
    for period in (1, 3, 4, 7):
        for p in (period, jnp.asarray(period), jnp.asarray(float(period))):
            got = [bool(period_boundary(jnp.asarray(n, jnp.int32), p)) for n in range(30)]
            assert got == [n % period == 0 for n in range(30)]
    got = jax.jit(period_boundary)(jnp.arange(1, 13, dtype=jnp.int32), 4)
    np.testing.assert_array_equal(got, np.arange(1, 13) % 4 == 0)


def _signals(n, shape, seed=0):
    return np.random.default_rng(seed).normal(size=(n,) + shape).astype(np.float32)


@pytest.mark.parametrize("period", [1, 3, 5])
def test_accumulate_then_apply_equals_a_hand_loop(period):
    n_steps, shape = 13, (3, 2)  # 13: the last period stays pending in the accumulator
    us = _signals(n_steps, shape)
    w0 = np.random.default_rng(1).normal(size=shape).astype(np.float32)

    @jax.jit
    def run(w, us):
        def step(carry, inp):
            w, a = carry
            n, u = inp
            a = accumulate(a, u)
            return apply_at_boundary(w, a, period_boundary(n, period)), w

        counts = jnp.arange(1, n_steps + 1, dtype=jnp.int32)
        return jax.lax.scan(step, (w, jnp.zeros_like(w)), (counts, us))

    (w, a), hist = run(jnp.asarray(w0), jnp.asarray(us))

    hw, ha, hand_hist = w0.copy(), np.zeros_like(w0), []
    for n in range(1, n_steps + 1):
        hand_hist.append(hw.copy())
        ha = ha + us[n - 1]
        if n % period == 0:
            hw, ha = hw - ha, np.zeros_like(ha)
    np.testing.assert_array_equal(hist, np.stack(hand_hist))
    np.testing.assert_array_equal(w, hw)
    np.testing.assert_array_equal(a, ha)
    # θ moves only at boundaries
    moved = [not np.array_equal(hist[i], hist[i + 1]) for i in range(n_steps - 1)]
    assert moved == [(i + 1) % period == 0 for i in range(n_steps - 1)]


def test_dtypes_are_kept_and_none_subtrees_pass_through():
    w = {"k": jnp.ones((2, 2), jnp.bfloat16), "gate": None}
    a = {"k": jnp.zeros((2, 2), jnp.float32), "gate": None}
    u = {"k": jnp.full((2, 2), 0.25, jnp.bfloat16), "gate": None}
    a = accumulate(a, u)
    assert a["k"].dtype == jnp.float32 and a["gate"] is None
    w1, a1 = apply_at_boundary(w, a, jnp.asarray(False))
    np.testing.assert_array_equal(w1["k"], w["k"])
    np.testing.assert_array_equal(a1["k"], a["k"])
    w2, a2 = apply_at_boundary(w, a, jnp.asarray(True))
    assert w2["k"].dtype == jnp.bfloat16 and w2["gate"] is None
    np.testing.assert_array_equal(w2["k"], np.full((2, 2), 0.75, np.float32))
    np.testing.assert_array_equal(a2["k"], np.zeros((2, 2)))
    np.testing.assert_array_equal(clear_at_boundary(a, True)["k"], np.zeros((2, 2)))
    sel = select_at_boundary(jnp.asarray(True), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})
    np.testing.assert_array_equal(sel["x"], np.ones(2))


def test_nested_reset_cascades_top_down_like_a_hand_loop():
    periods, n_steps, shape = (2, 4, 8), 17, (2,)
    k = len(periods)
    us = [_signals(n_steps, shape, seed=10 + j) for j in range(k)]
    w0 = [np.full(shape, float(j + 1), np.float32) for j in range(k)]

    @jax.jit
    def run(ws, us):
        def step(carry, inp):
            ws, accs = carry
            n, u = inp
            fire = [period_boundary(n, p) for p in periods]
            done = [apply_at_boundary(ws[j], accumulate(accs[j], u[j]), fire[j]) for j in range(k)]
            ws, accs = reset_to_slower([d[0] for d in done], [d[1] for d in done], fire)
            return (ws, accs), ws

        counts = jnp.arange(1, n_steps + 1, dtype=jnp.int32)
        zeros = [jnp.zeros_like(w) for w in ws]
        return jax.lax.scan(step, (ws, zeros), (counts, us))

    (ws, accs), hist = run([jnp.asarray(w) for w in w0], [jnp.asarray(u) for u in us])

    hw, ha = [w.copy() for w in w0], [np.zeros(shape, np.float32) for _ in range(k)]
    hand_hist = []
    for n in range(1, n_steps + 1):
        for j in range(k):
            ha[j] = ha[j] + us[j][n - 1]
            if n % periods[j] == 0:
                hw[j], ha[j] = hw[j] - ha[j], np.zeros(shape, np.float32)
        for j in range(k - 2, -1, -1):  # a slower boundary resets the faster level to it
            if n % periods[j + 1] == 0:
                hw[j], ha[j] = hw[j + 1].copy(), np.zeros(shape, np.float32)
        hand_hist.append([w.copy() for w in hw])
    for j in range(k):
        np.testing.assert_array_equal(hist[j], np.stack([h[j] for h in hand_hist]))
        np.testing.assert_array_equal(ws[j], hw[j])
        np.testing.assert_array_equal(accs[j], ha[j])
    # at step 8 every level equals the slowest one
    np.testing.assert_array_equal(hist[0][7], hist[2][7])
