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
- ``segment_ids`` (packed sequences) are not supported by HOLA.

Memory per head of the decoding state: ``K·V + (w + C)(K + V)`` floats plus ``O(w + C)``
scores/positions (SPEC §5), independent of the number of tokens seen.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.associative import gated_delta_chunked

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
_EPS = 1e-6
_F32 = jnp.float32
_INT_MAX = jnp.iinfo(jnp.int32).max


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
        _check_pos_int("init_hola_state", name, x)
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


def _check_pos_int(fn, name, x):
    if not isinstance(x, int) or isinstance(x, bool) or x <= 0:
        raise ValueError(f"{fn}: {name} must be a positive int, got {x!r}")


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


def _residual_chunk_local(kc, vc, gc, bc):
    """State-independent part of the residual pass, batched over chunks.

    ``kc [..., c, K]``, ``vc [..., c, V]``, ``gc, bc [..., c]``. Solves the WY/UT system once per
    chunk for both right-hand sides, ``(I + A) [W | Ũ] = [diag(βγ) K | diag(β) V]``, so the
    sequential pass only needs ``Δ = Ũ − W S_n``. Returns ``(W, Ũ, KKΓ, γ, γ_C/γ, γ_C)``.
    """
    c, Kd = kc.shape[-2], kc.shape[-1]
    G = jnp.cumsum(gc, axis=-1)  # log γ_t, γ_t = Π_{i≤t} α_i inside the chunk
    strict = jnp.arange(c)[None, :] < jnp.arange(c)[:, None]
    # Γ_{ti} = γ_t/γ_i for i < t; masked before exp so no overflow from the upper triangle.
    gam = jnp.exp(jnp.where(strict, G[..., :, None] - G[..., None, :], -jnp.inf))
    kk_gam = jnp.einsum("...tk,...ik->...ti", kc, kc) * gam  # zero on and above the diagonal
    gamma = jnp.exp(G)
    rhs = jnp.concatenate([kc * (bc * gamma)[..., None], vc * bc[..., None]], axis=-1)
    # Forward substitution (stable; SPEC §1), one batched solve for all chunks.
    eye = jnp.eye(c, dtype=kc.dtype)
    Y = lax.linalg.triangular_solve(
        eye + bc[..., :, None] * kk_gam, rhs, left_side=True, lower=True, unit_diagonal=True
    )
    decay_out = jnp.exp(G[..., -1:] - G)  # γ_C/γ_i
    return Y[..., :Kd], Y[..., Kd:], kk_gam, gamma, decay_out, jnp.exp(G[..., -1])


def gdn_residuals(k, v, g, beta, *, initial_state=None, chunk_size=64):
    """Per-token residuals ``e_t = v_t − α_t S_{t-1}ᵀ k_t`` of the gated delta rule (SPEC §1, §5).

    Derivation (per chunk starting from state ``S_n``, ``γ_t = Π_{i≤t} α_i`` inside the chunk): the
    write ``Δ_t = β_t e_t`` satisfies ``S_t = γ_t S_n + Σ_{i≤t} (γ_t/γ_i) k_i Δ_iᵀ``, hence
    ``α_t S_{t-1}ᵀ k_t = γ_t S_nᵀ k_t + Σ_{i<t} (γ_t/γ_i)(k_tᵀ k_i) Δ_i`` and
    ``(I + strict_tril(diag(β) K Kᵀ ⊙ Γ)) Δ = diag(β)(V − diag(γ) K S_n)`` (the WY/UT system, solved
    by forward substitution); then ``E = V − diag(γ) K S_n − strict_tril(K Kᵀ ⊙ Γ) Δ`` (valid for
    β = 0 too) and ``S_{n+1} = γ_C S_n + (K ⊙ γ_C/γ)ᵀ Δ``. Forward only: callers stop gradients.

    Args:
      k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, beta: ``[B, T, H]``.
      initial_state: optional ``[B, H, K, V]`` state ``S_{-1}``.
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
    _check_pos_int(fn, "chunk_size", chunk_size)
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
    Wm, Ut, kk_gam, gamma, decay_out, gamma_c = _residual_chunk_local(
        kc, vc, chunks(g), chunks(beta)
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


def hola_scores(k, v, g, beta, *, eviction="beta_e", initial_state=None, chunk_size=64):
    """Insertion scores of the magnitude evictions (SPEC §5), under ``stop_gradient``.

    ``"beta_e"``: ``β_t‖e_t‖``; ``"e"``: ``‖e_t‖``; ``"beta_v"``: ``β_t‖v_t‖``. (``"recency"`` and
    ``"cumulative_attention"`` are not per-token insertion magnitudes; see the module docstring.)

    Args:
      k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, beta: ``[B, T, H]``.
      initial_state: optional ``[B, H, K, V]`` GDN state before the first token.
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
    e, _ = gdn_residuals(k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size)
    norm = jnp.linalg.norm(e, axis=-1)
    return norm if eviction == "e" else b * norm


