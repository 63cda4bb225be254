"""Formal-language recognition batches: layout, determinism, membership checked by independent
recognisers, near-miss negatives, oracle / constant scores, bad arguments, one training step."""

from __future__ import annotations

import functools
import re
from collections import Counter, defaultdict

import numpy as np
import pytest

from nested_jax.eval.formal_languages import (
    FORMAL_TASKS,
    FormalVocab,
    dyck_shape,
    formal_accuracy,
    formal_chance,
    formal_correct,
    make_formal_batch,
    string_lengths,
)

TASKS = sorted(FORMAL_TASKS)
SHORT, LONG = (4, 40), (160, 320)  # train-like lengths and 4x-8x longer ones


def _is_reduced_to_empty(s: str, pairs: tuple[str, ...]) -> bool:
    """Dyck membership by deleting adjacent matched pairs until nothing changes."""
    while any(p in s for p in pairs):
        for p in pairs:
            s = s.replace(p, "")
    return s == ""


def _recognise(name: str, s: str) -> int:
    """The class of ``s``, written independently of the generators (regexes and counters)."""
    if name == "parity":
        return s.count("1") % 2
    if name == "modular_counting":
        return s.count("1") % 5
    if name == "aa_star":
        return int(re.fullmatch(r"(aa)+", s) is not None)
    if name == "abab_star":
        return int(re.fullmatch(r"(abab)+", s) is not None)
    if name == "anbn":
        m = re.fullmatch(r"(a*)(b*)", s)
        return int(m is not None and len(m[1]) == len(m[2]) > 0)
    if name == "anbncn":
        m = re.fullmatch(r"(a*)(b*)(c*)", s)
        return int(m is not None and len(m[1]) == len(m[2]) == len(m[3]) > 0)
    if name == "dyck1":
        return int(_is_reduced_to_empty(s, ("()",)) and s != "")
    if name == "dyck2":
        return int(_is_reduced_to_empty(s, ("()", "[]")) and s != "")
    raise AssertionError(name)


def _examples(batch: dict, vocab: FormalVocab) -> list[tuple[str, int]]:
    """``(string, class)`` per row, read back from the token ids."""
    out = []
    for x, y, n in zip(batch["inputs"], batch["targets"], string_lengths(batch), strict=True):
        out.append((vocab.decode(x[1 : n + 1]), int(y[n + 1]) - vocab.answer(0)))
    return out


@functools.cache
def _big(name: str, rows: int = 2000) -> tuple[dict, list[tuple[str, int]]]:
    batch = make_formal_batch(name, rows, SHORT, 123)
    return batch, _examples(batch, FormalVocab())


@pytest.mark.parametrize("name", TASKS)
def test_layout_and_membership_at_train_and_test_lengths(name):
    vocab = FormalVocab(offset=7)  # a shifted layout exercises every id computation
    task = FORMAL_TASKS[name]
    for length_range, rows in ((SHORT, 300), (LONG, 40)):
        batch = make_formal_batch(name, rows, length_range, 0, vocab=vocab)
        x, y, m = batch["inputs"], batch["targets"], batch["loss_mask"]
        t = length_range[1] + 2
        assert x.shape == y.shape == m.shape == (rows, t)
        assert x.dtype == y.dtype == np.int32 and m.dtype == np.float32
        assert (m.sum(1) == 1).all() and set(np.unique(m)) <= {0.0, 1.0}
        lengths = string_lengths(batch)
        assert (lengths >= length_range[0]).all() and (lengths <= length_range[1]).all()
        for r, n in enumerate(lengths):
            assert x[r, 0] == vocab.bos and x[r, n + 1] == vocab.query
            assert (x[r, n + 2 :] == vocab.pad).all()
            assert (np.delete(y[r], n + 1) == vocab.pad).all()
        for s, label in _examples(batch, vocab):
            assert set(s) <= set(task.alphabet)
            assert 0 <= label < task.num_classes
            assert _recognise(name, s) == label, (s, label)


@pytest.mark.parametrize("name", TASKS)
def test_deterministic_under_a_seed(name):
    a = make_formal_batch(name, 32, SHORT, 5)
    b = make_formal_batch(name, 32, SHORT, np.random.default_rng(5))
    c = make_formal_batch(name, 32, SHORT, 6)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["inputs"], c["inputs"])


@pytest.mark.parametrize("name", TASKS)
def test_oracle_scores_one_and_a_wrong_answer_zero(name):
    batch, _ = _big(name)
    b, t = batch["targets"].shape
    v = FormalVocab().size
    oracle = np.zeros((b, t, v), np.float32)
    np.put_along_axis(oracle, batch["targets"][..., None], 1.0, axis=-1)
    assert formal_accuracy(oracle, batch) == 1.0
    assert formal_accuracy(batch["targets"], batch) == 1.0  # argmax ids work too
    # a predictor right everywhere except at the answer position scores 0
    wrong = batch["targets"].copy()
    pos = batch["loss_mask"].argmax(-1)
    wrong[np.arange(b), pos] = FormalVocab().pad
    assert formal_accuracy(wrong, batch) == 0.0
    assert not formal_correct(wrong, batch).any()


CHANCE_TOL = 0.05  # 2000 rows: the std of a constant's accuracy is <= 0.011, so 0.05 is > 4 sigma


@pytest.mark.parametrize("name", TASKS)
def test_constant_answers_score_chance(name):
    batch, examples = _big(name)
    chance = formal_chance(name)
    assert chance == 1.0 / FORMAL_TASKS[name].num_classes
    for k in range(FORMAL_TASKS[name].num_classes):
        constant = np.full_like(batch["targets"], FormalVocab().answer(k))
        acc = formal_accuracy(constant, batch)
        assert abs(acc - chance) <= CHANCE_TOL and acc < 0.75, (k, acc)
    # labels are balanced, so the majority class is no better than chance either
    majority = Counter(label for _, label in examples).most_common(1)[0][1] / len(examples)
    assert majority <= chance + CHANCE_TOL


