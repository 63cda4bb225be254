"""Continual learning on two alternating synthetic languages: does a multi-level CMS forget less?

    python -m nested_jax.experiments.forgetting --out runs/forgetting [--quick]

Writes ``<out>/forgetting.json`` (settings, per-seed curves, summaries), ``<out>/forgetting.md``
(the tables) and, when matplotlib is importable, ``<out>/forgetting.png`` (current-language and
language-A loss at every phase end); prints the Markdown.

Code: the simulation (settings, arms, :func:`run_arm`) is
:mod:`nested_jax.experiments.forgetting_stream`; this module holds the metrics, the experiments
run, the tables and the command line.

**Task.** A latent first-order Markov chain over ``n`` symbols (each row of the transition matrix
drawn from ``Dirichlet(concentration · 1)``, so most mass sits on a few successors) is emitted
through two disjoint token maps: language A writes symbol ``s`` as token ``s``, language B as
token ``n + s`` (vocabulary ``V = 2n``). Both languages have the same entropy rate; the loss floor
(``floor``) is the loss of the true chain on the held-out sequences.

**Model.** ``tokens → embedding E [V, d] → CMS (SPEC §3.3) → head W_o [d, V] → softmax``. ``E``
(``N(0, 1)``) and ``W_o`` (``N(0, 1/d)``) are random and frozen; the CMS levels start from a random
init (``cms_init_levels``; the nested variant starts all levels at the fastest level's init, so its
initial function equals the one-level model's). In the acceptance protocol nothing is pretrained
on either language: every bit of knowledge of either language is then written during the stream by
the online CMS updates (:func:`nested_jax.core.cms.online.cms_online`, local surprise
``δ_t = ∂L_t/∂y_t`` of the next-token cross-entropy), so what is forgotten is a property of the
online CMS dynamics alone — the object of the claim. Two further protocols pretrain the initial
CMS levels (outer loop, Adam on ``cms_forward`` with fixed weights, ``E`` and ``W_o`` still frozen)
on both languages for ``pretrain_steps`` steps before the stream (SPEC §3.3: initial states are
learned by the outer loop), so the stream starts from partial (25 steps) or nearly complete (200
steps) knowledge of both.

**Stream.** ``n_phases`` phases of ``phase_len`` tokens, alternating A, B, A, B, … (each phase a
fresh sample of the chain; the transition between phases is not scored). Every seed draws its own
chain, embedding, head, init and a random *clock offset* in ``[0, C^(k))``: the stream starts at
token position ``offset`` of the CMS clock, so phase ends are not synchronised with the level
boundaries (a nested reset falling exactly at every phase end would otherwise decide the
measurement). Each seed runs ``n_streams`` independent streams (batch rows, each with its own online
weights).

**Measurements** (nats per token; means over streams, then seeds): after every phase, with the
stream's current weights (pending accumulations not yet applied), the loss on held-out language-A
and language-B sequences (``cms_forward``, the same sequences for all arms of a seed).

- ``forget_A``: mean over B phases of ``loss_A(after B phase) − loss_A(after the preceding A
  phase)`` — how much of A one B phase destroys (the quantity of the claim);
- ``forget_B``: the same for B over the A phases from the second on;
- ``retain_A``: mean ``loss_A`` after the B phases (what is left of A, absolute);
- ``current``: mean loss on the language of the phase just finished (plasticity);
- ``both``: mean over phase ends of ``(loss_A + loss_B)/2`` (all knowledge at once);
- ``online``: mean next-token loss during the stream (prequential).

A model that learns nothing has ``forget_A ≈ 0``: read ``forget_A`` together with ``current``.

**Arms.** ``k = 1`` (period 1) against ``k = 3`` levels, periods ``C^(1) < C^(2) < C^(3)``, equal
per-level width ``d_hidden`` (the nested forward uses one level, so its forward capacity equals the
one-level model's), SGD inner optimizer, base rate ``η`` for the fastest level. Slower levels'
rates (``lr_scaling``):

- ``"sum"``: ``η_ℓ = η`` — SPEC §3.3 as written, ``θ_ℓ ← θ_ℓ − Σ_{t∈period} η g_t``: a slow level
  changes as fast per token as the fast one, only in lumps. For ``nested`` this is *exactly* the
  one-level model (the slow level's update ``Σ η g_t`` equals the fast level's displacement over the
  same tokens, so every reset is a no-op; asserted by the tests);
- ``"mean"``: ``η_ℓ = η C^(1)/C^(ℓ)`` — one step of the period's mean gradient per period
  (``multi_frequency(accumulate="mean")``'s reading): a level with a longer period really is slower.

**Acceptance protocol** (fixed before measuring, from the reasoning above): variant ``nested``
(the level-reset mechanism meant to keep old knowledge in slow levels), ``lr_scaling="mean"``
(with ``"sum"`` the nested claim is vacuous), periods ``(1, 16, 128)``, ``phase_len = 256``,
8 phases, 4 seeds, against ``k = 1`` at the same ``η``. The claim holds if the seed-mean
``forget_A`` of the three-level CMS is below the one-level model's; the report also gives
``current``/``both``/``online`` so "forgets less" can be told apart from "learns less".
The base ``η = 0.03`` was chosen before the comparison as the one-level model's best prequential
(``online``) loss among ``{0.003, 0.01, 0.03, 0.1, 0.3}`` (two seeds; 0.3 diverged).

Results (every protocol, 4 seeds): ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nested_jax.experiments.forgetting_stream import (
    _SCALINGS,
    Arm,
    StreamSettings,
    level_lrs,
    run_arm,
)
from nested_jax.files import write_json

__all__ = [
    "summarize",
    "compare",
    "acceptance_arms",
    "grid_arms",
    "markdown_table",
    "verdict",
    "experiments",
    "main",
]

_METRICS = ("forget_A", "forget_B", "retain_A", "current", "both", "online")


def summarize(run: dict) -> dict[str, float]:
    """The metrics of one run (module docstring). ``run`` as returned by :func:`run_arm`."""
    ev = run["eval"]  # [P, 2]
    n = ev.shape[0]
    la, lb = ev[:, 0], ev[:, 1]
    b_phases = range(1, n, 2)
    a_later = range(2, n, 2)
    cur = np.array([ev[p, p % 2] for p in range(n)])
    out = {
        "forget_A": float(np.mean([la[p] - la[p - 1] for p in b_phases])),
        "forget_B": float(np.mean([lb[p] - lb[p - 1] for p in a_later])) if n > 2 else math.nan,
        "retain_A": float(np.mean([la[p] for p in b_phases])),
        "current": float(np.mean(cur)),
        "both": float(np.mean((la[1:] + lb[1:]) / 2)),
        "online": float(np.mean(run["online"])),
    }
    return out


def compare(s: StreamSettings, arms: Sequence[Arm], log=None) -> dict:
    """Runs every arm on every seed of ``s``.

    Returns:
      ``{"settings", "arms": [{"arm", "lrs", "per_seed": [...], "mean": {...}, "sem": {...},
      "curves": {...}, "init", "seconds"}], "floor"}``; ``mean``/``sem`` over seeds of
      :func:`summarize`'s metrics; ``curves`` the seed-mean ``eval`` ``[n_phases, 2]`` and
      ``online``.
    """
    if not arms:
        raise ValueError("arms: expected at least one arm")
    res = {"settings": dataclasses.asdict(s), "arms": []}
    floors = []
    for arm in arms:
        t0 = time.time()
        runs = [run_arm(s, arm, seed) for seed in s.seeds]
        per_seed = [summarize(r) for r in runs]
        floors = [float(r["floor"]) for r in runs]
        m = {k: float(np.mean([p[k] for p in per_seed])) for k in _METRICS}
        se = {
            k: float(np.std([p[k] for p in per_seed], ddof=1) / math.sqrt(len(per_seed)))
            if len(per_seed) > 1
            else math.nan
            for k in _METRICS
        }
        entry = {
            "arm": dataclasses.asdict(arm),
            "lrs": list(level_lrs(arm, s.lr)),
            "per_seed": per_seed,
            "offsets": [r["offset"] for r in runs],
            "diverged": any(r.get("diverged", False) for r in runs),
            "mean": m,
            "sem": se,
            "curves": {
                "eval": np.mean([r["eval"] for r in runs], axis=0).tolist(),
                "online": np.mean([r["online"] for r in runs], axis=0).tolist(),
            },
            "init": np.mean([r["init"] for r in runs], axis=0).tolist(),
            "seconds": time.time() - t0,
        }
        res["arms"].append(entry)
        if log is not None:
            log(
                f"{arm.name:<28} forget_A {m['forget_A']:+.3f}±{se['forget_A']:.3f}  "
                f"current {m['current']:.3f}  both {m['both']:.3f}  ({entry['seconds']:.1f}s)"
            )
    res["floor"] = float(np.mean(floors))
    return res


def acceptance_arms() -> list[Arm]:
    """The acceptance comparison (module docstring): k=1 vs three nested levels, mean rates."""
    return [
        Arm("k1", "sequential", (1,)),
        Arm("k3 nested mean (1,16,128)", "nested", (1, 16, 128), "mean"),
    ]


def grid_arms(periods: tuple[int, ...] = (1, 16, 128)) -> list[Arm]:
    """Every variant × rate reading at ``periods``, plus one-level baselines at the slow rates."""
    arms = [Arm("k1", "sequential", (1,))]
    for c in periods[1:]:
        arms.append(Arm(f"k1 lr/{c}", "sequential", (1,), "sum", 1.0 / c))
    for variant in ("sequential", "nested", "independent"):
        for sc in _SCALINGS:
            arms.append(Arm(f"k3 {variant} {sc} {periods}", variant, tuple(periods), sc))
    return arms


def markdown_table(res: dict, title: str = "") -> str:
    """One Markdown table of an experiment's seed means (± standard error)."""
    s = res["settings"]
    lines = []
    if title:
        lines.append(f"### {title}")
        lines.append("")
    lines.append(
        f"phase_len={s['phase_len']}, phases={s['n_phases']}, η={s['lr']}, inner={s['inner']}, "
        f"n={s['n_symbols']}, d={s['d_model']}, h={s['d_hidden']}, seeds={len(s['seeds'])} × "
        f"{s['n_streams']} streams, pretrain_steps={s['pretrain_steps']}; loss floor (true chain) "
        f"{res['floor']:.3f} nats/token; `init` = loss on A / B before the stream"
    )
    lines.append("")
    lines.append(
        "| arm | η per level | init | forget_A ↓ | forget_B ↓ | retain_A ↓ | current ↓ | both ↓ "
        "| online ↓ |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for a in res["arms"]:
        m, se = a["mean"], a["sem"]
        lrs = ", ".join(f"{x:.3g}" for x in a["lrs"])
        cells = [f"{m[k]:+.3f} ± {se[k]:.3f}" for k in ("forget_A", "forget_B")]
        cells += [f"{m[k]:.3f} ± {se[k]:.3f}" for k in ("retain_A", "current", "both", "online")]
        name = a["arm"]["name"] + (" (diverged)" if a["diverged"] else "")
        init = "{:.2f} / {:.2f}".format(*a["init"])
        lines.append(f"| {name} | {lrs} | {init} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(experiments: list[tuple[str, dict]], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(
        len(experiments), 1, figsize=(8, 3.2 * len(experiments)), squeeze=False
    )
    for ax, (title, res) in zip(axes[:, 0], experiments, strict=True):
        for a in res["arms"]:
            ev = np.asarray(a["curves"]["eval"])
            ax.plot(np.arange(1, len(ev) + 1), ev[:, 0], marker="o", label=a["arm"]["name"])
        ax.axhline(res["floor"], color="k", lw=0.5, ls="--")
        ax.set_title(f"{title}: held-out language-A loss after each phase (odd = after A)")
        ax.set_xlabel("phase")
        ax.set_ylabel("nats/token")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.forgetting", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run of the machinery)")
    p.add_argument("--lr", type=float, default=StreamSettings.lr, help="base η")
    p.add_argument("--seeds", type=int, nargs="+", default=list(StreamSettings.seeds))
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run the acceptance experiment and those whose title contains one of these strings",
    )
    return p


