"""The values ``transformers`` gives the ``config.json`` fields a checkpoint leaves out.

A Hugging Face ``config.json`` lists only what differs from its architecture's config class
(``LlamaConfig``, ``Qwen2Config``), and the two classes disagree: Qwen2 unties the head and has 32
KV heads unless told otherwise, Llama unties the head and gives every query head its own KV head.
An import that guessed a default would load another function than ``from_pretrained`` does (a
Qwen2 head taken as tied drops ``lm_head.weight``). :data:`TRANSFORMERS_DEFAULTS` is the table of
the class defaults for every field :func:`nested_jax.models.hf.hf_model_fields` reads; the test
suite compares it with the classes of the installed ``transformers``, so the import itself needs
no ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TRANSFORMERS_DEFAULTS", "with_transformers_defaults"]

# Fields every supported architecture shares the default of. ``head_dim`` absent or None means
# hidden_size // num_attention_heads in both classes (``hf_model_fields`` derives it).
_COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "head_dim": None,
}

# model_type -> {config.json field: the value its transformers config class gives it}.
# num_key_value_heads None: the class copies num_attention_heads.
TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "use_sliding_window": False,
    },
}

_ROPE_KEYS = ("rope_parameters", "rope_scaling")


def with_transformers_defaults(hf_config: Mapping[str, Any]) -> dict:
    """``hf_config`` (a parsed ``config.json``) with every field of
    :data:`TRANSFORMERS_DEFAULTS` that it leaves out set as ``transformers`` sets it.

    A ``rope_theta`` inside ``rope_parameters`` / ``rope_scaling`` counts as given. An unknown
    ``model_type`` is returned unchanged (``hf_model_fields`` refuses it, naming the field).
    """
    out = dict(hf_config)
    defaults = TRANSFORMERS_DEFAULTS.get(out.get("model_type"), {})
    for key, value in defaults.items():
        if key == "rope_theta" and any("rope_theta" in (out.get(k) or {}) for k in _ROPE_KEYS):
            continue
        out.setdefault(key, value)
    if out.get("num_key_value_heads") is None and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out
