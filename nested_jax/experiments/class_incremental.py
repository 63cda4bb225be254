"""Class-incremental continual learning on real text: which novel is a passage from?

    python -m nested_jax.experiments.class_incremental --out runs/class_incremental [--quick]
        [--scale cpu|gpu] [--seeds 0 1] [--arms transformer hope ...] [--steps-per-task N]
        [--passage-len P] [--permute]

The protocol of the Hope paper's §9.1 class-incremental experiments (CLINC, Banking, DBpedia
there), at CPU size on the six Austen novels (:func:`nested_jax.data.corpus.load_austen_novels`).
Writes ``<out>/class_incremental.{json,md,png}`` and prints the Markdown; each finished (arm,
seed) is kept in ``<out>/rows/<arm>-seed<k>.json`` and reused by a re-run with equal settings.

**Classes and passages.** Class ``c`` is a novel. Its chapters (front matter, ``CHAPTER n`` and
``VOLUME n`` heading lines dropped, every whitespace run collapsed to one space, so no layout or
title cue is left) are split per seed into disjoint sets: ``max(1, round(test_fraction · n))``
test chapters drawn by a permutation seeded with ``(seed, c)``, the rest train chapters. A passage
is ``P`` consecutive UTF-8 byte tokens (:class:`~nested_jax.data.tokenizers.ByteTokenizer`) of one
chapter: chapter ``d`` drawn with probability ``∝ len_d − P + 1``, then a uniform offset, so every
window of the split is equally likely. Test passages (``n_test`` per class) come from test chapters
only, training passages and the LM pretraining text from train chapters only (no test text is ever
trained on).

**Tasks.** The classes, in :data:`~nested_jax.data.corpus.AUSTEN_NOVELS` order (or a permutation
seeded by the seed, ``--permute``), arrive ``classes_per_task`` at a time: with 2, task ``i``
holds classes ``2i, 2i+1`` (3 tasks). Training on task ``i`` sees only its own classes.

**Classifier: the LM shell itself.** Class ``c`` (its position in the class order) has the label
token ``ℓ_c = 257 + c`` (vocabulary 263: bytes, the separator 256, six labels). An example is the
passage ``x_1..x_P`` followed by its label: ``inputs = x_{1..P}``, ``targets = (x_{2..P}, ℓ_c)``,
``loss_mask = e_P`` — the loss is the full-vocabulary cross-entropy at the last position only.
After task ``i`` the prediction is class-incremental (no task id at test time)::

    ĉ(x) = argmax_{c < n_i} z_P(x)[ℓ_c],     n_i = classes_per_task · (i + 1) classes seen so far

**Metrics** (per seed; then mean ± sample std over seeds). ``A[i, j]``: accuracy on task ``j``'s
test passages (both classes, ``n_test`` each), classified among the ``n_i`` seen classes, after
training on task ``i`` (``j ≤ i``; NaN above)::

    ā_i = (1/(i+1)) Σ_{j≤i} A[i, j]                            average accuracy after task i
    F   = (1/(N−1)) Σ_{j<N−1} ( max_{j≤i<N−1} A[i, j] − A[N−1, j] )     average forgetting
    chance after task i = 1 / n_i

``A_task`` is the same with the prediction restricted to task ``j``'s own classes (task-
incremental; it separates a lost representation from a head biased towards the newest classes).

**Arms.** Same shell (``d_model``, ``n_layers``, ``n_heads``), byte vocabulary + labels.

1. ``transformer``: Transformer++ pretrained as an LM on the train chapters of all six novels
   (``pretrain_steps`` AdamW steps, next-byte loss), then fine-tuned task after task, all weights,
   AdamW (``lr`` after ``warmup_steps``, constant; global-norm clipping at 1; one optimizer state
   carried across tasks).
2. ``hope_attention``: the same pretrained transformer converted (SPEC §3.4,
   :func:`~nested_jax.train.convert.convert_ffn_to_cms`: the SwiGLU FFN copied into every CMS
   level; variant ``independent``, uniform mixing, so the converted model computes the
   transformer's function exactly — the difference is recorded as ``conversion_max_abs``), then
   fine-tuned like (1) with the CMS in pretrain mode: level ``ℓ`` takes an AdamW step every
   ``C^(ℓ)`` optimizer steps from the gradients summed since its last step (``cms_periods``; every
   other weight every step; :func:`~nested_jax.optim.multifreq.multi_frequency`).
3. ``hope_attention_online``: the same converted model, but the CMS levels are the only learners
   during the task sequence — attention, embeddings (so the label rows), norms and the mixing
   weights stay at their pretrained / converted values — updated by the online rule of SPEC §3.3
   with SGD from the local surprise of the label loss. With ``L_n`` the mean label loss of update
   step ``n`` (``batch_size`` passages of ``P`` tokens: the "chunk" of the rule is one batch of
   independent passages, and periods count update steps)::

       A_ℓ ← A_ℓ + ∂L_n/∂θ_ℓ ;   at n ≡ 0 (mod C^(ℓ)):  θ_ℓ ← θ_ℓ − η · A_ℓ / C^(ℓ) ;  A_ℓ ← 0

   (``online_accumulate="mean"``: a slow level steps with the period's mean gradient, so it really
   is slower; ``"sum"`` is SPEC's literal ``Σ η g``, under which a slow level moves as far per
   token as the fast one, only in lumps). Why not :func:`nested_jax.eval.continual.stream_tokens`:
   its stream is one long sequence scored at every token — attention would then read earlier
   passages and their labels (in-context learning, not CMS), and the label loss would be 1/P of
   the signal. Passages are evaluated with the weights frozen.
4. ``hope``: Hope (SPEC §3.2, self-modifying memories + a sequential CMS at ``cms_periods``)
   pretrained like (1) on the same text (its CMS in pretrain mode, as Hope always trains here),
   then fine-tuned exactly like (1). Its in-context memories start fresh with every passage.

The converted arms hold ``k`` copies of the FFN, so more parameters than (1) (the table gives
the counts). Every arm of a seed shares the seed's split, class order, test passages and training
batches; (1)–(3) share one pretrained transformer, (4) its own pretrained Hope.

**Choices fixed before any forgetting run** (CPU size, seed 0, task 1 only): the
fine-tuning ``lr = 3e-3`` (the fine-tuned transformer's task-1 test accuracy after 100 steps: 0.66
at 3e-3, 0.60 at 1e-3; more steps or a batch of 16 with 600 pretraining steps stayed at 0.62–0.73,
so the CPU size keeps 100 steps); the online ``η = 1.0`` (the lowest task-1 *training* label loss,
last 10 and last 30 of 100 steps, among ``{0.1, 0.3, 1, 3}``: 1.064, 1.035, 1.029, 1.033).

**Scales.** ``cpu`` (default: d_model 64, 2 layers, P = 128, batch 8, 300 pretraining steps, 100
steps per task), ``gpu`` (d_model 256, 4 layers, P = 256, batch 32, 3000 / 400 steps; not run
here), ``--quick`` (tiny, a smoke run of the machinery).

Results (CPU size, seeds 0 and 1): ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from nested_jax.data.corpus import AUSTEN_NOVELS, load_austen_novels, split_chapters
from nested_jax.data.tokenizers import ByteTokenizer
from nested_jax.experiments._training import add_scalar_flags, cached_row, scalar_values
from nested_jax.files import write_json

__all__ = [
    "ARMS",
    "LABEL_BASE",
    "VOCAB",
    "SCALES",
    "ClassIncrementalSettings",
    "ClassSplit",
    "chapter_texts",
    "class_order",
    "split_classes",
    "sample_passages",
    "task_classes",
    "classification_batch",
    "lm_batch",
    "predict_seen",
    "accuracy_rows",
    "average_accuracy",
    "forgetting",
    "chance",
    "model_config",
    "run_arm",
    "run",
    "summarize",
    "verdict",
    "markdown_table",
    "plot",
    "main",
]

ARMS = ("transformer", "hope_attention", "hope_attention_online", "hope")
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


SCALES = {
    "cpu": ClassIncrementalSettings(),
    "gpu": ClassIncrementalSettings(
        passage_len=256,
        n_test=200,
        d_model=256,
        n_layers=4,
        n_heads=4,
        batch_size=32,
        pretrain_steps=3000,
        pretrain_lr=1e-3,
        steps_per_task=400,
        lr=3e-4,
        warmup_steps=20,
        eval_batch=200,
    ),
    "quick": ClassIncrementalSettings(
        passage_len=16,
        n_test=4,
        d_model=16,
        n_layers=1,
        n_heads=2,
        batch_size=4,
        pretrain_steps=2,
        steps_per_task=2,
        warmup_steps=1,
        cms_periods=(1, 2),
        eval_batch=8,
    ),
}


# ---------------------------------------------------------------------------------------- data


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
    """Disjoint train / test chapter sets per class (module docstring), deterministic in ``seed``.

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
    the label token ``LABEL_BASE + c`` after the last passage token (module docstring)."""
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


# ------------------------------------------------------------------------------------- metrics


def predict_seen(last_logits: np.ndarray, n_seen: int) -> np.ndarray:
    """Class ``argmax_{c < n_seen} z[LABEL_BASE + c]`` of each row of ``last_logits [N, V]``."""
    z = np.asarray(last_logits)
    if z.ndim != 2 or z.shape[1] < LABEL_BASE + n_seen or n_seen < 1:
        raise ValueError(
            f"last_logits: expected [N, V >= {LABEL_BASE + max(n_seen, 1)}] for n_seen={n_seen}, "
            f"got {z.shape}"
        )
    return np.argmax(z[:, LABEL_BASE : LABEL_BASE + n_seen], axis=1)


def accuracy_rows(
    predict: Callable[[np.ndarray], np.ndarray],
    test_sets: Sequence[np.ndarray],
    after: int,
    per_task: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Row ``after`` of ``A`` and of ``A_task`` (module docstring).

    Args:
      predict: ``inputs [N, P] -> last-position logits [N, V]``.
      test_sets: per class (in class order), its test passages ``[n, P]``.
      after: the task just trained (0-based).
      per_task: classes per task.

    Returns:
      ``(A_row, A_task_row)``, float ``[n_tasks]`` each, NaN for tasks after ``after``.
    """
    if per_task < 1 or len(test_sets) % per_task:
        raise ValueError(f"per_task: must divide the {len(test_sets)} test sets, got {per_task}")
    tasks = task_classes(len(test_sets), per_task)
    if not 0 <= after < len(tasks):
        raise ValueError(f"after: expected a task index in [0, {len(tasks)}), got {after}")
    a, a_task = np.full(len(tasks), np.nan), np.full(len(tasks), np.nan)
    n_seen = per_task * (after + 1)
    for j in range(after + 1):
        x = np.concatenate([test_sets[c] for c in tasks[j]])
        y = np.concatenate([np.full(len(test_sets[c]), c) for c in tasks[j]])
        z = np.asarray(predict(x))
        a[j] = float(np.mean(predict_seen(z, n_seen) == y))
        own = tasks[j][0] + np.argmax(
            z[:, LABEL_BASE + tasks[j][0] : LABEL_BASE + tasks[j][-1] + 1], 1
        )
        a_task[j] = float(np.mean(own == y))
    return a, a_task


