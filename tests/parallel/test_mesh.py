"""Mesh construction, logical-axis rules, parameter / batch shardings, and 4×2 mesh == 1 device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from nested_jax.parallel.mesh import (
    LOGICAL_AXIS_RULES,
    batch_sharding,
    constrain,
    global_batch_from_local,
    logical_to_mesh_spec,
    make_mesh,
    resolve_mesh_shape,
    state_shardings,
)
from nested_jax.train.config import MeshConfig, load_config
from nested_jax.train.loop import init_train_setup


def test_resolve_mesh_shape():
    assert resolve_mesh_shape(1, -1, 8) == (1, 8, 1, 1)
    assert resolve_mesh_shape(-1, 2, 8) == (4, 2, 1, 1)
    assert resolve_mesh_shape(4, 2, 8) == (4, 2, 1, 1)
    assert resolve_mesh_shape(1, -1, 8, tensor=2) == (1, 4, 1, 2)
    assert resolve_mesh_shape(2, 2, 8, tensor=-1) == (2, 2, 1, 2)
    assert resolve_mesh_shape(1, 2, 8, seq=-1) == (1, 2, 4, 1)
    with pytest.raises(ValueError, match=r"mesh\.fsdp: mesh\.data × mesh\.fsdp × mesh\.seq × "):
        resolve_mesh_shape(2, 2, 8)
    with pytest.raises(ValueError, match=r"mesh\.data: 3 does not divide"):
        resolve_mesh_shape(3, -1, 8)
    with pytest.raises(ValueError, match=r"mesh\.tensor: 3 does not divide"):
        resolve_mesh_shape(1, -1, 8, tensor=3)
    with pytest.raises(ValueError, match=r"at most one of"):
        resolve_mesh_shape(1, -1, 8, tensor=-1)


def test_make_mesh_axes_and_types():
    mesh = make_mesh(MeshConfig(data=4, fsdp=2))
    assert mesh.axis_names == ("data", "fsdp", "seq", "tensor")
    assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "seq": 1, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    one = make_mesh(MeshConfig(data=1, fsdp=-1), devices=jax.devices()[:1])
    assert dict(one.shape) == {"data": 1, "fsdp": 1, "seq": 1, "tensor": 1}
    tp = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=2))
    assert dict(tp.shape) == {"data": 1, "fsdp": 4, "seq": 1, "tensor": 2}
    cp = make_mesh(MeshConfig(data=1, fsdp=2, seq=4))
    assert dict(cp.shape) == {"data": 1, "fsdp": 2, "seq": 4, "tensor": 1}
    with pytest.raises(ValueError, match=r"mesh\.slices: 3 does not divide the 8 devices"):
        make_mesh(MeshConfig(slices=3))


def test_constrain_pins_activations_on_a_mesh_and_is_a_no_op_without_one():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    x = np.ones((8, 4, 6), np.float32)

    def f(a):
        return constrain(a * 2.0, ("batch", None, "vocab"))

    with jax.set_mesh(mesh):
        y = jax.jit(f)(x)
    assert y.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), 2.0 * x)  # no mesh: unchanged
    # A dimension the axes do not divide stays replicated instead of failing.
    with jax.set_mesh(mesh):
        z = jax.jit(lambda a: constrain(a, ("batch", None, "vocab")))(np.ones((6, 4, 5)))
    assert z.sharding.spec == P()
    with pytest.raises(ValueError, match=r"logical: expected 3 names"):
        constrain(x, ("batch", None))


def test_logical_rules_map_names_to_mesh_axes():
    mesh = make_mesh(MeshConfig(data=4, fsdp=2))
    assert LOGICAL_AXIS_RULES["embed"] == "fsdp"
    assert logical_to_mesh_spec(("embed", "mlp"), (8, 6), mesh) == P("fsdp")
    assert logical_to_mesh_spec(("vocab", "embed"), (257, 8), mesh) == P(None, "fsdp")
    # Not divisible by the fsdp size: replicated rather than an invalid sharding.
    assert logical_to_mesh_spec(("embed",), (7,), mesh) == P()
    assert logical_to_mesh_spec(("batch", None), (8, 3), mesh) == P(("data", "fsdp"))
    assert logical_to_mesh_spec(None, (3,), mesh) == P()
    assert batch_sharding(mesh).spec == P(("data", "fsdp"))


def test_param_shardings_follow_nnx_partition_metadata():
    class Tiny(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal()
            self.w = nnx.Param(init(rngs.params(), (8, 6)), out_sharding=("embed", "mlp"))
            self.e = nnx.Param(init(rngs.params(), (5, 8)), out_sharding=("vocab", "embed"))
            self.b = nnx.Param(np.zeros((6,), np.float32))

    with nnx.use_eager_sharding(False):
        model = Tiny(nnx.Rngs(0))
    mesh = make_mesh(MeshConfig(data=4, fsdp=2))
    specs = jax.tree.map(
        lambda s: s.spec, nnx.to_pure_dict(state_shardings(nnx.state(model), mesh))
    )
    assert specs == {"w": P("fsdp"), "e": P(None, "fsdp"), "b": P()}
    tp = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    specs = jax.tree.map(lambda s: s.spec, nnx.to_pure_dict(state_shardings(nnx.state(model), tp)))
    # mlp and vocab go to the tensor axis (the vocab of 5 does not divide 2: replicated).
    assert specs == {"w": P("fsdp", "tensor"), "e": P(None, "fsdp"), "b": P()}


def test_global_batch_from_local_is_sharded_over_data_and_fsdp():
    mesh = make_mesh(MeshConfig(data=4, fsdp=2))
    local = {"inputs": np.arange(16 * 3, dtype=np.int32).reshape(16, 3)}
    out = global_batch_from_local(local, mesh)["inputs"]
    assert out.shape == (16, 3)
    np.testing.assert_array_equal(np.asarray(out), local["inputs"])
    assert out.sharding.spec == P(("data", "fsdp"))
    assert {s.data.shape for s in out.addressable_shards} == {(2, 3)}


def _batches(n: int, b: int = 8, t: int = 32):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tok = rng.integers(0, 256, size=(b, t + 1)).astype(np.int32)
        seg = np.ones((b, t), np.int32)
        seg[:, t // 2 :] = 2  # a packed second document: segment resets must shard too
        out.append(
            {
                "inputs": tok[:, :-1],
                "targets": tok[:, 1:],
                "segment_ids": seg,
                "loss_mask": np.ones((b, t), np.float32),
            }
        )
    return out


@pytest.mark.parametrize(
    "model_name",
    # GDN compiles ~5x slower than attention on 8 fake devices: run it with the slow tests.
    ["transformer", pytest.param("gdn", marks=pytest.mark.slow)],
)
def test_data_fsdp_mesh_matches_one_device_trajectory(model_name):
    cfg = load_config(
        [],
        [
            f"model.name={model_name}",
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.chunk_size=16",
            "data.seq_len=32",
            "data.batch_size=8",
            "optimizer.warmup_steps=0",
            "optimizer.lr=0.01",
        ],
    )
    batches = _batches(4)
    one, _ = _trajectory(cfg, make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1]), batches)
    assert np.all(np.isfinite(one))
    fsdp, specs = _trajectory(cfg, make_mesh(MeshConfig(data=4, fsdp=2)), batches)
    assert any("fsdp" in s for s in specs)  # parameters really are sharded along fsdp
    np.testing.assert_allclose(fsdp, one, rtol=1e-5)
    tp, specs = _trajectory(cfg, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), batches)
    assert any("tensor" in s for s in specs)  # ... and along tensor
    np.testing.assert_allclose(tp, one, rtol=1e-5)


def _trajectory(cfg, mesh, batches) -> tuple[np.ndarray, list[str]]:
    """Losses of a few train steps on `mesh` and the parameters' partition specs."""
    setup = init_train_setup(cfg, mesh, token_bytes=np.ones(257, np.int32))
    specs = [str(x.sharding.spec) for x in jax.tree.leaves(setup.state["params"])]
    state, out = setup.state, []
    for b in batches:
        state, m = setup.train_step(state, global_batch_from_local(b, mesh))
        out.append(float(m["loss"]))
    return np.array(out), specs


