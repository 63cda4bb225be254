"""Titans MLP memory in chunks (SPEC §2 parallel form): dual-form reads, scan across chunks.

The memory, its per-token rule and the softclamp are in :mod:`nested_jax.core.titans.mlp`; this
module is the chunked form.

Chunked form (chunk size b; this paragraph is the derivation): all gradients of a chunk are taken
at the chunk-start weights ``W⁰`` (momentum ``S⁰``). With ``P^η_{tj} = Π_{j<i≤t} η_i`` and
``P^α_{ti} = Π_{i<r≤t} (1 − α_r)`` (tokens 1..b, index 0 = chunk start), the recurrences unroll
exactly to::

    S_t = E_t S⁰ − Σ_{j≤t} P^η_{tj} θ_j a_j δ_jᵀ,                 E_t = P^η_{t0}
    W_t = A_t W⁰ + C_t S⁰ − Σ_{j≤t} D_{tj} θ_j a_j δ_jᵀ,           A_t = P^α_{t0},
                                                                  C = P^α E,  D = P^α P^η

(``P`` are lower-triangular ``[b+1, b]`` matrices from cumulative products, never divisions, so
``η = 0`` or ``α = 1`` are exact). The dual form reads without per-token weights:
``z_t W_t = A_t z_t W⁰ + C_t z_t S⁰ − Σ_j D_{tj} θ_j (z_t·a_j) δ_jᵀ``, i.e. per layer
``H = A ⊙ (Z W⁰) + C ⊙ (Z S⁰) − (D ⊙ θ ⊙ Z Aᵀ) Δ``: only matmuls and ``[b × b]`` masks. A
``lax.scan`` over chunks carries ``(W, S)``; nothing of size ``[T/b, params]`` is built except
what reverse-mode autodiff of the scan saves (the carried state per chunk, linear in T).

Packed rows (``segment_ids``) reset the state at every document start and give every document its
own chunk grid (``_chunk_body`` derives both from the same unrolled recurrence). Shapes as in
``titans_mlp``; the scan walks the ``[N, B, H, b, ...]`` layout of ``core.scan.to_head_chunks``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import require_initial_state
from nested_jax.core.dgd import softclamp_factor
from nested_jax.core.scan import chunk, from_head_chunks, scan_remat, to_head_chunks
from nested_jax.core.titans.net import (
    MLP_STATE_CONSTRUCTOR,
    TitansMLPState,
    _backward,
    _check_state,
    _forward,
    _resolve_residual,
    _shape,
    _stop_gradient_where,
    activation_of,
    check_rule,
    horizon_cuts,
    segment_resets,
    validate_chunk_size,
    validate_common,
    validate_horizon,
    validate_segment_ids,
)
from nested_jax.rules import TitansRule

__all__ = ["titans_mlp_chunked", "titans_pool_gates"]


def _seg_prod(x):
    """``x [..., b]`` (tokens 1..b) → ``P [..., b+1, b+1]``, ``P[t, j] = Π_{j<i≤t} x_i`` (t ≥ j).

    Entries with ``t < j`` are 0.

    A cumulative product down each column (no division by running products, so zeros are exact and
    gradients stay finite).
    """
    b = x.shape[-1]
    xe = jnp.concatenate([jnp.ones_like(x[..., :1]), x], axis=-1)
    idx = jnp.arange(b + 1)
    strict = idx[:, None] > idx[None, :]
    y = jnp.where(strict, xe[..., :, None], jnp.ones((), x.dtype))
    return jnp.where(idx[:, None] >= idx[None, :], jnp.cumprod(y, axis=-2), 0.0)


def chunk_coefficients(eta, alpha):
    """Chunk coefficients from ``eta, alpha [..., b]``; rows ``t = 0..b`` (0 = chunk start).

    Returns ``A, C, E [..., b+1]`` and ``Peta, D [..., b+1, b]`` with
    ``S_t = E_t S⁰ − Σ_j Peta_tj θ_j u_j`` and ``W_t = A_t W⁰ + C_t S⁰ − Σ_j D_tj θ_j u_j``.
    """
    pe = _seg_prod(eta)
    pa = _seg_prod(1.0 - alpha)
    E, A = pe[..., :, 0], pa[..., :, 0]
    peta, palpha = pe[..., :, 1:], pa[..., :, 1:]
    C = jnp.einsum("...ti,...i->...t", palpha, E[..., 1:])
    D = jnp.einsum("...ti,...ij->...tj", palpha, peta[..., 1:, :])
    return A, C, E, peta, D


def _surprise_factors(W, k, v, th, rule: TitansRule, residual: bool):
    """Rank-1 factors ``(a_l, δ_l)`` of every token's surprise at ``W``; θ with the softclamp."""
    activation = activation_of(rule)
    out, inputs, pre = _forward(W, k, activation, residual)
    deltas = _backward(W, pre, out - v, activation)
    if rule.grad_clip:
        sq = sum(
            jnp.sum(jnp.square(a), -1) * jnp.sum(jnp.square(d), -1)
            for a, d in zip(inputs, deltas, strict=True)
        )
        th = th * softclamp_factor(sq, float(rule.grad_clip))
    return inputs, deltas, th


