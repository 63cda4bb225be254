"""The Pallas Titans matrix memory (``pallas_kernels/titans_linear``) against the core rule
(SPEC §2 with ``L_M = 1``).

Interpret mode on any backend: values and gradients (forward and backward kernels) of q, k, v,
θ, η, α and the initial ``(M, S)`` against ``titans_linear_chunked`` with the same chunk (the
kernel's rule), and against the per-token ``titans_linear_recurrent`` where the chunk rule must
equal it (``T = 1``: one chunk of one real token). TPU lowering by ahead-of-time compiles on
libtpu's abstract topologies (no chip needed; skipped without libtpu). The interpreter and the
core reference each take ~10 s to compile per case, so the default set is one case with every
option at once plus the door and the v5e lowering; the rest is ``slow``.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax import ops
from nested_jax.core.titans.chunk import local_chunk_starts
from nested_jax.core.titans.linear import titans_linear_chunked, titans_linear_recurrent
from nested_jax.core.titans.net import segment_resets
from nested_jax.layers.options import TitansOptions
from nested_jax.models.config import ModelConfig
from nested_jax.models.lm import build_model
from nested_jax.ops.titans import TitansMemorySpec, titans_memory_init_cache, titans_mlp_state
from nested_jax.rules import ProteusRule, TitansRule
from pallas_kernels.titans_linear import titans_linear_pallas
from tests.pallas_kernels.test_gated_delta_pallas import tpu_batch_mesh

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="libtpu not installed (pip install -e '.[tpu]'; scripts/test does)"
)
F32_TOL = 1e-4  # max |a − b| / max |b|, per output and per gradient
BF16_TOL = 2e-2  # bf16 q, k, v and a bf16 output (8 mantissa bits): a few output ulps
NAMES = ("o", "M", "S", "dq", "dk", "dv", "dtheta", "deta", "dalpha", "dM0", "dS0")


def _inputs(T, *, B=2, H=2, K=16, V=12, seed=0, init=False, seg=False, dtype=jnp.float32):
    """Unit-norm q, k (as the layers give), gates in (0, 1), an optional ``(M0, S0)`` and packed
    rows with a document start at t = 20 (mid-chunk, so document-local chunk starts fall inside
    grid chunks) and random others."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (B, T, H, K)))
    k = unit(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    theta = 0.5 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    eta = jax.nn.sigmoid(1.0 + jax.random.normal(ks[4], (B, T, H)))
    alpha = 0.2 * jax.nn.sigmoid(jax.random.normal(ks[5], (B, T, H)))
    st = None
    if init:
        st = (
            0.3 * jax.random.normal(ks[6], (B, H, K, V)),
            0.1 * jax.random.normal(ks[7], (B, H, K, V)),
        )
    sid = None
    if seg:
        starts = jax.random.bernoulli(ks[8], 0.05, (B, T)).at[:, 20 % T].set(True)
        sid = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return (q, k, v, theta, eta, alpha), st, sid


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _loss_and_grads(fn, args, st, sid, **kw):
    """Outputs ``(o, M, S)`` and the gradients of a fixed readout w.r.t. the six sequence inputs
    (and the initial ``(M, S)``)."""

    def loss(args, st):
        o, (M, S) = fn(*args, initial_state=st, segment_ids=sid, **kw)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        total = jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(jnp.sin(M)) + 0.7 * jnp.sum(S * M)
        return total, (o, M, S)

    argnums = (0, 1) if st is not None else 0
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(args, st)
    return out, grads


def _errors(T, C, *, init, seg, rbw=False, clip=0.0, against="chunked", **shape):
    args, st, sid = _inputs(T, init=init, seg=seg, **shape)
    rule = TitansRule(memory_chunk=C, read_before_write=rbw, grad_clip=clip)
    out, grads = _loss_and_grads(titans_linear_pallas, args, st, sid, rule=rule, interpret=True)
    ref = titans_linear_chunked if against == "chunked" else titans_linear_recurrent
    ref_out, ref_grads = _loss_and_grads(ref, args, st, sid, rule=rule)
    leaves = jax.tree.leaves((out, grads))
    ref_leaves = jax.tree.leaves((ref_out, ref_grads))
    assert len(leaves) == len(ref_leaves) == (11 if init else 9)
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert out[0].dtype == args[2].dtype and out[1].dtype == out[2].dtype == jnp.float32
    return {n: _rel(a, b) for n, a, b in zip(NAMES, leaves, ref_leaves, strict=False)}


def _check(**case):
    errors = _errors(**case)
    print(case, {n: f"{e:.1e}" for n, e in errors.items()})
    bad = {n: e for n, e in errors.items() if not e <= F32_TOL}
    assert not bad, bad


def test_packed_inputs_have_mid_chunk_local_starts():
    """The packed cases exercise every anchor of the kernel: a reset inside a grid chunk and a
    document-local chunk start inside a grid chunk (``W_r``)."""
    _, _, sid = _inputs(63, seg=True)
    r = segment_resets(sid)
    local = np.asarray(local_chunk_starts(r, 16))
    t = np.nonzero(local)[1]
    assert np.asarray(r)[:, 1:].any() and (t % 16 != 0).any()


@pytest.mark.parametrize(
    "case",
    [
        # everything at once: initial state, resets + local chunk starts, read-before-write, clip
        dict(T=63, C=8, init=True, seg=True, rbw=True, clip=0.3),
        # the plain rule, T not a multiple of the chunk
        pytest.param(dict(T=63, C=16, init=False, seg=False), marks=pytest.mark.slow),
    ],
    ids=["init-seg-rbw-clip", "plain"],
)
def test_matches_chunked_values_and_grads(case):
    _check(**case)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("seg", [False, True])
@pytest.mark.parametrize("rbw,clip", [(False, 0.0), (True, 0.5)])
def test_matches_chunked_grid(T, C, init, seg, rbw, clip):
    _check(T=T, C=C, init=init, seg=seg, rbw=rbw, clip=clip, K=32, V=24)


@pytest.mark.slow
@pytest.mark.parametrize("rbw,clip", [(False, 0.0), (True, 0.5)])
def test_one_token_equals_recurrent(rbw, clip):
    """``T = 1``: one chunk of one real token, where the chunk rule is the per-token rule."""
    _check(T=1, C=8, init=True, seg=False, rbw=rbw, clip=clip, against="recurrent")


@pytest.mark.slow
def test_padding_never_reaches_the_state():
    """T = 20 with chunk 16 pads 12 tokens: the final state equals the run on the first 16
    tokens continued by the last 4 (a separate call from the mid state), and equals the core."""
    args, st, _ = _inputs(20, init=True, B=1, H=1, K=8, V=8)
    kw = dict(rule=TitansRule(memory_chunk=8), interpret=True)
    _, full = titans_linear_pallas(*args, initial_state=st, **kw)
    head = [x[:, :16] for x in args]
    tail = [x[:, 16:] for x in args]
    _, mid = titans_linear_pallas(*head, initial_state=st, **kw)
    _, end = titans_linear_pallas(*tail, initial_state=tuple(mid), **kw)
    for a, b in zip(full, end, strict=True):
        assert _rel(a, b) < F32_TOL


@pytest.mark.slow
def test_grad_horizon_matches_core():
    """``grad_horizon = 16`` with chunk 8 over T = 40: the carried state's cotangent is cut at
    t = 16, 32 as the core's ``stop_gradient`` does (values unchanged)."""
    from nested_jax.core.titans.chunk import titans_mlp_chunked
    from nested_jax.core.titans.net import TitansMLPState

    args, st, _ = _inputs(40, init=True, B=1, H=2, K=8, V=8)
    cut = TitansRule(memory_chunk=8, grad_horizon=16, grad_clip=10.0)
    full = TitansRule(memory_chunk=8, grad_clip=10.0)

    def pallas(args, st):
        o, (M, S) = titans_linear_pallas(*args, initial_state=st, rule=cut, interpret=True)
        return o, M, S

    def core(args, st):
        o, s = titans_mlp_chunked(*args, initial_state=TitansMLPState((st[0],), (st[1],)), rule=cut)
        return o, s.weights[0], s.momentum[0]

    def loss(fn):
        def f(args, st):
            o, M, S = fn(args, st)
            return jnp.sum(o * jnp.cos(o)) + jnp.sum(M * S)

        return jax.value_and_grad(f, argnums=(0, 1))(args, st)

    (lp, gp), (lc, gc) = loss(pallas), loss(core)
    assert _rel(lp, lc) < F32_TOL
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gc), strict=True):
        assert _rel(a, b) < F32_TOL

    # and the cut is real: without it the initial state's gradient differs
    def squared(rule):
        def f(st):
            o, _ = titans_linear_pallas(*args, initial_state=st, rule=rule, interpret=True)
            return jnp.sum(o**2)

        return jax.value_and_grad(f)(st)

    (_, g_full), (_, g_cut) = squared(full), squared(cut)
    assert _rel(g_cut[0], g_full[0]) > 1e-3


