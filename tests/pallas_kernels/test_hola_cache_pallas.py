"""The Pallas HOLA cache read (``pallas_kernels/hola_cache``) against the XLA cache path (SPEC §5).

Interpret mode on any backend: the kernel against ``core.hola.cache.read_blocks`` (its contract)
on random stacked caches, and ``hola_forward(kernels=HolaKernels(cache_read=kernel))`` (the
two-phase cache path: merges first, then one read of all blocks) against ``hola_forward`` (the XLA
block scan), values and gradients (q, k, v, g, β, γ_q, γ_k, the sink, the gate and the initial
state's float leaves) at awkward lengths, with and without an initial state, ``C`` and ``w`` on
and off multiples of 8 (the entry pads them). ``ops.hola(impl="pallas")`` routes one stream to
the kernel and keeps the XLA scan for packed rows and ``cumulative_attention``. TPU lowering by
ahead-of-time compiles on libtpu's abstract topologies (no chip needed; skipped without libtpu).
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.hola.cache import read_blocks
from nested_jax.core.hola.forward import HolaKernels, hola_forward
from nested_jax.ops import hola as ops_hola
from pallas_kernels.hola_cache import BlockSizes, hola_cache_read_pallas

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="libtpu not installed (pip install -e '.[tpu]'; scripts/test does)"
)
F32_TOL = 1e-4  # max |a − b| / max |b|, per output and per gradient
B, H, K, V = 2, 2, 16, 12
SEQ = ("q", "k", "v", "g", "beta")
_STATE_GRAD = ("S", "cache_k", "cache_v", "block_k", "block_v")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _seq(T, seed=0):
    rng = np.random.default_rng(seed)
    f = np.float32
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return dict(
        q=jnp.asarray(unit(rng.normal(size=(B, T, H, K))), f),
        k=jnp.asarray(unit(rng.normal(size=(B, T, H, K))), f),
        v=jnp.asarray(rng.normal(size=(B, T, H, V)), f),
        g=jnp.asarray(-rng.uniform(0.01, 0.5, (B, T, H)), f),
        beta=jnp.asarray(rng.uniform(0.0, 1.0, (B, T, H)), f),
    )


def _params(seed=3):
    rng = np.random.default_rng(seed)
    f = np.float32
    return ops_hola.HolaReadParams(
        gamma_q=jnp.asarray(rng.uniform(0.5, 2.0, (H, K)), f),
        gamma_k=jnp.asarray(rng.uniform(0.5, 2.0, (H, K)), f),
        sink_logit=jnp.asarray(rng.normal(size=(H,)), f),
        gate_logit=jnp.asarray(rng.normal(size=(H,)), f),
    )


# --------------------------------------------------------------------------------------------------
# The kernel against read_blocks
# --------------------------------------------------------------------------------------------------


def kernel_read(**kw):
    """The kernel under ``read_blocks``'s contract ``(qh, kh, vh, (ck, cv, cval), filled, params,
    read_norm, cache_scale)`` (``ops.hola`` wraps it the same way, per mesh shard)."""

    def read(qh, kh, vh, cache, filled, params, read_norm, cache_scale):
        ck, cv, cval = cache
        return hola_cache_read_pallas(
            qh, kh, vh, ck, cv, cval, filled, params.gamma_q, params.gamma_k, params.sink_logit,
            read_norm, cache_scale, interpret=True, **kw,
        )  # fmt: skip

    return read


def _read_case(n, C, W, block_q, read_norm, seed=0):
    """Random slots, stacked caches with invalid entries and a partly filled last block; values
    and gradients of a fixed readout w.r.t. everything differentiable."""
    rng = np.random.default_rng(seed)
    f = np.float32
    L = n * C
    xs = (
        rng.normal(size=(B, H, L, K)).astype(f),
        rng.normal(size=(B, H, L, K)).astype(f),
        rng.normal(size=(B, H, L, V)).astype(f),
        rng.normal(size=(B, H, n, W, K)).astype(f),
        rng.normal(size=(B, H, n, W, V)).astype(f),
        rng.uniform(0.5, 2.0, (H, K)).astype(f),
        rng.uniform(0.5, 2.0, (H, K)).astype(f),
        rng.normal(size=(H,)).astype(f),
    )
    cval = rng.random((B, H, n, W)) < 0.6
    cval[:, :, 0] = False  # the first block reads an empty cache
    filled = np.ones((n, C), bool)
    filled[-1, C // 2 + 1 :] = False
    w_out = rng.normal(size=(B, H, L, V)).astype(f)
    gate = np.zeros((H,), f)  # not read by the cache read

    def run(read):
        def loss(*a):
            params = ops_hola.HolaReadParams(*a[5:], gate)
            o = read(*a[:3], (*a[3:5], cval), filled, params, read_norm, 0.3)
            return jnp.sum(o * w_out), o

        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True))(*xs)

    (_, o), g = run(kernel_read(block_sizes=BlockSizes(block_q)))
    (_, o_ref), g_ref = run(read_blocks)
    names = ("o", "dq", "dk", "dv", "dck", "dcv", "dgamma_q", "dgamma_k", "dsink")
    errors = {}
    for name, a, b in zip(names, (o, *g), (o_ref, *g_ref), strict=True):
        if read_norm == "l2" and name.startswith("dgamma"):
            assert float(jnp.max(jnp.abs(a))) == 0.0, name  # γ is unused by the l2 read
            continue
        errors[name] = _rel(a, b)
    assert max(errors.values()) < F32_TOL, errors
    return errors


def test_kernel_matches_read_blocks_tiled_and_padded():
    """``C = 20`` (padded to 24, three 8-query tiles: the backward accumulates over tiles),
    ``w = 5`` (padded to 8), rmsnorm."""
    _read_case(n=3, C=20, W=5, block_q=8, read_norm="rmsnorm")


@pytest.mark.slow
@pytest.mark.parametrize("n, C, W, block_q", [(2, 16, 8, 256), (4, 32, 16, 16), (1, 7, 3, 8)])
@pytest.mark.parametrize("read_norm", ["rmsnorm", "l2"])
def test_kernel_matches_read_blocks_grid(n, C, W, block_q, read_norm):
    _read_case(n=n, C=C, W=W, block_q=block_q, read_norm=read_norm)


# --------------------------------------------------------------------------------------------------
# The two-phase cache path (HolaKernels(cache_read=kernel)) against the XLA block scan
# --------------------------------------------------------------------------------------------------

_KERNEL_READ = kernel_read()


@functools.cache
def _forward_vg(window, block, eviction, read_norm, with_state, read):
    """Jitted ``((o, final state), grads)`` of ``Σ w ⊙ o + Σ sin(S_T) + Σ cos(cache_k, block_v)``
    w.r.t. the sequence, the four parameters and (``with_state``) the initial state's float
    leaves."""
    rule = ops_hola.HolaRule(window=window, block_size=block, eviction=eviction,
                             read_norm=read_norm)  # fmt: skip

    def loss(x, p, s0_diff, s0, w):
        s0 = s0._replace(**s0_diff) if with_state else None
        o, st = hola_forward(
            *(x[n] for n in SEQ), p, rule=rule, initial_state=s0, chunk_size=8,
            kernels=HolaKernels(cache_read=read),
        )  # fmt: skip
        extra = jnp.sum(jnp.cos(st.cache_k)) + jnp.sum(jnp.cos(st.block_v))
        return jnp.sum(o * w) + jnp.sum(jnp.sin(st.S)) + extra, (o, st)

    def run(x, p, s0, w):
        s0_diff = {n: getattr(s0, n) for n in _STATE_GRAD} if with_state else {}
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            x, p, s0_diff, s0, w
        )
        return out, grads

    return jax.jit(run)


def _forward_case(T, *, window, block, prefix=0, eviction="beta_e", read_norm="rmsnorm"):
    """``hola_forward`` with the kernel's read vs without: the selections (cache positions,
    validity, scores, the block buffer) equal bit for bit, values and gradients to f32 rounding.
    ``prefix > 0``: continue a state built by ``prefix`` earlier tokens."""
    x, p = _seq(T), _params()
    s0 = None
    if prefix:
        pre = _seq(prefix, seed=7)
        rule = ops_hola.HolaRule(window=window, block_size=block, eviction=eviction,
                                 read_norm=read_norm)  # fmt: skip
        fwd = functools.partial(hola_forward, rule=rule, chunk_size=8)
        _, s0 = jax.jit(fwd)(*(pre[n] for n in SEQ), p)
    w = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, H, V)), jnp.float32)
    static = (window, block, eviction, read_norm, prefix > 0)
    (o, st), grads = _forward_vg(*static, _KERNEL_READ)(x, p, s0, w)
    (o_ref, st_ref), grads_ref = _forward_vg(*static, None)(x, p, s0, w)
    for name in ("cache_pos", "cache_valid", "cache_score", "block_score", "pos"):
        np.testing.assert_array_equal(getattr(st, name), getattr(st_ref, name), err_msg=name)
    errors = {"o": _rel(o, o_ref)}
    for name in ("S", "cache_k", "cache_v", "block_k", "block_v"):
        errors[name] = _rel(getattr(st, name), getattr(st_ref, name))
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    flat_ref = jax.tree.leaves(grads_ref)
    for (path, a), b in zip(flat, flat_ref, strict=True):
        if float(jnp.max(jnp.abs(b))) == 0.0:  # γ with the l2 read; the state's S-only leaves
            assert float(jnp.max(jnp.abs(a))) == 0.0, jax.tree_util.keystr(path)
            continue
        errors["d" + jax.tree_util.keystr(path)] = _rel(a, b)
    assert max(errors.values()) < F32_TOL, errors
    if prefix:  # the initial cache's gradient is there (entries are read and carried)
        assert float(jnp.max(jnp.abs(grads_ref[2]["cache_k"]))) > 0
    return errors


@pytest.mark.parametrize(
    "T, window, block, prefix",
    [
        pytest.param(63, 8, 16, 0, marks=pytest.mark.slow),  # from zero (~9 s; the grid has more)
        (45, 5, 12, 21),  # C, w off multiples of 8, continuing a half-filled block buffer
    ],
)
def test_two_phase_forward_matches_the_block_scan(T, window, block, prefix):
    _forward_case(T, window=window, block=block, prefix=prefix)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("window, block", [(8, 16), (16, 32)])
@pytest.mark.parametrize("prefix", [0, 37])
@pytest.mark.parametrize("eviction, read_norm", [("beta_e", "rmsnorm"), ("recency", "l2")])
def test_two_phase_forward_matches_the_block_scan_grid(T, window, block, prefix, eviction,
                                                       read_norm):  # fmt: skip
    _forward_case(T, window=window, block=block, prefix=prefix, eviction=eviction,
                  read_norm=read_norm)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Routing, BlockSizes, argument errors
# --------------------------------------------------------------------------------------------------


def _pallas_calls(T, rule, segment_ids=None):
    """The names of the ``pallas_call``s in the jaxpr of ``ops.hola(impl="pallas")``."""
    x, p = _seq(T), _params()

    def f(x, p):
        return ops_hola.hola(*(x[n] for n in SEQ), p, rule=rule, segment_ids=segment_ids,
                             chunk_size=8, impl="pallas")  # fmt: skip

    text = str(jax.make_jaxpr(f)(x, p))
    return {name for name in ("hola_cache_fwd", "gated_delta") if name in text}


def test_ops_pallas_routes_one_stream_to_the_kernel_and_the_rest_to_xla():
    rule = ops_hola.HolaRule(window=4, block_size=8)
    assert _pallas_calls(20, rule) == {"hola_cache_fwd", "gated_delta"}
    sid = jnp.asarray(np.repeat(np.arange(2)[None], B, 0).repeat(10, 1), jnp.int32)
    assert _pallas_calls(20, rule, sid) == {"gated_delta"}  # packed rows: the XLA scan
    cum = ops_hola.HolaRule(window=4, block_size=8, eviction="cumulative_attention")
    assert _pallas_calls(20, cum) == {"gated_delta"}  # its merges need the reads


def test_block_sizes_default_frozen_and_validation():
    bs = BlockSizes.get_default()
    assert bs == BlockSizes(block_q=256)
    with pytest.raises(AttributeError):
        bs.block_q = 8  # type: ignore[misc]
    for bad in (0, 12, -8, 8.0, True):
        with pytest.raises(ValueError, match=r"^BlockSizes: block_q must be a positive multiple "
                                             r"of 8, got"):  # fmt: skip
            BlockSizes(block_q=bad)


def test_argument_errors_name_the_argument():
    L, n, C, W = 16, 2, 8, 4
    z = jnp.zeros
    good = dict(
        qh=z((B, H, L, K)), kh=z((B, H, L, K)), vh=z((B, H, L, V)), ck=z((B, H, n, W, K)),
        cv=z((B, H, n, W, V)), cval=z((B, H, n, W), bool), filled=z((n, C), bool),
        gamma_q=z((H, K)), gamma_k=z((H, K)), sink=z((H,)),
    )  # fmt: skip
    assert hola_cache_read_pallas(**good, interpret=True).shape == (B, H, L, V)
    with pytest.raises(ValueError, match="block_sizes must be a BlockSizes"):
        hola_cache_read_pallas(**good, block_sizes=8, interpret=True)
    with pytest.raises(ValueError, match="read_norm must be one of"):
        hola_cache_read_pallas(**good, read_norm="layer", interpret=True)
    with pytest.raises(ValueError, match=r"filled must have shape \[n, C\]"):
        hola_cache_read_pallas(**(good | dict(filled=z((3, 5), bool))), interpret=True)
    for name, shape in (("cv", (B, H, n, W, K)), ("cval", (B, H, n, W + 1)), ("sink", (H, 1))):
        bad = good | {name: z(shape, good[name].dtype)}
        with pytest.raises(ValueError, match=f"{name} must have shape"):
            hola_cache_read_pallas(**bad, interpret=True)


# --------------------------------------------------------------------------------------------------
# TPU lowering: ahead-of-time compiles for abstract topologies (libtpu on this CPU)
# --------------------------------------------------------------------------------------------------


def _compile_on(topology, C, W, D, block_q):
    """Compiles the kernels (interpret=False) under ``shard_map`` over the batch, the forward and
    forward+backward, bf16 slots, 4 blocks; returns ``{"fwd" | "grad": (text, compiled)}``."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.pallas_kernels.test_gated_delta_pallas import tpu_batch_mesh

    mesh, sds = tpu_batch_mesh(topology)
    Bt, Ht, n = 2 * mesh.devices.size, 2, 4
    L = n * C
    bf, f32 = jnp.bfloat16, jnp.float32

    def rep(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    specs = (
        sds((Bt, Ht, L, D), bf), sds((Bt, Ht, L, D), bf), sds((Bt, Ht, L, D), bf),
        sds((Bt, Ht, n, W, D), f32), sds((Bt, Ht, n, W, D), f32), sds((Bt, Ht, n, W), bool),
        rep((n, C), bool), rep((Ht, D), f32), rep((Ht, D), f32), rep((Ht,), f32),
    )  # fmt: skip

    def local(*a):
        return hola_cache_read_pallas(*a, "rmsnorm", None, block_sizes=BlockSizes(block_q))

    in_specs = (P("batch"),) * 6 + (P(),) * 4
    sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P("batch"))

    def loss(*a):
        return jnp.sum(sharded(*a) ** 2)

    fns = {"fwd": sharded, "grad": jax.grad(loss, argnums=(0, 1, 2, 3, 4, 7, 8, 9))}
    lowered = {name: jax.jit(fn).lower(*specs) for name, fn in fns.items()}
    return {name: (low.as_text(), low.compile()) for name, low in lowered.items()}


def _check_compiles(topology, C, W, D, block_q):
    for name, (text, compiled) in _compile_on(topology, C, W, D, block_q).items():
        calls = {"fwd": ["hola_cache_fwd"], "grad": ["hola_cache_fwd", "hola_cache_bwd"]}
        for kernel in calls[name]:  # Mosaic kernels, not the interpreter
            assert "tpu_custom_call" in text and kernel in text, (name, kernel)
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"{topology} C={C} w={W} D={D} block_q={block_q} {name}: temp {temp} B")


@needs_libtpu
def test_compiles_for_tpu_v5e():
    """The default HOLA shapes (``C = 256``, ``w = 64``, head dim 64), two query tiles a block."""
    _check_compiles("v5e:2x2", 256, 64, 64, 128)


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("C, W, D, block_q", [(256, 64, 128, 256), (200, 16, 64, 128)])
def test_compiles_for_tpu(topology, C, W, D, block_q):
    _check_compiles(topology, C, W, D, block_q)


@pytest.mark.slow
@needs_libtpu
def test_ops_hola_pallas_compiles_for_tpu_with_both_kernels():
    """``ops.hola(impl="pallas")`` fwd+bwd for v5e: the gated delta kernels (state path) and the
    cache-read kernels (cache path) are Mosaic calls of one program; prints its temp bytes next to
    ``impl="chunked"`` (the XLA block scan)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.pallas_kernels.test_gated_delta_pallas import tpu_batch_mesh

    mesh, sds = tpu_batch_mesh("v5e:2x2")
    Bt, T, Ht, D = 2 * mesh.devices.size, 512, 2, 64
    bf, f32 = jnp.bfloat16, jnp.float32

    def rep(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    specs = (
        *(sds((Bt, T, Ht, D), bf) for _ in range(3)), sds((Bt, T, Ht), f32),
        sds((Bt, T, Ht), f32), rep((Ht, D), f32), rep((Ht, D), f32), rep((Ht,), f32),
        rep((Ht,), f32),
    )  # fmt: skip
    rule = ops_hola.HolaRule(window=64, block_size=256)
    for impl in ("pallas", "chunked"):

        def local(*a, impl=impl):
            params = ops_hola.HolaReadParams(*a[5:])
            return ops_hola.hola(*a[:5], params, rule=rule, chunk_size=64, impl=impl)[0]

        in_specs = (P("batch"),) * 5 + (P(),) * 4
        sharded = jax.shard_map(
            local, mesh=mesh, in_specs=in_specs, out_specs=P("batch"), check_vma=False
        )

        def loss(*a, sharded=sharded):
            return jnp.sum(sharded(*a).astype(f32) ** 2)

        low = jax.jit(jax.grad(loss, argnums=tuple(range(9)))).lower(*specs)
        text = low.as_text()
        kernels = ("hola_cache_fwd", "hola_cache_bwd", "gated_delta")
        assert all((name in text) == (impl == "pallas") for name in kernels), impl
        temp = low.compile().memory_analysis().temp_size_in_bytes
        print(f"v5e:2x2 ops.hola impl={impl} fwd+bwd T={T}: temp {temp} B")


@pytest.mark.slow
def test_ops_pallas_on_a_2x2_mesh_equals_chunked():
    """``ops.hola(impl="pallas")`` inside ``jax.set_mesh`` (batch over fsdp 2, heads over tensor
    2; the 8 fake CPU devices): the cache read runs once per shard under ``jax.shard_map``, with
    the values and gradients of ``impl="chunked"``."""
    from nested_jax.parallel.mesh import make_mesh
    from nested_jax.train.config import MeshConfig

    x, p = _seq(40), _params()
    rule = ops_hola.HolaRule(window=8, block_size=16)
    w = jnp.asarray(np.random.default_rng(5).normal(size=(B, 40, H, V)), jnp.float32)

    def vg(impl):
        def loss(x, p):
            o, st = ops_hola.hola(*(x[n] for n in SEQ), p, rule=rule, chunk_size=8, impl=impl)
            return jnp.sum(o * w) + jnp.sum(jnp.cos(st.cache_k)), o

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        got, want = vg("pallas")(x, p), vg("chunked")(x, p)
        assert "hola_cache_fwd" in str(jax.make_jaxpr(vg("pallas"))(x, p))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and _rel(a, b) < F32_TOL
