"""nested_jax.core.scan against plain Python loops (values and gradients)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.scan import (
    affine_scan,
    chunk,
    from_head_chunks,
    pad_to_multiple,
    scan_remat,
    segment_starts,
    to_head_chunks,
    unchunk,
)


def _rand(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


@pytest.mark.parametrize("T,C", [(1, 4), (7, 4), (8, 4), (9, 1)])
def test_chunk_roundtrip(T, C):
    x = _rand(0, 2, T, 3, 5)
    xc = chunk(x, C, axis=1)
    N = -(-T // C)
    assert xc.shape == (2, N, C, 3, 5)
    # padding is zeros, at the end only
    flat = xc.reshape(2, N * C, 3, 5)
    np.testing.assert_array_equal(flat[:, :T], x)
    np.testing.assert_array_equal(flat[:, T:], 0)
    np.testing.assert_array_equal(unchunk(xc, T, axis=1), x)
    assert pad_to_multiple(x, C, axis=1).shape[1] == N * C


def test_chunk_other_axis_and_errors():
    x = _rand(1, 5, 6)
    np.testing.assert_array_equal(unchunk(chunk(x, 4, axis=-1), 6, axis=-2), x)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk(x, 0)
    with pytest.raises(ValueError, match="multiple"):
        pad_to_multiple(x, -2)
    with pytest.raises(ValueError, match="length"):
        unchunk(chunk(x, 4, axis=1), 99, axis=1)


def _affine_loop(a, b, initial, reverse):
    T = a.shape[0]
    x = np.zeros(b.shape[1:]) if initial is None else np.asarray(initial, np.float64)
    out = np.zeros(b.shape)
    order = range(T - 1, -1, -1) if reverse else range(T)
    for t in order:
        at = np.asarray(a[t], np.float64).reshape(a.shape[1:] + (1,) * (b.ndim - a.ndim))
        x = at * x + np.asarray(b[t], np.float64)
        out[t] = x
    return out


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_initial", [False, True])
def test_affine_scan_matches_loop(reverse, with_initial):
    T = 13
    a = jax.nn.sigmoid(_rand(2, T, 3))  # per-token scalar per batch row, broadcast over [K, V]
    b = _rand(3, T, 3, 4, 2)
    init = _rand(4, 3, 4, 2) if with_initial else None
    got = affine_scan(a, b, axis=0, reverse=reverse, initial=init)
    np.testing.assert_allclose(got, _affine_loop(a, b, init, reverse), atol=1e-5, rtol=1e-5)


def test_affine_scan_axis1_and_grad():
    a = jax.nn.sigmoid(_rand(5, 2, 11))
    b = _rand(6, 2, 11, 3)
    init = _rand(7, 2, 3)

    def loop(a, b, init):
        x, outs = init, []
        for t in range(a.shape[1]):
            x = a[:, t, None] * x + b[:, t]
            outs.append(x)
        return jnp.stack(outs, axis=1)

    np.testing.assert_allclose(
        affine_scan(a, b, axis=1, initial=init), loop(a, b, init), atol=1e-5, rtol=1e-5
    )
    w = _rand(8, 2, 11, 3)

    def loss(fn):
        return lambda a, b, i: jnp.sum(w * fn(a, b, i))

    g1 = jax.grad(loss(lambda a, b, i: affine_scan(a, b, axis=1, initial=i)), (0, 1, 2))(a, b, init)
    g2 = jax.grad(loss(loop), (0, 1, 2))(a, b, init)
    for x, y in zip(g1, g2, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


def test_affine_scan_bad_shapes():
    with pytest.raises(ValueError, match="a must have shape"):
        affine_scan(jnp.ones((4, 2)), jnp.ones((4, 3, 5)))
    with pytest.raises(ValueError, match="initial must have shape"):
        affine_scan(jnp.ones((4,)), jnp.ones((4, 3)), initial=jnp.ones((2,)))


@pytest.mark.parametrize(
    "T,n", [(12, 4), (13, 4), (3, 5), (7, 1), (29, (9, 3)), (30, (8, 3, 2)), (5, (9, 2))]
)
def test_scan_remat_equals_scan_values_and_grads(T, n):
    W = _rand(9, 4, 4) * 0.5
    xs = (_rand(10, T, 4), _rand(11, T))

    def f(c, x):
        xv, s = x
        c = jnp.tanh(W @ c + xv) * (1.0 + 0.1 * s)
        return c, jnp.sum(c**2)

    c0 = _rand(12, 4)

    def loss(scan_fn):
        def inner(c0, xs):
            c, ys = scan_fn(f, c0, xs)
            return jnp.sum(c) + jnp.sum(ys * jnp.arange(1.0, T + 1))

        return inner

    ref = jax.lax.scan(f, c0, xs)
    got = scan_remat(f, c0, xs, remat_every=n)
    np.testing.assert_allclose(got[0], ref[0], atol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], atol=1e-6)
    g_ref = jax.grad(loss(jax.lax.scan), (0, 1))(c0, xs)
    g_got = jax.grad(loss(lambda f_, c, x: scan_remat(f_, c, x, remat_every=n)), (0, 1))(c0, xs)
    chex.assert_trees_all_close(g_got, g_ref, atol=1e-5, rtol=1e-5)


def test_scan_remat_without_xs_and_errors():
    def f(c, _):
        return c * 0.5 + 1.0, c

    c, ys = scan_remat(f, jnp.float32(0.0), None, remat_every=3, length=7)
    c_ref, ys_ref = jax.lax.scan(f, jnp.float32(0.0), None, length=7)
    np.testing.assert_allclose(c, c_ref)
    np.testing.assert_allclose(ys, ys_ref)
    with pytest.raises(ValueError, match="remat_every"):
        scan_remat(f, 0.0, None, remat_every=0, length=3)
    with pytest.raises(ValueError, match="length"):
        scan_remat(f, 0.0, None, remat_every=2)
    with pytest.raises(ValueError, match="must decrease"):
        scan_remat(f, 0.0, None, remat_every=(2, 4), length=8)
    with pytest.raises(ValueError, match="remat_every"):
        scan_remat(f, 0.0, None, remat_every=(), length=8)


def test_scan_remat_saves_fewer_residuals():
    # The point of remat: the backward keeps block carries, not every carry.
    T, n, D = 64, 8, 32
    W = _rand(13, D, D) * 0.1
    xs = _rand(14, T, D)

    def f(c, x):
        return jnp.tanh(W @ c + x), None

    def loss(scan_fn):
        return lambda c0: jnp.sum(scan_fn(f, c0, xs)[0])

    c0 = _rand(15, D)
    plain = jax.jit(jax.grad(loss(jax.lax.scan))).lower(c0).compile().memory_analysis()
    remat = jax.jit(jax.grad(loss(lambda f_, c, x: scan_remat(f_, c, x, n)))).lower(c0).compile()
    assert remat.memory_analysis().temp_size_in_bytes < plain.temp_size_in_bytes


def test_nested_scan_remat_holds_fewer_carries_than_two_levels():
    # T = 512 steps of a 64 KiB carry: two levels hold 512/23 + 23 ≈ 46 carries at once, three
    # levels (64, 8) hold 8 + 8 + 8 = 24; the compiled backward's temporaries say so.
    T, D = 512, 128
    W = _rand(16, D, D) * 0.05
    xs = _rand(17, T, D)

    def f(c, x):
        return jnp.tanh(c @ W + x[None]), None

    def temp(sizes):
        loss = lambda c0: jnp.sum(scan_remat(f, c0, xs, sizes)[0])  # noqa: E731
        c0 = _rand(18, D, D)
        return jax.jit(jax.grad(loss)).lower(c0).compile().memory_analysis().temp_size_in_bytes

    two, three = temp(23), temp((64, 8))
    assert three < 0.75 * two, (two, three)


@pytest.mark.parametrize("T,C", [(7, 3), (8, 4), (5, 1), (2, 5)])
def test_head_chunks_layout_and_roundtrip(T, C):
    x = jnp.arange(2 * T * 3 * 2, dtype=jnp.float32).reshape(2, T, 3, 2)
    xc = to_head_chunks(x, C)
    N = -(-T // C)
    assert xc.shape == (N, 2, 3, C, 2)
    # element (n, b, h, c) is token n·C + c of row b, head h; the padding is zero
    for n in range(N):
        for c in range(C):
            t = n * C + c
            want = x[:, t] if t < T else jnp.zeros_like(x[:, 0])
            np.testing.assert_array_equal(xc[n, :, :, c], want)
    np.testing.assert_array_equal(from_head_chunks(xc, T), x)
    with pytest.raises(ValueError, match="B, T, H"):
        to_head_chunks(x[:, :, 0, 0], C)
    with pytest.raises(ValueError, match="N, B, H, C"):
        from_head_chunks(x[:, :, 0], T)


def test_segment_starts_marks_document_openings_after_position_zero():
    seg = jnp.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    want = np.array([[0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(segment_starts(seg), want)
    with pytest.raises(ValueError, match="segment_ids"):
        segment_starts(seg[0])
