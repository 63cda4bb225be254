"""``nested-jax launch``: start training on Cloud TPU VMs, on GKE (xpk), or as N local processes.

    nested-jax launch tpu-vm {create,status,install,run,logs,stop,delete} --tpu NAME
                             --project P --zone Z [--dry-run] ...
    nested-jax launch xpk {create,manifest,delete} --cluster C [--dry-run] ...
    nested-jax launch local --processes N --devices-per-process K [--port P] -- train ...

``--dry-run`` prints the exact commands (one per line, shell-quoted) and runs nothing. Bad input
is refused before anything runs, with one line naming the flag (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from nested_jax.launch import local, tpu_vm, xpk
from nested_jax.launch.common import CHECKOUT, TrainJob, execute

RESUME_NOTE = (
    "the workdir is RUNS_ROOT/RUN_NAME, so running the same --run-name again (after a "
    "preemption, `stop` or a crash) resumes from its newest checkpoint; without --config the run "
    "continues with the config saved in its workdir."
)


def _job_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--run-name", required=True, help="names the run, its workdir and its logs")
    p.add_argument(
        "--runs-root",
        required=True,
        help="shared directory of all runs, e.g. gs://my-bucket/runs (the workdir is "
        "RUNS_ROOT/RUN_NAME)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="training preset, relative to the repository root (repeatable)",
    )
    # The same option as `nested-jax train --set`, declared here so the launcher never imports
    # the training code (seconds of JAX imports for a command that only talks to gcloud).
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="passed to nested-jax train --set (repeatable)",
    )
    return p


def _dry_run_option() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def _vm_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, parents=[_dry_run_option()])
    p.add_argument("--tpu", required=True, help="TPU VM node id (also the queued resource id)")
    p.add_argument("--project", default="", help="Google Cloud project")
    p.add_argument("--zone", default="", help="zone of the slice, e.g. us-west4-a")
    return p


def _cluster_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, parents=[_dry_run_option()])
    p.add_argument("--cluster", required=True, help="GKE cluster made by `xpk cluster create`")
    p.add_argument("--project", default="", help="Google Cloud project (default: gcloud's)")
    p.add_argument("--zone", default="", help="zone of the cluster (default: gcloud's)")
    return p


def _workload_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, parents=[_job_options()])
    p.add_argument("--docker-image", required=True, help="image with the project installed")
    p.add_argument("--tpu-type", default="v5litepod-16", help="e.g. v5litepod-16, v5p-32, v6e-8")
    p.add_argument("--num-slices", type=int, default=1)
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart a failed or preempted workload this often (each restart resumes)",
    )
    p.add_argument("--image-dir", default="/app", help="the project's directory in the image")
    return p


# -- what each sub-command builds --------------------------------------------------------------


def _vm(a: argparse.Namespace) -> tpu_vm.TpuVm:
    return tpu_vm.TpuVm(a.tpu, a.project, a.zone)


def _job(a: argparse.Namespace) -> TrainJob:
    return TrainJob(a.run_name, a.runs_root, tuple(a.config), tuple(a.overrides))


def _cluster(a: argparse.Namespace) -> xpk.Cluster:
    return xpk.Cluster(a.cluster, a.project, a.zone)


def _workload(a: argparse.Namespace) -> xpk.Workload:
    return xpk.Workload(a.docker_image, a.tpu_type, a.num_slices, a.max_restarts, a.image_dir)


def _create(a: argparse.Namespace) -> list[list[str]]:
    provisioning = "spot" if a.spot else "best-effort" if a.best_effort else "on-demand"
    request = tpu_vm.SliceRequest(a.accelerator_type, a.runtime_version, provisioning)
    return tpu_vm.create(_vm(a), request)


TPU_VM: dict[str, tuple[str, Callable[[argparse.Namespace], list[list[str]]]]] = {
    "create": ("queue a TPU VM slice (queued resources)", _create),
    "status": ("describe the queued resource (wait for ACTIVE)", lambda a: tpu_vm.status(_vm(a))),
    "install": (
        "copy a git archive of this checkout to every worker and pip install -e .[tpu,gcs] there",
        lambda a: tpu_vm.install(_vm(a), a.source, ref=a.ref, python=a.python),
    ),
    "run": (
        "start training on every worker (--worker=all, NESTED_JAX_DISTRIBUTED=auto, nohup, a log "
        "per worker); " + RESUME_NOTE,
        lambda a: tpu_vm.run(_vm(a), _job(a)),
    ),
    "logs": (
        "stream a worker's training log (Ctrl-C stops streaming, not training)",
        lambda a: tpu_vm.logs(_vm(a), a.run_name, a.worker),
    ),
    "stop": (
        "SIGTERM the run on every worker: all save the same step, then exit (resume with run)",
        lambda a: tpu_vm.stop(_vm(a), a.run_name),
    ),
    "delete": (
        "delete the queued resource and its TPU VM (--force); the workdir stays",
        lambda a: tpu_vm.delete(_vm(a)),
    ),
}
XPK: dict[str, tuple[str, Callable[[argparse.Namespace], list[list[str]]]]] = {
    "create": (
        "xpk workload create running the training on every host; " + RESUME_NOTE,
        lambda a: xpk.create(_cluster(a), _workload(a), _job(a)),
    ),
    "manifest": ("print the equivalent JobSet YAML (for kubectl apply -f -)", None),
    "delete": (
        "xpk workload delete (the workdir stays)",
        lambda a: xpk.delete(_cluster(a), a.run_name),
    ),
}


def _add_tpu_vm(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("tpu-vm", help="Cloud TPU VM slices with gcloud")
    actions = p.add_subparsers(dest="action", required=True)
    for name, (help_, build) in TPU_VM.items():
        parents = [_vm_options()] + ([_job_options()] if name == "run" else [])
        sp = actions.add_parser(name, help=help_, description=help_, parents=parents)
        sp.set_defaults(build=build)
        if name in ("logs", "stop"):
            sp.add_argument("--run-name", required=True)
        if name == "logs":
            sp.add_argument("--worker", default="0", help="worker number, or all")
        if name == "create":
            sp.add_argument("--accelerator-type", default="v5litepod-16")
            sp.add_argument("--runtime-version", default="", help="default: the type's own")
            kind = sp.add_mutually_exclusive_group()
            kind.add_argument("--spot", action="store_true", help="preemptible, cheapest")
            kind.add_argument("--best-effort", action="store_true", help="spare capacity")
        if name == "install":
            sp.add_argument("--source", default=str(CHECKOUT), help="git checkout to copy")
            sp.add_argument("--ref", default="HEAD", help="commit to copy (committed files only)")
            sp.add_argument("--python", default="3.11", help="Python of the workers' venv")


def _add_xpk(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("xpk", help="GKE TPU workloads (xpk, or a JobSet manifest)")
    actions = p.add_subparsers(dest="action", required=True)
    for name, (help_, build) in XPK.items():
        # The manifest goes to whatever cluster kubectl points at: it needs no --cluster (and
        # only prints, with or without --dry-run).
        parents = [_dry_run_option() if name == "manifest" else _cluster_options()]
        parents += [] if name == "delete" else [_workload_options()]
        sp = actions.add_parser(name, help=help_, description=help_, parents=parents)
        sp.set_defaults(build=build)
        if name == "delete":
            sp.add_argument("--run-name", required=True)


def _add_local(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "local",
        help="N local CPU processes over gloo (the multi-host path on one machine)",
        description=" ".join(local.__doc__.split("\n\n")[1:3]),
        usage="nested-jax launch local [--processes N] [--devices-per-process K] [--port P] "
        "[--dry-run] -- train ...",
    )
    p.add_argument("--processes", type=int, default=2, metavar="N", help="default: 2")
    p.add_argument(
        "--devices-per-process", type=int, default=1, metavar="K", help="fake CPU devices each"
    )
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nested-jax launch",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kinds = p.add_subparsers(dest="kind", required=True)
    _add_tpu_vm(kinds)
    _add_xpk(kinds)
    _add_local(kinds)
    return p


def _run_local(args: argparse.Namespace, command: list[str]) -> int:
    launch = local.LocalLaunch(tuple(command), args.processes, args.devices_per_process, args.port)
    if args.dry_run:
        port = launch.port or local.free_port()
        return execute(local.commands(launch, port, os.environ), dry_run=True)
    return local.run_local(launch)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:  # `local ... -- train ...`: what follows is the children's command
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    try:
        if args.kind == "local":
            return _run_local(args, command)
        if args.kind == "xpk" and args.action == "manifest":
            print(xpk.render_manifest(_workload(args), _job(args)), end="")
            return 0
        return execute(args.build(args), dry_run=args.dry_run)
    except ValueError as err:
        print(f"nested-jax launch: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
