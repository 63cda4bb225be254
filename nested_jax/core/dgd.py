"""Delta Gradient Descent (DGD): the proximal step of a linear map on a regression target.

SPEC §3.1.

For a linear map ``y = W x`` with update signal ``g = ∂L/∂y``, DGD is the exact minimiser of::

    ½‖W x − u‖² + (1/2η)‖W − W_t‖²_F,        u = −g

which (Sherman–Morrison on ``(I + η x xᵀ)⁻¹``) is::

    W_{t+1} = W_t (I − γ x xᵀ) − γ g xᵀ,       γ = η / (1 + η ‖x‖²)

and with retention ``α``::

    W_{t+1} = W_t (α I − γ x xᵀ) − γ g xᵀ = α W_t − γ (W_t x + g) xᵀ.

**Decision (SPEC §3.1):** the Sherman–Morrison ``γ`` is the default (``step="exact"``);
``step="paper"`` uses ``γ = η / (1 + η)`` as printed in the paper (eq. 57), which equals the exact
step when ``‖x‖ = 1``.
Note that DGD shrinks ``W`` along ``x`` even when ``g = 0`` (plain GD would not move).

Nothing here forms a ``d_in × d_in`` matrix: ``W x xᵀ`` is computed as the outer product
``(W x) xᵀ``. For a multi-layer memory, DGD applies per layer with that layer's own input ``x_ℓ``
and backpropagated output signal ``g_ℓ = ∂L/∂y_ℓ`` (:func:`dgd_update_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from nested_jax.rules import DGD_TARGETS

__all__ = [
    "clamped_rate",
    "dgd_step_size",
    "dgd_update",
    "dgd_update_layers",
    "softclamp_factor",
]

_STEPS = ("exact", "paper")


def _check_step(step: str) -> None:
    if step not in _STEPS:
        raise ValueError(f"step must be one of {_STEPS}, got {step!r}")


def _broadcast_or_raise(name: str, shape, batch_shape, expected: str):
    try:
        return np.broadcast_shapes(tuple(shape), tuple(batch_shape))
    except ValueError:
        raise ValueError(
            f"{name} has shape {tuple(shape)}, which does not broadcast with the batch shape "
            f"{tuple(batch_shape)}; expected {expected}"
        ) from None


def softclamp_factor(sq_norm, c):
    """``c·tanh(n/c)/n`` with ``n = sqrt(sq_norm)``; 1 at ``n = 0`` (double where: finite grads).

    Scaling a step by it softclamps the step's norm ``n`` to ``c·tanh(n/c) < c`` (Titans'
    ``grad_clip``, Hope's ``grad_clip``)."""
    pos = sq_norm > 0
    n = jnp.sqrt(jnp.where(pos, sq_norm, 1.0))
    return jnp.where(pos, c * jnp.tanh(n / c) / n, 1.0)


def clamped_rate(lr, g, x, grad_clip: float | None):
    """The inner rate with the layer gradient ``G = g xᵀ`` softclamped: ``η · c·tanh(n/c)/n``.

    ``n = ‖G‖_F = ‖g‖‖x‖`` per token (a rank-1 gradient), so the rate's step ``η G`` has norm at
    most ``η c`` (Hope's ``grad_clip``; Titans' matrix memory with ``g = err``,
    ``x = k``). ``grad_clip`` 0 or None returns ``lr`` unchanged.

    Args:
      lr: ``η`` ``[...]``; g: ``[..., d_out]`` layer signal; x: ``[..., d_in]`` layer input.
      grad_clip: ``c >= 0`` (0 or None: off).

    Returns:
      ``η`` scaled, shape ``broadcast(lr, g[..., 0])``.
    """
    if not grad_clip:
        return lr
    sq = jnp.sum(x * x, -1) * jnp.sum(g * g, -1)  # Titans' order (its gradients bit for bit)
    return lr * softclamp_factor(sq, grad_clip)


def dgd_step_size(lr, x, *, step: str = "exact"):
    """The DGD step size ``γ`` (SPEC §3.1).

    ``γ = η / (1 + η ‖x‖²)`` for ``step="exact"`` (Sherman–Morrison) and ``γ = η / (1 + η)`` for
    ``step="paper"`` (the paper's eq. 57, exact only when ``‖x‖ = 1``). Useful to map a DGD
    step onto a gated delta rule (``β = γ / α``, SPEC §3.2).

    Args:
      lr: ``η``, a scalar or an array broadcastable to ``x.shape[:-1]``.
      x: the layer input ``[..., d_in]``.
      step: ``"exact"`` or ``"paper"``.

    Returns:
      ``γ`` with shape ``broadcast(lr.shape, x.shape[:-1])`` in the promoted float dtype.
    """
    _check_step(step)
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"x must have shape [..., d_in], got a scalar of shape {x.shape}")
    lr = jnp.asarray(lr)
    _broadcast_or_raise("lr", lr.shape, x.shape[:-1], "a scalar or an array broadcastable to [...]")
    if step == "paper":
        # Evaluated on the broadcast shape so both forms return the same shape.
        return jnp.broadcast_to(lr / (1.0 + lr), jnp.broadcast_shapes(lr.shape, x.shape[:-1]))
    sq = jnp.sum(jnp.square(x), axis=-1)
    return lr / (1.0 + lr * sq)