@pytest.mark.slow
def test_bf16_operands():
    args, st, sid = _inputs(40, init=True, seg=True, dtype=jnp.bfloat16)
    rule = TitansRule(memory_chunk=8)
    o, (M, S) = titans_linear_pallas(
        *args, initial_state=st, segment_ids=sid, rule=rule, interpret=True
    )
    # the chunk rule on the same (bf16-exact) values in f32
    f32 = [x.astype(jnp.float32) for x in args]
    o_ref, (M_ref, S_ref) = titans_linear_chunked(
        *f32, initial_state=st, segment_ids=sid, rule=rule
    )
    assert o.dtype == jnp.bfloat16 and M.dtype == S.dtype == jnp.float32
    assert _rel(o, o_ref) < BF16_TOL
    assert _rel(M, M_ref) < F32_TOL and _rel(S, S_ref) < F32_TOL  # the states never leave f32


@pytest.mark.parametrize("chunk", [4, 12])
def test_the_rule_chunk_must_fill_tpu_sublanes(chunk):
    """The kernels' chunk is the rule's ``memory_chunk``: a multiple of 8 (TPU sublanes)."""
    args, _, _ = _inputs(8)
    with pytest.raises(
        ValueError, match=r"^titans_linear_pallas: rule\.memory_chunk must be a mul"
    ):
        titans_linear_pallas(*args, rule=TitansRule(memory_chunk=chunk), interpret=True)


