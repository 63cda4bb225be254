"""Fault injection for `nested-jax train`: each case breaks a run the way users and machines do,
then checks the documented outcome and that no healthy checkpoint was lost.

Every case is a real `nested-jax train` / `eval` process (2 fake CPU devices, async checkpoints, a
shared persistent XLA cache), started from a copy of one trained base workdir (steps 2 and 4).
Healthy checkpoints are counted before and after: a checkpoint is healthy when a fresh reader
restores its state item; the case passes only if every checkpoint that was healthy before is still
there and healthy after.

Run the whole table (about 4 minutes on 2 cores)::

    .venv/bin/python tests/train/faults.py            # prints the Markdown table

The same cases run as tests in tests/train/test_faults.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_helpers import (  # noqa: E402
    defaults_preset,
    subprocess_env,
    tiny_overrides,
    write_corpus,
)

STEPS = 8  # steps of a finished run; the base run stops at BASE_STEPS
BASE_STEPS = 4

# The runner injects one fault into an otherwise normal `nested-jax train` process:
#   FAULT=kill_state | kill_data   SIGKILL while writing that item of checkpoint FAULT_STEP
#   FAULT=disk_full                 the state write of checkpoint FAULT_STEP fails with ENOSPC
#   FAULT=SIGINT | SIGTERM | SIGINT2  that signal (SIGINT2: Ctrl-C twice) during step FAULT_STEP
#   FAULT=SIGINT_SAVE               Ctrl-C during step FAULT_STEP, again while its checkpoint saves
#   FAULT=SIGTERM_START             SIGTERM while starting up (before jax.distributed / the loop)
#   FAULT=disk_low                  the disk reports 1 KiB free
#   FAULT=disk_full_tensorstore     checkpoint FAULT_STEP fails as tensorstore does on a full disk
RUNNER = r"""
import errno, os, signal, sys
from pathlib import Path

fault, at = os.environ.get("FAULT", ""), int(os.environ.get("FAULT_STEP", "0"))

def _step_of(directory):
    name = Path(str(getattr(directory, "path", directory))).parent.name
    return int(name.split(".")[0]) if name.split(".")[0].isdigit() else None

if fault in ("kill_state", "disk_full"):
    from orbax.checkpoint._src.handlers import standard_checkpoint_handler as h
    original_state = h.StandardCheckpointHandler.async_save
    async def async_save(self, directory, *args, **kwargs):
        if _step_of(directory) == at:
            if fault == "kill_state":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        return await original_state(self, directory, *args, **kwargs)
    h.StandardCheckpointHandler.async_save = async_save
if fault == "disk_full_tensorstore":
    from orbax.checkpoint._src.handlers import standard_checkpoint_handler as h
    original_ts = h.StandardCheckpointHandler.async_save
    async def async_save(self, directory, *args, **kwargs):
        if _step_of(directory) == at:
            raise ValueError("RESOURCE_EXHAUSTED: Error writing local file: [OS error 28: "
                             "No space left on device]")
        return await original_ts(self, directory, *args, **kwargs)
    h.StandardCheckpointHandler.async_save = async_save
if fault == "disk_low":
    import collections, shutil
    usage = collections.namedtuple("usage", "total used free")
    shutil.disk_usage = lambda path: usage(10**12, 10**12 - 1024, 1024)
if fault == "SIGINT_SAVE":
    from nested_jax.train.checkpoint import Checkpointer
    from nested_jax.train.metrics import MetricsWriter
    original_write, original_save = MetricsWriter.write, Checkpointer.save
    def write(self, step, kind, scalars):
        original_write(self, step, kind, scalars)
        if kind == "train" and step == at:
            os.kill(os.getpid(), signal.SIGINT)
    def save(self, step, *args, **kwargs):
        original_save(self, step, *args, **kwargs)
        if step == at:
            os.kill(os.getpid(), signal.SIGINT)
    MetricsWriter.write, Checkpointer.save = write, save
