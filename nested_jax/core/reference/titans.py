"""Slow, independent reference implementations of the Titans memory rules (SPEC §2), for tests only.

Written per (batch, head) as a Python loop over chunks and a token-by-token scan that materialises
the weights after every token; the inner gradient always comes from ``jax.grad`` of
``½‖M(k) − v‖²`` (never from the manual backprop used by ``nested_jax.core.titans_mlp``).
Batch and heads are handled with ``jax.vmap``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mlp(ws, z, activation, residual):
    """``M(z)`` for one head: ``ws`` list of ``[d_in, d_out]``, ``z [d_0]``."""
    a = z
    for i, w in enumerate(ws):
        a = a @ w
        if i < len(ws) - 1:
            a = activation(a)
    return a + z if residual else a


def _grad(ws, k, v, activation, residual, grad_clip):
    """Per-token surprise ``u = ∇ ½‖M(k) − v‖²``, softclamped to norm ``c·tanh(‖u‖/c)`` if asked."""
    u = jax.grad(lambda w: 0.5 * jnp.sum((mlp(w, k, activation, residual) - v) ** 2))(ws)
    if grad_clip is not None:
        n = jnp.sqrt(sum(jnp.sum(g**2) for g in u))
        f = grad_clip * jnp.tanh(n / grad_clip) / n
        u = [g * f for g in u]
    return u


def chunk_rule_single(
    ws, ss, q, k, v, theta, eta, alpha, reset=None, *,
    chunk_size, activation, residual, rbw, grad_clip,
):  # fmt: skip
    """One (batch, head): ``ws, ss`` lists of ``[d_in, d_out]``; ``q, k [T, K]``; gates ``[T]``.

    Chunk by chunk (the last one shorter, no padding): every surprise at the chunk-start weights
    (``jax.grad`` per token), then momentum/decay token by token with the weights materialised,
    reads ``y_t = M_t(q_t)`` (or ``M_{t-1}(q_t)``). With ``reset`` (``[T]`` bool), the state before
    a reset token is the initial one and the chunk's later tokens take their surprise there. The
    whole chunks go through one ``lax.scan`` and the tail chunk through the same function, which
    only keeps compile time low.
    """
    T = q.shape[0]
    init = (list(ws), list(ss))
    reset = jnp.zeros((T,), bool) if reset is None else reset
    grads = jax.vmap(
        lambda kt, vt, w: _grad(w, kt, vt, activation, residual, grad_clip), (0, 0, None)
    )

    def one_chunk(carry, xs):
        q, k, v, th, et, al, rs = xs
        us0 = grads(k, v, carry[0])  # at the chunk start
        usi = grads(k, v, init[0])  # at the initial weights (a document restarted in the chunk)
        after = jnp.cumsum(rs) > 0

        def token(carry, xs):
            ws, ss = carry
            u0, ui, aft, r, qt, th, et, al = xs
            u = [jnp.where(aft, a, b) for a, b in zip(ui, u0, strict=True)]
            ws = [jnp.where(r, a, b) for a, b in zip(init[0], ws, strict=True)]
            ss = [jnp.where(r, a, b) for a, b in zip(init[1], ss, strict=True)]
            ss_new = [et * s - th * g for s, g in zip(ss, u, strict=True)]
            ws_new = [(1.0 - al) * w + s for w, s in zip(ws, ss_new, strict=True)]
            y = mlp(ws if rbw else ws_new, qt, activation, residual)
            return (ws_new, ss_new), y

        return jax.lax.scan(token, carry, (us0, usi, after, rs, q, th, et, al))

    xs = (q, k, v, theta, eta, alpha, reset)
    n_full = (T // chunk_size) * chunk_size
    carry, ys = init, []
    if n_full:
        split = lambda x: x[:n_full].reshape(-1, chunk_size, *x.shape[1:])  # noqa: E731
        carry, y = jax.lax.scan(one_chunk, carry, tuple(map(split, xs)))
        ys.append(y.reshape(n_full, -1))
    if n_full < T:
        carry, y = one_chunk(carry, tuple(x[n_full:] for x in xs))
        ys.append(y)
    return jnp.concatenate(ys), carry[0], carry[1]


def chunk_rule(
    weights,
    momentum,
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    chunk_size,
    activation=jax.nn.silu,
    residual=False,
    read_before_write=False,
    grad_clip=None,
    segment_ids=None,
):
    """Batched reference: weights/momentum tuples ``[B, H, d_in, d_out]``; q, k, v ``[B, T, H, D]``.

    Returns ``(y [B, T, H, V], weights, momentum)``. ``chunk_size=1`` is the exact per-token rule.
    """

    def single(ws, ss, q, k, v, th, et, al, reset):
        return chunk_rule_single(
            ws, ss, q, k, v, th, et, al, reset,
            chunk_size=chunk_size, activation=activation, residual=residual,
            rbw=read_before_write, grad_clip=grad_clip,
        )  # fmt: skip

    # vmap over heads (axis 0 of per-batch [H, ...] states, axis 1 of [T, H, ...] inputs),
    # then over batch.
    B, T = q.shape[:2]
    if segment_ids is None:
        reset = jnp.zeros((B, T), bool)
    else:  # a new segment starts at t > 0 where the id changes
        reset = jnp.concatenate(
            [jnp.zeros((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
        )
    per_head = jax.vmap(single, in_axes=(0, 0, 1, 1, 1, 1, 1, 1, None), out_axes=(1, 0, 0))
    per_batch = jax.vmap(per_head, in_axes=0, out_axes=0)
    y, ws, ss = per_batch(list(weights), list(momentum), q, k, v, theta, eta, alpha, reset)
    return y, tuple(ws), tuple(ss)


def per_token_rule(
    weights,
    momentum,
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    activation=jax.nn.silu,
    residual=False,
    read_before_write=False,
    grad_clip=None,
):
    """The exact per-token rule (SPEC §2), batched like ``chunk_rule``.

    A scan whose step takes ``jax.grad`` at the current weights: what ``chunk_rule(chunk_size=1)``
    computes, compiled once instead of T times.
    """

    def single(ws, ss, q, k, v, th, et, al):
        def token(carry, xs):
            ws, ss = carry
            qt, kt, vt, a, b, c = xs
            u = _grad(ws, kt, vt, activation, residual, grad_clip)
            ss_new = [b * s - a * g for s, g in zip(ss, u, strict=True)]
            ws_new = [(1.0 - c) * w + s for w, s in zip(ws, ss_new, strict=True)]
            y = mlp(ws if read_before_write else ws_new, qt, activation, residual)
            return (ws_new, ss_new), y

        (ws, ss), y = jax.lax.scan(token, (list(ws), list(ss)), (q, k, v, th, et, al))
        return y, ws, ss

    per_head = jax.vmap(single, in_axes=(0, 0, 1, 1, 1, 1, 1, 1), out_axes=(1, 0, 0))
    y, ws, ss = jax.vmap(per_head)(list(weights), list(momentum), q, k, v, theta, eta, alpha)
    return y, tuple(ws), tuple(ss)
