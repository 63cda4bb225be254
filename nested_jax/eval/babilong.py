"""BABILong-style reasoning in a haystack: generated bAbI qa1-qa5 stories hidden in real text.

BABILong (Kuratov et al. 2024) scatters the sentences of a bAbI story through long unrelated text
and asks the story's question at the end. Here the stories come from a small seeded world
simulator (nothing is downloaded), so the ground truth is known and every question has exactly
one answer word.

Prompt layout (token space, exactly ``length`` tokens; the facts keep their story order and are
inserted at seeded random sentence starts of the haystack, so each one follows a sentence end)::

    [bos] h[0:p1] " Mary went to the kitchen." h[p1:p2] " John picked up the apple." ...
          h[pk:n] "\\n\\nQuestion: Where is the apple? Answer:" " garden"

``h`` is a window of ``n`` haystack tokens starting at a sentence start (the text is tiled when it
is shorter than ``n``), ``p1 <= ... <= pk`` are sentence starts inside the window (two facts may
be adjacent), and ``n`` is whatever is left of ``length`` after the bos, facts, question and
answer. Scoring is teacher-forced as for the passkey NIAH of :mod:`nested_jax.eval.tasks`: an
example is correct iff the argmax at every answer position equals the answer tokens (greedy
decoding from the prompt emits the answer).

World: people ``Mary John Sandra Daniel``, places ``kitchen garden office hallway bathroom
bedroom``, objects ``apple football milk book``. Facts (verbs drawn among the synonyms)::

    move     "Mary went to the kitchen."  (moved / journeyed / travelled to)
    pick up  "Mary picked up the apple."  (grabbed); only where the object lies, or a new object
    drop     "Mary dropped the apple."    (put down); the object stays at Mary's place
    give     "Mary gave the apple to John." (handed); John must be at Mary's place
    relation "The kitchen is north of the garden." (north / south / east / west: grid neighbours)

A held object is wherever its holder is. An object's *path* is the list of places it has been at:
the place where it is first picked up, then every place its holder moves to while holding it
(consecutive repeats merged; drops and gives keep it in place).

Tasks (question forms; the answer is one word; chance = a uniform guess among the words of the
answer's kind, see :func:`babilong_chance`):

======  ==============================  ===================================================  ======
task    facts                           questions -> answer                                  chance
======  ==============================  ===================================================  ======
qa1     moves                           "Where is Mary?" -> her last place                   1/6
qa2     moves, pick up, drop            "Where is the apple?" -> its holder's place, or      1/6
                                        where it was dropped
qa3     moves, pick up, drop            "Where was the apple before the kitchen?" -> the     1/6
                                        place before the kitchen in the apple's path
                                        (asked only when the kitchen is in the path once,
                                        not first)
qa4     relations (a tree of 1..5 grid  "What is north of the garden?" / "What is the        1/6
        neighbours among the places)    garden north of?" (about a stated relation or its
                                        converse)
qa5     moves, pick up, drop, give      "Who gave the milk to John?" / "What did Mary give   1/4
                                        to John?" / "Who received the milk?" / "Who did
                                        Mary give the milk to?" (asked only when the gives
                                        that match the question all have the same answer)
======  ==============================  ===================================================  ======

``n_facts`` is the number of fact sentences (the story length): at least 1, 2, 3, 1, 4 for qa1..qa5
(the fewest facts that can support the question), at most 5 for qa4 (six places in a tree).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from nested_jax.data.tokenizers import Tokenizer
from nested_jax.eval.seeds import as_rng
from nested_jax.eval.tasks import answer_predictions, token_ids

PEOPLE = ("Mary", "John", "Sandra", "Daniel")
PLACES = ("kitchen", "garden", "office", "hallway", "bathroom", "bedroom")
OBJECTS = ("apple", "football", "milk", "book")
DIRECTIONS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
MOVE_VERBS = ("went to", "moved to", "journeyed to", "travelled to")
PICK_VERBS = ("picked up", "grabbed")
DROP_VERBS = ("dropped", "put down")
GIVE_VERBS = ("gave", "handed")

TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")
MIN_FACTS = {"qa1": 1, "qa2": 2, "qa3": 3, "qa4": 1, "qa5": 4}
MAX_FACTS = {"qa4": len(PLACES) - 1}
DEFAULT_N_FACTS = {"qa1": 10, "qa2": 10, "qa3": 10, "qa4": 2, "qa5": 10}
# Answer kinds of each task's question forms (equally weighted in the chance).
_FORM_KINDS = {
    "qa1": (PLACES,),
    "qa2": (PLACES,),
    "qa3": (PLACES,),
    "qa4": (PLACES, PLACES),
    "qa5": (PEOPLE, OBJECTS, PEOPLE, PEOPLE),
}
# Relative frequency of each action kind while a story is simulated (only valid kinds compete).
_ACTION_WEIGHTS = {
    "qa1": {"move": 1.0},
    "qa2": {"move": 0.5, "pick": 0.3, "drop": 0.2},
    "qa3": {"move": 0.5, "pick": 0.3, "drop": 0.2},
    "qa5": {"move": 0.4, "pick": 0.2, "drop": 0.1, "give": 0.3},
}
_MAX_ATTEMPTS = 10_000
QUESTION_PREFIX = "\n\nQuestion: "
ANSWER_PREFIX = " Answer:"
# A sentence ends at . ! or ? (and closing quotes / brackets) followed by whitespace and a capital
# (maybe after opening quotes); not after an initial or Mr / Mrs / Ms / Dr / St.
_SENTENCE_END = re.compile(
    r"(?<!\b[A-Z])(?<!\bMr)(?<!\bMrs)(?<!\bMs)(?<!\bDr)(?<!\bSt)"
    r"[.!?][\"'\u201d\u2019)\]]*(?=\s+[\"'\u201c\u2018(\[_]*[A-Z])"
)


# ---- stories ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Story:
    """One generated bAbI-style story.

    Attributes:
      task: ``"qa1"`` .. ``"qa5"``.
      facts: the fact sentences in story order (each ends with ".").
      question: the question sentence (ends with "?").
      answer: the one-word answer.
    """

    task: str
    facts: tuple[str, ...]
    question: str
    answer: str


def _pick(rng: np.random.Generator, items: Sequence):
    return items[int(rng.integers(len(items)))]


class _World:
    """People, objects and the give history; every action keeps the state consistent."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.at: dict[str, str] = {}  # person -> place (people appear with their first move)
        self.holder: dict[str, str] = {}  # object -> person holding it
        self.lies: dict[str, str] = {}  # object -> place where it was dropped
        self.path: dict[str, list[str]] = {o: [] for o in OBJECTS}
        self.gives: list[tuple[str, str, str]] = []  # (giver, object, receiver)

    def where(self, obj: str) -> str | None:
        return self.at[self.holder[obj]] if obj in self.holder else self.lies.get(obj)

    def _visit(self, obj: str, place: str) -> None:
        if not self.path[obj] or self.path[obj][-1] != place:
            self.path[obj].append(place)

    def actions(self, kind: str) -> list[tuple]:
        at, holder = self.at, self.holder
        if kind == "move":
            return [(p, x) for p in PEOPLE for x in PLACES if at.get(p) != x]
        if kind == "pick":
            return [
                (p, o)
                for p in at
                for o in OBJECTS
                if o not in holder and self.lies.get(o, at[p]) == at[p]
            ]
        if kind == "drop":
            return list((p, o) for o, p in holder.items())
        return [(p, o, q) for o, p in holder.items() for q in at if q != p and at[q] == at[p]]

    def apply(self, kind: str, action: tuple) -> str:
        """Update the state and return the fact sentence."""
        verb = {"move": MOVE_VERBS, "pick": PICK_VERBS, "drop": DROP_VERBS, "give": GIVE_VERBS}
        v = _pick(self.rng, verb[kind])
        if kind == "move":
            p, x = action
            self.at[p] = x
            for o, h in self.holder.items():
                if h == p:
                    self._visit(o, x)
            return f"{p} {v} the {x}."
        if kind == "pick":
            p, o = action
            self.holder[o] = p
            self.lies.pop(o, None)
            self._visit(o, self.at[p])
            return f"{p} {v} the {o}."
        if kind == "drop":
            p, o = action
            del self.holder[o]
            self.lies[o] = self.at[p]
            return f"{p} {v} the {o}."
        p, o, q = action
        self.holder[o] = q
        self.gives.append((p, o, q))
        return f"{p} {v} the {o} to {q}."

    def step(self, weights: dict[str, float]) -> str:
        options = {k: self.actions(k) for k in weights}
        kinds = [k for k in weights if options[k]]
        w = np.asarray([weights[k] for k in kinds], np.float64)
        kind = kinds[int(self.rng.choice(len(kinds), p=w / w.sum()))]
        return self.apply(kind, _pick(self.rng, options[kind]))


