"""docs/from_yaml_to_core.md stays true: its snippet runs, every ``ops.*`` / ``core.*`` name it
cites exists, ``impl="pallas"`` reaches the kernel where one exists and fails at the first forward
elsewhere, as the page says."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers.gdn import GatedDeltaNet
from nested_jax.layers.hope import HopeMixer
from nested_jax.layers.options import HopeOptions
from nested_jax.train.config import load_config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "from_yaml_to_core.md"


def test_snippet_runs_and_reaches_the_named_layer():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert blocks, "the page lost its python snippet"
    ns: dict = {}
    exec(compile(blocks[0], str(PAGE), "exec"), ns)
    assert ns["cfg"].model.name == "gdn" and ns["cfg"].model.impl == "recurrent"
    assert ns["layer_cls"] is GatedDeltaNet


def _resolve(dotted: str):
    """``ops.hope.hope_memories`` / ``core.hola.decode.hola_recurrent`` → the object (import the
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


def test_pallas_runs_where_a_kernel_exists_and_fails_at_the_first_forward_elsewhere():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 16)), jnp.float32)
    chunked = GatedDeltaNet(16, 2, 8, impl="chunked", rngs=nnx.Rngs(0))
    pallas = GatedDeltaNet(16, 2, 8, impl="pallas", rngs=nnx.Rngs(0))
    np.testing.assert_allclose(pallas(x)[0], chunked(x)[0], rtol=1e-5, atol=1e-6)  # (y, cache)
    assert "pallas_kernels.gated_delta.gated_delta_pallas" in PAGE.read_text()
    hope = HopeMixer(16, 2, 8, HopeOptions(chunk_memory=2, chunk_other=2), impl="pallas",
                     rngs=nnx.Rngs(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"^model\.impl: 'pallas' has kernels for \['deltanet'"):
        load_config(["configs/experiments/tiny_hope.yaml"], ["model.impl=pallas"])
    gdn = load_config(["configs/experiments/tiny_gdn.yaml"], ["model.impl=pallas"])
    assert gdn.model.impl == "pallas"
    message = "hope_memories: impl='pallas' is not implemented yet"
    with pytest.raises(ValueError, match=message):
        hope(x)
    assert message in PAGE.read_text()
