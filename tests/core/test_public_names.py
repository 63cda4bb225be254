"""The public names of ``nested_jax.core`` and ``nested_jax.ops`` survive moves of their modules.

The lists are written out, not read from ``__all__``: a name dropped from a package (or from its
``__all__``) fails here, and so does a name that no longer resolves to an object.
"""

import importlib

import pytest

CORE_NAMES = (
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
)

OPS_NAMES = (
    "IMPLS",
    "check_impl",
    "linear",
    "titans",
    "hope",
    "hola",
    "cms",
    "linear_attention",
    "delta_rule",
    "gated_delta",
    "linear_attention_step",
    "delta_rule_step",
    "gated_delta_step",
    "proteus_key_rows",
    "proteus_gated_delta",
    "titans_memory",
    "titans_memory_step",
    "hope_memories",
    "hope_decode",
    "hola_step",
    "HolaReadParams",
    "cms_forward",
    "cms_online",
    "chunked_cross_entropy",
    "HopeRule",
    "ProteusRule",
    "HolaRule",
    "CMSRule",
    "TitansRule",
    "lstm",
    "lstm_step",
    "LSTMState",
)


@pytest.mark.parametrize(
    ("package", "names"), [("nested_jax.core", CORE_NAMES), ("nested_jax.ops", OPS_NAMES)]
)
def test_every_public_name_resolves_and_is_listed(package, names):
    mod = importlib.import_module(package)
    missing = [n for n in names if getattr(mod, n, None) is None]
    assert not missing, f"{package} lost {missing}"
    assert set(names) == set(mod.__all__), (
        f"{package}.__all__ changed: {set(names) ^ set(mod.__all__)}"
    )


def test_names_resolve_by_from_import():
    ns = {}
    exec("from nested_jax.core import *\nfrom nested_jax.ops import *", ns)
    assert set(CORE_NAMES) | set(OPS_NAMES) <= set(ns)
