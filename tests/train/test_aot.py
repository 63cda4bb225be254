"""``nested-jax aot``: real TPU executables compiled on this CPU (libtpu), memory per chip."""

from __future__ import annotations

import importlib.util
import re

import pytest

from nested_jax.train import aot
from nested_jax.train.config import load_config

# One worker runs the module: its fixture (a compile / a trained run) is built once.
pytestmark = pytest.mark.xdist_group("aot")
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="libtpu not installed (pip install -e '.[tpu]'; scripts/test does)"
)

# A small Transformer (it compiles fastest) whose tied head makes the logits the biggest
# activation (vocab 8192): were the logits or the residual stream sharded over features instead of
# the batch, every chip would hold partial sums for the GLOBAL batch (measured without the
# constraints: 454 MiB per chip on 4 chips, 1604 MiB on 16).
SMALL = [
    "model.name=transformer",
    "model.vocab_size=8192",
    "model.d_model=256",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.head_dim=128",
    "model.dtype=bfloat16",
    "data.tokenizer=byte",
    "data.seq_len=256",
    "data.batch_size=8",
]
PER_CHIP = 3  # global batch 12 on 4 chips, 48 on 16: sizes no other dimension has


def _dims(hlo: str) -> set[int]:
    """Every dimension size of every array shape in an HLO text."""
    return {int(d) for shape in re.findall(r"\[([\d,]+)\]", hlo) for d in shape.split(",") if d}


def test_count_collectives_reads_optimized_hlo():
    hlo = """
  %all-gather-start.1 = (f32[4], f32[16]) all-gather-start(f32[4] %p), replica_groups={{0,1}}
  %all-gather-done.1 = f32[16] all-gather-done(%all-gather-start.1)
  %ar = f32[8] all-reduce(f32[8] %x), to_apply=%add
  %rs.2 = f32[2] reduce-scatter(f32[8] %y), dimensions={0}
  %cp = f32[8] collective-permute(f32[8] %z), source_target_pairs={{0,1}}
"""
    counts = aot.count_collectives(hlo)
    assert counts == {
        "all-gather": 1,
        "all-reduce": 1,
        "reduce-scatter": 1,
        "all-to-all": 0,
        "collective-permute": 1,
    }


def test_unknown_generation_and_missing_libtpu_are_one_line(monkeypatch, capsys):
    with pytest.raises(aot.AotError, match=r"--topology: unknown TPU generation 'v9'"):
        aot.chip_capacity("v9:2x2")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(aot.AotError, match=r"pip install -e '\.\[tpu\]'"):
        aot.topology_devices("v5e:2x2")
    code = aot.main(["--config", "configs/experiments/tiny_gdn.yaml", "--topology", "v5e:2x2"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aot: libtpu is not installed")


def test_a_config_without_topology_is_refused(capsys):
    assert aot.main(["--config", "configs/experiments/tiny_gdn.yaml"]) == 2
    assert "mesh.topology:" in capsys.readouterr().err


def test_per_device_batch_counts_batch_shards_not_tensor_copies():
    cfg = load_config([], ["mesh.tensor=2", "mesh.fsdp=-1"])
    assert aot.with_per_device_batch(cfg, 4, 16).data.batch_size == 4 * 8
    cfg = load_config([], ["mesh.slices=2", "mesh.fsdp=-1"])
    assert aot.with_per_device_batch(cfg, 4, 16).data.batch_size == 4 * 16


@pytest.fixture(scope="module")
def small_on_2x2():
    cfg = load_config([], SMALL)
    return aot.compile_for_topology(
        cfg, "v5e:2x2", per_device_batch=PER_CHIP, eval_step=True, keep_text=True
    )


@needs_libtpu
def test_tiny_model_compiles_for_v5e_2x2_and_fits(small_on_2x2):
    cfg, mesh_shape, results = small_on_2x2
    assert mesh_shape == {"data": 1, "fsdp": 4, "seq": 1, "tensor": 1}
    assert cfg.data.batch_size == 4 * PER_CHIP
    assert [r.step for r in results] == ["train", "eval"]
    for r in results:
        assert r.fits and not r.error
        assert 0 < r.peak < r.capacity == 16 * aot.GIB
        assert r.temp > 0 and r.argument > 0
    train = results[0]
    assert train.alias > 0  # the donated train state is updated in place
    # FSDP: parameters are gathered for the forward and gradients reduced.
    assert train.collectives.get("all-gather", 0) > 0
    text = aot.describe(cfg, "v5e:2x2", mesh_shape, results)
    assert "train: peak" in text and "(fits)" in text and "collectives:" in text


@needs_libtpu
def test_memory_per_chip_does_not_grow_with_the_global_batch(small_on_2x2):
    """Fixed per-chip batch on 4 and 16 chips: no buffer on a chip holds the global batch, and
    per-chip memory stays within XLA's scheduling noise (at this toy size one local logits buffer,
    32 MiB, is fused on one topology and materialised on the other; the < 10 % figure is measured
    on the pod presets, README "TPU slices")."""
    _, _, (train4, _) = small_on_2x2
    cfg = load_config([], SMALL)
    _, _, (train16,) = aot.compile_for_topology(
        cfg, "v5e:4x4", per_device_batch=PER_CHIP, keep_text=True
    )
    assert train16.fits
    for result, global_batch in ((train4, 4 * PER_CHIP), (train16, 16 * PER_CHIP)):
        dims = _dims(result.hlo)
        assert PER_CHIP in dims  # the local batch is there ...
        assert global_batch not in dims  # ... the global one never
    assert train16.peak < 1.5 * train4.peak, (train4.peak, train16.peak)
    # Unpinned, the 16-chip program needed 1604 MiB of temporaries (global-batch logits).
    assert train16.temp < 256 * 2**20


@needs_libtpu
def test_cli_table_writes_markdown_and_exit_code_follows_the_fit(tmp_path, capsys):
    out = tmp_path / "table.md"
    small = [o for o in SMALL if not o.startswith("model.n_layers")] + ["model.n_layers=1"]
    overrides = [x for o in small + ["mesh.topology=v5e:2x2"] for x in ("--set", o)]
    table_args = ["--table", "configs/experiments/tiny_gdn.yaml", "--markdown", str(out)]
    code = aot.main(table_args + overrides)
    assert code == 0
    table = out.read_text()
    assert table.startswith("| preset | topology |")
    assert "| `tiny_gdn` | v5e:2x2 | 8 (2/chip) |" in table and "| yes |" in table
    # A batch far too large for 16 GiB chips: the compiler refuses, the command says so and exits 1.
    huge = overrides + ["--set", "data.batch_size=16384"]
    code = aot.main(["--config", "configs/experiments/tiny_gdn.yaml"] + huge)
    assert code == 1
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    assert captured.err.strip().splitlines()[-1].startswith("aot: does not fit")
