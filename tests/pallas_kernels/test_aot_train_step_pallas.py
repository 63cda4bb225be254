"""A whole tiny ``gdn`` train step with ``model.impl: pallas`` compiled ahead of time for TPU
slices on this CPU (``nested_jax.train.aot``, libtpu's abstract devices; issue 16): the program
must run the Mosaic kernels (``tpu_custom_call`` named ``gated_delta_fwd`` / ``gated_delta_bwd``),
one call per (batch, heads) shard under ``jax.shard_map``, not the Pallas interpreter's loops.

Two things make that hold (``nested_jax.ops._pallas``): the kernel is chosen by the platform the
step is lowered for (``jax.lax.platform_dependent``), not by ``jax.default_backend()`` (``cpu``
here, which used to give the TPU program the interpreter); and inside the step's mesh the kernel
call runs under ``jax.shard_map`` (XLA cannot partition a Mosaic call: "Mosaic kernels cannot be
automatically partitioned").

The lowered StableHLO is read for the kernels on every topology, and the compiled HLO too (XLA's
own text dump, ``aot.compile_with_text``: ``compiled.as_text()`` raises an XLA RET_CHECK on v5p
and v6e programs after a successful compile). The kernels' first operand ``q`` is
``[B·H per chip, T, K]``, so its leading size shows the shard each chip runs.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from nested_jax.train import aot
from nested_jax.train.config import load_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install -e '.[tpu]'; scripts/test does)",
)
TINY_PALLAS = [
    "model.impl=pallas",
    "model.d_model=128",
    "model.n_layers=1",
    "model.n_heads=1",
    "model.head_dim=128",
    "model.chunk_size=64",
    "model.dtype=bfloat16",
    "data.seq_len=128",
]
PER_DEVICE_BATCH = 2
KERNELS = ("gated_delta_fwd", "gated_delta_bwd")
_Q_ROWS = re.compile(r"\}\s*:\s*\(tensor<(\d+)x")  # the first operand type of a custom_call


def _compile_train_step(topology, overrides=()):
    """``(StepMemory, lowered StableHLO text, mesh shape)`` of the tiny pallas train step."""
    cfg = load_config(
        ["configs/experiments/tiny_gdn.yaml"],
        [*TINY_PALLAS, f"mesh.topology={topology}", *overrides],
    )
    assert cfg.model.name == "gdn" and cfg.model.impl == "pallas"
    lowered_text = []
    compile_step = aot.compile_step

    def keep_lowered(lowered, *args, **kwargs):
        lowered_text.append(lowered.as_text())
        return compile_step(lowered, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aot, "compile_step", keep_lowered)
        _, mesh_shape, (train,) = aot.compile_for_topology(
            cfg, topology, per_device_batch=PER_DEVICE_BATCH, keep_text=True
        )
    assert train.fits and not train.error and 0 < train.peak < train.capacity, train
    return train, lowered_text[0], mesh_shape


def _lowered_kernel_rows(lowered: str) -> dict[str, list[int]]:
    """For each Mosaic kernel in the lowered program, the leading size of its ``q`` operand."""
    rows: dict[str, list[int]] = {k: [] for k in KERNELS}
    for line in lowered.splitlines():
        if "stablehlo.custom_call @tpu_custom_call" not in line:
            continue
        for kernel in KERNELS:
            if f'kernel_name = "{kernel}"' in line:
                rows[kernel].append(int(_Q_ROWS.search(line).group(1)))
    return rows


def _assert_mosaic_kernels(train, lowered: str, rows_per_chip: int) -> None:
    rows = _lowered_kernel_rows(lowered)
    for kernel in KERNELS:
        assert rows[kernel] == [rows_per_chip], f"{kernel}: q rows per call {rows[kernel]}"
    calls = [ln for ln in train.hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in ln]
    for kernel in KERNELS:
        assert any(f"%{kernel}" in ln for ln in calls), f"no tpu_custom_call named {kernel}"


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_tiny_gdn_pallas_train_step_runs_the_mosaic_kernels_per_batch_shard(topology):
    train, lowered, mesh_shape = _compile_train_step(topology)
    assert mesh_shape == {"data": 1, "fsdp": 4, "seq": 1, "tensor": 1}
    assert train.hlo, "no optimized HLO: the compiled kernels cannot be read"
    # batch 8 split over fsdp 4, one head: each chip runs its 2 rows (unsplit it would be 8)
    _assert_mosaic_kernels(train, lowered, rows_per_chip=PER_DEVICE_BATCH * 1)


def test_tiny_gdn_pallas_train_step_splits_heads_over_tensor():
    """``mesh.tensor=2`` with 2 heads: batch over fsdp 2, heads over tensor 2, so each chip's
    kernel runs ``2 rows × 1 head`` (4 if the heads were not split, 8 if nothing were)."""
    overrides = ("mesh.tensor=2", "model.n_heads=2", "model.d_model=256")
    train, lowered, mesh_shape = _compile_train_step("v5e:2x2", overrides)
    assert mesh_shape == {"data": 1, "fsdp": 2, "seq": 1, "tensor": 2}
    _assert_mosaic_kernels(train, lowered, rows_per_chip=PER_DEVICE_BATCH * 1)