# --------------------------------------------------------------------------------------------------
# Cache read and merge (shared by the forward and the decode step)
# --------------------------------------------------------------------------------------------------


def _read_norm(x, gamma, read_norm):
    """``x [B, H, N, D]``, ``gamma [H, D]``."""
    if read_norm == "l2":
        return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _EPS)
    y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + _EPS)
    return y * gamma.astype(_F32)[None, :, None, :]


def _attend(qn, ck_n, cv, c_mask, bk_n, bv, b_mask, sink, cache_scale):
    """Softmax read over ``[cache ‖ block ‖ sink]``.

    ``qn [B,H,Q,K]``; ``ck_n [B,H,w,K]``, ``cv [B,H,w,V]``, ``c_mask [B,H,w]``; ``bk_n [B,H,C,K]``,
    ``bv [B,H,C,V]``, ``b_mask [B,H,Q,C]`` (causal × filled); ``sink [H]``.
    Returns ``(o [B,H,Q,V], p_cache [B,H,Q,w], p_block [B,H,Q,C])``.
    """
    w = ck_n.shape[2]
    lc = jnp.einsum("bhqk,bhjk->bhqj", qn, ck_n) * cache_scale
    lb = jnp.einsum("bhqk,bhjk->bhqj", qn, bk_n) * cache_scale
    lc = jnp.where(c_mask[:, :, None, :], lc, -jnp.inf)
    lb = jnp.where(b_mask, lb, -jnp.inf)
    ls = jnp.broadcast_to(sink.astype(_F32)[None, :, None, None], lc.shape[:3] + (1,))
    # The sink column is always present, so no row is fully masked (no NaN).
    p = jax.nn.softmax(jnp.concatenate([lc, lb, ls], axis=-1), axis=-1)
    pc, pb = p[..., :w], p[..., w:-1]
    o = jnp.einsum("bhqj,bhjv->bhqv", pc, cv) + jnp.einsum("bhqj,bhjv->bhqv", pb, bv)
    return o, pc, pb


