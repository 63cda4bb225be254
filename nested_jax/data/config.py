"""Data configuration: which corpus, which tokenizer, how sequences are packed and batched.

A frozen dataclass validated on construction, so a bad value fails once, at load time, with one line
naming the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_TOKENIZER_KINDS = ("byte", "sentencepiece")
# Each prefetched batch has its own read thread; more than this only adds GIL contention.
_MAX_PREFETCH = 64
# "<family>:<name>" of a generated task (nested_jax.data.task_source); names are identifiers.
_TASK_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*:[A-Za-z_][A-Za-z0-9_]*")


def _check_type(name: str, value: object, kind: type | tuple[type, ...]) -> None:
    # bool is a subclass of int; a YAML `true` must not silently become batch_size=1.
    if isinstance(value, bool) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValueError(f"data.{name}: expected {names}, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes `[batch, seq_len]` training arrays."""

    # "austen" (Jane Austen's six novels, fetched from Debian r-cran-janeaustenr and cached) or a
    # comma-separated list of .txt files and/or folders searched recursively for .txt files.
    corpus: str = "austen"
    # "byte" (UTF-8 bytes + a document separator), "sentencepiece" (BPE trained locally on the
    # train split, cached under data_dir) or a path to a Hugging Face `tokenizer.json`.
    tokenizer: str = "byte"
    # SentencePiece vocabulary size; must be > 0 for "sentencepiece", ignored otherwise.
    vocab_size: int = 0
    # Tokens per training sequence (inputs and targets are both seq_len long).
    seq_len: int = 256
    # Global batch size; each JAX process loads batch_size / process_count rows.
    batch_size: int = 16
    # Fraction of documents held out for validation (split by document, never inside one).
    val_fraction: float = 0.05
    # Seed of the train/validation split, the shuffle order and the tokenizer training sample.
    seed: int = 0
    # Cache directory for downloaded corpora, tokenizers and token arrays;
    # "" means $NESTED_JAX_DATA, or ~/.cache/nested_jax when that is unset.
    data_dir: str = ""
    # A folder written by `nested-jax prepare-data` (ArrayRecord token shards + manifest.json):
    # training batches are read from it instead of tokenising the corpus in the training process
    # (same batches; the manifest must match the tokenizer, seed, val_fraction and train text).
    # "" (the default) tokenises in-process, which suits small corpora.
    prepared_dir: str = ""
    # Training batches read ahead by that many background threads (grain ReadOptions); 0 reads
    # synchronously in the training thread. The iterator state is the same either way.
    prefetch: int = 0
    # A generated task instead of a text corpus: "" (the default) trains on `corpus`; else
    # "<family>:<name>", e.g. "formal:parity" or "mad:in_context_recall" (the families an upper
    # layer registered in nested_jax.data.task_source; `nested-jax train` registers formal and
    # mad). Rows are data.seq_len long; corpus, val_fraction and vocab_size are then unused.
    task: str = ""
    # Options of the task's generator, e.g. {train_lengths: [1, 16], eval_lengths: [17, 30]} for
    # a formal task or {seq_len: 64, vocab_size: 32} for a MAD task (each family checks its keys
    # when the run starts). Values: numbers, bools, strings or lists of ints. Only with data.task.
    task_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_type("corpus", self.corpus, str)
        if not self.corpus.strip():
            raise ValueError("data.corpus: must be 'austen' or a comma-separated list of paths")
        _check_type("tokenizer", self.tokenizer, str)
        if self.tokenizer not in _TOKENIZER_KINDS and not self.tokenizer.endswith(".json"):
            raise ValueError(
                f"data.tokenizer: expected 'byte', 'sentencepiece' or a path to tokenizer.json, "
                f"got {self.tokenizer!r}"
            )
        _check_type("vocab_size", self.vocab_size, int)
        if self.vocab_size < 0:
            raise ValueError(f"data.vocab_size: must be >= 0, got {self.vocab_size}")
        if self.tokenizer == "sentencepiece" and self.vocab_size < 300:
            # Byte fallback alone takes 256 pieces plus the control symbols.
            raise ValueError(
                f"data.vocab_size: sentencepiece needs vocab_size >= 300, got {self.vocab_size}"
            )
        _check_type("seq_len", self.seq_len, int)
        if self.seq_len < 1:
            raise ValueError(f"data.seq_len: must be >= 1, got {self.seq_len}")
        _check_type("batch_size", self.batch_size, int)
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size: must be >= 1, got {self.batch_size}")
        _check_type("val_fraction", self.val_fraction, (float, int))
        if not (math.isfinite(self.val_fraction) and 0.0 <= self.val_fraction < 1.0):
            raise ValueError(f"data.val_fraction: must be in [0, 1), got {self.val_fraction}")
        _check_type("seed", self.seed, int)
        if self.seed < 0:
            raise ValueError(f"data.seed: must be >= 0, got {self.seed}")
        _check_type("data_dir", self.data_dir, str)
        _check_type("prepared_dir", self.prepared_dir, str)
        if self.prepared_dir != self.prepared_dir.strip():
            raise ValueError(
                f"data.prepared_dir: leading/trailing spaces in {self.prepared_dir!r} (a typo?)"
            )
        _check_type("prefetch", self.prefetch, int)
        if not 0 <= self.prefetch <= _MAX_PREFETCH:
            raise ValueError(
                f"data.prefetch: must be in [0, {_MAX_PREFETCH}] batches, got {self.prefetch}"
            )
        self._check_task()

    def _check_task(self) -> None:
        _check_type("task", self.task, str)
        if self.task and not _TASK_PATTERN.fullmatch(self.task):
            raise ValueError(
                "data.task: expected '' (a text corpus) or '<family>:<name>' such as "
                f"'formal:parity' or 'mad:in_context_recall', got {self.task!r}"
            )
        _check_type("task_options", self.task_options, dict)
        for key, value in self.task_options.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise ValueError(f"data.task_options: keys must be identifiers, got {key!r}")
            if not _option_value_ok(value):
                raise ValueError(
                    f"data.task_options.{key}: expected an int, float, bool, str or a list of "
                    f"ints, got {type(value).__name__} {value!r}"
                )
        if not self.task:
            if self.task_options:
                raise ValueError(
                    f"data.task_options: only with data.task (a generated task), got "
                    f"{sorted(self.task_options)} for a text corpus"
                )
            return
        if self.prepared_dir:
            raise ValueError(
                f"data.prepared_dir: a generated task (data.task={self.task!r}) reads no prepared "
                "shards; leave prepared_dir empty"
            )
        if self.tokenizer != "byte":
            raise ValueError(
                f"data.tokenizer: a generated task (data.task={self.task!r}) brings its own token "
                f"ids; leave data.tokenizer at 'byte' (got {self.tokenizer!r})"
            )


def _option_value_ok(value: object) -> bool:
    if isinstance(value, bool | int | float | str):
        return True
    return isinstance(value, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )
