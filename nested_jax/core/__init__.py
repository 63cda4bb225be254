"""THE MATH of nested-jax: pure ``jnp`` functions over arrays and NamedTuple states.

No Flax, no configs, no sharding: import these into your own JAX code (SPEC §0.1 lists the
stable names). Shapes follow flash-linear-attention: ``[B, T, H, D]`` arrays, ``[B, T, H]`` gates
(``g`` is a *log* decay), ``[B, H, K, V]`` matrix states. Every sequence function takes its
per-token inputs, then its parameters, then the keyword ``initial_state=`` (required for the MLP
memories, which have no zero state), and returns ``(output, final_state)``; every ``*_step`` takes
``state`` first (``README.md`` §0).

    from nested_jax.core import gated_delta_chunked, titans_linear_chunked, dgd_update

A mechanism's static options are one frozen rule of :mod:`nested_jax.rules`, passed whole and
re-exported here: ``rule=TitansRule()`` (Titans), ``rule=HopeRule()`` (Hope), and the Proteus
schedule ``schedule=ProteusRule(blocks, context_len)`` of the Proteus-wrapped memories.

The names below are the public core API, written out so readers and tools can follow them.
Upper-case constants (VARIANTS, EVICTIONS, ...) stay in their modules: at package level their
meaning would be ambiguous.
"""

from nested_jax.core.associative.forms import (
    delta_rule_chunked,
    delta_rule_recurrent,
    delta_rule_step,
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
    linear_attention_chunked,
    linear_attention_recurrent,
    linear_attention_step,
)
from nested_jax.core.associative.proteus import (
    proteus_gated_delta_chunked,
    proteus_gated_delta_recurrent,
    proteus_gated_delta_step,
)
from nested_jax.core.cms.levels import (
    CMSLevel,
    cms_forward,
    cms_init_levels,
    cms_level_apply,
    cms_mix_weights,
)
from nested_jax.core.cms.online import CMSState, cms_initial_state, cms_online, surprise_from_loss
from nested_jax.core.dgd import (
    dgd_step_size,
    dgd_update,
    dgd_update_layers,
)
from nested_jax.core.hola.decode import (
    HolaReadParams,
    HolaState,
    hola_decode_step,
    init_hola_state,
)
from nested_jax.core.hola.forward import gdn_residuals, hola_forward, hola_scores
from nested_jax.core.hope.chunk import hope_chunked
from nested_jax.core.hope.decode import HopeDecodeState, hope_decode, hope_decode_state
from nested_jax.core.hope.linear import hope_linear_chunk_update
from nested_jax.core.hope.proteus import (
    proteus_hope_chunked,
    proteus_hope_masks,
    proteus_hope_recurrent,
    proteus_hope_step,
)
from nested_jax.core.hope.state import (
    HopeMemories,
    HopeReadout,
    HopeState,
    MLPMemory,
    hope_init_state,
    mlp_memory_apply,
)
from nested_jax.core.hope.token import hope_decode_step, hope_recurrent, hope_step
from nested_jax.core.lstm import LSTMState, lstm_recurrent, lstm_reference, lstm_step  # noqa: F401
from nested_jax.core.proteus import (
    proteus_active_blocks,
    proteus_block_ids,
    proteus_block_len,
    proteus_block_mask,
    proteus_chunk_constant,
    proteus_gate,
    proteus_gated_step,
    proteus_gated_update,
    proteus_hidden_mask,
    proteus_key_mask,
    proteus_mlp_masks,
    proteus_spans,
    run_proteus_spans,
    run_proteus_spans_packed,
)
from nested_jax.core.scan import (
    affine_scan,
    chunk,
    pad_to_multiple,
    scan_remat,
    unchunk,
)
from nested_jax.core.titans.chunk import titans_mlp_chunked, titans_pool_gates
from nested_jax.core.titans.linear import (
    TitansLinearState,
    titans_linear_chunked,
    titans_linear_recurrent,
    titans_linear_step,
)
from nested_jax.core.titans.mlp import (
    titans_mlp_apply,
    titans_mlp_init_weights,
    titans_mlp_recurrent,
    titans_mlp_state,
    titans_mlp_step,
)
from nested_jax.core.titans.net import TitansMLPState
from nested_jax.core.titans.proteus import (
    proteus_titans_linear_chunked,
    proteus_titans_linear_recurrent,
    proteus_titans_linear_step,
    proteus_titans_mlp_chunked,
    proteus_titans_mlp_masks,
    proteus_titans_mlp_recurrent,
    proteus_titans_mlp_step,
)
from nested_jax.rules import CMSRule, HolaRule, HopeRule, ProteusRule, TitansRule, check_periods

__all__ = [
    "linear_attention_step",
    "linear_attention_recurrent",
    "linear_attention_chunked",
    "delta_rule_step",
    "delta_rule_recurrent",
    "delta_rule_chunked",
    "gated_delta_step",
    "gated_delta_recurrent",
    "gated_delta_chunked",
    "pad_to_multiple",
    "chunk",
    "unchunk",
    "affine_scan",
    "scan_remat",
    "dgd_step_size",
    "dgd_update",
    "dgd_update_layers",
    "ProteusRule",
    "proteus_block_len",
    "proteus_active_blocks",
    "proteus_chunk_constant",
    "proteus_block_ids",
    "proteus_block_mask",
    "proteus_key_mask",
    "proteus_hidden_mask",
    "proteus_mlp_masks",
    "proteus_gate",
    "proteus_gated_update",
    "proteus_gated_step",
    "HolaRule",
    "HolaReadParams",
    "HolaState",
    "init_hola_state",
    "gdn_residuals",
    "hola_scores",
    "hola_forward",
    "hola_decode_step",
    "TitansRule",
    "TitansLinearState",
    "titans_linear_step",
    "titans_linear_recurrent",
    "titans_linear_chunked",
    "TitansMLPState",
    "titans_mlp_init_weights",
    "titans_mlp_state",
    "titans_mlp_apply",
    "titans_mlp_step",
    "titans_mlp_recurrent",
    "titans_mlp_chunked",
    "titans_pool_gates",
    "proteus_spans",
    "run_proteus_spans",
    "run_proteus_spans_packed",
    "proteus_gated_delta_step",
    "proteus_gated_delta_recurrent",
    "proteus_gated_delta_chunked",
    "proteus_titans_linear_step",
    "proteus_titans_linear_recurrent",
    "proteus_titans_linear_chunked",
    "proteus_titans_mlp_masks",
    "proteus_titans_mlp_step",
    "proteus_titans_mlp_recurrent",
    "proteus_titans_mlp_chunked",
    "proteus_hope_masks",
    "proteus_hope_step",
    "proteus_hope_recurrent",
    "proteus_hope_chunked",
    "CMSLevel",
    "CMSState",
    "cms_init_levels",
    "cms_level_apply",
    "cms_mix_weights",
    "cms_forward",
    "cms_initial_state",
    "cms_online",
    "surprise_from_loss",
    "CMSRule",
    "check_periods",
    "MLPMemory",
    "HopeMemories",
    "HopeReadout",
    "HopeState",
    "hope_init_state",
    "mlp_memory_apply",
    "hope_step",
    "hope_recurrent",
    "hope_chunked",
    "hope_decode_step",
    "HopeDecodeState",
    "hope_decode_state",
    "hope_decode",
    "HopeRule",
    "hope_linear_chunk_update",
]
