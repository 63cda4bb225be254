"""Nested Learning's small-model tables, each one command: formal languages (Table 5) and MAD
(Table 4), with the papers' numbers beside ours.

    python -m nested_jax.experiments.paper_tables formal --scale cpu --out runs/formal_table
    python -m nested_jax.experiments.paper_tables mad --scale cpu --out runs/mad_table
    python -m nested_jax.experiments.paper_tables formal --scale cpu --out runs/formal_table \\
        --tasks parity aa_star --models lstm hope@token --seeds 0     # one piece of the table

``formal``: every language of :data:`~nested_jax.eval.formal_protocol.PROTOCOL_TASKS` under the
next-character protocol (``synthetic --task protocol:<name>``; docs/RESULTS.md "Formal-language
protocol"), the models of :data:`FORMAL_MODELS` (the LSTM first: it is the control and sets the
parameter budget), a learning-rate sweep on the first seed (validation accuracy), then the seeds.
``mad``: the six MAD tasks with MAD's own protocol (mad-lab's ``MADConfig`` and task configs: a
fixed data set of ``num_train_examples``, 1 280 test instances, AdamW with cosine decay, the grid of
learning rate × weight decay, two mixer + MLP blocks; a task's score is the mean over its difficulty
settings of the chosen run's accuracy), the models of :data:`MAD_MODELS`. MAD picks the best run of
the grid on the test accuracy; here the grid's choice is made on a validation set drawn apart from
the test (never tuned on the scored split).

Every run is one ``synthetic`` run, cached under ``<out>/<table>/<task>/models/`` and reused when
its settings are equal, so a table is filled a piece at a time (``--tasks``, ``--models``,
``--seeds`` select a piece; the same command later finds the finished runs) and is deterministic
under its seeds. ``--scale`` picks a preset (:data:`FORMAL_SCALES`, :data:`MAD_SCALES`): ``cpu``
what a 2-core CPU finishes in hours (each shrink of MAD's protocol is named in the preset's
``note``), ``gpu`` the protocol's own sizes for one accelerator. Writes ``<out>/<table>.json``,
``.md`` (the table with the paper's numbers) and ``.png`` (accuracy per task, model and bin);
each task's own table and length plot stay in its folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from nested_jax.eval.formal_protocol import PROTOCOL_TASKS
from nested_jax.eval.mad import MAD_TASKS
from nested_jax.experiments._training import print_table
from nested_jax.experiments.synthetic import add_finished_only_flag, run_synthetic
from nested_jax.experiments.synthetic_data import SyntheticSettings
from nested_jax.experiments.synthetic_report import spread
from nested_jax.files import write_json

# Per-token Hope (both chunk sizes 1, the recurrence the paper writes) beside Hope at its
# training default; token-by-token chunk updates are the fast form at chunk size 1 (same values).
HOPE_TOKEN = (
    "model.hope.chunk_memory=1",
    "model.hope.chunk_other=1",
    "model.hope.chunk_updates=scan",
)
VARIANTS: dict[str, tuple[str, ...]] = {"hope@token": HOPE_TOKEN}

FORMAL_MODELS = ("lstm", "transformer", "deltanet", "gdn", "titans_lmm", "hope@token", "hope")
MAD_MODELS = ("transformer", "gdn", "titans_lmm", "hope")

# The papers' numbers (percent), as printed: Nested Learning Table 5 (after Irie et al. 2023) as
# (Bin0, Bin1) per language, and Table 4 (MAD). Models the tables do not list are absent.
_ALL_100 = {t: (100.0, 100.0) for t in PROTOCOL_TASKS}
_COUNTING_100 = {t: (100.0, 100.0) for t in ("anbn", "anbncn", "shuffle2")}
PAPER_FORMAL: dict[str, dict[str, tuple[float, float]]] = {
    "lstm": _ALL_100,
    "hope": _ALL_100,
    "transformer": {
        "parity": (46.4, 0.0),
        "aa_star": (0.0, 0.0),
        "abab_star": (0.0, 0.0),
        **_COUNTING_100,
    },
    "deltanet": {
        "parity": (98.2, 10.1),
        "aa_star": (0.0, 0.0),
        "abab_star": (0.0, 0.0),
        **_COUNTING_100,
    },
}
PAPER_MAD: dict[str, dict[str, float]] = {
    "transformer": {
        "compression": 49.4,
        "in_context_recall": 100.0,
        "fuzzy_in_context_recall": 47.9,
        "selective_copying": 96.2,
        "memorization": 83.7,
    },
    "titans_lmm": {
        "compression": 49.8,
        "in_context_recall": 100.0,
        "fuzzy_in_context_recall": 50.0,
        "selective_copying": 99.4,
        "memorization": 83.4,
    },
    "hope": {
        "compression": 51.2,
        "in_context_recall": 100.0,
        "fuzzy_in_context_recall": 52.1,
        "selective_copying": 99.7,
        "memorization": 85.2,
    },
}

# MAD's task configs (mad-lab configs/tasks/*.yml): the baseline sizes and the difficulty
# settings, each a change of one size from the baseline.
MAD_BASELINES: dict[str, dict[str, int | float]] = {
    "compression": {"vocab_size": 16, "seq_len": 32, "num_train_examples": 12_800},
    "fuzzy_in_context_recall": {"vocab_size": 16, "seq_len": 128, "num_train_examples": 12_800},
    "in_context_recall": {"vocab_size": 16, "seq_len": 128, "num_train_examples": 12_800},
    "memorization": {"vocab_size": 256, "seq_len": 32, "num_train_examples": 256},
    "noisy_in_context_recall": {
        "vocab_size": 32,
        "noise_vocab_size": 16,
        "seq_len": 128,
        "frac_noise": 0.2,
        "num_train_examples": 12_800,
    },
    "selective_copying": {
        "vocab_size": 16,
        "seq_len": 256,
        "num_tokens_to_copy": 16,
        "num_train_examples": 12_800,
    },
}
_FEWER = {"num_train_examples": (6_400, 3_200, 1_600, 800)}
_RECALL = {"vocab_size": (32, 64, 128), "seq_len": (256, 512, 1024), **_FEWER}
MAD_CHANGES: dict[str, dict[str, tuple]] = {
    "compression": {"vocab_size": (32, 64, 128), "seq_len": (64, 128, 256), **_FEWER},
    "fuzzy_in_context_recall": _RECALL,
    "in_context_recall": _RECALL,
    "memorization": {"vocab_size": (512, 1024, 2048, 4096, 8192)},
    "noisy_in_context_recall": {
        **_RECALL,
        "vocab_size": (48, 80, 144),
        "frac_noise": (0.4, 0.6, 0.8),
    },
    "selective_copying": {
        "vocab_size": (32, 64, 128),
        "seq_len": (512, 1024),
        **_FEWER,
        "num_tokens_to_copy": (32, 64, 96),
    },
}


@dataclasses.dataclass(frozen=True)
class TableScale:
    """A named preset of one table: sizes, the sweep and the seeds (``note``: how it departs from
    the protocol). Formal tables train ``steps`` steps; MAD tables ``epochs`` over the task's
    training set, at most ``max_steps``."""

    batch_size: int
    d_model: int
    n_layers: int
    n_heads: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    note: str
    steps: int = 0
    wds: tuple[float, ...] = ()
    epochs: int = 0
    max_steps: int = 0
    difficulty: bool = False  # MAD: every difficulty setting, else the baseline only
    mad_sizes: tuple[tuple[str, int | float], ...] = ()  # MAD: sizes set in every setting
    settings: tuple[tuple[str, object], ...] = ()  # other SyntheticSettings fields (train_size…)

    def mad_steps(self, num_train_examples: int) -> int:
        return min(math.ceil(self.epochs * num_train_examples / self.batch_size), self.max_steps)

    def synthetic(self, task: str, models: Sequence[str], **fields) -> SyntheticSettings:
        """The :class:`SyntheticSettings` of one task at this preset (``fields``: the task's own,
        e.g. ``steps``), with the variants' options of ``models``."""
        return SyntheticSettings(
            task=task,
            batch_size=self.batch_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            model_overrides=tuple((m, t) for m in models for t in VARIANTS.get(m, ())),
            **fields,
            **dict(self.settings),
        )


