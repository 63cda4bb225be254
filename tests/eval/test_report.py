"""`nested-jax report`: synthetic eval reports side by side (tables, plots, files, error lines)."""

from __future__ import annotations

import contextlib
import io
import json
from statistics import mean

import pytest

from nested_jax import cli
from nested_jax.eval import report

PNG = b"\x89PNG\r\n\x1a\n"

FULL = {  # every suite; two RULER kinds, two BABILong tasks with different lengths
    "workdir": "/runs/tf",
    "step": 400,
    "model": "transformer",
    "suites": ["validation", "niah", "ruler", "babilong"],
    "validation": {
        "loss": 1.0,
        "perplexity": 2.7,
        "bits_per_byte": 1.2345,
        "tokens": 900,
        "bytes": 1000,
        "batches": 2,
    },
    "unigram_entropy_bits_per_byte": 4.5,
    "niah": {
        "accuracy": {"256": {"0": 1.0, "0.5": 0.5, "1": 0.25}, "512": {"0": 0.5, "1": 0.0}},
        "overall": 0.45,
        "num_examples": 10,
    },
    "ruler": {
        "haystack": "noise",
        "kinds": {
            "single": {
                "accuracy": {"256": {"0": 1.0}},
                "recall": {"256": {"0": 1.0}},
                "overall": 0.875,
                "overall_recall": 0.9375,
                "num_examples": 8,
            },
            "multikey": {
                "accuracy": {"256": {"0": 0.0}},
                "recall": {"256": {"0": 0.5}},
                "overall": 0.125,
                "overall_recall": 0.5,
                "num_examples": 4,
            },
        },
    },
    "babilong": {
        "by_task": {"qa1": {"256": 0.5, "512": 0.25}, "qa4": {"256": 1.0}},
        "chance": {"qa1": 1 / 6, "qa4": 1 / 2},
        "overall": 0.6,
        "num_examples": 6,
    },
    "plots": [],
}
GDN = {  # another RULER kind, NIAH at other lengths, BABILong without chance for one length
    "workdir": "/runs/gdn",
    "step": 800,
    "model": "gdn",
    "suites": ["niah", "ruler", "babilong"],
    "niah": {
        "accuracy": {"256": {"0": 0.75, "1": 0.25}, "1024": {"0": 0.0, "1": 0.5}},
        "overall": 0.375,
        "num_examples": 8,
    },
    "ruler": {
        "haystack": "text",
        "kinds": {
            "variable_tracking": {
                "accuracy": {"512": {"0": 0.5}},
                "recall": {"512": {"0": 0.75}},
                "overall": 0.5,
                "overall_recall": 0.75,
                "num_examples": 2,
            }
        },
    },
    "babilong": {
        "by_task": {"qa2": {"512": 0.3, "1024": 0.1}},
        "chance": {"qa2": 0.25},
        "overall": 0.2,
        "num_examples": 4,
    },
}
OLD = {  # before the RULER / BABILong suites: no "suites" key either
    "workdir": "/runs/old",
    "step": 50,
    "model": "hope",
    "validation": {
        "loss": 2.0,
        "perplexity": 7.4,
        "bits_per_byte": 2.5,
        "tokens": 90,
        "bytes": 100,
        "batches": 1,
    },
    "unigram_entropy_bits_per_byte": 4.5,
    "niah": {"accuracy": {"512": {"0": 1.0, "1": 0.75}}, "overall": 0.875, "num_examples": 4},
}


def _write(path, content):
    path.mkdir(parents=True, exist_ok=True)
    (path / "eval_report.json").write_text(json.dumps(content))
    return path


