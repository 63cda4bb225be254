"""nested_jax.ops dispatch (explicit impl, no silent switching) and the benchmark machinery."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax import ops
from nested_jax.bench import common
from nested_jax.bench import core as bench_core
from nested_jax.core.associative import forms as A


def _inputs(B=1, T=20, H=1, K=4, V=4):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, H, K)).astype(np.float32)
    k = rng.normal(size=(B, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, V)).astype(np.float32)
    g = -rng.uniform(0, 0.5, size=(B, T, H)).astype(np.float32)
    beta = rng.uniform(size=(B, T, H)).astype(np.float32)
    s0 = rng.normal(size=(B, H, K, V)).astype(np.float32)
    return q, k, v, g, beta, s0


CASES = [
    (ops.linear_attention, A.linear_attention_recurrent, A.linear_attention_chunked, "qkvg"),
    (ops.delta_rule, A.delta_rule_recurrent, A.delta_rule_chunked, "qkvb"),
    (ops.gated_delta, A.gated_delta_recurrent, A.gated_delta_chunked, "qkvgb"),
]


@pytest.mark.parametrize("op,rec,chk,sig", CASES, ids=lambda c: getattr(c, "__name__", c))
def test_dispatch_routes_to_the_named_form(op, rec, chk, sig):
    q, k, v, g, beta, s0 = _inputs()
    pick = {"q": q, "k": k, "v": v, "g": g, "b": beta}
    args = [pick[c] for c in sig]
    o_r, S_r = op(*args, initial_state=s0, impl="recurrent")
    o_ref, S_ref = rec(*args, initial_state=s0)
    np.testing.assert_array_equal(o_r, o_ref)
    np.testing.assert_array_equal(S_r, S_ref)
    o_c, S_c = op(*args, initial_state=s0, impl="chunked", chunk_size=8)
    o_ref, S_ref = chk(*args, initial_state=s0, chunk_size=8)
    np.testing.assert_array_equal(o_c, o_ref)
    np.testing.assert_array_equal(S_c, S_ref)
    # the two implementations agree (SPEC §0)
    np.testing.assert_allclose(o_c, o_r, atol=1e-4)


@pytest.mark.parametrize("op", [ops.linear_attention, ops.delta_rule, ops.gated_delta])
def test_dispatch_rejects_unavailable_impls(op):
    q, k, v, g, beta, _ = _inputs()
    args = {
        ops.linear_attention: (q, k, v, g),
        ops.delta_rule: (q, k, v, beta),
        ops.gated_delta: (q, k, v, g, beta),
    }[op]
    if op is ops.linear_attention:  # the only linear rule without a kernel yet
        with pytest.raises(ValueError, match="impl='pallas' is not implemented yet"):
            op(*args, impl="pallas")
    with pytest.raises(ValueError, match="impl must be one of"):
        op(*args, impl="auto")


def test_time_interleaved_and_temp_bytes():
    calls = []

    def make(name):
        def f():
            calls.append(name)
            return jnp.zeros(())

        return f

    t = common.time_interleaved({"a": make("a"), "b": make("b")}, repeats=5, warmup=1)
    assert set(t) == {"a", "b"} and all(v > 0 for v in t.values())
    assert calls == ["a", "b"] * 6  # warm-up round, then strictly alternating rounds
    with pytest.raises(ValueError, match="repeats"):
        common.time_interleaved({"a": make("a")}, repeats=0)

    def f(x):
        return jnp.sum(jnp.tanh(x @ x.T))

    x = jnp.ones((64, 64))
    tb = common.temp_bytes(jax.jit(f), x)
    assert tb >= 0
    assert common.temp_bytes(jax.jit(f).lower(x).compile()) == tb
    assert common.matmul_gflops(n=64, repeats=1) > 0


def test_bench_core_tiny_json(capsys):
    rc = bench_core.main(
        ["--seq-lens", "24", "--heads", "1", "--dim", "8", "--chunk-size", "8"]
        + ["--repeats", "1", "--json"]
    )
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("[bench core] T=24") for line in lines[:-1])
    result = json.loads(lines[-1])
    for key in (
        "matmul_gflops",
        "gdn_chunked_over_recurrent_speedup_T24",
        "gdn_recurrent_over_chunked_temp_bytes_T24",
        "gdn_over_attention_speedup_T24",
        "gdn_gflops_T24",
    ):
        assert key in result and result[key] > 0, key


def test_chunked_gdn_flops_formula():
    # per chunk·head, C = K = V = d: forward 10C²d + 6Cd² + (2/3)C³, backward 20C²d + 12Cd²
    C = d = 4
    per_chunk = 10 * C * C * d + 6 * C * d * d + (2 / 3) * C**3 + 20 * C * C * d + 12 * C * d * d
    assert bench_core.chunked_gdn_flops(T=9, B=2, H=3, K=d, V=d, C=C) == pytest.approx(
        3 * 2 * 3 * per_chunk
    )
