"""Reference twin of the Titans memory rules (SPEC §2): the slow, obviously-correct form.

The fast paths ``titans_linear_{step,recurrent,chunked}`` (``nested_jax.core.titans.linear``) and
``titans_mlp_{step,recurrent,chunked}`` (``nested_jax.core.titans.mlp``) are tested against these
functions. They are written per (batch, head) as a ``lax.scan`` over whole chunks (plus one call
for a shorter last chunk) and a token-by-token ``lax.scan`` that materialises the weights after
every token; the inner gradient always comes from
``jax.grad`` of ``½‖M(k) − v‖²`` (never from the manual backprop or the dual form of the fast
paths). Batch and heads are handled with ``jax.vmap``. Everything is differentiable (tests compare
gradients too).

Per token (SPEC §2; with chunk size ``b`` every surprise is taken at the chunk-start weights)::

    u_t = ∇_W ½‖M_W(k_t) − v_t‖²           (softclamped: u ← u · c·tanh(‖u‖/c)/‖u‖ with grad_clip c)
    S_t = η_t S_{t−1} − θ_t u_t
    W_t = (1 − α_t) W_{t−1} + S_t
    y_t = M_{W_t}(q_t)                     (read_before_write: M_{W_{t−1}}(q_t))

Memory ``M_W(z) = σ(…σ(z W_1)…) W_L (+ z if residual)`` with weights ``W_ℓ [d_{ℓ−1}, d_ℓ]`` (row
vectors, as in ``titans_mlp``); a linear memory is ``L = 1``, ``W_1 = M [K, V]``, ``y = Mᵀ q``.

The twins take the same :class:`~nested_jax.rules.TitansRule` as the fast forms (default
``TitansRule()``, the paper's rule): ``memory_chunk``, ``read_before_write``, ``grad_clip``,
``activation`` and ``per_chunk_gates`` (each chunk's gates replaced by their mean, computed here
chunk by chunk). ``remat`` and ``grad_horizon`` only change how the fast forms backpropagate; the
twins always backpropagate through the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nested_jax.core.scan import segment_starts
from nested_jax.core.titans.net import activation_of
from nested_jax.rules import TitansRule


def mlp(ws, z, activation, residual):
    """``M(z) = σ(…σ(z W_1)…) W_L (+ z if residual)`` for one head (SPEC §2).

    Args:
      ws: list of ``[d_{ℓ−1}, d_ℓ]`` weights.
      z: ``[d_0]``.
      activation: elementwise ``σ`` between layers (not after the last).
      residual: add ``z`` (needs ``d_0 == d_L``).

    Returns:
      ``[d_L]``.
    """
    a = z
    for i, w in enumerate(ws):
        a = a @ w
        if i < len(ws) - 1:
            a = activation(a)
    return a + z if residual else a


def surprise(ws, k, v, activation, residual, grad_clip):
    """Momentary surprise ``u = ∇_W ½‖M_W(k) − v‖²`` of one token (SPEC §2), by ``jax.grad``.

    Args:
      ws: list of ``[d_{ℓ−1}, d_ℓ]`` weights (one head).
      k: ``[d_0]`` key; v: ``[d_L]`` value.
      activation, residual: as :func:`mlp`.
      grad_clip: ``0`` (off) or ``c > 0``: softclamp the whole gradient (all layers together) to
        norm ``c·tanh(‖u‖/c)``.

    Returns:
      list of ``[d_{ℓ−1}, d_ℓ]``, like ``ws``.
    """
    u = jax.grad(lambda w: 0.5 * jnp.sum((mlp(w, k, activation, residual) - v) ** 2))(ws)
    if grad_clip:
        n = jnp.sqrt(sum(jnp.sum(g**2) for g in u))
        f = grad_clip * jnp.tanh(n / grad_clip) / n
        u = [g * f for g in u]
    return u


def _mean_gates(gates):
    """``(θ, η, α)`` of one chunk ``[n]`` each → each replaced by its mean over the chunk."""
    return tuple(jnp.full_like(g, jnp.mean(g)) for g in gates)


def chunk_rule_single(ws, ss, xs, reset=None, *, rule: TitansRule, residual):
    """The chunk rule of SPEC §2 for one (batch, head).

    Chunk by chunk (the last one shorter, no padding): every surprise at the chunk-start weights
    (``jax.grad`` per token), then momentum/decay token by token with the weights materialised,
    reads ``y_t = M_t(q_t)`` (or ``M_{t-1}(q_t)``). With ``reset`` (``[T]`` bool), the state before
    a reset token is the initial one and the chunk's later tokens take their surprise there. The
    whole chunks go through one ``lax.scan`` and the tail chunk through the same function, which
    only keeps compile time low.

    Args:
      ws, ss: weights and momenta, lists of ``[d_{ℓ−1}, d_ℓ]``.
      xs: ``(q, k, v, theta, eta, alpha)``: ``q, k [T, K]``, ``v [T, V]``, gates ``[T]``.
      reset: optional ``bool [T]``: a packed document starts at this token.
      rule, residual: as :func:`chunk_rule`.

    Returns:
      ``(y [T, V], weights, momenta)``.
    """
    chunk_size, activation, clip = rule.memory_chunk, activation_of(rule), rule.grad_clip
    T = xs[0].shape[0]
    init = (list(ws), list(ss))
    reset = jnp.zeros((T,), bool) if reset is None else reset
    grads = jax.vmap(
        lambda kt, vt, w: surprise(w, kt, vt, activation, residual, clip), (0, 0, None)
    )

    def one_chunk(carry, xs):
        q, k, v, th, et, al, rs = xs
        if rule.per_chunk_gates:
            th, et, al = _mean_gates((th, et, al))
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
            y = mlp(ws if rule.read_before_write else ws_new, qt, activation, residual)
            return (ws_new, ss_new), y

        return jax.lax.scan(token, carry, (us0, usi, after, rs, q, th, et, al))

    xs = (*xs, reset)
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


def _initial(fn, initial_state):
    """``(weights, momentum)`` of ``initial_state``; the MLP memory has no zero state."""
    if initial_state is None:
        raise ValueError(
            f"{fn}: initial_state: required (the memory has no zero state: its weights are "
            "learned); pass initial_state=titans_mlp_state(weights, B) or (weights, momentum)"
        )
    weights, momentum = initial_state
    return weights, momentum


def chunk_rule(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state=None,
    rule: TitansRule = TitansRule(),
    residual=False,
    segment_ids=None,
):
    """Twin of ``titans_mlp_chunked`` / ``titans_linear_chunked`` (SPEC §2 chunked form).

    Inside a chunk of ``rule.memory_chunk`` tokens every surprise ``u_t`` is taken at the
    chunk-start weights; momentum, decay and the reads then run token by token with the weights
    materialised. ``memory_chunk = 1`` is the exact per-token rule (:func:`per_token_rule`). With
    ``segment_ids`` (packed rows, SPEC §0) the state before a document's first token is the
    initial one and the rest of that chunk takes its surprise at the initial weights: the row's
    chunk grid. ``titans_mlp_chunked`` gives every document its own grid instead, so for a
    document starting off the row's grid the two differ; the packed-row tests therefore run each
    document alone through this twin.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
      theta, eta, alpha: ``[B, T, H]`` inner lr, momentum and forget gates.
      initial_state: ``(weights, momentum)`` (e.g. a ``TitansMLPState``), tuples of
        ``[B, H, d_{ℓ−1}, d_ℓ]`` (initial weights and momenta); required.
      rule: :class:`~nested_jax.rules.TitansRule` (module docstring): ``memory_chunk`` (``b``;
        the last chunk may be shorter, no padding), ``read_before_write`` (``y_t =
        M_{t−1}(q_t)``), ``grad_clip`` (the softclamp norm of :func:`surprise`), ``activation``
        (``σ``), ``per_chunk_gates``.
      residual: ``M(z) + z``.
      segment_ids: optional int ``[B, T]`` document ids.

    Returns:
      ``(y [B, T, H, V], (weights, momentum))`` (final, tuples like the inputs).
    """
    weights, momentum = _initial("chunk_rule", initial_state)

    def single(ws, ss, q, k, v, th, et, al, reset):
        return chunk_rule_single(ws, ss, (q, k, v, th, et, al), reset, rule=rule, residual=residual)

    # vmap over heads (axis 0 of per-batch [H, ...] states, axis 1 of [T, H, ...] inputs),
    # then over batch.
    B, T = q.shape[:2]
    if segment_ids is None:
        reset = jnp.zeros((B, T), bool)
    else:  # a new segment starts at t > 0 where the id changes
        reset = segment_starts(segment_ids)
    per_head = jax.vmap(single, in_axes=(0, 0, 1, 1, 1, 1, 1, 1, None), out_axes=(1, 0, 0))
    per_batch = jax.vmap(per_head, in_axes=0, out_axes=0)
    y, ws, ss = per_batch(list(weights), list(momentum), q, k, v, theta, eta, alpha, reset)
    return y, (tuple(ws), tuple(ss))


def per_token_rule(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state=None,
    rule: TitansRule = TitansRule(),
    residual=False,
):
    """Twin of ``titans_mlp_recurrent`` / ``titans_linear_recurrent``: the exact per-token rule.

    A ``lax.scan`` whose step takes ``jax.grad`` at the current weights (SPEC §2 recurrence): what
    ``chunk_rule`` with ``memory_chunk = 1`` computes, compiled once instead of T times. Arguments
    and returns as :func:`chunk_rule` (no chunking: ``memory_chunk`` and ``per_chunk_gates`` do
    not apply; no ``segment_ids``).
    """
    weights, momentum = _initial("per_token_rule", initial_state)
    activation, clip = activation_of(rule), rule.grad_clip

    def single(ws, ss, q, k, v, th, et, al):
        def token(carry, xs):
            ws, ss = carry
            qt, kt, vt, a, b, c = xs
            u = surprise(ws, kt, vt, activation, residual, clip)
            ss_new = [b * s - a * g for s, g in zip(ss, u, strict=True)]
            ws_new = [(1.0 - c) * w + s for w, s in zip(ws, ss_new, strict=True)]
            y = mlp(ws if rule.read_before_write else ws_new, qt, activation, residual)
            return (ws_new, ss_new), y

        (ws, ss), y = jax.lax.scan(token, (list(ws), list(ss)), (q, k, v, th, et, al))
        return y, ws, ss

    per_head = jax.vmap(single, in_axes=(0, 0, 1, 1, 1, 1, 1, 1), out_axes=(1, 0, 0))
    y, ws, ss = jax.vmap(per_head)(list(weights), list(momentum), q, k, v, theta, eta, alpha)
    return y, (tuple(ws), tuple(ss))
