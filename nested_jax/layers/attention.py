"""Causal softmax attention mixer (Transformer++, SPEC §6): RoPE, optional sliding window, GQA, KV
cache."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.common import check_rank, dense
from nested_jax.layers.rope import RopeScaling, apply_rope
from nested_jax.ops.attention import splash_attention

# How a softmax attention runs without a KV cache: the blockwise XLA form or the splash kernel.
ATTENTION_IMPLS = ("xla", "pallas")


def check_attention_impl(impl: str) -> None:
    """``ValueError`` naming ``impl`` unless it is one of :data:`ATTENTION_IMPLS`."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl: expected one of {ATTENTION_IMPLS}, got {impl!r}")


class AttentionCache(NamedTuple):
    """Per-layer KV cache: ``k, v [B, S, H_kv, D]`` (``S = max_len`` slots) and ``pos`` int32 (slots
    filled)."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array


def attention_mask(
    q_index: jax.Array,
    k_index: jax.Array,
    *,
    window: int = 0,
    q_segment: jax.Array | None = None,
    k_segment: jax.Array | None = None,
    k_valid: jax.Array | None = None,
) -> jax.Array:
    """Boolean ``[B, T, S]`` visibility: ``k ≤ q`` (causal), ``q − k < window`` if ``window > 0``,
    same segment.

    Args:
      q_index: ``[B, T]`` absolute indices of the queries; k_index: ``[B, S]`` of the keys.
      window: sliding window (a query sees at most ``window`` keys including itself); 0 = global.
      q_segment, k_segment: optional ``[B, T]`` / ``[B, S]`` segment ids (keys of another segment
      are hidden).
      k_valid: optional ``[B, S]`` bool (unfilled cache slots are False).
    """
    diff = q_index[:, :, None] - k_index[:, None, :]
    mask = diff >= 0
    if window > 0:
        mask &= diff < window
    if q_segment is not None:
        mask &= q_segment[:, :, None] == k_segment[:, None, :]
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    return mask


def softmax_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None
) -> jax.Array:
    """``o_t = Σ_s softmax_s(scale · q_tᵀ k_s + mask) v_s`` with grouped KV heads (GQA), logits in
    float32.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, S, H_kv, D]`` with ``H % H_kv == 0`` (query head h reads KV
      head
        ``h // (H / H_kv)``).
      mask: ``[B, T, S]`` bool, True = visible. Every query must see at least one key.
      scale: default ``D ** -0.5``.

    Returns:
      ``[B, T, H, D]`` in ``q.dtype``.
    """
    check_rank("q", q, 4, "[B, T, H, D]")
    check_rank("k", k, 4, "[B, S, H_kv, D]")
    b, t, h, d = q.shape
    s, hk = k.shape[1], k.shape[2]
    if k.shape != (b, s, hk, d) or v.shape[:3] != (b, s, hk):
        raise ValueError(f"k, v: expected [B={b}, S, H_kv, D={d}], got {k.shape} and {v.shape}")
    if h % hk:
        raise ValueError(f"k: H_kv={hk} must divide the query heads H={h}")
    if mask.shape != (b, t, s):
        raise ValueError(f"mask: expected shape {(b, t, s)}, got {tuple(mask.shape)}")
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, t, hk, h // hk, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum(
        "bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return o.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


def _check_blockwise_inputs(q, k, q_index, k_index, q_segment, k_segment, k_valid) -> None:
    """Shapes of :func:`blockwise_softmax_attention`'s arguments, one ValueError per problem."""
    check_rank("q", q, 4, "[B, T, H, D]")
    check_rank("k", k, 4, "[B, S, H_kv, D]")
    b, t = q.shape[:2]
    s = k.shape[1]
    if (q_segment is None) != (k_segment is None):
        raise ValueError("q_segment, k_segment: pass both or neither")
    for name, arr, shape in (
        ("q_index", q_index, (b, t)),
        ("k_index", k_index, (b, s)),
        ("q_segment", q_segment, (b, t)),
        ("k_segment", k_segment, (b, s)),
        ("k_valid", k_valid, (b, s)),
    ):
        if arr is not None and tuple(arr.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(arr.shape)}")


def blockwise_softmax_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_index: jax.Array,
    k_index: jax.Array,
    window: int = 0,
    q_segment: jax.Array | None = None,
    k_segment: jax.Array | None = None,
    k_valid: jax.Array | None = None,
    scale: float | None = None,
    block: int = 512,
) -> jax.Array:
    """``softmax_attention(q, k, v, attention_mask(q_index, k_index, ...), scale=scale)`` computed
    ``block`` queries at a time, without the ``[B, T, S]`` mask or the ``[B, H, T, S]`` scores.

    Each query row's softmax runs over all ``S`` keys exactly as in the reference (same einsums,
    f32 logits, same masking), so the result equals it up to float rounding; the difference is
    memory. The queries are padded to a multiple of ``block`` (pad rows repeat the last real
    query's index and segment, so they see a key and stay finite; they are dropped) and walked
    with ``lax.map``; each block builds its ``[B, block, S]`` mask from the indices and is under
    ``jax.checkpoint``, so the backward pass recomputes the block's scores instead of storing
    them. Peak memory: ``O(B · H · block · S)`` f32 instead of ``O(B · H · T · S)``. ``block <= 0``
    or ``T <= block`` runs the reference on one block.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, S, H_kv, D]`` (GQA as in :func:`softmax_attention`).
      q_index, k_index: ``[B, T]`` / ``[B, S]`` absolute positions (see :func:`attention_mask`).
      window, q_segment, k_segment, k_valid: as in :func:`attention_mask`.
      scale: default ``D ** -0.5``.
      block: queries per block.

    Returns:
      ``[B, T, H, D]`` in ``q.dtype``.
    """
    _check_blockwise_inputs(q, k, q_index, k_index, q_segment, k_segment, k_valid)
    b, t = q.shape[:2]
    if block <= 0 or t <= block:
        mask = attention_mask(
            q_index, k_index, window=window, q_segment=q_segment, k_segment=k_segment,
            k_valid=k_valid,
        )  # fmt: skip
        return softmax_attention(q, k, v, mask, scale=scale)
    n = -(-t // block)
    pad = n * block - t

    def blocks(x):  # [B, T, ...] -> [n, B, block, ...], pad rows repeating the last query
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), mode="edge")
        return jnp.swapaxes(x.reshape(b, n, block, *x.shape[2:]), 0, 1)

    # Keys and values enter the blocks in (at least) f32, cast back inside: their gradients are
    # accumulated over the blocks in f32 rather than in a bf16 activation dtype. Forward values
    # are unchanged (the round trip is exact).
    acc = jnp.promote_types(k.dtype, jnp.float32), jnp.promote_types(v.dtype, jnp.float32)
    k_acc, v_acc = k.astype(acc[0]), v.astype(acc[1])

    # prevent_cse=False: inside lax.map the recomputation cannot be merged with the forward.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(xs):
        qb, qib, qsb = xs
        mask = attention_mask(
            qib, k_index, window=window, q_segment=qsb, k_segment=k_segment, k_valid=k_valid
        )
        kb, vb = k_acc.astype(k.dtype), v_acc.astype(v.dtype)
        return softmax_attention(qb, kb, vb, mask, scale=scale)

    xs = (blocks(q), blocks(q_index), None if q_segment is None else blocks(q_segment))
    o = jax.lax.map(one, xs)  # [n, B, block, H, D]
    return jnp.swapaxes(o, 0, 1).reshape(b, n * block, *o.shape[3:])[:, :t]


