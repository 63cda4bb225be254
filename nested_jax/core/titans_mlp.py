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

Gradient softclamp (``grad_clip=c``): ``u_t ← u_t · c·tanh(‖u_t‖/c)/‖u_t‖`` with
``‖u_t‖² = Σ_l ‖a_l‖²‖δ_l‖²`` (Frobenius norm over all layers). It bounds every write by ``c``
(so ``‖S‖ ≤ c·Σ η^i θ``), is the identity to first order for ``‖u‖ ≪ c``, and is smooth. The MLP
API defaults to ``c = 10`` (does not bind for unit-norm keys and O(1) values, but stops a runaway
deep memory); ``None`` disables it. The factor is a per-token scalar, so it folds into ``θ_t``.

Shapes: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, gates ``theta, eta, alpha [B, T, H]`` in
``(0, 1)`` (``[0, 1]`` works: ``η = 0`` no momentum, ``α = 1`` erase, ``θ = 0`` no write). Weights
and momentum ``W_l, S_l [B, H, d_l, d_{l+1}]`` (f32). No scale is applied to q (SPEC §0.1).
Outputs take v's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "TitansMLPState",
    "titans_mlp_init_weights",
    "titans_mlp_state",
    "titans_mlp_apply",
    "titans_mlp_step",
    "titans_mlp_recurrent",
    "titans_mlp_chunked",
    "titans_pool_gates",
]

Activation = Callable[[jax.Array], jax.Array]
DEFAULT_MLP_GRAD_CLIP = 10.0


class TitansMLPState(NamedTuple):
    """State of an MLP memory (SPEC §2); a pytree, carry it across calls.

    Attributes:
      weights: tuple of ``L`` arrays ``W_l [B, H, d_l, d_{l+1}]`` (``d_0 = K``, ``d_L = V``), the
        memory ``M_t``.
      momentum: tuple of ``L`` arrays of the same shapes, the past surprise ``S_t``.
    """

    weights: tuple
    momentum: tuple


# --------------------------------------------------------------------------------------------------
# Validation (trace time)
# --------------------------------------------------------------------------------------------------


def _shape(x):
    return getattr(x, "shape", None)


def _check_float(fn: str, name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{fn}: {name} must have a floating dtype, got {x.dtype}")


def _validate_weights(fn: str, name: str, ws, B, H, K, V) -> None:
    """``ws`` must be a non-empty tuple/list of ``[B, H, d_l, d_{l+1}]`` arrays chaining K → V."""
    if not isinstance(ws, (tuple, list)) or len(ws) == 0:
        raise ValueError(
            f"{fn}: {name} must be a non-empty tuple of arrays [B, H, d_l, d_(l+1)], got {type(ws)}"
        )
    d_in = K
    for i, w in enumerate(ws):
        last = i == len(ws) - 1
        want = f"[{B}, {H}, {d_in}, {V if last else 'd'}]"
        s = _shape(w)
        if s is None or len(s) != 4 or s[:3] != (B, H, d_in) or (last and s[3] != V):
            raise ValueError(f"{fn}: {name}[{i}] must have shape {want}, got {s}")
        _check_float(fn, f"{name}[{i}]", w)
        d_in = s[3]


def _validate_common(fn, q, k, v, theta, eta, alpha, grad_clip, per_token: bool):
    """Checks q, k, v and gates; returns ``(B, T, H, K, V)`` (``T`` is None for a step)."""
    rank, lead = (3, "[B, H") if per_token else (4, "[B, T, H")
    sfx = "_t" if per_token else ""
    for name, x in ((f"q{sfx}", q), (f"k{sfx}", k), (f"v{sfx}", v)):
        if _shape(x) is None or x.ndim != rank:
            raise ValueError(
                f"{fn}: {name} must have shape {lead}, D] (rank {rank}), got {_shape(x)}"
            )
        _check_float(fn, name, x)
    if k.shape != q.shape:
        raise ValueError(
            f"{fn}: k{sfx} must have shape {lead}, K] = {q.shape} like q, got {k.shape}"
        )
    if v.shape[:-1] != q.shape[:-1]:
        want = f"{lead}, V] with leading dims {q.shape[:-1]}"
        raise ValueError(f"{fn}: v{sfx} must have shape {want}, got {v.shape}")
    for name, x in ((f"theta{sfx}", theta), (f"eta{sfx}", eta), (f"alpha{sfx}", alpha)):
        if _shape(x) != q.shape[:-1]:
            raise ValueError(
                f"{fn}: {name} must have shape {lead}] = {q.shape[:-1]}, got {_shape(x)}"
            )
        _check_float(fn, name, x)
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
        raise ValueError(f"{fn}: grad_clip must be a positive float or None, got {grad_clip!r}")
    if per_token:
        B, H, K = q.shape
        return B, None, H, K, v.shape[-1]
    B, T, H, K = q.shape
    return B, T, H, K, v.shape[-1]


def _validate_segment_ids(fn, segment_ids, B, T):
    if segment_ids is None:
        return
    if _shape(segment_ids) != (B, T):
        raise ValueError(
            f"{fn}: segment_ids must have shape [B, T] = {(B, T)}, got {_shape(segment_ids)}"
        )
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"{fn}: segment_ids must have an integer dtype, got {segment_ids.dtype}")


