"""train_and_evaluate in-process: outputs, NaN policy, corrupt checkpoints, a failing writer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import numpy as np
import pytest
from train_helpers import tiny_overrides

from nested_jax.train.checkpoint import CORRUPT_DIR, Checkpointer, abstract_like
from nested_jax.train.config import load_config
from nested_jax.train.loop import TrainingError, init_train_setup, train_and_evaluate
from nested_jax.train.metrics import read_metrics

# One device compiles several times faster than the 8 fake ones; sharding is covered elsewhere
# (tests/parallel, and the 2-device subprocess resume test).
ONE = jax.devices()[:1]


def _config(corpus: Path, data_dir: Path, **extra):
    return load_config([], tiny_overrides(corpus, data_dir, **extra))


def _readable_steps(workdir: Path, cfg) -> int | None:
    """The newest step a fresh reader restores (without moving anything)."""
    from nested_jax.parallel.mesh import make_mesh

    setup = init_train_setup(cfg, make_mesh(cfg.mesh, ONE))
    ckpt = Checkpointer(workdir, read_only=True)
    out = ckpt.restore_latest(abstract_like(setup.state), None, quarantine=False)
    ckpt.manager.close()
    return None if out is None else out[0]


def _garble(step_dir: Path) -> None:
    rng = random.Random(0)
    files = sorted(
        p for p in (step_dir / "state").rglob("*") if p.is_file() and p.stat().st_size > 64
    )
    for p in files:
        data = bytearray(p.read_bytes())
        for i in range(len(data) // 3, len(data) // 3 + 32):
            data[i] = rng.randrange(256)
        p.write_bytes(bytes(data))


def test_skip_policy_outputs_resume_and_corrupt_latest(corpus, data_dir, tmp_path, capsys):
    workdir = tmp_path / "run"
    cfg = _config(corpus, data_dir, **{"train.debug_nan_at_steps": [2], "train.eval_every": 2})
    summary = train_and_evaluate(cfg, workdir, devices=ONE)
    out = capsys.readouterr().out
    assert "starting from scratch" in out and "update skipped" in out

    # Outputs: summary, metrics, TensorBoard events, config, checkpoints.
    saved = json.loads((workdir / "summary.json").read_text())
    for key in ("final_train_loss", "val_loss", "val_bits_per_byte", "tokens_per_s", "wall_time_s"):
        assert key in saved and key in summary
    assert saved["steps"] == 4 and saved["skipped_steps"] == 1
    assert saved["unigram_entropy_bits_per_byte"] > 3.0
    assert np.isfinite(saved["val_bits_per_byte"])
    train = read_metrics(workdir, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["skipped"] for r in train] == [0, 1, 0, 0]
    assert [r["step"] for r in read_metrics(workdir, "eval")] == [2, 4]
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((workdir / "config.json").read_text())["train"]["debug_nan_at_steps"] == [2]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4]

    # Corrupt the latest checkpoint: the next start says so, keeps the files, resumes from step 2.
    _garble(workdir / "checkpoints" / "4")
    cfg6 = _config(corpus, data_dir, **{"train.steps": 6, "train.debug_nan_at_steps": [2]})
    summary = train_and_evaluate(cfg6, workdir, devices=ONE)
    out = capsys.readouterr().out
    assert "checkpoint: step 4 in" in out and "is unreadable" in out
    assert "resuming from step 2" in out
    moved = list((workdir / CORRUPT_DIR).glob("step_4_*"))
    assert len(moved) == 1 and (moved[0] / "state").is_dir()
    assert summary["steps"] == 6 and summary["start_step"] == 2
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4, 6]

    # A different model in the same workdir is refused up front (its checkpoints cannot fit).
    other = _config(corpus, data_dir, **{"train.steps": 8, "model.d_model": 64})
    with pytest.raises(ValueError, match=r"with a changed model\.d_model \(32 -> 64\)"):
        train_and_evaluate(other, workdir, devices=ONE)
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2, 4, 6]


@pytest.mark.parametrize(
    "policy, nan_steps, message",
    [
        (
            "skip",
            [3, 4],
            r"2 consecutive non-finite steps .* exceed train\.max_consecutive_skips=1",
        ),
        ("stop", [3], r"non-finite loss/gradient at step 3 .* train\.nan_policy=stop"),
    ],
)
def test_nan_policy_stops_cleanly_and_keeps_last_checkpoint(
    corpus, data_dir, tmp_path, policy, nan_steps, message
):
    workdir = tmp_path / "run"
    cfg = _config(
        corpus,
        data_dir,
        **{
            "train.steps": 6,
            "train.nan_policy": policy,
            "train.debug_nan_at_steps": nan_steps,
            "train.max_consecutive_skips": 1,
        },
    )
    with pytest.raises(TrainingError, match=message):
        train_and_evaluate(cfg, workdir, devices=ONE)
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2]
    assert _readable_steps(workdir, cfg) == 2


def test_a_writer_that_raises_leaves_previous_checkpoint(corpus, data_dir, tmp_path, capsys):
    import grain._src.python.checkpoint.handler as grain_handler

    workdir = tmp_path / "run"
    cfg = _config(corpus, data_dir)
    original = grain_handler.CheckpointHandler.save

    def failing_save(self, directory, *args, **kwargs):
        if Path(str(directory)).parent.name.startswith("4."):  # <step>.orbax-checkpoint-tmp-*
            raise OSError("disk full (injected)")
        return original(self, directory, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(grain_handler.CheckpointHandler, "save", failing_save)
    try:
        with pytest.raises(Exception, match="disk full"):
            train_and_evaluate(cfg, workdir, devices=ONE)
    finally:
        mp.undo()
    assert [p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()] == ["2"]
    capsys.readouterr()
    summary = train_and_evaluate(cfg, workdir, devices=ONE)
    out = capsys.readouterr().out
    assert "resuming from step 2" in out
    assert summary["steps"] == 4


def test_sigterm_saves_a_checkpoint_and_stops_cleanly(corpus, data_dir, tmp_path, capsys):
    import os
    import signal

    from nested_jax.train.metrics import MetricsWriter

    workdir = tmp_path / "run"
    cfg = _config(corpus, data_dir, **{"train.steps": 6, "train.checkpoint_every": 5})
    original = MetricsWriter.write

    def write(self, step, kind, scalars):
        original(self, step, kind, scalars)
        if kind == "train" and step == 2:  # a scheduler's SIGTERM arrives during step 2
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    mp = pytest.MonkeyPatch()
    mp.setattr(MetricsWriter, "write", write)
    try:
        summary = train_and_evaluate(cfg, workdir, devices=ONE)
    finally:
        mp.undo()
    assert "preempted at step 2: checkpoint saved" in capsys.readouterr().out
    assert summary["preempted"] and summary["steps"] == 2
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [2]
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back
