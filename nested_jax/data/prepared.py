"""Pre-tokenised corpora: ``nested-jax prepare-data`` writes them, the pipeline reads them.

A corpus too large to tokenise at every start is tokenised once into a folder::

    manifest.json                      written last, atomically (below)
    train-00000-of-00004.arrayrecord   ArrayRecord shards (group_size 1, zstd), records round-robin
    ...
    tokenizer.model | tokenizer.json   the tokenizer file (SentencePiece / Hugging Face only)

Stream. The train split (the same document-level split as the in-process path:
:func:`~nested_jax.data.corpus.split_documents` with ``data.seed`` and ``data.val_fraction``) is
tokenised document by document, each document prefixed with ``bos_id``, into the token stream
``x[0:N]`` that :func:`nested_jax.data.pipeline.tokenize_documents` builds in memory. The stream is
cut into records of ``C`` tokens (the last one shorter): record ``r`` holds ``x[rC : (r+1)C]``, the
1-based document index of its first token and the in-record positions where a new document starts.
Record ``r`` is position ``r div S`` of shard ``r mod S``. The seq_len is not baked in: the
pipeline packs windows ``x[wT : wT+T+1]`` from the records at read time, so one prepared folder
serves any ``data.seq_len`` and ``data.batch_size``.

Record bytes (little-endian): ``b"NJT1"``, uint32 n_tokens, int64 first_segment, uint32 n_starts,
int32 starts[n_starts], tokens[n_tokens] (uint16 when the vocabulary fits, else int32).

Manifest. Tokenizer identity, corpus fingerprint, the split (seed, val_fraction, train document
count and sha256), token and record counts, per-shard file name / records / bytes / sha256, and a
content hash over the shards. The shards are written under temporary names, renamed, and the
manifest comes last, so a folder with a manifest is complete; an interrupted run leaves none.

Reading (:func:`open_prepared`) checks the manifest against the config and the tokenizer, and
each shard's size against it, in one line (:class:`~nested_jax.data.corpus.DataError`); ArrayRecord
(Riegeli) checks every chunk's hash as it reads, so a flipped byte fails the read that meets it,
and :func:`verify_prepared` re-hashes every shard. Local folders only: ArrayRecord's reader and
writer open local files (a gs:// bucket can be read through a gcsfuse mount).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import DataError, load_documents, one_line, split_documents
from nested_jax.data.identity import (
    TOKENIZER_FILES,
    corpus_fingerprint,
    tokenizer_from_payload,
    tokenizer_payload,
)
from nested_jax.data.tokenizers import Tokenizer, build_tokenizer
from nested_jax.files import as_path, is_remote, write_json

MANIFEST = "manifest.json"
FORMAT = "nested-jax-prepared-tokens"
VERSION = 1
DEFAULT_CHUNK_TOKENS = 4096
# group_size 1: every record is its own chunk, so a random read decodes only that record (grain
# warns otherwise); zstd makes token files ~3x smaller than raw at ~20 us per 8 KB record.
_WRITER_OPTIONS = "group_size:1,zstd:3"
_MAGIC = b"NJT1"
_HEADER = struct.Struct("<4sIqI")  # magic, n_tokens, first_segment, n_starts


# -- records ---------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (byte, most BPE vocabularies), else int32."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)


def encode_record(
    tokens: np.ndarray, first_segment: int, starts: np.ndarray, dtype: np.dtype
) -> bytes:
    """One record (module docstring): ``tokens`` int[n], ``starts`` int[k] in ``(0, n)``."""
    starts = np.asarray(starts, np.int32)
    head = _HEADER.pack(_MAGIC, int(tokens.shape[0]), int(first_segment), int(starts.shape[0]))
    return head + starts.astype("<i4").tobytes() + tokens.astype(dtype.newbyteorder("<")).tobytes()


def _parse_record(raw: bytes, dtype: np.dtype, where: str) -> tuple[np.ndarray, int, np.ndarray]:
    """``(tokens view, first_segment, starts)`` of one record, without copying the tokens."""
    if len(raw) < _HEADER.size:
        raise DataError(f"{where}: corrupt record ({len(raw)} bytes, shorter than its header)")
    magic, n, first, k = _HEADER.unpack_from(raw)
    body = _HEADER.size + 4 * k
    if magic != _MAGIC or len(raw) != body + n * dtype.itemsize:
        raise DataError(f"{where}: corrupt record (header and length disagree)")
    starts = np.frombuffer(raw, "<i4", k, _HEADER.size)
    return np.frombuffer(raw, dtype.newbyteorder("<"), n, body), first, starts


def _record_slice(
    parsed: tuple[np.ndarray, int, np.ndarray], a: int, b: int
) -> tuple[np.ndarray, np.ndarray]:
    tokens, first, starts = parsed
    # Token i belongs to document first + #{starts <= i}.
    seg = first + np.searchsorted(starts, np.arange(a, b), side="right")
    return tokens[a:b].astype(np.int32), seg.astype(np.int32)


def decode_record(raw: bytes, dtype: np.dtype, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32[n], segments int32[n])`` of one record; ``segments`` are 1-based document
    indices of the whole train stream (``TokenStream.segments`` restricted to the record).

    Raises:
      DataError: the bytes are not a record of this format (``where`` names the shard).
    """
    parsed = _parse_record(raw, dtype, where)
    return _record_slice(parsed, 0, parsed[0].shape[0])


