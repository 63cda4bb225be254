"""Context parallelism (core/context.py): the time axis split over a mesh axis equals the
single-device chunked rule on the whole sequence, values and gradients (issue 15)."""

import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from nested_jax.core import gated_delta_chunked, titans_linear_chunked
from nested_jax.core.context import gated_delta_context_parallel, titans_linear_context_parallel
from nested_jax.core.titans.linear import TitansLinearState
from nested_jax.rules import TitansRule

SEQ = P(None, "seq")  # [B, T, ...] with T split over "seq"


def _seq_mesh(devices: int):
    auto = (jax.sharding.AxisType.Auto,)
    return jax.make_mesh((devices,), ("seq",), axis_types=auto, devices=jax.devices()[:devices])


def _gdn_inputs(key, B=2, T=48, H=3, K=8, V=6):
    kq, kk, kv, kg, kb, ks = jax.random.split(key, 6)
    q = jax.random.normal(kq, (B, T, H, K))
    k = jax.random.normal(kk, (B, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(kv, (B, T, H, V))
    g = -jax.nn.softplus(jax.random.normal(kg, (B, T, H)))  # log decay ≤ 0
    beta = jax.nn.sigmoid(jax.random.normal(kb, (B, T, H)))
    s0 = 0.3 * jax.random.normal(ks, (B, H, K, V))
    return q, k, v, g, beta, s0


def _titans_inputs(key, B=2, T=48, H=2, K=6, V=5):
    kq, kk, kv, kt, ke, ka, km, ks = jax.random.split(key, 8)
    q = jax.random.normal(kq, (B, T, H, K)) * 0.5
    k = jax.random.normal(kk, (B, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(kv, (B, T, H, V))
    gate = lambda key, lo, hi: lo + (hi - lo) * jax.random.uniform(key, (B, T, H))  # noqa: E731
    theta, eta, alpha = gate(kt, 0.05, 0.5), gate(ke, 0.5, 0.95), gate(ka, 0.0, 0.1)
    state = TitansLinearState(
        0.3 * jax.random.normal(km, (B, H, K, V)), 0.1 * jax.random.normal(ks, (B, H, K, V))
    )
    return q, k, v, theta, eta, alpha, state


def _loss(out):
    o, final = out
    weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
    return jnp.sum(o * weights) + sum(jnp.sum(jnp.sin(s)) for s in jax.tree.leaves(final))


def _sharded(fn, mesh, seq_args: int, rest: int):
    """``fn`` under shard_map: the first ``seq_args`` operands split on time, the ``rest`` whole."""
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(SEQ,) * seq_args + (P(),) * rest,
        out_specs=(SEQ, P()),
        check_vma=True,
    )


@pytest.mark.parametrize(
    ("devices", "chunk", "fold"),
    [(8, 16, "gather"), (2, 5, "gather"), (8, 16, "prefix"), (3, 5, "prefix")],
    ids=["P8-C16", "P2-C5", "P8-C16-prefix", "P3-C5-prefix"],
)
def test_gdn_context_parallel_equals_single_device(devices, chunk, fold):
    q, k, v, g, beta, s0 = _gdn_inputs(jax.random.key(0))
    args = (q, k, v, g, beta, s0)

    def single(q, k, v, g, beta, s0):
        return gated_delta_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)

    def local(q, k, v, g, beta, s0):
        return gated_delta_context_parallel(
            q, k, v, g, beta, axis_name="seq", initial_state=s0, chunk_size=chunk, fold=fold
        )

    split = jax.jit(_sharded(local, _seq_mesh(devices), 5, 1))
    (o_ref, s_ref), (o, s) = single(*args), split(*args)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, rtol=2e-5, atol=2e-5)
    grads_ref = jax.grad(lambda *a: _loss(single(*a)), argnums=range(6))(*args)
    grads = jax.jit(jax.grad(lambda *a: _loss(split(*a)), argnums=range(6)))(*args)
    for name, gr, gs in zip("q k v g beta s0".split(), grads_ref, grads, strict=True):
        np.testing.assert_allclose(gs, gr, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize(
    ("devices", "rbw", "fold"),
    [(4, False, "gather"), (2, True, "gather"), (4, False, "prefix"), (3, True, "prefix")],
    ids=["P4-read_after", "P2-read_before", "P4-read_after-prefix", "P3-read_before-prefix"],
)
def test_titans_linear_context_parallel_equals_single_device(devices, rbw, fold):
    q, k, v, theta, eta, alpha, state = _titans_inputs(jax.random.key(1))
    chunk = 4
    opts = dict(rule=TitansRule(memory_chunk=chunk, read_before_write=rbw))

    def single(q, k, v, theta, eta, alpha, M, S):
        o, st = titans_linear_chunked(
            q, k, v, theta, eta, alpha, initial_state=TitansLinearState(M, S), **opts
        )
        return o, tuple(st)

    def local(q, k, v, theta, eta, alpha, M, S):
        o, st = titans_linear_context_parallel(
            q, k, v, theta, eta, alpha, axis_name="seq", initial_state=(M, S), fold=fold, **opts
        )
        return o, tuple(st)

    args = (q, k, v, theta, eta, alpha, *state)
    split = jax.jit(_sharded(local, _seq_mesh(devices), 6, 2))
    (o_ref, s_ref), (o, s) = single(*args), split(*args)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    for a, b in zip(s, s_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    names = "q k v theta eta alpha M S".split()
    grads_ref = jax.grad(lambda *a: _loss(single(*a)), argnums=range(8))(*args)
    grads = jax.jit(jax.grad(lambda *a: _loss(split(*a)), argnums=range(8)))(*args)
    for name, gr, gs in zip(names, grads_ref, grads, strict=True):
        np.testing.assert_allclose(gs, gr, rtol=1e-4, atol=1e-4, err_msg=name)


def test_one_device_is_the_plain_rule():
    """A one-device 'seq' axis folds nothing: the augmented pass alone must equal the rule."""
    q, k, v, g, beta, s0 = _gdn_inputs(jax.random.key(2), T=20)
    local = functools.partial(gated_delta_context_parallel, axis_name="seq", chunk_size=8)
    o, s = jax.jit(_sharded(local, _seq_mesh(1), 5, 0))(q, k, v, g, beta)
    o_ref, s_ref = gated_delta_chunked(q, k, v, g, beta, chunk_size=8)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, rtol=2e-5, atol=2e-5)


def test_titans_context_parallel_rejects_a_chunk_that_splits_devices():
    q, k, v, theta, eta, alpha, _ = _titans_inputs(jax.random.key(3), T=10)
    xs = (q, k, v, theta, eta, alpha)
    with pytest.raises(ValueError, match="memory_chunk must divide the local length T_loc = 10"):
        titans_linear_context_parallel(*xs, axis_name="seq", rule=TitansRule(memory_chunk=4))
    for field in ("grad_clip", "grad_horizon"):  # not affine / not cut across devices
        with pytest.raises(ValueError, match=rf"rule\.{field} must be 0"):
            rule = TitansRule(memory_chunk=5, **{field: 10 if field == "grad_clip" else 5})
            titans_linear_context_parallel(*xs, axis_name="seq", rule=rule)


def test_gdn_context_parallel_names_a_bad_argument():
    q, k, v, g, beta, _ = _gdn_inputs(jax.random.key(4), T=8)
    with pytest.raises(ValueError, match="gated_delta_context_parallel: beta must have shape"):
        gated_delta_context_parallel(q, k, v, g, beta[:, :4], axis_name="seq")
    local = functools.partial(gated_delta_context_parallel, axis_name="seq", fold="tree")
    with pytest.raises(ValueError, match="^fold: expected one of"):
        jax.jit(_sharded(local, _seq_mesh(2), 5, 0))(q, k, v, g, beta)


@pytest.mark.parametrize("fold", ["gather", "prefix"])
def test_gdn_context_parallel_with_packed_documents(fold, devices=4):
    """Documents that start mid-device, at a device boundary and span devices: equal to the
    single-device rule with the same segment ids (values and gradients)."""
    q, k, v, g, beta, _ = _gdn_inputs(jax.random.key(5), T=48)
    # T_loc = 12: starts at 5 (mid device 0), 12 (a boundary), 30 (mid device 2); row 1 has one
    # document spanning every device.
    ids = np.zeros((2, 48), np.int32)
    for start in (5, 12, 30):
        ids[0, start:] += 1
    ids = jnp.asarray(ids)
    args = (q, k, v, g, beta, ids)

    def single(q, k, v, g, beta, ids):
        return gated_delta_chunked(q, k, v, g, beta, segment_ids=ids, chunk_size=8)

    def local(q, k, v, g, beta, ids):
        return gated_delta_context_parallel(
            q, k, v, g, beta, axis_name="seq", segment_ids=ids, chunk_size=8, fold=fold
        )

    split = jax.jit(_sharded(local, _seq_mesh(devices), 6, 0))
    (o_ref, s_ref), (o, s) = single(*args), split(*args)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, rtol=2e-5, atol=2e-5)
    grads_ref = jax.grad(lambda *a: _loss(single(*a)), argnums=range(5))(*args)
    grads = jax.jit(jax.grad(lambda *a: _loss(split(*a)), argnums=range(5)))(*args)
    for name, gr, gs in zip("q k v g beta".split(), grads_ref, grads, strict=True):
        np.testing.assert_allclose(gs, gr, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["gdn", "titans"])
def test_context_parallel_at_4096_tokens_on_8_devices(rule):
    """Issue 15's acceptance size: T = 4096 over 8 devices, outputs, states and every gradient
    (``nested-jax bench context`` prints the same errors and the memory table)."""
    from nested_jax.bench.context import build_parser, check_equal

    errors = check_equal(rule, build_parser().parse_args([]))
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install -e '.[tpu]'; scripts/test does)",
)
def test_bench_context_compiles_both_folds_for_a_tpu_slice(capsys):
    """``bench context --topology``: the context-parallel fwd+bwd compiled for a TPU slice's
    chips (libtpu AOT), both folds, memory per device."""
    from nested_jax.bench.context import main

    argv = ["--topology", "v5e:2x2", "--devices", "4", "--seq-len", "256", "--rules", "gdn"]
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["topology"] == "v5e:2x2" and "gdn_plain_P1_temp_bytes" not in res
    for impl in ("cp", "cp_prefix"):
        assert res[f"gdn_{impl}_P4_temp_bytes"] > 0
