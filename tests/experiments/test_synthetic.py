"""Generated-task comparison (nested_jax.experiments.synthetic): end to end on a formal task and a
MAD task, settings validation, aggregation over seeds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nested_jax.experiments import synthetic, synthetic_data, synthetic_report
from nested_jax.experiments.synthetic_data import SyntheticSettings

TINY = ["--d-model", "16", "--n-layers", "1", "--batch-size", "4", "--eval-batches", "2"]
TINY += ["--steps", "2", "--warmup-steps", "1"]
RUN_KEYS = {"model", "seed", "d_model", "params", "steps", "final_train_loss", "accuracy"}
RUN_KEYS |= {"scores", "val", "lr", "weight_decay", "train_seconds", "tokens_per_s"}


def test_formal_task_end_to_end_writes_json_md_png(tmp_path, capsys):
    out = tmp_path / "synth"
    argv = ["--task", "formal:dyck1", "--models", "transformer", *TINY]
    argv += ["--train-lengths", "2", "6", "--eval-multipliers", "1", "2", "--out", str(out)]
    assert synthetic.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "formal_dyck1.json").read_text())
    md = (out / "formal_dyck1.md").read_text()
    png = (out / "formal_dyck1.png").read_bytes()
    assert md in printed and png.startswith(b"\x89PNG")
    assert "| 1× (2–6) | 2× (7–12) |" in md and "| transformer | 16 |" in md
    assert result["task"] == "formal:dyck1" and result["seeds"] == [0]
    assert result["chance"] == pytest.approx(0.5)
    (run,) = result["runs"]
    assert set(run) == RUN_KEYS and run["model"] == "transformer" and run["steps"] == 2
    assert list(run["scores"]) == ["1", "2"]
    for key, (lo, hi) in {"1": (2, 6), "2": (7, 12)}.items():
        sc = run["scores"][key]
        assert (sc["min_len"], sc["max_len"], sc["seq_len"]) == (lo, hi, int(key) * 8)
        assert 0.0 <= sc["accuracy"] <= 1.0 and sc["eval_loss"] > 0
        assert sc["eval_queries"] == 2 * 4  # one answer per string, 2 batches of 4
    assert run["accuracy"] == run["scores"]["1"]["accuracy"]
    (row,) = result["rows"]
    assert row["model"] == "transformer" and row["seeds"] == [0]
    assert row["scores"]["2"]["accuracy"]["mean"] == run["scores"]["2"]["accuracy"]
    # a re-run with the same settings reuses the finished model: identical rows, nothing trained
    assert synthetic.main(argv) == 0
    assert "reusing" in capsys.readouterr().out
    assert json.loads((out / "formal_dyck1.json").read_text())["runs"] == result["runs"]


def test_mad_task_end_to_end(tmp_path):
    s = SyntheticSettings(
        task="mad:in_context_recall", steps=2, batch_size=4, d_model=16, n_layers=1,
        warmup_steps=1, eval_batches=2, mad_sizes=(("seq_len", 16),),
    )  # fmt: skip
    assert (s.vocab, s.seq_len, s.chance) == (16, 15, pytest.approx(1 / 8))
    res = synthetic.run_synthetic(["gdn"], s, seeds=(3,), out=tmp_path)
    (run,) = res["runs"]
    assert set(run) == RUN_KEYS and run["seed"] == 3
    sc = run["scores"]["heldout"]
    assert 0.0 <= sc["accuracy"] <= 1.0 and sc["eval_queries"] > 0 and sc["seq_len"] == 15
    assert "| gdn | 16 |" in res["markdown"] and "× chance" in res["markdown"]
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"mad_in_context_recall.{ext}").is_file()


def test_bad_task_names_exit_with_one_line_naming_the_argument(capsys):
    for task in ("parity", "formal:palindromes", "mad:nope", "regular:parity"):
        assert synthetic.main(["--task", task, "--models", "gdn"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: task:") and "\n" not in err and repr(task) in err
    with pytest.raises(ValueError, match="^task:"):
        SyntheticSettings(task="formal")


def test_settings_name_the_bad_argument(capsys):
    bad = {
        "train_lengths": dict(task="formal:modular_counting", train_lengths=(1, 8)),
        "eval_multipliers": dict(eval_multipliers=(1, 1)),
        "mad_sizes": dict(task="formal:parity", mad_sizes=(("seq_len", 8),)),
        "d_model": dict(d_model=15, n_heads=2),
    }
    for field, kwargs in bad.items():
        with pytest.raises(ValueError, match=f"^{field}:"):
            SyntheticSettings(**kwargs)
    with pytest.raises(ValueError, match="^mad_sizes:"):
        SyntheticSettings(task="mad:selective_copying", mad_sizes=(("no_such_size", 3),))
    argv = ["--task", "mad:compression", "--models", "gdn", "--train-lengths", "1", "4"]
    assert synthetic.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: train_lengths:")
    assert synthetic.main(["--task", "mad:compression", "--models", "gdn", "--mad-sizes", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: mad_sizes:")
    assert synthetic.main(["--task", "formal:parity", "--models", "no_such_model"]) == 2
    assert capsys.readouterr().err.startswith("error: models:")


def test_length_bins_and_held_out_batches():
    s = SyntheticSettings(task="formal:parity", train_lengths=(1, 16), eval_batches=2)
    assert [s.eval_lengths(m) for m in (1, 2, 4, 8)] == [(1, 16), (17, 32), (33, 64), (65, 128)]
    sets = synthetic_data.eval_sets(s)
    assert [k for k, _, _ in sets] == ["1", "2", "4", "8"]
    for _, info, batches in sets:
        for b in batches:
            n = b["loss_mask"].argmax(-1) - 1  # string lengths
            assert b["inputs"].shape == (32, info["seq_len"])
            assert n.min() >= info["min_len"] and n.max() <= info["max_len"]
    # held-out batches come from seed + 10_000, training batches from the seed
    train = synthetic_data.train_batch(s, np.random.default_rng(s.seed))
    assert not np.array_equal(train["inputs"], sets[0][2][0]["inputs"])


def test_aggregate_over_seeds():
    def run(seed, acc):
        sc = {"1": {"multiplier": 1, "min_len": 1, "max_len": 4, "accuracy": acc, "eval_loss": 1.0}}
        return {"model": "m", "seed": seed, "d_model": 8, "params": 10, "scores": sc,
                "final_train_loss": 2.0, "train_seconds": 1.0}  # fmt: skip

    (row,) = synthetic_report.aggregate([run(0, 0.5), run(1, 0.7)])
    acc = row["scores"]["1"]["accuracy"]
    assert row["seeds"] == [0, 1] and row["scores"]["1"]["max_len"] == 4
    assert acc["mean"] == pytest.approx(0.6) and acc["std"] == pytest.approx(
        np.std([0.5, 0.7], ddof=1)
    )
    assert (acc["min"], acc["max"]) == (0.5, 0.7)
    s = SyntheticSettings(train_lengths=(1, 4), eval_multipliers=(1,))
    md = synthetic_report.markdown_table([row], s, [0, 1])
    assert "| m | 8 | 10 | 1.000 | 0.600 ± 0.141 |" in md and "seeds 0, 1" in md
    assert synthetic_report._cell_se(acc) == "0.600 ± 0.100"  # std / √2: the recall tables'


PROTO = ["--task", "protocol:parity", "--bins", "2", "6", "7", "10", "--train-size", "40"]
PROTO += ["--test-size", "12", "--val-size", "8", *TINY]


def test_protocol_task_end_to_end_with_lr_sweep_and_resume(tmp_path, capsys):
    out = tmp_path / "proto"
    argv = [*PROTO, "--models", "lstm", "--lrs", "1e-3", "3e-3", "--seeds", "0", "1"]
    assert synthetic.main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "protocol_parity.json").read_text())
    assert (out / "protocol_parity.png").read_bytes().startswith(b"\x89PNG")
    sweep = result["lr_sweep"]["lstm"]
    assert sweep["chosen"] in (1e-3, 3e-3) and set(sweep["val"]) == {"0.001", "0.003"}
    runs = result["runs"]
    assert [r["seed"] for r in runs] == [0, 1] and {r["lr"] for r in runs} == {sweep["chosen"]}
    for r in runs:
        assert set(r) == RUN_KEYS and list(r["scores"]) == ["bin0", "bin1"]
        assert r["scores"]["bin0"]["eval_queries"] == 12  # strings, not positions
        assert r["val"]["eval_queries"] == 8
        assert r["scores"]["bin1"]["min_len"] >= 7 and r["scores"]["bin1"]["max_len"] <= 10
    md = (out / "protocol_parity.md").read_text()
    assert "| model | lr | d_model | params | Bin0 | Bin1 |" in md and "(best " in md
    assert md in printed
    # deterministic under seeds: a fresh directory gives the same scores; the same one reuses
    assert synthetic.main([*argv, "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "protocol_parity.json").read_text())
    assert [r["scores"] for r in again["runs"]] == [r["scores"] for r in runs]
    capsys.readouterr()
    assert synthetic.main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("reusing") == 4 and ": d_model" not in printed
    assert json.loads((out / "protocol_parity.json").read_text())["runs"] == runs
    # runs saved before a settings field existed are still reused (they ran under its default)
    for saved in (out / "models").rglob("lstm-*.json"):
        record = json.loads(saved.read_text())
        for name in synthetic.FIELDS_ADDED:
            del record["key"]["settings"][name]
        saved.write_text(json.dumps(record))
    assert synthetic.main([*argv, "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("reusing") == 4


def test_protocol_checks_along_the_way_end_at_the_final_scores(tmp_path, capsys):
    argv = [*PROTO, "--models", "lstm", "--steps", "5", "--score-every", "2", "--seeds", "0", "1"]
    assert synthetic.main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "protocol_parity.json").read_text())
    for run in result["runs"]:
        assert [c["step"] for c in run["curve"]] == [2, 4, 5]
        last = run["curve"][-1]  # the last check scores the final weights: the same numbers
        assert last["scores"] == {k: v["accuracy"] for k, v in run["scores"].items()}
        assert last["val"] == run["val"]["accuracy"]
        best = synthetic_report.best_checks(run)
        assert all(best[k] == max(c["scores"][k] for c in run["curve"]) for k in best)
    row = result["rows"][0]
    assert row["best_checks"]["bin1"]["values"] == [
        synthetic_report.best_checks(r)["bin1"] for r in result["runs"]
    ]
    assert (tmp_path / "protocol_parity_curve.png").read_bytes().startswith(b"\x89PNG")
    printed = capsys.readouterr().out
    assert printed.count("[lstm] check: bin0") == 6 and "best check Bin0 / Bin1" in printed
    with pytest.raises(ValueError, match="^score_every"):
        SyntheticSettings(task="protocol:parity", score_every=-1)


def test_same_key_accepts_an_older_key_only_at_the_new_fields_defaults():
    from nested_jax.experiments._cache import same_key

    new = {"settings": {"lr": 0.1, "depth_bins": 5, "recall_sizes": []}, "d_model": 8}
    old = {"settings": {"lr": 0.1}, "d_model": 8}
    added = synthetic.FIELDS_ADDED
    assert same_key(new, new) and not same_key(old, new) and same_key(old, new, added)
    assert not same_key(old, {**new, "d_model": 9}, added)
    assert not same_key(old, {**new, "settings": {**new["settings"], "depth_bins": 7}}, added)
    assert not same_key({"settings": {"lr": 0.2}, "d_model": 8}, new, added)
    assert not same_key(None, new, added)


def test_protocol_splits_are_fixed_and_disjoint():
    s = SyntheticSettings(task="protocol:parity", train_size=300, test_size=200, val_size=100)
    data = synthetic_data.protocol_data(s)
    assert s.protocol_bins == ((2, 50), (51, 100)) and s.seq_len == 51
    assert not set(data["val"]) & set(data["bin0"])
    assert not set(data["train"]) & (set(data["bin0"]) | set(data["val"]))
    assert all(51 <= len(x) <= 100 for x in data["bin1"])
    b = synthetic_data.train_batch(s, np.random.default_rng(0))
    assert b["inputs"].shape == (32, 51) and b["loss_mask"].sum() > 32
    with pytest.raises(ValueError, match="^bins:"):
        SyntheticSettings(task="protocol:parity", bins=((2, 3), (4, 2)))
    with pytest.raises(ValueError, match="^bins:"):
        SyntheticSettings(task="formal:parity", bins=((2, 3), (4, 5)))


def test_per_model_overrides_are_strict_and_apply_to_one_model(capsys):
    base = ["--task", "formal:parity", "--models", "transformer", "gdn", *TINY]
    assert synthetic.main([*base, "--set-model", "gdn:model.gdn.nope=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.gdn") and err.count("\n") == 1
    assert synthetic.main([*base, "--set-model", "gdn.conv_size=2"]) == 2
    assert capsys.readouterr().err.startswith("error: set_model:")
    assert synthetic.main([*base, "--set-model", "hope:model.conv_size=2"]) == 2
    assert capsys.readouterr().err.startswith("error: model_overrides:")
    s = SyntheticSettings(model_overrides=(("gdn", "model.conv_size=2"),))
    from nested_jax.experiments._training import model_config

    assert model_config("gdn", s, 16).conv_size == 2
    assert model_config("transformer", s, 16).conv_size != 2
