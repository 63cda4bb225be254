"""The next-character protocol of formal-language recognition (Bhattamishra et al. 2020; Irie et
al. 2023), the protocol of Nested Learning's Table 5 (docs/RESULTS.md, "Formal-language protocol").

Only strings of the language are shown. After each prefix w_1..w_t the model predicts the class
of the set of legal continuations (one class token per position). A string counts as recognised
when every one of its L predictions is right. Languages: :data:`PROTOCOL_TASKS` (parity, aa_star,
abab_star, anbn, anbncn, shuffle2); vocabulary and generators shared with the
sequence-classification tasks of :mod:`nested_jax.eval.formal_languages`.

Layout of one row::

    position   0     1 .. L         L+1 ..
    inputs     BOS   w_1 .. w_L     PAD ..
    targets    PAD   y_1 .. y_L     PAD ..      y_t = answer(class after reading w_1..w_t)
    loss_mask  0     1 .. 1         0 ..
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nested_jax.eval.formal_languages import FormalVocab, _check_range, _dyck2_word, _pick_length
from nested_jax.eval.seeds import as_rng
from nested_jax.eval.tasks import predicted_ids


def _sample_parity(rng, lo, hi):
    n = _pick_length(rng, lo, hi, "parity (L >= 1)")
    bits = rng.integers(0, 2, size=n)
    bits[-1] ^= int(bits.sum() % 2)  # an even number of 1s, length kept
    return "".join("01"[b] for b in bits)


def _sample_aa_star(rng, lo, hi):
    return "a" * _pick_length(rng, lo, hi, "(aa)* (even L >= 2)", 2, (0,), 2)


def _sample_abab_star(rng, lo, hi):
    return "ab" * (_pick_length(rng, lo, hi, "(abab)* (L divisible by 4)", 4, (0,), 4) // 2)


def _sample_counter(k: int):
    def sample(rng, lo, hi):  # lo, hi bound n (the protocol's window for counter languages)
        n = _pick_length(rng, lo, hi, f"counter-{k} (n >= 1)")
        return "".join(c * n for c in "abc"[:k])

    return sample


def _sample_shuffle2(rng, lo, hi):
    return "".join(
        _dyck2_word(rng, _pick_length(rng, lo, hi, "Shuffle-2 (even L >= 2)", 2, (0,), 2))
    )


def _labels_parity(s: str) -> list[int]:
    ones = np.cumsum([c == "1" for c in s])
    return [int(k % 2 == 0) for k in ones]  # 1: the prefix is in the language (may end here)


def _labels_period(period: int) -> Callable[[str], list[int]]:
    def labels(s: str) -> list[int]:
        return [int((t + 1) % period == 0) for t in range(len(s))]

    return labels


def _labels_counter(s: str) -> list[int]:
    """Classes of the legal-continuation sets of ``a^n b^n`` / ``a^n b^n c^n`` prefixes:
    0 = {a, b}, 1 = {b}, 2 = {c}, 3 = {end} (``a^n b^n``: the last b gives {end})."""
    k = len(set(s))
    n = len(s) // k
    out = []
    for t in range(1, len(s) + 1):
        if t <= n:
            out.append(0)
        elif t < 2 * n:
            out.append(1)
        elif t == k * n:
            out.append(3)
        else:
            out.append(2)
    return out


def _labels_shuffle2(s: str) -> list[int]:
    """``2·[depth of ( > 0] + [depth of [ > 0]``: which closing brackets may follow (openers may
    always follow; the string may end iff the class is 0)."""
    d = {"(": 0, "[": 0}
    out = []
    for c in s:
        if c in "([":
            d[c] += 1
        else:
            d["(" if c == ")" else "["] -= 1
        out.append(2 * int(d["("] > 0) + int(d["["] > 0))
    return out


@dataclass(frozen=True)
class ProtocolTask:
    """One language of the next-character protocol.

    Attributes:
      sample: ``sample(rng, lo, hi) -> string`` of the language, ``lo..hi`` bounding ``window``.
      labels: ``labels(string) -> [class after each prefix]`` (length L).
      num_classes: number of continuation classes.
      alphabet: the symbols of the strings.
      window: what ``bins`` bound: ``"length"`` (the string length) or ``"n"`` (a^n b^n ...).
      bins: ``(Bin0, Bin1)``: Bin0 = the training window, Bin1 = the longer test window.
      enumerable: the language has at most one string per length (no disjoint splits exist).
    """

    sample: Callable[[np.random.Generator, int, int], str]
    labels: Callable[[str], list[int]]
    num_classes: int
    alphabet: str
    window: str
    bins: tuple[tuple[int, int], tuple[int, int]]
    enumerable: bool

    def max_length(self, window: tuple[int, int]) -> int:
        """Longest string a window allows."""
        return window[1] * (len(self.alphabet) if self.window == "n" else 1)


PROTOCOL_TASKS: dict[str, ProtocolTask] = {
    "parity": ProtocolTask(
        _sample_parity, _labels_parity, 2, "01", "length", ((2, 50), (51, 100)), False
    ),
    "aa_star": ProtocolTask(
        _sample_aa_star, _labels_period(2), 2, "a", "length", ((2, 50), (52, 100)), True
    ),
    "abab_star": ProtocolTask(
        _sample_abab_star, _labels_period(4), 2, "ab", "length", ((4, 48), (52, 100)), True
    ),
    "anbn": ProtocolTask(
        _sample_counter(2), _labels_counter, 4, "ab", "n", ((1, 50), (51, 100)), True
    ),
    "anbncn": ProtocolTask(
        _sample_counter(3), _labels_counter, 4, "abc", "n", ((1, 50), (51, 100)), True
    ),
    "shuffle2": ProtocolTask(
        _sample_shuffle2, _labels_shuffle2, 4, "()[]", "length", ((2, 50), (52, 100)), False
    ),
}


def _protocol_task(name: str) -> ProtocolTask:
    if name not in PROTOCOL_TASKS:
        raise ValueError(f"name: unknown protocol task {name!r}; known: {sorted(PROTOCOL_TASKS)}")
    return PROTOCOL_TASKS[name]


def protocol_strings(
    name: str,
    count: int,
    window: tuple[int, int],
    rng_or_seed: int | np.random.Generator,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[str]:
    """``count`` strings of task ``name`` in ``window`` (its unit: length or n).

    Distinct and outside ``exclude`` unless the language is enumerable (at most one string per
    length: then repeats are the protocol's, and ``exclude`` is ignored).

    Raises:
      ValueError: naming ``count`` when the window holds too few distinct strings.
    """
    task = _protocol_task(name)
    lo, hi = _check_range(window)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count: expected an int >= 0, got {count!r}")
    rng = as_rng(rng_or_seed)
    if task.enumerable:
        return [task.sample(rng, lo, hi) for _ in range(count)]
    seen, out = set(exclude), []
    for _ in range(100 * count + 100):
        if len(out) == count:
            break
        s = task.sample(rng, lo, hi)
        if s not in seen:
            seen.add(s)
            out.append(s)
    if len(out) < count:
        raise ValueError(
            f"count: {name!r} in {window} gave only {len(out)} distinct new strings of {count}"
        )
    return out


def make_protocol_batch(
    name: str, strings: list[str], seq_len: int, vocab: FormalVocab | None = None
) -> dict[str, np.ndarray]:
    """The rows of ``strings`` (layout in the module docstring).

    Returns ``{"inputs", "targets": int32[B, seq_len], "loss_mask": float32[B, seq_len]}``.
    """
    task = _protocol_task(name)
    vocab = FormalVocab() if vocab is None else vocab
    if vocab.num_answers < task.num_classes:
        raise ValueError(
            f"vocab: num_answers={vocab.num_answers} < {task.num_classes} classes of {name!r}"
        )
    longest = max((len(s) for s in strings), default=0)
    if seq_len < longest + 1:
        raise ValueError(f"seq_len: needs >= longest string + 1 = {longest + 1}, got {seq_len}")
    b = len(strings)
    inputs = np.full((b, seq_len), vocab.pad, np.int32)
    targets = np.full((b, seq_len), vocab.pad, np.int32)
    mask = np.zeros((b, seq_len), np.float32)
    for i, s in enumerate(strings):
        n = len(s)
        inputs[i, 0] = vocab.bos
        inputs[i, 1 : n + 1] = vocab.encode(s)
        targets[i, 1 : n + 1] = [vocab.answer(k) for k in task.labels(s)]
        mask[i, 1 : n + 1] = 1.0
    return {"inputs": inputs, "targets": targets, "loss_mask": mask}


def protocol_correct(logits, batch: dict) -> np.ndarray:
    """``bool[B]``: whether every scored prediction of each row is right (a row with no scored
    position counts as wrong).

    Args:
      logits: float[B, T, V], or the argmax ids int[B, T].
      batch: from :func:`make_protocol_batch`.
    """
    targets, mask = np.asarray(batch["targets"]), np.asarray(batch["loss_mask"]) > 0
    ids = predicted_ids(logits, targets.shape)
    wrong = (ids != targets) & mask
    return ~wrong.any(-1) & mask.any(-1)


def protocol_accuracy(logits, batch: dict) -> float:
    """String-level accuracy: the fraction of rows whose every prediction is right."""
    return float(protocol_correct(logits, batch).mean())