def _check_matrix(a) -> np.ndarray:
    a = np.asarray(a, np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise ValueError(f"A: expected a square [N, N] accuracy matrix, got shape {a.shape}")
    if np.isnan(a[np.tril_indices(a.shape[0])]).any():
        raise ValueError("A: NaN on or below the diagonal (every A[i, j], j <= i, is needed)")
    return a


def average_accuracy(a) -> np.ndarray:
    """``ā_i = mean_{j≤i} A[i, j]`` for every task ``i`` of the ``[N, N]`` matrix ``A``."""
    a = _check_matrix(a)
    return np.asarray([a[i, : i + 1].mean() for i in range(a.shape[0])])


def forgetting(a) -> float:
    """Average forgetting ``mean_{j<N−1} (max_{j≤i<N−1} A[i, j] − A[N−1, j])`` (NaN for N = 1)."""
    a = _check_matrix(a)
    last = a.shape[0] - 1
    if last == 0:
        return math.nan
    return float(np.mean([a[j:last, j].max() - a[last, j] for j in range(last)]))


def chance(n_tasks: int, per_task: int) -> np.ndarray:
    """Chance accuracy over the seen classes after each task: ``1 / (per_task · (i + 1))``."""
    return 1.0 / (per_task * np.arange(1, n_tasks + 1))


# ------------------------------------------------------------------------------------ training


def model_config(arm: str, s: ClassIncrementalSettings):
    """The :class:`~nested_jax.models.config.ModelConfig` of an arm (``"transformer"`` for the
    pretrained backbone of arms 1-3)."""
    from nested_jax.layers.options import CMSOptions
    from nested_jax.models import ModelConfig

    base = dict(
        vocab_size=VOCAB,
        d_model=s.d_model,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        chunk_size=min(64, s.passage_len),
    )
    if arm == "transformer":
        return ModelConfig(name="transformer", **base)
    if arm == "hope":
        return ModelConfig(name="hope", cms=CMSOptions(periods=s.cms_periods), **base)
    online = arm == "hope_attention_online"
    cms = CMSOptions(
        periods=s.cms_periods,
        variant="independent",
        mode="online" if online else "pretrain",
        online_lr=s.online_lr,
    )
    return ModelConfig(name="hope_attention", cms=cms, **base)


class _Program:
    """One model configuration's jitted train step and last-position logits (built once, reused
    by every seed: the jit caches key on these function objects)."""

    def __init__(self, cfg, phase: str, s: ClassIncrementalSettings):
        import jax
        import optax
        from flax import nnx

        from nested_jax.models import build_model
        from nested_jax.optim.multifreq import multi_frequency
        from nested_jax.train.config import OptimizerConfig
        from nested_jax.train.optimizer import build_optimizer, cms_level_of
        from nested_jax.train.step import make_train_step, params_to_state

        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
        graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
        state_def = jax.tree.structure(params)
        if phase == "pretrain":
            ocfg = OptimizerConfig(
                lr=s.pretrain_lr, warmup_steps=max(1, s.pretrain_steps // 10), weight_decay=0.1
            )
            tx, schedule = build_optimizer(ocfg, max(1, s.pretrain_steps), model=cfg)
        elif phase == "online":  # only the CMS levels learn, by SGD at their periods
            frozen = lambda p: jax.tree.map(  # noqa: E731
                lambda lab: lab is None, cms_level_of(p), is_leaf=lambda x: x is None
            )
            sgd = optax.sgd(s.online_lr)
            tx = optax.chain(
                optax.masked(optax.set_to_zero(), frozen),
                multi_frequency(
                    sgd,
                    level_of=cms_level_of,
                    periods=s.cms_periods,
                    accumulate=s.online_accumulate,
                ),
            )
            schedule = optax.constant_schedule(s.online_lr)
        else:
            ocfg = OptimizerConfig(
                lr=s.lr, warmup_steps=s.warmup_steps, decay="constant", weight_decay=s.weight_decay
            )
            tx, schedule = build_optimizer(ocfg, s.n_tasks * s.steps_per_task, model=cfg)
        self.tx = tx
        self.step = jax.jit(make_train_step(graphdef, state_def, tx, schedule), donate_argnums=0)

        def last_logits(p, rest, tokens):
            model = nnx.merge(graphdef, params_to_state(p, state_def), rest)
            return model(tokens)[0][:, -1, :]

        self.last_logits = jax.jit(last_logits)

    def init(self, seed: int):
        """``(params, rest, n_params)`` of a fresh model initialised with ``seed``."""
        import jax
        from flax import nnx

        from nested_jax.models import build_model

        _, params, rest = nnx.split(build_model(self.cfg, rngs=nnx.Rngs(seed)), nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        return params, rest, sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))

    def train(self, params, rest, batches, state=None):
        """Steps on ``batches`` (an iterable) from a copy of ``params`` (or a carried ``state``).

        Returns:
          ``(state, losses)``.
        """
        import jax
        import jax.numpy as jnp

        if state is None:
            params = jax.tree.map(jnp.array, params)  # a copy: the step donates its input
            state = {
                "step": jnp.zeros((), jnp.int32),
                "params": params,
                "opt_state": self.tx.init(params),
                "consecutive_skips": jnp.zeros((), jnp.int32),
            }
        losses = []
        for b in batches:
            state, m = self.step(state, rest, b)
            losses.append(m["loss"])
        return state, [float(x) for x in jax.device_get(losses)]

    def predictor(self, params, rest, eval_batch: int) -> Callable[[np.ndarray], np.ndarray]:
        """``inputs [N, P] -> logits [N, V]`` at the last position, ``eval_batch`` rows at a time
        (the last batch padded, so one compiled shape)."""

        def predict(x):
            out = []
            for i in range(0, len(x), eval_batch):
                chunk = x[i : i + eval_batch]
                pad = np.concatenate([chunk, np.repeat(chunk[-1:], eval_batch - len(chunk), 0)])
                out.append(np.asarray(self.last_logits(params, rest, pad))[: len(chunk)])
            return np.concatenate(out)

        return predict


def _task_batches(split: list[ClassSplit], classes: Sequence[int], s, rng, steps: int):
    """``steps`` classification batches of a task: classes balanced within each batch."""
    for _ in range(steps):
        labels = rng.permutation(np.resize(np.asarray(classes), s.batch_size))
        x = np.stack([sample_passages(split[c].train, 1, s.passage_len, rng)[0] for c in labels])
        yield classification_batch(x, labels)


class _SeedData:
    """What every arm of one seed shares: split, test passages, pretrained backbones (lazy)."""

    def __init__(self, s: ClassIncrementalSettings, seed: int, novels: dict, programs: dict):
        self.s, self.seed, self.programs = s, seed, programs
        self.order = class_order(seed, s.permute)
        self.split = split_classes(novels, self.order, s.test_fraction, seed)
        rng = np.random.default_rng([seed, 1])
        self.test_sets = [sample_passages(c.test, s.n_test, s.passage_len, rng) for c in self.split]
        self.backbones: dict[str, dict] = {}

    def program(self, arm: str, phase: str) -> _Program:
        key = (arm, phase)
        if key not in self.programs:
            self.programs[key] = _Program(model_config(arm, self.s), phase, self.s)
        return self.programs[key]

    def backbone(self, name: str) -> dict:
        """The pretrained ``"transformer"`` or ``"hope"`` of this seed (trained on first use)."""
        if name not in self.backbones:
            s, prog = self.s, self.program(name, "pretrain")
            params, rest, n = prog.init(self.seed)
            text = [ch for c in self.split for ch in c.train]
            rng = np.random.default_rng([self.seed, 2])
            batches = (
                lm_batch(text, s.batch_size, s.passage_len, rng) for _ in range(s.pretrain_steps)
            )
            t0 = time.perf_counter()
            state, losses = prog.train(params, rest, batches)
            secs = time.perf_counter() - t0
            tail = float(np.mean(losses[-20:])) if losses else math.nan
            print(
                f"  pretrained {name} seed {self.seed}: loss {tail:.3f} ({secs:.0f} s)", flush=True
            )
            self.backbones[name] = {
                "params": state["params"],
                "rest": rest,
                "loss": tail,
                "seconds": secs,
            }
        return self.backbones[name]


def run_arm(arm: str, data: _SeedData) -> dict:
    """Pretrained backbone → (conversion) → the task sequence, scored after every task.

    Returns:
      a row: ``arm, seed, order, A, A_task`` (``[N, N]``, NaN above the diagonal), ``avg_acc``
      (``[N]``), ``final_avg_acc``, ``forgetting``, ``forgetting_task``, ``task_loss`` (mean
      label loss of the last 10 steps of each task), ``params``, ``pretrain_loss``,
      ``pretrain_seconds``, ``conversion_max_abs`` (converted arms), ``seconds``.
    """
    from nested_jax.train.convert import check_convertible, convert_ffn_to_cms

    s = data.s
    t0 = time.perf_counter()
    bb = data.backbone("hope" if arm == "hope" else "transformer")
    phase = "online" if arm == "hope_attention_online" else "finetune"
    prog = data.program(arm, phase)
    params, rest, n_params = prog.init(data.seed)
    row = {"arm": arm, "seed": data.seed, "order": list(data.order), "params": n_params}
    if arm.startswith("hope_attention"):
        src = data.program("transformer", "pretrain")
        check_convertible(src.cfg, prog.cfg)
        params = convert_ffn_to_cms(bb["params"], params)
        x = data.test_sets[0][: s.eval_batch]
        before = src.predictor(bb["params"], bb["rest"], s.eval_batch)(x)
        after = prog.predictor(params, rest, s.eval_batch)(x)
        row["conversion_max_abs"] = float(np.max(np.abs(before - after)))
    else:
        params = bb["params"]
    rest = bb["rest"] if arm in ("transformer", "hope") else rest
    n = s.n_tasks
    a, a_task = np.full((n, n), np.nan), np.full((n, n), np.nan)
    rng = np.random.default_rng([data.seed, 3])
    state, task_loss = None, []
    for i, classes in enumerate(task_classes(len(data.split), s.classes_per_task)):
        batches = _task_batches(data.split, classes, s, rng, s.steps_per_task)
        state, losses = prog.train(params, rest, batches, state)
        task_loss.append(float(np.mean(losses[-10:])))
        predict = prog.predictor(state["params"], rest, s.eval_batch)
        a[i], a_task[i] = accuracy_rows(predict, data.test_sets, i, s.classes_per_task)
        print(
            f"  [{arm} seed {data.seed}] after task {i + 1}: "
            + " ".join(f"{v:.2f}" for v in a[i, : i + 1])
            + f" (label loss {task_loss[-1]:.3f})",
            flush=True,
        )
    return {
        **row,
        "A": a.tolist(),
        "A_task": a_task.tolist(),
        "avg_acc": average_accuracy(a).tolist(),
        "final_avg_acc": float(average_accuracy(a)[-1]),
        "forgetting": forgetting(a),
        "forgetting_task": forgetting(a_task),
        "task_loss": task_loss,
        "pretrain_loss": bb["loss"],
        "pretrain_seconds": bb["seconds"],
        "seconds": time.perf_counter() - t0,
    }


# -------------------------------------------------------------------------------------- report


def _spread(values) -> dict:
    x = np.asarray(values, np.float64)
    return {
        "mean": float(np.mean(x)),
        "std": float(np.std(x, ddof=1)) if len(x) > 1 else 0.0,
        "values": x.tolist(),
    }


def summarize(runs: Sequence[dict]) -> list[dict]:
    """One entry per arm (first-seen order): seed mean ± sample std of the final average accuracy,
    forgetting (class- and task-incremental), ``just_learned`` (``mean_i A[i, i]``: each task's
    accuracy right after it was trained, the plasticity) and ``ā_i``; the seed-mean ``A`` and
    ``A_task``."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        avg = np.asarray([r["avg_acc"] for r in mine], np.float64)
        out.append(
            {
                "arm": arm,
                "params": mine[0]["params"],
                "seeds": [r["seed"] for r in mine],
                "final_avg_acc": _spread([r["final_avg_acc"] for r in mine]),
                "forgetting": _spread([r["forgetting"] for r in mine]),
                "forgetting_task": _spread([r["forgetting_task"] for r in mine]),
                "retained": _spread([_retained(np.asarray(r["A"], float)) for r in mine]),
                "just_learned": _spread(
                    [np.mean(np.diag(np.asarray(r["A"], float))) for r in mine]
                ),
                "final_task_acc": _spread(
                    [np.nanmean(np.asarray(r["A_task"], float)[-1]) for r in mine]
                ),
                "avg_acc_mean": avg.mean(0).tolist(),
                "avg_acc_std": (avg.std(0, ddof=1) if len(mine) > 1 else 0 * avg[0]).tolist(),
                "A_mean": np.mean([np.asarray(r["A"], float) for r in mine], 0).tolist(),
                "A_task_mean": np.mean([np.asarray(r["A_task"], float) for r in mine], 0).tolist(),
                "pretrain_loss": _spread([r["pretrain_loss"] for r in mine]),
            }
        )
    return out


def _retained(a: np.ndarray) -> float:
    """``mean_{j<N−1} A[N−1, j]``: what is left of the old tasks at the end (NaN for N = 1)."""
    return float(np.mean(a[-1, :-1])) if len(a) > 1 else math.nan


def _pm(x: dict, sign: bool = False) -> str:
    f = "{:+.3f}" if sign else "{:.3f}"
    return f.format(x["mean"]) + (f" ± {x['std']:.3f}" if len(x["values"]) > 1 else "")


def verdict(summary: Sequence[dict]) -> dict:
    """Each arm against the fine-tuned transformer (``{}`` without a ``transformer`` arm).

    Returns:
      ``{arm: {"forgets_less", "retains_more"}}``: seed-mean ``F`` below the transformer's, and
      seed-mean retained old-task accuracy ``mean_{j<N−1} A[N−1, j]`` above it. ``F`` alone also
      falls when an arm learns less, so the claim "forgets less" needs both.
    """
    base = next((a for a in summary if a["arm"] == "transformer"), None)
    if base is None:
        return {}
    f0, r0 = base["forgetting"]["mean"], base["retained"]["mean"]
    return {
        a["arm"]: {
            "forgets_less": bool(a["forgetting"]["mean"] < f0),
            "retains_more": bool(a["retained"]["mean"] > r0),
        }
        for a in summary
        if a is not base
    }


def markdown_table(summary: Sequence[dict], s: ClassIncrementalSettings, seeds, tasks) -> str:
    """The results: settings, one row per arm, then each arm's seed-mean accuracy matrix."""
    n = s.n_tasks
    ch = chance(n, s.classes_per_task)
    seed_note = (
        f"mean ± sample std over seeds {list(seeds)}" if len(seeds) > 1 else f"seed {seeds[0]}"
    )
    lines = [
        f"Class-incremental Austen ({n} tasks of {s.classes_per_task} novels: "
        + "; ".join("/".join(t) for t in tasks)
        + f"). Passages of {s.passage_len} bytes, {s.n_test} test passages per novel from held-out "
        f"chapters; d_model {s.d_model}, {s.n_layers} layers; LM pretraining {s.pretrain_steps} "
        f"steps, {s.steps_per_task} steps × batch {s.batch_size} per task (AdamW lr {s.lr:g}; "
        f"online CMS SGD η {s.online_lr:g}, {s.online_accumulate}); CMS periods "
        f"{list(s.cms_periods)}; {seed_note}.",
        "",
        "| arm | params | final avg acc ↑ | forgetting F ↓ | old tasks at end ↑ "
        "| just-learned acc ↑ | "
        + " | ".join(f"avg acc after task {i + 1}" for i in range(n))
        + " | task-IL final acc | task-IL F | LM loss |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * n + "---:|---:|---:|",
    ]
    for a in summary:
        after = " | ".join(
            f"{m:.3f}" + (f" ± {d:.3f}" if len(a["seeds"]) > 1 else "")
            for m, d in zip(a["avg_acc_mean"], a["avg_acc_std"], strict=True)
        )
        lines.append(
            f"| {a['arm']} | {a['params']:,} | {_pm(a['final_avg_acc'])} | "
            f"{_pm(a['forgetting'], True)} | {_pm(a['retained'])} | {_pm(a['just_learned'])} | "
            f"{after} | "
            f"{_pm(a['final_task_acc'])} | "
            f"{_pm(a['forgetting_task'], True)} | {_pm(a['pretrain_loss'])} |"
        )
    lines.append(
        f"| chance | | {ch[-1]:.3f} | | | | "
        + " | ".join(f"{c:.3f}" for c in ch)
        + f" | {1 / s.classes_per_task:.3f} | | |"
    )
    lines += ["", "Seed-mean accuracy matrices A[i, j] (row: after task i; column: task j):", ""]
    lines.append("| arm | after task | " + " | ".join(f"task {j + 1}" for j in range(n)) + " |")
    lines.append("|---|---:|" + "---:|" * n)
    for a in summary:
        for i, row in enumerate(a["A_mean"]):
            cells = " | ".join("" if j > i else f"{v:.3f}" for j, v in enumerate(row))
            lines.append(f"| {a['arm']} | {i + 1} | {cells} |")
    v = verdict(summary)
    if v:
        yes = {True: "yes", False: "no"}
        lines += [
            "",
            "Against the fine-tuned transformer (seed means): forgets less (lower F) — "
            + ", ".join(f"{k} {yes[x['forgets_less']]}" for k, x in v.items())
            + "; retains more of the old tasks at the end — "
            + ", ".join(f"{k} {yes[x['retains_more']]}" for k, x in v.items())
            + ". F also falls when a task is learned less (just-learned accuracy).",
        ]
    return "\n".join(lines) + "\n"


def plot(summary: Sequence[dict], s: ClassIncrementalSettings, path: Path) -> Path:
    """Seed-mean ``A`` heatmaps (one per arm) and ``ā_i`` vs tasks seen (chance dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, k = s.n_tasks, len(summary)
    fig, axes = plt.subplots(1, k + 1, figsize=(3.2 * (k + 1), 3.4), squeeze=False)
    for ax, a in zip(axes[0, :k], summary, strict=True):
        m = np.asarray(a["A_mean"], float)
        ax.imshow(np.ma.masked_invalid(m), vmin=0, vmax=1, cmap="viridis")
        for i in range(n):
            for j in range(i + 1):
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
        ax.set_title(a["arm"], fontsize=9)
        ax.set_xlabel("task j (tested)")
        ax.set_ylabel("after task i")
        ax.set_xticks(range(n), [str(j + 1) for j in range(n)])
        ax.set_yticks(range(n), [str(i + 1) for i in range(n)])
    ax = axes[0, k]
    x = np.arange(1, n + 1)
    for a in summary:
        ax.errorbar(
            x, a["avg_acc_mean"], yerr=a["avg_acc_std"], marker="o", capsize=3, label=a["arm"]
        )
    ax.plot(x, chance(n, s.classes_per_task), "k--", lw=0.8, label="chance")
    ax.set_xlabel("tasks seen")
    ax.set_ylabel("average accuracy (seen classes)")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(x)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(
    s: ClassIncrementalSettings,
    arms: Sequence[str] = ARMS,
    seeds: Sequence[int] = (0, 1),
    out: str | Path | None = None,
) -> dict:
    """Every arm at every seed; writes ``class_incremental.{json,md,png}`` under ``out``.

    Returns:
      ``{"settings", "arms", "seeds", "tasks", "chance", "runs", "summary", "verdict",
      "markdown", "plot", "wall_s"}``.
    """
    arms, seeds = list(arms), list(seeds)
    if not arms or len(set(arms)) != len(arms) or any(a not in ARMS for a in arms):
        raise ValueError(f"arms: expected distinct names from {list(ARMS)}, got {arms}")
    if (
        not seeds
        or len(set(seeds)) != len(seeds)
        or any(isinstance(k, bool) or not isinstance(k, int) for k in seeds)
    ):
        raise ValueError(f"seeds: expected distinct ints, got {seeds}")
    t0 = time.perf_counter()
    novels = load_austen_novels(s.data_dir)
    programs: dict = {}
    runs = []
    for seed in seeds:
        data = None
        for arm in arms:
            path = None if out is None else Path(out) / "rows" / f"{arm}-seed{seed}.json"
            key = {"settings": dataclasses.asdict(s), "arm": arm, "seed": seed}

            def compute(arm=arm, seed=seed):
                nonlocal data
                if data is None:
                    data = _SeedData(s, seed, novels, programs)
                print(f"== {arm} seed {seed}", flush=True)
                return run_arm(arm, data)

            runs.append(cached_row(path, key, compute, f"{arm} seed {seed}"))
    summary = summarize(runs)
    orders = {tuple(r["order"]) for r in runs}
    first = runs[0]["order"]
    tasks = [first[i : i + s.classes_per_task] for i in range(0, len(first), s.classes_per_task)]
    md = markdown_table(summary, s, seeds, tasks)
    if len(orders) > 1:
        md += "\nClass order permuted per seed (tasks above: the first seed's).\n"
    result = {
        "settings": dataclasses.asdict(s),
        "arms": arms,
        "seeds": seeds,
        "tasks": tasks,
        "chance": chance(s.n_tasks, s.classes_per_task).tolist(),
        "runs": runs,
        "summary": summary,
        "verdict": verdict(summary),
        "markdown": md,
        "plot": None,
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        result["plot"] = str(plot(summary, s, out / "class_incremental.png"))
    result["wall_s"] = time.perf_counter() - t0
    rows_s = sum(r["seconds"] for r in runs)
    md += (
        f"\nwall time {result['wall_s']:.0f} s (this invocation); the rows took {rows_s:.0f} s "
        "when computed (sum over arms and seeds, pretraining and compilation included).\n"
    )
    result["markdown"] = md
    if out is not None:
        write_json(out / "class_incremental.json", result)
        (out / "class_incremental.md").write_text(md)
    return result


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, naming the argument (argparse's message does)
        self.exit(2, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m nested_jax.experiments.class_incremental",
        description="class-incremental continual learning on the six Austen novels "
        "(Hope paper §9.1 protocol): transformer vs Hope-Attention (pretrain / online CMS) vs Hope",
    )
    p.add_argument("--out", required=True, help="directory for the json, md and png")
    p.add_argument("--scale", choices=("cpu", "gpu"), default="cpu", help="size preset")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="one run per seed")
    p.add_argument("--arms", nargs="+", default=list(ARMS), help=f"subset of {list(ARMS)}")
    p.add_argument("--cms-periods", nargs="+", type=int, default=None, help="CMS level periods")
    p.add_argument("--permute", action="store_true", help="seeded permutation of the class order")
    add_scalar_flags(p, ClassIncrementalSettings)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        values = scalar_values(args, ClassIncrementalSettings)
        if args.cms_periods is not None:
            values["cms_periods"] = tuple(args.cms_periods)
        if args.permute:
            values["permute"] = True
        base = SCALES["quick" if args.quick else args.scale]
        s = dataclasses.replace(base, **values)
        result = run(s, args.arms, args.seeds, args.out)
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(result["markdown"], end="")
    print(f"plot: {result['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
