"""CLI processes on a machine without a TPU run on the CPU without libtpu's start-up noise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nested_jax.parallel.platform import (
    quiet_cpu_platforms,
    tpu_attached,
    tpu_configured,
    wants_cpu_only,
)

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "libtpu")


def _wants(command="train", env=None, *, libtpu=True, tpu=False, plugins=()):
    return wants_cpu_only(
        command, {} if env is None else env, libtpu=libtpu, tpu=tpu, plugins=plugins
    )


def test_cpu_only_exactly_when_libtpu_would_start_for_nothing():
    assert _wants()
    assert not _wants("aot")  # the topology compile needs libtpu
    assert not _wants(env={"JAX_PLATFORMS": "tpu"})  # the user's choice stands
    assert not _wants(env={"JAX_PLATFORMS": ""})
    assert not _wants(env={"TPU_WORKER_HOSTNAMES": "a,b"})
    assert not _wants(env={"JAX_FORCE_TPU_INIT": "1"})
    assert not _wants(libtpu=False)  # nothing to silence
    assert not _wants(tpu=True)
    assert not _wants(plugins=["xla_cuda12"])  # a GPU machine keeps its GPU


def test_tpu_configured_reads_tpu_variables():
    assert tpu_configured({"TPU_ACCELERATOR_TYPE": "v5litepod-16"})
    assert not tpu_configured({"PATH": "/bin", "XLA_FLAGS": ""})


@pytest.mark.parametrize(
    "files, attached",
    [
        ({}, False),
        ({"dev/accel0": ""}, True),
        ({"dev/vfio/0": ""}, True),
        ({"sys/bus/pci/devices/0000:00:04.0/vendor": "0x1ae0\n"}, True),
        ({"sys/bus/pci/devices/0000:00:04.0/vendor": "0x10de\n"}, False),
    ],
)
def test_tpu_attached_looks_at_device_files(tmp_path, files, attached):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert tpu_attached(str(tmp_path)) is attached


def test_quiet_cpu_platforms_leaves_aot_and_a_set_platform_alone():
    env = {"PATH": "/bin"}
    assert not quiet_cpu_platforms("aot", env)
    assert "JAX_PLATFORMS" not in env
    env = {"JAX_PLATFORMS": "cuda"}
    assert not quiet_cpu_platforms("train", env)
    assert env["JAX_PLATFORMS"] == "cuda"


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None or tpu_attached(),
    reason="needs the [tpu] extra installed on a machine without a TPU",
)
def test_cli_starts_jax_without_libtpu_noise(tmp_path):
    """`train` starts JAX (it counts the devices for the mesh, then refuses a mesh of 16), with
    libtpu installed and JAX_PLATFORMS unset: nothing from libtpu on stderr."""
    preset = tmp_path / "defaults.yaml"
    preset.write_text("# built-in defaults\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
    env["PYTHONPATH"] = str(ROOT)
    argv = ["train", "--config", str(preset), "--workdir", str(tmp_path / "w")]
    argv += ["--set", "mesh.data=16", "--set", "mesh.fsdp=1"]
    cmd = [sys.executable, "-m", "nested_jax.cli", *argv]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert "devices are available" in out.stderr, out.stderr[-2000:]  # JAX did start
    assert not [line for line in out.stderr.splitlines() if any(w in line for w in NOISE)]
