"""bAbI-style stories qa1-qa5 for BABILong (:mod:`nested_jax.eval.babilong`): a seeded world
simulator, so the ground truth is known and every question has exactly one answer word.

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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nested_jax.eval.seeds import as_rng

__all__ = [
    "PEOPLE",
    "PLACES",
    "OBJECTS",
    "DIRECTIONS",
    "OPPOSITE",
    "MOVE_VERBS",
    "PICK_VERBS",
    "DROP_VERBS",
    "GIVE_VERBS",
    "TASKS",
    "MIN_FACTS",
    "MAX_FACTS",
    "DEFAULT_N_FACTS",
    "Story",
    "check_task",
    "check_n_facts",
    "make_story",
    "babilong_chance",
]

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


def check_task(task) -> str:
    """``task`` if it is one of :data:`TASKS`, else ``ValueError`` naming ``task``."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {list(TASKS)}, got {task!r}")
    return task


def check_n_facts(task: str, n_facts) -> int:
    """``n_facts`` of ``task`` within its bounds (None: ``DEFAULT_N_FACTS[task]``), else
    ``ValueError`` naming ``n_facts``."""
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
    task = check_task(task)
    n_facts = check_n_facts(task, n_facts)
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


def babilong_chance(task: str) -> float:
    """Chance accuracy of ``task``: a uniform guess among the candidate words of the answer's kind
    (6 places: 1/6 for qa1-qa4; 4 people or 4 objects: 1/4 for qa5), averaged over the task's
    question forms as equally frequent (exact for any mix of forms here, since every qa5 form has
    4 candidates)."""
    task = check_task(task)
    return float(np.mean([1.0 / len(kind) for kind in _FORM_KINDS[task]]))
