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

Two haystacks (:data:`RECALL_TASKS`):

* ``kv``: filler ids drawn uniformly at random; only the answers are trained
  (``loss_mask`` 1 there).
* ``kv_text``: a window of Jane Austen's novels (lower-cased, one filler id per character of
  :data:`TEXT_ALPHABET`, every other character one id more; ``filler >= len(TEXT_ALPHABET) + 1``),
  the pairs written over it as needles are written into an essay, and the model **also predicts the
  text** (``loss_mask`` 1 at every position whose target is a text token, the answers weighted so
  that they and the text each carry half of a row's loss). A retrieval claim measured on language
  models (HOLA's S-NIAH) is made by models whose memory also serves the language around the
  needle; with a haystack it need not predict, a model trained on the task is free to treat the
  filler as it likes (``recall_probe`` measures what it writes). ``score_mask`` marks the
  answers, the positions :func:`recall_accuracy` scores; the text's accuracy is not scored.

Sizes (keyword arguments of :func:`make_recall_batch`, ``RECALL_SIZES`` the defaults):
``seq_len`` (T), ``pairs``, ``queries``, ``keys``, ``values``, ``filler``; and ``depth = (lo, hi)``,
the band of the haystack the pairs are drawn from (all pairs of a row lie in it), so a scoring grid
of bands × lengths is the needle-in-a-haystack heatmap with the model trained on the task.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from nested_jax.eval.mad import mad_accuracy
from nested_jax.eval.seeds import as_rng

RECALL_TASKS = {
    "kv": "key-value pairs at chosen depths of a haystack, queried at the end",
    "kv_text": "the same pairs written over Austen text, which the model also predicts",
}
HAYSTACKS = {"kv": "random", "kv_text": "text"}
TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"
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
    haystack: str = "random",
    text: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """``batch_size`` recall rows (module docstring).

    Args:
      haystack: ``"random"`` (task ``kv``) or ``"text"`` (``kv_text``).
      text: the text haystack's filler ids (``int [N]`` in ``[0, len(TEXT_ALPHABET)]``, N at least
        a row); default :func:`austen_text_ids`.

    Returns:
      ``{"inputs", "targets": int32[B, T], "loss_mask", "score_mask", "depth": float32[B, T]}``
      with ``T = seq_len``; ``score_mask`` is 1 at the answers, ``depth`` the queried pair's depth
      there (-1 elsewhere); ``loss_mask`` equals ``score_mask`` for ``"random"``.
    Raises:
      ValueError: naming the size that makes the row impossible, ``haystack`` or ``text``.
    """
    lo, hi = _check_sizes(seq_len, pairs, queries, keys, values, filler, depth)
    text = _check_haystack(haystack, text, filler, seq_len)
    rng = as_rng(rng_or_seed)
    vocab = RecallVocab(keys, values, filler)
    slots = haystack_slots(seq_len, queries)
    band = np.asarray(_band(slots, lo, hi))
    lead = seq_len + 1 - (1 + 2 * queries) - 2 * slots  # 0 or 1 filler token before the slots
    rows = np.empty((batch_size, seq_len + 1), np.int32)
    mask = np.zeros((batch_size, seq_len), np.float32)
    where = np.full((batch_size, seq_len), -1.0, np.float32)
    n = lead + 2 * slots
    for b in range(batch_size):
        if text is None:
            hay = vocab.filler_base + rng.integers(0, filler, size=n)
        else:
            start = int(rng.integers(0, len(text) - n + 1))
            hay = vocab.filler_base + text[start : start + n]
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
    loss = mask
    if text is not None:
        # every text target trained; the answers weighted to half of the row's loss
        predicted = (rows[:, 1:] >= vocab.filler_base).astype(np.float32)
        loss = predicted + mask * predicted.sum(1, keepdims=True) / queries
    return {
        "inputs": rows[:, :-1],
        "targets": rows[:, 1:],
        "loss_mask": loss,
        "score_mask": mask,
        "depth": where,
    }


def _check_haystack(haystack: str, text, filler: int, seq_len: int) -> np.ndarray | None:
    """The text haystack's ids (None for ``"random"``), after the checks of its arguments."""
    if haystack not in ("random", "text"):
        raise ValueError(f"haystack: expected 'random' or 'text', got {haystack!r}")
    if haystack == "random":
        return None
    if filler < len(TEXT_ALPHABET) + 1:
        raise ValueError(
            f"filler: a text haystack needs {len(TEXT_ALPHABET) + 1} filler ids (the alphabet and "
            f"one for every other character), got {filler}"
        )
    text = austen_text_ids() if text is None else np.asarray(text)
    if text.ndim != 1 or len(text) < seq_len or text.min() < 0 or text.max() > len(TEXT_ALPHABET):
        raise ValueError(
            f"text: expected int [N >= {seq_len}] ids in [0, {len(TEXT_ALPHABET)}], got "
            f"{text.dtype} {text.shape}"
        )
    return text


def encode_text(text: str) -> np.ndarray:
    """``int32 [len]``: the filler id of each character of ``text`` lower-cased with runs of
    whitespace made one space (its index in :data:`TEXT_ALPHABET`, every other character
    ``len(TEXT_ALPHABET)``)."""
    flat = " ".join(text.lower().split()).encode("latin-1", errors="replace")
    table = np.full(256, len(TEXT_ALPHABET), np.int32)
    table[np.frombuffer(TEXT_ALPHABET.encode("latin-1"), np.uint8)] = np.arange(len(TEXT_ALPHABET))
    return table[np.frombuffer(flat, np.uint8)]


@functools.lru_cache(maxsize=1)
def austen_text_ids() -> np.ndarray:
    """The six novels (:func:`nested_jax.data.corpus.austen_documents`, from the data cache) as
    one :func:`encode_text` stream: the text haystack."""
    from nested_jax.data.corpus import austen_documents

    return encode_text(" ".join(austen_documents()))


def recall_accuracy(logits: Any, batch: dict[str, np.ndarray]) -> float:
    """Fraction of the answers (``score_mask`` 1, else ``loss_mask`` > 0) whose argmax is the
    value (logits ``[B, T, V]`` or argmax ids ``[B, T]``; MAD's micro accuracy)."""
    scored = batch.get("score_mask", batch["loss_mask"])
    return mad_accuracy(logits, {"targets": batch["targets"], "loss_mask": scored}, "micro")


def recall_chance(values: int = RECALL_SIZES["values"], **_: Any) -> float:
    """A uniform guess among the value ids."""
    return 1.0 / values
