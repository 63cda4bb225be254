"""The Pallas gated delta kernel (``pallas_kernels/gated_delta``) against the core rule (SPEC §1).

Interpret mode on any backend: values and gradients (forward and backward kernels) against
``gated_delta_chunked`` and the per-token ground truth ``gated_delta_recurrent``; TPU lowering by
ahead-of-time compiles on libtpu's abstract topologies (no chip needed; skipped without libtpu).
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax import ops
from nested_jax.core.associative.forms import gated_delta_chunked, gated_delta_recurrent
from nested_jax.core.wy import chunk_flops
from pallas_kernels.gated_delta import BlockSizes, gated_delta_pallas

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="libtpu not installed (pip install -e '.[tpu]'; scripts/test does)"
)
F32_TOL = 1e-4  # max |a − b| / max |b|
BF16_TOL = 2e-2  # bf16 q, k, v and a bf16 output (8 mantissa bits): a few output ulps


def _inputs(T, *, B=2, H=2, K=16, V=16, seed=0, init=False, seg=False, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -0.5 * jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = jax.random.normal(ks[5], (B, H, K, V)) if init else None
    sid = None
    if seg:  # a few documents per row, one of them starting at a chunk boundary (t = 16)
        starts = jax.random.bernoulli(ks[6], 0.06, (B, T)).at[:, 16 % T].set(True)
        sid = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return (q, k, v, g, beta), s0, sid


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _loss_and_grads(fn, args, s0, sid, **kw):
    """Values and gradients w.r.t. q, k, v, g, beta (and initial_state) of a fixed readout."""

    def loss(args, s0):
        o, s = fn(*args, initial_state=s0, segment_ids=sid, **kw)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(jnp.sin(s)), (o, s)

    argnums = (0, 1) if s0 is not None else 0
    (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(args, s0)
    return out, grads


def _check_case(T, C, init, seg, K=16, V=16, against=("chunked",)):
    args, s0, sid = _inputs(T, K=K, V=V, init=init, seg=seg)
    out, grads = _loss_and_grads(
        gated_delta_pallas, args, s0, sid, block_sizes=BlockSizes(C), interpret=True
    )
    refs = {
        "chunked": lambda *a, **kw: gated_delta_chunked(*a, chunk_size=C, **kw),
        "recurrent": gated_delta_recurrent,
    }
    errors = {}
    for name in against:
        ref_out, ref_grads = _loss_and_grads(refs[name], args, s0, sid)
        leaves = jax.tree.leaves((out, grads))
        for i, (a, b) in enumerate(zip(leaves, jax.tree.leaves((ref_out, ref_grads)), strict=True)):
            errors[f"{name}[{i}]"] = _rel(a, b)
            assert a.shape == b.shape and a.dtype == b.dtype
    assert out[0].dtype == args[2].dtype and out[1].dtype == jnp.float32
    bad = {n: e for n, e in errors.items() if not e <= F32_TOL}
    assert not bad, bad


@pytest.mark.parametrize(
    "T, C, init, seg, against",
    [
        # resets (one at a chunk boundary) restarting from a non-zero initial state, T % C ≠ 0
        (63, 16, True, True, ("chunked", "recurrent")),
        (200, 64, False, False, ("chunked",)),
    ],
)
def test_matches_core_values_and_grads(T, C, init, seg, against):
    _check_case(T, C, init, seg, against=against)


def test_k_differs_from_v():
    _check_case(24, 8, False, False, K=16, V=24)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("seg", [False, True])
def test_matches_core_grid(T, C, init, seg):
    _check_case(T, C, init, seg, K=32, V=24, against=("chunked", "recurrent"))


def test_bf16_operands():
    args, s0, sid = _inputs(63, init=True, seg=True, dtype=jnp.bfloat16)
    o, s = gated_delta_pallas(
        *args, initial_state=s0, segment_ids=sid, block_sizes=BlockSizes(16), interpret=True
    )
    # ground truth on the same (bf16-exact) values in f32
    f32 = [x.astype(jnp.float32) for x in args]
    o_ref, s_ref = gated_delta_recurrent(*f32, initial_state=s0, segment_ids=sid)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert _rel(o, o_ref) < BF16_TOL
    assert _rel(s, s_ref) < F32_TOL  # the state never leaves f32


@pytest.mark.parametrize("chunk", [0, -8, 12, 8.0, True, None])
def test_block_sizes_validation(chunk):
    """``BlockSizes`` refuses a chunk that is not a positive multiple of 8 (the Titans kernel's
    chunk is its rule's ``memory_chunk``, checked in ``test_titans_linear_pallas``)."""
    with pytest.raises(ValueError, match=r"^BlockSizes: chunk must be a positive multiple of 8"):
        BlockSizes(chunk=chunk)


def test_block_sizes_default_and_frozen():
    bs = BlockSizes.get_default()
    assert bs == BlockSizes(chunk=64)
    with pytest.raises(AttributeError):
        bs.chunk = 8  # type: ignore[misc]
    args, _, _ = _inputs(8)
    with pytest.raises(ValueError, match="block_sizes must be a BlockSizes"):
        gated_delta_pallas(*args, block_sizes=64, interpret=True)


def test_ops_dispatch_routes_delta_rules_to_the_kernel():
    (q, k, v, g, beta), s0, sid = _inputs(40, init=True, seg=True)
    kw = dict(initial_state=s0, segment_ids=sid, chunk_size=16)
    for op, args in ((ops.gated_delta, (q, k, v, g, beta)), (ops.delta_rule, (q, k, v, beta))):
        o_p, s_p = op(*args, impl="pallas", **kw)
        o_c, s_c = op(*args, impl="chunked", **kw)
        assert _rel(o_p, o_c) < F32_TOL and _rel(s_p, s_c) < F32_TOL
    with pytest.raises(ValueError, match="impl='pallas' is not implemented yet"):
        ops.linear_attention(q, k, v, g, impl="pallas")
    with pytest.raises(ValueError, match="BlockSizes: chunk"):
        ops.gated_delta(q, k, v, g, beta, impl="pallas", chunk_size=12)


# --------------------------------------------------------------------------------------------------
# TPU lowering: ahead-of-time compiles for abstract topologies (libtpu on this CPU)
# --------------------------------------------------------------------------------------------------


def tpu_batch_mesh(topology):
    """``(mesh, sds)`` for an ahead-of-time TPU compile on this CPU: the abstract devices of
    ``topology`` (libtpu) on one ``"batch"`` axis, and ``sds(shape, dtype)`` an abstract array
    split over it along its first dimension."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # see nested_jax.train.aot
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = Mesh(np.asarray(devices), ("batch",))

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("batch")))

    return mesh, sds


def _compile_on(topology, head_dim, resets):
    """Compiles the kernels (interpret=False) under ``shard_map`` over the batch, forward and
    forward+backward, bf16 q, k, v and an initial state (``resets``: segment_ids too, the restart
    path); returns ``{"fwd" | "grad": compiled}``."""
    from jax.sharding import PartitionSpec as P

    mesh, sds = tpu_batch_mesh(topology)
    B, T, H, D = 2 * mesh.devices.size, 256, 2, head_dim

    bf, f32 = jnp.bfloat16, jnp.float32
    specs = (
        *(sds((B, T, H, D), bf) for _ in range(3)),
        sds((B, T, H), f32),
        sds((B, T, H), f32),
        sds((B, H, D, D), f32),
        sds((B, T), jnp.int32),
    )

    def local(q, k, v, g, beta, s0, sid):
        sid = sid if resets else None
        return gated_delta_pallas(q, k, v, g, beta, initial_state=s0, segment_ids=sid)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("batch"),) * 7, out_specs=P("batch"))

    def loss(*a):
        o, s = sharded(*a)
        return jnp.sum(o.astype(f32) ** 2) + jnp.sum(s**2)

    fns = {"fwd": sharded, "grad": jax.grad(loss, argnums=range(6))}
    lowered = {name: jax.jit(fn).lower(*specs) for name, fn in fns.items()}
    return {name: (low.as_text(), low.compile()) for name, low in lowered.items()}


def _check_compiles(topology, head_dim, resets):
    for name, (text, compiled) in _compile_on(topology, head_dim, resets).items():
        # (compiled.as_text() can fail to re-read libtpu's async ops; the lowering is checked)
        calls = {"fwd": ["gated_delta_fwd"], "grad": ["gated_delta_fwd", "gated_delta_bwd"]}[name]
        for kernel in calls:  # Mosaic kernels, not the interpreter
            assert "tpu_custom_call" in text and kernel in text, (name, kernel)
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"{topology} D={head_dim} resets={resets} {name}: temp {temp} B")
        # the kernels declare their cost (XLA counts nothing inside a custom call): per chip, two
        # rows of B·H = 4 (T = 256, chunk 64) at least the forward's matmul FLOPs
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        declared = 2 * 2 * (256 // 64) * chunk_flops(64, head_dim, head_dim, backward=False)
        assert cost["flops"] >= declared, (name, cost["flops"], declared)


@needs_libtpu
def test_compiles_for_tpu_v5e():
    _check_compiles("v5e:2x2", 128, resets=True)


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("resets", [False, True])
def test_compiles_for_tpu(topology, head_dim, resets):
    _check_compiles(topology, head_dim, resets)
