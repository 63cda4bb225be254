"""Causal softmax attention layer: reference math, GQA, sliding window, KV-cache decode, segments
(SPEC §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers import Attention, attention_mask, segment_positions, softmax_attention


def _rand(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _np_attention(q, k, v, window):
    """Loop reference: query t of head h sees keys max(0, t-window+1)..t of KV head h // groups."""
    B, T, H, D = q.shape
    Hk = k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hk)
            for t in range(T):
                lo = max(0, t - window + 1) if window else 0
                s = q[b, t, h] @ k[b, lo : t + 1, hk].T / np.sqrt(D)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[b, lo : t + 1, hk]
    return out


@pytest.mark.parametrize("window,hk", [(0, 4), (3, 2), (5, 1)])
def test_softmax_attention_matches_loop_reference(window, hk):
    q, k, v = _rand(0, (2, 9, 4, 6)), _rand(1, (2, 9, hk, 6)), _rand(2, (2, 9, hk, 6))
    idx = jnp.broadcast_to(jnp.arange(9), (2, 9))
    out = softmax_attention(q, k, v, attention_mask(idx, idx, window=window))
    ref = _np_attention(*(np.asarray(a) for a in (q, k, v)), window)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_softmax_attention_rejects_bad_shapes():
    q, k = _rand(0, (1, 4, 3, 8)), _rand(1, (1, 4, 2, 8))
    mask = jnp.ones((1, 4, 4), bool)
    with pytest.raises(ValueError, match="H_kv"):
        softmax_attention(q, k, k, mask)
    with pytest.raises(ValueError, match="mask"):
        softmax_attention(q, q, q, mask[:, :3])
    with pytest.raises(ValueError, match="q"):
        softmax_attention(q[0], q, q, mask)


def _layer(window=0, n_kv=2):
    return Attention(16, 4, 8, n_kv_heads=n_kv, window=window, rngs=nnx.Rngs(0))


def _positions(b, t):
    return segment_positions(None, b, t)


@nnx.jit
def _call(layer, x, positions, segment_ids=None, cache=None):
    return layer(x, positions=positions, segment_ids=segment_ids, cache=cache)


@pytest.mark.parametrize("window,n_kv", [(0, 4), (4, 2)])
def test_kv_cache_decode_equals_full_forward(window, n_kv):
    layer = _layer(window, n_kv)
    x = _rand(3, (2, 10, 16))
    full, none_cache = _call(layer, x, _positions(2, 10))
    assert none_cache is None
    # Prefill 3 tokens, then 1 token at a time, then a 2-token chunk: the same logits as the full
    # pass.
    cache, outs = layer.init_cache(2, 12), []
    for a, b in ((0, 3), *((i, i + 1) for i in range(3, 8)), (8, 10)):
        pos = segment_positions(None, 2, b - a, a)
        y, cache = _call(layer, x[:, a:b], pos, cache=cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert int(cache.pos) == 10 and cache.k.shape == (2, 12, n_kv, 8)


def test_packed_segments_equal_separate_sequences_and_causality():
    layer = _layer(window=3)
    x = _rand(4, (1, 11, 16))
    seg = jnp.array([[1] * 6 + [2] * 5])
    packed, _ = _call(layer, x, segment_positions(seg, 1, 11), seg)
    a, _ = _call(layer, x[:, :6], _positions(1, 6))
    b, _ = _call(layer, x[:, 6:], _positions(1, 5))
    np.testing.assert_allclose(packed, jnp.concatenate([a, b], 1), rtol=1e-5, atol=1e-5)
    # Causality: perturbing tokens >= 7 leaves outputs < 7 unchanged.
    x2 = x.at[:, 7:].add(1.0)
    y1, _ = _call(layer, x, _positions(1, 11))
    y2, _ = _call(layer, x2, _positions(1, 11))
    np.testing.assert_allclose(y1[:, :7], y2[:, :7], atol=1e-6)
    assert float(jnp.abs(y1[:, 7:] - y2[:, 7:]).max()) > 1e-3


def test_attention_param_names_and_config_errors():
    layer = _layer()
    specs = nnx.get_partition_spec(nnx.state(layer))
    assert tuple(specs["q_proj"]["kernel"].get_value()) == ("embed", "heads")
    assert tuple(specs["k_proj"]["kernel"].get_value()) == ("embed", "kv")
    assert tuple(specs["o_proj"]["kernel"].get_value()) == ("heads", "embed")
    with pytest.raises(ValueError, match="n_kv_heads"):
        Attention(16, 4, 8, n_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="head_dim"):
        Attention(15, 3, 5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cache"):
        layer(_rand(0, (1, 5, 16)), positions=_positions(1, 5), cache=layer.init_cache(1, 4))
    with pytest.raises(ValueError, match="segment_ids"):
        layer(
            _rand(0, (1, 2, 16)),
            positions=_positions(1, 2),
            segment_ids=jnp.zeros((1, 2), jnp.int32),
            cache=layer.init_cache(1, 4),
        )
