"""CMS ``pretrain`` mode: level ℓ's parameters step every ``C^(ℓ)`` optimizer steps (SPEC §3.3).

:func:`multi_frequency` wraps any optax transformation ``inner``. Each parameter leaf has a level
``ℓ ∈ {0, …, k−1}`` (0-based index into ``periods``) or ``None`` (updated every step, as
``inner`` alone would). With ``n = 1, 2, …`` the 1-based index of the current optimizer step::

    A_ℓ ← A_ℓ + g_n                                        (every step)
    if n mod C^(ℓ) = 0:   u_ℓ = inner_ℓ(A_ℓ  [/ C^(ℓ) for accumulate="mean"]);  A_ℓ ← 0
    else:                 u_ℓ = 0                          (θ_ℓ and inner_ℓ's state unchanged)

``accumulate="sum"`` (default) is SPEC §3.3's ``θ_ℓ ← θ_ℓ − Σ_{t∈B_j} η g_t`` for SGD;
``"mean"`` feeds the average gradient of the period (a ``C``-times larger batch at the per-step
gradient scale). ``inner_ℓ`` is a separate instance of ``inner`` over level ℓ's leaves only
(``optax.masked``) whose state advances only at its steps: e.g. Adam's moments and bias
correction count level steps, and a schedule inside ``inner`` (and weight decay) is in units of
that level's steps. Which branch is taken is a ``jnp.where`` on the step count, so the update
jits once (the inner update of every level is computed each step and discarded when not
firing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from nested_jax.core.periods import accumulate as _add
from nested_jax.core.periods import clear_at_boundary, period_boundary, select_at_boundary
from nested_jax.rules import check_periods

__all__ = ["MultiFreqState", "multi_frequency", "level_labels_by_index"]

_NONE = -1  # label of leaves updated every step


class MultiFreqState(NamedTuple):
    """State of :func:`multi_frequency`."""

    count: jax.Array  # int32 []: optimizer steps taken
    accum: Any  # per leaf: Σ g since the level's last step (optax.MaskedNode() for None leaves)
    inner_states: tuple  # group 0: leaves with level None; group ℓ+1: level ℓ


def _labels(level_of, params, k: int):
    lv = level_of(params) if callable(level_of) else level_of
    try:
        lv = jax.tree.map(lambda a, p: a, lv, params, is_leaf=lambda x: x is None)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "level_of must give one level index (int) or None per parameter leaf, with the "
            f"structure of the parameters: {e}"
        ) from e

    def check(path, a):
        if a is None:
            return _NONE
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < k:
            where = jax.tree_util.keystr(path, simple=True, separator="/")
            raise ValueError(
                f"level_of gave {a!r} for {where!r}; expected None or an int in [0, {k})"
            )
        return a

    return jax.tree_util.tree_map_with_path(check, lv, is_leaf=lambda x: x is None)


def level_labels_by_index(levels_key: str = "levels") -> Callable[[Any], Any]:
    """A ``level_of`` for parameter trees holding a tuple of levels under ``levels_key``.

    Every leaf whose path contains ``levels_key`` followed by an integer index ``ℓ`` (e.g.
    ``cms/levels/2/w_up`` or the ``[2]`` entry of a ``levels`` tuple) gets level ``ℓ``; others get
    ``None``.

    Args:
      levels_key: the dict key / attribute name of the level sequence.

    Returns:
      ``params -> pytree of (int | None)``.
    """

    def fn(params):
        def lab(path, _):
            for i, entry in enumerate(path[:-1]):
                name = getattr(entry, "key", getattr(entry, "name", None))
                if name == levels_key:
                    nxt = path[i + 1]
                    idx = getattr(nxt, "idx", getattr(nxt, "key", None))
                    if isinstance(idx, int):
                        return idx
            return None

        return jax.tree_util.tree_map_with_path(lab, params)

    return fn


def _zero_accum(labels, params):
    """``A = 0`` (at least float32) for every leaf with a level; ``MaskedNode`` for ``None``."""
    return jax.tree.map(
        lambda lab, p: (
            optax.MaskedNode()
            if lab == _NONE
            else jnp.zeros(jnp.shape(p), jnp.promote_types(jnp.result_type(p), jnp.float32))
        ),
        labels,
        params,
    )


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _accumulate_grads(labels, accum, updates):
    """``A_ℓ ← A_ℓ + g`` on every leaf with a level (every step)."""
    return jax.tree.map(
        lambda lab, a, g: a if lab == _NONE else _add(a, g),
        labels,
        accum,
        updates,
        is_leaf=_is_masked,
    )


def _inner_input(labels, accum, updates, periods, accumulate: str):
    """What the inner instances see: ``g`` for ``None`` leaves, ``A_ℓ`` (``"mean"``:
    ``A_ℓ / C^(ℓ)``) in ``g``'s dtype for leaves of level ℓ."""

    def fed(lab, a, g):
        if lab == _NONE:
            return g
        a = a / periods[lab] if accumulate == "mean" else a
        return a.astype(g.dtype)

    return jax.tree.map(fed, labels, accum, updates, is_leaf=_is_masked)


