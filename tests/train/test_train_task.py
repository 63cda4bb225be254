"""`nested-jax train --task FAMILY:NAME`: a generated task trained by the ordinary loop.

One module-scoped run trains ``formal:parity`` 4 steps (checkpoints at 2 and 4) through
``cli.main``; the tests read it, resume a copy of its step-2 checkpoint, and check the task data
source (same batches for the same seed, exact resume of the grain iterator, process slicing,
disjoint validation stream), the records a task run keeps and the one-line errors.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_helpers import defaults_preset, tiny_values

import nested_jax.eval.task_families  # noqa: F401  (registers formal / mad for data.task)
from nested_jax import cli
from nested_jax.data import pipeline
from nested_jax.data.config import DataConfig
from nested_jax.data.identity import data_spec, tokenizer_from_payload, tokenizer_payload
from nested_jax.data.task_source import (
    TASK_FAMILIES,
    TaskTokenizer,
    build_task,
    task_record,
    validation_batches,
)
from nested_jax.eval.formal_languages import FormalVocab, formal_accuracy
from nested_jax.train.checkpoint import Checkpointer, checkpoint_steps
from nested_jax.train.config import load_workdir_config
from nested_jax.train.metrics import read_metrics
from nested_jax.train.signals import EXIT_CONFIG, EXIT_OK

TASK = "formal:parity"
KEYS = ("inputs", "targets", "segment_ids", "loss_mask")


def _overrides(data_dir, **extra) -> list[str]:
    """`--set` of the tiny settings, without a corpus (a task run reads none)."""
    values = tiny_values("unused", data_dir, **extra)
    del values["data.corpus"]
    values.update({"data.task_options.train_lengths": "[1,12]", "eval.eval_batches": 2})
    out = []
    for k, v in values.items():
        v = str(v).lower() if isinstance(v, bool) else v
        out += ["--set", f"{k}={v}"]
    return out


def _train(root, workdir, *args, **extra) -> tuple[int, str, str]:
    argv = ["train", "--config", str(defaults_preset(root)), "--workdir", str(workdir)]
    argv += [*args, *_overrides(root / "data_cache", **extra)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    workdir = root / "parity"
    code, out, err = _train(root, workdir, "--task", TASK, **{"train.eval_every": 2})
    assert code == EXIT_OK, err
    return {"root": root, "workdir": workdir, "out": out}


def _cfg_from_workdir(run) -> DataConfig:
    return load_workdir_config(run["workdir"]).data


def _fresh(cfg: DataConfig, **kw):
    return pipeline.make_train_iterator(cfg, None, None, process_index=0, process_count=1, **kw)


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in KEYS)


# -- the run -----------------------------------------------------------------------------------


def test_train_task_writes_checkpoints_and_reports_accuracy(run):
    workdir = run["workdir"]
    assert checkpoint_steps(workdir) == [2, 4]
    evals = read_metrics(workdir, "eval")
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 0.0 <= r["val_accuracy"] <= 1.0 and np.isfinite(r["val_loss"])
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["val_accuracy"] == evals[-1]["val_accuracy"]
    assert f"task {TASK} ({FormalVocab().size} ids)" in run["out"]
    assert "val accuracy" in run["out"] and "validation accuracy" in run["out"]
    config = json.loads((workdir / "config.json").read_text())
    assert config["data"]["task"] == TASK
    assert config["data"]["task_options"] == {"train_lengths": [1, 12]}


def test_reported_accuracy_is_the_task_score_of_the_final_params(run):
    """val_accuracy at step 4 = formal_accuracy of the restored step-4 model's argmax ids on the
    held-out batches, recomputed here without the loop's scorer."""
    from nested_jax.train.inference import load_trained, sharded_argmax_fn

    trained = load_trained(run["workdir"])
    assert trained.step == 4 and trained.bundle.task is not None
    batches = pipeline.make_eval_batches(trained.config.data, trained.tokenizer, [], max_batches=2)
    predict = sharded_argmax_fn(trained)
    accs = [formal_accuracy(predict(b["inputs"]), b) for b in batches]
    logged = read_metrics(run["workdir"], "eval")[-1]["val_accuracy"]
    # every formal row has one scored position: the pooled accuracy is the mean over batches
    assert logged == pytest.approx(float(np.mean(accs)), abs=1e-12)


