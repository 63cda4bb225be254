"""Logical axis names of the memory states the ops return (the mesh rules of
:mod:`nested_jax.parallel.mesh`).

Every per-head memory state (the linear rules' ``S [B, H, K, V]``, Titans' ``(W_l, S_l)
[B, H, d_l, d_{l+1}]``, Hope's memories and momenta ``[B, H, ...]``, HOLA's state and cache
``[B, H, ...]``) is laid out batch first, heads second. The ops pin each such leaf to
``("batch", "heads", None, …)``, so on a mesh the state is split like the activations that made it
(batch over ``data × fsdp``, heads over ``tensor``) instead of being left to the partitioner,
and a decode cache built from it keeps that layout. Outside a mesh this is the identity
(:func:`nested_jax.parallel.mesh.constrain`).
"""

from __future__ import annotations

import jax

from nested_jax.parallel.mesh import constrain

__all__ = ["HEAD_STATE_AXES", "pin_head_state"]

HEAD_STATE_AXES = ("batch", "heads")  # the leading dimensions of every per-head state leaf


def pin_head_state(state):
    """``state`` with every leaf of rank ≥ 2 pinned to ``("batch", "heads", None, …)``.

    Args:
      state: a pytree of per-head state arrays ``[B, H, ...]`` (``None`` leaves are kept);
        leaves of rank < 2 (a shared position counter) are returned unchanged.

    Returns:
      the same tree; inside ``jax.set_mesh`` each leaf carries a sharding constraint.
    """

    def pin(leaf):
        if leaf.ndim < 2:
            return leaf
        return constrain(leaf, HEAD_STATE_AXES + (None,) * (leaf.ndim - 2))

    return jax.tree.map(pin, state)
