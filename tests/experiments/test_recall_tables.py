"""The recall tables (``nested_jax.experiments.recall_tables``): each table's models and options,
its presets, and one table end to end at a tiny preset (resumed from its cached runs)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from nested_jax.eval.recall import RecallVocab
from nested_jax.experiments import recall_tables
from nested_jax.experiments._training import model_config
from nested_jax.experiments.recall_probe import KINDS, token_kinds
from nested_jax.experiments.synthetic_data import recall_batch


def test_variants_reach_the_model_configs():
    scale = recall_tables.SCALES["cpu"]
    s = recall_tables.table_settings("hola", scale, recall_tables.TABLES["hola"])
    beta, recency = (model_config(m, s, 32).hola for m in ("hola", "hola@recency"))
    assert (beta.eviction, recency.eviction) == ("beta_e", "recency")
    assert beta.window == recency.window == 16 and beta.block_size == recency.block_size == 16
    s = recall_tables.table_settings("hola_text", scale, recall_tables.TABLES["hola_text"])
    assert s.task == "recall:kv_text" and model_config("hola@recency", s, 32).hola.window == 16
    s = recall_tables.table_settings("titans", scale, recall_tables.TABLES["titans"])
    assert model_config("transformer@swa", s, 32).window == s.seq_len // 4
    assert model_config("titans_mac", s, 32).titans.segment_len == s.seq_len // 4
    assert model_config("gdn", s, 32).window == 0
    s = recall_tables.table_settings("proteus", scale, recall_tables.TABLES["proteus"])
    assert model_config("gdn+proteus16", s, 32).proteus.blocks == 16
    s = recall_tables.table_settings("proteus", scale, ("gdn+proteus16@half", "gdn+proteus16"))
    half, whole = (model_config(m, s, 32).proteus for m in ("gdn+proteus16@half", "gdn+proteus16"))
    assert (half.blocks, half.context_len, whole.context_len) == (16, s.seq_len // 2, s.seq_len)
    head = s.d_model // s.n_heads
    assert 4 * s.recall_batch_sizes()["pairs"] >= 3 * head  # most of a head's state
    gpu = recall_tables.table_settings("proteus", recall_tables.SCALES["gpu"], ("gdn",))
    assert gpu.recall_batch_sizes()["pairs"] > gpu.d_model // gpu.n_heads  # beyond it
    assert s.depth_bins == 1 and s.eval_multipliers == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("scale", sorted(recall_tables.SCALES))
@pytest.mark.parametrize("table", sorted(recall_tables.TABLES))
def test_every_preset_builds_its_settings(table, scale):
    models = recall_tables.TABLES[table]
    s = recall_tables.table_settings(table, recall_tables.SCALES[scale], models)
    assert s.task.startswith("recall:kv") and s.recall_cells()
    for name in models:  # every model's options are valid at the preset's sizes
        model_config(name, s, s.d_model)
    # every training row holds filler between its pairs: rows of pairs only would leave the filler
    # ids unseen until the longer scored rows, which then measure untrained tokens, not length
    sizes = s.recall_batch_sizes()
    vocab = RecallVocab(sizes["keys"], sizes["values"], sizes["filler"])
    kinds = token_kinds(recall_batch(s, np.random.default_rng(0))["inputs"], vocab)
    assert (kinds == KINDS.index("filler")).any(axis=1).all()


def test_unknown_names_fail_in_one_line(capsys):
    assert recall_tables.main(["hola", "--scale", "tpu", "--out", "x"]) == 2
    assert "scale" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^table"):
        recall_tables.run_table("mamba", "cpu", "x")


def test_a_table_runs_and_resumes(tmp_path, monkeypatch, capsys):
    tiny = dataclasses.replace(
        recall_tables.SCALES["cpu"], steps=2, batch_size=4, d_model=16, lrs=(1e-3,), seeds=(0,),
        eval_batches=1, multipliers=(1, 2), depth_bins=2,
        sizes={"seq_len": 64, "pairs": 3, "queries": 2, "keys": 8, "values": 8, "filler": 4},
    )  # fmt: skip
    monkeypatch.setitem(recall_tables.SCALES, "cpu", tiny)
    argv = ["hola", "--out", str(tmp_path), "--models", "hola", "hola@recency"]
    assert recall_tables.main(argv) == 0
    first = capsys.readouterr().out
    assert "recall table `hola`" in first and "| hola@recency |" in first
    assert "lr chosen on validation: hola 0.001, hola@recency 0.001" in first  # the swept rates
    result = json.loads((tmp_path / "hola" / "recall_kv.json").read_text())
    assert [r["model"] for r in result["runs"]] == ["hola", "hola@recency"]
    assert (tmp_path / "hola" / "recall_kv_depth.png").is_file()
    assert "step 2/2" in first
    assert recall_tables.main(argv) == 0  # every run found in the cache: nothing trains
    again = capsys.readouterr().out
    assert "reusing" in again and "step 2/2" not in again
    wider = [*argv, "--seeds", "0", "1", "--finished-only"]  # seed 1 never trained: left out
    assert recall_tables.main(wider) == 0
    summary = capsys.readouterr().out
    assert "| hola (seed 0) |" in summary and "step " not in summary
    assert not list((tmp_path / "hola").rglob("*seed1*"))
    one_rate = ["hola", "--out", str(tmp_path), "--models", "hola", "--lrs", "3e-3"]
    assert recall_tables.main(one_rate) == 0  # a rate the preset does not sweep: trained anew
    assert "lr chosen on validation: hola 0.003" in capsys.readouterr().out
    assert (tmp_path / "hola" / "models" / "recall_kv" / "hola-seed0-lr0.003.json").is_file()
