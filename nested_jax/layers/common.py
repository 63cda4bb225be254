"""Small shared helpers of the NNX layers: logical-axis parameter initialisers and a no-bias dense.

Every parameter carries logical axis names (``"vocab"``, ``"embed"``, ``"mlp"``, ``"heads"``,
``"kv"``, ``"conv"``,
``"layers"``; ``None`` = replicated) that ``nested_jax.parallel`` maps to mesh axes. Eager sharding
is off so
that modules can be built without a mesh (tests, CPU); the trainer shards the state from
``nnx.get_partition_spec``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Names = Sequence[str | None]
# Per-head memory parameters ``[H, d_in, d_out]`` (Titans MLP memory, Hope's memories): the head
# axis shards over the tensor axis like the heads of the projections that feed them.
MEMORY_HEADS = ("heads", None, None)


def partitioned(init: Callable, names: Names) -> Callable:
    """Wrap an initialiser so the created ``nnx.Param`` records ``names`` as its logical
    sharding."""
    return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


def dense(
    d_in: int,
    d_out: int,
    names: Names,
    *,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
    init: Callable | None = None,
    bias: bool = False,
) -> nnx.Linear:
    """An ``nnx.Linear`` (``y = x W``, ``W [d_in, d_out]``; ``y = x W + b`` with ``bias``) with f32
    params and ``dtype`` compute.

    Args:
      d_in, d_out: input / output widths.
      names: two logical axis names of the kernel, e.g. ``("embed", "heads")``.
      dtype: activation dtype (the computation dtype; params stay float32).
      rngs: NNX random streams.
      init: kernel initialiser (default: LeCun normal, fan-in scaled).
      bias: add a learned bias ``b [d_out]`` (initialised at 0, named ``names[1:]``).
    """
    init = init or nnx.initializers.lecun_normal()
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        kernel_init=partitioned(init, names),
        bias_init=partitioned(nnx.initializers.zeros_init(), names[1:]),
        dtype=dtype,
        param_dtype=jnp.float32,
        rngs=rngs,
    )


def check_rank(name: str, x: jax.Array, rank: int, shape_doc: str) -> None:
    """Raise ``ValueError`` naming ``name`` when ``x`` does not have ``rank`` dimensions."""
    if x.ndim != rank:
        raise ValueError(f"{name}: expected shape {shape_doc}, got {tuple(x.shape)}")
