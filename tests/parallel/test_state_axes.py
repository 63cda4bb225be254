"""Memory states carry logical axis names: on a mesh the ops return them split like their inputs.

Every per-head state an op returns is pinned to ``("batch", "heads", None, …)``
(:func:`nested_jax.ops._state.pin_head_state`): batch over ``data × fsdp``, heads over ``tensor``.
The inputs below are plain host arrays, so without the pin the partitioner would have no reason to
split the state; each test fails if an op stops pinning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from nested_jax import ops
from nested_jax.ops.hola import HolaRule
from nested_jax.parallel.mesh import make_mesh
from nested_jax.train.config import MeshConfig

B, T, H, K = 4, 8, 4, 8
HEADS_SPEC = P(("data", "fsdp"), "tensor")  # ("batch", "heads", None, ...) on a 2×2×2 mesh


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(B, T, H, K)).astype(np.float32) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -rng.uniform(0.01, 0.5, size=(B, T, H)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, size=(B, T, H)).astype(np.float32)
    return q, k, v, g, beta


def _assert_head_sharded(tree):
    leaves = [a for a in jax.tree.leaves(tree) if a.ndim >= 2]
    assert leaves
    for a in leaves:
        assert a.sharding.spec == HEADS_SPEC, (a.shape, a.sharding.spec)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_linear_rules_pin_their_final_state(mesh, impl):
    q, k, v, g, beta = _inputs()
    calls = {
        "linear_attention": lambda: ops.linear_attention(q, k, v, impl=impl, chunk_size=4),
        "delta_rule": lambda: ops.delta_rule(q, k, v, beta, impl=impl, chunk_size=4),
        "gated_delta": lambda: ops.gated_delta(q, k, v, g, beta, impl=impl, chunk_size=4),
    }
    for name, call in calls.items():
        with jax.set_mesh(mesh):
            o, state = jax.jit(call)()
        assert state.shape == (B, H, K, K), name
        _assert_head_sharded(state)
        _, plain = call()  # off the mesh the pin is the identity: same values
        np.testing.assert_allclose(np.asarray(state), np.asarray(plain), rtol=1e-5, atol=1e-6)


def test_hola_pins_its_state_and_cache(mesh):
    q, k, v, g, beta = _inputs(1)
    params = ops.HolaReadParams(
        jnp.ones((H, K)), jnp.ones((H, K)), jnp.zeros((H,)), jnp.zeros((H,))
    )
    rule = HolaRule(window=2, block_size=4)
    with jax.set_mesh(mesh):
        _, state = jax.jit(
            lambda: ops.hola.hola(q, k, v, g, beta, params, rule=rule, chunk_size=4)
        )()
    _assert_head_sharded(state)  # S, the cache, the block buffer and their scores
    assert state.pos.ndim == 0  # the shared position counter is left alone


@pytest.mark.parametrize("layers", [1, 2])
def test_titans_memory_pins_weights_and_momenta(mesh, layers):
    q, k, v, _, _ = _inputs(2)
    gates = [np.full((B, T, H), c, np.float32) for c in (0.05, 0.9, 0.01)]  # θ, η, α
    dims = (K,) * (layers + 1)
    spec = ops.titans.TitansMemorySpec(dims=dims, rule=ops.TitansRule(memory_chunk=4))
    state = ops.titans.titans_mlp_state(
        ops.titans.titans_mlp_init_weights(jax.random.key(0), H, dims), B
    )
    with jax.set_mesh(mesh):
        _, final = jax.jit(
            lambda: ops.titans_memory(q, k, v, *gates, initial_state=state, spec=spec)
        )()
    _assert_head_sharded(final)


def test_hope_memories_pin_memories_and_momenta(mesh):
    from nested_jax.ops.hope import HopeMemories, HopeReadout, HopeRule, MLPMemory, hope_init_state

    rng = np.random.default_rng(3)
    h = 6
    mem = lambda: MLPMemory(  # noqa: E731
        jnp.asarray(0.3 * rng.normal(size=(H, K, h)), jnp.float32),
        jnp.asarray(0.3 * rng.normal(size=(H, h, K)), jnp.float32),
    )
    state = hope_init_state(HopeMemories(*(mem() for _ in range(5))), B, momentum=True)
    readout = HopeReadout(jnp.zeros((H, K)), jnp.zeros((H,)), jnp.zeros((H, K)), jnp.ones((H,)))
    x, q, _, _, _ = _inputs(4)
    rule = HopeRule(chunk_memory=4, chunk_other=2, momentum=True, chunk_updates="parallel")
    with jax.set_mesh(mesh):
        _, final = jax.jit(
            lambda: ops.hope_memories(x, q, readout, initial_state=state, rule=rule)
        )()
    _assert_head_sharded(final)  # five memories and their momenta, w1 and w2
