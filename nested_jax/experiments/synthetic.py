"""Train several LM-shell models from scratch on a generated task and compare them in one table.

    python -m nested_jax.experiments.synthetic --task formal:parity --models transformer gdn \\
        --steps 300 --train-lengths 1 16 --eval-multipliers 1 2 4 8 --seeds 0 1 --out runs/synth
    python -m nested_jax.experiments.synthetic --task mad:in_context_recall \\
        --models transformer gdn --steps 300 --mad-sizes seq_len=64 --out runs/synth

Tasks (``--task FAMILY:NAME``):

* ``formal:<name>``, a key of :data:`nested_jax.eval.formal_languages.FORMAL_TASKS` (parity, Dyck,
  aⁿbⁿ, ...): one string per row, the answer (its class) predicted at the QUERY position. Models
  train on strings with lengths in ``--train-lengths LO HI`` (rows padded to ``T = HI + 2``) and are
  scored by sequence accuracy (:func:`~nested_jax.eval.formal_languages.formal_accuracy`) on
  held-out strings in one length bin per multiplier ``m`` of ``--eval-multipliers``: ``m = 1`` is
  the training range ``[LO, HI]``, ``m > 1`` the bin ``(m · HI / 2, m · HI]`` (so 2×, 4×, 8× are
  ``(HI, 2 HI]``, ``(2 HI, 4 HI]``, ``(4 HI, 8 HI]``: lengths never seen in training), padded to
  ``m · T``. Chance: 1 / (number of classes)
  (:func:`~nested_jax.eval.formal_languages.formal_chance`).
* ``mad:<name>``, a key of :data:`nested_jax.eval.mad.MAD_TASKS` (in-context recall, selective
  copying, ...) at MAD's baseline sizes unless ``--mad-sizes KEY=INT ...`` overrides them (e.g.
  ``seq_len=64``); scored by the accuracy at the masked positions
  (:func:`~nested_jax.eval.mad.mad_accuracy`, micro) on held-out batches; chance
  :func:`~nested_jax.eval.mad.mad_chance`.

The loss is taken only at the scored positions. Training, parameter matching (``--match-params``,
default on: every model after the first gets the ``d_model`` whose parameter count is closest to
the first model's), model specs (``<name>+proteus<E>``) and the per-model cache are those of the
MQAR driver (:mod:`nested_jax.experiments._training`). Each model trains once per seed of
``--seeds`` (the seed sets the initialisation and the training batches; held-out batches use
``seed + 10_000``); the table reports the mean ± the sample standard deviation over seeds.

Writes ``<out>/<family>_<name>.json`` (settings, one run per model and seed, one aggregated row per
model), ``<out>/<family>_<name>.md`` (the table) and ``<out>/<family>_<name>.png`` (accuracy vs
string length per model for formal tasks, a bar chart for MAD; chance dashed), and prints the
Markdown. Each finished run is kept in ``<out>/models/<family>_<name>/<model>-seed<k>.json`` and
reused by a later run with identical settings and width.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nested_jax.eval.formal_languages import (
    FORMAL_TASKS,
    FormalVocab,
    formal_accuracy,
    formal_chance,
    make_formal_batch,
)
from nested_jax.eval.mad import MAD_TASKS, mad_accuracy, mad_chance, make_mad_batch
from nested_jax.experiments._training import (
    add_scalar_flags,
    cached_row,
    check_models,
    check_multipliers,
    check_positive,
    fit,
    make_scorer,
    model_widths,
    scalar_values,
)
from nested_jax.files import write_json

FAMILIES = {"formal": FORMAL_TASKS, "mad": MAD_TASKS}
EVAL_SEED_OFFSET = 10_000  # held-out batches: seed + this (training batches use the seed itself)


def parse_task(task: str) -> tuple[str, str]:
    """``"formal:parity"`` -> ``("formal", "parity")``.

    Raises:
      ValueError: naming ``task`` when the family or the name is unknown.
    """
    family, sep, name = str(task).partition(":")
    if not sep or family not in FAMILIES or name not in FAMILIES[family]:
        raise ValueError(
            f"task: expected formal:<name> or mad:<name>, got {task!r}; "
            f"formal: {sorted(FORMAL_TASKS)}; mad: {sorted(MAD_TASKS)}"
        )
    return family, name


@dataclasses.dataclass(frozen=True)
class SyntheticSettings:
    """One comparison on one generated task (the same for every model)."""

    task: str = "formal:parity"  # formal:<name> or mad:<name>
    steps: int = 300  # optimizer steps per model and seed
    batch_size: int = 32  # sequences per step (and per held-out batch)
    d_model: int = 64  # width of the first model (the parameter budget)
    n_layers: int = 2  # blocks per model
    n_heads: int = 2  # heads per mixer
    lr: float = 2e-3  # AdamW peak learning rate
    warmup_steps: int = 20  # linear warmup steps
    weight_decay: float = 0.1  # decoupled AdamW weight decay on matrices
    eval_batches: int = 8  # held-out batches per length bin (formal) or in all (MAD)
    seed: int = 0  # init and training batches of one run (run_synthetic sets it per seed)
    match_params: bool = True  # adjust d_model of models 2.. to the first model's parameter count
    train_lengths: tuple[int, int] = (1, 16)  # formal: training string lengths [lo, hi]
    eval_multipliers: tuple[int, ...] = (1, 2, 4, 8)  # formal: score at lengths up to m × hi
    mad_sizes: tuple[tuple[str, int], ...] = ()  # MAD: overrides of the task's baseline sizes

    def __post_init__(self) -> None:
        family, name = parse_task(self.task)
        check_positive(self, ("steps", "batch_size", "d_model", "n_layers", "n_heads"))
        check_positive(self, ("eval_batches",))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        # the generators validate the sizes; fail before any training, naming our own field
        if family == "mad":
            sizes = self.sizes
            try:
                make_mad_batch(name, 1, 0, **sizes)
            except (TypeError, ValueError) as err:
                raise ValueError(f"mad_sizes: {err}") from None
            return
        if self.mad_sizes:
            raise ValueError(f"mad_sizes: only for mad:<name> tasks, not {self.task!r}")
        try:
            make_formal_batch(name, 1, self.train_lengths, 0)
        except ValueError as err:
            raise ValueError(f"train_lengths: {err}") from None
        check_multipliers(self.eval_multipliers)
        for m in self.eval_multipliers:
            try:
                make_formal_batch(name, 1, self.eval_lengths(m), 0)
            except ValueError as err:
                raise ValueError(f"eval_multipliers: {m}×: {err}") from None

    @property
    def family(self) -> str:
        return parse_task(self.task)[0]

    @property
    def name(self) -> str:
        return parse_task(self.task)[1]

    @property
    def sizes(self) -> dict[str, int]:
        """The MAD size overrides as keyword arguments."""
        try:
            return dict(self.mad_sizes)
        except (TypeError, ValueError):
            raise ValueError(
                f"mad_sizes: expected (key, int) pairs, got {self.mad_sizes!r}"
            ) from None

    @property
    def vocab(self) -> int:
        """Model vocabulary: the 17 formal-language ids, or the MAD task's ``vocab_size``."""
        if self.family == "formal":
            return FormalVocab().size
        make = MAD_TASKS[self.name].make
        return self.sizes.get(
            "vocab_size", inspect.signature(make).parameters["vocab_size"].default
        )

    @property
    def seq_len(self) -> int:
        """T of a training batch."""
        if self.family == "formal":
            return self.train_lengths[1] + 2  # BOS, string, QUERY
        return make_mad_batch(self.name, 1, 0, **self.sizes)["inputs"].shape[1]

    @property
    def chance(self) -> float:
        if self.family == "formal":
            return formal_chance(self.name)
        return mad_chance(self.name, **self.sizes)

    def eval_lengths(self, m: int) -> tuple[int, int]:
        """String lengths of the ``m×`` bin: the training range at 1, else ``(m·hi/2, m·hi]``."""
        lo, hi = self.train_lengths
        return (lo, hi) if m == 1 else (m * hi // 2 + 1, m * hi)


def train_batch(s: SyntheticSettings, rng: np.random.Generator) -> dict:
    """One training batch of ``s.task`` drawn from ``rng``."""
    if s.family == "formal":
        return make_formal_batch(s.name, s.batch_size, s.train_lengths, rng)
    return make_mad_batch(s.name, s.batch_size, rng, **s.sizes)


def eval_sets(s: SyntheticSettings) -> list[tuple[str, dict, list[dict]]]:
    """``(key, info, batches)`` per held-out set: one per multiplier for a formal task (``key =
    str(m)``, ``info``: ``multiplier, min_len, max_len, seq_len``), one (``"heldout"``) for MAD."""
    seed = s.seed + EVAL_SEED_OFFSET
    if s.family == "mad":
        rng = np.random.default_rng(seed)
        batches = [
            make_mad_batch(s.name, s.batch_size, rng, **s.sizes) for _ in range(s.eval_batches)
        ]
        return [("heldout", {"seq_len": s.seq_len}, batches)]
    sets = []
    for m in s.eval_multipliers:
        lo, hi = s.eval_lengths(m)
        rng = np.random.default_rng(seed)  # the same source at every length
        batches = [
            make_formal_batch(s.name, s.batch_size, (lo, hi), rng, seq_len=m * s.seq_len)
            for _ in range(s.eval_batches)
        ]
        info = {"multiplier": m, "min_len": lo, "max_len": hi, "seq_len": m * s.seq_len}
        sets.append((str(m), info, batches))
    return sets


def train_and_score(name: str, s: SyntheticSettings, d_model: int, log_every: int = 50) -> dict:
    """Train model ``name`` on ``s.task`` from scratch (seed ``s.seed``) and score it.

    Returns:
      a run: ``model, seed, d_model, params, steps, final_train_loss, accuracy`` (of the first
      held-out set), ``scores`` (``{key: {**info, accuracy, eval_loss, eval_queries}}``, keys and
      info of :func:`eval_sets`), ``train_seconds`` (compilation included), ``tokens_per_s``.
    """
    trained, stats = fit(name, s, d_model, lambda rng: train_batch(s, rng), log_every)
    score = make_scorer(trained)
    accuracy_fn = formal_accuracy if s.family == "formal" else mad_accuracy
    scores = {key: {**info, **score(batches, accuracy_fn)} for key, info, batches in eval_sets(s)}
    return {
        "model": name,
        "seed": s.seed,
        "d_model": d_model,
        "params": stats["params"],
        "steps": s.steps,
        "final_train_loss": stats["final_train_loss"],
        "accuracy": next(iter(scores.values()))["accuracy"],
        "scores": scores,
        "train_seconds": stats["train_seconds"],
        "tokens_per_s": stats["tokens_per_s"],
    }


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


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """One row per model (in first-seen order): each score's accuracy and eval loss, the final
    train loss and the train seconds as :func:`spread` over the model's seeds."""
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
                "d_model": mine[0]["d_model"],
                "params": mine[0]["params"],
                "seeds": [r["seed"] for r in mine],
                "scores": scores,
                "final_train_loss": spread([r["final_train_loss"] for r in mine]),
                "train_seconds": spread([r["train_seconds"] for r in mine]),
            }
        )
    return rows


