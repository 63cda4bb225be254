"""``nested-jax train``: train (or resume) a model in a workdir.

    nested-jax train --config configs/experiments/tiny_gdn.yaml [--config MORE.yaml]
                     [--set train.steps=100 ...] --workdir runs/tiny_gdn
    nested-jax train --workdir runs/tiny_gdn [--set train.steps=2000]   # continue a run
    nested-jax train --task formal:parity --config configs/experiments/tiny_transformer.yaml \
                     --set data.task_options.train_lengths=[1,16] --workdir runs/parity

``--task FAMILY:NAME`` is ``--set data.task=FAMILY:NAME``: train on a generated task
(``formal:<name>``, ``mad:<name>``; :mod:`nested_jax.data.task_source`) with the same loop,
checkpoints and progress bar; each validation also reports the task's accuracy.

Without ``--config`` the run saved in the workdir is continued with its own config (``--set``
still applies); a workdir without a run is refused. A resumed run may change only settings that
are safe to change (``nested_jax.train.workdir.SAFE_ON_RESUME``); ``--reset-optimizer`` also lets
``optimizer.*`` change, keeping the weights and the data position.

One run per workdir: a second ``train`` on a workdir that a live run holds is refused (exit 2,
naming its pid and host; :mod:`nested_jax.train.lock`).

Exit codes: 0 finished; 75 stopped by SIGTERM / Ctrl-C with a checkpoint saved, or by SIGTERM
before the steps began (nothing to save yet; run the same command to resume); 2 bad command line
or config, a refused resume, or a workdir in use; 1 training or data error (one line on stderr, the
traceback appended to ``<workdir>/errors.log``); 130 aborted by a second Ctrl-C (no save; the last
checkpoint is intact).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from nested_jax.files import PathError, as_path
from nested_jax.train.config import ConfigError, add_override_argument
from nested_jax.train.errorlog import BackgroundNoise, log_exception, log_path, one_line
from nested_jax.train.signals import (
    EXIT_ABORTED,
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PREEMPTED,
    StoppedEarly,
    checkpoint_phrase,
    install_startup_handler,
    report_stopped_early,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nested-jax train", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML preset (repeatable; later files override earlier ones); omit to continue the "
        "run saved in --workdir",
    )
    add_override_argument(p)
    p.add_argument(
        "--workdir",
        required=True,
        help="run directory (checkpoints, metrics, summary); a local path or a gs:// URL",
    )
    p.add_argument(
        "--task",
        metavar="FAMILY:NAME",
        help="train on a generated task instead of text, e.g. formal:parity or "
        "mad:in_context_recall (shorthand for --set data.task=FAMILY:NAME; options via --set "
        "data.task_options.KEY=VALUE)",
    )
    p.add_argument(
        "--reset-optimizer",
        action="store_true",
        help="resume the weights and data position with a fresh optimizer state (allows "
        "changing optimizer.* settings)",
    )
    return p


def _error(prefix: str, err: BaseException) -> None:
    print(f"{prefix}: {one_line(err)}", file=sys.stderr)


def _failed(prefix: str, err: BaseException, workdir: str) -> int:
    """One line naming the log that keeps `err`'s traceback; returns :data:`EXIT_ERROR`."""
    try:
        path = log_exception(log_path(workdir), err, f"nested-jax train {prefix}")
        where = f"traceback in {path}"
    except OSError as log_err:  # a full disk: the line still comes
        where = f"no traceback saved: {log_err.strerror or log_err}"
    print(f"{prefix}: {one_line(err)} ({where})", file=sys.stderr)
    return EXIT_ERROR


def _check_task(config) -> None:
    """A generated task's family, name and options are known before anything runs (the families
    are registered by ``nested_jax.eval.task_families``, which ``nested-jax`` imports)."""
    if not config.data.task:
        return
    from nested_jax.data.task_source import build_task

    try:
        build_task(config.data)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def main(argv: list[str] | None = None, *, hard_abort: bool = False) -> int:
    """Runs ``nested-jax train``; returns the exit code.

    `hard_abort` (the ``nested-jax`` command sets it; the process ends anyway): on a second Ctrl-C
    end the process with :data:`EXIT_ABORTED` right after the message, without unwinding further.
    """
    # `nested-jax` installs it before importing this module; a direct caller gets its own back
    previous = install_startup_handler()
    args = build_parser().parse_args(argv)
    try:
        with BackgroundNoise(args.workdir):
            return _train(args, hard_abort)
    except StoppedEarly as err:
        return report_stopped_early(err, args.workdir)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _train(args: argparse.Namespace, hard_abort: bool) -> int:
    from nested_jax.data.corpus import DataError
    from nested_jax.train.workdir import resolve_config

    overrides = list(args.overrides)
    if args.task is not None:
        overrides.append(f"data.task={args.task}")
    try:
        workdir = as_path(args.workdir, "--workdir")
        config, source = resolve_config(workdir, args.config, overrides)
        _check_task(config)
    except (ConfigError, PathError) as err:
        _error("config error", err)
        return EXIT_CONFIG

    from nested_jax.parallel.distributed import maybe_initialize
    from nested_jax.train.lock import WorkdirBusy
    from nested_jax.train.loop import TrainingError, train_and_evaluate

    maybe_initialize()
    try:
        summary = train_and_evaluate(
            config,
            workdir,
            reset_optimizer=args.reset_optimizer,
            config_source=None if args.config else source,  # printed once the resume is accepted
        )
    except WorkdirBusy as err:  # another live run trains here: nothing was written
        _error("error", err)
        return EXIT_CONFIG
    except ConfigError as err:  # refused resume, mesh / vocabulary mismatch: nothing was written
        _error("config error", err)
        return EXIT_CONFIG
    except DataError as err:
        return _failed("data error", err, args.workdir)
    except TrainingError as err:
        return _failed("training stopped", err, args.workdir)
    except Exception as err:  # other errors at run time: one line, the traceback in the log
        return _failed("error", err, args.workdir)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: stopped without saving the step in progress; "
            f"{checkpoint_phrase(args.workdir)}",
            file=sys.stderr,
        )
        if hard_abort:
            # The interrupt unwound out of a running XLA call; freeing the frames it left can
            # crash the interpreter (a segfault instead of this exit code), so stop here.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_ABORTED)
        return EXIT_ABORTED
    return EXIT_PREEMPTED if summary["preempted"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
