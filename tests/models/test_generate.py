"""generate(): prefill + token-by-token decoding with the carried state (SPEC §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.models import ModelConfig, build_model, generate

SMALL = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=2, chunk_size=8)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)[0]


@pytest.mark.parametrize("name", ["transformer", "gdn"])
def test_greedy_generation_follows_the_full_forward_argmax(name):
    model = build_model(ModelConfig(name=name, **SMALL), rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, 48, jnp.int32)
    out = generate(model, prompt, 6, rng=jax.random.key(2), temperature=0.0)
    assert out.shape == (2, 11) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :5], prompt)
    # Every generated token is the argmax of the full-sequence logits at the previous position.
    logits = _forward(model, out)
    np.testing.assert_array_equal(out[:, 5:], jnp.argmax(logits[:, 4:10], -1))
    # top_k=1 sampling is greedy whatever the temperature.
    out_k1 = generate(model, prompt, 6, rng=jax.random.key(3), temperature=2.0, top_k=1)
    np.testing.assert_array_equal(out_k1, out)


def test_sampling_is_reproducible_and_in_range():
    model = build_model(ModelConfig(name="deltanet", **SMALL), rngs=nnx.Rngs(0))
    prompt = jnp.zeros((3, 2), jnp.int32)
    a = generate(model, prompt, 7, rng=jax.random.key(5), top_k=10)
    b = generate(model, prompt, 7, rng=jax.random.key(5), top_k=10)
    c = generate(model, prompt, 7, rng=jax.random.key(6), top_k=10)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    assert int(a.min()) >= 0 and int(a.max()) < 48
    np.testing.assert_array_equal(generate(model, prompt, 0, rng=jax.random.key(5)), prompt)
    with pytest.raises(ValueError, match="prompt"):
        generate(model, jnp.zeros((3,), jnp.int32), 2, rng=jax.random.key(0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1, rng=jax.random.key(0))
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 2, rng=jax.random.key(0), top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 2, rng=jax.random.key(0), temperature=-1.0)
