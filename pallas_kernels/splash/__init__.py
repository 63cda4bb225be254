"""Causal softmax attention on JAX's Pallas TPU splash-attention kernel (SPEC §6).

``splash_attention`` (``ops.py``) is the entry: the project's masks (causal, sliding window, a
tiled key sequence, learned prefix keys every query sees, packed segments) on
``jax.experimental.pallas.ops.tpu.splash_attention``, whose kernels skip fully masked blocks.
"""

from pallas_kernels.splash.ops import SplashBlocks, splash_attention

__all__ = ["SplashBlocks", "splash_attention"]
