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
- The scores read the state path's residuals ``e_t`` under ``stop_gradient``. With the default
  state path (``associative.gated_delta_chunked``) and ``"beta_e"``, they are the norms of its
  own writes ``Δ_t = β_t e_t`` (``associative.gated_delta_chunked_writes``: one pass over the
  chunks gives the output, the state and the writes). Otherwise (``"e"``, or another
  ``HolaKernels.state_path``: ``ops.hola`` passes the Pallas kernel for ``impl="pallas"``)
  ``e_t`` is recomputed by a forward-only WY/UT chunk pass (``gdn_residuals``; derivation in its
  docstring), one extra forward of the state path and no backward. ``"recency"``, ``"beta_v"``
  and ``"cumulative_attention"`` need no residuals.
- ``segment_ids`` (packed sequences, SPEC §0): each document runs as if alone — own GDN state
  and scores from zero, own block grid from its first token, own cache (starts empty, top-w over its
  own tokens only), reads masked to its own document (the sink stays visible). Equations in
  hola/README.md §5; the scan is ``hola.packed.cache_blocks_packed``. Not with ``initial_state``;
  decoding (``hola_decode_step``) is one stream and takes no segment ids.

Memory per head of the decoding state: ``K·V + (w + C)(K + V)`` floats plus ``O(w + C)``
scores/positions (SPEC §5), independent of the number of tokens seen.

The static options come as one ``HolaRule`` (``rule=``; ``window`` w, ``block_size`` C,
``eviction``, ``read_norm``, ``scale``, ``cache_scale``) and the learnable per-head arrays as one
``HolaReadParams`` (``γ_q, γ_k, s_h, λ_h``). ``chunk_size`` (the WY/UT chunk of the state path
and of the residual pass) is a plain keyword: it changes speed and memory, not values (up to
rounding).

Modules: this one holds the block-parallel form (``hola_forward``), the forward-only residual pass
(``gdn_residuals``) and the insertion scores (``hola_scores``); ``hola.decode`` holds the state and
parameter types (``HolaState``, ``HolaReadParams``, ``init_hola_state``), the per-token forms
(``hola_decode_step``, ``hola_recurrent``) and the shared argument checks; ``hola.cache`` the
top-w cache read and merge, ``hola.stream`` and ``hola.packed`` the block scans.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from nested_jax.core import wy
from nested_jax.core.associative.forms import gated_delta_chunked, gated_delta_chunked_writes
from nested_jax.core.checks import check_positive_int
from nested_jax.core.hola.cache import read_blocks
from nested_jax.core.hola.decode import (
    _F32,
    HolaState,
    _check_array,
    _check_params,
    _check_rule,
    _check_segments,
    _check_state,
    _sigmoid_gate,
    _validate_seq,
    init_hola_state,
)
from nested_jax.core.hola.packed import cache_blocks_packed, doc_starts
from nested_jax.core.hola.stream import cache_blocks
from nested_jax.core.scan import (
    cast_like,
    chunk,
    from_head_chunks,
    pad_to_multiple,
    segment_starts,
    state_zeros,
    to_head_chunks,
)
from nested_jax.rules import HolaRule

__all__ = [
    "gdn_residuals",
    "hola_scores",
    "HolaKernels",
    "hola_forward",
]

# HolaState fields with [B, H, ...] rows (all but the shared position)
_ROWS = tuple(f for f in HolaState._fields if f != "pos")


# --------------------------------------------------------------------------------------------------
# Scores: e_t from a forward-only WY/UT chunk pass
# --------------------------------------------------------------------------------------------------


