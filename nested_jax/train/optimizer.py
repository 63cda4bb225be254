"""Optimizers and learning-rate schedules, and their config section :class:`OptimizerConfig`.

The registry and its config live together (``nested_jax.train.config`` imports both; this module
imports no config).

``OPTIMIZERS`` maps a name to a factory ``(cfg: OptimizerConfig, learning_rate: optax.Schedule) ->
optax.GradientTransformation``. Other modules register more (e.g. M3) with
:func:`register_optimizer`; the config loader accepts any registered name. Global-norm clipping
wraps every optimizer (``grad_clip > 0``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from nested_jax.optim.m3 import m3_from_config
from nested_jax.optim.multifreq import level_labels_by_index, multi_frequency


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule (linear warmup then decay)."""

    # key of nested_jax.train.optimizer.OPTIMIZERS ("adamw"; other modules register more)
    name: str = "adamw"
    lr: float = 3e-3  # peak learning rate, reached at the end of warmup
    warmup_steps: int = 100  # linear warmup from 0 to lr over this many steps
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # shape of the decay after warmup
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of lr (cosine / linear decay)
    weight_decay: float = 0.1  # decoupled weight decay, applied to matrices (ndim >= 2) only
    b1: float = 0.9  # first-moment decay of Adam
    b2: float = 0.95  # second-moment decay of Adam
    eps: float = 1e-8  # Adam denominator epsilon
    grad_clip: float = 1.0  # clip gradients to this global L2 norm; 0 disables clipping
    # Free-form extra hyper-parameters for optimizers registered by other modules (e.g. m3); each
    # factory validates its own keys. AdamW accepts none.
    extra: dict = field(default_factory=dict)


OptimizerFactory = Callable[[OptimizerConfig, optax.Schedule], optax.GradientTransformation]
OPTIMIZERS: dict[str, OptimizerFactory] = {}


def register_optimizer(name: str, factory: OptimizerFactory) -> None:
    """Registers `factory` under `name` (overwrites an existing entry of the same name)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"name: expected a non-empty str, got {name!r}")
    OPTIMIZERS[name] = factory


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup 0 → lr over ``warmup_steps``, then ``decay`` to ``lr · min_lr_ratio`` at
    ``total_steps``.

    Args:
      cfg: optimizer config (lr, warmup_steps, decay, min_lr_ratio).
      total_steps: the step at which the decay ends (train.steps).
    Returns:
      an optax schedule ``step -> lr``.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps: expected >= 1, got {total_steps}")
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.decay == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.decay == "linear":
        after = optax.linear_schedule(cfg.lr, end, decay_steps)
    elif cfg.decay == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        raise ValueError(f"optimizer.decay: unknown {cfg.decay!r}")
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def with_fresh_hyperparams(restored: Any, fresh: Any) -> Any:
    """`restored` optimizer state with the hyper-parameters of each ``optax.inject_hyperparams``
    state in it taken from `fresh` (the same optimizer initialised from the current config).

    ``inject_hyperparams`` keeps a numeric hyper-parameter (a constant learning rate, say) in its
    state and reads it from there at every update, so a state restored from a checkpoint would go
    on with the saved value after the config changed it. Counts, moments and every other array
    stay as restored. Both states must have the same tree structure.
    """
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)

    def pick(old, new):
        return old._replace(hyperparams=new.hyperparams) if isinstance(old, kinds) else old

    return jax.tree.map(pick, restored, fresh, is_leaf=lambda x: isinstance(x, kinds))


def _decay_mask(params):
    # Decay matrices only: norms' scales and biases (ndim < 2) are not regularised towards 0.
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def _adamw(cfg: OptimizerConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    if cfg.extra:
        raise ValueError(f"optimizer.extra: adamw takes no extra options, got {sorted(cfg.extra)}")
    return optax.adamw(
        lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask
    )


register_optimizer("adamw", _adamw)
# M3 (SPEC §3.5): matrices → M3, the rest → AdamW; options via optimizer.extra (see m3_from_config).
register_optimizer("m3", m3_from_config)


def cms_level_of(params: Any) -> Any:
    """Each parameter leaf's CMS level: ``ℓ`` for leaves under ``blocks/mlp/levels/ℓ``, else None.

    ``level_labels_by_index("levels")`` restricted to the block FFN, so a mixer that happens to
    hold a ``levels`` container of its own is never stepped at CMS periods.
    """
    labels = level_labels_by_index("levels")(params)

    def keep(path, lab):
        names = [getattr(e, "key", getattr(e, "name", None)) for e in path[:2]]
        return lab if names == ["blocks", "mlp"] else None

    return jax.tree_util.tree_map_with_path(keep, labels, is_leaf=lambda x: x is None)


def cms_pretrain_periods(model: Any) -> tuple[int, ...] | None:
    """The CMS level periods (optimizer steps) when ``model`` trains its CMS in pretrain mode.

    Args:
      model: a :class:`nested_jax.models.config.ModelConfig` or None.

    Returns:
      ``model.cms.periods`` when the block FFN is CMS and ``model.cms.mode == "pretrain"``, else
      None (the optimizer is not wrapped).
    """
    if model is None or model.resolved_ffn() != "cms" or model.cms.mode != "pretrain":
        return None
    return tuple(model.cms.periods)


def build_optimizer(
    cfg: OptimizerConfig, total_steps: int, *, model: Any = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns ``(tx, schedule)``: clip_by_global_norm(grad_clip) then the registered optimizer.

    CMS pretrain mode (SPEC §3.3): when ``model`` (a ``ModelConfig``) has a CMS FFN with
    ``cms.mode == "pretrain"``, the optimizer is wrapped by
    :func:`nested_jax.optim.multifreq.multi_frequency` so the parameters of CMS level ℓ (every
    leaf under ``.../levels/ℓ/...``) take a step only every ``cms.periods[ℓ]`` optimizer steps,
    from the gradients accumulated since their last step (``cms.accumulate``: sum | mean); every
    other parameter steps every step. The learning-rate schedule is applied *outside* the wrapper
    (the registered optimizer is built with lr = 1, then scaled by ``schedule(step)``), so a level
    that fires at global step n uses the global lr of step n rather than a schedule counted in its
    own (rarer) steps, and warmup/decay mean the same for every level. This relies on the
    registered optimizer applying its lr as a final linear scale (true for adamw and m3).
    Gradient clipping acts on each step's raw gradient, before accumulation.

    Args:
      cfg: the optimizer section.
      total_steps: the step at which the schedule's decay ends (train.steps).
      model: optional ``ModelConfig``; only read for the CMS pretrain wrapping.
    """
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name: unknown {cfg.name!r}; registered: {sorted(OPTIMIZERS)}")
    schedule = learning_rate_schedule(cfg, total_steps)
    periods = cms_pretrain_periods(model)
    if periods is None:
        tx = OPTIMIZERS[cfg.name](cfg, schedule)
    else:
        inner = OPTIMIZERS[cfg.name](cfg, optax.constant_schedule(1.0))
        tx = optax.chain(
            multi_frequency(
                inner,
                level_of=cms_level_of,
                periods=periods,
                accumulate=model.cms.accumulate,
            ),
            optax.scale_by_schedule(schedule),
        )
    if cfg.grad_clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
    return tx, schedule
