"""Class-incremental continual learning on the Austen novels
(nested_jax.experiments.class_incremental; the Hope paper's §9.1 protocol)."""

import json

import numpy as np
import pytest

from nested_jax.data.corpus import AUSTEN_NOVELS, load_austen_novels
from nested_jax.experiments.class_incremental import main
from nested_jax.experiments.class_incremental_data import (
    LABEL_BASE,
    VOCAB,
    ClassIncrementalSettings,
    chapter_texts,
    class_order,
    classification_batch,
    sample_passages,
    split_classes,
    task_classes,
)
from nested_jax.experiments.class_incremental_report import (
    accuracy_rows,
    average_accuracy,
    chance,
    forgetting,
    predict_seen,
    verdict,
)


@pytest.fixture(scope="module")
def novels():
    return load_austen_novels()  # the real corpus (installed by scripts/setup), never skipped


def test_chapter_texts_drop_front_matter_headings_and_layout():
    lines = ["EMMA", "", "By Jane Austen", "", "VOLUME I", "", "CHAPTER I", "", "Emma  Woodhouse,"]
    lines += [
        "handsome.",
        "",
        "VOLUME II",
        "",
        "Chapter 2",
        "",
        "Mr.\tKnightley",
        "CHAPTER III",
        "",
    ]
    assert chapter_texts(lines) == ["Emma Woodhouse, handsome.", "Mr. Knightley"]


def test_split_is_disjoint_complete_and_deterministic(novels):
    a = split_classes(novels, AUSTEN_NOVELS, 0.25, seed=0)
    for x, y in zip(a, split_classes(novels, AUSTEN_NOVELS, 0.25, seed=0), strict=True):
        assert (x.train_chapters, x.test_chapters) == (y.train_chapters, y.test_chapters)
        for u, v in zip(x.test, y.test, strict=True):
            np.testing.assert_array_equal(u, v)
    other = split_classes(novels, AUSTEN_NOVELS, 0.25, seed=1)
    assert any(x.test_chapters != y.test_chapters for x, y in zip(a, other, strict=True))
    for c in a:
        n = len(chapter_texts(novels[c.name]))
        assert not set(c.train_chapters) & set(c.test_chapters)
        assert sorted(c.train_chapters + c.test_chapters) == list(range(n))
        assert len(c.test_chapters) == max(1, round(0.25 * n))
        assert len(c.train) == len(c.train_chapters) and len(c.test) == len(c.test_chapters)


def test_passages_come_from_their_own_split_only(novels):
    split = split_classes(novels, AUSTEN_NOVELS[:3], 0.25, seed=3)
    for c in split:
        train = [bytes(x.astype(np.uint8)) for x in c.train]
        test = [bytes(x.astype(np.uint8)) for x in c.test]
        for chapters, inside, outside in ((c.test, test, train), (c.train, train, test)):
            for p in sample_passages(chapters, 6, 96, np.random.default_rng(0)):
                window = bytes(p.astype(np.uint8))
                assert any(window in t for t in inside)
                assert not any(window in t for t in outside)


def test_sampler_is_deterministic_under_a_seed(novels):
    c = split_classes(novels, AUSTEN_NOVELS[:1], 0.25, seed=0)[0]
    x = sample_passages(c.train, 5, 32, np.random.default_rng(7))
    assert x.shape == (5, 32) and x.dtype == np.int32
    np.testing.assert_array_equal(x, sample_passages(c.train, 5, 32, np.random.default_rng(7)))
    assert not np.array_equal(x, sample_passages(c.train, 5, 32, np.random.default_rng(8)))
    with pytest.raises(ValueError, match="passage_len"):
        sample_passages([np.arange(10)], 1, 11, np.random.default_rng(0))


def test_class_order_and_tasks():
    assert class_order(0, permute=False) == AUSTEN_NOVELS
    perm = class_order(0, permute=True)
    assert sorted(perm) == sorted(AUSTEN_NOVELS) and perm == class_order(0, permute=True)
    assert any(class_order(k, permute=True) != AUSTEN_NOVELS for k in range(3))
    assert task_classes(6, 2) == [[0, 1], [2, 3], [4, 5]]
    assert task_classes(6, 3) == [[0, 1, 2], [3, 4, 5]]


