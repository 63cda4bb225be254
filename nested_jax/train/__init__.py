"""Training system: strict configs, sharded jitted steps, orbax checkpoints with exact resume, CLIs.

Public API (imported lazily so ``import nested_jax.train`` stays cheap)::

    from nested_jax.train import Config, load_config, train_and_evaluate
    config = load_config(["configs/experiments/tiny_gdn.yaml"], ["train.steps=100"])
    summary = train_and_evaluate(config, "runs/tiny_gdn")
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Config": "nested_jax.train.config",
    "ConfigError": "nested_jax.train.config",
    "load_config": "nested_jax.train.config",
    "config_from_dict": "nested_jax.train.config",
    "config_to_dict": "nested_jax.train.config",
    "OPTIMIZERS": "nested_jax.train.optimizer",
    "register_optimizer": "nested_jax.train.optimizer",
    "train_and_evaluate": "nested_jax.train.loop",
    "TrainingError": "nested_jax.train.loop",
    "load_trained": "nested_jax.train.inference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nested_jax.train' has no attribute {name!r}")
