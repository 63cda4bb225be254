"""Softmax attention with persistent memory (SPEC §2 "Persistent memory"): the attention of Titans
MAC, MAG and MAL.

:class:`PersistentSWA` is causal (sliding-window) softmax attention with RoPE and ``N_p`` learned
persistent key/value tokens that every query sees; ``impl="pallas"`` runs its cache-free forms on
the splash TPU kernel (:func:`nested_jax.ops.attention.splash_attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.attention import (
    AttentionCache,
    attention_mask,
    check_attention_impl,
    softmax_attention,
)
from nested_jax.layers.common import dense, partitioned
from nested_jax.layers.rope import apply_rope
from nested_jax.ops.attention import splash_attention

__all__ = ["PersistentSWA", "persistent_swa"]


class PersistentSWA(nnx.Module):
    """Causal softmax attention with RoPE, sliding ``window`` (0 = global) and ``N_p`` persistent
    tokens (SPEC §2 "Persistent memory").

    The persistent tokens are learned keys / values ``[N_p, H, D]`` (position-free, no RoPE) that
    every query sees in addition to its window. Returns per-head outputs (no output projection).
    ``impl``: ``xla`` (the reference softmax over the full mask) or ``pallas`` (the splash TPU
    kernel for the cache-free forms, :func:`nested_jax.ops.attention.splash_attention`).
    """

    def __init__(
        self, d_in, n_heads, head_dim, *, window, persistent, rope_theta, dtype, rngs, impl="xla"
    ):
        if head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
        check_attention_impl(impl)
        self.impl = impl
        self.n_heads, self.head_dim, self.window, self.n_persistent = (
            n_heads, head_dim, window, persistent,
        )  # fmt: skip
        self.rope_theta, self.dtype = rope_theta, dtype
        hd = n_heads * head_dim
        self.q_proj = dense(d_in, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = dense(d_in, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.v_proj = dense(d_in, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        init = partitioned(nnx.initializers.normal(1.0), (None, "heads", None))
        shape = (max(persistent, 1), n_heads, head_dim)  # a dummy row when N_p = 0 (never read)
        self.p_k = nnx.Param(init(rngs.params(), shape))
        self.p_v = nnx.Param(init(rngs.params(), shape))

    def init_cache(self, batch_size: int, max_len: int) -> AttentionCache:
        """KV cache with ``max_len`` slots."""
        shape = (batch_size, max_len, self.n_heads, self.head_dim)
        z = jnp.zeros(shape, self.dtype)
        return AttentionCache(z, z, jnp.zeros((), jnp.int32))

    def qkv(self, x, positions):
        """``q, k`` (RoPE at ``positions``) and ``v``, each ``[B, T, H, D]``."""
        b, t, _ = x.shape
        sh = (b, t, self.n_heads, self.head_dim)
        q = apply_rope(self.q_proj(x).reshape(sh), positions, theta=self.rope_theta)
        k = apply_rope(self.k_proj(x).reshape(sh), positions, theta=self.rope_theta)
        return q, k, self.v_proj(x).reshape(sh)

    def persistent_kv(self, b: int):
        """Persistent ``k, v [B, N_p, H, D]`` (activation dtype)."""
        f = (
            lambda p: jnp.broadcast_to(  # noqa: E731
                p[: self.n_persistent].astype(self.dtype), (b, self.n_persistent, *p.shape[1:])
            )
        )
        return f(self.p_k[...]), f(self.p_v[...])

    def attend(self, q, k, v, mask):
        """``softmax_attention`` over ``[persistent ‖ k]`` (persistent keys always visible)."""
        b, t = q.shape[:2]
        pk, pv = self.persistent_kv(b)
        k = jnp.concatenate([pk, k.astype(self.dtype)], axis=1)
        v = jnp.concatenate([pv, v.astype(self.dtype)], axis=1)
        mask = jnp.concatenate([jnp.ones((b, t, self.n_persistent), bool), mask], axis=2)
        return softmax_attention(q, k, v, mask)

    def attend_causal(self, q, k, v, *, window=0, tiles=1, segment_ids=None):
        """Causal attention over ``[persistent ‖ k]`` for a whole sequence (no cache).

        ``q [B, T, H, D]``, ``k, v [B, tiles · T, H, D]`` whose key ``j`` stands at position
        ``j mod T`` (MAC: ``[h̃ ‖ x]``, ``tiles = 2``); query ``t`` sees the persistent keys and
        the keys at positions ``t − window < s ≤ t`` (``window = 0``: all ``s ≤ t``) of its own
        segment (``segment_ids [B, T]``, the same for every tile)."""
        b, t = q.shape[:2]
        seg_k = None if segment_ids is None else jnp.tile(segment_ids, (1, tiles))
        if self.impl == "pallas":
            pk, pv = self.persistent_kv(b) if self.n_persistent else (None, None)
            return splash_attention(
                q, k.astype(self.dtype), v.astype(self.dtype), window=window, tiles=tiles,
                q_segment=segment_ids, k_segment=seg_k, prefix_k=pk, prefix_v=pv,
            )  # fmt: skip
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = attention_mask(idx, jnp.tile(idx, (1, tiles)), window=window, q_segment=segment_ids,
                              k_segment=seg_k)  # fmt: skip
        return self.attend(q, k, v, mask)

    def __call__(self, x, *, positions, segment_ids=None, cache=None):
        """``x [B, T, d]`` → ``(o [B, T, H, D], cache)``; the cache appends at ``cache.pos``."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x.astype(self.dtype), positions)
        if cache is None:
            return self.attend_causal(q, k, v, window=self.window, segment_ids=segment_ids), None
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        pos = cache.pos
        k_all = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, pos, 0, 0))
        v_all = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, pos, 0, 0))
        slots = jnp.broadcast_to(jnp.arange(k_all.shape[1], dtype=jnp.int32), (b, k_all.shape[1]))
        mask = attention_mask(idx + pos, slots, window=self.window)
        return self.attend(q, k_all, v_all, mask), AttentionCache(k_all, v_all, pos + t)


def persistent_swa(cfg, d_in, rngs):
    """The :class:`PersistentSWA` of a Titans mixer from its ``ModelConfig`` (``model.titans``
    window and persistent tokens, ``model.attention_impl``)."""
    o = cfg.titans
    return PersistentSWA(
        d_in, cfg.n_heads, cfg.resolved_head_dim(), window=o.window,
        persistent=o.persistent_tokens, rope_theta=cfg.rope_theta, dtype=cfg.activation_dtype(),
        rngs=rngs, impl=cfg.attention_impl,
    )  # fmt: skip
