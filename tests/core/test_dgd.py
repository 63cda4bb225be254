"""DGD (SPEC §3.1): the closed form equals an independently solved proximal problem."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.dgd import dgd_step_size, dgd_update, dgd_update_layers


def _prox_minimiser(W0, x, u, eta):
    """argmin_W ½‖W x − u‖² + (1/2η)‖W − W0‖²_F, solved from the normal equations in float64.

    Stationarity: (W x − u) xᵀ + (W − W0)/η = 0  ⇔  W (η x xᵀ + I) = W0 + η u xᵀ. Solved with a
    dense linear solve (no Sherman–Morrison), so the test does not share the closed form it checks.
    """
    W0, x, u = (np.asarray(a, np.float64) for a in (W0, x, u))
    A = eta * np.outer(x, x) + np.eye(x.size)
    rhs = W0 + eta * np.outer(u, x)
    # W A = rhs  ⇔  Aᵀ Wᵀ = rhsᵀ
    return np.linalg.solve(A.T, rhs.T).T


def _prox_by_gradient_descent(W0, x, u, eta, steps=20000):
    """Same minimiser by plain gradient descent on the objective (an independent second check)."""
    W0, x, u = (np.asarray(a, np.float64) for a in (W0, x, u))
    W = W0.copy()
    lip = np.dot(x, x) + 1.0 / eta
    for _ in range(steps):
        grad = np.outer(W @ x - u, x) + (W - W0) / eta
        W -= grad / lip
    return W


@pytest.mark.parametrize("eta", [0.05, 0.7, 3.0])
def test_dgd_equals_proximal_minimiser(eta):
    rng = np.random.default_rng(0)
    d_out, d_in = 5, 7
    W0 = rng.normal(size=(d_out, d_in))
    x = rng.normal(size=d_in)
    g = rng.normal(size=d_out)
    want = _prox_minimiser(W0, x, -g, eta)
    got = dgd_update(
        jnp.asarray(W0, jnp.float32), jnp.asarray(x, jnp.float32), jnp.asarray(g, jnp.float32), eta
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # float64 objective descent reaches the same point (guards the solver set-up itself)
    np.testing.assert_allclose(_prox_by_gradient_descent(W0, x, -g, eta), want, atol=1e-8)


def test_dgd_batched_matches_per_example():
    rng = np.random.default_rng(1)
    B, H, d_out, d_in = 2, 3, 4, 6
    W = rng.normal(size=(B, H, d_out, d_in)).astype(np.float32)
    x = rng.normal(size=(B, H, d_in)).astype(np.float32)
    g = rng.normal(size=(B, H, d_out)).astype(np.float32)
    lr = rng.uniform(0.1, 1.0, size=(B, H)).astype(np.float32)
    ret = rng.uniform(0.5, 1.0, size=(B, H)).astype(np.float32)
    got = np.asarray(jax.jit(dgd_update)(W, x, g, lr, ret))
    for b in range(B):
        for h in range(H):
            gamma = lr[b, h] / (1 + lr[b, h] * np.dot(x[b, h], x[b, h]))
            P = ret[b, h] * np.eye(d_in) - gamma * np.outer(x[b, h], x[b, h])
            want = W[b, h] @ P - gamma * np.outer(g[b, h], x[b, h])
            np.testing.assert_allclose(got[b, h], want, atol=1e-5, rtol=1e-5)


def test_dgd_shared_weights_broadcast_over_tokens():
    """W [d_out, d_in] with x [T, d_in]: one independent step per row of x (broadcast batch)."""
    rng = np.random.default_rng(2)
    W = rng.normal(size=(3, 4)).astype(np.float32)
    x = rng.normal(size=(5, 4)).astype(np.float32)
    g = rng.normal(size=(5, 3)).astype(np.float32)
    got = dgd_update(W, x, g, 0.3)
    assert got.shape == (5, 3, 4)
    for t in range(5):
        np.testing.assert_allclose(got[t], dgd_update(W, x[t], g[t], 0.3), atol=1e-6)


def test_dgd_with_zero_signal_still_shrinks_along_x():
    rng = np.random.default_rng(3)
    W = rng.normal(size=(4, 6)).astype(np.float32)
    x = rng.normal(size=6).astype(np.float32)
    W_new = np.asarray(dgd_update(W, x, np.zeros(4, np.float32), 0.5))
    # the response to x shrinks by the factor 1 − γ‖x‖² = 1/(1 + η‖x‖²) ...
    factor = 1.0 / (1.0 + 0.5 * np.dot(x, x))
    np.testing.assert_allclose(W_new @ x, factor * (W @ x), rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(W_new @ x) < np.linalg.norm(W @ x)
    # ... and directions orthogonal to x are untouched
    z = rng.normal(size=6).astype(np.float32)
    z -= np.dot(z, x) / np.dot(x, x) * x
    np.testing.assert_allclose(W_new @ z, W @ z, rtol=1e-5, atol=1e-5)


def test_dgd_paper_step():
    rng = np.random.default_rng(4)
    W = rng.normal(size=(3, 5)).astype(np.float32)
    x = rng.normal(size=5).astype(np.float32) * 2.0
    g = rng.normal(size=3).astype(np.float32)
    eta = 0.4
    gamma = eta / (1 + eta)
    want = W @ (np.eye(5) - gamma * np.outer(x, x)) - gamma * np.outer(g, x)
    np.testing.assert_allclose(dgd_update(W, x, g, eta, step="paper"), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dgd_step_size(eta, x, step="paper"), gamma, rtol=1e-6)
    # with ‖x‖ = 1 the printed step is the exact one ...
    xu = x / np.linalg.norm(x)
    np.testing.assert_allclose(
        dgd_update(W, xu, g, eta, step="paper"), dgd_update(W, xu, g, eta), rtol=1e-6, atol=1e-6
    )
    # ... and otherwise it is not
    assert not np.allclose(dgd_update(W, x, g, eta, step="paper"), dgd_update(W, x, g, eta))


def test_dgd_keeps_dtype_and_jits():
    W = jnp.ones((2, 3), jnp.bfloat16)
    out = jax.jit(dgd_update, static_argnames="step")(W, jnp.ones(3), jnp.ones(2), 0.1, 0.9)
    assert out.dtype == jnp.bfloat16


def test_dgd_gradients_flow_through_the_write():
    W = jnp.asarray(np.random.default_rng(5).normal(size=(3, 4)), jnp.float32)
    x = jnp.linspace(-1.0, 1.0, 4)
    g = jnp.linspace(0.5, -0.5, 3)

    def loss(lr):
        return jnp.sum(dgd_update(W, x, g, lr) ** 2)

    eps = 1e-3
    fd = (loss(0.3 + eps) - loss(0.3 - eps)) / (2 * eps)
    np.testing.assert_allclose(jax.grad(loss)(0.3), fd, rtol=1e-3)


def test_dgd_update_layers_matches_single_layer_calls():
    rng = np.random.default_rng(6)
    Ws = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(3, 4)).astype(np.float32)]
    xs = [rng.normal(size=3).astype(np.float32), rng.normal(size=4).astype(np.float32)]
    gs = [rng.normal(size=4).astype(np.float32), rng.normal(size=3).astype(np.float32)]
    out = dgd_update_layers(Ws, xs, gs, [0.1, 0.2], 0.9)
    for i, lr in enumerate([0.1, 0.2]):
        np.testing.assert_array_equal(out[i], dgd_update(Ws[i], xs[i], gs[i], lr, 0.9))
    with pytest.raises(ValueError, match="inputs"):
        dgd_update_layers(Ws, xs[:1], gs, 0.1)
    with pytest.raises(ValueError, match="lr"):
        dgd_update_layers(Ws, xs, gs, [0.1])


@pytest.mark.parametrize(
    "args, name",
    [
        ((np.ones(3), np.ones(3), np.ones(3), 0.1), "W"),
        ((np.ones((2, 3)), np.ones(4), np.ones(2), 0.1), "x"),
        ((np.ones((2, 3)), np.ones(3), np.ones(3), 0.1), "g"),
        ((np.ones((5, 2, 3)), np.ones((4, 3)), np.ones((5, 2)), 0.1), "x"),
        ((np.ones((5, 2, 3)), np.ones((5, 3)), np.ones((4, 2)), 0.1), "g"),
        ((np.ones((5, 2, 3)), np.ones((5, 3)), np.ones((5, 2)), np.ones(4)), "lr"),
        ((np.ones((5, 2, 3)), np.ones((5, 3)), np.ones((5, 2)), 0.1, np.ones(3)), "retention"),
    ],
)
def test_dgd_shape_errors_name_the_argument(args, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        dgd_update(*args)


def test_dgd_unknown_step():
    with pytest.raises(ValueError, match="step"):
        dgd_update(np.ones((2, 3)), np.ones(3), np.ones(2), 0.1, step="nope")


@pytest.mark.parametrize("eta", [0.05, 0.7, 3.0])
def test_proximal_target_equals_its_proximal_minimiser(eta):
    """``target="proximal"`` (SPEC §3.2 Decision) regresses ``W x`` onto ``u = W0 x − g``: its
    closed form ``W0 − γ g xᵀ`` is the float64 minimiser of that objective, and differs from the
    default (``u = −g``) target."""
    rng = np.random.default_rng(1)
    W0, x, g = rng.normal(size=(4, 6)), rng.normal(size=6), rng.normal(size=4)
    want = _prox_minimiser(W0, x, W0 @ x - g, eta)
    args = (jnp.asarray(W0, jnp.float32), jnp.asarray(x, jnp.float32), jnp.asarray(g, jnp.float32))
    got = dgd_update(*args, eta, target="proximal")
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    assert not np.allclose(np.asarray(dgd_update(*args, eta)), want, atol=1e-3)
    with pytest.raises(ValueError, match="target must be one of"):
        dgd_update(*args, eta, target="newton")
