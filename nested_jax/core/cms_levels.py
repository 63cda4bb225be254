"""CMS levels and their fixed-weight forward (SPEC §3.3, §3.4): ``CMSLevel``, ``cms_forward``.

Split from :mod:`nested_jax.core.cms` (which holds the online update mode, ``cms_online``, and
re-exports every public name here).

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

The periods ``C^(ℓ)`` matter only to the updates (``core.cms.cms_online``,
``nested_jax.optim.multifreq``); the forward here reads the levels as given. :class:`CMSRule`
holds the periods, the variant and the online inner step as one frozen value (``ops.cms`` takes it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "CMSLevel",
    "CMSRule",
    "VARIANTS",
    "INNERS",
    "check_periods",
    "cms_init_levels",
    "cms_level_apply",
    "cms_mix_weights",
    "cms_forward",
]

VARIANTS = ("sequential", "nested", "independent")
INNERS = ("sgd", "dgd")  # inner optimizers of the online mode (``core.cms.cms_online``)


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


def check_periods(periods, k: int | None = None, variant: str | None = None) -> tuple[int, ...]:
    """Validate CMS periods ``C^(1) < … < C^(k)`` (SPEC §3.3) and return them as a tuple.

    Shared by the online core, the pretrain optimizer wrapper and LM streaming.

    Args:
      periods: a non-empty tuple/list of positive ints, strictly increasing.
      k: the number of levels, when known (one period per level).
      variant: ``"nested"`` also needs each period to divide the next.
    """
    if not isinstance(periods, (tuple, list)) or not periods:
        raise ValueError(f"periods must be a non-empty tuple of positive ints, got {periods!r}")
    periods = tuple(periods)
    for p in periods:
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"periods must be positive ints, got {periods!r}")
    if any(b <= a for a, b in zip(periods, periods[1:], strict=False)):
        raise ValueError(f"periods must be strictly increasing (C^(1) < … < C^(k)), got {periods}")
    if k is not None and len(periods) != k:
        raise ValueError(f"periods must have one entry per level ({k}), got {len(periods)}")
    if variant == "nested" and any(b % a for a, b in zip(periods, periods[1:], strict=False)):
        raise ValueError(
            f"periods for variant='nested' must each divide the next (a level's context is whole "
            f"periods of the faster level), got {periods}"
        )
    return periods


@dataclass(frozen=True)
class CMSRule:
    """The CMS rule as one typed value (SPEC §3.3): periods, variant and the online inner step.

    ``CMSOptions.rule()`` (the ``model.cms`` config section) builds it, and the defaults below are
    ``CMSOptions``'s (a test keeps them equal). Frozen and hashable (lists become tuples). The
    core functions keep their plain keywords: ``ops.cms`` passes ``variant`` (fixed-weight forward)
    or :meth:`online_kwargs` (online mode) on. The level widths, ``gated`` and the pretrain
    optimizer's ``mode`` / ``accumulate`` are not part of the rule: they shape the parameters and
    the outer optimizer, not the CMS function.

    Attributes:
      periods: ``(C^(1), …, C^(k))``, one per level, strictly increasing (``nested``: each divides
        the next); tokens in the online mode.
      variant: one of ``VARIANTS``.
      lr: online inner rate ``η > 0``, one float or one per level.
      inner: online inner optimizer, one of ``INNERS`` (SPEC §3.1).
      remat_every: online: checkpoint the chunk scan every n chunks (None: no checkpoints).
    """

    periods: tuple[int, ...] = (1, 4, 16)
    variant: str = "sequential"
    lr: float | tuple[float, ...] = 1e-2
    inner: str = "sgd"
    remat_every: int | None = None

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(
                f"CMSRule.variant: unknown {self.variant!r}; expected one of {VARIANTS}"
            )
        try:
            periods = check_periods(self.periods, variant=self.variant)
        except ValueError as err:  # check_periods' message, under the field's name
            raise ValueError(f"CMSRule.periods: {str(err).removeprefix('periods ')}") from None
        object.__setattr__(self, "periods", periods)
        lrs = self.lr if isinstance(self.lr, tuple | list) else (self.lr,)
        if isinstance(self.lr, tuple | list):
            if len(lrs) != len(periods):
                raise ValueError(
                    f"CMSRule.lr: one rate per level ({len(periods)}) or one float, got {self.lr!r}"
                )
            object.__setattr__(self, "lr", tuple(lrs))
        for v in lrs:
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"CMSRule.lr: must be a float > 0 (or one per level), got {v!r}")
        if self.inner not in INNERS:
            raise ValueError(f"CMSRule.inner: unknown {self.inner!r}; expected one of {INNERS}")
        r = self.remat_every
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"CMSRule.remat_every: must be None or a positive int, got {r!r}")

    def online_kwargs(self) -> dict:
        """Every field as keywords of ``core.cms.cms_online``."""
        return dict(
            periods=self.periods,
            variant=self.variant,
            lr=self.lr,
            inner=self.inner,
            remat_every=self.remat_every,
        )


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
