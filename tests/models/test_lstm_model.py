"""The LSTM mixer in the LM shell: cached decoding == full forward, packed rows == rows alone, the
model learns a tiny task (loss goes down), impl other than recurrent is refused, preset loads."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nested_jax.models import ModelConfig, build_model
from nested_jax.train.config import load_config

SMALL = dict(vocab_size=16, d_model=24, n_layers=2, n_heads=2, impl="recurrent")


def _tokens(seed, b, t):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL["vocab_size"], jnp.int32)


def test_teacher_forced_decoding_equals_full_forward():
    model = build_model(ModelConfig(name="lstm", **SMALL), rngs=nnx.Rngs(0))
    tokens = _tokens(1, 2, 11)
    full, _ = model(tokens)
    cache = model.init_cache(2, 11)
    logits, cache = model(tokens[:, :4], cache=cache)
    outs = [logits]
    for t in range(4, 11):
        logits, cache = model(tokens[:, t : t + 1], cache=cache)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-4)


def test_packed_rows_equal_rows_alone():
    model = build_model(ModelConfig(name="lstm", **SMALL), rngs=nnx.Rngs(0))
    a, b = _tokens(2, 1, 5), _tokens(3, 1, 7)
    packed = jnp.concatenate([a, b], 1)
    seg = jnp.asarray([[1] * 5 + [2] * 7])
    y, _ = model(packed, segment_ids=seg)
    np.testing.assert_allclose(y[:, 5:], model(b)[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y[:, :5], model(a)[0], rtol=1e-4, atol=1e-4)


def test_learns_to_repeat_the_previous_token():
    model = build_model(ModelConfig(name="lstm", **SMALL), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(m, x):
        logits, _ = m(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, 1:], x[:, :-1]).mean()

    @nnx.jit
    def step(m, o, x):
        loss, g = nnx.value_and_grad(loss_fn)(m, x)
        o.update(m, g)
        return loss

    losses = [float(step(model, opt, _tokens(10 + i, 16, 12))) for i in range(60)]
    assert losses[0] > 2.0  # ≈ ln 16 at init
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_only_the_recurrent_form():
    with pytest.raises(ValueError, match="lstm: impl='chunked'"):
        build_model(ModelConfig(name="lstm", **dict(SMALL, impl="chunked")), rngs=nnx.Rngs(0))


def test_preset_loads():
    cfg = load_config(["configs/experiments/tiny_lstm.yaml"])
    assert cfg.model.name == "lstm" and cfg.model.impl == "recurrent"
    with pytest.raises(ValueError, match="hidden_size"):
        load_config(["configs/experiments/tiny_lstm.yaml"], ["model.hidden_size=3"])