def _state_at(row_sel, mats, coef_w, coef_s, D, peta, th_c, inputs, deltas):
    """``(W, S)`` tuples at the chunk row picked by the one-hot ``row_sel`` (``[b+1]`` or
    ``[B, 1, b+1]``; row t = the state after the chunk's first t tokens) from the unrolled
    recurrence ``W_t = Σ coef_w_t·m − Σ_j D_tj θ_j a_j δ_jᵀ`` (same for S with ``coef_s``,
    ``P^η``)."""
    pick = lambda c: jnp.sum(c * row_sel, -1)  # noqa: E731
    last = lambda c: pick(c)[..., None, None]  # noqa: E731
    d_l = jnp.sum(D * row_sel[..., :, None], -2) * th_c
    p_l = jnp.sum(peta * row_sel[..., :, None], -2) * th_c
    W_new, S_new = [], []
    for ms, a, d in zip(mats, inputs, deltas, strict=True):
        w = -jnp.einsum("...jd,...j,...je->...de", a, d_l, d)
        s_ = -jnp.einsum("...jd,...j,...je->...de", a, p_l, d)
        for cw, cs, m in zip(coef_w, coef_s, ms, strict=True):
            w, s_ = w + last(cw) * m, s_ + last(cs) * m
        W_new.append(w)
        S_new.append(s_)
    return tuple(W_new), tuple(S_new)


def _row_flag(f):
    """A ``[B, 1]`` 0/1 flag (per row) as a bool broadcasting over weights ``[B, H, d, d']``."""
    return f[:, :, None, None] > 0


def _pick_factors(where, alt, base):
    """Per token, the surprise factors ``alt = (a_l, δ_l, θ)`` where ``where [..., b, 1]`` is
    set, else ``base`` (a token whose anchor is not the chunk's default one)."""
    (in_a, de_a, th_a), (in_b, de_b, th_b) = alt, base
    inputs = [jnp.where(where, x, y) for x, y in zip(in_a, in_b, strict=True)]
    deltas = [jnp.where(where, x, y) for x, y in zip(de_a, de_b, strict=True)]
    return inputs, deltas, jnp.where(where[..., 0], th_a, th_b)


def _reset_terms(reset, et, al, init, factors, surprise):
    """Packed rows, resets: tokens past a reset take their surprise at ``W^i``; the resets become
    gates ``(η c, 1 − (1 − α) c)`` and the sources ``r (1 − α)`` (into M), ``r η`` (into S).

    Returns ``(factors, et, al, (src_m, src_s), after)`` with ``after [..., b, 1]`` (token j is
    past a reset of this chunk).
    """
    after = (jnp.cumsum(reset, axis=-1) > 0)[..., None]
    # Most chunks of packed rows hold no document start: skip the second set of factors then.
    at_init = lax.cond(jnp.any(after), lambda: surprise(init[0]), lambda: factors)
    factors = _pick_factors(after, at_init, factors)
    keep = 1.0 - reset
    src_m, src_s = reset * (1.0 - al), reset * et
    return factors, et * keep, 1.0 - (1.0 - al) * keep, (src_m, src_s), after


