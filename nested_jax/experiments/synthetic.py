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
* ``protocol:<name>``, a key of :data:`nested_jax.eval.formal_protocol.PROTOCOL_TASKS` (parity,
  aa_star, abab_star, anbn, anbncn, shuffle2): the next-character protocol of Nested Learning's
  Table 5 (Irie et al. 2023 after Bhattamishra et al. 2020; docs/RESULTS.md "Formal-language
  protocol"). Fixed string sets
  (:func:`~nested_jax.experiments.synthetic_data.protocol_data`): ``--train-size`` training
  strings in the Bin0 window, ``--val-size`` validation strings (Bin0 window, disjoint from the
  test strings) and ``--test-size`` test strings per bin; ``--bins LO0 HI0 LO1 HI1`` overrides the
  task's windows.
  Scored by string accuracy (every prediction of a string right, per bin); chance is ~0.
* ``mad:<name>``, a key of :data:`nested_jax.eval.mad.MAD_TASKS` (in-context recall, selective
  copying, ...) at MAD's baseline sizes unless ``--mad-sizes KEY=INT ...`` overrides them (e.g.
  ``seq_len=64``); scored by the accuracy at the masked positions
  (:func:`~nested_jax.eval.mad.mad_accuracy`, micro) on held-out batches; chance
  :func:`~nested_jax.eval.mad.mad_chance`.
* ``recall:kv`` (:mod:`nested_jax.eval.recall`): key–value pairs at chosen depths of a haystack of
  filler tokens, queried at the end; sizes ``--recall-sizes seq_len=128 pairs=8 queries=4 ...``.
  Trained at ``seq_len`` over the whole haystack; scored by the accuracy of the answers in every
  cell of the grid ``--eval-multipliers`` (rows ``m · seq_len`` long) × ``--depth-bins`` bands of
  the haystack (every pair of a row in the band): the needle-in-a-haystack heatmap of a model
  trained on the task. Chance ``1 / values``.

