"""Workdir, metrics, report and data paths that are URLs (``gs://bucket/runs/x``).

No network: ``gs://`` goes to an in-memory fsspec file system (:class:`FakeGCS`) through the same
``etils.epath`` fsspec backend that gcsfs serves on a real bucket, or is shown to be refused with
one line when no backend is installed. Orbax's array writes (tensorstore's own GCS driver) are not
exercised here.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import fsspec
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

from nested_jax import files
from nested_jax.data import pipeline
from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import load_documents, resolve_data_dir
from nested_jax.data.tokenizers import ByteTokenizer
from nested_jax.eval import main as eval_main
from nested_jax.eval.main import write_report
from nested_jax.files import PathError, as_path, resolve_path
from nested_jax.train import checkpoint, metrics
from nested_jax.train import main as train_main
from nested_jax.train.checkpoint import Checkpointer, checkpoint_steps
from nested_jax.train.config import ConfigError
from nested_jax.train.metrics import MetricsWriter, read_metrics
from nested_jax.train.workdir import (
    CONFIG_HISTORY,
    ConfigChange,
    has_run,
    record_config_changes,
    resolve_config,
)

RUN = "gs://bucket/runs/x"
# fsspec's registry of protocols (`fsspec.registry` itself is a read-only view of it).
_REGISTRY = importlib.import_module("fsspec.registry")._registry


class FakeGCS(MemoryFileSystem):
    """``gs://`` in memory (what gcsfs is to a real bucket); a fresh store per test."""

    protocol = ("gs", "gcs")
    store: dict = {}
    pseudo_dirs: list = [""]

    def __init__(self, *args, finalize_on_close=None, **kwargs):  # epath passes gcsfs's option
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        for prefix in ("gs://", "gcs://"):
            path = path.removeprefix(prefix)
        return super()._strip_protocol(path)


def _forget_backends():
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    files._backend_installed.cache_clear()


@pytest.fixture
def fake_gcs(monkeypatch):
    for name in ("gs", "gcs"):
        monkeypatch.setitem(_REGISTRY, name, FakeGCS)
    monkeypatch.setattr(FakeGCS, "store", {})
    monkeypatch.setattr(FakeGCS, "pseudo_dirs", [""])
    _forget_backends()
    yield FakeGCS
    _forget_backends()


@pytest.fixture
def no_gcsfs(monkeypatch):
    """A machine without gcsfs (and without tensorflow, whose gfile epath would use instead)."""
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # `import gcsfs` raises ImportError
    for name in ("gs", "gcs"):
        monkeypatch.delitem(_REGISTRY, name, raising=False)
    _forget_backends()
    yield
    _forget_backends()


def _objects(fs) -> list[str]:
    return sorted(fs.store)


# -- paths -----------------------------------------------------------------------------------------


def test_a_gs_url_stays_a_url_and_a_local_path_stays_pathlib(fake_gcs):
    run = as_path(RUN)
    assert str(run) == RUN and str(run / "checkpoints") == f"{RUN}/checkpoints"
    assert str(resolve_path(run)) == RUN  # epath's own resolve() would give $PWD/gs:/bucket/...
    assert files.is_remote(run) and not files.is_remote("runs/x")
    assert as_path("runs/x") == Path("runs/x")
    assert resolve_path("runs/x") == Path("runs/x").resolve()


def test_a_url_mangled_by_pathlib_or_of_an_unknown_scheme_is_refused(fake_gcs):
    hint = rf"looks like the URL {RUN} mangled by pathlib.Path .*; pass {RUN} itself$"
    with pytest.raises(PathError, match=rf"^--workdir gs:/bucket/runs/x: {hint}"):
        as_path(Path(RUN), "--workdir")  # pathlib.Path("gs://b") is the local folder gs:/b
    with pytest.raises(PathError, match=rf"^path /gs/bucket/runs/x: {hint}"):
        as_path(Path(as_path(RUN)))  # ... and pathlib.Path(epath gs://b) the local /gs/b
    with pytest.raises(PathError, match=r"unsupported URL scheme memory://"):
        as_path("memory://x", "data.corpus")
    assert str(as_path("/gcs/bucket/x")) == "/gcs/bucket/x"  # a FUSE mount is a local path


