"""Train several configs on the same data and compare them in one table.

    python -m nested_jax.experiments.compare \\
        --configs configs/experiments/tiny_hola.yaml configs/experiments/tiny_hola_recency.yaml \\
                  configs/experiments/tiny_gdn.yaml \\
        --workdir runs/hola_compare --niah-multipliers 1 4 8 [--set train.steps=200 ...]

Each config is trained with :func:`nested_jax.train.loop.train_and_evaluate` in
``<workdir>/<config stem>`` (re-running resumes / reuses finished runs), with the same ``--set``
overrides for all. The configs must agree on the data section, ``train.steps`` and ``train.seed``
(otherwise the comparison is not fair: ``ValueError``). Then every trained model is evaluated on
the same validation batches (loss, bits/byte) and on the same single-needle NIAH examples (passkey
exact match, :mod:`nested_jax.eval.tasks`) at lengths ``m × data.seq_len`` for each multiplier
``m``, all depths ``eval.niah_depths``, ``eval.niah_per_cell`` examples per cell and length.
Writes ``<workdir>/compare.json`` and ``<workdir>/compare.md`` and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from nested_jax.files import write_json
from nested_jax.train.config import (
    Config,
    ConfigError,
    add_override_argument,
    config_to_dict,
    load_config,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--configs", nargs="+", required=True, help="experiment YAML files")
    p.add_argument("--workdir", required=True, help="one sub-directory per config is used")
    p.add_argument(
        "--niah-multipliers",
        nargs="+",
        type=int,
        default=[1, 4, 8],
        help="NIAH lengths as multiples of data.seq_len (the training length)",
    )
    add_override_argument(p, "override applied to every config, e.g. --set train.steps=200")
    return p


def _describe(cfg: Config) -> str:
    m = cfg.model
    if m.name == "hola":
        h = m.hola
        name = f"hola (w={h.window}, C={h.block_size}, eviction={h.eviction})"
    else:
        name = m.name
    if m.proteus.blocks > 1:
        name += f" + Proteus (E={m.proteus.blocks}, N={m.proteus.context_len})"
    return name


def check_same_recipe(configs: dict[str, Config]) -> None:
    """Raise ``ValueError`` naming the field when the configs differ in data, steps or seed."""
    items = list(configs.items())
    first_name, first = items[0]
    for name, cfg in items[1:]:
        for what, a, b in (
            ("data", config_to_dict(first.data), config_to_dict(cfg.data)),
            ("train.steps", first.train.steps, cfg.train.steps),
            ("train.seed", first.train.seed, cfg.train.seed),
        ):
            if a != b:
                raise ValueError(
                    f"configs: {name} differs from {first_name} in {what} ({b!r} vs {a!r}); "
                    "a comparison needs the same data, steps and seed"
                )


def _validation(trained, data) -> dict:
    """``evaluate`` of a trained run on the first ``eval.eval_batches`` validation batches made
    with the data section ``data`` (the run's own, or one with a longer ``seq_len``)."""
    from nested_jax.data import pipeline
    from nested_jax.train.loop import evaluate

    batches = pipeline.make_eval_batches(
        data,
        trained.tokenizer,
        trained.bundle.val_docs,
        max_batches=trained.config.eval.eval_batches or None,
    )
    return evaluate(trained.setup, trained.params, batches)


def _niah_by_length(trained, multipliers: Sequence[int]) -> dict:
    """``{str(m): {length, accuracy, examples}}``: passkey exact match of single-needle NIAH at
    ``m × data.seq_len`` tokens, all depths ``eval.niah_depths``."""
    from nested_jax.eval.tasks import niah_grid, score_niah
    from nested_jax.train.inference import sharded_argmax_fn

    cfg = trained.config
    lengths = [m * cfg.data.seq_len for m in multipliers]
    haystack = "\n\n".join(trained.bundle.val_docs or trained.bundle.train_docs)
    examples = niah_grid(
        haystack,
        trained.tokenizer,
        lengths,
        cfg.eval.niah_depths,
        max(1, cfg.eval.niah_per_cell),
        cfg.eval.niah_seed,
    )
    result = score_niah(sharded_argmax_fn(trained), examples)
    by_length = {}
    for m, n in zip(multipliers, lengths, strict=True):
        oks = [ok for ex, ok in zip(examples, result["correct"], strict=True) if ex.length == n]
        by_length[str(m)] = {"length": n, "accuracy": sum(oks) / len(oks), "examples": len(oks)}
    return by_length


def evaluate_trained(
    workdir: Path, multipliers: Sequence[int], val_multipliers: Sequence[int] = ()
) -> dict:
    """Validation metrics + NIAH accuracy by length multiplier for a trained workdir.

    Args:
      workdir: a finished training run.
      multipliers: NIAH lengths ``m × data.seq_len``.
      val_multipliers: also the validation loss on windows of ``m × data.seq_len`` tokens
        (``"val_by_length"``; the first ``eval.eval_batches`` batches of each length, so a longer
        window covers more text).

    Returns:
      ``{step, params, val_loss, val_bits_per_byte, niah: {str(m): {length, accuracy,
      examples}}}`` plus ``val_by_length: {str(m): {length, val_loss, val_bits_per_byte,
      val_tokens}}`` when ``val_multipliers`` is not empty.
    """
    import dataclasses

    import jax
    import numpy as np

    from nested_jax.train.inference import load_trained

    trained = load_trained(workdir)
    data = trained.config.data
    val = _validation(trained, data)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trained.params))
    out = {
        "step": trained.step,
        "params": n_params,
        "val_loss": val["val_loss"],
        "val_bits_per_byte": val["val_bits_per_byte"],
        "niah": _niah_by_length(trained, multipliers),
    }
    if val_multipliers:
        out["val_by_length"] = {}
    for m in val_multipliers:
        longer = dataclasses.replace(data, seq_len=m * data.seq_len)
        v = val if m == 1 else _validation(trained, longer)
        out["val_by_length"][str(m)] = {
            "length": m * data.seq_len,
            "val_loss": v["val_loss"],
            "val_bits_per_byte": v["val_bits_per_byte"],
            "val_tokens": v["val_tokens"],
        }
    return out


