"""Stopping a run on purpose: SIGTERM (preemption) and Ctrl-C save a checkpoint and stop cleanly.

One process: SIGTERM and the first SIGINT (Ctrl-C) set a flag; the loop finishes the current step,
saves a checkpoint and returns with ``preempted: True`` (``nested-jax train`` exits with
:data:`EXIT_PREEMPTED`). A second Ctrl-C raises ``KeyboardInterrupt`` at once (abort without
saving; the last complete checkpoint stays intact and an interrupted save leaves only a temporary
directory that the next start ignores).

Several processes: orbax's ``reached_preemption(step)`` (the JAX preemption service, fed by
SIGTERM) agrees on the same step on every host; a per-host flag could make hosts stop at different
steps and deadlock the collectives. Ctrl-C keeps Python's default there (``KeyboardInterrupt``).

Before the loop (while jax loads, the config is checked and the steps compile) there is nothing to
save: :func:`install_startup_handler`, set by ``nested-jax train`` before it imports anything
heavy, turns SIGTERM into :class:`StoppedEarly`, which the command reports in one line and exits
with :data:`EXIT_PREEMPTED`. Once the stop checkpoint is being written a further Ctrl-C no longer
aborts: the save finishes and the run stops as saved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

# Exit codes of `nested-jax train` (docs/usage.md, the exit-code table).
EXIT_OK = 0  # finished (or nothing left to do)
EXIT_ERROR = 1  # training or data error (NaN policy stop, exhausted data, unreadable corpus)
EXIT_CONFIG = 2  # bad command line or config, or a resume refused because a setting changed
EXIT_PREEMPTED = 75  # stopped by SIGTERM / Ctrl-C after saving: run the same command to resume
EXIT_ABORTED = 130  # a second Ctrl-C: stopped without saving (the last checkpoint is intact)


class StoppedEarly(BaseException):  # noqa: N818  (a stop request, like KeyboardInterrupt)
    """SIGTERM arrived outside the training steps; ``during_startup``: before they began."""

    def __init__(self, signum: int, during_startup: bool):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.during_startup = during_startup


_loop_started = False  # whether a StopSignal was entered in this process (the steps began)


def _raise_stopped(signum: int, frame: Any) -> None:
    raise StoppedEarly(signum, during_startup=not _loop_started)


def newest_checkpoint(workdir: str) -> int | None:
    """The newest complete checkpoint step in a local `workdir` (None: none, or a URL)."""
    directory = os.path.join(workdir, "checkpoints")
    if "://" in workdir or not os.path.isdir(directory):
        return None
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
    return max(steps) if steps else None


def checkpoint_phrase(workdir: str) -> str:
    """``the newest checkpoint, step N in W, is intact`` or that W has none yet."""
    step = newest_checkpoint(workdir)
    if step is None:
        return f"{workdir} has no checkpoint yet"
    return f"the newest checkpoint, step {step} in {workdir}, is intact"


def report_stopped_early(err: StoppedEarly, workdir: str | None) -> int:
    """Prints the one line of a SIGTERM outside the steps; returns :data:`EXIT_PREEMPTED`."""
    name = signal.Signals(err.signum).name
    when = (
        "during start-up: nothing to save yet"
        if err.during_startup
        else ("after the training steps: nothing left to save")
    )
    where = f" ({checkpoint_phrase(workdir)})" if workdir else ""
    print(f"stopped by {name} {when}{where}; run the same command to resume", file=sys.stderr)
    return EXIT_PREEMPTED


def install_startup_handler() -> Any:
    """Makes SIGTERM raise :class:`StoppedEarly` from now on (the main thread only); returns the
    handler it replaced (None off the main thread), for a caller that restores it.

    In a multi-process run ``jax.distributed.initialize`` later hands SIGTERM to JAX's preemption
    notifier, which replaces this handler; the loop then stops at the agreed step.
    """
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, _raise_stopped)
    return None


class StopSignal:
    """Catches SIGTERM and SIGINT while a run trains (a context manager restoring the handlers)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._shielded = False  # the stop checkpoint is being written: Ctrl-C cannot abort it

    def __enter__(self) -> StopSignal:
        import jax

        global _loop_started
        _loop_started = True
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        import jax

        if self._shielded:
            if jax.process_index() == 0:
                name = signal.Signals(signum).name
                print(f"\n{name}: the checkpoint is being written; stopping once it is", flush=True)
            return
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now
        self.signum = signum
        if signum == signal.SIGINT and jax.process_index() == 0:
            print(
                "\nCtrl-C: finishing this step and saving a checkpoint (Ctrl-C again to abort "
                "without saving)",
                flush=True,
            )

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "preemption"

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """While inside, Ctrl-C and SIGTERM only print a line: the stop checkpoint completes."""
        self._shielded = True
        try:
            yield
        finally:
            self._shielded = False

    def requested(self, manager: Any, step: int) -> bool:
        """Whether to stop after `step` (`manager`: the orbax CheckpointManager, multi-host)."""
        import jax

        if jax.process_count() > 1:
            return bool(manager.reached_preemption(step))
        return self.signum is not None
