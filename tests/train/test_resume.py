"""Resume across processes: bit-exact continuation, and recovery from a process killed mid-save.

Each run is a fresh `nested-jax train` process (2 fake CPU devices, async checkpointing on). Runs
share a persistent
XLA compilation cache so only the first one compiles.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_helpers import defaults_preset, subprocess_env, tiny_overrides

from nested_jax.train.metrics import read_metrics

K = 3  # steps before the restart; the straight run does 2K

RUNNER = """
import os, signal, sys
from pathlib import Path
kill_at = os.environ.get("KILL_AT_SAVE")
if kill_at:
    import grain._src.python.checkpoint.handler as h
    original = h.CheckpointHandler.save
    def save(self, directory, *args, **kwargs):
        # The data item is written inside <step>.orbax-checkpoint-tmp-*: die there, mid-save.
        if Path(str(directory)).parent.name.startswith(kill_at + "."):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, directory, *args, **kwargs)
    h.CheckpointHandler.save = save
from nested_jax.train.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    runner = root / "runner.py"
    runner.write_text(RUNNER)
    e = subprocess_env(root, devices=2, drop=("KILL_AT_SAVE",))
    from train_helpers import write_corpus

    return {"root": root, "runner": runner, "env": e, "corpus": write_corpus(root / "corpus")}


def _train(env, workdir: Path, steps: int, kill_at: int | None = None):
    overrides = tiny_overrides(
        env["corpus"],
        env["root"] / "data_cache",
        **{
            "train.steps": steps,
            "train.checkpoint_every": K,
            "train.async_checkpointing": True,
            "train.eval_every": 0,
        },
    )
    preset = defaults_preset(env["root"])
    cmd = [sys.executable, str(env["runner"]), "--config", str(preset), "--workdir", str(workdir)]
    for o in overrides:
        cmd += ["--set", o]
    e = dict(env["env"])
    if kill_at is not None:
        e["KILL_AT_SAVE"] = str(kill_at)
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600)


def _losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}


def _state(workdir: Path, step: int):
    mgr = ocp.CheckpointManager(
        (workdir / "checkpoints").resolve(), options=ocp.CheckpointManagerOptions(read_only=True)
    )
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    mgr.close()
    return out


def _iterator(workdir: Path):
    from nested_jax.data import pipeline
    from nested_jax.train.config import load_workdir_config

    cfg = load_workdir_config(workdir)
    bundle = pipeline.prepare_data(cfg.data)
    return pipeline.make_train_iterator(
        cfg.data, bundle.tokenizer, bundle.train_docs, process_index=0, process_count=1
    )


def _next_batch(workdir: Path, step: int) -> dict:
    """The batch a resume from checkpoint `step` would train on next."""
    it = _iterator(workdir)
    state_file = workdir / "checkpoints" / str(step) / "data" / "process_0-of-1.json"
    it.set_state(json.loads(state_file.read_text()))
    return next(it)


def _assert_trees_equal(a, b):
    import chex
    import jax

    assert jax.tree.leaves(a)  # an empty restore would compare equal vacuously
    chex.assert_trees_all_equal(a, b)  # same structure, shapes, dtypes and values


def test_restart_is_bit_exact_and_a_kill_mid_save_resumes_from_previous(env):
    root = env["root"]
    straight, resumed, killed = root / "straight", root / "resumed", root / "killed"

    r = _train(env, straight, 2 * K)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(env, resumed, K)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(env, resumed, 2 * K)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {K}" in r.stdout

    # Identical per-step losses, parameters, optimizer state, step counter and next data batch.
    ls, lr = _losses(straight), _losses(resumed)
    assert sorted(ls) == list(range(1, 2 * K + 1)) and ls == lr
    # The straight run's step-K checkpoint was written asynchronously while the next steps ran
    # (with donated buffers): it equals run B's final step-K checkpoint.
    mid_a, mid_b = _state(straight, K), _state(resumed, K)
    _assert_trees_equal(mid_a["params"], mid_b["params"])
    _assert_trees_equal(mid_a["opt_state"], mid_b["opt_state"])
    a, b = _state(straight, 2 * K), _state(resumed, 2 * K)
    assert int(a["step"]) == int(b["step"]) == 2 * K
    _assert_trees_equal(a["params"], b["params"])
    _assert_trees_equal(a["opt_state"], b["opt_state"])
    na, nb = _next_batch(straight, 2 * K), _next_batch(resumed, 2 * K)
    _assert_trees_equal(na, nb)
    fresh = _iterator(straight)  # ... and it is batch 2K+1 of the stream, not a repeat
    batches = [next(fresh) for _ in range(2 * K + 1)]
    _assert_trees_equal(na, batches[-1])
    assert not np.array_equal(na["inputs"], batches[0]["inputs"])

    # A process killed while writing checkpoint 2K: only step K is complete ...
    r = _train(env, killed, 2 * K, kill_at=2 * K)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    names = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert str(K) in names and str(2 * K) not in names
    assert any(n.startswith(f"{2 * K}.") and "tmp" in n for n in names), names
    # ... the next start says so, resumes from K and ends exactly where the straight run did.
    r = _train(env, killed, 2 * K)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ignoring incomplete save" in r.stdout
    assert f"resuming from step {K}" in r.stdout
    assert _losses(killed) == ls
    # Steps K+1..2K were logged by both processes; readers keep the continuing run's records.
    assert len(read_metrics(killed, "train", latest=False)) == 3 * K
    assert [r["step"] for r in read_metrics(killed, "train")] == list(range(1, 2 * K + 1))
    _assert_trees_equal(_state(killed, 2 * K)["params"], a["params"])
