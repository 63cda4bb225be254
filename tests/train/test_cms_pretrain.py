"""CMS pretrain mode (SPEC §3.3) through the real train step: level ℓ's parameters change only every
``cms.periods[ℓ]`` optimizer steps, with the global learning rate of that step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers.options import CMSOptions
from nested_jax.models import ModelConfig, build_model
from nested_jax.optim.multifreq import MultiFreqState
from nested_jax.train.config import OptimizerConfig
from nested_jax.train.optimizer import build_optimizer, cms_level_of, cms_pretrain_periods
from nested_jax.train.step import make_loss_fn, make_train_step

SMALL = dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, mlp_hidden=16)
PERIODS = (1, 2, 4)
LR, WD, WARMUP, STEPS = 1e-2, 0.1, 8, 8


def _has_multifreq(opt_state) -> bool:
    leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MultiFreqState))
    return any(isinstance(x, MultiFreqState) for x in leaves)


def _opt_cfg(**kw):
    base = dict(lr=LR, warmup_steps=WARMUP, decay="constant", weight_decay=WD, grad_clip=0.0)
    return OptimizerConfig(**{**base, **kw})


def _batch(seed):
    toks = jax.random.randint(jax.random.key(seed), (2, 9), 0, 64, jnp.int32)
    return {
        "inputs": toks[:, :-1],
        "targets": toks[:, 1:],
        "loss_mask": jnp.ones((2, 8), jnp.float32),
    }


def _run(cfg: ModelConfig, opt_cfg: OptimizerConfig):
    model = build_model(cfg, rngs=nnx.Rngs(0))
    graphdef, pstate, rest = nnx.split(model, nnx.Param, ...)
    state_def = jax.tree.structure(pstate)
    params = nnx.to_pure_dict(pstate)
    tx, schedule = build_optimizer(opt_cfg, STEPS, model=cfg)
    step = jax.jit(make_train_step(graphdef, state_def, tx, schedule))
    grad = jax.jit(jax.grad(lambda p, b: make_loss_fn(graphdef, state_def)(p, rest, b)[0]))
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "consecutive_skips": jnp.zeros((), jnp.int32),
    }
    history, grads = [params], []
    for n in range(1, STEPS + 1):
        batch = _batch(n)
        grads.append(grad(state["params"], batch))
        state, metrics = step(state, rest, batch)
        assert float(metrics["finite"]) == 1.0
        history.append(state["params"])
    return history, grads, schedule, state


def _changed(a, b) -> bool:
    return bool(np.any(np.asarray(a) != np.asarray(b)))


def test_levels_step_only_at_their_period_boundaries():
    cfg = ModelConfig(**SMALL, name="hope_attention", cms=CMSOptions(periods=PERIODS))
    history, grads, schedule, state = _run(cfg, _opt_cfg())
    assert _has_multifreq(state["opt_state"])
    for n in range(1, STEPS + 1):
        before, after = history[n - 1], history[n]
        live = n > 1  # the warmup's lr is 0 at step 1: nothing moves
        # Every non-CMS parameter steps every step.
        for path in (("embed",), ("blocks", "mixer", "q_proj", "kernel")):
            a, b = before, after
            for k in path:
                a, b = a[k], b[k]
            assert _changed(a, b) == live, (n, path)
        for lvl, period in enumerate(PERIODS):
            for name in ("w_up", "w_gate", "w_down"):
                moved = _changed(
                    before["blocks"]["mlp"]["levels"][lvl][name],
                    after["blocks"]["mlp"]["levels"][lvl][name],
                )
                assert moved == (live and n % period == 0), (n, lvl, name)

    # The slowest level's first step (global step 4) is AdamW's first step on the SUM of the
    # four gradients, at the global lr of step 4 (schedule count 3, inside the warmup).
    lvl, period = 2, PERIODS[2]
    for name in ("w_up", "w_down"):
        acc = sum(np.asarray(g["blocks"]["mlp"]["levels"][lvl][name]) for g in grads[:period])
        p0 = np.asarray(history[0]["blocks"]["mlp"]["levels"][lvl][name])
        lr = float(schedule(period - 1))
        assert 0 < lr < LR
        expect = p0 - lr * (acc / (np.abs(acc) + 1e-8) + WD * p0)
        got = np.asarray(history[period]["blocks"]["mlp"]["levels"][lvl][name])
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-7)


def test_mean_accumulation_and_clipping_still_respect_the_periods():
    cfg = ModelConfig(
        **SMALL,
        name="hope_attention",
        cms=CMSOptions(periods=(2, 4), variant="independent", accumulate="mean"),
    )
    history, _, _, _ = _run(cfg, _opt_cfg(grad_clip=1.0, warmup_steps=0))
    for n in range(1, STEPS + 1):
        for lvl, period in enumerate((2, 4)):
            moved = _changed(
                history[n - 1]["blocks"]["mlp"]["levels"][lvl]["w_up"],
                history[n]["blocks"]["mlp"]["levels"][lvl]["w_up"],
            )
            assert moved == (n % period == 0), (n, lvl)
        # mix_logits are ordinary parameters: every step.
        assert _changed(
            history[n - 1]["blocks"]["mlp"]["mix_logits"], history[n]["blocks"]["mlp"]["mix_logits"]
        )


@pytest.mark.parametrize(
    "model",
    [
        None,
        ModelConfig(**SMALL, name="transformer"),
        ModelConfig(**SMALL, name="hope_attention", cms=CMSOptions(mode="online")),
    ],
    ids=["no-model", "transformer", "online-mode"],
)
def test_optimizer_is_wrapped_only_in_pretrain_mode(model):
    assert cms_pretrain_periods(model) is None
    params = {"w": jnp.ones((2, 2))}
    tx, _ = build_optimizer(_opt_cfg(), 10, model=model)
    assert not _has_multifreq(tx.init(params))
    pre = ModelConfig(**SMALL, name="hope_attention", cms=CMSOptions(periods=(1, 8)))
    assert cms_pretrain_periods(pre) == (1, 8)


def test_level_labels_cover_only_the_block_ffn():
    params = {
        "embed": jnp.ones(3),
        "blocks": {
            "mixer": {"levels": {0: {"w": jnp.ones(2)}}},  # a mixer's own "levels": not CMS
            "mlp": {"levels": {0: {"w_up": jnp.ones(2)}, 1: {"w_up": jnp.ones(2)}}},
        },
    }
    labels = cms_level_of(params)
    assert labels["embed"] is None and labels["blocks"]["mixer"]["levels"][0]["w"] is None
    assert labels["blocks"]["mlp"]["levels"][0]["w_up"] == 0
    assert labels["blocks"]["mlp"]["levels"][1]["w_up"] == 1
