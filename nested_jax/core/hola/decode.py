"""HOLA's state, parameters and per-token form (SPEC §5): ``HolaState``, ``hola_decode_step``.

The block-parallel ``hola_forward``, the residual pass and the scores are in
:mod:`nested_jax.core.hola.forward`. Per head and token
(``α_t = exp(g_t)``, ``d = K``; the equations of ``core.hola.forward``'s docstring)::

    e_t = v_t − α_t S_{t-1}ᵀ k_t ;  S_t = α_t S_{t-1} + β_t k_t e_tᵀ ;  m_t = score(t)
    V_t = A_{n-1} ∪ {block n at positions ≤ t} ∪ {sink}
    o_t = S_tᵀ (scale · q_t) + σ(λ_h) Σ_{j∈V_t} softmax_j(cache_scale · q̃_tᵀ k̃_j) v_j
    A_n = top-w(A_{n-1} ∪ block n)                 at the end of block n (position ≡ −1 mod C)

``HolaRule`` (:mod:`nested_jax.rules`) holds the static options (``window``, ``block_size``,
``eviction``, ``read_norm``, the two scales) as one frozen value and :class:`HolaReadParams` the
four learnable per-head arrays of the cache read; every form takes both whole.
``hola_decode_step`` is one token; ``hola_recurrent`` is the same step in a ``lax.scan`` over a
sequence (the per-token form of ``hola_forward``, equal to it token by token). The state's size is
independent of the number of tokens: per head ``K·V + (w + C)(K + V)`` floats plus ``O(w + C)``
scores and positions. The trace-time argument checks shared with ``core.hola.forward`` live here
too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import check_positive_int
from nested_jax.core.hola.cache import attend, merge_top_w, read_normalize
from nested_jax.core.scan import zeros_typed
from nested_jax.rules import HolaRule

__all__ = [
    "HolaReadParams",
    "HolaState",
    "init_hola_state",
    "hola_decode_step",
    "hola_recurrent",
]

_F32 = jnp.float32


class HolaReadParams(NamedTuple):
    """The learnable per-layer parameters of HOLA's cache read (SPEC §5), one pytree.

    ``o_t = S_tᵀ (scale · q_t) + σ(λ_h) Σ_{j∈V_t} softmax_j(cache_scale · q̃_tᵀ k̃_j) v_j`` with
    ``q̃ = N_q(q)``, ``k̃ = N_k(k)`` and a sink of logit ``s_h`` and value 0.

    Attributes:
      gamma_q, gamma_k: ``[H, K]`` read-norm scales of ``N_q``, ``N_k`` (``read_norm="rmsnorm"``;
        unused for ``"l2"``).
      sink_logit: ``[H]`` the sink's logit ``s_h``.
      gate_logit: ``[H]`` the gate ``λ_h``; the cache read is scaled by ``σ(λ_h)``.
    """

    gamma_q: jax.Array
    gamma_k: jax.Array
    sink_logit: jax.Array
    gate_logit: jax.Array


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


def _check_rule(fn, rule):
    if not isinstance(rule, HolaRule):
        raise ValueError(f"{fn}: rule must be a HolaRule, got {type(rule).__name__}")


def _check_params(fn, params, H, K):
    if not isinstance(params, HolaReadParams):
        raise ValueError(
            f"{fn}: params must be a HolaReadParams(gamma_q, gamma_k, sink_logit, gate_logit), "
            f"got {type(params).__name__}"
        )
    _check_array(fn, "params.gamma_q", params.gamma_q, (H, K))
    _check_array(fn, "params.gamma_k", params.gamma_k, (H, K))
    _check_array(fn, "params.sink_logit", params.sink_logit, (H,))
    _check_array(fn, "params.gate_logit", params.gate_logit, (H,))


def _check_state(fn, state, B, H, K, V, rule, name="state"):
    """``state`` is a ``HolaState`` with batch ``B``, heads ``H``, widths ``K, V`` and the rule's
    ``window`` and ``block_size`` entries."""
    if not isinstance(state, HolaState):
        raise ValueError(
            f"{fn}: {name} must be a HolaState (see init_hola_state), got {type(state)}"
        )
    w, c = state.cache_k.shape[2], state.block_k.shape[2]
    if (w, c) != (rule.window, rule.block_size):
        raise ValueError(
            f"{fn}: {name} holds window={w}, block_size={c} entries; the rule says "
            f"window={rule.window}, block_size={rule.block_size}"
        )
    for field, shape in _state_shapes(B, H, K, V, w, c).items():
        _check_array(fn, f"{name}.{field}", getattr(state, field), shape, floating=False)


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


def _sigmoid_gate(gate_logit):
    return jax.nn.sigmoid(gate_logit.astype(_F32))


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


def hola_decode_step(state, q_t, k_t, v_t, g_t, beta_t, params, *, rule=HolaRule()):
    """One token of HOLA (SPEC §5): equals ``hola_forward`` token by token.

    The token is written to the block buffer slot ``pos % C`` with its fixed score, the cache read
    sees ``A_{n-1}`` ∪ the filled buffer ∪ sink, and when the buffer completes a block it is merged
    into the cache (``top-w``) and cleared.

    Args:
      state: ``HolaState`` with the rule's ``window`` and ``block_size`` entries.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; g_t, beta_t: ``[B, H]``.
      params: :class:`HolaReadParams`; rule: ``HolaRule`` (``chunk_size`` has no meaning for one
        token); both as in ``hola_forward``.

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, new HolaState)`` with the same shapes as ``state``.
    """
    B, H, K, V = _check_step(state, (q_t, k_t, v_t, g_t, beta_t), params, rule)
    W, C, eviction, read_norm = rule.window, rule.block_size, rule.eviction, rule.read_norm
    gamma_q, gamma_k = params.gamma_q, params.gamma_k
    sc, cs = rule.scales(K)

    q, k, v = (x.astype(_F32) for x in (q_t, k_t, v_t))
    g, b = g_t.astype(_F32), beta_t.astype(_F32)
    S, e, o_state = _gdn_token(state.S, q, k, v, g, b, sc)
    r = state.pos % C
    score = lax.stop_gradient(_token_score(eviction, b, e, v, state.pos))
    at_r = jnp.arange(C) == r
    bk = jnp.where(at_r[None, None, :, None], k[:, :, None, :], state.block_k.astype(_F32))
    bv = jnp.where(at_r[None, None, :, None], v[:, :, None, :], state.block_v.astype(_F32))
    bs = jnp.where(at_r[None, None, :], score[:, :, None], state.block_score.astype(_F32))
    filled = jnp.arange(C) <= r

    # Read: A_{n-1} ∪ the filled buffer (this token included) ∪ sink.
    qn = read_normalize(q[:, :, None, :], gamma_q, read_norm)
    ck_n = read_normalize(state.cache_k.astype(_F32), gamma_k, read_norm)
    o_cache, pc, pb = attend(
        qn, ck_n, state.cache_v.astype(_F32),
        state.cache_valid, read_normalize(bk, gamma_k, read_norm), bv,
        jnp.broadcast_to(filled, (B, H, 1, C)), params.sink_logit, cs,
    )  # fmt: skip
    cscore = state.cache_score.astype(_F32)
    if eviction == "cumulative_attention":
        cscore = cscore + lax.stop_gradient(pc[:, :, 0])
        bs = bs + lax.stop_gradient(pb[:, :, 0])
    o = o_state + _sigmoid_gate(params.gate_logit)[None, :, None] * o_cache[:, :, 0]

    cache = (
        state.cache_k.astype(_F32),
        state.cache_v.astype(_F32),
        cscore,
        state.cache_pos,
        state.cache_valid,
    )
    pos_new = state.pos + 1
    cache, bk, bv, bs = _close_block(cache, (bk, bv, bs), state.pos, pos_new, r, W, eviction)
    new_state = HolaState(S, *cache, bk, bv, bs, pos_new)
    return o.astype(v_t.dtype), new_state


def _check_step(state, xs, params, rule):
    """Trace-time checks of :func:`hola_decode_step`'s arguments (``xs = (q_t, k_t, v_t, g_t,
    beta_t)``); returns ``(B, H, K, V)``."""
    fn = "hola_decode_step"
    q_t, k_t, v_t, g_t, beta_t = xs
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
    _check_params(fn, params, H, K)
    _check_rule(fn, rule)
    _check_state(fn, state, B, H, K, V, rule)
    return B, H, K, V


def _gdn_token(S_prev, q, k, v, g, b, scale):
    """One token of the gated delta state path (SPEC §1 GDN, decay first), keeping the residual
    ``e_t = v_t − α_t S_{t-1}ᵀ k_t`` for the score. All f32 ``[B, H, ...]``.

    Returns ``(S_t [B, H, K, V], e_t [B, H, V], o_t = S_tᵀ (scale · q_t) [B, H, V])``.
    """
    S = jnp.exp(g)[..., None, None] * S_prev.astype(_F32)
    e = v - jnp.einsum("bhk,bhkv->bhv", k, S)
    S = S + b[..., None, None] * k[..., :, None] * e[..., None, :]
    return S, e, jnp.einsum("bhk,bhkv->bhv", q * scale, S)


def _token_score(eviction, b, e, v, pos):
    """The token's insertion score ``[B, H]`` f32 (SPEC §5; not yet under ``stop_gradient``):
    ``β‖e‖``, ``‖e‖``, ``β‖v‖``, its position (``recency``) or 0 (``cumulative_attention``, which
    accumulates attention mass later)."""
    if eviction == "beta_e":
        return b * jnp.linalg.norm(e, axis=-1)
    if eviction == "e":
        return jnp.linalg.norm(e, axis=-1)
    if eviction == "beta_v":
        return b * jnp.linalg.norm(v, axis=-1)
    if eviction == "recency":
        return jnp.broadcast_to(pos.astype(_F32), b.shape)
    return jnp.zeros(b.shape, _F32)


def _close_block(cache, blk, pos, pos_new, r, W, eviction):
    """At a block end (``pos_new ≡ 0 mod C``): ``A_n = top-w(A_{n-1} ∪ block n)`` and an empty
    buffer; otherwise everything unchanged. ``cache`` is the 5-tuple of ``HolaState`` cache fields,
    ``blk = (block_k, block_v, block_score)`` the filled buffer; ``pos`` the token's position and
    ``r = pos % C`` its slot. Returns ``(cache, block_k, block_v, block_score)``."""
    C = blk[2].shape[-1]

    def merge_and_clear(operands):
        cache, bk, bv, bs = operands
        # typed like the buffer's scores (their shardings on an Explicit mesh), as the cache is
        pos_b = pos - r + jnp.arange(C, dtype=jnp.int32) + zeros_typed(bs, dtype=jnp.int32)
        val_b = jnp.logical_not(zeros_typed(bs, dtype=bool))
        merged = merge_top_w(cache, (bk, bv, bs, pos_b, val_b), W, eviction)
        return merged, jnp.zeros_like(bk), jnp.zeros_like(bv), jnp.zeros_like(bs)

    def keep(operands):
        return operands

    return lax.cond(pos_new % C == 0, merge_and_clear, keep, (cache, *blk))


def hola_recurrent(q, k, v, g, beta, params, *, rule=HolaRule(), initial_state=None):
    """HOLA per token (SPEC §5): ``hola_decode_step`` in a ``lax.scan`` over ``t = 0 … T−1``.

    ``(o_t, state_{t+1}) = hola_decode_step(state_t, q_t, k_t, v_t, g_t, β_t, …)`` from
    ``state_0 = initial_state`` (or the empty ``init_hola_state``). The GDN state path is the exact
    per-token recurrence (no WY/UT chunks) and every token is written to the block buffer and read
    before the next one, so this is ``hola_forward``'s per-token twin: the same outputs and final
    ``HolaState`` (up to float rounding), differentiable the same way (scores and the top-w
    selection under ``stop_gradient``). One stream: no ``segment_ids``; the cost is sequential in
    ``T`` (a test / ground-truth form, not the training path).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      params: :class:`HolaReadParams`; rule: ``HolaRule``; both as in
        ``core.hola.forward.hola_forward``.
      initial_state: optional ``HolaState`` with the same ``B, H, K, V`` and the rule's
        ``window, block_size``.

    Returns:
      ``(o [B, T, H, V] in v's dtype, HolaState)`` (state leaves f32, as ``hola_decode_step``'s).
    """
    fn = "hola_recurrent"
    B, T, H, K, V = _validate_seq(fn, q, k, v, g, beta)
    _check_params(fn, params, H, K)
    _check_rule(fn, rule)
    if initial_state is None:
        state0 = init_hola_state(B, H, K, V, rule.window, rule.block_size)
    else:
        _check_state(fn, initial_state, B, H, K, V, rule, name="initial_state")
        state0 = _as_carry(initial_state)

    def body(state, xs):
        o_t, state = hola_decode_step(state, *xs, params, rule=rule)
        return state, o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))  # [T, B, H, ...]
    state, o = lax.scan(body, state0, xs)
    return jnp.moveaxis(o, 0, 1), state


def _as_carry(state: HolaState) -> HolaState:
    """The state in ``hola_decode_step``'s output dtypes (f32 floats, int32 pos), so it can be a
    ``lax.scan`` carry."""
    return jax.tree.map(
        lambda x: x.astype(_F32) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
    )
