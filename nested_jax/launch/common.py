"""What every launcher shares: name rules, the training job of a run, and the command runner.

A run is identified by its ``run_name`` alone: the workdir is ``<runs_root>/<run_name>``, so
launching the same run_name again reaches the same checkpoints and ``nested-jax train`` resumes
from the newest one instead of starting over (``nested_jax.train.workdir``).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

CHECKOUT = Path(__file__).resolve().parents[2]  # the project checkout holding nested_jax

# The names gcloud (TPU nodes, queued resources) and Kubernetes (JobSets, xpk workloads) accept:
# lowercase letters, digits and hyphens, a letter first, no hyphen last, at most 63 characters.
NAME_RE = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
NAME_RULE = "1-63 lowercase letters, digits and hyphens, starting with a letter, not ending in '-'"

# The environment that makes `nested-jax train` call jax.distributed.initialize() with JAX's own
# cluster detection (TPU VM workers, GKE TPU pods): nested_jax.parallel.distributed.
DISTRIBUTED_ENV = "NESTED_JAX_DISTRIBUTED=auto"


def check_name(flag: str, value: str) -> str:
    """`value` if gcloud / Kubernetes accept it as a resource name; else ValueError naming `flag`.

    Checked here because gcloud refuses such names only after minutes of queueing, or (for a
    run name) the bad name would only fail when the workdir path is used.
    """
    if not NAME_RE.fullmatch(value or ""):
        raise ValueError(f"{flag}: {value!r} is not a valid name (use {NAME_RULE})")
    return value


def check_pattern(flag: str, value: str, pattern: str, example: str) -> str:
    """`value` if it matches `pattern` in full; else ValueError naming `flag` (and if missing)."""
    if not value:
        raise ValueError(f"{flag}: required (e.g. {flag} {example})")
    if not re.fullmatch(pattern, value):
        raise ValueError(f"{flag}: {value!r} does not look like one (e.g. {flag} {example})")
    return value


def check_project(value: str) -> str:
    """A Google Cloud project id (``--project``), e.g. ``my-project``."""
    pattern = r"(?:[a-z0-9.-]+:)?[a-z][-a-z0-9]{4,28}[a-z0-9]"  # optional "domain:" prefix
    return check_pattern("--project", value, pattern, "my-project")


def check_zone(value: str) -> str:
    """A Google Cloud zone (``--zone``), e.g. ``us-west4-a``."""
    return check_pattern("--zone", value, r"[a-z]+-[a-z]+[0-9]+-[a-z]", "us-west4-a")


def check_runs_root(flag: str, value: str) -> str:
    """A directory every worker shares: ``gs://BUCKET[/...]`` or an absolute path (a mount).

    A relative path would resolve on each worker's own disk: the processes of one run would
    write their checkpoint shards to different places and never find a complete checkpoint.
    """
    if re.fullmatch(r"gs://[^/\s]+(/\S*)?", value or "") or value.startswith("/"):
        return value
    raise ValueError(
        f"{flag}: {value!r} must be gs://BUCKET/... or an absolute path that every worker shares"
    )


def check_overrides(overrides: Sequence[str]) -> None:
    """Each ``--set`` value is ``KEY=VALUE`` (the trainer's own check would come only remotely)."""
    for text in overrides:
        key = text.split("=", 1)[0]
        if "=" not in text or not key or " " in key:
            raise ValueError(f"--set {text}: expected KEY=VALUE (e.g. --set train.steps=100)")


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """One training run: its name, where its workdir lives, and the `nested-jax train` settings.

    Without `configs` the command continues the run already saved in the workdir with its own
    config (``nested-jax train --workdir W``); with them a new run starts, or an existing one
    resumes when the settings agree with its checkpoints.
    """

    run_name: str
    runs_root: str
    configs: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_name("--run-name", self.run_name)
        check_runs_root("--runs-root", self.runs_root)
        check_overrides(self.overrides)

    @property
    def workdir(self) -> str:
        return f"{self.runs_root.rstrip('/')}/{self.run_name}"

    def train_argv(self) -> list[str]:
        """The ``train ...`` arguments of ``nested-jax`` (or ``python -m nested_jax.cli``)."""
        argv = ["train"]
        for path in self.configs:
            argv += ["--config", path]
        argv += ["--workdir", self.workdir]
        for text in self.overrides:
            argv += ["--set", text]
        return argv

    def shell(self, *program: str) -> str:
        """The multi-host training command as one shell line (for ssh / containers); `program`
        is how ``nested-jax`` is called there (default: ``nested-jax`` on the PATH)."""
        argv = [*(program or ("nested-jax",)), *self.train_argv()]
        return f"{DISTRIBUTED_ENV} {shlex.join(argv)}"


def execute(
    commands: Sequence[Sequence[str]], *, dry_run: bool, stream: TextIO | None = None
) -> int:
    """Runs `commands` in order, stopping at the first failure; returns its exit code (0 if none).

    With `dry_run` each command is printed (``shlex.join``: pasting the line into a shell runs
    exactly that argv) and nothing runs. Otherwise each line is echoed with ``+ `` on stderr
    first, so a log shows what ran.
    """
    stream = stream or sys.stdout
    for cmd in commands:
        line = shlex.join(cmd)
        if dry_run:
            print(line, file=stream, flush=True)
            continue
        print(f"+ {line}", file=sys.stderr, flush=True)
        try:
            code = subprocess.run(list(cmd)).returncode
        except FileNotFoundError:
            print(f"launch: {cmd[0]}: not found on PATH", file=sys.stderr)
            return 127
        if code != 0:
            print(f"launch: stopped: {cmd[0]} exited with code {code}", file=sys.stderr)
            return code
    return 0
