"""Optimizers and learning-rate schedules built from :class:`OptimizerConfig`.

``OPTIMIZERS`` maps a name to a factory ``(cfg: OptimizerConfig, learning_rate: optax.Schedule) ->
optax.GradientTransformation``. Other modules register more (e.g. M3) with
:func:`register_optimizer`; the config loader accepts any registered name. Global-norm clipping
wraps every optimizer (``grad_clip > 0``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from nested_jax.optim.m3 import m3_from_config
from nested_jax.train.config import OptimizerConfig

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


def build_optimizer(
    cfg: OptimizerConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns ``(tx, schedule)``: clip_by_global_norm(grad_clip) then the registered optimizer."""
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name: unknown {cfg.name!r}; registered: {sorted(OPTIMIZERS)}")
    schedule = learning_rate_schedule(cfg, total_steps)
    tx = OPTIMIZERS[cfg.name](cfg, schedule)
    if cfg.grad_clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
    return tx, schedule
