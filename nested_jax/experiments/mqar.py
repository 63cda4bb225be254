"""Train several LM-shell models from scratch on MQAR and compare their recall in one table.

    python -m nested_jax.experiments.mqar --models titans_lmm gdn transformer --steps 400 \\
        --seq-len 64 --num-kv-pairs 8 --vocab 64 --d-model 64 --out runs/mqar

Every model is a registered mixer name of the LM shell (``nested_jax.models.available_mixers``;
SPEC §6: models differ only in the mixer), so Hope / Proteus / HOLA models join by name. Each is
trained from scratch with AdamW (the training registry's ``adamw`` behind global-norm clipping,
linear warmup + cosine decay) on fresh MQAR batches (:func:`nested_jax.eval.tasks.make_mqar_batch`;
the loss is taken only at the query positions), the same batch sequence for every model. Then it
is scored on held-out batches from a different seed (:func:`nested_jax.eval.tasks.mqar_accuracy`:
argmax at each query equals its value). Chance is ``1 / (number of value ids) = 1 / (V − V // 2)``.

Equal parameter count: with ``--match-params`` (default on) the first model fixes the budget at
``--d-model`` and every other model gets the ``d_model`` (a multiple of ``2 · n_heads``) whose total
parameter count is closest to it; the table reports each count and its ratio to the first.

Proteus (SPEC §4): a model ``<name>+proteus<E>`` (e.g. ``gdn+proteus16``) is the registered
mixer ``<name>`` with ``model.proteus.blocks = E`` and ``context_len = --seq-len`` (the training
length); it has the same parameters as ``<name>``.

Length generalisation: ``--eval-multipliers 1 4`` scores every model on held-out batches of length
``m × seq_len`` for each ``m`` (same ``num_kv_pairs`` and query-slot distribution, so a longer
sequence has more filler); the ``accuracy`` / ``eval_loss`` fields are those at ``m = 1`` (or the
first multiplier) and ``by_length`` holds every ``m``.

Writes ``<out>/mqar.json`` (settings + one row per model) and ``<out>/mqar.md`` (the table) and
prints the Markdown. Each finished model is also kept in ``<out>/models/<model>.json`` and reused
by a later run with identical settings and width.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nested_jax.eval.tasks import make_mqar_batch, mqar_accuracy
from nested_jax.experiments._cache import cached_row
from nested_jax.experiments._training import (
    add_scalar_flags,
    check_models,
    check_multipliers,
    check_positive,
    fit,
    make_scorer,
    model_widths,
    scalar_values,
)
from nested_jax.files import write_json

__all__ = ["MqarSettings", "main", "markdown_table", "run_mqar", "train_and_score"]


@dataclasses.dataclass(frozen=True)
class MqarSettings:
    """One MQAR comparison (the same for every model)."""

    steps: int = 400  # optimizer steps per model
    seq_len: int = 64  # T of every sequence
    num_kv_pairs: int = 8  # N key-value pairs per sequence, each queried once
    vocab: int = 64  # V: keys from [1, V/2), values from [V/2, V)
    batch_size: int = 32  # sequences per step
    d_model: int = 64  # width of the first model (the parameter budget)
    n_layers: int = 2  # blocks per model
    n_heads: int = 2  # heads per mixer
    lr: float = 3e-3  # AdamW peak learning rate
    warmup_steps: int = 20  # linear warmup steps
    weight_decay: float = 0.1  # decoupled AdamW weight decay on matrices
    eval_batches: int = 8  # held-out batches for the accuracy
    power_a: float = 0.01  # query-slot distribution of make_mqar_batch
    seed: int = 0  # parameter init and training batches (eval uses seed + 10_000)
    match_params: bool = True  # adjust d_model of models 2.. to the first model's parameter count
    eval_multipliers: tuple[int, ...] = (1,)  # evaluate at m × seq_len for each m

    def __post_init__(self) -> None:
        check_positive(self, ("steps", "seq_len", "num_kv_pairs", "vocab", "batch_size", "d_model"))
        check_positive(self, ("n_layers", "n_heads", "eval_batches"))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        # make_mqar_batch validates the task sizes; fail before any training.
        make_mqar_batch(0, 1, self.seq_len, self.num_kv_pairs, self.vocab, self.power_a)
        check_multipliers(self.eval_multipliers)

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess among the value ids."""
        return 1.0 / (self.vocab - self.vocab // 2)


def _batches(s: MqarSettings, n: int, seed: int, seq_len: int | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    t = s.seq_len if seq_len is None else seq_len
    return [
        make_mqar_batch(rng, s.batch_size, t, s.num_kv_pairs, s.vocab, s.power_a) for _ in range(n)
    ]


def _score_by_length(s: MqarSettings, score) -> dict:
    """``{str(m): {seq_len, accuracy, eval_loss, eval_queries}}`` on held-out batches of length
    ``m × s.seq_len`` for each ``m`` of ``s.eval_multipliers`` (``score`` from
    :func:`~nested_jax.experiments._training.make_scorer`)."""
    by_length = {}
    for m in s.eval_multipliers:
        # the same held-out seed at every length (batches differ in length, not in their source)
        batches = _batches(s, s.eval_batches, s.seed + 10_000, m * s.seq_len)
        by_length[str(m)] = {"seq_len": m * s.seq_len, **score(batches, mqar_accuracy)}
    return by_length


def train_and_score(name: str, s: MqarSettings, d_model: int, log_every: int = 50) -> dict:
    """Train model ``name`` on MQAR from scratch and score it on held-out batches.

    Returns:
      a row: ``model, d_model, params, steps, final_train_loss, eval_loss, accuracy,
      eval_queries, train_seconds`` (compilation included), ``tokens_per_s`` (steps after the
      first), ``by_length`` (``{str(m): {seq_len, accuracy, eval_loss, eval_queries}}`` for each
      of ``s.eval_multipliers``; the top-level accuracy / eval_loss / eval_queries are those of
      ``m = 1``, or of the first multiplier when 1 is not among them).
    """

    def next_batch(rng):  # fresh MQAR batches, the same sequence for every model
        return make_mqar_batch(rng, s.batch_size, s.seq_len, s.num_kv_pairs, s.vocab, s.power_a)

    trained, stats = fit(name, s, d_model, next_batch, log_every)
    by_length = _score_by_length(s, make_scorer(trained))
    ref = by_length["1" if 1 in s.eval_multipliers else str(s.eval_multipliers[0])]
    return {
        "model": name,
        "d_model": d_model,
        "params": stats["params"],
        "steps": s.steps,
        "final_train_loss": stats["final_train_loss"],
        "eval_loss": ref["eval_loss"],
        "accuracy": ref["accuracy"],
        "eval_queries": ref["eval_queries"],
        "by_length": by_length,
        "train_seconds": stats["train_seconds"],  # compilation included
        # steady-state training throughput (steps after the first); NaN with a single step
        "tokens_per_s": stats["tokens_per_s"],
    }


def markdown_table(rows: Sequence[dict], s: MqarSettings) -> str:
    """The results table with a one-paragraph header of the settings."""
    base = rows[0]["params"] if rows else 1
    head = (
        f"MQAR: T={s.seq_len}, {s.num_kv_pairs} key-value pairs, vocab {s.vocab}, "
        f"{s.steps} AdamW steps (lr {s.lr:g}, batch {s.batch_size}) per model from scratch, "
        f"{s.n_layers} layers × {s.n_heads} heads; accuracy on {s.eval_batches} held-out batches; "
        f"chance {s.chance:.4f} (1/{s.vocab - s.vocab // 2}).\n\n"
    )
    extra = [m for m in s.eval_multipliers if m != 1]
    if extra:
        head = head.replace(
            "\n\n",
            f" Longer evaluations: {', '.join(f'{m}× (T={m * s.seq_len})' for m in extra)}, same "
            "number of pairs.\n\n",
            1,
        )
    cols = "".join(f" acc {m}× | loss {m}× |" for m in extra)
    lines = [
        "| model | d_model | params | params / first | accuracy | × chance | eval loss |"
        + cols
        + " train loss (last 10) | train tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(extra) + "---:|---:|",
    ]
    for r in rows:
        by = r["by_length"]
        cells = "".join(
            f" {by[str(m)]['accuracy']:.4f} | {by[str(m)]['eval_loss']:.4f} |" for m in extra
        )
        lines.append(
            f"| {r['model']} | {r['d_model']} | {r['params']:,} | {r['params'] / base:.3f} "
            f"| {r['accuracy']:.4f} | {r['accuracy'] / s.chance:.1f} | {r['eval_loss']:.4f} |"
            + cells
            + f" {r['final_train_loss']:.4f} | {r['tokens_per_s']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def run_mqar(models: Sequence[str], s: MqarSettings, out: str | Path | None = None) -> dict:
    """Size, train and score every model; write ``mqar.json`` / ``mqar.md`` under ``out``.

    Returns:
      ``{"settings": {...}, "chance": float, "rows": [...], "markdown": str}``.
    """
    check_models(models)
    widths = model_widths(models, s, s.match_params)

    def compute(name: str) -> dict:
        print(f"== {name}: d_model {widths[name]}, training {s.steps} steps", flush=True)
        row = train_and_score(name, s, widths[name])
        print(
            f"== {name}: {row['params']:,} params, accuracy {row['accuracy']:.4f} "
            f"(chance {s.chance:.4f}), {row['train_seconds']:.0f} s",
            flush=True,
        )
        return row

    rows = []
    for name in models:
        # a finished model with the same settings and width is reused (re-runs resume)
        done = None if out is None else Path(out) / "models" / f"{name}.json"
        key = {"settings": dataclasses.asdict(s), "d_model": widths[name]}
        rows.append(cached_row(done, key, lambda name=name: compute(name), name))
    md = markdown_table(rows, s)
    result = {
        "settings": dataclasses.asdict(s),
        "chance": s.chance,
        "rows": rows,
        "markdown": md,
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "mqar.json", result)
        (out / "mqar.md").write_text(md)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.mqar",
        description="train registered LM-shell models on MQAR and compare their recall",
    )
    p.add_argument(
        "--models",
        nargs="+",
        required=True,
        help="registered model (mixer) names, optionally <name>+proteus<E> (e.g. gdn+proteus16)",
    )
    add_scalar_flags(p, MqarSettings)
    p.add_argument(
        "--no-match-params",
        action="store_true",
        help="use --d-model for every model instead of matching the first model's parameters",
    )
    p.add_argument(
        "--eval-multipliers",
        nargs="+",
        type=int,
        default=None,
        help="evaluate at these multiples of --seq-len (default: 1)",
    )
    p.add_argument("--out", default=None, help="directory for mqar.json and mqar.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    values = scalar_values(args, MqarSettings)
    if args.eval_multipliers is not None:
        values["eval_multipliers"] = tuple(args.eval_multipliers)
    try:
        s = MqarSettings(match_params=not args.no_match_params, **values)
        out = run_mqar(args.models, s, args.out)
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(out["markdown"], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
