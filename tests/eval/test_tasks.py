"""NIAH and MQAR generators and scoring."""

from __future__ import annotations

import numpy as np
import pytest

from nested_jax.data.tokenizers import ByteTokenizer, train_sentencepiece
from nested_jax.eval.tasks import (
    NEEDLE_TEMPLATE,
    QUESTION,
    make_mqar_batch,
    mqar_accuracy,
    niah_grid,
    niah_markdown,
    score_niah,
)

_WORDS = "the letter was sent to her sister at the house before the ball in the evening".split()


def _haystack(n_words: int = 3000, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    sentences = [
        " ".join(rng.choice(_WORDS, size=9)).capitalize() + "." for _ in range(n_words // 9)
    ]
    return " ".join(sentences)


def _oracle(tokens: np.ndarray, vocab: int = 257) -> np.ndarray:
    """Causal-looking perfect predictor: at t it 'predicts' token t + 1."""
    b, t = tokens.shape
    logits = np.zeros((b, t, vocab), np.float32)
    nxt = np.concatenate([tokens[:, 1:], np.zeros((b, 1), tokens.dtype)], axis=1)
    np.put_along_axis(logits, nxt[..., None], 1.0, axis=-1)
    return logits


def _find(haystack: np.ndarray, needle: np.ndarray) -> int:
    for i in range(haystack.size - needle.size + 1):
        if np.array_equal(haystack[i : i + needle.size], needle):
            return i
    return -1


def test_niah_lengths_depths_and_structure():
    tok = ByteTokenizer()
    lengths, depths = [200, 513], [0.0, 0.25, 0.5, 1.0]
    exs = niah_grid(_haystack(), tok, lengths, depths, n_per_cell=3, seed=0)
    assert len(exs) == 2 * 4 * 3
    for ex in exs:
        assert ex.tokens.shape == (ex.length,) and ex.tokens.dtype == np.int32
        assert ex.tokens[0] == tok.bos_id
        assert tok.decode(ex.answer) == " " + ex.passkey and len(ex.passkey) == 5
        assert tok.decode(ex.prompt).endswith("\n\n" + QUESTION)
        needle = np.asarray(tok.encode(NEEDLE_TEMPLATE.format(key=ex.passkey)), np.int32)
        pos = _find(ex.tokens, needle)
        assert pos == ex.needle_start + 1  # after the needle's leading space
        # The needle sits at the requested fraction of the haystack (to one token).
        n_fill = (
            ex.prompt_len - 1 - len(tok.encode(" " + NEEDLE_TEMPLATE.format(key=ex.passkey) + " "))
        )
        n_fill -= len(tok.encode("\n\n" + QUESTION))
        assert abs((ex.needle_start - 1) - ex.depth * n_fill) <= 0.5
    again = niah_grid(_haystack(), tok, lengths, depths, n_per_cell=3, seed=0)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(exs, again, strict=True))
    other = niah_grid(_haystack(), tok, lengths, depths, n_per_cell=3, seed=1)
    assert [e.passkey for e in other] != [e.passkey for e in exs]


def test_niah_short_haystack_is_tiled_and_bpe_lengths_exact():
    docs = [_haystack(400, seed=s) for s in range(20)]
    tok = train_sentencepiece(docs, 320)
    exs = niah_grid("Short text. ", tok, [300, 301], [0.3], n_per_cell=2, seed=3)
    assert [e.tokens.size for e in exs] == [300, 300, 301, 301]
    for e in exs:
        assert tok.decode(e.answer).strip() == e.passkey


def test_score_niah_oracle_uniform_and_table():
    tok = ByteTokenizer()
    exs = niah_grid(_haystack(), tok, [128, 256], [0.0, 0.5, 1.0], n_per_cell=2, seed=0)
    res = score_niah(_oracle, exs, batch_size=4)
    assert res["overall"] == 1.0 and res["num_examples"] == 12
    assert res["accuracy"] == {
        128: {0.0: 1.0, 0.5: 1.0, 1.0: 1.0},
        256: {0.0: 1.0, 0.5: 1.0, 1.0: 1.0},
    }
    uniform = score_niah(lambda t: np.zeros((*t.shape, 257), np.float32), exs)
    assert uniform["overall"] == 0.0

    def shallow_only(tokens):
        # Perfect when the needle is in the first half, otherwise uniform: tests the table.
        out = _oracle(tokens)
        for row in range(tokens.shape[0]):
            start = tok.decode(tokens[row]).find("The pass key is")
            if start >= tokens.shape[1] // 2:
                out[row] = 0.0
        return out

    exs = niah_grid(_haystack(), tok, [256, 512], [0.0, 0.5, 1.0], n_per_cell=2, seed=0)
    res = score_niah(shallow_only, exs, batch_size=3)
    for length in (256, 512):
        assert res["accuracy"][length][0.0] == 1.0 and res["accuracy"][length][1.0] == 0.0
    md = niah_markdown(res)
    assert "| 256 | 1.00 | 1.00 | 0.00 |" in md and "depth 0.5" in md

    with pytest.raises(ValueError, match="logits_fn"):
        score_niah(lambda t: np.zeros((t.shape[0], 3, 257)), exs)


def test_niah_bad_arguments():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="lengths"):
        niah_grid(_haystack(), tok, [50], [0.5], 1, 0)  # too short for needle + question
    with pytest.raises(ValueError, match="depths"):
        niah_grid(_haystack(), tok, [200], [1.5], 1, 0)
    with pytest.raises(ValueError, match="haystack_text"):
        niah_grid("  ", tok, [200], [0.5], 1, 0)
    with pytest.raises(ValueError, match="n_per_cell"):
        niah_grid(_haystack(), tok, [200], [0.5], 0, 0)


