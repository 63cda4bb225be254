"""Pre-tokenised shards: same stream and batches as in-process, resume, sharding, validation."""

from __future__ import annotations

import dataclasses
import json
import pickle

import numpy as np
import pytest
from textgen import make_docs

from nested_jax import cli
from nested_jax.data import prepared
from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import DataError
from nested_jax.data.pipeline import (
    PackedWindows,
    _ShuffledShardSource,
    make_train_iterator,
    prepare_data,
    steps_per_epoch,
    tokenize_documents,
)
from nested_jax.data.tokenizers import ByteTokenizer

KEYS = ("inputs", "targets", "segment_ids", "loss_mask")
# Awkward sizes: records shorter than most documents and than a window (a window spans up to
# three records), and a shard count that does not divide the record count.
CHUNK, SHARDS = 37, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A user-text corpus, its config, the in-process bundle and a prepared folder."""
    root = tmp_path_factory.mktemp("prep")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, d in enumerate(make_docs(30, seed=4)):
        (corpus / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
    cfg = DataConfig(
        corpus=str(corpus), seq_len=48, batch_size=4, seed=3, data_dir=str(root / "cache")
    )
    out = root / "prepared"
    manifest = prepared.prepare_corpus(cfg, out, shards=SHARDS, chunk_tokens=CHUNK)
    return cfg, prepare_data(cfg), out, manifest


def _with(cfg, **kw) -> DataConfig:
    return dataclasses.replace(cfg, **kw)


def _it(cfg, bundle, p=0, n=1):
    return make_train_iterator(
        cfg, bundle.tokenizer, bundle.train_docs, process_index=p, process_count=n
    )


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(
        all(np.array_equal(x[k], y[k]) for k in KEYS) for x, y in zip(xs, ys, strict=True)
    )


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_manifest_and_stream_equal_the_in_process_tokens(setup):
    cfg, bundle, out, m = setup
    stream = tokenize_documents(bundle.tokenizer, bundle.train_docs)
    assert m["tokens"]["train"] == stream.tokens.size
    assert m["split"]["train_documents"] == len(bundle.train_docs)
    assert m["records"]["count"] == -(-stream.tokens.size // CHUNK)
    assert [s["file"] for s in m["shards"]] == [prepared.shard_name(i, SHARDS) for i in range(3)]
    assert json.loads((out / prepared.MANIFEST).read_text()) == m
    assert not list(out.glob(".*tmp"))
    ps = prepared.open_prepared(_with(cfg, prepared_dir=str(out)), bundle.tokenizer)
    tok, seg = ps.read(0, ps.num_tokens)
    assert np.array_equal(tok, stream.tokens) and np.array_equal(seg, stream.segments)
    for a, b in [(0, 1), (36, 38), (5, 120), (ps.num_tokens - 3, ps.num_tokens + 9)]:
        t, s = ps.read(a, b)
        assert np.array_equal(t, stream.tokens[a:b]) and np.array_equal(s, stream.segments[a:b])


def test_same_batches_from_both_paths_over_epochs_and_with_prefetch(setup):
    cfg, bundle, out, _ = setup
    pcfg = _with(cfg, prepared_dir=str(out))
    n = steps_per_epoch(cfg, bundle.tokenizer, bundle.train_docs)
    assert steps_per_epoch(pcfg, bundle.tokenizer, None) == n
    want = _take(_it(cfg, bundle), 2 * n + 3)  # crosses two epoch boundaries
    assert _same(_take(_it(pcfg, bundle), 2 * n + 3), want)
    assert _same(_take(_it(_with(pcfg, prefetch=3), bundle), 2 * n + 3), want)
    # The tokenizer comes from the prepared folder; no train_docs needed to read it.
    tok = prepared.prepared_tokenizer(out)
    assert tok.fingerprint == bundle.tokenizer.fingerprint
    first = next(make_train_iterator(pcfg, tok, None, process_index=0, process_count=1))
    assert _same([first], want[:1])


def test_resume_mid_epoch_from_a_saved_state(setup):
    cfg, bundle, out, _ = setup
    pcfg = _with(cfg, prepared_dir=str(out), prefetch=2)
    n = steps_per_epoch(cfg, bundle.tokenizer, bundle.train_docs)
    k = n // 2 + 1
    straight = _take(_it(pcfg, bundle), k + 6)
    it = _it(pcfg, bundle)
    _take(it, k)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    resumed = _it(pcfg, bundle)
    resumed.set_state(state)
    assert _same(_take(resumed, 6), straight[k:])
    # A checkpoint of the in-process path resumes on the prepared one, and back.
    inproc = _it(cfg, bundle)
    _take(inproc, k)
    other = _it(pcfg, bundle)
    other.set_state(inproc.get_state())
    assert _same(_take(other, 6), straight[k:])


def test_two_processes_partition_every_global_batch(setup):
    cfg, bundle, out, _ = setup
    pcfg = _with(cfg, prepared_dir=str(out))
    n = steps_per_epoch(cfg, bundle.tokenizer, bundle.train_docs)
    single = _take(_it(pcfg, bundle), n)
    p0, p1 = _take(_it(pcfg, bundle, 0, 2), n), _take(_it(pcfg, bundle, 1, 2), n)
    windows = PackedWindows(
        tokenize_documents(bundle.tokenizer, bundle.train_docs), cfg.seq_len, False
    )
    index = {windows[w]["inputs"].tobytes(): w for w in range(len(windows))}
    seen: list[int] = []
    for g in range(n):
        assert p0[g]["inputs"].shape == (2, cfg.seq_len)
        for k in KEYS:
            assert np.array_equal(np.concatenate([p0[g][k], p1[g][k]]), single[g][k])
        seen += [index[r.tobytes()] for b in (p0[g], p1[g]) for r in b["inputs"]]
    # One epoch: no window twice, and every window but the W mod B dropped ones.
    assert len(seen) == len(set(seen)) == n * cfg.batch_size
    assert len(windows) - len(seen) == len(windows) % cfg.batch_size


def test_source_pickles_for_worker_processes(setup):
    cfg, bundle, out, _ = setup
    ps = prepared.open_prepared(_with(cfg, prepared_dir=str(out)), bundle.tokenizer)
    src = _ShuffledShardSource(PackedWindows(ps, cfg.seq_len, False), 4, 1, 2, cfg.seed)
    copy = pickle.loads(pickle.dumps(src))
    for i in (0, 5, 77):
        assert _same([copy[i]], [src[i]])


def test_manifest_validation_errors(setup, tmp_path):
    cfg, bundle, out, _ = setup
    tok = bundle.tokenizer

    def opens(folder, c=cfg, t=tok, docs=bundle.train_docs):
        return prepared.open_prepared(_with(c, prepared_dir=str(folder)), t, docs)

    with pytest.raises(DataError, match=r"manifest.json: missing \(run `nested-jax prepare-data"):
        opens(tmp_path / "nothing")
    other = ByteTokenizer()
    other.fingerprint = "byte-v0"
    with pytest.raises(DataError, match="tokenizer mismatch: prepared with byte-v1"):
        opens(out, t=other)
    with pytest.raises(DataError, match=r"prepared with data.seed=3, data.val_fraction=0.05"):
        opens(out, c=_with(cfg, seed=4))
    with pytest.raises(DataError, match="prepared from other text"):
        opens(out, docs=bundle.train_docs[:-1] + ["edited"])
    bad = _copy(out, tmp_path / "bad")
    (bad / prepared.MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="unreadable manifest"):
        opens(bad)
    (bad / prepared.MANIFEST).write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(DataError, match="not a version-1 nested-jax-prepared-tokens manifest"):
        opens(bad)
    missing = _copy(out, tmp_path / "missing")
    (missing / prepared.shard_name(1, SHARDS)).unlink()
    with pytest.raises(DataError, match=r"train-00001-of-00003.arrayrecord: missing shard"):
        opens(missing)
    cut = _copy(out, tmp_path / "cut")
    shard = cut / prepared.shard_name(0, SHARDS)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"bytes, the manifest says \d+ \(truncated or replaced\)"):
        opens(cut)
    flipped = _copy(out, tmp_path / "flipped")
    shard = flipped / prepared.shard_name(2, SHARDS)
    raw = bytearray(shard.read_bytes())
    raw[2000] ^= 0xFF  # inside the records (the file ends in block padding); same size

    shard.write_bytes(bytes(raw))
    ps = opens(flipped)
    with pytest.raises(DataError, match=r"train-00002-of-00003.arrayrecord: unreadable record"):
        ps.read(0, ps.num_tokens)
    with pytest.raises(DataError, match="sha256 differs from the manifest"):
        prepared.verify_prepared(flipped)
    assert prepared.verify_prepared(out)["records"]["count"] > 0


def test_prepare_refuses_and_leaves_nothing_half_written(setup, tmp_path):
    cfg, _, out, m = setup
    with pytest.raises(DataError, match="already holds a prepared corpus"):
        prepared.prepare_corpus(cfg, out)
    target = tmp_path / "few"
    with pytest.raises(DataError, match=r"--shards 20: the train split makes only \d+ records"):
        prepared.prepare_corpus(cfg, target, shards=20, chunk_tokens=4096)
    assert list(target.iterdir()) == []  # no manifest, no shard, no temporary file
    with pytest.raises(ValueError, match="^shards: must be an int >= 1"):
        prepared.prepare_corpus(cfg, target, shards=0)
    # A record that is not of this format is refused, not misread.
    rec = prepared.encode_record(np.arange(5), 2, np.array([3]), np.dtype(np.uint16))
    tok, seg = prepared.decode_record(rec, np.dtype(np.uint16), "x")
    assert tok.tolist() == [0, 1, 2, 3, 4] and seg.tolist() == [2, 2, 2, 3, 3]
    with pytest.raises(DataError, match="^x: corrupt record"):
        prepared.decode_record(rec[:-1], np.dtype(np.uint16), "x")


def test_cli_prepare_data_verify_and_errors(setup, tmp_path, capsys):
    cfg, _, out, m = setup
    sets = [f"data.{k}={getattr(cfg, k)}" for k in ("corpus", "data_dir", "seed")]
    argv = ["prepare-data", *[a for s in sets for a in ("--set", s)], "--out"]
    assert cli.main([*argv, str(tmp_path / "p"), "--shards", "3", "--chunk-tokens", "37"]) == 0
    again = json.loads((tmp_path / "p" / prepared.MANIFEST).read_text())
    assert again["content_sha256"] == m["content_sha256"]  # deterministic
    assert "3 shards" in capsys.readouterr().out
    assert cli.main([*argv, str(tmp_path / "p")]) == 1
    assert "already holds a prepared corpus" in capsys.readouterr().err
    assert cli.main([*argv, str(tmp_path / "p"), "--overwrite"]) == 0  # 1 shard now
    assert [f.name for f in (tmp_path / "p").glob("*.arrayrecord")] == [prepared.shard_name(0, 1)]
    assert cli.main(["prepare-data", "--out", str(tmp_path / "p"), "--verify"]) == 0
    assert cli.main([*argv, str(tmp_path / "q"), "--set", "data.prefetch=-1"]) == 2
    assert "data.prefetch: must be in [0, 64]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("prefetch", -1, r"must be in \[0, 64\]"),
        ("prefetch", 65, r"must be in \[0, 64\]"),
        ("prefetch", True, "expected int"),
        ("prepared_dir", None, "expected str"),
        ("prepared_dir", " /data/p", "leading/trailing spaces"),
    ],
)
def test_config_rejects_bad_values(field, value, match):
    with pytest.raises(ValueError, match=rf"^data\.{field}: {match}"):
        DataConfig(**{field: value})


def test_config_rejects_unknown_key_and_resume_rules():
    from nested_jax.train.config import Config, ConfigError, config_to_dict, load_config
    from nested_jax.train.workdir import ResumeRefused, check_resume

    with pytest.raises(ConfigError, match="prefetc"):
        load_config([], ["data.prefetc=2"])
    saved = config_to_dict(Config())
    new = load_config([], ["data.prefetch=4", "data.prepared_dir=/p"])
    changes = check_resume(saved, new, "w")  # same data, same iterator state: allowed
    assert {c.field for c in changes} == {"data.prefetch", "data.prepared_dir"}
    with pytest.raises(ResumeRefused, match="data.seq_len"):
        check_resume(saved, load_config([], ["data.seq_len=128"]), "w")


def test_bench_data_reports_both_rates(setup):
    from nested_jax.bench.data import prefetch_rates

    cfg, _, out, _ = setup
    r = prefetch_rates(_with(cfg, prepared_dir=str(out)), prefetch=2, batches=4, repeats=1)
    assert r["batches_per_s_off"] > 0 and r["batches_per_s_on"] > 0
    assert r["on_over_off"] == pytest.approx(r["batches_per_s_on"] / r["batches_per_s_off"])
    assert r["source"] == "prepared"
