"""The one door from layers to the math: ``op(..., impl="chunked" | "recurrent" | "pallas")``.

Every mixer reaches its memory rule through this package (README.md, SPEC §0); layers import no
name from ``nested_jax.core`` (an import-linter ``forbidden`` contract in ``pyproject.toml``
checks it), only the ops and the state types the ops modules re-export. Each op takes ``impl``;
an ``impl`` that cannot run raises ``ValueError`` naming the op (never a silent switch), and
``"pallas"`` is the seam where the TPU kernels plug in (wired so far: ``gated_delta`` and
``delta_rule`` → ``pallas_kernels.gated_delta``). Each module's docstring says which core
function each ``impl`` reaches (and ``docs/from_yaml_to_core.md`` follows a config field there).

One module per mechanism:

- ``linear``: linear attention, delta rule, gated delta, decode steps, Proteus key rows (§1, §4)
- ``titans``: the Titans neural memory, sequence and decode forms (SPEC §2, §4)
- ``hope``: Hope's self-modifying memories, sequence and decode forms (SPEC §3.2, §4)
- ``hola``: gated delta state + exact top-w KV cache (SPEC §5); ``ops.hola.hola`` is its sequence
  form (the module keeps the name ``hola``, so the function is not re-exported here)
- ``cms``: the Continuum Memory System at fixed weights and online (SPEC §3.3)
- ``rnn``: the LSTM (``ops.lstm``, ``ops.lstm_step``), the formal-language protocol's control
- ``cross_entropy``: the LM loss over the vocabulary in sequence chunks, without the batch's
  ``[B, T, V]`` f32 logits (SPEC §6)
"""

from __future__ import annotations

from nested_jax.core.lstm import LSTMState
from nested_jax.ops import cms, hola, hope, linear, titans
from nested_jax.ops._impl import IMPLS, check_impl
from nested_jax.ops.cms import cms_forward, cms_online
from nested_jax.ops.cross_entropy import chunked_cross_entropy
from nested_jax.ops.hola import HolaReadParams, hola_step
from nested_jax.ops.hope import hope_decode, hope_memories
from nested_jax.ops.linear import (
    delta_rule,
    delta_rule_step,
    gated_delta,
    gated_delta_step,
    linear_attention,
    linear_attention_step,
    proteus_gated_delta,
    proteus_key_rows,
)
from nested_jax.ops.rnn import lstm, lstm_step
from nested_jax.ops.titans import titans_memory, titans_memory_step
from nested_jax.rules import CMSRule, HolaRule, HopeRule, ProteusRule, TitansRule

__all__ = [
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
    "lstm",
    "lstm_step",
    "LSTMState",
    "HopeRule",
    "ProteusRule",
    "HolaRule",
    "CMSRule",
    "TitansRule",
]
