"""Every shipped config loads; bad configs fail at load with one line naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from nested_jax.train.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    load_config,
    load_workdir_config,
    save_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALL_YAML = sorted(CONFIGS.rglob("*.yaml"))


def test_configs_directory_has_the_presets():
    names = {p.relative_to(CONFIGS).as_posix() for p in ALL_YAML}
    for required in (
        "experiments/tiny_transformer.yaml",
        "experiments/tiny_gdn.yaml",
        "experiments/tiny_deltanet.yaml",
        "experiments/tiny_lstm.yaml",
        "experiments/pod_gdn_125m.yaml",
        "experiments/pod_gdn_1.3b.yaml",
        "mesh/cpu.yaml",
        "mesh/pod_fsdp.yaml",
    ):
        assert required in names


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_every_shipped_config_loads(path):
    cfg = load_config([path])
    assert isinstance(cfg, Config)
    # Round trip: the saved dict rebuilds the same config.
    assert config_from_dict(config_to_dict(cfg)) == cfg


def _param_count(cfg: Config) -> int:
    from nested_jax.models import build_model

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: build_model(cfg.model, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "path",
    sorted((CONFIGS / "experiments").glob("pod_*.yaml")) + sorted(CONFIGS.glob("slices/*.yaml")),
    ids=lambda p: p.stem,
)
def test_pod_presets_have_the_size_in_their_name(path):
    """``pod_<model>_<size>`` and the rented-slice presets ``slices/<model>_<size>-<slice>``."""
    size = re.search(r"_(\d+(?:\.\d+)?)([mb])(?:-|$)", path.stem)
    target = float(size.group(1)) * (1e6 if size.group(2) == "m" else 1e9)
    n = _param_count(load_config([path]))
    assert 0.7 * target <= n <= 1.3 * target, f"{path.name}: {n / 1e6:.0f}M parameters"


def test_defaults_yaml_and_overrides_compose(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 10\n  seed: 3\noptimizer:\n  lr: 0.01\n")
    top = tmp_path / "top.yaml"
    top.write_text("include: base.yaml\ntrain:\n  steps: 20\n")
    cfg = load_config([top], ["train.log_every=5", "optimizer.lr=1", "eval.niah_depths=[0.5]"])
    assert cfg.train.steps == 20 and cfg.train.seed == 3 and cfg.train.log_every == 5
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int -> float allowed
    assert cfg.eval.niah_depths == (0.5,)


# YAML 1.2 floats that PyYAML (YAML 1.1) loads as strings: an exponent without a dot or sign.
EXPONENT_FLOATS = {"1e-3": 1e-3, "1E-3": 1e-3, "-2e5": -2e5, "+1.5e-4": 1.5e-4, "1.5e4": 1.5e4}


@pytest.mark.parametrize("text", EXPONENT_FLOATS)
def test_exponent_numbers_are_floats_in_yaml_files_and_set(tmp_path, text):
    value = EXPONENT_FLOATS[text]
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        f"model:\n  hola:\n    gate_init: {text}\neval:\n  niah_depths: [0.5, {text}]\n"
    )
    # (gate_init takes any sign; niah_depths only [0, 1], so the others are checked on gate_init)
    if 0 <= value <= 1:
        assert load_config([preset]).eval.niah_depths == (0.5, value)
    preset.write_text(f"model:\n  hola:\n    gate_init: {text}\n")
    gate = load_config([preset]).model.hola.gate_init
    assert gate == value and type(gate) is float
    assert load_config([], [f"model.hola.gate_init={text}"]).model.hola.gate_init == value


def test_an_exponent_learning_rate_loads_from_yaml_and_set(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("optimizer:\n  lr: 1e-3\n  min_lr_ratio: 5E-2\n")
    assert load_config([preset]).optimizer.lr == 1e-3
    assert load_config([preset]).optimizer.min_lr_ratio == 5e-2
    assert load_config([], ["optimizer.lr=1e-3"]).optimizer.lr == 1e-3


def test_a_str_field_keeps_an_exponent_number_as_text(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("mesh:\n  topology: 1e-3\n")
    assert load_config([preset]).mesh.topology == "1e-3"
    assert load_config([], ["mesh.topology=1E-3"]).mesh.topology == "1E-3"


def test_save_and_reload_from_workdir(tmp_path):
    cfg = load_config([], ["train.steps=7", "model.d_model=64"])
    save_config(cfg, tmp_path)
    assert (tmp_path / "config.yaml").is_file()
    assert load_workdir_config(tmp_path) == cfg
    assert load_workdir_config(tmp_path, ["train.steps=9"]).train.steps == 9


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stepz=3"], r"^train\.stepz: unknown key"),
        (["trian.steps=3"], r"^trian: unknown key"),
        (["train.steps=abc"], r"^train\.steps: expected int, got str 'abc'"),
        (["train.steps=1.5"], r"^train\.steps: expected int, got float"),
        (["train.steps=true"], r"^train\.steps: expected int, got bool"),
        (["optimizer.lr=fast"], r"^optimizer\.lr: expected float, got str"),
        (["optimizer.lr=1e-3x"], r"^optimizer\.lr: expected float, got str '1e-3x'"),
        (["optimizer.lr='0.5'"], r"^optimizer\.lr: expected float, got str '0\.5'"),
        (["train.steps=1e3"], r"^train\.steps: expected int, got str '1e3'"),
        (["train.async_checkpointing=1"], r"^train\.async_checkpointing: expected bool"),
        (["train.nan_policy=ignore"], r"^train\.nan_policy: expected one of \['skip', 'stop'\]"),
        (["eval.niah_lengths=[128, x]"], r"^eval\.niah_lengths\[1\]: expected int"),
        (["model.d_model=abc"], r"^model\.d_model: expected int"),
        (["model.n_heads=3"], r"^model\.d_model: .*n_heads=3"),
        (["data.seq_len=0"], r"^data\.seq_len: must be >= 1"),
        (["optimizer.name=sgd9"], r"^optimizer\.name: unknown optimizer 'sgd9'"),
        (["mesh.data=4", "mesh.fsdp=2", "data.batch_size=12"], r"^data\.batch_size: 12 is not div"),
        (
            ["model.name=gdn", "model.chunk_size=64", "data.seq_len=100"],
            r"^data\.seq_len: 100 is not a multiple of model\.chunk_size = 64",
        ),
        (["model.vocab_size=256"], r"^model\.vocab_size: 256 is smaller than the 'byte'"),
        (["train.steps=0"], r"^train\.steps: must be >= 1"),
        (["mesh.data=-1", "mesh.fsdp=-1"], r"^mesh\.data: at most one"),
        (["model=3"], r"^model: expected a mapping"),
        (["train.steps"], r"--set train\.steps: expected KEY=VALUE"),
        (
            ["model.name=gdn", "model.proteus.blocks=4", "model.proteus.context_len=64"],
            r"^model\.proteus\.context_len: 64 differs from data\.seq_len",
        ),
    ],
)
def test_bad_configs_fail_with_the_field_named(overrides, message):
    # The defaults are valid (checked below), so exactly the override is at fault.
    with pytest.raises(ConfigError) as err:
        load_config([], overrides)
    text = str(err.value)
    assert "\n" not in text
    assert re.search(message, text), text


def test_defaults_are_valid_and_section_defaults_survive_partial_yaml():
    assert load_config() == Config()
    assert load_config([], ["model.d_model=64"]).model.vocab_size == 257


def test_seq_len_rule_does_not_apply_to_attention_or_recurrent_impl():
    load_config([], ["model.name=transformer", "data.seq_len=100"])
    load_config([], ["model.impl=recurrent", "data.seq_len=100"])


@pytest.mark.parametrize(
    "overrides,knob",
    [
        (
            ["model.name=titans_lmm", "model.titans.memory_chunk=16"],
            r"model\.titans\.memory_chunk = 16",
        ),
        (
            ["model.name=titans_mac", "model.titans.memory_chunk=16"],
            r"model\.titans\.memory_chunk = 16",
        ),
        (["model.name=hope", "model.hope.chunk_memory=16"], r"model\.hope\.chunk_memory = 16"),
        (["model.name=hola", "model.chunk_size=64"], r"model\.chunk_size = 64"),
    ],
)
def test_seq_len_rule_names_the_chunk_the_mixer_reads(overrides, knob):
    """The registry asks each mixer which chunk it runs (models.registry.mixer_seq_len_multiples):
    Titans and Hope are checked against their own chunk sizes, not model.chunk_size."""
    with pytest.raises(ConfigError, match=rf"^data\.seq_len: 100 is not a multiple of {knob}"):
        load_config([], [*overrides, "data.seq_len=100"])


def test_seq_len_rule_ignores_knobs_a_mixer_does_not_read():
    # 96: a multiple of the Titans / Hope chunks, not of model.chunk_size = 64 (which neither reads)
    for name in ("titans_lmm", "titans_mag", "hope"):
        load_config([], [f"model.name={name}", "model.chunk_size=64", "data.seq_len=96"])
    load_config(
        [], ["model.name=titans_lmm", "model.titans.memory_impl=recurrent", "data.seq_len=97"]
    )
    load_config([], ["model.name=hope", "model.impl=recurrent", "data.seq_len=97"])


def test_bad_yaml_files_are_reported(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found"):
        load_config([missing])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config([bad])
    loop = tmp_path / "loop.yaml"
    loop.write_text("include: loop.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config([loop])
