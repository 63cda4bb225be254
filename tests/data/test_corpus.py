"""Corpus loading, the document-level split, atomic cache writes and the Austen decoder."""

from __future__ import annotations

import gzip
import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from nested_jax.data import corpus as corpus_mod
from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import (
    AUSTEN_NOVELS,
    DataError,
    austen_cache_path,
    austen_documents,
    decode_janeaustenr,
    load_austen_novels,
    load_documents,
    resolve_data_dir,
    split_chapters,
    split_documents,
    write_cache_bytes,
)


def _one_line_error(info, path) -> None:
    msg = str(info.value)
    assert "\n" not in msg
    assert str(path) in msg


# ---------------------------------------------------------------- user text


def test_folder_is_read_recursively_sorted(corpus_dir, docs):
    got = load_documents(DataConfig(corpus=str(corpus_dir)))
    # sorted paths: a/doc00, a/doc02, ..., b/doc01, ...
    expected = [docs[i] for i in range(0, len(docs), 2)] + [docs[i] for i in range(1, len(docs), 2)]
    assert got == expected


def test_comma_separated_files_and_duplicates(corpus_dir, docs):
    a = corpus_dir / "a" / "doc00.txt"
    b = corpus_dir / "b" / "doc01.txt"
    got = load_documents(DataConfig(corpus=f"{b}, {a},{b}"))
    assert got == [docs[1], docs[0]]


def test_crlf_is_normalised(tmp_path):
    p = tmp_path / "x.txt"
    p.write_bytes(b"line one\r\nline two\r\n")
    assert load_documents(DataConfig(corpus=str(p))) == ["line one\nline two\n"]


@pytest.mark.parametrize("case", ["missing", "empty", "blank", "no_txt", "not_utf8"])
def test_bad_user_data_gives_one_clear_error(tmp_path, case):
    if case == "missing":
        path = tmp_path / "nope.txt"
    elif case in ("empty", "blank"):
        path = tmp_path / "empty.txt"
        path.write_text("" if case == "empty" else "  \n\n", encoding="utf-8")
    elif case == "no_txt":
        path = tmp_path / "folder"
        path.mkdir()
        (path / "notes.md").write_text("hello", encoding="utf-8")
    else:
        path = tmp_path / "latin1.txt"
        path.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError) as info:
        load_documents(DataConfig(corpus=str(path)))
    _one_line_error(info, path)
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------- split


def test_split_is_deterministic_disjoint_and_complete(docs):
    train, val = split_documents(docs, 0.25, seed=3)
    again = split_documents(docs, 0.25, seed=3)
    assert (train, val) == again
    assert len(val) == 6 and len(train) == 18
    assert sorted(train + val) == sorted(docs)
    # both halves keep corpus order
    assert [docs.index(d) for d in train] == sorted(docs.index(d) for d in train)
    other = split_documents(docs, 0.25, seed=4)[1]
    assert other != val


def test_split_edge_cases(docs):
    assert split_documents(docs, 0.0, 0) == (docs, [])
    with pytest.raises(DataError, match="val_fraction"):
        split_documents(docs[:1], 0.05, 0)
    with pytest.raises(DataError):
        split_documents([], 0.1, 0)
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(docs, 1.0, 0)


# ---------------------------------------------------------------- cache helpers