# One epoch of the protocol's 10 000 training strings at batch 32: the bins are scored after each,
# as the source scores them after every epoch and reports each bin's best.
EPOCH_STEPS = math.ceil(SyntheticSettings.train_size / 32)  # 313
FORMAL_SCALES = {
    "cpu": TableScale(
        steps=7_813,  # 25 epochs of 10 000 strings at batch 32 (Bhattamishra et al.'s budget)
        batch_size=32,
        d_model=64,  # the LSTM's hidden size there; the other models matched to its parameters
        n_layers=1,
        n_heads=2,
        lrs=(1e-3, 3e-3),
        seeds=(0, 1, 2),
        # the source trains without weight decay; 0.1 cost the LSTM control aⁿbⁿ's Bin1
        # (docs/RESULTS.md "Formal-language protocol")
        settings=(("weight_decay", 0.0), ("score_every", EPOCH_STEPS)),
        note="the protocol's budget and the LSTM's size, no weight decay; a two-rate sweep",
    ),
    "gpu": TableScale(
        steps=7_813,
        batch_size=32,
        d_model=128,
        n_layers=2,
        n_heads=4,
        lrs=(3e-4, 1e-3, 3e-3),
        seeds=(0, 1, 2, 3, 4),
        settings=(("weight_decay", 0.0), ("score_every", EPOCH_STEPS)),
        note="wider and deeper than the CPU size, no weight decay, a three-rate sweep, five seeds",
    ),
}
MAD_SCALES = {
    "cpu": TableScale(
        batch_size=32,
        d_model=64,
        n_layers=2,
        n_heads=2,
        lrs=(1e-3,),
        wds=(0.0, 0.1),
        seeds=(0, 1, 2),
        epochs=200,
        max_steps=800,
        note=(
            "MAD's baseline setting of each task only (no difficulty settings); width 64, "
            "batch 32 and at most 800 steps (MAD: width 128, batch 128, 200 epochs, e.g. 20 000 "
            "steps for 12 800 instances); learning rate 1e-3 only (MAD: 1e-4, 5e-4, 1e-3)"
        ),
    ),
    "gpu": TableScale(
        batch_size=128,
        d_model=128,
        n_layers=2,
        n_heads=4,
        lrs=(1e-4, 5e-4, 1e-3),
        wds=(0.0, 0.1),
        seeds=(0, 1, 2),
        epochs=200,
        max_steps=10**9,
        difficulty=True,
        note="MAD's protocol: every difficulty setting, its grid, width 128, batch 128, 200 epochs",
    ),
}