def _validate_horizon(fn, grad_horizon, chunk_size):
    if not isinstance(grad_horizon, int) or isinstance(grad_horizon, bool) or grad_horizon < 0:
        raise ValueError(f"{fn}: grad_horizon must be an int >= 0, got {grad_horizon!r}")
    if grad_horizon % chunk_size:
        raise ValueError(
            f"{fn}: grad_horizon must be a multiple of chunk_size={chunk_size} (the state is cut "
            f"between chunks), got {grad_horizon}"
        )


def _stop_gradient_where(flag, tree):
    """``tree`` with its gradient cut where the scalar bool ``flag`` is set (values unchanged)."""
    return jax.tree.map(lambda a: jnp.where(flag, lax.stop_gradient(a), a), tree)


def _validate_chunk_size(fn, chunk_size):
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")


def _resolve_residual(fn, residual, L, K, V) -> bool:
    if residual is None:
        return L >= 2 and K == V
    if residual and K != V:
        raise ValueError(f"{fn}: residual=True needs K == V (z + MLP(z)), got K={K}, V={V}")
    return bool(residual)


# --------------------------------------------------------------------------------------------------
# Memory forward / manual backward (the rank-1 factors of the per-token inner gradient)
# --------------------------------------------------------------------------------------------------


def _act_grad(activation: Activation, h):
    """Elementwise ``σ'(h)`` by a JVP with a ones tangent (valid for any elementwise activation)."""
    return jax.jvp(activation, (h,), (jnp.ones_like(h),))[1]


def _forward(weights, z, activation, residual):
    """``z [..., n, d_0]`` → ``(M(z), layer inputs a_l, pre-activations h_l for l < L−1)``."""
    a, inputs, pre = z, [], []
    for i, w in enumerate(weights):
        inputs.append(a)
        h = jnp.einsum("...nd,...de->...ne", a, w)
        if i < len(weights) - 1:
            pre.append(h)
            a = activation(h)
        else:
            a = h
    return (a + z if residual else a), inputs, pre


def _backward(weights, pre, err, activation):
    """``δ_l`` for every layer from ``δ_{L-1} = err = M(k) − v`` (``∂ℓ/∂h_l``)."""
    deltas = [None] * len(weights)
    d = err
    for i in range(len(weights) - 1, -1, -1):
        deltas[i] = d
        if i > 0:
            d = jnp.einsum("...ne,...de->...nd", d, weights[i]) * _act_grad(activation, pre[i - 1])
    return deltas


