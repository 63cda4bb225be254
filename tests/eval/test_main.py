"""`nested-jax train | eval | generate` end to end on a tiny workdir, and their error messages."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import defaults_preset, tiny_overrides, write_corpus  # noqa: E402

from nested_jax import cli  # noqa: E402


def _set_args(overrides: list[str]) -> list[str]:
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalmain")
    corpus = write_corpus(root / "corpus")
    workdir = root / "run"
    overrides = tiny_overrides(
        corpus,
        root / "data_cache",
        **{"eval.niah_lengths": [160], "eval.niah_depths": [0.0, 1.0], "eval.niah_per_cell": 2},
    )
    preset = ["--config", str(defaults_preset(root))]
    assert cli.main(["train", *preset, "--workdir", str(workdir), *_set_args(overrides)]) == 0
    return workdir


def test_eval_writes_json_and_markdown_reports(trained, capsys):
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(trained)]) == 0
    out = capsys.readouterr().out
    report = json.loads((trained / "eval_report.json").read_text())
    assert report["step"] == 4 and report["model"] == "transformer"
    v = report["validation"]
    assert v["bytes"] > 0 and 0 < v["bits_per_byte"] < 20
    assert v["perplexity"] == pytest.approx(2.718281828 ** v["loss"], rel=1e-6)
    niah = report["niah"]
    assert niah["num_examples"] == 4
    assert set(niah["accuracy"]) == {"160"} and set(niah["accuracy"]["160"]) == {"0", "1"}
    md = (trained / "eval_report.md").read_text()
    assert "| validation bits/byte |" in md and "| 160 |" in md and "depth 1" in md
    assert md.strip() in out  # the table is printed too


def test_generate_prints_prompt_and_continuation(trained, capsys):
    capsys.readouterr()
    argv = ["generate", "--workdir", str(trained), "--prompt", "The letter", "--max-new-tokens"]
    # Nearly untrained: sample (greedy may pick the document separator, which decodes to "").
    sample = ["12", "--temperature", "1.0", "--seed", "3"]
    assert cli.main(argv + sample) == 0
    out = capsys.readouterr().out.rstrip("\n")
    assert out.startswith("The letter") and len(out) > len("The letter")
    assert cli.main(argv + sample) == 0  # same seed, same text
    assert capsys.readouterr().out.rstrip("\n") == out


def test_train_rejects_a_bad_config_with_one_line(tmp_path, capsys):
    preset = ["--config", str(defaults_preset(tmp_path))]
    code = cli.main(
        ["train", *preset, "--workdir", str(tmp_path / "w"), "--set", "train.steps=abc"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == "config error: train.steps: expected int, got str 'abc'"
    assert not (tmp_path / "w").exists()  # nothing written half-way


def test_eval_on_a_directory_without_a_run_fails_clearly(tmp_path, capsys):
    assert cli.main(["eval", "--workdir", str(tmp_path)]) == 2
    assert "holds no run" in capsys.readouterr().err


def test_eval_stream_then_generate_continues_the_saved_state(trained, tmp_path, capsys):
    capsys.readouterr()
    first, second = tmp_path / "s1", tmp_path / "s2"
    argv = ["eval", "--workdir", str(trained), "--stream", "val", "--max-tokens", "150"]
    assert cli.main(argv + ["--chunk", "64", "--segments", "3", "--state-out", str(first)]) == 0
    report = json.loads((trained / "stream_report.json").read_text())
    assert report["start_pos"] == 0 and report["end_pos"] == 150
    assert [r["tokens"] for r in report["segments"]] == [[0, 50], [50, 100], [100, 150]]
    assert all(0 < r["loss"] < 20 for r in report["segments"])
    assert "memories only" in capsys.readouterr().out

    gen = ["generate", "--workdir", str(trained), "--prompt", "The", "--max-new-tokens", "5"]
    assert (
        cli.main(gen + ["--temperature", "0", "--state-in", str(first), "--state-out", str(second)])
        == 0
    )
    meta = json.loads((second / "stream.json").read_text())
    assert meta["pos"] == 150 + 3 + 5  # stream + prompt bytes + sampled tokens

    # The stream continues from the generated state; a missing state is one clear line.
    assert cli.main(argv[:5] + ["--max-tokens", "20", "--state-in", str(second)]) == 0
    assert json.loads((trained / "stream_report.json").read_text())["start_pos"] == 158
    capsys.readouterr()
    assert cli.main(argv + ["--state-in", str(tmp_path / "nope")]) == 1
    assert "no stream state" in capsys.readouterr().err


def test_generate_chains_continue_with_the_default_capacity(trained, tmp_path, capsys):
    from nested_jax.eval.continual import HEADROOM

    first, second = tmp_path / "g1", tmp_path / "g2"
    gen = ["generate", "--workdir", str(trained), "--prompt", "The", "--temperature", "0"]
    gen += ["--max-new-tokens", "40"]
    assert cli.main(gen + ["--state-out", str(first)]) == 0
    meta = json.loads((first / "stream.json").read_text())
    assert meta["capacity"] == meta["pos"] + HEADROOM  # room for the next call
    assert cli.main(gen + ["--state-in", str(first), "--state-out", str(second)]) == 0
    pos = json.loads((second / "stream.json").read_text())["pos"]
    assert pos == meta["pos"] + 3 + 40
    stream = ["eval", "--workdir", str(trained), "--stream", "val", "--max-tokens", "30"]
    assert cli.main(stream + ["--state-in", str(second)]) == 0
    report = json.loads((trained / "stream_report.json").read_text())
    assert (report["start_pos"], report["end_pos"]) == (pos, pos + 30)
    capsys.readouterr()
    assert cli.main(gen + ["--state-in", str(second), "--capacity", "100"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --capacity: 100 positions, but this call reads up to position {pos + 43}; "
        f"raise --capacity to at least {pos + 43}"
    )


def test_reports_are_written_and_printed_by_process_zero_only(tmp_path, monkeypatch, capsys):
    import jax

    from nested_jax.eval.main import write_report

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    write_report(tmp_path, "eval_report", {"loss": float("nan")}, "# report\n")
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    write_report(tmp_path, "eval_report", {"loss": float("nan")}, "# report\n")
    assert json.loads((tmp_path / "eval_report.json").read_text()) == {"loss": None}
    assert capsys.readouterr().out == "# report\n"


def test_eval_suites_ruler_and_babilong_write_sections_and_plots(trained, capsys):
    sizes = [
        "eval.ruler_kinds=[single, variable_tracking]",
        "eval.ruler_lengths=[600]",
        "eval.ruler_per_cell=1",
        "eval.ruler_haystack=noise",
        "eval.babilong_tasks=[qa1, qa4]",
        "eval.babilong_lengths=[400, 512]",
        "eval.babilong_per_length=2",
    ]
    # The default eval (validation, niah) first, in this test: xdist may run this module's other
    # tests on another worker, and the default suites must survive the next call.
    assert cli.main(["eval", "--workdir", str(trained)]) == 0
    capsys.readouterr()
    argv = ["eval", "--workdir", str(trained), "--suite", "ruler,babilong,niah"]
    assert cli.main(argv + _set_args(sizes)) == 0
    report = json.loads((trained / "eval_report.json").read_text())
    # The default eval's validation is kept, with the step and settings it was computed at.
    assert report["suites"] == ["validation", "niah", "ruler", "babilong"]
    assert report["validation"]["bytes"] > 0 and report["computed"]["validation"]["step"] == 4
    assert report["computed"]["validation"]["settings"] == {
        "eval_batches": 1,
        "seq_len": 32,
        "batch_size": 8,
    }
    assert report["computed"]["ruler"] == {
        "step": 4,
        "settings": {
            "ruler_kinds": ["single", "variable_tracking"],
            "ruler_lengths": [600],
            "niah_depths": [0.0, 1.0],
            "ruler_per_cell": 1,
            "ruler_haystack": "noise",
            "niah_seed": 0,
        },
    }
    ruler = report["ruler"]
    assert ruler["haystack"] == "noise" and list(ruler["kinds"]) == ["single", "variable_tracking"]
    for r in ruler["kinds"].values():
        assert r["num_examples"] == 2 and set(r["accuracy"]) == {"600"}
        assert set(r["accuracy"]["600"]) == {"0", "1"} and 0.0 <= r["overall_recall"] <= 1.0
        assert 0.0 <= r["overall_token_recall"] <= 1.0
    bab = report["babilong"]
    assert bab["num_examples"] == 8 and set(bab["by_task"]) == {"qa1", "qa4"}
    assert set(bab["by_task"]["qa1"]) == {"400", "512"} and bab["chance"]["qa1"] == 1 / 6
    names = sorted(Path(p).name for p in report["plots"])
    assert names == ["eval_babilong.png", "eval_niah.png", "eval_ruler.png"]
    for name in names:
        assert (trained / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (trained / "eval_report.md").read_text()
    assert "## RULER-style retrieval (noise haystack" in md and "### variable_tracking" in md
    assert "## BABILong-style" in md and "| qa4 |" in md and "| validation bits/byte |" in md
    assert "| ruler | 4 | ruler_kinds=[single,variable_tracking], ruler_lengths=[600]" in md
    captured = capsys.readouterr()
    assert md.strip() in captured.out
    # Progress on stderr: what runs (compiling), then examples done of the suite's total.
    assert (
        "[eval ruler] 0/4 compiling…" in captured.err and "[eval ruler] 4/4 (100%)" in captured.err
    )
    assert "[eval babilong] 8/8 (100%)" in captured.err

    assert cli.main(["eval", "--workdir", str(trained), "--suite", "niah", "--replace"]) == 0
    report = json.loads((trained / "eval_report.json").read_text())
    assert report["suites"] == ["niah"] and list(report["computed"]) == ["niah"]
    assert "validation" not in report and "ruler" not in report
    assert [Path(p).name for p in report["plots"]] == ["eval_niah.png"]


NIAH = {"accuracy": {"160": {"0": 1.0, "1": 0.5}}, "overall": 0.75, "num_examples": 4}


def test_an_older_report_keeps_its_suites_marked_with_their_step():
    from nested_jax.eval.main import merge_reports, report_markdown

    old = {  # written before suites carried their step; perplexity was inf (null in strict JSON)
        "workdir": "w",
        "step": 2,
        "model": "transformer",
        "suites": ["validation", "niah"],
        "validation": {"loss": 1.0, "perplexity": None, "bits_per_byte": 2.0, "tokens": 9},
        "unigram_entropy_bits_per_byte": 4.0,
        "niah": {**NIAH, "overall": 0.5},
        "plots": ["w/eval_niah.png", "w/eval_ruler.png"],
    }
    old["validation"]["bytes"] = 10
    settings = {"niah_lengths": [160], "niah_depths": [0.0, 1.0]}
    new = {
        "workdir": "w",
        "step": 6,
        "model": "transformer",
        "suites": ["niah"],
        "computed": {"niah": {"step": 6, "settings": settings}},
        "niah": NIAH,
        "plots": ["w/eval_niah.png"],
    }
    merged = merge_reports(old, new)
    assert merged["step"] == 6 and merged["suites"] == ["validation", "niah"]
    assert merged["computed"] == {
        "validation": {"step": 2, "settings": None},
        "niah": {"step": 6, "settings": settings},
    }
    assert merged["niah"] == NIAH and merged["validation"] == old["validation"]
    assert merged["unigram_entropy_bits_per_byte"] == 4.0
    assert merged["plots"] == ["w/eval_niah.png"]  # the old NIAH plot was redrawn, no RULER kept
    md = report_markdown(merged)
    assert "| validation | **2** (older than 6) | — |" in md
    assert "| niah | 6 | niah_lengths=[160], niah_depths=[0.0,1.0] |" in md
    assert "> computed at step 2, not at this checkpoint's step 6" in md
    assert "| validation perplexity | nan |" in md and "overall 0.750 over 4" in md
    assert md.count("not at this checkpoint") == 1  # NIAH is current

    assert merge_reports({**old, "model": "gdn"}, new) is new  # another model: nothing kept
    assert merge_reports(None, new) is new


def test_eval_suite_errors_are_one_line(trained, capsys):
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(trained), "--suite", "niah,babel"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --suite: expected names from")
    bad_kind = ["--suite", "ruler", "--set", "eval.ruler_kinds=[single, haystacks]"]
    assert cli.main(["eval", "--workdir", str(trained), *bad_kind]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("error: eval.ruler_kinds: expected names")
    )
    bad_hay = ["--suite", "ruler", "--set", "eval.ruler_haystack=sand"]
    assert cli.main(["eval", "--workdir", str(trained), *bad_hay]) == 2
    assert "eval.ruler_haystack: expected 'text' or 'noise'" in capsys.readouterr().err