def _unique(answers: set[str], kind: Sequence[str]) -> str:
    assert len(answers) == 1, f"question is ambiguous: {sorted(answers)}"
    (answer,) = answers
    assert answer in kind, answer
    return answer


def _question(task: str, world: _World) -> tuple[str, str] | None:
    """A question with a unique answer about the world, or None if the story supports none."""
    rng = world.rng
    if task == "qa1":
        if not world.at:
            return None
        p = _pick(rng, list(world.at))
        return f"Where is {p}?", _unique({world.at[p]}, PLACES)
    if task == "qa2":
        located = [o for o in OBJECTS if world.where(o) is not None]
        if not located:
            return None
        o = _pick(rng, located)
        return f"Where is the {o}?", _unique({world.where(o)}, PLACES)
    if task == "qa3":
        pairs = [(o, x) for o in OBJECTS for x in world.path[o][1:] if world.path[o].count(x) == 1]
        if not pairs:
            return None
        o, x = _pick(rng, pairs)
        path = world.path[o]
        before = {path[i - 1] for i in range(1, len(path)) if path[i] == x}
        return f"Where was the {o} before the {x}?", _unique(before, PLACES)
    # qa5: every question form built from every give; keep those with one answer.
    gives = world.gives
    forms: dict[str, dict[str, set[str]]] = {k: {} for k in ("who", "what", "received", "to")}
    for g, o, q in gives:
        forms["who"].setdefault(f"Who gave the {o} to {q}?", set()).add(g)
        forms["what"].setdefault(f"What did {g} give to {q}?", set()).add(o)
        forms["received"].setdefault(f"Who received the {o}?", set()).add(q)
        forms["to"].setdefault(f"Who did {g} give the {o} to?", set()).add(q)
    usable = {k: [s for s, a in qs.items() if len(a) == 1] for k, qs in forms.items()}
    kinds = [k for k in usable if usable[k]]
    if not kinds:
        return None
    kind = _pick(rng, kinds)
    question = _pick(rng, usable[kind])
    return question, _unique(forms[kind][question], OBJECTS if kind == "what" else PEOPLE)