def _residual_decays(gc, zc=None):
    """Decays of the residual pass from the chunked log decays ``gc [..., c]``.

    Returns ``(Γ, γ, γ_C/γ, γ_C)``: ``Γ [..., c, c]`` with ``Γ_{ti} = γ_t/γ_i`` for ``i < t`` (zero
    on and above the diagonal), ``γ_t = Π_{i≤t} α_i`` inside the chunk, ``[..., c]``, and
    ``γ_C [...]``. ``zc [..., c]`` (optional, int): number of segment starts in the chunk up to and
    including each token. Then ``Γ_{ti} = 0`` across segments, ``γ_t = 0`` after a start (the state
    restarts from zero) and ``γ_C/γ_i = 0``, ``γ_C = 0`` outside the chunk's last segment.
    """
    c = gc.shape[-1]
    G = jnp.cumsum(gc, axis=-1)  # log γ_t
    strict = jnp.arange(c)[None, :] < jnp.arange(c)[:, None]
    if zc is not None:
        strict = strict & (zc[..., :, None] == zc[..., None, :])
    # masked before exp so no overflow from the upper triangle
    gam = jnp.exp(jnp.where(strict, G[..., :, None] - G[..., None, :], -jnp.inf))
    gamma = jnp.exp(G) if zc is None else jnp.where(zc == 0, jnp.exp(G), 0.0)
    decay_out = jnp.exp(G[..., -1:] - G)  # γ_C/γ_i
    gamma_c = jnp.exp(G[..., -1])
    if zc is not None:
        decay_out = jnp.where(zc == zc[..., -1:], decay_out, 0.0)
        gamma_c = jnp.where(zc[..., -1] == 0, gamma_c, 0.0)
    return gam, gamma, decay_out, gamma_c


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
        S0 = state_zeros(k, v)
    else:
        _check_array(fn, "initial_state", initial_state, (B, H, K, V))
        S0 = initial_state.astype(_F32)
    c = chunk_size
    kp, vp = (pad_to_multiple(x.astype(_F32), c) for x in (k, v))  # sliced per chunk below
    bc = to_head_chunks(beta.astype(_F32), c)  # padding has β = 0, g = 0: a no-op write
    zc = None
    if segment_ids is not None:  # starts counted inside each chunk (padding continues the last)
        zc = jnp.cumsum(chunk(segment_starts(segment_ids), c).astype(jnp.int32), axis=-1)
        zc = jnp.broadcast_to(jnp.moveaxis(zc, 1, 0)[:, :, None], bc.shape)  # [n, B, H, c]
    decays = _residual_decays(to_head_chunks(g.astype(_F32), c), zc)

    def step(S, xs):  # one chunk, from S = S_n; as wy_delta_core, no transposing pass over k, v
        n, b_n, (gam, gamma, decay_out, gamma_c) = xs
        kc, vc = wy.chunk_of(kp, n, c), wy.chunk_of(vp, n, c)
        # strict_tril(K Kᵀ ⊙ Γ) (A = diag(β) of it is wy.kkt's matrix). Not through wy.kkt: E
        # needs it without β, and this einsum rounds differently from kkt's matmul on XLA:CPU for
        # C > 16.
        kk_gam = jnp.einsum("...tk,...ik->...ti", kc, kc) * gam
        Wm, Ut = wy.w_u(kc, vc, b_n, gamma, A=b_n[..., :, None] * kk_gam)
        S_next, delta = wy.state_step(S, Wm, Ut, kc * decay_out[..., None], gamma_c)  # Δ = β ⊙ e
        return S_next, vc - gamma[..., None] * (kc @ S) - kk_gam @ delta

    S_T, e = lax.scan(step, S0, (jnp.arange(bc.shape[0]), bc, decays))
    return from_head_chunks(e, T), S_T


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


# --------------------------------------------------------------------------------------------------
# Block-parallel forward
# --------------------------------------------------------------------------------------------------


class HolaKernels(NamedTuple):
    """The two parts of ``hola_forward`` that have another implementation (``ops.hola`` passes
    the Pallas kernels for ``impl="pallas"``); the defaults are the XLA forms.

    Attributes:
      state_path: the gated delta rule of the state path, called as
        ``state_path(q, k, v, g, beta, scale=, initial_state=, segment_ids=, chunk_size=)`` and
        returning ``(o [B, T, H, V], S_T [B, H, K, V] f32)`` with ``gated_delta_chunked``'s
        contract (``initial_state`` None = zero). The cache path does not use it; the scores
        use its writes only when it is the default (module docstring).
      cache_read: every block's cache read at once, with the contract of
        ``hola.cache.read_blocks`` (the default, XLA), or None (the cache path reads block by
        block inside its scan). Given, the one-stream cache path runs in two phases
        (``hola.stream.cache_blocks``: the merges first, then one read of all blocks; the faster
        on XLA:CPU, docs/RESULTS.md "Timings behind constants of the core"); not used by
        ``cumulative_attention`` (its merges need the reads) nor with ``segment_ids`` (the
        packed scan).
    """

    state_path: Callable = gated_delta_chunked
    cache_read: Callable | None = read_blocks


