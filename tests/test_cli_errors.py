"""`nested-jax` failures: one line on stderr, the traceback in errors.log, missing extras named."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from nested_jax import cli
from nested_jax.train import errorlog

ROOT = Path(__file__).resolve().parents[1]


def _broken(monkeypatch, err: Exception) -> None:
    def main(argv):
        raise err

    real = cli.importlib.import_module
    monkeypatch.setattr(
        cli.importlib,
        "import_module",
        lambda name: (
            types.SimpleNamespace(main=main) if name == "nested_jax.eval.report" else real(name)
        ),
    )


def test_uncaught_error_is_one_line_with_the_log_in_the_workdir(tmp_path, monkeypatch, capsys):
    _broken(monkeypatch, RuntimeError("boom\nsecond line"))
    assert cli.main(["report", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    log = tmp_path / "errors.log"
    assert err == f"error: boom (traceback in {log})\n"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: boom" in text
    cli.main(["report", f"--workdir={tmp_path}"])  # appended, each entry with a timestamp
    assert log.read_text().count("] nested-jax report (pid") == 2


def test_without_a_workdir_the_log_goes_to_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NESTED_JAX_DATA", str(tmp_path / "cache"))
    _broken(monkeypatch, ValueError("bad"))
    assert cli.main(["report", "--workdir", str(tmp_path / "missing")]) == 1
    log = tmp_path / "cache" / "errors.log"
    assert capsys.readouterr().err == f"error: bad (traceback in {log})\n"
    assert "ValueError: bad" in log.read_text()


def _run_without(module: str, *argv: str) -> subprocess.CompletedProcess:
    """`nested-jax ARGV` in a child where importing `module` fails as if it were not installed."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from nested_jax.cli import main\n"
        f"sys.exit(main({list(argv)!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize(
    "module,argv,extra",
    [
        ("lm_eval", ("lm-eval", "--help"), "hf"),
        ("etils", ("train", "--workdir", "x"), "train"),
    ],
)
def test_a_missing_extra_is_named_in_one_line(module, argv, extra):
    p = _run_without(module, *argv)
    line = f'nested-jax {argv[0]} needs the extra {extra!r}: pip install "nested-jax[{extra}]"'
    assert (p.returncode, p.stderr) == (1, line + "\n"), p.stderr


def test_the_extras_table_covers_pyproject():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    module_of = {"pyyaml": "yaml", "orbax-checkpoint": "orbax", "lm-eval": "lm_eval",
                 "array-record": "array_record", "tensorboardx": "tensorboardX"}  # fmt: skip
    for extra in ("train", "hf", "tpu", "docs"):
        for requirement in extras[extra]:
            name = requirement.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()
            module = module_of.get(name.lower(), name.replace("-", "_"))
            assert errorlog.EXTRA_OF_MODULE.get(module) == extra, (extra, requirement)


def test_background_noise_goes_to_the_log_and_teardown_noise_is_dropped(tmp_path, capsys):
    import logging
    import threading

    def fail(err):
        raise err

    with errorlog.BackgroundNoise(tmp_path) as noise:
        for err in (OSError(28, "No space left on device"), RuntimeError("Event loop is closed")):
            t = threading.Thread(target=fail, args=(err,))
            t.start()
            t.join()
        logging.getLogger("absl").error("save failed", exc_info=RuntimeError("real"))
    assert capsys.readouterr().err == ""
    text = (tmp_path / "errors.log").read_text()
    assert noise.written == 2 and "No space left on device" in text and "RuntimeError: real" in text
    assert "Event loop is closed" not in text
