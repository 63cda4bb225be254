"""How an op calls a Pallas TPU kernel: Mosaic when lowered for TPU, the interpreter elsewhere,
one call per shard of the mesh in context.

Two facts about the program decide how a ``pallas_call`` enters it, and neither is the Python
process's default backend:

- the platform the program is lowered for. :func:`jax.lax.platform_dependent` stages the kernel
  twice, ``interpret=False`` for ``tpu`` and ``interpret=True`` for every other platform, and
  lowering keeps only its platform's branch. A TPU program compiled ahead of time on a CPU host
  (:mod:`nested_jax.train.aot`) therefore holds the Mosaic ``tpu_custom_call`` while a CPU run of
  the same code interprets the kernel.
- the mesh in context. XLA cannot partition a Mosaic custom call, so inside ``jax.set_mesh`` the
  call runs under :func:`jax.shard_map` over the mesh's non-manual axes, each operand split as its
  logical dimension names say (:data:`nested_jax.parallel.mesh.LOGICAL_AXIS_RULES`: ``batch`` over
  ``data × fsdp``, ``heads`` over ``tensor``; a dimension the axes do not divide stays whole). A
  kernel that is independent per (batch, head) then computes exactly its own rows on each shard.
  Outside any mesh the call is direct.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax

from nested_jax.ops._shard import per_shard

__all__ = ["pallas_per_shard"]


def _interpret_unless_tpu(kernel: Callable, operands: Mapping[str, jax.Array]):
    """``kernel(**operands, interpret=False)`` in a program lowered for TPU, ``interpret=True``
    in one lowered for any other platform (chosen at lowering, not from the default backend)."""

    def call(interpret, ops):
        return kernel(**ops, interpret=interpret)

    return jax.lax.platform_dependent(
        dict(operands),
        tpu=functools.partial(call, False),
        default=functools.partial(call, True),
    )


def pallas_per_shard(
    kernel: Callable,
    operands: Mapping[str, jax.Array | None],
    logical: Mapping[str, Sequence[str | None]],
    out_logical: Sequence[Sequence[str | None]],
    out_shapes: Sequence[Sequence[int]],
):
    """``kernel(**operands, interpret=…)`` on the lowering platform, per shard of the mesh.

    :func:`nested_jax.ops._shard.per_shard` of the platform-dependent call: each shard runs the
    kernel on its block of every operand, split as the logical names say, and the outputs are
    joined along the same axes. The kernel must be independent along every dimension named here
    (batch, heads), so the result equals the kernel on the whole arrays. Without a mesh it is the
    kernel itself. The shard_map runs with ``check_vma=False``: JAX's Pallas HLO interpreter (the
    non-TPU branch) mixes invariant grid indices with the operands' varying blocks, which the
    varying-axes type check rejects ("Primitive and requires varying manual axes to match"); the
    specs are the whole contract.

    Args:
      kernel: ``kernel(**operands, interpret: bool) -> tuple of arrays``; a kernel parameter that
        is ``None`` in ``operands`` is left out of the call (its default applies).
      operands: keyword arrays of the kernel; ``None`` values are dropped.
      logical: one logical name (or None) per dimension of each non-``None`` operand.
      out_logical, out_shapes: the logical names and shapes of the kernel's outputs.

    Returns:
      the kernel's outputs (a tuple), as global arrays.
    """
    local = functools.partial(_interpret_unless_tpu, kernel)
    return per_shard(
        lambda ops: tuple(local(ops)), operands, logical, out_logical, out_shapes, check_vma=False
    )
