"""One call per shard of the mesh in context, each operand split as its logical names say.

Ops whose computation XLA must not partition on its own (a Mosaic kernel it cannot split; a
context-parallel rule whose devices exchange states explicitly) run under :func:`jax.shard_map`
over the mesh's non-manual axes, with every operand's spec from its logical dimension names
(:data:`nested_jax.parallel.mesh.LOGICAL_AXIS_RULES`: ``batch`` over ``data × fsdp``, ``seq``
over ``seq``, ``heads`` over ``tensor``; a dimension the axes do not divide stays whole).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax

from nested_jax.parallel.mesh import LOGICAL_AXIS_RULES, logical_to_mesh_spec

__all__ = ["per_shard", "mesh_axis_size"]


def _free_axes() -> tuple[jax.sharding.AbstractMesh, frozenset]:
    """The abstract mesh in context and its non-manual axes (empty outside any mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = frozenset() if mesh.empty else frozenset(mesh.axis_names) - set(mesh.manual_axes)
    return mesh, axes


def mesh_axis_size(name: str) -> int:
    """Size of the non-manual mesh axis ``name`` in context (1 outside a mesh or without it)."""
    mesh, axes = _free_axes()
    return int(mesh.shape[name]) if name in axes else 1


def _rules_on(axes: frozenset) -> dict:
    """:data:`LOGICAL_AXIS_RULES` restricted to the mesh axes ``axes`` (the others dropped)."""

    def keep(target):
        names = () if target is None else (target,) if isinstance(target, str) else target
        kept = tuple(a for a in names if a in axes)
        return kept or None

    return {name: keep(target) for name, target in LOGICAL_AXIS_RULES.items()}


def per_shard(
    fn: Callable,
    operands: Mapping[str, jax.Array | None],
    logical: Mapping[str, Sequence[str | None]],
    out_logical: Sequence[Sequence[str | None]],
    out_shapes: Sequence[Sequence[int]],
    *,
    check_vma: bool = True,
):
    """``fn(operands)`` run once per shard of the mesh in context.

    With mesh axes ``A`` (the non-manual axes of ``jax.sharding.get_abstract_mesh()``) and
    ``spec(x) = logical_to_mesh_spec(logical[x], x.shape, mesh)`` over ``A``, the result is
    ``shard_map(fn, in_specs=spec(operands), out_specs=spec(outputs))``. Without a mesh (or with
    every axis manual already) it is ``fn(operands)``.

    Args:
      fn: ``fn(dict of the non-None operands) -> tuple of arrays``.
      operands: keyword arrays; ``None`` values are dropped.
      logical: one logical name (or None) per dimension of each non-``None`` operand.
      out_logical, out_shapes: the logical names and (global) shapes of ``fn``'s outputs.
      check_vma: the shard_map's varying-axes type check.

    Returns:
      ``fn``'s outputs (a tuple), as global arrays.
    """
    present = {name: x for name, x in operands.items() if x is not None}
    mesh, axes = _free_axes()
    if not axes:
        return fn(present)
    rules = _rules_on(axes)
    in_specs = {
        n: logical_to_mesh_spec(logical[n], x.shape, mesh, rules) for n, x in present.items()
    }
    out_specs = tuple(
        logical_to_mesh_spec(names, shape, mesh, rules)
        for names, shape in zip(out_logical, out_shapes, strict=True)
    )
    mapped = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(in_specs,),
        out_specs=out_specs,
        axis_names=axes,
        check_vma=check_vma,
    )
    return mapped(present)
