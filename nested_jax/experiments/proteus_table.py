"""Proteus E=16 vs E=1 on tiny GDN and Titans LMM: one command, one table (SPEC §4).

    python -m nested_jax.experiments.proteus_table --out runs/proteus \\
        [--configs configs/experiments/tiny_gdn.yaml configs/experiments/tiny_gdn_proteus.yaml \\
                   configs/experiments/tiny_titans_lmm.yaml \\
                   configs/experiments/tiny_titans_lmm_proteus.yaml] \\
        [--multipliers 1 4] [--set train.steps=200 ...] [--mqar-steps 300 --mqar-seq-len 64 ...]

1. **Language modelling** (:mod:`nested_jax.experiments.compare`): every config is trained on
   the same data, steps and seed (``<out>/lm/<config stem>``; a re-run reuses finished runs),
   then scored on the same validation text in windows of ``m × data.seq_len`` tokens (loss,
   bits/byte) and on the same single-needle NIAH examples of length ``m × data.seq_len``, for
   every ``m`` of
   ``--multipliers`` (default 1 and 4). For a Proteus config ``model.proteus.context_len`` is set
   to ``data.seq_len`` (the training context ``N``; a config value that differs is overridden and
   the table says so), so ``m > 1`` is evaluation beyond ``N`` with the memory fully open.
2. **MQAR** (:mod:`nested_jax.experiments.mqar`): the same mixers (``<name>`` /
   ``<name>+proteus<E>``) from scratch on MQAR at ``--mqar-seq-len L``, scored at ``m × L`` for
   the same ``m``; all at ``--mqar-d-model`` (Proteus adds no parameters, so E=16 and E=1 have
   equal counts).

A mixer without a Proteus option cannot make a silent E=1 copy: ``ModelConfig`` refuses
``model.proteus.blocks > 1`` on it (the registry lists the option sections each mixer reads, and
a test checks that every mixer listing ``proteus`` changes its logits with E > 1).

Writes ``<out>/proteus_table.json`` and ``<out>/proteus_table.md`` and prints the Markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nested_jax.files import write_json
from nested_jax.train.config import add_override_argument

DEFAULT_CONFIGS = (
    "configs/experiments/tiny_gdn.yaml",
    "configs/experiments/tiny_gdn_proteus.yaml",
    "configs/experiments/tiny_titans_lmm.yaml",
    "configs/experiments/tiny_titans_lmm_proteus.yaml",
)


def mqar_spec(model_cfg) -> str:
    """MQAR model name of a ``ModelConfig``: ``name`` or ``name+proteus<E>``."""
    from nested_jax.experiments._training import PROTEUS_TAG

    e = model_cfg.proteus.blocks
    return model_cfg.name if e == 1 else f"{model_cfg.name}{PROTEUS_TAG}{e}"


def load_configs(paths: Sequence[str | Path], overrides: Sequence[str]) -> tuple[dict, list[str]]:
    """``{stem: Config}`` with ``model.proteus.context_len = data.seq_len`` for Proteus configs.

    Returns:
      ``(configs, notes)``; a note for every context_len that had to be changed.
    """
    from nested_jax.train.config import load_config

    configs, notes = {}, []
    for path in paths:
        name = Path(path).stem
        if name in configs:
            raise ValueError(f"configs: two configs named {name!r}")
        # The config loader insists on context_len == data.seq_len for Proteus configs: read the
        # length (and the configured N) with Proteus off, then load with N = the length.
        plain = load_config([path], [*overrides, "model.proteus.blocks=1"])
        n, given = plain.data.seq_len, plain.model.proteus.context_len
        cfg = load_config([path], [*overrides, f"model.proteus.context_len={n}"])
        if cfg.model.proteus.blocks == 1:  # Proteus off: keep the config exactly as written
            cfg = load_config([path], overrides)
        elif given != n:
            notes.append(
                f"{name}: model.proteus.context_len {given} -> {n} "
                "(= data.seq_len, the training context)"
            )
        configs[name] = cfg
    return configs, notes


def train_tokens_per_s(summary: dict, workdir: Path) -> float:
    """Training throughput of a run: the summary's, or (a reused finished run reports NaN) the
    last ``tokens_per_s`` logged in ``<workdir>/metrics.jsonl``."""
    tok_s = summary.get("tokens_per_s", float("nan"))
    if tok_s == tok_s:  # not NaN
        return tok_s
    path = workdir / "metrics.jsonl"
    if path.is_file():
        for line in reversed(path.read_text().splitlines()):
            row = json.loads(line)
            if row.get("kind") == "train" and "tokens_per_s" in row:
                return float(row["tokens_per_s"])
    return tok_s


def markdown_table(rows: list[dict], multipliers: Sequence[int], lm_len: int, mqar_len) -> str:
    """One row per config: params, val loss / NIAH / MQAR accuracy at every multiplier."""
    from nested_jax.experiments.compare import markdown_lines, niah_cells

    head = ["config", "mixer", "E", "params"]
    head += [f"val loss {m}× ({m * lm_len})" for m in multipliers]
    head += [f"NIAH {m}× ({m * lm_len})" for m in multipliers]
    if mqar_len:
        head += [f"MQAR acc {m}× ({m * mqar_len})" for m in multipliers]
    head += ["train tok/s"]
    body = []
    for r in rows:
        cells = [r["config"], r["mixer"], str(r["blocks"]), f"{r['params'] / 1e6:.3f}M"]
        cells += [f"{r['val_by_length'][str(m)]['val_loss']:.4f}" for m in multipliers]
        cells += niah_cells(r, multipliers)
        if mqar_len:
            mq = r.get("mqar")
            cells += [
                f"{mq['by_length'][str(m)]['accuracy']:.4f}" if mq else "—" for m in multipliers
            ]
        cells.append(f"{r['tokens_per_s']:.0f}")
        body.append(cells)
    return markdown_lines(head, body)


def _lm_rows(configs: dict, out: Path, multipliers: list[int]) -> list[dict]:
    """Part 1: trains (or reuses) every config in ``<out>/lm/<stem>`` and evaluates it at every
    multiplier; one row per config."""
    from nested_jax.experiments.compare import _describe, evaluate_trained
    from nested_jax.train.loop import train_and_evaluate

    rows = []
    for name, cfg in configs.items():
        print(f"== {name}: training {_describe(cfg)}", flush=True)
        summary = train_and_evaluate(cfg, out / "lm" / name)
        print(f"== {name}: evaluating at {multipliers}× seq_len", flush=True)
        ev = evaluate_trained(out / "lm" / name, multipliers, multipliers)
        rows.append(
            {
                "config": name,
                "mixer": cfg.model.name,
                "blocks": cfg.model.proteus.blocks,
                "context_len": cfg.model.proteus.context_len,
                "tokens_per_s": train_tokens_per_s(summary, out / "lm" / name),
                "wall_time_s": summary["wall_time_s"],
                **ev,
            }
        )
    return rows


def _add_mqar(rows: list[dict], configs: dict, s, out: Path) -> str:
    """Part 2: trains every config's MQAR twin under settings ``s`` in ``<out>/mqar``, adds its
    row to the config's row as ``"mqar"``; returns the MQAR Markdown."""
    from nested_jax.experiments.mqar import run_mqar

    specs = list(dict.fromkeys(mqar_spec(c.model) for c in configs.values()))
    print(f"== MQAR: {specs}", flush=True)
    res = run_mqar(specs, s, out / "mqar")
    by_spec = {r["model"]: r for r in res["rows"]}
    for row, cfg in zip(rows, configs.values(), strict=True):
        row["mqar"] = by_spec[mqar_spec(cfg.model)]
    return res["markdown"]


