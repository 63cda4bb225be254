"""RULER-style retrieval tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"): needles of key-value facts or variable chains in a haystack.

Every example is built in token space, so it has exactly the requested number of tokens, and is
scored teacher-forced like :mod:`nested_jax.eval.tasks`' NIAH: an example is correct iff the argmax
at every answer position equals the answer token ("greedy decoding from the prompt emits the
answer"). Partial credit (RULER reports recall over several answers): the fraction of answer
tokens right, and the fraction of answer items (one value, one variable name) whose tokens are all
right.

Layout of every example (``N`` needle pieces, each encoded as ``" " + sentence + " "``; the
haystack pieces ``fill`` together hold ``n_fill`` tokens, whatever the length leaves)::

    [bos] preamble fill[:p_1] needle_1 fill[p_1:p_2] needle_2 ... fill[p_N:] "\\n\\n" question
          " " item_1 ", " item_2 ...                                                  <- answer

Prompt text by kind (``{nouns}`` / ``{noun}``: ``pass keys`` / ``pass key`` for ``value_type=
"passkey"`` (5 digits, e.g. ``48213``), ``numbers`` / ``number`` for ``"number"`` (7 digits),
``uuids`` / ``uuid`` for ``"uuid"`` (12 hex digits from the rng as ``3f2a9c1e-7b4d``); keys are
words of :data:`KEY_WORDS` (``key_type="word"``) or 6 random lowercase letters (``"letters"``)):

``single``
  preamble ``"Some special magic {nouns} are hidden within the following text. Memorize them.
  \\n\\n"``; one needle ``"One of the special magic {nouns} for {key} is: {value}."``; question
  ``"What is the special magic {noun} for {key}? The special magic {noun} for {key} is"``;
  answer ``" {value}"``.
``multikey``
  as ``single`` plus ``num_distractors`` (default 3) needles of other keys with their own values;
  the question asks for the target key. A reader that copies a random needle's value scores
  ``1 / (num_distractors + 1)``.
``multivalue``
  one key in ``num_values`` (default 4) needles with different values; question ``"What are all
  the special magic {nouns} for {key}? The special magic {nouns} for {key} are"``; answer
  ``" v_1, v_2, ..."`` in the order of the needles in the text.
``multiquery``
  ``num_queries`` (default 4) keys, one needle each; question ``"What are all the special magic
  {nouns} for k_a, k_b, ... and k_z? The special magic {nouns} for k_a, ... and k_z are"`` with
  the keys in a shuffled order; answer their values in the question's order.
``variable_tracking``
  preamble ``"Memorize and track the chains of variable assignments hidden in the following
  text.\\n\\n"``; a chain of ``hops`` (default 4) hops is ``hops + 1`` needles ``"VAR QXWTZ =
  48213."``, ``"VAR LMPRA = QXWTZ."``, ... (names: 5 random capitals; value: 5 digits), plus
  ``num_distractors`` (default 1) chains of the same length with other names and values; question
  ``"Which variables are assigned the value 48213? The variables assigned the value 48213 are"``;
  answer the chain's names in chain order, ``" QXWTZ, LMPRA, ..."``.

Placement. ``depth`` is a fraction of the ``n_fill`` haystack tokens. The ``m`` target needles
(the one needle, the values of a ``multivalue`` key, the queried keys, the chain's statements) go
at ``p_i = round((depth + i (1 - depth) / m) n_fill)``, ``i = 0..m-1``: the first at ``depth``,
the others spread evenly towards the end, in order. Distractor needles (``multikey``) and each
distractor chain go at sorted positions drawn uniformly from ``[0, n_fill]``. Needles at the same
position keep their order (targets first). The haystack is real text ids from a random offset
(tiled if short, as :func:`~nested_jax.eval.tasks.make_niah_example` does), or, for
``haystack_text=None``, RULER's noise :data:`NOISE_TEXT` repeated from its start.

Tokenization. Each piece above is encoded on its own (the answer item by item with its separator,
so item spans are exact); for the byte tokenizer this equals encoding the whole text.

Chance. Exact match of a uniform or constant guess is ~0 (every answer has several distinct
tokens); :func:`ruler_chance` gives the exact values for a set of examples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from nested_jax.data.tokenizers import Tokenizer
from nested_jax.eval.seeds import as_rng
from nested_jax.eval.tasks import (
    PromptAnswer,
    answer_predictions,
    grid_markdown,
    haystack_window,
    token_ids,
)

KINDS = ("single", "multikey", "multivalue", "multiquery", "variable_tracking")
VALUE_TYPES = ("passkey", "number", "uuid")
KEY_TYPES = ("word", "letters")
NOISE_TEXT = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
KEY_WORDS = (
    "apple anchor barrel basket bridge button cactus candle castle cloud copper desert dragon "
    "engine falcon forest garden ginger harbor helmet island jacket jungle kettle kitten ladder "
    "lantern lemon magnet marble meadow mirror napkin orange oyster palace parrot pencil pepper "
    "planet pocket quartz rabbit rocket saddle salmon silver spider teapot tiger tunnel umbrella "
    "velvet violin wagon walnut whistle window yogurt zebra acorn beetle cobalt dolphin"
).split()
MAX_COUNT = len(KEY_WORDS)  # bound on every count option (distinct word keys available)

PREAMBLE = "Some special magic {nouns} are hidden within the following text. Memorize them.\n\n"
NEEDLE = "One of the special magic {nouns} for {key} is: {value}."
QUESTION_ONE = "What is the special magic {noun} for {keys}? The special magic {noun} for {keys} is"
QUESTION_ALL = (
    "What are all the special magic {nouns} for {keys}? The special magic {nouns} for {keys} are"
)
VT_PREAMBLE = (
    "Memorize and track the chains of variable assignments hidden in the following text.\n\n"
)
VT_FIRST = "VAR {name} = {value}."
VT_HOP = "VAR {name} = {prev}."
VT_QUESTION = (
    "Which variables are assigned the value {value}? The variables assigned the value {value} are"
)
ANSWER_SEP = ", "

_NOUNS = {
    "passkey": ("pass key", "pass keys"),
    "number": ("number", "numbers"),
    "uuid": ("uuid", "uuids"),
}
_HEX = "0123456789abcdef"
_NEEDLE_KEYS = {"value_type": "number", "key_type": "word"}
# Each kind's options and their defaults; counts are ints in [least, MAX_COUNT].
_DEFAULTS = {
    "single": dict(_NEEDLE_KEYS),
    "multikey": {**_NEEDLE_KEYS, "num_distractors": 3},
    "multivalue": {**_NEEDLE_KEYS, "num_values": 4},
    "multiquery": {**_NEEDLE_KEYS, "num_queries": 4},
    "variable_tracking": {"hops": 4, "num_distractors": 1},
}
_LEAST = {"num_values": 1, "num_queries": 1, "hops": 1}


@dataclass(frozen=True)
class RulerExample(PromptAnswer):
    """One RULER-style retrieval example.

    Attributes:
      tokens: int32[length], the prompt followed by the answer.
      prompt_len: number of prompt tokens; ``tokens[prompt_len:]`` is the answer.
      length: requested total length (== ``len(tokens)``).
      depth: requested depth fraction in [0, 1] of the first target needle.
      kind: one of :data:`KINDS`.
      haystack: ``"text"`` or ``"noise"``.
      answer_text: the answer items joined by ``", "`` (the answer tokens decode to
        ``" " + answer_text``).
      answers: the answer items in answer order (values, or variable names).
      query: what the question asks about (keys; for ``variable_tracking`` the value).
      needle_starts: index in ``tokens`` of each target needle piece (its leading space), in the
        order of :func:`make_ruler_example`'s placement (increasing).
      answer_spans: ``(start, stop)`` token range of each answer item within the answer (with its
        leading separator).
    """

    tokens: np.ndarray
    prompt_len: int
    length: int
    depth: float
    kind: str
    haystack: str
    answer_text: str
    answers: tuple[str, ...]
    query: tuple[str, ...]
    needle_starts: tuple[int, ...]
    answer_spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _Plan:
    """The text of one example before placement (targets in placement order)."""

    preamble: str
    targets: list[str]
    distractors: list[list[str]]  # groups whose members keep their order (chains)
    question: str
    answers: list[str]
    query: tuple[str, ...]


# ---- options and draws ------------------------------------------------------------------------


def _check_kind(kind) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind: unknown RULER task {kind!r}; known: {list(KINDS)}")
    return kind


def resolve_options(kind: str, **options) -> dict:
    """The options of ``kind`` with defaults filled in (module docstring), each checked.

    Raises:
      ValueError: naming ``kind``, an option ``kind`` does not take, or a value out of range
        (counts are ints in ``[1, MAX_COUNT]``, ``num_distractors`` of ``variable_tracking``
        from 0; ``multikey`` needs ``1 + num_distractors <= MAX_COUNT`` keys).
    """
    defaults = _DEFAULTS[_check_kind(kind)]
    for name in options:
        if name not in defaults:
            raise ValueError(
                f"{name}: not an option of RULER task {kind!r}; its options: {sorted(defaults)}"
            )
    out = {**defaults, **options}
    if "value_type" in out and out["value_type"] not in VALUE_TYPES:
        raise ValueError(
            f"value_type: expected one of {list(VALUE_TYPES)}, got {out['value_type']!r}"
        )
    if "key_type" in out and out["key_type"] not in KEY_TYPES:
        raise ValueError(f"key_type: expected one of {list(KEY_TYPES)}, got {out['key_type']!r}")
    for name in set(out) - {"value_type", "key_type"}:
        least = _LEAST.get(name, 0 if kind == "variable_tracking" else 1)
        most = MAX_COUNT - 1 if kind == "multikey" else MAX_COUNT
        value = out[name]
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name}: expected an int in [{least}, {most}], got {value!r}")
        if not least <= value <= most:
            raise ValueError(f"{name}: expected an int in [{least}, {most}], got {value}")
        out[name] = int(value)
    return out


def _distinct(draw: Callable[[], str], n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        item = draw()
        if item not in out:
            out.append(item)
    return out


def _value(rng: np.random.Generator, value_type: str) -> str:
    if value_type == "passkey":
        return str(int(rng.integers(10_000, 100_000)))
    if value_type == "number":
        return str(int(rng.integers(1_000_000, 10_000_000)))
    digits = "".join(_HEX[d] for d in rng.integers(0, 16, size=12))
    return digits[:8] + "-" + digits[8:]


def _keys(rng: np.random.Generator, key_type: str, n: int) -> list[str]:
    if key_type == "word":
        return [KEY_WORDS[i] for i in rng.choice(len(KEY_WORDS), size=n, replace=False)]
    return _distinct(lambda: "".join(chr(97 + c) for c in rng.integers(0, 26, size=6)), n)


def _and_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _plan_needles(kind: str, rng: np.random.Generator, opts: dict) -> _Plan:
    noun, nouns = _NOUNS[opts["value_type"]]
    n_keys = {
        "multikey": 1 + opts.get("num_distractors", 0),
        "multiquery": opts.get("num_queries", 1),
    }
    keys = _keys(rng, opts["key_type"], n_keys.get(kind, 1))
    n_values = opts["num_values"] if kind == "multivalue" else len(keys)
    values = _distinct(lambda: _value(rng, opts["value_type"]), n_values)
    if kind == "multivalue":
        needles = [NEEDLE.format(nouns=nouns, key=keys[0], value=v) for v in values]
    else:
        needles = [
            NEEDLE.format(nouns=nouns, key=k, value=v) for k, v in zip(keys, values, strict=True)
        ]
    preamble = PREAMBLE.format(nouns=nouns)
    if kind in ("single", "multikey"):
        question = QUESTION_ONE.format(noun=noun, keys=keys[0])
        return _Plan(
            preamble, needles[:1], [[s] for s in needles[1:]], question, values[:1], (keys[0],)
        )
    if kind == "multivalue":
        question = QUESTION_ALL.format(nouns=nouns, keys=keys[0])
        return _Plan(preamble, needles, [], question, values, (keys[0],))
    order = [int(i) for i in rng.permutation(len(keys))]
    asked = [keys[i] for i in order]
    question = QUESTION_ALL.format(nouns=nouns, keys=_and_list(asked))
    return _Plan(preamble, needles, [], question, [values[i] for i in order], tuple(asked))


def _plan_variable_tracking(rng: np.random.Generator, opts: dict) -> _Plan:
    n_chains, n_names = 1 + opts["num_distractors"], opts["hops"] + 1
    letters = lambda: "".join(chr(65 + c) for c in rng.integers(0, 26, size=5))  # noqa: E731
    names = _distinct(letters, n_chains * n_names)
    values = _distinct(lambda: _value(rng, "passkey"), n_chains)
    chains = []
    for c in range(n_chains):
        chain = names[c * n_names : (c + 1) * n_names]
        lines = [VT_FIRST.format(name=chain[0], value=values[c])]
        lines += [VT_HOP.format(name=b, prev=a) for a, b in zip(chain[:-1], chain[1:], strict=True)]
        chains.append(lines)
    question = VT_QUESTION.format(value=values[0])
    return _Plan(VT_PREAMBLE, chains[0], chains[1:], question, names[:n_names], (values[0],))


# ---- one example and the grid -----------------------------------------------------------------


def make_ruler_example(
    kind: str,
    haystack_ids: np.ndarray | None,
    tokenizer: Tokenizer,
    length: int,
    depth: float,
    rng: np.random.Generator,
    **options,
) -> RulerExample:
    """Build one example of exactly ``length`` tokens (layouts in the module docstring).

    Args:
      kind: one of :data:`KINDS`.
      haystack_ids: int[N] token ids of the haystack text (tiled if shorter than needed, read from
        a random offset), or ``None`` for the noise haystack (:data:`NOISE_TEXT` repeated).
      tokenizer: encodes every piece (and supplies ``bos_id``).
      length: total tokens (prompt + answer).
      depth: where the first target needle goes, as a fraction of the haystack tokens.
      rng: source of keys, values, names, the haystack offset and distractor positions.
      **options: the kind's options (:func:`resolve_options`).

    Returns:
      A :class:`RulerExample`.
    """
    opts = resolve_options(kind, **options)
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
        raise ValueError(f"length: expected an int >= 1, got {length!r}")
    ok = not isinstance(depth, bool) and isinstance(depth, int | float | np.integer | np.floating)
    if not ok or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a fraction in [0, 1], got {depth!r}")
    if haystack_ids is not None:
        haystack_ids = np.asarray(haystack_ids, dtype=np.int32)
        if haystack_ids.ndim != 1 or haystack_ids.size == 0:
            raise ValueError(
                f"haystack_ids: expected a non-empty [N] array or None, got {haystack_ids.shape}"
            )
    if kind == "variable_tracking":
        plan = _plan_variable_tracking(rng, opts)
    else:
        plan = _plan_needles(kind, rng, opts)
    head = np.asarray([] if tokenizer.bos_id is None else [tokenizer.bos_id], np.int32)
    head = np.concatenate([head, token_ids(tokenizer, plan.preamble)])
    pieces = [token_ids(tokenizer, " " + s + " ") for s in plan.targets]
    groups = [[token_ids(tokenizer, " " + s + " ") for s in g] for g in plan.distractors]
    question = token_ids(tokenizer, "\n\n" + plan.question)
    items = [
        token_ids(tokenizer, (" " if i == 0 else ANSWER_SEP) + a)
        for i, a in enumerate(plan.answers)
    ]
    answer = np.concatenate(items)
    fixed = head.size + question.size + answer.size + sum(p.size for p in pieces)
    fixed += sum(p.size for g in groups for p in g)
    n_fill = int(length) - fixed
    if n_fill < 0:
        raise ValueError(
            f"length: {length} tokens cannot hold the {kind} needles, question and answer "
            f"({fixed} tokens)"
        )
    fill = _haystack(haystack_ids, tokenizer, n_fill, rng)
    body, starts = _place(fill, pieces, groups, float(depth), rng)
    tokens = np.concatenate([head, body, question, answer]).astype(np.int32)
    assert tokens.size == length
    bounds = np.cumsum([0] + [it.size for it in items])
    return RulerExample(
        tokens=tokens,
        prompt_len=int(length - answer.size),
        length=int(length),
        depth=float(depth),
        kind=kind,
        haystack="noise" if haystack_ids is None else "text",
        answer_text=ANSWER_SEP.join(plan.answers),
        answers=tuple(plan.answers),
        query=plan.query,
        needle_starts=tuple(int(head.size + a) for a in starts),
        answer_spans=tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)),
    )


def _place(fill, pieces, groups, depth: float, rng) -> tuple[np.ndarray, list[int]]:
    """The haystack with the needles inserted (placement in the module docstring), and where each
    target piece starts in it."""
    n_fill, m = fill.size, len(pieces)
    placed = [(round((depth + i * (1.0 - depth) / m) * n_fill), i, p) for i, p in enumerate(pieces)]
    for g in groups:
        spots = np.sort(rng.integers(0, n_fill + 1, size=len(g)))
        first = len(placed)
        placed += [(int(s), first + j, p) for j, (s, p) in enumerate(zip(spots, g, strict=True))]
    placed.sort(key=lambda t: (t[0], t[1]))
    parts, starts, at, cursor = [], [0] * m, 0, 0
    for pos, order, piece in placed:
        parts += [fill[cursor:pos], piece]
        at += pos - cursor
        cursor = pos
        if order < m:
            starts[order] = at
        at += piece.size
    return np.concatenate([*parts, fill[cursor:]]), starts


def _haystack(haystack_ids, tokenizer: Tokenizer, n_fill: int, rng) -> np.ndarray:
    """``n_fill`` haystack tokens: the noise from its start, or text from a random offset."""
    if haystack_ids is None:
        noise = token_ids(tokenizer, NOISE_TEXT + " ")
        return np.tile(noise, n_fill // noise.size + 1)[:n_fill]
    return haystack_window(haystack_ids, n_fill, rng)


def ruler_grid(
    kind: str,
    haystack_text: str | None,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    n_per_cell: int,
    seed: int | np.random.Generator,
    **options,
) -> list[RulerExample]:
    """``n_per_cell`` examples of ``kind`` per (length, depth) pair, deterministic in ``seed``.

    Args:
      kind: one of :data:`KINDS`.
      haystack_text: corpus text for the filler, or ``None`` for RULER's noise haystack.
      tokenizer: the model's tokenizer.
      lengths: total token lengths.
      depths: depth fractions in [0, 1] of the first target needle.
      n_per_cell: examples per (length, depth) cell.
      seed: an int (or a ``numpy.random.Generator``) seeding every draw.
      **options: the kind's options (:func:`resolve_options`), e.g. ``value_type="uuid"``,
        ``num_distractors=7``, ``hops=2``.

    Returns:
      Examples ordered by length, then depth, then index.
    """
    resolve_options(kind, **options)
    if haystack_text is not None and (
        not isinstance(haystack_text, str) or not haystack_text.strip()
    ):
        raise ValueError("haystack_text: expected non-empty text or None (the noise haystack)")
    if not lengths or any(isinstance(n, bool) or int(n) != n or n < 1 for n in lengths):
        raise ValueError(f"lengths: expected positive integers, got {list(lengths)}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths: expected fractions in [0, 1], got {list(depths)}")
    if isinstance(n_per_cell, bool) or not isinstance(n_per_cell, int) or n_per_cell < 1:
        raise ValueError(f"n_per_cell: expected an int >= 1, got {n_per_cell!r}")
    try:
        rng = as_rng(seed)
    except ValueError:
        raise ValueError(f"seed: expected an int or a numpy Generator, got {seed!r}") from None
    hay = None if haystack_text is None else token_ids(tokenizer, haystack_text)
    return [
        make_ruler_example(kind, hay, tokenizer, int(n), float(d), rng, **options)
        for n in lengths
        for d in depths
        for _ in range(n_per_cell)
    ]


# ---- scoring ----------------------------------------------------------------------------------


def _answer_hits(logits_fn, examples: Sequence[RulerExample], batch_size: int) -> list[np.ndarray]:
    """``bool[n_answer]`` per example: the teacher-forced argmax equals the answer token."""
    predictions = answer_predictions(logits_fn, examples, batch_size)
    return [np.asarray(p == ex.answer) for p, ex in zip(predictions, examples, strict=True)]


def _by_cell(examples: Sequence[RulerExample], values: Sequence[float]) -> dict:
    cells: dict[tuple[int, float], list[float]] = {}
    for ex, v in zip(examples, values, strict=True):
        cells.setdefault((ex.length, ex.depth), []).append(v)
    table: dict[int, dict[float, float]] = {}
    for (length, depth), vs in cells.items():
        table.setdefault(length, {})[depth] = float(np.mean(vs))
    return table


def score_ruler(
    logits_fn: Callable[[np.ndarray], np.ndarray],
    examples: Sequence[RulerExample],
    batch_size: int = 8,
) -> dict:
    """Teacher-forced exact match and recall, overall and by length × depth.

    Examples of one length are stacked into batches of up to ``batch_size`` and passed whole
    (``int32[B, length]``) to ``logits_fn``; the predictions at positions ``prompt_len - 1 ..
    length - 2`` are compared with the answer tokens. Per example: ``correct`` (all right),
    ``token_recall`` (fraction of answer tokens right) and ``item_recall`` (fraction of answer
    items, :attr:`RulerExample.answer_spans`, whose tokens are all right: RULER's recall).

    Args:
      logits_fn: ``tokens int32[B, L] -> logits [B, L, V]`` (causal), or directly the argmax ids
        ``int [B, L]`` (as :func:`nested_jax.eval.tasks.score_niah` takes).
      examples: from :func:`ruler_grid` (kinds may be mixed).
      batch_size: examples per ``logits_fn`` call.

    Returns:
      ``{"accuracy": {length: {depth: exact}}, "recall": {length: {depth: item recall}},
      "overall", "overall_recall", "overall_token_recall", "num_examples", "correct",
      "item_recall", "token_recall"}`` (the last three are per example, in input order).
    """
    if not examples or not all(isinstance(ex, RulerExample) for ex in examples):
        raise ValueError("examples: expected a non-empty sequence of RulerExample")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    hits = _answer_hits(logits_fn, examples, batch_size)
    correct = [bool(h.all()) for h in hits]
    token_recall = [float(h.mean()) for h in hits]
    item_recall = [
        float(np.mean([h[a:b].all() for a, b in ex.answer_spans]))
        for h, ex in zip(hits, examples, strict=True)
    ]
    return {
        "accuracy": _by_cell(examples, correct),
        "recall": _by_cell(examples, item_recall),
        "overall": float(np.mean(correct)),
        "overall_recall": float(np.mean(item_recall)),
        "overall_token_recall": float(np.mean(token_recall)),
        "num_examples": len(examples),
        "correct": correct,
        "item_recall": item_recall,
        "token_recall": token_recall,
    }


def ruler_chance(examples: Sequence[RulerExample], vocab_size: int) -> dict:
    """What guessing scores on ``examples`` (teacher-forced, as :func:`score_ruler` measures).

    Uniform guess (argmax uniform over ``V`` ids, independently per position), in expectation:
    ``exact = mean_e V^-n_e`` (``n_e`` answer tokens, so ~0), ``token_recall = 1 / V``,
    ``recall = mean_e mean_items V^-n_item``. Best constant guess (one id ``c`` everywhere):
    ``constant_exact = max_c mean_e [answer_e == c everywhere]`` (0 whenever every answer holds
    two different tokens) and ``constant_token_recall = max_c mean_e mean(answer_e == c)``,
    reached by ``constant_id``.

    Raises:
      ValueError: naming ``examples`` (empty) or ``vocab_size`` (not above every token id).
    """
    if not examples or not all(isinstance(ex, RulerExample) for ex in examples):
        raise ValueError("examples: expected a non-empty sequence of RulerExample")
    top = max(int(ex.tokens.max()) for ex in examples)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= top:
        raise ValueError(
            f"vocab_size: expected an int > the largest token id {top}, got {vocab_size!r}"
        )
    v = float(vocab_size)
    share = np.zeros(vocab_size)
    whole = np.zeros(vocab_size)
    for ex in examples:
        ids, counts = np.unique(ex.answer, return_counts=True)
        share[ids] += counts / ex.answer.size
        if ids.size == 1:
            whole[ids[0]] += 1.0
    n = len(examples)
    return {
        "exact": float(np.mean([v**-ex.answer.size for ex in examples])),
        "token_recall": 1.0 / v,
        "recall": float(
            np.mean([np.mean([v ** -(b - a) for a, b in ex.answer_spans]) for ex in examples])
        ),
        "constant_exact": float(whole.max() / n),
        "constant_token_recall": float(share.max() / n),
        "constant_id": int(share.argmax()),
    }


def ruler_markdown(result: dict) -> str:
    """:func:`score_ruler`'s tables as Markdown: rows length, columns depth, cells ``exact /
    recall``, then the overall numbers."""
    exact, recall = result["accuracy"], result["recall"]
    lines = grid_markdown(exact, lambda n, d: f"{exact[n][d]:.2f} / {recall[n][d]:.2f}")
    lines.append(
        f"\ncells: exact match / recall; overall exact {result['overall']:.3f}, recall "
        f"{result['overall_recall']:.3f}, token recall {result['overall_token_recall']:.3f} "
        f"over {result['num_examples']} examples"
    )
    return "\n".join(lines)
