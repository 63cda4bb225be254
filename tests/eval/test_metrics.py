"""Masked loss sums, bits/byte and perplexity."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.eval.metrics import bits_per_byte, masked_loss_sums, perplexity, summarize


def test_bits_per_byte_and_perplexity_values():
    assert bits_per_byte(math.log(2) * 10, 10) == pytest.approx(1.0)
    assert bits_per_byte(math.log(256) * 7, 7) == pytest.approx(8.0)
    assert perplexity(math.log(5) * 3, 3) == pytest.approx(5.0)
    assert perplexity(1e6, 1) == math.inf
    with pytest.raises(ValueError, match="total_bytes"):
        bits_per_byte(1.0, 0)
    with pytest.raises(ValueError, match="total_tokens"):
        perplexity(1.0, -1)


def test_masked_sums_ignore_masked_positions_even_nan():
    loss = np.array([[1.0, 2.0, np.nan], [4.0, np.inf, 6.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 1]], np.float32)
    targets = np.array([[0, 1, 2], [2, 0, 1]], np.int32)
    token_bytes = np.array([1, 3, 0], np.int32)
    s = masked_loss_sums(loss, mask, targets, token_bytes)
    assert float(s["nats"]) == pytest.approx(13.0)
    assert float(s["tokens"]) == 4.0
    assert float(s["bytes"]) == 1 + 3 + 0 + 3
    jitted = jax.jit(masked_loss_sums)(loss, mask, targets, jnp.asarray(token_bytes))
    assert float(jitted["nats"]) == pytest.approx(13.0)


def test_sums_aggregate_across_batches():
    rng = np.random.default_rng(0)
    loss = rng.uniform(0, 5, (6, 10)).astype(np.float32)
    mask = (rng.uniform(size=(6, 10)) > 0.3).astype(np.float32)
    targets = rng.integers(0, 50, (6, 10)).astype(np.int32)
    tb = rng.integers(0, 4, 50).astype(np.int32)
    whole = masked_loss_sums(loss, mask, targets, tb)
    parts = [
        masked_loss_sums(loss[i : i + 2], mask[i : i + 2], targets[i : i + 2], tb)
        for i in (0, 2, 4)
    ]
    total = {k: sum(float(p[k]) for p in parts) for k in whole}
    for k in whole:
        assert total[k] == pytest.approx(float(whole[k]), rel=1e-6)
    out = summarize(total)
    expected = float((loss * mask).sum() / (math.log(2) * (mask * tb[targets]).sum()))
    assert out["bits_per_byte"] == pytest.approx(expected, rel=1e-5)
    assert out["loss"] == pytest.approx(float((loss * mask).sum() / mask.sum()), rel=1e-5)


def test_shape_errors_name_the_argument():
    ok = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="per_token_loss"):
        masked_loss_sums(np.zeros(3), ok, ok.astype(np.int32), np.ones(4))
    with pytest.raises(ValueError, match="loss_mask"):
        masked_loss_sums(ok, np.zeros((2, 4)), ok.astype(np.int32), np.ones(4))
    with pytest.raises(ValueError, match="token_bytes"):
        masked_loss_sums(ok, ok, ok.astype(np.int32), np.ones((2, 2)))
