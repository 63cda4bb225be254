"""`python -m nested_jax.experiments.compare_hope` (and its wrapper `scripts/compare_hope`): the
options, the two commands it builds, and the run/report logic with stand-in parts (no training)."""

import subprocess
import sys
from pathlib import Path

import pytest

from nested_jax.experiments import compare_hope

REPO = Path(__file__).resolve().parents[2]


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        compare_hope.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--steps", "--mqar-steps", "--eval-batches", "--mqar-eval", "--workdir"):
        assert flag in out
    assert "--parallel" in out and "env STEPS" in out and "--dry-run" in out


def test_commands_follow_the_environment_and_pass_extra_arguments_to_compare():
    env = {"STEPS": "200", "EVAL_BATCHES": "4", "MQAR_STEPS": "300", "MQAR_ARGS": "--d-model 48"}
    env |= {"WORKDIR": "w/c", "MQAR_OUT": "w/m", "NICE": "5", "PARALLEL": "1"}
    args, extra = compare_hope.build_parser(env).parse_known_args(["--set", "train.lr=1e-3"])
    assert args.parallel and extra == ["--set", "train.lr=1e-3"]
    cmp = compare_hope.compare_command(args, extra)
    assert cmp[:3] == ["nice", "-n", "5"] and cmp[4:7] == [
        "-u",
        "-m",
        "nested_jax.experiments.compare",
    ]
    assert cmp[cmp.index("--workdir") + 1] == "w/c"
    assert cmp[-6:] == ["--set", "train.steps=200", "--set", "eval.eval_batches=4"] + extra
    assert [c for c in cmp if c.endswith(".yaml")] == list(compare_hope.COMPARE_CONFIGS)
    mq = compare_hope.mqar_command(args)
    assert mq[6] == "nested_jax.experiments.mqar"
    assert mq[mq.index("--steps") + 1] == "300" and mq[mq.index("--eval-batches") + 1] == "8"
    assert mq[-4:] == ["--d-model", "48", "--out", "w/m"]
    # flags win over the environment; without either, the configs' own steps are used
    args, _ = compare_hope.build_parser(env).parse_known_args(["--steps", "7", "--nice", "0"])
    assert "train.steps=7" in compare_hope.compare_command(args) and args.nice == 0
    args, _ = compare_hope.build_parser({}).parse_known_args([])
    assert not any("train.steps" in c for c in compare_hope.compare_command(args))
    assert not args.parallel and args.nice == 10 and args.mqar_steps == 400


def test_dry_run_prints_both_commands_and_writes_nothing(tmp_path, capsys):
    work = tmp_path / "runs" / "c"
    argv = ["--dry-run", "--workdir", str(work), "--mqar-out", str(tmp_path / "m")]
    assert compare_hope.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "nested_jax.experiments.compare " in lines[0]
    assert lines[0].endswith(f"> {work}.log 2>&1") and "nested_jax.experiments.mqar" in lines[1]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("parallel", [False, True])
def test_runs_both_parts_logs_them_and_reports_the_last_failure(
    tmp_path, capsys, monkeypatch, parallel
):
    # Stand-in parts: compare writes its table and succeeds, MQAR writes no table and fails.
    def part(text, table, code):
        write = f"open({str(table)!r}, 'w').write('| table |\\n');" if table else ""
        return [sys.executable, "-c", f"{write}print({text!r}); raise SystemExit({code})"]

    work, mq = tmp_path / "a" / "cmp", tmp_path / "b" / "mq"
    work.mkdir(parents=True)
    monkeypatch.setattr(
        compare_hope, "compare_command", lambda a, e: part("C", work / "compare.md", 0)
    )
    monkeypatch.setattr(compare_hope, "mqar_command", lambda a: part("M", None, 3))
    argv = ["--workdir", str(work), "--mqar-out", str(mq)] + ["--parallel"] * parallel
    assert compare_hope.main(argv) == 3
    out = capsys.readouterr().out
    assert "(exit 3)" in out and "| table |" in out and f"missing {mq}/mqar.md" in out
    assert Path(f"{work}.log").read_text() == "C\n" and Path(f"{mq}.log").read_text() == "M\n"


def test_wrapper_script_execs_the_module_from_the_repository(tmp_path):
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("the wrapper runs .venv/bin/python")
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "compare_hope"), "--dry-run"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "STEPS": "9"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "train.steps=9" in res.stdout and "nested_jax.experiments.mqar" in res.stdout
