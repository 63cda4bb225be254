"""nested_jax.files: atomic writes and strict JSON."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nested_jax import files


def test_atomic_write_never_leaves_half_file(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "cache.json"
    files.atomic_write_bytes(target, b"old")
    assert target.read_bytes() == b"old"

    def boom(src, dst):
        raise KeyboardInterrupt  # an interrupt between writing and renaming

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        files.atomic_write_bytes(target, b"new but interrupted")
    assert target.read_bytes() == b"old"
    assert [p.name for p in target.parent.iterdir()] == ["cache.json"]


def test_disk_full_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    files.write_json(target, {"a": 1})

    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: _FullFile(fd))
    with pytest.raises(OSError, match="No space"):
        files.write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


class _FullFile:
    def __init__(self, fd):
        import os

        self._fd = fd
        self._close = os.close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._close(self._fd)
        return False

    def write(self, data):
        raise OSError(28, "No space left on device")


def test_strict_json_turns_non_finite_into_null():
    value = {
        "nan": float("nan"),
        "inf": -math.inf,
        "np": np.float32(1.5),
        "arr": np.array([1.0, np.nan]),
        "tuple": (1, float("inf")),
        3: "int key",
    }
    text = files.strict_json(value)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {
        "nan": None,
        "inf": None,
        "np": 1.5,
        "arr": [1.0, None],
        "tuple": [1, None],
        "3": "int key",
    }
