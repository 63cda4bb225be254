"""Jitted entry of the Pallas gated delta rule (SPEC §1): layout, padding, per-token scalars,
``custom_vjp``.

``gated_delta_pallas`` has the contract of ``nested_jax.core.associative.forms.gated_delta_chunked``
(shapes, ``scale``, ``initial_state``, ``segment_ids``; returns ``(o [B, T, H, V] in v's dtype,
final_state [B, H, K, V] f32)``). The forward is the kernel of ``kernel.py``; the backward is
the reverse-chunk kernel of ``kernel.py`` from the chunk-start states the forward saves; the
per-token scalars' cotangents reach ``g`` and ``β`` by autodiff of ``_token_scalars``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.associative.forms import validate_seq
from nested_jax.core.scan import pad_to_multiple, segment_starts
from pallas_kernels.common import check_chunk, from_heads_major, heads_major
from pallas_kernels.gated_delta.kernel import SCALARS, gated_delta_bwd_call, gated_delta_fwd_call

__all__ = ["BlockSizes", "gated_delta_pallas"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the gated delta kernels (numerics: only rounding depends on them).

    Attributes:
      chunk: tokens per chunk ``C`` (a positive multiple of 8); ``T`` is padded to a multiple.
    """

    chunk: int

    def __post_init__(self):
        check_chunk(self.chunk)

    @classmethod
    def get_default(cls) -> BlockSizes:
        """``chunk=64`` (the core chunked rule's default)."""
        return cls(chunk=64)


def _token_scalars(g, beta, segment_ids, C):
    """The per-token scalars of the kernel (core/associative/README.md §2, §4), all f32.

    With ``bc`` the in-chunk cumulative log decay, ``z`` the in-chunk segment index (count of
    segment starts so far in the chunk) and ``r`` the last segment start at or before ``i`` in the
    chunk: ``d_i = e^{bc_i}`` while ``z_i = 0`` (else 0), ``d0_i = e^{bc_i − bc_{r−1}}`` once
    ``z_i > 0`` (else 0), ``kdec_j = e^{bc_C − bc_j} [z_j = z_C]``. Padding continues the last
    segment with ``g = β = 0``.

    Returns:
      ``scalars [B·H, N, len(SCALARS), C]`` (each chunk's tokens on the last axis: lane-dense).
    """
    B, T, H = g.shape
    f32 = jnp.float32
    gc = heads_major(g.astype(f32), C).reshape(B, H, -1, C)  # [B, H, N, C]
    bc = jnp.cumsum(gc, axis=-1)
    if segment_ids is None:
        z = jnp.zeros_like(bc)
        logd = bc
    else:
        starts = pad_to_multiple(segment_starts(segment_ids), C).reshape(B, 1, -1, C)
        z = jnp.broadcast_to(jnp.cumsum(starts, axis=-1), bc.shape).astype(f32)
        pos = jnp.where(starts, jnp.arange(C), -1)
        last = jnp.broadcast_to(lax.cummax(pos, axis=pos.ndim - 1), bc.shape)
        before = jnp.take_along_axis(bc - gc, jnp.maximum(last, 0), axis=-1)  # bc_{r−1}
        logd = bc - jnp.where(last >= 0, before, 0.0)
    carried = z == 0
    d = jnp.where(carried, jnp.exp(logd), 0.0)
    d0 = jnp.where(carried, 0.0, jnp.exp(logd))
    tail = z == z[..., -1:]
    kdec = jnp.where(tail, jnp.exp(jnp.where(tail, bc[..., -1:] - bc, 0.0)), 0.0)
    beta_c = heads_major(beta.astype(f32), C).reshape(bc.shape)
    named = {"b": bc, "z": z, "beta": beta_c, "d": d, "d0": d0, "kdec": kdec}
    N = bc.shape[2]
    return jnp.stack([named[n] for n in SCALARS], axis=-2).reshape(B * H, N, len(SCALARS), C)


def _kernel_inputs(q, k, v, g, beta, s0, segment_ids, chunk):
    """Heads-major padded operands and the per-token scalars with their VJP (to ``g``, ``β``)."""
    B, T, H, K = q.shape
    scalars, scalars_vjp = jax.vjp(
        lambda g, beta: _token_scalars(g, beta, segment_ids, chunk), g, beta
    )
    qkv = tuple(heads_major(x, chunk) for x in (q, k, v))
    return (*qkv, scalars, s0.reshape(B * H, K, -1)), scalars_vjp