def mad_settings(task: str, difficulty: bool) -> list[dict[str, int | float]]:
    """MAD's sizes for ``task``: the baseline, then (with ``difficulty``) one setting per value
    of each change (mad-lab's ``make_benchmark_mad_configs``)."""
    base = MAD_BASELINES[task]
    out = [dict(base)]
    if difficulty:
        for key, values in MAD_CHANGES[task].items():
            out.extend({**base, key: v} for v in values)
    return out


def _label(sizes: Mapping[str, int | float], base: Mapping[str, int | float]) -> str:
    changed = [f"{k}={v:g}" for k, v in sizes.items() if base.get(k) != v]
    return ",".join(changed) or "baseline"


def run_formal(
    scale: TableScale,
    models: Sequence[str],
    tasks: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    finished_only: bool = False,
) -> dict:
    """Every language of ``tasks`` (:func:`run_synthetic` each): ``{task: result}``."""
    results = {}
    for task in tasks:
        s = scale.synthetic(f"protocol:{task}", models, steps=scale.steps)
        print(f"=== formal {task}: {list(models)}, seeds {list(seeds)}", flush=True)
        results[task] = run_synthetic(
            models, s, seeds, out / task, lrs=scale.lrs, wds=scale.wds, finished_only=finished_only
        )
    return results


def run_mad(
    scale: TableScale,
    models: Sequence[str],
    tasks: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    finished_only: bool = False,
) -> dict:
    """Every MAD task of ``tasks`` at each of its settings: ``{task: {setting: result}}``."""
    results = {}
    for task in tasks:
        results[task] = {}
        for sizes in mad_settings(task, scale.difficulty):
            label = _label(sizes, MAD_BASELINES[task])
            sizes = {**sizes, **dict(scale.mad_sizes)}
            s = scale.synthetic(
                f"mad:{task}",
                models,
                steps=scale.mad_steps(int(sizes["num_train_examples"])),
                warmup_steps=0,  # MAD: cosine decay from the first step
                mad_sizes=tuple(sizes.items()),
            )
            print(f"=== mad {task} ({label}): {list(models)}, seeds {list(seeds)}", flush=True)
            results[task][label] = run_synthetic(
                models,
                s,
                seeds,
                out / task / label,
                lrs=scale.lrs,
                wds=scale.wds,
                finished_only=finished_only,
            )
    return results


def formal_rows(results: Mapping[str, dict]) -> dict[str, dict[str, dict]]:
    """``{model: {task: {"bin0": spread, "bin1": spread, "lr": chosen}}}`` of accuracy in %, at
    the end of training; where the runs were checked along the way (``score_every``) also
    ``"bin0_best"`` and ``"bin1_best"``: each bin's best check, the source's measure."""
    rows: dict[str, dict[str, dict]] = {}
    for task, result in results.items():
        for row in result["rows"]:
            cell = {b: _percent(row["scores"][b]["accuracy"]) for b in ("bin0", "bin1")}
            if row.get("best_checks"):
                cell |= {f"{b}_best": _percent(row["best_checks"][b]) for b in ("bin0", "bin1")}
            rows.setdefault(row["model"], {})[task] = {**cell, "lr": row["lr"]}
    return rows


