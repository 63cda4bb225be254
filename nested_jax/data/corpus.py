"""Corpora as lists of documents, the document-level train/validation split, and the data cache.

Two sources:
  * ``"austen"``: Jane Austen's six novels from the Debian package ``r-cran-janeaustenr``. The
    package stores each novel as an R character vector (one element per printed line) in an R
    lazy-load database (``data/Rdata.rdx`` index + ``data/Rdata.rdb`` blobs), decoded with the
    PyPI ``rdata`` parser (no R needed). Documents are chapters, so the held-out split is whole
    chapters. The decoded lines are cached as JSON under the data directory; later runs never
    download.
  * user text: a comma-separated list of files and folders; every file is one document, folders are
    searched recursively for ``*.txt`` in sorted order.

Every problem with the data (missing, empty, undecodable, corrupt cache) raises :class:`DataError`
with one line naming the path. Cache files are written to a temporary name and renamed, so an
interrupted run never leaves a half-written file behind.

``data.corpus`` entries and ``data.data_dir`` may be URLs (``gs://bucket/texts``): they are read and
written through :func:`nested_jax.files.as_path`.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shutil
import struct
import subprocess
import tempfile
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from etils import epath

from nested_jax.data.config import DataConfig
from nested_jax.files import as_path, atomic_write_bytes, is_remote, resolve_path

AUSTEN_NOVELS = (
    "emma",
    "mansfieldpark",
    "northangerabbey",
    "persuasion",
    "prideprejudice",
    "sensesensibility",
)
AUSTEN_PACKAGE = "r-cran-janeaustenr"
_AUSTEN_CACHE_FORMAT = 1
_RDATA_SUBDIR = "usr/lib/R/site-library/janeaustenr/data"
# A chapter heading is a line holding only "CHAPTER <arabic or roman numeral>" (any case).
_CHAPTER_RE = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlcdm]+)\.?\s*$", re.IGNORECASE)
_USER_TEXT_HINT = "set data.corpus to your own .txt files or folders instead"


class DataError(ValueError):
    """Missing, empty, corrupt or unreadable data; the message is one line naming the path."""


def one_line(detail: object) -> str:
    """First non-empty line of an external message (tools and parsers may print many)."""
    lines = [x.strip() for x in str(detail).splitlines() if x.strip()]
    return lines[0] if lines else type(detail).__name__


def resolve_data_dir(data_dir: str = "") -> epath.Path:
    """Cache root: ``data_dir``, else ``$NESTED_JAX_DATA``, else ``~/.cache/nested_jax``."""
    root = data_dir or os.environ.get("NESTED_JAX_DATA", "") or "~/.cache/nested_jax"
    return as_path(root, "data.data_dir").expanduser()


def write_cache_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically writes a data-cache file (:func:`nested_jax.files.atomic_write_bytes`).

    Raises:
      DataError: the cache folder cannot be written, in one line naming the setting to change.
    """
    try:
        atomic_write_bytes(path, data)
    except OSError as e:
        raise DataError(
            f"{as_path(path).parent}: cannot write the data cache ({e.strerror}); "
            f"set data.data_dir or $NESTED_JAX_DATA to a writable folder"
        ) from e


# --------------------------------------------------------------------------------------------
# Austen: R lazy-load database decoding, download, cache
# --------------------------------------------------------------------------------------------


def _unserialize(raw: bytes, where: Path):
    import rdata  # local import: only the Austen path needs it

    try:
        with warnings.catch_warnings():
            # The blobs carry no file header; rdata warns that it assumes RDS, which is right.
            warnings.simplefilter("ignore")
            parsed = rdata.parser.parse_data(raw)
            return rdata.conversion.convert(parsed)
    except Exception as e:  # the rdata parser raises many types on bad input
        raise DataError(
            f"{where}: cannot parse R serialized data ({type(e).__name__}: {one_line(e)})"
        ) from e


def _decompress_rdb_entry(blob: bytes, where: Path) -> bytes:
    """One .rdb entry: 4-byte big-endian uncompressed length, then a zlib stream (R's default).

    R also writes type-tagged entries ('Z' zlib, '2' bzip2, 'X' xz, '0' none) after the length.
    """
    if len(blob) < 5:
        raise DataError(f"{where}: truncated R database entry")
    (size,) = struct.unpack(">I", blob[:4])
    body = blob[4:]
    try:
        if body[:1] in (b"Z", b"2", b"X", b"0") and body[1:2] != b"\x9c":
            tag, body = body[:1], body[1:]
            if tag == b"Z":
                raw = zlib.decompress(body)
            elif tag == b"2":
                import bz2

                raw = bz2.decompress(body)
            elif tag == b"X":
                import lzma

                raw = lzma.decompress(body)
            else:
                raw = body
        else:
            raw = zlib.decompress(body)
    except (zlib.error, OSError, ValueError, EOFError) as e:
        raise DataError(f"{where}: corrupt compressed R database entry ({one_line(e)})") from e
    if len(raw) != size:
        raise DataError(f"{where}: R database entry has {len(raw)} bytes, index says {size}")
    return raw


