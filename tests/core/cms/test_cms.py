"""CMS levels, variants and the online update mode (SPEC §3.3) against the per-token twin
``core/cms/reference.py`` (SGD) and per-layer DGD steps."""

import dataclasses
import math
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.cms.levels import CMSLevel, cms_forward, cms_init_levels, cms_mix_weights
from nested_jax.core.cms.online import cms_initial_state, cms_online, surprise_from_loss
from nested_jax.core.cms.reference import cms_reference
from nested_jax.core.dgd import dgd_update_layers
from nested_jax.rules import CMSRule

D, H, B = 4, 6, 2


def sq_loss(y, target):
    # per-token ½‖y − target‖², so δ_t = y_t − target_t
    return 0.5 * jnp.sum(jnp.square(y - target), axis=-1)


DELTA_FN = surprise_from_loss(sq_loss)


def make(k, seed=0, gated=False, same_init=False):
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    levels = cms_init_levels(k1, D, H, k, gated=gated, same_init=same_init, init_scale=0.5)
    return levels, k2, k3


def data(key, T):
    kx, kt = jax.random.split(key)
    return 0.5 * jax.random.normal(kx, (B, T, D)), 0.5 * jax.random.normal(kt, (B, T, D))


def ref_mlp(lv, x):
    u = x @ lv.w_up
    hid = jax.nn.silu(u) if lv.w_gate is None else jax.nn.silu(x @ lv.w_gate) * u
    return x + hid @ lv.w_down


def ref_online(levels, x, tgt, periods, variant, lrs, mix=None, delta=None):
    """The twin ``cms_reference`` with δ_t = y_t − target_t (or the given δ)."""
    rule = CMSRule(periods=periods, variant=variant, online_lr=lrs)
    if delta is not None:
        return cms_reference(levels, x, rule=rule, delta=delta, mix_logits=mix)
    return cms_reference(levels, x, rule=rule, loss_fn=sq_loss, side=tgt, mix_logits=mix)


CASES = [
    # (variant, periods, T): T is never a multiple of the largest period
    ("sequential", (2, 3, 5), 13),  # gcd 1: chunk of one token
    ("independent", (2, 4, 6), 13),  # gcd 2: padded last chunk, tail left in the accumulators
    ("nested", (2, 4, 8), 13),
]


