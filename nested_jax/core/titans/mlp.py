"""Titans neural long-term memory with an MLP memory ``M_θ`` (SPEC §2): step, recurrent, chunked.

The memory of one (batch, head) is ``L = L_M`` linear layers without biases, stored row-major so
that the matrix memory of SPEC §0.1 is the case ``L = 1`` (``y = zᵀ W = Mᵀ z``)::

    a_0 = z,   h_l = a_l W_l  (W_l ∈ R^{d_l × d_{l+1}}),   a_{l+1} = σ(h_l)  (l < L−1)
    M(z) = h_{L-1} (+ z when ``residual``)      e.g. L = 2:  M(z) = z + W_1ᵀ σ(W_0ᵀ z)

with ``d_0 = K`` (key/query dim), ``d_L = V`` (value dim), hidden sizes given by the weight shapes,
``σ`` elementwise (default SiLU). ``residual=None`` (auto) adds ``z`` iff ``L ≥ 2`` and ``K == V``;
the matrix memory (``L = 1``) has no residual unless asked for.

Inner loss ``ℓ(M; k, v) = ½‖M(k) − v‖²``; its gradient for layer ``l`` and one token is the rank-1
matrix ``a_l δ_lᵀ`` with ``δ_{L-1} = M(k) − v`` and ``δ_{l-1} = (W_l δ_l) ⊙ σ'(h_{l-1})``.
Per token (SPEC §2)::

    u_t = ∇_W ℓ(M_{t-1}; k_t, v_t)            (optionally softclamped, below)
    S_t = η_t S_{t-1} − θ_t u_t                (momentum, lives in parameter space)
    M_t = (1 − α_t) M_{t-1} + S_t              (forgetting = weight decay)
    y_t = M_t(q_t)      (read_before_write=True: y_t = M_{t-1}(q_t))

Chunked form (SPEC §2 parallel form, dual-form reads): ``titans_mlp_chunked`` and
``titans_pool_gates`` live in :mod:`nested_jax.core.titans.chunk` (the derivation is there);
the state type, argument checks and the forward / manual backward of
``M`` live in :mod:`nested_jax.core.titans.net`.

Static options: one :class:`~nested_jax.rules.TitansRule` (``rule=``, default ``TitansRule()``,
the paper's rule): ``read_before_write``, ``grad_clip``, ``activation`` (``σ`` by name) and
``grad_horizon``; the per-token forms ignore the chunk options (``memory_chunk``,
``per_chunk_gates``, ``remat``).

Gradient softclamp (``rule.grad_clip = c > 0``): ``u_t ← u_t · c·tanh(‖u_t‖/c)/‖u_t‖`` with
``‖u_t‖² = Σ_l ‖a_l‖²‖δ_l‖²`` (Frobenius norm over all layers). It bounds every write by ``c``
(so ``‖S‖ ≤ c·Σ η^i θ``), is the identity to first order for ``‖u‖ ≪ c``, and is smooth; ``0``
(the paper's rule) disables it. The factor is a per-token scalar, so it folds into ``θ_t``.

Shapes: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, gates ``theta, eta, alpha [B, T, H]`` in
``(0, 1)`` (``[0, 1]`` works: ``η = 0`` no momentum, ``α = 1`` erase, ``θ = 0`` no write). Weights
and momentum ``W_l, S_l [B, H, d_l, d_{l+1}]`` (f32). No scale is applied to q (SPEC §0.1).
Outputs take v's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import require_initial_state
from nested_jax.core.dgd import softclamp_factor
from nested_jax.core.titans.net import (
    MLP_STATE_CONSTRUCTOR,
    TitansMLPState,
    _check_state,
    _f32_state,
    _forward,
    _resolve_residual,
    _shape,
    _stop_gradient_where,
    _validate_weights,
    activation_of,
    check_rule,
    horizon_cuts,
    segment_resets,
    validate_common,
    validate_segment_ids,
)
from nested_jax.rules import TitansRule

__all__ = [
    "titans_mlp_init_weights",
    "titans_mlp_state",
    "titans_mlp_apply",
    "titans_mlp_step",
    "titans_mlp_recurrent",
]


def titans_mlp_apply(weights, z, *, rule: TitansRule = TitansRule(), residual=None):
    """Reads the memory: ``M(z)`` for every position (SPEC §2; no update).

    Args:
      weights: tuple of ``W_l [B, H, d_l, d_{l+1}]``.
      z: ``[B, T, H, K]`` queries.
      rule: :class:`~nested_jax.rules.TitansRule`; only ``rule.activation`` (σ between layers,
        SiLU by default) applies to a read.
      residual: add ``z`` to the output; None = auto (``L ≥ 2`` and ``K == V``).

    Returns:
      ``[B, T, H, V]`` in z's dtype.
    """
    fn = "titans_mlp_apply"
    check_rule(fn, rule)
    if _shape(z) is None or z.ndim != 4:
        raise ValueError(f"{fn}: z must have shape [B, T, H, K] (rank 4), got {_shape(z)}")
    B, _, H, K = z.shape
    V = _shape(weights[-1])[-1] if isinstance(weights, (tuple, list)) and weights else None
    _validate_weights(fn, "weights", weights, B, H, K, V)
    res = _resolve_residual(fn, residual, len(weights), K, V)
    zh = jnp.moveaxis(z, 1, 2).astype(jnp.float32)  # [B, H, T, K]
    ws = tuple(w.astype(jnp.float32) for w in weights)
    y, _, _ = _forward(ws, zh, activation_of(rule), res)
    return jnp.moveaxis(y, 2, 1).astype(z.dtype)


# --------------------------------------------------------------------------------------------------
# State helpers
# --------------------------------------------------------------------------------------------------


def titans_mlp_init_weights(key, num_heads: int, dims, *, dtype=jnp.float32):
    """Initial memory weights (outer parameters), ``W_l ~ N(0, 1/d_l)``, ``[H, d_l, d_{l+1}]``.

    Args:
      key: PRNG key.
      num_heads: H.
      dims: ``(d_0 = K, d_1, ..., d_L = V)``; ``L = len(dims) − 1`` layers (``L_M``).

    Returns:
      tuple of ``L`` arrays ``[H, d_l, d_{l+1}]``; broadcast over batch with ``titans_mlp_state``.
    """
    dims = tuple(int(d) for d in dims)
    if len(dims) < 2 or min(dims) <= 0:
        raise ValueError(
            f"titans_mlp_init_weights: dims must be (K, ..., V) of positive ints, got {dims}"
        )
    keys = jax.random.split(key, len(dims) - 1)
    return tuple(
        jax.random.normal(kk, (num_heads, a, b), dtype) * (a**-0.5)
        for kk, a, b in zip(keys, dims[:-1], dims[1:], strict=True)
    )


def titans_mlp_state(weights, batch_size: int | None = None) -> TitansMLPState:
    """Builds a ``TitansMLPState`` with zero momentum.

    Args:
      weights: tuple of ``[H, d_l, d_{l+1}]`` (then ``batch_size`` is required and they are
        broadcast) or of ``[B, H, d_l, d_{l+1}]`` (``batch_size`` None).

    Returns:
      ``TitansMLPState(weights [B, H, ...] f32, momentum zeros [B, H, ...] f32)``.
    """
    ws = []
    for i, w in enumerate(weights):
        if batch_size is not None:
            if w.ndim != 3:
                raise ValueError(
                    f"titans_mlp_state: weights[{i}] must be [H, d_in, d_out], got {w.shape}"
                )
            w = jnp.broadcast_to(w, (batch_size, *w.shape))
        elif w.ndim != 4:
            raise ValueError(
                f"titans_mlp_state: weights[{i}] must be [B, H, d_in, d_out], got {w.shape}"
            )
        ws.append(w.astype(jnp.float32))
    return TitansMLPState(tuple(ws), tuple(jnp.zeros_like(w) for w in ws))


# --------------------------------------------------------------------------------------------------
# Step and recurrent forms (ground truth: the inner gradient comes from jax.grad)
# --------------------------------------------------------------------------------------------------


def _step_math(state, token, rule: TitansRule, residual: bool, anchor=None):
    """One token for all (B, H) in f32: ``token = (q, k, v, θ, η, α)`` with ``q, k [B,H,K]``,
    ``v [B,H,V]``, gates ``[B,H]``.

    The surprise is taken at ``anchor`` when given (the chunk rule), else at the current weights.
    """
    W, S = state
    q, k, v, th, et, al = token
    activation = activation_of(rule)

    def loss(ws):  # sum over (B, H) of independent losses → per-(b, h) gradients
        out, _, _ = _forward(ws, k[..., None, :], activation, residual)
        return 0.5 * jnp.sum(jnp.square(out[..., 0, :] - v))

    u = jax.grad(loss)(W if anchor is None else anchor)
    if rule.grad_clip:
        sq = sum(jnp.sum(jnp.square(g), axis=(-2, -1)) for g in u)
        th = th * softclamp_factor(sq, float(rule.grad_clip))
    bc = lambda x: x[..., None, None]  # noqa: E731
    S = tuple(bc(et) * s - bc(th) * g for s, g in zip(S, u, strict=True))
    W_new = tuple(bc(1.0 - al) * w + s for w, s in zip(W, S, strict=True))
    y, _, _ = _forward(
        W if rule.read_before_write else W_new, q[..., None, :], activation, residual
    )
    return y[..., 0, :], TitansMLPState(W_new, S)


def titans_mlp_step(
    state: TitansMLPState,
    q_t,
    k_t,
    v_t,
    theta_t,
    eta_t,
    alpha_t,
    *,
    rule: TitansRule = TitansRule(),
    residual=None,
    anchor=None,
):
    """One token of the Titans memory update and read (SPEC §2).

    ``u = ∇_W ½‖M_{t-1}(k_t) − v_t‖²``, ``S_t = η_t S_{t-1} − θ_t u``,
    ``M_t = (1 − α_t) M_{t-1} + S_t``, ``y_t = M_t(q_t)`` (``M_{t-1}(q_t)`` with
    ``rule.read_before_write``).

    Decoding consistently with ``titans_mlp_chunked`` (chunks of ``b = rule.memory_chunk``): pass
    ``anchor`` = the weights at the start of the current chunk (set ``anchor = state.weights``
    before every token whose position is a multiple of b); the surprise is then
    ``∇ℓ(anchor; k_t, v_t)``, which is exactly the chunk rule, so token-by-token decoding equals
    the chunked forward.

    Args:
      state: ``TitansMLPState`` with ``W_l, S_l [B, H, d_l, d_{l+1}]``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; theta_t, eta_t, alpha_t: ``[B, H]``.
      rule: :class:`~nested_jax.rules.TitansRule`: ``read_before_write``, ``grad_clip``
        (softclamp of ``‖u‖``, 0 = off) and ``activation`` apply.
      residual: add ``z`` to the memory's output; None = auto (see ``titans_mlp_apply``).
      anchor: optional tuple like ``state.weights``: take the surprise there (chunk rule).

    Returns:
      ``(y_t [B, H, V] in v_t's dtype, new TitansMLPState f32)``.
    """
    fn = "titans_mlp_step"
    check_rule(fn, rule)
    B, _, H, K, V = validate_common(fn, q_t, k_t, v_t, theta_t, eta_t, alpha_t, per_token=True)
    _check_state(fn, state, B, H, K, V)
    res = _resolve_residual(fn, residual, len(state.weights), K, V)
    f = lambda x: x.astype(jnp.float32)  # noqa: E731
    if anchor is not None:
        _validate_weights(fn, "anchor", anchor, B, H, K, V)
        anchor = tuple(f(w) for w in anchor)
    token = tuple(f(x) for x in (q_t, k_t, v_t, theta_t, eta_t, alpha_t))
    y, new = _step_math(_f32_state(state), token, rule, res, anchor)
    return y.astype(v_t.dtype), new


def titans_mlp_recurrent(
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
    """Titans memory over a sequence token by token (``lax.scan`` of the step; ground truth).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      initial_state: ``TitansMLPState`` (weights usually learned outer params, momentum zero;
        ``titans_mlp_state(weights, B)``), arrays ``[B, H, d_l, d_{l+1}]``. Required: the MLP
        memory has no zero state (None raises ``ValueError``).
      rule: :class:`~nested_jax.rules.TitansRule`, as ``titans_mlp_step``; ``rule.grad_horizon =
        n`` (truncated backprop) makes the carried state a ``stop_gradient`` before every
        position that is a positive multiple of n (values unchanged; 0 = off).
      residual: as ``titans_mlp_step``.
      segment_ids: optional ``[B, T]`` int (packed sequences, SPEC §0): the state resets to
        ``reset_state`` before the first token of every segment after the first.
      reset_state: the state a segment start resets to (default ``initial_state``; a caller that
        carries the state across calls passes the learned initial state here).

    Returns:
      ``(y [B, T, H, V] in v's dtype, final TitansMLPState f32)``.
    """
    fn = "titans_mlp_recurrent"
    check_rule(fn, rule)
    state = require_initial_state(fn, initial_state, MLP_STATE_CONSTRUCTOR)
    B, T, H, K, V = validate_common(fn, q, k, v, theta, eta, alpha, per_token=False)
    _check_state(fn, state, B, H, K, V, name="initial_state")
    validate_segment_ids(fn, segment_ids, B, T)
    res = _resolve_residual(fn, residual, len(state.weights), K, V)
    tm = lambda x: jnp.moveaxis(x, 1, 0).astype(jnp.float32)  # noqa: E731
    st0 = _f32_state(state)
    if reset_state is not None:
        _check_state(fn + " (reset_state)", reset_state, B, H, K, V)
    st_r = st0 if reset_state is None else _f32_state(reset_state)
    resets = None if segment_ids is None else tm(segment_resets(segment_ids))
    cut = horizon_cuts(T, 1, rule.grad_horizon)

    def body(st, xs):
        *token, r, c = xs
        if c is not None:
            st = _stop_gradient_where(c, st)
        if r is not None:
            st = jax.tree.map(lambda a, b: jnp.where(r[:, None, None, None] > 0, b, a), st, st_r)
        y, st = _step_math(st, token, rule, res)
        return st, y

    xs = tuple(map(tm, (q, k, v, theta, eta, alpha))) + (resets, cut)
    st, y = lax.scan(body, st0, xs)
    return jnp.moveaxis(y, 0, 1).astype(v.dtype), st