def test_gs_without_gcsfs_is_one_line_naming_the_flag_and_what_to_install(
    no_gcsfs, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert train_main.main(["--workdir", RUN]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"config error: --workdir {RUN}: reaching gs:// URLs needs the gcsfs package, which is "
        "not installed: pip install gcsfs or pip install 'nested-jax[gcs]'\n"
    )
    assert eval_main.main(["--workdir", RUN]) == 2
    assert capsys.readouterr().err.startswith(f"config error: --workdir {RUN}: reaching gs://")
    with pytest.raises(PathError, match=r"^data\.corpus gs://bucket/texts: .* pip install gcsfs"):
        load_documents(DataConfig(corpus="gs://bucket/texts"))
    with pytest.raises(PathError, match=r"^data\.data_dir gs://bucket/cache: "):
        resolve_data_dir("gs://bucket/cache")
    assert list(tmp_path.iterdir()) == []  # no local ./gs:/bucket/runs/x


# -- workdir files ---------------------------------------------------------------------------------


def test_workdir_records_on_a_gs_workdir(fake_gcs):
    with pytest.raises(ConfigError, match=rf"^--workdir {RUN} does not exist"):
        resolve_config(RUN, [], [])
    assert not has_run(RUN)

    change = ConfigChange("train.steps", 10, 20)
    record_config_changes(RUN, 5, [change])
    record_config_changes(RUN, 9, [change])  # an object store cannot append: read and rewrite
    lines = (as_path(RUN) / CONFIG_HISTORY).read_text().splitlines()
    assert [json.loads(x)["resumed_at_step"] for x in lines] == [5, 9]

    files.atomic_write_text(f"{RUN}/checkpoints/3/state/x", "")
    assert has_run(RUN)


def test_a_report_is_written_to_gs_directly(fake_gcs, monkeypatch):
    def no_temp_files(*args, **kwargs):
        raise AssertionError("a URL is written directly (an object store has no atomic rename)")

    monkeypatch.setattr(files.tempfile, "mkstemp", no_temp_files)
    write_report(RUN, "eval_report", {"loss": float("nan")}, "# report\n")
    assert _objects(fake_gcs) == [
        "/bucket/runs/x/eval_report.json",
        "/bucket/runs/x/eval_report.md",
    ]
    assert json.loads((as_path(RUN) / "eval_report.json").read_text()) == {"loss": None}


class _Manager:
    """Stands in for orbax's CheckpointManager, which on gs:// asks the real bucket about itself."""

    def __init__(self, directory, options):
        self.directory = directory

    def reload(self):
        pass

    def close(self):
        pass


def test_checkpoints_on_gs_are_found_and_an_unreadable_one_is_moved_aside(fake_gcs, monkeypatch):
    monkeypatch.setattr(checkpoint.ocp, "CheckpointManager", _Manager)
    for name in ("3/state/x", "7/state/x", "8.orbax-checkpoint-tmp-1/x"):
        files.atomic_write_text(f"{RUN}/checkpoints/{name}", "garbled")
    assert checkpoint_steps(RUN) == [3, 7]
    ckpt = Checkpointer(RUN)
    assert str(ckpt.manager.directory) == f"{RUN}/checkpoints"  # not $PWD/gs:/bucket/...
    assert [p.name for p in ckpt.incomplete] == ["8.orbax-checkpoint-tmp-1"]
    moved = ckpt._quarantine(7)
    assert str(moved).startswith(f"{RUN}/corrupt_checkpoints/step_7_")
    assert (moved / "state" / "x").read_text() == "garbled"
    assert checkpoint_steps(RUN) == [3]


# -- metrics ---------------------------------------------------------------------------------------


def test_metrics_on_gs_are_batched_and_skip_tensorboard(fake_gcs, capsys):
    path = as_path(RUN) / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "loss": 3.0}\n{"step": 2, "ki')  # killed mid-line
    writer = MetricsWriter(RUN)
    assert "notice: no TensorBoard events for the remote workdir gs://" in capsys.readouterr().out
    writer.write(2, "train", {"loss": 2.5})
    writer.write(3, "eval", {"val_loss": float("nan")})
    assert read_metrics(RUN) == [{"step": 1, "kind": "train", "loss": 3.0}]  # not yet flushed
    writer.close()
    assert read_metrics(RUN) == [
        {"step": 1, "kind": "train", "loss": 3.0},
        {"step": 2, "kind": "train", "loss": 2.5},
        {"step": 3, "kind": "eval", "val_loss": None},
    ]
    assert _objects(fake_gcs) == ["/bucket/runs/x/metrics.jsonl"]  # no tensorboard/ folder


def test_metrics_on_gs_are_flushed_after_the_interval(fake_gcs, monkeypatch):
    monkeypatch.setattr(metrics, "REMOTE_FLUSH_S", 0.0)
    writer = MetricsWriter(RUN, tensorboard=False)
    writer.write(1, "train", {"loss": 1.0})
    assert read_metrics(RUN, "train") == [{"step": 1, "kind": "train", "loss": 1.0}]
    writer.close()


# -- data ------------------------------------------------------------------------------------------


def test_corpus_folder_and_token_cache_on_gs(fake_gcs, monkeypatch):
    texts = {"b.txt": "second\n", "a.txt": "first\n", "sub/c.txt": "third\n", "notes.md": "no\n"}
    for name, text in texts.items():
        files.atomic_write_text(f"gs://bucket/texts/{name}", text)
    docs = load_documents(DataConfig(corpus="gs://bucket/texts,gs://bucket/texts/a.txt"))
    assert docs == ["first\n", "second\n", "third\n"]  # sorted by path, each file once

    cfg = DataConfig(corpus="gs://bucket/texts", data_dir="gs://bucket/cache")
    cache = pipeline._token_cache_dir(cfg)
    assert str(cache) == "gs://bucket/cache/tokens"
    stream = pipeline.tokenize_documents(ByteTokenizer(), docs, cache)
    (npz,) = as_path(cache).iterdir()
    monkeypatch.setattr(pipeline, "_MEMO", {})  # read it back from the bucket
    again = pipeline.tokenize_documents(ByteTokenizer(), docs, cache)
    assert npz.suffix == ".npz" and again.tokens.tolist() == stream.tokens.tolist()