def test_resolve_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NESTED_JAX_DATA", str(tmp_path / "env"))
    assert resolve_data_dir("") == tmp_path / "env"
    assert resolve_data_dir(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.delenv("NESTED_JAX_DATA")
    assert resolve_data_dir("") == Path("~/.cache/nested_jax").expanduser()


# ---------------------------------------------------------------- Austen (offline pieces)


def test_split_chapters_keeps_front_matter_and_text():
    lines = ["EMMA", "", "VOLUME I", "CHAPTER I", "", "one", "", "Chapter 2.", "two", "", ""]
    docs = split_chapters(lines)
    assert docs == ["EMMA\n\nVOLUME I\nCHAPTER I\n\none\n", "Chapter 2.\ntwo\n"]
    assert split_chapters(["no headings", "at all"]) == ["no headings\nat all\n"]
    # A sentence mentioning a chapter is not a heading.
    assert len(split_chapters(["CHAPTER 1", "the chapter ended", "Chapter the last"])) == 1


def _fake_rdata_dir(tmp_path: Path, corrupt: str | None = None) -> Path:
    """An R lazy-load database in janeaustenr's layout, written with rdata's serializer."""
    import rdata.unparser
    from rdata.conversion import convert_python_to_r_data

    def ser(obj) -> bytes:
        return rdata.unparser.unparse_data(convert_python_to_r_data(obj), file_format="xdr")

    rdb, index = b"", {}
    for name in AUSTEN_NOVELS:
        lines = np.array([name.upper(), "", "CHAPTER 1", f"{name} one", "CHAPTER 2", "end"])
        raw = ser(lines)
        blob = struct.pack(">I", len(raw)) + zlib.compress(raw)
        if corrupt == "entry" and name == "persuasion":
            blob = blob[:6] + b"\x00" * (len(blob) - 6)
        index[name] = np.array([len(rdb), len(blob)], dtype=np.int32)
        rdb += blob
    idx = {"variables": index, "references": {}, "compressed": np.array([True])}
    d = tmp_path / "rdata"
    d.mkdir()
    (d / "Rdata.rdb").write_bytes(rdb)
    rdx = gzip.compress(ser(idx))
    (d / "Rdata.rdx").write_bytes(rdx[:20] if corrupt == "index" else rdx)
    return d


def test_decode_lazy_load_database(tmp_path):
    novels = decode_janeaustenr(_fake_rdata_dir(tmp_path))
    assert list(novels) == list(AUSTEN_NOVELS)
    assert novels["emma"] == ["EMMA", "", "CHAPTER 1", "emma one", "CHAPTER 2", "end"]


@pytest.mark.parametrize("corrupt", ["entry", "index"])
def test_decode_corrupt_database(tmp_path, corrupt):
    with pytest.raises(DataError) as info:
        decode_janeaustenr(_fake_rdata_dir(tmp_path, corrupt))
    assert "\n" not in str(info.value) and "Rdata.rd" in str(info.value)


def test_austen_cache_is_used_and_corruption_detected(tmp_path, monkeypatch):
    novels = decode_janeaustenr(_fake_rdata_dir(tmp_path))
    cache = austen_cache_path(str(tmp_path / "data"))
    payload = {"format": 1, "source": "test", "novels": novels}
    write_cache_bytes(cache, json.dumps(payload).encode())

    def no_download(*a, **k):
        raise AssertionError("must not download when the cache exists")

    monkeypatch.setattr(corpus_mod, "_download_deb", no_download)
    docs = austen_documents(str(tmp_path / "data"))
    assert len(docs) == 2 * len(AUSTEN_NOVELS)
    assert docs[0].startswith("EMMA\n\nCHAPTER 1\nemma one")

    for bad in (b'{"format": 1, "novels": {"emma": []}}', b"\x00garbage", b'{"format": 9}'):
        cache.write_bytes(bad)
        with pytest.raises(DataError) as info:
            load_austen_novels(str(tmp_path / "data"))
        _one_line_error(info, cache)


def test_missing_apt_gives_user_text_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod.shutil, "which", lambda name: None)
    monkeypatch.setattr(corpus_mod, "_RDATA_SUBDIR", "nonexistent/janeaustenr/data")
    with pytest.raises(DataError, match="data.corpus") as info:
        load_documents(DataConfig(data_dir=str(tmp_path)))
    assert "\n" not in str(info.value)
    assert not austen_cache_path(str(tmp_path)).exists()


def test_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    import subprocess

    calls = []

    def fake_run(cmd, cwd):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 100, "", "W: x\nE: Unable to locate package\n")

    monkeypatch.setattr(corpus_mod.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(corpus_mod, "_RDATA_SUBDIR", "nonexistent/janeaustenr/data")
    monkeypatch.setattr(corpus_mod, "_run", fake_run)
    with pytest.raises(DataError, match="Unable to locate package") as info:
        load_documents(DataConfig(data_dir=str(tmp_path)))
    assert "\n" not in str(info.value) and "data.corpus" in str(info.value)
    assert calls[0] == ["apt-get", "download", "r-cran-janeaustenr"]
    # Nothing half-written: no cache file, no leftover download folder.
    assert list((tmp_path / "austen").iterdir()) == []


def test_unwritable_data_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataError, match="data_dir"):
        write_cache_bytes(blocker / "sub" / "c.json", b"{}")


# ---------------------------------------------------------------- Austen (real download)


@pytest.mark.skipif(
    shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None,
    reason="needs Debian apt-get/dpkg-deb",
)
def test_real_austen_corpus(tmp_path):
    data_dir = str(tmp_path / "data")
    docs = load_documents(DataConfig(data_dir=data_dir))
    assert austen_cache_path(data_dir).is_file()
    # 269 chapters: Emma 55, Mansfield Park 48, Northanger Abbey 31, Persuasion 24,
    # Pride and Prejudice 61, Sense and Sensibility 50.
    assert len(docs) == 269
    assert docs[0].startswith("EMMA")
    assert 3_900_000 < sum(len(d) for d in docs) < 4_200_000
    assert any(d.startswith("PRIDE AND PREJUDICE") for d in docs)
    assert any("It is a truth universally acknowledged" in d for d in docs)
    # The second load comes from the cache and is identical.
    assert load_documents(DataConfig(data_dir=data_dir)) == docs
    # End to end: split, byte tokenizer, one training batch.
    from nested_jax.data.pipeline import make_train_iterator, prepare_data

    cfg = DataConfig(data_dir=data_dir, seq_len=64, batch_size=2)
    bundle = prepare_data(cfg)
    assert len(bundle.val_docs) == 14 and len(bundle.train_docs) == 255
    batch = next(make_train_iterator(cfg, bundle.tokenizer, bundle.train_docs))
    assert batch["inputs"].shape == (2, 64) and batch["loss_mask"].sum() > 0