def test_data_record_names_the_task_and_rebuilds_its_tokenizer(run):
    spec = json.loads((run["workdir"] / "data_spec.json").read_text())
    assert spec["tokenizer"]["kind"] == "task" and spec["tokenizer"]["file"] is None
    assert spec["corpus"]["source"] == TASK and spec["corpus"]["task"] == TASK
    assert spec["corpus"]["options"] == {"train_lengths": [1, 12]}
    tok = tokenizer_from_payload(spec["tokenizer"], None, "data_spec.json")
    assert isinstance(tok, TaskTokenizer) and tok.fingerprint == spec["tokenizer"]["fingerprint"]
    assert TASK in tok.fingerprint and tok.vocab_size == FormalVocab().size
    # a record edited to another vocabulary no longer matches its fingerprint
    bad = {**spec["tokenizer"], "vocab_size": 18}
    with pytest.raises(ValueError, match="fingerprint"):
        tokenizer_from_payload(bad, None, "data_spec.json")


def test_resume_continues_with_the_exact_next_batch(run):
    """A copy of the step-2 checkpoint resumed to step 4 trains on the straight run's batches 3
    and 4 (equal losses), and its saved grain state gives the fresh iterator's batch 2."""
    root, workdir = run["root"], run["workdir"]
    cfg = _cfg_from_workdir(run)
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        restored = _fresh(cfg)
        data = grain.checkpoint.CheckpointRestore(restored)
        ckpt.manager.restore(2, args=ocp.args.Composite(data=data))
    finally:
        ckpt.manager.close()
    fresh = _fresh(cfg)
    for _ in range(2):
        next(fresh)
    assert _same(next(restored), next(fresh))

    copy = root / "resumed"
    (copy / "checkpoints").mkdir(parents=True)
    shutil.copytree(workdir / "checkpoints" / "2", copy / "checkpoints" / "2")
    for name in ("config.json", "data_spec.json"):
        shutil.copy(workdir / name, copy / name)
    code, out, err = cli_resume(copy)
    assert code == EXIT_OK, err
    assert "resuming from step 2" in out
    straight = {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}
    resumed = {r["step"]: r["loss"] for r in read_metrics(copy, "train")}
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s] == straight[s] for s in (3, 4)), (resumed, straight)


def cli_resume(workdir) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["train", "--workdir", str(workdir)])
    return code, out.getvalue(), err.getvalue()


def test_resume_with_another_task_is_refused_in_one_line(run):
    root, workdir = run["root"], run["workdir"]
    before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    code, _, err = _train(root, workdir, "--task", "formal:dyck1")
    err = err.strip().splitlines()[-1]
    assert code == EXIT_CONFIG
    assert err.startswith(f"config error: cannot resume {workdir} with a changed data.task")
    assert f"'{TASK}' -> 'formal:dyck1'" in err
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("formal:nope", "config error: data.task: unknown formal task 'nope'; known: "),
        ("nope:parity", "config error: data.task: unknown task family 'nope'; registered: "),
        ("parity", "config error: data.task: expected '' (a text corpus) or '<family>:<name>'"),
        ("mad:nope", "config error: data.task: unknown MAD task 'nope'"),
    ],
)
def test_an_unknown_task_is_one_config_line_naming_data_task(tmp_path, task, message):
    workdir = tmp_path / "run"
    code, _, err = _train(tmp_path, workdir, "--task", task)
    assert code == EXIT_CONFIG and err.strip().startswith(message), err
    assert "\n" not in err.strip() and not workdir.exists()


def test_bad_task_options_name_the_option(tmp_path):
    workdir = tmp_path / "run"
    too_long = ["--set", "data.task_options.eval_lengths=[31,40]"]
    code, _, err = _train(tmp_path, workdir, "--task", TASK, *too_long)
    assert code == EXIT_CONFIG and not workdir.exists()
    assert err.strip().startswith("config error: data.task_options.eval_lengths: strings up to 40")


