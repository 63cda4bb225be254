"""SwiGLU feed-forward block of the LM shell (SPEC §6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.common import dense


class SwiGLU(nnx.Module):
    """``y = (silu(x W_gate) ⊙ x W_up) W_down`` with hidden width ``hidden``.

    Kernels: ``W_gate, W_up [d_model, hidden]`` named ``("embed", "mlp")``; ``W_down`` ``("mlp",
    "embed")``.
    """

    def __init__(self, d_model: int, hidden: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.d_model = d_model
        self.gate = dense(d_model, hidden, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up = dense(d_model, hidden, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down = dense(hidden, d_model, ("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Args: ``x [..., d_model]``. Returns ``[..., d_model]`` in the layer's dtype."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected last dimension {self.d_model}, got {tuple(x.shape)}")
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
