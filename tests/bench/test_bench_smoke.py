"""Smoke tests of the Titans and optimizer benchmarks on tiny sizes: they run, report their keys."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nested_jax.bench import optim as bench_optim
from nested_jax.bench import titans as bench_titans


@pytest.mark.slow  # ~100 s on 2 cores (chunked / recurrent Titans memories, L = 1 and 2, three T)
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


@pytest.mark.slow  # ~2–5 min on 2 CPU cores (two GDN train-step compiles)
def test_bench_optim_sweep_keys():
    # two optimizers (each compiles the GDN train step once, the slow part); every optimizer's
    # construction is checked on a small tree in test_bench_optim_every_optimizer_steps
    sweeps = {"adamw": (1e-3, 3e-3), "m3_rms": (1e-2,)}
    res = bench_optim.compare_optimizers(
        steps=3, batch_size=2, seq_len=16, data="synthetic", eval_batches=1, repeats=1,
        d_model=16, n_layers=1, m3_slow_every=2, sweeps=sweeps,
    )  # fmt: skip
    for name in sweeps:
        for key in ("step_ms", "update_ms", "final_train_loss", "eval_loss", "lr"):
            assert math.isfinite(res[f"{key}_{name}"]) and res[f"{key}_{name}"] > 0, (key, name)
        assert res[f"sweep_lrs_{name}"] == list(sweeps[name])
        assert len(res[f"sweep_eval_loss_{name}"]) == len(sweeps[name])
        # best of the sweep: the lowest held-out loss, and its rate
        best = min(res[f"sweep_eval_loss_{name}"])
        assert res[f"eval_loss_{name}"] == best
        assert res[f"lr_{name}"] == sweeps[name][res[f"sweep_eval_loss_{name}"].index(best)]
    assert res["adam_lr"] == res["lr_adamw"]  # the non-matrix AdamW rate: AdamW's best
    assert res["step_time_m3_rms_over_adamw"] > 0
    assert res["update_time_m3_rms_over_adamw"] > 0
    # A first few steps from the same initialisation: every optimizer still near log(vocab).
    for name in sweeps:
        assert abs(res[f"eval_loss_{name}"] - math.log(256)) < 1.5


def test_bench_optim_proteus_overhead_keys():
    pro = bench_optim.proteus_overhead(T=32, H=1, D=16, repeats=1)
    for key in ("proteus_tokens_per_s_E16", "proteus_tokens_per_s_E1", "proteus_tokens_per_s_gdn"):
        assert pro[key] > 0
    assert pro["proteus_E16_over_E1_time"] > 0


def test_bench_optim_every_optimizer_steps():
    """make_optimizer for every name: the rate lives in the state (one update serves all rates),
    matrices and the rest are routed as documented, and a step moves the parameters."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    params = {"embed": jnp.ones((10, 4)), "w": jnp.ones((2, 4, 6)), "scale": jnp.ones(4)}
    grads = jax.tree.map(
        lambda p: jnp.asarray(np.random.default_rng(0).normal(size=p.shape)), params
    )
    for name in bench_optim.OPTIMIZER_NAMES:
        a = bench_optim.make_optimizer(name, 1e-3, steps=10)
        b = bench_optim.make_optimizer(name, 2e-3, steps=10)
        update = jax.jit(a.update)
        sa, sb = a.init(params), b.init(params)
        for _ in range(3):  # past the one warmup step
            ua, sa = update(grads, sa, params)
            ub, sb = update(grads, sb, params)  # a's update, b's state (its rate)
        for key in params:
            assert np.all(np.isfinite(ua[key])) and np.any(ua[key] != 0), (name, key)
        # the swept rate scales the matrices' update (all leaves for adamw)
        np.testing.assert_allclose(ub["w"], 2 * np.asarray(ua["w"]), rtol=1e-4, err_msg=name)
        same = np.allclose(ub["scale"], 2 * np.asarray(ua["scale"]), rtol=1e-4)
        assert same == (name == "adamw"), name  # the others: AdamW at the fixed adam_lr
    with pytest.raises(ValueError, match="name"):
        bench_optim.make_optimizer("sgd", 1e-3, steps=10)