# -- the task source ---------------------------------------------------------------------------


def _parity(seed: int = 3, **kw) -> DataConfig:
    return DataConfig(
        task=TASK,
        task_options={"train_lengths": [1, 12]},
        seq_len=32,
        batch_size=8,
        seed=seed,
        **kw,
    )


def test_same_seed_same_batches_and_other_seed_other_batches():
    a, b, c = _fresh(_parity()), _fresh(_parity()), _fresh(_parity(seed=4))
    first = [next(a) for _ in range(3)]
    assert all(_same(x, next(b)) for x in first)
    assert not _same(first[0], next(c))
    assert not _same(first[0], first[1])
    for x in first:
        assert {k: (v.dtype, v.shape) for k, v in x.items()} == {
            "inputs": (np.int32, (8, 32)),
            "targets": (np.int32, (8, 32)),
            "segment_ids": (np.int32, (8, 32)),
            "loss_mask": (np.float32, (8, 32)),
        }
        assert (x["loss_mask"].sum(-1) == 1).all() and (x["segment_ids"] == 1).all()


def test_iterator_state_restores_the_exact_next_batch_and_prefetch_changes_nothing():
    cfg = _parity()
    it = _fresh(cfg)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = next(it)
    again = _fresh(cfg)
    again.set_state(state)
    assert _same(next(again), expected)
    threaded = pipeline.make_train_iterator(
        DataConfig(**{**cfg.__dict__, "prefetch": 2}), None, None, process_index=0, process_count=1
    )
    plain = _fresh(cfg)
    assert all(_same(next(threaded), next(plain)) for _ in range(3))


def test_processes_split_each_global_batch_by_rows():
    cfg = _parity()
    whole = next(_fresh(cfg))
    parts = [
        next(pipeline.make_train_iterator(cfg, None, None, process_index=p, process_count=2))
        for p in range(2)
    ]
    for k in KEYS:
        assert np.array_equal(np.concatenate([p[k] for p in parts]), whole[k])
    val = pipeline.make_eval_batches(cfg, None, [], max_batches=2, process_index=1, process_count=2)
    full = pipeline.make_eval_batches(cfg, None, [], max_batches=2)
    assert len(val) == 2 and all(
        np.array_equal(v["inputs"], f["inputs"][4:]) for v, f in zip(val, full, strict=True)
    )


def test_validation_batches_are_fixed_and_drawn_apart_from_training():
    cfg = _parity()
    task = build_task(cfg)
    one, two = (validation_batches(task, cfg, 3, 0, 1) for _ in range(2))
    assert all(_same(x, y) for x, y in zip(one, two, strict=True))
    train = [next(it) for it in [_fresh(cfg)] for _ in range(3)]
    assert not any(np.array_equal(v["inputs"], t["inputs"]) for v in one for t in train)
    # eval_lengths: held-out strings of other lengths than training's
    longer = DataConfig(
        **{**cfg.__dict__, "task_options": {"train_lengths": [1, 12], "eval_lengths": [13, 30]}}
    )
    lengths = (
        pipeline.make_eval_batches(longer, None, [], max_batches=2)[0]["loss_mask"].argmax(-1) - 1
    )
    assert lengths.min() >= 13 and lengths.max() <= 30
    train_lengths = next(_fresh(longer))["loss_mask"].argmax(-1) - 1
    assert train_lengths.max() <= 12


