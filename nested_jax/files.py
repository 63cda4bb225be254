"""Files the project writes: atomically, and JSON strictly.

Every JSON file nested-jax writes (summaries, reports, manifests, metrics lines, benchmark lines)
goes through :func:`strict_json`, so it is valid JSON for any reader: Python's ``json`` would
otherwise write bare ``NaN`` / ``Infinity``, which ``jq``, JavaScript and most JSON libraries
refuse. A non-finite float becomes ``null`` (a missing measurement), numpy scalars and arrays become
numbers and lists, and tuples become lists.

Writes go to a temporary file in the same folder, are flushed to disk and then renamed over the
target, so a crash or a full disk never leaves a half-written file and never replaces a good one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "atomic_write_text", "jsonable", "strict_json", "write_json"]


def jsonable(x: Any) -> Any:
    """`x` with non-finite floats as None, numpy values as Python ones, tuples as lists."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, str):  # numpy scalar / array, jax array
        return jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def strict_json(x: Any, **dumps_kwargs: Any) -> str:
    """``json.dumps`` of :func:`jsonable` (`x`); raises rather than write NaN / Infinity."""
    return json.dumps(jsonable(x), allow_nan=False, **dumps_kwargs)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file in the same folder and an atomic rename.

    Raises:
      OSError: the folder cannot be created or written (the previous file, if any, is untouched).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; nothing we write is secret
        os.replace(tmp, path)
    except BaseException:
        # Interrupted (KeyboardInterrupt included) or disk full: drop the partial temporary file.
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """:func:`atomic_write_bytes` of UTF-8 `text`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, x: Any, *, indent: int | None = 2, **dumps_kwargs: Any) -> None:
    """Writes `x` as strict JSON (:func:`strict_json`) atomically, with a final newline."""
    atomic_write_text(path, strict_json(x, indent=indent, **dumps_kwargs) + "\n")
