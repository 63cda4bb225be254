"""Proteus training-time wrapper (SPEC §4): locked parameter blocks stay bit-identical."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nested_jax.core.proteus import proteus_active_blocks
from nested_jax.optim.proteus_mask import (
    ProteusMaskState,
    block_axes_by_path,
    proteus_adamw,
    proteus_mask,
    proteus_update_masks,
)

N, E, H = 8, 4, 10  # Δ = 2 steps per block; hidden size 10 → blocks of 2, 2, 2, 4

AXES = block_axes_by_path({r"mlp/w_in$": -1, r"mlp/w_out$": 0, r"mlp/b_hidden$": 0})


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "mlp": {
            "w_in": jnp.asarray(rng.normal(size=(3, H)), jnp.float32),  # [d, h]: columns = hidden
            "w_out": jnp.asarray(rng.normal(size=(H, 3)), jnp.float32),  # [h, d]: rows = hidden
            "b_hidden": jnp.asarray(rng.normal(size=(H,)), jnp.float32),
        },
        "other": jnp.asarray(rng.normal(size=(3, 3)), jnp.float32),  # never blocked
    }


def _grads(n, seed=1):
    rng = np.random.default_rng(seed)
    p = _params()
    return [
        jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), p) for _ in range(n)
    ]


def _open_hidden(step):
    """Hidden units open at 1-based optimizer step ``step`` (blocks of 2, last block 4 wide)."""
    k = proteus_active_blocks(step, N, E)
    return np.arange(H) < (H if k == E else 2 * k)


def _hidden_view(path_key, x):
    x = np.asarray(x)
    return x.T if path_key == "w_in" else x  # hidden axis first


def test_axes_by_path_and_masks():
    p = _params()
    assert AXES(p) == {"mlp": {"w_in": -1, "w_out": 0, "b_hidden": 0}, "other": None}
    masks = proteus_update_masks(3, p, AXES, N, E)
    assert masks["other"] is None
    assert masks["mlp"]["w_in"].shape == (1, H) and masks["mlp"]["w_out"].shape == (H, 1)
    np.testing.assert_array_equal(masks["mlp"]["b_hidden"], _open_hidden(3))
    np.testing.assert_array_equal(masks["mlp"]["w_in"][0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("wrap", ["adamw_in_chain", "proteus_adamw"])
def test_locked_blocks_bit_identical_with_adamw_and_decay(wrap):
    lr, wd = 0.05, 0.1
    if wrap == "adamw_in_chain":
        tx = proteus_mask(
            optax.adamw(lr, weight_decay=wd), block_axis_fn=AXES, total_steps=N, num_blocks=E
        )
    else:
        tx = proteus_adamw(lr, weight_decay=wd, block_axis_fn=AXES, total_steps=N, num_blocks=E)
    params = _params()
    state = tx.init(params)
    assert isinstance(state, ProteusMaskState)
    update = jax.jit(tx.update)
    locked_seen = 0
    for step, g in enumerate(_grads(10), start=1):  # beyond N = 8 everything is open
        u, state = update(g, state, params)
        new = optax.apply_updates(params, u)
        is_open = _open_hidden(step)
        for key in ("w_in", "w_out", "b_hidden"):
            before = _hidden_view(key, params["mlp"][key])
            after = _hidden_view(key, new["mlp"][key])
            np.testing.assert_array_equal(after[~is_open], before[~is_open])  # bit-identical
            assert (after[is_open] != before[is_open]).all()  # open units all moved
            locked_seen += (~is_open).sum()
        assert (np.asarray(new["other"]) != np.asarray(params["other"])).all()
        params = new
    assert locked_seen > 0
    assert int(state.count) == 10


def test_unmasked_decay_moves_locked_blocks_only_by_decay():
    lr, wd = 0.05, 0.1
    tx = proteus_adamw(
        lr,
        weight_decay=wd,
        block_axis_fn=AXES,
        total_steps=N,
        num_blocks=E,
        mask_weight_decay=False,
    )
    ref = optax.adamw(lr, weight_decay=wd)  # what open coordinates get (same gated gradients)
    params = _params()
    state, ref_state = tx.init(params), ref.init(params)
    update = jax.jit(tx.update)
    for step, g in enumerate(_grads(4), start=1):
        u, state = update(g, state, params)
        new = optax.apply_updates(params, u)
        is_open = _open_hidden(step)
        for key in ("w_in", "w_out", "b_hidden"):
            before = _hidden_view(key, params["mlp"][key])
            after = _hidden_view(key, new["mlp"][key])
            # locked: exactly the decoupled decay θ ← θ − lr·wd·θ, nothing from Adam
            np.testing.assert_allclose(after[~is_open], (1 - lr * wd) * before[~is_open], rtol=1e-6)
            assert (after[~is_open] != before[~is_open]).all()
        # open coordinates: AdamW on the masked gradients (ref fed the same masked gradients)
        masks = proteus_update_masks(step, g, AXES, N, E)
        gm = jax.tree.map(
            lambda x, m: x if m is None else jnp.where(m, x, 0.0),
            g,
            masks,
            is_leaf=lambda x: x is None,
        )
        ru, ref_state = ref.update(gm, ref_state, params)
        b = np.asarray(_hidden_view("b_hidden", u["mlp"]["b_hidden"]))
        np.testing.assert_allclose(
            b[is_open], np.asarray(ru["mlp"]["b_hidden"])[is_open], rtol=1e-5
        )
        params = new


def test_single_block_is_the_inner_optimizer_and_jits_once():
    tx = proteus_mask(
        optax.adamw(0.01, weight_decay=0.1), block_axis_fn=AXES, total_steps=N, num_blocks=1
    )
    ref = optax.adamw(0.01, weight_decay=0.1)
    params = _params()
    s, rs = tx.init(params), ref.init(params)
    chex.clear_trace_counter()  # chex keys its trace counts by definition site, across tests
    step = jax.jit(chex.assert_max_traces(tx.update, n=1))  # raises on a second trace
    for g in _grads(5):
        u, s = step(g, s, params)
        ru, rs = ref.update(g, rs, params)
        chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-7)


def test_errors():
    p = _params()
    with pytest.raises(ValueError, match="block axis"):
        proteus_update_masks(
            1, p, {"mlp": {"w_in": 2, "w_out": 0, "b_hidden": 0}, "other": None}, N, E
        )
    with pytest.raises(ValueError, match="num_blocks"):
        proteus_update_masks(1, p, AXES, N, 16)  # 10 hidden units < 16 blocks
    with pytest.raises(ValueError, match="total_steps"):
        proteus_mask(optax.sgd(0.1), block_axis_fn=AXES, total_steps=0, num_blocks=E)
    with pytest.raises(ValueError, match="block_axis_fn"):
        proteus_update_masks(1, p, {"mlp": None}, N, E)
    tx = proteus_adamw(
        0.1, block_axis_fn=AXES, total_steps=N, num_blocks=E, mask_weight_decay=False
    )
    with pytest.raises(ValueError, match="params"):
        tx.update(p, tx.init(p))
