"""The one door from layers to the math: ``op(..., impl="chunked" | "recurrent" | "pallas")``.

Every mixer reaches its memory rule through this package (DESIGN.md, SPEC §0); layers import no
function from ``nested_jax.core`` (an import-linter contract in ``pyproject.toml`` checks it). Each
op takes ``impl``; an ``impl`` that cannot run raises ``ValueError`` (never a silent switch), and
``"pallas"`` is the seam where the TPU kernels plug in.

Modules, one per mechanism: ``linear`` (linear attention, delta rule, gated delta; SPEC §1).
"""

from __future__ import annotations

from nested_jax.ops._impl import IMPLS, check_impl
from nested_jax.ops.linear import (
    delta_rule,
    delta_rule_step,
    gated_delta,
    gated_delta_step,
    linear_attention,
    linear_attention_step,
    proteus_key_rows,
)

__all__ = [
    "IMPLS",
    "check_impl",
    "linear_attention",
    "delta_rule",
    "gated_delta",
    "linear_attention_step",
    "delta_rule_step",
    "gated_delta_step",
    "proteus_key_rows",
]
