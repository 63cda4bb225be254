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
* ``protocol:<name>``, a key of :data:`nested_jax.eval.formal_languages.PROTOCOL_TASKS` (parity,
  aa_star, abab_star, anbn, anbncn, shuffle2): the next-character protocol of Nested Learning's
  Table 5 (Irie et al. 2023 after Bhattamishra et al. 2020; docs/RESULTS.md "Formal-language
  protocol"). Fixed string sets (:func:`protocol_data`): ``--train-size`` training strings in the
  Bin0 window, ``--val-size`` validation strings (Bin0 window, disjoint from the test strings) and
  ``--test-size`` test strings per bin; ``--bins LO0 HI0 LO1 HI1`` overrides the task's windows.
  Scored by string accuracy (every prediction of a string right, per bin); chance is ~0.
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

Per-model options: ``--set-model MODEL:model.KEY=VALUE`` (repeatable) overrides one model's
``ModelConfig`` through the strict config machinery (an unknown key fails in one line before any
training). ``--lrs A B ...`` sweeps the learning rate per model (first seed; the best validation
accuracy wins, :func:`run_synthetic`) and runs the seeds at the chosen rate. Tables give mean ±
std over seeds and, for protocol tasks, the best seed.

Writes ``<out>/<family>_<name>.json`` (settings, one run per model and seed, one aggregated row per
model), ``<out>/<family>_<name>.md`` (the table) and ``<out>/<family>_<name>.png`` (accuracy vs
string length per model for formal tasks, a bar chart for MAD; chance dashed), and prints the
Markdown. Each finished run is kept in ``<out>/models/<family>_<name>/<model>-seed<k>.json`` and
reused by a later run with identical settings and width.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nested_jax.eval.formal_languages import (
    FORMAL_TASKS,
    PROTOCOL_TASKS,
    FormalVocab,
    formal_accuracy,
    formal_chance,
    make_formal_batch,
    make_protocol_batch,
    protocol_accuracy,
    protocol_strings,
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
    model_config,
    model_widths,
    scalar_values,
)
from nested_jax.files import write_json

FAMILIES = {"formal": FORMAL_TASKS, "mad": MAD_TASKS, "protocol": PROTOCOL_TASKS}
EVAL_SEED_OFFSET = 10_000  # held-out batches: seed + this (training batches use the seed itself)
VAL_SEED_OFFSET = 20_000  # validation batches (learning-rate choice) of formal / MAD tasks
PROTOCOL_DATA_SEED = 30_000  # protocol: the fixed test, validation and training strings
EVAL_ROWS = 250  # protocol: strings per scoring batch


def parse_task(task: str) -> tuple[str, str]:
    """``"formal:parity"`` -> ``("formal", "parity")``.

    Raises:
      ValueError: naming ``task`` when the family or the name is unknown.
    """
    family, sep, name = str(task).partition(":")
    if not sep or family not in FAMILIES or name not in FAMILIES[family]:
        raise ValueError(
            f"task: expected formal:<name>, protocol:<name> or mad:<name>, got {task!r}; "
            f"formal: {sorted(FORMAL_TASKS)}; protocol: {sorted(PROTOCOL_TASKS)}; "
            f"mad: {sorted(MAD_TASKS)}"
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
    train_size: int = 10_000  # protocol: training strings (batches drawn from them)
    test_size: int = 2_000  # protocol: scored strings per bin
    val_size: int = 500  # protocol: validation strings (Bin0 window, disjoint from the test)
    bins: tuple[tuple[int, int], ...] = ()  # protocol: (Bin0, Bin1) windows; () = the task's
    model_overrides: tuple[tuple[str, str], ...] = ()  # (model, "model.KEY=VALUE") pairs

    def __post_init__(self) -> None:
        family, name = parse_task(self.task)
        check_positive(self, ("steps", "batch_size", "d_model", "n_layers", "n_heads"))
        check_positive(self, ("eval_batches", "train_size", "test_size", "val_size"))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        for pair in self.model_overrides:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise ValueError(
                    f"model_overrides: expected (model, KEY=VALUE) pairs, got {pair!r}"
                )
        if family == "protocol":
            if self.mad_sizes:
                raise ValueError(f"mad_sizes: only for mad:<name> tasks, not {self.task!r}")
            bins = self.protocol_bins
            if len(bins) != 2:
                raise ValueError(f"bins: expected (Bin0, Bin1) windows, got {self.bins!r}")
            for window in bins:
                try:
                    protocol_strings(name, 1, window, 0)
                except ValueError as err:
                    raise ValueError(f"bins: {err}") from None
            return
        if self.bins:
            raise ValueError(f"bins: only for protocol:<name> tasks, not {self.task!r}")
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
    def protocol_bins(self) -> tuple[tuple[int, int], ...]:
        """Protocol: the (Bin0, Bin1) windows (``bins``, else the task's own)."""
        if self.bins:
            return tuple(tuple(w) for w in self.bins)
        return PROTOCOL_TASKS[self.name].bins

    def protocol_seq_len(self, window: tuple[int, int]) -> int:
        """Protocol: T of a row of the window (BOS + the longest string)."""
        return PROTOCOL_TASKS[self.name].max_length(window) + 1

    @property
    def vocab(self) -> int:
        """Model vocabulary: the 17 formal-language ids, or the MAD task's ``vocab_size``."""
        if self.family in ("formal", "protocol"):
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
        if self.family == "protocol":
            return self.protocol_seq_len(self.protocol_bins[0])
        return make_mad_batch(self.name, 1, 0, **self.sizes)["inputs"].shape[1]

    @property
    def chance(self) -> float:
        if self.family == "protocol":
            return 0.0  # every prediction of a string must be right: guessing scores ~0
        if self.family == "formal":
            return formal_chance(self.name)
        return mad_chance(self.name, **self.sizes)

    def eval_lengths(self, m: int) -> tuple[int, int]:
        """String lengths of the ``m×`` bin: the training range at 1, else ``(m·hi/2, m·hi]``."""
        lo, hi = self.train_lengths
        return (lo, hi) if m == 1 else (m * hi // 2 + 1, m * hi)


@functools.lru_cache(maxsize=8)
def _protocol_data(name: str, bins, train_size: int, test_size: int, val_size: int) -> dict:
    rng = np.random.default_rng(PROTOCOL_DATA_SEED)
    bin0, bin1 = bins
    test0 = protocol_strings(name, test_size, bin0, rng)
    test1 = protocol_strings(name, test_size, bin1, rng)
    val = protocol_strings(name, val_size, bin0, rng, exclude=set(test0))
    train = protocol_strings(name, train_size, bin0, rng, exclude=set(test0) | set(val))
    return {"train": tuple(train), "val": tuple(val), "bin0": tuple(test0), "bin1": tuple(test1)}


def protocol_data(s: SyntheticSettings) -> dict:
    """Protocol: the fixed string sets ``{train, val, bin0, bin1}`` (the same for every model and
    seed; drawn from ``PROTOCOL_DATA_SEED``). ``val`` and ``train`` avoid the Bin0 test strings
    and each other, unless the language has one string per length (``enumerable``)."""
    return _protocol_data(s.name, s.protocol_bins, s.train_size, s.test_size, s.val_size)


def _protocol_batches(s: SyntheticSettings, strings, window) -> list[dict]:
    t = s.protocol_seq_len(window)
    return [
        make_protocol_batch(s.name, list(strings[i : i + EVAL_ROWS]), t)
        for i in range(0, len(strings), EVAL_ROWS)
    ]


def train_batch(s: SyntheticSettings, rng: np.random.Generator) -> dict:
    """One training batch of ``s.task`` drawn from ``rng`` (protocol: ``batch_size`` of the fixed
    training strings, drawn with replacement)."""
    if s.family == "protocol":
        pool = protocol_data(s)["train"]
        rows = [pool[i] for i in rng.integers(0, len(pool), size=s.batch_size)]
        return make_protocol_batch(s.name, rows, s.seq_len)
    if s.family == "formal":
        return make_formal_batch(s.name, s.batch_size, s.train_lengths, rng)
    return make_mad_batch(s.name, s.batch_size, rng, **s.sizes)


def eval_sets(s: SyntheticSettings) -> list[tuple[str, dict, list[dict]]]:
    """``(key, info, batches)`` per held-out set: one per multiplier for a formal task (``key =
    str(m)``, ``info``: ``multiplier, min_len, max_len, seq_len``), one (``"heldout"``) for MAD."""
    if s.family == "protocol":
        data, sets = protocol_data(s), []
        for key, window in zip(("bin0", "bin1"), s.protocol_bins, strict=True):
            lengths = [len(x) for x in data[key]]
            info = {
                "bin": key,
                "window": list(window),
                "min_len": min(lengths),
                "max_len": max(lengths),
                "seq_len": s.protocol_seq_len(window),
            }
            sets.append((key, info, _protocol_batches(s, data[key], window)))
        return sets
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


def val_batches(s: SyntheticSettings) -> list[dict]:
    """The validation set of the learning-rate choice: protocol: the ``val`` strings (Bin0 window,
    disjoint from the scored test strings); formal: ``eval_batches`` batches of the training range
    from ``seed + VAL_SEED_OFFSET`` (a stream apart from the scored one); MAD: likewise."""
    if s.family == "protocol":
        return _protocol_batches(s, protocol_data(s)["val"], s.protocol_bins[0])
    rng = np.random.default_rng(s.seed + VAL_SEED_OFFSET)
    if s.family == "mad":
        return [make_mad_batch(s.name, s.batch_size, rng, **s.sizes) for _ in range(s.eval_batches)]
    return [
        make_formal_batch(s.name, s.batch_size, s.train_lengths, rng, seq_len=s.seq_len)
        for _ in range(s.eval_batches)
    ]


def _accuracy_fn(s: SyntheticSettings):
    """``(accuracy_fn, per_row)`` of the task family."""
    if s.family == "protocol":
        return protocol_accuracy, True
    return (formal_accuracy if s.family == "formal" else mad_accuracy), False


def train_and_score(name: str, s: SyntheticSettings, d_model: int, log_every: int = 50) -> dict:
    """Train model ``name`` on ``s.task`` from scratch (seed ``s.seed``) and score it.

    Returns:
      a run: ``model, seed, d_model, params, steps, final_train_loss, accuracy`` (of the first
      held-out set), ``scores`` (``{key: {**info, accuracy, eval_loss, eval_queries}}``, keys and
      info of :func:`eval_sets`), ``train_seconds`` (compilation included), ``tokens_per_s``.
    """
    trained, stats = fit(name, s, d_model, lambda rng: train_batch(s, rng), log_every)
    score = make_scorer(trained)
    accuracy_fn, per_row = _accuracy_fn(s)
    scores = {
        key: {**info, **score(batches, accuracy_fn, per_row)} for key, info, batches in eval_sets(s)
    }
    return {
        "model": name,
        "seed": s.seed,
        "d_model": d_model,
        "params": stats["params"],
        "steps": s.steps,
        "final_train_loss": stats["final_train_loss"],
        "accuracy": next(iter(scores.values()))["accuracy"],
        "scores": scores,
        "val": score(val_batches(s), accuracy_fn, per_row),
        "lr": s.lr,
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
                "lr": mine[0].get("lr"),
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
            }
        )
    return rows


def _cell(x: dict) -> str:
    return f"{x['mean']:.3f}" if len(x["values"]) == 1 else f"{x['mean']:.3f} ± {x['std']:.3f}"


def _cell_best(x: dict) -> str:
    """Mean ± std and the best seed (``max``), e.g. ``0.912 ± 0.030 (best 0.950)``."""
    if len(x["values"]) == 1:
        return f"{x['mean']:.3f}"
    return f"{_cell(x)} (best {x['max']:.3f})"


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
        + (
            f"mean ± sample std (best) over seeds {', '.join(map(str, seeds))}"
            if len(seeds) > 1
            else f"seed {seeds[0]}"
        )
        + ".\n\n"
    )
    lines = [
        "| model | lr | d_model | params | Bin0 | Bin1 | val | train loss | train s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sc = r["scores"]
        lines.append(
            f"| {r['model']} | {r['lr']:g} | {r['d_model']} | {r['params']:,} "
            f"| {_cell_best(sc['bin0']['accuracy'])} | {_cell_best(sc['bin1']['accuracy'])} "
            f"| {_cell(r['val']) if r['val'] else '–'} | {_cell(r['final_train_loss'])} "
            f"| {r['train_seconds']['mean']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def markdown_table(rows: Sequence[dict], s: SyntheticSettings, seeds: Sequence[int]) -> str:
    """The results table with a one-paragraph header of the settings."""
    if s.family == "protocol":
        return _protocol_table(rows, s, seeds)
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
    lrs: Sequence[float] = (),
) -> dict:
    """Size, train and score every model at every seed; write ``<stem>.json`` / ``.md`` / ``.png``
    under ``out`` (``stem = <family>_<name>``).

    With ``lrs``, each model first trains at every rate of ``lrs`` with the first seed and keeps
    the rate of the best validation accuracy (:func:`val_batches`; ties: lower validation loss,
    then the smaller rate); its seeds then run at that rate (the sweep's run at the chosen rate is
    reused). Without ``lrs`` every model uses ``s.lr``.

    Returns:
      ``{"task", "settings", "seeds", "chance", "runs", "rows", "markdown", "plot", "lr_sweep"}``
      (``plot``: the PNG path, or None without ``out``; ``lr_sweep``: per model, the validation
      accuracy and loss at each rate and the chosen rate).
    """
    check_models(models)
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(not isinstance(k, int) for k in seeds):
        raise ValueError(f"seeds: expected distinct ints, got {seeds}")
    lrs = [float(x) for x in lrs]
    if any(not x > 0 for x in lrs) or len(set(lrs)) != len(lrs):
        raise ValueError(f"lrs: expected distinct rates > 0, got {lrs}")
    unknown = sorted({m for m, _ in s.model_overrides} - set(models))
    if unknown:
        raise ValueError(f"model_overrides: models {unknown} are not in models {list(models)}")
    widths = model_widths(models, s, s.match_params)
    stem = s.task.replace(":", "_")

    def compute(name: str, si: SyntheticSettings) -> dict:
        print(
            f"== {name} seed {si.seed} lr {si.lr:g}: d_model {widths[name]}, {s.steps} steps",
            flush=True,
        )
        run = train_and_score(name, si, widths[name], log_every)
        accs = ", ".join(f"{k}: {v['accuracy']:.3f}" for k, v in run["scores"].items())
        print(
            f"== {name} seed {si.seed}: accuracy {accs} (chance {s.chance:.3f}), "
            f"{run['train_seconds']:.0f} s",
            flush=True,
        )
        return run

    def run_one(name: str, seed: int, lr: float) -> dict:
        mine = tuple(p for p in s.model_overrides if p[0] == name)
        si = dataclasses.replace(s, seed=seed, lr=lr, model_overrides=mine)
        tag = f"{name}-seed{seed}" + ("" if lr == s.lr else f"-lr{lr:g}")
        done = None if out is None else Path(out) / "models" / stem / f"{tag}.json"
        key = {"settings": dataclasses.asdict(si), "d_model": widths[name]}
        return cached_row(done, key, lambda: compute(name, si), f"{name} seed {seed} lr {lr:g}")

    runs, sweep = [], {}
    for name in models:
        lr = s.lr
        if lrs:
            tried = {x: run_one(name, seeds[0], x)["val"] for x in lrs}
            lr = min(lrs, key=lambda x: (-tried[x]["accuracy"], tried[x]["eval_loss"], x))
            sweep[name] = {"chosen": lr, "val": {f"{x:g}": tried[x] for x in lrs}}
            print(f"== {name}: lr {lr:g} (validation accuracy {tried[lr]['accuracy']:.3f})")
        runs.extend(run_one(name, seed, lr) for seed in seeds)
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
        "lr_sweep": sweep,
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
    p.add_argument(
        "--lrs",
        nargs="+",
        type=float,
        default=None,
        help="per-model learning-rate sweep: train at each rate (first seed), keep the best "
        "validation accuracy, run the seeds there",
    )
    p.add_argument("--out", default=None, help="directory for the json, md and png")
    return p


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
        out = run_synthetic(args.models, s, args.seeds, args.out, lrs=args.lrs or ())
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(out["markdown"], end="")
    if out["plot"]:
        print(f"plot: {out['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
