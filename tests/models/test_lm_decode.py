"""LM shell (SPEC §6): cached token-by-token decoding == full forward, packed segments,
causality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.models import LMCache, ModelConfig, build_model

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, chunk_size=8)
CASES = {
    "transformer": dict(name="transformer"),
    "transformer_window_gqa": dict(name="transformer", n_heads=4, n_kv_heads=2, window=4),
    "deltanet": dict(name="deltanet"),
    "gdn": dict(name="gdn"),
}


def _model(seed=0, **kw):
    return build_model(ModelConfig(**{**SMALL, **kw}), rngs=nnx.Rngs(seed))


@nnx.jit
def _forward(model, tokens, segment_ids=None, cache=None):
    return model(tokens, segment_ids=segment_ids, cache=cache)


def _tokens(seed, b, t):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL["vocab_size"], jnp.int32)


@pytest.mark.parametrize("case", list(CASES))
def test_teacher_forced_decoding_equals_full_forward(case):
    model = _model(**CASES[case])
    tokens = _tokens(1, 2, 11)
    full, cache_out = _forward(model, tokens)
    assert full.shape == (2, 11, 64) and full.dtype == jnp.float32 and cache_out is None
    # Prefill 4 tokens through the full forward, then feed the true tokens one at a time.
    cache = model.init_cache(2, 11)
    logits, cache = _forward(model, tokens[:, :4], cache=cache)
    outs = [logits]
    for t in range(4, 11):
        logits, cache = _forward(model, tokens[:, t : t + 1], cache=cache)
        outs.append(logits)
    assert isinstance(cache, LMCache) and int(cache.pos) == 11
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["transformer_window_gqa", "deltanet", "gdn"])
def test_packed_segments_equal_separate_sequences(case):
    model = _model(**CASES[case])
    tokens = _tokens(2, 1, 12)
    seg = jnp.array([[1] * 6 + [2] * 6], jnp.int32)  # equal lengths: one compile for both halves
    packed, _ = _forward(model, tokens, seg)
    a, _ = _forward(model, tokens[:, :6])
    b, _ = _forward(model, tokens[:, 6:])
    np.testing.assert_allclose(packed, jnp.concatenate([a, b], 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["transformer", "gdn"])
def test_causality(case):
    model = _model(**CASES[case])
    tokens = _tokens(3, 2, 12)
    y1, _ = _forward(model, tokens)
    y2, _ = _forward(model, tokens.at[:, 7:].set((tokens[:, 7:] + 1) % 64))
    np.testing.assert_allclose(y1[:, :7], y2[:, :7], atol=1e-6)
    assert float(jnp.abs(y1[:, 7:] - y2[:, 7:]).max()) > 1e-4