if fault == "SIGTERM_START":
    import nested_jax.parallel.distributed as d
    original_init = d.maybe_initialize
    def maybe_initialize():
        os.kill(os.getpid(), signal.SIGTERM)
        return original_init()
    d.maybe_initialize = maybe_initialize
if fault == "kill_data":
    import grain._src.python.checkpoint.handler as g
    original_data = g.CheckpointHandler.save
    def save(self, directory, *args, **kwargs):
        if _step_of(directory) == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original_data(self, directory, *args, **kwargs)
    g.CheckpointHandler.save = save
if fault in ("SIGINT", "SIGTERM", "SIGINT2"):
    from nested_jax.train.metrics import MetricsWriter
    original_write = MetricsWriter.write
    def write(self, step, kind, scalars):
        original_write(self, step, kind, scalars)
        if kind == "train" and step == at:
            sig = signal.SIGTERM if fault == "SIGTERM" else signal.SIGINT
            os.kill(os.getpid(), sig)
            if fault == "SIGINT2":
                os.kill(os.getpid(), sig)
    MetricsWriter.write = write

from nested_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


@dataclasses.dataclass
class Env:
    root: Path
    runner: Path
    env: dict
    corpus: Path
    preset: Path
    base: Path  # a run trained to BASE_STEPS (checkpoints 2, 4)

    def overrides(self, **extra) -> list[str]:
        values = {
            "train.steps": STEPS,
            "train.checkpoint_every": 2,
            "train.keep_checkpoints": 20,  # no rotation: every checkpoint can be counted
            "train.async_checkpointing": True,
        }
        values.update(extra)
        return tiny_overrides(self.corpus, self.root / "data_cache", **values)


@dataclasses.dataclass
class Run:
    code: int
    out: str  # stdout + stderr
    err: str = ""  # stderr alone

    def has(self, text: str) -> bool:
        return text in self.out


def make_env(root: Path) -> Env:
    runner = root / "runner.py"
    runner.write_text(RUNNER)
    e = subprocess_env(root, devices=2, drop=("FAULT", "FAULT_STEP"))
    env = Env(root, runner, e, write_corpus(root / "corpus"), defaults_preset(root), root / "base")
    r = train(env, env.base, steps=BASE_STEPS)
    if r.code != 0:
        raise RuntimeError(f"base run failed ({r.code}):\n{r.out[-3000:]}")
    return env


def run_cli(env: Env, argv: list[str], fault: str = "", at: int = 0) -> Run:
    e = dict(env.env)
    if fault:
        e.update(FAULT=fault, FAULT_STEP=str(at))
    p = subprocess.run(
        [sys.executable, str(env.runner), *argv], env=e, capture_output=True, text=True, timeout=600
    )
    return Run(p.returncode, p.stdout + p.stderr, p.stderr)


def train(
    env: Env,
    workdir: Path,
    *,
    config: bool = True,
    fault: str = "",
    at: int = 0,
    flags: tuple[str, ...] = (),
    **extra,
) -> Run:
    """`nested-jax train` on `workdir` with the tiny config (`--set` for every field)."""
    steps = extra.pop("steps", STEPS)
    argv = ["train", "--workdir", str(workdir), *flags]
    if config:
        argv += ["--config", str(env.preset)]
    for o in env.overrides(**{"train.steps": steps, **extra}):
        argv += ["--set", o]
    return run_cli(env, argv, fault, at)