def markdown_lines(head: list[str], body: list[list[str]], text_columns: int = 2) -> str:
    """A Markdown table: the first ``text_columns`` columns left-aligned, the rest right-aligned."""
    rule = "|" + "---|" * text_columns + "---:|" * (len(head) - text_columns)
    lines = ["| " + " | ".join(head) + " |", rule]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def niah_cells(row: dict, multipliers: Sequence[int]) -> list[str]:
    """``accuracy (n=examples)`` of a result row's NIAH at every length multiplier."""
    return [
        f"{row['niah'][str(m)]['accuracy']:.2f} (n={row['niah'][str(m)]['examples']})"
        for m in multipliers
    ]


def markdown_table(rows: list[dict], multipliers: Sequence[int], seq_len: int) -> str:
    """One Markdown table: a row per config, validation metrics and NIAH accuracy per length."""
    head = ["config", "mixer", "params", "steps", "val loss", "val bits/byte"]
    head += [f"NIAH {m}× ({m * seq_len})" for m in multipliers]
    head += ["train tok/s"]
    body = [
        [
            r["config"],
            r["mixer"],
            f"{r['params'] / 1e6:.2f}M",
            str(r["step"]),
            f"{r['val_loss']:.4f}",
            f"{r['val_bits_per_byte']:.4f}",
            *niah_cells(r, multipliers),
            f"{r['tokens_per_s']:.0f}",
        ]
        for r in rows
    ]
    return markdown_lines(head, body)


def run_compare(
    config_paths: Sequence[str | Path],
    workdir: str | Path,
    multipliers: Sequence[int],
    overrides: Sequence[str] = (),
) -> dict:
    """Train (or resume) every config, evaluate all, return ``{"rows": [...], "markdown": str}``."""
    from nested_jax.train.loop import train_and_evaluate

    if not multipliers or any(m < 1 for m in multipliers):
        raise ValueError(f"niah_multipliers: expected positive integers, got {list(multipliers)}")
    workdir = Path(workdir)
    configs: dict[str, Config] = {}
    for path in config_paths:
        name = Path(path).stem
        if name in configs:
            raise ValueError(f"configs: two configs named {name!r}")
        configs[name] = load_config([path], overrides)
    check_same_recipe(configs)
    rows = []
    for name, cfg in configs.items():
        print(f"== {name}: training {_describe(cfg)}", flush=True)
        summary = train_and_evaluate(cfg, workdir / name)
        print(f"== {name}: evaluating", flush=True)
        ev = evaluate_trained(workdir / name, multipliers)
        rows.append(
            {
                "config": name,
                "mixer": _describe(cfg),
                "tokens_per_s": summary["tokens_per_s"],
                "wall_time_s": summary["wall_time_s"],
                **ev,
            }
        )
    seq_len = next(iter(configs.values())).data.seq_len
    md = markdown_table(rows, multipliers, seq_len)
    first = next(iter(configs.values()))
    md = (
        f"Trained {first.train.steps} steps each on `{first.data.corpus}` (seq_len {seq_len}, "
        f"batch {first.data.batch_size}, seed {first.train.seed}); NIAH: depths "
        f"{list(first.eval.niah_depths)}, {first.eval.niah_per_cell} example(s) per depth and "
        "length, passkey exact match. train tok/s is wall-clock under whatever else ran on the "
        "machine (compare speed with `nested-jax bench hola`).\n\n" + md
    )
    return {"rows": rows, "markdown": md, "overrides": list(overrides)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run_compare(args.configs, args.workdir, args.niah_multipliers, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    workdir = Path(args.workdir)
    write_json(workdir / "compare.json", out["rows"], default=str)
    (workdir / "compare.md").write_text(out["markdown"])
    print(out["markdown"], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
