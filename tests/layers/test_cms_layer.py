"""CMSFFN: the CMS levels as NNX params, its forward vs core cms_forward, labels, sharding names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.core.cms.levels import CMSLevel, cms_forward
from nested_jax.layers.cms import CMSFFN
from nested_jax.layers.options import CMSOptions
from nested_jax.optim.multifreq import level_labels_by_index


def _ffn(variant="sequential", gated=True, k=3, d=12, h=20, dtype=jnp.float32, seed=0):
    opts = CMSOptions(periods=tuple(2**i for i in range(k)), variant=variant, gated=gated)
    return CMSFFN(d, h, opts, dtype=dtype, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("variant", ["sequential", "nested", "independent"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_forward_is_cms_forward_minus_input(variant, gated):
    ffn = _ffn(variant, gated)
    if variant == "independent":  # non-uniform mixing so the weights matter
        ffn.mix_logits[...] = jnp.array([0.3, -1.0, 0.5])
    z = jax.random.normal(jax.random.key(1), (2, 7, 12))
    params = nnx.to_pure_dict(nnx.state(ffn, nnx.Param))
    levels = tuple(
        CMSLevel(
            w_up=params["levels"][i]["w_up"],
            w_down=params["levels"][i]["w_down"],
            w_gate=params["levels"][i]["w_gate"] if gated else None,
        )
        for i in range(3)
    )
    mix = params["mix_logits"] if variant == "independent" else None
    expect = cms_forward(levels, z, variant=variant, mix_logits=mix) - z
    np.testing.assert_allclose(np.asarray(ffn(z)), np.asarray(expect), rtol=1e-6, atol=1e-6)
    # The levels are distinct random initialisations (not k copies of one).
    assert not np.allclose(params["levels"][0]["w_up"], params["levels"][1]["w_up"])


def test_one_gated_level_is_a_swiglu_update():
    # One gated level: CMS(z) − z = (silu(z W_gate) ⊙ z W_up) W_down, the shell's SwiGLU FFN.
    ffn = _ffn(k=1)
    lv = ffn.levels[0]
    z = jax.random.normal(jax.random.key(2), (3, 5, 12))
    swiglu = (jax.nn.silu(z @ lv.w_gate[...]) * (z @ lv.w_up[...])) @ lv.w_down[...]
    np.testing.assert_allclose(np.asarray(ffn(z)), np.asarray(swiglu), rtol=1e-5, atol=1e-6)


def test_param_layout_names_and_level_labels():
    ffn = _ffn("independent")
    state = nnx.state(ffn, nnx.Param)
    pure = nnx.to_pure_dict(state)
    assert sorted(pure) == ["levels", "mix_logits"]
    assert sorted(pure["levels"]) == [0, 1, 2]
    assert pure["levels"][1]["w_up"].shape == (12, 20)
    assert pure["levels"][1]["w_gate"].shape == (12, 20)
    assert pure["levels"][1]["w_down"].shape == (20, 12)
    np.testing.assert_array_equal(np.asarray(pure["mix_logits"]), np.zeros(3))  # uniform start
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    assert tuple(specs["levels"][2]["w_up"]) == ("embed", "mlp")
    assert tuple(specs["levels"][2]["w_gate"]) == ("embed", "mlp")
    assert tuple(specs["levels"][2]["w_down"]) == ("mlp", "embed")
    labels = level_labels_by_index("levels")(pure)
    assert labels["mix_logits"] is None
    for i in range(3):
        assert {labels["levels"][i][n] for n in ("w_up", "w_gate", "w_down")} == {i}


def test_plain_and_non_independent_have_no_extra_params():
    pure = nnx.to_pure_dict(nnx.state(_ffn("sequential", gated=False), nnx.Param))
    assert sorted(pure) == ["levels"]
    assert sorted(pure["levels"][0]) == ["w_down", "w_up"]


def test_bfloat16_activations_keep_f32_params():
    ffn = _ffn(dtype=jnp.bfloat16)
    y = ffn(jnp.ones((1, 4, 12), jnp.float32))
    assert y.dtype == jnp.bfloat16
    assert ffn.levels[0].w_up[...].dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"^CMSOptions\.variant: unknown 'parallel'"):
        _ffn("parallel")
    with pytest.raises(ValueError, match=r"^CMSOptions\.periods: must be a non-empty tuple"):
        _ffn(k=0)
    with pytest.raises(ValueError, match=r"^hidden: expected a positive int"):
        _ffn(h=0)
    with pytest.raises(ValueError, match=r"^z: expected shape \[B, T, 12\]"):
        _ffn()(jnp.zeros((2, 5, 13)))
    with pytest.raises(ValueError, match=r"^z: expected shape"):
        _ffn()(jnp.zeros((5, 12)))


def test_gradients_reach_every_level():
    ffn = _ffn("independent")
    z = jax.random.normal(jax.random.key(3), (2, 4, 12))
    graphdef, params = nnx.split(ffn, nnx.Param)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(z) ** 2)

    g = nnx.to_pure_dict(jax.grad(loss)(params))
    for i in range(3):
        for n in ("w_up", "w_gate", "w_down"):
            assert float(jnp.abs(g["levels"][i][n]).max()) > 0, (i, n)
    assert float(jnp.abs(g["mix_logits"]).max()) > 0
