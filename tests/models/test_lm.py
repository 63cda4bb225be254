"""LM shell (SPEC §6): bf16, parameter names, cache shapes, input errors, registry, depth."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from nested_jax.layers import Attention
from nested_jax.models import ModelConfig, build_model, register_mixer

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, chunk_size=8)


def _model(seed=0, **kw):
    return build_model(ModelConfig(**{**SMALL, **kw}), rngs=nnx.Rngs(seed))


@nnx.jit
def _forward(model, tokens, segment_ids=None, cache=None):
    return model(tokens, segment_ids=segment_ids, cache=cache)


def _tokens(seed, b, t):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL["vocab_size"], jnp.int32)


@pytest.mark.parametrize("name", ["transformer", "gdn"])
def test_bf16_forward_is_finite(name):
    model = _model(name=name, dtype="bfloat16")
    tokens = _tokens(6, 2, 9)
    logits, cache = _forward(model, tokens, cache=model.init_cache(2, 9))
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    assert model.embed[...].dtype == jnp.float32
    if name == "gdn":
        assert cache.layers.state.dtype == jnp.float32  # memory states stay f32 under bf16


def test_param_names_cache_shapes_and_input_errors():
    model = _model(name="transformer", n_heads=4, n_kv_heads=2, tie_embeddings=False)
    specs = nnx.get_partition_spec(nnx.state(model))
    assert tuple(specs["embed"].get_value()) == ("vocab", "embed")
    assert tuple(specs["head"]["kernel"].get_value()) == ("embed", "vocab")
    assert tuple(specs["blocks"]["mixer"]["q_proj"]["kernel"].get_value()) == (
        "layers",
        "embed",
        "heads",
    )
    assert tuple(specs["blocks"]["mlp"]["up"]["kernel"].get_value()) == ("layers", "embed", "mlp")
    assert model.blocks.mixer.q_proj.kernel.shape == (2, 32, 32)
    cache = model.init_cache(3, 20)
    assert cache.layers.k.shape == (2, 3, 20, 2, 8) and cache.layers.pos.shape == (2,)
    tokens = _tokens(7, 1, 4)
    with pytest.raises(ValueError, match="tokens"):
        model(tokens.astype(jnp.float32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, segment_ids=jnp.zeros((1, 4), jnp.int32), cache=model.init_cache(1, 4))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, segment_ids=jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="max_len"):
        model.init_cache(1, 0)


class _ScaledAttention(Attention):
    """A stand-in for a later mixer: registered from outside, no edit of the LM shell."""

    def __call__(self, x, **kw):
        y, cache = super().__call__(x, **kw)
        return 0.5 * y, cache


def test_register_mixer_plugs_a_new_mixer_into_the_shell():
    register_mixer("test_scaled_attention", _ScaledAttention, overwrite=True)
    model = _model(name="test_scaled_attention")
    assert isinstance(model.blocks.mixer, _ScaledAttention)
    assert _forward(model, _tokens(8, 1, 5))[0].shape == (1, 5, 64)
    with pytest.raises(ValueError, match="already registered"):
        register_mixer("gdn", _ScaledAttention)
    with pytest.raises(ValueError, match="cls"):
        register_mixer("broken", object)
    with pytest.raises(ValueError, match=r"^options: unknown option sections \['titan'\]"):
        register_mixer("test_typo", _ScaledAttention, options=("titan",))


def _n_eqns(jaxpr) -> int:
    """Equations in a jaxpr, counting those inside nested sub-jaxprs (scan bodies, pjit, ...)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                if hasattr(sub, "jaxpr"):
                    n += _n_eqns(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
                elif hasattr(sub, "eqns"):
                    n += _n_eqns(sub)
    return n


def test_scanned_program_size_does_not_grow_with_depth():
    tokens = _tokens(9, 1, 8)

    def size(n_layers, scan_layers):
        model = _model(name="gdn", n_layers=n_layers, scan_layers=scan_layers, impl="recurrent")
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens)[0])(state)
        return _n_eqns(jaxpr.jaxpr)

    assert size(2, True) == size(4, True)
    assert size(4, False) > 1.8 * size(2, False)