def _header(first, s) -> str:
    """The paragraph above the table: the LM recipe of ``first`` and, when ``s`` is not None,
    the MQAR settings."""
    md = (
        f"Proteus (SPEC §4) E=16 vs E=1. LM: {first.train.steps} steps each on "
        f"`{first.data.corpus}` (seq_len N = {first.data.seq_len}, batch "
        f"{first.data.batch_size}, seed {first.train.seed}), model.proteus.context_len = N; "
        "validation loss on the same validation text cut into windows of m×N tokens (first "
        f"{first.eval.eval_batches} batches per length); NIAH: depths "
        f"{list(first.eval.niah_depths)}, {first.eval.niah_per_cell} example(s) per depth and "
        "length, passkey exact match."
    )
    if s is not None:
        md += (
            f" MQAR: trained at L = {s.seq_len}, {s.num_kv_pairs} pairs, vocab {s.vocab}, "
            f"{s.steps} steps, d_model {s.d_model}; accuracy on {s.eval_batches} held-out batches "
            f"of length m×L (chance {s.chance:.4f})."
        )
    return md


def run_table(
    config_paths: Sequence[str | Path],
    out: str | Path,
    multipliers: Sequence[int] = (1, 4),
    overrides: Sequence[str] = (),
    mqar_settings=None,
) -> dict:
    """Train / evaluate every config (LM part) and its MQAR twin; returns rows and Markdown.

    Args:
      config_paths: experiment YAMLs (same data, steps and seed).
      out: output directory (``lm/<stem>`` run directories, ``mqar/``).
      multipliers: evaluation lengths as multiples of the training lengths.
      overrides: ``--set`` overrides for every config.
      mqar_settings: an :class:`~nested_jax.experiments.mqar.MqarSettings` (its
        ``eval_multipliers`` are replaced by ``multipliers``), or None to skip MQAR.

    Returns:
      ``{"rows": [...], "notes": [...], "markdown": str, "wall_s": float}``.
    """
    from nested_jax.experiments.compare import check_same_recipe

    multipliers = [int(m) for m in multipliers]
    if (
        not multipliers
        or any(m < 1 for m in multipliers)
        or len(set(multipliers)) != len(multipliers)
    ):
        raise ValueError(f"multipliers: expected distinct positive ints, got {multipliers}")
    start = time.perf_counter()
    out = Path(out)
    configs, notes = load_configs(config_paths, overrides)
    check_same_recipe(configs)
    rows = _lm_rows(configs, out, multipliers)
    s, mqar_md = None, ""
    if mqar_settings is not None:
        s = dataclasses.replace(mqar_settings, eval_multipliers=tuple(multipliers))
        mqar_md = _add_mqar(rows, configs, s, out)
    first = next(iter(configs.values()))
    md = _header(first, s) + "\n\n"
    md += markdown_table(rows, multipliers, first.data.seq_len, None if s is None else s.seq_len)
    for line in notes:
        md += f"\nnote: {line}"
    if mqar_md:
        md += "\n\nMQAR detail:\n\n" + mqar_md
    wall = time.perf_counter() - start
    md += f"\nTotal wall time: {wall:.0f} s.\n"
    return {"rows": rows, "notes": notes, "markdown": md, "wall_s": wall}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.proteus_table", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="experiment YAMLs")
    p.add_argument(
        "--multipliers", nargs="+", type=int, default=[1, 4], help="multiples of training length"
    )
    add_override_argument(p, "override applied to every config, e.g. --set train.steps=200")
    p.add_argument("--no-mqar", action="store_true", help="skip the MQAR part")
    for name, typ, default in (
        ("steps", int, 300),
        ("seq_len", int, 64),
        ("num_kv_pairs", int, 8),
        ("vocab", int, 64),
        ("d_model", int, 64),
        ("batch_size", int, 32),
        ("eval_batches", int, 4),
    ):
        p.add_argument(
            "--mqar-" + name.replace("_", "-"),
            type=typ,
            default=default,
            dest="mqar_" + name,
            help=f"MQAR {name} (default {default})",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    from nested_jax.experiments.mqar import MqarSettings
    from nested_jax.train.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        mqar = None
        if not args.no_mqar:
            mqar = MqarSettings(
                **{k[5:]: v for k, v in vars(args).items() if k.startswith("mqar_")},
                match_params=False,
                eval_multipliers=tuple(args.multipliers),
            )
        res = run_table(args.configs, args.out, args.multipliers, args.overrides, mqar)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / "proteus_table.json", {k: v for k, v in res.items() if k != "markdown"}, default=str
    )
    (out / "proteus_table.md").write_text(res["markdown"])
    print(res["markdown"], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