The loss is taken only at the scored positions. Training, parameter matching (``--match-params``,
default on: every model after the first gets the ``d_model`` whose parameter count is closest to
the first model's), model specs (``<name>+proteus<E>``) and the per-model cache are those of the
MQAR driver (:mod:`nested_jax.experiments._training`). Each model trains once per seed of
``--seeds`` (the seed sets the initialisation and the training batches; held-out batches use
``seed + 10_000``); the table reports the mean ± the sample standard deviation over seeds.

Per-model options: ``--set-model MODEL:model.KEY=VALUE`` (repeatable) overrides one model's
``ModelConfig`` through the strict config machinery (an unknown key fails in one line before any
training). ``--lrs A B ...`` sweeps the learning rate per model (first seed; the best validation
accuracy wins, :func:`run_synthetic`) and runs the seeds at the chosen rate. Tables give mean ±
std over seeds and, for protocol tasks, the best seed. ``--score-every N`` also scores the
held-out sets and the validation split every ``N`` steps (a run's ``curve``, plotted in
``<out>/<family>_<name>_curve.png``); protocol tables then add each bin's best check, the measure
the protocol's source reports (its best epoch per bin), beside the end of training.

Writes ``<out>/<family>_<name>.json`` (settings, one run per model and seed, one aggregated row per
model), ``<out>/<family>_<name>.md`` (the table) and ``<out>/<family>_<name>.png`` (accuracy vs
string length per model for formal tasks, a bar chart for MAD; chance dashed), and prints the
Markdown. Each finished run is kept in ``<out>/models/<family>_<name>/<model>-seed<k>.json`` (its
trained weights beside it, ``.params.npz``) and reused by a later run with identical settings and
width. A run in progress saves its state every five minutes (``.progress.npz`` beside it), so a
stopped table (killed, a machine handed back) continues each run from where it stopped, on the
same batches, to the same weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from nested_jax.eval.formal_languages import formal_accuracy
from nested_jax.eval.formal_protocol import protocol_accuracy
from nested_jax.eval.mad import mad_accuracy
from nested_jax.eval.recall import recall_accuracy
from nested_jax.experiments._cache import cached_row, saved_row
from nested_jax.experiments._training import (
    Checks,
    Progress,
    add_scalar_flags,
    check_models,
    fit,
    make_scorer,
    model_config,
    model_widths,
    save_params,
    scalar_values,
)
from nested_jax.experiments.synthetic_data import (
    SyntheticSettings,
    eval_sets,
    parse_task,
    train_batch,
    val_batches,
)
from nested_jax.experiments.synthetic_report import (
    aggregate,
    markdown_table,
    plot,
    plot_curves,
)
from nested_jax.files import write_json

# Settings fields added after tables were already filled, at their defaults: a saved run whose key
# lacks them was made under these values and is reused (see _cache.same_key).
FIELDS_ADDED = {
    f.name: f.default
    for f in dataclasses.fields(SyntheticSettings)
    if f.name in ("recall_sizes", "depth_bins", "score_every")
}


def _accuracy_fn(s: SyntheticSettings):
    """``(accuracy_fn, per_row)`` of the task family."""
    if s.family == "protocol":
        return protocol_accuracy, True
    by_family = {"formal": formal_accuracy, "recall": recall_accuracy}
    return by_family.get(s.family, mad_accuracy), False


def score_checks(name: str, s: SyntheticSettings, sets: list, val: list) -> Checks:
    """Every ``s.score_every`` steps: the accuracy on each held-out set of ``sets`` (those of
    :func:`eval_sets`) and on the validation batches ``val``, ``{"scores": {key: accuracy},
    "val": accuracy}`` (one line printed)."""
    accuracy_fn, per_row = _accuracy_fn(s)
    scorer: list = []  # built at the first check, then reused (compiled once per batch shape)

    def check(trained) -> dict:
        if not scorer:
            scorer.append(make_scorer(trained))
        score = scorer[0]
        accs = {k: score(b, accuracy_fn, per_row, trained.params)["accuracy"] for k, _, b in sets}
        val_acc = score(val, accuracy_fn, per_row, trained.params)["accuracy"]
        shown = " ".join(f"{k} {a:.3f}" for k, a in accs.items())
        print(f"  [{name}] check: {shown} val {val_acc:.3f}", flush=True)
        return {"scores": accs, "val": val_acc}

    return Checks(s.score_every, check)


def train_and_score(
    name: str,
    s: SyntheticSettings,
    d_model: int,
    log_every: int = 50,
    params_path: Path | None = None,
    progress: Progress | None = None,
) -> dict:
    """Train model ``name`` on ``s.task`` from scratch (seed ``s.seed``) and score it; with
    ``params_path``, keep the trained weights there (:func:`~._training.save_params`); with
    ``progress``, continue a stopped run and save as it goes (:class:`~._training.Progress`).

    Returns:
      a run: ``model, seed, d_model, params, steps, final_train_loss, accuracy`` (of the first
      held-out set), ``scores`` (``{key: {**info, accuracy, eval_loss, eval_queries}}``, keys and
      info of :func:`eval_sets`), ``train_seconds`` (compilation and checks included),
      ``tokens_per_s``; with ``s.score_every``, ``curve``: the :func:`score_checks` along the way.
    """
    sets, val = eval_sets(s), val_batches(s)
    checks = score_checks(name, s, sets, val) if s.score_every else None
    trained, stats = fit(
        name, s, d_model, lambda rng: train_batch(s, rng), log_every, progress, checks
    )
    if params_path is not None:
        save_params(params_path, trained.params)
    score = make_scorer(trained)
    accuracy_fn, per_row = _accuracy_fn(s)
    scores = {key: {**info, **score(batches, accuracy_fn, per_row)} for key, info, batches in sets}
    return {
        "model": name,
        "seed": s.seed,
        "d_model": d_model,
        "params": stats["params"],
        "steps": s.steps,
        "final_train_loss": stats["final_train_loss"],
        "accuracy": next(iter(scores.values()))["accuracy"],
        "scores": scores,
        "val": score(val, accuracy_fn, per_row),
        "lr": s.lr,
        "weight_decay": s.weight_decay,
        "train_seconds": stats["train_seconds"],
        "tokens_per_s": stats["tokens_per_s"],
        **({"curve": stats["curve"]} if checks is not None else {}),
    }


def run_file(out: str | Path, s: SyntheticSettings, name: str, seed: int, lr: float, wd: float):
    """Where :func:`run_synthetic` keeps model ``name``'s run at ``seed``, ``lr`` and weight decay
    ``wd`` (its trained weights: the same path with ``.params.npz``): ``<out>/models/<stem>/
    <name>-seed<k>[-lr<lr>][-wd<wd>].json``, the rate and decay named where they differ from
    ``s``'s."""
    tag = f"{name}-seed{seed}" + ("" if lr == s.lr else f"-lr{lr:g}")
    tag += "" if wd == s.weight_decay else f"-wd{wd:g}"
    return Path(out) / "models" / s.task.replace(":", "_") / f"{tag}.json"


def _checked_lists(models, s: SyntheticSettings, seeds, lrs, wds):
    """``(seeds, lrs, wds)`` as lists, after the checks of :func:`run_synthetic`'s arguments.

    Raises:
      ValueError: naming ``models``, ``seeds``, ``lrs``, ``wds`` or ``model_overrides``.
    """
    check_models(models)
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(not isinstance(k, int) for k in seeds):
        raise ValueError(f"seeds: expected distinct ints, got {seeds}")
    lrs = [float(x) for x in lrs]
    if any(not x > 0 for x in lrs) or len(set(lrs)) != len(lrs):
        raise ValueError(f"lrs: expected distinct rates > 0, got {lrs}")
    wds = [float(x) for x in wds]
    if any(not x >= 0 for x in wds) or len(set(wds)) != len(wds):
        raise ValueError(f"wds: expected distinct decays >= 0, got {wds}")
    unknown = sorted({m for m, _ in s.model_overrides} - set(models))
    if unknown:
        raise ValueError(f"model_overrides: models {unknown} are not in models {list(models)}")
    return seeds, lrs, wds


class _NotFinished(Exception):
    """A run that ``finished_only`` did not find saved."""


def _finished(run_one: Callable[..., dict], *args) -> dict | None:
    """``run_one(*args)``, or None for a run that ``finished_only`` did not find saved."""
    try:
        return run_one(*args)
    except _NotFinished:
        return None


def run_synthetic(
    models: Sequence[str],
    s: SyntheticSettings,
    seeds: Sequence[int] = (0,),
    out: str | Path | None = None,
    log_every: int = 50,
    lrs: Sequence[float] = (),
    wds: Sequence[float] = (),
    finished_only: bool = False,
) -> dict:
    """Size, train and score every model at every seed; write ``<stem>.json`` / ``.md`` / ``.png``
    under ``out`` (``stem = <family>_<name>``).

    With ``lrs``, each model first trains at every rate of ``lrs`` with the first seed and keeps
    the rate of the best validation accuracy
    (:func:`~nested_jax.experiments.synthetic_data.val_batches`; ties: lower validation loss, then
    the smaller rate); its seeds then run at that rate (the sweep's run at the chosen rate is
    reused). Without ``lrs`` every model uses ``s.lr``. ``wds`` sweeps the weight decay the same
    way, over the grid ``lrs × wds`` (MAD's protocol sweeps both; ties also prefer the smaller
    decay).

    ``finished_only``: train nothing; summarise the runs already saved under ``out`` (a table
    filled a piece at a time, read while its other pieces train). A model whose sweep is not
    complete, or with no finished seed, is left out and named in ``unfinished``; a row with
    fewer seeds than asked says which it has.

    Returns:
      ``{"task", "settings", "seeds", "chance", "runs", "rows", "markdown", "plot", "lr_sweep",
      "unfinished"}``
      (``plot``: the PNG path, or None without ``out``; ``lr_sweep``: per model, the validation
      accuracy and loss at each rate (``"<lr>"``, or ``"<lr>/wd<wd>"`` with ``wds``), the chosen
      rate and decay).
    """
    seeds, lrs, wds = _checked_lists(models, s, seeds, lrs, wds)
    if finished_only and out is None:
        raise ValueError("finished_only: needs out, the directory of the saved runs")
    widths = model_widths(models, s, s.match_params)

    def compute(name: str, si: SyntheticSettings, done: Path | None, key: dict) -> dict:
        print(
            f"== {name} seed {si.seed} lr {si.lr:g}: d_model {widths[name]}, {s.steps} steps",
            flush=True,
        )
        params_path = progress = None
        if done is not None:  # a stopped run continues from its .progress.npz
            params_path = done.with_suffix(".params.npz")
            progress = Progress(done.with_suffix(".progress.npz"), key, added=FIELDS_ADDED)
        run = train_and_score(name, si, widths[name], log_every, params_path, progress)
        accs = ", ".join(f"{k}: {v['accuracy']:.3f}" for k, v in run["scores"].items())
        print(
            f"== {name} seed {si.seed}: accuracy {accs} (chance {s.chance:.3f}), "
            f"{run['train_seconds']:.0f} s",
            flush=True,
        )
        return run

    def run_one(name: str, seed: int, lr: float, wd: float) -> dict:
        mine = tuple(p for p in s.model_overrides if p[0] == name)
        si = dataclasses.replace(s, seed=seed, lr=lr, weight_decay=wd, model_overrides=mine)
        done = None if out is None else run_file(out, s, name, seed, lr, wd)
        key = {"settings": dataclasses.asdict(si), "d_model": widths[name]}
        label = f"{name} seed {seed} lr {lr:g}" + (f" wd {wd:g}" if wds else "")
        if finished_only:  # what is saved, never waiting for a run another process trains
            row = saved_row(done, key, FIELDS_ADDED, label)
            if row is None:
                raise _NotFinished(label)
            return row
        return cached_row(done, key, lambda: compute(name, si, done, key), label, FIELDS_ADDED)

    runs, sweep, unfinished = [], {}, []
    for name in models:
        lr, wd = s.lr, s.weight_decay
        if lrs or wds:
            grid = [(a, b) for a in lrs or [s.lr] for b in wds or [s.weight_decay]]
            try:
                lr, wd, sweep[name] = _sweep(name, grid, bool(wds), run_one, seeds[0])
            except _NotFinished:
                unfinished.append(name)
                continue
        mine = [r for r in (_finished(run_one, name, seed, lr, wd) for seed in seeds) if r]
        if not mine:
            unfinished.append(name)
        runs.extend(mine)
    rows = aggregate(runs)
    md = markdown_table(rows, s, seeds)
    if unfinished:
        md += f"\nNot finished (no sweep or no seed saved yet): {', '.join(unfinished)}.\n"
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
        "lr_sweep": sweep,
        "unfinished": unfinished,
    }
    if out is not None:
        _write_result(Path(out), s, result)
    return result


