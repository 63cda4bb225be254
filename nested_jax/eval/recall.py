"""Key–value recall in a haystack, trained directly: the retrieval task family of the long-context
claims (HOLA's S-NIAH, Titans' needle tests, Proteus' capacity), generated locally.

A row holds ``pairs`` key–value pairs ``k v`` at chosen depths of a haystack of filler tokens, then
a QUERY marker and ``queries`` of the keys, each followed by its value::

    f f k₁ v₁ f f f f k₂ v₂ f f … f f  QUERY  k₂ v₂ k₁ v₁
    └──────────── haystack ────────────┘       └ queries ┘

Next-token form (``inputs = row[:-1]``, ``targets = row[1:]``, ``T = seq_len``): the scored
positions are the queried keys, whose target is their value (``loss_mask`` 1 there, 0 elsewhere;
the model is trained on the answers only). A query's answer sits ``depth`` of the haystack back:
a pair's depth is the position of its slot in the haystack, ``0`` at its start (farthest from the
query) and ``1`` at its end. ``pairs = queries = 1`` is a passkey test; many pairs make capacity
matter (a state of ``d_k × d_v`` holds about ``d_k`` pairs without interference).

Vocabulary (``RecallVocab``): ``0`` padding (unused), ``1`` QUERY, then ``keys`` key ids, ``values``
value ids and ``filler`` filler ids. Keys are distinct within a row; values repeat freely; queried
keys are distinct and in random order. Chance ``1 / values``.

Sizes (keyword arguments of :func:`make_recall_batch`, ``RECALL_SIZES`` the defaults):
``seq_len`` (T), ``pairs``, ``queries``, ``keys``, ``values``, ``filler``; and ``depth = (lo, hi)``,
the band of the haystack the pairs are drawn from (all pairs of a row lie in it), so a scoring grid
of bands × lengths is the needle-in-a-haystack heatmap with the model trained on the task.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from nested_jax.eval.mad import mad_accuracy
from nested_jax.eval.seeds import as_rng

RECALL_TASKS = {"kv": "key-value pairs at chosen depths of a haystack, queried at the end"}
RECALL_SIZES = {"seq_len": 128, "pairs": 8, "queries": 4, "keys": 64, "values": 64, "filler": 64}


@dataclasses.dataclass(frozen=True)
class RecallVocab:
    """Token ids of a recall task: ``0`` pad, ``1`` QUERY, then keys, values, filler."""

    keys: int
    values: int
    filler: int

    QUERY = 1

    @property
    def key_base(self) -> int:
        return 2

    @property
    def value_base(self) -> int:
        return 2 + self.keys

    @property
    def filler_base(self) -> int:
        return 2 + self.keys + self.values

    @property
    def size(self) -> int:
        return 2 + self.keys + self.values + self.filler


def _check_sizes(seq_len, pairs, queries, keys, values, filler, depth) -> tuple[float, float]:
    """One ValueError per impossible size, naming it; returns the depth band as floats."""
    for name, value in (("seq_len", seq_len), ("pairs", pairs), ("queries", queries),
                        ("keys", keys), ("values", values), ("filler", filler)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if queries > pairs:
        raise ValueError(f"queries: at most pairs={pairs} keys can be queried, got {queries}")
    if keys < pairs:
        raise ValueError(f"keys: {pairs} distinct keys per row need keys >= pairs, got {keys}")
    try:
        lo, hi = (float(x) for x in depth)
    except (TypeError, ValueError):
        raise ValueError(f"depth: expected (lo, hi) in [0, 1], got {depth!r}") from None
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"depth: expected 0 <= lo < hi <= 1, got {depth!r}")
    slots = haystack_slots(seq_len, queries)
    band = _band(slots, lo, hi)
    if len(band) < pairs:
        raise ValueError(
            f"seq_len: a row of {seq_len} tokens has {slots} two-token haystack slots, "
            f"{len(band)} in the depth band {depth}; {pairs} pairs need {pairs} (raise seq_len, "
            "widen depth or lower pairs)"
        )
    return lo, hi


def haystack_slots(seq_len: int, queries: int) -> int:
    """Two-token slots of the haystack in a row of ``seq_len`` inputs (``seq_len + 1`` tokens)."""
    return max(seq_len + 1 - (1 + 2 * queries), 0) // 2


def _band(slots: int, lo: float, hi: float) -> range:
    """The slots whose centre depth ``(s + 0.5) / slots`` lies in ``[lo, hi)`` (``]`` at 1)."""
    first = math.ceil(lo * slots - 0.5)
    last = slots if hi >= 1.0 else math.ceil(hi * slots - 0.5)
    return range(max(first, 0), min(last, slots))


def make_recall_batch(
    batch_size: int,
    rng_or_seed: Any,
    *,
    seq_len: int = RECALL_SIZES["seq_len"],
    pairs: int = RECALL_SIZES["pairs"],
    queries: int = RECALL_SIZES["queries"],
    keys: int = RECALL_SIZES["keys"],
    values: int = RECALL_SIZES["values"],
    filler: int = RECALL_SIZES["filler"],
    depth: tuple[float, float] = (0.0, 1.0),
) -> dict[str, np.ndarray]:
    """``batch_size`` recall rows (module docstring).

    Returns:
      ``{"inputs", "targets": int32[B, T], "loss_mask": float32[B, T], "depth": float32[B, T]}``
      with ``T = seq_len``; ``depth`` is the queried pair's depth at the scored positions, -1
      elsewhere.
    Raises:
      ValueError: naming the size that makes the row impossible.
    """
    lo, hi = _check_sizes(seq_len, pairs, queries, keys, values, filler, depth)
    rng = as_rng(rng_or_seed)
    vocab = RecallVocab(keys, values, filler)
    slots = haystack_slots(seq_len, queries)
    band = np.asarray(_band(slots, lo, hi))
    lead = seq_len + 1 - (1 + 2 * queries) - 2 * slots  # 0 or 1 filler token before the slots
    rows = np.empty((batch_size, seq_len + 1), np.int32)
    mask = np.zeros((batch_size, seq_len), np.float32)
    where = np.full((batch_size, seq_len), -1.0, np.float32)
    for b in range(batch_size):
        hay = vocab.filler_base + rng.integers(0, filler, size=lead + 2 * slots)
        chosen = np.sort(rng.choice(band, size=pairs, replace=False))
        k = vocab.key_base + rng.choice(keys, size=pairs, replace=False)
        v = vocab.value_base + rng.integers(0, values, size=pairs)
        hay[lead + 2 * chosen], hay[lead + 2 * chosen + 1] = k, v
        asked = rng.choice(pairs, size=queries, replace=False)
        tail = np.stack([k[asked], v[asked]], axis=1).reshape(-1)
        rows[b] = np.concatenate([hay, [vocab.QUERY], tail])
        scored = len(hay) + 1 + 2 * np.arange(queries)  # row index of each queried key
        mask[b, scored] = 1.0
        where[b, scored] = (chosen[asked] + 0.5) / slots
    return {
        "inputs": rows[:, :-1],
        "targets": rows[:, 1:],
        "loss_mask": mask,
        "depth": where,
    }


def recall_accuracy(logits: Any, batch: dict[str, np.ndarray]) -> float:
    """Fraction of the scored positions (``loss_mask`` 1) whose argmax is the value (logits
    ``[B, T, V]`` or argmax ids ``[B, T]``; MAD's micro accuracy)."""
    return mad_accuracy(logits, batch, "micro")


def recall_chance(values: int = RECALL_SIZES["values"], **_: Any) -> float:
    """A uniform guess among the value ids."""
    return 1.0 / values
