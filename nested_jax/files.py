"""Files the project writes: atomically, and JSON strictly; paths that may be URLs.

Every JSON file nested-jax writes (summaries, reports, manifests, metrics lines, benchmark lines)
goes through :func:`strict_json`, so it is valid JSON for any reader: Python's ``json`` would
otherwise write bare ``NaN`` / ``Infinity``, which ``jq``, JavaScript and most JSON libraries
refuse. A non-finite float becomes ``null`` (a missing measurement), numpy scalars and arrays become
numbers and lists, and tuples become lists.

Writes go to a temporary file in the same folder, are flushed to disk and then renamed over the
target, so a crash or a full disk never leaves a half-written file and never replaces a good one.

Paths. A workdir, report, cache or corpus path may be a URL (``gs://bucket/runs/x``, also ``s3://``,
``az://``, ``hf://``): :func:`as_path` makes every path an :class:`etils.epath.Path`, which reaches
URLs through fsspec (``gcsfs`` for ``gs://``: ``pip install 'nested-jax[gcs]'``) or TensorFlow's
gfile, and local paths exactly as ``pathlib`` does. ``pathlib.Path("gs://b/x")`` would be the local
folder ``gs:/b/x`` (and ``pathlib.Path`` of an epath ``gs://b/x`` the local ``/gs/b/x``):
:func:`as_path` refuses such a mangled URL instead of writing there.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from etils import epath

__all__ = [
    "PathError",
    "append_text",
    "as_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "is_remote",
    "jsonable",
    "move",
    "resolve_path",
    "strict_json",
    "write_json",
]

# The URL schemes etils.epath reaches, and the fsspec package each needs.
REMOTE_BACKENDS = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEMES = "|".join(REMOTE_BACKENDS)
# What pathlib.Path makes of a URL: "gs:/b/x" of the string "gs://b/x", "/gs/b/x" of an epath
# gs://b/x (and etils.epath itself reads a local /gs/b/x as gs://b/x).
_MANGLED_URL = re.compile(rf"^(?:(?P<a>{_SCHEMES}):|/(?P<b>{_SCHEMES}))/(?!/)")


class PathError(ValueError):
    """A path that cannot be used as given; ``str`` is one line naming the flag and the fix."""


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


# -- paths -----------------------------------------------------------------------------------------


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` is a URL (``gs://...``) rather than a local path."""
    return _URL.match(os.fspath(path)) is not None


@functools.cache
def _backend_installed(scheme: str) -> bool:
    if importlib.util.find_spec("tensorflow") is not None:  # epath then uses tf.io.gfile
        return True
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)  # imports gcsfs / s3fs / ...
    except ImportError:
        return False
    return True


def as_path(path: str | os.PathLike, flag: str = "path") -> epath.Path:
    """`path` as an :class:`etils.epath.Path`: a URL stays a URL, a local path is as in pathlib.

    Args:
      path: a local path or a ``gs://`` / ``s3://`` / ``az://`` / ``hf://`` URL.
      flag: what the user set (``--workdir``, ``data.corpus``), named in errors.
    Raises:
      PathError: one line naming `flag`, for a URL whose backend is not installed (saying what to
        install), a URL scheme epath does not know, or a URL that ``pathlib.Path`` mangled
        (``gs:/b/x``, ``/gs/b/x``; etils.epath would also read a local ``/gs/...`` as a URL).
    """
    text = os.fspath(path)
    mangled = _MANGLED_URL.match(text)
    if mangled:
        url = f"{mangled['a'] or mangled['b']}://{text[mangled.end() :]}"
        raise PathError(
            f"{flag} {text}: looks like the URL {url} mangled by pathlib.Path (etils.epath takes "
            f"local paths under /gs/, /s3/, /az/, /hf/ for URLs too); pass {url} itself"
        )
    match = _URL.match(text)
    if match:
        scheme = match.group(1)
        package = REMOTE_BACKENDS.get(scheme)
        if package is None:
            known = ", ".join(f"{s}://" for s in REMOTE_BACKENDS)
            raise PathError(f"{flag} {text}: unsupported URL scheme {scheme}:// (use {known})")
        if not _backend_installed(scheme):
            extra = " or pip install 'nested-jax[gcs]'" if scheme == "gs" else ""
            raise PathError(
                f"{flag} {text}: reaching {scheme}:// URLs needs the {package} package, which is "
                f"not installed: pip install {package}{extra}"
            )
    return epath.Path(text)


def resolve_path(path: str | os.PathLike) -> epath.Path:
    """An absolute `path`: pathlib's ``resolve()`` for a local path, a URL as it is.

    (epath's own ``resolve()`` would turn ``gs://b/x`` into the local ``$PWD/gs:/b/x``.)
    """
    path = as_path(path)
    return path if is_remote(path) else epath.Path(Path(path).resolve())


def move(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Moves the file or folder `src` to `dst`, creating the folder `dst` goes into.

    Local: ``shutil.move`` (a rename within one file system). A URL: fsspec's recursive move. An
    object store copies every object and then deletes the originals (not atomic), and it has no
    empty folders, so epath's ``rename`` (which insists that `dst`'s folder exists) cannot do it.
    """
    src, dst = as_path(src), as_path(dst)
    if not is_remote(src):
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dst)
        return
    import fsspec

    fs, _ = fsspec.core.url_to_fs(os.fspath(src))
    fs.mv(os.fspath(src), os.fspath(dst), recursive=True)


# -- writes ----------------------------------------------------------------------------------------


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file in the same folder and an atomic rename.

    A URL is written directly: object stores (GCS, S3) have no atomic rename (a rename copies, then
    deletes) but publish an object only when its upload completes, so readers see the old object or
    the new one, never half of it.

    Raises:
      OSError: the folder cannot be created or written (the previous file, if any, is untouched).
      PathError: see :func:`as_path`.
    """
    path = as_path(path)
    if is_remote(path):
        path.write_bytes(data)
        return
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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of UTF-8 `text`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(
    path: str | os.PathLike, x: Any, *, indent: int | None = 2, **dumps_kwargs: Any
) -> None:
    """Writes `x` as strict JSON (:func:`strict_json`) atomically, with a final newline."""
    atomic_write_text(path, strict_json(x, indent=indent, **dumps_kwargs) + "\n")


def append_text(path: str | os.PathLike, text: str) -> None:
    """Appends `text` to the file `path` (created if missing).

    Local: append mode. A URL: object stores cannot append, so the object is read and written
    whole again (readers see the old or the new object); callers batch appends to a URL.
    """
    path = as_path(path)
    if is_remote(path):
        path.write_text((path.read_text() if path.exists() else "") + text)
        return
    with path.open("a") as f:
        f.write(text)
