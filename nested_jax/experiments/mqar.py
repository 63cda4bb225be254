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
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested_jax.eval.tasks import make_mqar_batch, mqar_accuracy
from nested_jax.files import write_json


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
        for name in ("steps", "seq_len", "num_kv_pairs", "vocab", "batch_size", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("n_layers", "n_heads", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        # make_mqar_batch validates the task sizes; fail before any training.
        make_mqar_batch(0, 1, self.seq_len, self.num_kv_pairs, self.vocab, self.power_a)
        m = self.eval_multipliers
        if (
            not isinstance(m, tuple)
            or not m
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in m)
            or len(set(m)) != len(m)
        ):
            raise ValueError(
                f"eval_multipliers: expected a non-empty tuple of distinct positive ints, got {m!r}"
            )

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess among the value ids."""
        return 1.0 / (self.vocab - self.vocab // 2)


PROTEUS_TAG = "+proteus"


def parse_model(spec: str) -> tuple[str, int]:
    """``"gdn"`` -> ``("gdn", 1)``; ``"gdn+proteus16"`` -> ``("gdn", 16)`` (Proteus blocks E).

    Raises:
      ValueError: naming ``models`` when the Proteus suffix is not a positive int.
    """
    if PROTEUS_TAG not in spec:
        return spec, 1
    name, _, blocks = spec.partition(PROTEUS_TAG)
    if not blocks.isdigit() or int(blocks) < 1:
        raise ValueError(
            f"models: {spec!r}: expected <name>{PROTEUS_TAG}<E> with a positive int E "
            f"(e.g. gdn{PROTEUS_TAG}16)"
        )
    return name, int(blocks)


def model_config(name: str, s: MqarSettings, d_model: int):
    """The :class:`ModelConfig` of model ``name`` (maybe ``<mixer>+proteus<E>``, see
    :func:`parse_model`) at width ``d_model`` for these settings."""
    from nested_jax.layers.options import ProteusOptions
    from nested_jax.models import ModelConfig

    mixer, blocks = parse_model(name)
    proteus = ProteusOptions(blocks=blocks, context_len=s.seq_len if blocks > 1 else 0)
    chunk = min(64, s.seq_len)
    return ModelConfig(
        name=mixer,
        vocab_size=s.vocab,
        d_model=d_model,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        chunk_size=chunk,
        proteus=proteus,
    )


def count_params(name: str, s: MqarSettings, d_model: int) -> int:
    """Parameters of model ``name`` at ``d_model`` (from abstract shapes; nothing allocated)."""
    from nested_jax.models import build_model

    cfg = model_config(name, s, d_model)
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def matched_d_model(name: str, s: MqarSettings, target: int) -> tuple[int, int]:
    """``(d_model, params)`` of ``name`` closest to ``target`` parameters (``d_model`` a multiple
    of ``2 · n_heads``, searched from ``2 · n_heads`` up to ``4 · s.d_model``)."""
    step = 2 * s.n_heads
    best = None
    for d in range(step, 4 * s.d_model + 1, step):
        try:
            n = count_params(name, s, d)
        except ValueError:  # a mixer may reject some widths (e.g. head-dim constraints)
            continue
        if best is None or abs(n - target) < abs(best[1] - target):
            best = (d, n)
        if n >= target:
            break  # counts grow with d_model: past the target the search is over
    if best is None:
        raise ValueError(f"models: no d_model gives a valid {name!r} model")
    return best


def _batches(s: MqarSettings, n: int, seed: int, seq_len: int | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    t = s.seq_len if seq_len is None else seq_len
    return [
        make_mqar_batch(rng, s.batch_size, t, s.num_kv_pairs, s.vocab, s.power_a) for _ in range(n)
    ]


def _build_training(name: str, s: MqarSettings, d_model: int):
    """Model ``name`` at ``d_model`` (init seed ``s.seed``), its jitted AdamW train step and the
    initial train state: ``(graphdef, state_def, rest, step, state, n_params)``."""
    from nested_jax.models import build_model
    from nested_jax.train.config import OptimizerConfig
    from nested_jax.train.optimizer import build_optimizer
    from nested_jax.train.step import make_train_step

    cfg = model_config(name, s, d_model)
    model = build_model(cfg, rngs=nnx.Rngs(s.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state_def = jax.tree.structure(params)
    params = nnx.to_pure_dict(params)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    ocfg = OptimizerConfig(
        name="adamw",
        lr=s.lr,
        warmup_steps=min(s.warmup_steps, s.steps),
        weight_decay=s.weight_decay,
    )
    # model=cfg: CMS models (hope, hope_attention) get their pretrain-mode multi-frequency steps
    # as in the training loop; a no-op for every other model.
    tx, schedule = build_optimizer(ocfg, s.steps, model=cfg)
    step = jax.jit(make_train_step(graphdef, state_def, tx, schedule), donate_argnums=(0,))
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "consecutive_skips": jnp.zeros((), jnp.int32),
    }
    return graphdef, state_def, rest, step, state, n_params


def _train(name: str, s: MqarSettings, step, state: dict, rest, log_every: int):
    """``s.steps`` steps on fresh MQAR batches (seed ``s.seed``, the same for every model).

    Returns:
      ``(state, losses, seconds, steady_seconds)``: wall time of all steps (compilation
      included) and of the steps after the first.
    """
    rng = np.random.default_rng(s.seed)
    losses = []
    t_start = t0 = time.perf_counter()
    for i in range(1, s.steps + 1):
        batch = make_mqar_batch(rng, s.batch_size, s.seq_len, s.num_kv_pairs, s.vocab, s.power_a)
        state, m = step(state, rest, batch)
        losses.append(m["loss"])
        if i == 1:  # throughput excludes the first step (compilation)
            jax.block_until_ready(state["params"])
            t0 = time.perf_counter()
        if log_every and (i % log_every == 0 or i == s.steps):
            print(f"  [{name}] step {i}/{s.steps} loss {float(m['loss']):.4f}", flush=True)
    jax.block_until_ready(state["params"])
    t_end = time.perf_counter()
    return state, losses, t_end - t_start, t_end - t0


def _score_by_length(s: MqarSettings, graphdef, state_def, rest, params) -> dict:
    """``{str(m): {seq_len, accuracy, eval_loss, eval_queries}}`` on held-out batches of length
    ``m × s.seq_len`` for each ``m`` of ``s.eval_multipliers``."""
    from nested_jax.train.step import make_eval_step

    eval_step = jax.jit(make_eval_step(graphdef, state_def))
    logits_fn = jax.jit(
        lambda p, tokens: nnx.merge(
            graphdef, jax.tree.unflatten(state_def, jax.tree.leaves(p)), rest
        )(tokens)[0]
    )
    by_length = {}
    for m in s.eval_multipliers:
        correct, total, loss_sum, tokens = 0.0, 0, 0.0, 0.0
        # the same held-out seed at every length (batches differ in length, not in their source)
        for b in _batches(s, s.eval_batches, s.seed + 10_000, m * s.seq_len):
            n = int(b["loss_mask"].sum())
            correct += mqar_accuracy(logits_fn(params, b["inputs"]), b) * n
            total += n
            sums = eval_step(params, rest, b)
            loss_sum += float(sums["loss_sum"])
            tokens += float(sums["tokens"])
        by_length[str(m)] = {
            "seq_len": m * s.seq_len,
            "accuracy": correct / total,
            "eval_loss": loss_sum / tokens,
            "eval_queries": total,
        }
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
    graphdef, state_def, rest, step, state, n_params = _build_training(name, s, d_model)
    state, losses, seconds, steady = _train(name, s, step, state, rest, log_every)
    timed_steps = s.steps - 1
    tail = np.asarray(jax.device_get(losses[-10:]), np.float64)
    by_length = _score_by_length(s, graphdef, state_def, rest, state["params"])
    ref = by_length["1" if 1 in s.eval_multipliers else str(s.eval_multipliers[0])]
    return {
        "model": name,
        "d_model": d_model,
        "params": n_params,
        "steps": s.steps,
        "final_train_loss": float(tail.mean()),
        "eval_loss": ref["eval_loss"],
        "accuracy": ref["accuracy"],
        "eval_queries": ref["eval_queries"],
        "by_length": by_length,
        "train_seconds": seconds,  # compilation included
        # steady-state training throughput (steps after the first); NaN with a single step
        "tokens_per_s": (
            timed_steps * s.batch_size * s.seq_len / steady if timed_steps else float("nan")
        ),
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
    from nested_jax.models import available_mixers

    if not models:
        raise ValueError("models: expected at least one model name")
    known = available_mixers()
    unknown = [m for m in models if parse_model(m)[0] not in known]
    if unknown:
        raise ValueError(f"models: unknown {unknown}; registered: {list(known)}")
    if len(set(models)) != len(models):
        raise ValueError(f"models: duplicate names in {list(models)}")
    widths = {models[0]: s.d_model}
    target = count_params(models[0], s, s.d_model)
    for name in models[1:]:
        widths[name] = matched_d_model(name, s, target)[0] if s.match_params else s.d_model
    rows = []
    for name in models:
        # a finished model with the same settings and width is reused (re-runs resume)
        done = None if out is None else Path(out) / "models" / f"{name}.json"
        key = {"settings": dataclasses.asdict(s), "d_model": widths[name]}
        if done is not None and done.is_file():
            saved = json.loads(done.read_text())
            if saved.get("key") == json.loads(json.dumps(key)):
                print(f"== {name}: reusing {done}", flush=True)
                rows.append(saved["row"])
                continue
        print(f"== {name}: d_model {widths[name]}, training {s.steps} steps", flush=True)
        row = train_and_score(name, s, widths[name])
        if done is not None:
            done.parent.mkdir(parents=True, exist_ok=True)
            write_json(done, {"key": key, "row": row})
        print(
            f"== {name}: {row['params']:,} params, accuracy {row['accuracy']:.4f} "
            f"(chance {s.chance:.4f}), {row['train_seconds']:.0f} s",
            flush=True,
        )
        rows.append(row)
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
    defaults = MqarSettings()
    for f in dataclasses.fields(MqarSettings):
        if f.name in ("match_params", "eval_multipliers"):
            continue
        flag = "--" + ("vocab" if f.name == "vocab" else f.name.replace("_", "-"))
        p.add_argument(flag, type=type(getattr(defaults, f.name)), default=None, dest=f.name)
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
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(MqarSettings)
        if f.name not in ("match_params", "eval_multipliers") and getattr(args, f.name) is not None
    }
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
