"""Accumulate over a period, apply at its boundary: the multi-frequency rule (SPEC §3.3, §3.5).

A quantity ``θ`` updated at period ``C`` from per-step signals ``u_n`` (``n = 1, 2, …`` the
1-based count of steps or tokens consumed) follows::

    A ← A + u_n                                            (every step)
    if n ≡ 0 (mod C):   θ ← θ − A ;   A ← 0                 (the boundary of the period)

so ``θ`` changes only at boundaries, by ``Σ_{n∈B_j} u_n`` over the period ``B_j`` just ended
(SPEC §3.3: ``θ_ℓ ← θ_ℓ − Σ_{t∈B_j} η g_t``). ``nested`` CMS adds a reset: after the boundaries
of a step, a level whose slower neighbour ``ℓ+1`` hit its boundary takes that neighbour's weights
and drops its own accumulation, top-down, so one slow boundary cascades to every faster level.

Users: ``core.cms.online.cms_online`` (CMS levels, per chunk of tokens), ``eval.continual`` (the CMS
levels of a whole LM, streamed), ``optim.multifreq`` (outer-optimizer steps every ``C^(ℓ)``
steps: there the accumulation is fed to an inner optimizer at the boundary instead of being
subtracted) and ``optim.m3`` (the slow buffer ``B`` of M3's slow momentum).

Every boundary is a traced boolean and every "apply" a ``jnp.where`` between the applied and the
kept value, so one compiled step serves every step count. All functions are pure and take
pytrees (a bare array is a one-leaf pytree); ``acc`` leaves keep their dtype (usually float32
for low-precision parameters: the sums of a period would lose their small terms in bf16).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = [
    "period_boundary",
    "accumulate",
    "select_at_boundary",
    "clear_at_boundary",
    "apply_at_boundary",
    "reset_to_slower",
]


def period_boundary(count, period):
    """``count ≡ 0 (mod period)``: the period ends with step ``count`` (bool ``[]``).

    Args:
      count: int array ``[]`` (traced), the 1-based number of steps / tokens consumed.
      period: ``C``, a positive Python int or int array (cast to ``count``'s dtype: hyperparameters
        injected by ``optax.inject_hyperparams`` may come as other numeric arrays).
    """
    count = jnp.asarray(count)
    return count % jnp.asarray(period, count.dtype) == 0


def accumulate(acc, signal):
    """``A ← A + u`` leaf by leaf, in ``A``'s dtype (``u`` is cast first).

    Args:
      acc: pytree ``A``.
      signal: pytree ``u`` with ``acc``'s structure (``None`` subtrees where ``acc`` has them).
    """
    return jax.tree.map(lambda a, u: a + u.astype(a.dtype), acc, signal)


def select_at_boundary(at_boundary, new, old):
    """``new`` where ``at_boundary`` else ``old``, leaf by leaf (same structures)."""
    return jax.tree.map(lambda a, b: jnp.where(at_boundary, a, b), new, old)


def clear_at_boundary(acc, at_boundary):
    """``A ← 0`` where ``at_boundary`` (``A`` kept otherwise)."""
    return jax.tree.map(lambda a: jnp.where(at_boundary, jnp.zeros_like(a), a), acc)


def apply_at_boundary(params, acc, at_boundary):
    """At a boundary ``θ ← θ − A`` (in ``θ``'s dtype) and ``A ← 0``; otherwise both unchanged.

    Args:
      params: pytree ``θ``.
      acc: pytree ``A``, ``θ``'s structure (e.g. after :func:`accumulate`).
      at_boundary: bool ``[]`` (e.g. :func:`period_boundary`) or broadcastable to the leaves.

    Returns:
      ``(θ', A')``.
    """
    applied = jax.tree.map(lambda w, a: (w - a).astype(w.dtype), params, acc)
    return select_at_boundary(at_boundary, applied, params), clear_at_boundary(acc, at_boundary)


def reset_to_slower(params: Sequence, acc: Sequence, at_boundary: Sequence):
    """``nested`` reset, top-down: ``θ_ℓ ← θ_{ℓ+1}`` and ``A_ℓ ← 0`` where level ``ℓ+1`` hit its
    boundary (``ℓ = k−2, …, 0``, so a slow boundary cascades to every faster level).

    Args:
      params: ``k`` pytrees ``θ_ℓ`` of one structure (fastest first), after their own boundaries.
      acc: ``k`` pytrees ``A_ℓ``.
      at_boundary: ``k`` bools ``[]``, level ``ℓ``'s boundary this step.

    Returns:
      ``(list of θ_ℓ, list of A_ℓ)``.
    """
    params, acc = list(params), list(acc)
    for j in range(len(params) - 2, -1, -1):
        params[j] = select_at_boundary(at_boundary[j + 1], params[j + 1], params[j])
        acc[j] = clear_at_boundary(acc[j], at_boundary[j + 1])
    return params, acc
