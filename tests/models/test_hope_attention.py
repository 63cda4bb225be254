"""Hope-Attention (SPEC §3.4): attention + CMS FFN in the LM shell, its config, and its
initialisation from a trained transformer (same logits with one level)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers.options import CMSOptions
from nested_jax.models import ModelConfig, available_mixers, build_model
from nested_jax.train.config import ConfigError, load_config
from nested_jax.train.convert import check_convertible, convert_ffn_to_cms

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mlp_hidden=48)
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "experiments"


def _cfg(name="hope_attention", periods=(1, 4, 16), variant="sequential", **kw):
    return ModelConfig(
        **{**SMALL, **kw}, name=name, cms=CMSOptions(periods=periods, variant=variant)
    )


def _build(cfg, seed=0):
    return build_model(cfg, rngs=nnx.Rngs(seed))


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _with_params(cfg, params):
    model = _build(cfg, seed=123)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state, rest)


@nnx.jit
def _forward(model, tokens, cache=None):
    return model(tokens, cache=cache)


def _tokens(seed, b=2, t=11):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL["vocab_size"], jnp.int32)


def _count(params):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


# --------------------------------------------------------------------------------------------
# config


def test_ffn_resolution_rule():
    assert "hope_attention" in available_mixers()
    assert _cfg().resolved_ffn() == "cms"
    assert ModelConfig(**SMALL, name="transformer").resolved_ffn() == "swiglu"
    assert ModelConfig(**SMALL, name="gdn", ffn="cms").resolved_ffn() == "cms"
    assert ModelConfig(**SMALL, name="hope_attention", ffn="cms").resolved_ffn() == "cms"
    assert _cfg(mlp_hidden=48).resolved_cms_hidden() == 48
    assert ModelConfig(**SMALL, cms=CMSOptions(hidden=20)).resolved_cms_hidden() == 20


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.ffn=mlp"], r"^model\.ffn: unknown 'mlp'"),
        (["model.name=hope_attention", "model.ffn=swiglu"], r"^model\.ffn: hope_attention is"),
        (["model.cms.periods=[4, 1]"], r"^model\.cms\.periods: must be strictly increasing"),
        (["model.cms.periods=[]"], r"^model\.cms\.periods: must be a non-empty tuple"),
        (["model.cms.periods=[0, 2]"], r"^model\.cms\.periods: must be positive ints"),
        (["model.cms.periods=[1, x]"], r"^model\.cms\.periods\[1\]: expected int"),
        (["model.cms.variant=parallel"], r"^model\.cms\.variant: unknown 'parallel'"),
        (
            ["model.cms.variant=nested", "model.cms.periods=[2, 3]"],
            r"^model\.cms\.periods: for variant='nested' must each divide the next",
        ),
        (["model.cms.hidden=-1"], r"^model\.cms\.hidden: must be an int >= 0"),
        (["model.cms.gated=1"], r"^model\.cms\.gated: expected bool"),
        (["model.cms.mode=offline"], r"^model\.cms\.mode: unknown 'offline'"),
        (["model.cms.accumulate=max"], r"^model\.cms\.accumulate: unknown 'max'"),
        (["model.cms.online_inner=adam"], r"^model\.cms\.online_inner: unknown 'adam'"),
        (["model.cms.online_lr=0"], r"^model\.cms\.online_lr: must be a float > 0"),
        (["model.cms.levels=3"], r"^model\.cms\.levels: unknown key"),
    ],
)
def test_bad_cms_configs_fail_with_the_field_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config([], overrides)
    assert "\n" not in str(err.value)
    assert re.search(message, str(err.value)), str(err.value)


def test_cms_config_values_load_and_round_trip():
    cfg = load_config(
        [],
        [
            "model.name=hope_attention",
            "model.cms.periods=[2, 8]",
            "model.cms.variant=independent",
            "model.cms.mode=online",
            "model.cms.online_inner=dgd",
        ],
    )
    assert cfg.model.cms.periods == (2, 8) and cfg.model.cms.mode == "online"
    assert cfg.model.resolved_ffn() == "cms"


# --------------------------------------------------------------------------------------------
# model


def test_existing_models_keep_their_swiglu_and_params():
    auto = _build(ModelConfig(**SMALL, name="transformer"))
    explicit = _build(ModelConfig(**SMALL, name="transformer", ffn="swiglu"))
    pa, pe = _params(auto), _params(explicit)
    assert sorted(pa["blocks"]["mlp"]) == ["down", "gate", "up"]
    chex.assert_trees_all_equal(pa, pe)


@pytest.mark.parametrize("variant", ["sequential", "independent"])
def test_parameter_count_is_transformer_plus_extra_levels(variant):
    k, L, d, h = 3, SMALL["n_layers"], SMALL["d_model"], SMALL["mlp_hidden"]
    base = _count(_params(_build(ModelConfig(**SMALL, name="transformer"))))
    n = _count(_params(_build(_cfg(variant=variant))))
    extra_mix = k * L if variant == "independent" else 0
    assert n == base + (k - 1) * L * 3 * d * h + extra_mix


def test_forward_is_causal_and_every_level_gets_gradients():
    model = _build(_cfg(variant="sequential"))
    tokens = _tokens(1)
    logits, _ = _forward(model, tokens)
    assert logits.shape == (2, 11, 64) and bool(jnp.isfinite(logits).all())
    changed = tokens.at[:, 7:].set((tokens[:, 7:] + 5) % 64)
    logits2, _ = _forward(model, changed)
    np.testing.assert_allclose(np.asarray(logits[:, :7]), np.asarray(logits2[:, :7]), atol=1e-6)
    assert not np.allclose(np.asarray(logits[:, 7:]), np.asarray(logits2[:, 7:]))

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        out, _ = nnx.merge(graphdef, p, rest)(tokens)
        return jnp.mean(jax.nn.log_softmax(out)[..., 0])

    g = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))
    for i in range(3):
        for name in ("w_up", "w_gate", "w_down"):
            assert float(jnp.abs(g["blocks"]["mlp"]["levels"][i][name]).max()) > 0


def test_decode_token_by_token_equals_forward():
    model = _build(_cfg(variant="independent"))
    tokens = _tokens(2, b=2, t=6)
    full, _ = _forward(model, tokens)
    cache = model.init_cache(2, 6)
    steps = []
    for t in range(6):
        out, cache = _forward(model, tokens[:, t : t + 1], cache)
        steps.append(out)
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("variant", ["sequential", "nested", "independent"])
def test_bf16_forward_is_finite(variant):
    periods = (1, 4) if variant == "nested" else (1, 3)
    model = _build(_cfg(variant=variant, periods=periods, dtype="bfloat16"))
    logits, _ = _forward(model, _tokens(3))
    assert bool(jnp.isfinite(logits).all())


def test_hope_model_uses_the_cms_ffn_when_registered():
    if "hope" not in available_mixers():
        pytest.skip("the 'hope' mixer is not registered yet (nested_jax/layers/hope.py)")
    cfg = load_config([CONFIGS / "tiny_hope.yaml"]).model
    assert cfg.resolved_ffn() == "cms"
    model = _build(cfg)
    assert sorted(_params(model)["blocks"]["mlp"]) == ["levels"]
    logits, _ = model(jax.random.randint(jax.random.key(0), (1, 64), 0, 257, jnp.int32))
    assert bool(jnp.isfinite(logits).all())


# --------------------------------------------------------------------------------------------
# initialisation from a transformer (SPEC §3.4)


def _transformer_and_logits(seed=0, **kw):
    cfg = ModelConfig(**{**SMALL, **kw}, name="transformer")
    model = _build(cfg, seed)
    tokens = _tokens(4)
    return cfg, _params(model), tokens, _forward(model, tokens)[0]


@pytest.mark.parametrize(
    "periods, variant, equal",
    [
        ((1,), "sequential", True),
        ((5,), "independent", True),
        ((1, 4, 16), "independent", True),
        ((1, 2), "nested", True),
        ((1, 4), "sequential", False),  # the FFN composed twice: a different function
    ],
    ids=["1-level", "1-level-indep", "3-level-indep", "2-level-nested", "2-level-seq"],
)
def test_converted_model_gives_the_transformer_logits(periods, variant, equal):
    src_cfg, src_params, tokens, expect = _transformer_and_logits()
    dst_cfg = _cfg(periods=periods, variant=variant)
    check_convertible(src_cfg, dst_cfg)
    params = convert_ffn_to_cms(src_params, _params(_build(dst_cfg, seed=7)))
    mlp = params["blocks"]["mlp"]
    for i in range(len(periods)):  # every level holds the source FFN exactly
        np.testing.assert_array_equal(
            mlp["levels"][i]["w_gate"], src_params["blocks"]["mlp"]["gate"]["kernel"]
        )
        np.testing.assert_array_equal(
            mlp["levels"][i]["w_down"], src_params["blocks"]["mlp"]["down"]["kernel"]
        )
    np.testing.assert_array_equal(params["embed"], src_params["embed"])
    got, _ = _forward(_with_params(dst_cfg, params), tokens)
    close = np.allclose(np.asarray(got), np.asarray(expect), atol=2e-5, rtol=1e-5)
    assert close == equal, float(jnp.abs(got - expect).max())


def test_conversion_errors_are_one_line_and_named():
    src_cfg, src_params, _, _ = _transformer_and_logits()
    with pytest.raises(ValueError, match=r"^model\.cms\.hidden: the CMS level width 20 differs"):
        check_convertible(
            src_cfg, ModelConfig(**SMALL, name="hope_attention", cms=CMSOptions(hidden=20))
        )
    with pytest.raises(ValueError, match=r"^model\.cms\.gated: must be true"):
        check_convertible(
            src_cfg, ModelConfig(**SMALL, name="hope_attention", cms=CMSOptions(gated=False))
        )
    with pytest.raises(ValueError, match=r"^model\.name: the target mixer 'gdn' differs"):
        check_convertible(src_cfg, ModelConfig(**SMALL, name="gdn", ffn="cms"))
    with pytest.raises(ValueError, match=r"^model\.ffn: the target 'transformer' must have a CMS"):
        check_convertible(src_cfg, ModelConfig(**SMALL, name="transformer"))
    with pytest.raises(ValueError, match=r"^init_from: the source model 'hope_attention' has no"):
        check_convertible(_cfg(), _cfg())
    # Shapes: a wider target hidden (bypassing the config check) and an untied source head.
    wide = _params(_build(_cfg(mlp_hidden=64)))
    with pytest.raises(ValueError, match=r"^init_from: shape mismatch at blocks/mlp/levels/0/w_"):
        convert_ffn_to_cms(src_params, wide)
    _, untied, _, _ = _transformer_and_logits(tie_embeddings=False)
    with pytest.raises(
        ValueError, match=r"^init_from: the source parameter head/kernel has no place"
    ):
        convert_ffn_to_cms(untied, _params(_build(_cfg())))
    with pytest.raises(
        ValueError, match=r"^init_from: the source checkpoint has no parameter head"
    ):
        convert_ffn_to_cms(src_params, _params(_build(_cfg(tie_embeddings=False))))


# --------------------------------------------------------------------------------------------
# from an orbax checkpoint


@pytest.fixture(scope="module")
def saved_transformer(tmp_path_factory):
    """A training-layout checkpoint (state/params + config) of a random SMALL transformer."""
    import orbax.checkpoint as ocp

    from nested_jax.train.config import config_from_dict, config_to_dict

    config = config_from_dict({"model": {**SMALL, "name": "transformer", "vocab_size": 257}})
    model = _build(config.model, seed=3)
    workdir = tmp_path_factory.mktemp("saved") / "run"
    manager = ocp.CheckpointManager((workdir / "checkpoints").resolve())
    state = {"step": jnp.asarray(5, jnp.int32), "params": _params(model)}
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config_to_dict(config))
    )
    manager.save(5, args=args)
    manager.wait_until_finished()
    manager.close()
    return workdir, config.model, model


def test_checkpoint_params_convert_to_the_same_logits(saved_transformer):
    from nested_jax.train.convert import init_params_from_checkpoint, load_checkpoint_params

    workdir, src_cfg, src_model = saved_transformer
    cfg, params, step = load_checkpoint_params(workdir)
    assert step == 5 and cfg == src_cfg
    chex.assert_trees_all_equal(params, _params(src_model))
    _, params, _ = load_checkpoint_params(workdir / "checkpoints" / "5")  # a step directory
    chex.assert_trees_all_equal(params, _params(src_model))

    dst_cfg = ModelConfig(
        **{**SMALL, "vocab_size": 257}, name="hope_attention", cms=CMSOptions(periods=(1,))
    )
    converted = init_params_from_checkpoint(workdir, dst_cfg, _params(_build(dst_cfg, seed=9)))
    tokens = _tokens(5)
    np.testing.assert_allclose(
        np.asarray(_forward(_with_params(dst_cfg, converted), tokens)[0]),
        np.asarray(_forward(src_model, tokens)[0]),
        atol=2e-5,
        rtol=1e-5,
    )


def test_missing_and_corrupt_checkpoints_are_reported(saved_transformer, tmp_path):
    import shutil

    from nested_jax.train.convert import load_checkpoint_params, main

    with pytest.raises(FileNotFoundError, match=r"^init_from: no checkpoint at .*nowhere"):
        load_checkpoint_params(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"^init_from: no checkpoint at"):
        load_checkpoint_params(saved_transformer[0] / "checkpoints" / "7")
    bad = tmp_path / "bad"
    shutil.copytree(saved_transformer[0], bad)
    for f in (bad / "checkpoints" / "5" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
            f.write_bytes(b"garbage")
    with pytest.raises(
        ValueError, match=r"^init_from: checkpoint .*bad/checkpoints/5 is unreadable"
    ):
        load_checkpoint_params(bad)
    assert main(["--from", str(tmp_path / "nowhere"), "--workdir", str(tmp_path / "x")]) == 1
    assert main(["--from", "a", "--set", "model.cms.mode=x", "--workdir", "y"]) == 2


@pytest.mark.slow
def test_convert_cli_then_training_resumes_from_step_0(tmp_path):
    """End to end: train a transformer 2 steps, convert its run into step 0 of a hope_attention
    workdir (CLI), check the logits, then `train_and_evaluate` resumes from that step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    from train_helpers import tiny_overrides, write_corpus

    from nested_jax.train.convert import main
    from nested_jax.train.inference import load_trained
    from nested_jax.train.loop import train_and_evaluate

    overrides = tiny_overrides(
        write_corpus(tmp_path / "corpus"), tmp_path / "cache", **{"train.steps": 2}
    )
    src = tmp_path / "transformer"
    train_and_evaluate(load_config([], overrides), src)
    trained = load_trained(src)

    hope = [o for o in overrides if not o.startswith("model.name=")]
    hope += ["model.name=hope_attention", "model.cms.periods=[1]", "train.steps=3"]
    dst = tmp_path / "hope"
    argv = ["--from", str(src), "--workdir", str(dst)]
    for o in hope:
        argv += ["--set", o]
    assert main(argv) == 0
    restored = load_trained(dst)
    assert restored.step == 0
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 257, jnp.int32)
    np.testing.assert_allclose(
        np.asarray(_forward(restored.model(), tokens)[0]),
        np.asarray(_forward(trained.model(), tokens)[0]),
        atol=2e-5,
        rtol=1e-5,
    )
    summary = train_and_evaluate(load_config([], hope), dst)
    assert summary["start_step"] == 0 and summary["steps"] == 3
    assert np.isfinite(summary["final_train_loss"])
    assert main(argv) == 1  # the workdir has checkpoints now: refused
