"""Scores and report of the class-incremental experiment: accuracy matrices, forgetting, tables.

The metrics (defined in the docstring of :mod:`nested_jax.experiments.class_incremental`):
``A[i, j]``, the accuracy on task ``j`` after training task ``i`` among the classes seen so far
(:func:`accuracy_rows`), and ``A_task`` restricted to task ``j``'s own classes; the average
accuracy ``ā_i`` (:func:`average_accuracy`), the average forgetting ``F`` (:func:`forgetting`) and
chance (:func:`chance`). Then the seed summary of every arm (:func:`summarize`), each arm against
the fine-tuned transformer (:func:`verdict`), the Markdown table (:func:`markdown_table`) and the
plot (:func:`plot`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from nested_jax.experiments.class_incremental_data import (
    LABEL_BASE,
    ClassIncrementalSettings,
    task_classes,
)

__all__ = [
    "predict_seen",
    "accuracy_rows",
    "average_accuracy",
    "forgetting",
    "chance",
    "summarize",
    "verdict",
    "markdown_table",
    "plot",
]


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
    """Row ``after`` of ``A`` and of ``A_task`` (definitions above).

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
