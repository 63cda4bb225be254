"""Classic recurrent cells behind the one door: the LSTM (the formal-language protocol's control).

- :func:`lstm`: the LSTM over a sequence; ``impl="recurrent"`` reaches
  ``core.lstm.lstm_recurrent`` (a ``lax.scan`` over tokens). An LSTM has no chunked form (its
  state update is nonlinear), so ``"chunked"`` raises, and no Pallas kernel is wired.
- :func:`lstm_step`: one token for decoding (``core.lstm.lstm_step``).

The state type ``LSTMState`` (``core.lstm``) reaches layers as ``nested_jax.ops.LSTMState``.
"""

from __future__ import annotations

import jax

from nested_jax.core.lstm import LSTMState, lstm_recurrent
from nested_jax.core.lstm import lstm_step as _lstm_step
from nested_jax.ops._impl import check_impl

__all__ = ["lstm", "lstm_step"]


def lstm(
    x: jax.Array,
    w_x: jax.Array,
    w_h: jax.Array,
    b: jax.Array,
    *,
    initial_state: LSTMState | None = None,
    reset: jax.Array | None = None,
    impl: str = "recurrent",
) -> tuple[jax.Array, LSTMState]:
    """The LSTM over ``x [B, T, D]``: ``(h [B, T, H] float32, final LSTMState)``.

    Args and equations: ``core.lstm.lstm_recurrent`` (gate blocks ``(i, f, g, o)`` of ``w_x [D,
    4H]``, ``w_h [H, 4H]``, ``b [4H]``; ``reset [B, T]`` zeroes the state entering a token).
    impl: ``"recurrent"`` only.
    """
    check_impl("lstm", impl, ("recurrent",))
    return lstm_recurrent(x, w_x, w_h, b, initial_state=initial_state, reset=reset)


def lstm_step(
    state: LSTMState, x_t: jax.Array, w_x: jax.Array, w_h: jax.Array, b: jax.Array
) -> tuple[jax.Array, LSTMState]:
    """One token ``x_t [B, D]`` → ``(h_t [B, H], LSTMState)`` (``core.lstm.lstm_step``)."""
    return _lstm_step(state, x_t, w_x, w_h, b)