def reset_coefficients(al, D, peta, E, src_m, src_s):
    """Coefficients of ``(W^i, S^i)`` in the unrolled W (``F``, ``G``) and S (``0``, ``Hs``);
    ``al`` is the reset-gated α of :func:`_reset_terms`."""
    palpha = _seg_prod(1.0 - al)[..., :, 1:]
    coef_w = [
        jnp.einsum("...ti,...i->...t", palpha, src_m),
        jnp.einsum("...tj,...j->...t", D, src_s),
    ]
    return coef_w, [jnp.zeros_like(E), jnp.einsum("...tj,...j->...t", peta, src_s)]


def _local_start_terms(bound, reset, after, unrolled, factors, Wa, Wi, surprise):
    """Packed rows, document-local chunk start at offset ``r > 0``: tokens ``r..`` (until a reset)
    take their surprise at ``W_r``, read from the ``unrolled = (mats, coef_w, coef_s, D, peta)``
    recurrence. Returns ``(factors, next anchor)``: ``W^i`` after a reset here, else ``W_r``, else
    ``W^a``."""
    inputs, deltas, th_c = factors
    bnd = bound.at[..., 0].set(0.0)
    row_r = jnp.pad(bnd, [(0, 0)] * (bnd.ndim - 1) + [(0, 1)])  # token offset r ↔ row r

    def with_bound():
        W_r, _ = _state_at(row_r, *unrolled, th_c, inputs, deltas)
        return surprise(W_r), W_r

    at_r, W_r = lax.cond(jnp.any(bnd > 0), with_bound, lambda: (factors, Wa))
    mid = ((jnp.cumsum(bnd, axis=-1) > 0) & ~after[..., 0])[..., None]
    factors = _pick_factors(mid, at_r, factors)
    has_r, has_i = _row_flag(jnp.sum(bnd, -1)), _row_flag(jnp.sum(reset, -1))
    Wa = tuple(
        jnp.where(has_i, wi, jnp.where(has_r, wr, wa))
        for wi, wr, wa in zip(Wi, W_r, Wa, strict=True)
    )
    return factors, Wa


def _dual_read(q, mats, coef_w, D, factors, *, rule: TitansRule, residual: bool):
    """``y_t = M_t(q_t)`` (``M_{t−1}`` with ``rule.read_before_write``) of every token by the dual
    form, layer by layer ``H = Σ_m coef_m ⊙ (Z m) − (D ⊙ θ ⊙ Z Aᵀ) Δ`` (no per-token weights)."""
    inputs, deltas, th_c = factors
    activation = activation_of(rule)
    rows = slice(0, -1) if rule.read_before_write else slice(1, None)
    Dr = D[..., rows, :] * th_c[..., None, :]
    z = q
    for i, ms in enumerate(mats):
        za = jnp.einsum("...td,...jd->...tj", z, inputs[i])
        h = -jnp.einsum("...tj,...je->...te", Dr * za, deltas[i])
        for c, m in zip(coef_w, ms, strict=True):
            h = h + c[..., rows, None] * jnp.einsum("...td,...de->...te", z, m)
        z = activation(h) if i < len(mats) - 1 else h
    return z + q if residual else z


