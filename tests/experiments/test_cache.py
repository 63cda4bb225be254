"""Finished runs on disk (nested_jax.experiments._cache): a run another process is training is
waited for and reused, never trained twice."""

from __future__ import annotations

import threading
import time

from nested_jax.experiments._cache import cached_row, saved_row
from nested_jax.files import write_json
from nested_jax.train.lock import take


def test_a_run_another_process_trains_is_waited_for_and_reused(tmp_path, capsys):
    path = tmp_path / "gdn-seed0-lr0.003.json"
    held = take(path.with_suffix(".lock"))  # "another process" is training this run
    calls, got = [], []

    def compute() -> dict:
        calls.append(1)
        return {"accuracy": 0.5}

    waiter = threading.Thread(
        target=lambda: got.append(cached_row(path, {"k": 1}, compute, "gdn seed 0", poll_s=0.01))
    )
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not calls  # waiting, not training
    write_json(path, {"key": {"k": 1}, "row": {"accuracy": 1.0}})  # the holder saves its row
    held.release()
    waiter.join(10)
    assert got == [{"accuracy": 1.0}] and not calls
    printed = capsys.readouterr().out
    assert "gdn seed 0: another process (pid " in printed and "waiting for it" in printed
    assert "gdn seed 0: reusing" in printed


def test_a_free_run_is_computed_saved_and_its_lock_removed(tmp_path):
    path = tmp_path / "m.json"
    assert cached_row(path, {"k": 1}, lambda: {"a": 2}, "m") == {"a": 2}
    assert saved_row(path, {"k": 1}) == {"a": 2} and saved_row(path, {"k": 2}) is None
    assert not path.with_suffix(".lock").exists()
    assert cached_row(path, {"k": 1}, lambda: {"a": 3}, "m") == {"a": 2}  # reused
    assert cached_row(None, {"k": 1}, lambda: {"a": 4}, "m") == {"a": 4}  # nowhere to save
