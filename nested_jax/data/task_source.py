"""Generated tasks as training data: ``data.task = "<family>:<name>"`` instead of a text corpus.

Registry. The generators live above this layer (formal languages and MAD in ``nested_jax.eval``),
so an upper layer registers each family here (:func:`register_task_family`; ``nested-jax train``
and ``eval`` import ``nested_jax.eval.task_families`` first). A family's factory builds, from
``(name, options, seq_len, seed)``, a :class:`GeneratedTask`: its ``vocab_size``, a batch
generator ``batch(rng_or_seed, batch_size, split)`` (``split`` ``"train"`` or ``"validation"``) and
a scorer ``score(logits, batch) -> {"accuracy": ...}``. Unknown families, names and options fail
with one line naming ``data.task`` / ``data.task_options``.

Batches. Every task row is ``data.seq_len`` tokens; a batch is what the text pipeline yields::

    {"inputs", "targets", "segment_ids": int32[b, T], "loss_mask": float32[b, T]}

with ``segment_ids`` all 1 (one example per row; the generators pad rows themselves and the mask
is 0 on padding). Global batch ``g`` of split ``s`` is drawn from its own stream,
``numpy.random.default_rng([seed, s, g])`` (``s`` = 0 train, 1 validation), so

* training batch ``g`` depends only on ``(data.seed, g)``: the grain iterator over
  :class:`TaskBatchSource` (item ``g`` = global batch ``g``) checkpoints as one index and resumes
  with the exact next batch, and the batches are the same for any number of processes (process
  ``p`` of ``P`` keeps rows ``[p b, (p + 1) b)`` of each global batch, ``b = B / P``);
* validation batches come from a disjoint stream (different seed-sequence entropy), the same at
  every evaluation.

Tokenizer. :class:`TaskTokenizer` stands in for a text tokenizer: ``vocab_size`` from the task,
``token_bytes`` all 1 (so "bits per byte" is bits per token), no BOS/EOS, a fingerprint naming the
task and its options, and ``encode`` / ``decode`` of ids written as space-separated integers.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from nested_jax.data.config import DataConfig

Batch = dict[str, np.ndarray]
SPLITS = ("train", "validation")
# Validation batches per evaluation when eval.eval_batches is 0 ("all": a generator has no end).
DEFAULT_EVAL_BATCHES = 8
_BATCH_KEYS = ("inputs", "targets", "loss_mask")


@runtime_checkable
class GeneratedTask(Protocol):
    """What a family's factory returns (one task at one set of options and row length)."""

    vocab_size: int  # ids the rows use: the model needs at least that many embedding rows

    def batch(self, rng_or_seed: Any, batch_size: int, split: str) -> Batch:
        """``{"inputs", "targets": int32[B, T], "loss_mask": float32[B, T]}``, ``T = seq_len``."""
        ...

    def score(self, logits: Any, batch: Batch) -> dict[str, float]:
        """Metrics of predictions ``logits`` (``[B, T, V]`` floats or ``[B, T]`` argmax ids) on
        `batch`, each an average over the batch's scored positions (``loss_mask > 0``)."""
        ...


TaskFactory = Callable[[str, Mapping[str, Any], int, int], GeneratedTask]
TASK_FAMILIES: dict[str, TaskFactory] = {}


def register_task_family(family: str, factory: TaskFactory) -> None:
    """Registers `factory` ``(name, options, seq_len, seed) -> GeneratedTask`` as `family`
    (``data.task = "<family>:<name>"``); an existing entry of that name is replaced."""
    if not isinstance(family, str) or not family.isidentifier():
        raise ValueError(f"family: expected an identifier, got {family!r}")
    if not callable(factory):
        raise ValueError(f"factory: expected a callable, got {type(factory).__name__}")
    TASK_FAMILIES[family] = factory


def parse_task(task: str) -> tuple[str, str]:
    """``"formal:parity" -> ("formal", "parity")`` (ValueError naming ``data.task`` otherwise)."""
    family, sep, name = str(task).partition(":")
    if not (sep and family and name):
        raise ValueError(f"data.task: expected '<family>:<name>', got {task!r}")
    return family, name


