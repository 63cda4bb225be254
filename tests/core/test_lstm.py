"""core.lstm: the scan form equals the Python-loop reference in values and gradients (awkward
sizes, initial state, resets), the step form chains to the sequence form; ops.lstm is its door.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax import ops
from nested_jax.core.lstm import LSTMState, lstm_recurrent, lstm_reference, lstm_step


def _params(seed, d, h, scale=0.5):
    k = jax.random.split(jax.random.key(seed), 3)
    return (
        scale * jax.random.normal(k[0], (d, 4 * h)),
        scale * jax.random.normal(k[1], (h, 4 * h)),
        0.3 * jax.random.normal(k[2], (4 * h,)),
    )


def _inputs(seed, b, t, d, h):
    k = jax.random.split(jax.random.key(seed + 100), 3)
    x = jax.random.normal(k[0], (b, t, d))
    s0 = LSTMState(0.5 * jax.random.normal(k[1], (b, h)), jax.random.normal(k[2], (b, h)))
    reset = jax.random.bernoulli(jax.random.key(seed + 7), 0.2, (b, t))
    return x, s0, reset


@pytest.mark.parametrize("b,t,d,h", [(1, 1, 1, 1), (3, 7, 5, 3), (2, 13, 4, 6)])
def test_scan_equals_reference_values(b, t, d, h):
    w_x, w_h, bias = _params(0, d, h)
    x, s0, reset = _inputs(1, b, t, d, h)
    for kw in ({}, {"initial_state": s0}, {"initial_state": s0, "reset": reset}):
        out, fin = lstm_recurrent(x, w_x, w_h, bias, **kw)
        ref, fin_ref = lstm_reference(x, w_x, w_h, bias, **kw)
        assert out.shape == (b, t, h)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(fin.h, fin_ref.h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(fin.c, fin_ref.c, rtol=1e-5, atol=1e-6)
        # the last output is the final hidden state
        np.testing.assert_allclose(out[:, -1], fin.h, rtol=1e-6, atol=1e-7)


def test_scan_equals_reference_gradients():
    b, t, d, h = 2, 9, 3, 5
    w_x, w_h, bias = _params(2, d, h)
    x, s0, reset = _inputs(3, b, t, d, h)
    w_out = jax.random.normal(jax.random.key(9), (b, t, h))

    def loss(fn, x, w_x, w_h, bias, h0, c0):
        out, fin = fn(x, w_x, w_h, bias, initial_state=LSTMState(h0, c0), reset=reset)
        return jnp.sum(out * w_out) + jnp.sum(fin.c**2)

    args = (x, w_x, w_h, bias, s0.h, s0.c)
    g = jax.grad(lambda *a: loss(lstm_recurrent, *a), argnums=range(6))(*args)
    g_ref = jax.grad(lambda *a: loss(lstm_reference, *a), argnums=range(6))(*args)
    for a, r in zip(g, g_ref, strict=True):
        assert float(jnp.abs(r).max()) > 0  # every input gets a gradient
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)


def test_equations_by_hand_one_token():
    # D = H = 1, all weights 0 except the biases: z = b, so c = σ(b_f) c0 + σ(b_i) tanh(b_g)
    w_x, w_h = jnp.zeros((1, 4)), jnp.zeros((1, 4))
    bias = jnp.array([0.5, -1.0, 2.0, 0.25])
    s0 = LSTMState(jnp.array([[0.3]]), jnp.array([[-0.7]]))
    h, s = lstm_step(s0, jnp.ones((1, 1)), w_x, w_h, bias)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    c = sig(-1.0) * -0.7 + sig(0.5) * np.tanh(2.0)
    np.testing.assert_allclose(s.c, [[c]], rtol=1e-6)
    np.testing.assert_allclose(h, [[sig(0.25) * np.tanh(c)]], rtol=1e-6)


def test_steps_chain_to_the_sequence_and_split_sequences_continue():
    b, t, d, h = 2, 6, 3, 4
    w_x, w_h, bias = _params(4, d, h)
    x, s0, _ = _inputs(5, b, t, d, h)
    full, fin = lstm_recurrent(x, w_x, w_h, bias, initial_state=s0)
    first, mid = lstm_recurrent(x[:, :4], w_x, w_h, bias, initial_state=s0)
    rest, fin2 = lstm_recurrent(x[:, 4:], w_x, w_h, bias, initial_state=mid)
    np.testing.assert_allclose(jnp.concatenate([first, rest], 1), full, rtol=1e-6, atol=1e-6)
    state, outs = s0, []
    for i in range(t):
        o, state = lstm_step(state, x[:, i], w_x, w_h, bias)
        outs.append(o)
    np.testing.assert_allclose(jnp.stack(outs, 1), full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fin2.c, fin.c, rtol=1e-5, atol=1e-6)


def test_reset_starts_each_segment_from_zero():
    b, t, d, h = 1, 8, 2, 3
    w_x, w_h, bias = _params(6, d, h)
    x, s0, _ = _inputs(7, b, t, d, h)
    reset = jnp.zeros((b, t), bool).at[:, 5].set(True)
    out, _ = lstm_recurrent(x, w_x, w_h, bias, initial_state=s0, reset=reset)
    alone, _ = lstm_recurrent(x[:, 5:], w_x, w_h, bias)
    np.testing.assert_allclose(out[:, 5:], alone, rtol=1e-6, atol=1e-6)
    cont, _ = lstm_recurrent(x, w_x, w_h, bias, initial_state=s0)
    assert float(jnp.abs(cont[:, 5:] - alone).max()) > 1e-3


def test_ops_door_and_argument_errors():
    w_x, w_h, bias = _params(8, 3, 2)
    x = jnp.ones((2, 4, 3))
    out, fin = ops.lstm(x, w_x, w_h, bias, impl="recurrent")
    ref, _ = lstm_reference(x, w_x, w_h, bias)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="lstm: impl='chunked'"):
        ops.lstm(x, w_x, w_h, bias, impl="chunked")
    with pytest.raises(ValueError, match="pallas"):
        ops.lstm(x, w_x, w_h, bias, impl="pallas")
    with pytest.raises(ValueError, match="^x:"):
        lstm_recurrent(x[0], w_x, w_h, bias)
    with pytest.raises(ValueError, match="^w_x:"):
        lstm_recurrent(x, w_x[:2], w_h, bias)
    with pytest.raises(ValueError, match="^w_h:"):
        lstm_recurrent(x, w_x, w_h[:, :5], bias)
    with pytest.raises(ValueError, match="^b:"):
        lstm_recurrent(x, w_x, w_h, bias[:3])
    with pytest.raises(ValueError, match="^initial_state:"):
        lstm_recurrent(
            x, w_x, w_h, bias, initial_state=LSTMState(jnp.zeros((1, 2)), jnp.zeros((1, 2)))
        )
    with pytest.raises(ValueError, match="^reset:"):
        lstm_recurrent(x, w_x, w_h, bias, reset=jnp.zeros((2, 3), bool))
