"""The Pallas gated delta kernel inside a mesh, on this CPU's fake devices (issue 16).

Inside ``jax.set_mesh`` ``impl="pallas"`` runs the kernel under ``jax.shard_map`` with the batch
over ``data × fsdp`` and the heads over ``tensor`` (``nested_jax.ops._pallas``), and chooses the
kernel by the lowering platform (``jax.lax.platform_dependent``: the interpreter here, Mosaic in a
program lowered for TPU, see ``test_aot_train_step_pallas.py``). On a 2×2 mesh (fsdp 2 × tensor 2
of the 8 fake devices of ``tests/conftest.py``) a GDN layer with the kernel equals
``impl="chunked"`` (output and every parameter gradient), and so does the delta rule continuing
an initial state over packed rows (the HOLA state path's form). On CPU the interpreter would also
run unsplit, so each test also checks that the call went through the shard_map with those specs.
Without a mesh the call is the kernel's interpreter exactly as before: bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

from nested_jax import ops
from nested_jax.layers.gdn import GatedDeltaNet
from nested_jax.parallel.mesh import make_mesh
from nested_jax.train.config import MeshConfig
from pallas_kernels.gated_delta import BlockSizes, gated_delta_pallas
from tests.pallas_kernels.test_pallas_wiring import layer_value_and_grads

TOL = 1e-4  # max |a − b| / max |b|, as in test_pallas_wiring.py
B, T, H, K, V = 2, 40, 2, 8, 6  # T not a multiple of the chunk
SEQ_SPEC = P("fsdp", None, "tensor")  # q, k, v, g, β on the mesh below


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])


def _seq(seed=0):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(B, T, H, K)).astype(np.float32) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(
        q=q,
        k=k,
        v=rng.normal(size=(B, T, H, V)).astype(np.float32),
        g=-rng.uniform(0.01, 0.5, (B, T, H)).astype(np.float32),
        beta=rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32),
    )


def _segments():
    starts = np.zeros((B, T), bool)
    starts[:, [0, 11, 16]] = True  # a reset inside a chunk and one at a chunk boundary
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


def _rel(a, b, floor=1e-2):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor))


def _assert_close(got, want):
    leaves = jax.tree_util.tree_leaves_with_path(want)
    errors = {}
    for (path, b), a in zip(leaves, jax.tree.leaves(got), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        errors[jax.tree_util.keystr(path)] = _rel(a, b)
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, bad


def _shard_maps(jaxpr) -> list:
    """Every ``shard_map`` equation of a closed jaxpr, nested jaxprs included."""
    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "shard_map":
                found.append(eqn)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


def _delta_vg(impl, with_state):
    """Jitted ``((o, S_T), grads)`` of ``Σ w ⊙ o + Σ sin(S_T)`` w.r.t. q, k, v, β (and S_0)."""

    def loss(x, s0, sid, w):
        o, s = ops.delta_rule(
            x["q"], x["k"], x["v"], x["beta"], initial_state=s0, segment_ids=sid,
            chunk_size=16, impl=impl,
        )  # fmt: skip
        return jnp.sum(o * w) + jnp.sum(jnp.sin(s)), (o, s)

    argnums = (0, 1) if with_state else (0,)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def test_delta_rule_pallas_on_a_mesh_continues_a_state_like_chunked(mesh):
    x = {n: a for n, a in _seq().items() if n != "g"}
    s0 = np.random.default_rng(3).normal(size=(B, H, K, V)).astype(np.float32)
    w = np.random.default_rng(4).normal(size=(B, T, H, V)).astype(np.float32)
    args = (x, s0, _segments(), w)
    with jax.set_mesh(mesh):
        (_, got), got_grads = _delta_vg("pallas", True)(*args)
        (_, want), want_grads = _delta_vg("chunked", True)(*args)
        maps = _shard_maps(jax.make_jaxpr(_delta_vg("pallas", True))(*args))
    _assert_close((got, got_grads), (want, want_grads))
    assert float(jnp.max(jnp.abs(want_grads[1]))) > 0  # S_0's gradient is not trivially zero
    assert len(maps) == 2  # the forward and its transpose
    flat = list(maps[0].params["in_specs"])  # one spec per operand of the kernel
    assert flat.count(SEQ_SPEC) == 5, flat  # q, k, v, g (= 0) and β split over fsdp × tensor
    assert P("fsdp", "tensor") in flat and P("fsdp") in flat, flat  # S_0 and the segment ids


_gdn_vg = layer_value_and_grads  # (y, ∇_params Σ w ⊙ y) over packed rows


def test_gdn_layer_pallas_on_a_2x2_mesh_equals_chunked(mesh):
    d = 16
    x = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, d)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(6).normal(size=(B, T, d)), jnp.float32)
    sid = _segments()
    out = {}
    with jax.set_mesh(mesh):
        for impl in ("pallas", "chunked"):
            layer = GatedDeltaNet(d, H, K, chunk_size=16, impl=impl, rngs=nnx.Rngs(0))
            out[impl] = nnx.jit(_gdn_vg)(layer, x, sid, w)
        pallas = GatedDeltaNet(d, H, K, chunk_size=16, impl="pallas", rngs=nnx.Rngs(0))
        maps = _shard_maps(jax.make_jaxpr(lambda m: _gdn_vg(m, x, sid, w))(pallas))
    _assert_close(out["pallas"], out["chunked"])
    grads = jax.tree.leaves(out["pallas"][1])
    assert grads and all(float(jnp.max(jnp.abs(g))) > 0 for g in grads)
    assert len(maps) == 2
    assert list(maps[0].params["in_specs"]).count(SEQ_SPEC) == 5


def test_without_a_mesh_pallas_is_the_interpreted_kernel_bit_for_bit():
    """No mesh: ``ops.gated_delta(impl="pallas")`` on CPU is ``gated_delta_pallas(interpret=True)``
    (what the op called before the lowering-platform choice), values and gradients."""
    x = _seq(1)
    sid = _segments()

    def loss(fn):
        def f(x):
            o, s = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], segment_ids=sid)
            return jnp.sum(jnp.sin(o)) + jnp.sum(s * s), (o, s)

        return jax.jit(jax.value_and_grad(f, has_aux=True))

    op = lambda *a, **kw: ops.gated_delta(*a, **kw, chunk_size=16, impl="pallas")  # noqa: E731
    kernel = lambda *a, **kw: gated_delta_pallas(  # noqa: E731
        *a, **kw, block_sizes=BlockSizes(chunk=16), interpret=True
    )
    for a, b in zip(jax.tree.leaves(loss(op)(x)), jax.tree.leaves(loss(kernel)(x)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not _shard_maps(jax.make_jaxpr(loss(op))(x))


def test_the_kernel_without_an_initial_state_differentiates_inside_a_typed_shard_map(mesh):
    """``gated_delta_pallas`` inside a user's ``jax.shard_map`` with the varying-axes check on
    (the Mosaic kernel's setting; traced only, so no TPU is needed): the zero initial state it
    makes varies like ``q``, as the custom VJP's ``∂L/∂S_0`` does (it used to be invariant: "Custom
    VJP bwd rule must produce an output with the same type")."""
    x = _seq(2)

    def loss(q, k, v, g, beta):
        o, s = gated_delta_pallas(q, k, v, g, beta, block_sizes=BlockSizes(chunk=16))
        return jnp.sum(o) + jnp.sum(s)

    grad = jax.shard_map(
        jax.grad(loss, argnums=(0, 1, 2, 3, 4)),
        mesh=mesh,
        in_specs=SEQ_SPEC,
        out_specs=SEQ_SPEC,
        check_vma=True,
    )
    jaxpr = jax.make_jaxpr(grad)(*(x[n] for n in ("q", "k", "v", "g", "beta")))
    assert [eqn.params["check_vma"] for eqn in _shard_maps(jaxpr)] == [True]
