"""The roofline estimate of ``nested-jax aot --estimate``: collective bytes read from HLO, the
arithmetic of the estimate, and (with libtpu) a compiled step whose every layer is counted."""

from __future__ import annotations

import importlib.util
import math

import pytest

from nested_jax.train import aot
from nested_jax.train.aot_estimate import collective_bytes, describe_estimate, estimate_step
from nested_jax.train.chips import CHIPS, Chip, chip_of
from nested_jax.train.config import load_config

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu (the tpu extra) is not installed"
)

HLO = """
  %all-gather.1 = bf16[1,256,704]{2,1,0:T(8,128)(2,1)} all-gather(%p.1), channel_id=75
  %ar = (f32[64,64]{1,0}, f32[128]{0}) all-reduce(%a, %b), to_apply=%add
  %ags = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%x), dimensions={0}
  %agd = bf16[16,8]{1,0} all-gather-done(%ags)
  %rs = f32[10]{0} reduce-scatter(%y), dimensions={0}
  %dot.3 = f32[64,64]{1,0} dot(%a, %b)
"""


def test_collective_bytes_sum_results_and_count_async_pairs_once():
    moved = collective_bytes(HLO)
    assert moved["all-gather"] == 256 * 704 * 2 + 16 * 8 * 2  # sync result + the start's largest
    assert moved["all-reduce"] == (64 * 64 + 128) * 4  # a combined op: every result
    assert moved["reduce-scatter"] == 40
    assert moved["all-to-all"] == moved["collective-permute"] == 0


def test_estimate_arithmetic():
    chip = Chip("t", 1.0, peak_tflops=1.0, hbm_gbps=1.0, ici_gbps=2.0, dcn_gbps=None, source="x")
    cost = {"flops": 3e12, "bytes accessed": 2e9}
    e = estimate_step(cost, collective_bytes(HLO), chip, chips=4, params=10**6, tokens=10**5)
    assert e.model_flops == 6e11 and e.compute_s == pytest.approx(3.0)  # compiled > model / chips
    assert e.memory_s == pytest.approx(2.0) and e.bound == "compute"
    wire = 2 * e.collective_bytes["all-reduce"] + e.collective_bytes["all-gather"] + 40
    assert e.collective_s == pytest.approx(wire / 2e9)
    assert e.step_s == pytest.approx(3.0 + wire / 2e9)
    assert e.tokens_per_s_per_chip == pytest.approx(10**5 / 4 / e.step_s)
    assert e.mfu(1.0) == pytest.approx(6e11 / e.step_s / 4e12)
    none = collective_bytes("")
    cheap = estimate_step({"flops": 1.0, "bytes accessed": 1.0}, none, chip, 4, 10**6, 10**5)
    assert cheap.compute_s == pytest.approx(6e11 / 4 / 1e12)  # the model's floor
    no_ici = Chip("u", 1.0, 1.0, 1.0, None, None, "y")
    e = estimate_step(cost, collective_bytes(HLO), no_ici, 4, 10**6, 10**5)
    assert math.isnan(e.collective_s) and e.step_s == pytest.approx(3.0)
    assert "n/a (no published ICI bandwidth)" in describe_estimate(e, no_ici)
    with pytest.raises(ValueError, match="^cost:"):
        estimate_step({"flops": 1.0}, none, chip, 1, 1, 1)


def test_chip_table_names_its_sources_and_matches_the_capacity():
    for name, chip in CHIPS.items():
        assert chip.source.startswith("https://cloud.google.com/tpu/docs/")
        assert aot.chip_capacity(f"{name}:2x2") == int(chip.hbm_gib * aot.GIB)
    assert chip_of("v5p:2x2x2").peak_tflops == 459.0
    with pytest.raises(ValueError, match="^topology:"):
        chip_of("v9:2x2")


@needs_libtpu
def test_the_estimate_counts_every_layer_of_a_scanned_model():
    flops = {}
    for layers in (1, 3):
        cfg = load_config(
            ["configs/experiments/tiny_gdn.yaml"],
            [f"model.n_layers={layers}", "model.scan_layers=true"],
        )
        _, _, (train,) = aot.compile_for_topology(cfg, "v5e:2x2", estimate=True)
        e = train.estimate
        assert e is not None and e.chips == 4 and e.flops > 0 and e.hbm_bytes > 0
        assert e.collective_bytes["all-gather"] > 0  # FSDP gathers the parameters
        flops[layers] = e.flops
        text = aot.describe(cfg, "v5e:2x2", {"data": 1, "fsdp": 4}, [train])
        assert "estimate (v5e:" in text and "tokens/s/chip" in text and "MFU" in text
        row = aot.table_row("tiny_gdn.yaml", cfg, "v5e:2x2", {"data": 1, "fsdp": 4}, [train])
        assert row.count("|") == 11 and "%" in row
    # XLA counts a loop body once: with the layers scanned, 1 and 3 layers would cost the same
    assert flops[3] > 2 * flops[1]


@needs_libtpu
def test_an_estimate_that_fails_leaves_the_fit_and_says_why(monkeypatch):
    def out_of_memory(*_):
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")

    monkeypatch.setattr(aot, "estimate_train_step", out_of_memory)
    cfg = load_config(["configs/experiments/tiny_gdn.yaml"], ["model.n_layers=1"])
    _, mesh_shape, (train,) = aot.compile_for_topology(cfg, "v5e:2x2", estimate=True)
    assert train.fits and train.estimate is None
    assert train.estimate_error == "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm"
    text = aot.describe(cfg, "v5e:2x2", mesh_shape, [train])
    assert "(fits)" in text and "estimate: not made (RESOURCE_EXHAUSTED" in text