def test_classification_batch_scores_only_the_label():
    x = np.arange(12, dtype=np.int32).reshape(2, 6)
    b = classification_batch(x, np.array([0, 5]))
    np.testing.assert_array_equal(b["inputs"], x)
    np.testing.assert_array_equal(b["targets"][:, :-1], x[:, 1:])
    np.testing.assert_array_equal(b["targets"][:, -1], [LABEL_BASE, LABEL_BASE + 5])
    np.testing.assert_array_equal(b["loss_mask"], [[0, 0, 0, 0, 0, 1]] * 2)
    assert VOCAB == LABEL_BASE + 6 == 263
    with pytest.raises(ValueError, match="passages, classes"):
        classification_batch(x, np.array([0]))


def test_prediction_is_restricted_to_the_seen_classes():
    z = np.zeros((2, VOCAB))
    z[:, 65] = 100.0  # a byte logit: never a class
    z[0, LABEL_BASE + 5], z[0, LABEL_BASE + 1] = 10.0, 5.0  # unseen class 5 is the global max
    z[1, LABEL_BASE + 0], z[1, LABEL_BASE + 3] = 2.0, 9.0
    np.testing.assert_array_equal(predict_seen(z, 2), [1, 0])
    np.testing.assert_array_equal(predict_seen(z, 4), [1, 3])
    np.testing.assert_array_equal(predict_seen(z, 6), [5, 3])
    with pytest.raises(ValueError, match="last_logits"):
        predict_seen(z[:, :260], 4)


def _labelled_sets(counts):
    """Class c's passages are rows filled with c (unequal counts make the shares non-trivial)."""
    return [np.full((n, 4), c, np.int32) for c, n in enumerate(counts)]


def test_oracle_scores_one_and_a_constant_predictor_its_class_share():
    counts = [3, 5, 2, 6, 4, 4]
    sets = _labelled_sets(counts)

    def oracle(x):
        z = np.zeros((len(x), VOCAB))
        z[np.arange(len(x)), LABEL_BASE + x[:, 0]] = 1.0
        return z

    def constant(x):  # always class 0 (all-zero logits elsewhere)
        z = np.zeros((len(x), VOCAB))
        z[:, LABEL_BASE] = 1.0
        return z

    for i in range(3):
        a, a_task = accuracy_rows(oracle, sets, i, 2)
        np.testing.assert_array_equal(a[: i + 1], 1.0)
        np.testing.assert_array_equal(a_task[: i + 1], 1.0)
        assert np.isnan(a[i + 1 :]).all()
        a, a_task = accuracy_rows(constant, sets, i, 2)
        # class-incremental: class 0 is task 0's share, nothing of the later tasks
        np.testing.assert_allclose(a[: i + 1], [3 / 8, 0.0, 0.0][: i + 1])
        # pooled over all seen passages: exactly class 0's share of them
        seen = sum(counts[: 2 * (i + 1)])
        pooled = np.dot(a[: i + 1], [sum(counts[2 * j : 2 * j + 2]) for j in range(i + 1)]) / seen
        assert pooled == pytest.approx(3 / seen)
        # task-incremental: ties go to each task's first class, so its share of the task
        np.testing.assert_allclose(a_task[: i + 1], [3 / 8, 2 / 8, 4 / 8][: i + 1])
    with pytest.raises(ValueError, match="after"):
        accuracy_rows(oracle, sets, 3, 2)
    with pytest.raises(ValueError, match="per_task"):
        accuracy_rows(oracle, sets, 0, 4)


def test_average_accuracy_and_forgetting_of_known_matrices():
    nan = np.nan
    a = np.array([[0.9, nan, nan], [0.5, 0.8, nan], [0.2, 0.4, 0.7]])
    np.testing.assert_allclose(average_accuracy(a), [0.9, 0.65, (0.2 + 0.4 + 0.7) / 3])
    assert forgetting(a) == pytest.approx(((0.9 - 0.2) + (0.8 - 0.4)) / 2)
    # the max runs over every earlier row, not just the diagonal
    b = np.array([[0.6, nan, nan], [0.9, 0.7, nan], [0.3, 0.1, 0.5]])
    assert forgetting(b) == pytest.approx(((0.9 - 0.3) + (0.7 - 0.1)) / 2)
    # no forgetting (0) and backward transfer (negative)
    assert forgetting(np.array([[0.5, nan], [0.5, 0.9]])) == 0.0
    assert forgetting(np.array([[0.5, nan], [0.75, 0.9]])) == pytest.approx(-0.25)
    assert np.isnan(forgetting(np.array([[0.7]])))
    with pytest.raises(ValueError, match="A:"):
        forgetting(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="A:"):
        average_accuracy(np.array([[0.5, nan], [nan, 0.5]]))


