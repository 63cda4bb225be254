"""train.loop.run_and_close: a failed final checkpoint save is an error unless the steps failed."""

from types import SimpleNamespace

import pytest

from nested_jax.train import loop


class _Closable:
    def __init__(self, error=None):
        self.closed, self.error = False, error

    def close(self):
        self.closed = True
        if self.error is not None:
            raise self.error


def _run(ckpt_error=None):
    return SimpleNamespace(progress=_Closable(), writer=_Closable(), ckpt=_Closable(ckpt_error))


def test_a_failed_last_save_after_good_steps_is_raised(monkeypatch):
    monkeypatch.setattr(loop, "run_steps", lambda run, state, start: ("state", "stats"))
    run = _run(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        loop.run_and_close(run, {}, 0)
    assert run.progress.closed and run.writer.closed


def test_a_failed_last_save_does_not_mask_the_steps_error(monkeypatch):
    def boom(run, state, start):
        raise RuntimeError("step failed")

    monkeypatch.setattr(loop, "run_steps", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        loop.run_and_close(_run(OSError("disk full")), {}, 0)


def test_good_steps_and_good_save_return_the_result(monkeypatch):
    monkeypatch.setattr(loop, "run_steps", lambda run, state, start: ("state", "stats"))
    run = _run()
    assert loop.run_and_close(run, {}, 0) == ("state", "stats")
    assert run.ckpt.closed
