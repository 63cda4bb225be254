"""LSTM mixer: the classic recurrent control of the formal-language protocol (docs/RESULTS.md).

``y = h W_o`` with ``h [B, T, H]`` the LSTM over the block input (``ops.lstm``, math in
``core.lstm``), ``H = d_model``. The forget-gate bias starts at 1 (Gers et al. 2000; Jozefowicz et
al. 2015), the other biases at 0; ``w_x`` is LeCun normal, ``w_h`` orthogonal per gate block.
Packed rows (``segment_ids``) reset the state at each document start. Decoding keeps
``LSTMCache(h, c)`` (float32, ``[B, H]`` each) and runs the exact single-token step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax import ops
from nested_jax.layers.common import check_rank, dense, partitioned


class LSTMCache(NamedTuple):
    """Per-layer decode state: ``h, c [B, H]`` float32."""

    h: jax.Array
    c: jax.Array


def _recurrent_init(key, shape, dtype=jnp.float32):
    """Orthogonal ``[H, H]`` blocks side by side: ``w_h [H, 4H]``."""
    h = shape[0]
    keys = jax.random.split(key, 4)
    ortho = nnx.initializers.orthogonal()
    return jnp.concatenate([ortho(k, (h, h), dtype) for k in keys], axis=1)


def _bias_init(key, shape, dtype=jnp.float32):
    """Gate biases ``[4H]``: 1 for the forget gate, 0 for the others."""
    del key
    h = shape[0] // 4
    return jnp.zeros(shape, dtype).at[h : 2 * h].set(1.0)


class LSTMMixer(nnx.Module):
    """LSTM layer (``core.lstm``): gates ``(i, f, g, o)`` from ``x W_x + h W_h + b``, then ``W_o``.

    Args:
      d_model: input and output width; the hidden width ``H`` equals it.
      impl: the ``ops.lstm`` form (``"recurrent"``).
      dtype: activation dtype (the recurrence runs in float32).
    """

    IMPLS = ("recurrent",)  # the forms ops.lstm has (the synthetic driver picks the first)

    def __init__(self, d_model: int, *, impl: str = "recurrent", dtype=jnp.float32, rngs):
        if not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model: expected an int >= 1, got {d_model!r}")
        ops.check_impl("lstm", impl, self.IMPLS)
        self.d_model, self.hidden, self.impl, self.dtype = d_model, d_model, impl, dtype
        h = d_model
        lecun = nnx.initializers.lecun_normal()
        self.w_x = nnx.Param(
            partitioned(lecun, ("embed", "heads"))(rngs.params(), (d_model, 4 * h))
        )
        self.w_h = nnx.Param(
            partitioned(_recurrent_init, (None, "heads"))(rngs.params(), (h, 4 * h))
        )
        self.b = nnx.Param(partitioned(_bias_init, ("heads",))(None, (4 * h,)))
        self.o_proj = dense(h, d_model, ("heads", "embed"), dtype=dtype, rngs=rngs)

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs):
        """Build from a :class:`nested_jax.models.config.ModelConfig` (registry entry ``lstm``).
        ``model.impl`` must be ``recurrent``."""
        return cls(cfg.d_model, impl=cfg.impl, dtype=cfg.activation_dtype(), rngs=rngs)

    def init_cache(self, batch_size: int, max_len: int) -> LSTMCache:
        """Zero decode state (``max_len`` unused: the state does not grow with length)."""
        del max_len
        z = jnp.zeros((batch_size, self.hidden), jnp.float32)
        return LSTMCache(z, z)

    def __call__(
        self,
        x: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: LSTMCache | None = None,
    ) -> tuple[jax.Array, LSTMCache | None]:
        """``x [B, T, d_model]`` → ``(y [B, T, d_model], new cache or None)``; no ``positions``."""
        del positions
        check_rank("x", x, 3, "[B, T, d_model]")
        x = x.astype(self.dtype)
        w_x, w_h, b = self.w_x[...], self.w_h[...], self.b[...]
        state = None if cache is None else ops.LSTMState(cache.h, cache.c)
        if cache is not None and x.shape[1] == 1:
            h_t, new = ops.lstm_step(state, x[:, 0], w_x, w_h, b)
            h = h_t[:, None]
        else:
            reset = None
            if segment_ids is not None:
                prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
                reset = segment_ids != prev
            h, new = ops.lstm(x, w_x, w_h, b, initial_state=state, reset=reset, impl=self.impl)
        y = self.o_proj(h.astype(self.dtype))
        return y, (None if cache is None else LSTMCache(new.h, new.c))
