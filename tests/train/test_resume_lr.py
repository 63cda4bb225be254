"""A resume with a new learning-rate schedule keeps the saved optimizer state and uses the new
rate from its first step (nested_jax.train.workdir.SCHEDULE_FIELDS)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_helpers import tiny_overrides

from nested_jax.parallel.mesh import global_batch_from_local
from nested_jax.train.config import load_config
from nested_jax.train.loop import (
    BATCH_KEYS,
    init_train_setup,
    prepare_data,
    restore_or_start,
    train_and_evaluate,
)
from nested_jax.train.optimizer import with_fresh_hyperparams
from nested_jax.train.workdir import plan_resume, record_run

ONE = jax.devices()[:1]
LR, LOWER = 0.01, 0.0025


def _adamw_with_rate_in_state(cfg, schedule):
    # A constant rate held in the state by inject_hyperparams (the schedule is ignored on purpose):
    # a restored state would keep the saved rate unless the resume refreshes it.
    return optax.inject_hyperparams(optax.adamw)(learning_rate=cfg.lr, weight_decay=0.0)


def _rate(opt_state):
    kind = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    (found,) = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind))
        if isinstance(s, kind)
    ]
    return found.hyperparams["learning_rate"]


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _leaves(tree):
    return jax.tree.leaves(jax.device_get(tree))


@pytest.mark.slow  # two compiled train steps and a 2-step run: about 30 s on 2 CPU cores
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_rate_in_state"])
def test_a_lower_lr_on_resume_keeps_the_moments_and_takes_effect(
    tmp_path, corpus, data_dir, monkeypatch, optimizer
):
    from nested_jax.train import optimizer as opt_module

    monkeypatch.setitem(opt_module.OPTIMIZERS, "adamw_rate_in_state", _adamw_with_rate_in_state)
    sets = {
        "optimizer.name": optimizer,
        "optimizer.decay": "constant",
        "optimizer.warmup_steps": 0,
        "optimizer.lr": LR,
        "train.steps": 2,
    }
    cfg = load_config([], tiny_overrides(corpus, data_dir, **sets))
    work = tmp_path / "run"
    train_and_evaluate(cfg, work, devices=ONE)

    lower = dataclasses.replace(
        cfg,
        optimizer=dataclasses.replace(cfg.optimizer, lr=LOWER),
        train=dataclasses.replace(cfg.train, steps=3),
    )
    plan = plan_resume(lower, work)  # allowed without --reset-optimizer
    assert [c.field for c in plan.changes] == ["optimizer.lr", "train.steps"]
    prep = prepare_data(lower, work, plan, ONE)
    ckpt, start, state, iterator = restore_or_start(
        lower, work, prep.setup, prep.make_iterator, plan
    )
    saved = ckpt.restore_latest(prep.setup.state, None)[1]  # checkpoint 2 as written
    ckpt.manager.close()
    assert start == 2

    # Moments and counts exactly as saved; only a rate held in the state takes the new value.
    fresh = prep.setup.state["opt_state"]
    as_saved = with_fresh_hyperparams(saved["opt_state"], fresh)
    for got, want in zip(_leaves(state["opt_state"]), _leaves(as_saved), strict=True):
        np.testing.assert_array_equal(got, want)
    if optimizer == "adamw_rate_in_state":
        assert _rate(state["opt_state"]) == np.float32(LOWER)  # (held as float32)
        assert _rate(saved["opt_state"]) == np.float32(LR)

    # The next update: the resumed step against the same state stepped at the old rate. AdamW's
    # whole update (moments' direction and weight decay) scales with the rate.
    local = next(iterator)
    batch = global_batch_from_local({k: local[k] for k in BATCH_KEYS}, prep.setup.mesh)
    before = _leaves(state["params"])
    old_state = {**_copy(state), "opt_state": saved["opt_state"]}
    resumed, _ = prep.setup.train_step(state, batch)  # (the step donates its input state)
    stepped_old, _ = init_train_setup(cfg, prep.setup.mesh).train_step(old_state, batch)
    after = zip(before, _leaves(resumed["params"]), _leaves(stepped_old["params"]), strict=True)
    for p, new, old in after:
        np.testing.assert_allclose(new - p, (LOWER / LR) * (old - p), rtol=1e-3, atol=1e-7)

    # the resumed run records the change like any other applied on resume
    record_run(lower, work, plan, prep.spec, prep.bundle.tokenizer, start)
    history = [json.loads(x) for x in (work / "config_history.jsonl").read_text().splitlines()]
    assert {"resumed_at_step": 2, "field": "optimizer.lr", "old": LR, "new": LOWER} in history
