"""GKE TPU workloads: an ``xpk workload create`` command and the equivalent JobSet manifest.

Both start the same container command on every TPU host of the slice:
``cd IMAGE_DIR && NESTED_JAX_DISTRIBUTED=auto nested-jax train ... --workdir RUNS_ROOT/RUN``.
The workload is named after the run, and a restarted workload (``--max-restarts``, or the same
command again after a preemption) reaches the same workdir and resumes from its newest checkpoint.
GKE sends SIGTERM to every pod before it evicts them; ``terminationGracePeriodSeconds`` gives the
trainers time to agree on a step and save it.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

import yaml

from nested_jax.launch.common import TrainJob, check_name, check_project, check_zone
from nested_jax.launch.tpu import TpuSlice

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
GRACE_S = 300  # SIGTERM -> SIGKILL: one step plus a checkpoint save of a large model


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The GKE cluster (made with ``xpk cluster create``); `project` / `zone` are optional, as
    xpk falls back to gcloud's configured defaults."""

    name: str
    project: str = ""
    zone: str = ""

    def __post_init__(self) -> None:
        check_name("--cluster", self.name)
        if self.project:
            check_project(self.project)
        if self.zone:
            check_zone(self.zone)

    def args(self) -> list[str]:
        out = ["--cluster", self.name]
        out += ["--project", self.project] if self.project else []
        return out + (["--zone", self.zone] if self.zone else [])


@dataclasses.dataclass(frozen=True)
class Workload:
    """How a run's pods start: the image holding the project (checked out at `image_dir`), the
    TPU type, the slice count, and how often a failed or preempted workload restarts."""

    docker_image: str
    tpu_type: str = "v5litepod-16"
    num_slices: int = 1
    max_restarts: int = 0
    image_dir: str = "/app"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"\S+", self.docker_image or ""):
            raise ValueError(
                f"--docker-image: {self.docker_image!r}: give an image reference, e.g. "
                "us-docker.pkg.dev/my-project/images/nested-jax:latest"
            )
        TpuSlice(self.tpu_type, "--tpu-type")  # raises for an unknown type
        if self.num_slices < 1:
            raise ValueError(f"--num-slices: {self.num_slices} (must be at least 1)")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts: {self.max_restarts} (must be 0 or more)")
        if not self.image_dir.startswith("/"):
            raise ValueError(f"--image-dir: {self.image_dir!r} must be an absolute path")


def container_command(workload: Workload, job: TrainJob) -> str:
    """The shell line every TPU host's container runs (the project's checkout is `image_dir`,
    so relative ``--config`` paths resolve as in the repository)."""
    return f"cd {shlex.quote(workload.image_dir)} && {job.shell()}"


def create(cluster: Cluster, workload: Workload, job: TrainJob) -> list[list[str]]:
    cmd = ["xpk", "workload", "create", *cluster.args(), "--workload", job.run_name]
    cmd += ["--tpu-type", workload.tpu_type, "--num-slices", str(workload.num_slices)]
    cmd += ["--docker-image", workload.docker_image, "--max-restarts", str(workload.max_restarts)]
    return [cmd + ["--command", container_command(workload, job)]]


def delete(cluster: Cluster, run_name: str) -> list[list[str]]:
    """Deletes the workload's pods (its workdir and checkpoints stay where they are)."""
    name = check_name("--run-name", run_name)
    return [["xpk", "workload", "delete", *cluster.args(), "--workload", name]]


def manifest(workload: Workload, job: TrainJob) -> dict:
    """A JobSet running `job` on one TPU slice (``kubectl apply -f``), from the same parameters
    as :func:`create`. Multi-slice needs the DCN set-up xpk does, so it is refused here."""
    if workload.num_slices != 1:
        raise ValueError(
            f"--num-slices: {workload.num_slices}: the plain manifest describes one slice; use "
            "`xpk create` for multi-slice workloads"
        )
    tpu = TpuSlice(workload.tpu_type, "--tpu-type")
    container = {
        "name": "train",
        "image": workload.docker_image,
        "command": ["bash", "-c", container_command(workload, job)],
        "ports": [{"containerPort": 8471}, {"containerPort": 8080}],
        "securityContext": {"privileged": True},
        "resources": {"limits": {"google.com/tpu": tpu.chips_per_host}},
    }
    pod = {
        "metadata": {"labels": {"nested-jax/run": job.run_name}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": GRACE_S,
            "nodeSelector": {
                "cloud.google.com/gke-tpu-accelerator": tpu.family.gke_accelerator,
                "cloud.google.com/gke-tpu-topology": tpu.topology,
            },
            "containers": [container],
        },
    }
    slice_job = {
        "name": "slice",
        "replicas": 1,
        "template": {
            "spec": {
                "parallelism": tpu.hosts,
                "completions": tpu.hosts,
                "backoffLimit": 0,
                "template": pod,
            }
        },
    }
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {
            "name": job.run_name,
            "annotations": {
                "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
            },
        },
        "spec": {
            "failurePolicy": {"maxRestarts": workload.max_restarts},
            "replicatedJobs": [slice_job],
        },
    }


def render_manifest(workload: Workload, job: TrainJob) -> str:
    return yaml.safe_dump(manifest(workload, job), sort_keys=False)