def _sweep(
    name: str, grid: list, with_wd: bool, run_one: Callable[..., dict], seed: int
) -> tuple[float, float, dict]:
    """``(lr, wd, record)``: the point of ``grid`` whose run ``run_one(name, seed, lr, wd)`` has
    the best validation accuracy (ties: lower validation loss, then the smaller values), and the
    sweep's record ``{"chosen", "chosen_wd", "val": {"<lr>[/wd<wd>]": val}}``."""
    tried = {p: run_one(name, seed, *p)["val"] for p in grid}
    lr, wd = min(grid, key=lambda p: (-tried[p]["accuracy"], tried[p]["eval_loss"], p))
    label = (lambda a, b: f"{a:g}/wd{b:g}") if with_wd else (lambda a, b: f"{a:g}")
    print(
        f"== {name}: lr {lr:g}"
        + (f" wd {wd:g}" if with_wd else "")
        + f" (validation accuracy {tried[lr, wd]['accuracy']:.3f})"
    )
    return lr, wd, {"chosen": lr, "chosen_wd": wd, "val": {label(*p): tried[p] for p in grid}}


def _write_result(out: Path, s: SyntheticSettings, result: dict) -> None:
    """``<stem>.json`` / ``.md`` / ``.png`` (and ``_curve.png`` where runs were checked along the
    way) of a :func:`run_synthetic` result under ``out``; sets ``result["plot"]``."""
    stem = s.task.replace(":", "_")
    out.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(plot(result["rows"], s, out / f"{stem}.png"))
    if any(r.get("curve") for r in result["runs"]):
        plot_curves(result["runs"], s, out / f"{stem}_curve.png")
    write_json(out / f"{stem}.json", result)
    (out / f"{stem}.md").write_text(result["markdown"])