def _clear_fired(labels, accum, fire: dict):
    """``A_ℓ ← 0`` on the leaves of the levels at their boundary."""
    return jax.tree.map(
        lambda lab, a: a if lab == _NONE else clear_at_boundary(a, fire[lab]),
        labels,
        accum,
        is_leaf=_is_masked,
    )


def multi_frequency(
    inner: optax.GradientTransformation,
    *,
    level_of: Any,
    periods: tuple[int, ...],
    accumulate: str = "sum",
) -> optax.GradientTransformationExtraArgs:
    """Steps level ℓ's parameters every ``periods[ℓ]`` optimizer steps (CMS pretrain, SPEC §3.3).

    The accumulate / boundary rule is :mod:`nested_jax.core.periods`'s, except that at the
    boundary ``A_ℓ`` goes through ``inner_ℓ`` instead of being subtracted (module docstring).

    Args:
      inner: the optimizer (e.g. ``optax.adamw(3e-4)``); one instance per level group.
      level_of: ``params -> pytree of (int | None)`` (or that pytree): each leaf's 0-based level
        index into ``periods``, or ``None`` for leaves stepped every step.
      periods: ``(C^(1), …, C^(k))`` positive, strictly increasing ints (``C = 1`` allowed).
      accumulate: ``"sum"`` (SPEC §3.3) or ``"mean"`` of the gradients since the last step.

    Returns:
      ``optax.GradientTransformationExtraArgs`` with state :class:`MultiFreqState`.
    """
    periods = check_periods(periods)
    if accumulate not in ("sum", "mean"):
        raise ValueError(f"accumulate must be 'sum' or 'mean', got {accumulate!r}")
    k = len(periods)
    inner = optax.with_extra_args_support(inner)
    groups = (_NONE,) + tuple(range(k))

    def masked(labels, g):
        return optax.masked(inner, jax.tree.map(lambda lab: lab == g, labels))

    def init_fn(params):
        labels = _labels(level_of, params, k)
        return MultiFreqState(
            count=jnp.zeros([], jnp.int32),
            accum=_zero_accum(labels, params),
            inner_states=tuple(masked(labels, g).init(params) for g in groups),
        )

    def update_fn(updates, state, params=None, **extra_args):
        labels = _labels(level_of, updates, k)
        n = optax.safe_increment(state.count)
        fire = {_NONE: jnp.asarray(True)}
        for j, p in enumerate(periods):
            fire[j] = period_boundary(n, p)
        acc = _accumulate_grads(labels, state.accum, updates)
        feed = _inner_input(labels, acc, updates, periods, accumulate)
        # Every group's inner update is computed each step (one compiled update) and kept, with
        # its new inner state, only at the group's boundary; elsewhere its leaves get 0.
        out = jax.tree.map(jnp.zeros_like, updates)
        new_states = []
        for g, s in zip(groups, state.inner_states, strict=True):
            u, s_new = masked(labels, g).update(feed, s, params, **extra_args)
            f = fire[g]
            new_states.append(select_at_boundary(f, s_new, s))
            out = jax.tree.map(
                lambda lab, o, uu, f=f, g=g: (
                    select_at_boundary(f, uu, jnp.zeros_like(uu)).astype(o.dtype) if lab == g else o
                ),
                labels,
                out,
                u,
            )
        acc = _clear_fired(labels, acc, fire)
        return out, MultiFreqState(count=n, accum=acc, inner_states=tuple(new_states))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