def tree_changed(a, b):
    return any(
        not np.array_equal(np.asarray(u), np.asarray(v))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("variant,periods,T", CASES, ids=[c[0] for c in CASES])
def test_online_equals_hand_loop_and_changes_only_at_boundaries(variant, periods, T):
    levels, kd, km = make(len(periods))
    x, tgt = data(kd, T)
    lrs = (0.2, 0.1, 0.05)
    mix = jax.random.normal(km, (3,)) if variant == "independent" else None
    rule = CMSRule(periods=periods, variant=variant, online_lr=lrs)
    kw = dict(rule=rule, delta_fn=DELTA_FN, mix_logits=mix)
    y, st_full = cms_online(levels, x, side=tgt, **kw)
    y_ref, lv_ref, acc_ref = ref_online(levels, x, tgt, periods, variant, lrs, mix)
    chex.assert_trees_all_close(y, y_ref, rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_close(st_full.levels, tuple(lv_ref), rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_close(st_full.accum, tuple(acc_ref), rtol=2e-5, atol=2e-5)
    assert int(st_full.pos) == T
    # the weights did move, so the output is not the static forward (the test can fail)
    y_static = cms_forward(levels, x, variant=variant, mix_logits=mix)
    assert not np.allclose(np.asarray(y), np.asarray(y_static), atol=1e-4)

    # token-by-token stream (carried state; with gcd(periods) = 2 the resumed chunk is offset):
    # level ℓ changes iff the token count is a multiple of C^(ℓ)
    step = jax.jit(lambda st, xx, tt: cms_online(levels, xx, side=tt, initial_state=st, **kw))
    st = cms_initial_state(levels, B)
    ys, prev = [], st.levels
    for t in range(T):
        y_t, st = step(st, x[:, t : t + 1], tgt[:, t : t + 1])
        ys.append(y_t)
        p = t + 1
        for j, C in enumerate(periods):
            assert tree_changed(st.levels[j], prev[j]) == (p % C == 0), (variant, j, p)
        if variant == "nested":
            for j in range(len(periods) - 1):
                if p % periods[j + 1] == 0:  # end of level j's context: reset to level j+1
                    assert not tree_changed(st.levels[j], st.levels[j + 1])
                elif p % periods[j] == 0:  # level j stepped on its own inside its context
                    assert tree_changed(st.levels[j], st.levels[j + 1])
        prev = st.levels
    chex.assert_trees_all_close(jnp.concatenate(ys, axis=1), y, rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_close(st, st_full, rtol=2e-5, atol=2e-5)

    if math.gcd(*periods) == 1:
        return  # every call is aligned to one-token chunks: the split below adds nothing
    # an uneven split: the second call starts mid-chunk
    y1, st = cms_online(levels, x[:, :3], side=tgt[:, :3], **kw)
    y2, st = cms_online(levels, x[:, 3:], side=tgt[:, 3:], initial_state=st, **kw)
    chex.assert_trees_all_close(jnp.concatenate([y1, y2], axis=1), y, rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_close(st, st_full, rtol=2e-5, atol=2e-5)


def test_period_one_equals_plain_per_token_sgd():
    """One level with C = 1: θ ← θ − η ∇_θ L_t(θ) after every token (the loss's own gradient)."""
    (lv,), kd, _ = make(1, seed=2, gated=True)
    T, lr = 7, 0.25
    x, tgt = data(kd, T)
    rule = CMSRule(periods=(1,), online_lr=lr)
    y, st = cms_online((lv,), x, rule=rule, delta_fn=DELTA_FN, side=tgt)

    @jax.jit
    def sgd_token(w, xt, tt):
        g = jax.grad(lambda p: sq_loss(ref_mlp(p, xt), tt))(w)
        return ref_mlp(w, xt), jax.tree.map(lambda a, gg: a - lr * gg, w, g)

    for b in range(B):
        w = lv
        for t in range(T):
            yt, w = sgd_token(w, x[b, t], tgt[b, t])
            np.testing.assert_allclose(y[b, t], yt, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(
            jax.tree.map(lambda a, b=b: a[b], st.levels[0]), w, rtol=2e-5, atol=2e-5
        )


def test_period_one_dgd_equals_per_token_dgd_update_layers():
    """inner='dgd' with C = 1 is exact per-token DGD per layer (SPEC §3.1) on W = kernelᵀ."""
    (lv,), kd, _ = make(1, seed=3)
    T, lr = 6, 0.5
    x, tgt = data(kd, T)
    rule = CMSRule(periods=(1,), online_lr=lr, online_inner="dgd")
    y, st = cms_online((lv,), x, rule=rule, delta_fn=DELTA_FN, side=tgt)

    @jax.jit
    def dgd_token(up, down, xt, tt):
        u = up @ xt
        hid = jax.nn.silu(u)
        yt = xt + down @ hid
        e = yt - tt
        # hand derivatives: signal of W_down is e; of W_up is σ'(u) ⊙ W_downᵀ e
        sig = jax.nn.sigmoid(u)
        g_up = sig * (1 + u * (1 - sig)) * (down.T @ e)
        return yt, *dgd_update_layers([up, down], [xt, hid], [g_up, e], lr)

    for b in range(B):
        up, down = lv.w_up.T, lv.w_down.T  # column form [d_out, d_in]
        for t in range(T):
            yt, up, down = dgd_token(up, down, x[b, t], tgt[b, t])
            np.testing.assert_allclose(y[b, t], yt, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(st.levels[0].w_up[b], up.T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(st.levels[0].w_down[b], down.T, rtol=1e-5, atol=1e-5)


def test_precomputed_delta_and_remat():
    levels, kd, _ = make(2, seed=4)
    T = 7
    x, tgt = data(kd, T)
    delta = jax.random.normal(jax.random.PRNGKey(7), x.shape)
    rule = CMSRule(periods=(2, 4), variant="sequential", online_lr=(0.1, 0.05))
    y, st = cms_online(levels, x, rule=rule, delta=delta)
    y_ref, lv_ref, _ = ref_online(levels, x, tgt, (2, 4), "sequential", (0.1, 0.05), delta=delta)
    chex.assert_trees_all_close(y, y_ref, rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_close(st.levels, tuple(lv_ref), rtol=2e-5, atol=2e-5)
    y2, st2 = cms_online(levels, x, rule=dataclasses.replace(rule, remat_every=2), delta=delta)
    chex.assert_trees_all_close(y2, y, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(st2, st, rtol=1e-6, atol=1e-6)


def test_gradients_through_online_updates_match_hand_loop():
    """Meta-gradient w.r.t. the initial levels flows through every boundary update."""
    levels, kd, _ = make(2, seed=5)
    T = 5
    x, tgt = data(kd, T)
    x, tgt = x[:1], tgt[:1]  # one row keeps the differentiated hand loop short
    periods, lrs = (1, 2), (0.2, 0.1)
    rule = CMSRule(periods=periods, online_lr=lrs)

    def loss(lv):
        y, _ = cms_online(lv, x, rule=rule, delta_fn=DELTA_FN, side=tgt)
        return jnp.sum(jnp.sin(y))

    def loss_ref(lv):
        y, _, _ = ref_online(lv, x, tgt, periods, "sequential", lrs)
        return jnp.sum(jnp.sin(y))

    g = jax.grad(loss)(levels)
    g_ref = jax.grad(loss_ref)(levels)
    chex.assert_trees_all_close(g, g_ref, rtol=1e-4, atol=1e-4)
    chex.assert_tree_all_finite(g)

    # stop_gradient=True drops the second-order path through δ(y): a different meta-gradient
    first = surprise_from_loss(sq_loss, stop_gradient=True)
    g1 = jax.grad(
        lambda lv: jnp.sum(jnp.sin(cms_online(lv, x, rule=rule, delta_fn=first, side=tgt)[0]))
    )(levels)
    assert tree_changed(g1, g)


def test_independent_weights_sum_to_one_and_forward():
    levels, kd, km = make(3, seed=6)
    mix = jax.random.normal(km, (3,)) * 3
    w = cms_mix_weights(mix)
    np.testing.assert_allclose(float(jnp.sum(w)), 1.0, rtol=1e-6)
    assert np.all(np.asarray(w) > 0)
    x, _ = data(kd, 5)
    y = cms_forward(levels, x, variant="independent", mix_logits=mix)
    y_ref = sum(w[j] * ref_mlp(lv, x) for j, lv in enumerate(levels))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    y_seq = cms_forward(levels, x, variant="sequential")
    np.testing.assert_allclose(
        y_seq, ref_mlp(levels[2], ref_mlp(levels[1], ref_mlp(levels[0], x))), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        cms_forward(levels, x, variant="nested"), ref_mlp(levels[0], x), rtol=1e-5, atol=1e-5
    )


def test_validation_errors():
    levels, kd, _ = make(2)
    x, tgt = data(kd, 5)
    on = partial(cms_online, levels, x, delta_fn=DELTA_FN, side=tgt)
    # the rule checks its own fields (CMSRule.<field>: ...); the online form checks them against
    # the levels and the inputs
    with pytest.raises(ValueError, match=r"^CMSRule\.periods: must be strictly increasing"):
        CMSRule(periods=(4, 2))
    with pytest.raises(ValueError, match="strictly increasing"):
        CMSRule(periods=(2, 2))
    with pytest.raises(ValueError, match="positive"):
        CMSRule(periods=(0, 2))
    with pytest.raises(ValueError, match="positive"):
        CMSRule(periods=(-1, 2))
    with pytest.raises(ValueError, match="divide"):
        CMSRule(periods=(2, 3), variant="nested")
    with pytest.raises(ValueError, match=r"^CMSRule\.variant: unknown 'parallel'"):
        CMSRule(periods=(1, 2), variant="parallel")
    with pytest.raises(ValueError, match=r"^CMSRule\.online_inner: unknown 'adam'"):
        CMSRule(periods=(1, 2), online_inner="adam")
    with pytest.raises(ValueError, match="one entry per level"):
        on(rule=CMSRule(periods=(1, 2, 3)))
    with pytest.raises(ValueError, match=r"^rule must be a CMSRule, got dict"):
        on(rule=dict(periods=(1, 2)))
    with pytest.raises(ValueError, match="variant"):
        cms_forward(levels, x, variant="bogus")
    rule = CMSRule(periods=(1, 2))
    with pytest.raises(ValueError, match=r"^x must have shape \[B, T, d=4\]"):
        cms_online(levels, x[..., :3], rule=rule, delta_fn=DELTA_FN)
    with pytest.raises(ValueError, match=r"^x must have shape"):
        cms_forward(levels, x[0])
    with pytest.raises(ValueError, match=r"^delta must have shape"):
        cms_online(levels, x, rule=rule, delta=x[:, :3])
    with pytest.raises(ValueError, match="exactly one"):
        cms_online(levels, x, rule=rule)
    with pytest.raises(ValueError, match=r"^side leaves"):
        cms_online(levels, x, rule=rule, delta_fn=DELTA_FN, side=tgt[:, :2])
    with pytest.raises(ValueError, match=r"levels\[1\]\.w_down"):
        bad = (levels[0], CMSLevel(levels[1].w_up, levels[1].w_down[:, :3]))
        cms_forward(bad, x)
    with pytest.raises(ValueError, match="mix_logits"):
        cms_forward(levels, x, variant="independent", mix_logits=jnp.zeros(3))
    with pytest.raises(ValueError, match="mix_logits"):
        cms_forward(levels, x, variant="sequential", mix_logits=jnp.zeros(2))
    with pytest.raises(ValueError, match=r"^CMSRule\.online_lr: one rate per level \(2\)"):
        CMSRule(periods=(1, 2), online_lr=(0.1, 0.2, 0.3))