def _chunk_body(carry, xs, *, init, rule: TitansRule, residual: bool):
    """One chunk for all (B, H). Carry ``(W, S)`` (``(W, S, W^a)`` for packed rows); xs arrays
    ``[B, H, b, ...]``, ``sel [b+1]``, ``reset`` and ``bound`` (``[B, 1, b]`` 0/1, or None).

    ``sel`` is the one-hot row of the chunk's last real token (< b only for a padded last chunk):
    the final state is read from that row, so padding never touches the state.

    Resets (packed sequences): at a token with ``r_t = 1`` the state before it is ``init =
    (W^i, S^i)``. With ``c = 1 − r`` this is the same unrolled recurrence with gates ``η c`` and
    ``(1 − α) c`` plus sources ``(1 − c)(1 − α) W^i`` into M and ``(1 − c) η S^i`` into S, whose
    coefficients are ``F = P^α (1−c)(1−α)``, ``G = D (1−c)η`` (into W) and ``Hs = P^η (1−c)η``
    (into S).

    Per-document chunk grid (packed rows): a document's chunks start at its own first token, as
    in a separate run, while the scan runs on the row's grid. A token's surprise is taken at its
    *anchor*, the weights at the start of its document-local chunk: ``W^i`` after a reset in this
    chunk; ``W_r`` (the state after the chunk's first r tokens) at and after a document-local
    chunk start at offset ``r > 0`` (``bound``); otherwise the carried ``W^a`` (the anchor of the
    chunk's first token, which is ``W⁰`` when a document-local chunk starts with this chunk).
    There is at most one such ``r`` per chunk (document-local starts are b apart) and no reset
    before it, so ``W_r`` only needs the surprises at ``W^a``.
    """
    q, k, v, th, et, al, sel, reset, bound = xs
    surprise = functools.partial(_surprise_factors, k=k, v=v, th=th, rule=rule, residual=residual)
    packed = reset is not None
    if packed:
        W0, S0, Wa = carry
        Wa = tuple(jnp.where(_row_flag(bound[..., 0]), w, a) for w, a in zip(W0, Wa, strict=True))
    else:
        W0, S0 = carry
        Wa = W0
    factors = surprise(Wa)
    mats = list(zip(W0, S0, strict=True))
    if packed:
        factors, et, al, src, after = _reset_terms(reset, et, al, init, factors, surprise)
        mats = list(zip(W0, S0, *init, strict=True))
    A, C, E, peta, D = chunk_coefficients(et, al)
    coef_w, coef_s = [A, C], [jnp.zeros_like(E), E]  # coefficients of (W⁰, S⁰[, W^i, S^i])
    if packed:
        cw, cs = reset_coefficients(al, D, peta, E, *src)
        coef_w, coef_s = coef_w + cw, coef_s + cs
        unrolled = (mats, coef_w, coef_s, D, peta)
        factors, Wa = _local_start_terms(
            bound, reset, after, unrolled, factors, Wa, init[0], surprise
        )
    y = _dual_read(q, mats, coef_w, D, factors, rule=rule, residual=residual)
    # State after the chunk's last real token.
    inputs, deltas, th_c = factors
    W_new, S_new = _state_at(sel, mats, coef_w, coef_s, D, peta, th_c, inputs, deltas)
    return ((W_new, S_new, Wa) if packed else (W_new, S_new)), y


