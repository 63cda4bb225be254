"""The project's causal attention masks on JAX's splash-attention TPU kernel (SPEC §6).

``splash_attention`` has the contract of ``nested_jax.layers.attention.blockwise_softmax_attention``
for full-sequence causal attention (no KV cache): ``o_t = Σ_s softmax_s(scale · q_tᵀ k_s) v_s`` over
the keys query ``t`` sees, with GQA. The mask is what the callers need:

- causal, optionally a sliding window (query ``t`` sees key ``s`` iff ``0 ≤ t − s < window``);
- a *tiled* key sequence of ``tiles · T`` keys whose key ``j`` stands at position ``j mod T``
  (Titans MAC attends over ``[h̃ ‖ x]``, both causal in the segment: ``tiles = 2``);
- packed segments (keys of another segment are hidden);
- ``P`` prefix keys that every query sees, whatever its segment (Titans' persistent tokens).

JAX's kernel (``jax.experimental.pallas.ops.tpu.splash_attention``) takes one sequence and ``[H,
T, D]`` operands, visits only the key blocks a query block can see (its mask is static), and
supports segments; this module vmaps it over batch rows and key/value heads (its MQA form per KV
head, so grouped query heads share their keys without a copy), pads ``T`` to whole blocks (pad
rows are a segment of their own, ``-1``, and are dropped), and adds the prefix keys.

Prefix keys cannot be a part of the kernel's mask: segments are an equality of ids, and a prefix
key must match every segment. They are attended separately and merged by log-sum-exp: with the
kernel's ``(o_m, lse_m)`` over the sequence keys and the ``P`` prefix logits ``s_p`` (an XLA
einsum of ``[.., T, P]``, ``P`` is small), ``LSE = logaddexp(lse_m, logsumexp(s_p))`` and
``o = e^{lse_m − LSE} o_m + Σ_p e^{s_p − LSE} v_p``. The gradient is the softmax gradient of the
merged attention: ``dS = P ⊙ (dO vᵀ − D)`` with ``D = rowsum(dO ⊙ o)`` and ``P = e^{S − LSE}``
over every key. For the sequence keys that is exactly the splash backward kernel run with the
merged ``(o, LSE)`` as its residuals (the kernel computes ``P`` from the ``lse`` residual and
``D`` from the ``out`` residual), so one backward pass covers them; the prefix keys' share is
three small einsums. The backward kernel is reached through the module's ``_splash_attention_bwd``
(not a public name): ``tests/ops/test_splash.py`` holds the merged gradient to autodiff of the
reference, so a JAX release that changes it fails there.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _sk

__all__ = ["SplashBlocks", "splash_attention"]

_LANES = 128  # TPU lane width: the kernel's blocks are multiples of it


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
    """Tile sizes of the splash kernels (numerics: only rounding depends on them).

    Attributes:
      q: queries per block; kv: keys per block. Positive multiples of 128; a sequence shorter
        than a block uses one block of its length rounded up to 128.
    """

    q: int = 512
    kv: int = 512

    def __post_init__(self):
        for name in ("q", "kv"):
            value = getattr(self, name)
            whole = isinstance(value, int) and not isinstance(value, bool)
            if not whole or value <= 0 or value % _LANES:
                raise ValueError(
                    f"SplashBlocks.{name}: expected a positive multiple of 128, got {value!r}"
                )

    def for_length(self, t: int) -> tuple[int, int, int]:
        """``(block_q, block_kv, padded T)`` for a sequence of ``t`` tokens."""
        fit = -(-t // _LANES) * _LANES
        bq, bkv = min(self.q, fit), min(self.kv, fit)
        step = math.lcm(bq, bkv)
        return bq, bkv, -(-t // step) * step


def _visible(tp: int, tiles: int, window: int) -> sa.Mask:
    """The static ``[tp, tiles · tp]`` mask: key ``j`` at position ``j mod tp``, causal, window."""
    if tiles == 1:
        if window:
            return sa.LocalMask((tp, tp), window_size=(window - 1, 0), offset=0)
        return sa.CausalMask((tp, tp))
    d = np.arange(tp)[:, None] - np.arange(tp)[None, :]
    one = (d >= 0) & ((d < window) if window else True)
    return sa.NumpyMask(np.tile(one, (1, tiles)))


def _kernel(tp: int, tiles: int, window: int, group: int, bq: int, bkv: int, residuals: bool,
            interpret: bool):  # fmt: skip
    """The MQA splash kernel of one KV head (``group`` query heads share its keys).

    Built in the caller's trace, never cached across traces: the kernel holds its mask tables as
    arrays made by ``jnp.array``, which inside a trace are that trace's values."""
    sizes = sa.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv,
    )  # fmt: skip
    mask = sa.MultiHeadMask([_visible(tp, tiles, window)] * group)
    return sa.make_splash_mqa_single_device(
        mask, block_sizes=sizes, save_residuals=residuals, interpret=interpret
    )


