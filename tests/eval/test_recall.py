"""The key-value recall task (``nested_jax.eval.recall``) and its place in the synthetic driver
(``recall:kv``: the length × depth grid, the table and the heatmap)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nested_jax.eval.recall import (
    TEXT_ALPHABET,
    RecallVocab,
    austen_text_ids,
    encode_text,
    haystack_slots,
    make_recall_batch,
    recall_accuracy,
    recall_chance,
)
from nested_jax.experiments import synthetic
from nested_jax.experiments.synthetic_data import SyntheticSettings, eval_sets, train_batch

SIZES = dict(seq_len=60, pairs=5, queries=3, keys=12, values=10, filler=7)


def _pairs_of(row: np.ndarray, vocab: RecallVocab) -> dict[int, int]:
    """The haystack's key -> value pairs of one full row (inputs + the last target)."""
    out = {}
    query = int(np.flatnonzero(row == vocab.QUERY)[0])
    for i in range(query - 1):
        if vocab.key_base <= row[i] < vocab.value_base:
            out[int(row[i])] = int(row[i + 1])
    return out


def test_rows_hold_their_pairs_and_the_answers_are_their_values():
    vocab = RecallVocab(SIZES["keys"], SIZES["values"], SIZES["filler"])
    b = make_recall_batch(16, 3, **SIZES)
    assert b["inputs"].shape == b["targets"].shape == b["loss_mask"].shape == (16, 60)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])  # next-token form
    for i in range(16):
        row = np.concatenate([b["inputs"][i], b["targets"][i, -1:]])
        pairs = _pairs_of(row, vocab)
        assert len(pairs) == SIZES["pairs"]  # distinct keys, each once in the haystack
        scored = np.flatnonzero(b["loss_mask"][i])
        assert len(scored) == SIZES["queries"]
        asked = b["inputs"][i, scored]
        assert len(set(asked.tolist())) == SIZES["queries"]
        for pos, key in zip(scored, asked, strict=True):
            assert b["targets"][i, pos] == pairs[int(key)]
        haystack = row[: np.flatnonzero(row == vocab.QUERY)[0]]
        fill = haystack[(haystack >= vocab.filler_base)]
        assert fill.size == haystack.size - 2 * SIZES["pairs"] and fill.max() < vocab.size
    assert (b["depth"][b["loss_mask"] == 0] == -1).all()


@pytest.mark.parametrize("band", [(0.0, 0.2), (0.4, 0.6), (0.8, 1.0)])
def test_depth_band_places_every_pair_inside_it(band):
    b = make_recall_batch(32, 0, **{**SIZES, "pairs": 2, "queries": 2}, depth=band)
    d = b["depth"][b["loss_mask"] > 0]
    assert d.min() >= band[0] and d.max() <= band[1]
    slots = haystack_slots(SIZES["seq_len"], 2)
    # the pairs' key positions: farther from the end for a smaller depth
    where = [np.flatnonzero((r >= 2) & (r < 2 + SIZES["keys"]))[0] for r in b["inputs"]]
    assert max(where) <= 1 + 2 * (band[1] * slots + 1)


def test_same_seed_same_rows_and_accuracy_scores_the_answers():
    a, b = make_recall_batch(4, 9, **SIZES), make_recall_batch(4, 9, **SIZES)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    perfect = np.eye(RecallVocab(12, 10, 7).size)[a["targets"]]
    assert recall_accuracy(perfect, a) == 1.0
    wrong = np.eye(RecallVocab(12, 10, 7).size)[np.zeros_like(a["targets"])]
    assert recall_accuracy(wrong, a) == 0.0
    assert recall_chance(**SIZES) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(queries=6), "queries"),
        (dict(keys=4), "keys"),
        (dict(seq_len=12), "seq_len"),
        (dict(depth=(0.5, 0.5)), "depth"),
        (dict(filler=0), "filler"),
        (dict(pairs=True), "pairs"),
    ],
)
def test_impossible_sizes_name_themselves(change, match):
    with pytest.raises(ValueError, match=f"^{match}:"):
        make_recall_batch(1, 0, **{**SIZES, **change})


def test_settings_grid_and_batches():
    s = SyntheticSettings(
        task="recall:kv", recall_sizes=tuple(SIZES.items()), eval_multipliers=(1, 2),
        depth_bins=2, eval_batches=1, batch_size=4,
    )  # fmt: skip
    assert s.seq_len == 60 and s.vocab == RecallVocab(12, 10, 7).size and s.chance == 0.1
    sets = eval_sets(s)
    assert [k for k, _, _ in sets] == ["1x@0.00", "1x@0.50", "2x@0.00", "2x@0.50"]
    assert [info["seq_len"] for _, info, _ in sets] == [60, 60, 120, 120]
    assert sets[3][2][0]["inputs"].shape == (4, 120)
    assert "depth" not in train_batch(s, np.random.default_rng(0))
    with pytest.raises(ValueError, match="^recall_sizes:"):
        SyntheticSettings(task="recall:kv", recall_sizes=(("pears", 3),))
    with pytest.raises(ValueError, match="^recall_sizes:"):  # 16× rows fine, but 5 bands of 1×?
        SyntheticSettings(task="recall:kv", recall_sizes=(("seq_len", 24), ("pairs", 4)))
    with pytest.raises(ValueError, match="^recall_sizes: only"):
        SyntheticSettings(task="mad:compression", recall_sizes=(("pairs", 3),))


