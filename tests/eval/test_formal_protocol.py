"""The next-character protocol (Bhattamishra et al. 2020; Irie et al. 2023): every language's
strings are members, the labels are the legal-continuation classes (checked against a brute-force
membership oracle where one exists), an oracle scores 1, a constant predictor scores ~0, a single
wrong prediction rejects the string, splits are disjoint and seeded."""

import numpy as np
import pytest

from nested_jax.eval.formal_languages import FormalVocab
from nested_jax.eval.formal_protocol import (
    PROTOCOL_TASKS,
    make_protocol_batch,
    protocol_accuracy,
    protocol_correct,
    protocol_strings,
)

NAMES = sorted(PROTOCOL_TASKS)
V = FormalVocab()


def _member(name: str, s: str) -> bool:
    if name == "parity":
        return set(s) <= set("01") and s.count("1") % 2 == 0
    if name == "aa_star":
        return set(s) <= {"a"} and len(s) % 2 == 0
    if name == "abab_star":
        return len(s) % 4 == 0 and s == "ab" * (len(s) // 2)
    if name in ("anbn", "anbncn"):
        k = 2 if name == "anbn" else 3
        n = len(s) // k
        return len(s) == k * n and s == "".join(c * n for c in "abc"[:k])
    depth = {"(": 0, "[": 0}  # shuffle2: each bracket type balanced on its own
    for c in s:
        key = "(" if c in "()" else "["
        depth[key] += 1 if c in "([" else -1
        if depth[key] < 0:
            return False
    return depth == {"(": 0, "[": 0}


def test_the_protocol_languages():
    assert set(NAMES) == {"parity", "aa_star", "abab_star", "anbn", "anbncn", "shuffle2"}


@pytest.mark.parametrize("name", NAMES)
def test_strings_are_members_in_their_bins(name):
    task = PROTOCOL_TASKS[name]
    for window in task.bins:
        for s in protocol_strings(name, 40, window, 0):
            assert _member(name, s), s
            size = len(s) // len(task.alphabet) if task.window == "n" else len(s)
            assert window[0] <= size <= window[1]
            assert len(task.labels(s)) == len(s)


@pytest.mark.parametrize("name", ["parity", "aa_star", "abab_star"])
def test_regular_labels_are_prefix_membership(name):
    task = PROTOCOL_TASKS[name]
    for s in protocol_strings(name, 20, task.bins[0], 1):
        assert task.labels(s) == [int(_member(name, s[: t + 1])) for t in range(len(s))]


def test_counter_and_shuffle_labels_by_hand():
    lab = PROTOCOL_TASKS["anbncn"].labels
    assert lab("aabbcc") == [0, 0, 1, 2, 2, 3]  # {a,b} {a,b} {b} {c} {c} {end}
    assert PROTOCOL_TASKS["anbn"].labels("aaabbb") == [0, 0, 0, 1, 1, 3]
    assert PROTOCOL_TASKS["shuffle2"].labels("([])[]") == [2, 3, 2, 0, 1, 0]


@pytest.mark.parametrize("name", NAMES)
def test_oracle_scores_one_and_one_wrong_prediction_rejects(name):
    task = PROTOCOL_TASKS[name]
    strings = protocol_strings(name, 16, task.bins[1], 2)
    batch = make_protocol_batch(name, strings, task.max_length(task.bins[1]) + 1)
    assert protocol_accuracy(batch["targets"], batch) == 1.0
    ids = batch["targets"].copy()
    rng = np.random.default_rng(0)
    rows = np.arange(len(strings))
    pos = 1 + rng.integers(0, [len(s) for s in strings])  # one scored position per row
    cls = ids[rows, pos] - V.answer(0)
    ids[rows, pos] = V.answer(0) + (cls + 1) % task.num_classes  # a wrong class there
    assert not protocol_correct(ids, batch).any()


@pytest.mark.parametrize("name", NAMES)
def test_constant_predictor_scores_near_zero(name):
    task = PROTOCOL_TASKS[name]
    for window, bound in zip(task.bins, (0.05, 0.01), strict=True):
        strings = protocol_strings(name, 200, window, 3)
        batch = make_protocol_batch(name, strings, task.max_length(window) + 1)
        for k in range(task.num_classes):
            const = np.full_like(batch["targets"], V.answer(k))
            assert protocol_accuracy(const, batch) <= bound, (name, k)


@pytest.mark.parametrize("name", ["parity", "shuffle2"])
def test_splits_are_distinct_disjoint_and_seeded(name):
    window = PROTOCOL_TASKS[name].bins[0]
    test = protocol_strings(name, 300, window, 4)
    assert len(set(test)) == 300
    train = protocol_strings(name, 500, window, 5, exclude=set(test))
    assert not set(train) & set(test)
    assert protocol_strings(name, 300, window, 4) == test
    assert protocol_strings(name, 300, window, 6) != test


def test_bad_arguments():
    with pytest.raises(ValueError, match="^name:"):
        protocol_strings("dyck9", 3, (2, 4), 0)
    with pytest.raises(ValueError, match="^count:"):
        protocol_strings("parity", -1, (2, 4), 0)
    with pytest.raises(ValueError, match="^count:"):
        protocol_strings("parity", 50, (2, 3), 0)  # only 4 even-parity strings of length 2..3
    with pytest.raises(ValueError, match="^length_range:"):
        protocol_strings("parity", 3, (0, 4), 0)
    with pytest.raises(ValueError, match="^seq_len:"):
        make_protocol_batch("parity", ["0110"], 4)
