"""RMSNorm, gated RMSNorm, SwiGLU, RoPE, segment positions, short conv (SPEC §1, §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers import (
    GatedRMSNorm,
    RMSNorm,
    ShortConv,
    SwiGLU,
    apply_rope,
    causal_depthwise_conv,
    segment_positions,
)


def _rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, dtype)


def test_rmsnorm_matches_formula_and_keeps_dtype():
    norm = RMSNorm(6, eps=1e-6, rngs=nnx.Rngs(0))
    norm.scale[...] = jnp.arange(1.0, 7.0)
    x = _rand(0, (2, 3, 6))
    ref = np.asarray(x) / np.sqrt((np.asarray(x) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(norm(x), ref * np.arange(1.0, 7.0), rtol=1e-5, atol=1e-6)
    assert norm(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="x"):
        norm(_rand(0, (2, 5)))


def test_gated_rmsnorm_is_norm_times_silu_gate():
    norm = GatedRMSNorm(4, eps=1e-6, rngs=nnx.Rngs(0))
    x, g = _rand(1, (2, 3, 2, 4)), _rand(2, (2, 3, 2, 4))
    xn = np.asarray(x) / np.sqrt((np.asarray(x) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(norm(x, g), xn * np.asarray(jax.nn.silu(g)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="gate"):
        norm(x, g[..., :3])


def test_swiglu_matches_formula_and_param_names():
    mlp = SwiGLU(8, 16, rngs=nnx.Rngs(0))
    x = _rand(3, (2, 5, 8))
    wg, wu, wd = mlp.gate.kernel[...], mlp.up.kernel[...], mlp.down.kernel[...]
    ref = (jax.nn.silu(x @ wg) * (x @ wu)) @ wd
    np.testing.assert_allclose(mlp(x), ref, rtol=1e-5, atol=1e-6)
    specs = nnx.get_partition_spec(nnx.state(mlp))
    assert tuple(specs["gate"]["kernel"].get_value()) == ("embed", "mlp")
    assert tuple(specs["down"]["kernel"].get_value()) == ("mlp", "embed")


def test_rope_preserves_norm_and_scores_depend_on_relative_position():
    q, k = _rand(4, (1, 1, 1, 8)), _rand(5, (1, 1, 1, 8))

    def score(pq, pk):
        rq = apply_rope(q, jnp.array([[pq]]))
        rk = apply_rope(k, jnp.array([[pk]]))
        return float(jnp.sum(rq * rk))

    np.testing.assert_allclose(score(7, 3), score(104, 100), rtol=1e-4)
    assert abs(score(7, 3) - score(7, 4)) > 1e-4  # the rotation is not the identity
    np.testing.assert_allclose(apply_rope(q, jnp.array([[0]])), q, atol=1e-7)
    rq = apply_rope(q, jnp.array([[13]]))
    np.testing.assert_allclose(jnp.linalg.norm(rq), jnp.linalg.norm(q), rtol=1e-5)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(q, jnp.zeros((1, 2), jnp.int32))


def test_segment_positions_restart_at_segment_starts():
    seg = jnp.array([[1, 1, 1, 2, 2, 3], [0, 0, 0, 0, 0, 0]])
    pos = segment_positions(seg, 2, 6)
    np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(segment_positions(None, 1, 3, 5), [[5, 6, 7]])


def _np_conv(x, w):
    """Reference causal depthwise conv with zero history: y_t = sum_i w[i] x[t - W + 1 + i]."""
    W = w.shape[0]
    xp = np.concatenate([np.zeros((x.shape[0], W - 1, x.shape[2])), x], axis=1)
    return np.stack([(xp[:, t : t + W] * w).sum(1) for t in range(x.shape[1])], axis=1)


def test_conv_matches_reference_and_streams_with_state():
    conv = ShortConv(6, 4, rngs=nnx.Rngs(0))
    x = _rand(6, (2, 11, 6))
    y, _ = conv(x)
    np.testing.assert_allclose(y, _np_conv(np.asarray(x), np.asarray(conv.kernel[...])), atol=1e-6)
    # Streaming: 1 + 3 + 7 tokens with carried state equals the full sequence.
    state, outs = conv.init_state(2), []
    for a, b in ((0, 1), (1, 4), (4, 11)):
        o, state = conv(x[:, a:b], state=state)
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), y, atol=1e-6)
    np.testing.assert_allclose(state, x[:, -3:])


def test_conv_segments_do_not_mix_and_bad_shapes_raise():
    kernel = _rand(7, (4, 3))
    x = _rand(8, (1, 9, 3))
    seg = jnp.array([[1] * 5 + [2] * 4])
    y, _ = causal_depthwise_conv(x, kernel, segment_ids=seg)
    y1, _ = causal_depthwise_conv(x[:, :5], kernel)
    y2, _ = causal_depthwise_conv(x[:, 5:], kernel)
    np.testing.assert_allclose(y, jnp.concatenate([y1, y2], 1), atol=1e-6)
    with pytest.raises(ValueError, match="kernel"):
        causal_depthwise_conv(x, kernel[:, :2])
    with pytest.raises(ValueError, match="state"):
        causal_depthwise_conv(x, kernel, state=jnp.zeros((1, 2, 3)))
    with pytest.raises(ValueError, match="x"):
        causal_depthwise_conv(x[0], kernel)
