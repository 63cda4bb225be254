"""Results of :mod:`nested_jax.experiments.synthetic`: runs aggregated over seeds, the Markdown
table and the plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nested_jax.eval.formal_protocol import PROTOCOL_TASKS
from nested_jax.experiments.synthetic_data import SyntheticSettings


def spread(values: Sequence[float]) -> dict:
    """``{mean, std, min, max, values}`` over seeds (``std``: sample, ddof 1; 0 for one value)."""
    x = np.asarray(values, np.float64)
    std = float(x.std(ddof=1)) if x.size > 1 else 0.0
    return {
        "mean": float(x.mean()),
        "std": std,
        "min": float(x.min()),
        "max": float(x.max()),
        "values": x.tolist(),
    }


def best_checks(run: dict) -> dict[str, float]:
    """Each held-out set's best accuracy over a run's checks (``score_every``): the measure the
    formal-language protocol's source reports (its best epoch per bin). It is chosen on the scored
    sets themselves, so it is never our headline number."""
    return {key: max(c["scores"][key] for c in run["curve"]) for key in run["scores"]}


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """One row per model (in first-seen order): each score's accuracy and eval loss, the final
    train loss and the train seconds as :func:`spread` over the model's seeds; where every seed
    has a curve of checks, ``best_checks``: :func:`best_checks` as :func:`spread` per set."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [r for r in runs if r["model"] == model]
        scores = {}
        for key, first in mine[0]["scores"].items():
            info = {k: v for k, v in first.items() if k not in ("accuracy", "eval_loss")}
            scores[key] = {
                **info,
                "accuracy": spread([r["scores"][key]["accuracy"] for r in mine]),
                "eval_loss": spread([r["scores"][key]["eval_loss"] for r in mine]),
            }
        rows.append(
            {
                "model": model,
                "lr": mine[0].get("lr"),
                "weight_decay": mine[0].get("weight_decay"),
                "d_model": mine[0]["d_model"],
                "params": mine[0]["params"],
                "seeds": [r["seed"] for r in mine],
                "scores": scores,
                "val": (
                    spread([r["val"]["accuracy"] for r in mine])
                    if all("val" in r for r in mine)
                    else None
                ),
                "final_train_loss": spread([r["final_train_loss"] for r in mine]),
                "train_seconds": spread([r["train_seconds"] for r in mine]),
                "best_checks": (
                    {k: spread([best_checks(r)[k] for r in mine]) for k in scores}
                    if all(r.get("curve") for r in mine)
                    else None
                ),
            }
        )
    return rows


def _cell(x: dict) -> str:
    return f"{x['mean']:.3f}" if len(x["values"]) == 1 else f"{x['mean']:.3f} ± {x['std']:.3f}"


def _cell_se(x: dict) -> str:
    """Mean ± standard error over seeds (``std / √n``), e.g. ``0.944 ± 0.014``."""
    n = len(x["values"])
    return f"{x['mean']:.3f}" if n == 1 else f"{x['mean']:.3f} ± {x['std'] / np.sqrt(n):.3f}"


def _cell_best(x: dict) -> str:
    """Mean ± std and the best seed (``max``), e.g. ``0.912 ± 0.030 (best 0.950)``."""
    if len(x["values"]) == 1:
        return f"{x['mean']:.3f}"
    return f"{_cell(x)} (best {x['max']:.3f})"


def _seeds_note(seeds: Sequence[int], stats: str = "mean ± sample std") -> str:
    """``"<stats> over seeds 0, 1, 2"``, or ``"seed 0"`` for one seed."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"{stats} over seeds {', '.join(map(str, seeds))}"


def _model(row: dict, seeds: Sequence[int]) -> str:
    """The row's model, with its seeds where it has fewer than the table asked for (a table
    summarised before all its runs finished)."""
    have = row.get("seeds", list(seeds))
    if list(have) == list(seeds):
        return row["model"]
    return f"{row['model']} (seed{'s' if len(have) > 1 else ''} {', '.join(map(str, have))})"


def _rates(s: SyntheticSettings, rows: Sequence[dict]) -> str:
    """``"lr <s.lr>"``, or each model's rate where a sweep chose rates other than ``s.lr``."""
    if all(r.get("lr") in (None, s.lr) for r in rows):
        return f"lr {s.lr:g}"
    return "lr chosen on validation: " + ", ".join(f"{r['model']} {r['lr']:g}" for r in rows)


