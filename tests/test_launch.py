"""`nested-jax launch`: the exact cloud commands (dry runs), the manifest, input checks, and the
local launcher (fake children for its mechanics; real 2-process training in the slow tests)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from nested_jax import cli
from nested_jax.launch import local, tpu_vm
from nested_jax.launch.common import TrainJob, execute
from nested_jax.launch.tpu import TpuSlice

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
from train_helpers import (  # noqa: E402
    defaults_preset,
    subprocess_env,
    tiny_overrides,
    write_corpus,
)

from nested_jax.train.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VM = ["--tpu", "my-tpu", "--project", "my-project", "--zone", "us-west4-a"]
WHERE = "--project my-project --zone us-west4-a"
JOB = ["--run-name", "exp1", "--runs-root", "gs://my-bucket/runs"]
CONFIG = ["--config", "configs/experiments/pod_gdn_125m.yaml", "--set", "train.steps=100"]


def with_dry_run(argv: list[str] | tuple[str, ...]) -> list[str]:
    """`argv` + ``--dry-run``, placed before a ``--`` (what follows it is the children's)."""
    argv = list(argv)
    argv.insert(argv.index("--") if "--" in argv else len(argv), "--dry-run")
    return argv


def dry(capsys, *argv: str) -> list[str]:
    """The lines `nested-jax launch ARGV --dry-run` prints (exit code 0 asserted)."""
    assert cli.main(["launch", *with_dry_run(argv)]) == 0
    return capsys.readouterr().out.splitlines()


def remote(line: str) -> str:
    """The shell line an ssh dry-run line runs on the workers."""
    argv = shlex.split(line)
    return argv[argv.index("--command") + 1]


# -- Cloud TPU VMs -----------------------------------------------------------------------------


def test_create_queues_the_slice_with_its_runtime(capsys):
    assert dry(capsys, "tpu-vm", "create", *VM, "--spot") == [
        "gcloud compute tpus queued-resources create my-tpu --node-id my-tpu "
        f"{WHERE} --accelerator-type v5litepod-16 --runtime-version v2-alpha-tpuv5-lite --spot"
    ]
    (line,) = dry(capsys, "tpu-vm", "create", *VM, "--accelerator-type", "v6e-8", "--best-effort")
    assert line.endswith("--accelerator-type v6e-8 --runtime-version v2-alpha-tpuv6e --best-effort")
    (line,) = dry(capsys, "tpu-vm", "create", *VM, "--runtime-version", "v2-alpha-tpuv5-lite-x")
    assert line.endswith("--runtime-version v2-alpha-tpuv5-lite-x")  # an explicit one wins


@pytest.mark.parametrize(
    "accelerator, runtime",
    [
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5p-8", "v2-alpha-tpuv5"),
        ("v6e-16", "v2-alpha-tpuv6e"),
        ("v4-32", "tpu-ubuntu2204-base"),
    ],
)
def test_runtime_version_follows_the_chip_generation(accelerator, runtime):
    assert tpu_vm.SliceRequest(accelerator).runtime == runtime


def test_status_and_delete(capsys):
    assert dry(capsys, "tpu-vm", "status", *VM) == [
        f"gcloud compute tpus queued-resources describe my-tpu {WHERE}"
    ]
    assert dry(capsys, "tpu-vm", "delete", *VM) == [
        f"gcloud compute tpus queued-resources delete my-tpu {WHERE} --force"
    ]


def test_install_copies_a_git_archive_to_every_worker(capsys):
    archive = tpu_vm.default_archive(tpu_vm.TpuVm("my-tpu", "my-project", "us-west4-a"))
    lines = dry(capsys, "tpu-vm", "install", *VM, "--ref", "v1.0")
    assert lines[:2] == [
        f"git -C {shlex.quote(str(ROOT))} archive --format=tar.gz --output {archive} v1.0",
        f"gcloud compute tpus tpu-vm scp {archive} my-tpu:nested-jax.tar.gz {WHERE} --worker=all",
    ]
    assert lines[2].startswith(f"gcloud compute tpus tpu-vm ssh my-tpu {WHERE} --worker=all ")
    script = remote(lines[2])
    assert "tar -xzf nested-jax.tar.gz" in script
    assert "uv venv --python 3.11 nested-jax-venv" in script
    assert "pip install --python nested-jax-venv/bin/python -q -e './nested-jax[tpu,gcs]'" in script


def test_run_trains_on_every_worker_in_the_run_workdir(capsys):
    (line,) = dry(capsys, "tpu-vm", "run", *VM, *JOB, *CONFIG)
    assert line.startswith(f"gcloud compute tpus tpu-vm ssh my-tpu {WHERE} --worker=all --command ")
    script = remote(line)
    train = (
        "NESTED_JAX_DISTRIBUTED=auto nohup ../nested-jax-venv/bin/nested-jax train "
        "--config configs/experiments/pod_gdn_125m.yaml --workdir gs://my-bucket/runs/exp1 "
        "--set train.steps=100 >> ../nested-jax-logs/exp1.log 2>&1 < /dev/null & "
        "echo $! > ../nested-jax-logs/exp1.pid"
    )
    assert train in script
    assert "already running" in script  # a second trainer on the same chips is refused
    # Resume: the same run name gives the same command, hence the same workdir and checkpoints.
    assert dry(capsys, "tpu-vm", "run", *VM, *JOB, *CONFIG) == [line]
    (cont,) = dry(capsys, "tpu-vm", "run", *VM, *JOB)  # no --config: continue the saved run
    assert "nested-jax train --workdir gs://my-bucket/runs/exp1 >>" in remote(cont)


def test_logs_and_stop(capsys):
    assert dry(capsys, "tpu-vm", "logs", *VM, "--run-name", "exp1") == [
        f"gcloud compute tpus tpu-vm ssh my-tpu {WHERE} --worker=0 "
        "--command 'tail -n +1 -F nested-jax-logs/exp1.log'"
    ]
    (line,) = dry(capsys, "tpu-vm", "logs", *VM, "--run-name", "exp1", "--worker", "3")
    assert " --worker=3 " in line
    (line,) = dry(capsys, "tpu-vm", "stop", *VM, "--run-name", "exp1")
    assert " --worker=all " in line
    script = remote(line)
    assert "p=$(cat nested-jax-logs/exp1.pid" in script and 'kill -TERM "$p"' in script
    assert 'while kill -0 "$p"' in script  # waits until the checkpoint is saved


def test_remote_scripts_are_valid_shell():
    job = TrainJob("exp1", "gs://b/runs", ("c.yaml",), ("a.b=x y",))
    for script in (tpu_vm.install_script("3.11"), tpu_vm.run_script(job), tpu_vm.stop_script("r")):
        result = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
        assert result.returncode == 0, (script, result.stderr)
    assert "--set 'a.b=x y'" in tpu_vm.run_script(job)  # quoted once for the remote shell


# -- GKE (xpk, JobSet) -------------------------------------------------------------------------

CLUSTER = ["--cluster", "tpu-cluster", "--project", "my-project", "--zone", "us-west4-a"]
IMAGE = ["--docker-image", "us-docker.pkg.dev/p/images/nested-jax:1", "--tpu-type", "v5litepod-16"]
TRAIN_LINE = (
    "cd /app && NESTED_JAX_DISTRIBUTED=auto nested-jax train --config "
    "configs/experiments/pod_gdn_125m.yaml --workdir gs://my-bucket/runs/exp1 --set train.steps=100"
)


def test_xpk_create_and_delete(capsys):
    assert dry(capsys, "xpk", "create", *CLUSTER, *IMAGE, *JOB, *CONFIG, "--max-restarts", "3") == [
        f"xpk workload create --cluster tpu-cluster {WHERE} --workload exp1 "
        "--tpu-type v5litepod-16 --num-slices 1 --docker-image "
        "us-docker.pkg.dev/p/images/nested-jax:1 --max-restarts 3 --command "
        + shlex.quote(TRAIN_LINE)
    ]
    assert dry(capsys, "xpk", "delete", *CLUSTER, "--run-name", "exp1") == [
        f"xpk workload delete --cluster tpu-cluster {WHERE} --workload exp1"
    ]


def test_manifest_is_a_jobset_on_the_tpu_nodes(capsys):
    assert cli.main(["launch", "xpk", "manifest", *IMAGE, *JOB, *CONFIG]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "JobSet" and doc["metadata"]["name"] == "exp1"
    (job,) = doc["spec"]["replicatedJobs"]
    assert job["template"]["spec"]["parallelism"] == job["template"]["spec"]["completions"] == 4
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    assert container["command"] == ["bash", "-c", TRAIN_LINE]  # the same line as xpk create
    assert pod["terminationGracePeriodSeconds"] >= 60  # time to save after SIGTERM


@pytest.mark.parametrize(
    "accelerator, chips, hosts, topology",
    [
        ("v5litepod-1", 1, 1, "1x1"),
        ("v5litepod-8", 8, 1, "2x4"),
        ("v5litepod-16", 16, 4, "4x4"),
        ("v6e-256", 256, 64, "16x16"),
        ("v4-8", 4, 1, "2x2x1"),
        ("v4-16", 8, 2, "2x2x2"),
        ("v5p-64", 32, 8, "2x4x4"),
        ("v5p-128", 64, 16, "4x4x4"),
    ],
)
def test_slice_shapes(accelerator, chips, hosts, topology):
    s = TpuSlice(accelerator)
    assert (s.chips, s.hosts, s.topology) == (chips, hosts, topology)


# -- bad input: one line naming the flag, before anything runs ----------------------------------


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["tpu-vm", "create", *VM, "--accelerator-type", "v5e-16"], "--accelerator-type"),
        (["tpu-vm", "create", *VM, "--accelerator-type", "v5litepod-12"], "--accelerator-type"),
        (["tpu-vm", "create", "--tpu", "my-tpu", "--zone", "us-west4-a"], "--project"),
        (["tpu-vm", "create", "--tpu", "my-tpu", "--project", "my-project"], "--zone"),
        (["tpu-vm", "delete", *VM[:4], "--zone", "west"], "--zone"),
        (["tpu-vm", "delete", "--tpu", "My_TPU", *VM[2:]], "--tpu"),
        (["tpu-vm", "run", *VM, "--run-name", "Run_1", "--runs-root", "gs://b/r"], "--run-name"),
        (["tpu-vm", "run", *VM, "--run-name", "r", "--runs-root", "runs"], "--runs-root"),
        (["tpu-vm", "run", *VM, *JOB, "--set", "train.steps"], "--set"),
        (["tpu-vm", "logs", *VM, "--run-name", "r", "--worker", "first"], "--worker"),
        (["xpk", "create", *CLUSTER, *IMAGE[:2], "--tpu-type", "v7-8", *JOB], "--tpu-type"),
        (["xpk", "manifest", *IMAGE, *JOB, "--num-slices", "2"], "--num-slices"),
        (["xpk", "delete", "--cluster", "tpu_cluster", "--run-name", "r"], "--cluster"),
        (["local", "--processes", "0", "--", "train"], "--processes"),
        (["local", "--processes", "2"], "command"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(capsys, argv, flag):
    assert cli.main(["launch", *with_dry_run(argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nested-jax launch: error: {flag}") and "\n" not in err


def test_functions_raise_value_error_naming_the_flag():
    with pytest.raises(ValueError, match="^--accelerator-type: unknown TPU type 'tpu-16'"):
        TpuSlice("tpu-16")
    with pytest.raises(ValueError, match="^--project: required"):
        tpu_vm.TpuVm("my-tpu", "", "us-west4-a")
    with pytest.raises(ValueError, match="^--run-name: 'a.b' is not a valid name"):
        TrainJob("a.b", "gs://b/runs")


# -- dry runs never run anything; real runs run exactly what dry runs print ---------------------


def test_dry_run_never_executes(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a dry run executed {args}")

    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)
    monkeypatch.setattr(os, "system", refuse)
    for argv in (
        ["tpu-vm", "create", *VM],
        ["tpu-vm", "status", *VM],
        ["tpu-vm", "install", *VM],
        ["tpu-vm", "run", *VM, *JOB],
        ["tpu-vm", "logs", *VM, "--run-name", "exp1"],
        ["tpu-vm", "stop", *VM, "--run-name", "exp1"],
        ["tpu-vm", "delete", *VM],
        ["xpk", "create", *CLUSTER, *IMAGE, *JOB],
        ["xpk", "delete", *CLUSTER, "--run-name", "exp1"],
        ["local", "--processes", "2", "--", "train", "--workdir", "w"],
    ):
        assert dry(capsys, *argv), argv


def test_execute_runs_the_printed_commands_and_stops_at_a_failure(monkeypatch, capsys):
    ran = []

    def fake_run(cmd, **kwargs):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if len(ran) == 1 else 7)

    monkeypatch.setattr(subprocess, "run", fake_run)
    cmds = [["echo", "a b"], ["false"], ["never"]]
    assert execute(cmds, dry_run=False) == 7
    assert ran == cmds[:2]
    err = capsys.readouterr().err
    assert "+ echo 'a b'" in err and "false exited with code 7" in err


def test_launch_is_a_cli_command_and_the_wrappers_reach_it(capsys):
    assert "launch" in cli.COMMANDS
    for kind, argv in (
        ("tpu_vm", ["delete", *VM]),
        ("xpk", ["delete", *CLUSTER, "--run-name", "exp1"]),
        ("local", ["--port", "1234", "--", "train", "--workdir", "w"]),
    ):
        wrapper = ROOT / "launch" / kind
        assert os.access(wrapper, os.X_OK), wrapper
        out = subprocess.run(
            [str(wrapper), *with_dry_run(argv)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()


# -- the local launcher: environment and mechanics ----------------------------------------------


def test_local_children_get_the_multi_process_environment(capsys):
    launch = local.LocalLaunch(("train", "--workdir", "w"), 2, 2, port=1234)
    base = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"}
    env = local.child_env_updates(launch, 1, 1234, base)
    assert env["NESTED_JAX_COORDINATOR"] == "127.0.0.1:1234"
    assert (env["NESTED_JAX_NUM_PROCESSES"], env["NESTED_JAX_PROCESS_ID"]) == ("2", "1")
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    single = local.child_env_updates(local.LocalLaunch(("train",), 1, 4), 0, 1, {})
    assert "NESTED_JAX_COORDINATOR" not in single  # one process: a plain run
    lines = dry(capsys, "local", "--processes", "2", "--port", "1234", "--", "train")
    assert [shlex.split(x)[3] for x in lines] == [
        "NESTED_JAX_PROCESS_ID=0",
        "NESTED_JAX_PROCESS_ID=1",
    ]
    assert all(x.endswith("-m nested_jax.cli train") for x in lines)


# A stand-in for `python -m nested_jax.cli MODE READY_FILE`: exits 75 on SIGTERM (as a preempted
# trainer does), says hello, then: "ok" exits 0; "fail" exits 3 on process 1 once process 0 is
# ready (READY_FILE exists); anything else sleeps for a minute.
FAKE_CHILD = r"""
import os, signal, sys, time
me = os.environ.get("NESTED_JAX_PROCESS_ID", "0")
mode, ready = sys.argv[1], sys.argv[2]
def on_term(signum, frame):
    print(f"got {signal.Signals(signum).name}", flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
print(f"hello from {me} of {os.environ.get('NESTED_JAX_NUM_PROCESSES')}", flush=True)
if me == "0":
    open(ready, "w").close()
if mode == "ok":
    sys.exit(0)
if mode == "fail" and me == "1":
    while not os.path.exists(ready):
        time.sleep(0.05)
    sys.exit(3)
time.sleep(60)
"""


class Lines:
    """A stream for run_local that calls `on_line(text)` for every line written."""

    def __init__(self, on_line=lambda text: None):
        self.text, self.on_line = "", on_line

    def write(self, s: str) -> None:
        self.text += s
        self.on_line(self.text)

    def flush(self) -> None:
        pass


@pytest.fixture
def fake_children(monkeypatch):
    monkeypatch.setattr(
        local, "child_command", lambda argv: [sys.executable, "-c", FAKE_CHILD, *argv]
    )


def test_local_prefixes_output_and_succeeds(fake_children, tmp_path):
    out = Lines()
    assert local.run_local(local.LocalLaunch(("ok", str(tmp_path / "ready")), 2, 1), out=out) == 0
    assert "[p0] hello from 0 of 2" in out.text and "[p1] hello from 1 of 2" in out.text
    assert "[launch] done: exit code 0" in out.text


def test_local_failure_stops_the_others_and_is_the_exit_code(fake_children, tmp_path):
    out = Lines()
    t0 = time.monotonic()
    launch = local.LocalLaunch(("fail", str(tmp_path / "ready")), 2, 1)
    assert local.run_local(launch, out=out) == 3
    assert time.monotonic() - t0 < 30  # p0 was stopped, not waited for (it sleeps 60 s)
    assert "[launch] p1 exited with code 3" in out.text and "[p0] got SIGTERM" in out.text


def test_local_forwards_sigterm_to_every_process(fake_children, tmp_path):
    sent = []

    def when_ready(text: str) -> None:
        if "[p0] hello" in text and "[p1] hello" in text and not sent:
            sent.append(threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)))
            sent[0].start()

    def ignore(signum, frame):  # this process's handler while no launcher runs: never killed
        pass

    before = signal.signal(signal.SIGTERM, ignore)
    try:
        out = Lines(when_ready)
        launch = local.LocalLaunch(("wait", str(tmp_path / "ready")), 2, 1)
        assert local.run_local(launch, out=out) == 75
        assert signal.getsignal(signal.SIGTERM) is ignore  # the launcher's handler is gone
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "[launch] SIGTERM: sending SIGTERM to every process" in out.text
    assert "[p0] got SIGTERM" in out.text and "[p1] got SIGTERM" in out.text


# -- the local launcher training for real (slow: several JAX processes on 2 cores) --------------


def _train_args(root: Path, workdir: Path, **extra) -> list[str]:
    corpus = write_corpus(root / "corpus")
    args = ["train", "--config", str(defaults_preset(root)), "--workdir", str(workdir)]
    for o in tiny_overrides(corpus, root / "data_cache", **extra):
        args += ["--set", o]
    return args


def _launch(processes: int, devices: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "nested_jax.cli", "launch", "local", "--processes",
            str(processes), "--devices-per-process", str(devices), "--", *args]  # fmt: skip


@pytest.mark.slow
def test_local_two_by_two_trains_like_one_by_four(tmp_path):
    """~95 s on 2 cores. The losses agree to rtol 1e-6: measured 8e-8 (one f32 ulp; the 2-process
    gradient all-reduce over gloo sums in another order than one process's 4-device reduction)."""
    env = subprocess_env(tmp_path, devices=8)
    runs = {}
    for name, (n, k) in {"single": (1, 4), "multi": (2, 2)}.items():
        cmd = _launch(n, k, _train_args(tmp_path, tmp_path / name, **{"train.steps": 4}))
        runs[name] = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert runs[name].returncode == 0, runs[name].stdout[-3000:] + runs[name].stderr[-3000:]
    out = runs["multi"].stdout
    assert "[p0] model transformer" in out and "mesh {'data': 1, 'fsdp': 4" in out
    assert "[launch] p1 exited with code 0" in out
    a = [r["loss"] for r in read_metrics(tmp_path / "single", "train")]
    b = [r["loss"] for r in read_metrics(tmp_path / "multi", "train")]
    assert len(a) == len(b) == 4
    np.testing.assert_allclose(b, a, rtol=1e-6)


@pytest.mark.slow
def test_sigterm_on_one_worker_saves_the_same_step_everywhere_and_resumes(tmp_path):
    """~100 s on 2 cores. SIGTERM goes to ONE child (process 1, not the coordinator), as a pod's
    preemption notice reaches one host: the JAX preemption service spreads it, and orbax's
    reached_preemption makes both processes stop and save at the same step."""
    env = subprocess_env(tmp_path, devices=8)
    workdir = tmp_path / "run"
    many = {"train.steps": 100000, "train.checkpoint_every": 1000}
    log = tmp_path / "launch.log"
    with log.open("w") as f:
        launcher = subprocess.Popen(
            _launch(2, 2, _train_args(tmp_path, workdir, **many)),
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(workdir, "train"):
            assert launcher.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no training step logged in 300 s"
            time.sleep(0.5)
        pid = int(re.search(r"\[launch\] p1 pid (\d+)", log.read_text()).group(1))
        os.kill(pid, signal.SIGTERM)
        assert launcher.wait(timeout=300) == 75  # the trainer's "saved, run again to resume"
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # forwarded to the children: they save and exit
            launcher.wait(timeout=120)
    out = log.read_text()
    step = int(re.search(r"\[p0\] preempted at step (\d+): checkpoint saved", out).group(1))
    assert "[launch] p0 exited with code 75" in out and "[launch] p1 exited with code 75" in out
    # Each process reports the step it agreed on (orbax logs it when reached_preemption is True).
    for p in ("p0", "p1"):
        agreed = set(re.findall(rf"\[{p}\] .*Reached preemption sync point, step=(\d+)", out))
        assert agreed == {str(step)}, (p, agreed)
    data = workdir / "checkpoints" / str(step) / "data"
    assert sorted(x.name for x in data.glob("process_*.json")) == [
        "process_0-of-2.json",
        "process_1-of-2.json",
    ]

    more = {**many, "train.steps": step + 2}  # train.steps may change on resume
    again = subprocess.run(
        _launch(2, 2, _train_args(tmp_path, workdir, **more)),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"[p0] resuming from step {step} " in again.stdout
    steps = [r["step"] for r in read_metrics(workdir, "train")]
    assert steps[-2:] == [step + 1, step + 2]
