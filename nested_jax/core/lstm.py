"""The LSTM recurrence (Hochreiter & Schmidhuber 1997, with the forget gate of Gers et al. 2000).

Per token, with ``z_t = x_t W_x + h_{t-1} W_h + b`` split into four ``[B, H]`` blocks in the order
``(i, f, g, o)``::

    i_t = σ(z_i)   f_t = σ(z_f)   g_t = tanh(z_g)   o_t = σ(z_o)
    c_t = f_t ⊙ c_{t-1} + i_t ⊙ g_t
    h_t = o_t ⊙ tanh(c_t)

Shapes: ``x [B, T, D]``, ``w_x [D, 4H]``, ``w_h [H, 4H]``, ``b [4H]``, state ``(h, c)`` with
``h, c [B, H]`` (float32). ``reset [B, T]`` (bool, optional) zeroes the incoming state at the
tokens where it is True (a packed document's first token), so each document starts from
``(0, 0)`` (or, at ``t = 0``, from ``initial_state``'s replacement by zeros).

Forms: :func:`lstm_recurrent` (``lax.scan`` over T, the fast path), :func:`lstm_step` (one token,
for decoding) and :func:`lstm_reference` (a plain Python loop over T, the reference twin).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LSTMState(NamedTuple):
    """``h, c [B, H]`` float32: hidden output and cell of the last token."""

    h: jax.Array
    c: jax.Array


def lstm_zero_state(batch_size: int, hidden: int) -> LSTMState:
    """``(0, 0)`` of shape ``[batch_size, hidden]`` each (float32)."""
    z = jnp.zeros((batch_size, hidden), jnp.float32)
    return LSTMState(z, z)


def _check(x, w_x, w_h, b, state):
    if x.ndim != 3:
        raise ValueError(f"x: expected [B, T, D], got shape {x.shape}")
    d = x.shape[-1]
    if w_h.ndim != 2 or w_h.shape[1] != 4 * w_h.shape[0]:
        raise ValueError(f"w_h: expected [H, 4H], got shape {w_h.shape}")
    h = w_h.shape[0]
    if w_x.shape != (d, 4 * h):
        raise ValueError(f"w_x: expected [D, 4H] = {(d, 4 * h)}, got shape {w_x.shape}")
    if b.shape != (4 * h,):
        raise ValueError(f"b: expected [4H] = {(4 * h,)}, got shape {b.shape}")
    if state is not None and (state.h.shape != (x.shape[0], h) or state.c.shape != state.h.shape):
        raise ValueError(
            f"initial_state: expected h, c [B, H] = {(x.shape[0], h)}, got "
            f"{state.h.shape}, {state.c.shape}"
        )
    return h


def _cell(z: jax.Array, c_prev: jax.Array) -> LSTMState:
    """One LSTM cell from the pre-activations ``z [B, 4H]`` and ``c_{t-1} [B, H]``."""
    i, f, g, o = jnp.split(z, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c_prev + jax.nn.sigmoid(i) * jnp.tanh(g)
    return LSTMState(jax.nn.sigmoid(o) * jnp.tanh(c), c)


def lstm_step(
    state: LSTMState, x_t: jax.Array, w_x: jax.Array, w_h: jax.Array, b: jax.Array
) -> tuple[jax.Array, LSTMState]:
    """One token: ``x_t [B, D]`` → ``(h_t [B, H], LSTMState)`` (equations in the module docstring).

    Computes in float32 whatever the dtype of ``x_t``.
    """
    if x_t.ndim != 2:
        raise ValueError(f"x_t: expected [B, D], got shape {x_t.shape}")
    _check(x_t[:, None], w_x, w_h, b, state)
    f32 = jnp.float32
    z = x_t.astype(f32) @ w_x.astype(f32) + state.h @ w_h.astype(f32) + b.astype(f32)
    new = _cell(z, state.c)
    return new.h, new


def _prepare(x, w_x, w_h, b, initial_state, reset):
    h = _check(x, w_x, w_h, b, initial_state)
    bsz, t, _ = x.shape
    state = lstm_zero_state(bsz, h) if initial_state is None else initial_state
    state = LSTMState(state.h.astype(jnp.float32), state.c.astype(jnp.float32))
    if reset is None:
        reset = jnp.zeros((bsz, t), bool)
    elif reset.shape != (bsz, t):
        raise ValueError(f"reset: expected [B, T] = {(bsz, t)}, got shape {reset.shape}")
    f32 = jnp.float32
    # the input part of every gate, for all tokens at once (one matmul instead of T)
    zx = jnp.einsum("btd,dg->btg", x.astype(f32), w_x.astype(f32)) + b.astype(f32)
    return state, zx, reset.astype(bool), w_h.astype(f32)


def lstm_recurrent(
    x: jax.Array,
    w_x: jax.Array,
    w_h: jax.Array,
    b: jax.Array,
    *,
    initial_state: LSTMState | None = None,
    reset: jax.Array | None = None,
) -> tuple[jax.Array, LSTMState]:
    """The LSTM over ``x [B, T, D]`` by ``lax.scan``: ``(h [B, T, H] float32, final LSTMState)``.

    Args:
      x: inputs ``[B, T, D]``.
      w_x, w_h, b: ``[D, 4H]``, ``[H, 4H]``, ``[4H]``, gate blocks ordered ``(i, f, g, o)``.
      initial_state: ``LSTMState`` with ``h, c [B, H]`` (default zeros).
      reset: optional bool ``[B, T]``: the state entering a True token is zeroed.
    """
    state, zx, reset, w_h = _prepare(x, w_x, w_h, b, initial_state, reset)

    def body(carry: LSTMState, inp):
        zx_t, r_t = inp
        keep = (~r_t)[:, None].astype(jnp.float32)
        h_prev, c_prev = carry.h * keep, carry.c * keep
        new = _cell(zx_t + h_prev @ w_h, c_prev)
        return new, new.h

    final, hs = jax.lax.scan(body, state, (jnp.swapaxes(zx, 0, 1), jnp.swapaxes(reset, 0, 1)))
    return jnp.swapaxes(hs, 0, 1), final


def lstm_reference(
    x: jax.Array,
    w_x: jax.Array,
    w_h: jax.Array,
    b: jax.Array,
    *,
    initial_state: LSTMState | None = None,
    reset: jax.Array | None = None,
) -> tuple[jax.Array, LSTMState]:
    """Reference twin of :func:`lstm_recurrent`: a plain Python loop of :func:`lstm_step`."""
    state, _, reset, _ = _prepare(x, w_x, w_h, b, initial_state, reset)
    outs = []
    for t in range(x.shape[1]):
        keep = (~reset[:, t])[:, None].astype(jnp.float32)
        state = LSTMState(state.h * keep, state.c * keep)
        h_t, state = lstm_step(state, x[:, t], w_x, w_h, b)
        outs.append(h_t)
    return jnp.stack(outs, axis=1), state
