"""Proteus-wrapped memories (SPEC §4): one import point for every wrapper.

The wrappers live in ``core/associative/proteus.py`` (gated delta rule, key-row blocks),
``core/proteus_titans.py`` (Titans matrix and MLP memories) and ``core/proteus_hope.py`` (Hope's
MLP memories, hidden-unit blocks); the static span split :func:`proteus_spans` and the span
runner :func:`run_proteus_spans` are shared. This
module re-exports all of them so ``from nested_jax.core.proteus_memory import …`` keeps working.
"""

from __future__ import annotations

from nested_jax.core._proteus_common import (
    proteus_spans,
    run_proteus_spans,
    run_proteus_spans_packed,
)
from nested_jax.core.associative.proteus import (
    proteus_gated_delta_chunked,
    proteus_gated_delta_recurrent,
    proteus_gated_delta_step,
)
from nested_jax.core.proteus_hope import (
    proteus_hope_chunked,
    proteus_hope_masks,
    proteus_hope_recurrent,
    proteus_hope_step,
)
from nested_jax.core.proteus_titans import (
    proteus_titans_linear_chunked,
    proteus_titans_linear_recurrent,
    proteus_titans_linear_step,
    proteus_titans_mlp_chunked,
    proteus_titans_mlp_masks,
    proteus_titans_mlp_recurrent,
    proteus_titans_mlp_step,
)

__all__ = [
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
]
