"""docs/from_yaml_to_core.md stays true: its snippet runs, every ``ops.*`` / ``core.*`` name it
cites exists, and an unavailable ``impl`` fails at the first forward as the page says."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from nested_jax.layers.gdn import GatedDeltaNet

PAGE = Path(__file__).resolve().parents[1] / "docs" / "from_yaml_to_core.md"


def test_snippet_runs_and_reaches_the_named_layer():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert blocks, "the page lost its python snippet"
    ns: dict = {}
    exec(compile(blocks[0], str(PAGE), "exec"), ns)
    assert ns["cfg"].model.name == "gdn" and ns["cfg"].model.impl == "recurrent"
    assert ns["layer_cls"] is GatedDeltaNet


def _resolve(dotted: str):
    """``ops.hope.hope_memories`` / ``core.hola_decode.hola_recurrent`` → the object (import the
    longest module prefix, then getattr the rest)."""
    parts = ("nested_jax." + dotted).split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_cited_ops_and_core_name_exists():
    text = PAGE.read_text()
    cited = set(re.findall(r"\b((?:ops|core)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text))
    assert len(cited) > 20, sorted(cited)
    missing = []
    for dotted in sorted(cited):
        try:
            _resolve(dotted)
        except (ModuleNotFoundError, AttributeError) as err:
            missing.append(f"{dotted}: {err}")
    assert not missing, missing


def test_pallas_fails_at_the_first_forward_with_the_pages_message():
    layer = GatedDeltaNet(16, 2, 8, impl="pallas", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"gated_delta: impl='pallas' is not implemented yet"):
        layer(jnp.zeros((1, 4, 16)))
    assert "gated_delta: impl='pallas' is not implemented yet" in PAGE.read_text()
