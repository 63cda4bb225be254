"""Flax NNX layers: thin shells (parameters, projections, norms, short conv) around one ``ops`` call
each."""

from nested_jax.layers.attention import Attention, AttentionCache, attention_mask, softmax_attention
from nested_jax.layers.conv import ShortConv, causal_depthwise_conv
from nested_jax.layers.deltanet import DeltaCache, DeltaNet, l2_normalize
from nested_jax.layers.gdn import GatedDeltaNet
from nested_jax.layers.mlp import SwiGLU
from nested_jax.layers.norm import GatedRMSNorm, RMSNorm, rms_norm
from nested_jax.layers.rope import apply_rope, segment_positions

__all__ = [
    "Attention",
    "AttentionCache",
    "DeltaCache",
    "DeltaNet",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "RMSNorm",
    "ShortConv",
    "SwiGLU",
    "apply_rope",
    "attention_mask",
    "causal_depthwise_conv",
    "l2_normalize",
    "rms_norm",
    "segment_positions",
    "softmax_attention",
]
