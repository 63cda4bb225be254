"""A stopped training run continues from its saved progress exactly (nested_jax.experiments
._training.Progress): the same parameters, losses and batch sequence as an unbroken run."""

from __future__ import annotations

import numpy as np
import pytest

from nested_jax.experiments import _training
from nested_jax.experiments.synthetic_data import SyntheticSettings, train_batch

SETTINGS = SyntheticSettings(
    task="protocol:parity", steps=6, batch_size=4, d_model=16, n_layers=1, warmup_steps=1,
    train_size=64, test_size=16, val_size=8, bins=((2, 8), (9, 12)),
)  # fmt: skip


class Stop(Exception):
    pass


def _batches(stop_after: int | None = None):
    drawn = []

    def next_batch(rng):
        if stop_after is not None and len(drawn) == stop_after:
            raise Stop  # the process dies here
        drawn.append(1)
        return train_batch(SETTINGS, rng)

    return next_batch


def _fit(progress=None, stop_after=None, checks=None):
    return _training.fit("gdn", SETTINGS, 16, _batches(stop_after), 0, progress, checks)


def _leaves(trained):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(trained.params)]


def test_a_stopped_run_resumes_to_the_same_weights_and_losses(tmp_path, capsys):
    unbroken, stats = _fit()
    progress = _training.Progress(tmp_path / "run.progress.npz", {"run": 1}, every_s=0.0)
    with pytest.raises(Stop):
        _fit(progress, stop_after=4)
    assert progress.path.is_file()
    assert _training.load_meta(progress.path)["done"] == 4
    resumed, resumed_stats = _fit(progress)
    assert "resuming at step 4/6" in capsys.readouterr().out
    for a, b in zip(_leaves(unbroken), _leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed_stats["final_train_loss"] == pytest.approx(stats["final_train_loss"], rel=1e-6)
    assert resumed_stats["train_seconds"] > 0 and np.isfinite(resumed_stats["tokens_per_s"])
    assert not progress.path.exists()  # a finished run leaves no progress behind


def test_progress_of_other_settings_or_unreadable_starts_over(tmp_path, capsys):
    unbroken, _ = _fit()
    path = tmp_path / "run.progress.npz"
    with pytest.raises(Stop):
        _fit(_training.Progress(path, {"run": 1}, every_s=0.0), stop_after=3)
    other, _ = _fit(_training.Progress(path, {"run": 2}))
    assert "is for other settings: starting over" in capsys.readouterr().out
    path.write_bytes(b"not an npz")
    broken, _ = _fit(_training.Progress(path, {"run": 1}))
    assert "unreadable" in capsys.readouterr().out
    for run in (other, broken):
        for a, b in zip(_leaves(unbroken), _leaves(run), strict=True):
            np.testing.assert_array_equal(a, b)


def test_progress_saved_before_a_field_existed_resumes_at_its_default(tmp_path, capsys):
    old = {"settings": {"lr": 0.1}}
    new = {"settings": {"lr": 0.1, "score_every": 0}}
    path = tmp_path / "run.progress.npz"
    with pytest.raises(Stop):
        _fit(_training.Progress(path, old, every_s=0.0), stop_after=3)
    _fit(_training.Progress(path, new, added={"score_every": 0}))
    assert "resuming at step 3/6" in capsys.readouterr().out
    with pytest.raises(Stop):
        _fit(_training.Progress(path, old, every_s=0.0), stop_after=3)
    _fit(
        _training.Progress(
            path, {"settings": {"lr": 0.1, "score_every": 2}}, added={"score_every": 0}
        )
    )
    assert "is for other settings: starting over" in capsys.readouterr().out


def _square_norm(trained) -> dict:
    import jax

    return {"norm": float(sum(np.sum(np.square(x)) for x in jax.tree.leaves(trained.params)))}


def test_checks_along_the_way_survive_a_stop(tmp_path):
    checks = _training.Checks(4, _square_norm)  # after steps 4 and 6 (the last)
    unbroken, stats = _fit(checks=checks)
    assert [c["step"] for c in stats["curve"]] == [4, 6]
    assert stats["curve"][-1] == {"step": 6, **_square_norm(unbroken)}
    progress = _training.Progress(tmp_path / "run.progress.npz", {"run": 1}, every_s=0.0)
    with pytest.raises(Stop):
        _fit(progress, stop_after=5, checks=checks)  # dies after the check at step 4
    assert [c["step"] for c in _training.load_meta(progress.path)["curve"]] == [4]
    _, resumed = _fit(progress, checks=checks)
    assert resumed["curve"] == stats["curve"]
