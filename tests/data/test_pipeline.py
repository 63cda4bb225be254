"""Grain pipeline: packing, segments, mask, determinism, exact resume, sharding, eval batches."""

from __future__ import annotations

import numpy as np
import pytest
from textgen import make_docs

from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import DataError
from nested_jax.data.pipeline import (
    _MEMO,
    PackedWindows,
    make_eval_batches,
    make_train_iterator,
    prepare_data,
    steps_per_epoch,
    tokenize_documents,
    unigram_byte_entropy,
)
from nested_jax.data.tokenizers import ByteTokenizer

KEYS = ("inputs", "targets", "segment_ids", "loss_mask")


@pytest.fixture
def cfg(tmp_path) -> DataConfig:
    return DataConfig(corpus="unused", seq_len=32, batch_size=4, seed=5, data_dir=str(tmp_path))


@pytest.fixture
def tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture
def train_docs() -> list[str]:
    return make_docs(30, seed=2)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _equal(a, b) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in KEYS)


def test_tokenize_prefixes_separator_and_caches(tmp_path, tok, train_docs):
    _MEMO.clear()
    s = tokenize_documents(tok, train_docs, tmp_path)
    assert s.tokens.dtype == np.int32 and s.doc_lengths.sum() == s.tokens.size
    starts = np.concatenate([[0], np.cumsum(s.doc_lengths)[:-1]])
    assert (s.tokens[starts] == tok.bos_id).all()
    assert tok.decode(s.tokens[starts[1] : starts[2]]) == train_docs[1]
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1
    _MEMO.clear()
    again = tokenize_documents(tok, train_docs, tmp_path)  # from disk
    assert np.array_equal(again.tokens, s.tokens)
    _MEMO.clear()
    files[0].write_bytes(b"truncated")
    with pytest.raises(DataError, match=files[0].name):
        tokenize_documents(tok, train_docs, tmp_path)


def test_packing_segments_and_mask(tok):
    docs = ["abc", "defgh", "ij"]  # stream: |abc |defgh |ij  (| = separator), 13 tokens
    stream = tokenize_documents(tok, docs)
    seg = stream.segments
    t = 4
    windows = PackedWindows(stream, t, pad_last=True)
    assert len(windows) == 3  # targets 1..12 in windows of 4
    for w in range(len(windows)):
        row = windows[w]
        for i in range(t):
            g = w * t + i  # global position of the input token
            if g + 1 < stream.tokens.size:
                assert row["inputs"][i] == stream.tokens[g]
                assert row["targets"][i] == stream.tokens[g + 1]
                same = seg[g] == seg[g + 1]
                assert row["loss_mask"][i] == float(same)
                assert row["segment_ids"][i] == seg[g] - seg[w * t] + 1
            else:  # padding
                assert row["loss_mask"][i] == 0 and row["targets"][i] == 0
    first = windows[0]
    assert first["segment_ids"].tolist() == [1, 1, 1, 1]
    assert first["loss_mask"].tolist() == [1, 1, 1, 0]  # 'c' -> separator of doc 2 is not scored
    assert PackedWindows(stream, t, pad_last=False).__len__() == 3
    assert len(PackedWindows(stream, 5, pad_last=False)) == 2


def test_batch_format_and_determinism(cfg, tok, train_docs):
    a = _take(make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1), 6)
    b = _take(make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1), 6)
    for x, y in zip(a, b, strict=True):
        assert _equal(x, y)
    x = a[0]
    assert set(x) == set(KEYS)
    for k in KEYS:
        assert x[k].shape == (4, 32)
    assert x["inputs"].dtype == np.int32 and x["loss_mask"].dtype == np.float32
    assert np.array_equal(x["inputs"][:, 1:], x["targets"][:, :-1])
    other = DataConfig(**{**cfg.__dict__, "seed": 6})
    c = next(make_train_iterator(other, tok, train_docs, process_index=0, process_count=1))
    assert not _equal(a[0], c)


def test_epochs_are_permutations_with_fresh_order(cfg, tok, train_docs):
    n_steps = steps_per_epoch(cfg, tok, train_docs)
    it = make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1)
    windows = PackedWindows(tokenize_documents(tok, train_docs), cfg.seq_len, pad_last=False)
    lookup = {windows[w]["inputs"].tobytes(): w for w in range(len(windows))}

    def epoch_ids():
        rows = [r for b in _take(it, n_steps) for r in b["inputs"]]
        return [lookup[r.tobytes()] for r in rows]

    e0, e1 = epoch_ids(), epoch_ids()
    assert len(set(e0)) == len(e0) == n_steps * cfg.batch_size
    assert len(set(e1)) == len(e1)
    assert e0 != e1


def test_resume_from_state_is_exact(cfg, tok, train_docs):
    n_steps = steps_per_epoch(cfg, tok, train_docs)
    k = n_steps - 2  # resume just before an epoch boundary
    straight = _take(
        make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1), k + 5
    )
    it = make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1)
    _take(it, k)
    state = it.get_state()
    fresh = make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1)
    fresh.set_state(state)
    for x, y in zip(_take(fresh, 5), straight[k:], strict=True):
        assert _equal(x, y)