def test_argument_errors():
    args, st, sid = _inputs(8)
    with pytest.raises(ValueError, match="rule must be a TitansRule"):
        titans_linear_pallas(*args, rule=16, interpret=True)
    with pytest.raises(
        ValueError, match=r"rule\.grad_horizon must be a multiple of rule\.memory_c"
    ):
        titans_linear_pallas(*args, rule=TitansRule(grad_horizon=8), interpret=True)
    with pytest.raises(ValueError, match="reset_state needs segment_ids"):
        titans_linear_pallas(*args, reset_state=jnp.zeros((2, 2, 16, 12)), interpret=True)
    with pytest.raises(ValueError, match=r"initial_state.M must have shape \[B, H, K, V\]"):
        titans_linear_pallas(*args, initial_state=jnp.zeros((2, 2, 12, 12)), interpret=True)
    with pytest.raises(ValueError, match="theta must have shape"):
        titans_linear_pallas(*args[:3], args[3][..., :1], *args[4:], interpret=True)


# --------------------------------------------------------------------------------------------------
# The ops door and the layer
# --------------------------------------------------------------------------------------------------


def test_ops_titans_memory_pallas_matches_chunked_and_refuses_what_it_lacks():
    (q, k, v, th, et, al), st, sid = _inputs(40, init=True, seg=True, K=8, V=8)
    rule = TitansRule(memory_chunk=8, grad_clip=10.0, read_before_write=True)
    spec = TitansMemorySpec(dims=(8, 8), rule=rule)
    state = titans_mlp_state((st[0][0],), 2)  # learned M_0 broadcast over the batch, S = 0
    reset = titans_mlp_state((st[1][1],), 2)
    kw = dict(spec=spec, initial_state=state, segment_ids=sid, reset_state=reset)
    y_p, s_p = ops.titans_memory(q, k, v, th, et, al, impl="pallas", **kw)
    y_c, s_c = ops.titans_memory(q, k, v, th, et, al, impl="chunked", **kw)
    for a, b in zip(jax.tree.leaves((y_p, s_p)), jax.tree.leaves((y_c, s_c)), strict=True):
        assert _rel(a, b) < F32_TOL
    mlp = TitansMemorySpec(dims=(8, 16, 8), rule=TitansRule(memory_chunk=8))
    mlp_state = titans_mlp_state((jnp.zeros((2, 8, 16)), jnp.zeros((2, 16, 8))), 2)
    with pytest.raises(ValueError, match="impl='pallas' covers only the matrix memory"):
        ops.titans_memory(q, k, v, th, et, al, spec=mlp, initial_state=mlp_state, impl="pallas")
    with pytest.raises(ValueError, match="titans_memory_init_cache: impl='pallas' covers only"):
        titans_memory_init_cache(mlp, 2, 2, impl="pallas")
    proteus = TitansMemorySpec(dims=(8, 8), rule=rule, proteus=ProteusRule(2, context_len=32))
    with pytest.raises(ValueError, match="impl='pallas' covers only the plain matrix memory"):
        ops.titans_memory(q, k, v, th, et, al, spec=proteus, initial_state=state, impl="pallas")
    # decoding with impl="pallas" is the chunked decode path (the same chunk rule)
    cache_p = titans_memory_init_cache(spec, 2, 2, impl="pallas")
    cache_c = titans_memory_init_cache(spec, 2, 2, impl="chunked")
    assert jax.tree.map(jnp.shape, cache_p) == jax.tree.map(jnp.shape, cache_c)
    with pytest.raises(ValueError, match=r"TitansOptions.memory_impl: 'pallas' covers only"):
        TitansOptions(memory_layers=2, memory_impl="pallas")
    with pytest.raises(ValueError, match=r"TitansOptions.memory_chunk: memory_impl='pallas'"):
        TitansOptions(memory_layers=1, memory_impl="pallas", memory_chunk=4, segment_len=8,
                      grad_horizon=0)  # fmt: skip


