"""docs/chunking.md names every chunk/block/period knob of the config and the seq_len rule."""

import dataclasses
import pathlib
import re

import pytest

from nested_jax.models.registry import available_mixers, mixer_seq_len_multiples
from nested_jax.train.config import Config

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "chunking.md"
KNOB = re.compile(r"chunk|block|segment|period|horizon")


def _leaf_fields(obj, prefix=""):
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        path = f"{prefix}.{field.name}" if prefix else field.name
        if dataclasses.is_dataclass(value):
            yield from _leaf_fields(value, path)
        else:
            yield path


def _table_rows(text: str) -> dict[str, str]:
    """``{field path: kind}`` from the page's first table (rows ``| `path` | kind | ...``)."""
    return dict(re.findall(r"^\| `([a-z_.]+)` \| (compute|rule|gradient) \|", text, flags=re.M))


def test_every_piece_knob_of_the_config_is_on_the_page_with_its_kind():
    rows = _table_rows(PAGE.read_text())
    knobs = [p for p in _leaf_fields(Config()) if KNOB.search(p.rsplit(".", 1)[-1])]
    assert knobs, "the config walk found no knob (the walk is broken)"
    missing = [p for p in knobs if p not in rows]
    assert not missing, f"docs/chunking.md lacks {missing}"
    stale = [p for p in rows if p not in knobs]
    assert not stale, f"docs/chunking.md names fields the config no longer has: {stale}"


@pytest.mark.parametrize("mixer", available_mixers())
def test_the_seq_len_table_matches_what_each_default_mixer_asks(mixer):
    """The first seq_len row naming the mixer is its default (chunked) form: same knobs."""
    from nested_jax.models.config import ModelConfig

    seq_len_table = PAGE.read_text().split("## What `data.seq_len`", 1)[1]
    rows = [line.split("|")[1:3] for line in seq_len_table.splitlines() if line.startswith("| `")]
    cells = next((c for c in rows if f"`{mixer}`" in c[0]), None)
    assert cells is not None, f"docs/chunking.md has no seq_len row for {mixer}"
    named = set(re.findall(r"`(model\.[a-z_.]+)`", cells[1]))
    assert named == set(mixer_seq_len_multiples(ModelConfig(name=mixer)))