def test_resume_through_orbax_checkpoint(cfg, tok, train_docs, tmp_path):
    import grain
    import orbax.checkpoint as ocp

    it = make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1)
    _take(it, 3)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mgr.wait_until_finished()
    expected = _take(it, 2)
    fresh = make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    for x, y in zip(_take(fresh, 2), expected, strict=True):
        assert _equal(x, y)


def test_process_sharding_partitions_the_global_batch(cfg, tok, train_docs):
    single = _take(make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1), 8)
    p0 = _take(make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=2), 8)
    p1 = _take(make_train_iterator(cfg, tok, train_docs, process_index=1, process_count=2), 8)
    for g, a, b in zip(single, p0, p1, strict=True):
        assert a["inputs"].shape == (2, 32)
        rows_a = {r.tobytes() for r in a["inputs"]}
        rows_b = {r.tobytes() for r in b["inputs"]}
        assert not rows_a & rows_b  # disjoint
        for k in KEYS:  # together they are exactly the 1-process global batch
            assert np.array_equal(np.concatenate([a[k], b[k]]), g[k])


def test_process_defaults_come_from_jax(cfg, tok, train_docs):
    import jax

    assert jax.process_count() == 1
    a = next(make_train_iterator(cfg, tok, train_docs))
    b = next(make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=1))
    assert _equal(a, b)


def test_bad_pipeline_inputs(cfg, tok, train_docs):
    with pytest.raises(ValueError, match="data.batch_size"):
        make_train_iterator(cfg, tok, train_docs, process_index=0, process_count=3)
    with pytest.raises(ValueError, match="process_index"):
        make_train_iterator(cfg, tok, train_docs, process_index=2, process_count=2)
    with pytest.raises(DataError, match="batch_size"):
        make_train_iterator(cfg, tok, ["tiny"], process_index=0, process_count=1)
    with pytest.raises(DataError, match="no documents"):
        make_train_iterator(cfg, tok, [], process_index=0, process_count=1)
    with pytest.raises(DataError, match="validation split is empty"):
        make_eval_batches(cfg, tok, [], process_index=0, process_count=1)
    with pytest.raises(ValueError, match="max_batches"):
        make_eval_batches(cfg, tok, train_docs, max_batches=0, process_index=0, process_count=1)


def test_eval_batches_cover_every_target_once(cfg, tok):
    val = make_docs(5, seed=9)
    batches = make_eval_batches(cfg, tok, val, process_index=0, process_count=1)
    again = make_eval_batches(cfg, tok, val, process_index=0, process_count=1)
    assert len(batches) == len(again)
    assert all(_equal(a, b) for a, b in zip(batches, again, strict=True))
    for b in batches:
        assert b["inputs"].shape == (4, 32) and b["loss_mask"].shape == (4, 32)
    n_tokens = sum(len(tok.encode(d)) + 1 for d in val)
    # Every token after the first is a target once; separators after a document are not scored.
    scored = sum(float(b["loss_mask"].sum()) for b in batches)
    assert scored == n_tokens - len(val)
    scored_bytes = sum(int((tok.token_bytes[b["targets"]] * b["loss_mask"]).sum()) for b in batches)
    assert scored_bytes == sum(len(d.encode()) for d in val)
    # Fixed shapes: the last global batch is padded with fully masked rows.
    n_windows = -(-(n_tokens - 1) // cfg.seq_len)
    assert len(batches) == -(-n_windows // cfg.batch_size)
    # Two processes split each global batch; both get the same number of batches.
    halves = [make_eval_batches(cfg, tok, val, process_index=p, process_count=2) for p in range(2)]
    assert len(halves[0]) == len(halves[1]) == len(batches)
    for g, a, b in zip(batches, *halves, strict=True):
        assert np.array_equal(np.concatenate([a["targets"], b["targets"]]), g["targets"])
    assert (
        len(make_eval_batches(cfg, tok, val, max_batches=1, process_index=0, process_count=1)) == 1
    )


def test_prepare_data_on_user_text(corpus_dir, tmp_path):
    cfg = DataConfig(corpus=str(corpus_dir), val_fraction=0.25, data_dir=str(tmp_path / "d"))
    bundle = prepare_data(cfg)
    assert len(bundle.train_docs) == 18 and len(bundle.val_docs) == 6
    assert isinstance(bundle.tokenizer, ByteTokenizer)


def test_unigram_byte_entropy():
    assert unigram_byte_entropy(["abab"]) == pytest.approx(1.0)
    assert unigram_byte_entropy(["ab", "cd"]) == pytest.approx(2.0)
    assert unigram_byte_entropy(["aaaa"]) == pytest.approx(0.0)
    with pytest.raises(DataError):
        unigram_byte_entropy([""])