def chunk_pool(x, b, T):
    """Mean of ``x [B, T, H]`` over the real tokens of each chunk, back to ``[B, T, H]``."""
    N = -(-T // b)
    xp = chunk(x, b)  # [B, N, b, H], zero padded
    counts = jnp.minimum(b, T - b * jnp.arange(N)).astype(x.dtype)
    mean = xp.sum(2) / counts[None, :, None]
    return jnp.repeat(mean, b, axis=1)[:, :T]


def titans_pool_gates(x, chunk_size: int):
    """Per-chunk gates (SPEC §2 option): each token's gate becomes the mean over its chunk.

    Args:
      x: ``[B, T, H]`` gate (θ, η or α); chunks are ``[n·chunk_size, (n+1)·chunk_size)``, the last
        one possibly shorter (mean over its real tokens only).

    Returns:
      ``[B, T, H]``. ``titans_*_chunked`` with ``rule.per_chunk_gates`` (and ``memory_chunk =
      chunk_size``) equals the chunked form fed with these pooled gates.
    """
    validate_chunk_size("titans_pool_gates", chunk_size)
    if _shape(x) is None or x.ndim != 3:
        raise ValueError(f"titans_pool_gates: x must have shape [B, T, H], got {_shape(x)}")
    return chunk_pool(x, chunk_size, x.shape[1])


def local_chunk_starts(resets, b):
    """``[B, T]`` float 0/1: 1 where a document-local chunk starts inside a document (its local
    position is a positive multiple of b; the row's first document starts at position 0)."""
    t = jnp.arange(resets.shape[1])
    start = lax.cummax(jnp.where(resets > 0, t, 0), axis=1)
    lp = t - start
    return ((lp % b == 0) & (lp > 0)).astype(jnp.float32)


def document_chunk_pool(x, chunk_starts):
    """Mean of ``x [B, T, H]`` over each document-local chunk, back to ``[B, T, H]``.

    ``chunk_starts`` ``[B, T]`` (float 0/1) marks where a chunk starts after position 0: a
    document's first token and every ``b`` tokens after it (``segment_resets`` plus
    :func:`local_chunk_starts`). So a document gets the pooled gates it gets alone
    (:func:`chunk_pool` on it); the last chunk of a document may be shorter.
    """
    group = jnp.cumsum((chunk_starts > 0).astype(jnp.int32), axis=1)  # [B, T], 0 at position 0
    T = x.shape[1]
    pool_row = functools.partial(jax.ops.segment_sum, num_segments=T)
    sums = jax.vmap(pool_row)(x, group)  # [B, T(groups), H]
    counts = jax.vmap(pool_row)(jnp.ones(group.shape, x.dtype), group)  # [B, T(groups)]
    means = sums / jnp.maximum(counts, 1)[..., None]
    return jnp.take_along_axis(means, group[..., None], axis=1)


def _chunked_core(state, xs, *, rule: TitansRule, residual: bool, segment_ids=None,
                  reset_state=None):  # fmt: skip
    """Shared chunked engine (validated inputs): ``(y [B,T,H,V] f32, (W, S) f32 tuples)``.

    ``state = (weights, momentum)`` tuples, ``xs = (q, k, v, θ, η, α)``; chunks of
    ``rule.memory_chunk``. ``reset_state``: ``(W, S)`` tuples a segment start resets to (default
    the initial carry); ``rule.grad_horizon``: cut the carried state's gradient before every
    chunk starting at a positive multiple of it (a multiple of the chunk).
    """
    weights, momentum = state
    q = xs[0]
    B, T, H, _ = q.shape
    b = rule.memory_chunk
    N = -(-T // b)
    f32 = jnp.float32
    q, k, v, theta, eta, alpha = (x.astype(f32) for x in xs)
    if segment_ids is not None:
        r = segment_resets(segment_ids)  # [B, T]: 1 before a document's first token
        doc_chunks = local_chunk_starts(r, b)  # 1 where a document-local chunk starts inside it
    if rule.per_chunk_gates and segment_ids is None:
        theta, eta, alpha = (chunk_pool(x, b, T) for x in (theta, eta, alpha))
    elif rule.per_chunk_gates:  # each document's own chunks, as it gets alone
        theta, eta, alpha = (document_chunk_pool(x, r + doc_chunks) for x in (theta, eta, alpha))
    last = jnp.minimum(b, T - b * jnp.arange(N))  # row index (1..b) of each chunk's last real token
    sel = jax.nn.one_hot(last, b + 1, dtype=f32)
    carry = (tuple(w.astype(f32) for w in weights), tuple(s.astype(f32) for s in momentum))
    init = carry
    if reset_state is not None:
        init = tuple(tuple(a.astype(f32) for a in part) for part in reset_state)
    xs = tuple(to_head_chunks(x, b) for x in (q, k, v, theta, eta, alpha)) + (sel,)
    cut = horizon_cuts(N, b, rule.grad_horizon)

    def run(carry, xs):
        body = functools.partial(_chunk_body, init=init, rule=rule, residual=residual)
        if rule.remat:
            body = jax.checkpoint(body, prevent_cse=False)
        if cut is not None:
            inner = body

            def body(c, x):
                return inner(_stop_gradient_where(x[-1], c), x[:-1])

        steps = xs + ((cut,) if cut is not None else ())
        block = rule.remat_block(N)
        if block > 1:  # only every block-th carry is stored; the chunks between are recomputed
            carry, y = scan_remat(body, carry, steps, remat_every=block)
        else:
            carry, y = lax.scan(body, carry, steps)
        return from_head_chunks(y, T), carry[:2]  # y [N, B, H, b, V] → [B, T, H, V]

    if segment_ids is None:
        return run(carry, xs + (None, None))
    reset = to_head_chunks(r[:, :, None], b)  # [B, T] → [N, B, 1, b]
    bound = to_head_chunks(doc_chunks[:, :, None], b)
    # Rows without a document start (most rows of long documents) take the plain engine.
    return lax.cond(
        jnp.any(r > 0),
        lambda: run((*carry, carry[0]), xs + (reset, bound)),  # + the anchor W^a of the grid
        lambda: run(carry, xs + (None, None)),
    )


def titans_mlp_chunked(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state: TitansMLPState | None = None,
    rule: TitansRule = TitansRule(),
    residual=None,
    segment_ids=None,
    reset_state: TitansMLPState | None = None,
):
    """Titans memory in chunks of ``rule.memory_chunk`` (SPEC §2 parallel form, dual-form reads).

    Gradients inside a chunk are taken at the chunk-start weights; momentum and decay are exact;
    each token reads with its own ``M_t`` (or ``M_{t-1}``) through the dual form.
    ``memory_chunk = 1`` equals ``titans_mlp_recurrent``. Any ``T`` (the last chunk is padded;
    padding never reaches the state).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      initial_state: ``TitansMLPState`` ``[B, H, d_l, d_{l+1}]`` arrays
        (``titans_mlp_state(weights, B)``). Required: the MLP memory has no zero state (None
        raises ``ValueError``).
      rule: :class:`~nested_jax.rules.TitansRule` (default: the paper's rule), every field:
        ``memory_chunk`` (b), ``read_before_write``, ``grad_clip``, ``activation`` (as
        ``titans_mlp_step``), ``per_chunk_gates`` (θ, η, α replaced by their per-chunk means,
        ``titans_pool_gates``; on packed rows over each document's own chunks), ``remat``
        (recompute each chunk in the backward pass, saving only the carried state per chunk) and
        ``grad_horizon`` (truncated backprop, a multiple of ``memory_chunk``, 0 = off: the
        carried state is a ``stop_gradient`` before every chunk starting at a positive multiple of
        it; values unchanged).
      residual: add ``z`` to the memory's output; None = auto (see ``titans_mlp_apply``).
      segment_ids: optional ``[B, T]`` int (packed sequences): the state resets to
        ``reset_state`` at every segment start, and each segment keeps its own chunk grid
        (chunks of b tokens from its first token; a token's surprise is taken at the weights at
        the start of its segment-local chunk). Every segment then gets exactly the outputs of a
        separate call on it, wherever it starts in the row. Costs up to two more surprise
        evaluations per chunk where a segment starts or a segment-local chunk starts mid-chunk
        (skipped by ``lax.cond`` elsewhere).
      reset_state: the state a segment start resets to (default ``initial_state``; a caller that
        carries the state across calls passes the learned initial state here).

    Returns:
      ``(y [B, T, H, V] in v's dtype, final TitansMLPState f32)``.
    """
    fn = "titans_mlp_chunked"
    check_rule(fn, rule)
    state = require_initial_state(fn, initial_state, MLP_STATE_CONSTRUCTOR)
    B, T, H, K, V = validate_common(fn, q, k, v, theta, eta, alpha, per_token=False)
    _check_state(fn, state, B, H, K, V, name="initial_state")
    validate_segment_ids(fn, segment_ids, B, T)
    validate_horizon(fn, rule)
    if reset_state is not None:
        _check_state(fn + " (reset_state)", reset_state, B, H, K, V)
    res = _resolve_residual(fn, residual, len(state.weights), K, V)
    y, (W, S) = _chunked_core(
        (state.weights, state.momentum), (q, k, v, theta, eta, alpha), rule=rule, residual=res,
        segment_ids=segment_ids, reset_state=reset_state,
    )  # fmt: skip
    return y.astype(v.dtype), TitansMLPState(W, S)
