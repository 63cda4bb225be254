"""Metric sinks: JSON lines (``workdir/metrics.jsonl``) and TensorBoard event files
(``workdir/tensorboard``).

Only process 0 writes. Each JSONL record is ``{"step": int, "kind": "train"|"eval"|"event",
...scalars}``; floats are written with ``repr`` precision so the JSONL is an exact record of the f32
values (the resume test compares losses), and a non-finite value (a skipped NaN step) is ``null``:
every line is strict JSON.

A remote workdir (``gs://...``): object stores cannot append, so ``metrics.jsonl`` is rewritten
whole at most every :data:`REMOTE_FLUSH_S` seconds and on close (a killed process loses at most
that much, which a resume from the last checkpoint logs again). TensorBoard events are not written
there, with a notice: tensorboardX uploads from a background thread whose failure (a permission, a
network error) leaves its queue full and blocks training; every scalar is in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
from etils import epath

from nested_jax.files import append_text, as_path, is_remote, jsonable, strict_json

REMOTE_FLUSH_S = 60.0


def _ends_mid_line(path: epath.Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        f.seek(0, 2)
        size = f.tell()
        if size == 0:
            return False
        f.seek(size - 1)
        return f.read(1) != b"\n"


class MetricsWriter:
    """Appends metrics to ``metrics.jsonl`` and TensorBoard; a no-op on processes other than 0."""

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        workdir = as_path(workdir)
        self.path = workdir / "metrics.jsonl"
        self._file = None  # local: the open file; remote: lines wait in _pending
        self._pending: list[str] = []
        self._flushed_at = time.monotonic()
        self._tb = None
        if not self.enabled:
            return
        cut_short = _ends_mid_line(self.path)
        if is_remote(workdir):
            if tensorboard:
                print(
                    f"notice: no TensorBoard events for the remote workdir {workdir} "
                    "(tensorboardX's remote writers can block training); metrics.jsonl there "
                    "holds every scalar",
                    flush=True,
                )
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
            if tensorboard:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(workdir / "tensorboard"))
        if cut_short:  # a killed run's partial last line: start ours on a fresh one
            self._emit("\n")

    def _emit(self, text: str) -> None:
        if self._file is not None:
            self._file.write(text)
            self._file.flush()
            return
        self._pending.append(text)
        if time.monotonic() - self._flushed_at >= REMOTE_FLUSH_S:
            self._flush_remote()

    def _flush_remote(self) -> None:
        if self._pending:
            append_text(self.path, "".join(self._pending))
            self._pending.clear()
        self._flushed_at = time.monotonic()

    def write(self, step: int, kind: str, scalars: dict[str, Any]) -> None:
        """Writes one record; TensorBoard tags are ``<kind>/<name>``."""
        if not self.enabled:
            return
        record = jsonable({"step": int(step), "kind": kind, **scalars})
        self._emit(strict_json(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if (
                    k not in ("step", "kind")
                    and isinstance(v, int | float)
                    and not isinstance(v, bool)
                ):
                    self._tb.add_scalar(f"{kind}/{k}", v, int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._flush_remote()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(
    workdir: str | os.PathLike, kind: str | None = None, *, latest: bool = True
) -> list[dict]:
    """Reads ``metrics.jsonl`` records (optionally of one kind), ordered by step.

    After a resume, steps between the checkpoint and a crash were logged twice; with
    ``latest=True`` only the last record per (kind, step) is kept - the one of the run that
    continued. A line cut short by a killed process is skipped.
    """
    path = as_path(workdir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed process
            continue
    out = [r for r in out if kind is None or r.get("kind") == kind]
    if latest:
        out = list({(r.get("kind"), r["step"]): r for r in out}.values())
    return sorted(out, key=lambda r: r["step"])