def _best_from_feature(examples, feature) -> float:
    """Accuracy of the best classifier that sees only ``feature(string)`` (majority per value)."""
    groups = defaultdict(Counter)
    for s, label in examples:
        groups[feature(s)][label] += 1
    return sum(c.most_common(1)[0][1] for c in groups.values()) / len(examples)


NEAR_MISS_TOL = 0.85  # by construction a length- or count-only rule reaches at most ~0.75


@pytest.mark.parametrize("name", ["abab_star", "anbn", "anbncn", "dyck1", "dyck2"])
def test_negatives_are_near_misses(name):
    _, examples = _big(name)
    assert _best_from_feature(examples, len) < NEAR_MISS_TOL
    counts = lambda s: tuple(s.count(c) for c in FORMAL_TASKS[name].alphabet)
    assert _best_from_feature(examples, counts) < NEAR_MISS_TOL
    negatives = [s for s, label in examples if label == 0]
    positives = [s for s, label in examples if label == 1]
    assert len(negatives) > 0.4 * len(examples) and len(positives) > 0.4 * len(examples)
    if name in ("anbn", "anbncn", "dyck1", "dyck2"):
        # both classes have the same lengths modulo the language's period
        period = 3 if name == "anbncn" else 2
        assert {len(s) % period for s in negatives} == {len(s) % period for s in positives}


def test_aa_star_is_length_defined_but_interleaved():
    _, examples = _big("aa_star")
    pos = {len(s) for s, label in examples if label}
    neg = {len(s) for s, label in examples if not label}
    assert all(n % 2 == 0 for n in pos) and all(n % 2 for n in neg)
    assert min(neg) < max(pos) and min(pos) < max(neg)  # no threshold on length separates them


def test_dyck_shape_is_balanced_and_varied():
    rng = np.random.default_rng(0)
    words = {tuple(dyck_shape(rng, 8)) for _ in range(400)}
    assert len(words) == 14  # all Catalan(4) words of length 8 appear
    for w in words:
        depth = np.cumsum(np.where(w, 1, -1))
        assert depth.min() >= 0 and depth[-1] == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="name"):
        make_formal_batch("palindromes", 4, SHORT, 0)
    with pytest.raises(ValueError, match="batch_size"):
        make_formal_batch("parity", 0, SHORT, 0)
    for bad in [(5, 3), (0, 4), (2,), "4-8", (2.0, 8)]:
        with pytest.raises(ValueError, match="length_range"):
            make_formal_batch("parity", 4, bad, 0)
    with pytest.raises(ValueError, match="length_range"):
        make_formal_batch("anbn", 4, (3, 3), 0)  # no even length
    with pytest.raises(ValueError, match="length_range"):
        make_formal_batch("anbncn", 4, (4, 5), 0)  # no multiple of 3
    with pytest.raises(ValueError, match="length_range"):
        make_formal_batch("aa_star", 4, (4, 4), 0)  # no odd length for negatives
    with pytest.raises(ValueError, match="length_range"):
        make_formal_batch("modular_counting", 4, (2, 10), 0)  # class 4 needs 4 symbols
    with pytest.raises(ValueError, match="seq_len"):
        make_formal_batch("parity", 4, SHORT, 0, seq_len=SHORT[1] + 1)
    with pytest.raises(ValueError, match="vocab"):
        make_formal_batch("modular_counting", 4, SHORT, 0, vocab=FormalVocab(num_answers=2))
    with pytest.raises(ValueError, match="vocab"):
        FormalVocab(num_answers=1)
    with pytest.raises(ValueError, match="rng_or_seed"):
        make_formal_batch("parity", 4, SHORT, "seed")
    with pytest.raises(ValueError, match="name"):
        formal_chance("palindromes")
    batch = make_formal_batch("parity", 4, SHORT, 0)
    with pytest.raises(ValueError, match="logits"):
        formal_accuracy(np.zeros((4, 3, 17)), batch)
    with pytest.raises(ValueError, match="loss_mask"):
        formal_accuracy(batch["targets"], {**batch, "loss_mask": np.zeros_like(batch["loss_mask"])})


@pytest.mark.slow  # ~15-20 s on 2 CPU cores, nearly all of it the XLA compile of the step
def test_one_training_step_on_a_formal_batch():
    """The MQAR experiment's training step (unchanged) trains on formal batches."""
    import jax

    from nested_jax.experiments._training import build_training
    from nested_jax.experiments.mqar import MqarSettings

    vocab = FormalVocab()
    batch = make_formal_batch("dyck2", 4, (4, 14), 0, vocab=vocab)
    s = MqarSettings(
        steps=3,
        seq_len=batch["inputs"].shape[1],
        num_kv_pairs=1,
        vocab=vocab.size,
        batch_size=4,
        d_model=16,
        n_layers=1,
        n_heads=2,
        warmup_steps=1,
    )
    _, _, rest, step, state, _ = build_training("transformer", s, s.d_model)
    losses = []
    for _ in range(3):  # the first step has lr 0 (warmup), the second moves the parameters
        state, metrics = step(state, rest, batch)
        losses.append(float(metrics["loss"]))
    assert float(jax.device_get(metrics["tokens"])) == 4.0  # one answer per row is trained
    assert all(np.isfinite(losses)) and losses[2] < losses[0]
