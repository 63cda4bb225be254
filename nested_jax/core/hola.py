"""HOLA: gated delta state plus a persistent exact KV cache chosen by write magnitude (SPEC §5).

Per layer and head (column vectors, ``α_t = exp(g_t)``, ``d = K``)::

    e_t = v_t − α_t S_{t-1}ᵀ k_t ;  S_t = α_t S_{t-1} + β_t k_t e_tᵀ
    m_t = β_t ‖e_t‖₂                                          (score fixed at insertion)
    A_n = top-w by m over (A_{n-1} ∪ tokens of block n)     ties → earlier position
    V_t = A_{n-1} ∪ {tokens of block n at positions ≤ t} ∪ {null sink}
    q̃ = N_q(q), k̃ = N_k(k)                                   cache path only
    o_cache,t = Σ_{j∈V_t} softmax_j(cache_scale · q̃_tᵀ k̃_j) v_j   (sink: logit s_h, value 0)
    o_t = S_tᵀ (scale · q_t) + σ(λ_h) · o_cache,t

Blocks are ``C = block_size`` consecutive absolute positions ``[nC, (n+1)C)``; position 0 is the
first token ever given to the state (streaming calls and decoding continue the count). ``A_n`` holds
at most ``w = window`` entries; a query in block ``n`` sees ``A_{n-1}`` (only earlier blocks, so
never a later position), the causal prefix of its own block and the sink.

Decisions (documented options, SPEC §5):

- ``read_norm="rmsnorm"`` (default): ``N_q(x) = γ_q ⊙ x / sqrt(mean(x²) + 1e-6)``, the same with
  ``γ_k`` for keys (separate learnable ``[H, K]`` scales). ``read_norm="l2"``: the "flat" unit-L2
  read of the paper's ablation, ``N(x) = x / sqrt(‖x‖² + 1e-6)``; ``γ_q, γ_k`` are then unused
  (zero gradient).
- ``cache_scale`` defaults to ``K ** -0.5`` (the ``1/√d`` of SPEC §5, temperature τ = 1); ``scale``
  (state path) defaults to ``K ** -0.5`` too, as in SPEC §0.
- The cache stores the raw ``k, v`` of a token; normalisation is applied at every read, so the cache
  is independent of ``γ`` and gradients reach ``γ_k`` from every read.
- Eviction scores (all under ``stop_gradient``: selection is not differentiated; gradients reach the
  selected entries' ``k, v`` through the gather):
  ``"beta_e"`` ``m_t = β_t‖e_t‖``; ``"e"`` ``‖e_t‖``; ``"beta_v"`` ``β_t‖v_t‖``; ``"recency"``
  keeps the ``w`` latest positions (stored score = position, for inspection);
  ``"cumulative_attention"`` (H2O-style) scores an entry by the total cache-read attention
  probability it has received so far, summed over every query that saw it (its own position
  included, sink in the normaliser): it starts at 0 on insertion, grows while the token is in the
  current block or in the cache, and the merge at the end of block ``n`` ranks ``A_{n-1} ∪ block n``
  by the masses accumulated up to the end of block ``n``. Old entries have had more queries, so
  this score favours them (as H2O does).
- Ties in the merge go to the earlier position; invalid (empty) slots are never selected before
  valid ones. Cache entries are stored in selection order (score descending, then position
  ascending), so the block-parallel forward and token-by-token decoding give the same state layout.
- The per-token residuals ``e_t`` for the scores are recomputed by a forward-only WY/UT chunk pass
  (``gdn_residuals``; derivation in its docstring) under ``stop_gradient``; the differentiable state
  path is ``associative.gated_delta_chunked``. This costs one extra forward of the state path and no
  backward. ``"recency"``, ``"beta_v"`` and ``"cumulative_attention"`` skip that pass.
- ``segment_ids`` (packed sequences, SPEC §0): each document runs as if alone — own GDN state
  and scores from zero, own block grid from its first token, own cache (starts empty, top-w over its
  own tokens only), reads masked to its own document (the sink stays visible). Equations in
  ``hola_forward``; the scan is ``hola_cache.cache_blocks_packed``. Not with ``initial_state``;
  decoding (``hola_decode_step``) is one stream and takes no segment ids.

Memory per head of the decoding state: ``K·V + (w + C)(K + V)`` floats plus ``O(w + C)``
scores/positions (SPEC §5), independent of the number of tokens seen.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.associative import gated_delta_chunked
from nested_jax.core.checks import check_positive_int
from nested_jax.core.hola_cache import (
    attend,
    cache_blocks,
    cache_blocks_packed,
    doc_starts,
    merge_top_w,
    read_normalize,
)

__all__ = [
    "EVICTIONS",
    "READ_NORMS",
    "HolaState",
    "init_hola_state",
    "gdn_residuals",
    "hola_scores",
    "hola_forward",
    "hola_decode_step",
]

EVICTIONS = ("beta_e", "recency", "e", "beta_v", "cumulative_attention")
READ_NORMS = ("rmsnorm", "l2")
_F32 = jnp.float32


class HolaState(NamedTuple):
    """Decoding / streaming state of one HOLA layer (SPEC §5). Size independent of tokens seen.

    Attributes:
      S: ``[B, H, K, V]`` f32 gated delta state.
      cache_k, cache_v: ``[B, H, w, K]``, ``[B, H, w, V]`` raw keys/values of the persistent cache.
      cache_score: ``[B, H, w]`` f32 eviction score of each entry.
      cache_pos: ``[B, H, w]`` int32 absolute position of each entry (−1 when empty).
      cache_valid: ``[B, H, w]`` bool, which slots hold a token. Empty slots are zero.
      block_k, block_v: ``[B, H, C, K]``, ``[B, H, C, V]`` tokens of the current (unfinished)
        block; slot ``i`` holds absolute position ``pos − pos % C + i``, filled iff ``i < pos % C``.
      block_score: ``[B, H, C]`` f32 eviction scores of the current block's tokens.
      pos: ``[]`` int32, number of tokens consumed so far (shared by the batch).
    """

    S: jax.Array
    cache_k: jax.Array
    cache_v: jax.Array
    cache_score: jax.Array
    cache_pos: jax.Array
    cache_valid: jax.Array
    block_k: jax.Array
    block_v: jax.Array
    block_score: jax.Array
    pos: jax.Array


def init_hola_state(batch, heads, key_dim, value_dim, window, block_size) -> HolaState:
    """Empty HOLA state: zero GDN state, empty cache and block buffer, position 0 (SPEC §5).

    Args:
      batch, heads, key_dim, value_dim: ``B, H, K, V``.
      window: cache capacity ``w``; block_size: block length ``C``.

    Returns:
      ``HolaState`` with the shapes listed on the class.
    """
    for name, x in (
        ("batch", batch),
        ("heads", heads),
        ("key_dim", key_dim),
        ("value_dim", value_dim),
        ("window", window),
        ("block_size", block_size),
    ):
        check_positive_int(f"init_hola_state: {name}", x)
    B, H, K, V, W, C = batch, heads, key_dim, value_dim, window, block_size
    return HolaState(
        S=jnp.zeros((B, H, K, V), _F32),
        cache_k=jnp.zeros((B, H, W, K), _F32),
        cache_v=jnp.zeros((B, H, W, V), _F32),
        cache_score=jnp.zeros((B, H, W), _F32),
        cache_pos=jnp.full((B, H, W), -1, jnp.int32),
        cache_valid=jnp.zeros((B, H, W), bool),
        block_k=jnp.zeros((B, H, C, K), _F32),
        block_v=jnp.zeros((B, H, C, V), _F32),
        block_score=jnp.zeros((B, H, C), _F32),
        pos=jnp.zeros((), jnp.int32),
    )


# --------------------------------------------------------------------------------------------------
# Validation (trace time)
# --------------------------------------------------------------------------------------------------


def _check_array(fn, name, x, shape, floating=True):
    got = getattr(x, "shape", None)
    if got is None or tuple(got) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {list(shape)}, got shape {got}")
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{fn}: {name} must have a floating dtype, got {x.dtype}")


def _check_options(fn, eviction, read_norm):
    if eviction not in EVICTIONS:
        raise ValueError(f"{fn}: eviction must be one of {EVICTIONS}, got {eviction!r}")
    if read_norm not in READ_NORMS:
        raise ValueError(f"{fn}: read_norm must be one of {READ_NORMS}, got {read_norm!r}")


def _check_params(fn, H, K, gamma_q, gamma_k, sink_logit, gate_logit):
    _check_array(fn, "gamma_q", gamma_q, (H, K))
    _check_array(fn, "gamma_k", gamma_k, (H, K))
    _check_array(fn, "sink_logit", sink_logit, (H,))
    _check_array(fn, "gate_logit", gate_logit, (H,))


def _check_state(fn, state, B, H, K, V, W, C):
    if not isinstance(state, HolaState):
        raise ValueError(
            f"{fn}: state must be a HolaState (see init_hola_state), got {type(state)}"
        )
    for name, shape in _state_shapes(B, H, K, V, W, C).items():
        _check_array(fn, f"state.{name}", getattr(state, name), shape, floating=False)


def _state_shapes(B, H, K, V, W, C):
    return {
        "S": (B, H, K, V),
        "cache_k": (B, H, W, K),
        "cache_v": (B, H, W, V),
        "cache_score": (B, H, W),
        "cache_pos": (B, H, W),
        "cache_valid": (B, H, W),
        "block_k": (B, H, C, K),
        "block_v": (B, H, C, V),
        "block_score": (B, H, C),
        "pos": (),
    }


def _check_segments(fn, segment_ids, B, T, initial_state):
    if segment_ids is None:
        return
    shape = getattr(segment_ids, "shape", None)
    if shape is None or tuple(shape) != (B, T):
        raise ValueError(f"{fn}: segment_ids must have shape [B, T] = [{B}, {T}], got {shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"{fn}: segment_ids must have an integer dtype, got {segment_ids.dtype}")
    if initial_state is not None:
        raise ValueError(
            f"{fn}: segment_ids cannot be combined with initial_state (every packed document "
            "starts from an empty state)"
        )


def _validate_seq(fn, q, k, v, g, beta):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{fn}: {name} must have shape [B, T, H, D] (rank 4), got shape "
                f"{getattr(x, 'shape', None)}"
            )
    B, T, H, K = q.shape
    _check_array(fn, "q", q, (B, T, H, K))
    _check_array(fn, "k", k, (B, T, H, K))
    V = v.shape[3]
    _check_array(fn, "v", v, (B, T, H, V))
    _check_array(fn, "g", g, (B, T, H))
    _check_array(fn, "beta", beta, (B, T, H))
    return B, T, H, K, V


# --------------------------------------------------------------------------------------------------
# Scores: e_t from a forward-only WY/UT chunk pass
# --------------------------------------------------------------------------------------------------


def _residual_chunk_local(kc, vc, gc, bc, zc=None):
    """State-independent part of the residual pass, batched over chunks.

    ``kc [..., c, K]``, ``vc [..., c, V]``, ``gc, bc [..., c]``. Solves the WY/UT system once per
    chunk for both right-hand sides, ``(I + A) [W | Ũ] = [diag(βγ) K | diag(β) V]``, so the
    sequential pass only needs ``Δ = Ũ − W S_n``. Returns ``(W, Ũ, KKΓ, γ, γ_C/γ, γ_C)``.

    ``zc [..., c]`` (optional, int): number of segment starts in the chunk up to and including each
    token. Then ``Γ_{ti} = 0`` across segments, ``γ_t = 0`` after a start (the state restarts from
    zero) and ``γ_C/γ_i = 0``, ``γ_C = 0`` outside the chunk's last segment.
    """
    c, Kd = kc.shape[-2], kc.shape[-1]
    G = jnp.cumsum(gc, axis=-1)  # log γ_t, γ_t = Π_{i≤t} α_i inside the chunk
    strict = jnp.arange(c)[None, :] < jnp.arange(c)[:, None]
    if zc is not None:
        strict = strict & (zc[..., :, None] == zc[..., None, :])
    # Γ_{ti} = γ_t/γ_i for i < t; masked before exp so no overflow from the upper triangle.
    gam = jnp.exp(jnp.where(strict, G[..., :, None] - G[..., None, :], -jnp.inf))
    kk_gam = jnp.einsum("...tk,...ik->...ti", kc, kc) * gam  # zero on and above the diagonal
    gamma = jnp.exp(G) if zc is None else jnp.where(zc == 0, jnp.exp(G), 0.0)
    rhs = jnp.concatenate([kc * (bc * gamma)[..., None], vc * bc[..., None]], axis=-1)
    # Forward substitution (stable; SPEC §1), one batched solve for all chunks.
    eye = jnp.eye(c, dtype=kc.dtype)
    Y = lax.linalg.triangular_solve(
        eye + bc[..., :, None] * kk_gam, rhs, left_side=True, lower=True, unit_diagonal=True
    )
    decay_out = jnp.exp(G[..., -1:] - G)  # γ_C/γ_i
    gamma_c = jnp.exp(G[..., -1])
    if zc is not None:
        decay_out = jnp.where(zc == zc[..., -1:], decay_out, 0.0)
        gamma_c = jnp.where(zc[..., -1] == 0, gamma_c, 0.0)
    return Y[..., :Kd], Y[..., Kd:], kk_gam, gamma, decay_out, gamma_c


def gdn_residuals(k, v, g, beta, *, initial_state=None, segment_ids=None, chunk_size=64):
    """Per-token residuals ``e_t = v_t − α_t S_{t-1}ᵀ k_t`` of the gated delta rule (SPEC §1, §5).

    Derivation (per chunk starting from state ``S_n``, ``γ_t = Π_{i≤t} α_i`` inside the chunk): the
    write ``Δ_t = β_t e_t`` satisfies ``S_t = γ_t S_n + Σ_{i≤t} (γ_t/γ_i) k_i Δ_iᵀ``, hence
    ``α_t S_{t-1}ᵀ k_t = γ_t S_nᵀ k_t + Σ_{i<t} (γ_t/γ_i)(k_tᵀ k_i) Δ_i`` and
    ``(I + strict_tril(diag(β) K Kᵀ ⊙ Γ)) Δ = diag(β)(V − diag(γ) K S_n)`` (the WY/UT system, solved
    by forward substitution); then ``E = V − diag(γ) K S_n − strict_tril(K Kᵀ ⊙ Γ) Δ`` (valid for
    β = 0 too) and ``S_{n+1} = γ_C S_n + (K ⊙ γ_C/γ)ᵀ Δ``. Forward only: callers stop gradients.
    With ``segment_ids`` (SPEC §0 packed sequences) the state restarts from zero at every segment
    start ``t₀`` (``S_{t₀-1} := 0``, so ``e_{t₀} = v_{t₀}``): the terms that cross a start are
    masked out of ``Γ``, ``γ`` and ``γ_C`` (exact, no large negative decay).

    Args:
      k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, beta: ``[B, T, H]``.
      initial_state: optional ``[B, H, K, V]`` state ``S_{-1}`` (not with ``segment_ids``).
      segment_ids: optional ``int [B, T]``; a segment starts where the id changes.
      chunk_size: chunk length.

    Returns:
      ``(e [B, T, H, V] f32, S_T [B, H, K, V] f32)``.
    """
    fn = "gdn_residuals"
    if getattr(k, "ndim", None) != 4:
        raise ValueError(f"{fn}: k must have shape [B, T, H, K], got {getattr(k, 'shape', None)}")
    B, T, H, K = k.shape
    if getattr(v, "ndim", None) != 4:
        raise ValueError(f"{fn}: v must have shape [B, T, H, V], got {getattr(v, 'shape', None)}")
    V = v.shape[3]
    _check_array(fn, "v", v, (B, T, H, V))
    _check_array(fn, "g", g, (B, T, H))
    _check_array(fn, "beta", beta, (B, T, H))
    check_positive_int(f"{fn}: chunk_size", chunk_size)
    _check_segments(fn, segment_ids, B, T, initial_state)
    if initial_state is None:
        S0 = jnp.zeros((B, H, K, V), _F32)
    else:
        _check_array(fn, "initial_state", initial_state, (B, H, K, V))
        S0 = initial_state.astype(_F32)
    c = chunk_size
    n = -(-T // c)
    pad = n * c - T

    def chunks(x):  # [B, T, H, ...] -> [n, B, H, c, ...]; padding has β = 0, g = 0 (no-op write)
        x = jnp.pad(x.astype(_F32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((B, n, c) + x.shape[2:])
        perm = (1, 0, 3, 2) + tuple(range(4, x.ndim))
        return jnp.transpose(x, perm)

    kc, vc = chunks(k), chunks(v)
    zc = None
    if segment_ids is not None:  # starts counted inside each chunk (padding continues the last)
        starts = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, pad)))
        zc = jnp.cumsum(starts.reshape(B, n, c).astype(jnp.int32), axis=-1)
        zc = jnp.broadcast_to(jnp.moveaxis(zc, 1, 0)[:, :, None], (n, B, H, c))
    Wm, Ut, kk_gam, gamma, decay_out, gamma_c = _residual_chunk_local(
        kc, vc, chunks(g), chunks(beta), zc
    )

    def body(S, xs):  # only the S-dependent matmuls are sequential
        Wn, Un, kkn, gn, dn, gcn, kn, vn = xs
        delta = Un - Wn @ S  # Δ = β ⊙ e
        e = vn - gn[..., None] * (kn @ S) - kkn @ delta
        S_new = gcn[..., None, None] * S + jnp.swapaxes(kn * dn[..., None], -1, -2) @ delta
        return S_new, e

    S_T, e = lax.scan(body, S0, (Wm, Ut, kk_gam, gamma, decay_out, gamma_c, kc, vc))
    e = jnp.transpose(e, (1, 0, 3, 2, 4)).reshape(B, n * c, H, V)[:, :T]
    return e, S_T


def hola_scores(
    k, v, g, beta, *, eviction="beta_e", initial_state=None, segment_ids=None, chunk_size=64
):
    """Insertion scores of the magnitude evictions (SPEC §5), under ``stop_gradient``.

    ``"beta_e"``: ``β_t‖e_t‖``; ``"e"``: ``‖e_t‖``; ``"beta_v"``: ``β_t‖v_t‖``. (``"recency"`` and
    ``"cumulative_attention"`` are not per-token insertion magnitudes; see the module docstring.)

    Args:
      k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, beta: ``[B, T, H]``.
      initial_state: optional ``[B, H, K, V]`` GDN state before the first token.
      segment_ids: optional ``int [B, T]``: ``e_t`` restarts from a zero state at every segment
        start (as in ``gdn_residuals``).
      chunk_size: chunk length of the residual pass.

    Returns:
      ``[B, T, H]`` f32 scores.
    """
    if eviction not in ("beta_e", "e", "beta_v"):
        raise ValueError(
            f"hola_scores: eviction must be 'beta_e', 'e' or 'beta_v', got {eviction!r}"
        )
    k, v, g, beta = (lax.stop_gradient(x) for x in (k, v, g, beta))
    if initial_state is not None:
        initial_state = lax.stop_gradient(initial_state)
    b = beta.astype(_F32)
    if eviction == "beta_v":
        return b * jnp.linalg.norm(v.astype(_F32), axis=-1)
    e, _ = gdn_residuals(
        k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size
    )
    norm = jnp.linalg.norm(e, axis=-1)
    return norm if eviction == "e" else b * norm


def _sigmoid_gate(gate_logit):
    return jax.nn.sigmoid(gate_logit.astype(_F32))


# --------------------------------------------------------------------------------------------------
# Block-parallel forward
# --------------------------------------------------------------------------------------------------


def hola_forward(
    q,
    k,
    v,
    g,
    beta,
    gamma_q,
    gamma_k,
    sink_logit,
    gate_logit,
    *,
    window=64,
    block_size=256,
    eviction="beta_e",
    read_norm="rmsnorm",
    scale=None,
    cache_scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size=64,
):
    """HOLA layer math, block-parallel (SPEC §5): ``o_t = S_tᵀ (scale q_t) + σ(λ_h) o_cache,t``.

    The state path is ``gated_delta_chunked``; the cache path is a ``lax.scan`` over blocks of
    ``block_size`` absolute positions carrying the persistent cache (fixed size ``window``). Per
    block every query attends over ``[A_{n-1} ‖ block (causal) ‖ sink]``, then
    ``A_n = top-w(A_{n-1} ∪ block)``. A trailing unfinished block is returned as the state's block
    buffer (not merged), so continuing with ``initial_state`` (another ``hola_forward`` call or
    ``hola_decode_step``) gives the same result as one call over the concatenated sequence.

    Packed rows (``segment_ids``, SPEC §0): every document is run as if alone — the gated delta
    state and the scores ``e_t`` restart from zero at its start, its blocks are counted from its
    own first token (document position ``p_t = t − D_t``, block ``⌊p_t/C⌋``), its cache starts
    empty and holds only its own tokens (top-w over its own earlier blocks), and a query reads only
    cache entries and block tokens of its own document (plus the sink)::

        V_t = A_{d(t)}(⌊p_t/C⌋ − 1) ∪ {j : D_j = D_t, ⌊p_j/C⌋ = ⌊p_t/C⌋, j ≤ t} ∪ {sink}

    so outputs and gradients equal those of each document alone (tested). See
    ``hola_cache.cache_blocks_packed`` for the scan. ``recency`` scores and ``cache_pos`` are
    document positions.

    Args:
      q, k: ``[B, T, H, K]`` (the state path expects unit-norm q, k as in GDN layers).
      v: ``[B, T, H, V]``.
      g: ``[B, T, H]`` log decay; beta: ``[B, T, H]`` in ``[0, 1]``.
      gamma_q, gamma_k: ``[H, K]`` read-norm scales of the cache path (unused for "l2").
      sink_logit: ``[H]`` per-head sink logit (the sink's value is zero).
      gate_logit: ``[H]`` per-head gate ``λ_h``; the cache read is scaled by ``σ(λ_h)``.
      window: cache capacity ``w``; block_size: block length ``C``.
      eviction: one of ``EVICTIONS``; read_norm: one of ``READ_NORMS``.
      scale: state-path query scale, default ``K ** -0.5``; cache_scale: cache logit scale, default
        ``K ** -0.5``.
      initial_state: optional ``HolaState`` with the same ``B, H, K, V, window, block_size``.
      segment_ids: optional ``int [B, T]`` packed-document ids (a document starts where the id
        changes); not together with ``initial_state``.
      chunk_size: chunk length of the state path and of the residual pass.

    Returns:
      ``(o [B, T, H, V] in v's dtype, HolaState)``. With ``segment_ids`` the state is that of each
      row's last document run alone; its ``pos`` (shared by the batch) is row 0's last-document
      length, so it continues every row exactly only when those lengths agree (e.g. ``B = 1``).
    """
    fn = "hola_forward"
    B, T, H, K, V = _validate_seq(fn, q, k, v, g, beta)
    _check_params(fn, H, K, gamma_q, gamma_k, sink_logit, gate_logit)
    check_positive_int(f"{fn}: window", window)
    check_positive_int(f"{fn}: block_size", block_size)
    check_positive_int(f"{fn}: chunk_size", chunk_size)
    _check_options(fn, eviction, read_norm)
    _check_segments(fn, segment_ids, B, T, initial_state)
    if initial_state is not None:
        _check_state(fn, initial_state, B, H, K, V, window, block_size)
        state0, S0 = initial_state, initial_state.S
    else:
        state0, S0 = init_hola_state(B, H, K, V, window, block_size), None

    o_state, S_T = gated_delta_chunked(
        q, k, v, g, beta, scale=scale, initial_state=S0, segment_ids=segment_ids,
        chunk_size=chunk_size,
    )  # fmt: skip
    if segment_ids is None:
        positions = jnp.broadcast_to(state0.pos + jnp.arange(T, dtype=jnp.int32), (B, T))
    else:
        doc, positions = doc_starts(segment_ids)
    scores = _insertion_scores(k, v, g, beta, positions, S0, segment_ids, eviction, chunk_size)
    cs = K**-0.5 if cache_scale is None else cache_scale
    params = (gamma_q, gamma_k, sink_logit)
    if segment_ids is None:
        o_cache, cache, blk = cache_blocks(
            q, k, v, scores, *params, state0, initial_state is not None,
            window, block_size, eviction, read_norm, cs,
        )  # fmt: skip
        pos = state0.pos + T
    else:
        o_cache, cache, blk, pos = cache_blocks_packed(
            q, k, v, scores, doc, positions, *params, window, block_size, eviction, read_norm, cs
        )
    o = o_state.astype(_F32) + _sigmoid_gate(gate_logit)[None, None, :, None] * o_cache
    return o.astype(v.dtype), HolaState(S_T, *cache, *blk, pos=pos)


def _insertion_scores(k, v, g, beta, positions, S0, segment_ids, eviction, chunk_size):
    """``[B, T, H]`` f32 insertion scores (SPEC §5): the magnitudes of ``hola_scores``, the
    (document) position for ``recency``, zeros for ``cumulative_attention`` (accumulated by the
    block scan)."""
    B, T, H = g.shape
    if eviction in ("beta_e", "e", "beta_v"):
        return hola_scores(
            k, v, g, beta, eviction=eviction, initial_state=S0, segment_ids=segment_ids,
            chunk_size=chunk_size,
        )  # fmt: skip
    if eviction == "recency":
        return jnp.broadcast_to(positions.astype(_F32)[:, :, None], (B, T, H))
    return jnp.zeros((B, T, H), _F32)


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


def hola_decode_step(
    state,
    q_t,
    k_t,
    v_t,
    g_t,
    beta_t,
    gamma_q,
    gamma_k,
    sink_logit,
    gate_logit,
    *,
    eviction="beta_e",
    read_norm="rmsnorm",
    scale=None,
    cache_scale=None,
):
    """One token of HOLA (SPEC §5): equals ``hola_forward`` token by token.

    The token is written to the block buffer slot ``pos % C`` with its fixed score, the cache read
    sees ``A_{n-1}`` ∪ the filled buffer ∪ sink, and when the buffer completes a block it is merged
    into the cache (``top-w``) and cleared. ``window`` and ``block_size`` come from the state's
    shapes.

    Args:
      state: ``HolaState``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; g_t, beta_t: ``[B, H]``.
      gamma_q, gamma_k, sink_logit, gate_logit, eviction, read_norm, scale, cache_scale: as in
        ``hola_forward``.

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, new HolaState)`` with the same shapes as ``state``.
    """
    fn = "hola_decode_step"
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(
                f"{fn}: {name} must have shape [B, H, D], got {getattr(x, 'shape', None)}"
            )
    B, H, K = q_t.shape
    V = v_t.shape[-1]
    _check_array(fn, "q_t", q_t, (B, H, K))
    _check_array(fn, "k_t", k_t, (B, H, K))
    _check_array(fn, "v_t", v_t, (B, H, V))
    _check_array(fn, "g_t", g_t, (B, H))
    _check_array(fn, "beta_t", beta_t, (B, H))
    _check_params(fn, H, K, gamma_q, gamma_k, sink_logit, gate_logit)
    _check_options(fn, eviction, read_norm)
    if not isinstance(state, HolaState):
        raise ValueError(f"{fn}: state must be a HolaState, got {type(state)}")
    W, C = state.cache_k.shape[2], state.block_k.shape[2]
    _check_state(fn, state, B, H, K, V, W, C)
    sc = K**-0.5 if scale is None else scale
    cs = K**-0.5 if cache_scale is None else cache_scale

    q, k, v = (x.astype(_F32) for x in (q_t, k_t, v_t))
    g, b = g_t.astype(_F32), beta_t.astype(_F32)
    # State path, keeping e_t for the score (SPEC §1 GDN, decay first).
    S = jnp.exp(g)[..., None, None] * state.S.astype(_F32)
    e = v - jnp.einsum("bhk,bhkv->bhv", k, S)
    S = S + b[..., None, None] * k[..., :, None] * e[..., None, :]
    o_state = jnp.einsum("bhk,bhkv->bhv", q * sc, S)

    r = state.pos % C
    if eviction == "beta_e":
        score = b * jnp.linalg.norm(e, axis=-1)
    elif eviction == "e":
        score = jnp.linalg.norm(e, axis=-1)
    elif eviction == "beta_v":
        score = b * jnp.linalg.norm(v, axis=-1)
    elif eviction == "recency":
        score = jnp.broadcast_to(state.pos.astype(_F32), (B, H))
    else:
        score = jnp.zeros((B, H), _F32)
    score = lax.stop_gradient(score)
    at_r = jnp.arange(C) == r
    bk = jnp.where(at_r[None, None, :, None], k[:, :, None, :], state.block_k.astype(_F32))
    bv = jnp.where(at_r[None, None, :, None], v[:, :, None, :], state.block_v.astype(_F32))
    bs = jnp.where(at_r[None, None, :], score[:, :, None], state.block_score.astype(_F32))
    filled = jnp.arange(C) <= r

    qn = read_normalize(q[:, :, None, :], gamma_q, read_norm)
    ck_n = read_normalize(state.cache_k.astype(_F32), gamma_k, read_norm)
    o_cache, pc, pb = attend(
        qn, ck_n, state.cache_v.astype(_F32),
        state.cache_valid, read_normalize(bk, gamma_k, read_norm), bv,
        jnp.broadcast_to(filled, (B, H, 1, C)), sink_logit, cs,
    )  # fmt: skip
    cscore = state.cache_score.astype(_F32)
    if eviction == "cumulative_attention":
        cscore = cscore + lax.stop_gradient(pc[:, :, 0])
        bs = bs + lax.stop_gradient(pb[:, :, 0])
    o = o_state + _sigmoid_gate(gate_logit)[None, :, None] * o_cache[:, :, 0]

    cache = (
        state.cache_k.astype(_F32),
        state.cache_v.astype(_F32),
        cscore,
        state.cache_pos,
        state.cache_valid,
    )
    pos_new = state.pos + 1

    def merge_and_clear(operands):
        cache, bk, bv, bs = operands
        pos_b = jnp.broadcast_to(state.pos - r + jnp.arange(C, dtype=jnp.int32), (B, H, C))
        val_b = jnp.ones((B, H, C), bool)
        merged = merge_top_w(cache, (bk, bv, bs, pos_b, val_b), W, eviction)
        return merged, jnp.zeros_like(bk), jnp.zeros_like(bv), jnp.zeros_like(bs)

    def keep(operands):
        return operands

    cache, bk, bv, bs = lax.cond(pos_new % C == 0, merge_and_clear, keep, (cache, bk, bv, bs))
    new_state = HolaState(S, *cache, bk, bv, bs, pos_new)
    return o.astype(v_t.dtype), new_state