def test_mqar_structure():
    v, n, t = 64, 8, 40
    batch = make_mqar_batch(0, 16, t, n, v)
    assert batch["inputs"].shape == batch["targets"].shape == batch["loss_mask"].shape == (16, t)
    assert batch["inputs"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
    assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert (batch["loss_mask"].sum(1) == n).all()
    for b in range(16):
        x, y, m = batch["inputs"][b], batch["targets"][b], batch["loss_mask"][b] > 0
        keys, values = x[0 : 2 * n : 2], x[1 : 2 * n : 2]
        assert ((1 <= keys) & (keys < v // 2)).all() and len(set(keys)) == n
        assert ((v // 2 <= values) & (values < v)).all()
        binding = dict(zip(keys.tolist(), values.tolist(), strict=True))
        assert sorted(x[m].tolist()) == sorted(keys.tolist())  # every key queried once
        assert all(binding[k] == val for k, val in zip(x[m], y[m], strict=True))
        assert not m[: 2 * n].any()  # queries come after the context
        # a key appears only in its pair and its query
        for k in keys:
            assert (x == k).sum() == 2
    same = make_mqar_batch(np.random.default_rng(0), 16, t, n, v)
    assert all(np.array_equal(batch[k], same[k]) for k in batch)


def test_mqar_accuracy_oracle_and_uniform():
    batch = make_mqar_batch(1, 8, 64, 4, 32)
    oracle = np.zeros((8, 64, 32), np.float32)
    np.put_along_axis(oracle, batch["targets"][..., None], 1.0, axis=-1)
    assert mqar_accuracy(oracle, batch) == 1.0
    assert mqar_accuracy(np.zeros_like(oracle), batch) == 0.0  # argmax 0 is never a value
    with pytest.raises(ValueError, match="logits"):
        mqar_accuracy(oracle[:, :10], batch)


def test_mqar_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        make_mqar_batch(0, 2, 64, 8, 16)
    with pytest.raises(ValueError, match="seq_len"):
        make_mqar_batch(0, 2, 30, 8, 64)
    with pytest.raises(ValueError, match="num_kv_pairs"):
        make_mqar_batch(0, 2, 30, 0, 64)
