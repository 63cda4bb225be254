"""The claims registry (nested_jax.experiments.claims): completeness, the list and dry-run output,
every invocation's argv against its driver's own parser (nothing is trained), config overrides
that load, and one-line errors for an unknown claim or scale."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nested_jax.experiments import claims, proteus_table
from nested_jax.train.config import load_config

REPO = Path(__file__).resolve().parents[2]
NAMES = ["hope_formal", "hola_niah", "titans_babilong", "proteus_sweep", "cms_forgetting"]
ALL = [(c.name, s, i) for c in claims.CLAIMS.values() for s in claims.SCALES for i in c.scales[s]]


def test_registry_has_the_five_claims_at_both_scales():
    assert list(claims.CLAIMS) == NAMES
    for c in claims.CLAIMS.values():
        assert set(c.scales) == {"cpu", "gpu"}
        assert all(len(c.scales[s]) >= 1 for s in claims.SCALES)
        assert c.paper and "arXiv" in c.paper and c.claim.endswith(".")
        assert c.scales["cpu"] != c.scales["gpu"], c.name


def test_a_claim_without_both_scales_is_refused():
    inv = claims.Invocation("nested_jax.experiments.forgetting", ("--out", "{out}"))
    with pytest.raises(ValueError, match=r"^scales: claim 'x' needs invocations for exactly"):
        claims.Claim("x", "p", "c.", {"cpu": (inv,)}, "t")
    with pytest.raises(ValueError, match=r"^target: .*'nested_jax.eval.main'"):
        claims.Invocation("nested_jax.eval.main", ())


def test_cli_modules_match_the_nested_jax_command_table():
    from nested_jax.cli import COMMANDS

    for sub, module in claims.CLI_MODULES.items():
        assert COMMANDS[sub][0] == module


@pytest.mark.parametrize(
    ("name", "scale", "inv"), ALL, ids=[f"{n}-{s}-{k}" for k, (n, s, _) in enumerate(ALL)]
)
def test_every_argv_parses_with_its_drivers_parser(name, scale, inv, tmp_path):
    argv = list(inv.resolved(tmp_path / name))
    assert not any("{out}" in a for a in argv)
    args = inv.parser().parse_args(argv)  # argparse exits (SystemExit) on an unknown flag
    # the overrides name real config fields and the configs load with them
    configs = getattr(args, "configs", None) or getattr(args, "config", None)
    overrides = getattr(args, "overrides", None) or []
    if configs:
        paths = [REPO / p for p in configs]
        if inv.target.endswith("proteus_table"):
            proteus_table.load_configs(paths, overrides)
        else:
            for p in paths:
                load_config([p], overrides)
    if inv.target == "eval":
        from nested_jax.data.tokenizers import ByteTokenizer
        from nested_jax.eval import babilong
        from nested_jax.eval.suites import parse_suites

        parse_suites(args.suite)
        e = load_config([REPO / "configs/experiments/tiny_titans_lmm.yaml"], overrides).eval
        hay = "Emma walked home. " * 50
        for task in e.babilong_tasks:  # every length holds the story, question and answer
            babilong.babilong_grid(task, hay, ByteTokenizer(), list(e.babilong_lengths), 1, 0)


def test_a_bad_argv_fails_the_parser_check():
    inv = claims.Invocation("nested_jax.experiments.compare", ("--workdir", "w", "--steps", "3"))
    with pytest.raises(SystemExit):
        inv.parser().parse_args(list(inv.resolved("o")))


def test_display_and_subprocess_argv():
    inv = claims.Invocation("eval", ("--workdir", "{out}/a", "--set", "eval.x=[1, 2]"))
    assert inv.display("runs/c") == "nested-jax eval --workdir runs/c/a --set 'eval.x=[1, 2]'"
    assert inv.subprocess_argv("runs/c")[:4] == [sys.executable, "-m", "nested_jax.cli", "eval"]
    mod = claims.Invocation("nested_jax.experiments.forgetting", ("--out", "{out}"))
    assert mod.display("d") == "python -m nested_jax.experiments.forgetting --out d"
    assert mod.subprocess_argv("d") == [sys.executable, "-m", mod.target, "--out", "d"]


def test_list_prints_every_claim_with_both_scales(capsys):
    assert claims.main(["list"]) == 0
    out = capsys.readouterr().out
    for c in claims.CLAIMS.values():
        assert f"## {c.name}" in out and c.claim in out
        for scale in claims.SCALES:
            for inv in c.scales[scale]:
                assert inv.display(f"runs/claims/{c.name}") in out
    assert out.count("\ncpu:\n") == 5 and out.count("\ngpu:\n") == 5


@pytest.mark.parametrize("scale", claims.SCALES)
def test_dry_run_prints_the_commands_and_runs_nothing(scale, capsys, tmp_path):
    out = tmp_path / "h"
    argv = ["run", "titans_babilong", "--scale", scale, "--out", str(out), "--dry-run"]
    assert claims.main(argv) == 0
    assert claims.main(["run", "hola_niah", "--scale", scale, "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = claims.CLAIMS["hola_niah"].scales[scale]
    assert lines[-len(expected) :] == [f"$ {i.display(out)}" for i in expected]
    assert not out.exists()


def test_run_calls_each_invocation_in_order_and_stops_at_a_failure():
    calls, printed = [], []
    todo = claims.invocations("titans_babilong", "cpu")

    def runner(argv):
        calls.append(argv)
        return 3 if len(calls) == 2 else 0

    rc = claims.run_claim("titans_babilong", "cpu", "o", runner=runner, echo=printed.append)
    assert rc == 3 and calls == [i.subprocess_argv("o") for i in todo[:2]]
    assert printed[: len(todo)] == [f"$ {i.display('o')}" for i in todo]
    calls.clear()
    ok = claims.run_claim("cms_forgetting", "gpu", "o", runner=lambda a: calls.append(a) or 0)
    assert ok == 0 and calls == [
        claims.CLAIMS["cms_forgetting"].scales["gpu"][0].subprocess_argv("o")
    ]


def test_unknown_claim_or_scale_is_one_line_naming_it(capsys):
    with pytest.raises(ValueError, match=r"^name: unknown claim 'nope'; known: hope_formal") as e:
        claims.invocations("nope", "cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^scale: unknown scale 'tpu'; expected one of cpu, gpu$"):
        claims.invocations("hola_niah", "tpu")
    for argv, bad in (
        (["run", "nope", "--out", "o"], "'nope'"),
        (["run", "hola_niah", "--scale", "tpu", "--out", "o"], "'tpu'"),
    ):
        with pytest.raises(SystemExit) as ex:
            claims.main(argv)
        assert ex.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "error:" in err and "invalid choice" in err and bad in err
