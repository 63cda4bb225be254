"""Failures in one line on stderr, their tracebacks in a log file (standard library only).

A command that fails prints one line (``error: <text> (traceback in <path>)``) and appends the full
traceback, with a UTC timestamp, to ``<workdir>/errors.log`` (the workdir of a ``--workdir`` that
exists locally) or else to ``errors.log`` in the cache folder (``$NESTED_JAX_DATA``, else
``~/.cache/nested_jax``, as the data cache). A missing optional package is named with the extra
that installs it. This module imports nothing beyond the standard library, so it can report that
the packages of the ``train`` extra themselves are missing.

:class:`BackgroundNoise` keeps what background threads report (orbax's async save threads, their
asyncio loops) off the terminal while a run trains: their tracebacks go to the log; the same error
reaches the main thread through the checkpoint manager, which reports it in one line. The one
message dropped outright is asyncio's "Event loop is closed" raised while orbax tears down its
loops after a failed save: it says nothing about the run.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
import threading
import traceback
from pathlib import Path

ERRORS_LOG = "errors.log"

# Top-level module -> the extra of pyproject.toml's optional-dependencies that installs it.
EXTRA_OF_MODULE = {
    **dict.fromkeys(
        (
            "flax", "optax", "orbax", "etils", "grain", "array_record", "yaml", "rdata",
            "sentencepiece", "tokenizers", "tensorboardX", "tqdm", "matplotlib",
        ),
        "train",
    ),
    **dict.fromkeys(("torch", "transformers", "safetensors", "lm_eval"), "hf"),
    "gcsfs": "gcs",
    "libtpu": "tpu",
    "pdoc": "docs",
}  # fmt: skip


def cache_dir() -> Path:
    """The cache folder: ``$NESTED_JAX_DATA``, else ``~/.cache/nested_jax`` (as the data cache)."""
    return Path(os.environ.get("NESTED_JAX_DATA", "") or "~/.cache/nested_jax").expanduser()


def log_path(workdir: str | os.PathLike | None) -> Path:
    """``<workdir>/errors.log`` for a local `workdir` that exists, else the cache folder's."""
    if workdir is not None and "://" not in os.fspath(workdir) and Path(workdir).is_dir():
        return Path(workdir) / ERRORS_LOG
    return cache_dir() / ERRORS_LOG


def append(path: Path, title: str, text: str) -> Path:
    """Appends ``[timestamp] title`` and `text` to `path` (creating its folder); returns `path`."""
    stamp = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"[{stamp}] {title} (pid {os.getpid()})\n{text.rstrip()}\n\n")
    return path


def log_exception(path: Path, err: BaseException, title: str) -> Path:
    """Appends `err`'s full traceback to `path`; returns `path`."""
    return append(path, title, "".join(traceback.format_exception(err)))


def one_line(err: BaseException) -> str:
    """The first line of `err`'s message (its type name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def missing_extra(err: BaseException) -> str | None:
    """The extra that installs the module a ``ModuleNotFoundError`` names (None: no extra's)."""
    if not isinstance(err, ModuleNotFoundError) or not err.name:
        return None
    return EXTRA_OF_MODULE.get(err.name.split(".")[0])


def missing_extra_line(command: str, extra: str) -> str:
    return f'nested-jax {command} needs the extra {extra!r}: pip install "nested-jax[{extra}]"'


def is_teardown_noise(err: BaseException | None) -> bool:
    """asyncio's "Event loop is closed", raised when a loop is used after orbax closed it."""
    return isinstance(err, RuntimeError) and str(err) == "Event loop is closed"


class _ToLog(logging.Filter):
    """Sends records with a traceback (or ERROR and worse) to the log instead of the terminal."""

    def __init__(self, noise: BackgroundNoise):
        super().__init__()
        self.noise = noise

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR and not record.exc_info:
            return True
        err = record.exc_info[1] if record.exc_info else None
        if not is_teardown_noise(err):
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info))
            self.noise.write(f"log {record.name} {record.levelname}", text)
        return False


class BackgroundNoise:
    """While active, tracebacks from background threads, unraisable exceptions and the ERROR
    records of the ``absl`` (orbax) and ``asyncio`` loggers go to :func:`log_path` (`workdir`), not
    to stderr.

    Usage: ``with BackgroundNoise(workdir) as noise: ...``; ``noise.written`` counts the entries.
    """

    LOGGERS = ("absl", "asyncio")

    def __init__(self, workdir: str | os.PathLike | None):
        self.workdir = workdir  # the log is chosen when written: a new workdir appears later
        self.written = 0
        self._filter = _ToLog(self)
        self._saved: tuple = ()
        self._lock = threading.Lock()

    def write(self, title: str, text: str) -> None:
        with self._lock:
            try:
                append(log_path(self.workdir), title, text)
                self.written += 1
            except OSError:  # the disk is full: the entry is lost, the terminal stays quiet
                pass

    def _thread_hook(self, args: threading.ExceptHookArgs) -> None:
        if is_teardown_noise(args.exc_value):
            return
        text = "".join(
            traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
        )
        self.write(f"exception in thread {getattr(args.thread, 'name', '?')}", text)

    def _unraisable_hook(self, args) -> None:
        if is_teardown_noise(args.exc_value):
            return
        text = "".join(
            traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
        )
        self.write(f"unraisable exception ({args.err_msg or ''} {args.object!r})", text)

    def __enter__(self) -> BackgroundNoise:
        self._saved = (threading.excepthook, sys.unraisablehook)
        threading.excepthook = self._thread_hook
        sys.unraisablehook = self._unraisable_hook
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self._filter)
        return self

    def __exit__(self, *exc) -> None:
        threading.excepthook, sys.unraisablehook = self._saved
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)
