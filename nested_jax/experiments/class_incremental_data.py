"""Classes, passages and batches of the class-incremental experiment, and its settings.

The protocol (classes, chapters, passages, tasks, the label-token classifier) is the docstring
of :mod:`nested_jax.experiments.class_incremental`. Here: :class:`ClassIncrementalSettings`, the
label tokens (class ``c`` is the token ``LABEL_BASE + c`` of the byte vocabulary extended by the
six labels, :data:`VOCAB`), the chapter split per class, passage sampling, and the classification
and LM batches.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from nested_jax.data.corpus import AUSTEN_NOVELS, split_chapters
from nested_jax.data.tokenizers import ByteTokenizer

__all__ = [
    "LABEL_BASE",
    "VOCAB",
    "ClassIncrementalSettings",
    "ClassSplit",
    "chapter_texts",
    "class_order",
    "split_classes",
    "sample_passages",
    "task_classes",
    "classification_batch",
    "lm_batch",
]

LABEL_BASE = ByteTokenizer.SEP_ID + 1  # 257: the label token of class c is LABEL_BASE + c
VOCAB = LABEL_BASE + len(AUSTEN_NOVELS)  # 263
_HEADING = re.compile(r"^\s*(chapter|volume)\s+([0-9]+|[ivxlcdm]+)\.?\s*$", re.IGNORECASE)
_ACCUMULATE = ("sum", "mean")


@dataclasses.dataclass(frozen=True)
class ClassIncrementalSettings:
    """One class-incremental comparison (every arm and seed runs these)."""

    passage_len: int = 128  # P: byte tokens per passage (the T of every batch)
    classes_per_task: int = 2  # classes arriving together; must divide the 6 novels
    permute: bool = False  # seeded permutation of the class order (else AUSTEN_NOVELS order)
    test_fraction: float = 0.25  # of each novel's chapters held out for the test passages
    n_test: int = 64  # test passages per class
    d_model: int = 64  # residual width of every arm
    n_layers: int = 2  # blocks per model
    n_heads: int = 2  # heads per mixer
    batch_size: int = 8  # sequences per step (pretraining and tasks)
    pretrain_steps: int = 300  # LM pretraining steps of each backbone
    pretrain_lr: float = 3e-3  # AdamW peak lr of pretraining (10% warmup, cosine to 10%)
    steps_per_task: int = 100  # fine-tuning / online steps per task
    lr: float = 3e-3  # AdamW lr of fine-tuning (constant after warmup)
    warmup_steps: int = 10  # fine-tuning warmup (once, at the start of task 1)
    weight_decay: float = 0.0  # decoupled AdamW decay of fine-tuning (pretraining: 0.1)
    cms_periods: tuple[int, ...] = (1, 4, 16)  # CMS level periods (steps) of arms 2-4
    online_lr: float = 1.0  # η of the online CMS arm (SGD)
    online_accumulate: str = "mean"  # online arm: mean (η/C per level) or sum (SPEC literal)
    eval_batch: int = 64  # passages per evaluation forward
    data_dir: str = ""  # Austen cache root ("" = $NESTED_JAX_DATA or ~/.cache/nested_jax)

    def __post_init__(self) -> None:
        for name in ("passage_len", "classes_per_task", "n_test", "d_model", "n_layers"):
            _positive_int(self, name)
        for name in ("n_heads", "batch_size", "steps_per_task", "eval_batch"):
            _positive_int(self, name)
        for name in ("pretrain_steps", "warmup_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if self.passage_len < 2:
            raise ValueError(f"passage_len: expected >= 2 byte tokens, got {self.passage_len}")
        if len(AUSTEN_NOVELS) % self.classes_per_task:
            raise ValueError(
                f"classes_per_task: must divide the {len(AUSTEN_NOVELS)} novels, "
                f"got {self.classes_per_task}"
            )
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction: expected in (0, 1), got {self.test_fraction}")
        for name in ("pretrain_lr", "lr", "online_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: expected >= 0, got {self.weight_decay}")
        p = self.cms_periods
        if (
            not isinstance(p, tuple)
            or not p
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in p)
            or list(p) != sorted(set(p))
        ):
            raise ValueError(f"cms_periods: expected increasing positive ints, got {p!r}")
        if self.online_accumulate not in _ACCUMULATE:
            raise ValueError(
                f"online_accumulate: expected one of {_ACCUMULATE}, got {self.online_accumulate!r}"
            )

    @property
    def n_tasks(self) -> int:
        return len(AUSTEN_NOVELS) // self.classes_per_task


def _positive_int(s: object, name: str) -> None:
    v = getattr(s, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {v!r}")


def chapter_texts(lines: Sequence[str]) -> list[str]:
    """The chapters of one novel as plain text: front matter and heading lines (``CHAPTER n``,
    ``VOLUME n``) dropped, every whitespace run collapsed to one space, empty chapters dropped."""
    out = []
    for doc in split_chapters(lines):
        rows = doc.split("\n")
        first = next((i for i, r in enumerate(rows) if _HEADING.match(r)), -1)
        body = " ".join(r for r in rows[first + 1 :] if not _HEADING.match(r))
        text = " ".join(body.split())
        if text:
            out.append(text)
    return out


@dataclasses.dataclass(frozen=True)
class ClassSplit:
    """One class: its novel, its train / test chapters (indices into :func:`chapter_texts`) and
    their byte tokens (int32 arrays)."""

    name: str
    train_chapters: tuple[int, ...]
    test_chapters: tuple[int, ...]
    train: tuple[np.ndarray, ...]
    test: tuple[np.ndarray, ...]


def class_order(seed: int, permute: bool) -> tuple[str, ...]:
    """The novels in class order: :data:`AUSTEN_NOVELS`, or its permutation seeded by ``seed``."""
    if not permute:
        return AUSTEN_NOVELS
    perm = np.random.default_rng([seed, 7]).permutation(len(AUSTEN_NOVELS))
    return tuple(AUSTEN_NOVELS[i] for i in perm)


def split_classes(
    novels: dict[str, Sequence[str]], order: Sequence[str], test_fraction: float, seed: int
) -> list[ClassSplit]:
    """Disjoint train / test chapter sets per class, deterministic in ``seed`` (the protocol:
    :mod:`nested_jax.experiments.class_incremental`).

    Args:
      novels: ``{name: lines}`` (:func:`~nested_jax.data.corpus.load_austen_novels`).
      order: the class order (names in ``novels``).
      test_fraction: share of each novel's chapters held out, in ``(0, 1)``.
      seed: the run's seed (class ``c`` uses the generator seeded ``(seed, c)``).
    """
    tok = ByteTokenizer()
    out = []
    for c, name in enumerate(order):
        if name not in novels:
            raise ValueError(f"order: no novel {name!r} in novels ({sorted(novels)})")
        chapters = chapter_texts(novels[name])
        n = len(chapters)
        n_test = max(1, round(test_fraction * n))
        if n - n_test < 1:
            raise ValueError(f"test_fraction: {test_fraction} leaves no train chapter of {name!r}")
        perm = np.random.default_rng([seed, c]).permutation(n)
        test_idx, train_idx = sorted(perm[:n_test].tolist()), sorted(perm[n_test:].tolist())

        def enc(idx, chapters=chapters):
            return tuple(np.asarray(tok.encode(chapters[i]), np.int32) for i in idx)

        out.append(
            ClassSplit(name, tuple(train_idx), tuple(test_idx), enc(train_idx), enc(test_idx))
        )
    return out


def sample_passages(
    chapters: Sequence[np.ndarray], n: int, length: int, rng: np.random.Generator
) -> np.ndarray:
    """``n`` windows of ``length`` tokens, each inside one chapter, every window equally likely.

    Returns:
      int32 ``[n, length]``.
    """
    sizes = np.asarray([len(c) for c in chapters])
    weights = np.maximum(sizes - length + 1, 0).astype(np.float64)
    if not weights.sum():
        raise ValueError(f"passage_len: {length} is longer than every chapter of the split")
    which = rng.choice(len(chapters), size=n, p=weights / weights.sum())
    out = np.empty((n, length), np.int32)
    for r, d in enumerate(which):
        start = int(rng.integers(0, sizes[d] - length + 1))
        out[r] = chapters[d][start : start + length]
    return out


def task_classes(n_classes: int, per_task: int) -> list[list[int]]:
    """Class indices of each task: ``[[0, 1], [2, 3], [4, 5]]`` for 6 classes, 2 per task."""
    return [list(range(i, i + per_task)) for i in range(0, n_classes, per_task)]


def classification_batch(passages: np.ndarray, classes: np.ndarray) -> dict[str, np.ndarray]:
    """Passages ``[N, P]`` with their classes ``[N]`` as an LM batch whose only scored target is
    the label token ``LABEL_BASE + c`` after the last passage token (the classifier of
    :mod:`nested_jax.experiments.class_incremental`)."""
    passages, classes = np.asarray(passages), np.asarray(classes)
    if passages.ndim != 2 or classes.shape != passages.shape[:1]:
        raise ValueError(
            f"passages, classes: expected [N, P] and [N], got {passages.shape} and {classes.shape}"
        )
    labels = (LABEL_BASE + classes).astype(np.int32)[:, None]
    mask = np.zeros(passages.shape, np.float32)
    mask[:, -1] = 1.0
    targets = np.concatenate([passages[:, 1:], labels], axis=1).astype(np.int32)
    return {"inputs": passages.astype(np.int32), "targets": targets, "loss_mask": mask}


def lm_batch(chapters: Sequence[np.ndarray], batch: int, length: int, rng) -> dict:
    """Next-byte LM batch: windows of ``length + 1`` tokens, every position scored."""
    w = sample_passages(chapters, batch, length + 1, rng)
    mask = np.ones((batch, length), np.float32)
    return {"inputs": w[:, :-1], "targets": w[:, 1:], "loss_mask": mask}
