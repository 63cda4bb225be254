"""Hope's values (SPEC §3.2): the memories and their read, readout, carried state.

- :class:`MLPMemory` (``M(z) = z + W_1 σ(W_2 z)``, read by :func:`mlp_memory_apply`), the bundle
  :class:`HopeMemories` (``k, v, η, α, memory`` and ``q`` with ``adaptive_q``), the outer scalar
  readouts :class:`HopeReadout` of ``M_η``, ``M_α``, and the carried :class:`HopeState`
  (memories, momenta); :func:`hope_init_state` broadcasts learned memories over a batch.

The rule itself (chunk sizes, ablation flags, backprop options) is one frozen
:class:`nested_jax.rules.HopeRule`, which every form takes whole as ``rule=``
(:func:`check_rule`). The forms that run it are :mod:`nested_jax.core.hope.chunk` (chunked) and
:mod:`nested_jax.core.hope.token` (per token, decode step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nested_jax.rules import HopeRule

# What the error for a missing ``initial_state`` tells the caller to pass (SPEC §0: Hope's
# memories are learned, so there is no zero state).
HOPE_STATE_CONSTRUCTOR = "hope_init_state(memories, B)"

__all__ = [
    "MLPMemory",
    "HopeMemories",
    "HopeReadout",
    "HopeState",
    "check_rule",
    "hope_init_state",
    "mlp_memory_apply",
]


class MLPMemory(NamedTuple):
    """Residual MLP ``M(z) = z + W_1 σ(W_2 z)``; ``w1 [.., H, D, h]``, ``w2 [.., H, h, D]``."""

    w1: jax.Array
    w2: jax.Array


class HopeMemories(NamedTuple):
    """The self-modifying memories (``q`` is ``None`` unless ``adaptive_q``)."""

    k: MLPMemory
    v: MLPMemory
    eta: MLPMemory
    alpha: MLPMemory
    memory: MLPMemory
    q: MLPMemory | None = None


class HopeReadout(NamedTuple):
    """Outer scalar readouts of ``M_η``, ``M_α``: ``*_w [H, D]``, ``*_b [H]``."""

    eta_w: jax.Array
    eta_b: jax.Array
    alpha_w: jax.Array
    alpha_b: jax.Array


class HopeState(NamedTuple):
    """Carried state: the memories ``[B, H, ...]`` and (``momentum=True``) their momenta."""

    memories: HopeMemories
    momentum: HopeMemories | None = None


def check_rule(fn: str, rule) -> HopeRule:
    """``rule`` after checking it is a :class:`HopeRule` (a ``HopeOptions`` is one); raises
    ``ValueError("<fn>: rule must be a HopeRule ...")`` otherwise. The rule checked its own fields
    when it was built."""
    if not isinstance(rule, HopeRule):
        raise ValueError(f"{fn}: rule must be a HopeRule, got {type(rule).__name__}")
    return rule


def _names(mems: HopeMemories):
    """The names of the memories present (``q`` only with ``adaptive_q``), in field order."""
    return [n for n in HopeMemories._fields if getattr(mems, n) is not None]


def mlp_memory_apply(mem: MLPMemory, z, activation: Callable = jax.nn.silu):
    """``M(z) = z + W_1 σ(W_2 z)`` per head (SPEC §3.2).

    Args:
      mem: ``MLPMemory`` with ``w1 [B, H, D, h]``, ``w2 [B, H, h, D]``.
      z: ``[B, N, H, D]`` (``N`` tokens read with the same weights).
      activation: elementwise ``σ``.

    Returns:
      ``[B, N, H, D]``.
    """
    a = jnp.einsum("bhkd,bnhd->bnhk", mem.w2, z)
    return z + jnp.einsum("bhdk,bnhk->bnhd", mem.w1, activation(a))


def hope_init_state(
    memories: HopeMemories, batch_size: int, *, momentum: bool = False, dtype=jnp.float32
) -> HopeState:
    """Broadcast initial (meta-learned) memories to a batch and add zero momenta if asked.

    Args:
      memories: ``HopeMemories`` with ``w1 [H, D, h]``/``w2 [H, h, D]`` or already ``[B, ...]``.
      batch_size: ``B``.
      momentum: also create zero momentum buffers.
      dtype: state dtype (f32 or wider).

    Returns:
      ``HopeState`` with every weight ``[B, H, ...]``.
    """
    if not isinstance(memories, HopeMemories):
        raise ValueError(f"memories must be a HopeMemories, got {type(memories).__name__}")

    def bcast(name, w, kind):
        w = jnp.asarray(w, dtype)
        if w.ndim == 3:
            w = jnp.broadcast_to(w, (batch_size,) + w.shape)
        if w.ndim != 4 or w.shape[0] != batch_size:
            raise ValueError(
                f"memories.{name}.{kind} must have shape [H, ., .] or [B={batch_size}, H, ., .], "
                f"got {w.shape}"
            )
        return w

    out = {}
    for n in _names(memories):
        m = getattr(memories, n)
        out[n] = MLPMemory(bcast(n, m.w1, "w1"), bcast(n, m.w2, "w2"))
    mems = HopeMemories(**out)
    mom = jax.tree.map(jnp.zeros_like, mems) if momentum else None
    return HopeState(mems, mom)