def _relations_story(n_facts: int, rng: np.random.Generator) -> Story:
    """qa4: ``n_facts`` relations forming a tree of grid neighbours among ``n_facts + 1`` places."""
    places = [PLACES[i] for i in rng.permutation(len(PLACES))[: n_facts + 1]]
    cell = {places[0]: (0, 0)}
    taken = {(0, 0)}
    rel: list[tuple[str, str, str]] = []  # (a, direction, b): a is <direction> of b
    for new in places[1:]:
        free = [
            (old, d)
            for old in cell
            for d, (dx, dy) in DIRECTIONS.items()
            if (cell[old][0] + dx, cell[old][1] + dy) not in taken
        ]
        old, d = _pick(rng, free)
        dx, dy = DIRECTIONS[d]
        cell[new] = (cell[old][0] + dx, cell[old][1] + dy)
        taken.add(cell[new])
        rel.append((new, d, old) if rng.integers(2) else (old, OPPOSITE[d], new))
    rel = [rel[i] for i in rng.permutation(len(rel))]
    facts = tuple(f"The {a} is {d} of the {b}." for a, d, b in rel)
    known = rel + [(b, OPPOSITE[d], a) for a, d, b in rel]  # every relation with its converse
    a, d, b = _pick(rng, known)
    if rng.integers(2):
        question = f"What is {d} of the {b}?"
        answers = {x for x, dd, y in known if dd == d and y == b}
    else:
        question = f"What is the {a} {d} of?"
        answers = {y for x, dd, y in known if dd == d and x == a}
    return Story("qa4", facts, question, _unique(answers, PLACES))


def _check_task(task) -> str:
    if task not in TASKS:
        raise ValueError(f"task: expected one of {list(TASKS)}, got {task!r}")
    return task