def mad_rows(results: Mapping[str, Mapping[str, dict]]) -> dict[str, dict[str, dict]]:
    """``{model: {task: {"score": spread, "settings": n}}}``: per seed, the mean over the task's
    settings of the chosen run's accuracy (MAD's score), in %; a seed counts once it has finished
    every setting."""
    rows: dict[str, dict[str, dict]] = {}
    for task, by_setting in results.items():
        per_model: dict[str, dict[int, list[float]]] = {}
        for result in by_setting.values():  # its runs are the seeds at the chosen lr and decay
            for run in result["runs"]:
                by_seed = per_model.setdefault(run["model"], {})
                by_seed.setdefault(run["seed"], []).append(run["accuracy"])
        n = len(by_setting)
        for model, by_seed in per_model.items():
            scores = [sum(accs) / n for accs in by_seed.values() if len(accs) == n]
            if scores:
                cell = {"score": _percent(spread(scores)), "settings": n}
                rows.setdefault(model, {})[task] = cell
    return rows


def _percent(x: dict) -> dict:
    return {**x, **{k: 100 * x[k] for k in ("mean", "std", "min", "max")}}


def _fmt(x: dict, seeds: int) -> str:
    """Mean ± std (best) in %, and how many of the table's ``seeds`` it has where fewer."""
    k = len(x["values"])
    cell = f"{x['mean']:.1f}" if k == 1 else f"{x['mean']:.1f} ± {x['std']:.1f} ({x['max']:.1f})"
    return cell if k == seeds else f"{cell} ({k} of {seeds} seeds)"


