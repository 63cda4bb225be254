"""Gated DeltaNet mixer (SPEC §1; GDN paper / FLA parameterisation of the decay)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax import ops
from nested_jax.layers.common import dense, partitioned
from nested_jax.layers.deltanet import DeltaNet


def _a_log_init(key, shape, dtype=jnp.float32):
    """``A_log = log A`` with ``A ~ U(0, 16)`` (FLA / Mamba2 default); kept away from log 0."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1e-4, 16.0))


def _dt_bias_init(key, shape, dtype=jnp.float32, dt_min=1e-3, dt_max=0.1, floor=1e-4):
    """``dt_bias = softplus⁻¹(dt)`` with ``dt`` log-uniform in ``[dt_min, dt_max]`` (Mamba2 / FLA
    GDN)."""
    u = jax.random.uniform(key, shape, dtype)
    dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), floor)
    return dt + jnp.log(-jnp.expm1(-dt))


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet (SPEC §1): ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``.

    Decay ``g_t = log α_t = −softplus(x W_a + dt_bias) · exp(A_log)`` per head; everything else as
    :class:`DeltaNet`, including Proteus key-row blocks (SPEC §4; ``proteus_blocks``,
    ``proteus_context_len``, from ``model.proteus`` in ``from_config``): the layer then equals
    ``core.associative.proteus.proteus_gated_delta_*`` (see ``nested_jax.layers.deltanet``).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(d_model, n_heads, head_dim, rngs=rngs, **kwargs)
        self.a_proj = dense(d_model, n_heads, ("embed", None), dtype=self.dtype, rngs=rngs)
        self.A_log = nnx.Param(partitioned(_a_log_init, ("heads",))(rngs.params(), (n_heads,)))
        self.dt_bias = nnx.Param(partitioned(_dt_bias_init, ("heads",))(rngs.params(), (n_heads,)))

    def _log_decay(self, x: jax.Array) -> jax.Array:
        a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...]
        return -jax.nn.softplus(a) * jnp.exp(self.A_log[...])

    def _rule(self, q, k, v, g, beta, *, state, segment_ids, single_step: bool):
        if single_step:
            o, s = ops.gated_delta_step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            return o[:, None], s
        return ops.gated_delta(
            q,
            k,
            v,
            g,
            beta,
            initial_state=state,
            segment_ids=segment_ids,
            chunk_size=self.chunk_size,
            impl=self.impl,
        )