def dgd_update(W, x, g, lr, retention=1.0, *, step: str = "exact", target: str = "gradient"):
    """One DGD step of a linear map ``y = W x`` (SPEC §0.1, §3.1).

    ``target="proximal"`` (SPEC §3.2 Decision) regresses ``W x`` onto ``u = W₀ x − g`` (the
    layer's own target at the current weights) instead of ``u = −g``, which gives
    ``W_new = α W − γ g xᵀ``: GD with the Sherman–Morrison step.

    ``W_new = W (α I − γ x xᵀ) − γ g xᵀ = α W − γ (W x + g) xᵀ`` with ``γ = η / (1 + η‖x‖²)``
    (``step="exact"``, the exact minimiser of ``½‖W x + g‖² + (1/2η)‖W − W₀‖²`` when ``α = 1``) or
    ``γ = η / (1 + η)`` (``step="paper"``). Batched over leading dims; no ``d_in × d_in`` matrix is
    formed.

    Args:
      W: weights ``[..., d_out, d_in]``.
      x: layer input ``[..., d_in]``; its leading dims broadcast with ``W``'s.
      g: output signal ``∂L/∂y`` ``[..., d_out]`` (``u = −g`` is the regression target).
      lr: ``η``, scalar or broadcastable to the batch shape ``[...]``.
      retention: ``α``, scalar or broadcastable to ``[...]`` (1 = no decay).
      step: ``"exact"`` (default, Sherman–Morrison) or ``"paper"``.
      target: ``"gradient"`` (eq. 88 as printed) or ``"proximal"``.

    Returns:
      ``W_new`` with the broadcast batch shape ``[..., d_out, d_in]`` and ``W``'s dtype. The
      arithmetic runs in the promoted dtype of ``W, x, g`` (at least f32).

    Raises:
      ValueError: naming the argument whose shape does not fit, or an unknown ``step``.
    """
    _check_step(step)
    if target not in DGD_TARGETS:
        raise ValueError(f"target must be one of {DGD_TARGETS}, got {target!r}")
    W, x, g = jnp.asarray(W), jnp.asarray(x), jnp.asarray(g)
    if W.ndim < 2:
        raise ValueError(f"W must have shape [..., d_out, d_in], got {W.shape}")
    d_out, d_in = W.shape[-2:]
    if x.ndim < 1 or x.shape[-1] != d_in:
        raise ValueError(
            f"x must have shape [..., d_in={d_in}] to match W {W.shape}, got {x.shape}"
        )
    if g.ndim < 1 or g.shape[-1] != d_out:
        raise ValueError(
            f"g must have shape [..., d_out={d_out}] to match W {W.shape}, got {g.shape}"
        )
    batch = _broadcast_or_raise("x", x.shape[:-1], W.shape[:-2], f"[..., {d_in}] matching W")
    batch = _broadcast_or_raise("g", g.shape[:-1], batch, f"[..., {d_out}] matching W and x")
    lr = jnp.asarray(lr)
    retention = jnp.asarray(retention)
    _broadcast_or_raise("lr", lr.shape, batch, f"a scalar or an array broadcastable to {batch}")
    _broadcast_or_raise(
        "retention", retention.shape, batch, f"a scalar or an array broadcastable to {batch}"
    )

    cdt = jnp.promote_types(jnp.result_type(W, x, g), jnp.float32)
    Wc, xc, gc = W.astype(cdt), x.astype(cdt), g.astype(cdt)
    gamma = dgd_step_size(lr.astype(cdt), xc, step=step)  # [...x]
    Wx = jnp.einsum("...oi,...i->...o", Wc, xc)
    resid = Wx + gc if target == "gradient" else gc  # W x − u
    gamma = gamma[..., None, None]
    alpha = retention.astype(cdt)[..., None, None]
    W_new = alpha * Wc - gamma * (resid[..., :, None] * xc[..., None, :])
    return W_new.astype(W.dtype)


def dgd_update_layers(
    weights: Sequence,
    inputs: Sequence,
    signals: Sequence,
    lr,
    retention=1.0,
    *,
    step: str = "exact",
) -> list:
    """Per-layer DGD for a multi-layer (e.g. MLP) memory (SPEC §3.1, last paragraph).

    Layer ``ℓ`` computes ``y_ℓ = W_ℓ x_ℓ``; it is updated with its own input ``x_ℓ`` and its
    backpropagated output signal ``g_ℓ = ∂L/∂y_ℓ`` (both taken at the pre-update weights):
    ``W_ℓ ← W_ℓ (α I − γ_ℓ x_ℓ x_ℓᵀ) − γ_ℓ g_ℓ x_ℓᵀ``, ``γ_ℓ`` computed from ``‖x_ℓ‖``.
    For the residual MLP ``M(z) = z + W_1 σ(W_2 z)`` with ``e = M(k) − v̂``: ``W_1`` has input
    ``σ(W_2 k)`` and signal ``e``; ``W_2`` has input ``k`` and signal ``σ'(W_2 k) ⊙ (W_1ᵀ e)``.

    Args:
      weights: sequence of ``W_ℓ [..., d_out_ℓ, d_in_ℓ]``.
      inputs: sequence of ``x_ℓ [..., d_in_ℓ]``, same length.
      signals: sequence of ``g_ℓ [..., d_out_ℓ]``, same length.
      lr: ``η`` shared by all layers (scalar or broadcastable to ``[...]``), or a sequence of
        per-layer ones.
      retention: ``α`` likewise.
      step: ``"exact"`` or ``"paper"``.

    Returns:
      list of updated weights, one per layer.
    """
    n = len(weights)
    if len(inputs) != n:
        raise ValueError(f"inputs must have one entry per layer ({n}), got {len(inputs)}")
    if len(signals) != n:
        raise ValueError(f"signals must have one entry per layer ({n}), got {len(signals)}")

    def per_layer(name, value):
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name} as a sequence must have {n} entries, got {len(value)}")
            return list(value)
        return [value] * n

    lrs, rets = per_layer("lr", lr), per_layer("retention", retention)
    return [
        dgd_update(W, x, g, a, r, step=step)
        for W, x, g, a, r in zip(weights, inputs, signals, lrs, rets, strict=True)
    ]
