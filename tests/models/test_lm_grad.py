"""LM shell (SPEC §6): scan vs unrolled layers and remat agree; a training step is finite."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nested_jax.models import ModelConfig, build_model

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, chunk_size=8)


def _model(seed=0, **kw):
    return build_model(ModelConfig(**{**SMALL, **kw}), rngs=nnx.Rngs(seed))


@nnx.jit
def _forward(model, tokens, segment_ids=None, cache=None):
    return model(tokens, segment_ids=segment_ids, cache=cache)


def _tokens(seed, b, t):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL["vocab_size"], jnp.int32)


def _loss(model, tokens):
    logits, _ = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_scan_unrolled_and_remat_agree_on_logits_and_gradients():
    # Attention compiles fastest; the layer stacking under test is the same for every mixer.
    kw = dict(name="transformer", n_layers=3)
    base = _model(**kw)
    tokens = _tokens(4, 2, 10)
    grad_fn = nnx.jit(nnx.grad(_loss))
    ref, ref_grad = _forward(base, tokens)[0], grad_fn(base, tokens)
    for mode in (dict(scan_layers=False), dict(remat=True)):
        other = _model(seed=7, **kw, **mode)
        nnx.update(other, nnx.state(base))  # the same stacked parameters in every mode
        np.testing.assert_allclose(_forward(other, tokens)[0], ref, rtol=1e-5, atol=1e-5)
        grad = grad_fn(other, tokens)
        for g1, g2 in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
            np.testing.assert_allclose(g1, g2, rtol=0, atol=1e-4 * float(jnp.abs(g2).max()))


def test_gradient_step_is_finite_and_lowers_the_loss():
    model = _model(name="gdn", tie_embeddings=False)
    tokens = _tokens(5, 2, 12)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens):
        loss, grads = nnx.value_and_grad(_loss)(model, tokens)
        opt.update(model, grads)
        return loss, grads

    loss0, grads = step(model, opt, tokens)
    chex.assert_tree_all_finite(grads)
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0
    loss, _ = step(model, opt, tokens)
    assert np.isfinite(float(loss)) and float(loss) < float(loss0)