def _softclamp_factor(sq_norm, c):
    """``c·tanh(n/c)/n``, ``n = sqrt(sq_norm)``; 1 at ``n = 0`` (double where: finite grads)."""
    pos = sq_norm > 0
    n = jnp.sqrt(jnp.where(pos, sq_norm, 1.0))
    return jnp.where(pos, c * jnp.tanh(n / c) / n, 1.0)


def titans_mlp_apply(weights, z, *, activation: Activation = jax.nn.silu, residual=None):
    """Reads the memory: ``M(z)`` for every position (SPEC §2; no update).

    Args:
      weights: tuple of ``W_l [B, H, d_l, d_{l+1}]``.
      z: ``[B, T, H, K]`` queries.
      activation: elementwise σ between layers (default SiLU).
      residual: add ``z`` to the output; None = auto (``L ≥ 2`` and ``K == V``).

    Returns:
      ``[B, T, H, V]`` in z's dtype.
    """
    fn = "titans_mlp_apply"
    if _shape(z) is None or z.ndim != 4:
        raise ValueError(f"{fn}: z must have shape [B, T, H, K] (rank 4), got {_shape(z)}")
    B, _, H, K = z.shape
    V = _shape(weights[-1])[-1] if isinstance(weights, (tuple, list)) and weights else None
    _validate_weights(fn, "weights", weights, B, H, K, V)
    res = _resolve_residual(fn, residual, len(weights), K, V)
    zh = jnp.moveaxis(z, 1, 2).astype(jnp.float32)  # [B, H, T, K]
    y, _, _ = _forward(tuple(w.astype(jnp.float32) for w in weights), zh, activation, res)
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


def _step_math(state, q, k, v, th, et, al, activation, residual, rbw, grad_clip, anchor=None):
    """One token for all (B, H) in f32. ``q, k [B,H,K]``, ``v [B,H,V]``, gates ``[B,H]``.

    The surprise is taken at ``anchor`` when given (the chunk rule), else at the current weights.
    """
    W, S = state

    def loss(ws):  # sum over (B, H) of independent losses → per-(b, h) gradients
        out, _, _ = _forward(ws, k[..., None, :], activation, residual)
        return 0.5 * jnp.sum(jnp.square(out[..., 0, :] - v))

    u = jax.grad(loss)(W if anchor is None else anchor)
    if grad_clip is not None:
        sq = sum(jnp.sum(jnp.square(g), axis=(-2, -1)) for g in u)
        th = th * _softclamp_factor(sq, grad_clip)
    bc = lambda x: x[..., None, None]  # noqa: E731
    S = tuple(bc(et) * s - bc(th) * g for s, g in zip(S, u, strict=True))
    W_new = tuple(bc(1.0 - al) * w + s for w, s in zip(W, S, strict=True))
    y, _, _ = _forward(W if rbw else W_new, q[..., None, :], activation, residual)
    return y[..., 0, :], TitansMLPState(W_new, S)


def _f32_state(state):
    f = lambda t: tuple(x.astype(jnp.float32) for x in t)  # noqa: E731
    return TitansMLPState(f(state.weights), f(state.momentum))


def _check_state(fn, state, B, H, K, V):
    if not isinstance(state, TitansMLPState):
        raise ValueError(
            f"{fn}: state must be a TitansMLPState(weights, momentum), got {type(state)}"
        )
    _validate_weights(fn, "state.weights", state.weights, B, H, K, V)
    if not isinstance(state.momentum, (tuple, list)) or len(state.momentum) != len(state.weights):
        raise ValueError(f"{fn}: state.momentum must be a tuple like state.weights")
    for i, (w, s) in enumerate(zip(state.weights, state.momentum, strict=True)):
        if _shape(s) != w.shape:
            raise ValueError(
                f"{fn}: state.momentum[{i}] must have shape {w.shape}, got {_shape(s)}"
            )


