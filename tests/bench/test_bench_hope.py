"""Smoke test of ``nested-jax bench hope`` (tiny sizes): the JSON keys exist and are finite."""

import json
import math

import pytest

from nested_jax.bench import hope as bench_hope


@pytest.mark.slow  # ~4 min on 2 CPU cores: five tiny-LM fwd+bwd compiles (Hope, Titans, GDN, sweep)
def test_bench_hope_json_keys(capsys):
    argv = ["--seq-len", "8", "--batch", "1", "--d-model", "16", "--layers", "1", "--heads", "2"]
    argv += ["--sweep", "1:1,4:2", "--repeats", "1", "--json"]
    assert bench_hope.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "matmul_gflops",
        "model_tokens_per_s_hope",
        "model_tokens_per_s_titans_lmm",
        "model_tokens_per_s_gdn",
        "model_params_hope",
        "model_hope_over_gdn_time",
        "model_hope_over_titans_lmm_time",
        "model_tokens_per_s_hope_store_all",
        "model_hope_store_all_over_titans_lmm_time",
        "model_hope_scan_over_titans_lmm_time",
        "sweep_tokens_per_s_cm1_co1",
        "sweep_tokens_per_s_cm4_co2",
        "sweep_time_over_first_cm4_co2",
        "hope_ffn",
        "wall_s",
    ):
        assert key in out, key
    assert out["T"] == 8 and out["sweep_time_over_first_cm1_co1"] == 1.0
    for key, value in out.items():
        if isinstance(value, float):
            assert math.isfinite(value) and value > 0, key


def test_bench_hope_bad_sweep():
    with pytest.raises(ValueError, match="--sweep"):
        bench_hope._parse_sweep("4-2")
