"""MQAR comparison (nested_jax.experiments.mqar): runs end to end, sizes models, rejects bad
input."""

from __future__ import annotations

import json

import pytest

from nested_jax.experiments import _training, mqar


def test_mqar_two_steps_one_model(tmp_path, capsys):
    out = tmp_path / "mqar"
    argv = ["--models", "gdn", "--steps", "2", "--seq-len", "16", "--num-kv-pairs", "2"]
    argv += ["--vocab", "16", "--d-model", "16", "--n-layers", "1", "--batch-size", "4"]
    argv += ["--eval-batches", "1", "--warmup-steps", "1", "--out", str(out)]
    assert mqar.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "mqar.json").read_text())
    md = (out / "mqar.md").read_text()
    assert md in printed and "| gdn | 16 |" in md
    assert result["chance"] == pytest.approx(1 / 8)
    assert result["settings"]["steps"] == 2 and result["settings"]["vocab"] == 16
    (row,) = result["rows"]
    assert row["model"] == "gdn" and row["steps"] == 2 and row["params"] > 0
    assert 0.0 <= row["accuracy"] <= 1.0
    assert row["eval_queries"] == 4 * 2  # batch 4 × 2 queries per sequence
    assert row["eval_loss"] > 0 and row["final_train_loss"] > 0


def test_matched_d_model_is_closest_in_its_grid():
    s = mqar.MqarSettings(seq_len=16, num_kv_pairs=2, vocab=16, d_model=32, n_layers=1)
    target = _training.count_params("gdn", s, 32)
    d, n = _training.matched_d_model("transformer", s, target)
    assert d % (2 * s.n_heads) == 0 and n == _training.count_params("transformer", s, d)
    for other in (d - 2 * s.n_heads, d + 2 * s.n_heads):
        if other > 0:
            assert abs(_training.count_params("transformer", s, other) - target) >= abs(n - target)


def test_bad_inputs_fail_before_training(capsys):
    assert mqar.main(["--models", "no_such_model", "--steps", "1"]) == 2
    assert "no_such_model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seq_len"):
        mqar.MqarSettings(seq_len=8, num_kv_pairs=8)
    with pytest.raises(ValueError, match="d_model"):
        mqar.MqarSettings(d_model=63, n_heads=2)


@pytest.mark.slow  # ~85 s on 2 cores (three model compiles)
def test_proteus_model_specs_and_longer_evaluation(tmp_path):
    assert _training.parse_model("gdn") == ("gdn", 1)
    assert _training.parse_model("gdn+proteus16") == ("gdn", 16)
    with pytest.raises(ValueError, match="models"):
        _training.parse_model("gdn+proteusx")
    s = mqar.MqarSettings(
        steps=2, seq_len=16, num_kv_pairs=2, vocab=16, d_model=16, n_layers=1, batch_size=4,
        eval_batches=1, warmup_steps=1, eval_multipliers=(1, 4), match_params=False,
    )  # fmt: skip
    cfg = _training.model_config("gdn+proteus4", s, 16)
    assert (cfg.name, cfg.proteus.blocks, cfg.proteus.context_len) == ("gdn", 4, 16)
    assert _training.count_params("gdn+proteus4", s, 16) == _training.count_params("gdn", s, 16)
    res = mqar.run_mqar(["gdn+proteus4"], s, tmp_path)
    (row,) = res["rows"]
    assert row["model"] == "gdn+proteus4"
    assert {k: v["seq_len"] for k, v in row["by_length"].items()} == {"1": 16, "4": 64}
    assert row["accuracy"] == row["by_length"]["1"]["accuracy"]
    assert row["by_length"]["4"]["eval_queries"] == 4 * 2
    assert "acc 4×" in res["markdown"] and "| gdn+proteus4 |" in res["markdown"]
    assert (tmp_path / "models" / "gdn+proteus4.json").is_file()
    again = mqar.run_mqar(["gdn+proteus4"], s, tmp_path)  # reused: identical row, no training
    assert again["rows"] == res["rows"]
    for bad in ((), (0,), (1, 1)):
        with pytest.raises(ValueError, match="eval_multipliers"):
            mqar.MqarSettings(eval_multipliers=bad)


_HOPE_SETTINGS = dict(
    steps=2, seq_len=16, num_kv_pairs=2, vocab=16, d_model=16, n_layers=1, batch_size=2,
    eval_batches=1, warmup_steps=1, match_params=False,
)  # fmt: skip


class _Stop(Exception):
    pass


def test_hope_models_get_the_cms_pretrain_optimizer(monkeypatch):
    # hope / hope_attention resolve ffn=auto to CMS; MQAR must hand the model config to
    # build_optimizer so the CMS levels step at their periods, as in the training loop.
    # The spy stops before any compilation, so this stays cheap.
    from nested_jax.train import optimizer

    seen = []

    def spy(cfg, total_steps, *, model=None):
        seen.append(optimizer.cms_pretrain_periods(model))
        raise _Stop

    monkeypatch.setattr(optimizer, "build_optimizer", spy)
    s = mqar.MqarSettings(**_HOPE_SETTINGS)
    for name in ("hope", "hope_attention", "gdn"):
        with pytest.raises(_Stop):
            mqar.train_and_score(name, s, 16)
    assert seen == [(1, 4, 16), (1, 4, 16), None]


@pytest.mark.slow
def test_hope_models_train_end_to_end(tmp_path):
    s = mqar.MqarSettings(**_HOPE_SETTINGS)
    res = mqar.run_mqar(["hope", "hope_attention"], s, tmp_path)
    assert [r["model"] for r in res["rows"]] == ["hope", "hope_attention"]
    for r in res["rows"]:
        assert r["final_train_loss"] > 0 and 0.0 <= r["accuracy"] <= 1.0
