"""Fixtures for training tests: a small generated corpus and a private data cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import write_corpus


@pytest.fixture
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")
