"""`nested-jax train --workdir W` (no --config) says which config the run uses only once the resume
is accepted: a refused resume prints the refusal alone."""

from __future__ import annotations

import pytest
from train_helpers import defaults_preset, tiny_overrides

from nested_jax.train import loop
from nested_jax.train import main as train_main
from nested_jax.train.config import Config, save_config
from nested_jax.train.signals import EXIT_CONFIG, EXIT_OK
from nested_jax.train.workdir import ResumeRefused


def test_a_refused_resume_prints_no_config_line(tmp_path, monkeypatch, capsys):
    save_config(Config(), tmp_path)

    def refuse(config, workdir, **kwargs):
        raise ResumeRefused(f"cannot resume {workdir} with a changed train.seed (0 -> 3)")

    monkeypatch.setattr(loop, "train_and_evaluate", refuse)
    code = train_main.main(["--workdir", str(tmp_path), "--set", "train.seed=3"])
    out, err = capsys.readouterr()
    assert code == EXIT_CONFIG and err.startswith("config error: cannot resume")
    assert "config" not in out


@pytest.mark.slow  # two short training runs: about 30 s on 2 CPU cores
def test_the_config_line_follows_an_accepted_resume(tmp_path, corpus, data_dir, capsys):
    work = tmp_path / "run"
    argv = ["--config", str(defaults_preset(tmp_path)), "--workdir", str(work)]
    for o in tiny_overrides(corpus, data_dir, **{"train.steps": 2}):
        argv += ["--set", o]
    assert train_main.main(argv) == EXIT_OK
    capsys.readouterr()

    code = train_main.main(["--workdir", str(work), "--set", "train.seed=3"])
    out, err = capsys.readouterr()
    assert code == EXIT_CONFIG and err.startswith(f"config error: cannot resume {work}")
    assert "config" not in out

    assert train_main.main(["--workdir", str(work), "--set", "train.steps=3"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    uses = lines.index(f"this run uses the config saved in {work / 'config.json'}")
    assert lines[uses - 1].startswith("resuming from step 2 ")