def _other_arms(periods: tuple[int, ...] = (1, 16, 128), nested_sum: bool = False) -> list[Arm]:
    """Arms run under the other protocols. Nested ``"sum"`` is omitted unless
    ``nested_sum``: with SGD it is the one-level model exactly (module docstring)."""
    arms = [Arm("k1", "sequential", (1,)), Arm("k1 lr/3", "sequential", (1,), "sum", 1.0 / 3)]
    extra = (("nested", "sum"),) if nested_sum else ()
    for variant, sc in extra + (
        ("sequential", "sum"),
        ("sequential", "mean"),
        ("nested", "mean"),
        ("independent", "sum"),
        ("independent", "mean"),
    ):
        arms.append(Arm(f"k3 {variant} {sc} {periods}", variant, tuple(periods), sc))
    return arms


def experiments(
    quick: bool, lr: float, seeds: Sequence[int]
) -> list[tuple[str, StreamSettings, list[Arm]]]:
    """The experiments run by the CLI: the acceptance protocol first, then every other protocol
    (phase length, stream length, variants, rate readings, one-level rate sweep)."""
    seeds = tuple(seeds)
    if quick:
        s = StreamSettings(
            n_symbols=4,
            d_model=8,
            d_hidden=8,
            phase_len=16,
            n_phases=4,
            n_streams=2,
            n_eval=4,
            eval_len=8,
            lr=lr,
            seeds=seeds[:2],
        )
        return [("quick", s, [Arm("k1"), Arm("k3 nested mean", "nested", (1, 2, 4), "mean")])]
    acc = StreamSettings(lr=lr, seeds=seeds)
    grid = grid_arms((1, 16, 128))
    grid.insert(1, Arm("k1 lr/3", "sequential", (1,), "sum", 1.0 / 3))
    return [
        ("acceptance: nested, mean rates, phase 256 × 8", acc, acceptance_arms()),
        ("grid: phase 256 × 8, periods (1,16,128)", acc, grid),
        ("long stream: phase 256 × 24", dataclasses.replace(acc, n_phases=24), _other_arms()),
        (
            "long phases: phase 1024 × 4",
            dataclasses.replace(acc, phase_len=1024, n_phases=4),
            _other_arms(),
        ),
        (
            "short phases: phase 64 × 16",
            dataclasses.replace(acc, phase_len=64, n_phases=16),
            _other_arms(),
        ),
        (
            "pretrained briefly on both languages (25 Adam steps): phase 256 × 8",
            dataclasses.replace(acc, pretrain_steps=25),
            _other_arms(),
        ),
        (
            "pretrained on both languages (200 Adam steps): phase 256 × 8",
            dataclasses.replace(acc, pretrain_steps=200),
            _other_arms(),
        ),
        (
            "DGD inner optimizer: phase 256 × 8",
            dataclasses.replace(acc, inner="dgd"),
            _other_arms(nested_sum=True),
        ),
    ]


