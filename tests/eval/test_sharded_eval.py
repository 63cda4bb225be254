"""Sharded evaluation: a checkpoint trained on one mesh evaluates to the same report on 1 device,
on other mesh shapes (orbax reshards on restore), and on 2 processes × 4 devices (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import defaults_preset, tiny_overrides, write_corpus  # noqa: E402

from nested_jax import cli  # noqa: E402
from nested_jax.eval.main import run_eval  # noqa: E402
from nested_jax.train.inference import load_trained  # noqa: E402

# One worker runs the module: its fixture (a compile / a trained run) is built once.
pytestmark = pytest.mark.xdist_group("sharded_eval")
ROOT = Path(__file__).resolve().parents[2]
# f32 CPU: the same sums reduced in another order over other shards.
RTOL = 1e-5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_eval")
    corpus = write_corpus(root / "corpus")
    overrides = tiny_overrides(
        corpus,
        root / "data_cache",
        **{
            "train.steps": 3,
            "eval.niah_lengths": [160],
            "eval.niah_depths": [0.0, 1.0],
            "eval.niah_per_cell": 3,  # 6 examples: batches that do not divide 8 or 4 devices
        },
    )
    workdir = root / "run"
    args = ["train", "--config", str(defaults_preset(root)), "--workdir", str(workdir)]
    for o in overrides + ["mesh.fsdp=4", "mesh.data=2"]:  # trained on a 2×4 mesh
        args += ["--set", o]
    assert cli.main(args) == 0
    return workdir


def _report(workdir, devices=None, overrides=()) -> dict:
    trained = load_trained(workdir, list(overrides), devices=devices)
    shape = dict(trained.setup.mesh.shape)
    return run_eval(trained), shape


def _assert_same(report: dict, reference: dict) -> None:
    v, r = report["validation"], reference["validation"]
    assert v["tokens"] == r["tokens"] and v["bytes"] == r["bytes"]
    np.testing.assert_allclose(v["loss"], r["loss"], rtol=RTOL)
    np.testing.assert_allclose(v["bits_per_byte"], r["bits_per_byte"], rtol=RTOL)
    assert report["niah"]["accuracy"] == reference["niah"]["accuracy"]
    assert report["step"] == reference["step"]


def test_restore_onto_other_meshes_gives_the_same_report(workdir):
    one, shape1 = _report(workdir, jax.devices()[:1], ["mesh.data=1", "mesh.fsdp=-1"])
    assert shape1 == {"data": 1, "fsdp": 1, "seq": 1, "tensor": 1}
    assert one["niah"]["num_examples"] == 6
    for overrides, expected in (
        (["mesh.data=1", "mesh.fsdp=-1"], {"data": 1, "fsdp": 8, "seq": 1, "tensor": 1}),
        (
            ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
            {"data": 2, "fsdp": 2, "seq": 1, "tensor": 2},
        ),
    ):
        report, shape = _report(workdir, overrides=overrides)
        assert shape == expected
        _assert_same(report, one)


def test_two_processes_evaluate_like_one(workdir):
    """2 processes × 4 CPU devices (gloo) write the report 1 process × 8 devices computes."""
    reference, _ = _report(workdir)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the launcher sets the device count per process
    cmd = [sys.executable, "-m", "nested_jax.cli", "launch", "local", "--processes", "2"]
    cmd += ["--devices-per-process", "4", "--", "eval", "--workdir", str(workdir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((workdir / "eval_report.json").read_text())
    _assert_same(report, reference)
