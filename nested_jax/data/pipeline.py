"""Grain input pipeline: tokenize → pack → shuffle by (seed, epoch) → shard by process → batch.

Packing. Documents are tokenized, each prefixed with the tokenizer's separator ``bos_id``, and
concatenated into one stream. Window ``w`` is the ``seq_len + 1`` tokens starting at ``w * seq_len``
(stride ``seq_len``, so every token after the first is a target exactly once); it gives
``inputs = window[:-1]`` and ``targets = window[1:]``. ``segment_ids`` numbers the documents inside
a row from 1 (0 = padding); ``loss_mask[t] = 1`` iff the target at ``t`` is real text of the same
document as the input at ``t``: the first token of a document is never predicted from the previous
one, and padding is never scored.

Order. Training windows form an infinite stream of epochs; epoch ``e`` visits the windows in the
permutation drawn from ``numpy.random.default_rng([seed, e])`` and drops the ``W mod batch_size``
windows left over, so every global batch is full. Global batch ``g`` holds stream elements
``[g*B, (g+1)*B)``; JAX process ``p`` of ``P`` loads rows ``[p*B/P, (p+1)*B/P)`` of it. The global
batch is therefore the same for any process count (1-process and 4-process runs see the same data).

State. The iterator is a grain ``DatasetIterator``; its state is the next batch index (small JSON),
saved with ``grain.checkpoint.CheckpointSave`` or ``get_state()``; restoring it reproduces the exact
next batch.

Sources. By default the train documents are tokenised in this process (cached under ``data_dir``).
With ``data.prepared_dir`` the same token stream is read from the ArrayRecord shards written by
``nested-jax prepare-data`` (:mod:`nested_jax.data.prepared`); windows, order, sharding and state
are unchanged, so both give the same batches and a checkpoint of one resumes the other.
``data.prefetch`` reads that many batches ahead in grain threads (same batches, same state).

Generated tasks. With ``data.task`` (``"formal:parity"``, ...) there is no corpus: the training
iterator yields the task's batches (global batch ``g`` drawn from ``(seed, g)``; same keys and
shapes, same checkpointable index state), the evaluation batches are held-out task batches and
the tokenizer is the task's (:mod:`nested_jax.data.task_source`).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np
from etils import epath

from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import (
    DataError,
    load_documents,
    resolve_data_dir,
    split_documents,
    write_cache_bytes,
)
from nested_jax.data.identity import corpus_fingerprint
from nested_jax.data.prepared import PreparedStream, open_prepared, prepared_tokenizer
from nested_jax.data.task_source import (
    DEFAULT_EVAL_BATCHES,
    TaskBatchSource,
    build_task,
    task_record,
    task_tokenizer,
    validation_batches,
)
from nested_jax.data.tokenizers import Tokenizer, build_tokenizer
from nested_jax.files import as_path

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class TokenStream:
    """Concatenated token ids of a document list; ``doc_lengths[i]`` tokens belong to document i."""

    tokens: np.ndarray  # int32[N]
    doc_lengths: np.ndarray  # int64[num_docs], sums to N

    @property
    def segments(self) -> np.ndarray:
        """int32[N]: 1-based document index of every token."""
        return np.repeat(
            np.arange(1, len(self.doc_lengths) + 1, dtype=np.int32), self.doc_lengths
        ).astype(np.int32)


_MEMO: dict[str, TokenStream] = {}
_MEMO_LOCK = threading.Lock()


def _docs_key(tokenizer: Tokenizer, docs: Sequence[str]) -> str:
    h = hashlib.sha256(
        f"tokens-v1|{tokenizer.fingerprint}|{tokenizer.bos_id}|{len(docs)}|".encode()
    )
    for d in docs:
        h.update(hashlib.sha256(d.encode("utf-8")).digest())
    return h.hexdigest()[:24]


def tokenize_documents(
    tokenizer: Tokenizer, docs: Sequence[str], cache_dir: str | os.PathLike | None = None
) -> TokenStream:
    """Tokenize ``docs`` (each prefixed with ``tokenizer.bos_id`` when it has one), cached.

    The result is memoised in-process and, when ``cache_dir`` is given, stored there as
    ``<key>.npz`` (atomic write) keyed by the tokenizer fingerprint and the document texts.
    """
    if not docs:
        raise DataError("no documents to tokenize")
    key = _docs_key(tokenizer, docs)
    with _MEMO_LOCK:
        if key in _MEMO:
            return _MEMO[key]
    path = as_path(cache_dir) / f"{key}.npz" if cache_dir is not None else None
    stream = None
    if path is not None and path.is_file():
        try:
            with path.open("rb") as f, np.load(f) as z:  # a file object: path may be a URL
                stream = TokenStream(
                    z["tokens"].astype(np.int32), z["doc_lengths"].astype(np.int64)
                )
        except Exception as e:  # numpy raises several types on truncated/corrupt archives
            raise DataError(
                f"{path}: unreadable token cache ({type(e).__name__}); delete it"
            ) from e
        if stream.tokens.shape[0] != int(stream.doc_lengths.sum()):
            raise DataError(f"{path}: inconsistent token cache; delete it")
    if stream is None:
        prefix = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        pieces = [np.asarray(prefix + tokenizer.encode(d), dtype=np.int32) for d in docs]
        stream = TokenStream(
            np.concatenate(pieces), np.asarray([len(p) for p in pieces], dtype=np.int64)
        )
        if path is not None:
            buf = io.BytesIO()
            # uint16 halves the file for vocabularies that fit (byte, most BPEs).
            small = tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1
            np.savez(
                buf,
                tokens=stream.tokens.astype(np.uint16 if small else np.int32),
                doc_lengths=stream.doc_lengths,
            )
            write_cache_bytes(path, buf.getvalue())
    if stream.tokens.size and (
        stream.tokens.min() < 0 or stream.tokens.max() >= tokenizer.vocab_size
    ):
        raise DataError("token ids outside [0, vocab_size): tokenizer and cache disagree")
    with _MEMO_LOCK:
        if len(_MEMO) >= 8:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = stream
    return stream


class _InMemory:
    """``read(a, b)`` over a :class:`TokenStream` (segments computed once)."""

    def __init__(self, stream: TokenStream) -> None:
        self.tokens = stream.tokens
        self.segments = stream.segments
        self.num_tokens = int(stream.tokens.shape[0])

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens[start:stop], self.segments[start:stop]


class PackedWindows:
    """Random access to the packed ``seq_len + 1`` windows of a token stream.

    Args:
      stream: the tokenized documents, in memory (:class:`TokenStream`) or prepared on disk
        (:class:`~nested_jax.data.prepared.PreparedStream`: the same tokens and segments).
      seq_len: T; windows start every T tokens and hold T + 1 tokens.
      pad_last: keep a final partial window (padded with id 0, segment 0) instead of dropping it.
    """

    def __init__(self, stream: TokenStream | PreparedStream, seq_len: int, pad_last: bool) -> None:
        self.stream = _InMemory(stream) if isinstance(stream, TokenStream) else stream
        self.seq_len = seq_len
        n = self.stream.num_tokens
        # Each window needs at least one (input, target) pair: start w*T must be < n - 1.
        self.num_windows = (
            max(0, math.ceil((n - 1) / seq_len)) if pad_last else max(0, (n - 1) // seq_len)
        )

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, w: int) -> Batch:
        """One row: inputs/targets/segment_ids int32[T], loss_mask float32[T]."""
        if not 0 <= w < self.num_windows:
            raise IndexError(f"window {w} out of range [0, {self.num_windows})")
        t = self.seq_len
        start = w * t
        tok = np.zeros((t + 1,), np.int32)
        seg = np.zeros((t + 1,), np.int32)
        piece, s = self.stream.read(start, start + t + 1)
        tok[: piece.shape[0]] = piece
        # Renumber documents inside the row from 1; documents are contiguous so this is a shift.
        seg[: s.shape[0]] = s - s[0] + 1
        mask = (seg[1:] == seg[:-1]) & (seg[1:] > 0)
        return {
            "inputs": tok[:-1],
            "targets": tok[1:],
            "segment_ids": seg[:-1],
            "loss_mask": mask.astype(np.float32),
        }


class _ShuffledShardSource:
    """Infinite random-access source of this process's rows, in global-batch order.

    Local element ``i`` is row ``j = i mod b`` of local batch ``g = i div b``; it is global stream
    element ``k = g*B + p*b + j``; in epoch ``e = k div (S*B)`` it is window
    ``perm_e[k mod (S*B)]``.
    """

    def __init__(
        self,
        windows: PackedWindows,
        global_batch: int,
        process_index: int,
        process_count: int,
        seed: int,
    ) -> None:
        self.windows = windows
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.process_index = process_index
        self.seed = seed
        self.steps_per_epoch = len(windows) // global_batch
        self.per_epoch = self.steps_per_epoch * global_batch
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # Picklable for grain worker processes: a lock cannot be copied, permutations are redrawn.
        return {**self.__dict__, "_perms": {}, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __len__(self) -> int:
        return sys.maxsize  # endless: epochs repeat with fresh permutations

    def permutation(self, epoch: int) -> np.ndarray:
        """Window order of ``epoch`` (depends only on seed, epoch and the number of windows)."""
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
                # Reads move forward through epochs: keep only the current and the next one.
                self._perms = {e: p for e, p in self._perms.items() if e > epoch - 1}
                self._perms[epoch] = perm
            return perm

    def __getitem__(self, i: int) -> Batch:
        g, j = divmod(int(i), self.local_batch)
        k = g * self.global_batch + self.process_index * self.local_batch + j
        epoch, r = divmod(k, self.per_epoch)
        return self.windows[int(self.permutation(epoch)[r])]


def _process_args(
    cfg: DataConfig, process_index: int | None, process_count: int | None
) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            "process_index/process_count: need 0 <= index < count, "
            f"got {process_index}/{process_count}"
        )
    if cfg.batch_size % process_count:
        raise ValueError(
            f"data.batch_size: {cfg.batch_size} is not divisible by process_count {process_count}"
        )
    return process_index, process_count


def _token_cache_dir(cfg: DataConfig) -> epath.Path:
    return resolve_data_dir(cfg.data_dir) / "tokens"


def train_windows(
    cfg: DataConfig, tokenizer: Tokenizer, train_docs: Sequence[str] | None
) -> PackedWindows:
    """The packed training windows (full windows only) and a check that one global batch fits.

    With ``cfg.prepared_dir`` the tokens come from the prepared shards
    (:func:`~nested_jax.data.prepared.open_prepared`, checked against `cfg`, `tokenizer` and,
    when given, `train_docs`); otherwise `train_docs` are tokenised here (token cache in
    ``data_dir``).
    """
    if cfg.prepared_dir:
        stream: TokenStream | PreparedStream = open_prepared(cfg, tokenizer, train_docs)
    elif train_docs is None:
        raise ValueError("train_docs: required unless data.prepared_dir is set")
    else:
        stream = tokenize_documents(tokenizer, train_docs, _token_cache_dir(cfg))
    windows = PackedWindows(stream, cfg.seq_len, False)
    if len(windows) < cfg.batch_size:
        raise DataError(
            f"train split packs into {len(windows)} sequences of {cfg.seq_len + 1} tokens, fewer "
            f"than data.batch_size={cfg.batch_size}: use more text or smaller seq_len/batch_size"
        )
    return windows


def steps_per_epoch(cfg: DataConfig, tokenizer: Tokenizer, train_docs: Sequence[str] | None) -> int:
    """Global batches per training epoch (leftover windows are dropped each epoch)."""
    if cfg.task:
        raise ValueError(f"data.task: {cfg.task!r} is generated without end (no epochs)")
    return len(train_windows(cfg, tokenizer, train_docs)) // cfg.batch_size


def read_options(prefetch: int) -> grain.ReadOptions:
    """``data.prefetch`` as grain read options: ``prefetch`` batches in flight, one thread each.

    0 reads synchronously (no threads), which grain recommends for data already in memory. The
    iterator state (the next batch index) does not depend on it.
    """
    return grain.ReadOptions(num_threads=prefetch, prefetch_buffer_size=prefetch)


def make_train_iterator(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    train_docs: Sequence[str] | None,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.DatasetIterator:
    """Endless, deterministic, checkpointable iterator of this process's training batches.

    Args:
      cfg: data config (seq_len T, global batch_size B, seed, data_dir for the token cache,
        prepared_dir for pre-tokenised shards, prefetch).
      tokenizer: from :func:`build_tokenizer` (must be the prepared corpus' one, if any).
      train_docs: training documents; with ``cfg.prepared_dir`` they are only checked against
        the manifest (``None`` skips that check).
      process_index, process_count: this JAX process and the number of processes
        (default ``jax.process_index()``/``jax.process_count()``); B must divide by the count.

    Returns:
      A grain ``DatasetIterator`` yielding ``{"inputs", "targets", "segment_ids": int32[b, T],
      "loss_mask": float32[b, T]}`` with ``b = B / process_count``. ``get_state()/set_state()``
      and ``grain.checkpoint.CheckpointSave/CheckpointRestore`` restore the exact next batch.
      The batches and the state are the same with and without ``prepared_dir`` or ``prefetch``.
      With ``cfg.task`` the batches are the generated task's (`tokenizer` and `train_docs`
      unused; :class:`~nested_jax.data.task_source.TaskBatchSource`).
    """
    process_index, process_count = _process_args(cfg, process_index, process_count)
    if cfg.task:
        source = TaskBatchSource(
            build_task(cfg), cfg.seed, cfg.batch_size, cfg.seq_len, process_index, process_count
        )
        ds = grain.MapDataset.source(source)
        return iter(ds.to_iter_dataset(read_options=read_options(cfg.prefetch)))
    windows = train_windows(cfg, tokenizer, train_docs)
    source = _ShuffledShardSource(windows, cfg.batch_size, process_index, process_count, cfg.seed)
    ds = grain.MapDataset.source(source).batch(source.local_batch, drop_remainder=True)
    return iter(ds.to_iter_dataset(read_options=read_options(cfg.prefetch)))


def make_eval_batches(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    val_docs: Sequence[str],
    *,
    max_batches: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> list[Batch]:
    """All validation windows in corpus order, as this process's share of fixed-shape batches.

    The final partial window is padded, and the final global batch is filled with all-padding rows
    (``loss_mask`` 0), so every batch has shape ``[batch_size / process_count, seq_len]`` and every
    process gets the same number of batches.

    Args:
      cfg, tokenizer, val_docs: as for :func:`make_train_iterator`.
      max_batches: keep only the first ``max_batches`` global batches (``None``: all).
      process_index, process_count: as for :func:`make_train_iterator`.

    Returns:
      A list of batches (dicts of numpy arrays, same keys as training batches).

    With ``cfg.task``: ``max_batches`` (default
    :data:`~nested_jax.data.task_source.DEFAULT_EVAL_BATCHES`) held-out batches of the task
    (`tokenizer` and `val_docs` unused).
    """
    process_index, process_count = _process_args(cfg, process_index, process_count)
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches: must be >= 1 or None, got {max_batches}")
    if cfg.task:
        count = DEFAULT_EVAL_BATCHES if max_batches is None else max_batches
        return validation_batches(build_task(cfg), cfg, count, process_index, process_count)
    if not val_docs:
        raise DataError("validation split is empty (data.val_fraction is 0 or the corpus is tiny)")
    windows = PackedWindows(
        tokenize_documents(tokenizer, val_docs, _token_cache_dir(cfg)), cfg.seq_len, True
    )
    if len(windows) == 0:
        raise DataError("validation split has fewer than 2 tokens")
    gb, lb = cfg.batch_size, cfg.batch_size // process_count
    n_batches = math.ceil(len(windows) / gb)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    t = cfg.seq_len
    batches = []
    for g in range(n_batches):
        rows = []
        for j in range(lb):
            w = g * gb + process_index * lb + j
            if w < len(windows):
                rows.append(windows[w])
            else:
                rows.append(
                    {
                        "inputs": np.zeros((t,), np.int32),
                        "targets": np.zeros((t,), np.int32),
                        "segment_ids": np.zeros((t,), np.int32),
                        "loss_mask": np.zeros((t,), np.float32),
                    }
                )
        batches.append({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    return batches


@dataclass(frozen=True)
class DataBundle:
    """Everything a run needs from the data side."""

    tokenizer: Tokenizer
    train_docs: list[str]
    val_docs: list[str]
    corpus: dict  # corpus_fingerprint() of all documents in corpus order (task: task_record())
    task: Any = None  # the GeneratedTask of data.task (None: a text corpus)


def prepare_data(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> DataBundle:
    """Load the corpus, split it by document and build the tokenizer (trained on train docs).

    Args:
      cfg: the data config.
      tokenizer: use this tokenizer (a workdir's saved one) instead of building it from `cfg`;
        without one, a ``cfg.prepared_dir``'s tokenizer is used (the one its tokens were made
        with), else one is built from `cfg`.

    With ``cfg.task`` nothing is read: the bundle holds the task, its
    :class:`~nested_jax.data.task_source.TaskTokenizer`, no documents and the task record as
    ``corpus``. A given `tokenizer` must be that task's (same fingerprint).

    Raises:
      ValueError: ``cfg.task`` names an unregistered family / unknown task / bad options.
      DataError: the corpus cannot be read, or `tokenizer` belongs to another task.
    """
    if cfg.task:
        task = build_task(cfg)
        tok = task_tokenizer(cfg, task)
        if tokenizer is not None and tokenizer.fingerprint != tok.fingerprint:
            raise DataError(
                f"data.task: the saved tokenizer {tokenizer.fingerprint} is not the one of "
                f"{tok.fingerprint}"
            )
        return DataBundle(tok, [], [], task_record(cfg), task=task)
    docs = load_documents(cfg)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    if tokenizer is None and cfg.prepared_dir:
        tokenizer = prepared_tokenizer(cfg.prepared_dir)
    if tokenizer is None:
        tokenizer = build_tokenizer(cfg, train_docs)
    return DataBundle(tokenizer, train_docs, val_docs, corpus_fingerprint(docs))


def unigram_byte_entropy(docs: Sequence[str]) -> float:
    """Entropy in bits/byte of the corpus' byte unigram distribution: ``-sum_b p_b log2 p_b``.

    The bits/byte a model reaches by knowing only byte frequencies; a baseline for LM results.
    """
    counts = np.zeros((256,), np.int64)
    for d in docs:
        counts += np.bincount(np.frombuffer(d.encode("utf-8"), np.uint8), minlength=256)
    total = counts.sum()
    if total == 0:
        raise DataError("cannot compute byte entropy of empty documents")
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())
