"""Shared fixtures for the data tests: small generated text, never the network."""

from __future__ import annotations

import pytest
from textgen import make_docs


@pytest.fixture
def docs() -> list[str]:
    return make_docs(24, seed=1)


@pytest.fixture
def corpus_dir(tmp_path, docs):
    """A folder tree of .txt files (nested, plus a non-.txt file that must be ignored)."""
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a").mkdir()
    for i, d in enumerate(docs):
        sub = root / ("a" if i % 2 == 0 else "b")
        (sub / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
    (root / "README.md").write_text("not a document", encoding="utf-8")
    return root
