"""Cloud TPU VM slices with ``gcloud``: create, install, run, logs, stop, delete.

Each function returns the argv lists to run (``nested_jax.launch.common.execute`` runs or prints
them). On the workers everything lives in the login user's home directory, where
``gcloud ... tpu-vm ssh`` starts::

    ~/nested-jax/             the project (unpacked from a git archive of the local checkout)
    ~/nested-jax-venv/        its venv (Python 3.11 by uv; `pip install -e .[tpu,gcs]`)
    ~/nested-jax-logs/RUN.log the output of run RUN on that worker (appended across restarts)
    ~/nested-jax-logs/RUN.pid the pid of its `nested-jax train` process (for stop)

Training runs under ``nohup`` with its output in the log, so the ssh session may end (or drop)
without touching the run. The same run name always means the same workdir, so ``run`` after a
preemption, ``stop`` or crash resumes from the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import shlex
import tempfile
from pathlib import Path

from nested_jax.launch.common import TrainJob, check_name, check_project, check_zone
from nested_jax.launch.tpu import TpuSlice

REMOTE_SRC = "nested-jax"
REMOTE_VENV = "nested-jax-venv"
REMOTE_LOGS = "nested-jax-logs"
REMOTE_ARCHIVE = "nested-jax.tar.gz"
PROVISIONING = ("on-demand", "spot", "best-effort")


@dataclasses.dataclass(frozen=True)
class TpuVm:
    """A TPU VM slice: its node id (also the queued resource id), project and zone."""

    name: str
    project: str
    zone: str

    def __post_init__(self) -> None:
        check_name("--tpu", self.name)
        check_project(self.project)
        check_zone(self.zone)

    def where(self) -> list[str]:
        return ["--project", self.project, "--zone", self.zone]


@dataclasses.dataclass(frozen=True)
class SliceRequest:
    """What ``create`` asks for: the accelerator type, its runtime, and how it is provisioned.

    ``runtime_version`` defaults to the one of the chip generation (a mismatched runtime gives a
    VM whose libtpu cannot open the chips); ``spot`` is cheapest and preemptible (SIGTERM, then
    the run resumes on the next ``run``), ``best-effort`` uses spare capacity.
    """

    accelerator_type: str = "v5litepod-16"
    runtime_version: str = ""
    provisioning: str = "on-demand"

    def __post_init__(self) -> None:
        TpuSlice(self.accelerator_type)  # raises for an unknown type
        if self.provisioning not in PROVISIONING:
            raise ValueError(f"provisioning: {self.provisioning!r} is not one of {PROVISIONING}")

    @property
    def runtime(self) -> str:
        return self.runtime_version or TpuSlice(self.accelerator_type).family.runtime_version


def _tpus(*args: str) -> list[str]:
    return ["gcloud", "compute", "tpus", *args]


def ssh(vm: TpuVm, worker: str, remote: str) -> list[str]:
    """``gcloud ... tpu-vm ssh`` running the shell line `remote` on `worker` (a number or all)."""
    if worker != "all" and not worker.isdigit():
        raise ValueError(f"--worker: {worker!r} is neither a worker number nor 'all'")
    return _tpus("tpu-vm", "ssh", vm.name, *vm.where(), f"--worker={worker}", "--command", remote)


def create(vm: TpuVm, request: SliceRequest) -> list[list[str]]:
    """Queues the slice; it becomes usable when ``status`` shows ACTIVE (queued resources wait
    for capacity instead of failing the way a plain ``tpu-vm create`` does)."""
    cmd = _tpus("queued-resources", "create", vm.name, "--node-id", vm.name, *vm.where())
    cmd += ["--accelerator-type", request.accelerator_type]
    cmd += ["--runtime-version", request.runtime]
    if request.provisioning != "on-demand":
        cmd.append(f"--{request.provisioning}")
    return [cmd]


def status(vm: TpuVm) -> list[list[str]]:
    return [_tpus("queued-resources", "describe", vm.name, *vm.where())]


def delete(vm: TpuVm) -> list[list[str]]:
    """Deletes the queued resource and (``--force``) the TPU VM with it: billing stops."""
    return [_tpus("queued-resources", "delete", vm.name, *vm.where(), "--force")]


def default_archive(vm: TpuVm) -> str:
    return str(Path(tempfile.gettempdir()) / f"nested-jax-{vm.name}.tar.gz")


def install_script(python: str) -> str:
    """The shell line that replaces the project on a worker with the uploaded archive and
    installs it (TPU VM images ship Python 3.10; the project needs 3.11, which uv provides)."""
    new = f"{REMOTE_SRC}.new"
    uv, venv_python = "python3 -m uv", f"{REMOTE_VENV}/bin/python"
    editable = shlex.quote(f"./{REMOTE_SRC}[tpu,gcs]")  # gcs: gs:// workdirs
    steps = [
        "set -e",
        f"rm -rf {new}",
        f"mkdir {new}",
        f"tar -xzf {REMOTE_ARCHIVE} -C {new}",
        f"rm -rf {REMOTE_SRC}",
        f"mv {new} {REMOTE_SRC}",
        "python3 -m pip install --user -q uv",
        f"test -x {venv_python} || {uv} venv --python {shlex.quote(python)} {REMOTE_VENV}",
        f"{uv} pip install --python {venv_python} -q -e {editable}",
        'echo "installed on $(hostname)"',
    ]
    return "; ".join(steps)


def install(
    vm: TpuVm, source: str, *, ref: str = "HEAD", archive: str = "", python: str = "3.11"
) -> list[list[str]]:
    """Packs commit `ref` of the checkout at `source` (``git archive``: only committed files, so
    every worker gets exactly that commit), copies it to every worker and installs it there."""
    archive = archive or default_archive(vm)
    return [
        ["git", "-C", source, "archive", "--format=tar.gz", "--output", archive, ref],
        _tpus("tpu-vm", "scp", archive, f"{vm.name}:{REMOTE_ARCHIVE}", *vm.where(), "--worker=all"),
        ssh(vm, "all", install_script(python)),
    ]


def _log(run_name: str, ext: str) -> str:
    return f"{REMOTE_LOGS}/{check_name('--run-name', run_name)}.{ext}"


def run_script(job: TrainJob) -> str:
    """The shell line that starts `job` in the background on one worker (refused while the same
    run is still running there: two trainers on one slice cannot both own the chips)."""
    log, pid = f"../{_log(job.run_name, 'log')}", f"../{_log(job.run_name, 'pid')}"
    train = job.shell("nohup", f"../{REMOTE_VENV}/bin/nested-jax")
    return "; ".join(
        [
            f"mkdir -p {REMOTE_LOGS}",
            f'if kill -0 "$(cat {_log(job.run_name, "pid")} 2>/dev/null)" 2>/dev/null; then '
            f'echo "{job.run_name} is already running on $(hostname)" >&2; exit 1; fi',
            f"cd {REMOTE_SRC} || exit 1",
            f"{train} >> {log} 2>&1 < /dev/null & echo $! > {pid}",
            f'echo "{job.run_name} started on $(hostname): log ~/{_log(job.run_name, "log")}"',
        ]
    )


def run(vm: TpuVm, job: TrainJob) -> list[list[str]]:
    """Starts `job` on every worker at once (``--worker=all``), each with
    ``NESTED_JAX_DISTRIBUTED=auto`` so JAX finds the other workers of the slice."""
    return [ssh(vm, "all", run_script(job))]


def logs(vm: TpuVm, run_name: str, worker: str = "0") -> list[list[str]]:
    """Streams a worker's log from its start (Ctrl-C stops streaming, not training)."""
    return [ssh(vm, worker, f"tail -n +1 -F {_log(run_name, 'log')}")]


def stop_script(run_name: str) -> str:
    """SIGTERM to the run's trainer on one worker, then wait for it to exit (it saves first)."""
    pid = _log(run_name, "pid")
    return "; ".join(
        [
            f'p=$(cat {pid} 2>/dev/null) && kill -0 "$p" 2>/dev/null || '
            f'{{ echo "{run_name} is not running on $(hostname)"; exit 0; }}',
            'kill -TERM "$p"',
            'while kill -0 "$p" 2>/dev/null; do sleep 2; done',
            f'grep "preempted at step" {_log(run_name, "log")} | tail -n 1',  # worker 0 prints it
        ]
    )


def stop(vm: TpuVm, run_name: str) -> list[list[str]]:
    """Stops the run like a preemption: SIGTERM on every worker; the JAX preemption service
    makes all of them save the same step, then they exit (run it again to resume)."""
    return [ssh(vm, "all", stop_script(run_name))]