def titans_mlp_step(
    state: TitansMLPState,
    q_t,
    k_t,
    v_t,
    theta_t,
    eta_t,
    alpha_t,
    *,
    activation: Activation = jax.nn.silu,
    residual=None,
    read_before_write: bool = False,
    grad_clip: float | None = DEFAULT_MLP_GRAD_CLIP,
    anchor=None,
):
    """One token of the Titans memory update and read (SPEC §2).

    ``u = ∇_W ½‖M_{t-1}(k_t) − v_t‖²``, ``S_t = η_t S_{t-1} − θ_t u``,
    ``M_t = (1 − α_t) M_{t-1} + S_t``, ``y_t = M_t(q_t)`` (``M_{t-1}(q_t)`` with
    ``read_before_write``).

    Decoding consistently with ``titans_mlp_chunked(chunk_size=b)``: pass ``anchor`` = the weights
    at the start of the current chunk (set ``anchor = state.weights`` before every token whose
    position is a multiple of b); the surprise is then ``∇ℓ(anchor; k_t, v_t)``, which is exactly
    the chunk rule, so token-by-token decoding equals the chunked forward.

    Args:
      state: ``TitansMLPState`` with ``W_l, S_l [B, H, d_l, d_{l+1}]``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; theta_t, eta_t, alpha_t: ``[B, H]``.
      activation, residual: the memory architecture (see ``titans_mlp_apply``).
      read_before_write: read with ``M_{t-1}``.
      grad_clip: softclamp threshold for ``‖u‖`` (None: off).
      anchor: optional tuple like ``state.weights``: take the surprise there (chunk rule).

    Returns:
      ``(y_t [B, H, V] in v_t's dtype, new TitansMLPState f32)``.
    """
    fn = "titans_mlp_step"
    B, _, H, K, V = _validate_common(
        fn, q_t, k_t, v_t, theta_t, eta_t, alpha_t, grad_clip, per_token=True
    )
    _check_state(fn, state, B, H, K, V)
    res = _resolve_residual(fn, residual, len(state.weights), K, V)
    f = lambda x: x.astype(jnp.float32)  # noqa: E731
    if anchor is not None:
        _validate_weights(fn, "anchor", anchor, B, H, K, V)
        anchor = tuple(f(w) for w in anchor)
    y, new = _step_math(
        _f32_state(state), f(q_t), f(k_t), f(v_t), f(theta_t), f(eta_t), f(alpha_t),
        activation, res, read_before_write, grad_clip, anchor,
    )  # fmt: skip
    return y.astype(v_t.dtype), new