def _run(q, k, v, g, beta, s0, segment_ids, scale, chunk, has_init, interpret, save_states):
    B, T, H, K = q.shape
    args, _ = _kernel_inputs(q, k, v, g, beta, s0, segment_ids, chunk)
    o, s_fin, *states = gated_delta_fwd_call(
        *args,
        chunk=chunk,
        scale=scale,
        restart=has_init and segment_ids is not None,
        interpret=interpret,
        save_states=save_states,
    )
    return (from_heads_major(o, B, T), s_fin.reshape(s0.shape)), states


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _gated_delta(q, k, v, g, beta, s0, segment_ids, scale, chunk, has_init, interpret):
    static = (scale, chunk, has_init, interpret)
    return _run(q, k, v, g, beta, s0, segment_ids, *static, save_states=False)[0]


def _gated_delta_fwd(q, k, v, g, beta, s0, segment_ids, scale, chunk, has_init, interpret):
    static = (scale, chunk, has_init, interpret)
    out, (states,) = _run(q, k, v, g, beta, s0, segment_ids, *static, save_states=True)
    return out, (q, k, v, g, beta, s0, segment_ids, states)


def _gated_delta_bwd(scale, chunk, has_init, interpret, res, cts):
    q, k, v, g, beta, s0, segment_ids, states = res
    do, ds_fin = cts
    B, T, H, K = q.shape
    args, scalars_vjp = _kernel_inputs(q, k, v, g, beta, s0, segment_ids, chunk)
    dq, dk, dv, dscalars, ds0 = gated_delta_bwd_call(
        *args,
        states,
        heads_major(do, chunk),
        ds_fin.reshape(B * H, K, -1),
        chunk=chunk,
        scale=scale,
        restart=has_init and segment_ids is not None,
        interpret=interpret,
    )
    dg, dbeta = scalars_vjp(dscalars)
    dq, dk, dv = (from_heads_major(d, B, T).astype(x.dtype) for d, x in ((dq, q), (dk, k), (dv, v)))
    return dq, dk, dv, dg.astype(g.dtype), dbeta.astype(beta.dtype), ds0.reshape(s0.shape), None


_gated_delta.defvjp(_gated_delta_fwd, _gated_delta_bwd)


def _zero_state(q, shape):
    """The zero f32 initial state, varying over the manual mesh axes ``q`` varies over.

    Under ``jax.shard_map`` the kernels' outputs vary like ``q`` (``kernel._call``), ``∂L/∂S_0``
    among them; the custom VJP's primal ``S_0`` must have that type too. Outside a shard_map
    ``q`` varies over no axis and this is ``zeros(shape)``.
    """
    varying = tuple(sorted(jax.typeof(q).manual_axis_type.varying))
    return lax.pcast(jnp.zeros(shape, jnp.float32), varying, to="varying")


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def gated_delta_pallas(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
):
    """Gated delta rule (GDN) by the Pallas chunk kernel (SPEC §1; equals ``gated_delta_chunked``).

    ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale · q_t)``,
    ``α_t = e^{g_t}``; the WY/UT chunk form of core/associative/README.md §2 with segment resets
    folded into the masks (§4). Gradients: ``custom_vjp`` with the reverse-chunk backward kernel
    (README §3).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay (≤ 0);
        beta: ``[B, T, H]``. Any float dtypes (the Grams take q, k's dtype with f32
        accumulation; everything else is f32).
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.
      block_sizes: :class:`BlockSizes`; default ``BlockSizes.get_default()``.
      interpret: run the Pallas interpreter (any backend) instead of compiling for TPU.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    validate_seq("gated_delta_pallas", q, k, v, g, beta, initial_state, segment_ids)
    if block_sizes is None:
        block_sizes = BlockSizes.get_default()
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(
            f"gated_delta_pallas: block_sizes must be a BlockSizes, got {block_sizes!r}"
        )
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    has_init = initial_state is not None
    s0 = initial_state.astype(jnp.float32) if has_init else _zero_state(q, (B, H, K, V))
    return _gated_delta(
        q, k, v, g, beta, s0, segment_ids, scale, block_sizes.chunk, has_init, interpret
    )
