"""`python -m nested_jax.experiments.proteus_table`: context_len filling, the Markdown
table (training itself is the loop's; the end-to-end run is marked slow)."""

from pathlib import Path

import pytest

from nested_jax.experiments import proteus_table

REPO = Path(__file__).resolve().parents[2]


def test_configs_exist_and_context_len_is_the_training_length(tmp_path):
    paths = [REPO / p for p in proteus_table.DEFAULT_CONFIGS]
    configs, notes = proteus_table.load_configs(paths, [])
    assert notes == []
    assert [c.model.proteus.blocks for c in configs.values()] == [1, 16, 1, 16]
    for c in configs.values():
        if c.model.proteus.blocks > 1:
            assert c.model.proteus.context_len == c.data.seq_len
    configs, notes = proteus_table.load_configs(paths[:2], ["data.seq_len=256"])
    assert configs["tiny_gdn_proteus"].model.proteus.context_len == 256
    assert len(notes) == 1 and "context_len 128 -> 256" in notes[0]
    assert proteus_table.mqar_spec(configs["tiny_gdn_proteus"].model) == "gdn+proteus16"
    assert proteus_table.mqar_spec(configs["tiny_gdn"].model) == "gdn"


def test_markdown_table_columns_per_multiplier():
    row = {
        "config": "tiny_gdn_proteus",
        "mixer": "gdn",
        "blocks": 16,
        "params": 470_000,
        "val_by_length": {"1": {"val_loss": 1.5}, "4": {"val_loss": 1.75}},
        "niah": {"1": {"accuracy": 0.5, "examples": 4}, "4": {"accuracy": 0.25, "examples": 4}},
        "mqar": {"by_length": {"1": {"accuracy": 0.9}, "4": {"accuracy": 0.125}}},
        "tokens_per_s": 1000.0,
    }
    md = proteus_table.markdown_table([row, dict(row, mqar=None)], [1, 4], 128, 64)
    lines = md.strip().splitlines()
    assert len(lines) == 4
    assert "val loss 4× (512)" in lines[0] and "MQAR acc 4× (256)" in lines[0]
    assert "| 1.5000 | 1.7500 | 0.50 (n=4) | 0.25 (n=4) | 0.9000 | 0.1250 | 1000 |" in lines[2]
    assert "| — | — |" in lines[3]
    assert len(lines[1].split("|")) == len(lines[0].split("|"))


def test_bad_arguments(capsys):
    with pytest.raises(ValueError, match="multipliers"):
        proteus_table.run_table(["x.yaml"], "/tmp/unused", [0])
    assert proteus_table.main(["--out", "/tmp/unused", "--configs", "/no/such.yaml"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.slow  # trains two tiny models on Austen for 2 steps (~3 min on the shared CPUs)
def test_one_command_end_to_end(tmp_path):
    argv = ["--out", str(tmp_path), "--configs"]
    argv += [str(REPO / p) for p in proteus_table.DEFAULT_CONFIGS[:2]]
    for o in ("train.steps=2", "data.batch_size=8", "eval.eval_batches=1", "eval.niah_per_cell=1",
              "eval.niah_depths=[0.5]", "train.eval_every=0"):  # fmt: skip
        argv += ["--set", o]
    argv += ["--mqar-steps", "2", "--mqar-seq-len", "32", "--mqar-num-kv-pairs", "4"]
    argv += ["--mqar-vocab", "32", "--mqar-d-model", "32", "--mqar-batch-size", "4"]
    argv += ["--mqar-eval-batches", "1"]
    assert proteus_table.main(argv) == 0
    md = (tmp_path / "proteus_table.md").read_text()
    assert "| tiny_gdn | gdn | 1 |" in md and "| tiny_gdn_proteus | gdn | 16 |" in md
    assert "MQAR acc 4× (128)" in md and "val loss 4× (512)" in md


def test_reused_runs_report_the_logged_throughput(tmp_path):
    assert proteus_table.train_tokens_per_s({"tokens_per_s": 5.0}, tmp_path) == 5.0
    (tmp_path / "metrics.jsonl").write_text(
        '{"kind": "train", "tokens_per_s": 7.0}\n{"kind": "train", "tokens_per_s": 9.0}\n'
        '{"kind": "eval", "val_loss": 1.0}\n'
    )
    assert proteus_table.train_tokens_per_s({"tokens_per_s": float("nan")}, tmp_path) == 9.0