def _training_note(s: SyntheticSettings, rows: Sequence[dict], where: str = "") -> str:
    """``"<steps> AdamW steps (lr, batch) per model and seed from scratch<where>, <L> layers × <H>
    heads[, width matched …]"``: how every model of a table was trained."""
    return (
        f"{s.steps} AdamW steps ({_rates(s, rows)}, batch {s.batch_size}) per model and seed from "
        f"scratch{where}, {s.n_layers} layers × {s.n_heads} heads"
        + (", width matched to the first model's parameters" if s.match_params else "")
    )


def _protocol_table(rows: Sequence[dict], s: SyntheticSettings, seeds: Sequence[int]) -> str:
    (b0, b1) = s.protocol_bins
    unit = "n" if PROTOCOL_TASKS[s.name].window == "n" else "length"
    head = (
        f"`{s.task}` (next-character protocol): {s.steps} AdamW steps (batch {s.batch_size}) per "
        f"model and seed from scratch on {s.train_size} training strings ({unit} {b0[0]}–{b0[1]}), "
        f"{s.n_layers} layers × {s.n_heads} heads"
        + (", width matched to the first model's parameters" if s.match_params else "")
        + f"; string accuracy (every prediction right) on {s.test_size} test strings per bin "
        f"(Bin0: {unit} {b0[0]}–{b0[1]}, Bin1: {unit} {b1[0]}–{b1[1]}); "
        + _seeds_note(seeds, "mean ± sample std (best)")
        + ".\n\n"
    )
    checked = any(r.get("best_checks") for r in rows)
    if checked:
        head += (
            f"Best check: each bin's best accuracy over the checks every {s.score_every} steps, "
            "the source's measure (its best epoch per bin, chosen on the scored bins); Bin0 / "
            "Bin1 are the end of training.\n\n"
        )
    extra = " best check Bin0 / Bin1 |" if checked else ""
    lines = [
        "| model | lr | d_model | params | Bin0 | Bin1 |" + extra + " val | train loss | train s |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if checked else "") + "---:|---:|---:|",
    ]
    for r in rows:
        sc, best = r["scores"], r.get("best_checks")
        cell = (
            f" {_cell_best(best['bin0'])} / {_cell_best(best['bin1'])} |"
            if best
            else (" – |" if checked else "")
        )
        lines.append(
            f"| {_model(r, seeds)} | {r['lr']:g} | {r['d_model']} | {r['params']:,} "
            f"| {_cell_best(sc['bin0']['accuracy'])} | {_cell_best(sc['bin1']['accuracy'])} |"
            + cell
            + f" {_cell(r['val']) if r['val'] else '–'} | {_cell(r['final_train_loss'])} "
            f"| {r['train_seconds']['mean']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def recall_grid(row: dict, s: SyntheticSettings) -> np.ndarray:
    """Recall: ``[seeds, multipliers, depth bands]`` accuracies of one aggregated row."""
    cells = [[] for _ in s.eval_multipliers]
    for score in row["scores"].values():
        cells[list(s.eval_multipliers).index(score["multiplier"])].append(
            score["accuracy"]["values"]
        )
    return np.moveaxis(np.asarray(cells, np.float64), -1, 0)


def _recall_table(rows: Sequence[dict], s: SyntheticSettings, seeds: Sequence[int]) -> str:
    """Recall: accuracy per length multiplier (the mean over the depth bands), mean ± standard
    error over seeds (the retrieval claims are compared by their means)."""
    sizes = s.recall_batch_sizes()
    head = (
        f"`{s.task}` ({', '.join(f'{k}={v}' for k, v in sizes.items())}): "
        + _training_note(s, rows, f" at {sizes['seq_len']} tokens")
        + f"; answer accuracy on {s.eval_batches} × {s.batch_size} held-out rows per (length, "
        f"depth band) cell, averaged over the {s.depth_bins} bands; chance {s.chance:.3f}; "
        + _seeds_note(seeds, "mean ± standard error")
        + ".\n\n"
    )
    cols = "".join(f" {m}× ({m * sizes['seq_len']}) |" for m in s.eval_multipliers)
    lines = ["| model | d_model | params |" + cols + " train loss | train s |"]
    lines.append("|---|---:|---:|" + "---:|" * len(s.eval_multipliers) + "---:|---:|")
    for r in rows:
        by_length = recall_grid(r, s).mean(axis=2)  # [seeds, multipliers]
        accs = "".join(f" {_cell_se(spread(by_length[:, i]))} |" for i in range(by_length.shape[1]))
        lines.append(
            f"| {_model(r, seeds)} | {r['d_model']} | {r['params']:,} |{accs} "
            f"{_cell(r['final_train_loss'])} | {r['train_seconds']['mean']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def markdown_table(rows: Sequence[dict], s: SyntheticSettings, seeds: Sequence[int]) -> str:
    """The results table with a one-paragraph header of the settings."""
    if s.family == "protocol":
        return _protocol_table(rows, s, seeds)
    if s.family == "recall":
        return _recall_table(rows, s, seeds)
    first = rows[0]["params"] if rows else 1
    head = f"`{s.task}`: " + _training_note(s, rows)
    if s.family == "formal":
        lo, hi = s.train_lengths
        head += (
            f"; trained on string lengths {lo}–{hi}; sequence accuracy on {s.eval_batches} × "
            f"{s.batch_size} held-out strings per length bin"
        )
    else:
        sizes = ", ".join(f"{k}={v}" for k, v in s.sizes.items()) or "MAD baseline sizes"
        head += f" ({sizes}, T={s.seq_len}); accuracy at the scored positions of "
        head += f"{s.eval_batches} held-out batches"
    head += f"; chance {s.chance:.3f}; {_seeds_note(seeds)}.\n\n"
    if s.family == "formal":
        keys = list(rows[0]["scores"]) if rows else []
        bins = [rows[0]["scores"][k] for k in keys] if rows else []
        cols = "".join(f" {b['multiplier']}× ({b['min_len']}–{b['max_len']}) |" for b in bins)
        lines = ["| model | d_model | params | params / first |" + cols + " train loss | train s |"]
        lines.append("|---|---:|---:|---:|" + "---:|" * len(bins) + "---:|---:|")
        for r in rows:
            accs = "".join(f" {_cell(r['scores'][k]['accuracy'])} |" for k in keys)
            lines.append(
                f"| {_model(r, seeds)} | {r['d_model']} | {r['params']:,} "
                f"| {r['params'] / first:.3f} |"
                + accs
                + f" {_cell(r['final_train_loss'])} | {r['train_seconds']['mean']:.0f} |"
            )
        return head + "\n".join(lines) + "\n"
    lines = [
        "| model | d_model | params | params / first | accuracy | × chance | eval loss "
        "| train loss | train s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sc = r["scores"]["heldout"]
        lines.append(
            f"| {_model(r, seeds)} | {r['d_model']} | {r['params']:,} | {r['params'] / first:.3f} "
            f"| {_cell(sc['accuracy'])} | {sc['accuracy']['mean'] / s.chance:.1f} "
            f"| {_cell(sc['eval_loss'])} | {_cell(r['final_train_loss'])} "
            f"| {r['train_seconds']['mean']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], s: SyntheticSettings, path: Path) -> Path:
    """Accuracy vs string length (formal; error bars = std over seeds) or a bar per model (MAD),
    chance dashed; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if s.family == "protocol":
        width = 0.8 / max(len(rows), 1)
        for i, r in enumerate(rows):
            acc = [r["scores"][k]["accuracy"] for k in ("bin0", "bin1")]
            x = np.arange(2) + (i - (len(rows) - 1) / 2) * width
            ax.bar(x, [a["mean"] for a in acc], width, yerr=[a["std"] for a in acc], capsize=3,
                   label=r["model"])  # fmt: skip
            ax.scatter(x, [a["max"] for a in acc], marker="_", color="k", zorder=3)
        ax.set_xticks(range(2), [f"Bin{i} ({b[0]}–{b[1]})" for i, b in enumerate(s.protocol_bins)])
        ax.set_ylabel("string accuracy (bars: mean, ticks: best seed)")
    elif s.family == "recall":
        lengths = [m * s.seq_len for m in s.eval_multipliers]
        for i, r in enumerate(rows):
            by_length = recall_grid(r, s).mean(axis=2)  # [seeds, multipliers]
            ax.errorbar(lengths, by_length.mean(0), yerr=by_length.std(0), marker="o", capsize=3,
                        color=f"C{i}", label=r["model"])  # fmt: skip
            # each seed thin: runs that learn the task and runs that do not are far apart, and
            # a mean with its spread hides which
            ax.plot(lengths, by_length.T, color=f"C{i}", lw=0.6, alpha=0.5, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("row length (tokens; trained at the first)")
        ax.set_ylabel("answer accuracy (dashed: each seed)")
        plot_depth_heatmaps(rows, s, path.with_name(f"{path.stem}_depth.png"))
    elif s.family == "formal":
        for r in rows:
            bins = list(r["scores"].values())
            x = [b["max_len"] for b in bins]
            y = [b["accuracy"]["mean"] for b in bins]
            err = [b["accuracy"]["std"] for b in bins]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=r["model"])
        ax.set_xscale("log", base=2)
        ax.axvline(s.train_lengths[1], color="grey", lw=0.8, ls=":", label="longest training")
        ax.set_xlabel("longest string length of the evaluation bin")
        ax.set_ylabel("sequence accuracy")
    else:
        names = [r["model"] for r in rows]
        acc = [r["scores"]["heldout"]["accuracy"] for r in rows]
        ax.bar(names, [a["mean"] for a in acc], yerr=[a["std"] for a in acc], capsize=4)
        ax.set_ylabel("accuracy at the scored positions")
    if s.family != "protocol":
        ax.axhline(s.chance, color="k", lw=0.8, ls="--", label="chance")
    ax.set_ylim(0.0, 1.02)
    ax.set_title(f"{s.task} ({s.steps} steps)")
    if rows or s.family != "protocol":  # a table with no finished run yet has nothing to name
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(runs: Sequence[dict], s: SyntheticSettings, path: Path) -> Path:
    """The checks along training (``score_every``): one panel per held-out set, accuracy vs step,
    one line per run (a colour per model, a line per seed); written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checked = [r for r in runs if r.get("curve")]
    keys = list(checked[0]["scores"]) if checked else []
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4.2 * max(len(keys), 1), 3.4))
    axes = np.atleast_1d(axes)
    colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r["model"] for r in checked))}
    for ax, key in zip(axes, keys, strict=False):
        for r in checked:
            steps = [c["step"] for c in r["curve"]]
            accs = [c["scores"][key] for c in r["curve"]]
            first = r is next(x for x in checked if x["model"] == r["model"])
            ax.plot(steps, accs, color=colours[r["model"]], lw=1, marker=".", ms=3,
                    label=r["model"] if first else None)  # fmt: skip
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("accuracy (a line per seed)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{s.task}: scored every {s.score_every} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_depth_heatmaps(rows: Sequence[dict], s: SyntheticSettings, path: Path) -> Path:
    """Recall: one heatmap per model, answer accuracy (mean over seeds) by row length × depth of
    the pairs in the haystack (0: its start, farthest from the query); written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(rows), 1)
    fig, axes = plt.subplots(1, n, figsize=(2.6 * n + 1.0, 3.0), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=False):
        grid = recall_grid(r, s).mean(axis=0)  # [multipliers, bands]
        im = ax.imshow(grid.T, origin="lower", vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(s.eval_multipliers)), [f"{m}×" for m in s.eval_multipliers])
        ax.set_yticks(range(s.depth_bins), [f"{i / s.depth_bins:.1f}" for i in range(s.depth_bins)])
        ax.set_title(r["model"], fontsize=8)
        ax.set_xlabel("length")
    axes[0][0].set_ylabel("depth band (start)")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
