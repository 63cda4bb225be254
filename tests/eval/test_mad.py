"""MAD synthetic tasks: shapes at MAD's baseline sizes, targets re-derived independently from the
inputs, determinism, oracle / constant scores, bad arguments."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest

from nested_jax.eval.mad import (
    MAD_TASKS,
    mad_accuracy,
    mad_chance,
    make_mad_batch,
    memorization_kv_map,
)

TASKS = sorted(MAD_TASKS)
# T at MAD's baseline sizes (recall tasks are next-token shifted: seq_len - 1; compression's LM form
# holds the sequence and its reconstruction: 2 (seq_len - 1))
BASELINE_T = {
    "in_context_recall": 127,
    "noisy_in_context_recall": 127,
    "fuzzy_in_context_recall": 128,
    "selective_copying": 256,
    "compression": 62,
    "memorization": 32,
}
CHANCE = {
    "in_context_recall": 1 / 8,
    "noisy_in_context_recall": 1 / 8,
    "fuzzy_in_context_recall": 1 / 8,
    "selective_copying": 1 / 14,
    "compression": 1 / 15,
    "memorization": 1 / 128,
}


@functools.cache
def _big(name: str, rows: int = 512) -> dict:
    return make_mad_batch(name, rows, 2024)


def _pairs_recall(batch: dict, n_ids: int) -> None:
    """Every scored key was shown before with the target value; every unscored key is new."""
    half = n_ids // 2
    for x, y, m in zip(batch["inputs"], batch["targets"], batch["loss_mask"], strict=True):
        stream = np.append(x, y[-1])
        assert m[-1] == 1  # the final probe is always scored
        seen: dict[int, int] = {}
        for i in range(0, stream.size, 2):
            k, v = int(stream[i]), int(stream[i + 1])
            if k >= n_ids:  # a noise pair: two noise ids, never scored
                assert v >= n_ids and m[i] == 0
                continue
            assert k < half <= v < n_ids
            if k in seen:
                assert m[i] == 1 and seen[k] == v and y[i] == v
            else:
                assert m[i] == 0
            seen[k] = v
        assert (m[1::2] == 0).all()  # only key positions (whose target is the value) are scored


def _check_fuzzy(batch: dict, vocab_size: int = 16) -> None:
    """Parse each row into key runs and value runs; scored tokens are values of repeated keys."""
    n = vocab_size - 1
    for x, y, m in zip(batch["inputs"], batch["targets"], batch["loss_mask"], strict=True):
        stream, scored = np.append(x[:1], y), np.append(0, m)
        start = int(np.argmax(stream != n))
        assert (stream[:start] == n).all() and (stream[start:] != n).all()
        runs, cur = [], [int(stream[start])]
        for tok in stream[start + 1 :].tolist():
            if (tok < n // 2) == (cur[-1] < n // 2):
                cur.append(tok)
            else:
                runs.append(cur)
                cur = [tok]
        runs.append(cur)
        assert len(runs) % 2 == 0 and runs[0][0] < n // 2  # key, value, key, value, ...
        seen, pos, expected = {}, start, np.zeros_like(scored)
        for key, value in zip(runs[0::2], runs[1::2], strict=True):
            assert len(set(key)) == len(key) <= 3 and len(set(value)) == len(value) <= 3
            pos += len(key)
            if tuple(key) in seen:
                assert seen[tuple(key)] == value
                expected[pos : pos + len(value)] = 1
            seen[tuple(key)] = value
            pos += len(value)
        assert np.array_equal(scored, expected)
        assert tuple(runs[-2]) in {tuple(k) for k in runs[:-2:2]}  # the probe was seen


def _check(name: str, batch: dict) -> None:
    x, y, m = batch["inputs"], batch["targets"], batch["loss_mask"] > 0
    if name == "in_context_recall":
        _pairs_recall(batch, 16)
    elif name == "noisy_in_context_recall":
        _pairs_recall(batch, 16)
        assert (x >= 16).any()  # some noise at frac_noise 0.2
    elif name == "fuzzy_in_context_recall":
        _check_fuzzy(batch)
    elif name == "selective_copying":
        n, blank, copy = 16, 14, 15
        assert (x[:, -n - 1] == copy).all() and (x[:, -n:] == blank).all()
        assert (m[:, -n:]).all() and not m[:, :-n].any()
        for row_x, row_y in zip(x, y, strict=True):
            content = row_x[: -n - 1][row_x[: -n - 1] != blank]
            assert content.size == n and (content < blank).all()
            assert np.array_equal(row_y[-n:], content)
    elif name == "compression":
        n = 31
        assert (x[:, n:] == 15).all() and (x[:, :n] < 15).all()
        assert m[:, n:].all() and not m[:, :n].any()
        assert np.array_equal(y[:, n:], x[:, :n])
    elif name == "memorization":
        assert (x[:, 1::2] == 255).all() and m[:, 1::2].all() and not m[:, 0::2].any()
        value_of = {}
        for k, v in zip(x[:, 0::2].ravel(), y[:, 1::2].ravel(), strict=True):
            assert 0 <= k < 127 <= v < 255
            assert value_of.setdefault(int(k), int(v)) == v  # one value per key


@pytest.mark.parametrize("name", TASKS)
def test_baseline_shapes_and_targets_rederived(name):
    batch = make_mad_batch(name, 48, 0)
    t = BASELINE_T[name]
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "inputs": ((48, t), np.int32),
        "targets": ((48, t), np.int32),
        "loss_mask": ((48, t), np.float32),
    }
    assert set(np.unique(batch["loss_mask"])) <= {0.0, 1.0}
    assert (batch["loss_mask"].sum(1) >= 1).all()
    v = 256 if name == "memorization" else 32 if name.startswith("noisy") else 16
    for key in ("inputs", "targets"):
        assert batch[key].min() >= 0 and batch[key].max() < v
    _check(name, batch)


def test_fuzzy_test_split_and_larger_sizes():
    batch = make_mad_batch("fuzzy_in_context_recall", 32, 1, fixed_key_size=True)
    _check_fuzzy(batch)
    stream = np.concatenate([batch["inputs"][:, :1], batch["targets"]], axis=1)
    assert stream.shape == (32, 129)
    big = make_mad_batch("in_context_recall", 8, 1, vocab_size=64, seq_len=256)
    assert big["inputs"].shape == (8, 255)
    _pairs_recall(big, 64)
    copy = make_mad_batch("selective_copying", 8, 1, vocab_size=32, num_tokens_to_copy=32)
    assert copy["loss_mask"].sum(1).tolist() == [32] * 8


@pytest.mark.parametrize("name", TASKS)
def test_deterministic_under_a_seed(name):
    a = make_mad_batch(name, 16, 3)
    b = make_mad_batch(name, 16, np.random.default_rng(3))
    c = make_mad_batch(name, 16, 4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["inputs"], c["inputs"])


def test_memorization_map_is_fixed_across_batches_and_seeded():
    table = memorization_kv_map(256, 12345)
    assert table.shape == (127,) and len(set(table.tolist())) == 127
    assert ((127 <= table) & (table < 255)).all()
    for seed in (0, 1, 2):
        b = make_mad_batch("memorization", 8, seed)
        assert np.array_equal(b["targets"][:, 1::2], table[b["inputs"][:, 0::2]])
    assert not np.array_equal(table, memorization_kv_map(256, 1))


@pytest.mark.parametrize("name", TASKS)
def test_oracle_scores_one(name):
    batch = _big(name)
    b, t = batch["targets"].shape
    oracle = np.zeros((b, t, int(batch["targets"].max()) + 1), np.float32)
    np.put_along_axis(oracle, batch["targets"][..., None], 1.0, axis=-1)
    assert mad_accuracy(oracle, batch) == 1.0
    assert mad_accuracy(oracle, batch, average="macro") == 1.0
    assert mad_accuracy(batch["targets"], batch) == 1.0  # argmax ids work too
    # the same predictions shifted by one position are (nearly) never right
    shifted = np.roll(batch["targets"], 1, axis=1)
    assert mad_accuracy(shifted, batch) < 0.5


# A fixed token's accuracy is a mean of >= 8000 scored positions (>= 4000 effectively independent
# for the recall tasks, whose values repeat within a row), so its std is <= 0.06 * chance; the
# tolerance 0.3 * chance is > 4 sigma. The majority token is picked after seeing the targets, so it
# gets a looser bound.
REL_TOL = 0.3


@pytest.mark.parametrize("name", TASKS)
def test_constant_predictors_score_chance(name):
    rows = 2048 if name == "memorization" else 512
    batch = _big(name, rows)
    chance = mad_chance(name)
    assert chance == pytest.approx(CHANCE[name])
    scored = batch["targets"][batch["loss_mask"] > 0]
    # a fixed token: the first id a scored position can hold
    fixed = np.full_like(batch["targets"], int(scored.min()))
    acc = mad_accuracy(fixed, batch)
    assert abs(acc - chance) <= REL_TOL * chance, acc
    # the majority target: no better than 1.5 x chance, far from solving the task
    top = Counter(scored.tolist()).most_common(1)[0][0]
    acc = mad_accuracy(np.full_like(batch["targets"], top), batch)
    assert acc <= 1.5 * chance and acc < 0.5, acc
    # macro average of a constant: 1 / (number of target classes present)
    macro = mad_accuracy(fixed, batch, average="macro")
    assert macro == pytest.approx(1 / np.unique(scored).size)
    assert abs(macro - chance) <= REL_TOL * chance


def test_bad_arguments():
    with pytest.raises(ValueError, match="name"):
        make_mad_batch("associative_recall", 4, 0)
    with pytest.raises(ValueError, match="name"):
        mad_chance("associative_recall")
    for name in TASKS:
        with pytest.raises(ValueError, match="batch_size"):
            make_mad_batch(name, 0, 0)
        with pytest.raises(ValueError, match="rng_or_seed"):
            make_mad_batch(name, 2, "zero")
    with pytest.raises(ValueError, match="sizes"):
        make_mad_batch("compression", 2, 0, frac_noise=0.1)  # not a compression size
    with pytest.raises(ValueError, match="seq_len"):
        make_mad_batch("in_context_recall", 2, 0, seq_len=127)
    with pytest.raises(ValueError, match="frac_noise"):
        make_mad_batch("noisy_in_context_recall", 2, 0, frac_noise=1.0)
    with pytest.raises(ValueError, match="noise_vocab_size"):
        make_mad_batch("in_context_recall", 2, 0, frac_noise=0.2)
    with pytest.raises(ValueError, match="vocab_size"):
        make_mad_batch("noisy_in_context_recall", 2, 0, vocab_size=16, noise_vocab_size=16)
    with pytest.raises(ValueError, match="vocab_size"):
        make_mad_batch("fuzzy_in_context_recall", 2, 0, vocab_size=6)
    with pytest.raises(ValueError, match="seq_len"):
        make_mad_batch("fuzzy_in_context_recall", 2, 0, seq_len=10)
    with pytest.raises(ValueError, match="k_motif_size"):
        make_mad_batch("fuzzy_in_context_recall", 2, 0, k_motif_size=0)
    with pytest.raises(ValueError, match="seq_len"):
        make_mad_batch("selective_copying", 2, 0, seq_len=33)
    with pytest.raises(ValueError, match="num_tokens_to_copy"):
        make_mad_batch("selective_copying", 2, 0, num_tokens_to_copy=0)
    with pytest.raises(ValueError, match="seq_len"):
        make_mad_batch("compression", 2, 0, seq_len=1)
    with pytest.raises(ValueError, match="seq_len"):
        make_mad_batch("memorization", 2, 0, seq_len=31)
    with pytest.raises(ValueError, match="vocab_size"):
        make_mad_batch("memorization", 2, 0, vocab_size=2)
    batch = make_mad_batch("compression", 2, 0)
    with pytest.raises(ValueError, match="logits"):
        mad_accuracy(np.zeros((2, 5, 16)), batch)
    with pytest.raises(ValueError, match="average"):
        mad_accuracy(batch["targets"], batch, average="weighted")
    with pytest.raises(ValueError, match="loss_mask"):
        mad_accuracy(batch["targets"], {**batch, "loss_mask": np.zeros_like(batch["loss_mask"])})