def titans_mlp_recurrent(
    state: TitansMLPState,
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    activation: Activation = jax.nn.silu,
    residual=None,
    read_before_write: bool = False,
    grad_clip: float | None = DEFAULT_MLP_GRAD_CLIP,
    segment_ids=None,
    reset_state: TitansMLPState | None = None,
    grad_horizon: int = 0,
):
    """Titans memory over a sequence token by token (``lax.scan`` of the step; ground truth).

    Args:
      state: initial ``TitansMLPState`` (weights usually learned outer params, momentum zero; see
        ``titans_mlp_state``), arrays ``[B, H, d_l, d_{l+1}]``.
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      activation, residual, read_before_write, grad_clip: as ``titans_mlp_step``.
      segment_ids: optional ``[B, T]`` int (packed sequences, SPEC §0): the state resets to
        ``reset_state`` before the first token of every segment after the first.
      reset_state: the state a segment start resets to (default ``state``; a caller that carries
        the state across calls passes the learned initial state here).
      grad_horizon: truncated backprop, ``n ≥ 0``: the carried state is a ``stop_gradient``
        before every position that is a positive multiple of n (values unchanged; 0 = off).

    Returns:
      ``(y [B, T, H, V] in v's dtype, final TitansMLPState f32)``.
    """
    fn = "titans_mlp_recurrent"
    B, T, H, K, V = _validate_common(fn, q, k, v, theta, eta, alpha, grad_clip, per_token=False)
    _check_state(fn, state, B, H, K, V)
    _validate_segment_ids(fn, segment_ids, B, T)
    _validate_horizon(fn, grad_horizon, 1)
    res = _resolve_residual(fn, residual, len(state.weights), K, V)
    tm = lambda x: jnp.moveaxis(x, 1, 0).astype(jnp.float32)  # noqa: E731
    st0 = _f32_state(state)
    if reset_state is not None:
        _check_state(fn + " (reset_state)", reset_state, B, H, K, V)
    st_r = st0 if reset_state is None else _f32_state(reset_state)
    resets = None if segment_ids is None else tm(_segment_resets(segment_ids))
    cut = None
    if grad_horizon:
        t_idx = np.arange(T)
        cut = jnp.asarray((t_idx % grad_horizon == 0) & (t_idx > 0))

    def body(st, xs):
        *xs, r, c = xs
        if c is not None:
            st = _stop_gradient_where(c, st)
        if r is not None:
            st = jax.tree.map(lambda a, b: jnp.where(r[:, None, None, None] > 0, b, a), st, st_r)
        y, st = _step_math(st, *xs, activation, res, read_before_write, grad_clip)
        return st, y

    xs = tuple(map(tm, (q, k, v, theta, eta, alpha))) + (resets, cut)
    st, y = lax.scan(body, st0, xs)
    return jnp.moveaxis(y, 0, 1).astype(v.dtype), st


# --------------------------------------------------------------------------------------------------
# Chunked form (dual form inside chunks, scan across chunks)
# --------------------------------------------------------------------------------------------------


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


def _coefficients(eta, alpha):
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


def _surprise_factors(W, k, v, th, activation, residual, grad_clip):
    """Rank-1 factors ``(a_l, δ_l)`` of every token's surprise at ``W``; θ with the softclamp."""
    out, inputs, pre = _forward(W, k, activation, residual)
    deltas = _backward(W, pre, out - v, activation)
    if grad_clip is not None:
        sq = sum(
            jnp.sum(jnp.square(a), -1) * jnp.sum(jnp.square(d), -1)
            for a, d in zip(inputs, deltas, strict=True)
        )
        th = th * _softclamp_factor(sq, grad_clip)
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


