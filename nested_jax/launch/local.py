"""N ``nested-jax`` processes on this machine, talking over gloo on 127.0.0.1.

The multi-host code path (``jax.distributed``, per-process data shards, orbax's multi-process
checkpoints, the preemption service) without a pod: process i gets
``NESTED_JAX_COORDINATOR=127.0.0.1:PORT``, ``NESTED_JAX_NUM_PROCESSES=N``,
``NESTED_JAX_PROCESS_ID=i`` and K fake CPU devices, and runs the command after ``--``.

Stopping: the launcher's first SIGTERM or Ctrl-C reaches every process as SIGTERM, which the JAX
preemption service turns into one agreed step that every process saves (exit 75, run the same
command to resume); a second Ctrl-C reaches them as SIGINT (abort without saving, like a second
Ctrl-C of ``nested-jax train``). A SIGTERM sent to a single process (``kill -TERM PID`` with a
pid the launcher prints) stops all of them the same way: that is how a pod's preemption notice
reaches one host. When a process fails, the others are sent SIGTERM (they could wait forever in a
collective with a missing peer) and killed if still alive after a grace period.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from nested_jax.launch.common import CHECKOUT

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
GRACE_S = 30.0  # after the first failure: how long the other processes get to exit


@dataclasses.dataclass(frozen=True)
class LocalLaunch:
    """`processes` copies of ``python -m nested_jax.cli ARGV``, `devices_per_process` CPU devices
    each; `port` 0 picks a free port when the processes start."""

    argv: tuple[str, ...]
    processes: int = 2
    devices_per_process: int = 1
    port: int = 0
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ValueError(f"--processes: {self.processes} (must be at least 1)")
        if self.devices_per_process < 1:
            raise ValueError(
                f"--devices-per-process: {self.devices_per_process} (must be at least 1)"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port: {self.port} is not a TCP port (0 picks a free one)")
        if not self.argv:
            raise ValueError(
                "command: give the nested-jax command after `--`, e.g. "
                "-- train --config FILE --workdir DIR"
            )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def xla_flags(existing: str, devices: int) -> str:
    """`existing` XLA flags with the fake CPU device count set to `devices` (others kept)."""
    kept = [f for f in existing.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])


def child_env_updates(
    launch: LocalLaunch, index: int, port: int, base: Mapping[str, str]
) -> dict[str, str]:
    """The variables process `index` gets on top of `base` (the launcher's environment).

    One process runs without the coordinator variables: a plain single-process run, the
    reference the multi-process runs must match.
    """
    updates = {}
    if launch.processes > 1:
        updates.update(
            NESTED_JAX_COORDINATOR=f"{launch.host}:{port}",
            NESTED_JAX_NUM_PROCESSES=str(launch.processes),
            NESTED_JAX_PROCESS_ID=str(index),
        )
    path = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(CHECKOUT)]
    updates.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_flags(base.get("XLA_FLAGS", ""), launch.devices_per_process),
        PYTHONPATH=os.pathsep.join([str(CHECKOUT), *path]),  # this checkout's nested_jax
        PYTHONUNBUFFERED="1",  # lines reach the prefixing reader as they are printed
    )
    return updates


def child_command(argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "nested_jax.cli", *argv]


def commands(launch: LocalLaunch, port: int, base: Mapping[str, str]) -> list[list[str]]:
    """Each process as one ``env VAR=... python -m nested_jax.cli ...`` argv (for --dry-run)."""
    out = []
    for i in range(launch.processes):
        env = [f"{k}={v}" for k, v in child_env_updates(launch, i, port, base).items()]
        out.append(["env", *env, *child_command(launch.argv)])
    return out


def exit_code(returncode: int) -> int:
    """A child's status as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM (saves, then exits) if the launcher dies without a word."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pump(proc: subprocess.Popen, prefix: str, out: TextIO, lock: threading.RLock) -> None:
    for line in proc.stdout:
        with lock:
            out.write(prefix + line)
            out.flush()


class _Children:
    """The running processes: signal forwarding and the first-failure rule."""

    def __init__(self, out: TextIO) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []  # one output reader per process
        self.stops = 0
        self.out = out
        self.lock = threading.RLock()  # the signal handler may print while main holds it

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(f"[launch] {text}\n")
            self.out.flush()

    def send(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def on_signal(self, signum: int, frame: Any) -> None:
        self.stops += 1
        first = self.stops == 1 or signum == signal.SIGTERM
        forward = signal.SIGTERM if first else signal.SIGINT
        self.say(
            f"{signal.Signals(signum).name}: sending {forward.name} to every process"
            + (" (each saves the same step)" if first else " (abort without saving)")
        )
        self.send(forward)

    def wait(self, grace_s: float, preempted_code: int) -> int:
        """Waits for every process; returns the first non-zero exit code (0 if none)."""
        first, deadline, done = 0, None, set()
        while len(done) < len(self.procs):
            for i, p in enumerate(self.procs):
                if i in done or p.poll() is None:
                    continue
                done.add(i)
                self.pumps[i].join(timeout=2)  # its last lines first, then the exit code
                code = exit_code(p.returncode)
                self.say(f"p{i} exited with code {code}")
                if code == 0 or first:
                    continue
                first, deadline = code, time.monotonic() + grace_s
                if code != preempted_code and len(done) < len(self.procs):
                    self.say("stopping the other processes")
                    self.send(signal.SIGTERM)
            if deadline is not None and time.monotonic() > deadline:
                self.send(signal.SIGKILL)
            time.sleep(0.05)
        return first


def run_local(
    launch: LocalLaunch,
    *,
    out: TextIO | None = None,
    base_env: Mapping[str, str] | None = None,
    grace_s: float = GRACE_S,
) -> int:
    """Runs the processes to the end, their output prefixed ``[p0]``, ``[p1]``, ...; returns the
    first non-zero exit code, or 0 when every process succeeded."""
    from nested_jax.train.signals import EXIT_PREEMPTED  # the trainer's "saved, resume me" code

    out = out or sys.stdout
    base = dict(os.environ if base_env is None else base_env)
    port = launch.port or free_port(launch.host)
    children = _Children(out)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, children.on_signal)
    coordinator = f", coordinator {launch.host}:{port}" if launch.processes > 1 else ""
    children.say(
        f"{launch.processes} process(es) x {launch.devices_per_process} CPU device(s){coordinator}"
    )
    try:
        for i in range(launch.processes):
            env = {**base, **child_env_updates(launch, i, port, base)}
            proc = subprocess.Popen(
                child_command(launch.argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it.
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
            children.procs.append(proc)
            children.say(f"p{i} pid {proc.pid}: {shlex.join(child_command(launch.argv))}")
        for i, proc in enumerate(children.procs):
            t = threading.Thread(target=_pump, args=(proc, f"[p{i}] ", out, children.lock))
            t.start()
            children.pumps.append(t)
        code = children.wait(grace_s, EXIT_PREEMPTED)
    finally:
        children.send(signal.SIGKILL)  # only if the launcher itself failed mid-way
        for t in children.pumps:
            t.join(timeout=5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    children.say(f"done: exit code {code}")
    return code
