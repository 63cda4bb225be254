"""Slow, independent Hope reference (SPEC §3.2): Python loop over tokens, per-(b, h) vector math
via vmap, inner-loss weight gradients from ``jax.grad`` (not the hand-derived layer signals of
``nested_jax.core.hope``). Chunking by snapshots: the projection memories are re-snapshotted at
``t % chunk_other == 0`` and ``M_memory`` at ``t % chunk_memory == 0``; projections, targets and
gradients use the snapshots, the in-order writes and the read use the running weights.
"""

import functools

import jax
import jax.numpy as jnp

NAMES = ("k", "v", "eta", "alpha", "memory", "q")


def _mlp(W1, W2, z, act):
    return z + W1 @ act(W2 @ z)


def _bh(f):
    """vmap a per-(b, h) function over batch then heads (all args have leading [B, H])."""
    return jax.vmap(jax.vmap(f))


def _norm(z):
    return z / jnp.sqrt(jnp.sum(z * z) + 1e-6)


def hope_reference(
    x,
    q,
    mems,
    moms,
    readout,
    *,
    chunk_memory=1,
    chunk_other=1,
    act=jax.nn.silu,
    **flags,
):
    """``mems``/``moms``: dict name -> (W1 [B,H,D,h], W2 [B,H,h,D]); returns (o, mems, moms).

    The Python loop over tokens and the snapshot bookkeeping live here; one token's math is a
    jitted function (compiled once per configuration) so the reference stays fast enough on CPU.
    """
    T = x.shape[1]
    mems = {n: tuple(w) for n, w in mems.items()}
    moms = None if moms is None else {n: tuple(w) for n, w in moms.items()}
    token = _token_fn(act, tuple(sorted(flags.items())))
    snap = dict(mems)
    outs = []
    for t in range(T):
        for n in mems:
            c = chunk_memory if n == "memory" else chunk_other
            if t % c == 0:
                snap[n] = mems[n]
        o_t, mems, moms = token(mems, snap, moms, x[:, t], q[:, t], tuple(readout))
        outs.append(o_t)
    return jnp.stack(outs, 1), mems, moms


@functools.cache
def _token_fn(act, flags):
    return jax.jit(functools.partial(_token, act=act, **dict(flags)))


def _token(
    mems,
    snap,
    moms,
    xt,
    qt,
    readout,
    *,
    act,
    dgd=True,
    step="exact",
    momentum=False,
    momentum_coef=0.9,
    decay=True,
    inner_k=True,
    inner_v=True,
    inner_q=True,
    adaptive_q=False,
    stop_gradient_targets=False,
):
    B, H, D = xt.shape
    eta_w, eta_b, alpha_w, alpha_b = readout
    adapt = ["eta", "alpha", "memory"] + [n for n, f in (("k", inner_k), ("v", inner_v)) if f]
    if adaptive_q and inner_q:
        adapt.append("q")
    app = lambda n, z: _bh(lambda a, b, zz: _mlp(a, b, zz, act))(*snap[n], z)  # noqa: E731
    k = _bh(_norm)(app("k", xt))
    v = app("v", xt)
    eta = jax.nn.sigmoid(jnp.einsum("bhd,hd->bh", app("eta", xt), eta_w) + eta_b)
    if decay:
        alpha = jax.nn.sigmoid(jnp.einsum("bhd,hd->bh", app("alpha", xt), alpha_w) + alpha_b)
    else:
        alpha = jnp.ones((B, H))
    qt = app("q", xt) if adaptive_q else qt
    qt = _bh(_norm)(qt)
    o_t = _bh(lambda a, b, z: _mlp(a, b, z, act))(*mems["memory"], qt)
    new = dict(mems)
    new_m = None if moms is None else dict(moms)
    for n in adapt:

        def per_bh(W1, W2, W10, W20, S1, S2, kk, vv, e, a):
            target = _mlp(W10, W20, vv, act)
            if stop_gradient_targets:
                target = jax.lax.stop_gradient(target)

            def loss(A, Bm):
                return 0.5 * jnp.sum((_mlp(A, Bm, kk, act) - target) ** 2)

            G1, G2 = jax.grad(loss, argnums=(0, 1))(W10, W20)
            x1, x2 = act(W20 @ kk), kk
            res = []
            for W, S, G, xx in ((W1, S1, G1, x1), (W2, S2, G2, x2)):
                if dgd:
                    gam = e / (1 + e * jnp.sum(xx * xx)) if step == "exact" else e / (1 + e)
                    u = -gam * (jnp.outer(W @ xx, xx) + G)
                else:
                    u = -e * G
                if momentum:
                    u = momentum_coef * S + u
                res.append((a * W + u, u))
            return res[0][0], res[1][0], res[0][1], res[1][1]

        if momentum:
            S1, S2 = moms[n]
        else:
            S1, S2 = jnp.zeros_like(mems[n][0]), jnp.zeros_like(mems[n][1])
        W1, W2, U1, U2 = _bh(per_bh)(*mems[n], *snap[n], S1, S2, k, v, eta, alpha)
        new[n] = (W1, W2)
        if momentum:
            new_m[n] = (U1, U2)
    return o_t, new, new_m
