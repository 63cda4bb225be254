"""Proteus-wrapped gated delta rule (GDN) with key-row blocks (SPEC §1, §4).

With training context ``N``, ``E`` blocks, ``Δ = max(1, ⌊N/E⌋)`` and the 1-based absolute position
``t = t0 + i + 1`` of local token ``i`` (``t0`` = tokens already seen, for streaming and decoding),
the mask ``g_t`` opens the first ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` blocks of key rows of
``S [B, H, K, V]`` (``core/proteus.py``) and::

    S̃    = g_t ⊙ S_{t-1}
    S_t  = where(g_t, α_t S̃ + β_t k_t (v_t − α_t S̃ᵀk_t)ᵀ, S_{t-1})   # locked rows keep their bits
    o_t  = (g_t ⊙ S_t)ᵀ (scale · q_t) = S_tᵀ (g_t ⊙ scale · q_t)

Forms: ``*_step`` (one token at ``t``), ``*_recurrent`` (``lax.scan`` of the step, ground truth;
``t0`` may be traced, ``[]`` or ``[B]``), ``*_chunked`` (static ``t0``; equals the recurrent form
to rounding, see :func:`proteus_gated_delta_chunked`). Static dispatch: ``num_blocks == 1``, or a
static ``t0`` with every position of the call past the last opening, calls the plain backbone (bit
for bit). Not covered: ``segment_ids``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from nested_jax.core._proteus_common import (
    _check_blocked,
    _check_schedule,
    _check_static_t0,
    _check_t0,
    _is_int,
    _positions,
    _statically_open,
    _zero_where,
    proteus_spans,
)
from nested_jax.core.associative import (
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
)
from nested_jax.core.proteus import (
    proteus_active_blocks,
    proteus_block_ids,
    proteus_gated_step,
)

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
    state, q_t, k_t, v_t, g_t, beta_t, *, t, context_len: int, num_blocks: int, scale=None
):
    """One GDN token with Proteus key-row blocks at 1-based position ``t`` (SPEC §1, §4).

    ``S_t = where(g_t, α_t S̃ + β_t k_t (v_t − α_t S̃ᵀk_t)ᵀ, S_{t-1})`` with ``S̃ = g_t ⊙ S_{t-1}``
    (key rows), ``o_t = (g_t ⊙ S_t)ᵀ (scale · q_t)``.

    Args:
      state: ``[B, H, K, V]`` previous state.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; g_t, beta_t: ``[B, H]``.
      t: 1-based absolute position of this token, int or integer array ``[]`` / ``[B]``.
      context_len: training context ``N``; num_blocks: ``E`` (``K ≥ E``).
      scale: multiplies ``q_t``; default ``K ** -0.5``.

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, new_state [B, H, K, V] f32)``.
    """
    fn = "proteus_gated_delta_step"
    n, e = _check_schedule(fn, context_len, num_blocks)
    if getattr(q_t, "ndim", None) != 3:
        raise ValueError(f"{fn}: q_t must have shape [B, H, K], got {getattr(q_t, 'shape', None)}")
    B, _, K = q_t.shape
    _check_blocked(fn, "key dim K", K, e)
    _check_t0(fn, t, B, name="t (1-based)", low=1)
    if _statically_open(t - 1 if _is_int(t) else t, n, e):
        return gated_delta_step(state, q_t, k_t, v_t, g_t, beta_t, scale=scale)
    pos = _positions(t, B)
    return _gdn_masked_step(state, q_t, k_t, v_t, g_t, beta_t, pos, n, e, scale)


def _gdn_masked_step(S, q_t, k_t, v_t, g_t, b_t, pos, n, e, scale):
    """``pos`` int32 ``[B]`` 1-based positions; key mask per batch row."""
    K = q_t.shape[-1]
    ids = jnp.asarray(proteus_block_ids(K, e))
    open_k = ids < proteus_active_blocks(pos, n, e)[:, None]  # [B, K]
    q_t = _zero_where(open_k[:, None, :], q_t)
    return proteus_gated_step(
        gated_delta_step, S, open_k[:, None, :, None], q_t, k_t, v_t, g_t, b_t, scale=scale
    )


def proteus_gated_delta_recurrent(
    q, k, v, g, beta, *, context_len: int, num_blocks: int, scale=None, initial_state=None, t0=0
):
    """GDN with Proteus key-row blocks, token by token (SPEC §1, §4; ground truth).

    ``lax.scan`` of :func:`proteus_gated_delta_step` at positions ``t = t0 + 1 … t0 + T``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      context_len: training context ``N`` (Python int); num_blocks: ``E`` (``K ≥ E``).
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      t0: tokens already seen: a Python int (static; enables the fully-open dispatch) or an integer
        array ``[]`` / ``[B]`` (traced, e.g. ragged decoding).

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    fn = "proteus_gated_delta_recurrent"
    n, e = _check_schedule(fn, context_len, num_blocks)
    B, T, H, K, V = _check_gdn(fn, q, k, v, g, beta, initial_state)
    _check_blocked(fn, "key dim K", K, e)
    _check_t0(fn, t0, B)
    if _statically_open(t0, n, e):
        return gated_delta_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    pos0 = _positions(t0, B)
    s0 = (
        jnp.zeros((B, H, K, V), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )

    def body(S, xs):
        i, q_t, k_t, v_t, g_t, b_t = xs
        o_t, S = _gdn_masked_step(S, q_t, k_t, v_t, g_t, b_t, pos0 + i + 1, n, e, scale)
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
    context_len: int,
    num_blocks: int,
    scale=None,
    initial_state=None,
    t0: int = 0,
    chunk_size: int = 64,
):
    """GDN with Proteus key-row blocks in chunk form (SPEC §1, §4; equals the recurrent form).

    On a span of constant mask ``g`` (``proteus_spans``) the open rows evolve exactly as a GDN with
    keys ``g ⊙ k`` from ``g ⊙ S`` (``(g ⊙ S)ᵀ(g ⊙ k) = Sᵀ(g ⊙ k)``, and a masked key never writes a
    locked row) and the locked rows are frozen, so each span is one ``gated_delta_chunked`` call on
    ``(g ⊙ q, g ⊙ k)`` from ``g ⊙ S``, after which the locked rows are put back with ``where``.
    A fully open span is a plain call. Spans shorter than ``chunk_size`` use their length as the
    chunk size (no padding work).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      context_len: training context ``N``; num_blocks: ``E`` (``K ≥ E``), Python ints.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      t0: tokens already seen (static Python int ``≥ 0``).
      chunk_size: chunk length ``C`` (> 0); neither ``T`` nor the spans need be multiples of it.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    fn = "proteus_gated_delta_chunked"
    n, e = _check_schedule(fn, context_len, num_blocks)
    B, T, H, K, V = _check_gdn(fn, q, k, v, g, beta, initial_state)
    _check_blocked(fn, "key dim K", K, e)
    t0 = _check_static_t0(fn, t0)
    if not _is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    spans = proteus_spans(T, t0, n, e)
    if _statically_open(t0, n, e) or not spans:
        return gated_delta_chunked(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size
        )
    S = (
        jnp.zeros((B, H, K, V), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )
    partial = [sp for sp in spans if sp[2] < e]
    ids = jnp.asarray(proteus_block_ids(K, e))

    def masked_span(S, xs, active, c):
        """A span with ``active`` (static or traced) blocks open: GDN on masked q, k from g ⊙ S."""
        qs, ks, vs, gs, bs = xs
        m = ids < active  # [K]
        o, X = gated_delta_chunked(
            _zero_where(m, qs), _zero_where(m, ks), vs, gs, bs,
            scale=scale, initial_state=_zero_where(m[:, None], S), chunk_size=c,
        )  # fmt: skip
        return jnp.where(m[:, None], X, S), o

    seq = (q, k, v, g, beta)
    end = partial[-1][1]
    if len(partial) == 1:
        S, o_part = masked_span(
            S, tuple(x[:, :end] for x in seq), partial[0][2], min(chunk_size, end)
        )
    else:
        S, o_part = _padded_span_scan(masked_span, S, seq, partial, chunk_size)
    outs = [o_part]
    if end < T:  # the fully open tail (at most one span, always last): the plain backbone
        o_tail, S = gated_delta_chunked(
            *(x[:, end:] for x in seq), scale=scale, initial_state=S,
            chunk_size=min(chunk_size, T - end),
        )  # fmt: skip
        outs.append(o_tail)
    return jnp.concatenate(outs, axis=1), S


def _padded_span_scan(span_fn, S, seq, spans, chunk_size):
    """Runs ``span_fn`` over ``spans`` with one compiled body (``lax.scan`` over spans).

    Every span is zero-padded at its end to the longest span length ``L``; a padding token has
    ``k = v = q = 0``, ``g = 0``, ``β = 0`` and leaves a GDN state exactly as it is, so the carried
    state is the unpadded one. Compile time then does not grow with the number of blocks.

    Args:
      span_fn: ``(S, xs, active, chunk_size) -> (S, o)`` on time-sliced ``xs`` ``[B, L, ...]``.
      S: initial state.
      seq: tuple of ``[B, T, ...]`` arrays.
      spans: ``(start, end, active)`` static triples, contiguous from 0.
      chunk_size: requested chunk size (capped at ``L``).

    Returns:
      ``(S, o)`` with ``o [B, end_of_last_span, ...]``.
    """
    lens = [b - a for a, b, _ in spans]
    L = max(lens)
    offs = np.arange(L)
    idx = np.stack([np.minimum(a + offs, b - 1) for a, b, _ in spans])  # [P, L] (clipped: valid)
    valid = jnp.asarray(offs[None, :] < np.asarray(lens)[:, None])  # [P, L]

    def gather(x):  # [B, T, ...] -> [P, B, L, ...], zero on padding
        xp = jnp.moveaxis(jnp.take(x, jnp.asarray(idx), axis=1), 1, 0)
        v = valid.reshape(valid.shape[0], 1, L, *([1] * (x.ndim - 2)))
        return _zero_where(v, xp)

    active = jnp.asarray([act for _, _, act in spans], jnp.int32)
    c = min(int(chunk_size), L)
    S, o = lax.scan(
        lambda s, xs: span_fn(s, xs[:-1], xs[-1], c), S, (*map(gather, seq), active)
    )  # o [P, B, L, ...]
    # back to time order: local t of span i sits at flat index i·L + (t − start_i)
    flat = np.concatenate([i * L + np.arange(n) for i, n in enumerate(lens)])
    o = jnp.moveaxis(o, 0, 1)
    o = o.reshape(o.shape[0], -1, *o.shape[3:])
    return S, jnp.take(o, jnp.asarray(flat), axis=1)