def test_mad_task_rows_are_padded_to_seq_len_and_scored():
    cfg = DataConfig(
        task="mad:in_context_recall", task_options={"seq_len": 24}, seq_len=32, batch_size=4
    )
    task = build_task(cfg)
    assert task.vocab_size == 16
    b = next(_fresh(cfg))
    assert b["inputs"].shape == (4, 32)
    assert (b["loss_mask"][:, 23:] == 0).all() and b["loss_mask"].sum() > 0
    assert b["inputs"].max() < 16
    perfect = task.score(b["targets"], b)["accuracy"]
    wrong = task.score((b["targets"] + 1) % 16, b)["accuracy"]
    assert perfect == 1.0 and wrong == 0.0
    with pytest.raises(ValueError, match=r"^data\.seq_len: mad:in_context_recall rows hold 127"):
        build_task(DataConfig(task="mad:in_context_recall", seq_len=32))
    with pytest.raises(ValueError, match=r"^data\.task_options: "):
        build_task(DataConfig(task="mad:in_context_recall", task_options={"bogus": 1}))


def test_task_tokenizer_and_record():
    cfg = _parity()
    tok = pipeline.prepare_data(cfg).tokenizer
    assert isinstance(tok, TaskTokenizer) and tok.bos_id is None and tok.eos_id is None
    assert tok.vocab_size == FormalVocab().size and (tok.token_bytes == 1).all()
    assert tok.encode("1 10 2") == [1, 10, 2] and tok.decode(np.asarray([1, 10, 2])) == "1 10 2"
    with pytest.raises(ValueError, match="text: '17' is not a token id"):
        tok.encode("1 17")
    assert tokenizer_payload(tok) == ("task", None)
    other = TaskTokenizer(TASK, tok.vocab_size, {"train_lengths": [1, 8]})
    assert other.fingerprint != tok.fingerprint
    spec = data_spec(cfg, tok, task_record(cfg))
    assert (
        spec["corpus"]["sha256"]
        != task_record(DataConfig(**{**cfg.__dict__, "task": "formal:dyck1"}))["sha256"]
    )
    with pytest.raises(ValueError, match="data.task: the saved tokenizer"):
        pipeline.prepare_data(cfg, tokenizer=other)
    with pytest.raises(ValueError, match=r"^data\.task: .*\(no epochs\)$"):
        pipeline.steps_per_epoch(cfg, tok, None)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"task": "formal"}, r"^data\.task: expected '' \(a text corpus\)"),
        ({"task_options": {"train_lengths": [1, 4]}}, r"^data\.task_options: only with data\.task"),
        ({"task": TASK, "prepared_dir": "/x"}, r"^data\.prepared_dir: a generated task"),
        ({"task": TASK, "tokenizer": "sentencepiece", "vocab_size": 400}, r"^data\.tokenizer: "),
        (
            {"task": TASK, "task_options": {"train_lengths": [1.5, 2]}},
            r"^data\.task_options\.train",
        ),
        ({"task": TASK, "task_options": {"a-b": 1}}, r"^data\.task_options: keys must be"),
    ],
)
def test_data_config_refuses_impossible_task_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**kw)


def test_unregistered_family_names_data_task(monkeypatch):
    monkeypatch.delitem(TASK_FAMILIES, "formal")
    with pytest.raises(
        ValueError, match=r"^data\.task: unknown task family 'formal'; registered: mad$"
    ):
        build_task(_parity())


def test_eval_reports_the_task_accuracy_and_refuses_text_suites(run, capsys):
    workdir = run["workdir"]
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(workdir)]) == 0
    report = json.loads((workdir / "eval_report.json").read_text())
    assert report["suites"] == ["validation"] and report["task"] == TASK
    assert 0.0 <= report["validation"]["accuracy"] <= 1.0
    assert "niah" not in report and "bits_per_byte" not in report["validation"]
    assert f"Generated task `{TASK}`" in (workdir / "eval_report.md").read_text()
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(workdir), "--suite", "validation,niah"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the "restored step" note
    assert err.startswith("error: --suite: niah read text; this run trained on the generated task")


def test_a_task_model_may_have_only_the_tasks_ids(tmp_path):
    vocab = build_task(DataConfig(task=TASK, task_options={"train_lengths": [1, 12]})).vocab_size
    code, _, err = _train(tmp_path, tmp_path / "small", "--task", TASK, **{
        "model.vocab_size": vocab, "train.steps": 1, "train.checkpoint_every": 1,
    })  # fmt: skip
    assert code == EXIT_OK, err
