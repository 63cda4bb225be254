"""``nested-jax train``: train (or resume) a model in a workdir.

    nested-jax train --config configs/experiments/tiny_gdn.yaml [--config MORE.yaml]
                     [--set train.steps=100 ...] --workdir runs/tiny_gdn

Without ``--config`` an existing workdir is continued with the config saved in it (``--set`` still
applies, e.g. ``--set train.steps=2000`` to train longer); a new workdir without ``--config`` uses
the defaults. Exit codes: 0 done, 1 training/data error, 2 bad command line or config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nested_jax.train.config import ConfigError, load_config, load_workdir_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nested-jax train", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML preset (repeatable; later files override earlier ones)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="override one field, e.g. --set train.steps=100 (repeatable)",
    )
    p.add_argument("--workdir", required=True, help="run directory (checkpoints, metrics, summary)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workdir = Path(args.workdir)
    try:
        if not args.config and (workdir / "config.json").is_file():
            config = load_workdir_config(workdir, args.overrides)
        else:
            config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    from nested_jax.parallel.distributed import maybe_initialize
    from nested_jax.train.loop import TrainingError, train_and_evaluate

    maybe_initialize()

    try:
        train_and_evaluate(config, workdir)
    except TrainingError as err:
        print(f"training stopped: {err}", file=sys.stderr)
        return 1
    except (
        ValueError
    ) as err:  # bad data / config combinations found at run time: one line, no traceback
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(msg if msg.startswith("config error") else f"error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