def _tables(md: str) -> list[list[list[str]]]:
    """Every Markdown table as rows of cells (the separator row dropped)."""
    tables, current = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                current.append([c.strip() for c in line.strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables


def _f(x):
    return "—" if x is None else f"{x:.3f}"


def _niah_by_length(r, n):
    row = r["niah"]["accuracy"].get(n)
    return None if row is None else mean(row.values())


def _babilong_by_length(r, n):
    vals = [row[n] for row in r["babilong"]["by_task"].values() if n in row]
    return mean(vals) if vals else None


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The three runs compared through `nested-jax report`: (run dirs, --out dir, stdout)."""
    root = tmp_path_factory.mktemp("report")
    runs = [_write(root / name, r) for name, r in (("tf", FULL), ("gdn", GDN), ("old", OLD))]
    out = root / "cmp"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["report", *map(str, runs), "--out", str(out)]) == 0
    return runs, out, printed.getvalue()


def test_report_tables_rows_columns_and_numbers(compared):
    _, out, printed = compared
    md = (out / "report.md").read_text()
    assert printed == md
    summary, counts, niah, bab = _tables(md)

    kinds = ["single", "multikey", "variable_tracking"]
    assert summary[0] == [
        "run",
        "model",
        "step",
        "val bits/byte",
        "NIAH",
        *(f"RULER {k}" for k in kinds),
        "BABILong",
    ]
    reports = {"tf": FULL, "gdn": GDN, "old": OLD}
    assert [row[0] for row in summary[1:]] == list(reports)
    for row, (name, r) in zip(summary[1:], reports.items(), strict=True):
        bits = r.get("validation", {}).get("bits_per_byte")
        ruler = r.get("ruler", {}).get("kinds", {})
        expected_ruler = [
            f"{_f(ruler[k]['overall'])} / {_f(ruler[k]['overall_recall'])}" if k in ruler else "—"
            for k in kinds
        ]
        overall = r.get("babilong", {}).get("overall")
        expected = [name, r["model"], str(r["step"]), _f(bits), _f(r["niah"]["overall"])]
        assert row == expected + expected_ruler + [_f(overall)]
    assert summary[3][5:] == ["—"] * 4  # the old report: no RULER, no BABILong

    assert counts[0] == ["run", "val bytes", "NIAH", *(f"RULER {k}" for k in kinds)] + [
        "RULER haystack",
        "BABILong",
    ]
    assert counts[1] == ["tf", "1000", "10", "8", "4", "—", "noise", "6"]
    assert counts[2] == ["gdn", "—", "8", "—", "—", "2", "text", "4"]
    assert counts[3] == ["old", "100", "4", "—", "—", "—", "—", "—"]

    lengths = ["256", "512", "1024"]
    assert niah[0] == ["run", *lengths]
    for row, (name, r) in zip(niah[1:], reports.items(), strict=True):
        assert row == [name, *(_f(_niah_by_length(r, n)) for n in lengths)]
    assert bab[0] == ["run", *lengths, "chance"]
    assert [row[0] for row in bab[1:]] == ["tf", "gdn"]  # the old report has no BABILong row
    for row, r in zip(bab[1:], (FULL, GDN), strict=True):
        chance = mean(r["babilong"]["chance"].values())
        assert row[1:] == [*(_f(_babilong_by_length(r, n)) for n in lengths), _f(chance)]
    assert bab[1][1:3] == ["0.750", "0.250"]  # (0.5 + 1.0) / 2 and qa1 alone at 512
    assert "![report_niah.png](report_niah.png)" in md


def test_report_writes_json_rows_and_png_plots(compared):
    runs, out, _ = compared
    data = json.loads((out / "report.json").read_text())
    rows = {row["name"]: row for row in data["runs"]}
    assert list(rows) == ["tf", "gdn", "old"]
    assert rows["tf"]["source"] == str(runs[0]) and rows["old"]["ruler"] is None
    assert rows["gdn"]["niah"]["by_length"]["1024"] == pytest.approx(0.25)
    assert rows["tf"]["babilong"]["chance"] == pytest.approx((1 / 6 + 1 / 2) / 2)
    files = sorted(p.rsplit("/", 1)[-1] for p in data["plots"])
    assert files == ["report_babilong.png", "report_niah.png", "report_ruler.png"]
    for file in files:
        assert (out / file).read_bytes()[:8] == PNG


def test_only_plots_with_data_are_drawn(tmp_path, capsys):
    run = _write(tmp_path / "old", OLD)
    out = tmp_path / "out"
    assert report.main([str(run / "eval_report.json"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "report_niah.png"]
    md = capsys.readouterr().out
    assert "| old | hope | 50 | 2.500 | 0.875 | — |" in md and "## BABILong" not in md


def test_bad_runs_are_one_line_naming_the_run(tmp_path, capsys):
    good = _write(tmp_path / "good", OLD)
    out = tmp_path / "out"
    missing = tmp_path / "missing"
    missing.mkdir()
    bad_json = tmp_path / "broken"
    bad_json.mkdir()
    (bad_json / "eval_report.json").write_text('{"model": "gdn", "step": ')
    stream = _write(tmp_path / "stream", {"workdir": "w", "step": 1, "model": "m", "segments": []})
    layout = _write(tmp_path / "layout", {**OLD, "niah": {"accuracy": {}, "num_examples": 0}})
    cases = {
        missing: f"error: run {missing}: no eval_report.json (run `nested-jax eval --workdir "
        f"{missing}` first)",
        tmp_path / "nope.json": f"error: run {tmp_path / 'nope.json'}: no such file",
        bad_json: f"error: run {bad_json}: eval_report.json is not valid JSON (line 1",
        stream: f"error: run {stream}: eval_report.json is not an eval report",
        layout: f"error: run {layout}: eval_report.json is not an eval report (niah: no 'overall')",
    }
    for run, line in cases.items():
        capsys.readouterr()
        assert report.main([str(good), str(run), "--out", str(out)]) == 1, run
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith(line), err
    assert not out.exists()  # nothing written for a failed comparison

    assert report.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "RUN" in err


def test_duplicate_basenames_get_unique_names(tmp_path, capsys):
    a, b = _write(tmp_path / "a" / "tf", FULL), _write(tmp_path / "b" / "tf", GDN)
    assert report.run_names([a, b, a, tmp_path / "a" / "tf" / "eval_report.json"]) == [
        "tf",
        "tf-2",
        "tf-3",
        "tf-4",
    ]  # the same workdir twice: the parents do not tell the four apart
    assert report.run_names([a, b]) == ["a/tf", "b/tf"]
    assert report.unique_names([("x", ""), ("x", ""), ("x-2", "p")]) == ["x", "x-2", "x-2-2"]
    assert report.main([str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    summary = _tables(capsys.readouterr().out)[0]
    assert [row[0] for row in summary[1:]] == ["a/tf", "b/tf"]
    with pytest.raises(ValueError, match="names: expected 2 distinct names"):
        report.comparison_markdown([FULL, GDN], ["x", "x"])


def test_suites_from_an_older_step_carry_that_step_in_every_table(tmp_path, capsys):
    settings = {"niah_lengths": [256, 512]}
    accumulated = {  # validation from step 200, NIAH and BABILong recomputed at 400
        **{k: v for k, v in FULL.items() if k != "ruler"},
        "suites": ["validation", "niah", "babilong"],
        "computed": {
            "validation": {"step": 200, "settings": {"eval_batches": 8}},
            "niah": {"step": 400, "settings": settings},
            "babilong": {"step": 200, "settings": None},
        },
    }
    run = _write(tmp_path / "tf", accumulated)
    assert report.main([str(run), str(_write(tmp_path / "old", OLD)), "--out", str(tmp_path)]) == 0
    md = capsys.readouterr().out
    summary, _, niah, bab = _tables(md)
    assert summary[1] == [
        "tf",
        "transformer",
        "400",
        "1.234 (step 200)",
        "0.450",
        "0.600 (step 200)",
    ]
    assert summary[2] == ["old", "hope", "50", "2.500", "0.875", "—"]  # no `computed`: its step
    assert niah[1][0] == "tf" and bab[1][0] == "tf (step 200)"
    rows = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert rows[0]["steps"] == {"validation": 200, "niah": 400, "babilong": 200}
    assert rows[1]["steps"] == {"validation": 50, "niah": 50}

    bad = _write(tmp_path / "bad", {**accumulated, "computed": {"niah": 3}})
    assert report.main([str(bad), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(
        f"error: run {bad}: eval_report.json is not an eval report (computed: expected"
    )


def test_cli_help_lists_report(capsys):
    assert cli.main(["--help"]) == 0
    assert "report" in capsys.readouterr().out
    assert cli.COMMANDS["report"][0] == "nested_jax.eval.report"
