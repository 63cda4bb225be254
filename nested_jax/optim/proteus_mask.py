"""Proteus, training-time variant: block-masked parameter updates over optimizer steps (SPEC §4).

Paper §4.2, eq. 14: ``θ_{i+1} = θ_i − η_{i+1} (g_{i+1} ⊙ e_i)`` where ``e_i`` opens the first
``k`` of ``E`` contiguous blocks of a chosen axis of each blocked parameter (e.g. the hidden units
of an MLP: the last axis of ``W_in [d, h]`` and the first of ``W_out [h, d]``), with the schedule of
:func:`nested_jax.core.proteus.proteus_active_blocks` run over optimizer steps:
``k = k(i + 1; N = total_steps, E = num_blocks)`` for the update that produces ``θ_{i+1}`` (the
first update uses ``k(1)``); after ``total_steps`` every block stays open. Blocks split as in
``core/proteus.py`` (``⌊D/E⌋`` each, the last block absorbs the remainder).

What is masked (:func:`proteus_mask`):

- the gradient entering the inner transformation (``e ⊙ g``), so moment estimates of locked
  coordinates see zeros (the paper's gated-gradient AdamW);
- the inner transformation's output (``e ⊙ u``), so *everything* it does — including an
  ``add_decayed_weights`` inside the chain — leaves locked coordinates bit-identical.
  **Decision (SPEC §4):** weight decay is masked by default.
- ``mask_weight_decay=False`` reproduces the paper's eq. 15 as printed (decay acts on every
  coordinate): pass the decay as the separate ``decay`` transformation (fed with zero updates and
  the parameters, e.g. ``chain(add_decayed_weights(wd), scale_by_learning_rate(lr))``), which is
  then added unmasked. :func:`proteus_adamw` does this wiring.

Leaves whose block axis is ``None`` are not masked. Masking uses ``jnp.where`` (no ``0·x``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from nested_jax.core.checks import check_positive_int
from nested_jax.core.proteus import proteus_active_blocks, proteus_block_ids

__all__ = [
    "ProteusMaskState",
    "proteus_mask",
    "proteus_adamw",
    "proteus_update_masks",
    "block_axes_by_path",
]


class ProteusMaskState(NamedTuple):
    """State of :func:`proteus_mask`."""

    count: jax.Array  # int32 [], optimizer steps taken (the next update uses k(count + 1))
    inner_state: Any
    decay_state: Any  # optax.EmptyState() when there is no separate decay


def _path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _resolve_axes(block_axis_fn, params):
    axes = block_axis_fn(params) if callable(block_axis_fn) else block_axis_fn
    try:
        return jax.tree.map(lambda a, p: a, axes, params, is_leaf=lambda x: x is None)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "block_axis_fn must give one axis (int) or None per parameter leaf, with the structure "
            f"of the parameters: {e}"
        ) from e


def proteus_update_masks(step, params, block_axis_fn, total_steps: int, num_blocks: int):
    """Per-leaf boolean masks ``e`` for the update at 1-based optimizer step ``step``.

    Args:
      step: 1-based step (int or int32 array; the update producing ``θ_step``).
      params: parameter (or update) pytree; only shapes are used.
      block_axis_fn: ``params -> pytree of (int | None)`` or that pytree itself.
      total_steps: ``N`` of the schedule (steps over which all blocks open).
      num_blocks: ``E``.

    Returns:
      pytree like ``params`` with a bool mask per leaf, broadcastable to it (``[1, .., D, .., 1]``
      on the blocked axis), or ``None`` for unmasked leaves.
    """
    check_positive_int("total_steps", total_steps)
    check_positive_int("num_blocks", num_blocks)
    axes = _resolve_axes(block_axis_fn, params)
    k = proteus_active_blocks(jnp.asarray(step, jnp.int32), total_steps, num_blocks)

    def leaf_mask(path, axis, p):
        if axis is None:
            return None
        ndim = jnp.ndim(p)
        if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
            raise ValueError(
                f"block axis for {_path_str(path)!r} must be an int in [-{ndim}, {ndim}) or None, "
                f"got {axis!r} for shape {jnp.shape(p)}"
            )
        size = jnp.shape(p)[axis]
        if size < num_blocks:
            raise ValueError(
                f"block axis {axis} of {_path_str(path)!r} (shape {jnp.shape(p)}) has {size} "
                f"coordinates, fewer than num_blocks={num_blocks}"
            )
        ids = jnp.asarray(proteus_block_ids(size, num_blocks))
        shape = [1] * ndim
        shape[axis] = size
        return (ids < k).reshape(shape)

    return jax.tree_util.tree_map_with_path(leaf_mask, axes, params, is_leaf=lambda x: x is None)


def _apply(tree, masks):
    return jax.tree.map(
        lambda x, m: x if m is None else jnp.where(m, x, jnp.zeros((), x.dtype)),
        tree,
        masks,
        is_leaf=lambda x: x is None,
    )


def proteus_mask(
    inner: optax.GradientTransformation,
    *,
    block_axis_fn: Any,
    total_steps: int,
    num_blocks: int,
    mask_weight_decay: bool = True,
    decay: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Mask a whole optimizer chain by the Proteus block schedule over steps (SPEC §4, paper §4.2).

    ``u_i = e_i ⊙ inner(e_i ⊙ g_i) + [e_i ⊙] decay(0)`` with ``e_i`` opening ``k(i)`` blocks,
    ``i = 1, 2, …`` the optimizer step. With the default ``mask_weight_decay=True`` a locked
    coordinate gets an update of exactly zero (put the decay inside ``inner`` or in ``decay``).

    Args:
      inner: the optimizer chain (e.g. ``optax.adamw(lr, weight_decay=0.1)``).
      block_axis_fn: ``params -> pytree of (int | None)`` (or that pytree): the blocked axis of each
        leaf, ``None`` for leaves that are never masked. See :func:`block_axes_by_path`.
      total_steps: ``N``: optimizer steps over which the blocks open (``Δ = max(1, ⌊N/E⌋)``).
      num_blocks: ``E`` (1 = no masking at all).
      mask_weight_decay: mask ``decay``'s output too (default). ``False`` = the paper's eq. 15 as
        printed: decay reaches locked coordinates.
      decay: optional transformation producing the decay term from zero updates and the params,
        e.g. ``optax.chain(optax.add_decayed_weights(wd), optax.scale_by_learning_rate(lr))``.

    Returns:
      ``optax.GradientTransformationExtraArgs`` with state :class:`ProteusMaskState`; ``update``
      needs ``params`` when ``decay`` is given.
    """
    check_positive_int("total_steps", total_steps)
    check_positive_int("num_blocks", num_blocks)
    inner = optax.with_extra_args_support(inner)
    decay_tx = None if decay is None else optax.with_extra_args_support(decay)

    def init_fn(params):
        return ProteusMaskState(
            count=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
            decay_state=optax.EmptyState() if decay_tx is None else decay_tx.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if decay_tx is not None and params is None:
            raise ValueError("params must be given to update() when a decay transformation is set")
        step = optax.safe_increment(state.count)  # 1-based index of this update
        masks = proteus_update_masks(step, updates, block_axis_fn, total_steps, num_blocks)
        u, inner_state = inner.update(
            _apply(updates, masks), state.inner_state, params, **extra_args
        )
        u = _apply(u, masks)
        decay_state = state.decay_state
        if decay_tx is not None:
            d, decay_state = decay_tx.update(
                jax.tree.map(jnp.zeros_like, updates), decay_state, params, **extra_args
            )
            if mask_weight_decay:
                d = _apply(d, masks)
            u = jax.tree.map(lambda a, b: (a + b).astype(a.dtype), u, d)
        return u, ProteusMaskState(count=step, inner_state=inner_state, decay_state=decay_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def proteus_adamw(
    learning_rate,
    *,
    block_axis_fn: Any,
    total_steps: int,
    num_blocks: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    weight_decay_mask: Any = None,
    mask_weight_decay: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """AdamW under the Proteus training-time schedule (SPEC §4; paper §4.2, eq. 15).

    ``mask_weight_decay=True`` (default): ``proteus_mask(optax.adamw(...))`` — locked blocks get
    exactly zero update. ``False``: Adam masked, decoupled decay ``−lr · wd · θ`` on every
    coordinate (the paper's eq. 15 as printed).

    Args:
      learning_rate: float or schedule.
      block_axis_fn: as in :func:`proteus_mask`.
      total_steps: ``N`` of the schedule.
      num_blocks: ``E``.
      b1, b2, eps: Adam moments.
      weight_decay: decoupled decay rate.
      weight_decay_mask: optax mask for the decay.
      mask_weight_decay: see above.

    Returns:
      ``optax.GradientTransformationExtraArgs``.
    """
    if mask_weight_decay:
        inner = optax.adamw(
            learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=weight_decay_mask
        )
        decay = None
    else:
        inner = optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
        decay = optax.chain(
            optax.add_decayed_weights(weight_decay, weight_decay_mask),
            optax.scale_by_learning_rate(learning_rate),
        )
    return proteus_mask(
        inner,
        block_axis_fn=block_axis_fn,
        total_steps=total_steps,
        num_blocks=num_blocks,
        mask_weight_decay=mask_weight_decay,
        decay=decay,
    )


def block_axes_by_path(rules: Mapping[str, int]) -> Callable[[Any], Any]:
    """A ``block_axis_fn`` from path rules: the first regex that ``re.search``-matches a leaf's path
    (keys joined by ``/``, e.g. ``"layers/mlp/w_in"``) gives its axis; other leaves get ``None``.

    Example: ``block_axes_by_path({r"mlp/w_in$": -1, r"mlp/w_out$": -2})`` blocks MLP hidden units.

    Args:
      rules: ordered mapping ``regex -> axis``.

    Returns:
      ``params -> pytree of (int | None)``.
    """
    compiled = [(re.compile(pat), axis) for pat, axis in rules.items()]

    def fn(params):
        def axis_for(path, _):
            s = _path_str(path)
            for pat, axis in compiled:
                if pat.search(s):
                    return axis
            return None

        return jax.tree_util.tree_map_with_path(axis_for, params)

    return fn
