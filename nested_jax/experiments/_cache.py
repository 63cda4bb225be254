"""Finished runs on disk, shared by the drivers that fill a table a piece at a time.

A run's row is saved as ``{"key", "row"}`` JSON, ``key`` being the settings it was made with; a
later call with the same settings reuses it (:func:`cached_row`), so a stopped table resumes
after its last finished run. Two processes filling pieces of one table (the background queues
the tables are meant for) may reach the same run: a run is trained under its own lock file
(``<run>.lock``, :func:`nested_jax.train.lock.take`), and the process that finds it held waits,
then reuses the row the other one saved, instead of training the same run twice over one
progress file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from nested_jax.files import write_json
from nested_jax.train.lock import WorkdirLock, describe, holder_of, take


def same_key(saved: dict, key: dict, added: dict | None = None) -> bool:
    """Whether a run saved under ``saved`` was made with the settings ``key`` describes.

    ``added``: settings fields introduced after runs were saved, with their default values. A
    saved key without such a field matches when ``key["settings"]`` holds its default, because
    the run was made before the field existed, i.e. under that default. Without this a new field
    would silently invalidate every finished run of a table (hours of CPU).
    """
    key = json.loads(json.dumps(key))
    if not isinstance(saved, dict) or saved == key:
        return saved == key
    old_settings = saved.get("settings")
    if not added or not isinstance(old_settings, dict) or "settings" not in key:
        return False
    settings = dict(key["settings"])
    for name, default in json.loads(json.dumps(added)).items():
        if name not in old_settings and settings.get(name) == default:
            del settings[name]
    return saved == {**key, "settings": settings}


def saved_row(
    path: Path | None, key: dict, added: dict | None = None, label: str | None = None
) -> dict | None:
    """The row saved at ``path`` under the settings ``key`` (:func:`same_key`), or None; with
    ``label``, a found row is announced in one line (``== <label>: reusing <path>``)."""
    if path is None or not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if not same_key(saved.get("key"), key, added):
        return None
    if label is not None:
        print(f"== {label}: reusing {path}", flush=True)
    return saved["row"]


def _hold(path: Path, label: str, poll_s: float) -> WorkdirLock:
    """The lock file ``path``, waiting (one line printed) while another process holds it."""
    lock = take(path)
    if lock is None:
        print(
            f"== {label}: another process ({describe(holder_of(path))}) is training this run; "
            f"waiting for it",
            flush=True,
        )
        while (lock := take(path)) is None:
            time.sleep(poll_s)
    return lock


def cached_row(
    path: Path | None,
    key: dict,
    compute: Callable[[], dict],
    label: str,
    added: dict | None = None,
    poll_s: float = 30.0,
) -> dict:
    """``compute()``, or the row saved at ``path`` by an earlier call with the same ``key``
    (:func:`same_key`, with ``added`` the settings fields newer than some saved runs).

    A computed row is saved as ``{"key", "row"}`` JSON at ``path`` (nothing when ``path`` is None),
    so a re-run with the same settings resumes after its last finished model. ``compute`` runs
    holding ``path``'s lock (``.lock`` beside it); a process that finds the lock held waits,
    checking every ``poll_s`` seconds, and reuses the row once the holder has saved it.
    """
    if path is None:
        return compute()
    row = saved_row(path, key, added, label)
    if row is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _hold(path.with_suffix(".lock"), label, poll_s):
            row = saved_row(path, key, added, label)  # the holder we waited for may have saved it
            if row is None:
                row = compute()
                write_json(path, {"key": key, "row": row})
    return row