def test_bench_optim_toy_only_json(capsys):
    argv = ["--toy-only", "--toy-steps", "5", "--json", "--optimizers", "adamw,m3,m3_rms_ema"]
    argv += ["--toy-sweep", "m3=1e-4,1e-3"]
    assert bench_optim.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("| m3_rms_ema |") for line in out[:-1])  # the printed table
    res = json.loads(out[-1])
    assert res["toy_steps"] == 5 and math.isfinite(res["toy_initial_loss"])
    assert res["toy_sweep_lrs_m3"] == [1e-4, 1e-3] and len(res["toy_final_loss_m3"]) == 2
    for name in ("adamw", "m3", "m3_rms_ema"):
        assert res[f"toy_best_loss_{name}"] == min(res[f"toy_final_loss_{name}"])
    assert "toy_final_loss_muon" not in res and "eval_loss_adamw" not in res


@pytest.mark.parametrize(
    "argv",
    [["--sweep", "nope=1e-3"], ["--sweep", "m3=abc"], ["--sweep", "m3="], ["--optimizers", "x"]],
)
def test_bench_optim_rejects_bad_sweeps(argv, capsys):
    with pytest.raises(SystemExit):
        bench_optim.main([*argv, "--toy-only"])
    assert "usage" in capsys.readouterr().err


def test_bench_optim_rejects_bad_data():
    with pytest.raises(ValueError, match="data"):
        bench_optim.compare_optimizers(steps=2, data="nope")
    with pytest.raises(ValueError, match="sweeps"):
        bench_optim.compare_optimizers(steps=2, sweeps={"sgd": (0.1,)})
    with pytest.raises(ValueError, match="sweeps"):
        bench_optim.compare_optimizers(steps=2, sweeps={"m3": (-1.0,)})
    with pytest.raises(ValueError, match="adam_lr"):  # AdamW's best rate needs an AdamW sweep
        bench_optim.compare_optimizers(steps=2, sweeps={"m3": (1e-4,)})


def test_bench_hola_keys():
    from nested_jax.bench import hola

    res = hola.run(
        T=128, d_model=32, heads=2, head_dim=16, window=4, block_size=32, model_T=64, repeats=1
    )
    for key in ("mixer_hola_over_gdn_time", "core_hola_over_gdn_time",
                "core_hola_scan_read_over_gdn_time", "model_hola_over_gdn_time"):  # fmt: skip
        assert res[key] > 0
    # the decode state of HOLA and GDN does not grow with the length budget; a KV cache does
    assert res["decode_state_bytes_hola_T2048"] == res["decode_state_bytes_hola_T32768"]
    kv = [res[f"decode_state_bytes_transformer_T{n}"] for n in (2048, 32768)]
    assert kv[1] > kv[0]


def test_bench_momentum_scan_form_equals_the_library_and_reports():
    from nested_jax.bench import momentum
    from nested_jax.bench.titans import titans_inputs
    from nested_jax.core.titans.linear import titans_linear_chunked
    from nested_jax.rules import TitansRule

    xs = titans_inputs(48, H=2, D=8)
    o, M = momentum.titans_linear_by_scan(*xs, chunk_size=16)
    want_o, want = titans_linear_chunked(*xs, rule=TitansRule(memory_chunk=16))
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(M, want.M, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="^q: T = 48"):
        momentum.titans_linear_by_scan(*xs, chunk_size=32)
    res = momentum.run(T=64, chunks=(16,), repeats=1)
    assert res["c16_max_rel_diff"] < 1e-4 and res["c16_temp_bytes_scan"] > 0
    assert res["c16_fwdbwd_scan_over_coefficients"] > 0
