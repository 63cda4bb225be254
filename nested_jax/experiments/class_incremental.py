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

Code: the settings, classes, passages and batches are
:mod:`nested_jax.experiments.class_incremental_data`; the arms' models, training and per-task
scoring :mod:`nested_jax.experiments.class_incremental_arms`; the metrics, tables and plot
:mod:`nested_jax.experiments.class_incremental_report`. This module holds the size presets
(:data:`SCALES`), :func:`run` and the command line.

Results (CPU size, seeds 0 and 1): ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nested_jax.data.corpus import load_austen_novels
from nested_jax.experiments._cache import cached_row
from nested_jax.experiments._training import (
    add_scalar_flags,
    print_table,
    scalar_values,
)
from nested_jax.experiments.class_incremental_arms import ARMS, SeedData, run_arm
from nested_jax.experiments.class_incremental_data import ClassIncrementalSettings
from nested_jax.experiments.class_incremental_report import (
    chance,
    markdown_table,
    plot,
    summarize,
    verdict,
)
from nested_jax.files import write_json

__all__ = ["SCALES", "run", "build_parser", "main"]

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
                    data = SeedData(s, seed, novels, programs)
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

    def run_it():
        values = scalar_values(args, ClassIncrementalSettings)
        if args.cms_periods is not None:
            values["cms_periods"] = tuple(args.cms_periods)
        if args.permute:
            values["permute"] = True
        base = SCALES["quick" if args.quick else args.scale]
        return run(dataclasses.replace(base, **values), args.arms, args.seeds, args.out)

    return print_table(run_it)


if __name__ == "__main__":
    sys.exit(main())
