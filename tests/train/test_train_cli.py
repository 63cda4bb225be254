"""`nested-jax train` command line: exit codes and one-line errors that leave nothing behind."""

from __future__ import annotations

import pytest
from train_helpers import defaults_preset, tiny_overrides

from nested_jax.train import main as train_main
from nested_jax.train.signals import EXIT_CONFIG, EXIT_ERROR


def _argv(tmp_path, workdir, corpus, data_dir, **extra):
    argv = ["--config", str(defaults_preset(tmp_path)), "--workdir", str(workdir)]
    for o in tiny_overrides(corpus, data_dir, **extra):
        argv += ["--set", o]
    return argv


def test_a_missing_corpus_is_a_data_error_and_creates_no_workdir(tmp_path, data_dir, capsys):
    workdir = tmp_path / "run"
    code = train_main.main(_argv(tmp_path, workdir, tmp_path / "no_such_corpus", data_dir))
    err = capsys.readouterr().err.strip()
    assert code == EXIT_ERROR and err.startswith("data error: ") and "\n" not in err
    assert not workdir.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"mesh.data": 3}, "config error: mesh.data: 3 does not divide"),
        ({"mesh.data": 2, "data.batch_size": 3}, "config error: data.batch_size: 3 is not"),
        ({"model.vocab_size": 100}, "config error: model.vocab_size: 100 is smaller"),
    ],
)
def test_mesh_and_vocabulary_errors_are_config_errors(
    tmp_path, corpus, data_dir, capsys, extra, message
):
    workdir = tmp_path / "run"
    code = train_main.main(_argv(tmp_path, workdir, corpus, data_dir, **extra))
    err = capsys.readouterr().err.strip()
    assert code == EXIT_CONFIG and err.startswith(message), err
    assert not workdir.exists()


def test_a_new_workdir_without_config_is_refused(tmp_path, capsys):
    code = train_main.main(["--workdir", str(tmp_path / "typo"), "--set", "train.steps=5"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_CONFIG
    assert err.endswith(
        "does not exist: give --config FILE to start a new run there (or check the path)"
    )
    assert not (tmp_path / "typo").exists()