def _merge(cache, blk, window, eviction):
    """Top-``window`` of ``cache ∪ block`` (SPEC §5); each is ``(k, v, score, pos, valid)``, entries
    on axis 2.

    Order key: score descending (``recency``: position descending), then position ascending; invalid
    entries last. Selection is not differentiated; the gathers pass gradients to the chosen k, v.
    """
    k, v, s, p, val = (jnp.concatenate([a, b], axis=2) for a, b in zip(cache, blk, strict=True))
    if eviction == "recency":
        primary = jnp.where(val, -p, _INT_MAX)
    else:
        # + 0.0 maps −0.0 to +0.0 so the total-order float sort does not split ties by sign.
        primary = jnp.where(val, -lax.stop_gradient(s) + 0.0, jnp.inf)
    secondary = jnp.where(val, p, _INT_MAX)
    idx = lax.broadcasted_iota(jnp.int32, val.shape, val.ndim - 1)
    _, _, order = lax.sort((primary, secondary, idx), dimension=-1, num_keys=2)
    sel = order[..., :window]
    take = lambda x: jnp.take_along_axis(x, sel, axis=2)  # noqa: E731
    take_d = lambda x: jnp.take_along_axis(x, sel[..., None], axis=2)  # noqa: E731
    nval = take(val)
    return (
        jnp.where(nval[..., None], take_d(k), 0.0),
        jnp.where(nval[..., None], take_d(v), 0.0),
        jnp.where(nval, take(s), 0.0),
        jnp.where(nval, take(p), -1),
        nval,
    )


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
    chunk_size=64,
):
    """HOLA layer math, block-parallel (SPEC §5): ``o_t = S_tᵀ (scale q_t) + σ(λ_h) o_cache,t``.

    The state path is ``gated_delta_chunked``; the cache path is a ``lax.scan`` over blocks of
    ``block_size`` absolute positions carrying the persistent cache (fixed size ``window``). Per
    block every query attends over ``[A_{n-1} ‖ block (causal) ‖ sink]``, then
    ``A_n = top-w(A_{n-1} ∪ block)``. A trailing unfinished block is returned as the state's block
    buffer (not merged), so continuing with ``initial_state`` (another ``hola_forward`` call or
    ``hola_decode_step``) gives the same result as one call over the concatenated sequence.

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
      chunk_size: chunk length of the state path and of the residual pass.

    Returns:
      ``(o [B, T, H, V] in v's dtype, HolaState)``.
    """
    fn = "hola_forward"
    B, T, H, K, V = _validate_seq(fn, q, k, v, g, beta)
    _check_params(fn, H, K, gamma_q, gamma_k, sink_logit, gate_logit)
    _check_pos_int(fn, "window", window)
    _check_pos_int(fn, "block_size", block_size)
    _check_pos_int(fn, "chunk_size", chunk_size)
    _check_options(fn, eviction, read_norm)
    if initial_state is not None:
        _check_state(fn, initial_state, B, H, K, V, window, block_size)
        state0, S0 = initial_state, initial_state.S
    else:
        state0, S0 = init_hola_state(B, H, K, V, window, block_size), None

    o_state, S_T = gated_delta_chunked(
        q, k, v, g, beta, scale=scale, initial_state=S0, chunk_size=chunk_size
    )
    positions = state0.pos + jnp.arange(T, dtype=jnp.int32)
    if eviction in ("beta_e", "e", "beta_v"):
        scores = hola_scores(
            k, v, g, beta, eviction=eviction, initial_state=S0, chunk_size=chunk_size
        )
    elif eviction == "recency":
        scores = jnp.broadcast_to(positions.astype(_F32)[None, :, None], (B, T, H))
    else:  # cumulative attention: accumulated from zero by the block scan
        scores = jnp.zeros((B, T, H), _F32)
    cs = K**-0.5 if cache_scale is None else cache_scale
    o_cache, cache, blk = _cache_blocks(
        q, k, v, scores, gamma_q, gamma_k, sink_logit, state0, initial_state is not None,
        window, block_size, eviction, read_norm, cs,
    )  # fmt: skip
    o = o_state.astype(_F32) + _sigmoid_gate(gate_logit)[None, None, :, None] * o_cache
    new_state = HolaState(S_T, *cache, *blk, pos=state0.pos + T)
    return o.astype(v.dtype), new_state