def _flat_infos(dq_info, dkv_info):
    """The backward kernels' mask infos as the kernel's own call passes them (leading block
    dimensions of ``partial_mask_blocks`` collapsed)."""

    def flat(info):
        if info is None or info.partial_mask_blocks is None:
            return info
        blocks = info.partial_mask_blocks
        return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))

    return flat(dq_info), flat(dkv_info)


def _with_prefix(kernel, q, k, v, pk, pv, q_seg, k_seg):
    """Attention of one (batch row, KV head) over ``P`` prefix keys and the sequence keys (the
    module docstring's merge). ``q [G, Tp, D]`` (scaled), ``k, v [S, D]``, ``pk, pv [P, D]``.

    The kernel's mask tables enter the ``custom_vjp`` as arguments (they are values of the
    caller's trace, which a ``custom_vjp`` function may not close over)."""
    kw = kernel.kwargs
    f32 = jnp.float32
    tables = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)

    def merged(q, k, v, pk, pv, seg, tables):
        o_m, (lse_m,) = _sk.SplashAttentionKernel(*tables, **kw)(q, k, v, segment_ids=seg)
        s_p = jnp.einsum("gtd,pd->gtp", q, pk, preferred_element_type=f32)
        lse = jnp.logaddexp(lse_m, jax.nn.logsumexp(s_p, axis=-1))
        p_p = jnp.exp(s_p - lse[..., None])
        o = jnp.exp(lse_m - lse)[..., None] * o_m.astype(f32) + jnp.einsum(
            "gtp,pd->gtd", p_p, pv.astype(f32)
        )
        return o, lse, p_p

    @jax.custom_vjp
    def attend(q, k, v, pk, pv, seg, tables):
        return merged(q, k, v, pk, pv, seg, tables)[0].astype(q.dtype)

    def fwd(q, k, v, pk, pv, seg, tables):
        o, lse, p_p = merged(q, k, v, pk, pv, seg, tables)
        return o.astype(q.dtype), (q, k, v, pk, pv, seg, tables, o, lse, p_p)

    def bwd(res, do):
        q, k, v, pk, pv, seg, tables, o, lse, p_p = res
        dq_info, dkv_info = _flat_infos(*tables[1:])
        residuals = (q, k, v, seg, None, o, lse, dq_info, dkv_info)
        grads = _sk._splash_attention_bwd(
            False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
            kw["attn_logits_soft_cap"], kw["interpret"], residuals, do,
        )  # fmt: skip
        dq, dk, dv = grads[3:6]
        do32 = do.astype(f32)
        di = jnp.sum(do32 * o, axis=-1, keepdims=True)
        ds = p_p * (jnp.einsum("gtd,pd->gtp", do32, pv.astype(f32)) - di)
        dq = dq.astype(f32) + jnp.einsum("gtp,pd->gtd", ds, pk.astype(f32))
        dpk = jnp.einsum("gtp,gtd->pd", ds, q.astype(f32))
        dpv = jnp.einsum("gtp,gtd->pd", p_p, do32)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
                dpk.astype(pk.dtype), dpv.astype(pv.dtype), None, None)  # fmt: skip

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, pk, pv, sa.SegmentIds(q_seg, k_seg), tables)