def formal_markdown(
    rows: Mapping[str, Mapping[str, dict]], tasks: Sequence[str], seeds: int, suffix: str = ""
) -> str:
    """Model × language, Bin0 and Bin1: ours (mean ± std (best) in % over the ``seeds`` asked
    for) and the paper's; ``suffix`` ``"_best"``: each bin's best check instead of the end of
    training (``–`` where unchecked or not finished)."""
    head = "| model | " + " | ".join(f"{t} Bin0 | {t} Bin1" for t in tasks) + " |"
    lines = [head, "|---|" + "---:|" * (2 * len(tasks))]
    for model, cells in rows.items():
        paper = PAPER_FORMAL.get(model.partition("@")[0], {})
        parts = []
        for t in tasks:
            for i, b in enumerate(("bin0", "bin1")):
                ours = _fmt(cells[t][b + suffix], seeds) if b + suffix in cells.get(t, {}) else "–"
                ref = f" [{paper[t][i]:g}]" if t in paper else ""
                parts.append(ours + ref)
        lines.append(f"| {model} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def mad_markdown(rows: Mapping[str, Mapping[str, dict]], tasks: Sequence[str], seeds: int) -> str:
    """Model × MAD task: our score (mean ± std (best) in % over the ``seeds`` asked for) and the
    paper's."""
    lines = ["| model | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for model, cells in rows.items():
        paper = PAPER_MAD.get(model, {})
        parts = [
            (_fmt(cells[t]["score"], seeds) if t in cells else "–")
            + (f" [{paper[t]:g}]" if t in paper else "")
            for t in tasks
        ]
        lines.append(f"| {model} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def plot_table(rows: Mapping[str, Mapping[str, dict]], tasks: Sequence[str], path: Path) -> Path:
    """One panel per task: a bar per model and bin (formal) or per model (MAD), the mean over
    seeds with the seeds as dots; each bin's best epoch (mean over seeds) as an open triangle
    where the runs were checked along the way; the paper's number as a cross."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    models = list(rows)
    for ax, task in zip(axes.flat, tasks, strict=False):
        keys = ("bin0", "bin1") if any("bin0" in rows[m].get(task, {}) for m in models) else ()
        bars = keys or ("score",)
        width = 0.8 / len(bars)
        for j, key in enumerate(bars):
            xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(models))]
            means = [rows[m][task][key]["mean"] if task in rows[m] else 0.0 for m in models]
            ax.bar(xs, means, width, label=key if keys else None, alpha=0.75)
            for x, m in zip(xs, models, strict=True):
                if task in rows[m]:
                    vals = [100 * v for v in rows[m][task][key]["values"]]
                    ax.plot([x] * len(vals), vals, "k.", ms=3)
                    best = rows[m][task].get(f"{key}_best")
                    if best is not None:  # the source's measure: each bin's best epoch
                        ax.plot([x], [best["mean"]], "v", mfc="none", mec="k", ms=5)
                ref = _paper(m, task, j if keys else None)
                if ref is not None:
                    ax.plot([x], [ref], "rx", ms=6)
        ax.set_title(task)
        ax.set_xticks(range(len(models)), models, rotation=45, ha="right", fontsize=7)
        ax.set_ylim(0, 105)
        if keys:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    fig.suptitle(
        "accuracy % (bars: mean over seeds at the end of training, dots: seeds, open triangle: "
        "best epoch, red x: the paper)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _paper(model: str, task: str, bin_index: int | None) -> float | None:
    base = model.partition("@")[0]
    if bin_index is None:
        return PAPER_MAD.get(base, {}).get(task)
    ref = PAPER_FORMAL.get(base, {}).get(task)
    return None if ref is None else ref[bin_index]


def run_table(
    table: str,
    scale: str,
    out: str | Path,
    models: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    finished_only: bool = False,
) -> dict:
    """Fill table ``table`` (``formal`` or ``mad``) at preset ``scale``; write its summary
    (``finished_only``: train nothing, summarise the runs saved so far; see
    :func:`~nested_jax.experiments.synthetic.run_synthetic`).

    Returns:
      ``{"table", "scale", "models", "tasks", "seeds", "rows", "markdown", "plot"}``.

    Raises:
      ValueError: naming ``table``, ``scale``, ``tasks`` or ``models`` when one is unknown.
    """
    presets = {"formal": FORMAL_SCALES, "mad": MAD_SCALES}
    if table not in presets:
        raise ValueError(f"table: expected 'formal' or 'mad', got {table!r}")
    if scale not in presets[table]:
        raise ValueError(f"scale: expected one of {sorted(presets[table])}, got {scale!r}")
    preset = presets[table][scale]
    known = list(PROTOCOL_TASKS) if table == "formal" else list(MAD_TASKS)
    tasks = list(tasks or known)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise ValueError(f"tasks: unknown {unknown}; {table}: {known}")
    models = list(models or (FORMAL_MODELS if table == "formal" else MAD_MODELS))
    seeds = list(seeds if seeds is not None else preset.seeds)
    out = Path(out)
    if table == "formal":
        rows = formal_rows(run_formal(preset, models, tasks, seeds, out / table, finished_only))
        rows = {m: rows.get(m, {}) for m in models}  # a model with nothing finished: "–"
        md = formal_markdown(rows, tasks, len(seeds))
        if any("bin1_best" in cell for cells in rows.values() for cell in cells.values()):
            md += (
                "\nEach bin's best check during training (every "
                f"{dict(preset.settings)['score_every']} steps): the source's measure, its best "
                "epoch per bin, chosen on the scored bins themselves, so never the headline:\n\n"
                + formal_markdown(rows, tasks, len(seeds), "_best")
            )
    else:
        rows = mad_rows(run_mad(preset, models, tasks, seeds, out / table, finished_only))
        rows = {m: rows.get(m, {}) for m in models}  # a model with nothing finished: "–"
        md = mad_markdown(rows, tasks, len(seeds))
    head = (
        f"{table} table, scale `{scale}` ({preset.note}); seeds {', '.join(map(str, seeds))}; "
        "cells: mean ± std (best seed) in %, [the paper's number]\n\n"
    )
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "table": table,
        "scale": scale,
        "preset": dataclasses.asdict(preset),
        "models": models,
        "tasks": tasks,
        "seeds": seeds,
        "rows": rows,
        "markdown": head + md,
        "plot": str(plot_table(rows, tasks, out / f"{table}.png")),
    }
    write_json(out / f"{table}.json", result)
    (out / f"{table}.md").write_text(result["markdown"])
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.paper_tables",
        description="Nested Learning's formal-language (Table 5) and MAD (Table 4) tables, one "
        "command each, resumable",
    )
    p.add_argument("table", choices=("formal", "mad"))
    p.add_argument("--scale", default="cpu", help="a preset: cpu or gpu (default cpu)")
    p.add_argument("--out", required=True, help="directory of the runs and the summary")
    p.add_argument("--tasks", nargs="+", default=None, help="a subset of the languages / tasks")
    p.add_argument("--models", nargs="+", default=None, help="a subset or other models")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the preset's")
    add_finished_only_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return print_table(
        lambda: run_table(
            args.table,
            args.scale,
            args.out,
            args.models,
            args.tasks,
            args.seeds,
            args.finished_only,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