def _cache_blocks(
    q, k, v, scores, gamma_q, gamma_k, sink, state0, lead, W, C, eviction, read_norm, cs
):
    """Cache path over blocks.

    Returns ``(o_cache [B,T,H,V], cache 5-tuple, (block_k, block_v, block_score))``. Tokens are laid
    on "slots" aligned to absolute block boundaries: slot ``s`` is position ``pos0 − r + s`` with
    ``r = pos0 % C``. With an initial state (``lead``), slots ``[0, r)`` hold its block buffer (keys
    only; their queries were answered earlier) and the new tokens start at slot ``r``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    pos0 = state0.pos
    if lead:
        r = pos0 % C
        n_blocks = -(-(C + T) // C)
    else:
        r = jnp.zeros((), jnp.int32)
        n_blocks = -(-T // C)
    L = n_blocks * C

    def to_slots(x, buf):  # x [B, T, H, ...] -> [B, L, H, ...]; buf [B, H, C, ...] or None
        out = jnp.zeros((B, L) + x.shape[2:], _F32)
        if buf is not None:
            out = out.at[:, :C].set(jnp.moveaxis(buf.astype(_F32), 2, 1))
        start = (jnp.zeros((), jnp.int32), r) + (jnp.zeros((), jnp.int32),) * (x.ndim - 2)
        return lax.dynamic_update_slice(out, x.astype(_F32), start)

    def to_blocks(x):  # [B, L, H, ...] -> [n, B, H, C, ...]
        x = x.reshape((B, n_blocks, C) + x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    buf = (state0.block_k, state0.block_v, state0.block_score) if lead else (None, None, None)
    qs = to_blocks(to_slots(q, None))
    ks = to_blocks(to_slots(k, buf[0]))
    vs = to_blocks(to_slots(v, buf[1]))
    ss = to_blocks(to_slots(lax.stop_gradient(scores), buf[2]))
    slot = jnp.arange(L, dtype=jnp.int32)
    filled = (slot < r + T).reshape(n_blocks, C)
    is_query = ((slot >= r) & (slot < r + T)).reshape(n_blocks, C)
    abs_pos = (pos0 - r + slot).reshape(n_blocks, C)
    causal = jnp.tril(jnp.ones((C, C), bool))
    cumulative = eviction == "cumulative_attention"

    def body(cache, xs):
        qb, kb, vb, sb, fb, iq, pb = xs
        ck, cv, cscore, cpos, cval = cache
        qn = _read_norm(qb, gamma_q, read_norm)
        b_mask = jnp.broadcast_to(causal & fb[None, :], (B, H, C, C))
        o, pc, pb_ = _attend(
            qn, _read_norm(ck, gamma_k, read_norm), cv, cval,
            _read_norm(kb, gamma_k, read_norm), vb, b_mask, sink, cs,
        )  # fmt: skip
        if cumulative:
            # Only this call's queries add mass; buffer tokens already hold earlier queries' mass.
            wq = iq.astype(_F32)[None, None, :, None]
            cscore = cscore + lax.stop_gradient(jnp.sum(pc * wq, axis=2))
            sb = sb + lax.stop_gradient(jnp.sum(pb_ * wq, axis=2))
        pos_b = jnp.broadcast_to(pb, (B, H, C))
        val_b = jnp.broadcast_to(fb, (B, H, C))
        old = (ck, cv, cscore, cpos, cval)
        merged = _merge(old, (kb, vb, sb, pos_b, val_b), W, eviction)
        complete = fb[-1]  # a block is merged only once all of its C positions have been seen
        new = tuple(jnp.where(complete, m, o_) for m, o_ in zip(merged, old, strict=True))
        return new, (o, sb)

    cache0 = (
        state0.cache_k.astype(_F32),
        state0.cache_v.astype(_F32),
        state0.cache_score.astype(_F32),
        state0.cache_pos,
        state0.cache_valid,
    )
    cache, (o_blocks, s_blocks) = lax.scan(
        body, cache0, (qs, ks, vs, ss, filled, is_query, abs_pos)
    )
    # [n, B, H, C, V] -> [B, L, H, V] -> the T query slots.
    o = jnp.moveaxis(o_blocks, 0, 1).transpose(0, 1, 3, 2, 4).reshape(B, L, H, V)
    o = lax.dynamic_slice_in_dim(o, r, T, axis=1)
    # The unfinished last block becomes the buffer (empty when r + T is a multiple of C).
    end = r + T
    last = jnp.minimum(end // C, n_blocks - 1)
    n_fill = end % C
    keep = jnp.arange(C) < n_fill
    bk = jnp.where(keep[None, None, :, None], ks[last], 0.0)
    bv = jnp.where(keep[None, None, :, None], vs[last], 0.0)
    bs = jnp.where(keep[None, None, :], s_blocks[last], 0.0)
    return o, cache, (bk, bv, bs)


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

    qn = _read_norm(q[:, :, None, :], gamma_q, read_norm)
    o_cache, pc, pb = _attend(
        qn, _read_norm(state.cache_k.astype(_F32), gamma_k, read_norm), state.cache_v.astype(_F32),
        state.cache_valid, _read_norm(bk, gamma_k, read_norm), bv,
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
        merged = _merge(cache, (bk, bv, bs, pos_b, val_b), W, eviction)
        return merged, jnp.zeros_like(bk), jnp.zeros_like(bv), jnp.zeros_like(bs)

    def keep(operands):
        return operands

    cache, bk, bv, bs = lax.cond(pos_new % C == 0, merge_and_clear, keep, (cache, bk, bv, bs))
    new_state = HolaState(S, *cache, bk, bv, bs, pos_new)
    return o.astype(v_t.dtype), new_state
