"""Nested Learning's small-model tables (nested_jax.experiments.paper_tables): model variants, MAD's
fixed data sets and its learning-rate × weight-decay grid, and both tables end to end at a tiny
preset (resumable, the paper's numbers beside ours)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nested_jax.experiments import paper_tables, synthetic, synthetic_data
from nested_jax.experiments._training import model_config, parse_model
from nested_jax.experiments.paper_tables import TableScale
from nested_jax.experiments.synthetic_data import SyntheticSettings

TINY = {"batch_size": 4, "d_model": 16, "n_layers": 1, "n_heads": 2, "note": "tiny"}
TINY_FORMAL = TableScale(
    steps=2, lrs=(1e-3,), seeds=(0, 1), **TINY,
    settings=(("bins", ((2, 6), (7, 10))), ("train_size", 40), ("test_size", 12),
              ("val_size", 8), ("warmup_steps", 1), ("score_every", 1)),
)  # fmt: skip
TINY_MAD = TableScale(
    epochs=2, max_steps=3, lrs=(1e-3,), wds=(0.0, 0.1), seeds=(0,), **TINY,
    mad_sizes=(("seq_len", 16), ("num_train_examples", 12), ("num_test_examples", 8)),
    settings=(("val_size", 8),),
)  # fmt: skip


def test_variant_labels_name_a_second_entry_of_one_mixer():
    assert parse_model("hope@token") == ("hope", 1)
    assert parse_model("gdn+proteus4@wide") == ("gdn", 4)
    for bad in ("hope@", "hope@to-ken"):
        with pytest.raises(ValueError, match="^models:"):
            parse_model(bad)
    s = paper_tables.FORMAL_SCALES["cpu"].synthetic("protocol:parity", ["hope", "hope@token"])
    token, default = model_config("hope@token", s, 16), model_config("hope", s, 16)
    assert token.name == default.name == "hope"
    assert (token.hope.chunk_memory, token.hope.chunk_other) == (1, 1)
    assert token.hope.chunk_updates == "scan"
    assert (default.hope.chunk_memory, default.hope.chunk_other) != (1, 1)


def test_mad_settings_follow_the_task_configs():
    assert paper_tables.mad_settings("memorization", False) == [
        {"vocab_size": 256, "seq_len": 32, "num_train_examples": 256}
    ]
    settings = paper_tables.mad_settings("compression", True)
    assert len(settings) == 1 + 3 + 3 + 4
    base = paper_tables.MAD_BASELINES["compression"]
    labels = [paper_tables._label(x, base) for x in settings]
    assert labels[0] == "baseline" and "num_train_examples=800" in labels
    assert len(set(labels)) == len(labels)
    assert set(paper_tables.MAD_BASELINES) == set(paper_tables.MAD_TASKS)
    for task in paper_tables.MAD_TASKS:  # every setting is a valid MAD configuration
        for sizes in paper_tables.mad_settings(task, True):
            SyntheticSettings(task=f"mad:{task}", mad_sizes=tuple(sizes.items()))


def test_mad_fixed_data_set_is_shared_by_models_and_seeds():
    sizes = (("seq_len", 16), ("num_train_examples", 20), ("num_test_examples", 12))
    s = SyntheticSettings(task="mad:in_context_recall", mad_sizes=sizes, batch_size=5, val_size=6)
    assert s.mad_dataset == (20, 12) and "num_train_examples" not in s.sizes
    data = synthetic_data.mad_data(s)
    assert [len(data[k]["inputs"]) for k in ("train", "val", "test")] == [20, 6, 12]
    pool = {tuple(r) for r in data["train"]["inputs"]}
    for seed in (0, 1):
        b = synthetic_data.train_batch(s, np.random.default_rng(seed))
        assert b["inputs"].shape == (5, 15) and {tuple(r) for r in b["inputs"]} <= pool
    ((key, info, batches),) = synthetic_data.eval_sets(s)
    assert (
        key == "heldout"
        and info["examples"] == 12
        and [len(x["inputs"]) for x in batches]
        == [
            5,
            5,
            2,
        ]
    )
    other = SyntheticSettings(task="mad:in_context_recall", mad_sizes=sizes, seed=7, val_size=6)
    np.testing.assert_array_equal(
        synthetic_data.mad_data(other)["test"]["inputs"], data["test"]["inputs"]
    )
    with pytest.raises(ValueError, match="^mad_sizes: num_test_examples needs"):
        SyntheticSettings(task="mad:in_context_recall", mad_sizes=(("num_test_examples", 4),))
    with pytest.raises(ValueError, match="^mad_sizes: num_train_examples"):
        SyntheticSettings(task="mad:in_context_recall", mad_sizes=(("num_train_examples", 0),))


def test_mad_sizes_flag_takes_floats_and_the_grid_flag():
    assert synthetic._task_sizes("mad_sizes", ["frac_noise=0.4", "seq_len=64"]) == (
        ("frac_noise", 0.4),
        ("seq_len", 64),
    )
    with pytest.raises(ValueError, match="^mad_sizes:"):
        synthetic._task_sizes("mad_sizes", ["seq_len=x"])
    args = synthetic.build_parser().parse_args(
        ["--task", "mad:compression", "--models", "gdn", "--lrs", "1e-3", "--wds", "0", "0.1"]
    )
    assert args.wds == [0.0, 0.1]


def test_formal_table_end_to_end_resumes_and_prints_the_paper(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(paper_tables.FORMAL_SCALES, "tiny", TINY_FORMAL)
    argv = ["formal", "--scale", "tiny", "--out", str(tmp_path), "--tasks", "parity"]
    argv += ["--models", "lstm", "transformer"]
    assert paper_tables.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "formal.json").read_text())
    assert (tmp_path / "formal.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "formal" / "parity" / "protocol_parity.json").is_file()
    assert result["seeds"] == [0, 1] and list(result["rows"]) == ["lstm", "transformer"]
    cell = result["rows"]["transformer"]["parity"]
    assert len(cell["bin1"]["values"]) == 2 and 0 <= cell["bin1"]["mean"] <= 100
    md = (tmp_path / "formal.md").read_text()
    assert md in printed and "| parity Bin0 | parity Bin1 |" in md
    assert "[46.4]" in md and "[100]" in md  # the paper's Transformer and LSTM
    # checked after every step: each bin's best check, never below the end of training
    for b in ("bin0", "bin1"):
        best, end = cell[f"{b}_best"]["values"], cell[b]["values"]
        assert all(x >= y for x, y in zip(best, end, strict=True))
    assert md.count("| parity Bin0 | parity Bin1 |") == 2 and "best epoch per bin" in md
    assert paper_tables.main(argv) == 0
    # per model: the sweep's run (seed 0), then seeds 0 and 1, all found on disk
    assert capsys.readouterr().out.count("reusing") == 2 * 3
    assert json.loads((tmp_path / "formal.json").read_text())["rows"] == result["rows"]


def test_finished_only_summarises_what_is_saved_and_trains_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(paper_tables.FORMAL_SCALES, "tiny", TINY_FORMAL)
    argv = ["formal", "--scale", "tiny", "--out", str(tmp_path), "--tasks", "parity"]
    both = [*argv, "--models", "lstm", "transformer", "--finished-only"]
    assert paper_tables.main(both) == 0
    assert not list(tmp_path.rglob("*-seed*.json"))  # nothing was trained
    task_md = tmp_path / "formal" / "parity" / "protocol_parity.md"
    assert "Not finished (no sweep or no seed saved yet): lstm, transformer." in task_md.read_text()
    assert paper_tables.main([*argv, "--models", "lstm", "--seeds", "0"]) == 0
    capsys.readouterr()
    assert paper_tables.main(both) == 0
    assert "lstm seed 0 lr 0.001: reusing" in capsys.readouterr().out
    md = (tmp_path / "formal.md").read_text()
    assert "(1 of 2 seeds)" in md and "| transformer | – [46.4] | – [0] |" in md
    assert "| lstm (seed 0) |" in task_md.read_text() and "transformer." in task_md.read_text()
    assert len(list(tmp_path.rglob("*-seed*.json"))) == 1  # still only lstm's seed 0
    with pytest.raises(ValueError, match="^finished_only"):
        synthetic.run_synthetic(
            ["lstm"], SyntheticSettings(task="protocol:parity"), finished_only=True
        )


def test_mad_score_counts_a_seed_once_it_has_every_setting():
    run = lambda seed, acc: {"model": "gdn", "seed": seed, "accuracy": acc}  # noqa: E731
    results = {
        "memorization": {"a": {"runs": [run(0, 0.5), run(1, 0.9)]}, "b": {"runs": [run(0, 0.7)]}}
    }
    cell = paper_tables.mad_rows(results)["gdn"]["memorization"]
    assert cell["settings"] == 2 and cell["score"]["values"] == [pytest.approx(0.6)]
    assert (
        paper_tables.mad_markdown(paper_tables.mad_rows(results), ["memorization"], 3).count(
            "(1 of 3 seeds)"
        )
        == 1
    )


def test_formal_presets_score_the_bins_after_every_epoch():
    for scale in paper_tables.FORMAL_SCALES.values():
        s = scale.synthetic("protocol:parity", ["lstm"], steps=scale.steps)
        assert s.score_every == math.ceil(s.train_size / s.batch_size)


def test_mad_table_end_to_end_with_the_grid(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(paper_tables.MAD_SCALES, "tiny", TINY_MAD)
    out = tmp_path / "mad"
    res = paper_tables.run_table("mad", "tiny", out, models=["gdn"], tasks=["memorization"])
    setting = out / "mad" / "memorization" / "baseline"
    result = json.loads((setting / "mad_memorization.json").read_text())
    sweep = result["lr_sweep"]["gdn"]
    assert set(sweep["val"]) == {"0.001/wd0", "0.001/wd0.1"} and sweep["chosen_wd"] in (0.0, 0.1)
    assert result["runs"][0]["steps"] == 3  # ceil(2 epochs × 12 instances / batch 4) = 6, cap 3
    cell = res["rows"]["gdn"]["memorization"]
    assert cell["settings"] == 1 and cell["score"]["mean"] == pytest.approx(
        100 * result["runs"][0]["accuracy"]
    )
    assert "| gdn |" in res["markdown"] and (out / "mad.png").is_file()
    with pytest.raises(ValueError, match="^tasks:"):
        paper_tables.run_table("mad", "tiny", out, tasks=["parity"])
    with pytest.raises(ValueError, match="^scale:"):
        paper_tables.run_table("formal", "huge", out)


def test_a_finished_run_keeps_weights_that_score_as_it_did(tmp_path):
    from nested_jax.experiments import _training
    from nested_jax.experiments.synthetic_data import eval_sets

    s = SyntheticSettings(
        task="protocol:parity", steps=3, batch_size=4, d_model=16, n_layers=1, warmup_steps=1,
        bins=((2, 6), (7, 10)), train_size=40, test_size=12, val_size=8, lr=3e-3,
    )  # fmt: skip
    res = synthetic.run_synthetic(["transformer"], s, seeds=(0,), out=tmp_path)
    (saved,) = (tmp_path / "models" / "protocol_parity").glob("*.params.npz")
    graphdef, state_def, rest, _, state, _ = _training.build_training("transformer", s, 16)
    params = _training.load_params(saved, state["params"])
    score = _training.make_scorer(_training.Trained(graphdef, state_def, rest, params))
    (_, _, batches), _ = eval_sets(s)
    run = res["runs"][0]
    assert score(batches, synthetic._accuracy_fn(s)[0], True) == {
        k: pytest.approx(run["scores"]["bin0"][k])
        for k in ("accuracy", "eval_loss", "eval_queries")
    }
    wrong = _training.build_training("transformer", s, 24)[4]["params"]
    with pytest.raises(ValueError, match="^path:"):
        _training.load_params(saved, wrong)


def test_probe_reloads_a_table_run_and_counts_every_prefix(tmp_path, monkeypatch, capsys):
    from nested_jax.experiments import formal_probe

    monkeypatch.setitem(paper_tables.FORMAL_SCALES, "tiny", TINY_FORMAL)
    paper_tables.run_table("formal", "tiny", tmp_path, models=["lstm"], tasks=["parity"])
    folder = tmp_path / "formal" / "parity"
    report = formal_probe.probe(folder, ["lstm"], 1, tmp_path / "probe")
    x = report["models"]["lstm"]
    assert x["prefix_length"] == list(range(1, 11)) and x["train_max"] == 6
    # 12 test strings per bin: every one has prefixes 1 and 2; only Bin1 strings reach 7..10
    assert x["strings"][0] == 24 and x["strings"][-1] <= 12 and x["strings"][6] == 12
    assert all(0.0 <= a <= 1.0 for a in x["accuracy"])
    assert all(1 <= p <= 10 for p in x["first_errors"])
    assert (tmp_path / "probe" / "probe_parity.png").is_file()
    hidden = formal_probe.probe(folder, ["lstm"], 1, tmp_path / "probe", hidden=True)
    y = hidden["models"]["lstm"]["hidden"]
    assert y["bands"] and y["bands"][0][0] == 1 and y["bands"][-1][1] == 10
    for key in ("model", "probe_bin0", "probe_band"):
        assert len(y[key]) == len(y["bands"]) and all(0.0 <= a <= 1.0 for a in y[key])
    assert all(b[0] == a[1] + 1 for a, b in zip(y["bands"][:-1], y["bands"][1:], strict=True))
    assert formal_probe.main(["--dir", str(folder), "--models", "gdn", "--out", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: models: 'gdn' is not in the table")
    assert formal_probe.main(["--dir", str(folder), "--models", "lstm", "--seed", "5"]
                             + ["--out", "x"]) == 2  # fmt: skip
    assert capsys.readouterr().err.startswith("error: dir: no weights for lstm seed 5")


def test_linear_readout_reads_what_is_there_and_nothing_else():
    from nested_jax.experiments.formal_probe import _bands, linear_readout

    rng = np.random.default_rng(0)
    h = rng.normal(size=(600, 8))
    y = np.where(h[:, 2] - 0.5 * h[:, 5] > 0, 3, 4)  # a linear function of the features
    read = linear_readout(h[:300], y[:300])
    assert np.mean(read(h[300:]) == y[300:]) > 0.9
    noise = rng.integers(0, 2, size=600)  # labels the features do not hold
    read = linear_readout(h[:300], noise[:300])
    assert abs(np.mean(read(h[300:]) == noise[300:]) - 0.5) < 0.1
    assert _bands(100, 10)[-1] == (91, 100) and len(_bands(100, 10)) == 10
    assert _bands(103, 10)[-1] == (91, 103)  # a short remainder joins the last band
    assert _bands(107, 10)[-1] == (101, 107)
