"""RMSNorm and the SiLU-gated RMSNorm used on the outputs of DeltaNet / Gated DeltaNet (SPEC §1,
§6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.common import Names, partitioned


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``y = x / sqrt(mean(x², -1) + eps) * scale``, computed in float32, returned in ``x.dtype``.

    Args:
      x: ``[..., D]`` activations.
      scale: ``[D]`` learned gain.
      eps: numerical floor inside the square root.
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned gain initialised at 1 (SPEC §6, Transformer++)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, names: Names = ("embed",), rngs: nnx.Rngs):
        del rngs  # deterministic init; the argument keeps the NNX constructor convention
        self.dim = dim
        self.eps = eps
        self.scale = nnx.Param(partitioned(nnx.initializers.ones, names)(None, (dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Args: ``x [..., dim]``. Returns the normalised ``x`` in its own dtype."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"x: expected last dimension {self.dim}, got shape {tuple(x.shape)}")
        return rms_norm(x, self.scale[...], self.eps)


class GatedRMSNorm(nnx.Module):
    """Output norm of DeltaNet / GDN: ``o = RMSNorm(o) * silu(gate)`` per head (SPEC §1).

    The gain has the head width and is shared by all heads (as in FLA's fused gated norm).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        del rngs
        self.dim = dim
        self.eps = eps
        self.scale = nnx.Param(
            partitioned(nnx.initializers.ones, (None,))(None, (dim,), jnp.float32)
        )

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        """Args: ``x [..., dim]`` (per-head outputs), ``gate`` same shape. Returns ``x.dtype``."""
        if x.shape[-1] != self.dim or gate.shape != x.shape:
            raise ValueError(
                f"x, gate: expected equal shapes [..., {self.dim}], got {x.shape} and {gate.shape}"
            )
        y = rms_norm(x.astype(jnp.float32), self.scale[...], self.eps)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
