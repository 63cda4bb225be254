"""Train step pieces: masked cross-entropy, schedule, optimizer registry, exact NaN skipping."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nested_jax.parallel.mesh import MESH_AXES, global_batch_from_local, make_mesh
from nested_jax.train.config import MeshConfig, OptimizerConfig, load_config
from nested_jax.train.loop import init_train_setup
from nested_jax.train.optimizer import (
    OPTIMIZERS,
    build_optimizer,
    learning_rate_schedule,
    register_optimizer,
)
from nested_jax.train.step import bits_per_byte, masked_cross_entropy


def test_masked_cross_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, size=(2, 5))
    mask = (rng.random((2, 5)) > 0.3).astype(np.float32)
    logits[0, 0] = np.inf  # a masked-out position with a non-finite logit must not leak
    mask[0, 0] = 0.0
    total, weight = masked_cross_entropy(
        jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask)
    )
    z = logits.astype(np.float64)
    expect = 0.0
    for b in range(2):
        for t in range(5):
            if mask[b, t]:
                lse = np.log(np.exp(z[b, t] - z[b, t].max()).sum()) + z[b, t].max()
                expect += lse - z[b, t, targets[b, t]]
    np.testing.assert_allclose(float(total), expect, rtol=1e-5)
    assert float(weight) == mask.sum()
    with pytest.raises(ValueError, match="logits/targets/mask"):
        masked_cross_entropy(jnp.zeros((2, 5)), jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 5)))


def test_bits_per_byte():
    assert bits_per_byte(math.log(2.0) * 8, 4) == pytest.approx(2.0)
    assert math.isnan(bits_per_byte(1.0, 0))


def test_schedule_warmup_then_cosine_to_min_ratio():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    s = learning_rate_schedule(cfg, 110)
    assert float(s(0)) == 0.0
    assert float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.55, abs=1e-6)  # half-way down the cosine
    assert float(s(110)) == pytest.approx(0.1, abs=1e-6)
    lin = learning_rate_schedule(OptimizerConfig(lr=1.0, warmup_steps=0, decay="linear"), 10)
    assert float(lin(5)) == pytest.approx(0.55)


def test_optimizer_registry_accepts_new_names():
    def sgd(cfg, lr):
        return optax.sgd(lr)

    register_optimizer("test_sgd", sgd)
    try:
        cfg = load_config([], ["optimizer.name=test_sgd"])
        tx, _ = build_optimizer(cfg.optimizer, 10)
        state = tx.init({"w": jnp.ones(3)})
        assert state is not None
    finally:
        OPTIMIZERS.pop("test_sgd")
    with pytest.raises(ValueError, match="optimizer.extra"):
        build_optimizer(OptimizerConfig(extra={"beta": 1.0}), 10)


def _synthetic_batch(seed: int, b: int = 8, t: int = 32, vocab: int = 257) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, size=(b, t + 1)).astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((b, t), np.int32),
        "loss_mask": np.ones((b, t), np.float32),
    }


def test_nan_step_is_skipped_exactly_and_counted():
    cfg = load_config(
        [],
        [
            "model.name=transformer",
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "data.seq_len=32",
            "data.batch_size=8",
            "train.debug_nan_at_steps=[2, 3]",
            "optimizer.warmup_steps=0",
        ],
    )
    mesh = make_mesh(MeshConfig(data=1, fsdp=1), devices=jax.devices()[:1])
    assert mesh.axis_names == MESH_AXES
    setup = init_train_setup(cfg, mesh, token_bytes=np.ones(257, np.int32))
    state = setup.state
    seen = []
    for step in range(1, 5):
        before = jax.tree.map(np.asarray, state)
        state, m = setup.train_step(state, global_batch_from_local(_synthetic_batch(step), mesh))
        after = jax.tree.map(np.asarray, state)
        seen.append((float(m["finite"]), int(m["consecutive_skips"])))
        assert int(after["step"]) == step  # the data position always advances
        same = jax.tree.map(np.array_equal, before["params"], after["params"])
        same_opt = jax.tree.map(np.array_equal, before["opt_state"], after["opt_state"])
        if step in (2, 3):
            assert all(jax.tree.leaves(same)) and all(jax.tree.leaves(same_opt))
            assert math.isnan(float(m["loss"]))
        else:
            assert not any(jax.tree.leaves(same))
            assert np.isfinite(float(m["loss"]))
    assert seen == [(1.0, 0), (0.0, 1), (0.0, 2), (1.0, 0)]


def test_bf16_activations_keep_f32_master_weights_and_optimizer_state():
    cfg = load_config(
        [],
        [
            "model.name=transformer",
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.dtype=bfloat16",
            "data.seq_len=32",
            "data.batch_size=8",
        ],
    )
    mesh = make_mesh(MeshConfig(data=1, fsdp=1), devices=jax.devices()[:1])
    setup = init_train_setup(cfg, mesh)
    state, m = setup.train_step(setup.state, global_batch_from_local(_synthetic_batch(0), mesh))
    assert np.isfinite(float(m["loss"]))
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    import nested_jax.train as train_pkg

    assert train_pkg.train_and_evaluate is not None and "load_config" in train_pkg.__all__