def hola_forward(
    q,
    k,
    v,
    g,
    beta,
    params,
    *,
    rule=HolaRule(),
    initial_state=None,
    segment_ids=None,
    chunk_size=64,
    kernels: HolaKernels = HolaKernels(),
):
    """HOLA layer math, block-parallel (SPEC §5): ``o_t = S_tᵀ (scale q_t) + σ(λ_h) o_cache,t``.

    The state path ``(o_state, S_T)`` is ``kernels.state_path`` (``gated_delta_chunked`` by
    default); the cache path is a ``lax.scan`` over blocks of ``block_size`` absolute positions
    carrying the persistent cache (fixed size ``window``). Per block every query attends over
    ``[A_{n-1} ‖ block (causal) ‖ sink]``, then ``A_n = top-w(A_{n-1} ∪ block)``. A trailing
    unfinished block is returned as the state's block buffer (not merged), so continuing with
    ``initial_state`` (another ``hola_forward`` call or ``hola_decode_step``) gives the same result
    as one call over the concatenated sequence.

    Packed rows (``segment_ids``, SPEC §0): every document runs as if alone — GDN state and scores
    restart from zero at its start, its blocks count from its own first token (document position
    ``p_t = t − D_t``), its cache starts empty and holds only its own tokens, and a query reads
    only its own document's cache entries and block tokens plus the sink (equations in
    hola/README.md §5; scan ``hola.packed.cache_blocks_packed``). Outputs and gradients equal those
    of each document alone (tested); ``recency`` scores and ``cache_pos`` are document positions.

    Args:
      q, k: ``[B, T, H, K]`` (the state path expects unit-norm q, k as in GDN layers).
      v: ``[B, T, H, V]``.
      g: ``[B, T, H]`` log decay; beta: ``[B, T, H]`` in ``[0, 1]``.
      params: ``HolaReadParams(gamma_q, gamma_k, sink_logit, gate_logit)``: the read-norm scales
        ``[H, K]`` of the cache path (unused for "l2"), the per-head sink logit ``[H]`` (the
        sink's value is zero) and the per-head gate ``λ_h [H]`` (the cache read is scaled by
        ``σ(λ_h)``).
      rule: ``HolaRule``: cache capacity ``window`` (w), block length ``block_size`` (C),
        ``eviction`` (one of ``EVICTIONS``), ``read_norm`` (one of ``READ_NORMS``), the
        state-path query ``scale`` and the cache logit scale ``cache_scale`` (None:
        ``K ** -0.5``). A config section that extends the rule (``HolaOptions``) is one too.
      initial_state: optional ``HolaState`` with the same ``B, H, K, V`` and the rule's
        ``window, block_size``.
      segment_ids: optional ``int [B, T]`` packed-document ids (a document starts where the id
        changes); not together with ``initial_state``.
      chunk_size: chunk length of the WY/UT state path and of the residual pass (speed and
        memory only: values equal up to rounding).
      kernels: :class:`HolaKernels`: the state path and the every-block cache read (default: the
        XLA forms; ``ops.hola`` passes the Pallas kernels for ``impl="pallas"``).

    Returns:
      ``(o [B, T, H, V] in v's dtype, HolaState)``. With ``segment_ids`` the state is that of each
      row's last document run alone; its ``pos`` (shared by the batch) is row 0's last-document
      length, so it continues every row exactly only when those lengths agree (e.g. ``B = 1``).
    """
    fn = "hola_forward"
    xs = (q, k, v, g, beta)
    state0, S0 = _check_forward(fn, xs, params, rule, chunk_size, initial_state, segment_ids)
    _check_kernels(fn, kernels)
    state_args = dict(
        scale=rule.scale, initial_state=S0, segment_ids=segment_ids, chunk_size=chunk_size
    )
    scores = None
    if kernels.state_path is gated_delta_chunked and rule.eviction == "beta_e":
        # β‖e‖ = ‖Δ‖: the state path's own writes, no second pass over the chunks for the scores
        o_state, S_T, writes = gated_delta_chunked_writes(q, k, v, g, beta, **state_args)
        scores = jnp.linalg.norm(lax.stop_gradient(writes), axis=-1)
    else:
        o_state, S_T = kernels.state_path(q, k, v, g, beta, **state_args)
    o_cache, cache, blk, pos = _cache_path(
        xs, params, state0, S0, rule=rule, segment_ids=segment_ids, chunk_size=chunk_size,
        cache_read=kernels.cache_read, scores=scores,
    )  # fmt: skip
    o = o_state.astype(_F32) + _sigmoid_gate(params.gate_logit)[None, None, :, None] * o_cache
    return o.astype(v.dtype), HolaState(S_T, *cache, *blk, pos=pos)


