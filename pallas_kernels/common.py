"""What the chunked Pallas kernels share: the token layout, the chunk check and the call.

Both kernels (``gated_delta``, ``titans_linear``) walk a grid ``(B·H "parallel", N chunks
"arbitrary")`` over heads-major tokens ``[B·H, Tp, D]`` (``Tp = N·C``, zero padded), with
chunks a whole number of TPU sublanes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nested_jax.core.scan import pad_to_multiple

__all__ = [
    "SUBLANES",
    "check_chunk",
    "heads_major",
    "from_heads_major",
    "chunk_specs",
    "chunked_pallas_call",
]

SUBLANES = 8  # a chunk is a multiple of the TPU sublane count (second-minor tile dimension)


def check_chunk(chunk) -> None:
    """``BlockSizes.chunk`` must be a positive multiple of 8 (one line naming the field)."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0 or chunk % SUBLANES:
        raise ValueError(f"BlockSizes: chunk must be a positive multiple of 8, got {chunk!r}")


def heads_major(x, C):
    """``[B, T, H, ...] → [B·H, Tp, ...]``, zero padded to ``Tp = N·C``."""
    x = jnp.moveaxis(pad_to_multiple(x, C), 2, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def from_heads_major(x, B, T):
    """``[B·H, Tp, D] → [B, T, H, D]`` (the padding dropped)."""
    return jnp.moveaxis(x.reshape(B, -1, *x.shape[1:])[:, :, :T], 1, 2)


def chunked_pallas_call(kernel, grid, in_specs, out_specs, out_shape, scratch, interpret, name,
                        *args, semantics=("parallel", "arbitrary"), flops=0.0,
                        transcendentals=0.0):  # fmt: skip
    """``pl.pallas_call`` over ``grid = (B·H, N, …)`` with rows parallel and chunks sequential
    (``semantics``, one per grid axis); ``out_shape`` is a list of ``(shape, dtype)``.

    It declares a ``pl.CostEstimate`` (XLA counts nothing inside a custom call, so without one a
    compiled program's FLOPs and bytes leave the kernel out, e.g. ``nested-jax aot --estimate``):
    the caller's ``flops`` and ``transcendentals`` for the whole call, and as bytes every input
    and output once (each block is read or written once; the state stays in VMEM).
    """
    # under shard_map (check_vma) the outputs vary over the mesh axes the inputs vary over
    mat = jax.typeof(args[0]).manual_axis_type
    outs = [jax.ShapeDtypeStruct(s, t, manual_axis_type=mat) for s, t in out_shape]
    moved = sum(x.size * x.dtype.itemsize for x in (*args, *outs))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=outs,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=interpret,
        name=name,
        cost_estimate=pl.CostEstimate(
            flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(moved)
        ),
    )(*args)


def chunk_specs(N, chunk, K, V, reverse, per_chunk):
    """Block specs over the grid ``(B·H, N)``; ``reverse`` walks the chunks last to first.

    ``tok(width)``: a chunk of heads-major tokens ``[C, width]``; ``state``: the row's ``[K, V]``
    (one block for every chunk); ``states``: the row's chunk-``n`` slice of ``[B·H, N, K, V]``;
    and for each ``name: shape`` of ``per_chunk`` the chunk-``n`` block ``shape`` of a
    ``[B·H, N, *shape]`` array.
    """
    sq = pl.Squeezed()
    at = (lambda n: N - 1 - n) if reverse else (lambda n: n)

    def tok(width):
        return pl.BlockSpec((sq, chunk, width), lambda h, n: (h, at(n), 0))

    def chunk_block(shape):
        return pl.BlockSpec((sq, sq, *shape), lambda h, n: (h, at(n)) + (0,) * len(shape))

    specs = {
        "tok": tok,
        "state": pl.BlockSpec((sq, K, V), lambda h, n: (h, 0, 0)),
        "states": chunk_block((K, V)),
    }
    return specs | {name: chunk_block(shape) for name, shape in per_chunk.items()}