def _cell(x: dict) -> str:
    return f"{x['mean']:.3f}" if len(x["values"]) == 1 else f"{x['mean']:.3f} ± {x['std']:.3f}"


def markdown_table(rows: Sequence[dict], s: SyntheticSettings, seeds: Sequence[int]) -> str:
    """The results table with a one-paragraph header of the settings."""
    first = rows[0]["params"] if rows else 1
    head = (
        f"`{s.task}`: {s.steps} AdamW steps (lr {s.lr:g}, batch {s.batch_size}) per model and "
        f"seed from scratch, {s.n_layers} layers × {s.n_heads} heads"
        + (", width matched to the first model's parameters" if s.match_params else "")
    )
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
    seed_note = (
        f"mean ± sample std over seeds {', '.join(map(str, seeds))}"
        if len(seeds) > 1
        else f"seed {seeds[0]}"
    )
    head += f"; chance {s.chance:.3f}; {seed_note}.\n\n"
    if s.family == "formal":
        keys = list(rows[0]["scores"]) if rows else []
        bins = [rows[0]["scores"][k] for k in keys] if rows else []
        cols = "".join(f" {b['multiplier']}× ({b['min_len']}–{b['max_len']}) |" for b in bins)
        lines = ["| model | d_model | params | params / first |" + cols + " train loss | train s |"]
        lines.append("|---|---:|---:|---:|" + "---:|" * len(bins) + "---:|---:|")
        for r in rows:
            accs = "".join(f" {_cell(r['scores'][k]['accuracy'])} |" for k in keys)
            lines.append(
                f"| {r['model']} | {r['d_model']} | {r['params']:,} | {r['params'] / first:.3f} |"
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
            f"| {r['model']} | {r['d_model']} | {r['params']:,} | {r['params'] / first:.3f} "
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
    if s.family == "formal":
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
    ax.axhline(s.chance, color="k", lw=0.8, ls="--", label="chance")
    ax.set_ylim(0.0, 1.02)
    ax.set_title(f"{s.task} ({s.steps} steps)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_synthetic(
    models: Sequence[str],
    s: SyntheticSettings,
    seeds: Sequence[int] = (0,),
    out: str | Path | None = None,
    log_every: int = 50,
) -> dict:
    """Size, train and score every model at every seed; write ``<stem>.json`` / ``.md`` / ``.png``
    under ``out`` (``stem = <family>_<name>``).

    Returns:
      ``{"task", "settings", "seeds", "chance", "runs", "rows", "markdown", "plot"}`` (``plot``:
      the PNG path, or None without ``out``).
    """
    check_models(models)
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(not isinstance(k, int) for k in seeds):
        raise ValueError(f"seeds: expected distinct ints, got {seeds}")
    widths = model_widths(models, s, s.match_params)
    stem = s.task.replace(":", "_")

    def compute(name: str, si: SyntheticSettings) -> dict:
        print(f"== {name} seed {si.seed}: d_model {widths[name]}, {s.steps} steps", flush=True)
        run = train_and_score(name, si, widths[name], log_every)
        accs = ", ".join(f"{k}: {v['accuracy']:.3f}" for k, v in run["scores"].items())
        print(
            f"== {name} seed {si.seed}: accuracy {accs} (chance {s.chance:.3f}), "
            f"{run['train_seconds']:.0f} s",
            flush=True,
        )
        return run

    runs = []
    for name in models:
        for seed in seeds:
            si = dataclasses.replace(s, seed=seed)
            done = None if out is None else Path(out) / "models" / stem / f"{name}-seed{seed}.json"
            key = {"settings": dataclasses.asdict(si), "d_model": widths[name]}
            runs.append(
                cached_row(done, key, lambda n=name, x=si: compute(n, x), f"{name} seed {seed}")
            )
    rows = aggregate(runs)
    md = markdown_table(rows, s, seeds)
    settings = {k: v for k, v in dataclasses.asdict(s).items() if k != "seed"}
    result = {
        "task": s.task,
        "settings": settings,
        "seeds": seeds,
        "chance": s.chance,
        "runs": runs,
        "rows": rows,
        "markdown": md,
        "plot": None,
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        result["plot"] = str(plot(rows, s, out / f"{stem}.png"))
        write_json(out / f"{stem}.json", result)
        (out / f"{stem}.md").write_text(md)
    return result


def _mad_sizes(items: Sequence[str]) -> tuple[tuple[str, int], ...]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value.lstrip("-").isdigit():
            raise ValueError(f"mad_sizes: expected KEY=INT (e.g. seq_len=64), got {item!r}")
        pairs.append((key, int(value)))
    return tuple(pairs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.synthetic",
        description="train registered LM-shell models on a generated task (formal languages, MAD) "
        "and compare their accuracy",
    )
    p.add_argument("--task", required=True, help="formal:<name> or mad:<name>")
    p.add_argument(
        "--models",
        nargs="+",
        required=True,
        help="registered model (mixer) names, optionally <name>+proteus<E> (e.g. gdn+proteus16)",
    )
    add_scalar_flags(p, SyntheticSettings, skip=("task", "seed"))
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per seed (default 0)")
    p.add_argument(
        "--train-lengths",
        nargs=2,
        type=int,
        default=None,
        metavar=("LO", "HI"),
        help="formal: training string lengths (default 1 16)",
    )
    p.add_argument(
        "--eval-multipliers",
        nargs="+",
        type=int,
        default=None,
        help="formal: score the length bins (m·HI/2, m·HI]; 1 = the training range "
        "(default 1 2 4 8)",
    )
    p.add_argument(
        "--mad-sizes", nargs="+", default=None, metavar="KEY=INT", help="MAD: size overrides"
    )
    p.add_argument(
        "--no-match-params",
        action="store_true",
        help="use --d-model for every model instead of matching the first model's parameters",
    )
    p.add_argument("--out", default=None, help="directory for the json, md and png")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    values = scalar_values(args, SyntheticSettings, skip=("task", "seed"))
    try:
        family, _ = parse_task(args.task)
        formal_only = {
            "train_lengths": args.train_lengths,
            "eval_multipliers": args.eval_multipliers,
        }
        for field, given in formal_only.items():
            if given is not None:
                if family != "formal":
                    raise ValueError(f"{field}: only for formal:<name> tasks, not {args.task!r}")
                values[field] = tuple(given)
        if args.mad_sizes is not None:
            values["mad_sizes"] = _mad_sizes(args.mad_sizes)
        s = SyntheticSettings(task=args.task, match_params=not args.no_match_params, **values)
        out = run_synthetic(args.models, s, args.seeds, args.out)
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(out["markdown"], end="")
    if out["plot"]:
        print(f"plot: {out['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