def _check_n_facts(task: str, n_facts) -> int:
    if n_facts is None:
        return DEFAULT_N_FACTS[task]
    least, most = MIN_FACTS[task], MAX_FACTS.get(task)
    if isinstance(n_facts, bool) or not isinstance(n_facts, int | np.integer) or n_facts < least:
        raise ValueError(f"n_facts: {task} needs an int >= {least} facts, got {n_facts!r}")
    if most is not None and n_facts > most:
        raise ValueError(
            f"n_facts: {task} relates at most {most} facts ({len(PLACES)} places), got {n_facts}"
        )
    return int(n_facts)


def make_story(task: str, n_facts: int | None, rng_or_seed) -> Story:
    """One story of ``n_facts`` facts and its question (module docstring), drawn by the simulator.

    Stories are simulated action by action (a random valid move / pick up / drop / give, weighted
    by kind) and redrawn until the question form has a unique answer, which the simulator's state
    gives; qa4 builds a random tree of grid neighbours directly.

    Args:
      task: ``"qa1"`` .. ``"qa5"``.
      n_facts: number of fact sentences (None: ``DEFAULT_N_FACTS[task]``); bounds in the module
        docstring.
      rng_or_seed: an int seed or a ``numpy.random.Generator``.

    Returns:
      A :class:`Story`.
    """
    task = _check_task(task)
    n_facts = _check_n_facts(task, n_facts)
    rng = as_rng(rng_or_seed)
    if task == "qa4":
        return _relations_story(n_facts, rng)
    for _ in range(_MAX_ATTEMPTS):
        world = _World(rng)
        facts = tuple(world.step(_ACTION_WEIGHTS[task]) for _ in range(n_facts))
        asked = _question(task, world)
        if asked is not None:
            return Story(task, facts, *asked)
    raise RuntimeError(f"{task}: no answerable story of {n_facts} facts in {_MAX_ATTEMPTS} draws")


# ---- examples in a haystack -------------------------------------------------------------------


@dataclass(frozen=True)
class Haystack:
    """Token ids of the filler text and where its sentences start.

    Attributes:
      ids: int32[N] token ids.
      sentence_starts: int64[S] increasing token indices in ``[0, N)`` where a sentence (with its
        leading whitespace) begins, 0 included; None: no sentence information (facts and the
        window start may fall anywhere, as for a raw id array).
    """

    ids: np.ndarray
    sentence_starts: np.ndarray | None = None


