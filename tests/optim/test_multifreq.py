"""CMS pretrain mode: multi_frequency steps each level every C^(ℓ) optimizer steps (SPEC §3.3)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nested_jax.core.cms.levels import cms_init_levels
from nested_jax.optim.multifreq import MultiFreqState, level_labels_by_index, multi_frequency

PERIODS = (2, 3)
N_STEPS = 13  # not a multiple of any period: the last accumulation stays pending


def make_params():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "fast": jax.random.normal(k[0], (3, 4)),  # level 0, C = 2
        "slow": {"w": jax.random.normal(k[1], (4,)), "b": jnp.ones((2, 2))},  # level 1, C = 3
        "other": jax.random.normal(k[2], (5,)),  # None: every step
    }


LEVEL_OF = {"fast": 0, "slow": {"w": 1, "b": 1}, "other": None}
GROUP = {"fast": 0, "slow": 1, "other": None}


def grads_at(params, n):
    # gradients that depend on the params and on the step (so accumulation order matters)
    key = jax.random.PRNGKey(100 + n)
    noise = jax.tree.map(
        lambda p, kk: jax.random.normal(kk, p.shape),
        params,
        jax.tree.unflatten(
            jax.tree.structure(params), list(jax.random.split(key, len(jax.tree.leaves(params))))
        ),
    )
    return jax.tree.map(lambda p, z: jnp.sin(p) + z, params, noise)


def run_wrapped(tx, params, n_steps):
    state = tx.init(params)

    @jax.jit
    def step(params, state, n):
        g = grads_at(params, n)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    hist = [params]
    for n in range(1, n_steps + 1):
        params, state = step(params, state, n)
        hist.append(params)
    return hist, state, step


def run_hand(make_inner, params, n_steps, accumulate="sum"):
    """Separate plain optax instances per group, stepped with a Python `if` on the step count."""
    groups = {"fast": PERIODS[0], "slow": PERIODS[1], "other": 1}
    inners = {name: make_inner() for name in groups}
    states = {name: inners[name].init(params[name]) for name in groups}
    acc = {name: jax.tree.map(jnp.zeros_like, params[name]) for name in groups}
    hist = [params]
    for n in range(1, n_steps + 1):
        g = grads_at(params, n)
        new = dict(params)
        for name, C in groups.items():
            acc[name] = jax.tree.map(jnp.add, acc[name], g[name])
            if n % C == 0:
                feed = acc[name]
                if accumulate == "mean":
                    feed = jax.tree.map(lambda a, C=C: a / C, feed)
                u, states[name] = inners[name].update(feed, states[name], params[name])
                new[name] = optax.apply_updates(params[name], u)
                acc[name] = jax.tree.map(jnp.zeros_like, acc[name])
        params = new
        hist.append(params)
    return hist


@pytest.mark.parametrize(
    "name,make_inner,accumulate",
    [
        ("sgd_sum", lambda: optax.sgd(0.1), "sum"),
        ("adamw_mean", lambda: optax.adamw(0.05, weight_decay=0.1), "mean"),
        ("momentum_sum", lambda: optax.sgd(0.05, momentum=0.9), "sum"),
    ],
    ids=["sgd_sum", "adamw_mean", "momentum_sum"],
)
def test_matches_hand_loop_and_steps_only_every_period(name, make_inner, accumulate):
    params = make_params()
    tx = multi_frequency(make_inner(), level_of=LEVEL_OF, periods=PERIODS, accumulate=accumulate)
    hist, state, step = run_wrapped(tx, params, N_STEPS)
    ref = run_hand(make_inner, params, N_STEPS, accumulate)
    for n in range(N_STEPS + 1):
        chex.assert_trees_all_close(hist[n], ref[n], rtol=1e-5, atol=1e-5)
    for n in range(1, N_STEPS + 1):
        for key, g in GROUP.items():
            C = 1 if g is None else PERIODS[g]
            moved = any(
                not np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(
                    jax.tree.leaves(hist[n][key]), jax.tree.leaves(hist[n - 1][key]), strict=True
                )
            )
            assert moved == (n % C == 0), (key, n)
    assert int(state.count) == N_STEPS
    # pending accumulation after step 13: fast holds g_13 (13 mod 2 = 1), slow holds g_13
    # (13 mod 3 = 1); "other" keeps no accumulator
    assert isinstance(state.accum["other"], optax.MaskedNode)
    chex.assert_trees_all_close(
        state.accum["fast"], grads_at(hist[12], 13)["fast"], rtol=1e-5, atol=1e-5
    )
    chex.assert_trees_all_close(
        state.accum["slow"], grads_at(hist[12], 13)["slow"], rtol=1e-5, atol=1e-5
    )
    assert step._cache_size() == 1  # one compilation for every step of the cycle


def test_period_one_level_is_plain_inner_and_callable_level_of():
    params = make_params()
    tx = multi_frequency(
        optax.adam(0.1),
        level_of=lambda p: {"fast": 0, "slow": {"w": 0, "b": 0}, "other": None},
        periods=(1,),
    )
    hist, _, _ = run_wrapped(tx, params, 4)
    hist_ref, _, _ = run_wrapped(optax.adam(0.1), params, 4)
    chex.assert_trees_all_close(hist[-1], hist_ref[-1], rtol=1e-5, atol=1e-5)


def test_state_type_and_scan_carry():
    params = make_params()
    tx = multi_frequency(optax.sgd(0.1), level_of=LEVEL_OF, periods=PERIODS)
    state = tx.init(params)
    assert isinstance(state, MultiFreqState)

    def body(carry, n):
        p, s = carry
        u, s = tx.update(grads_at(p, n), s, p)
        return (optax.apply_updates(p, u), s), None

    (p_scan, _), _ = jax.lax.scan(body, (params, state), jnp.arange(1, 7))
    hist, _, _ = run_wrapped(tx, params, 6)
    chex.assert_trees_all_close(p_scan, hist[-1], rtol=1e-5, atol=1e-5)


def test_level_labels_by_index():
    levels = cms_init_levels(jax.random.PRNGKey(0), 4, 6, 3)
    params = {"cms": {"levels": levels}, "embed": jnp.zeros((3, 4))}
    labels = level_labels_by_index()(params)
    assert labels["embed"] is None
    assert [lv.w_up for lv in labels["cms"]["levels"]] == [0, 1, 2]
    assert [lv.w_down for lv in labels["cms"]["levels"]] == [0, 1, 2]


def test_validation():
    params = make_params()
    with pytest.raises(ValueError, match="strictly increasing"):
        multi_frequency(optax.sgd(0.1), level_of=LEVEL_OF, periods=(3, 2))
    with pytest.raises(ValueError, match="positive"):
        multi_frequency(optax.sgd(0.1), level_of=LEVEL_OF, periods=(0, 2))
    with pytest.raises(ValueError, match="positive"):
        multi_frequency(optax.sgd(0.1), level_of=LEVEL_OF, periods=())
    with pytest.raises(ValueError, match="accumulate"):
        multi_frequency(optax.sgd(0.1), level_of=LEVEL_OF, periods=(2, 3), accumulate="ema")
    bad = {"fast": 2, "slow": {"w": 1, "b": 1}, "other": None}
    with pytest.raises(ValueError, match=r"level_of gave 2 for 'fast'"):
        multi_frequency(optax.sgd(0.1), level_of=bad, periods=(2, 3)).init(params)
    with pytest.raises(ValueError, match="structure"):
        multi_frequency(optax.sgd(0.1), level_of={"fast": 0}, periods=(2, 3)).init(params)