@pytest.mark.parametrize("name", ["adamw", "m3"])
def test_optimizer_state_shardings_follow_parameters(name):
    from nested_jax.parallel.mesh import shardings_like_params
    from nested_jax.train.config import OptimizerConfig
    from nested_jax.train.optimizer import build_optimizer

    mesh = make_mesh(MeshConfig(data=4, fsdp=2))
    params = {"w": np.zeros((8, 6), np.float32), "b": np.zeros((6,), np.float32)}
    shard = {"w": jax.sharding.NamedSharding(mesh, P("fsdp")), "b": batch_sharding(mesh, 1)}
    tx, _ = build_optimizer(OptimizerConfig(name=name), 10)
    abstract = jax.eval_shape(tx.init, params)
    specs = jax.tree_util.tree_leaves_with_path(
        shardings_like_params(abstract, params, shard, mesh)
    )
    shapes = jax.tree.leaves(abstract)
    assert len(specs) == len(shapes)
    for (path, sh), leaf in zip(specs, shapes, strict=True):
        last = path[-1]
        if isinstance(last, jax.tree_util.DictKey) and last.key == "w" and leaf.shape == (8, 6):
            assert sh.spec == P("fsdp"), path  # moments of w are sharded like w
        elif leaf.ndim == 0:
            assert sh.spec == P(), path  # counts stay replicated
    assert any(sh.spec == P("fsdp") for _, sh in specs)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["gdn", "titans_lmm", "hope", "hola"])
def test_tensor_axis_shards_memory_heads_and_matches_one_device(model_name):
    """Per-head memory parameters carry the "heads" name: on a tensor axis they shard by head and
    the trajectory equals one device's."""
    cfg = load_config(
        [f"configs/experiments/tiny_{model_name}.yaml"],
        [
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.head_dim=16",
            "model.chunk_size=16",
            "model.vocab_size=257",
            "data.tokenizer=byte",
            "data.seq_len=32",
            "data.batch_size=8",
            "optimizer.warmup_steps=0",
        ],
    )
    batches = _batches(2)
    one, _ = _trajectory(cfg, make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1]), batches)
    assert np.all(np.isfinite(one))
    tp, specs = _trajectory(cfg, make_mesh(MeshConfig(data=1, fsdp=4, tensor=2)), batches)
    assert any("tensor" in s for s in specs)
    np.testing.assert_allclose(tp, one, rtol=2e-5)
