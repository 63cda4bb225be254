"""Causal softmax attention on the TPU splash kernel (SPEC §6): the ``impl="pallas"`` door.

``splash_attention`` reaches ``pallas_kernels.splash.splash_attention`` (JAX's splash-attention
kernels under the project's masks: causal, sliding window, a tiled key sequence, prefix keys every
query sees, packed segments): the Mosaic kernel in a program lowered for TPU, the Pallas
interpreter on any other platform, and inside a mesh one call per (batch, heads) shard
(:func:`nested_jax.ops._pallas.pallas_per_shard`; attention is independent per batch row and
head). The XLA forms it equals — the full-scores reference ``softmax_attention`` and the
query-blockwise ``blockwise_softmax_attention`` — live with the attention layer
(``nested_jax.layers.attention``), which chooses between them by ``model.attention.impl``.
"""

from __future__ import annotations

import functools

import jax

from nested_jax.ops._pallas import pallas_per_shard
from pallas_kernels.splash import splash_attention as _splash

__all__ = ["splash_attention"]

_SEQ = ("batch", None, "heads", None)  # q, o: [B, T, H, D]
_KV = ("batch", None, "kv", None)  # k, v, prefix_k, prefix_v: [B, S, H_kv, D]
_LOGICAL = {
    "q": _SEQ,
    "k": _KV,
    "v": _KV,
    "prefix_k": _KV,
    "prefix_v": _KV,
    "q_segment": ("batch", None),
    "k_segment": ("batch", None),
}


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
) -> jax.Array:
    """``softmax_s(scale · q_tᵀ k_s) v_s`` over the keys query ``t`` sees, on the splash kernel.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, tiles · T, H_kv, D]`` (GQA: query head ``h`` reads KV head
        ``h // (H / H_kv)``); key ``j`` stands at position ``j mod T``.
      window: query ``t`` sees positions ``t − window < s ≤ t`` (0: every ``s ≤ t``).
      tiles: ``T``-long tiles of the key sequence (Titans MAC: 2, ``[h̃ ‖ x]``).
      q_segment, k_segment: optional ``[B, T]`` / ``[B, tiles · T]`` int segment ids (≥ 0).
      prefix_k, prefix_v: optional ``[B, P, H_kv, D]`` keys every query sees (persistent tokens).
      scale: default ``D ** -0.5``.

    Returns:
      ``[B, T, H, D]`` in ``q.dtype``; equal to the layer's reference up to float rounding.
    """
    kernel = functools.partial(_splash, window=window, tiles=tiles, scale=scale)
    operands = dict(
        q=q, k=k, v=v, q_segment=q_segment, k_segment=k_segment, prefix_k=prefix_k,
        prefix_v=prefix_v,
    )  # fmt: skip
    (o,) = pallas_per_shard(lambda **ops: (kernel(**ops),), operands, _LOGICAL, (_SEQ,), (q.shape,))
    return o
