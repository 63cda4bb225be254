"""DataConfig: defaults load, every bad field fails with a message naming it."""

import dataclasses

import pytest

from nested_jax.data.config import DataConfig


def test_defaults_are_valid_and_frozen():
    cfg = DataConfig()
    assert cfg.corpus == "austen" and cfg.tokenizer == "byte" and cfg.seq_len == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_len = 3  # type: ignore[misc]


def test_valid_alternatives():
    DataConfig(tokenizer="sentencepiece", vocab_size=1024)
    DataConfig(tokenizer="/some/where/tokenizer.json")
    DataConfig(corpus="a.txt, folder/", val_fraction=0.0, seq_len=1, batch_size=1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("corpus", ""),
        ("corpus", 3),
        ("tokenizer", "wordpiece"),
        ("vocab_size", -1),
        ("vocab_size", 1.5),
        ("seq_len", 0),
        ("seq_len", True),
        ("batch_size", 0),
        ("batch_size", "16"),
        ("val_fraction", 1.0),
        ("val_fraction", -0.1),
        ("val_fraction", float("nan")),
        ("seed", -1),
        ("data_dir", None),
    ],
)
def test_bad_field_is_named(field, value):
    with pytest.raises(ValueError, match=rf"^data\.{field}:") as info:
        DataConfig(**{field: value})
    assert "\n" not in str(info.value)


def test_sentencepiece_needs_vocab_size():
    with pytest.raises(ValueError, match=r"^data\.vocab_size:"):
        DataConfig(tokenizer="sentencepiece")
