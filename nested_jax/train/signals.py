"""Stopping a run on purpose: SIGTERM (preemption) and Ctrl-C save a checkpoint and stop cleanly.

One process: SIGTERM and the first SIGINT (Ctrl-C) set a flag; the loop finishes the current step,
saves a checkpoint and returns with ``preempted: True`` (``nested-jax train`` exits with
:data:`EXIT_PREEMPTED`). A second Ctrl-C raises ``KeyboardInterrupt`` at once (abort without
saving; the last complete checkpoint stays intact and an interrupted save leaves only a temporary
directory that the next start ignores).

Several processes: orbax's ``reached_preemption(step)`` (the JAX preemption service, fed by
SIGTERM) agrees on the same step on every host; a per-host flag could make hosts stop at different
steps and deadlock the collectives. Ctrl-C keeps Python's default there (``KeyboardInterrupt``).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax

# Exit codes of `nested-jax train` (README "Exit codes").
EXIT_OK = 0  # finished (or nothing left to do)
EXIT_ERROR = 1  # training or data error (NaN policy stop, exhausted data, unreadable corpus)
EXIT_CONFIG = 2  # bad command line or config, or a resume refused because a setting changed
EXIT_PREEMPTED = 75  # stopped by SIGTERM / Ctrl-C after saving: run the same command to resume
EXIT_ABORTED = 130  # a second Ctrl-C: stopped without saving (the last checkpoint is intact)


class StopSignal:
    """Catches SIGTERM and SIGINT while a run trains (a context manager restoring the handlers)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
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

    def requested(self, manager: Any, step: int) -> bool:
        """Whether to stop after `step` (`manager`: the orbax CheckpointManager, multi-host)."""
        if jax.process_count() > 1:
            return bool(manager.reached_preemption(step))
        return self.signum is not None
