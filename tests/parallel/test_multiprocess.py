"""Two JAX processes (2 fake CPU devices each, gloo collectives) train like one process with 4."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import defaults_preset, tiny_overrides, write_corpus  # noqa: E402

from nested_jax.train.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(workdir: Path, overrides: list[str]) -> list[str]:
    preset = defaults_preset(workdir.parent)
    cmd = [sys.executable, "-m", "nested_jax.cli", "train", "--config", str(preset)]
    cmd += ["--workdir", str(workdir)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    overrides = tiny_overrides(corpus, tmp_path / "data_cache", **{"train.steps": 4})
    single = subprocess.run(
        _cmd(tmp_path / "single", overrides),
        env=_env(4),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr[-3000:]

    port = _free_port()
    procs = [
        subprocess.Popen(
            _cmd(tmp_path / "multi", overrides),
            env=_env(
                2,
                NESTED_JAX_COORDINATOR=f"127.0.0.1:{port}",
                NESTED_JAX_NUM_PROCESSES="2",
                NESTED_JAX_PROCESS_ID=str(i),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "mesh {'data': 1, 'fsdp': 4}" in outs[0][0]

    a = [r["loss"] for r in read_metrics(tmp_path / "single", "train")]
    b = [r["loss"] for r in read_metrics(tmp_path / "multi", "train")]
    assert len(a) == len(b) == 4
    np.testing.assert_allclose(b, a, rtol=1e-5)
    steps = sorted(int(p.name) for p in (tmp_path / "multi" / "checkpoints").iterdir())
    assert steps == [2, 4]
    data = tmp_path / "multi" / "checkpoints" / "4" / "data"
    assert sorted(p.name for p in data.glob("process_*.json")) == [
        "process_0-of-2.json",
        "process_1-of-2.json",
    ]
