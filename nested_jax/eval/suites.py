"""The generated retrieval suites of ``nested-jax eval --suite``: NIAH, RULER-style, BABILong-style.

Each suite builds its examples from the workdir's validation text (the haystack) with the config's
``eval`` settings, scores them teacher-forced through the run's sharded argmax
(:func:`~nested_jax.train.inference.sharded_argmax_fn`), and returns a JSON-able section of the
report plus, where a picture beats a table, a PNG:

=========  ==========================================  ===========================================
suite      config (``eval.*``)                          plot
=========  ==========================================  ===========================================
niah       niah_lengths × niah_depths, niah_per_cell   ``eval_niah.png``: length × depth heatmap
ruler      ruler_kinds, ruler_lengths × niah_depths,   ``eval_ruler.png``: one length × depth
           ruler_per_cell, ruler_haystack              heatmap (exact match) per kind
babilong   babilong_tasks, babilong_lengths,           ``eval_babilong.png``: accuracy vs length
           babilong_per_length                         per task, chance dashed
=========  ==========================================  ===========================================

Every generator is seeded with ``eval.niah_seed`` (the same report from the same workdir). Lengths
are in tokens; a memory model streams the whole example (nothing is truncated), so lengths beyond
``data.seq_len`` measure length generalisation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from nested_jax.eval import babilong, babilong_stories, ruler, tasks

SUITES = ("validation", "niah", "ruler", "babilong")
DEFAULT_SUITES = ("validation", "niah")


def parse_suites(text: str) -> tuple[str, ...]:
    """``"niah,ruler"`` → ``("niah", "ruler")`` in :data:`SUITES` order, without repeats.

    Raises:
      ValueError: naming ``--suite`` for an empty list or an unknown name.
    """
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    unknown = sorted(set(names) - set(SUITES))
    if not names or unknown:
        raise ValueError(
            f"--suite: expected names from {', '.join(SUITES)} joined by commas, got {text!r}"
        )
    return tuple(n for n in SUITES if n in names)


def _check_names(field: str, names: Sequence[str], known: Sequence[str]) -> None:
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise ValueError(f"eval.{field}: expected names from {', '.join(known)}, got {list(names)}")


def _cells(table: dict) -> dict:
    """``{length: {depth: v}}`` with string keys (JSON)."""
    return {str(n): {f"{d:g}": v for d, v in row.items()} for n, row in table.items()}


def run_niah(predict: Callable, tokenizer, haystack: str, e) -> dict:
    """Passkey retrieval over ``eval.niah_lengths × eval.niah_depths`` (:mod:`.tasks`)."""
    examples = tasks.niah_grid(
        haystack, tokenizer, e.niah_lengths, e.niah_depths, e.niah_per_cell, e.niah_seed
    )
    result = tasks.score_niah(predict, examples)
    return {
        "accuracy": _cells(result["accuracy"]),
        "overall": result["overall"],
        "num_examples": result["num_examples"],
    }


def run_ruler(predict: Callable, tokenizer, haystack: str, e) -> dict:
    """Each kind of ``eval.ruler_kinds`` over ``eval.ruler_lengths × eval.niah_depths``
    (:mod:`.ruler`; the noise haystack when ``eval.ruler_haystack`` is ``noise``)."""
    _check_names("ruler_kinds", e.ruler_kinds, ruler.KINDS)
    text = None if e.ruler_haystack == "noise" else haystack
    out = {}
    for kind in e.ruler_kinds:
        examples = ruler.ruler_grid(
            kind,
            text,
            tokenizer,
            e.ruler_lengths,
            e.niah_depths,
            e.ruler_per_cell,
            e.niah_seed,
        )
        r = ruler.score_ruler(predict, examples)
        out[kind] = {
            "accuracy": _cells(r["accuracy"]),
            "recall": _cells(r["recall"]),
            "overall": r["overall"],
            "overall_recall": r["overall_recall"],
            "overall_token_recall": r["overall_token_recall"],
            "num_examples": r["num_examples"],
        }
    return {"haystack": e.ruler_haystack, "kinds": out}


def run_babilong(predict: Callable, tokenizer, haystack: str, e) -> dict:
    """Each task of ``eval.babilong_tasks`` at ``eval.babilong_lengths`` (:mod:`.babilong`)."""
    _check_names("babilong_tasks", e.babilong_tasks, babilong_stories.TASKS)
    examples = []
    for task in e.babilong_tasks:
        examples += babilong.babilong_grid(
            task, haystack, tokenizer, list(e.babilong_lengths), e.babilong_per_length, e.niah_seed
        )
    r = babilong.score_babilong(predict, examples)
    return {
        "by_task": {t: {str(n): a for n, a in row.items()} for t, row in r["by_task"].items()},
        "chance": {t: babilong_stories.babilong_chance(t) for t in e.babilong_tasks},
        "overall": r["overall"],
        "num_examples": r["num_examples"],
    }


RUNNERS = {"niah": run_niah, "ruler": run_ruler, "babilong": run_babilong}


# ---- Markdown -----------------------------------------------------------------------------------


def niah_section(niah: dict) -> list[str]:
    acc = niah["accuracy"]
    return [
        "## Needle in a haystack (passkey exact match)",
        "",
        *tasks.grid_markdown(acc, lambda n, d: f"{acc[n][d]:.2f}"),
        "",
        f"overall {niah['overall']:.3f} over {niah['num_examples']} examples",
    ]


def ruler_section(section: dict) -> list[str]:
    lines = [f"## RULER-style retrieval ({section['haystack']} haystack; exact / recall)"]
    for kind, r in section["kinds"].items():
        exact, recall = r["accuracy"], r["recall"]
        lines += [
            "",
            f"### {kind}",
            "",
            *tasks.grid_markdown(
                exact, lambda n, d, e=exact, c=recall: f"{e[n][d]:.2f} / {c[n][d]:.2f}"
            ),
            "",
            f"overall exact {r['overall']:.3f}, recall {r['overall_recall']:.3f}, token recall "
            f"{r['overall_token_recall']:.3f} over {r['num_examples']} examples",
        ]
    return lines


def babilong_section(section: dict) -> list[str]:
    table = section["by_task"]
    lengths = sorted({int(n) for row in table.values() for n in row})
    lines = [
        "## BABILong-style (bAbI facts in the text; exact match)",
        "",
        "| task | " + " | ".join(str(n) for n in lengths) + " | chance |",
        "|---|" + "---:|" * (len(lengths) + 1),
    ]
    for task, row in table.items():
        cells = [f"{row[str(n)]:.2f}" if str(n) in row else "" for n in lengths]
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {section['chance'][task]:.2f} |")
    lines += ["", f"overall {section['overall']:.3f} over {section['num_examples']} examples"]
    return lines


SECTIONS = {"niah": niah_section, "ruler": ruler_section, "babilong": babilong_section}


# ---- plots --------------------------------------------------------------------------------------


def _heatmap(ax, cells: dict, title: str):
    lengths = sorted(cells, key=int)
    depths = sorted({float(d) for row in cells.values() for d in row})
    grid = np.full((len(lengths), len(depths)), np.nan)
    for i, n in enumerate(lengths):
        for j, d in enumerate(depths):
            grid[i, j] = cells[n].get(f"{d:g}", np.nan)
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), lengths)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("length (tokens)")
    ax.set_title(title, fontsize=9)
    for i in range(len(lengths)):
        for j in range(len(depths)):
            if np.isfinite(grid[i, j]):
                shade = "k" if grid[i, j] > 0.6 else "w"  # readable on viridis' light end
                ax.text(
                    j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color=shade, fontsize=7
                )
    return im


def plot_suite(name: str, section: dict, path: Path, title: str) -> Path:
    """The suite's picture as a PNG at ``path`` (see the module table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if name == "niah":
        fig, ax = plt.subplots(figsize=(5.0, 3.6), layout="constrained")
        im = _heatmap(ax, section["accuracy"], f"{title}: passkey NIAH")
        fig.colorbar(im, ax=ax, label="exact match")
    elif name == "ruler":
        kinds = list(section["kinds"])
        fig, axes = plt.subplots(
            1, len(kinds), figsize=(3.8 * len(kinds), 3.6), squeeze=False, layout="constrained"
        )
        for ax, kind in zip(axes[0], kinds, strict=True):
            im = _heatmap(ax, section["kinds"][kind]["accuracy"], f"{title}: {kind}")
        fig.colorbar(im, ax=axes[0].tolist(), label="exact match")
    else:
        fig, ax = plt.subplots(figsize=(5.6, 3.8), layout="constrained")
        for task, row in section["by_task"].items():
            lengths = sorted(row, key=int)
            line = ax.plot([int(n) for n in lengths], [row[n] for n in lengths], "o-", label=task)
            ax.axhline(section["chance"][task], color=line[0].get_color(), lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ticks = sorted({int(n) for row in section["by_task"].values() for n in row})
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("exact match (dashed: chance)")
        ax.set_title(f"{title}: BABILong-style", fontsize=9)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