def _check_kernels(fn, kernels):
    if not isinstance(kernels, HolaKernels):
        raise ValueError(f"{fn}: kernels must be a HolaKernels, got {type(kernels).__name__}")
    if not callable(kernels.state_path):
        raise ValueError(f"{fn}: kernels.state_path must be a function, got {kernels.state_path!r}")
    read = kernels.cache_read
    if read is not None and not callable(read):
        raise ValueError(f"{fn}: kernels.cache_read must be a function or None, got {read!r}")


def _check_forward(fn, xs, params, rule, chunk_size, initial_state, segment_ids):
    """Argument checks of ``hola_forward`` (``xs = (q, k, v, g, beta)``); returns
    ``(state0, S0)``: the ``HolaState`` it continues (an empty one without ``initial_state``) and
    the GDN state ``S_{-1}`` (or None)."""
    B, T, H, K, V = _validate_seq(fn, *xs)
    _check_params(fn, params, H, K)
    _check_rule(fn, rule)
    check_positive_int(f"{fn}: chunk_size", chunk_size)
    _check_segments(fn, segment_ids, B, T, initial_state)
    if initial_state is None:
        # the empty state is scanned over the inputs: typed like their [B, H] rows (scan.py)
        rows = xs[1][:, :1].sum(1)[..., 0]  # [B, H]
        state0 = init_hola_state(B, H, K, V, rule.window, rule.block_size)
        return state0._replace(**{f: cast_like(getattr(state0, f), rows) for f in _ROWS}), None
    _check_state(fn, initial_state, B, H, K, V, rule, name="initial_state")
    return initial_state, initial_state.S


def _cache_path(xs, params, state0, S0, *, rule, segment_ids, chunk_size, cache_read,
                scores=None):  # fmt: skip
    """The cache half of ``hola_forward`` (SPEC §5; ``xs = (q, k, v, g, beta)``): insertion
    scores (``scores [B, T, H]`` when the caller has them), then the block scan over one stream
    continuing ``state0`` (``S0`` is None for a fresh start) or over packed documents.

    Returns ``(o_cache [B, T, H, V] f32, cache, block buffer, pos)`` (``HolaState`` parts).
    """
    q, k, v, g, beta = xs
    B, T, H, K = q.shape
    if segment_ids is None:
        positions = jnp.broadcast_to(state0.pos + jnp.arange(T, dtype=jnp.int32), (B, T))
    else:
        doc, positions = doc_starts(segment_ids)
    if scores is None:
        scores = _insertion_scores(
            k, v, g, beta, positions, S0, segment_ids, rule.eviction, chunk_size
        )
    _, cs = rule.scales(K)
    if segment_ids is None:
        o_cache, cache, blk = cache_blocks(
            q, k, v, scores, params, state0, lead=S0 is not None, rule=rule, cache_scale=cs,
            read=cache_read,
        )  # fmt: skip
        return o_cache, cache, blk, state0.pos + T
    return cache_blocks_packed(q, k, v, scores, doc, positions, params, rule=rule, cache_scale=cs)


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
