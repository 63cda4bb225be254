"""Data: corpora, tokenizers and the grain input pipeline (see the submodules' docstrings)."""

from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import DataError, load_documents, split_documents
from nested_jax.data.pipeline import (
    DataBundle,
    make_eval_batches,
    make_train_iterator,
    prepare_data,
    steps_per_epoch,
    unigram_byte_entropy,
)
from nested_jax.data.tokenizers import Tokenizer, build_tokenizer

__all__ = [
    "DataBundle",
    "DataConfig",
    "DataError",
    "Tokenizer",
    "build_tokenizer",
    "load_documents",
    "make_eval_batches",
    "make_train_iterator",
    "prepare_data",
    "split_documents",
    "steps_per_epoch",
    "unigram_byte_entropy",
]
