"""Proteus-wrapped gated delta rule (GDN) with key-row blocks (SPEC §1, §4).

With training context ``N``, ``E`` blocks, ``Δ = max(1, ⌊N/E⌋)`` and the 1-based absolute position
``t = t0 + i + 1`` of local token ``i`` (``t0`` = tokens already seen, for streaming and decoding),
the mask ``g_t`` opens the first ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` blocks of key rows of
``S [B, H, K, V]`` (``core/proteus.py``) and::

    S̃    = g_t ⊙ S_{t-1}
    S_t  = where(g_t, α_t S̃ + β_t k_t (v_t − α_t S̃ᵀk_t)ᵀ, S_{t-1})   # locked rows keep their bits
    o_t  = (g_t ⊙ S_t)ᵀ (scale · q_t) = S_tᵀ (g_t ⊙ scale · q_t)

The schedule ``(E, N)`` is one :class:`~nested_jax.rules.ProteusRule` (``schedule=``); the rest
are GDN's plain keywords. Forms: ``*_step`` (one token at ``t``), ``*_recurrent`` (``lax.scan`` of
the step, ground truth; ``t0`` may be traced, ``[]`` or ``[B]``), ``*_chunked`` (static ``t0``;
equals the recurrent form to rounding, see :func:`proteus_gated_delta_chunked`). Static dispatch:
``schedule.blocks == 1``, or a static ``t0`` with every position of the call past the last
opening, calls the plain backbone (bit for bit). Not covered: ``segment_ids``. The chunk form
takes its backbone as ``backbone`` (``gated_delta_chunked`` or a function with its contract, e.g.
the Pallas kernel that ``ops.linear.proteus_gated_delta`` passes for ``impl="pallas"``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from nested_jax.core.associative.forms import (
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
)
from nested_jax.core.checks import check_positive_int
from nested_jax.core.proteus import (
    _check_blocked,
    _check_schedule_rule,
    _check_static_t0,
    _check_t0,
    _is_int,
    _positions,
    _statically_open,
    _zero_where,
    proteus_active_blocks,
    proteus_block_ids,
    proteus_gated_step,
    proteus_spans,
)
from nested_jax.core.scan import state_zeros, zeros_typed
from nested_jax.rules import ProteusRule

__all__ = [
    "proteus_gated_delta_step",
    "proteus_gated_delta_recurrent",
    "proteus_gated_delta_chunked",
]


def _check_gdn(fn, q, k, v, g, beta, initial_state):
    """Shape/dtype checks of a GDN sequence call; returns ``(B, T, H, K, V)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{fn}: {name} must have shape [B, T, H, D], got {getattr(x, 'shape', None)}"
            )
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{fn}: k must have shape [B, T, H, K] = {q.shape} like q, got {k.shape}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(
            f"{fn}: v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {v.shape}"
        )
    for name, x in (("g", g), ("beta", beta)):
        if getattr(x, "shape", None) != (B, T, H):
            raise ValueError(
                f"{fn}: {name} must have shape [B, T, H] = [{B}, {T}, {H}], got "
                f"{getattr(x, 'shape', None)}"
            )
    V = v.shape[3]
    if initial_state is not None and getattr(initial_state, "shape", None) != (B, H, K, V):
        raise ValueError(
            f"{fn}: initial_state must have shape [B, H, K, V] = [{B}, {H}, {K}, {V}], got "
            f"{getattr(initial_state, 'shape', None)}"
        )
    return B, T, H, K, V


def proteus_gated_delta_step(
    state, q_t, k_t, v_t, g_t, beta_t, *, t, schedule: ProteusRule, scale=None
):
    """One GDN token with Proteus key-row blocks at 1-based position ``t`` (SPEC §1, §4).

    ``S_t = where(g_t, α_t S̃ + β_t k_t (v_t − α_t S̃ᵀk_t)ᵀ, S_{t-1})`` with ``S̃ = g_t ⊙ S_{t-1}``
    (key rows), ``o_t = (g_t ⊙ S_t)ᵀ (scale · q_t)``.

    Args:
      state: ``[B, H, K, V]`` previous state.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; g_t, beta_t: ``[B, H]``.
      t: 1-based absolute position of this token, int or integer array ``[]`` / ``[B]``.
      schedule: :class:`~nested_jax.rules.ProteusRule` ``(E, N)``: ``E`` blocks (``K ≥ E``)
        opened over the training context ``N``.
      scale: multiplies ``q_t``; default ``K ** -0.5``.

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, new_state [B, H, K, V] f32)``.
    """
    fn = "proteus_gated_delta_step"
    n, e = _check_schedule_rule(fn, schedule)
    if getattr(q_t, "ndim", None) != 3:
        raise ValueError(f"{fn}: q_t must have shape [B, H, K], got {getattr(q_t, 'shape', None)}")
    B, _, K = q_t.shape
    _check_blocked(fn, "key dim K", K, e)
    _check_t0(fn, t, B, name="t (1-based)", low=1)
    if _statically_open(t - 1 if _is_int(t) else t, n, e):
        return gated_delta_step(state, q_t, k_t, v_t, g_t, beta_t, scale=scale)
    pos = _positions(t, B)
    return _gdn_masked_step(state, (q_t, k_t, v_t, g_t, beta_t), pos, schedule, scale)