def test_driver_trains_scores_the_grid_and_draws_the_heatmap(tmp_path, capsys):
    code = synthetic.main(
        ["--task", "recall:kv", "--models", "gdn", "--steps", "3", "--batch-size", "4",
         "--d-model", "16", "--eval-batches", "1", "--eval-multipliers", "1", "2",
         "--depth-bins", "2", "--recall-sizes", *(f"{k}={v}" for k, v in SIZES.items()),
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "| 1× (60) | 2× (120) |" in out
    result = json.loads((tmp_path / "recall_kv.json").read_text())
    assert set(result["runs"][0]["scores"]) == {"1x@0.00", "1x@0.50", "2x@0.00", "2x@0.50"}
    assert (tmp_path / "recall_kv_depth.png").stat().st_size > 0


TEXT_SIZES = {**SIZES, "filler": len(TEXT_ALPHABET) + 1}


def test_text_haystack_is_a_window_of_the_text_with_the_pairs_written_over_it():
    text = np.arange(500) % (len(TEXT_ALPHABET) + 1)  # every window tells where it starts
    b = make_recall_batch(8, 1, **TEXT_SIZES, haystack="text", text=text)
    vocab = RecallVocab(SIZES["keys"], SIZES["values"], TEXT_SIZES["filler"])
    for i in range(8):
        row = np.concatenate([b["inputs"][i], b["targets"][i, -1:]])
        query = int(np.flatnonzero(row == vocab.QUERY)[0])
        hay = row[:query]
        filler = hay >= vocab.filler_base
        assert (~filler).sum() == 2 * SIZES["pairs"]  # only the pairs are not text
        # the text runs on under the pairs: token j of the window is (start + j) mod 31 there
        window = np.flatnonzero(filler)
        offsets = (hay[window] - vocab.filler_base - window) % (len(TEXT_ALPHABET) + 1)
        assert len(set(offsets.tolist())) == 1
        assert _pairs_of(row, vocab)  # the pairs are still there and queried
    # the loss: every text target, and the answers weighted to half of each row's loss
    text_targets = (b["targets"] >= vocab.filler_base).astype(np.float32)
    np.testing.assert_array_equal(b["loss_mask"] * (b["score_mask"] == 0), text_targets)
    answers = (b["loss_mask"] * b["score_mask"]).sum(1)
    np.testing.assert_allclose(answers, text_targets.sum(1))
    assert (b["score_mask"].sum(1) == SIZES["queries"]).all()
    perfect = np.eye(vocab.size)[b["targets"]]
    perfect[b["score_mask"] == 0] = np.eye(vocab.size)[0]  # wrong on all the text
    assert recall_accuracy(perfect, b) == 1.0  # scored on the answers only


def test_random_haystack_scores_and_trains_the_answers_only():
    b = make_recall_batch(4, 2, **SIZES)
    np.testing.assert_array_equal(b["loss_mask"], b["score_mask"])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(haystack="essay"), "haystack"),
        (dict(haystack="text", filler=len(TEXT_ALPHABET)), "filler"),
        (dict(haystack="text", text=np.zeros(10, int)), "text"),
        (dict(haystack="text", text=np.full(100, len(TEXT_ALPHABET) + 1)), "text"),
    ],
)
def test_bad_haystacks_name_themselves(change, match):
    with pytest.raises(ValueError, match=f"^{match}:"):
        make_recall_batch(1, 0, **{**TEXT_SIZES, **change})


def test_encode_text_and_the_austen_stream():
    other = len(TEXT_ALPHABET)
    got = encode_text("Ab,\n\t  z!")
    np.testing.assert_array_equal(got, [0, 1, TEXT_ALPHABET.index(","), 26, 25, other])
    ids = austen_text_ids()  # the real corpus (installed by scripts/setup)
    assert len(ids) > 3_000_000 and ids.min() == 0 and ids.max() == other
    assert np.mean(ids == TEXT_ALPHABET.index(" ")) > 0.1  # words


def test_driver_trains_the_text_task(tmp_path, capsys):
    sizes = {**TEXT_SIZES, "seq_len": 40}
    code = synthetic.main(
        ["--task", "recall:kv_text", "--models", "gdn", "--steps", "2", "--batch-size", "4",
         "--d-model", "16", "--eval-batches", "1", "--eval-multipliers", "1", "--depth-bins", "1",
         "--recall-sizes", *(f"{k}={v}" for k, v in sizes.items()), "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "recall_kv_text.json").read_text())
    assert result["runs"][0]["scores"]["1x@0.00"]["eval_queries"] == 4 * SIZES["queries"]
