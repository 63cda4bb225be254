"""The optimizers of ``nested-jax bench optim`` and their learning-rate sweeps: names, default
rates, ``--sweep NAME=LR,LR`` parsing, the best run of a sweep and its Markdown table.

Shared by the LM sweep (:mod:`nested_jax.bench.optim_lm`) and the toy regression
(:mod:`nested_jax.bench.optim_toy`); the benchmark itself is :mod:`nested_jax.bench.optim`.
"""

from __future__ import annotations

import math

import numpy as np

OPTIMIZER_NAMES = ("adamw", "muon", "m3", "m3_rms", "m3_rms_ema")
# M3 settings of each M3 entry: (accumulate, normalize).
M3_VARIANTS = {
    "m3": ("additive", "none"),  # Algorithm 1 as printed (the default of m3())
    "m3_rms": ("additive", "rms"),  # scale-invariant, the paper's additive momenta
    "m3_rms_ema": ("ema", "rms"),  # scale-invariant, EMA momenta (neither is the paper's)
}
# Peak learning rates swept on the tiny GDN LM (the matrix lr for muon and the M3s): three per
# optimizer (factor ~3 apart; 4 for m3), chosen so that at the default sizes each optimizer's best
# rate lies inside its sweep (wider sweeps, 150 steps: 1e-3 … 1e-1 for AdamW, 6e-3 … 0.6 for Muon,
# 1e-5 … 2.56e-3 for m3, 3e-3 … 0.3 for the rms variants). m3 (Algorithm 1: step ∝ lr/|g|) needs
# far smaller rates.
DEFAULT_SWEEPS: dict[str, tuple[float, ...]] = {
    "adamw": (1e-2, 3e-2, 1e-1),
    "muon": (2e-2, 6e-2, 2e-1),
    "m3": (4e-5, 1.6e-4, 6.4e-4),
    "m3_rms": (3e-2, 1e-1, 3e-1),
    "m3_rms_ema": (3e-2, 1e-1, 3e-1),
}
# Constant learning rates of the toy regression (cheap: all runs compile as one jitted function).
TOY_SWEEPS: dict[str, tuple[float, ...]] = {
    "adamw": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "muon": (3e-3, 1e-2, 3e-2, 1e-1),
    "m3": (1e-4, 3e-4, 1e-3, 3e-3),
    "m3_rms": (1e-3, 3e-3, 1e-2, 3e-2),
    "m3_rms_ema": (1e-3, 3e-3, 1e-2, 3e-2),
}


def _check_sweeps(sweeps: dict, what: str) -> dict[str, tuple[float, ...]]:
    unknown = sorted(set(sweeps) - set(OPTIMIZER_NAMES))
    if unknown:
        raise ValueError(f"{what}: unknown optimizer(s) {unknown}; expected {OPTIMIZER_NAMES}")
    out = {}
    for name in OPTIMIZER_NAMES:
        if name not in sweeps:
            continue
        lrs = tuple(float(x) for x in sweeps[name])
        if not lrs or not all(math.isfinite(x) and x > 0 for x in lrs):
            raise ValueError(f"{what}: {name} needs positive learning rates, got {lrs}")
        out[name] = lrs
    if not out:
        raise ValueError(f"{what}: no optimizer to run")
    return out


def _best(lrs, losses) -> int:
    keyed = [x if math.isfinite(x) else math.inf for x in losses]
    return int(np.argmin(keyed))


def sweep_table(title: str, rows: dict[str, tuple[list, list]], extra: dict | None = None) -> str:
    """A markdown table: optimizer, rates tried, loss per rate, best rate, best loss (+ extras).

    Args:
      title: column title of the losses.
      rows: name → (rates, losses).
      extra: optional column name → {name: text}.
    """
    extra = extra or {}
    head = ["optimizer", "lrs tried", f"{title} per lr", "best lr", f"best {title}", *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, (lrs, losses) in rows.items():
        b = _best(lrs, losses)
        cells = [
            name,
            ", ".join(f"{x:g}" for x in lrs),
            ", ".join(f"{x:.3f}" for x in losses),
            f"{lrs[b]:g}",
            f"{losses[b]:.3f}",
            *(col.get(name, "") for col in extra.values()),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse_lrs(text: str, what: str) -> tuple[float, ...]:
    try:
        lrs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not lrs:
        raise ValueError(f"{what}: expected at least one learning rate, got {text!r}")
    return lrs


def parse_sweep_args(items, defaults: dict, optimizers: str | None, what: str = "--sweep") -> dict:
    """``--sweep NAME=LR,LR`` items (later ones win) over ``defaults``, restricted to
    ``optimizers`` (comma-separated names; None = all of ``defaults``)."""
    sweeps = dict(defaults)
    for item in items or ():
        name, sep, lrs = item.partition("=")
        if not sep or name not in OPTIMIZER_NAMES:
            raise ValueError(
                f"{what}: expected NAME=LR,LR,... with NAME in {OPTIMIZER_NAMES}, got {item!r}"
            )
        sweeps[name] = _parse_lrs(lrs, f"{what} {name}")
    if optimizers is not None:
        names = [n.strip() for n in optimizers.split(",") if n.strip()]
        unknown = [n for n in names if n not in OPTIMIZER_NAMES]
        if unknown or not names:
            raise ValueError(
                f"--optimizers: expected names from {OPTIMIZER_NAMES}, got {optimizers!r}"
            )
        sweeps = {n: sweeps[n] for n in OPTIMIZER_NAMES if n in names}
    return sweeps
