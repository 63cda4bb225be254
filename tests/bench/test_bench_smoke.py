"""Smoke tests of the Titans and optimizer benchmarks on tiny sizes: they run, report their keys."""

from __future__ import annotations

import json
import math

import pytest

from nested_jax.bench import optim as bench_optim
from nested_jax.bench import titans as bench_titans


def test_bench_titans_json_keys(capsys):
    argv = ["--seq-len", "32", "--mem-seq-lens", "16,32", "--dim", "8", "--heads", "1"]
    argv += ["--chunk-size", "8", "--repeats", "1", "--skip-models", "--json"]
    assert bench_titans.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "matmul_gflops",
        "titans_L1_chunked_over_recurrent_speedup",
        "titans_L2_chunked_over_recurrent_speedup",
        "core_tokens_per_s_gdn",
        "core_tokens_per_s_titans_L1",
        "core_tokens_per_s_titans_L2",
        "titans_lmm_registered",
        "temp_bytes_L1_T32",
        "temp_bytes_per_token_L2_T16",
        "temp_bytes_slope_L1_T16_32",
        "wall_s",
    ):
        assert key in out, key
    assert out["T"] == 32 and out["chunk_size"] == 8
    for key, value in out.items():
        if isinstance(value, float):
            assert math.isfinite(value) and value > 0, key
    # More tokens never need less scratch memory.
    assert out["temp_bytes_L2_T32"] >= out["temp_bytes_L2_T16"] > 0


def test_bench_optim_keys_and_proteus():
    res = bench_optim.compare_optimizers(
        steps=3, batch_size=2, seq_len=16, data="synthetic", eval_batches=1, repeats=1,
        d_model=16, n_layers=1, m3_slow_every=2,
    )  # fmt: skip
    for name in bench_optim.OPTIMIZER_NAMES:
        for key in ("step_ms", "update_ms", "final_train_loss", "eval_loss", "lr"):
            assert math.isfinite(res[f"{key}_{name}"]) and res[f"{key}_{name}"] > 0, (key, name)
    for name in ("muon", "m3"):
        assert res[f"step_time_{name}_over_adamw"] > 0
        assert res[f"update_time_{name}_over_adamw"] > 0
    # A first few steps from the same initialisation: every optimizer still near log(vocab).
    for name in bench_optim.OPTIMIZER_NAMES:
        assert abs(res[f"eval_loss_{name}"] - math.log(256)) < 1.5
    pro = bench_optim.proteus_overhead(T=32, H=1, D=16, repeats=1)
    for key in ("proteus_tokens_per_s_E16", "proteus_tokens_per_s_E1", "proteus_tokens_per_s_gdn"):
        assert pro[key] > 0
    assert pro["proteus_E16_over_E1_time"] > 0


def test_bench_optim_rejects_bad_data():
    with pytest.raises(ValueError, match="data"):
        bench_optim.compare_optimizers(steps=2, data="nope")
