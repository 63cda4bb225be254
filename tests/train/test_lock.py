"""The workdir lock (nested_jax.train.lock): one holder, stale locks taken over by exactly one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from nested_jax.train.lock import LOCK_FILE, WorkdirBusy, acquire, holder_of, stale_notice


def test_second_acquire_is_refused_naming_the_holder(tmp_path):
    with acquire(tmp_path) as lock:
        assert holder_of(lock.path)["pid"] == os.getpid()
        with pytest.raises(WorkdirBusy, match=rf"pid {os.getpid()} on host {socket.gethostname()}"):
            acquire(tmp_path)  # another open file description: the flock conflicts
    assert not (tmp_path / LOCK_FILE).exists()
    acquire(tmp_path).release()  # free again once released


def test_stale_lock_is_taken_over_with_a_notice(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(dead.stdout)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    with acquire(tmp_path) as lock:
        assert lock.taken_over == {"pid": pid, "host": socket.gethostname()}
        assert f"pid {pid} on host" in stale_notice(lock) and "no longer running" in stale_notice(
            lock
        )
        assert holder_of(lock.path)["pid"] == os.getpid()


def test_concurrent_takeover_of_a_stale_lock_has_one_winner(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 999999999, "host": "gone"}))
    barrier, results = threading.Barrier(8), []

    def take():
        barrier.wait()
        try:
            results.append(acquire(tmp_path))
        except WorkdirBusy:
            results.append(None)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and len(results) == 8
    winners[0].release()


def test_release_removes_a_workdir_it_created_when_empty(tmp_path):
    new = tmp_path / "new" / "run"
    acquire(new).release()
    assert not new.exists()  # a refused or failed start leaves no empty workdir
    lock = acquire(new)
    (new / "config.json").write_text("{}")
    lock.release()
    assert sorted(p.name for p in new.iterdir()) == ["config.json"]


def test_remote_workdirs_are_not_locked():
    assert acquire("gs://bucket/runs/x") is None
    assert stale_notice(None) is None
