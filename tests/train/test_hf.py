"""`nested-jax import-hf` / `export-hf` against PyTorch `transformers` (issue 18 items 1–2).

Tiny randomly initialised `LlamaForCausalLM` (GQA, llama3 RoPE scaling, untied head) and
`Qwen2ForCausalLM` (q/k/v biases, tied head) are made here with `transformers` and saved with
`save_pretrained` (nothing is downloaded). Parity: the imported model's logits equal torch's to
float32 rounding on 150 tokens, beyond the llama3 scaling's 64-token original length: max |logit|
about 3, largest difference measured 4e-5 (float32 cos / sin of angles up to 150 rad differ
between XLA and torch by ~1e-5), asserted at 1e-4 absolute; the RoPE frequencies themselves are
compared to the model's own ``inv_freq`` at 1e-6 relative. Round trip: import → step 0 →
export → `from_pretrained` gives the same tensors bit for bit and the same logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_helpers import defaults_preset, tiny_values, write_corpus  # noqa: E402

from nested_jax import cli  # noqa: E402
from nested_jax.layers.rope import rope_frequencies  # noqa: E402
from nested_jax.models import build_model, hf  # noqa: E402
from nested_jax.train.convert import load_checkpoint_params  # noqa: E402

SIZES = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,  # O(1) logits, so the comparison is not of near-zeros
)
T = 150


def _save(model_cls, config, directory: Path) -> Path:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    llama = LlamaConfig(
        **SIZES,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    qwen = Qwen2Config(**SIZES, tie_word_embeddings=True, rope_theta=5000.0)
    return {
        "llama": _save(LlamaForCausalLM, llama, root / "llama"),
        "qwen2": _save(Qwen2ForCausalLM, qwen, root / "qwen2"),
    }


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfruns")
    corpus = write_corpus(root / "corpus")
    values = tiny_values(corpus, root / "data_cache", **{"data.seq_len": 64, "train.steps": 2})
    sets = []
    for key, value in values.items():
        if not key.startswith("model."):  # the checkpoint fixes the model
            sets += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    return root, ["--config", str(defaults_preset(root)), *sets]


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, (2, T))


def _torch_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _jax_logits(workdir: Path, tokens: np.ndarray) -> np.ndarray:
    cfg, params, step = load_checkpoint_params(workdir)
    assert step == 0
    model = build_model(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    nnx.update(model, state)
    return np.asarray(model(jnp.asarray(tokens))[0])


def _import(run_root, source: Path, workdir: Path, *extra: str) -> None:
    _, argv = run_root
    code = cli.main(["import-hf", "--from", str(source), *argv, "--workdir", str(workdir), *extra])
    assert code == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_import_gives_the_logits_of_transformers(checkpoints, run_root, arch):
    root = run_root[0]
    workdir = root / f"imported_{arch}"
    _import(run_root, checkpoints[arch], workdir)
    tokens = _tokens(SIZES["vocab_size"])
    ref = _torch_logits(checkpoints[arch], tokens)
    ours = _jax_logits(workdir, tokens)
    assert np.abs(ref).max() > 0.5  # not a comparison of near-zeros
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    model = json.loads((workdir / "config.json").read_text())["model"]
    assert model["attention"]["qkv_bias"] == (arch == "qwen2")
    assert model["attention"]["rope_scaling"] == ("llama3" if arch == "llama" else "none")
    assert model["tie_embeddings"] == (arch == "qwen2")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_export_round_trip_is_exact(checkpoints, run_root, arch, capsys):
    root = run_root[0]
    workdir, out = root / f"roundtrip_{arch}", root / f"exported_{arch}"
    _import(run_root, checkpoints[arch], workdir)
    # 40 KiB shards: the export is split and indexed, as a large model's would be.
    argv = ["export-hf", "--workdir", str(workdir), "--out", str(out), "--max-shard-mb", "0.04"]
    assert cli.main(argv) == 0
    assert (out / hf.INDEX_FILE).is_file()
    _, original = hf.read_hf_checkpoint(checkpoints[arch])
    _, exported = hf.read_hf_checkpoint(out)
    assert set(exported) == set(original)  # lm_head.weight exactly when untied
    for name, value in original.items():
        if name in exported:
            np.testing.assert_array_equal(np.asarray(exported[name]), np.asarray(value), name)
    tokens = _tokens(SIZES["vocab_size"])
    np.testing.assert_allclose(
        _torch_logits(out, tokens), _torch_logits(checkpoints[arch], tokens), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rope_frequencies_equal_the_models_inv_freq(checkpoints, arch):
    model = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32)
    cfg = hf.model_config_from_hf(hf.read_hf_config(checkpoints[arch]))
    ours = rope_frequencies(cfg.resolved_head_dim(), cfg.rope_theta, cfg.attention.scaling())
    np.testing.assert_allclose(ours, model.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_import_into_hope_attention_copies_the_ffn_and_exports_back(checkpoints, run_root):
    root = run_root[0]
    workdir, out = root / "hope_attention", root / "hope_attention_out"
    _import(run_root, checkpoints["llama"], workdir, "--to", "hope_attention")
    cfg, params, _ = load_checkpoint_params(workdir)
    assert cfg.name == "hope_attention" and cfg.resolved_ffn() == "cms"
    levels = params["blocks"]["mlp"]["levels"]
    assert len(levels) == len(cfg.cms.periods) > 1
    _, original = hf.read_hf_checkpoint(checkpoints["llama"])
    gate0 = np.asarray(original["model.layers.0.mlp.gate_proj.weight"]).T
    for level in levels.values():
        np.testing.assert_array_equal(np.asarray(level["w_gate"])[0], gate0)
    assert cli.main(["export-hf", "--workdir", str(workdir), "--out", str(out)]) == 0
    _, exported = hf.read_hf_checkpoint(out)
    for name, value in original.items():
        np.testing.assert_array_equal(np.asarray(exported[name]), np.asarray(value), name)


def test_imported_run_trains_on(checkpoints, run_root):
    root, argv = run_root
    workdir = root / "train_on"
    _import(run_root, checkpoints["qwen2"], workdir)
    assert cli.main(["train", "--workdir", str(workdir), *argv[2:]]) == 0
    assert (workdir / "checkpoints" / "2").is_dir()


def test_import_refuses_a_config_that_contradicts_the_checkpoint(checkpoints, run_root, capsys):
    root, argv = run_root
    code = cli.main(
        ["import-hf", "--from", str(checkpoints["llama"]), *argv, "--set", "model.d_model=32"]
        + ["--workdir", str(root / "refused")]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "model.d_model" in err and "32" in err and "64" in err
    assert not (root / "refused").exists()


def test_import_names_the_bad_tensor(checkpoints, run_root, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    config, tensors = hf.read_hf_checkpoint(checkpoints["llama"])
    tensors = {k: np.asarray(v) for k, v in tensors.items()}
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:5]
    hf.write_safetensors(bad / hf.SINGLE_FILE, tensors)
    _, argv = run_root
    code = cli.main(["import-hf", "--from", str(bad), *argv, "--workdir", str(tmp_path / "w")])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err == "tensor model.layers.1.mlp.up_proj.weight: shape [5, 64], expected [96, 64]"


def _copy_checkpoint(source: Path, directory: Path, **changes) -> Path:
    """``source`` rewritten into ``directory`` with ``changes`` (name -> array, None removes)."""
    directory.mkdir()
    (directory / "config.json").write_text((source / "config.json").read_text())
    _, tensors = hf.read_hf_checkpoint(source)
    tensors = {k: np.asarray(v) for k, v in tensors.items()}
    for name, value in changes.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    hf.write_safetensors(directory / hf.SINGLE_FILE, tensors)
    return directory


def _refusal(run_root, source: Path, workdir: Path, capsys) -> str:
    _, argv = run_root
    code = cli.main(["import-hf", "--from", str(source), *argv, "--workdir", str(workdir)])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert not workdir.exists()
    return err


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_defaults_are_the_transformers_config_class_defaults(arch):
    # Every field of the table left out in turn: the model fields must be the ones read from the
    # config that transformers builds from the same config.json.
    from transformers import AutoConfig

    given = {
        **SIZES,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        **({"attention_bias": False, "mlp_bias": False} if arch == "llama" else {}),
        **({"use_sliding_window": False} if arch == "qwen2" else {}),
    }
    given.pop("initializer_range")
    assert set(hf.TRANSFORMERS_DEFAULTS[arch]) == set(given)
    for field in given:
        config = {k: v for k, v in given.items() if k != field}
        theirs = AutoConfig.for_model(arch, **config).to_dict()
        assert hf.hf_model_fields({"model_type": arch, **config}) == hf.hf_model_fields(theirs), (
            field
        )


def test_qwen2_untied_head_with_the_tying_left_out(run_root, tmp_path):
    # Qwen2Config unties the head by default: config.json need not say so.
    source = _save(
        Qwen2ForCausalLM, Qwen2Config(**SIZES, tie_word_embeddings=False), tmp_path / "q"
    )
    config = json.loads((source / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (source / "config.json").write_text(json.dumps(config))
    _, tensors = hf.read_hf_checkpoint(source)
    assert "lm_head.weight" in tensors
    workdir = tmp_path / "w"
    _import(run_root, source, workdir)
    tokens = _tokens(SIZES["vocab_size"])
    np.testing.assert_allclose(
        _jax_logits(workdir, tokens), _torch_logits(source, tokens), atol=1e-4, rtol=0
    )
    assert json.loads((workdir / "config.json").read_text())["model"]["tie_embeddings"] is False


def test_import_refuses_a_tensor_it_does_not_use(checkpoints, run_root, tmp_path, capsys):
    extra = np.zeros(64, np.float32)
    source = _copy_checkpoint(
        checkpoints["llama"], tmp_path / "extra", **{"model.layers.0.self_attn.o_proj.bias": extra}
    )
    err = _refusal(run_root, source, tmp_path / "w", capsys)
    assert err.startswith("tensor model.layers.0.self_attn.o_proj.bias has no place in the model")


def test_a_tied_checkpoint_may_repeat_the_embedding_as_head_only_exactly(
    checkpoints, run_root, tmp_path, capsys
):
    _, tensors = hf.read_hf_checkpoint(checkpoints["qwen2"])
    embed = np.asarray(tensors["model.embed_tokens.weight"])
    same = _copy_checkpoint(checkpoints["qwen2"], tmp_path / "same", **{"lm_head.weight": embed})
    _import(run_root, same, tmp_path / "w_same")
    other = _copy_checkpoint(
        checkpoints["qwen2"], tmp_path / "other", **{"lm_head.weight": embed + 1}
    )
    err = _refusal(run_root, other, tmp_path / "w_other", capsys)
    assert err.startswith("tensor lm_head.weight differs from model.embed_tokens.weight")


def test_import_streams_one_tensor_at_a_time(checkpoints, run_root, tmp_path, monkeypatch):
    # The import never initialises the full train state (random weights, optimizer moments) and
    # holds at most one checkpoint tensor, read into memory it owns (not a memory map).
    import weakref

    from nested_jax.train import hf_import, setup

    def no_init(plan):
        raise AssertionError("the import initialised the full train state")

    monkeypatch.setattr(setup, "initialise", no_init)
    live, most = [0], [0]
    read = hf_import.SafetensorsFiles.read

    def counted(self, name):
        a = read(self, name)
        assert a.base is None  # owns its bytes
        live[0] += 1
        most[0] = max(most[0], live[0])
        weakref.finalize(a, lambda: live.__setitem__(0, live[0] - 1))
        return a

    monkeypatch.setattr(hf_import.SafetensorsFiles, "read", counted)
    workdir = tmp_path / "w"
    _import(run_root, checkpoints["llama"], workdir)
    assert most[0] == 1
    from nested_jax.train.checkpoint import Checkpointer

    leaves = Checkpointer(workdir, read_only=True).saved_leaves(0)
    assert not [k for k in leaves if k.startswith("opt_state")]
    assert any(k.startswith("params.") for k in leaves)
