"""Tokenizers: exact round trips, token_bytes that count UTF-8 bytes, determinism, caching."""

from __future__ import annotations

import numpy as np
import pytest
from textgen import make_docs

from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import DataError
from nested_jax.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    train_sentencepiece,
)

# Unseen characters, CJK, astral plane, tabs, runs of spaces and newlines: all must survive.
HARD_TEXT = "Mr. Darcy's  letter\n\n\tcafé — 東京 𝄞 ☃\r\nend  \n"


def _check_round_trip_and_bytes(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.token_bytes.shape == (tok.vocab_size,) and tok.token_bytes.dtype == np.int32
    # bits/byte relies on this: the token byte counts add up to the text's UTF-8 length.
    assert int(tok.token_bytes[np.asarray(ids)].sum()) == len(text.encode("utf-8"))


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 257 and tok.bos_id == tok.eos_id == 256
    assert tok.token_bytes[256] == 0 and tok.token_bytes[:256].sum() == 256
    _check_round_trip_and_bytes(tok, HARD_TEXT)
    assert tok.decode([256, *tok.encode("ab"), 256]) == "ab"
    assert tok.decode(np.array([104, 105], np.int32)) == "hi"
    with pytest.raises(ValueError, match="text"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def spm_docs() -> list[str]:
    return make_docs(60, seed=7, min_sent=20, max_sent=40)


def test_sentencepiece_round_trip_deterministic_and_cached(spm_docs, tmp_path):
    a = train_sentencepiece(spm_docs, 400)
    b = train_sentencepiece(spm_docs, 400)
    assert a.model_proto == b.model_proto and a.fingerprint == b.fingerprint
    assert isinstance(a, SentencePieceTokenizer) and isinstance(a, Tokenizer)
    assert a.vocab_size == 400 and a.bos_id is not None and a.token_bytes[a.bos_id] == 0
    for text in (HARD_TEXT, spm_docs[0]):
        _check_round_trip_and_bytes(a, text)
    # BPE learned merges: common text is much shorter than its bytes.
    assert len(a.encode(spm_docs[0])) < 0.5 * len(spm_docs[0])

    cfg = DataConfig(tokenizer="sentencepiece", vocab_size=400, data_dir=str(tmp_path))
    c = build_tokenizer(cfg, spm_docs)
    files = list((tmp_path / "tokenizers").glob("*.model"))
    assert len(files) == 1 and c.fingerprint == a.fingerprint
    assert build_tokenizer(cfg, spm_docs).fingerprint == a.fingerprint  # from the cache
    files[0].write_bytes(b"not a model")
    with pytest.raises(DataError, match="tokenizers"):
        build_tokenizer(cfg, spm_docs)


def test_sentencepiece_bad_vocab(spm_docs):
    with pytest.raises(ValueError, match="vocab_size"):
        train_sentencepiece(spm_docs[:2], 100)
    with pytest.raises(ValueError, match="vocab_size"):
        train_sentencepiece(["tiny text"], 50_000)


def _train_hf_bytelevel(docs, path):
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))


def test_hf_tokenizer_json(spm_docs, tmp_path):
    path = tmp_path / "tokenizer.json"
    _train_hf_bytelevel(spm_docs, path)
    tok = build_tokenizer(DataConfig(tokenizer=str(path)), spm_docs)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.bos_id == tok.eos_id == 0 and tok.token_bytes[0] == 0
    for text in (HARD_TEXT, spm_docs[1]):
        _check_round_trip_and_bytes(tok, text)


def test_hf_tokenizer_bad_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing.json")), [])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(DataError, match="bad.json") as info:
        build_tokenizer(DataConfig(tokenizer=str(bad)), [])
    assert "\n" not in str(info.value)
