"""Causal depthwise short convolution with a decode state (SPEC §1: width 4 on q, k, v of DeltaNet /
GDN)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.common import check_rank, partitioned


def causal_depthwise_conv(
    x: jax.Array,
    kernel: jax.Array,
    *,
    state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv ``y_t = Σ_{i<W} w_i ⊙ x_{t-W+1+i}`` (inputs before the sequence come
    from ``state``).

    With ``segment_ids`` a tap that reaches into an earlier segment contributes zero, so packed
    sequences do not
    mix; the ``state`` is treated as part of the segment of the first token.

    Args:
      x: ``[B, T, C]`` inputs.
      kernel: ``[W, C]`` per-channel taps (``kernel[W-1]`` multiplies the current token).
      state: ``[B, W-1, C]`` the last ``W-1`` inputs before ``x`` (``None`` → zeros).
      segment_ids: optional ``[B, T]`` integer ids of packed sequences.

    Returns:
      ``(y [B, T, C], new_state [B, W-1, C])``; ``new_state`` holds the last ``W-1`` inputs (in
      ``x.dtype``).
    """
    check_rank("x", x, 3, "[B, T, C]")
    check_rank("kernel", kernel, 2, "[W, C]")
    b, t, c = x.shape
    w = kernel.shape[0]
    if kernel.shape[1] != c:
        raise ValueError(f"kernel: expected shape [W, {c}], got {tuple(kernel.shape)}")
    if state is None:
        state = jnp.zeros((b, w - 1, c), x.dtype)
    if state.shape != (b, w - 1, c):
        raise ValueError(f"state: expected shape {(b, w - 1, c)}, got {tuple(state.shape)}")
    xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    if segment_ids is not None:
        if segment_ids.shape != (b, t):
            raise ValueError(f"segment_ids: expected shape {(b, t)}, got {segment_ids.shape}")
        seg_p = jnp.concatenate(
            [jnp.repeat(segment_ids[:, :1], w - 1, axis=1), segment_ids], axis=1
        )
    kernel = kernel.astype(jnp.float32)
    y = jnp.zeros((b, t, c), jnp.float32)
    # W is tiny (4): a sum of W shifted products is cheaper and simpler than a general conv op and
    # lets the
    # segment mask act per tap.
    for i in range(w):
        tap = xp[:, i : i + t].astype(jnp.float32)
        if segment_ids is not None:
            same = (seg_p[:, i : i + t] == segment_ids)[..., None]
            tap = jnp.where(same, tap, 0.0)
        y = y + tap * kernel[i]
    new_state = xp[:, t:] if w > 1 else xp[:, :0]
    return y.astype(x.dtype), new_state


class ShortConv(nnx.Module):
    """Depthwise causal conv of width ``conv_size`` over ``channels`` (no bias), kernel named
    ``("conv", names)``.

    Initialised like PyTorch's ``Conv1d`` default: ``U(-1/√W, 1/√W)`` (fan-in of a depthwise filter
    is W).
    """

    def __init__(
        self,
        channels: int,
        conv_size: int = 4,
        *,
        names: tuple[str | None] = ("heads",),
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if conv_size < 1:
            raise ValueError(f"conv_size: must be >= 1, got {conv_size}")
        self.channels = channels
        self.conv_size = conv_size
        self.dtype = dtype
        bound = conv_size**-0.5

        def init(key, shape, dt=jnp.float32):
            return jax.random.uniform(key, shape, dt, -bound, bound)

        self.kernel = nnx.Param(
            partitioned(init, ("conv", *names))(rngs.params(), (conv_size, channels))
        )

    def init_state(self, batch_size: int) -> jax.Array:
        """Zero decode state ``[batch_size, conv_size-1, channels]`` in the activation dtype."""
        return jnp.zeros((batch_size, self.conv_size - 1, self.channels), self.dtype)

    def __call__(self, x, *, state=None, segment_ids=None):
        """See :func:`causal_depthwise_conv`. Returns ``(y [B, T, C], new_state [B, W-1, C])``."""
        return causal_depthwise_conv(
            x.astype(self.dtype), self.kernel[...], state=state, segment_ids=segment_ids
        )
