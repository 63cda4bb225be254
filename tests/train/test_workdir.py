"""nested_jax.train.workdir: which settings a resume may change, and config resolution.

(The resume-check tests moved here from tests/train/test_loop.py with the check itself, which
now compares every field, not only model / tokenizer / corpus.)
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nested_jax.train.checkpoint import describe_mismatch, leaf_table
from nested_jax.train.config import Config, ConfigError, config_to_dict
from nested_jax.train.optimizer import OPTIMIZERS, build_optimizer, with_fresh_hyperparams
from nested_jax.train.workdir import (
    SCHEDULE_FIELDS,
    ConfigChange,
    ResumeRefused,
    check_resume,
    config_changes,
    describe_change,
    record_config_changes,
    resolve_config,
)


def _with(cfg, section, **fields):
    return dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)}
    )


def test_resume_check_fills_fields_an_older_saved_config_lacks(tmp_path):
    cfg = _with(Config(), "model", name="titans_lmm")
    old = config_to_dict(cfg)
    del old["model"]["cms"]  # sections and fields added after the run was saved
    del old["model"]["titans"]["grad_horizon"]
    assert check_resume(old, cfg, tmp_path) == []  # the old run used the defaults: compatible

    old["model"]["titans"]["memory_layers"] = 3  # a real difference is still refused
    with pytest.raises(ResumeRefused, match=r"model\.titans\.memory_layers \(3 -> 2\)"):
        check_resume(old, cfg, tmp_path)


def test_a_hope_run_saved_before_the_bounded_step_keeps_its_math(tmp_path):
    # Saved before issue 17's changes: no grad_clip field (that run had no softclamp) and the
    # scan update form. The form is a compute knob (a notice); the softclamp would change the
    # math, so resuming with today's default is refused until the run asks for grad_clip 0.
    cfg = _with(Config(), "model", name="hope")
    old = config_to_dict(cfg)
    del old["model"]["hope"]["grad_clip"]
    old["model"]["hope"]["chunk_updates"] = "scan"
    with pytest.raises(ResumeRefused, match=r"model\.hope\.grad_clip \(0\.0 -> 4\.0\)"):
        check_resume(old, cfg, tmp_path)
    unbounded = _with(cfg, "model", hope=dataclasses.replace(cfg.model.hope, grad_clip=0.0))
    changes = check_resume(old, unbounded, tmp_path)
    assert [c.field for c in changes] == ["model.hope.chunk_updates"]


@pytest.mark.parametrize(
    ("name", "changed", "refused"),
    [
        ("gdn", ("hope", "remat"), False),  # GDN does not read model.hope
        ("gdn", ("titans", "memory_layers"), False),
        ("gdn", ("proteus", "blocks"), True),  # ... but does read model.proteus
        ("hope", ("cms", "hidden"), True),  # hope's FFN resolves to CMS
        ("transformer", ("cms", "hidden"), False),  # SwiGLU FFN: model.cms is inert
        ("titans_lmm", ("hola", "window"), False),
    ],
)
def test_resume_check_ignores_option_sections_the_model_does_not_read(
    tmp_path, name, changed, refused
):
    cfg = _with(Config(), "model", name=name)
    old = config_to_dict(cfg)
    section, field = changed
    assert field in old["model"][section]
    old["model"][section][field] = 7
    if refused:
        with pytest.raises(ResumeRefused, match=rf"model\.{section}\.{field} \(7 -> "):
            check_resume(old, cfg, tmp_path)
    else:
        assert check_resume(old, cfg, tmp_path) == []


# One changed field per config section: (section, field, new value, refused without / with
# --reset-optimizer).
SECTION_CHANGES = [
    ("model", "d_model", 96, (True, True)),
    ("data", "seq_len", 64, (True, True)),
    ("data", "tokenizer", "sentencepiece", (True, True)),
    ("optimizer", "grad_clip", 0.0, (True, False)),
    ("optimizer", "lr", 1e-4, (False, False)),  # the schedule: the saved moments are kept
    ("optimizer", "warmup_steps", 7, (False, False)),
    ("optimizer", "b1", 0.8, (True, False)),  # the saved moments were averaged with the old b1
    ("mesh", "data", 2, (False, False)),
    ("train", "steps", 5000, (False, False)),
    ("train", "eval_every", 7, (False, False)),
    ("train", "seed", 3, (True, True)),
    ("eval", "niah_per_cell", 9, (False, False)),
]


@pytest.mark.parametrize(("section", "field", "value", "refused"), SECTION_CHANGES)
def test_a_changed_setting_of_every_section(tmp_path, section, field, value, refused):
    saved = config_to_dict(Config())
    extra = {"vocab_size": 400} if field == "tokenizer" else {}
    new = _with(Config(), section, **{field: value}, **extra)
    for reset, refuse in zip((False, True), refused, strict=True):
        if refuse:
            with pytest.raises(ResumeRefused, match=rf"{section}\.{field} \(") as err:
                check_resume(saved, new, tmp_path, reset_optimizer=reset)
            assert "\n" not in str(err.value) and "nothing was changed" in str(err.value)
            hint = "--reset-optimizer" in str(err.value)
            assert hint == (section == "optimizer")  # offered only where it helps
        else:
            changes = check_resume(saved, new, tmp_path, reset_optimizer=reset)
            assert f"{section}.{field}" in [c.field for c in changes]


SCHEDULE_VALUES = {"lr": 1e-4, "warmup_steps": 7, "decay": "linear", "min_lr_ratio": 0.5}


@pytest.mark.parametrize("cms", [False, True], ids=["plain", "cms_pretrain"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_schedule_fields_leave_every_optimizer_state_unchanged(name, cms):
    # Why SCHEDULE_FIELDS may change on resume: the restored state is the one the new config
    # builds, array for array (the CMS pretrain wrapper included).
    assert {f"optimizer.{k}" for k in SCHEDULE_VALUES} == set(SCHEDULE_FIELDS)
    model = _with(
        Config(), "model", name="hope", cms=dataclasses.replace(Config().model.cms, mode="pretrain")
    )
    model = model.model if cms else None
    params = {"blocks": {"mlp": {"levels": [{"w": jnp.ones((4, 6))}]}}, "norm": jnp.ones(4)}
    base = dataclasses.replace(Config().optimizer, name=name)
    tx, _ = build_optimizer(base, 100, model=model)
    want = tx.init(params)
    for field, value in SCHEDULE_VALUES.items():
        tx, _ = build_optimizer(dataclasses.replace(base, **{field: value}), 100, model=model)
        got = tx.init(params)
        assert jax.tree.structure(got) == jax.tree.structure(want), field
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def test_with_fresh_hyperparams_replaces_only_the_injected_values():
    params = {"w": jnp.ones(3)}
    tx = optax.chain(optax.clip(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
    saved = tx.update({"w": jnp.full(3, 0.5)}, tx.init(params), params)[1]
    fresh = optax.chain(
        optax.clip(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=0.02)
    ).init(params)
    out = with_fresh_hyperparams(saved, fresh)
    assert float(out[1].hyperparams["learning_rate"]) == pytest.approx(0.02)
    assert int(out[1].count) == 1
    np.testing.assert_array_equal(out[1].inner_state[0].mu["w"], saved[1].inner_state[0].mu["w"])
    assert float(out[1].inner_state[0].mu["w"][0]) != 0.0  # a real moment, kept
    plain = optax.adam(0.1)  # no hyper-parameters in the state: returned as restored
    state = plain.update(params, plain.init(params), params)[1]
    kept = with_fresh_hyperparams(state, plain.init(params))
    assert all(a is b for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(state), strict=True))


def test_a_schedule_change_notice_shows_the_rate_before_and_after():
    cfg = _with(_with(Config(), "optimizer", lr=1e-3, decay="constant"), "train", steps=500)
    change = ConfigChange("optimizer.lr", 3e-3, 1e-3)
    text = describe_change(change, cfg, 200, reset_optimizer=False)
    assert text == (
        "notice: optimizer.lr (0.003 -> 0.001) applied on resume; the optimizer state is kept "
        "(lr at step 200: 0.003 -> 0.001)"
    )
    reset = describe_change(change, cfg, 200, reset_optimizer=True)
    assert reset.endswith("applied on resume with a fresh optimizer state")
    steps = describe_change(ConfigChange("train.steps", 1000, 500), cfg, 200, False)
    assert steps.endswith("schedule now ends at step 500 (lr at step 200: 0.001 -> 0.001)")


def test_config_changes_compare_values_not_container_types():
    saved = json.loads(json.dumps(config_to_dict(Config())))  # tuples became lists in JSON
    assert config_changes(saved, Config()) == []


def test_config_history_records_each_applied_change(tmp_path):
    saved = config_to_dict(Config())
    new = _with(Config(), "train", steps=5000)
    record_config_changes(tmp_path, 300, check_resume(saved, new, tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    assert lines == [{"resumed_at_step": 300, "field": "train.steps", "old": 1000, "new": 5000}]


def test_resolve_config_refuses_a_workdir_without_a_run(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist: give --config FILE"):
        resolve_config(tmp_path / "typo", [], [])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no run: give --config FILE"):
        resolve_config(tmp_path / "empty", [], ["train.steps=3"])


def test_resolve_config_continues_the_saved_config(tmp_path):
    from nested_jax.train.config import save_config

    save_config(_with(Config(), "train", steps=77), tmp_path)
    config, where = resolve_config(tmp_path, [], ["eval.niah_per_cell=1"])
    assert config.train.steps == 77 and config.eval.niah_per_cell == 1
    assert "config.json" in where


def test_describe_mismatch_names_missing_extra_and_reshaped_arrays():
    saved = leaf_table({"params": {"w": jnp.zeros((3, 4))}, "opt": {"mu": jnp.zeros(2)}})
    wanted = leaf_table({"params": {"w": jnp.zeros((3, 5))}, "opt2": {"mu": jnp.zeros(2)}})
    text = describe_mismatch(saved, wanted)
    assert "lacks: 1 (e.g. opt2.mu)" in text
    assert "does not build: 1 (e.g. opt.mu)" in text
    assert "params.w: (3, 4) float32 saved, (3, 5) float32 now" in text
    assert describe_mismatch(saved, saved) is None
    # a partial restore (--reset-optimizer) ignores what the checkpoint has beyond the target
    assert (
        describe_mismatch(saved, leaf_table({"params": {"w": jnp.zeros((3, 4))}}), partial=True)
        is None
    )