def _stream_records(
    tokenizer: Tokenizer, docs: Sequence[str], chunk_tokens: int
) -> Iterator[tuple[np.ndarray, int, list[int]]]:
    """``(tokens, first_segment, starts)`` of consecutive records, tokenising one document at a
    time (memory: one record plus one document)."""
    prefix = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    buf: list[np.ndarray] = []
    filled, first, starts = 0, 1, []
    for d, text in enumerate(docs, start=1):
        ids = np.asarray(prefix + tokenizer.encode(text), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
            raise DataError(f"document {d}: token ids outside [0, {tokenizer.vocab_size})")
        pos = 0
        while pos < ids.size:
            if filled == 0:
                first, starts = d, []  # a record starts inside (or at the start of) document d
            elif pos == 0:
                starts.append(filled)
            take = min(chunk_tokens - filled, ids.size - pos)
            buf.append(ids[pos : pos + take])
            filled, pos = filled + take, pos + take
            if filled == chunk_tokens:
                yield np.concatenate(buf), first, starts
                buf, filled = [], 0
    if filled:
        yield np.concatenate(buf), first, starts


# -- writing ---------------------------------------------------------------------------------------


def shard_name(index: int, count: int) -> str:
    return f"train-{index:05d}-of-{count:05d}.arrayrecord"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def content_hash(shards: Sequence[dict]) -> str:
    """sha256 over the shards' names and sha256s, in order."""
    h = hashlib.sha256(b"prepared-v1")
    for s in shards:
        h.update(f"{s['file']}:{s['sha256']}\n".encode())
    return h.hexdigest()


def _local_dir(path: str | os.PathLike, flag: str) -> Path:
    if is_remote(path):
        raise DataError(
            f"{flag} {path}: prepared data must be a local folder (ArrayRecord opens local files; "
            "mount the bucket with gcsfuse)"
        )
    return Path(as_path(path, flag)).expanduser()


def _write_shards(
    out: Path, names: Sequence[str], tokenizer: Tokenizer, train: Sequence[str], chunk: int
) -> tuple[list[int], int, np.dtype]:
    """Writes the records round-robin into ``names`` (temporary names first, renamed when all are
    complete); returns ``(records per shard, train tokens, token dtype)``."""
    from array_record.python.array_record_module import ArrayRecordWriter

    dtype = token_dtype(tokenizer.vocab_size)
    tmp = [out / f".{n}.tmp" for n in names]
    counts, n_tokens = [0] * len(names), 0
    writers = []
    try:
        try:
            for p in tmp:
                writers.append(ArrayRecordWriter(str(p), _WRITER_OPTIONS))
            for r, (tokens, first, starts) in enumerate(_stream_records(tokenizer, train, chunk)):
                writers[r % len(names)].write(encode_record(tokens, first, starts, dtype))
                counts[r % len(names)] += 1
                n_tokens += int(tokens.shape[0])
        finally:
            for w in writers:
                w.close()
        if 0 in counts:
            raise DataError(
                f"--shards {len(names)}: the train split makes only {sum(counts)} records of "
                f"{chunk} tokens; use fewer shards or a smaller --chunk-tokens"
            )
    except BaseException:
        for p in tmp:  # leave nothing half-written behind
            p.unlink(missing_ok=True)
        raise
    for p, n in zip(tmp, names, strict=True):
        os.replace(p, out / n)
    for old in out.glob("train-*-of-*.arrayrecord"):  # shards of a replaced corpus
        if old.name not in names:
            old.unlink()
    return counts, n_tokens, dtype


def prepare_corpus(
    cfg: DataConfig,
    out: str | os.PathLike,
    *,
    shards: int = 1,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    overwrite: bool = False,
) -> dict:
    """Tokenises the train split of ``cfg``'s corpus into ``shards`` ArrayRecord files in ``out``.

    Args:
      cfg: the data config of the runs that will read it (corpus, tokenizer, seed, val_fraction).
      out: a local folder (created); refused if it already holds a manifest unless `overwrite`.
      shards: number of ArrayRecord files (records are dealt round-robin).
      chunk_tokens: C, tokens per record.
      overwrite: replace a prepared corpus already in `out` (its manifest is removed first).

    Returns:
      The manifest (also written to ``out/manifest.json``, last).

    Raises:
      ValueError: `shards` or `chunk_tokens` < 1. DataError: unreadable corpus, unwritable `out`,
        more shards than records.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards: must be an int >= 1, got {shards!r}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: must be an int >= 1, got {chunk_tokens!r}")
    out = _local_dir(out, "--out")
    manifest_path = out / MANIFEST
    if manifest_path.exists() and not overwrite:
        raise DataError(f"{out}: already holds a prepared corpus (pass --overwrite to replace it)")
    docs = load_documents(cfg)
    train, _ = split_documents(docs, cfg.val_fraction, cfg.seed)
    tokenizer = build_tokenizer(cfg, train)
    names = [shard_name(i, shards) for i in range(shards)]
    kind, payload = tokenizer_payload(tokenizer)
    try:
        out.mkdir(parents=True, exist_ok=True)
        manifest_path.unlink(missing_ok=True)  # from here on the folder reads as incomplete
        counts, n_tokens, dtype = _write_shards(out, names, tokenizer, train, chunk_tokens)
        if payload is not None:
            (out / TOKENIZER_FILES[kind]).write_bytes(payload)
        shard_records = [
            {
                "file": n,
                "records": c,
                "bytes": (out / n).stat().st_size,
                "sha256": _sha256_file(out / n),
            }
            for n, c in zip(names, counts, strict=True)
        ]
    except (OSError, RuntimeError) as e:  # ArrayRecord's writer raises RuntimeError
        why = getattr(e, "strerror", None) or one_line(e)
        raise DataError(f"{out}: cannot write the prepared corpus ({why})") from e
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {
            "kind": kind,
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": int(tokenizer.vocab_size),
            "bos_id": tokenizer.bos_id,
            "file": TOKENIZER_FILES.get(kind),
        },
        "corpus": {"source": cfg.corpus, **corpus_fingerprint(docs)},
        "split": {
            "seed": cfg.seed,
            "val_fraction": cfg.val_fraction,
            "train_documents": len(train),
            "train_sha256": corpus_fingerprint(train)["sha256"],
        },
        "tokens": {"train": n_tokens, "dtype": dtype.name},
        "records": {"count": sum(counts), "chunk_tokens": chunk_tokens},
        "shards": shard_records,
        "content_sha256": content_hash(shard_records),
    }
    write_json(manifest_path, manifest)
    return manifest


# -- reading ---------------------------------------------------------------------------------------


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a prepared folder, its structure checked.

    Raises:
      DataError: missing, unreadable, another format or version, or fields missing.
    """
    path = _local_dir(directory, "data.prepared_dir") / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{path}: missing (run `nested-jax prepare-data --config ... --out "
            f"{path.parent}`; an interrupted prepare-data leaves no manifest)"
        )
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable manifest ({one_line(e)})") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        raise DataError(f"{path}: not a version-{VERSION} {FORMAT} manifest")
    try:
        shards = m["shards"]
        ok = (
            isinstance(m["tokenizer"]["fingerprint"], str)
            and isinstance(m["split"]["train_sha256"], str)
            and int(m["tokens"]["train"]) >= 0
            and int(m["records"]["chunk_tokens"]) >= 1
            and isinstance(shards, list)
            and len(shards) >= 1
            and all(isinstance(s["file"], str) and int(s["records"]) >= 0 for s in shards)
            and sum(int(s["records"]) for s in shards) == int(m["records"]["count"])
        )
        np.dtype(m["tokens"]["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: incomplete manifest ({type(e).__name__}: {e})") from e
    if not ok:
        raise DataError(f"{path}: inconsistent manifest (counts or types)")
    return m


def check_manifest(
    manifest: dict,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    train_docs: Sequence[str] | None,
    where: str,
) -> None:
    """Refuses a prepared corpus that would not give the in-process path's batches.

    Raises:
      DataError: one line naming what differs (tokenizer, split seed/fraction, train text).
    """
    tok = manifest["tokenizer"]
    if tok["fingerprint"] != tokenizer.fingerprint or tok.get("bos_id") != tokenizer.bos_id:
        raise DataError(
            f"{where}: tokenizer mismatch: prepared with {tok['fingerprint']}, this run uses "
            f"{tokenizer.fingerprint}; run prepare-data again with this config"
        )
    split = manifest["split"]
    if split["seed"] != cfg.seed or split["val_fraction"] != cfg.val_fraction:
        raise DataError(
            f"{where}: prepared with data.seed={split['seed']}, data.val_fraction="
            f"{split['val_fraction']} (another train split); the config has {cfg.seed}, "
            f"{cfg.val_fraction}"
        )
    if train_docs is not None:
        now = corpus_fingerprint(train_docs)
        if now["documents"] != split["train_documents"] or now["sha256"] != split["train_sha256"]:
            raise DataError(
                f"{where}: prepared from other text ({split['train_documents']} train documents, "
                f"sha256 {split['train_sha256'][:8]}; data.corpus now gives {now['documents']}, "
                f"{now['sha256'][:8]}); run prepare-data again"
            )


class PreparedStream:
    """Random access to the train token stream of a prepared folder.

    ``read(a, b)`` returns ``(tokens, segments)`` = ``int32[b - a]`` each, equal to
    ``TokenStream.tokens[a:b]`` and ``TokenStream.segments[a:b]`` of the in-process path.
    Picklable (grain may copy it into worker processes; readers reopen lazily).
    """

    def __init__(self, directory: str | os.PathLike, manifest: dict) -> None:
        import grain

        self.directory = _local_dir(directory, "data.prepared_dir")
        self.num_tokens = int(manifest["tokens"]["train"])
        self.chunk = int(manifest["records"]["chunk_tokens"])
        self.dtype = np.dtype(manifest["tokens"]["dtype"])
        shards = manifest["shards"]
        self.files = [str(self.directory / s["file"]) for s in shards]
        counts = [int(s["records"]) for s in shards]
        for f, s in zip(self.files, shards, strict=True):
            p = Path(f)
            if not p.is_file():
                raise DataError(f"{p}: missing shard of the prepared corpus (data.prepared_dir)")
            if "bytes" in s and p.stat().st_size != int(s["bytes"]):
                raise DataError(
                    f"{p}: {p.stat().st_size} bytes, the manifest says {s['bytes']} "
                    "(truncated or replaced); run prepare-data again"
                )
        self.num_shards = len(shards)
        self.offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        if 0 in counts:
            # prepare_corpus writes an empty shard only when there are fewer records than shards.
            raise DataError(
                f"{self.files[counts.index(0)]}: shard holds no records (fewer records than "
                "shards); run prepare-data with fewer --shards"
            )
        # "path[0:n]" tells grain the record count, so no reader opens before the first read.
        self.source = grain.sources.ArrayRecordDataSource(
            [f"{f}[0:{c}]" for f, c in zip(self.files, counts, strict=True)]
        )

    def _record(self, r: int) -> tuple[np.ndarray, int, np.ndarray]:
        shard, pos = r % self.num_shards, r // self.num_shards
        where = self.files[shard]
        try:
            raw = self.source[int(self.offsets[shard]) + pos]
        except Exception as e:  # Riegeli raises RuntimeError on hash mismatch / truncation
            raise DataError(f"{where}: unreadable record {pos} ({one_line(e)})") from e
        return _parse_record(raw, self.dtype, where)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, segments)`` of stream positions ``[start, stop)`` (clipped to the stream)."""
        stop = min(stop, self.num_tokens)
        if not 0 <= start < stop:
            return np.zeros((0,), np.int32), np.zeros((0,), np.int32)
        c = self.chunk
        parts = [
            _record_slice(self._record(r), max(start - r * c, 0), min(stop - r * c, c))
            for r in range(start // c, (stop - 1) // c + 1)
        ]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def open_prepared(
    cfg: DataConfig, tokenizer: Tokenizer, train_docs: Sequence[str] | None = None
) -> PreparedStream:
    """The prepared train stream named by ``cfg.prepared_dir``, checked against `cfg`,
    `tokenizer` and (when given) the train documents the in-process path would tokenise.

    Raises:
      DataError: see :func:`read_manifest`, :func:`check_manifest`; a shard missing or of another
        size than the manifest says.
    """
    manifest = read_manifest(cfg.prepared_dir)
    check_manifest(manifest, cfg, tokenizer, train_docs, f"data.prepared_dir {cfg.prepared_dir}")
    return PreparedStream(cfg.prepared_dir, manifest)


def prepared_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer a prepared folder was made with (rebuilt from its file, fingerprint
    checked)."""
    manifest = read_manifest(directory)
    meta = manifest["tokenizer"]
    payload = None
    if meta.get("file"):
        path = _local_dir(directory, "data.prepared_dir") / meta["file"]
        payload = path.read_bytes() if path.is_file() else None
    return tokenizer_from_payload(meta, payload, str(as_path(directory) / (meta.get("file") or "")))