def healthy_steps(workdir: Path) -> list[int]:
    """Steps whose checkpoint state a fresh reader restores (as numpy: any device count)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    def is_array(x):
        return hasattr(x, "shape") and hasattr(x, "dtype")

    directory = workdir / "checkpoints"
    out = []
    for p in sorted(directory.iterdir()) if directory.is_dir() else []:
        if not p.name.isdigit():
            continue
        path = (p / "state").resolve()
        try:
            meta = ocp.StandardCheckpointHandler().metadata(path)
            tree = getattr(meta, "tree", meta)
            as_numpy = jax.tree.map(
                lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree, is_leaf=is_array
            )
            with ocp.PyTreeCheckpointer() as reader:
                reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
            out.append(int(p.name))
        except Exception:
            continue
    return sorted(out)


@dataclasses.dataclass
class Outcome:
    case: str
    outcome: str  # what happened, in words
    before: list[int]  # healthy checkpoints before the fault
    after: list[int]  # healthy checkpoints after the fault and the recovery
    ok: bool  # the documented outcome happened and nothing healthy was lost
    detail: str = ""  # the line the user sees


def _copy_base(env: Env, name: str) -> Path:
    workdir = env.root / "cases" / name
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(env.base, workdir)
    return workdir


def _line(run: Run, *needles: str) -> str:
    for line in run.out.splitlines():
        if any(n in line for n in needles):
            return line.strip()
    return ""


def _result(case, outcome, before, workdir, ok, detail="") -> Outcome:
    after = healthy_steps(workdir)
    kept = set(before) <= set(after)
    return Outcome(case, outcome, before, after, ok and kept, detail)


# -- the cases --------------------------------------------------------------------------------


def _kill_case(env: Env, item: str) -> Outcome:
    w = _copy_base(env, f"kill_{item}")
    before = healthy_steps(w)
    killed = train(env, w, fault=f"kill_{item}", at=6)
    resumed = train(env, w)
    ok = (
        killed.code == -9
        and resumed.code == 0
        and resumed.has("ignoring incomplete save")
        and resumed.has("resuming from step 4")
    )
    what = "state" if item == "state" else "data iterator"
    return _result(
        f"kill -9 while writing checkpoint 6 ({what})",
        f"killed (rc {killed.code}); next start ignores the partial save, resumes at 4, "
        f"finishes (rc {resumed.code})",
        before,
        w,
        ok,
        _line(resumed, "ignoring incomplete save"),
    )


def case_kill_during_state_save(env: Env) -> Outcome:
    return _kill_case(env, "state")


def case_kill_during_data_save(env: Env) -> Outcome:
    return _kill_case(env, "data")


def case_disk_full(env: Env) -> Outcome:
    w = _copy_base(env, "disk_full")
    before = healthy_steps(w)
    full = train(env, w, fault="disk_full", at=6)
    resumed = train(env, w)
    ok = full.code == 1 and resumed.code == 0 and resumed.has("resuming from step 4")
    return _result(
        "disk full while writing checkpoint 6",
        f"one-line error, rc {full.code}; after freeing space the next start resumes at 4 "
        f"(rc {resumed.code})",
        before,
        w,
        ok,
        _line(full, "could not be written"),
    )


def case_truncated_metadata(env: Env) -> Outcome:
    w = _copy_base(env, "truncated_metadata")
    meta = w / "checkpoints" / "4" / "state" / "_METADATA"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    before = healthy_steps(w)  # step 4 is no longer healthy; step 2 is
    resumed = train(env, w)
    moved = list((w / "corrupt_checkpoints").glob("step_4_*"))
    ok = resumed.code == 0 and resumed.has("resuming from step 2") and len(moved) == 1
    return _result(
        "truncated _METADATA in the newest checkpoint (4)",
        f"reported, moved to corrupt_checkpoints/ (kept), resumed at 2 (rc {resumed.code})",
        before,
        w,
        ok,
        _line(resumed, "is unreadable"),
    )


def _changed_setting(env: Env, name: str, refused: bool, flags=(), **change) -> Outcome:
    w = _copy_base(env, f"changed_{name}")
    before = healthy_steps(w)
    listing = sorted(p.name for p in w.rglob("*"))
    r = train(env, w, flags=flags, **change)
    field = ", ".join(f"{k}={v}" for k, v in change.items())
    if refused:
        untouched = sorted(p.name for p in w.rglob("*")) == listing
        ok = r.code == 2 and r.has("config error: cannot resume") and untouched
        outcome = f"refused (rc {r.code}), workdir untouched"
        detail = _line(r, "config error")
    else:
        ok = r.code == 0 and r.has("resuming from step 4") and r.has("notice:")
        outcome = f"applied with a notice, resumed at 4 (rc {r.code})"
        detail = _line(r, f"notice: {next(iter(change))}")
    case = f"resume with {field}" + (f" {' '.join(flags)}" if flags else "")
    return _result(case, outcome, before, w, ok, detail)


CHANGED_SETTINGS = [
    # (name, refused, flags, change)
    ("model", True, (), {"model.d_model": 48}),
    ("data", True, (), {"data.seq_len": 16}),
    ("optimizer", True, (), {"optimizer.grad_clip": 0.0}),
    ("optimizer_reset", False, ("--reset-optimizer",), {"optimizer.grad_clip": 0.0}),
    ("mesh", False, (), {"mesh.data": 2}),
    ("train_steps", False, (), {"train.steps": 10}),
    ("train_seed", True, (), {"train.seed": 5}),
    ("eval", False, (), {"eval.eval_batches": 2}),
]


def case_changed_setting(env: Env, index: int) -> Outcome:
    name, refused, flags, change = CHANGED_SETTINGS[index]
    return _changed_setting(env, name, refused, flags, **change)


def case_deleted_config_json(env: Env) -> Outcome:
    w = _copy_base(env, "deleted_config")
    (w / "config.json").unlink()
    before = healthy_steps(w)
    r = train(env, w, config=False)
    saved = json.loads((w / "config.json").read_text())
    ok = (
        r.code == 0
        and r.has("recovered from checkpoint 4")
        and r.has("resuming from step 4")
        and saved["model"]["d_model"] == 32
    )
    return _result(
        "config.json deleted, `train --workdir W`",
        f"config recovered from checkpoint 4, resumed at 4 (rc {r.code})",
        before,
        w,
        ok,
        _line(r, "recovered from"),
    )


def case_new_workdir_without_config(env: Env) -> Outcome:
    w = env.root / "cases" / "typo_workdir"
    shutil.rmtree(w, ignore_errors=True)
    r = run_cli(env, ["train", "--workdir", str(w), "--set", "train.steps=2000"])
    ok = r.code == 2 and r.has("does not exist: give --config") and not w.exists()
    return _result(
        "`train --workdir NEW` without --config (a typo)",
        f"refused (rc {r.code}), nothing created",
        [],
        w,
        ok,
        _line(r, "config error"),
    )


def case_changed_corpus(env: Env) -> Outcome:
    w = _copy_base(env, "changed_corpus")
    corpus = env.root / "cases" / "corpus_plus_one"
    shutil.rmtree(corpus, ignore_errors=True)
    shutil.copytree(env.corpus, corpus)
    write_corpus(corpus / "extra", n_docs=1, seed=7)
    before = healthy_steps(w)
    r = train(env, w, **{"data.corpus": str(corpus)})
    ev = run_cli(
        env,
        ["eval", "--workdir", str(w), "--set", f"data.corpus={corpus}"]
        + ["--set", "eval.niah_lengths=[160]"],  # the tiny preset's 48 cannot hold a needle
    )
    report = json.loads((w / "eval_report.json").read_text()) if ev.code == 0 else {}
    ok = (
        r.code == 2
        and r.has("the corpus changed since this workdir was trained")
        and ev.code == 0
        and ev.has("warning: the corpus changed")
        and "corpus_change" in report
    )
    return _result(
        "one .txt added to the corpus folder",
        f"train refused (rc {r.code}); eval uses the saved tokenizer and warns (rc {ev.code})",
        before,
        w,
        ok,
        _line(r, "config error"),
    )


def _signal_case(env: Env, sig: str) -> Outcome:
    at = random.Random().randint(BASE_STEPS + 1, STEPS - 1)  # a random step (shown in the table)
    w = _copy_base(env, f"signal_{sig}")
    before = healthy_steps(w)
    stopped = train(env, w, fault=sig, at=at)
    saved = healthy_steps(w)
    resumed = train(env, w)
    summary = json.loads((w / "summary.json").read_text())
    ok = (
        stopped.code == 75
        and stopped.has(f"preempted at step {at}: checkpoint saved ({sig})")
        and at in saved
        and resumed.code == 0
        and resumed.has(f"resuming from step {at}")
        and summary["steps"] == STEPS
    )
    return _result(
        f"{sig} at step {at}",
        f"step {at} saved, rc {stopped.code}; the same command resumes at {at} and finishes "
        f"(rc {resumed.code})",
        before,
        w,
        ok,
        _line(stopped, "preempted at step"),
    )


def case_sigint(env: Env) -> Outcome:
    return _signal_case(env, "SIGINT")


def case_sigterm(env: Env) -> Outcome:
    return _signal_case(env, "SIGTERM")


def case_double_ctrl_c(env: Env) -> Outcome:
    w = _copy_base(env, "double_ctrl_c")
    before = healthy_steps(w)
    r = train(env, w, fault="SIGINT2", at=5)
    ok = r.code == 130 and r.has("stopped without saving") and "Traceback" not in r.out
    return _result(
        "Ctrl-C twice at step 5",
        f"aborted without saving (rc {r.code}), no traceback",
        before,
        w,
        ok,
        _line(r, "stopped without saving"),
    )


def case_lock_held(env: Env) -> Outcome:
    w = _copy_base(env, "lock_held")
    before = healthy_steps(w)
    listing = sorted(p.name for p in w.rglob("*"))
    holder = subprocess.Popen(  # a live run's lock, held by another process
        [sys.executable, "-c", HOLD_LOCK, str(w)], env=env.env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        r = train(env, w)
    finally:
        holder.kill()
        holder.wait()
    untouched = sorted(p.name for p in w.rglob("*")) == listing + ["train.lock"]
    ok = (
        r.code == 2
        and r.has(f"is in use by another training run (pid {holder.pid} on host")
        and len(r.err.strip().splitlines()) == 1
        and untouched
    )
    return _result(
        "a second `train` while a live run holds the workdir",
        f"refused in one line naming pid and host (rc {r.code}); nothing written",
        before,
        w,
        ok,
        _line(r, "in use"),
    )


HOLD_LOCK = """
import sys, time
from nested_jax.train.lock import acquire
lock = acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def case_stale_lock(env: Env) -> Outcome:
    w = _copy_base(env, "stale_lock")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_TEXT)
    pid = int(dead.stdout)  # a process that has exited
    (w / "train.lock").write_text(json.dumps({"pid": pid, "host": os.uname().nodename}))
    before = healthy_steps(w)
    r = train(env, w)
    ok = (
        r.code == 0
        and r.has(f"took over the stale lock {w / 'train.lock'} (pid {pid}")
        and r.has("resuming from step 4")
        and not (w / "train.lock").exists()
    )
    return _result(
        "lock file of a killed run (pid gone)",
        f"taken over with a notice, resumed at 4 (rc {r.code}); the lock is gone afterwards",
        before,
        w,
        ok,
        _line(r, "stale lock"),
    )