def decode_janeaustenr(rdata_dir: str | os.PathLike) -> dict[str, list[str]]:
    """Decode the six novels from janeaustenr's ``Rdata.rdx``/``Rdata.rdb`` lazy-load database.

    Args:
      rdata_dir: folder holding ``Rdata.rdx`` and ``Rdata.rdb`` (``<pkg>/data``).

    Returns:
      ``{novel: [line, ...]}`` for the names in :data:`AUSTEN_NOVELS`.
    """
    rdata_dir = Path(rdata_dir)
    rdx_path, rdb_path = rdata_dir / "Rdata.rdx", rdata_dir / "Rdata.rdb"
    for p in (rdx_path, rdb_path):
        if not p.is_file():
            raise DataError(f"{p}: missing file of the janeaustenr R database")
    rdx = rdx_path.read_bytes()
    try:
        # The index is a whole serialized object, gzip-wrapped (saveRDS) or a raw zlib stream.
        rdx_raw = gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:])
    except (OSError, zlib.error, EOFError) as e:
        raise DataError(
            f"{rdx_path}: cannot decompress the R database index ({one_line(e)})"
        ) from e
    index = _unserialize(rdx_raw, rdx_path)
    try:
        variables = {str(k): v for k, v in index["variables"].items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{rdx_path}: R database index has no 'variables' table") from e
    rdb = rdb_path.read_bytes()
    novels: dict[str, list[str]] = {}
    for name in AUSTEN_NOVELS:
        if name not in variables:
            raise DataError(f"{rdx_path}: novel {name!r} missing from the R database index")
        offset, length = (int(x) for x in variables[name])
        if offset < 0 or length <= 0 or offset + length > len(rdb):
            raise DataError(f"{rdb_path}: entry {name!r} lies outside the file")
        obj = _unserialize(_decompress_rdb_entry(rdb[offset : offset + length], rdb_path), rdb_path)
        lines = ["" if x is None else str(x) for x in np.asarray(obj, dtype=object).ravel()]
        if not any(line.strip() for line in lines):
            raise DataError(f"{rdb_path}: novel {name!r} is empty")
        novels[name] = lines
    return novels


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def _download_deb(workdir: Path) -> Path:
    """``apt-get download`` the package into ``workdir``; refresh package lists once if needed."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise DataError(
            f"cannot fetch the Austen corpus: apt-get/dpkg-deb not found (Debian/Ubuntu only); "
            f"{_USER_TEXT_HINT}"
        )
    res = _run(["apt-get", "download", AUSTEN_PACKAGE], workdir)
    if res.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
        # Fresh containers often ship without package lists; only root may refresh them.
        _run(["apt-get", "update", "-qq"], workdir)
        res = _run(["apt-get", "download", AUSTEN_PACKAGE], workdir)
    debs = sorted(workdir.glob(f"{AUSTEN_PACKAGE}_*.deb"))
    if res.returncode != 0 or not debs:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(
            f"cannot fetch the Austen corpus: `apt-get download {AUSTEN_PACKAGE}` failed ({last}); "
            f"try `sudo apt-get update`, or {_USER_TEXT_HINT}"
        )
    return debs[-1]


def novels_from_deb(deb_path: str | os.PathLike) -> dict[str, list[str]]:
    """Extract a ``r-cran-janeaustenr`` .deb (``dpkg-deb -x``) and decode its novels."""
    deb_path = Path(deb_path)
    with tempfile.TemporaryDirectory(prefix="janeaustenr-") as tmp:
        res = _run(["dpkg-deb", "-x", str(deb_path), tmp], Path(tmp))
        if res.returncode != 0:
            raise DataError(f"{deb_path}: dpkg-deb cannot extract it ({one_line(res.stderr)})")
        return decode_janeaustenr(Path(tmp) / _RDATA_SUBDIR)


def _validate_novels(novels: object, where: Path) -> dict[str, list[str]]:
    if not isinstance(novels, dict):
        raise DataError(f"{where}: corrupt Austen cache (delete it to re-download)")
    for name in AUSTEN_NOVELS:
        lines = novels.get(name)
        if (
            not isinstance(lines, list)
            or not all(isinstance(x, str) for x in lines)
            or not any(x.strip() for x in lines)
        ):
            raise DataError(
                f"{where}: corrupt Austen cache, novel {name!r} (delete it to re-download)"
            )
    return {name: novels[name] for name in AUSTEN_NOVELS}


def austen_cache_path(data_dir: str = "") -> epath.Path:
    """Where the decoded novels are cached (JSON)."""
    return resolve_data_dir(data_dir) / "austen" / "janeaustenr_v1.json"


def load_austen_novels(data_dir: str = "") -> dict[str, list[str]]:
    """The six novels as lines, from the cache or else fetched, decoded and cached.

    Order of sources: the JSON cache; a system-wide install of the R package (no download);
    ``apt-get download r-cran-janeaustenr`` + ``dpkg-deb -x`` in a temporary folder.
    """
    cache = austen_cache_path(data_dir)
    if cache.exists():
        try:
            payload = json.loads(cache.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(
                f"{cache}: unreadable Austen cache ({type(e).__name__}); delete it to re-download"
            ) from e
        if not isinstance(payload, dict) or payload.get("format") != _AUSTEN_CACHE_FORMAT:
            raise DataError(f"{cache}: unknown Austen cache format; delete it to re-download")
        return _validate_novels(payload.get("novels"), cache)

    system = Path("/") / _RDATA_SUBDIR
    if (system / "Rdata.rdb").is_file():
        novels = decode_janeaustenr(system)
    else:
        local = None if is_remote(cache) else cache.parent  # a gs:// cache downloads to /tmp
        try:
            if local is not None:
                local.mkdir(parents=True, exist_ok=True)
            workdir = tempfile.TemporaryDirectory(dir=local, prefix=".download-")
        except OSError as e:
            raise DataError(
                f"{cache.parent}: cannot write the data cache ({e.strerror}); "
                f"set data.data_dir or $NESTED_JAX_DATA to a writable folder"
            ) from e
        with workdir as tmp:
            novels = novels_from_deb(_download_deb(Path(tmp)))
    payload = {"format": _AUSTEN_CACHE_FORMAT, "source": AUSTEN_PACKAGE, "novels": novels}
    write_cache_bytes(cache, json.dumps(payload, ensure_ascii=False).encode("utf-8"))
    return novels


def split_chapters(lines: Sequence[str]) -> list[str]:
    """Split one novel (list of lines) into chapter documents.

    Each document starts at a ``CHAPTER <n>`` heading line (kept in the text). Front matter before
    the first heading (title, author, preface) stays with the first chapter so nothing is lost and
    the novel's title stays at the start of its first document. Trailing blank lines are dropped.
    """
    heads = [i for i, line in enumerate(lines) if _CHAPTER_RE.match(line)]
    if not heads:
        bounds = [0, len(lines)]
    else:
        bounds = [0, *heads[1:], len(lines)]
    docs = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        text = "\n".join(lines[a:b]).strip("\n")
        if text.strip():
            docs.append(text + "\n")
    return docs


def austen_documents(data_dir: str = "") -> list[str]:
    """All chapters of the six novels, novel by novel (alphabetical), chapters in book order."""
    novels = load_austen_novels(data_dir)
    return [doc for name in AUSTEN_NOVELS for doc in split_chapters(novels[name])]


# --------------------------------------------------------------------------------------------
# User text
# --------------------------------------------------------------------------------------------


def _text_files(folder: epath.Path) -> list[epath.Path]:
    """The ``*.txt`` files in `folder` and its subfolders, sorted by path."""
    if not is_remote(folder):
        return sorted(as_path(p) for p in Path(folder).rglob("*.txt") if p.is_file())
    # epath has no rglob for URLs (and its walk() drops fsspec's scheme): list folder by folder.
    found = []
    for p in folder.iterdir():
        if p.is_dir():
            found += _text_files(p)
        elif p.suffix == ".txt":
            found.append(p)
    return sorted(found)


def _user_files(spec: str) -> list[epath.Path]:
    files: list[epath.Path] = []
    for entry in (s.strip() for s in spec.split(",")):
        if not entry:
            continue
        path = as_path(entry, "data.corpus").expanduser()
        if path.is_dir():
            found = _text_files(path)
            if not found:
                raise DataError(f"{path}: folder contains no .txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{path}: no such file or folder (data.corpus)")
    seen: set[epath.Path] = set()
    unique = []
    for f in files:
        key = resolve_path(f)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    if not unique:
        raise DataError(f"data.corpus {spec!r}: names no files")
    return unique


def read_text_file(path: epath.Path) -> str:
    """One user document: UTF-8 text with ``\\r\\n`` normalised to ``\\n``; empty is an error."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text (byte {e.start})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or one_line(e)})") from e
    text = text.replace("\r\n", "\n")
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    return text


def load_documents(cfg: DataConfig) -> list[str]:
    """The corpus named by ``cfg.corpus`` as a list of documents (see module docstring)."""
    if cfg.corpus.strip().lower() == "austen":
        return austen_documents(cfg.data_dir)
    return [read_text_file(p) for p in _user_files(cfg.corpus)]


def split_documents(
    docs: Sequence[str], val_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """Deterministic document-level split.

    ``ceil(val_fraction * n)`` documents chosen by a permutation seeded with ``seed`` are held out
    (none when ``val_fraction == 0``); both halves keep the corpus order.

    Returns:
      ``(train_docs, val_docs)``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction: must be in [0, 1), got {val_fraction}")
    n = len(docs)
    if n == 0:
        raise DataError("corpus has no documents")
    n_val = math.ceil(val_fraction * n) if val_fraction > 0 else 0
    if n_val >= n:
        raise DataError(
            f"corpus has {n} document(s): a document-level split with val_fraction={val_fraction} "
            f"leaves no training data (add files or set data.val_fraction=0)"
        )
    held = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    train = [d for i, d in enumerate(docs) if i not in held]
    val = [d for i, d in enumerate(docs) if i in held]
    return train, val
