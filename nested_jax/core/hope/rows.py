"""Hope's parallel chunk form on stacked memories (SPEC §3.2; the driver is :mod:`core.hope.chunk`).

The memories of a Hope layer fall into two chunk groups that never read each other: the
projection memories ``M_k, M_v, M_η, M_α`` (``M_q``) make ``k, v, η, α`` (``q``) from the layer
input and train on those alone, and ``M_memory`` reads ``q`` and trains on ``k, v, η, α``. So the
parallel form runs the groups one after the other, each over its own chunks: the projection group
over chunks of ``chunk_other`` (:func:`_projection_chunk`), then ``M_memory`` over chunks of
``chunk_memory`` (:func:`_memory_chunk`). Each group's chunk-start snapshot is its running state
(nothing else is carried), and the larger chunk size is not walked in pieces of the smaller.

The memories of a group are 2-layer MLPs of the same shapes, updated with the same gates
``η_t, α_t`` and hence the same chunk coefficients (:mod:`core.hope.parallel`), so they are kept
as rows of one stack (``w1 [M, B, H, D, h]``, ``w2 [M, B, H, h, D]``, ``_names`` order) from the
start of the scan to its end: a chunk's projections, targets, signals, triangular solves and
updates run once for all rows (``jax.vmap`` over the row axis), and nothing is restacked per
chunk. A row that does not adapt (``inner_k`` ... off) is computed and dropped. Also here: the
per-chunk helpers both chunk forms share (signals, ``l2norm``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.hope.parallel import (
    chunk_coefficients,
    keep_for_backward,
    layer_end,
    layer_updates,
    read_running,
)
from nested_jax.core.hope.state import HopeMemories, HopeReadout, MLPMemory
from nested_jax.rules import HopeRule


def _l2norm(x, eps=1e-6):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _signals(mem0: MLPMemory, k, v, activation, stop_gradient_targets, read=None):
    """Layer inputs and signals of ``L̃ = ½‖M_0(k) − M_0(v)‖²`` at snapshot ``M_0``, all tokens.

    ``k, v [B, c, H, D]``. Returns ``((x1, g1, x2, g2), (W_1 x1, W_2 x2), W_2 read)``:
    ``(x1, g1)`` for ``W_1 [D, h]`` and ``(x2, g2)`` for ``W_2 [h, D]``, the snapshot's own
    products with the layer inputs (the parallel form's ``W_0 x`` when the snapshot is the running
    memory), and ``W_2`` applied to the optional queries ``read [B, c', H, D]`` (None without).
    ``k``, ``v`` (and ``read``) go through each weight in one product (one read of the weights).
    """
    c = k.shape[1]
    a = jnp.einsum(
        "bhkd,bnhd->bnhk", mem0.w2, jnp.concatenate([k, v] + ([] if read is None else [read]), 1)
    )
    a = keep_for_backward(a)
    a, a_read = (a, None) if read is None else (a[:, : 2 * c], a[:, 2 * c :])
    s, ds = jax.jvp(activation, (a,), (jnp.ones_like(a),))  # σ(a), σ'(a) (elementwise σ)
    y = keep_for_backward(jnp.einsum("bhdk,bnhk->bnhd", mem0.w1, s))  # W_1 σ(W_2 ·) of k, v
    target = v + y[:, c:]  # M_0(v)
    if stop_gradient_targets:
        target = lax.stop_gradient(target)
    e = k + y[:, :c] - target
    g2 = ds[:, :c] * keep_for_backward(jnp.einsum("bhdk,bnhd->bnhk", mem0.w1, e))
    return (s[:, :c], e, k, g2), (y[:, :c], a[:, :c]), a_read


def _pick(fresh, new, old, rows: bool = False):
    """Per token ``[B, N]``: ``new`` where ``fresh`` else ``old`` (arrays ``[B, N, ...]``, or
    ``[M, B, N, ...]`` stacks with ``rows``)."""
    lead = 3 if rows else 2
    return jax.tree.map(
        lambda a, b: jnp.where(fresh.reshape(fresh.shape + (1,) * (a.ndim - lead)), a, b),
        new, old,
    )  # fmt: skip


def _adapting(rule: HopeRule) -> list[str]:
    """The memories that adapt in the inner loop (``M_η``, ``M_α``, ``M_memory`` always)."""
    adapt = ["eta", "alpha", "memory"]
    adapt += [n for n in ("k", "v") if getattr(rule, "inner_" + n)]
    if rule.adaptive_q and rule.inner_q:
        adapt.append("q")
    return adapt


class _Group(NamedTuple):
    """Static facts about one chunk group's memories, stacked on a leading axis."""

    names: tuple[str, ...]
    adapting: tuple[bool, ...]  # the rows that adapt in the inner loop (:func:`_adapting`)


def _groups(names, rule: HopeRule) -> tuple[_Group, _Group]:
    """The projection group (every memory present but ``M_memory``, ``_names`` order) and the
    memory group (``M_memory`` alone)."""
    adapt = set(_adapting(rule))
    proj = tuple(n for n in names if n != "memory")
    return _Group(proj, tuple(n in adapt for n in proj)), _Group(("memory",), (True,))


def _stack(mems: HopeMemories | None, names) -> MLPMemory | None:
    """The memories ``names`` in one ``MLPMemory`` (None for None): ``w1 [M, B, H, D, h]``,
    ``w2 [M, B, H, h, D]`` (a group's memories share shapes, gates and chunk coefficients)."""
    if mems is None:
        return None
    return jax.tree.map(lambda *a: jnp.stack(a), *(getattr(mems, n) for n in names))


def _unstack(stacked: MLPMemory | None, names) -> dict[str, MLPMemory]:
    """The inverse of :func:`_stack` as ``{name: MLPMemory}`` (one split per leaf, whose
    transpose is one concatenate; empty for None)."""
    if stacked is None:
        return {}
    parts = jax.tree.map(lambda a: [p[0] for p in jnp.split(a, a.shape[0])], stacked)
    return {n: MLPMemory(parts.w1[i], parts.w2[i]) for i, n in enumerate(names)}


def _row_mask(flags, ndim: int):
    """A static per-row bool tuple as an array broadcasting over ``ndim``-dimensional stacks."""
    return jnp.asarray(flags).reshape((-1,) + (1,) * (ndim - 1))


def _per_row(stack: MLPMemory, a):
    """``a`` broadcast over the stack's rows. Under the ``vmap`` over rows each row then has its
    own batched product, not one product over all rows' weights side by side (which needs the
    whole stack transposed, a copy per chunk)."""
    return jnp.broadcast_to(a, (stack.w1.shape[0], *a.shape))


def _projections(y, q_c, readout: HopeReadout, rule: HopeRule):
    """``k, v, η, α, q`` (SPEC §3.2) from the projection memories' outputs ``y[name]``
    ``[B, c, H, D]`` (``alpha`` read only with ``rule.decay``, ``q`` only with ``adaptive_q``):
    ``k = norm(M_k(x))``, ``η = eta_max·σ(w_ηᵀ M_η(x) + b_η)``, ``α = σ(w_αᵀ M_α(x) + b_α)``."""
    eta = rule.eta_max * jax.nn.sigmoid(
        jnp.einsum("bnhd,hd->bnh", y["eta"], readout.eta_w) + readout.eta_b
    )
    if rule.decay:
        logit = jnp.einsum("bnhd,hd->bnh", y["alpha"], readout.alpha_w) + readout.alpha_b
        alpha = jax.nn.sigmoid(logit)
    else:
        alpha = jnp.ones_like(eta)
    q = _l2norm(y["q"] if rule.adaptive_q else q_c)
    return _l2norm(y["k"]), y["v"], eta, alpha, q


def _project_rows(stack: MLPMemory, names, x_c, q_c, readout: HopeReadout, rule: HopeRule, act):
    """:func:`_projections` from the stacked projection memories ``names``: every row applied to
    the chunk's tokens in one batched call."""

    def apply(m, x):  # mlp_memory_apply, its products kept for the backward
        a = keep_for_backward(jnp.einsum("bhkd,bnhd->bnhk", m.w2, x))
        return x + keep_for_backward(jnp.einsum("bhdk,bnhk->bnhd", m.w1, act(a)))

    ys = jax.vmap(apply)(stack, _per_row(stack, x_c))
    return _projections({n: ys[i] for i, n in enumerate(names)}, q_c, readout, rule)


def _stacked_signals(stack: MLPMemory, k, v, rule: HopeRule, act, read=None):
    """:func:`_signals` of every row of ``stack`` (``[M, B, c, H, ·]``)."""
    reads = None if read is None else _per_row(stack, read)
    return jax.vmap(
        lambda m, k_, v_, r: _signals(m, k_, v_, act, rule.stop_gradient_targets, read=r)
    )(stack, _per_row(stack, k), _per_row(stack, v), reads)


def _group_signals(w: MLPMemory, k, v, rule: HopeRule, act, init=None, fresh=None, read=None):
    """A group's signals from its chunk-start (running) memories ``w``: :func:`_stacked_signals`
    ``(sig, w0x, W_2 read)``. With packed rows (``fresh [B, c]``: a document started in this chunk
    at or before the token) those tokens take their signals from ``init``, and ``w0x`` is None
    (a document's first chunk reads the initial memories: not ``W_0 x``)."""
    sig, w0x, w2_read = _stacked_signals(w, k, v, rule, act, read)
    if fresh is None:
        return sig, w0x, w2_read
    sig = _pick(fresh, _stacked_signals(init, k, v, rule, act)[0], sig, rows=True)
    return sig, None, w2_read


def _heads_first(a):
    """``[…, c, H, ·] → […, H, c, ·]``."""
    return jnp.moveaxis(a, -3, -2)


def _group_updates(carry, sig, eta, alpha, valid_c, rule: HopeRule, group: _Group, restart=None,
                   w0x=None, read=None):  # fmt: skip
    """One chunk's in-order updates of a group's stacked memories in parallel form
    (:mod:`core.hope.parallel`): every memory layer's per-token recurrence as one triangular
    solve, all rows in one batched call (equal to the per-token rule up to rounding).

    Args:
      carry: ``(w, s)``, the group's running memories and momenta (``s`` None without momentum),
        stacked (:func:`_stack`, ``M`` rows); they are also the chunk-start snapshot of the
        signals.
      sig: ``(x1, g1, x2, g2)`` of every row, ``[M, B, c, H, ·]``; eta, alpha: ``[B, c, H]``;
        valid_c: ``[B, c]`` bool (a prefix).
      rule: the :class:`HopeRule` (its ``mu``, ``dgd``, ``step``, ``dgd_target``, ``grad_clip``).
      group: the rows' static facts; a row that does not adapt keeps its weights (its update is
        computed and dropped).
      restart: packed rows: ``(init, reset_c)``, the stacked memories a document start resets to
        and ``[B, c]`` bool document starts (momenta restart at zero); None without resets.
      w0x: optional ``(W_1 x1, W_2 x2)`` of the running memories, ``[M, B, c, H, ·]``.
      read: the memory group's read before write, ``(q [B, c, H, D], W_2 q [B, c, H, h], σ)``
        of row 0 (:func:`_signals`' ``read``, the memories' ``σ``): ``o_t = M_{t−1}(q_t)`` with
        the running weights.

    Returns:
      ``(o [B, c, H, D] or None without read, w, s)`` after the chunk.
    """
    w, s = carry
    init, reset_c = (None, None) if restart is None else restart
    on = valid_c[:, None, :]  # [B, 1, c]
    lr = jnp.where(on, jnp.moveaxis(eta, 1, 2), 0.0)  # [B, H, c]
    co = chunk_coefficients(
        jnp.where(on, jnp.moveaxis(alpha, 1, 2), 1.0), rule.mu, valid_c, reset_c
    )
    x1, g1, x2, g2 = (_heads_first(a) for a in sig)
    g1, g2 = (jnp.where(on[..., None], g, 0.0) for g in (g1, g2))
    updates = functools.partial(layer_updates, lr=lr, co=co, rule=rule)
    per_row = jax.vmap(lambda W, S, x, g, Wi, p: updates(W, S, x, g, W_init=Wi, w0x=p))
    s1_0, s2_0 = (None, None) if s is None else s
    i1_0, i2_0 = (None, None) if init is None else init
    p1, p2 = (None, None) if w0x is None else (_heads_first(p) for p in w0x)
    u1 = per_row(w.w1, s1_0, x1, g1, i1_0, p1)
    u2 = per_row(w.w2, s2_0, x2, g2, i2_0, p2)
    o = None
    if read is not None:  # o_t = M_{t−1}(q_t) of row 0, read before write
        at = lambda a: None if a is None else a[0]  # noqa: E731
        q, w2q = (_heads_first(a) for a in read[:2])
        act = read[2]
        z = keep_for_backward(
            read_running(w.w2[0], at(s2_0), x2[0], u2[0], q, co, at(i2_0), w0z=w2q)
        )
        o = q + read_running(w.w1[0], at(s1_0), x1[0], u1[0], act(z), co, at(i1_0))
    # The chunk-end writes come after o's reads of the chunk-start weights (layer_end's
    # ``after``), so they can overwrite them in place.
    end = jax.vmap(layer_end, in_axes=(0, 0, 0, 0, None, 0, None))  # co: shared by the rows
    w1, s1 = end(w.w1, s1_0, x1, u1, co, i1_0, o)
    w2, s2 = end(w.w2, s2_0, x2, u2, co, i2_0, o)
    new_w, new_s = MLPMemory(w1, w2), (None if s is None else MLPMemory(s1, s2))
    if not all(group.adapting):  # the others stay (a document start still restarts them)
        keep = lambda new, old: jnp.where(_row_mask(group.adapting, new.ndim), new, old)  # noqa: E731
        old_w, old_s = w, s
        if init is not None:
            restarted = jnp.any(co.end.astype(bool) & co.fresh, axis=1)[:, None, None, None]
            old_w = jax.tree.map(lambda a, b: jnp.where(restarted, a, b), init, w)
            old_s = None if s is None else jax.tree.map(lambda b: jnp.where(restarted, 0.0, b), s)
        new_w = jax.tree.map(keep, new_w, old_w)
        new_s = None if s is None else jax.tree.map(keep, new_s, old_s)
    return None if o is None else jnp.moveaxis(o, 2, 1), new_w, new_s


def _projection_chunk(carry, x_c, q_c, valid_c, readout: HopeReadout, rule: HopeRule, act,
                      group: _Group, init=None, flags=None):  # fmt: skip
    """One chunk (of ``chunk_other`` tokens) of the projection memories ``group``: ``k, v, η, α,
    q`` of its tokens and the signals from the chunk-start (running) memories ``carry = (w, s)``,
    then :func:`_group_updates`.

    ``x_c, q_c [B, c, H, D]``; ``flags = (reset_c, fresh_c)`` ``[B, c]`` for packed rows
    (``fresh``: a document started in this chunk at or before the token, so its snapshot is
    ``init``). Returns ``((w, s), (k, v, η, α, q))``.
    """
    w, s = carry
    reset_c, fresh = (None, None) if flags is None else flags
    proj = _project_rows(w, group.names, x_c, q_c, readout, rule, act)
    if fresh is not None:
        proj = _pick(fresh, _project_rows(init, group.names, x_c, q_c, readout, rule, act), proj)
    k, v, eta, alpha, _ = proj
    sig, w0x, _ = _group_signals(w, k, v, rule, act, init, fresh)
    restart = None if init is None else (init, reset_c)
    _, w, s = _group_updates((w, s), sig, eta, alpha, valid_c, rule, group, restart, w0x)
    return (w, s), proj


def _memory_chunk(carry, projections, valid_c, rule: HopeRule, act, group: _Group, init=None,
                  flags=None):  # fmt: skip
    """One chunk (of ``chunk_memory`` tokens) of ``M_memory`` (a one-row stack, ``carry = (w,
    s)``): its signals from the chunk-start (running) memory, :func:`_group_updates`, and the
    reads ``o_t = M_{memory,t−1}(q_t)``. ``projections = (k, v, η, α, q)`` of the chunk's tokens
    (:func:`_projection_chunk`'s), ``k, v, q [B, c, H, D]``, ``η, α [B, c, H]``; ``flags`` as
    :func:`_projection_chunk`. Returns ``((w, s), o [B, c, H, D])``."""
    w, _ = carry
    k, v, eta, alpha, q = projections
    reset_c, fresh = (None, None) if flags is None else flags
    sig, w0x, w2q = _group_signals(w, k, v, rule, act, init, fresh, read=q)
    restart = None if init is None else (init, reset_c)
    o, w, s = _group_updates(
        carry, sig, eta, alpha, valid_c, rule, group, restart, w0x, (q, w2q[0], act)
    )
    return (w, s), o