_TEXT = {"capture_output": True, "text": True, "check": True}


def case_disk_full_tensorstore(env: Env) -> Outcome:
    w = _copy_base(env, "disk_full_ts")
    before = healthy_steps(w)
    r = train(env, w, fault="disk_full_tensorstore", at=6)
    lines = r.err.strip().splitlines()
    ok = (
        r.code == 1
        and len(lines) <= 3
        and "Traceback" not in r.out
        and r.has("no space left on device (a checkpoint needs about")
        and r.has(f"traceback in {w / 'errors.log'}")
        and (w / "errors.log").is_file()
    )
    return _result(
        "disk full (tensorstore's error) while writing checkpoint 6",
        f"{len(lines)} line(s) on stderr naming the space a checkpoint needs, rc {r.code}; "
        "traceback in errors.log",
        before,
        w,
        ok,
        _line(r, "no space left"),
    )


def case_disk_low(env: Env) -> Outcome:
    w = _copy_base(env, "disk_low")
    before = healthy_steps(w)
    metrics = (w / "metrics.jsonl").read_text()
    r = train(env, w, fault="disk_low")
    ok = (
        r.code == 1
        and r.has("not enough free space for a checkpoint")
        and r.has("1.0 KiB free")
        and (w / "metrics.jsonl").read_text() == metrics
    )
    return _result(
        "resume on a disk with 1 KiB free",
        f"refused up front in one line (rc {r.code}), nothing trained",
        before,
        w,
        ok,
        _line(r, "not enough free space"),
    )


