"""DeltaNet and Gated DeltaNet layers against a NumPy re-derivation of SPEC §1, decode, segments,
init."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers import DeltaNet, GatedDeltaNet

D_MODEL, H, D = 12, 2, 4


def _rand(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _make(cls, impl="chunked", dtype=jnp.float32):
    return cls(D_MODEL, H, D, conv_size=4, chunk_size=4, impl=impl, dtype=dtype, rngs=nnx.Rngs(0))


@nnx.jit
def _call(layer, x, segment_ids=None, cache=None):
    return layer(x, segment_ids=segment_ids, cache=cache)


def _np_reference(layer, x):
    """SPEC §1 written out per token in float64 NumPy from the layer's own parameters."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = f(x)
    B, T, _ = x.shape
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731

    def conv(z, kernel):
        zp = np.concatenate([np.zeros((B, 3, z.shape[-1])), z], 1)
        return np.stack([(zp[:, t : t + 4] * f(kernel)).sum(1) for t in range(T)], 1)

    def proj(lin):
        return x @ f(lin.kernel[...])

    q = silu(conv(proj(layer.q_proj), layer.q_conv.kernel[...])).reshape(B, T, H, D)
    k = silu(conv(proj(layer.k_proj), layer.k_conv.kernel[...])).reshape(B, T, H, D)
    v = silu(conv(proj(layer.v_proj), layer.v_conv.kernel[...])).reshape(B, T, H, D)
    q = q / np.sqrt((q**2).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k**2).sum(-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-proj(layer.b_proj)))
    if isinstance(layer, GatedDeltaNet):
        a = proj(layer.a_proj) + f(layer.dt_bias[...])
        alpha = np.exp(-np.log1p(np.exp(a)) * np.exp(f(layer.A_log[...])))
    else:
        alpha = np.ones((B, T, H))
    S = np.zeros((B, H, D, D))
    o = np.zeros((B, T, H, D))
    for t in range(T):
        for b in range(B):
            for h in range(H):
                s = alpha[b, t, h] * S[b, h]
                err = v[b, t, h] - s.T @ k[b, t, h]
                S[b, h] = s + beta[b, t, h] * np.outer(k[b, t, h], err)
                o[b, t, h] = S[b, h].T @ (q[b, t, h] / np.sqrt(D))
    o = o / np.sqrt((o**2).mean(-1, keepdims=True) + 1e-6) * f(layer.o_norm.scale[...])
    o = o * silu(proj(layer.g_proj).reshape(B, T, H, D))
    return o.reshape(B, T, H * D) @ f(layer.o_proj.kernel[...])


@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_layer_matches_spec_reference(cls, impl):
    layer = _make(cls, impl)
    x = _rand(1, (2, 11, D_MODEL))
    y, cache = _call(layer, x)
    assert cache is None
    np.testing.assert_allclose(y, _np_reference(layer, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
def test_decode_with_cache_equals_full_forward(cls):
    layer = _make(cls)
    x = _rand(2, (2, 9, D_MODEL))
    full, _ = _call(layer, x)
    cache, outs = layer.init_cache(2, 9), []
    # A 3-token prefill (chunked path from the cached state), then single exact steps.
    for a, b in ((0, 3), *((i, i + 1) for i in range(3, 9))):
        y, cache = _call(layer, x[:, a:b], cache=cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)
    assert cache.state.dtype == jnp.float32 and cache.state.shape == (2, H, D, D)
    assert cache.conv_q.shape == (2, 3, H * D)


@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
def test_packed_segments_equal_separate_sequences(cls):
    layer = _make(cls)
    x = _rand(3, (1, 10, D_MODEL))
    seg = jnp.array([[3] * 4 + [7] * 6])
    packed, _ = _call(layer, x, seg)
    a, _ = _call(layer, x[:, :4])
    b, _ = _call(layer, x[:, 4:])
    np.testing.assert_allclose(packed, jnp.concatenate([a, b], 1), rtol=1e-4, atol=1e-5)


def test_causality_and_bf16_activations():
    layer = _make(GatedDeltaNet)
    x = _rand(4, (1, 10, D_MODEL))
    y1, _ = _call(layer, x)
    y2, _ = _call(layer, x.at[:, 6:].set(3.0))
    np.testing.assert_allclose(y1[:, :6], y2[:, :6], atol=1e-6)
    assert float(jnp.abs(y1[:, 6:] - y2[:, 6:]).max()) > 1e-4
    lb = _make(GatedDeltaNet, dtype=jnp.bfloat16)
    yb, cache = _call(lb, x, cache=lb.init_cache(1, 10))
    assert yb.dtype == jnp.bfloat16 and cache.state.dtype == jnp.float32
    assert bool(jnp.isfinite(yb.astype(jnp.float32)).all())
    assert lb.q_proj.kernel[...].dtype == jnp.float32


def test_gdn_decay_init_and_param_names():
    layer = GatedDeltaNet(16, 64, 4, rngs=nnx.Rngs(1))
    a = np.exp(np.asarray(layer.A_log[...]))
    dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert (a > 0).all() and (a <= 16).all() and a.std() > 1  # spread over U(0, 16)
    np.testing.assert_array_less(dt, 0.1 + 1e-6)
    np.testing.assert_array_less(1e-3 - 1e-6, dt)
    g = layer._log_decay(_rand(5, (1, 3, 16)))
    assert g.shape == (1, 3, 64) and bool((g <= 0).all())
    specs = nnx.get_partition_spec(nnx.state(layer))
    assert tuple(specs["q_conv"]["kernel"].get_value()) == ("conv", "heads")
    assert tuple(specs["q_proj"]["kernel"].get_value()) == ("embed", "heads")
    assert tuple(specs["o_proj"]["kernel"].get_value()) == ("heads", "embed")
