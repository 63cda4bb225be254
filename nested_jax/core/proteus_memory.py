"""Proteus-wrapped memories: GDN and Titans with incremental block activation (SPEC §4).

With training context ``N``, ``E`` blocks, ``Δ = max(1, ⌊N/E⌋)`` and the 1-based absolute position
``t = t0 + i + 1`` of local token ``i`` (``t0`` = tokens already seen, for streaming and decoding),
the mask ``g_t`` opens the first ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` blocks (``core/proteus.py``) and::

    M^{(g)}_{t-1} = g_t ⊙ M_{t-1}
    candidate     = the backbone's step on M^{(g)}_{t-1}   (write, decay and momentum)
    M_t           = where(g_t, candidate, M_{t-1})          # locked coordinates keep their bits
    y_t           = Read(g_t ⊙ M_t, q_t)   (read_before_write: Read(M^{(g)}_{t-1}, q_t))

Blocked axes (contiguous blocks, remainder in the last block):

- GDN ``S [B, H, K, V]`` and the Titans matrix memory (``L_M = 1``) ``M, S [B, H, K, V]``: key rows.
  The read-after-write ``(g ⊙ S_t)ᵀ q`` equals ``S_tᵀ (g ⊙ q)``, so the query is masked; for
  Titans the key is masked too, which makes the step's gradient ``k (Mᵀk − v)ᵀ`` equal to
  ``g ⊙ ∇ℓ(M^{(g)})`` exactly (SPEC §4's masked gradient, and the softclamp norm sees only it).
- Titans MLP memory (``L_M ≥ 2``, weights ``W_l [B, H, d_l, d_{l+1}]``, ``M(z) = z + W_1ᵀσ(W_0ᵀz)``
  for ``L_M = 2``): hidden units, i.e. columns of ``W_0`` and rows of ``W_1`` (SPEC §4's "rows of
  W_2 and columns of W_1" in the column-major writing of ``core/proteus.py``). **Decision** for
  ``L_M ≥ 3``: every hidden layer is blocked with the same schedule and a middle weight's
  coordinate is open iff both of its units are. With ``σ(0) = 0`` (SiLU, GELU, tanh, ReLU) a locked
  hidden unit of the gated memory outputs 0, so the gradient on locked coordinates is exactly 0
  and the step's own read is ``Read(g ⊙ M_t)``; activations with ``σ(0) ≠ 0`` are refused.

Structure of the forms:

- ``*_step``: one token at position ``t``; ``*_recurrent``: ``lax.scan`` of the step (ground
  truth; ``t0`` may be traced, shape ``[]`` or ``[B]``, for ragged decoding).
- ``*_chunked``: ``t0`` is a static Python int. The mask is constant between Δ-boundaries, so time
  is split into static spans (``proteus_spans``); on a span with ``k < E`` blocks open, the open
  part of the state evolves exactly as the backbone on the gated state (with masked keys/queries
  where that applies) and locked coordinates are frozen; each span runs the backbone's chunked
  form from the gated state and the locked coordinates are put back with ``where``. Spans need not
  be multiples of the chunk size (the backbone pads). For GDN this is exact (equals the recurrent
  form to rounding). For Titans the chunked form takes gradients at chunk starts, and **its chunk
  grid restarts at every Δ-boundary** (the mask changes there); with ``chunk_size = 1`` it equals
  the recurrent form, and when ``chunk_size`` divides ``Δ`` and ``t0`` the grid is the global one.
  GDN runs all partially open spans as one ``lax.scan`` over zero-padded spans (a padding token is
  an exact no-op for GDN), so its compile time does not grow with ``E``; a Titans padding token
  is not a no-op (``M ← M + S``), so Titans spans are unrolled (one backbone call per span: the
  compiled program grows with the number of spans in the call, at most ``E``).

Static dispatch: ``num_blocks == 1``, or a static ``t0`` with every position of the call beyond the
last opening (``k(t0 + 1) = E``, e.g. evaluation beyond ``N``), calls the plain backbone function,
so the result is the backbone's bit for bit (an all-ones ``where`` can change XLA's fusion).

Not covered here: ``segment_ids`` (packed sequences would need per-document positions), Hope
memories and layer options (``proteus_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nested_jax.core.associative import (
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
)
from nested_jax.core.proteus import (
    proteus_active_blocks,
    proteus_block_ids,
    proteus_block_len,
    proteus_gate,
    proteus_gated_step,
    proteus_gated_update,
)
from nested_jax.core.titans import (
    DEFAULT_MLP_GRAD_CLIP,
    TitansLinearState,
    TitansMLPState,
    titans_linear_chunked,
    titans_linear_recurrent,
    titans_linear_step,
    titans_mlp_chunked,
    titans_mlp_recurrent,
    titans_mlp_step,
)

__all__ = [
    "proteus_spans",
    "proteus_gated_delta_step",
    "proteus_gated_delta_recurrent",
    "proteus_gated_delta_chunked",
    "proteus_titans_linear_step",
    "proteus_titans_linear_recurrent",
    "proteus_titans_linear_chunked",
    "proteus_titans_mlp_masks",
    "proteus_titans_mlp_step",
    "proteus_titans_mlp_recurrent",
    "proteus_titans_mlp_chunked",
]


# --------------------------------------------------------------------------------------------------
# Static schedule helpers and validation
# --------------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_schedule(fn: str, context_len, num_blocks) -> tuple[int, int]:
    for name, x in (("context_len", context_len), ("num_blocks", num_blocks)):
        if not _is_int(x) or x < 1:
            raise ValueError(f"{fn}: {name} must be a positive Python int, got {x!r}")
    return int(context_len), int(num_blocks)


def _check_blocked(fn: str, name: str, size: int, num_blocks: int) -> None:
    if size < num_blocks:
        raise ValueError(
            f"{fn}: {name} ({size}) must be >= num_blocks ({num_blocks}) so that no block is empty"
        )


def _check_static_t0(fn: str, t0) -> int:
    if not _is_int(t0) or t0 < 0:
        raise ValueError(
            f"{fn}: t0 must be a non-negative Python int (the chunked form splits time statically;"
            f" use the recurrent form for a traced position), got {t0!r}"
        )
    return int(t0)


def _check_t0(fn: str, t0, B: int, name: str = "t0", low: int = 0) -> None:
    """``t0``: a Python int ``≥ low`` or an integer array ``[]`` / ``[B]`` (maybe traced)."""
    if _is_int(t0):
        if t0 < low:
            raise ValueError(f"{fn}: {name} must be >= {low}, got {t0}")
        return
    shape = getattr(t0, "shape", None)
    if shape not in ((), (B,)) or not jnp.issubdtype(t0.dtype, jnp.integer):
        raise ValueError(
            f"{fn}: {name} must be an int or an integer array of shape [] or [B] = [{B}], got "
            f"{getattr(t0, 'dtype', type(t0).__name__)} {shape}"
        )


def _positions(t0, B: int):
    """Checked ``t0`` → int32 ``[B]``."""
    return jnp.broadcast_to(jnp.asarray(t0, jnp.int32), (B,))


def _statically_open(t0, context_len: int, num_blocks: int) -> bool:
    """True when every position of the call has all blocks open, known at trace time."""
    if num_blocks == 1:
        return True
    return _is_int(t0) and proteus_active_blocks(int(t0) + 1, context_len, num_blocks) == num_blocks


def proteus_spans(length: int, t0: int, context_len: int, num_blocks: int):
    """Static split of local positions ``[0, length)`` into spans of constant ``k(t)`` (SPEC §4).

    ``k`` steps up at absolute ``t = jΔ + 1`` (``j = 1 … E−1``), i.e. before local index
    ``i = jΔ − t0``; after ``(E−1)Δ`` tokens every block is open for good.

    Args:
      length: number of tokens ``T`` of the call (``≥ 0``).
      t0: tokens already seen before the call (``≥ 0``, Python int).
      context_len: ``N``.
      num_blocks: ``E``.

    Returns:
      list of ``(start, end, k)`` Python ints, contiguous, covering ``[0, length)`` (empty when
      ``length == 0``); ``k`` is the number of open blocks on ``[start, end)``.
    """
    fn = "proteus_spans"
    n, e = _check_schedule(fn, context_len, num_blocks)
    if not _is_int(length) or length < 0:
        raise ValueError(f"{fn}: length must be a non-negative int, got {length!r}")
    t0 = _check_static_t0(fn, t0)
    delta = proteus_block_len(n, e)
    cuts = [j * delta - t0 for j in range(1, e) if 0 < j * delta - t0 < length]
    edges = [0, *cuts, int(length)] if length > 0 else []
    return [
        (a, b, proteus_active_blocks(t0 + a + 1, n, e))
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]


def _open_ids(size: int, num_blocks: int, active: int) -> np.ndarray:
    """Static bool ``[size]``: coordinates in the first ``active`` blocks."""
    return proteus_block_ids(size, num_blocks) < active


def _zero_where(mask, x):
    return jnp.where(mask, x, jnp.zeros((), x.dtype))


# --------------------------------------------------------------------------------------------------
# Gated delta rule (GDN)
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Titans: matrix memory (L_M = 1) and MLP memory (L_M ≥ 2)
# --------------------------------------------------------------------------------------------------


def _check_titans_seq(fn, q, k, v, theta, eta, alpha, per_token: bool):
    """Rank/shape checks shared by the Titans wrappers; returns ``(B, H, K)``.

    The backbone validates everything again (dtypes, grad_clip, state shapes); this only makes
    sure the shapes the wrapper reads are there, with errors naming the argument.
    """
    rank, lead, sfx = (3, "[B, H", "_t") if per_token else (4, "[B, T, H", "")
    for name, x in ((f"q{sfx}", q), (f"k{sfx}", k), (f"v{sfx}", v)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(
                f"{fn}: {name} must have shape {lead}, D], got {getattr(x, 'shape', None)}"
            )
    if k.shape != q.shape:
        raise ValueError(
            f"{fn}: k{sfx} must have shape {lead}, K] = {q.shape} like q, got {k.shape}"
        )
    for name, x in ((f"theta{sfx}", theta), (f"eta{sfx}", eta), (f"alpha{sfx}", alpha)):
        if getattr(x, "shape", None) != q.shape[:-1]:
            raise ValueError(
                f"{fn}: {name} must have shape {lead}] = {q.shape[:-1]}, got "
                f"{getattr(x, 'shape', None)}"
            )
    return q.shape[0], q.shape[-2], q.shape[-1]


def _linear_state(fn, initial_state, B, H, K, V) -> TitansLinearState:
    """None → zeros; ``TitansLinearState``/``(M, S)`` → f32; a bare ``M`` → ``(M, 0)``."""
    if initial_state is None:
        z = jnp.zeros((B, H, K, V), jnp.float32)
        return TitansLinearState(z, z)
    if isinstance(initial_state, tuple) and len(initial_state) == 2:
        M, S = initial_state
    else:
        M, S = initial_state, None
    for name, x in (("initial_state.M", M), ("initial_state.S", S)):
        if x is not None and getattr(x, "shape", None) != (B, H, K, V):
            raise ValueError(
                f"{fn}: {name} must have shape [B, H, K, V] = {(B, H, K, V)}, got "
                f"{getattr(x, 'shape', None)}"
            )
    M = M.astype(jnp.float32)
    return TitansLinearState(M, jnp.zeros_like(M) if S is None else S.astype(jnp.float32))


def _key_open(active, K: int, e: int):
    """Open key rows: static ``active`` → numpy ``[K]``; traced ``[B]`` → ``[B, K]``."""
    ids = proteus_block_ids(K, e)
    if _is_int(active):
        return ids < active
    return jnp.asarray(ids) < active[:, None]


def _state_rows(open_k):
    """Key mask ``[K]`` / ``[B, K]`` → broadcastable to ``[B, H, K, V]``."""
    return open_k[:, None] if open_k.ndim == 1 else open_k[:, None, :, None]


def _token_rows(open_k):
    """Key mask ``[K]`` / ``[B, K]`` → broadcastable to a token ``[B, H, K]``."""
    return open_k if open_k.ndim == 1 else open_k[:, None, :]


def proteus_titans_linear_step(
    state,
    q_t,
    k_t,
    v_t,
    theta_t,
    eta_t,
    alpha_t,
    *,
    t,
    context_len: int,
    num_blocks: int,
    read_before_write: bool = False,
    grad_clip: float | None = None,
):
    """One Titans matrix-memory token (L_M = 1) with Proteus key-row blocks (SPEC §2, §4).

    With ``g`` the key-row mask at ``t``, ``M̃ = g ⊙ M``, ``S̃ = g ⊙ S``, ``k̃ = g ⊙ k_t``:
    ``u = k̃ (M̃ᵀk̃ − v_t)ᵀ = g ⊙ ∇ℓ(M̃; k_t, v_t)``, ``S_t = where(g, η S̃ − θ u, S)``,
    ``M_t = where(g, (1 − α) M̃ + S_t, M)``, ``o_t = M_tᵀ (g ⊙ q_t)`` (``M_{t-1}`` with
    ``read_before_write``).

    Args:
      state: ``TitansLinearState(M, S)`` or a bare ``M`` (zero momentum), ``[B, H, K, V]``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; theta_t, eta_t, alpha_t: ``[B, H]``.
      t: 1-based absolute position, int or integer array ``[]`` / ``[B]``.
      context_len: ``N``; num_blocks: ``E`` (``K ≥ E``).
      read_before_write, grad_clip: as ``titans_linear_step``.

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, TitansLinearState f32)``.
    """
    fn = "proteus_titans_linear_step"
    n, e = _check_schedule(fn, context_len, num_blocks)
    B, H, K = _check_titans_seq(fn, q_t, k_t, v_t, theta_t, eta_t, alpha_t, per_token=True)
    _check_blocked(fn, "key dim K", K, e)
    _check_t0(fn, t, B, name="t (1-based)", low=1)
    kw = dict(read_before_write=read_before_write, grad_clip=grad_clip)
    if _statically_open(t - 1 if _is_int(t) else t, n, e):
        return titans_linear_step(state, q_t, k_t, v_t, theta_t, eta_t, alpha_t, **kw)
    st = _linear_state(fn, state, B, H, K, v_t.shape[-1])
    open_k = _key_open(proteus_active_blocks(_positions(t, B), n, e), K, e)
    return _titans_key_step(
        titans_linear_step, st, open_k, q_t, k_t, v_t, theta_t, eta_t, alpha_t, kw
    )


def _titans_key_step(step_fn, st, open_k, q_t, k_t, v_t, th, et, al, kw):
    """Gated step of a key-row-blocked Titans memory: masked q, k on the gated state, then merge."""
    rows = _token_rows(open_k)
    return proteus_gated_step(
        step_fn, st, _state_rows(open_k), _zero_where(rows, q_t), _zero_where(rows, k_t),
        v_t, th, et, al, **kw,
    )  # fmt: skip


def proteus_titans_linear_recurrent(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    context_len: int,
    num_blocks: int,
    initial_state=None,
    t0=0,
    read_before_write: bool = False,
    grad_clip: float | None = None,
):
    """Titans matrix memory with Proteus key-row blocks, token by token (SPEC §2, §4; ground truth).

    ``lax.scan`` of :func:`proteus_titans_linear_step` at positions ``t0 + 1 … t0 + T``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      context_len: ``N``; num_blocks: ``E`` (``K ≥ E``), Python ints.
      initial_state: None (zeros), ``TitansLinearState(M, S)`` or a bare ``M``, ``[B, H, K, V]``.
      t0: tokens already seen: Python int, or integer array ``[]`` / ``[B]`` (traced).
      read_before_write, grad_clip: as ``titans_linear_recurrent``.

    Returns:
      ``(o [B, T, H, V] in v's dtype, TitansLinearState(M, S) f32 [B, H, K, V])``.
    """
    fn = "proteus_titans_linear_recurrent"
    n, e = _check_schedule(fn, context_len, num_blocks)
    B, H, K = _check_titans_seq(fn, q, k, v, theta, eta, alpha, per_token=False)
    _check_blocked(fn, "key dim K", K, e)
    _check_t0(fn, t0, B)
    kw = dict(read_before_write=read_before_write, grad_clip=grad_clip)
    if _statically_open(t0, n, e):
        return titans_linear_recurrent(
            q, k, v, theta, eta, alpha, initial_state=initial_state, **kw
        )
    st = _linear_state(fn, initial_state, B, H, K, v.shape[-1])
    pos0 = _positions(t0, B)

    def body(s, xs):
        i, *tok = xs
        open_k = _key_open(proteus_active_blocks(pos0 + i + 1, n, e), K, e)
        o_t, s = _titans_key_step(titans_linear_step, s, open_k, *tok, kw)
        return s, o_t

    tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    xs = (jnp.arange(q.shape[1], dtype=jnp.int32), *map(tm, (q, k, v, theta, eta, alpha)))
    st, o = lax.scan(body, st, xs)
    return jnp.moveaxis(o, 0, 1), st


def _run_spans_unrolled(span_fn, open_fn, state, seq, spans, e):
    """Static loop over spans: ``span_fn(state, xs, active)`` while blocks are locked, then
    ``open_fn(state, xs)`` on the fully open tail. Returns ``(concatenated outputs, state)``."""
    outs = []
    for a, b, active in spans:
        xs = tuple(x[:, a:b] for x in seq)
        o, state = open_fn(state, xs) if active == e else span_fn(state, xs, active)
        outs.append(o)
    return jnp.concatenate(outs, axis=1), state


def proteus_titans_linear_chunked(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    context_len: int,
    num_blocks: int,
    initial_state=None,
    t0: int = 0,
    chunk_size: int = 16,
    read_before_write: bool = False,
    grad_clip: float | None = None,
    per_chunk_gates: bool = False,
    remat: bool = True,
):
    """Titans matrix memory with Proteus key-row blocks in chunk form (SPEC §2, §4).

    Each span of constant mask ``g`` (``proteus_spans``) is one ``titans_linear_chunked`` call on
    ``(g ⊙ q, g ⊙ k)`` from ``(g ⊙ M, g ⊙ S)``; the locked rows of ``M`` and ``S`` are then put
    back with ``where``. The chunk grid restarts at every span (the mask changes there), so with
    ``chunk_size = 1`` this equals the recurrent form, and with ``chunk_size`` dividing ``Δ`` and
    ``t0`` the chunks are the global ones.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``; any T.
      context_len: ``N``; num_blocks: ``E`` (``K ≥ E``), Python ints.
      initial_state: None (zeros), ``TitansLinearState(M, S)`` or a bare ``M``, ``[B, H, K, V]``.
      t0: tokens already seen (static Python int ``≥ 0``).
      chunk_size, read_before_write, grad_clip, per_chunk_gates, remat: as
        ``titans_linear_chunked`` (pooled gates are pooled over chunks of each span).

    Returns:
      ``(o [B, T, H, V] in v's dtype, TitansLinearState(M, S) f32 [B, H, K, V])``.
    """
    fn = "proteus_titans_linear_chunked"
    n, e = _check_schedule(fn, context_len, num_blocks)
    B, H, K = _check_titans_seq(fn, q, k, v, theta, eta, alpha, per_token=False)
    _check_blocked(fn, "key dim K", K, e)
    t0 = _check_static_t0(fn, t0)
    if not _is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    kw = dict(
        read_before_write=read_before_write, grad_clip=grad_clip,
        per_chunk_gates=per_chunk_gates, remat=remat,
    )  # fmt: skip
    spans = proteus_spans(q.shape[1], t0, n, e)
    if _statically_open(t0, n, e) or not spans:
        return titans_linear_chunked(
            q, k, v, theta, eta, alpha, initial_state=initial_state, chunk_size=chunk_size, **kw
        )
    st = _linear_state(fn, initial_state, B, H, K, v.shape[-1])

    def open_fn(s, xs):
        return titans_linear_chunked(*xs, initial_state=s, chunk_size=chunk_size, **kw)

    def span_fn(s, xs, active):
        open_k = _key_open(active, K, e)
        rows = _state_rows(open_k)
        qs, ks, *rest = xs
        o, cand = titans_linear_chunked(
            _zero_where(open_k, qs), _zero_where(open_k, ks), *rest,
            initial_state=proteus_gate(s, rows), chunk_size=chunk_size, **kw,
        )  # fmt: skip
        return o, proteus_gated_update(s, cand, rows)

    return _run_spans_unrolled(span_fn, open_fn, st, (q, k, v, theta, eta, alpha), spans, e)


# MLP memory ------------------------------------------------------------------------------------


def _mlp_dims(fn, state) -> tuple[int, ...]:
    if not isinstance(state, TitansMLPState) or not isinstance(state.weights, (tuple, list)):
        raise ValueError(
            f"{fn}: state must be a TitansMLPState(weights, momentum), got {type(state)}"
        )
    if not state.weights:
        raise ValueError(f"{fn}: state.weights must be a non-empty tuple of [B, H, d_l, d_(l+1)]")
    for i, w in enumerate(state.weights):
        if getattr(w, "ndim", None) != 4:
            raise ValueError(
                f"{fn}: state.weights[{i}] must have shape [B, H, d_l, d_(l+1)], got "
                f"{getattr(w, 'shape', None)}"
            )
    return (state.weights[0].shape[2], *(w.shape[3] for w in state.weights))


def proteus_titans_mlp_masks(active, dims, num_blocks: int):
    """Open coordinates of every weight of an MLP memory with ``active`` blocks open (SPEC §4).

    ``L = 1`` (matrix memory): key rows of ``W_0``. ``L ≥ 2``: hidden units: columns of ``W_l`` for
    ``l < L−1`` and rows of ``W_l`` for ``l > 0`` (a middle weight is open where both units are).

    Args:
      active: number of open blocks, a Python int or an integer array ``[B]``.
      dims: ``(d_0 = K, d_1, …, d_L = V)``.
      num_blocks: ``E`` (every blocked size ``≥ E``).

    Returns:
      tuple of ``L`` bool masks broadcastable to ``W_l [B, H, d_l, d_{l+1}]`` (static int →
      numpy ``[d_l or 1, d_{l+1} or 1]``; array → ``[B, 1, d_l or 1, d_{l+1} or 1]``).
    """
    L = len(dims) - 1
    static = _is_int(active)

    def side(size, blocked, row):
        if not blocked:
            return None
        m = _key_open(active, size, num_blocks)  # [d] or [B, d]
        shape = (size, 1) if row else (1, size)
        return m.reshape(shape) if static else m.reshape(m.shape[0], 1, *shape)

    masks = []
    for i in range(L):
        rows = side(dims[i], blocked=(L == 1 or i > 0), row=True)
        cols = side(dims[i + 1], blocked=(i < L - 1), row=False)
        masks.append(rows if cols is None else cols if rows is None else rows & cols)
    return tuple(masks)


def _mlp_setup(fn, state, q, context_len, num_blocks, t0, activation, residual):
    """Shared checks; returns ``(n, e, dims)``. Refuses what the hidden-unit gating cannot do."""
    n, e = _check_schedule(fn, context_len, num_blocks)
    dims = _mlp_dims(fn, state)
    L = len(dims) - 1
    _check_blocked(
        fn, "key dim K" if L == 1 else "every hidden size", min(dims[1:-1] or dims[:1]), e
    )
    if _statically_open(t0, n, e):
        return n, e, dims
    if L == 1 and residual:
        # a residual z + Wᵀz would read the unmasked query: masking q, k is only exact without it
        raise ValueError(f"{fn}: residual=True with L_M = 1 is not supported with num_blocks > 1")
    if L >= 2:
        with jax.ensure_compile_time_eval():
            at0 = float(activation(jnp.zeros((), jnp.float32)))
        if at0 != 0.0:
            raise ValueError(
                f"{fn}: activation must satisfy σ(0) = 0 (got {at0}) so that locked hidden units "
                "of the gated memory are silent (SPEC §4 hidden-unit blocks)"
            )
    return n, e, dims


def _mlp_gated_step(st, masks, q_t, k_t, v_t, th, et, al, kw, L):
    mask_tree = TitansMLPState(masks, masks)
    if L == 1:
        rows = masks[0][..., 0]  # [K] or [B, 1, K]
        q_t, k_t = _zero_where(rows, q_t), _zero_where(rows, k_t)
    return proteus_gated_step(titans_mlp_step, st, mask_tree, q_t, k_t, v_t, th, et, al, **kw)


def proteus_titans_mlp_step(
    state: TitansMLPState,
    q_t,
    k_t,
    v_t,
    theta_t,
    eta_t,
    alpha_t,
    *,
    t,
    context_len: int,
    num_blocks: int,
    activation: Callable = jax.nn.silu,
    residual=None,
    read_before_write: bool = False,
    grad_clip: float | None = DEFAULT_MLP_GRAD_CLIP,
):
    """One token of the Titans MLP memory with Proteus blocks (SPEC §2, §4).

    ``M̃ = g ⊙ M`` (hidden units for ``L ≥ 2``, key rows for ``L = 1``), the backbone step on
    ``(M̃, g ⊙ S)``, then ``where(g, ·, previous)`` on weights and momentum. With ``σ(0) = 0`` a
    locked unit of ``M̃`` is silent, so the step's gradient is 0 on locked coordinates (equal to
    ``g ⊙ ∇ℓ(M̃)``) and its read is ``(g ⊙ M_t)(q_t)`` (``M̃(q_t)`` with ``read_before_write``).

    Args:
      state: ``TitansMLPState`` with ``W_l, S_l [B, H, d_l, d_{l+1}]``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; theta_t, eta_t, alpha_t: ``[B, H]``.
      t: 1-based absolute position, int or integer array ``[]`` / ``[B]``.
      context_len: ``N``; num_blocks: ``E``.
      activation: σ with ``σ(0) = 0``; residual, read_before_write, grad_clip: as
        ``titans_mlp_step``.

    Returns:
      ``(y_t [B, H, V] in v_t's dtype, TitansMLPState f32)``.
    """
    fn = "proteus_titans_mlp_step"
    B, _, _ = _check_titans_seq(fn, q_t, k_t, v_t, theta_t, eta_t, alpha_t, per_token=True)
    _check_t0(fn, t, B, name="t (1-based)", low=1)
    t_prev = t - 1 if _is_int(t) else t
    n, e, dims = _mlp_setup(fn, state, q_t, context_len, num_blocks, t_prev, activation, residual)
    kw = dict(
        activation=activation, residual=residual, read_before_write=read_before_write,
        grad_clip=grad_clip,
    )  # fmt: skip
    if _statically_open(t_prev, n, e):
        return titans_mlp_step(state, q_t, k_t, v_t, theta_t, eta_t, alpha_t, **kw)
    masks = proteus_titans_mlp_masks(proteus_active_blocks(_positions(t, B), n, e), dims, e)
    return _mlp_gated_step(state, masks, q_t, k_t, v_t, theta_t, eta_t, alpha_t, kw, len(dims) - 1)


def proteus_titans_mlp_recurrent(
    state: TitansMLPState,
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    context_len: int,
    num_blocks: int,
    t0=0,
    activation: Callable = jax.nn.silu,
    residual=None,
    read_before_write: bool = False,
    grad_clip: float | None = DEFAULT_MLP_GRAD_CLIP,
):
    """Titans MLP memory with Proteus blocks, token by token (SPEC §2, §4; ground truth).

    ``lax.scan`` of :func:`proteus_titans_mlp_step` at positions ``t0 + 1 … t0 + T``.

    Args:
      state: initial ``TitansMLPState`` (``[B, H, d_l, d_{l+1}]`` arrays).
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      context_len: ``N``; num_blocks: ``E``, Python ints.
      t0: tokens already seen: Python int, or integer array ``[]`` / ``[B]`` (traced).
      activation, residual, read_before_write, grad_clip: as :func:`proteus_titans_mlp_step`.

    Returns:
      ``(y [B, T, H, V] in v's dtype, final TitansMLPState f32)``.
    """
    fn = "proteus_titans_mlp_recurrent"
    B, _, _ = _check_titans_seq(fn, q, k, v, theta, eta, alpha, per_token=False)
    _check_t0(fn, t0, B)
    n, e, dims = _mlp_setup(fn, state, q, context_len, num_blocks, t0, activation, residual)
    kw = dict(
        activation=activation, residual=residual, read_before_write=read_before_write,
        grad_clip=grad_clip,
    )  # fmt: skip
    if _statically_open(t0, n, e):
        return titans_mlp_recurrent(state, q, k, v, theta, eta, alpha, **kw)
    pos0 = _positions(t0, B)
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731

    def body(s, xs):
        i, *tok = xs
        masks = proteus_titans_mlp_masks(proteus_active_blocks(pos0 + i + 1, n, e), dims, e)
        y_t, s = _mlp_gated_step(s, masks, *tok, kw, len(dims) - 1)
        return s, y_t

    tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    xs = (jnp.arange(q.shape[1], dtype=jnp.int32), *map(tm, (q, k, v, theta, eta, alpha)))
    st, y = lax.scan(body, f32(state), xs)
    return jnp.moveaxis(y, 0, 1), st


def proteus_titans_mlp_chunked(
    state: TitansMLPState,
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    context_len: int,
    num_blocks: int,
    t0: int = 0,
    chunk_size: int = 16,
    activation: Callable = jax.nn.silu,
    residual=None,
    read_before_write: bool = False,
    grad_clip: float | None = DEFAULT_MLP_GRAD_CLIP,
    per_chunk_gates: bool = False,
    remat: bool = True,
):
    """Titans MLP memory with Proteus blocks in chunk form (SPEC §2, §4).

    Each span of constant mask (``proteus_spans``) is one ``titans_mlp_chunked`` call from the
    gated state (weights and momentum; masked q, k for ``L = 1``), then the locked coordinates are
    put back with ``where``. Locked coordinates stay exactly 0 inside the span (silent units, zero
    gradients), so reads are those of the gated memory. The chunk grid restarts at every span;
    ``chunk_size = 1`` equals the recurrent form.

    Args:
      state: initial ``TitansMLPState`` (``[B, H, d_l, d_{l+1}]`` arrays).
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``; any T.
      context_len: ``N``; num_blocks: ``E``, Python ints.
      t0: tokens already seen (static Python int ``≥ 0``).
      chunk_size, activation, residual, read_before_write, grad_clip, per_chunk_gates, remat: as
        ``titans_mlp_chunked`` (``σ(0) = 0`` required when ``num_blocks > 1``).

    Returns:
      ``(y [B, T, H, V] in v's dtype, final TitansMLPState f32)``.
    """
    fn = "proteus_titans_mlp_chunked"
    _check_titans_seq(fn, q, k, v, theta, eta, alpha, per_token=False)
    t0 = _check_static_t0(fn, t0)
    n, e, dims = _mlp_setup(fn, state, q, context_len, num_blocks, t0, activation, residual)
    if not _is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    kw = dict(
        chunk_size=chunk_size, activation=activation, residual=residual,
        read_before_write=read_before_write, grad_clip=grad_clip,
        per_chunk_gates=per_chunk_gates, remat=remat,
    )  # fmt: skip
    spans = proteus_spans(q.shape[1], t0, n, e)
    if _statically_open(t0, n, e) or not spans:
        return titans_mlp_chunked(state, q, k, v, theta, eta, alpha, **kw)
    L = len(dims) - 1
    st = jax.tree.map(lambda x: x.astype(jnp.float32), state)

    def open_fn(s, xs):
        return titans_mlp_chunked(s, *xs, **kw)

    def span_fn(s, xs, active):
        masks = proteus_titans_mlp_masks(active, dims, e)
        tree = TitansMLPState(masks, masks)
        qs, ks, *rest = xs
        if L == 1:
            rows = masks[0][:, 0]  # [K]
            qs, ks = _zero_where(rows, qs), _zero_where(rows, ks)
        o, cand = titans_mlp_chunked(proteus_gate(s, tree), qs, ks, *rest, **kw)
        return o, proteus_gated_update(s, cand, tree)

    return _run_spans_unrolled(span_fn, open_fn, st, (q, k, v, theta, eta, alpha), spans, e)