def verify_prepared(directory: str | os.PathLike) -> dict:
    """Re-hashes every shard against the manifest (reads all the data once).

    Raises:
      DataError: a shard is missing or its sha256 differs, in one line naming it.
    """
    manifest = read_manifest(directory)
    folder = _local_dir(directory, "data.prepared_dir")
    for s in manifest["shards"]:
        p = folder / s["file"]
        if not p.is_file():
            raise DataError(f"{p}: missing shard of the prepared corpus")
        if _sha256_file(p) != s["sha256"]:
            raise DataError(f"{p}: sha256 differs from the manifest (corrupted); run prepare-data")
    if content_hash(manifest["shards"]) != manifest["content_sha256"]:
        raise DataError(f"{folder / MANIFEST}: content hash does not match its shard list")
    return manifest


# -- command line ----------------------------------------------------------------------------------


def main(
    argv: Sequence[str] | None,
    load_data_config: Callable[[list[str], list[str]], DataConfig],
) -> int:
    """``nested-jax prepare-data --config F [--set k=v] --out DIR [--shards N] [--chunk-tokens C]
    [--overwrite] [--verify]``.

    Args:
      argv: the arguments after ``prepare-data``.
      load_data_config: ``(yaml paths, --set overrides) -> DataConfig``; the CLI passes the
        training config loader (includes, validation), which lives above this layer.

    Exit codes: 0 done, 1 data error, 2 bad command line or config.
    """
    parser = argparse.ArgumentParser(
        prog="nested-jax prepare-data",
        description="Tokenise the configured corpus once into ArrayRecord shards (set "
        "data.prepared_dir=DIR to train from them).",
    )
    parser.add_argument("--config", action="append", default=[], help="YAML config (repeatable)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="override one field, e.g. --set data.seq_len=512 (repeatable)",
    )
    parser.add_argument("--out", required=True, help="local output folder")
    parser.add_argument("--shards", type=int, default=1, help="number of ArrayRecord files")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    parser.add_argument("--overwrite", action="store_true", help="replace a prepared corpus")
    parser.add_argument(
        "--verify", action="store_true", help="only re-hash an existing --out against its manifest"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        if args.verify:
            m = verify_prepared(args.out)
            print(f"{args.out}: {len(m['shards'])} shards match the manifest")
            return 0
        cfg = load_data_config(args.config, args.overrides)
        m = prepare_corpus(
            cfg,
            args.out,
            shards=args.shards,
            chunk_tokens=args.chunk_tokens,
            overwrite=args.overwrite,
        )
    except DataError as e:
        print(f"prepare-data: data error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # ConfigError, PathError, bad --shards: one line, no traceback
        print(f"prepare-data: config error: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.out}: {m['split']['train_documents']} train documents, {m['tokens']['train']} "
        f"tokens in {m['records']['count']} records, {len(m['shards'])} shards "
        f"(content sha256 {m['content_sha256'][:12]})"
    )
    return 0
