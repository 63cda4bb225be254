"""A Hope chunk of a *linear* memory through the gated delta kernel (SPEC §3.2, §1).

It needs none of the MLP-memory machinery of :mod:`nested_jax.core.hope.chunk`, only
``core.dgd.dgd_step_size`` and ``core.associative.forms.gated_delta_chunked``. It takes the Hope
rule whole (``rule=``, a :class:`~nested_jax.rules.HopeRule`) and computes the rule's plain DGD
step: eq. 88's target, no momentum, no inner-gradient softclamp (another rule raises).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from nested_jax.core.associative.forms import gated_delta_chunked
from nested_jax.core.dgd import dgd_step_size
from nested_jax.core.hope.state import check_rule
from nested_jax.rules import HopeRule

__all__ = ["hope_linear_chunk_update"]


# The rule fields the gated delta form fixes: (field, the value it computes).
_LINEAR_RULE = (("dgd", True), ("dgd_target", "gradient"), ("momentum", False), ("grad_clip", 0.0))


def _check_linear_rule(rule: HopeRule) -> HopeRule:
    """``rule`` after checking the linear chunk computes it (:data:`_LINEAR_RULE`)."""
    check_rule("hope_linear_chunk_update", rule)
    for name, value in _LINEAR_RULE:
        if getattr(rule, name) != value:
            raise ValueError(
                f"hope_linear_chunk_update: rule.{name} must be {value!r} (the chunk is the plain "
                f"DGD step as a gated delta rule), got {getattr(rule, name)!r}"
            )
    return rule


def hope_linear_chunk_update(
    M0, k, v_hat, alpha, eta, *, rule: HopeRule = HopeRule(), chunk_size: int = 64,
    backbone: Callable = gated_delta_chunked,
):  # fmt: skip
    """One Hope chunk of a linear memory ``y = M z`` through the gated delta kernel (SPEC §3.2).

    ``M_t = M_{t−1}(α_t I − γ_t k_t k_tᵀ) − γ_t (M_0 k_t − v̂_t) k_tᵀ`` for ``t = 1..T`` (all
    signals at the chunk-start ``M_0``; ``γ_t`` from :func:`dgd_step_size`). With ``S = Mᵀ`` this is
    §1's gated delta rule with ``g = log α_t``, ``β_t = γ_t/α_t`` and values ``α_t(v̂_t − M_0 k_t)``,
    computed by :func:`gated_delta_chunked` (β may exceed 1). Self-generated targets: ``v̂ = M_0 v``.

    Args:
      M0: ``[B, H, V, K]`` chunk-start memory.
      k: ``[B, T, H, K]`` keys (the T tokens of one Hope chunk).
      v_hat: ``[B, T, H, V]`` targets.
      alpha: ``[B, T, H]`` retention in ``(0, 1]``.
      eta: ``[B, T, H]`` inner rate.
      rule: the :class:`~nested_jax.rules.HopeRule`; its ``step`` (``"exact"`` or ``"paper"``,
        SPEC §3.1) is read, and it must be the plain DGD step (``dgd``, ``dgd_target="gradient"``,
        no ``momentum``, ``grad_clip = 0``; ``ValueError`` otherwise). The chunk sizes do not
        apply: ``k``'s ``T`` tokens are the chunk.
      chunk_size: the kernel's WY chunk length (any value; not the Hope chunk).
      backbone: the gated delta rule it runs, with ``gated_delta_chunked``'s contract
        ``backbone(q, k, v, g, beta, scale=, initial_state=, chunk_size=) -> (o, state)``
        (``ops.hope.hope_linear_chunk`` passes ``ops.linear.gated_delta`` with its ``impl``, so
        the Pallas kernel runs it).

    Returns:
      ``M_T`` ``[B, H, V, K]`` (f32).
    """
    rule = _check_linear_rule(rule)
    M0, k, v_hat = jnp.asarray(M0), jnp.asarray(k), jnp.asarray(v_hat)
    if k.ndim != 4:
        raise ValueError(f"k must have shape [B, T, H, K], got {k.shape}")
    B, T, H, K = k.shape
    if M0.ndim != 4 or M0.shape[0] != B or M0.shape[1] != H or M0.shape[3] != K:
        raise ValueError(f"M0 must have shape [B={B}, H={H}, V, K={K}], got {M0.shape}")
    V = M0.shape[2]
    if v_hat.shape != (B, T, H, V):
        raise ValueError(f"v_hat must have shape [B, T, H, V]={(B, T, H, V)}, got {v_hat.shape}")
    for name, a in (("alpha", alpha), ("eta", eta)):
        if jnp.shape(a) != (B, T, H):
            raise ValueError(f"{name} must have shape [B, T, H]={(B, T, H)}, got {jnp.shape(a)}")
    f32 = jnp.promote_types(jnp.result_type(M0, k, v_hat), jnp.float32)
    M0, k, v_hat = M0.astype(f32), k.astype(f32), v_hat.astype(f32)
    alpha, eta = jnp.asarray(alpha, f32), jnp.asarray(eta, f32)
    gamma = dgd_step_size(eta, k, step=rule.step)
    M0k = jnp.einsum("bhvk,bthk->bthv", M0, k)
    values = alpha[..., None] * (v_hat - M0k)
    _, S = backbone(
        k,
        k,
        values,
        jnp.log(alpha),
        gamma / alpha,
        scale=1.0,
        initial_state=jnp.swapaxes(M0, -1, -2),
        chunk_size=chunk_size,
    )
    return jnp.swapaxes(S, -1, -2)