def case_ctrl_c_during_stop_save(env: Env) -> Outcome:
    w = _copy_base(env, "ctrl_c_save")
    before = healthy_steps(w)
    r = train(env, w, fault="SIGINT_SAVE", at=5)
    ok = (
        r.code == 75
        and r.has("preempted at step 5: checkpoint saved (SIGINT)")
        and "Traceback" not in r.out
        and not r.has("stopped without saving")
        and 5 in healthy_steps(w)
    )
    return _result(
        "Ctrl-C at step 5, again while its checkpoint is written",
        f"the save completes and is reported saved (rc {r.code}), no traceback",
        before,
        w,
        ok,
        _line(r, "preempted at step"),
    )


def case_sigterm_at_startup(env: Env) -> Outcome:
    w = _copy_base(env, "sigterm_start")
    before = healthy_steps(w)
    r = train(env, w, fault="SIGTERM_START")
    ok = (
        r.code == 75
        and r.has("stopped by SIGTERM during start-up: nothing to save yet")
        and len(r.err.strip().splitlines()) == 1
        and not (w / "train.lock").exists()
    )
    return _result(
        "SIGTERM while the run starts up",
        f"one line, rc {r.code} (a preemption: run the same command again)",
        before,
        w,
        ok,
        _line(r, "stopped by SIGTERM"),
    )