def encode_haystack(text: str, tokenizer: Tokenizer) -> Haystack:
    """Tokenize ``text`` sentence by sentence, recording each sentence's first token.

    A sentence ends at ``.!?`` (plus closing quotes) before whitespace and a capital letter, not
    after an initial or ``Mr Mrs Ms Dr St``; the cut is before the whitespace, so every sentence
    but the first starts with it. The pieces concatenate back to ``text``.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("haystack_text: expected non-empty text")
    cuts = [0, *(m.end() for m in _SENTENCE_END.finditer(text)), len(text)]
    pieces = [
        tokenizer.encode(text[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a
    ]
    sizes = np.fromiter(map(len, pieces), np.int64, count=len(pieces))
    ids = np.fromiter(chain.from_iterable(pieces), np.int32, count=int(sizes.sum()))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    starts = np.unique(starts[starts < ids.size])
    if ids.size == 0:
        raise ValueError("haystack_text: encodes to no tokens")
    return Haystack(ids, starts)


@dataclass(frozen=True)
class BabilongExample:
    """One story hidden in a haystack.

    Attributes:
      tokens: int32[length], the prompt followed by the answer.
      prompt_len: number of prompt tokens; ``tokens[prompt_len:]`` is the answer.
      length: requested total length (== ``len(tokens)``).
      task: ``"qa1"`` .. ``"qa5"``.
      n_facts: number of fact sentences.
      answer: the answer word (the answer tokens encode ``" " + answer``).
      question: the question sentence.
      facts: the fact sentences in order.
      fact_starts: index in ``tokens`` where each fact (with its leading space) begins; increasing.
    """

    tokens: np.ndarray
    prompt_len: int
    length: int
    task: str
    n_facts: int
    answer: str
    question: str
    facts: tuple[str, ...]
    fact_starts: tuple[int, ...]

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[: self.prompt_len]

    @property
    def answer_tokens(self) -> np.ndarray:
        return self.tokens[self.prompt_len :]


def make_babilong_example(
    haystack: Haystack | np.ndarray,
    tokenizer: Tokenizer,
    task: str,
    length: int,
    rng: np.random.Generator,
    n_facts: int | None = None,
) -> BabilongExample:
    """Build one example of exactly ``length`` tokens (layout in the module docstring).

    Cost is O(length) array work (one concatenation) plus the story simulation.

    Args:
      haystack: from :func:`encode_haystack`, or int[N] token ids (then facts may split words).
      tokenizer: encodes facts, question and answer (and supplies ``bos_id``).
      task: ``"qa1"`` .. ``"qa5"``.
      length: total tokens (prompt + answer).
      rng: draws the story, the haystack window and the fact positions.
      n_facts: story length (None: the task's default).

    Returns:
      A :class:`BabilongExample`.
    """
    if not isinstance(haystack, Haystack):
        haystack = Haystack(np.asarray(haystack))
    ids = np.asarray(haystack.ids, dtype=np.int32)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"haystack: expected non-empty [N] token ids, got shape {ids.shape}")
    story = make_story(task, n_facts, rng)
    head = np.asarray([] if tokenizer.bos_id is None else [tokenizer.bos_id], np.int32)
    facts = [token_ids(tokenizer, " " + f) for f in story.facts]
    question = token_ids(tokenizer, QUESTION_PREFIX + story.question + ANSWER_PREFIX)
    answer = token_ids(tokenizer, " " + story.answer)
    fixed = head.size + sum(f.size for f in facts) + question.size + answer.size
    n_fill = int(length) - fixed
    if n_fill < 0:
        raise ValueError(
            f"length: {length} tokens cannot hold the {len(facts)} facts, question and answer "
            f"({fixed} tokens)"
        )
    starts = haystack.sentence_starts
    if ids.size < n_fill + 1:
        reps = n_fill // ids.size + 2
        if starts is not None:
            starts = (np.asarray(starts)[None, :] + ids.size * np.arange(reps)[:, None]).ravel()
        ids = np.tile(ids, reps)
    if starts is None:
        offset = int(rng.integers(0, ids.size - n_fill + 1))
        where = np.arange(n_fill + 1)
    else:
        starts = np.asarray(starts, np.int64)
        usable = starts[: np.searchsorted(starts, ids.size - n_fill, side="right")]
        offset = int(usable[rng.integers(usable.size)]) if usable.size else 0
        lo, hi = np.searchsorted(starts, [offset, offset + n_fill], side="left")
        inside = starts[lo : hi + 1]
        where = np.union1d([0], inside[inside <= offset + n_fill] - offset)
    fill = ids[offset : offset + n_fill]
    pos = np.sort(rng.choice(where, size=len(facts), replace=True))
    pieces, fact_starts, prev, done = [head], [], 0, head.size
    for p, f in zip(pos.tolist(), facts, strict=True):
        pieces += [fill[prev:p], f]
        fact_starts.append(done + p - prev)
        done += p - prev + f.size
        prev = p
    pieces += [fill[prev:], question, answer]
    tokens = np.concatenate(pieces).astype(np.int32)
    assert tokens.size == length, (tokens.size, length)
    return BabilongExample(
        tokens=tokens,
        prompt_len=int(length - answer.size),
        length=int(length),
        task=story.task,
        n_facts=len(facts),
        answer=story.answer,
        question=story.question,
        facts=story.facts,
        fact_starts=tuple(fact_starts),
    )


def babilong_grid(
    task: str,
    haystack_text: str,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    n_per_length: int,
    seed: int,
    n_facts: int | None = None,
) -> list[BabilongExample]:
    """``n_per_length`` examples of ``task`` at every length, deterministic in ``seed``.

    Args:
      task: ``"qa1"`` .. ``"qa5"``.
      haystack_text: real text for the filler (e.g. validation documents joined).
      tokenizer: the model's tokenizer.
      lengths: total token lengths (each must hold the facts, question and answer).
      n_per_length: examples per length.
      seed: an int seed (or a ``numpy.random.Generator``) for the stories, windows and positions.
      n_facts: story length (None: ``DEFAULT_N_FACTS[task]``).

    Returns:
      Examples ordered by length, then index.
    """
    task = _check_task(task)
    n_facts = _check_n_facts(task, n_facts)
    if isinstance(lengths, str | bytes) or not lengths:
        raise ValueError(f"lengths: expected positive integers, got {lengths!r}")
    if any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 for n in lengths):
        raise ValueError(f"lengths: expected positive integers, got {list(lengths)}")
    if isinstance(n_per_length, bool) or not isinstance(n_per_length, int) or n_per_length < 1:
        raise ValueError(f"n_per_length: expected an int >= 1, got {n_per_length!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer | np.random.Generator):
        raise ValueError(f"seed: expected an int seed or a numpy Generator, got {seed!r}")
    hay = encode_haystack(haystack_text, tokenizer)
    rng = as_rng(seed)
    return [
        make_babilong_example(hay, tokenizer, task, int(n), rng, n_facts)
        for n in lengths
        for _ in range(n_per_length)
    ]


# ---- scoring ----------------------------------------------------------------------------------


def score_babilong(
    logits_fn: Callable[[np.ndarray], np.ndarray],
    examples: Sequence[BabilongExample],
    batch_size: int = 8,
) -> dict:
    """Teacher-forced exact-match accuracy, overall, by length and by task × length.

    Examples of one length (of any tasks) are stacked into batches of up to ``batch_size`` and
    passed whole (``int32[B, length]``) to ``logits_fn``; the predictions at positions
    ``prompt_len - 1 .. length - 2`` must equal the answer tokens.

    Args:
      logits_fn: ``tokens int32[B, L] -> logits [B, L, V]`` (causal), or directly the argmax ids
        ``int [B, L]`` (as :func:`nested_jax.eval.tasks.score_niah` takes).
      examples: from :func:`babilong_grid` (grids of several tasks may be concatenated).
      batch_size: examples per ``logits_fn`` call.

    Returns:
      ``{"accuracy": {length: acc}, "by_task": {task: {length: acc}}, "overall": acc,
      "num_examples": n, "correct": [bool per example, in input order]}``.
    """
    if not examples:
        raise ValueError("examples: expected at least one BABILong example")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    predictions = answer_predictions(logits_fn, examples, batch_size)
    correct = [
        bool(np.array_equal(p, ex.answer_tokens))
        for p, ex in zip(predictions, examples, strict=True)
    ]
    lengths: dict[int, list[bool]] = {}
    cells: dict[tuple[str, int], list[bool]] = {}
    for ex, ok in zip(examples, correct, strict=True):
        lengths.setdefault(ex.length, []).append(ok)
        cells.setdefault((ex.task, ex.length), []).append(ok)
    by_task: dict[str, dict[int, float]] = {}
    for (task, length), oks in sorted(cells.items()):
        by_task.setdefault(task, {})[length] = float(np.mean(oks))
    return {
        "accuracy": {n: float(np.mean(oks)) for n, oks in sorted(lengths.items())},
        "by_task": by_task,
        "overall": float(np.mean(correct)),
        "num_examples": len(examples),
        "correct": correct,
    }


def babilong_chance(task: str) -> float:
    """Chance accuracy of ``task``: a uniform guess among the candidate words of the answer's kind
    (6 places: 1/6 for qa1-qa4; 4 people or 4 objects: 1/4 for qa5), averaged over the task's
    question forms as equally frequent (exact for any mix of forms here, since every qa5 form has
    4 candidates)."""
    task = _check_task(task)
    return float(np.mean([1.0 / len(kind) for kind in _FORM_KINDS[task]]))


def babilong_markdown(result: dict) -> str:
    """The accuracy table of :func:`score_babilong` as Markdown (rows: task, columns: length)."""
    table = result["by_task"]
    lengths = sorted({n for row in table.values() for n in row})
    lines = [
        "| task | " + " | ".join(f"{n}" for n in lengths) + " | chance |",
        "|---|" + "---:|" * (len(lengths) + 1),
    ]
    for task in sorted(table):
        cells = [f"{table[task][n]:.2f}" if n in table[task] else "" for n in lengths]
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {babilong_chance(task):.2f} |")
    lines.append(
        f"\noverall accuracy {result['overall']:.3f} over {result['num_examples']} examples"
    )
    return "\n".join(lines)
