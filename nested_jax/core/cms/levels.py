"""CMS levels and their fixed-weight forward (SPEC §3.3, §3.4): ``CMSLevel``, ``cms_forward``.

The online update mode, ``cms_online``, is in :mod:`nested_jax.core.cms.online`.

**Levels.** Each level is a residual MLP on row vectors ``x ∈ R^d`` (kernels stored row-major
like Flax ``Dense`` kernels, so a Transformer FFN can be copied into a level, SPEC §3.4)::

    plain  (w_gate is None):  MLP(x) = x + σ(x W_up) W_down                 (SPEC §3.2 form)
    gated  (SwiGLU):          MLP(x) = x + (σ(x W_gate) ⊙ x W_up) W_down

with ``W_up, W_gate ∈ R^{d×h}``, ``W_down ∈ R^{h×d}``, ``σ`` = SiLU. In column form the plain level
is SPEC §3.2's ``M(z) = z + W_1 σ(W_2 z)`` with ``W_1 = W_downᵀ``, ``W_2 = W_upᵀ``.

**Variants** for ``k`` levels with periods ``C^(1) < … < C^(k)`` (tokens; level 1 is the fastest):

- ``sequential``: ``y = MLP_k(… MLP_1(x))``.
- ``independent`` (head-wise): ``y = Σ_ℓ w_ℓ MLP_ℓ(x)`` with ``w = softmax(mix_logits)``
  (learned, outer parameters; ``Σ w_ℓ = 1``, so the residual ``x`` passes with weight 1).
- ``nested``: only the fastest level computes the output, ``y = MLP_1(x)``; the slower levels are
  its (meta-learned) initial states. **Reading (documented decision):** level ℓ's *context* is
  one period of level ℓ+1. At the end of each period of level ℓ+1, level ℓ+1 applies its own
  update and then level ℓ is reset to level ℓ+1's (new) state (top-down, so a boundary of level
  ``m`` cascades to all faster levels). The slowest level is never reset. Requires
  ``C^(ℓ) | C^(ℓ+1)`` so a context holds whole periods of the faster level. Level ℓ+1's update
  signal is the first-order meta-gradient: the gradient of the loss w.r.t. the fast weights
  (``∂θ_ℓ/∂θ_ℓ,0 ≈ I``, as first-order MAML/Reptile), accumulated over level ℓ+1's period with its
  own rate. The given per-level parameters are the states at the start of the stream.

The periods ``C^(ℓ)`` matter only to the updates (``core.cms.online.cms_online``,
``nested_jax.optim.multifreq``); the forward here reads the levels as given. :class:`CMSRule`
holds the periods, the variant and the online inner step as one frozen value (``ops.cms`` takes it).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from nested_jax.rules import CMS_INNERS, CMS_VARIANTS

__all__ = [
    "CMSLevel",
    "VARIANTS",
    "INNERS",
    "cms_init_levels",
    "cms_level_apply",
    "cms_mix_weights",
    "cms_forward",
]

VARIANTS = CMS_VARIANTS
INNERS = CMS_INNERS  # inner optimizers of the online mode (``core.cms.online.cms_online``)


class CMSLevel(NamedTuple):
    """Parameters of one CMS level (a residual MLP; SPEC §3.3).

    Leaves may carry leading batch dims ``[..., ·]`` (online states are ``[B, ...]``).
    """

    w_up: Any  # [..., d, h]
    w_down: Any  # [..., h, d]
    w_gate: Any = None  # [..., d, h] for a SwiGLU level, None for the plain level


# ----------------------------------------------------------------------------------------------
# validation


def _check_variant(variant) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _check_levels(levels, d: int | None = None, batch: int | None = None) -> int:
    """Validates the level tuple; returns the model width ``d``."""
    if isinstance(levels, CMSLevel) or not isinstance(levels, (tuple, list)) or not levels:
        raise ValueError("levels must be a non-empty tuple of CMSLevel")
    lead = () if batch is None else (batch,)
    for i, lv in enumerate(levels):
        if not isinstance(lv, CMSLevel):
            raise ValueError(f"levels[{i}] must be a CMSLevel, got {type(lv).__name__}")
        up = jnp.shape(lv.w_up)
        n = len(lead)
        if len(up) != n + 2 or up[:n] != lead:
            raise ValueError(f"levels[{i}].w_up must have shape {(*lead, 'd', 'h')}, got {up}")
        dd, h = up[n:]
        if d is None:
            d = dd
        if dd != d:
            raise ValueError(f"levels[{i}].w_up must have shape {(*lead, d, 'h')}, got {up}")
        if jnp.shape(lv.w_down) != (*lead, h, d):
            raise ValueError(
                f"levels[{i}].w_down must have shape {(*lead, h, d)}, got {jnp.shape(lv.w_down)}"
            )
        if lv.w_gate is not None and jnp.shape(lv.w_gate) != (*lead, d, h):
            raise ValueError(
                f"levels[{i}].w_gate must be None or have shape {(*lead, d, h)}, "
                f"got {jnp.shape(lv.w_gate)}"
            )
    return d


def _check_x(x, d: int):
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != d:
        raise ValueError(f"x must have shape [B, T, d={d}], got {x.shape}")
    return x


def _check_mix(mix_logits, k: int, variant: str):
    if variant != "independent":
        if mix_logits is not None:
            raise ValueError(f"mix_logits is only used by variant='independent', got {variant!r}")
        return None
    if mix_logits is None:
        return jnp.zeros((k,), jnp.float32)
    mix_logits = jnp.asarray(mix_logits)
    if mix_logits.shape != (k,):
        raise ValueError(f"mix_logits must have shape [k={k}], got {mix_logits.shape}")
    return mix_logits


# ----------------------------------------------------------------------------------------------
# forward


def cms_init_levels(
    key,
    d_model: int,
    d_hidden: int,
    num_levels: int,
    *,
    gated: bool = False,
    init_scale: float = 1.0,
    same_init: bool = False,
    dtype=jnp.float32,
) -> tuple:
    """Random initial CMS levels (outer parameters; SPEC §3.3).

    ``W_up, W_gate ~ N(0, s²/d)``, ``W_down ~ N(0, s²/h)`` with ``s = init_scale``.

    Args:
      key: PRNG key.
      d_model: ``d``; d_hidden: ``h``; num_levels: ``k``.
      gated: SwiGLU levels (adds ``w_gate``).
      same_init: every level gets the same weights (e.g. a nested CMS whose levels all start from
        one meta-learned state, or an FFN copied into every level).
      dtype: parameter dtype.

    Returns:
      tuple of ``k`` :class:`CMSLevel`.
    """
    keys = jax.random.split(key, num_levels)

    def one(kk):
        k1, k2, k3 = jax.random.split(kk, 3)
        up = jax.random.normal(k1, (d_model, d_hidden), dtype) * (init_scale / math.sqrt(d_model))
        down = jax.random.normal(k2, (d_hidden, d_model), dtype) * (
            init_scale / math.sqrt(d_hidden)
        )
        gate = (
            jax.random.normal(k3, (d_model, d_hidden), dtype) * (init_scale / math.sqrt(d_model))
            if gated
            else None
        )
        return CMSLevel(up, down, gate)

    if same_init:
        lv = one(keys[0])
        return tuple(lv for _ in range(num_levels))
    return tuple(one(kk) for kk in keys)


def _linear(a, w, tap):
    # a [..., t, i] @ w [..., i, o]; ``tap`` (zeros) is a handle whose cotangent is ∂L/∂(a w).
    z = jnp.einsum("...ti,...io->...to", a, w)
    return z if tap is None else z + tap


def _level_apply(lv: CMSLevel, x, taps=None):
    """One level on ``x [..., t, d]``; returns ``(y, layer inputs per linear)``."""
    t_up, t_gate, t_down = (None, None, None) if taps is None else taps
    u = _linear(x, lv.w_up, t_up)
    if lv.w_gate is None:
        hid = jax.nn.silu(u)
        ins = (x, None, hid)
    else:
        gt = _linear(x, lv.w_gate, t_gate)
        hid = jax.nn.silu(gt) * u
        ins = (x, x, hid)
    y = x + _linear(hid, lv.w_down, t_down)
    return y, ins


def cms_level_apply(level: CMSLevel, x):
    """One CMS level ``MLP(x) = x + σ(x W_up) W_down`` (SwiGLU when ``w_gate`` is set; SPEC §3.3).

    Args:
      level: :class:`CMSLevel` (leaves may carry leading batch dims matching ``x``'s).
      x: ``[..., T, d]``.

    Returns:
      ``[..., T, d]``.
    """
    return _level_apply(level, x)[0]


def cms_mix_weights(mix_logits):
    """Weights of the ``independent`` variant: ``w = softmax(mix_logits)`` (``Σ w = 1``; SPEC §3.3).

    Args:
      mix_logits: ``[k]``.

    Returns:
      ``[k]`` f32 weights.
    """
    return jax.nn.softmax(jnp.asarray(mix_logits, jnp.float32), axis=-1)


def _apply(levels, x, variant, mix_logits, taps=None):
    """CMS forward with optional taps; returns ``(y, per-level layer inputs)``."""
    k = len(levels)
    taps = (None,) * k if taps is None else taps
    if variant == "sequential":
        ins, h = [], x
        for lv, tp in zip(levels, taps, strict=True):
            h, i = _level_apply(lv, h, tp)
            ins.append(i)
        return h, tuple(ins)
    if variant == "nested":
        y, i = _level_apply(levels[0], x, taps[0])
        return y, (i,) + (None,) * (k - 1)
    w = cms_mix_weights(mix_logits)
    ys, ins = [], []
    for lv, tp in zip(levels, taps, strict=True):
        yl, i = _level_apply(lv, x, tp)
        ys.append(yl)
        ins.append(i)
    y = sum(w[j].astype(x.dtype) * ys[j] for j in range(k))
    return y, tuple(ins)


def cms_forward(levels, x, *, variant: str = "sequential", mix_logits=None):
    """CMS output with fixed weights (SPEC §3.3; also the ``pretrain``-mode forward).

    ``sequential``: ``y = MLP_k(… MLP_1(x))``; ``nested``: ``y = MLP_1(x)`` (slower levels are its
    initial states); ``independent``: ``y = Σ_ℓ softmax(mix_logits)_ℓ MLP_ℓ(x)``.

    Args:
      levels: tuple of ``k`` :class:`CMSLevel` (``w_up [d, h]``, ``w_down [h, d]``).
      x: ``[B, T, d]``.
      variant: ``"sequential" | "nested" | "independent"``.
      mix_logits: ``[k]`` for ``independent`` (None = uniform); must be None otherwise.

    Returns:
      ``y [B, T, d]`` in ``x``'s dtype.
    """
    _check_variant(variant)
    d = _check_levels(levels)
    x = _check_x(x, d)
    mix_logits = _check_mix(mix_logits, len(levels), variant)
    return _apply(tuple(levels), x, variant, mix_logits)[0].astype(x.dtype)
