"""Hope's parallel chunk form on stacked memories (SPEC §3.2; the driver is :mod:`core.hope`).

Every memory ``M_□`` of a Hope layer is a 2-layer MLP of the same shapes, updated with the same
gates ``η_t, α_t`` and hence the same chunk coefficients (:mod:`core.hope_parallel`). The parallel
form therefore keeps them as rows of one stack (``w1 [M, B, H, D, h]``, ``w2 [M, B, H, h, D]``,
``_names`` order) from the start of the scan to its end: a chunk's projections, targets,
signals, triangular solves and updates run once for all rows (``jax.vmap`` over the row axis),
and nothing is restacked per chunk. A row that does not adapt (``inner_k`` ... off) is computed
and dropped. Also here: the per-chunk helpers both chunk forms share (signals, ``l2norm``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.hope_parallel import (
    chunk_coefficients,
    keep_for_backward,
    layer_end,
    layer_updates,
    read_running,
)
from nested_jax.core.hope_state import (
    HopeMemories,
    HopeReadout,
    HopeRule,
    MLPMemory,
    _names,
)


def _l2norm(x, eps=1e-6):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _signals(mem0: MLPMemory, k, v, activation, stop_gradient_targets):
    """Layer inputs and signals of ``L̃ = ½‖M_0(k) − M_0(v)‖²`` at snapshot ``M_0``, all tokens.

    ``k, v [B, c, H, D]``. Returns ``((x1, g1, x2, g2), (W_1 x1, W_2 x2))``: ``(x1, g1)`` for
    ``W_1 [D, h]`` and ``(x2, g2)`` for ``W_2 [h, D]``, and the snapshot's own products with the
    layer inputs (the parallel form's ``W_0 x`` when the snapshot is the running memory). ``k``
    and ``v`` go through each weight in one product (one read of the weights, not two).
    """
    c = k.shape[1]
    a = jnp.einsum("bhkd,bnhd->bnhk", mem0.w2, jnp.concatenate([k, v], axis=1))
    a = keep_for_backward(a)
    s, ds = jax.jvp(activation, (a,), (jnp.ones_like(a),))  # σ(a), σ'(a) (elementwise σ)
    y = keep_for_backward(jnp.einsum("bhdk,bnhk->bnhd", mem0.w1, s))  # W_1 σ(W_2 ·) of k, v
    target = v + y[:, c:]  # M_0(v)
    if stop_gradient_targets:
        target = lax.stop_gradient(target)
    e = k + y[:, :c] - target
    g2 = ds[:, :c] * keep_for_backward(jnp.einsum("bhdk,bnhd->bnhk", mem0.w1, e))
    return (s[:, :c], e, k, g2), (y[:, :c], a[:, :c])


def _pick(fresh, new, old):
    """Per token ``[B, N]``: ``new`` where ``fresh`` else ``old`` (arrays ``[B, N, ...]``)."""
    return jax.tree.map(
        lambda a, b: jnp.where(fresh.reshape(fresh.shape + (1,) * (a.ndim - 2)), a, b), new, old
    )


def _adapting(rule: HopeRule) -> list[str]:
    """The memories that adapt in the inner loop (``M_η``, ``M_α``, ``M_memory`` always)."""
    adapt = ["eta", "alpha", "memory"]
    adapt += [n for n in ("k", "v") if getattr(rule, "inner_" + n)]
    if rule.adaptive_q and rule.inner_q:
        adapt.append("q")
    return adapt


class _Rows(NamedTuple):
    """Static facts about the memories stacked on a leading axis (``_names`` order)."""

    names: tuple[str, ...]
    memory: int  # the row of ``M_memory``
    adapting: tuple[bool, ...]  # the rows that adapt in the inner loop (:func:`_adapting`)
    big: tuple[int, ...]  # the rows of the larger-chunk group (empty when both sizes are equal)


def _rows(names, rule: HopeRule) -> _Rows:
    adapt = set(_adapting(rule))
    memory = names.index("memory")
    if rule.chunk_memory == rule.chunk_other:
        big = ()
    elif rule.chunk_memory > rule.chunk_other:
        big = (memory,)
    else:
        big = tuple(i for i in range(len(names)) if i != memory)
    return _Rows(tuple(names), memory, tuple(n in adapt for n in names), big)


def _take_rows(stacked, rows: tuple[int, ...]):
    """The rows ``rows`` (static, increasing) of a stack: one slice when they are contiguous."""
    if rows == tuple(range(rows[0], rows[0] + len(rows))):
        return jax.tree.map(lambda a: a[rows[0] : rows[0] + len(rows)], stacked)
    return jax.tree.map(lambda a: jnp.take(a, jnp.asarray(rows), axis=0), stacked)


def _stack(mems: HopeMemories) -> MLPMemory:
    """Every present memory (``_names`` order) in one ``MLPMemory``: ``w1 [M, B, H, D, h]``,
    ``w2 [M, B, H, h, D]`` (the memories share shapes, gates and chunk coefficients)."""
    return jax.tree.map(lambda *a: jnp.stack(a), *(getattr(mems, n) for n in _names(mems)))


def _unstack(stacked: MLPMemory, names) -> HopeMemories:
    """The inverse of :func:`_stack` (one split per leaf, whose transpose is one concatenate)."""
    parts = jax.tree.map(lambda a: [p[0] for p in jnp.split(a, a.shape[0])], stacked)
    return HopeMemories(**{n: MLPMemory(parts.w1[i], parts.w2[i]) for i, n in enumerate(names)})


def _row_mask(flags, ndim: int):
    """A static per-row bool tuple as an array broadcasting over ``ndim``-dimensional stacks."""
    return jnp.asarray(flags).reshape((-1,) + (1,) * (ndim - 1))


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
    """:func:`_projections` from stacked snapshots whose rows are the memories ``names``: every
    row applied to the chunk's tokens in one batched call (an ``M_memory`` row's output is
    unused)."""
    # x_c broadcast over the rows: a batched product per row, not one product over all rows'
    # weights side by side (that needs the whole stack transposed, a copy per chunk)
    rows_x = jnp.broadcast_to(x_c, (stack.w1.shape[0], *x_c.shape))

    def apply(m, x):  # mlp_memory_apply, its products kept for the backward
        a = keep_for_backward(jnp.einsum("bhkd,bnhd->bnhk", m.w2, x))
        return x + keep_for_backward(jnp.einsum("bhdk,bnhk->bnhd", m.w1, act(a)))

    ys = jax.vmap(apply)(stack, rows_x)
    return _projections({n: ys[i] for i, n in enumerate(names)}, q_c, readout, rule)


def _row_signals(signals, w: MLPMemory, snap_big: MLPMemory | None, rows: _Rows):
    """Every row's ``(x1, g1, x2, g2)`` from its group's chunk-start snapshot: the running ``w``
    for the smaller-chunk group (its chunk starts now), ``snap_big`` for the larger group's rows
    ``rows.big`` (None when both chunk sizes are equal: every row reads ``w``).

    Also returns the running weights' products with the layer inputs, ``(W_1 x1, W_2 x2)`` of
    every row (``layer_updates``' ``w0x``), where they come free with the signals, else None.
    """
    if snap_big is None:  # every snapshot is the running memory: its products are W_0 x
        return signals(w)
    i = rows.memory
    if rows.big == (i,):
        # All rows from w and the memory row replaced: one row computed twice is cheaper than
        # slicing the other rows out of the stack (a copy of most of it).
        sig, (w1x1, w2x2) = signals(w)
        mem_sig = jax.tree.map(lambda a: a[0], signals(snap_big)[0])
        sig = jax.tree.map(lambda a, b: a.at[i].set(b), sig, mem_sig)
        # x2 = k for every row, so W_2 x2 of the running memory is right for row i too; its
        # x1 = σ(W_2 k) is the snapshot's, so W_1 x1 of row i is computed here
        w1x1 = w1x1.at[i].set(keep_for_backward(jnp.einsum("bhdk,bnhk->bnhd", w.w1[i], mem_sig[0])))
        return sig, (w1x1, w2x2)
    mem = signals(_take_rows(w, (i,)))[0]
    others = signals(snap_big)[0]  # rows.big: every row but i
    return jax.tree.map(lambda m, o: jnp.concatenate([o[:i], m, o[i:]]), mem, others), None


def _parallel_updates(w: MLPMemory, s: MLPMemory | None, sig, q, eta, alpha, valid_c,
                      rule: HopeRule, act, rows: _Rows, init: MLPMemory | None = None,
                      reset_c=None, w0x=None):  # fmt: skip
    """A chunk's in-order updates and reads in parallel form (:mod:`core.hope_parallel`): every
    memory layer's per-token recurrence as one triangular solve, all memories of a layer in one
    batched call, the reads of ``M_memory`` with its running weights as matmuls (equal to the
    per-token rule up to rounding).

    Args:
      w, s: the running memories and momenta (``s`` None without momentum), stacked
        (:func:`_stack`, ``M`` rows).
      sig: ``(x1, g1, x2, g2)`` of every row, ``[M, B, c, H, ·]``; q: ``[B, c, H, D]``
        normalised queries; eta, alpha: ``[B, c, H]``; valid_c: ``[B, c]`` bool (a prefix).
      rows: the rows' static facts; a row that does not adapt keeps its weights (its update is
        computed and dropped).
      init, reset_c: packed rows: the stacked memories a document start resets to and ``[B, c]``
        bool document starts (momenta restart at zero); None without resets.
      w0x: optional ``(W_1 x1, W_2 x2)`` of the running memories, ``[M, B, c, H, ·]``
        (:func:`_row_signals`).

    Returns:
      ``(o [B, c, H, D], w, s)`` after the chunk.
    """
    heads_first = lambda a: jnp.moveaxis(a, -3, -2)  # noqa: E731  [.., c, H, ·] -> [.., H, c, ·]
    on = valid_c[:, None, :]  # [B, 1, c]
    lr = jnp.where(on, jnp.moveaxis(eta, 1, 2), 0.0)  # [B, H, c]
    co = chunk_coefficients(
        jnp.where(on, jnp.moveaxis(alpha, 1, 2), 1.0), rule.mu, valid_c, reset_c
    )
    x1, g1, x2, g2 = (heads_first(a) for a in sig)
    g1, g2 = (jnp.where(on[..., None], g, 0.0) for g in (g1, g2))
    updates = functools.partial(
        layer_updates, lr=lr, co=co, dgd=rule.dgd, step=rule.step, target=rule.dgd_target,
        grad_clip=rule.grad_clip,
    )  # fmt: skip
    per_row = jax.vmap(lambda W, S, x, g, Wi, p: updates(W, S, x, g, W_init=Wi, w0x=p))
    s1_0, s2_0 = (None, None) if s is None else s
    i1_0, i2_0 = (None, None) if init is None else init
    p1, p2 = (None, None) if w0x is None else (heads_first(p) for p in w0x)
    u1 = per_row(w.w1, s1_0, x1, g1, i1_0, p1)
    u2 = per_row(w.w2, s2_0, x2, g2, i2_0, p2)
    # o_t = M_{memory,t−1}(q_t), read before write with the running weights
    i = rows.memory
    at = lambda a: None if a is None else a[i]  # noqa: E731
    qh = heads_first(q)
    z = keep_for_backward(read_running(w.w2[i], at(s2_0), x2[i], u2[i], qh, co, at(i2_0)))
    o = qh + read_running(w.w1[i], at(s1_0), x1[i], u1[i], act(z), co, at(i1_0))
    # The chunk-end writes come after o's reads of the chunk-start weights (layer_end's
    # ``after``), so they can overwrite them in place.
    end = jax.vmap(layer_end, in_axes=(0, 0, 0, 0, None, 0, None))  # co: shared by the rows
    w1, s1 = end(w.w1, s1_0, x1, u1, co, i1_0, o)
    w2, s2 = end(w.w2, s2_0, x2, u2, co, i2_0, o)
    new_w, new_s = MLPMemory(w1, w2), (None if s is None else MLPMemory(s1, s2))
    if not all(rows.adapting):  # the others stay (a document start still restarts them)
        keep = lambda new, old: jnp.where(_row_mask(rows.adapting, new.ndim), new, old)  # noqa: E731
        old_w, old_s = w, s
        if init is not None:
            restarted = jnp.any(co.end.astype(bool) & co.fresh, axis=1)[:, None, None, None]
            old_w = jax.tree.map(lambda a, b: jnp.where(restarted, a, b), init, w)
            old_s = None if s is None else jax.tree.map(lambda b: jnp.where(restarted, 0.0, b), s)
        new_w = jax.tree.map(keep, new_w, old_w)
        new_s = None if s is None else jax.tree.map(keep, new_s, old_s)
    return jnp.moveaxis(o, 2, 1), new_w, new_s


def _parallel_chunk(w, s, snap_big, x_c, q_c, valid_c, readout, rule: HopeRule, act,
                    rows: _Rows, init=None, flags=None):  # fmt: skip
    """One chunk of the parallel form on stacked memories: projections, targets and signals from
    the chunk-start snapshots, then :func:`_parallel_updates`.

    The smaller-chunk group's snapshot is the running ``w`` itself (its chunk starts with this
    one); only the larger group's rows are carried as ``snap_big`` (``rows.big``, refreshed by
    the caller every ``big / small`` chunks; None when both sizes are equal), so the carry holds
    one snapshot row, not a copy of every memory. ``flags = (reset_c, fresh_proj_c,
    fresh_mem_c)`` ``[B, c]`` for packed rows (see :func:`_chunk_body`). Returns ``(o, w, s)``.
    """
    if snap_big is None or rows.big == (rows.memory,):
        proj, proj_names = w, rows.names
    else:
        proj, proj_names = snap_big, tuple(rows.names[i] for i in rows.big)
    k, v, eta, alpha, q = _project_rows(proj, proj_names, x_c, q_c, readout, rule, act)
    reset_c = None
    if flags is not None:
        reset_c, fresh_proj, fresh_mem = flags
        k, v, eta, alpha, q = _pick(
            fresh_proj, _project_rows(init, rows.names, x_c, q_c, readout, rule, act),
            (k, v, eta, alpha, q),
        )  # fmt: skip

    def signals(stack):  # k, v broadcast over the rows, as in _project_rows
        per_row = lambda a: jnp.broadcast_to(a, (stack.w1.shape[0], *a.shape))  # noqa: E731
        return jax.vmap(lambda m, k_, v_: _signals(m, k_, v_, act, rule.stop_gradient_targets))(
            stack, per_row(k), per_row(v)
        )

    sig, w0x = _row_signals(signals, w, snap_big, rows)
    if flags is not None:
        w0x = None  # a document's first chunk reads the initial memories: not W_0 x
        is_memory = tuple(j == rows.memory for j in range(len(rows.names)))
        fresh = jnp.where(_row_mask(is_memory, 3), fresh_mem[None], fresh_proj[None])  # [M,B,c]
        sig = jax.tree.map(
            lambda a, b: jnp.where(fresh.reshape(fresh.shape + (1,) * (a.ndim - 3)), a, b),
            signals(init)[0], sig,
        )  # fmt: skip
    return _parallel_updates(w, s, sig, q, eta, alpha, valid_c, rule, act, rows, init, reset_c, w0x)
