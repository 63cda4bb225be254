"""The Titans MLP memory ``M_θ`` (SPEC §2): its state, checks, forward pass, inner-gradient factors.

Shared by the per-token forms (:mod:`nested_jax.core.titans.mlp`) and the chunked form
(:mod:`nested_jax.core.titans.chunk`); the math is in ``titans_mlp``'s docstring. Here:

- :class:`TitansMLPState` (weights and momenta ``[B, H, d_l, d_{l+1}]``) and the argument checks
  every form runs at trace time (messages name the calling function), the rule's included
  (:func:`check_rule`; a :class:`~nested_jax.rules.TitansRule` checks its own fields).
- :func:`activation_of`: the rule's activation name as its function.
- ``_forward`` / ``_backward``: ``M(z)`` with its layer inputs ``a_l`` and pre-activations, and the
  backpropagated ``δ_l``; one token's inner gradient for layer ``l`` is the rank-1 ``a_l δ_lᵀ``.
- ``segment_resets``: packed-row resets (SPEC §0) as the float mask the forms multiply with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nested_jax.core.scan import segment_starts
from nested_jax.rules import TitansRule

__all__ = ["ACTIVATIONS", "MLP_STATE_CONSTRUCTOR", "TitansMLPState", "activation_of", "check_rule"]

Activation = Callable[[jax.Array], jax.Array]
# The functions behind ``TitansRule.activation`` (every name of ``rules.TITANS_ACTIVATIONS``).
ACTIVATIONS: dict[str, Activation] = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
}
# What the error for a missing ``initial_state`` tells the caller to pass (SPEC §0: no zero state).
MLP_STATE_CONSTRUCTOR = "titans_mlp_state(weights, B)"


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


def check_rule(fn: str, rule) -> TitansRule:
    """``rule`` must be a :class:`TitansRule` (a config's ``TitansOptions`` is one); returns it."""
    if not isinstance(rule, TitansRule):
        raise ValueError(f"{fn}: rule must be a TitansRule, got {rule!r}")
    return rule


def activation_of(rule: TitansRule) -> Activation:
    """The function of ``rule.activation`` (SPEC §2: σ between the memory's layers)."""
    return ACTIVATIONS[rule.activation]


def validate_common(fn, q, k, v, theta, eta, alpha, per_token: bool):
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
    if per_token:
        B, H, K = q.shape
        return B, None, H, K, v.shape[-1]
    B, T, H, K = q.shape
    return B, T, H, K, v.shape[-1]


def validate_segment_ids(fn, segment_ids, B, T):
    if segment_ids is None:
        return
    if _shape(segment_ids) != (B, T):
        raise ValueError(
            f"{fn}: segment_ids must have shape [B, T] = {(B, T)}, got {_shape(segment_ids)}"
        )
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"{fn}: segment_ids must have an integer dtype, got {segment_ids.dtype}")


def validate_horizon(fn, rule: TitansRule):
    """A chunked form cuts the state between chunks: ``rule.grad_horizon`` must be a multiple of
    ``rule.memory_chunk``."""
    if rule.grad_horizon % rule.memory_chunk:
        raise ValueError(
            f"{fn}: rule.grad_horizon must be a multiple of rule.memory_chunk={rule.memory_chunk} "
            f"(the state is cut between chunks), got {rule.grad_horizon}"
        )


def horizon_cuts(n_steps: int, step: int, grad_horizon: int):
    """``[n_steps]`` bool (static): step ``i`` starts at position ``i·step``, a positive multiple
    of ``grad_horizon``, where the carried state's gradient is cut; None when ``grad_horizon`` is 0
    (full backprop)."""
    if not grad_horizon:
        return None
    starts = np.arange(n_steps) * step
    return jnp.asarray((starts % grad_horizon == 0) & (starts > 0))


def _stop_gradient_where(flag, tree):
    """``tree`` with its gradient cut where the scalar bool ``flag`` is set (values unchanged)."""
    return jax.tree.map(lambda a: jnp.where(flag, lax.stop_gradient(a), a), tree)


def validate_chunk_size(fn, chunk_size):
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


# --------------------------------------------------------------------------------------------------
# State and packed-row helpers
# --------------------------------------------------------------------------------------------------


def _f32_state(state):
    """``state`` with every array in f32 (the forms compute in f32)."""
    f = lambda t: tuple(x.astype(jnp.float32) for x in t)  # noqa: E731
    return TitansMLPState(f(state.weights), f(state.momentum))


def _check_state(fn, state, B, H, K, V, name="state"):
    """``state`` (the argument ``name``) must be a ``TitansMLPState`` of ``[B, H, d_l, d_{l+1}]``
    arrays chaining K → V."""
    if not isinstance(state, TitansMLPState):
        raise ValueError(
            f"{fn}: {name} must be a TitansMLPState(weights, momentum), got {type(state)}"
        )
    _validate_weights(fn, f"{name}.weights", state.weights, B, H, K, V)
    if not isinstance(state.momentum, (tuple, list)) or len(state.momentum) != len(state.weights):
        raise ValueError(f"{fn}: {name}.momentum must be a tuple like {name}.weights")
    for i, (w, s) in enumerate(zip(state.weights, state.momentum, strict=True)):
        if _shape(s) != w.shape:
            raise ValueError(
                f"{fn}: {name}.momentum[{i}] must have shape {w.shape}, got {_shape(s)}"
            )


def segment_resets(segment_ids):
    """``[B, T]`` float 0/1: 1 where the state resets before token t (a new segment, t > 0)."""
    return segment_starts(segment_ids).astype(jnp.float32)
