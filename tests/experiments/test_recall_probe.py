"""The recall probe (``nested_jax.experiments.recall_probe``): token kinds, the recorded gates, and
HOLA's cache contents checked against what a recency cache must hold; the command end to end on a
tiny table."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from nested_jax.eval.recall import RecallVocab, make_recall_batch
from nested_jax.experiments import recall_probe, recall_tables
from nested_jax.experiments._training import Trained, build_training
from nested_jax.experiments.synthetic_data import SyntheticSettings

SIZES = {"seq_len": 48, "pairs": 3, "queries": 2, "keys": 8, "values": 8, "filler": 4}


def _settings(model: str, *options: str) -> SyntheticSettings:
    return SyntheticSettings(
        task="recall:kv", steps=1, batch_size=4, d_model=16, n_layers=2, n_heads=2,
        recall_sizes=tuple(SIZES.items()), model_overrides=tuple((model, o) for o in options),
    )  # fmt: skip


def _untrained(model: str, *options: str) -> tuple[SyntheticSettings, Trained]:
    s = _settings(model, *options)
    graphdef, state_def, rest, _, state, _ = build_training(model, s, s.d_model)
    return s, Trained(graphdef, state_def, rest, state["params"])


def _batch(rows: int = 4, multiplier: int = 1):
    vocab = RecallVocab(SIZES["keys"], SIZES["values"], SIZES["filler"])
    sizes = {**SIZES, "seq_len": multiplier * SIZES["seq_len"]}
    batch = make_recall_batch(rows, 3, **sizes)
    return batch["inputs"], recall_probe.token_kinds(batch["inputs"], vocab)


def test_token_kinds_follow_the_vocabulary():
    inputs, kinds = _batch()
    q = int(np.argmax(inputs[0] == RecallVocab.QUERY))
    assert (kinds[:, q:] == 3).all() and (kinds[:, :q] != 3).all()
    assert ((kinds == 1).sum(1) == SIZES["pairs"]).all()  # each pair's key once in the haystack
    assert ((kinds == 2).sum(1) == SIZES["pairs"]).all()
    # every key of the haystack is followed by its value
    rows, cols = np.nonzero(kinds == 1)
    assert (kinds[rows, cols + 1] == 2).all()
    with pytest.raises(ValueError, match="^inputs"):
        recall_probe.token_kinds(inputs[:, :q], RecallVocab(8, 8, 4))  # no QUERY left


def test_mean_by_kind():
    kinds = np.array([[0, 1, 1, 3]])
    x = np.array([[[1.0, 3.0], [2.0, 2.0], [4.0, 4.0], [5.0, 7.0]]])  # [B, T, H]
    assert recall_probe.mean_by_kind(x, kinds) == [2.0, 3.0, None, 6.0]
    assert recall_probe.mean_by_kind(x, kinds, per_head=True) == [
        [1.0, 3.0],
        [3.0, 3.0],
        None,
        [5.0, 7.0],
    ]


def test_gates_are_recorded_per_layer():
    _, trained = _untrained("gdn")
    inputs, kinds = _batch()
    gates = recall_probe.gate_statistics(trained, inputs, kinds)
    assert len(gates["write"]) == len(gates["retain"]) == 2  # n_layers
    for layer in gates["write"] + gates["retain"]:
        assert all(0.0 < v < 1.0 for v in layer)
    for layer, per_head in zip(gates["retain"], gates["retain_by_head"], strict=True):
        # two heads per layer; their mean is the layer's (every head sees the same tokens)
        np.testing.assert_allclose([np.mean(h) for h in per_head], layer, rtol=1e-6)
    _, titans = _untrained("titans_lmm")
    gates = recall_probe.gate_statistics(titans, inputs, kinds)
    assert len(gates["write"]) == 2 and all(v > 0 for v in gates["retain"][0])
    _, transformer = _untrained("transformer")
    assert recall_probe.gate_statistics(transformer, inputs, kinds) is None


def test_a_recency_cache_holds_the_last_w_tokens_before_the_last_block():
    w, c = 4, 8
    opts = (f"model.hola.window={w}", f"model.hola.block_size={c}", "model.hola.eviction=recency")
    _, trained = _untrained("hola", *opts)
    inputs, kinds = _batch(multiplier=2)
    got = recall_probe.hola_cache_contents(trained, inputs, kinds)
    prefix = int(np.argmax(kinds[0] == 3))
    end = (prefix // c) * c  # the persistent cache is updated at block boundaries only
    held = kinds[:, end - w : end]
    for layer in range(2):
        assert got["entries"][layer] == w
        share = [float((held == i).mean()) for i in range(4)]
        np.testing.assert_allclose(got["share"][layer], share)
        values = kinds[:, :prefix] == 2
        kept = values[:, end - w : end].sum() / values.sum()
        np.testing.assert_allclose(got["kept_values"][layer], kept)
    _, gdn = _untrained("gdn")
    assert recall_probe.hola_cache_contents(gdn, inputs, kinds) is None


def test_answers_split_by_the_filler_around_their_pairs():
    vocab = RecallVocab(SIZES["keys"], SIZES["values"], SIZES["filler"])
    batch = make_recall_batch(16, 5, **SIZES)
    inputs, answers = batch["inputs"], batch["score_mask"] > 0
    # by hand: a pair is ahead of the filler when no filler token comes before its key
    is_filler = inputs >= vocab.filler_base
    ahead, after_count = [], []
    for b, t in zip(*np.nonzero(answers), strict=True):
        key = list(inputs[b]).index(inputs[b, t])
        ahead.append(not is_filler[b, :key].any())
        after_count.append(int(is_filler[b, key:].sum()))
    ahead = np.array(ahead)
    assert ahead.any() and not ahead.all()  # the seed gives both kinds of pair
    wrong_ahead = answers.copy()
    wrong_ahead[np.nonzero(answers)[0][ahead], np.nonzero(answers)[1][ahead]] = False
    got = recall_probe.split_by_filler(inputs, answers, wrong_ahead, vocab, bands=2)
    assert got["before_filler"] == [0.0, int(ahead.sum())]
    assert got["after_filler"] == [1.0, int((~ahead).sum())]
    top = max(c for c, a in zip(after_count, ahead, strict=True) if not a)
    bands = got["by_filler_after"]
    assert [b[:2] for b in bands] == [[0.0, top / 2], [top / 2, float(top)]]
    assert sum(b[3] for b in bands) == (~ahead).sum() and all(b[2] in (1.0, None) for b in bands)
    everything_wrong = recall_probe.split_by_filler(inputs, answers, ~answers, vocab)
    assert everything_wrong["before_filler"][0] == everything_wrong["after_filler"][0] == 0.0
    with pytest.raises(ValueError, match="^right"):
        recall_probe.split_by_filler(inputs, answers, answers[:, 1:], vocab)


def test_the_probe_runs_on_a_table(tmp_path, monkeypatch, capsys):
    tiny = dataclasses.replace(
        recall_tables.SCALES["cpu"], steps=2, batch_size=4, d_model=16, lrs=(1e-3,), seeds=(0,),
        eval_batches=1, multipliers=(1,), depth_bins=1, sizes=SIZES,
    )  # fmt: skip
    monkeypatch.setitem(recall_tables.SCALES, "cpu", tiny)
    assert recall_tables.main(["hola", "--out", str(tmp_path), "--models", "hola", "gdn"]) == 0
    capsys.readouterr()
    out = tmp_path / "probe"
    argv = ["--dir", str(tmp_path / "hola"), "--models", "hola", "gdn", "--multipliers", "1", "2"]
    assert recall_probe.main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "== hola 2x: write" in printed and "entries/head" in printed
    report = json.loads((out / "recall_probe.json").read_text())
    assert set(report["models"]) == {"hola", "gdn"}
    assert report["models"]["gdn"]["2x"]["cache"] is None
    assert (out / "recall_probe.png").is_file()
    answers = report["models"]["gdn"]["1x"]["answers"]
    assert answers["before_filler"][1] + answers["after_filler"][1] == 4 * SIZES["queries"]
    assert recall_probe.main(["--dir", str(tmp_path), "--models", "hola", "--out", str(out)]) == 2
    assert "dir" in capsys.readouterr().err
    # a run read from its own record, at a rate, matches the table's choice (its only rate)
    (tmp_path / "hola" / "recall_kv.json").unlink()
    again = tmp_path / "again"
    gdn_only = [*argv[:3], "gdn", *argv[5:]]
    assert recall_probe.main([*gdn_only, "--lr", "1e-3", "--out", str(again)]) == 0
    recorded = json.loads((again / "recall_probe.json").read_text())["models"]["gdn"]
    assert recorded == report["models"]["gdn"]
    assert recall_probe.main([*gdn_only, "--lr", "3e-3", "--out", str(again)]) == 2
    assert "lr" in capsys.readouterr().err
