"""One training run per workdir: ``<workdir>/train.lock``, held while ``train`` writes there.

The lock is an ``fcntl.flock`` on the file, which holds ``{"pid", "host", "started"}`` of the
holder. The kernel drops a flock when its holder dies (even by SIGKILL), so a lock file left by a
killed run is stale the moment that run is gone: the next run takes it without guessing from pids,
and of two runs taking it over at once exactly one gets the flock. Releasing deletes the file while
still holding the flock; a run that opened the old file before the delete sees that the path no
longer names the file it locked and tries again, so two runs never hold "the" lock through two
different files.

Local paths only: object stores (``gs://``) have no lock that a killed VM releases, and orbax does
not lock a checkpoint directory either, so a remote workdir is not locked (:func:`acquire` returns
None for it); running one run per remote workdir is up to the launcher. ``eval`` and ``generate``
only read a workdir and never take the lock.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from nested_jax.train.config import ConfigError

LOCK_FILE = "train.lock"


class WorkdirBusy(ConfigError):
    """Another live run holds the workdir's lock; ``str`` is one line naming it (pid, host)."""


def holder_of(path: str | os.PathLike) -> dict:
    """The ``{"pid", "host", "started"}`` record of a lock file ({} when unreadable or empty)."""
    try:
        record = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def describe(record: dict) -> str:
    """``pid N on host H, started T`` of a lock record."""
    pid, host = record.get("pid", "?"), record.get("host", "?")
    started = f", started {record['started']}" if record.get("started") else ""
    return f"pid {pid} on host {host}{started}"


class WorkdirLock:
    """The held lock of one workdir: :meth:`release` (or leaving the ``with`` block) frees it.

    Attributes:
      path: the lock file.
      taken_over: the record of a stale lock this run replaced (None: the file was free or new).
    """

    def __init__(self, path: Path, fd: int, taken_over: dict | None, created_dir: Path | None):
        self.path = path
        self.taken_over = taken_over
        self._fd: int | None = fd
        self._created_dir = created_dir  # removed again when it is left empty

    def release(self) -> None:
        """Deletes the lock file (still holding the flock, so no newcomer locks a dead file)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
        if self._created_dir is not None:
            try:  # a run refused before writing anything leaves no empty workdir behind
                self._created_dir.rmdir()
            except OSError:
                pass

    def __enter__(self) -> WorkdirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _try_lock(path: Path) -> tuple[int, dict] | None:
    """``(fd, previous record)`` once this process holds the flock of the file now at `path`;
    None when another open file description holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            return fd, holder_of(path)
        os.close(fd)  # the holder released (deleted) the file between our open and flock: retry


def acquire(workdir: str | os.PathLike) -> WorkdirLock | None:
    """Takes `workdir`'s training lock before anything is written there (creating `workdir`).

    Returns:
      the held :class:`WorkdirLock`, or None for a remote (URL) workdir, which is not locked.
    Raises:
      WorkdirBusy: a live run holds the lock (one line naming its pid and host).
    """
    text = os.fspath(workdir)
    if "://" in text:
        return None
    directory = Path(text)
    created = None if directory.exists() else directory
    if created is not None:
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    lock = take(path, created)
    if lock is None:
        raise WorkdirBusy(
            f"{directory} is in use by another training run ({describe(holder_of(path))}): wait "
            f"for it to finish or stop it; two runs in one workdir would mix their checkpoints "
            f"(lock file {path})"
        )
    return lock


def take(path: Path, created_dir: Path | None = None) -> WorkdirLock | None:
    """The flock of the lock file ``path`` (any local file, e.g. one run of a table's), holding
    this process's ``{"pid", "host", "started"}``; None while another live process holds it.
    ``created_dir``: a directory made for this lock, removed on release when left empty."""
    got = _try_lock(path)
    if got is None:
        return None
    fd, previous = got
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    return WorkdirLock(path, fd, previous or None, created_dir)


def stale_notice(lock: WorkdirLock | None) -> str | None:
    """The notice line for a lock taken over from a run that is gone (None: nothing to say)."""
    if lock is None or not lock.taken_over:
        return None
    record = lock.taken_over
    gone = "no longer running"
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        gone = "no longer running" if not _pid_alive(record["pid"]) else "no longer holding it"
    return f"notice: took over the stale lock {lock.path} ({describe(record)}, {gone})"
