"""Metric sinks: JSON lines (``workdir/metrics.jsonl``) and TensorBoard event files
(``workdir/tensorboard``).

Only process 0 writes. Each JSONL record is ``{"step": int, "kind": "train"|"eval"|"event",
...scalars}``; floats are written with ``repr`` precision so the JSONL is an exact record of the f32
values (the resume test compares losses), and a non-finite value (a skipped NaN step) is ``null``:
every line is strict JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from nested_jax.files import jsonable, strict_json


def _ends_mid_line(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


class MetricsWriter:
    """Appends metrics to ``metrics.jsonl`` and TensorBoard; a no-op on processes other than 0."""

    def __init__(self, workdir: str | Path, *, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = Path(workdir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut_short = _ends_mid_line(self.path)
        self._file = self.path.open("a")
        if cut_short:  # a killed run's partial last line: start ours on a fresh one
            self._file.write("\n")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"))

    def write(self, step: int, kind: str, scalars: dict[str, Any]) -> None:
        """Writes one record; TensorBoard tags are ``<kind>/<name>``."""
        if not self.enabled:
            return
        record = jsonable({"step": int(step), "kind": kind, **scalars})
        self._file.write(strict_json(record) + "\n")
        self._file.flush()
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
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(
    workdir: str | Path, kind: str | None = None, *, latest: bool = True
) -> list[dict]:
    """Reads ``metrics.jsonl`` records (optionally of one kind), ordered by step.

    After a resume, steps between the checkpoint and a crash were logged twice; with
    ``latest=True`` only the last record per (kind, step) is kept - the one of the run that
    continued. A line cut short by a killed process is skipped.
    """
    path = Path(workdir) / "metrics.jsonl"
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