def _check(q, k, v, tiles, q_segment, k_segment, prefix_k, prefix_v, window) -> None:
    """One ValueError per malformed argument of :func:`splash_attention`."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v: expected [B, T, H, D] and [B, tiles·T, H_kv, D], got {q.shape}, {k.shape}, "
            f"{v.shape}"
        )
    b, t, h, d = q.shape
    hk = k.shape[2]
    if k.shape != (b, tiles * t, hk, d) or v.shape != k.shape:
        raise ValueError(
            f"k, v: expected [B={b}, tiles·T={tiles * t}, H_kv, D={d}], got {k.shape} and {v.shape}"
        )
    if h % hk:
        raise ValueError(f"k: H_kv={hk} must divide the query heads H={h}")
    if (q_segment is None) != (k_segment is None):
        raise ValueError("q_segment, k_segment: pass both or neither")
    if q_segment is not None and (q_segment.shape != (b, t) or k_segment.shape != (b, tiles * t)):
        raise ValueError(
            f"q_segment, k_segment: expected {(b, t)} and {(b, tiles * t)}, got "
            f"{q_segment.shape} and {k_segment.shape}"
        )
    if (prefix_k is None) != (prefix_v is None):
        raise ValueError("prefix_k, prefix_v: pass both or neither")
    if prefix_k is not None and (
        prefix_k.ndim != 4 or prefix_k.shape[::2] != (b, hk) or prefix_k.shape[3] != d
        or prefix_v.shape != prefix_k.shape
    ):  # fmt: skip
        raise ValueError(
            f"prefix_k, prefix_v: expected [B={b}, P, H_kv={hk}, D={d}], got {prefix_k.shape} "
            f"and {prefix_v.shape}"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window: expected an int >= 0 (0 = global), got {window!r}")
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles: expected an int >= 1, got {tiles!r}")


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int = 0,
    tiles: int = 1,
    q_segment: jax.Array | None = None,
    k_segment: jax.Array | None = None,
    prefix_k: jax.Array | None = None,
    prefix_v: jax.Array | None = None,
    scale: float | None = None,
    blocks: SplashBlocks = SplashBlocks(),
    interpret: bool = False,
) -> jax.Array:
    """Causal softmax attention on the splash kernel (see the module docstring for the mask).

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, tiles · T, H_kv, D]`` (``H_kv`` divides ``H``; query head
        ``h`` reads KV head ``h // (H / H_kv)``); key ``j`` stands at position ``j mod T``.
      window: a query sees the keys at positions ``t − window < s ≤ t`` (0: all ``s ≤ t``).
      tiles: the number of ``T``-long tiles of the key sequence.
      q_segment, k_segment: optional ``[B, T]`` / ``[B, tiles · T]`` int segment ids (ids ≥ 0).
      prefix_k, prefix_v: optional ``[B, P, H_kv, D]`` keys every query sees (no position).
      scale: multiplies the logits; default ``D ** -0.5`` (applied to ``q`` before the kernel).
      blocks: the kernel's tile sizes.
      interpret: run the Pallas interpreter (any platform) instead of Mosaic (TPU).

    On TPU, lower the program under the default matmul precision: JAX's kernel leaves its
    products' precision to ``jax_default_matmul_precision`` at lowering time, and Mosaic cannot
    lower a ``highest``-precision product of bf16 operands ("Bad lhs type").

    Returns:
      ``[B, T, H, D]`` in ``q.dtype``.
    """
    _check(q, k, v, tiles, q_segment, k_segment, prefix_k, prefix_v, window)
    b, t, h, d = q.shape
    hk = k.shape[2]
    group = h // hk
    bq, bkv, tp = blocks.for_length(t)
    scale = d**-0.5 if scale is None else scale
    kernel = _kernel(tp, tiles, window, group, bq, bkv, prefix_k is not None, interpret)

    def pad_tiles(x, fill, n=tiles):  # [B, n·T, ...] -> [B, n·Tp, ...], each tile padded
        x = x.reshape(b, n, t, *x.shape[2:])
        x = jnp.pad(x, ((0, 0), (0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 3),
                    constant_values=fill)  # fmt: skip
        return x.reshape(b, n * tp, *x.shape[3:])

    qh = (q.astype(jnp.float32) * scale).astype(q.dtype)
    qh = pad_tiles(qh, 0, 1).reshape(b, tp, hk, group, d).transpose(0, 2, 3, 1, 4)  # [B,Hk,G,Tp,D]
    kh, vh = (pad_tiles(x, 0).transpose(0, 2, 1, 3) for x in (k, v))  # [B, Hk, tiles·Tp, D]
    zeros = jnp.zeros((b, t), jnp.int32)
    qs = zeros if q_segment is None else q_segment.astype(jnp.int32)
    ks = jnp.tile(zeros, (1, tiles)) if k_segment is None else k_segment.astype(jnp.int32)
    qs, ks = pad_tiles(qs, -1, 1), pad_tiles(ks, -1)  # pad rows: a segment of their own

    o = _attend(kernel, qh, kh, vh, qs, ks, prefix_k, prefix_v)
    o = o.transpose(0, 3, 1, 2, 4).reshape(b, tp, h, d)  # [B, Tp, H, D]
    return o[:, :t].astype(q.dtype)


def _attend(kernel, qh, kh, vh, qs, ks, prefix_k, prefix_v):
    """The kernel per (batch row, KV head): ``[B, H_kv, G, Tp, D]`` out."""
    if prefix_k is None:

        def one(qx, kx, vx, qsx, ksx):
            return kernel(qx, kx, vx, segment_ids=sa.SegmentIds(qsx, ksx))

        return jax.vmap(jax.vmap(one, (0, 0, 0, None, None)))(qh, kh, vh, qs, ks)
    pk, pv = (x.transpose(0, 2, 1, 3) for x in (prefix_k, prefix_v))  # [B, Hk, P, D]

    def with_prefix(qx, kx, vx, pkx, pvx, qsx, ksx):
        return _with_prefix(kernel, qx, kx, vx, pkx, pvx, qsx, ksx)

    return jax.vmap(jax.vmap(with_prefix, (0,) * 5 + (None, None)))(qh, kh, vh, pk, pv, qs, ks)