def test_chance_is_one_over_the_seen_classes():
    np.testing.assert_allclose(chance(3, 2), [1 / 2, 1 / 4, 1 / 6])
    np.testing.assert_allclose(chance(2, 3), [1 / 3, 1 / 6])


def test_verdict_compares_each_arm_with_the_transformer():
    def arm(name, f, kept):
        return {"arm": name, "forgetting": {"mean": f}, "retained": {"mean": kept}}

    v = verdict([arm("transformer", 0.5, 0.1), arm("hope", 0.4, 0.2), arm("online", 0.3, 0.0)])
    assert v == {
        "hope": {"forgets_less": True, "retains_more": True},
        # lower F without keeping more: learned less, not forgot less
        "online": {"forgets_less": True, "retains_more": False},
    }
    assert verdict([arm("hope", 0.4, 0.2)]) == {}


@pytest.mark.parametrize(
    "field, value",
    [
        ("passage_len", 1),
        ("classes_per_task", 4),
        ("test_fraction", 1.0),
        ("cms_periods", (4, 1)),
        ("online_accumulate", "median"),
        ("steps_per_task", 0),
        ("online_lr", 0.0),
    ],
)
def test_settings_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ClassIncrementalSettings(**{field: value})


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--arms", "transformer", "gpt"], "arms"),
        (["--seeds", "0", "0"], "seeds"),
        (["--passage-len", "abc"], "--passage-len"),
        (["--test-fraction", "2"], "test_fraction"),
        (["--cms-periods", "4", "2"], "cms_periods"),
        (["--scale", "tpu"], "--scale"),
    ],
)
def test_bad_arguments_give_one_line_errors(tmp_path, capsys, argv, name):
    try:
        code = main(["--out", str(tmp_path), *argv])
    except SystemExit as exit_:  # argparse's own checks (types, choices)
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and name in err and err.startswith("error:")
    assert not (tmp_path / "class_incremental.json").exists()


def test_quick_end_to_end_writes_the_three_files(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--quick", "--seeds", "0"]
    assert main([*argv, "--arms", "transformer", "hope_attention_online"]) == 0
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"class_incremental.{ext}").stat().st_size > 0
    res = json.loads((tmp_path / "class_incremental.json").read_text())
    for key in ("settings", "arms", "seeds", "tasks", "chance", "runs", "summary", "verdict"):
        assert key in res
    assert res["tasks"] == [list(AUSTEN_NOVELS[i : i + 2]) for i in (0, 2, 4)]
    assert [r["arm"] for r in res["runs"]] == ["transformer", "hope_attention_online"]
    for r in res["runs"]:
        a = np.asarray(r["A"], float)  # NaN above the diagonal is written as null
        assert a.shape == (3, 3) and np.isnan(a[np.triu_indices(3, 1)]).all()
        assert ((a[np.tril_indices(3)] >= 0) & (a[np.tril_indices(3)] <= 1)).all()
        assert r["forgetting"] == pytest.approx(forgetting(a))
        assert r["final_avg_acc"] == pytest.approx(average_accuracy(a)[-1])
    # the FFN copied into every level of an independent CMS keeps the transformer's logits
    assert res["runs"][1]["conversion_max_abs"] < 1e-4
    assert res["verdict"].keys() == {"hope_attention_online"}
    for arm, r in zip(res["summary"], res["runs"], strict=True):
        a = np.asarray(r["A"], float)
        assert arm["retained"]["mean"] == pytest.approx(a[-1, :-1].mean())
        assert arm["just_learned"]["mean"] == pytest.approx(np.diag(a).mean())
    md = (tmp_path / "class_incremental.md").read_text()
    assert "| transformer |" in md and "| hope_attention_online |" in md and "| chance |" in md
    # a re-run with the same settings reuses the saved rows (no training)
    capsys.readouterr()
    assert main([*argv, "--arms", "transformer"]) == 0
    assert "reusing" in capsys.readouterr().out
