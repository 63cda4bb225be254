"""Rotary position embedding (RoPE) for ``[B, T, H, D]`` arrays (SPEC §6, Transformer++)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

ROPE_SCALINGS = ("linear", "llama3")


class RopeScaling(NamedTuple):
    """A stretch of the RoPE frequencies for contexts beyond the trained length (the Hugging Face
    ``rope_scaling`` of Llama-style checkpoints).

    - ``linear``: every frequency divided by ``factor`` (position interpolation).
    - ``llama3``: with wavelength ``λ_i = 2π/ω_i`` and ``L = original_max_len``,
      ``s_i = clip((L/λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor), 0, 1)`` and
      ``ω_i ← (1 − s_i) ω_i / factor + s_i ω_i``: long wavelengths (``λ > L/low_freq_factor``) are
      slowed by ``factor``, short ones (``λ < L/high_freq_factor``) kept, the band between
      interpolated.
    """

    kind: str  # one of ROPE_SCALINGS
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Inverse frequencies ``ω_i = θ^{-2i/D}``, ``i < D/2``, float32 ``[D/2]``, stretched by
    ``scaling`` (:class:`RopeScaling`) when given."""
    freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return freq
    if scaling.kind == "linear":
        return freq / scaling.factor
    if scaling.kind != "llama3":
        raise ValueError(f"scaling.kind: expected one of {ROPE_SCALINGS}, got {scaling.kind!r}")
    band = scaling.high_freq_factor - scaling.low_freq_factor
    wavelength = 2 * math.pi / freq
    s = jnp.clip((scaling.original_max_len / wavelength - scaling.low_freq_factor) / band, 0, 1)
    return (1 - s) * freq / scaling.factor + s * freq


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
) -> jax.Array:
    """Rotate channel pairs ``(x_i, x_{i+D/2})`` by angle ``p · ω_i`` (rotate-half layout, as
    Llama), ``ω_i`` from :func:`rope_frequencies`.

    Args:
      x: ``[B, T, H, D]`` queries or keys, ``D`` even.
      positions: ``[B, T]`` integer positions (restart at 0 at each packed segment start).
      theta: base frequency.
      scaling: optional frequency stretch (:class:`RopeScaling`); None = plain RoPE.

    Returns:
      ``[B, T, H, D]`` in ``x.dtype`` (the rotation itself is computed in float32).
    """
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"x: expected shape [B, T, H, D] with even D, got {tuple(x.shape)}")
    if positions.shape != x.shape[:2]:
        raise ValueError(f"positions: expected shape {x.shape[:2]}, got {tuple(positions.shape)}")
    d = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(
        d, theta, scaling
    )  # [B, T, D/2]
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
