"""`python -m nested_jax.experiments.compare`: fair-recipe check and the one-table report (the
training itself is the loop's, tested in tests/train)."""

import pytest

from nested_jax.experiments.compare import (
    build_parser,
    check_same_recipe,
    markdown_table,
    run_compare,
)
from nested_jax.train.config import load_config


def test_configs_must_share_data_steps_and_seed():
    a = load_config([], ["model.name=hola"])
    check_same_recipe({"a": a, "b": load_config([], ["model.name=gdn"])})
    for override, field in (
        ("data.seq_len=512", "data"),
        ("train.steps=7", "train.steps"),
        ("train.seed=3", "train.seed"),
    ):
        with pytest.raises(ValueError, match=f"b differs from a in {field}"):
            check_same_recipe({"a": a, "b": load_config([], [override])})


def test_markdown_table_has_one_row_per_config_and_a_column_per_length():
    row = {
        "config": "tiny_hola",
        "mixer": "hola (w=32, C=32, eviction=beta_e)",
        "params": 470_000,
        "step": 10,
        "val_loss": 1.5,
        "val_bits_per_byte": 2.25,
        "niah": {"1": {"accuracy": 0.5, "examples": 4}, "4": {"accuracy": 0.25, "examples": 4}},
        "tokens_per_s": 1000.0,
    }
    md = markdown_table([row, dict(row, config="tiny_gdn")], [1, 4], 128)
    lines = md.strip().splitlines()
    assert len(lines) == 4
    assert "NIAH 1× (128)" in lines[0] and "NIAH 4× (512)" in lines[0]
    assert "| tiny_hola |" in lines[2] and "0.25 (n=4)" in lines[2] and "2.2500" in lines[2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="niah_multipliers"):
        run_compare(["x.yaml"], "/tmp/unused", [0])
    args = build_parser().parse_args(["--configs", "a.yaml", "--workdir", "w"])
    assert args.niah_multipliers == [1, 4, 8] and args.overrides == []
