"""The Continuum Memory System behind the one door (SPEC §3.3, §3.4).

``k`` residual MLP levels ``MLP_ℓ(x) = x + σ(x W_up) W_down`` (SwiGLU when ``w_gate`` is set;
``nested_jax.core.cms.levels``) combined by ``variant``::

    sequential:   y = MLP_k(… MLP_1(x))
    nested:       y = MLP_1(x)                       (slower levels are its initial states)
    independent:  y = Σ_ℓ softmax(mix_logits)_ℓ MLP_ℓ(x)

Two ops, each with ``impl`` (never switched silently; an ``impl`` that cannot run raises
``ValueError``):

- :func:`cms_forward`: the levels at fixed weights (the LM's CMS FFN, and the ``pretrain``-mode
  forward). A position-wise MLP stack has one XLA form, ``core.cms.levels.cms_forward``, offered as
  ``"chunked"`` (the value every op takes by default); there is no per-token ``"recurrent"`` form
  of a position-wise map, so it raises.
- :func:`cms_online`: the ``online`` mode, where level ℓ accumulates its local-surprise gradient
  and applies it at the end of each period ``C^(ℓ)`` (``core.cms.online.cms_online``). ``"chunked"``
  is its only form: a ``lax.scan`` over chunks of ``c = gcd(C^(1..k))`` tokens that share weights.
  No per-token ``"recurrent"`` form exists in core, so it raises.

``"pallas"`` is the seam for ``pallas_kernels/cms``; no kernel is wired, so it raises
``ValueError``. Both take the static options as one frozen :class:`CMSRule` (``rule=``; a
``CMSOptions``, the ``model.cms`` config section, is one): :func:`cms_online` passes it on whole to
``core.cms.online.cms_online``, :func:`cms_forward` passes its ``variant``. ``VARIANTS``,
``CMSLevel``, ``CMSRule``, ``check_periods``, ``CMSState``, ``cms_initial_state`` and
``surprise_from_loss`` stay importable from here, so callers import CMS from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nested_jax.core.cms import levels as _cms_levels
from nested_jax.core.cms import online as _cms
from nested_jax.core.cms.levels import VARIANTS as VARIANTS
from nested_jax.core.cms.levels import CMSLevel as CMSLevel
from nested_jax.core.cms.online import CMSState as CMSState
from nested_jax.core.cms.online import cms_initial_state as cms_initial_state
from nested_jax.core.cms.online import surprise_from_loss as surprise_from_loss
from nested_jax.ops._impl import check_impl as _check_impl
from nested_jax.rules import CMSRule as CMSRule
from nested_jax.rules import check_periods as check_periods

__all__ = ["cms_forward", "cms_online"]

_AVAILABLE = ("chunked",)


def _check(op: str, impl: str) -> None:
    """``check_impl`` over the one form CMS has (``"recurrent"`` names no CMS form)."""
    _check_impl(op, impl, _AVAILABLE)


def cms_forward(levels, x, *, rule: CMSRule, mix_logits=None, impl: str = "chunked"):
    """CMS output at fixed weights (SPEC §3.3): the formulas of the module docstring.

    Args:
      levels: tuple of ``k`` :class:`CMSLevel` (``w_up [d, h]``, ``w_down [h, d]``, optional
        ``w_gate [d, h]``).
      x: ``[B, T, d]``.
      rule: :class:`CMSRule`; its ``variant`` combines the levels and its ``periods`` must have
        one entry per level (the forward reads no period).
      mix_logits: ``[k]`` for ``independent`` (None = uniform); must be None otherwise.
      impl: ``"chunked"`` (``"recurrent"``, ``"pallas"``: ValueError).

    Returns:
      ``y [B, T, d]`` in ``x``'s dtype.
    """
    _check("cms_forward", impl)
    if isinstance(levels, tuple | list) and len(levels) != len(rule.periods):
        raise ValueError(
            f"cms_forward: rule.periods has {len(rule.periods)} entries, one per level; got "
            f"{len(levels)} levels"
        )
    return _cms_levels.cms_forward(levels, x, variant=rule.variant, mix_logits=mix_logits)


def cms_online(
    levels,
    x,
    *,
    rule: CMSRule,
    delta_fn: Callable | None = None,
    delta=None,
    side: Any = None,
    mix_logits=None,
    initial_state: CMSState | None = None,
    impl: str = "chunked",
):
    """CMS in ``online`` mode (SPEC §3.3): each level learns from the local surprise at its period.

    ``δ_t = ∂L_t/∂y_t``; level ℓ's signal ``g_t^(ℓ) = ∂L_t/∂θ_ℓ`` (by ``jax.vjp`` of the forward)
    is accumulated over its period ``B_j^(ℓ)`` and applied at its end: ``sgd``
    ``θ_ℓ ← θ_ℓ − Σ_{t∈B_j} η_ℓ g_t^(ℓ)``; ``dgd`` per layer ``W ← W − Σ_t γ_t a_t (a_t W + g_t)ᵀ``,
    ``γ_t = η_ℓ/(1 + η_ℓ‖a_t‖²)``. Output at ``t`` uses the weights in force before ``t``.

    Args:
      levels: tuple of ``k`` :class:`CMSLevel` (unbatched), the initial weights of every row
        (ignored when ``initial_state`` is given).
      x: ``[B, T, d]``.
      rule: :class:`CMSRule`: ``periods`` ``(C^(1), …, C^(k))`` in tokens, ``variant``, the inner
        rate ``online_lr`` (``η``, one or one per level), ``online_inner`` (``"sgd" | "dgd"``) and
        ``remat_every`` (checkpoint the chunk scan every n chunks); passed on whole.
      delta_fn: ``(y [B, c, d], side_chunk) -> δ [B, c, d]`` (see :func:`surprise_from_loss`), or
      delta: a precomputed ``δ [B, T, d]``; exactly one of the two.
      side: optional pytree of ``[B, T, ...]`` arrays handed to ``delta_fn`` chunk by chunk.
      mix_logits: as in :func:`cms_forward`.
      initial_state: :class:`CMSState` to continue (or :func:`cms_initial_state`).
      impl: ``"chunked"`` (``"recurrent"``, ``"pallas"``: ValueError).

    Returns:
      ``(y [B, T, d] in x's dtype, CMSState)``.
    """
    _check("cms_online", impl)
    return _cms.cms_online(
        levels,
        x,
        rule=rule,
        delta_fn=delta_fn,
        delta=delta,
        side=side,
        mix_logits=mix_logits,
        initial_state=initial_state,
    )
