"""Titans neural long-term memory (SPEC §2): the linear (matrix) memory API of SPEC §0.1.

Per head, ``M, S ∈ R^{K×V}`` (stored ``[B, H, K, V]``), inner loss ``ℓ(M; k, v) = ½‖Mᵀk − v‖²``
whose gradient is ``u_t = k_t (M_{t-1}ᵀ k_t − v_t)ᵀ``::

    S_t = η_t S_{t-1} − θ_t u_t          (momentum / past surprise)
    M_t = (1 − α_t) M_{t-1} + S_t        (forgetting = weight decay)
    o_t = M_tᵀ q_t                       (read_before_write=True: o_t = M_{t-1}ᵀ q_t)

No scale is applied to q (SPEC §0.1: the layer normalises q, k). ``theta`` is the inner learning
rate, ``eta`` the momentum, ``alpha`` the forget gate, all ``[B, T, H]`` in ``(0, 1)``. The static
options are one :class:`~nested_jax.rules.TitansRule` (``rule=``; default ``TitansRule()``,
exactly SPEC §0.1): ``rule.grad_clip = c > 0`` softclamps ``u_t`` to norm ``c·tanh(‖u_t‖/c)``
with ``‖u_t‖ = ‖k_t‖‖M_{t-1}ᵀk_t − v_t‖``; the matrix memory has no activation.

Three forms with one meaning (SPEC §0): ``titans_linear_step`` (one token),
``titans_linear_recurrent`` (``lax.scan`` of the step; ground truth) and ``titans_linear_chunked``
(gradients at chunk start, exact momentum/decay inside the chunk, dual-form reads;
``memory_chunk = 1`` equals the recurrence). The chunked form is the ``L_M = 1`` case of the MLP
engine in :mod:`nested_jax.core.titans.chunk` (deep-memory API: ``titans.mlp``,
``titans.chunk``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.dgd import clamped_rate
from nested_jax.core.scan import state_zeros
from nested_jax.core.titans.chunk import _chunked_core
from nested_jax.core.titans.net import (
    _stop_gradient_where,
    check_rule,
    horizon_cuts,
    segment_resets,
    validate_common,
    validate_horizon,
    validate_segment_ids,
)
from nested_jax.rules import TitansRule

__all__ = [
    "TitansLinearState",
    "titans_linear_step",
    "titans_linear_recurrent",
    "titans_linear_chunked",
]


class TitansLinearState(NamedTuple):
    """Matrix memory state (SPEC §0.1): ``M`` (memory), ``S`` (momentum), both ``[B, H, K, V]``."""

    M: jax.Array
    S: jax.Array


def state_of(fn: str, x, B, H, K, V, name: str = "initial_state", like=None) -> TitansLinearState:
    """None → zeros; a bare ``[B, H, K, V]`` array → ``(M, 0)``; a state tuple is checked.

    ``like = (k, v)``: the zeros are typed like those inputs (``scan.state_zeros``), as the carry
    of a scan over them must be under ``jax.shard_map`` and on Explicit meshes."""
    f32 = jnp.float32
    if x is None:
        z = jnp.zeros((B, H, K, V), f32) if like is None else state_zeros(*like)
        return TitansLinearState(z, z)
    M, S = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
    for nm, a in ((f"{name}.M", M), (f"{name}.S", S)):
        if a is None:
            continue
        shape = getattr(a, "shape", None)
        if shape != (B, H, K, V):
            raise ValueError(
                f"{fn}: {nm} must have shape [B, H, K, V] = {(B, H, K, V)}, got {shape}"
            )
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{fn}: {nm} must have a floating dtype, got {a.dtype}")
    M = M.astype(f32)
    return TitansLinearState(M, jnp.zeros_like(M) if S is None else S.astype(f32))


def _linear_step_math(state, token, rule: TitansRule, anchor=None):
    """One token in f32: ``token = (q, k, v, θ, η, α)`` with ``q, k [B,H,K]``, ``v [B,H,V]``,
    gates ``[B,H]``; surprise at anchor."""
    M, S = state
    q, k, v, th, et, al = token
    err = jnp.einsum("bhk,bhkv->bhv", k, M if anchor is None else anchor) - v
    # the rank-1 surprise k errᵀ softclamped (0: off)
    th = clamped_rate(th, err, k, float(rule.grad_clip))
    u = k[..., :, None] * err[..., None, :]
    S = et[..., None, None] * S - th[..., None, None] * u
    M_new = (1.0 - al)[..., None, None] * M + S
    o = jnp.einsum("bhk,bhkv->bhv", q, M if rule.read_before_write else M_new)
    return o, TitansLinearState(M_new, S)


def titans_linear_step(
    state,
    q_t,
    k_t,
    v_t,
    theta_t,
    eta_t,
    alpha_t,
    *,
    rule: TitansRule = TitansRule(),
    anchor=None,
):
    """One token of the Titans matrix memory (SPEC §2 with L_M = 1, SPEC §0.1).

    ``u = k_t (M_{t-1}ᵀ k_t − v_t)ᵀ``, ``S_t = η_t S_{t-1} − θ_t u``,
    ``M_t = (1 − α_t) M_{t-1} + S_t``, ``o_t = M_tᵀ q_t`` (``M_{t-1}ᵀ q_t`` with
    ``rule.read_before_write``).

    Decoding consistently with ``titans_linear_chunked`` (chunks of ``b = rule.memory_chunk``):
    pass ``anchor`` = ``M`` at the start of the current chunk (set ``anchor = state.M`` before
    every token whose position is a multiple of b); the surprise is then
    ``k_t (anchorᵀ k_t − v_t)ᵀ``, exactly the chunk rule.

    Args:
      state: ``TitansLinearState(M, S)`` or a bare ``M`` (zero momentum), ``[B, H, K, V]``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; theta_t, eta_t, alpha_t: ``[B, H]``.
      rule: :class:`~nested_jax.rules.TitansRule`: ``read_before_write`` and ``grad_clip``
        (softclamp of ``‖u‖``, 0 = off) apply.
      anchor: optional ``[B, H, K, V]``: take the surprise at this memory (chunk rule).

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, TitansLinearState f32)``.
    """
    fn = "titans_linear_step"
    check_rule(fn, rule)
    B, _, H, K, V = validate_common(fn, q_t, k_t, v_t, theta_t, eta_t, alpha_t, per_token=True)
    if state is None:
        raise ValueError(f"{fn}: state must be a TitansLinearState(M, S) of [B, H, K, V], got None")
    st = state_of(fn, state, B, H, K, V, name="state")
    f = lambda x: x.astype(jnp.float32)  # noqa: E731
    if anchor is not None:
        anchor = state_of(fn, anchor, B, H, K, V, name="anchor").M
    token = tuple(f(x) for x in (q_t, k_t, v_t, theta_t, eta_t, alpha_t))
    o, st = _linear_step_math(st, token, rule, anchor)
    return o.astype(v_t.dtype), st


def titans_linear_recurrent(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state=None,
    rule: TitansRule = TitansRule(),
    segment_ids=None,
):
    """Titans matrix memory token by token (``lax.scan`` of ``titans_linear_step``; ground truth).

    SPEC §2 with L_M = 1 and the SPEC §0.1 signature.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      initial_state: None (zeros), ``TitansLinearState(M, S)`` or a bare ``M``, ``[B, H, K, V]``.
      rule: :class:`~nested_jax.rules.TitansRule`, as ``titans_linear_step``; ``grad_horizon =
        n`` cuts the carried state's gradient before every position that is a positive multiple
        of n (values unchanged; 0 = off).
      segment_ids: optional ``[B, T]`` int (packed sequences, SPEC §0): the state resets to
        ``initial_state`` before the first token of every segment after the first.

    Returns:
      ``(o [B, T, H, V] in v's dtype, TitansLinearState(M, S) f32 [B, H, K, V])``.
    """
    fn = "titans_linear_recurrent"
    check_rule(fn, rule)
    B, T, H, K, V = validate_common(fn, q, k, v, theta, eta, alpha, per_token=False)
    validate_segment_ids(fn, segment_ids, B, T)
    st0 = state_of(fn, initial_state, B, H, K, V, like=(k, v))
    tm = lambda x: jnp.moveaxis(x, 1, 0).astype(jnp.float32)  # noqa: E731
    resets = None if segment_ids is None else tm(segment_resets(segment_ids))
    cut = horizon_cuts(T, 1, rule.grad_horizon)

    def body(s, xs):
        *token, r, c = xs
        if c is not None:
            s = _stop_gradient_where(c, s)
        if r is not None:
            s = jax.tree.map(lambda a, b: jnp.where(r[:, None, None, None] > 0, b, a), s, st0)
        o, s = _linear_step_math(s, token, rule)
        return s, o

    xs = tuple(map(tm, (q, k, v, theta, eta, alpha))) + (resets, cut)
    st, o = lax.scan(body, st0, xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), st


def titans_linear_chunked(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state=None,
    rule: TitansRule = TitansRule(),
    segment_ids=None,
):
    """Titans matrix memory in chunks (SPEC §2 parallel form with L_M = 1; SPEC §0.1 signature).

    Inside a chunk of size ``b = rule.memory_chunk`` all surprises are taken at the chunk-start
    memory ``M⁰``: ``u_j = k_j (M⁰ᵀ k_j − v_j)ᵀ``; then exactly
    ``M_t = A_t M⁰ + C_t S⁰ − Σ_{j≤t} D_tj θ_j u_j`` and
    ``o_t = A_t M⁰ᵀq_t + C_t S⁰ᵀq_t − Σ_j D_tj θ_j (q_t·k_j) e_j`` (coefficients from the
    momentum and decay products, see ``titans.chunk``). ``memory_chunk = 1`` equals
    ``titans_linear_recurrent``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``; any T.
      initial_state: None (zeros), ``TitansLinearState(M, S)`` or a bare ``M``, ``[B, H, K, V]``.
      rule: :class:`~nested_jax.rules.TitansRule`, every field but ``activation`` (as
        ``titans_mlp_chunked``): ``memory_chunk``, ``read_before_write``, ``grad_clip``,
        ``per_chunk_gates``, ``remat`` (saves only ``(M, S)`` per chunk), ``grad_horizon``.
      segment_ids: optional ``[B, T]`` int: resets to ``initial_state`` at segment starts (see
        ``titans_mlp_chunked``).

    Returns:
      ``(o [B, T, H, V] in v's dtype, TitansLinearState(M, S) f32 [B, H, K, V])``.
    """
    fn = "titans_linear_chunked"
    check_rule(fn, rule)
    B, T, H, K, V = validate_common(fn, q, k, v, theta, eta, alpha, per_token=False)
    validate_segment_ids(fn, segment_ids, B, T)
    validate_horizon(fn, rule)
    st = state_of(fn, initial_state, B, H, K, V, like=(k, v))
    o, (W, S) = _chunked_core(
        ((st.M,), (st.S,)), (q, k, v, theta, eta, alpha), rule=rule, residual=False,
        segment_ids=segment_ids,
    )  # fmt: skip
    return o.astype(v.dtype), TitansLinearState(W[0], S[0])