class Attention(nnx.Module):
    """Multi-head causal softmax attention with RoPE, optional sliding window and GQA (SPEC §6).

    ``q = RoPE(x W_q)``, ``k = RoPE(x W_k)``, ``v = x W_v``, ``y = softmax_attention(q, k, v) W_o``.
    Kernels: ``W_q [d, H·D]`` ``("embed", "heads")``, ``W_k, W_v [d, H_kv·D]`` ``("embed", "kv")``,
    ``W_o [H·D, d]`` ``("heads", "embed")``.

    ``attention_block``: above this many queries in one call (training, prefill) the scores are
    computed per block of that many queries (:func:`blockwise_softmax_attention`, no
    ``[B, H, T, S]`` scores); ``0`` always uses the full-scores reference.

    ``impl``: ``xla`` (the above) or ``pallas``: a call without a KV cache runs on the splash TPU
    kernel (:func:`nested_jax.ops.attention.splash_attention`, the Pallas interpreter off TPU;
    equal values); decoding with a cache always takes the XLA form.

    ``qkv_bias``: ``q = RoPE(x W_q + b_q)`` etc. (Qwen2); ``rope_scaling``: the RoPE frequency
    stretch (:class:`nested_jax.layers.rope.RopeScaling`; Llama 3). Both come from the config's
    ``model.attention`` section (``AttentionOptions``).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        n_kv_heads: int | None = None,
        window: int = 0,
        rope_theta: float = 10000.0,
        attention_block: int = 512,
        impl: str = "xla",
        qkv_bias: bool = False,
        rope_scaling: RopeScaling | None = None,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        n_kv_heads = n_kv_heads or n_heads
        if not isinstance(attention_block, int) or attention_block < 0:
            raise ValueError(
                f"attention_block: expected an int >= 0 (0 = full scores), got {attention_block!r}"
            )
        check_attention_impl(impl)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: {n_kv_heads} must divide n_heads={n_heads}")
        if head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.n_kv_heads, self.window, self.rope_theta, self.dtype = (
            n_kv_heads,
            window,
            rope_theta,
            dtype,
        )
        self.attention_block, self.rope_scaling, self.impl = attention_block, rope_scaling, impl
        qkv = {"dtype": dtype, "rngs": rngs, "bias": qkv_bias}
        self.q_proj = dense(d_model, n_heads * head_dim, ("embed", "heads"), **qkv)
        self.k_proj = dense(d_model, n_kv_heads * head_dim, ("embed", "kv"), **qkv)
        self.v_proj = dense(d_model, n_kv_heads * head_dim, ("embed", "kv"), **qkv)
        self.o_proj = dense(n_heads * head_dim, d_model, ("heads", "embed"), dtype=dtype, rngs=rngs)

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs) -> Attention:
        """Build from a :class:`nested_jax.models.config.ModelConfig` (registry entry
        ``transformer``)."""
        return cls(
            cfg.d_model,
            cfg.n_heads,
            cfg.resolved_head_dim(),
            n_kv_heads=cfg.resolved_kv_heads(),
            window=cfg.window,
            rope_theta=cfg.rope_theta,
            # ModelConfig.attention_block when the config has the field; 512 until then.
            attention_block=cfg.attention_block,
            impl=cfg.attention_impl,
            qkv_bias=cfg.attention.qkv_bias,
            rope_scaling=cfg.attention.scaling(),
            dtype=cfg.activation_dtype(),
            rngs=rngs,
        )

    def init_cache(self, batch_size: int, max_len: int) -> AttentionCache:
        """Empty KV cache with ``max_len`` slots (activation dtype) and ``pos = 0``."""
        shape = (batch_size, max_len, self.n_kv_heads, self.head_dim)
        return AttentionCache(
            jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype), jnp.zeros((), jnp.int32)
        )

    def __call__(
        self,
        x: jax.Array,
        *,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
        cache: AttentionCache | None = None,
    ) -> tuple[jax.Array, AttentionCache | None]:
        """Args:
          x: ``[B, T, d_model]``.
          positions: ``[B, T]`` RoPE positions (restarting at segment starts for packed input).
          segment_ids: optional ``[B, T]``; keys of other segments are masked (only without a
          cache).
          cache: optional :class:`AttentionCache`; the T new keys/values are written at slots
            ``pos … pos+T−1`` and the queries attend to every filled slot (caller keeps ``pos + T ≤
            S``).

        Returns:
          ``(y [B, T, d_model], new_cache or None)``.
        """
        check_rank("x", x, 3, "[B, T, d_model]")
        b, t, _ = x.shape
        if segment_ids is not None and cache is not None:
            raise ValueError(
                "segment_ids: packed segments are not supported together with a KV cache"
            )
        x = x.astype(self.dtype)
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        q = apply_rope(q, positions, theta=self.rope_theta, scaling=self.rope_scaling)
        k = apply_rope(k, positions, theta=self.rope_theta, scaling=self.rope_scaling)
        q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        k_index, new_cache = q_index, None
        if cache is not None:
            pos = cache.pos
            # Past the last slot dynamic_update_slice clamps silently: catch it when pos is known.
            if not isinstance(pos, jax.core.Tracer) and int(pos) + t > cache.k.shape[1]:
                raise ValueError(
                    f"cache: {int(pos)} + {t} tokens exceed the {cache.k.shape[1]} cache slots"
                )
            k_all = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, pos, 0, 0))
            v_all = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, pos, 0, 0))
            slots = jnp.broadcast_to(
                jnp.arange(k_all.shape[1], dtype=jnp.int32), (b, k_all.shape[1])
            )
            q_index, k_index = q_index + pos, slots
            new_cache = AttentionCache(k_all, v_all, pos + t)
            k, v = k_all.astype(self.dtype), v_all.astype(self.dtype)
        if self.impl == "pallas" and cache is None:
            o = splash_attention(
                q, k, v, window=self.window, q_segment=segment_ids, k_segment=segment_ids
            )
            return self.o_proj(o.reshape(b, t, self.n_heads * self.head_dim)), None
        # T > attention_block: per query block, no [B, T, S] mask / [B, H, T, S] scores; otherwise
        # (and attention_block = 0) the reference softmax_attention(attention_mask(...)).
        o = blockwise_softmax_attention(
            q, k, v, q_index=q_index, k_index=k_index, window=self.window,
            q_segment=segment_ids, k_segment=segment_ids, block=self.attention_block,
        )  # fmt: skip
        return self.o_proj(o.reshape(b, t, self.n_heads * self.head_dim)), new_cache