def _task_sizes(field: str, items: Sequence[str]) -> tuple[tuple[str, int | float], ...]:
    """``KEY=NUMBER`` strings as ``(key, number)`` pairs (ValueError naming ``field``)."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        try:
            number = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            number = None
        if not sep or not key or number is None:
            raise ValueError(
                f"{field}: expected KEY=NUMBER (e.g. seq_len=64, frac_noise=0.4), got {item!r}"
            )
        pairs.append((key, number))
    return tuple(pairs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.synthetic",
        description="train registered LM-shell models on a generated task (formal languages, MAD) "
        "and compare their accuracy",
    )
    p.add_argument(
        "--task", required=True, help="formal:<name>, protocol:<name>, mad:<name> or recall:kv"
    )
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
        help="formal: score the length bins (m·HI/2, m·HI]; 1 = the training range; recall: "
        "score rows m times the training length (default 1 2 4 8)",
    )
    p.add_argument(
        "--mad-sizes",
        nargs="+",
        default=None,
        metavar="KEY=NUMBER",
        help="MAD: size overrides; num_train_examples=N (and num_test_examples=M, default 1280) "
        "train epochs over a fixed data set, as MAD's protocol",
    )
    p.add_argument(
        "--recall-sizes",
        nargs="+",
        default=None,
        metavar="KEY=INT",
        help="recall: generator sizes (seq_len, pairs, queries, keys, values, filler)",
    )
    p.add_argument(
        "--no-match-params",
        action="store_true",
        help="use --d-model for every model instead of matching the first model's parameters",
    )
    p.add_argument(
        "--bins",
        nargs=4,
        type=int,
        default=None,
        metavar=("LO0", "HI0", "LO1", "HI1"),
        help="protocol: the Bin0 (training) and Bin1 windows (length, or n for a^n b^n (c^n)); "
        "default: the task's protocol bins",
    )
    p.add_argument(
        "--set-model",
        action="append",
        default=[],
        metavar="MODEL:model.KEY=VALUE",
        help="a config override for one model, e.g. hope:model.hope.chunk_memory=1 (repeatable; "
        "unknown keys are rejected)",
    )
    _add_sweep_flags(p)
    add_finished_only_flag(p)
    p.add_argument("--out", default=None, help="directory for the json, md and png")
    return p


def add_finished_only_flag(p: argparse.ArgumentParser) -> None:
    """``--finished-only``: summarise the saved runs, train nothing (``run_synthetic``'s)."""
    p.add_argument(
        "--finished-only",
        action="store_true",
        help="train nothing: summarise the runs already saved under --out (a table read while "
        "its other pieces train)",
    )


def add_lrs_flag(p: argparse.ArgumentParser, default: str = "") -> None:
    """``--lrs``: :func:`run_synthetic`'s per-model learning-rate sweep (``default``: what the
    command does without it, said in the help)."""
    p.add_argument(
        "--lrs",
        nargs="+",
        type=float,
        default=None,
        help="per-model learning-rate sweep: train at each rate (first seed), keep the best "
        "validation accuracy, run the seeds there; one rate: every model at it"
        + (f" (default: {default})" if default else ""),
    )


def _add_sweep_flags(p: argparse.ArgumentParser) -> None:
    """``--lrs`` and ``--wds``: the per-model sweep of :func:`run_synthetic`."""
    add_lrs_flag(p)
    p.add_argument(
        "--wds",
        nargs="+",
        type=float,
        default=None,
        help="sweep the weight decay too (the grid --lrs x --wds, as MAD's protocol)",
    )


def parse_set_model(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``["hope:model.hope.chunk_memory=1"]`` -> ``(("hope", "model.hope.chunk_memory=1"),)``.

    Raises:
      ValueError: naming ``set_model`` when an item is not ``MODEL:model.KEY=VALUE``.
    """
    pairs = []
    for item in items:
        model, sep, text = str(item).partition(":")
        if not sep or not model or not text.startswith("model.") or "=" not in text:
            raise ValueError(
                f"set_model: expected MODEL:model.KEY=VALUE (e.g. "
                f"hope:model.hope.chunk_memory=1), got {item!r}"
            )
        pairs.append((model, text))
    return tuple(pairs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    values = scalar_values(args, SyntheticSettings, skip=("task", "seed"))
    try:
        family, _ = parse_task(args.task)
        only = {
            "train_lengths": (args.train_lengths, ("formal",)),
            "eval_multipliers": (args.eval_multipliers, ("formal", "recall")),
        }
        for field, (given, families) in only.items():
            if given is not None:
                if family not in families:
                    raise ValueError(
                        f"{field}: only for {' / '.join(f + ':<name>' for f in families)} tasks, "
                        f"not {args.task!r}"
                    )
                values[field] = tuple(given)
        if args.mad_sizes is not None:
            values["mad_sizes"] = _task_sizes("mad_sizes", args.mad_sizes)
        if args.recall_sizes is not None:
            values["recall_sizes"] = _task_sizes("recall_sizes", args.recall_sizes)
        if args.bins is not None:
            values["bins"] = (tuple(args.bins[:2]), tuple(args.bins[2:]))
        values["model_overrides"] = parse_set_model(args.set_model)
        s = SyntheticSettings(task=args.task, match_params=not args.no_match_params, **values)
        # a bad override fails here, in one line, before any training
        for name, text in s.model_overrides:
            if name in args.models:
                model_config(
                    name, dataclasses.replace(s, model_overrides=((name, text),)), s.d_model
                )
        out = run_synthetic(
            args.models,
            s,
            args.seeds,
            args.out,
            lrs=args.lrs or (),
            wds=args.wds or (),
            finished_only=args.finished_only,
        )
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(out["markdown"], end="")
    if out["plot"]:
        print(f"plot: {out['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