def _chunk_body(carry, xs, *, init, activation, residual, rbw, grad_clip):
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
    packed = reset is not None
    if packed:
        W0, S0, Wa = carry
        bc = lambda f: f[:, :, None, None] > 0  # noqa: E731  [B, 1] flag → weights
        Wa = tuple(jnp.where(bc(bound[..., 0]), w, a) for w, a in zip(W0, Wa, strict=True))
    else:
        W0, S0 = carry
        Wa = W0
    inputs, deltas, th_c = _surprise_factors(Wa, k, v, th, activation, residual, grad_clip)
    mats = list(zip(W0, S0, strict=True))
    if packed:
        Wi, Si = init
        after = (jnp.cumsum(reset, axis=-1) > 0)[..., None]  # token j is past a reset
        # Most chunks of packed rows hold no document start: skip the second set of factors then.
        in_i, de_i, th_i = lax.cond(
            jnp.any(after),
            lambda: _surprise_factors(Wi, k, v, th, activation, residual, grad_clip),
            lambda: (inputs, deltas, th_c),
        )
        inputs = [jnp.where(after, x, y) for x, y in zip(in_i, inputs, strict=True)]
        deltas = [jnp.where(after, x, y) for x, y in zip(de_i, deltas, strict=True)]
        th_c = jnp.where(after[..., 0], th_i, th_c)
        keep = 1.0 - reset
        src_m, src_s = reset * (1.0 - al), reset * et
        et, al = et * keep, 1.0 - (1.0 - al) * keep
        mats = list(zip(W0, S0, Wi, Si, strict=True))
    A, C, E, peta, D = _coefficients(et, al)
    coef_w, coef_s = [A, C], [jnp.zeros_like(E), E]  # coefficients of (W⁰, S⁰[, W^i, S^i])
    if packed:
        palpha = _seg_prod(1.0 - al)[..., :, 1:]
        coef_w += [
            jnp.einsum("...ti,...i->...t", palpha, src_m),
            jnp.einsum("...tj,...j->...t", D, src_s),
        ]
        coef_s += [jnp.zeros_like(E), jnp.einsum("...tj,...j->...t", peta, src_s)]
        # A document-local chunk start at offset r > 0: anchor W_r for tokens r.. (until a reset).
        bnd = bound.at[..., 0].set(0.0)
        row_r = jnp.pad(bnd, [(0, 0)] * (bnd.ndim - 1) + [(0, 1)])  # token offset r ↔ row r

        def with_bound():
            W_r, _ = _state_at(row_r, mats, coef_w, coef_s, D, peta, th_c, inputs, deltas)
            return _surprise_factors(W_r, k, v, th, activation, residual, grad_clip), W_r

        (in_r, de_r, th_r), W_r = lax.cond(
            jnp.any(bnd > 0), with_bound, lambda: ((inputs, deltas, th_c), Wa)
        )
        mid = ((jnp.cumsum(bnd, axis=-1) > 0) & ~after[..., 0])[..., None]
        inputs = [jnp.where(mid, x, y) for x, y in zip(in_r, inputs, strict=True)]
        deltas = [jnp.where(mid, x, y) for x, y in zip(de_r, deltas, strict=True)]
        th_c = jnp.where(mid[..., 0], th_r, th_c)
        # Anchor of the next chunk's first token: W^i after a reset here, else W_r, else W^a.
        has_r, has_i = bc(jnp.sum(bnd, -1)), bc(jnp.sum(reset, -1))
        Wa = tuple(
            jnp.where(has_i, wi, jnp.where(has_r, wr, wa))
            for wi, wr, wa in zip(Wi, W_r, Wa, strict=True)
        )
    rows = slice(0, -1) if rbw else slice(1, None)
    Dr = D[..., rows, :] * th_c[..., None, :]
    z = q
    for i, ms in enumerate(mats):
        za = jnp.einsum("...td,...jd->...tj", z, inputs[i])
        h = -jnp.einsum("...tj,...je->...te", Dr * za, deltas[i])
        for c, m in zip(coef_w, ms, strict=True):
            h = h + c[..., rows, None] * jnp.einsum("...td,...de->...te", z, m)
        z = activation(h) if i < len(mats) - 1 else h
    y = z + q if residual else z
    # State after the chunk's last real token.
    W_new, S_new = _state_at(sel, mats, coef_w, coef_s, D, peta, th_c, inputs, deltas)
    return ((W_new, S_new, Wa) if packed else (W_new, S_new)), y