def task_family(family: str) -> TaskFactory:
    """The factory registered as `family`.

    Raises:
      ValueError: one line naming ``data.task`` and the registered families.
    """
    if family not in TASK_FAMILIES:
        known = ", ".join(sorted(TASK_FAMILIES)) or "none (import nested_jax.eval.task_families)"
        raise ValueError(f"data.task: unknown task family {family!r}; registered: {known}")
    return TASK_FAMILIES[family]


def build_task(cfg: DataConfig) -> GeneratedTask:
    """The :class:`GeneratedTask` of ``cfg.task`` with ``cfg.task_options`` at ``cfg.seq_len``.

    Raises:
      ValueError: ``cfg.task`` is empty, its family is not registered, or the factory refuses the
        name / options / row length (one line naming the ``data.*`` field).
    """
    if not cfg.task:
        raise ValueError("data.task: empty (a text corpus run has no generated task)")
    family, name = parse_task(cfg.task)
    task = task_family(family)(name, dict(cfg.task_options), cfg.seq_len, cfg.seed)
    vocab = getattr(task, "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"data.task: {cfg.task!r} reports vocab_size {vocab!r}, not an int >= 1")
    return task


def describe_task(cfg: DataConfig) -> str:
    """``"formal:parity"`` or ``"formal:parity {"train_lengths": [1, 16]}"`` (options as JSON)."""
    if not cfg.task_options:
        return cfg.task
    return f"{cfg.task} {canonical_options(cfg.task_options)}"


def canonical_options(options: Mapping[str, Any]) -> str:
    """The options as compact JSON with sorted keys (tuples become lists)."""
    return json.dumps(dict(options), sort_keys=True, separators=(",", ":"))


def task_record(cfg: DataConfig) -> dict:
    """What a task run records where a text run records its corpus fingerprint
    (:func:`nested_jax.data.identity.corpus_fingerprint`): the task, its options and a hash of
    both (``documents`` and ``bytes`` are 0: there is no text)."""
    digest = hashlib.sha256(f"task-v1|{cfg.task}|{canonical_options(cfg.task_options)}".encode())
    return {
        "task": cfg.task,
        "options": json.loads(canonical_options(cfg.task_options)),
        "sha256": digest.hexdigest(),
        "documents": 0,
        "bytes": 0,
    }


# -- batches ---------------------------------------------------------------------------------------


def batch_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of global batch `index` of `split`: ``default_rng([seed, split_id, index])``
    (independent streams for every batch and split)."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    return np.random.default_rng([int(seed), SPLITS.index(split), int(index)])


def global_batch(
    task: GeneratedTask, seed: int, split: str, index: int, batch_size: int, seq_len: int,
    vocab_size: int,
) -> Batch:  # fmt: skip
    """Global batch `index` of `split`, checked, with ``segment_ids`` (all 1) added.

    Returns:
      ``{"inputs", "targets", "segment_ids": int32[B, T], "loss_mask": float32[B, T]}``.
    Raises:
      ValueError: the generator returned other keys, shapes or ids outside ``[0, vocab_size)``.
    """
    raw = task.batch(batch_rng(seed, split, index), batch_size, split)
    shape = (batch_size, seq_len)
    out: Batch = {}
    for key in _BATCH_KEYS:
        value = np.asarray(raw.get(key)) if isinstance(raw, Mapping) else None
        if value is None or value.shape != shape:
            got = None if value is None else value.shape
            raise ValueError(f"data.task: the generator's {key!r} is {got}, expected {shape}")
        out[key] = value.astype(np.float32 if key == "loss_mask" else np.int32)
    for key in ("inputs", "targets"):
        if out[key].min() < 0 or out[key].max() >= vocab_size:
            raise ValueError(f"data.task: {key} ids outside [0, {vocab_size}) from the generator")
    out["segment_ids"] = np.ones(shape, np.int32)
    return out


def _rows(batch: Batch, process_index: int, local_batch: int) -> Batch:
    start = process_index * local_batch
    return {k: v[start : start + local_batch] for k, v in batch.items()}


class TaskBatchSource:
    """Endless random-access source of this process's training batches: item ``g`` is rows
    ``[p b, (p + 1) b)`` of global training batch ``g`` (module docstring), a function of
    ``(seed, g)`` alone, so a grain iterator over it resumes exactly from its saved index.

    Args:
      task: the generated task.
      seed: ``data.seed``.
      global_batch: B; local_batch ``b = B / process_count``.
      seq_len: T.
      process_index, process_count: this JAX process and the number of processes.
    """

    def __init__(
        self, task: GeneratedTask, seed: int, global_batch: int, seq_len: int,
        process_index: int, process_count: int,
    ) -> None:  # fmt: skip
        self.task = task
        self.seed = seed
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.seq_len = seq_len
        self.process_index = process_index

    def __len__(self) -> int:
        return sys.maxsize  # endless: every index is a fresh batch

    def __getitem__(self, g: int) -> Batch:
        if int(g) < 0:
            raise IndexError(f"batch index {g} is negative")
        full = global_batch(
            self.task,
            self.seed,
            "train",
            int(g),
            self.global_batch,
            self.seq_len,
            self.task.vocab_size,
        )
        return _rows(full, self.process_index, self.local_batch)


def validation_batches(
    task: GeneratedTask, cfg: DataConfig, count: int, process_index: int, process_count: int
) -> list[Batch]:
    """Global validation batches ``0 .. count - 1`` of `task` (this process's rows of each): the
    same held-out rows at every evaluation, drawn from a stream disjoint from training's."""
    local = cfg.batch_size // process_count
    return [
        _rows(
            global_batch(
                task, cfg.seed, "validation", i, cfg.batch_size, cfg.seq_len, task.vocab_size
            ),
            process_index,
            local,
        )
        for i in range(count)
    ]


# -- the tokenizer of a task run -------------------------------------------------------------------


class TaskTokenizer:
    """The :class:`~nested_jax.data.tokenizers.Tokenizer` of a task run: ids ``0 .. vocab_size-1``
    written as space-separated integers ("3 10 10 2").

    ``token_bytes`` is 1 for every id, so bits per byte is bits per token; ``bos_id`` and
    ``eos_id`` are None (rows carry their own BOS / QUERY ids). The fingerprint names the task,
    its options and the vocabulary size, so a workdir's saved record identifies the task.

    Args:
      task: ``data.task`` (``"<family>:<name>"``).
      vocab_size: ids of the task.
      options: ``data.task_options``.
    """

    def __init__(self, task: str, vocab_size: int, options: Mapping[str, Any] | None = None):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size: expected an int >= 1, got {vocab_size!r}")
        self.task = str(task)
        self.options = json.loads(canonical_options(options or {}))
        self.vocab_size = vocab_size
        self.bos_id = None
        self.eos_id = None
        self.token_bytes = np.ones((vocab_size,), np.int32)
        self.fingerprint = (
            f"task-v1:{self.task}:{canonical_options(self.options)}:vocab{self.vocab_size}"
        )

    def encode(self, text: str) -> list[int]:
        """``"3 10 2" -> [3, 10, 2]``.

        Raises:
          ValueError: naming ``text`` for a word that is not an id in ``[0, vocab_size)``.
        """
        if not isinstance(text, str):
            raise ValueError(f"text: expected str, got {type(text).__name__}")
        ids = []
        for word in text.split():
            if not word.isdigit() or int(word) >= self.vocab_size:
                raise ValueError(
                    f"text: {word!r} is not a token id in [0, {self.vocab_size}) of {self.task}"
                )
            ids.append(int(word))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """``[3, 10, 2] -> "3 10 2"`` (any integers, unchecked)."""
        return " ".join(str(int(i)) for i in np.asarray(list(ids)).ravel())


def task_tokenizer(cfg: DataConfig, task: GeneratedTask) -> TaskTokenizer:
    """The :class:`TaskTokenizer` of ``cfg.task`` (vocabulary from `task`)."""
    return TaskTokenizer(cfg.task, task.vocab_size, cfg.task_options)