def _gdn_masked_step(S, token, pos, schedule: ProteusRule, scale):
    """``token = (q, k, v, g, β)`` of one position; ``pos`` int32 ``[B]`` 1-based positions; key
    mask per batch row."""
    q_t, *rest = token
    K = q_t.shape[-1]
    n, e = schedule.context_len, schedule.blocks
    ids = jnp.asarray(proteus_block_ids(K, e))
    open_k = ids < proteus_active_blocks(pos, n, e)[:, None]  # [B, K]
    q_t = _zero_where(open_k[:, None, :], q_t)
    return proteus_gated_step(
        gated_delta_step, S, open_k[:, None, :, None], q_t, *rest, scale=scale
    )


def proteus_gated_delta_recurrent(
    q, k, v, g, beta, *, schedule: ProteusRule, scale=None, initial_state=None, t0=0
):
    """GDN with Proteus key-row blocks, token by token (SPEC §1, §4; ground truth).

    ``lax.scan`` of :func:`proteus_gated_delta_step` at positions ``t = t0 + 1 … t0 + T``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      schedule: :class:`~nested_jax.rules.ProteusRule` ``(E, N)`` (``K ≥ E``).
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      t0: tokens already seen: a Python int (static; enables the fully-open dispatch) or an integer
        array ``[]`` / ``[B]`` (traced, e.g. ragged decoding).

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    fn = "proteus_gated_delta_recurrent"
    n, e = _check_schedule_rule(fn, schedule)
    B, T, H, K, V = _check_gdn(fn, q, k, v, g, beta, initial_state)
    _check_blocked(fn, "key dim K", K, e)
    _check_t0(fn, t0, B)
    if _statically_open(t0, n, e):
        return gated_delta_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    pos0 = _positions(t0, B)
    s0 = state_zeros(k, v) if initial_state is None else initial_state.astype(jnp.float32)

    def body(S, xs):
        i, *token = xs
        o_t, S = _gdn_masked_step(S, token, pos0 + i + 1, schedule, scale)
        return S, o_t

    tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    xs = (jnp.arange(T, dtype=jnp.int32), *map(tm, (q, k, v, g, beta)))
    S, o = lax.scan(body, s0, xs)
    return jnp.moveaxis(o, 0, 1), S


def proteus_gated_delta_chunked(
    q,
    k,
    v,
    g,
    beta,
    *,
    schedule: ProteusRule,
    scale=None,
    initial_state=None,
    t0: int = 0,
    chunk_size: int = 64,
    backbone: Callable = gated_delta_chunked,
):
    """GDN with Proteus key-row blocks in chunk form (SPEC §1, §4; equals the recurrent form).

    One ``backbone`` (``gated_delta_chunked``) call over the whole sequence, whatever ``E``:

    - Every token uses masked keys and queries ``g_t ⊙ k_t``, ``g_t ⊙ q_t`` (``g_t`` static per
      position). Then ``Sᵀ(g_t ⊙ k_t)`` reads only open rows and a masked key writes no locked
      row, so the open rows evolve exactly as in the recurrent form.
    - The call starts from ``g_{t0+1} ⊙ S_0``: rows locked at the start are 0, and a zero row that
      is never written stays 0 under any decay, so it needs no freezing.
    - A block opening inside the call must start from its frozen ``S_0`` rows: each of its rows
      ``r`` is put back by one *injection token* right before the opening, ``k = e_r``, ``β = 1``,
      ``g = 0``, ``v = S_0[r]``, ``q = 0`` (a delta step with a unit key replaces row ``r``, which
      is 0 there, by ``v``: ``S + e_r (v − Sᵀe_r)ᵀ``). Its output is dropped. Without an
      ``initial_state`` (zero) no injection is needed.
    - Rows still locked at the end are restored from ``S_0`` with ``where`` (their exact bits).

    So the cost is the backbone's on ``T + R`` tokens, ``R ≤ K`` the rows opened by injection
    (0 from a zero state), with the backbone's full chunk parallelism. ``v`` is promoted to f32
    when injections are needed (the backbone computes in f32; the output keeps ``v``'s dtype).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      schedule: :class:`~nested_jax.rules.ProteusRule` ``(E, N)`` (``K ≥ E``).
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      t0: tokens already seen (static Python int ``≥ 0``).
      chunk_size: chunk length ``C`` (> 0); ``T`` need not be a multiple of it.
      backbone: the chunked gated delta rule every path calls, as
        ``backbone(q, k, v, g, beta, scale=, initial_state=, chunk_size=)`` returning
        ``(o [B, T', H, V], S [B, H, K, V] f32)`` with ``gated_delta_chunked``'s contract
        (``initial_state`` None = zero); default ``gated_delta_chunked``. The injections are
        ordinary tokens, so any such backbone runs them (``ops.linear.proteus_gated_delta``
        passes the Pallas kernel).

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    fn = "proteus_gated_delta_chunked"
    n, e = _check_schedule_rule(fn, schedule)
    B, T, H, K, V = _check_gdn(fn, q, k, v, g, beta, initial_state)
    _check_blocked(fn, "key dim K", K, e)
    t0 = _check_static_t0(fn, t0)
    check_positive_int(f"{fn}: chunk_size", chunk_size)
    if not callable(backbone):
        raise ValueError(f"{fn}: backbone must be a function, got {backbone!r}")
    run = functools.partial(backbone, scale=scale, chunk_size=chunk_size)
    spans = [] if _statically_open(t0, n, e) else proteus_spans(T, t0, n, e)
    if not spans:
        return run(q, k, v, g, beta, initial_state=initial_state)
    ids = proteus_block_ids(K, e)
    active = np.concatenate([np.full(b - a, act) for a, b, act in spans])  # static k(t), [T]
    tok_open = jnp.asarray(ids[None, :] < active[:, None])[None, :, None, :]  # [1, T, 1, K]
    qm, km = _zero_where(tok_open, q), _zero_where(tok_open, k)
    open_start = ids < spans[0][2]
    open_end = ids < spans[-1][2]
    if initial_state is None:
        o, S = run(qm, km, v, g, beta)
        return o, _zero_where(open_end[:, None], S)  # locked rows: exactly the zero start
    S0 = initial_state.astype(jnp.float32)
    s_start = _zero_where(open_start[:, None], S0)
    if len(spans) == 1:  # nothing opens inside the call
        o, S = run(qm, km, v, g, beta, initial_state=s_start)
        return o, jnp.where(open_end[:, None], S, S0)
    o, S = _gdn_with_injections(run, (qm, km, v, g, beta), S0, s_start, spans, ids)
    return o, jnp.where(open_end[:, None], S, S0)


def _gdn_with_injections(run, xs, S0, s_start, spans, ids):
    """One ``run`` (the backbone with its ``scale`` and ``chunk_size``) call over ``xs = (q, k, v,
    g, β)`` (q, k masked) with the rows of each newly opened block injected from ``S0`` right
    before the block's first token (see :func:`proteus_gated_delta_chunked`)."""
    qm, km, v, g, beta = xs
    B, _, H, K = qm.shape
    vdt = jnp.promote_types(v.dtype, jnp.float32)
    pieces = {name: [] for name in ("q", "k", "v", "g", "beta")}
    real = []  # [start, end) of each span's real tokens in the extended sequence
    n_ext = 0
    prev = spans[0][2]
    for a, b, act in spans:
        rows = np.flatnonzero((ids >= prev) & (ids < act))  # opened by this span (static)
        prev = act
        R = rows.size
        if R:
            # injected rows typed like the tokens (sharded like them on an Explicit mesh, varying
            # like them under shard_map): concatenate needs one type for all its pieces
            onehot = jnp.asarray(np.eye(K, dtype=np.float32)[rows], km.dtype)  # [R, K]
            pieces["q"].append(zeros_typed(qm[:, :1], (B, R, H, K)))
            pieces["k"].append(onehot[None, :, None, :] + zeros_typed(km[:, :1], (B, R, H, K)))
            pieces["v"].append(jnp.moveaxis(S0[:, :, rows, :], 2, 1).astype(vdt))  # [B, R, H, V]
            pieces["g"].append(zeros_typed(g[:, :1], (B, R, H)))
            pieces["beta"].append(1 + zeros_typed(beta[:, :1], (B, R, H)))
            n_ext += R
        for name, x in (("q", qm), ("k", km), ("v", v.astype(vdt)), ("g", g), ("beta", beta)):
            pieces[name].append(x[:, a:b])
        real.append((n_ext, n_ext + b - a))
        n_ext += b - a
    cat = {name: jnp.concatenate(p, axis=1) for name, p in pieces.items()}
    o, S = run(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], initial_state=s_start)
    # static slices, not a gather: the gather's transpose is a scatter that XLA constant-folds
    o = jnp.concatenate([o[:, a:b] for a, b in real], axis=1)
    return o.astype(v.dtype), S
