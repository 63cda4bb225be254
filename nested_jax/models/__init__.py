"""LM shell, mixer registry, configuration and generation (SPEC §6)."""

from nested_jax.models.config import ModelConfig
from nested_jax.models.generate import generate
from nested_jax.models.lm import Block, LanguageModel, LMCache, build_model
from nested_jax.models.registry import available_mixers, get_mixer, register_mixer

__all__ = [
    "Block",
    "LMCache",
    "LanguageModel",
    "ModelConfig",
    "available_mixers",
    "build_model",
    "generate",
    "get_mixer",
    "register_mixer",
]
