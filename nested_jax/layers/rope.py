"""Rotary position embedding (RoPE) for ``[B, T, H, D]`` arrays (SPEC §6, Transformer++)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
    """Inverse frequencies ``θ^{-2i/D}``, ``i < D/2``, float32 ``[D/2]``."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float = 10000.0) -> jax.Array:
    """Rotate channel pairs ``(x_i, x_{i+D/2})`` by angle ``p · θ^{-2i/D}`` (rotate-half layout, as
    Llama).

    Args:
      x: ``[B, T, H, D]`` queries or keys, ``D`` even.
      positions: ``[B, T]`` integer positions (restart at 0 at each packed segment start).
      theta: base frequency.

    Returns:
      ``[B, T, H, D]`` in ``x.dtype`` (the rotation itself is computed in float32).
    """
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"x: expected shape [B, T, H, D] with even D, got {tuple(x.shape)}")
    if positions.shape != x.shape[:2]:
        raise ValueError(f"positions: expected shape {x.shape[:2]}, got {tuple(positions.shape)}")
    d = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(d, theta)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def segment_positions(
    segment_ids: jax.Array | None, batch: int, length: int, offset=0
) -> jax.Array:
    """Token positions ``[B, T]`` int32: ``offset + t``, or ``t − start(segment of t)`` with
    ``segment_ids``.

    Args:
      segment_ids: optional ``[B, T]`` integer ids; a new segment starts wherever the id changes.
      batch, length: ``B`` and ``T``.
      offset: scalar added to every position when ``segment_ids`` is None (the decode cache
      position).
    """
    t = jnp.arange(length, dtype=jnp.int32)
    if segment_ids is None:
        return jnp.broadcast_to(t + jnp.asarray(offset, jnp.int32), (batch, length))
    if segment_ids.shape != (batch, length):
        raise ValueError(f"segment_ids: expected shape {(batch, length)}, got {segment_ids.shape}")
    is_start = jnp.concatenate(
        [jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start = jax.lax.cummax(jnp.where(is_start, t, 0), axis=1)
    return t - start