@pytest.mark.slow
def test_tiny_titans_lmm_pallas_equals_chunked_loss_and_grads():
    """A tiny ``titans_lmm`` LM with ``memory_layers: 1``: ``memory_impl: pallas`` gives the
    loss and parameter gradients of ``memory_impl: chunked`` (same seed and parameters), packed
    rows included."""
    Bm, Tm = 2, 24

    def loss_and_grads(impl):
        opts = TitansOptions(
            memory_layers=1, memory_impl=impl, memory_chunk=8, segment_len=8, grad_horizon=16
        )
        cfg = ModelConfig(name="titans_lmm", vocab_size=32, d_model=32, n_layers=1, n_heads=2,
                          titans=opts)  # fmt: skip
        model = build_model(cfg, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(3), (Bm, Tm), 0, 32)
        sid = jnp.asarray(np.repeat([[0] * 11 + [1] * 13], Bm, 0), jnp.int32)

        def loss(m):
            h, _ = m.hidden(tokens, segment_ids=sid)
            w, layout = m.output_weight()
            logits = jnp.einsum("btd,vd->btv" if layout == "vd" else "btd,dv->btv", h, w)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

        return nnx.value_and_grad(loss)(model)

    lp, gp = loss_and_grads("pallas")
    lc, gc = loss_and_grads("chunked")
    assert _rel(lp, lc) < F32_TOL
    leaves_p, leaves_c = jax.tree.leaves(gp), jax.tree.leaves(gc)
    assert len(leaves_p) == len(leaves_c) > 5
    for a, b in zip(leaves_p, leaves_c, strict=True):
        assert _rel(a, b) < F32_TOL


# --------------------------------------------------------------------------------------------------
# TPU lowering: ahead-of-time compiles for abstract topologies (libtpu on this CPU)
# --------------------------------------------------------------------------------------------------


def _compile_on(topology, head_dim, resets, chunk, which):
    """Compiles the kernels (interpret=False) under ``shard_map`` over the batch, forward and
    forward+backward, bf16 q, k, v, an initial state, grad_clip and grad_horizon (``resets``:
    segment_ids too, the packed path); returns ``{"fwd" | "grad": (lowered text, compiled)}``."""
    from jax.sharding import PartitionSpec as P

    mesh, sds = tpu_batch_mesh(topology)
    B, T, H, D = 2 * mesh.devices.size, 256, 2, head_dim

    bf, f32 = jnp.bfloat16, jnp.float32
    specs = (
        *(sds((B, T, H, D), bf) for _ in range(3)),
        *(sds((B, T, H), f32) for _ in range(3)),
        sds((B, H, D, D), f32),
        sds((B, H, D, D), f32),
        sds((B, T), jnp.int32),
    )

    def local(q, k, v, th, et, al, m0, s0, sid):
        return titans_linear_pallas(
            q, k, v, th, et, al, initial_state=(m0, s0), segment_ids=sid if resets else None,
            rule=TitansRule(memory_chunk=chunk, grad_clip=10.0, grad_horizon=64),
        )  # fmt: skip

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("batch"),) * 9, out_specs=P("batch"))

    def loss(*a):
        o, (M, S) = sharded(*a)
        return jnp.sum(o.astype(f32) ** 2) + jnp.sum(M**2) + jnp.sum(S**2)

    fns = {"fwd": sharded, "grad": jax.grad(loss, argnums=range(8))}
    lowered = {name: jax.jit(fns[name]).lower(*specs) for name in which}
    return {name: (low.as_text(), low.compile()) for name, low in lowered.items()}


