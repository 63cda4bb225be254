"""The seed papers' claims as prepared runs: one named entry per claim, a CPU size and a GPU size.

    python -m nested_jax.experiments.claims list
    python -m nested_jax.experiments.claims run NAME --scale cpu|gpu --out DIR [--dry-run]

Each :class:`Claim` states one claim of a seed paper in one sentence and, for each scale in
:data:`SCALES`, the exact driver invocations (:class:`Invocation`: an experiment module or a
``nested-jax`` sub-command, with its argv) whose output is the claim's table. Nothing here trains
or scores anything itself: the drivers do (``synthetic``, ``compare``, ``proteus_table``,
``forgetting``, ``nested-jax train / eval / report``), and this module only fixes their sizes.

Scales (the idea of ``class_incremental --scale``: named presets, not free sizes):

* ``cpu``: sizes that finish in at most 20 minutes (aimed at about 12) on a shared 2-core CPU;
  their tables are in docs/RESULTS.md with the commands that produced them. At these budgets a
  table says what separates *at this budget*, not what the papers' full-size runs show.
* ``gpu``: the papers' small settings scaled to one accelerator (wider and deeper models, longer
  training and contexts, more seeds). Prepared, not run here: a test checks that every argv
  parses with its driver's own parser and that every config override loads.

Arguments are templates: ``{out}`` is replaced by the run's ``--out`` directory, so
``run NAME --out DIR`` writes everything under ``DIR``. Config paths are relative to the
repository root (run from there). ``run`` prints each command (shell-quoted, ``$`` prefix) before
starting it as a subprocess of ``sys.executable`` and stops at the first one that fails (exit
status != 0); ``--dry-run`` prints the commands only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

SCALES = ("cpu", "gpu")
# `nested-jax <sub-command>` -> the module whose build_parser / main serve it (the CLI's own
# table is above this layer; a test checks that the two agree).
CLI_MODULES = {
    "train": "nested_jax.train.main",
    "eval": "nested_jax.eval.main",
    "report": "nested_jax.eval.report",
}
_EXPERIMENTS = "nested_jax.experiments."
_CFG = "configs/experiments/"


@dataclasses.dataclass(frozen=True)
class Invocation:
    """One driver run: ``python -m <target> <argv>`` for an experiment module, or
    ``nested-jax <target> <argv>`` when ``target`` is a key of :data:`CLI_MODULES`.

    ``argv`` may contain ``{out}`` (the run's output directory) anywhere in an argument.
    """

    target: str
    argv: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.target not in CLI_MODULES and not self.target.startswith(_EXPERIMENTS):
            raise ValueError(
                f"target: expected a nested-jax sub-command {sorted(CLI_MODULES)} or a module "
                f"{_EXPERIMENTS}<name>, got {self.target!r}"
            )

    @property
    def module(self) -> str:
        """The module that parses and runs this invocation."""
        return CLI_MODULES.get(self.target, self.target)

    def resolved(self, out: str | Path) -> tuple[str, ...]:
        """``argv`` with every ``{out}`` replaced by ``out``."""
        return tuple(a.replace("{out}", str(out)) for a in self.argv)

    def display(self, out: str | Path) -> str:
        """The shell command a person would type (``python -m ...`` or ``nested-jax ...``)."""
        head = ["nested-jax", self.target] if self.target in CLI_MODULES else ["python", "-m"]
        if self.target not in CLI_MODULES:
            head.append(self.target)
        return shlex.join([*head, *self.resolved(out)])

    def subprocess_argv(self, out: str | Path) -> list[str]:
        """The argv of the subprocess that runs it under this interpreter."""
        if self.target in CLI_MODULES:
            return [sys.executable, "-m", "nested_jax.cli", self.target, *self.resolved(out)]
        return [sys.executable, "-m", self.target, *self.resolved(out)]

    def parser(self) -> argparse.ArgumentParser:
        """The driver's own argument parser (``build_parser()`` of :attr:`module`)."""
        return importlib.import_module(self.module).build_parser()


@dataclasses.dataclass(frozen=True)
class Claim:
    """A seed paper's claim and the invocations that produce its table at each scale."""

    name: str
    paper: str
    claim: str
    scales: Mapping[str, tuple[Invocation, ...]]
    table: str  # where the driver writes the table (relative to --out)

    def __post_init__(self) -> None:
        missing = [s for s in SCALES if not self.scales.get(s)]
        if missing or set(self.scales) - set(SCALES):
            raise ValueError(
                f"scales: claim {self.name!r} needs invocations for exactly {list(SCALES)}, got "
                f"{sorted(self.scales)}"
            )


def _m(module: str, *argv: str) -> Invocation:
    return Invocation(_EXPERIMENTS + module, tuple(argv))


def _sets(pairs: Mapping[str, object]) -> list[str]:
    out = []
    for key, value in pairs.items():
        out += ["--set", f"{key}={value}"]
    return out


# One accelerator's "small setting": 6 layers × 384 (≈ 10–15M parameters with the byte
# vocabulary), contexts of 512, 5000 steps (the papers' smallest models are 125M–340M on billions
# of tokens; this is the size that still finishes in hours on one chip).
_GPU_LM = {
    "model.d_model": 384,
    "model.n_layers": 6,
    "model.n_heads": 6,
    "data.seq_len": 512,
    "data.batch_size": 32,
    "train.steps": 5000,
    "train.eval_every": 1000,
    "train.checkpoint_every": 1000,
    "eval.eval_batches": 64,
}


def _hope_formal() -> Claim:
    def synth(task: str, lengths: tuple[int, int], extra: Sequence[str]) -> Invocation:
        return _m(
            "synthetic",
            "--task",
            task,
            "--train-lengths",
            *map(str, lengths),
            *extra,
            "--out",
            "{out}",
        )

    # CPU: the settings of docs/RESULTS.md "Dyck-1 with Hope" (Hope's run alone ~10 minutes)
    cpu = synth(
        "formal:dyck1",
        (2, 16),
        ["--models", "transformer", "hope", "--steps", "500", "--lr", "2e-3", "--seeds", "0"],
    )
    # GPU: Table 5's benchmark (Irie et al. 2023 after Bhattamishra et al. 2020; docs/RESULTS.md
    # "Formal-language protocol"): next-character prediction on the six languages, the protocol's
    # Bin0/Bin1, 25 epochs of 10k strings at batch 32, a per-model learning-rate sweep on the
    # validation split, the LSTM as the control that must solve Parity
    gpu_args = [
        "--models", "hope", "transformer", "gdn", "deltanet", "lstm",
        "--steps", "7813", "--batch-size", "32", "--d-model", "128", "--n-layers", "2",
        "--n-heads", "2", "--warmup-steps", "200", "--lrs", "3e-4", "1e-3", "3e-3",
        "--seeds", "0", "1", "2", "3", "4",
    ]  # fmt: skip
    gpu = tuple(
        _m("synthetic", "--task", f"protocol:{name}", *gpu_args, "--out", "{out}")
        for name in ("parity", "aa_star", "abab_star", "anbn", "anbncn", "shuffle2")
    )
    return Claim(
        name="hope_formal",
        paper="Nested Learning: The Illusion of Deep Learning Architectures (Behrouz et al., "
        "arXiv 2512.24695)",
        claim="Hope (self-modifying memory + CMS) recognises formal languages and generalises "
        "to longer strings better than a Transformer of the same size.",
        scales={"cpu": (cpu,), "gpu": gpu},
        table="formal_<task>.md (cpu), protocol_<task>.md (gpu)",
    )


def _hola_niah() -> Claim:
    configs = [_CFG + f"tiny_{c}.yaml" for c in ("hola", "hola_recency", "gdn")]
    mult = ["--niah-multipliers", "1", "2", "4", "8", "16"]
    # CPU: 200 steps × batch 8 instead of the configs' 300 × 16 keep the three runs within the
    # CPU scale's 20 minutes (wall time in docs/RESULTS.md)
    cpu = _m(
        "compare",
        "--configs",
        *configs,
        "--workdir",
        "{out}",
        *mult,
        *_sets({"train.steps": 200, "data.batch_size": 8, "eval.niah_per_cell": 2}),
    )
    gpu = _m(
        "compare",
        "--configs",
        *configs,
        "--workdir",
        "{out}",
        *mult,
        *_sets({**_GPU_LM, "model.hola.window": 64, "eval.niah_per_cell": 8}),
    )
    return Claim(
        name="hola_niah",
        paper="A Hippocampus for Linear Attention (HOLA; Cui, arXiv 2607.02303)",
        claim="An exact top-w KV cache chosen by surprise (β‖e‖) lets Gated DeltaNet retrieve "
        "needles that a recency cache of the same size and plain GDN lose, out to 16× the "
        "training length.",
        scales={"cpu": (cpu,), "gpu": (gpu,)},
        table="compare.md",
    )


def _titans_babilong() -> Claim:
    variants = ("lmm", "mac", "mag", "mal")

    def scale(train: Mapping[str, object], evals: Mapping[str, object], suite: str):
        runs = []
        for v in variants:
            work = f"{{out}}/titans_{v}"
            runs.append(
                Invocation(
                    "train",
                    ("--config", _CFG + f"tiny_titans_{v}.yaml", "--workdir", work, *_sets(train)),
                )
            )
            runs.append(Invocation("eval", ("--workdir", work, "--suite", suite, *_sets(evals))))
        report = ("report", *(f"{{out}}/titans_{v}" for v in variants), "--out", "{out}/report")
        return (*runs, Invocation(report[0], report[1:]))

    # CPU: 512 is the shortest length holding every task's story (qa3 needs more than 256 byte
    # tokens)
    cpu = scale(
        {"train.steps": 200, "data.batch_size": 8},
        {"eval.babilong_lengths": "[512, 1024]", "eval.babilong_per_length": 2},
        "validation,babilong",
    )
    gpu = scale(
        _GPU_LM,
        {
            "eval.babilong_lengths": "[1024, 2048, 4096, 8192]",
            "eval.babilong_per_length": 32,
            "eval.niah_lengths": "[512, 2048, 8192]",
        },
        "validation,niah,babilong",
    )
    return Claim(
        name="titans_babilong",
        paper="Titans: Learning to Memorize at Test Time (Behrouz et al., arXiv 2501.00663)",
        claim="The neural long-term memory answers BABILong-style questions over facts "
        "scattered in long text, and memory as context (MAC) does best of LMM, MAC, MAG and MAL.",
        scales={"cpu": cpu, "gpu": gpu},
        table="report/report.md",
    )


def _proteus_sweep() -> Claim:
    def run(e: int, configs: Sequence[str], sets: Mapping[str, object], extra: Sequence[str]):
        return _m(
            "proteus_table",
            "--configs",
            *configs,
            "--out",
            f"{{out}}/E{e}",
            *_sets({**sets, "model.proteus.blocks": e}),
            *extra,
        )

    # CPU: no MQAR part at this size: at 300 steps and d_model 64 MQAR stays at chance and takes
    # about a third of a run's time (docs/RESULTS.md)
    cpu = tuple(run(e, [_CFG + "tiny_gdn_proteus.yaml"], {}, ["--no-mqar"]) for e in (1, 4, 16))
    gpu_extra = [
        "--multipliers", "1", "4", "16",
        "--mqar-steps", "3000", "--mqar-seq-len", "256", "--mqar-num-kv-pairs", "32",
        "--mqar-d-model", "128", "--mqar-eval-batches", "16",
    ]  # fmt: skip
    gpu_configs = [_CFG + "tiny_gdn_proteus.yaml", _CFG + "tiny_titans_lmm_proteus.yaml"]
    gpu = tuple(run(e, gpu_configs, _GPU_LM, gpu_extra) for e in (1, 2, 4, 8, 16, 32, 64))
    return Claim(
        name="proteus_sweep",
        paper="Proteus: Incremental Memory Activation for Long-Context Sequence Modeling "
        "(Bayat, Behrouz et al., arXiv 2608.16844)",
        claim="Opening a recurrent memory's capacity in E blocks over the training context "
        "(E > 1) extrapolates better beyond the training length than the always-open memory "
        "(E = 1), at no extra parameters.",
        scales={"cpu": cpu, "gpu": gpu},
        table="E<E>/proteus_table.md",
    )


def _cms_forgetting() -> Claim:
    # CPU: the acceptance protocol and the full arm grid under it, 131 s (the other six protocols
    # are the gpu size's: all eight took 1228 s on the CPU)
    cpu = _m("forgetting", "--out", "{out}", "--only", "grid")
    seeds = [str(s) for s in range(8)]
    gpu = _m("forgetting", "--out", "{out}", "--seeds", *seeds)
    return Claim(
        name="cms_forgetting",
        paper="Nested Learning: The Illusion of Deep Learning Architectures (Behrouz et al., "
        "arXiv 2512.24695)",
        claim="A continuum memory system with levels updated at slower frequencies forgets an "
        "earlier language less than a one-level memory when two languages alternate.",
        scales={"cpu": (cpu,), "gpu": (gpu,)},
        table="forgetting.md",
    )


CLAIMS: dict[str, Claim] = {
    c.name: c
    for c in (_hope_formal(), _hola_niah(), _titans_babilong(), _proteus_sweep(), _cms_forgetting())
}


def get_claim(name: str) -> Claim:
    """The registered claim ``name``; ``ValueError`` naming it and the known names otherwise."""
    if name not in CLAIMS:
        raise ValueError(f"name: unknown claim {name!r}; known: {', '.join(CLAIMS)}")
    return CLAIMS[name]


def invocations(name: str, scale: str) -> tuple[Invocation, ...]:
    """The invocations of claim ``name`` at ``scale`` (``ValueError`` naming a bad one)."""
    claim = get_claim(name)
    if scale not in SCALES:
        raise ValueError(f"scale: unknown scale {scale!r}; expected one of {', '.join(SCALES)}")
    return claim.scales[scale]


def list_text(out: str = "runs/claims") -> str:
    """Every claim with its paper, sentence and commands at both scales (``--out <out>/<name>``)."""
    lines = []
    for c in CLAIMS.values():
        lines += [f"## {c.name}", f"paper: {c.paper}", f"claim: {c.claim}", f"table: {c.table}"]
        for scale in SCALES:
            lines.append(f"{scale}:")
            lines += [f"  {inv.display(f'{out}/{c.name}')}" for inv in c.scales[scale]]
        lines.append("")
    return "\n".join(lines)


def run_claim(
    name: str,
    scale: str,
    out: str | Path,
    dry_run: bool = False,
    runner: Callable[[list[str]], int] | None = None,
    echo: Callable[[str], None] | None = None,
) -> int:
    """Run (or with ``dry_run`` only print) claim ``name``'s invocations at ``scale`` in order.

    Args:
      runner: runs one subprocess argv and returns its exit status (default
        ``subprocess.run(argv).returncode``; tests pass a fake).
      echo: where the ``$ command`` lines and the wall times go.

    Returns:
      0, or the exit status of the first invocation that failed (the rest are not started).
    """
    todo = invocations(name, scale)
    if echo is None:

        def echo(line: str) -> None:
            print(line, flush=True)  # before the subprocess writes to the same stream

    if runner is None:

        def runner(argv: list[str]) -> int:
            return subprocess.run(argv, check=False).returncode

    for inv in todo:
        echo(f"$ {inv.display(out)}")
    if dry_run:
        return 0
    start = time.perf_counter()
    for i, inv in enumerate(todo, 1):
        echo(f"== [{i}/{len(todo)}] $ {inv.display(out)}")
        t0 = time.perf_counter()
        rc = runner(inv.subprocess_argv(out))
        echo(f"== [{i}/{len(todo)}] exit {rc} after {time.perf_counter() - t0:.0f} s")
        if rc != 0:
            return rc
    echo(f"== {name} ({scale}): {len(todo)} command(s), {time.perf_counter() - start:.0f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.claims", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="every claim with its commands at both scales")
    ls.add_argument("--out", default="runs/claims", help="root shown in the commands")
    r = sub.add_parser("run", help="run one claim's invocations at one scale")
    r.add_argument("name", choices=list(CLAIMS), help="the claim")
    r.add_argument("--scale", choices=SCALES, default="cpu", help="size preset")
    r.add_argument("--out", required=True, help="output directory ({out} in the commands)")
    r.add_argument("--dry-run", action="store_true", help="print the commands only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        print(list_text(args.out), end="")
        return 0
    return run_claim(args.name, args.scale, args.out, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