def verdict(res: dict) -> dict:
    """The claim on an acceptance result (first arm: one level, second: three levels).

    Returns:
      ``{"claim", "holds", "forget_A_k1", "forget_A_k3", "sem_k1", "sem_k3", "current_k1",
      "current_k3"}``; ``holds`` is ``forget_A(k3) < forget_A(k1)`` (seed means).
    """
    a1, a3 = res["arms"][0], res["arms"][1]
    if a1["arm"]["periods"] != [1] and a1["arm"]["periods"] != (1,):
        raise ValueError("res: the first arm must be the one-level model")
    f1, f3 = a1["mean"]["forget_A"], a3["mean"]["forget_A"]
    return {
        "claim": f"{a3['arm']['name']} forgets language A less than {a1['arm']['name']}",
        "holds": bool(f3 < f1),
        "forget_A_k1": f1,
        "forget_A_k3": f3,
        "sem_k1": a1["sem"]["forget_A"],
        "sem_k3": a3["sem"]["forget_A"],
        "current_k1": a1["mean"]["current"],
        "current_k3": a3["mean"]["current"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results, md = [], []
    todo = experiments(args.quick, args.lr, args.seeds)
    if args.only:
        todo = [e for i, e in enumerate(todo) if i == 0 or any(o in e[0] for o in args.only)]
    for i, (title, s, arms) in enumerate(todo):
        print(f"== {title}", flush=True)
        res = compare(s, arms, log=lambda m: print("  " + m, flush=True))
        table = markdown_table(res, title)
        if i == 0:
            res["verdict"] = v = verdict(res)
            table += (
                f"\n\n**Acceptance claim** ({v['claim']}): "
                f"{'HOLDS' if v['holds'] else 'DOES NOT HOLD'} — forget_A "
                f"{v['forget_A_k3']:+.3f} ± {v['sem_k3']:.3f} (three levels) vs "
                f"{v['forget_A_k1']:+.3f} ± {v['sem_k1']:.3f} (one level)."
            )
        results.append((title, res))
        md.append(table)
        # Written after every experiment so a long run leaves its finished tables behind.
        (out / "forgetting.md").write_text("\n\n".join(md) + "\n")
    wall = time.time() - t0
    png = _plot(results, out / "forgetting.png")
    note = (
        f"plot: {png}" if png else "plot: skipped (matplotlib is not installed in this environment)"
    )
    text = "\n\n".join(md) + f"\n\nwall time {wall:.0f} s; {note}\n"
    (out / "forgetting.md").write_text(text)
    payload = {"experiments": [{"title": t, **r} for t, r in results], "wall_s": wall, "plot": png}
    write_json(out / "forgetting.json", payload, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
