"""`nested_jax.models.hf` without a model: safetensors files, config mapping, RoPE scaling rules.

The parity of whole models with PyTorch `transformers` is `tests/train/test_hf.py`.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nested_jax.layers.options import AttentionOptions
from nested_jax.layers.rope import RopeScaling, rope_frequencies
from nested_jax.models import hf

LLAMA = {
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def test_our_file_reads_in_safetensors_and_theirs_in_ours(tmp_path):
    rng = np.random.default_rng(0)
    ours = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.bf16": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
        "c.i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "d.empty": np.zeros((0, 2), np.float32),
    }
    hf.write_safetensors(tmp_path / "ours.safetensors", ours, {"format": "pt"})
    theirs = load_file(tmp_path / "ours.safetensors")
    assert set(theirs) == set(ours)
    for name, value in ours.items():
        got = theirs[name].float().numpy() if name == "b.bf16" else theirs[name].numpy()
        np.testing.assert_array_equal(got, np.asarray(value, got.dtype), name)
    assert theirs["b.bf16"].dtype == torch.bfloat16

    save_file({k: v for k, v in theirs.items()}, tmp_path / "theirs.safetensors")
    back = hf.read_safetensors(tmp_path / "theirs.safetensors")
    assert back["b.bf16"].dtype == ml_dtypes.bfloat16
    for name, value in ours.items():
        np.testing.assert_array_equal(back[name], value, name)
        assert back[name].shape == value.shape


def test_a_truncated_file_is_one_line(tmp_path):
    hf.write_safetensors(tmp_path / "x.safetensors", {"w": np.ones((64, 64), np.float32)})
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"cut.safetensors: tensor w \(64, 64\) has a truncated"):
        hf.read_safetensors(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        hf.read_safetensors(tmp_path / "junk.safetensors")


def test_missing_shard_and_missing_weights_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hf.read_hf_checkpoint(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / hf.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="shard model-00002-of-00002.safetensors"):
        hf.read_hf_checkpoint(tmp_path)


def test_config_maps_both_ways():
    cfg = hf.model_config_from_hf(LLAMA)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (64, 2, 4, 2)
    assert (cfg.resolved_head_dim(), cfg.mlp_hidden, cfg.norm_eps) == (16, 96, 1e-5)
    assert cfg.rope_theta == 500000.0 and cfg.attention.scaling() is None
    assert not cfg.tie_embeddings and not cfg.attention.qkv_bias
    back = hf.hf_config_from_model(cfg)
    assert hf.model_config_from_hf(back) == cfg
    qwen = hf.model_config_from_hf({**LLAMA, "model_type": "qwen2", "tie_word_embeddings": True})
    assert qwen.attention.qkv_bias and qwen.tie_embeddings
    assert hf.hf_config_from_model(qwen)["model_type"] == "qwen2"


def test_fields_left_out_take_the_transformers_defaults_of_their_architecture():
    bare = {
        k: v for k, v in LLAMA.items() if k not in ("tie_word_embeddings", "num_key_value_heads")
    }
    llama = hf.hf_model_fields(bare)
    assert not llama["tie_embeddings"] and llama["n_kv_heads"] == 4
    qwen = hf.hf_model_fields({**bare, "model_type": "qwen2"})
    assert not qwen["tie_embeddings"] and qwen["n_kv_heads"] == 32
    layers = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    assert hf.model_config_from_hf(layers).n_layers == 32


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ],
)
def test_what_the_shell_cannot_compute_is_refused_by_name(change, field):
    config = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=rf"^config.json {field}: ") as err:
        hf.model_config_from_hf(config)
    assert "\n" not in str(err.value)


def test_export_refuses_a_window_and_a_biased_llama():
    cfg = hf.model_config_from_hf({**LLAMA, "model_type": "qwen2"})
    with pytest.raises(ValueError, match="model.attention.qkv_bias"):
        hf.hf_config_from_model(cfg, "llama")
    import dataclasses

    with pytest.raises(ValueError, match="model.window"):
        hf.hf_config_from_model(dataclasses.replace(cfg, window=8))


def _llama3_reference(freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Meta's three-branch rule, written independently of rope.py's clipped form."""
    out = []
    for w in freq:
        wavelength = 2 * math.pi / w
        if wavelength < s.original_max_len / s.high_freq_factor:
            out.append(w)
        elif wavelength > s.original_max_len / s.low_freq_factor:
            out.append(w / s.factor)
        else:
            smooth = (s.original_max_len / wavelength - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * w / s.factor + smooth * w)
    return np.array(out)


def test_rope_scaling_rules():
    base = np.asarray(rope_frequencies(128, 500000.0))
    s = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    ours = np.asarray(rope_frequencies(128, 500000.0, s))
    np.testing.assert_allclose(ours, _llama3_reference(base, s), rtol=1e-6)
    # all three bands are present at these sizes
    assert np.sum(ours == base) > 0 and np.sum(np.isclose(ours, base / 8, rtol=1e-6)) > 0
    assert np.sum(~np.isclose(ours, base) & ~np.isclose(ours, base / 8)) > 0
    linear = np.asarray(rope_frequencies(128, 500000.0, RopeScaling("linear", 4.0)))
    np.testing.assert_allclose(linear, base / 4, rtol=1e-6)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rope_scaling": "yarn"}, "AttentionOptions.rope_scaling: unknown 'yarn'"),
        ({"rope_factor": 0.0}, "AttentionOptions.rope_factor: must be a number > 0"),
        ({"qkv_bias": 1}, "AttentionOptions.qkv_bias: expected bool"),
        (
            {"rope_scaling": "llama3", "rope_low_freq_factor": 4.0},
            "AttentionOptions.rope_high_freq_factor: must exceed",
        ),
    ],
)
def test_attention_options_reject_bad_values(fields, message):
    with pytest.raises(ValueError, match=message):
        AttentionOptions(**fields)