def case_finished_rerun(env: Env) -> Outcome:
    w = _copy_base(env, "rerun")
    first = train(env, w)
    good = json.loads((w / "summary.json").read_text())
    before = healthy_steps(w)
    again = train(env, w)
    text = (w / "summary.json").read_text()
    now = json.loads(text)
    ok = (
        first.code == 0
        and again.code == 0
        and "NaN" not in text
        and now["final_train_loss"] == good["final_train_loss"]
        and now["tokens_per_s"] == good["tokens_per_s"]
    )
    return _result(
        "re-run of a finished workdir",
        f"rc {again.code}; summary.json strict JSON, train loss and tokens/s kept",
        before,
        w,
        ok,
    )


CASES: list[Callable[[Env], Outcome]] = [
    case_kill_during_state_save,
    case_kill_during_data_save,
    case_disk_full,
    case_truncated_metadata,
    *[(lambda env, i=i: case_changed_setting(env, i)) for i in range(len(CHANGED_SETTINGS))],
    case_deleted_config_json,
    case_new_workdir_without_config,
    case_changed_corpus,
    case_sigint,
    case_sigterm,
    case_double_ctrl_c,
    case_finished_rerun,
    case_lock_held,
    case_stale_lock,
    case_disk_full_tensorstore,
    case_disk_low,
    case_ctrl_c_during_stop_save,
    case_sigterm_at_startup,
]


def markdown(rows: list[Outcome]) -> str:
    lines = [
        "| case | outcome | healthy checkpoints before | after | ok |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.outcome} | {r.before or '-'} | {r.after or '-'} | "
            f"{'yes' if r.ok else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    import tempfile

    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    with tempfile.TemporaryDirectory(prefix="nested-jax-faults-") as tmp:
        env = make_env(Path(tmp))
        rows = []
        for case in CASES:
            row = case(env)
            rows.append(row)
            print(f"{'ok ' if row.ok else 'FAIL'} {row.case}: {row.outcome}", flush=True)
            if row.detail:
                print(f"     {row.detail}", flush=True)
    print()
    print(markdown(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