def _check_compiles(topology, head_dim, resets, chunk, which=("fwd", "grad")):
    compiled_programs = _compile_on(topology, head_dim, resets, chunk, which)
    for name, (text, compiled) in compiled_programs.items():
        calls = {"fwd": ["titans_linear_fwd"], "grad": ["titans_linear_fwd", "titans_linear_bwd"]}
        for kernel in calls[name]:  # Mosaic kernels, not the interpreter
            assert "tpu_custom_call" in text and kernel in text, (name, kernel)
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"{topology} D={head_dim} resets={resets} C={chunk} {name}: temp {temp} B")


@needs_libtpu
def test_compiles_for_tpu_v5e():
    """The training program (forward kernel saving its states + backward kernel); the plain
    forward alone is compiled in the slow set."""
    _check_compiles("v5e:2x2", 128, resets=True, chunk=16, which=("grad",))


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("head_dim,resets,chunk", [(128, True, 16), (64, False, 64)])
def test_compiles_for_tpu(topology, head_dim, resets, chunk):
    _check_compiles(topology, head_dim, resets, chunk)


# --------------------------------------------------------------------------------------------------
# Inside a mesh (the 8 fake CPU devices of tests/conftest.py)
# --------------------------------------------------------------------------------------------------


def _mesh():
    from nested_jax.parallel.mesh import make_mesh
    from nested_jax.train.config import MeshConfig

    return make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])


def _shard_map_count(jaxpr) -> int:
    from jax.extend.core import jaxprs_in_params

    def walk(j):
        n = 0
        for eqn in j.eqns:
            n += eqn.primitive.name == "shard_map"
            n += sum(walk(sub) for sub in jaxprs_in_params(eqn.params))
        return n

    return walk(jaxpr.jaxpr)


@pytest.mark.slow
def test_ops_pallas_on_a_2x2_mesh_equals_chunked():
    """``ops.titans_memory(impl="pallas")`` inside ``jax.set_mesh`` (batch over fsdp 2, heads
    over tensor 2): one kernel call per shard under ``jax.shard_map``, values and gradients of
    ``impl="chunked"`` (packed rows, learned ``M_0`` with its gradient)."""
    (q, k, v, th, et, al), st, sid = _inputs(40, init=True, seg=True, K=8, V=8)
    rule = TitansRule(memory_chunk=8, grad_clip=10.0, grad_horizon=16)
    spec = TitansMemorySpec(dims=(8, 8), rule=rule)

    def vg(impl):
        def loss(xs, m0):
            state = titans_mlp_state((m0,), 2)
            y, s = ops.titans_memory(
                *xs, spec=spec, initial_state=state, segment_ids=sid, impl=impl
            )
            return jnp.sum(jnp.sin(y)) + jnp.sum(s.weights[0] * s.momentum[0]), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    args = ((q, k, v, th, et, al), st[0][0])
    with jax.set_mesh(_mesh()):
        got, want = vg("pallas")(*args), vg("chunked")(*args)
        maps = _shard_map_count(jax.make_jaxpr(vg("pallas"))(*args))
    assert maps == 2  # the forward and its transpose
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and _rel(a, b) < F32_TOL


def test_the_kernel_without_an_initial_state_differentiates_inside_a_typed_shard_map():
    """Inside a user's ``jax.shard_map`` with the varying-axes check on (the Mosaic kernel's
    setting; traced only): the zero initial state the entry makes varies like ``q``, as the
    custom VJP's ``∂L/∂(M_0, S_0)`` does."""
    from jax.sharding import PartitionSpec as P

    (q, k, v, th, et, al), _, _ = _inputs(16, K=8, V=8)

    def loss(q, k, v, th, et, al):
        o, (M, S) = titans_linear_pallas(q, k, v, th, et, al, rule=TitansRule(memory_chunk=8))
        return jnp.sum(o) + jnp.sum(M) + jnp.sum(S)

    seq = P("fsdp", None, "tensor")
    grad = jax.shard_map(
        jax.grad(loss, argnums=range(6)), mesh=_mesh(), in_specs=seq, out_specs=seq,
        check_vma=True,
    )  # fmt: skip
    jaxpr = jax.make_jaxpr(grad)(q, k, v, th, et, al)
    assert _shard_map_count(jaxpr) == 1
