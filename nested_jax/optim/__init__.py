"""Optimizers as optax transformations: M3 (SPEC §3.5), Proteus training-time mask (SPEC §4)."""

from nested_jax.optim.m3 import (
    M3State,
    default_m3_mask,
    m3,
    m3_from_config,
    newton_schulz,
    scale_by_m3,
)
from nested_jax.optim.proteus_mask import (
    ProteusMaskState,
    block_axes_by_path,
    proteus_adamw,
    proteus_mask,
    proteus_update_masks,
)

__all__ = [
    "M3State",
    "default_m3_mask",
    "m3",
    "m3_from_config",
    "newton_schulz",
    "scale_by_m3",
    "ProteusMaskState",
    "block_axes_by_path",
    "proteus_adamw",
    "proteus_mask",
    "proteus_update_masks",
]
