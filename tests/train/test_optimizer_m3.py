"""optimizer.name=m3 is registered in the training optimizer registry and trains (SPEC §3.5)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from train_helpers import tiny_overrides

from nested_jax.models import ModelConfig, build_model
from nested_jax.train.config import OptimizerConfig, load_config
from nested_jax.train.loop import train_and_evaluate
from nested_jax.train.metrics import read_metrics
from nested_jax.train.optimizer import OPTIMIZERS, build_optimizer
from nested_jax.train.step import make_train_step


def test_m3_is_registered_and_reads_extra():
    assert "m3" in OPTIMIZERS
    cfg = load_config([], ["optimizer.name=m3", "optimizer.extra={slow_every: 2, alpha: 0.5}"])
    assert cfg.optimizer.extra == {"slow_every": 2, "alpha": 0.5}
    build_optimizer(cfg.optimizer, 10)  # accepted keys build


def test_m3_rejects_unknown_extra():
    cfg = load_config([], ["optimizer.name=m3", "optimizer.extra={nope: 1}"])
    try:
        build_optimizer(cfg.optimizer, 10)
    except ValueError as err:
        assert "nope" in str(err)
    else:
        raise AssertionError("unknown optimizer.extra key was accepted")


def test_m3_train_step_three_finite_steps():
    """build_optimizer(optimizer.name=m3) + the pure train step: 3 finite steps that move params."""
    model = build_model(
        ModelConfig(name="gdn", vocab_size=32, d_model=32, n_layers=1, n_heads=2, chunk_size=8),
        rngs=nnx.Rngs(0),
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state_def = jax.tree.structure(params)
    params = nnx.to_pure_dict(params)
    ocfg = OptimizerConfig(name="m3", lr=1e-2, warmup_steps=1, extra={"slow_every": 2})
    tx, schedule = build_optimizer(ocfg, 3)
    step = jax.jit(make_train_step(graphdef, state_def, tx, schedule))
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "consecutive_skips": jnp.zeros((), jnp.int32),
    }
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, size=(4, 17)).astype(np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": np.ones((4, 16), np.float32),
    }
    losses = []
    for _ in range(3):
        state, m = step(state, rest, batch)
        assert float(m["finite"]) == 1.0
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and int(state["step"]) == 3
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state["params"], params)
    assert all(jax.tree.leaves(moved))
    assert losses[-1] < losses[0]  # same batch three times: the loss must go down


def test_m3_config_trains_three_finite_steps(corpus, data_dir, tmp_path):
    extra = {
        "optimizer.name": "m3",
        "optimizer.extra": "{slow_every: 2}",  # a slow step happens inside the 3 steps
        "train.steps": 3,
        "train.checkpoint_every": 3,
    }
    cfg = load_config([], tiny_overrides(corpus, data_dir, **extra))
    assert cfg.optimizer.name == "m3"
    summary = train_and_evaluate(cfg, tmp_path / "run", devices=jax.devices()[:1])
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["steps"] == 3 and saved["skipped_steps"] == 0
    assert np.isfinite(summary["final_train_loss"]) and np.isfinite(summary["val_loss"])
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r and "step" in r]
    assert len(rows) >= 3 and all(np.isfinite(r["loss"]) for r in rows)
