"""Synthetic recall tasks: single-needle NIAH (passkey retrieval) and MQAR.

NIAH. A passkey sentence is inserted at depth ``d`` (a fraction of the haystack) into real corpus
text, followed by a question whose answer is the passkey::

    [bos] haystack[:d*n] " The pass key is 48213. Remember it. 48213 is the pass key. "
          haystack[d*n:] "\\n\\nWhat is the pass key? The pass key is" " 48213"

Everything is built in token space so each example has exactly the requested number of tokens.
Scoring is teacher-forced: an example is correct iff the argmax prediction at every answer position
equals the answer token, which is exactly "greedy decoding from the prompt emits the answer".

MQAR (multi-query associative recall, as in the Zoology benchmark). A sequence starts with ``N``
key-value pairs ``k1 v1 ... kN vN`` (distinct keys from ids ``[1, V/2)``, values from ``[V/2, V)``);
later, each key is queried once at a slot of the remaining sequence (slot ``s`` holds ``k v`` at
positions ``2N + 2s, 2N + 2s + 1``; slots are drawn with probability ``∝ s^(power_a - 1)``, so most
queries come soon after the context). The loss is taken only where the input is a query key and the
target is its value. Positions outside pairs and queries hold random filler tokens, never one of the
sequence's keys (so no key is ever bound to a second value).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nested_jax.data.tokenizers import Tokenizer

NEEDLE_TEMPLATE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


class PromptAnswer:
    """Mixin of the generated retrieval examples: ``tokens`` is the prompt followed by the answer,
    split at ``prompt_len`` (both fields of the dataclass that inherits it)."""

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[: self.prompt_len]

    @property
    def answer(self) -> np.ndarray:
        return self.tokens[self.prompt_len :]


@dataclass(frozen=True)
class NiahExample(PromptAnswer):
    """One needle-in-a-haystack example.

    Attributes:
      tokens: int32[length], the prompt followed by the answer.
      prompt_len: number of prompt tokens; ``tokens[prompt_len:]`` is the answer.
      length: requested total length (== ``len(tokens)``).
      depth: requested depth fraction in [0, 1].
      needle_start: index in ``tokens`` where the needle sentence begins.
      passkey: the 5-digit key as text.
    """

    tokens: np.ndarray
    prompt_len: int
    length: int
    depth: float
    needle_start: int
    passkey: str


def token_ids(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """``int32[n]`` ids of ``text`` (every generated task encodes its pieces one by one)."""
    return np.asarray(tokenizer.encode(text), dtype=np.int32)


def haystack_window(haystack_ids: np.ndarray, n_fill: int, rng: np.random.Generator) -> np.ndarray:
    """``n_fill`` consecutive haystack ids from a random offset (the haystack tiled when it is
    shorter than ``n_fill + 1``), the filler of every needle task."""
    if haystack_ids.size < n_fill + 1:
        haystack_ids = np.tile(haystack_ids, n_fill // haystack_ids.size + 2)
    start = int(rng.integers(0, haystack_ids.size - n_fill + 1))
    return haystack_ids[start : start + n_fill]


def answer_predictions(
    logits_fn: Callable, examples: Sequence, batch_size: int
) -> list[np.ndarray]:
    """Teacher-forced predictions of every example's answer, in input order.

    Examples (anything with ``tokens int32[length]``, ``length`` and ``prompt_len``) of one length
    are stacked into batches of up to ``batch_size`` and passed whole to ``logits_fn``
    (``int32[B, length] -> logits [B, length, V]`` or argmax ids ``[B, length]``); an example's
    prediction is the argmax at positions ``prompt_len - 1 .. length - 2``, the positions that
    predict its answer tokens.
    """
    out: list[np.ndarray] = [np.zeros(0, np.int32)] * len(examples)
    by_length: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        by_length.setdefault(ex.length, []).append(i)
    for length, idx in by_length.items():
        for a in range(0, len(idx), batch_size):
            chunk = idx[a : a + batch_size]
            tokens = np.stack([examples[i].tokens for i in chunk]).astype(np.int32)
            predicted = predicted_ids(logits_fn(tokens), tokens.shape, name="logits_fn")
            for row, i in enumerate(chunk):
                out[i] = predicted[row, examples[i].prompt_len - 1 : length - 1]
    return out


def make_niah_example(
    haystack_ids: np.ndarray,
    tokenizer: Tokenizer,
    length: int,
    depth: float,
    rng: np.random.Generator,
) -> NiahExample:
    """Build one example of exactly ``length`` tokens with the needle at ``depth``.

    Args:
      haystack_ids: int[N] token ids of the haystack text (tiled if shorter than needed).
      tokenizer: encodes the needle, question and answer (and supplies ``bos_id``).
      length: total tokens (prompt + answer).
      depth: where the needle goes, as a fraction of the haystack tokens (0 = start, 1 = end).
      rng: source of the passkey and of the haystack offset.

    Returns:
      A :class:`NiahExample`; its needle starts after ``round(depth * n_fill)`` haystack tokens.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a fraction in [0, 1], got {depth}")
    haystack_ids = np.asarray(haystack_ids, dtype=np.int32)
    if haystack_ids.ndim != 1 or haystack_ids.size == 0:
        raise ValueError(f"haystack_ids: expected a non-empty [N] array, got {haystack_ids.shape}")
    key = str(int(rng.integers(10000, 100000)))
    head = np.asarray([] if tokenizer.bos_id is None else [tokenizer.bos_id], np.int32)
    needle = token_ids(tokenizer, " " + NEEDLE_TEMPLATE.format(key=key) + " ")
    question = token_ids(tokenizer, "\n\n" + QUESTION)
    answer = token_ids(tokenizer, " " + key)
    n_fill = length - head.size - needle.size - question.size - answer.size
    if n_fill < 0:
        raise ValueError(
            f"lengths: {length} tokens cannot hold the needle, question and answer "
            f"({length - n_fill} tokens)"
        )
    fill = haystack_window(haystack_ids, n_fill, rng)
    pos = int(round(depth * n_fill))
    tokens = np.concatenate([head, fill[:pos], needle, fill[pos:], question, answer])
    assert tokens.size == length
    return NiahExample(
        tokens=tokens.astype(np.int32),
        prompt_len=int(length - answer.size),
        length=int(length),
        depth=float(depth),
        needle_start=int(head.size + pos),
        passkey=key,
    )


def niah_grid(
    haystack_text: str,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    n_per_cell: int,
    seed: int,
) -> list[NiahExample]:
    """``n_per_cell`` examples for every (length, depth) pair, deterministic in ``seed``.

    Args:
      haystack_text: corpus text for the filler (e.g. validation documents joined).
      tokenizer: the model's tokenizer.
      lengths: total token lengths.
      depths: needle depth fractions in [0, 1].
      n_per_cell: examples per (length, depth) cell.
      seed: seeds passkeys and haystack offsets.

    Returns:
      Examples ordered by length, then depth, then index.
    """
    if not isinstance(haystack_text, str) or not haystack_text.strip():
        raise ValueError("haystack_text: expected non-empty text")
    if not lengths or any(int(n) != n or n < 1 for n in lengths):
        raise ValueError(f"lengths: expected positive integers, got {list(lengths)}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths: expected fractions in [0, 1], got {list(depths)}")
    if n_per_cell < 1:
        raise ValueError(f"n_per_cell: expected >= 1, got {n_per_cell}")
    hay = token_ids(tokenizer, haystack_text)
    rng = np.random.default_rng(seed)
    return [
        make_niah_example(hay, tokenizer, int(n), float(d), rng)
        for n in lengths
        for d in depths
        for _ in range(n_per_cell)
    ]


def score_niah(
    logits_fn: Callable[[np.ndarray], np.ndarray],
    examples: Sequence[NiahExample],
    batch_size: int = 8,
) -> dict:
    """Teacher-forced exact-match accuracy, overall and by length × depth.

    Examples of one length are stacked into batches of up to ``batch_size`` and passed whole
    (prompt + answer, ``int32[B, length]``) to ``logits_fn``; the predictions at positions
    ``prompt_len - 1 .. length - 2`` must equal the answer tokens.

    Args:
      logits_fn: ``tokens int32[B, L] -> logits [B, L, V]`` (causal: position t sees tokens <= t),
        or directly the argmax ids ``int [B, L]`` (what a sharded evaluation returns, so that no
        ``[B, L, V]`` array leaves the devices).
      examples: from :func:`niah_grid`.
      batch_size: examples per ``logits_fn`` call.

    Returns:
      ``{"accuracy": {length: {depth: acc}}, "overall": acc, "num_examples": n,
      "correct": [bool per example, in input order]}``.
    """
    if not examples:
        raise ValueError("examples: expected at least one NIAH example")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    predictions = answer_predictions(logits_fn, examples, batch_size)
    correct = [
        bool(np.array_equal(p, ex.answer)) for p, ex in zip(predictions, examples, strict=True)
    ]
    table: dict[int, dict[float, float]] = {}
    cells: dict[tuple[int, float], list[bool]] = {}
    for ex, ok in zip(examples, correct, strict=True):
        cells.setdefault((ex.length, ex.depth), []).append(ok)
    for (length, depth), oks in cells.items():
        table.setdefault(length, {})[depth] = float(np.mean(oks))
    return {
        "accuracy": table,
        "overall": float(np.mean(correct)),
        "num_examples": len(examples),
        "correct": correct,
    }


def predicted_ids(out, shape: tuple[int, int], name: str = "logits") -> np.ndarray:
    """``[B, L]`` predicted ids from logits ``[B, L, V]`` or from ids already taken (every
    generated task's scorer takes either); ValueError naming ``name`` for any other shape."""
    out = np.asarray(out)
    ok = out.shape[:2] == tuple(shape) and (
        out.ndim == 3 or (out.ndim == 2 and np.issubdtype(out.dtype, np.integer))
    )
    if not ok:
        raise ValueError(
            f"{name}: expected logits [B, L, V] or int ids [B, L] with B, L = {tuple(shape)}, "
            f"got {out.dtype} {out.shape}"
        )
    return out.argmax(-1) if out.ndim == 3 else out


