"""Hope / Hope-Attention vs Titans LMM, Gated DeltaNet and Transformer++: one command.

    python -m nested_jax.experiments.compare_hope [--steps 200 --mqar-steps 300 --parallel]
    bash scripts/compare_hope                      # the same (it runs this module from the repo)

Trains tiny Hope and tiny Hope-Attention on Jane Austen next to Titans LMM, Gated DeltaNet and
Transformer++ (same data, steps and seed) and reports

1. validation loss / bits-per-byte and NIAH at 1× and 4× the training length
   (:mod:`nested_jax.experiments.compare`) -> ``<workdir>/compare.md``;
2. MQAR recall, from scratch, parameter-matched to the first model
   (:mod:`nested_jax.experiments.mqar`) -> ``<mqar-out>/mqar.md``.

Each part runs as its own ``nice``-d process (``python -u -m ...``) whose output goes to
``<workdir>.log`` / ``<mqar-out>.log``; the two run one after the other, or at the same time with
``--parallel``. Re-running reuses finished compare runs (compare resumes); MQAR reuses a finished
model only when its settings are identical. At the end both tables are printed; the exit status
is the last non-zero status of the two parts (0 when both succeed).

Every option defaults to an environment variable, so
``STEPS=200 MQAR_STEPS=300 PARALLEL=1 bash scripts/compare_hope`` sets them: ``STEPS``,
``MQAR_STEPS`` (400), ``EVAL_BATCHES``, ``MQAR_EVAL`` (8), ``WORKDIR`` (runs/hope_compare),
``MQAR_OUT`` (runs/hope_mqar), ``PARALLEL=1``, ``NICE`` (10; the CPU is shared) and ``MQAR_ARGS``
(extra MQAR flags, split on whitespace). Unrecognised arguments go to compare (e.g.
``--set train.lr=1e-3``). Relative paths (configs, output directories) are taken from the current
directory, the repository root when started by ``scripts/compare_hope``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

COMPARE_CONFIGS = (
    "configs/experiments/tiny_hope.yaml",
    "configs/experiments/tiny_hope_attention.yaml",
    "configs/experiments/tiny_titans_lmm.yaml",
    "configs/experiments/tiny_gdn.yaml",
    "configs/experiments/tiny_transformer.yaml",
)
MQAR_MODELS = ("hope", "hope_attention", "titans_lmm", "gdn", "transformer")


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The options; their defaults come from ``env`` (default ``os.environ``), see the module
    docstring."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.compare_hope",
        description=__doc__.split("\n\n")[0],
        epilog="Unrecognised arguments are passed on to nested_jax.experiments.compare.",
        allow_abbrev=False,  # an abbreviation must not swallow a compare option
    )
    p.add_argument(
        "--steps",
        type=int,
        default=_env_int(env, "STEPS"),
        help="train.steps of every compare config (env STEPS; default: the configs' own, 300)",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=_env_int(env, "EVAL_BATCHES"),
        help="eval.eval_batches of compare (env EVAL_BATCHES; default: the configs' own, 16)",
    )
    p.add_argument(
        "--mqar-steps",
        type=int,
        default=_env_int(env, "MQAR_STEPS", 400),
        help="optimizer steps per MQAR model (env MQAR_STEPS; default 400)",
    )
    p.add_argument(
        "--mqar-eval",
        type=int,
        default=_env_int(env, "MQAR_EVAL", 8),
        help="held-out MQAR batches (env MQAR_EVAL; default 8)",
    )
    p.add_argument(
        "--workdir",
        default=env.get("WORKDIR") or "runs/hope_compare",
        help="compare directory; log in <workdir>.log (env WORKDIR; default runs/hope_compare)",
    )
    p.add_argument(
        "--mqar-out",
        default=env.get("MQAR_OUT") or "runs/hope_mqar",
        help="MQAR directory; log in <mqar-out>.log (env MQAR_OUT; default runs/hope_mqar)",
    )
    p.add_argument(
        "--mqar-args",
        default=env.get("MQAR_ARGS", ""),
        help='extra MQAR flags, split on whitespace, e.g. --mqar-args="--batch-size 16 '
        '--d-model 48" (env MQAR_ARGS)',
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        default=env.get("PARALLEL", "0") == "1",
        help="run the two parts at the same time instead of one after the other (env PARALLEL=1)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=_env_int(env, "NICE", 10),
        help="niceness of both parts (env NICE; default 10: the CPU is shared)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the two commands and exit without running"
    )
    return p


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    text = env.get(name, "")
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"compare_hope: {name}={text!r} is not an integer") from None


def compare_command(args: argparse.Namespace, extra: Sequence[str] = ()) -> list[str]:
    """The compare part: ``nice -n N python -u -m nested_jax.experiments.compare ...``."""
    sets = []
    if args.steps is not None:
        sets += ["--set", f"train.steps={args.steps}"]
    if args.eval_batches is not None:
        sets += ["--set", f"eval.eval_batches={args.eval_batches}"]
    return [
        *_nice_python(args.nice),
        "nested_jax.experiments.compare",
        "--configs",
        *COMPARE_CONFIGS,
        "--workdir",
        str(args.workdir),
        "--niah-multipliers",
        "1",
        "4",
        *sets,
        *extra,
    ]


def mqar_command(args: argparse.Namespace) -> list[str]:
    """The MQAR part: ``nice -n N python -u -m nested_jax.experiments.mqar ...``."""
    return [
        *_nice_python(args.nice),
        "nested_jax.experiments.mqar",
        "--models",
        *MQAR_MODELS,
        "--steps",
        str(args.mqar_steps),
        "--eval-batches",
        str(args.mqar_eval),
        *args.mqar_args.split(),
        "--out",
        str(args.mqar_out),
    ]


def _nice_python(niceness: int) -> list[str]:
    return ["nice", "-n", str(niceness), sys.executable, "-u", "-m"]


def _launch(command: Sequence[str], log: Path) -> subprocess.Popen:
    """Starts ``command`` with stdout and stderr to ``log`` (overwritten)."""
    with open(log, "w") as f:
        return subprocess.Popen(list(command), stdout=f, stderr=subprocess.STDOUT)


def _status(proc: subprocess.Popen) -> int:
    rc = proc.wait()
    return 128 - rc if rc < 0 else rc  # killed by signal s: 128 + s, as a shell reports it


def run_parts(parts: Sequence[tuple[list[str], Path]], parallel: bool) -> int:
    """Runs every ``(command, log)``, all at once or one after the other; returns the last
    non-zero exit status (0 when all succeed)."""
    rc = 0
    if parallel:
        codes = [_status(p) for p in [_launch(cmd, log) for cmd, log in parts]]
    else:
        codes = [_status(_launch(cmd, log)) for cmd, log in parts]
    for code in codes:
        rc = code or rc
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    workdir, mqar_out = str(args.workdir), str(args.mqar_out)  # logs: <dir>.log, as written
    parts = [
        (compare_command(args, extra), Path(f"{workdir}.log")),
        (mqar_command(args), Path(f"{mqar_out}.log")),
    ]
    if args.dry_run:
        for cmd, log in parts:  # shell syntax; " &": the parts would run at the same time
            print(
                f"{shlex.join(cmd)} > {shlex.quote(str(log))} 2>&1"
                + (" &" if args.parallel else "")
            )
        return 0
    Path(workdir).parent.mkdir(parents=True, exist_ok=True)
    Path(mqar_out).parent.mkdir(parents=True, exist_ok=True)
    start = int(time.time())
    print(
        f"== {time.strftime('%H:%M:%S', time.gmtime())} compare -> {workdir} ({workdir}.log), "
        f"MQAR -> {mqar_out} ({mqar_out}.log)",
        flush=True,
    )
    rc = run_parts(parts, args.parallel)
    print(f"== wall time {int(time.time()) - start} s (exit {rc})")
    for table in (f"{workdir}/compare.md", f"{mqar_out}/mqar.md"):
        if Path(table).is_file():
            print()
            sys.stdout.write(Path(table).read_text())
        else:
            print(f"missing {table} (see the logs)")
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