def _chunk_pool(x, b, T):
    """Mean of ``x [B, T, H]`` over the real tokens of each chunk, back to ``[B, T, H]``."""
    B, _, H = x.shape
    N = -(-T // b)
    xp = jnp.pad(x, ((0, 0), (0, N * b - T), (0, 0))).reshape(B, N, b, H)
    counts = jnp.minimum(b, T - b * jnp.arange(N)).astype(x.dtype)
    mean = xp.sum(2) / counts[None, :, None]
    return jnp.repeat(mean, b, axis=1)[:, :T]


def titans_pool_gates(x, chunk_size: int):
    """Per-chunk gates (SPEC §2 option): each token's gate becomes the mean over its chunk.

    Args:
      x: ``[B, T, H]`` gate (θ, η or α); chunks are ``[n·chunk_size, (n+1)·chunk_size)``, the last
        one possibly shorter (mean over its real tokens only).

    Returns:
      ``[B, T, H]``. ``titans_*_chunked(..., per_chunk_gates=True)`` equals the chunked form fed
      with these pooled gates.
    """
    _validate_chunk_size("titans_pool_gates", chunk_size)
    if _shape(x) is None or x.ndim != 3:
        raise ValueError(f"titans_pool_gates: x must have shape [B, T, H], got {_shape(x)}")
    return _chunk_pool(x, chunk_size, x.shape[1])


def _to_chunks(x, b, N):
    """``[B, T, H, ...]`` → ``[N, B, H, b, ...]`` (zero padded at the end)."""
    T = x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, N * b - T)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], N, b, *x.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def _segment_resets(segment_ids):
    """``[B, T]`` float 0/1: 1 where the state resets before token t (a new segment, t > 0)."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros_like(change[:, :1]), change], axis=1).astype(jnp.float32)


def _local_chunk_starts(resets, b):
    """``[B, T]`` float 0/1: 1 where a document-local chunk starts inside a document (its local
    position is a positive multiple of b; the row's first document starts at position 0)."""
    t = jnp.arange(resets.shape[1])
    start = lax.cummax(jnp.where(resets > 0, t, 0), axis=1)
    lp = t - start
    return ((lp % b == 0) & (lp > 0)).astype(jnp.float32)


def _chunked_core(
    weights, momentum, q, k, v, theta, eta, alpha, *,
    chunk_size, activation, residual, rbw, grad_clip, per_chunk_gates, remat, segment_ids=None,
    reset_state=None, grad_horizon=0,
):  # fmt: skip
    """Shared chunked engine (validated inputs): ``(y [B,T,H,V] f32, (W, S) f32 tuples)``.

    ``reset_state``: ``(W, S)`` tuples a segment start resets to (default the initial carry);
    ``grad_horizon``: cut the carried state's gradient before every chunk starting at a positive
    multiple of it (a multiple of ``chunk_size``).
    """
    B, T, H, _ = q.shape
    b = chunk_size
    N = -(-T // b)
    f32 = jnp.float32
    q, k, v, theta, eta, alpha = (x.astype(f32) for x in (q, k, v, theta, eta, alpha))
    if per_chunk_gates:
        theta, eta, alpha = (_chunk_pool(x, b, T) for x in (theta, eta, alpha))
    last = jnp.minimum(b, T - b * jnp.arange(N))  # row index (1..b) of each chunk's last real token
    sel = jax.nn.one_hot(last, b + 1, dtype=f32)
    carry = (tuple(w.astype(f32) for w in weights), tuple(s.astype(f32) for s in momentum))
    init = carry
    if reset_state is not None:
        init = tuple(tuple(a.astype(f32) for a in part) for part in reset_state)
    xs = tuple(_to_chunks(x, b, N) for x in (q, k, v, theta, eta, alpha)) + (sel,)
    cut = None
    if grad_horizon:
        starts = np.arange(N) * b
        cut = jnp.asarray((starts % grad_horizon == 0) & (starts > 0))

    def run(carry, xs):
        body = lambda c, x: _chunk_body(  # noqa: E731
            c, x, init=init, activation=activation, residual=residual, rbw=rbw,
            grad_clip=grad_clip,
        )  # fmt: skip
        if remat:
            body = jax.checkpoint(body, prevent_cse=False)
        if cut is not None:
            inner = body

            def body(c, x):
                return inner(_stop_gradient_where(x[-1], c), x[:-1])

        carry, y = lax.scan(body, carry, xs + ((cut,) if cut is not None else ()))
        y = jnp.moveaxis(y, 0, 2).reshape(B, H, N * b, -1)[:, :, :T]  # y [N, B, H, b, V]
        return jnp.moveaxis(y, 1, 2), carry[:2]

    if segment_ids is None:
        return run(carry, xs + (None, None))
    r = _segment_resets(segment_ids)
    reset = _to_chunks(r[:, :, None], b, N)  # [B, T] → [N, B, 1, b]
    bound = _to_chunks(_local_chunk_starts(r, b)[:, :, None], b, N)
    # Rows without a document start (most rows of long documents) take the plain engine.
    return lax.cond(
        jnp.any(r > 0),
        lambda: run((*carry, carry[0]), xs + (reset, bound)),  # + the anchor W^a of the grid
        lambda: run(carry, xs + (None, None)),
    )


def titans_mlp_chunked(
    state: TitansMLPState,
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    chunk_size: int = 16,
    activation: Activation = jax.nn.silu,
    residual=None,
    read_before_write: bool = False,
    grad_clip: float | None = DEFAULT_MLP_GRAD_CLIP,
    per_chunk_gates: bool = False,
    remat: bool = True,
    segment_ids=None,
    reset_state: TitansMLPState | None = None,
    grad_horizon: int = 0,
):
    """Titans memory in chunks of ``chunk_size`` (SPEC §2 parallel form, dual-form reads).

    Gradients inside a chunk are taken at the chunk-start weights; momentum and decay are exact;
    each token reads with its own ``M_t`` (or ``M_{t-1}``) through the dual form.
    ``chunk_size=1`` equals ``titans_mlp_recurrent``. Any ``T`` (the last chunk is padded; padding
    never reaches the state).

    Args:
      state: initial ``TitansMLPState`` ``[B, H, d_l, d_{l+1}]`` arrays.
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      chunk_size: b.
      activation, residual, read_before_write, grad_clip: as ``titans_mlp_step``.
      per_chunk_gates: replace θ, η, α by their per-chunk means (``titans_pool_gates``).
      remat: recompute each chunk in the backward pass (saves only the carried state per chunk).
      segment_ids: optional ``[B, T]`` int (packed sequences): the state resets to
        ``reset_state`` at every segment start, and each segment keeps its own chunk grid
        (chunks of b tokens from its first token; a token's surprise is taken at the weights at
        the start of its segment-local chunk). Every segment then gets exactly the outputs of a
        separate call on it, wherever it starts in the row. Costs up to two more surprise
        evaluations per chunk where a segment starts or a segment-local chunk starts mid-chunk
        (skipped by ``lax.cond`` elsewhere).
      reset_state: the state a segment start resets to (default ``state``; a caller that carries
        the state across calls passes the learned initial state here).
      grad_horizon: truncated backprop, a multiple of ``chunk_size`` (0 = off): the carried state
        is a ``stop_gradient`` before every chunk starting at a positive multiple of it. Values
        are unchanged; gradients stop flowing through the inner loop after that many tokens.

    Returns:
      ``(y [B, T, H, V] in v's dtype, final TitansMLPState f32)``.
    """
    fn = "titans_mlp_chunked"
    B, T, H, K, V = _validate_common(fn, q, k, v, theta, eta, alpha, grad_clip, per_token=False)
    _validate_chunk_size(fn, chunk_size)
    _check_state(fn, state, B, H, K, V)
    _validate_segment_ids(fn, segment_ids, B, T)
    _validate_horizon(fn, grad_horizon, chunk_size)
    if reset_state is not None:
        _check_state(fn + " (reset_state)", reset_state, B, H, K, V)
    res = _resolve_residual(fn, residual, len(state.weights), K, V)
    y, (W, S) = _chunked_core(
        state.weights, state.momentum, q, k, v, theta, eta, alpha,
        chunk_size=chunk_size, activation=activation, residual=res, rbw=read_before_write,
        grad_clip=grad_clip, per_chunk_gates=per_chunk_gates, remat=remat,
        segment_ids=segment_ids, reset_state=reset_state, grad_horizon=grad_horizon,
    )  # fmt: skip
    return y.astype(v.dtype), TitansMLPState(W, S)