def grid_markdown(table: dict, cell: Callable[[Any, Any], str]) -> list[str]:
    """A length × depth table as Markdown rows (rows: length, columns: depth).

    Args:
      table: ``{length: {depth: value}}``; keys numbers or their strings (a JSON report's).
      cell: ``(length, depth) -> text`` for each present cell (an absent one is left empty).
    """
    depths = sorted({d for row in table.values() for d in row}, key=float)
    lines = [
        "| length | " + " | ".join(f"depth {float(d):g}" for d in depths) + " |",
        "|---:|" + "---:|" * len(depths),
    ]
    for n in sorted(table, key=int):
        cells = [cell(n, d) if d in table[n] else "" for d in depths]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def niah_markdown(result: dict) -> str:
    """The accuracy table of :func:`score_niah` as Markdown (rows: length, columns: depth)."""
    table = result["accuracy"]
    lines = grid_markdown(table, lambda n, d: f"{table[n][d]:.2f}")
    lines.append(
        f"\noverall accuracy {result['overall']:.3f} over {result['num_examples']} examples"
    )
    return "\n".join(lines)


def make_mqar_batch(
    rng_or_seed: int | np.random.Generator,
    batch_size: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    power_a: float = 0.01,
) -> dict[str, np.ndarray]:
    """One batch of multi-query associative recall (layout in the module docstring).

    Args:
      rng_or_seed: a seed or a ``numpy.random.Generator``.
      batch_size: B.
      seq_len: T; needs ``T + 1 >= 4 * num_kv_pairs`` (context pairs plus one slot per query).
      num_kv_pairs: N pairs, each queried once.
      vocab_size: V; needs ``V // 2 - 1 >= N`` distinct keys and ``V - V // 2 >= N`` values.
      power_a: exponent of the slot distribution ``p(s) ∝ s^(power_a - 1)``, s = 1..slots.

    Returns:
      ``{"inputs": int32[B, T], "targets": int32[B, T], "loss_mask": float32[B, T]}``;
      ``loss_mask`` is 1 at exactly N positions per row (the queries).
    """
    rng = (
        rng_or_seed
        if isinstance(rng_or_seed, np.random.Generator)
        else np.random.default_rng(rng_or_seed)
    )
    n, t, v = num_kv_pairs, seq_len, vocab_size
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    if n < 1:
        raise ValueError(f"num_kv_pairs: expected >= 1, got {n}")
    if v // 2 - 1 < n or v - v // 2 < n:
        raise ValueError(f"vocab_size: {v} too small for {n} distinct keys and values")
    if t + 1 < 4 * n:
        raise ValueError(f"seq_len: needs seq_len + 1 >= 4 * num_kv_pairs = {4 * n}, got {t}")
    if not power_a > 0:
        raise ValueError(f"power_a: expected > 0, got {power_a}")
    slots = (t + 1 - 2 * n) // 2
    p = np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1.0)
    p /= p.sum()
    stream = rng.integers(0, v, size=(batch_size, t + 1)).astype(np.int32)
    mask = np.zeros((batch_size, t), np.float32)
    for b in range(batch_size):
        keys = rng.choice(np.arange(1, v // 2), size=n, replace=False).astype(np.int32)
        values = rng.choice(np.arange(v // 2, v), size=n, replace=False).astype(np.int32)
        row = stream[b]
        row[np.isin(row, keys)] = 0  # filler must not re-bind a key
        row[0 : 2 * n : 2] = keys
        row[1 : 2 * n : 2] = values
        chosen = rng.choice(slots, size=n, replace=False, p=p)
        order = rng.permutation(n)
        qpos = 2 * n + 2 * chosen
        row[qpos] = keys[order]
        row[qpos + 1] = values[order]
        mask[b, qpos] = 1.0
    return {"inputs": stream[:, :-1], "targets": stream[:, 1:], "loss_mask": mask}


def mqar_accuracy(logits, batch: dict) -> float:
    """Fraction of query positions whose argmax prediction is the right value.

    Args:
      logits: float[B, T, V].
      batch: from :func:`make_mqar_batch` (uses ``targets`` and ``loss_mask``).

    Returns:
      Accuracy in [0, 1].
    """
    logits = np.asarray(logits)
    targets, mask = np.asarray(batch["targets"]), np.asarray(batch["loss_mask"])
    if logits.ndim != 3 or logits.shape[:2] != targets.shape:
        raise ValueError(
            f"logits: expected [B, T, V] with B, T = {targets.shape}, got {logits.shape}"
        )
    sel = mask > 0
    if not sel.any():
        raise ValueError("batch: loss_mask selects no query positions")
    return float((logits.argmax(-1)[sel] == targets[sel]).mean())
