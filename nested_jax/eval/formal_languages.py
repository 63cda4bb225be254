"""Formal-language recognition with length generalisation (sequence classification).

Each example is one string ``w`` of a task's alphabet; the model reads it and, at the query
position, predicts one answer token: the class of ``w`` (accept / reject for a recognition task,
``#1(w) mod m`` for modular counting). Scoring is sequence-level, as in the Hope paper's
formal-language table: an example is correct iff the argmax at its answer position is the right
answer token (one scored position per sequence, so token accuracy there = sequence accuracy).

Layout of one row (strings are right-padded, so pads come after the answer and a causal model's
prediction at the query never sees them)::

    position   0     1 .. L      L+1     L+2 .. T-1
    inputs     BOS   w_1 .. w_L  QUERY   PAD ..
    targets    PAD   PAD ..      ANSWER  PAD ..
    loss_mask  0     0 ..        1       0 ..

Example, ``anbn`` with the default :class:`FormalVocab` and ``length_range=(2, 6)`` (``T = 8``)::

    "aabb" (accept)  inputs    [1, 10, 10, 11, 11,  2, 0, 0]    # BOS a a b b QUERY PAD PAD
                     targets   [0,  0,  0,  0,  0,  4, 0, 0]    # answer 1 (accept) = token 4
                     loss_mask [0,  0,  0,  0,  0,  1, 0, 0]

Vocabulary (:class:`FormalVocab`, shared by every task so one model can learn several):
``PAD = offset``, ``BOS = offset + 1``, ``QUERY = offset + 2``, answers ``class k -> offset + 3 +
k`` for ``k < num_answers`` (binary tasks: 0 = reject, 1 = accept), then the symbols
``0 1 a b c ( ) [ ]`` in that order. Default ``num_answers = 5``, ``offset = 0``: PAD 0, BOS 1,
QUERY 2, answers 3..7, symbols ``0 1 a b c ( ) [ ]`` = 8..16 (17 ids).

Lengths: ``length_range = (lo, hi)`` bounds the string length ``L`` (BOS and QUERY excluded); train
on ``(lo, n)`` and test at ``(n + 1, 8 n)`` for length generalisation. Rows are padded to
``T = hi + 2`` (or ``seq_len``), so every batch of one range has the same shape (no recompiles).
A task draws ``L`` uniformly among the lengths in the range that its class allows.

Tasks (chance = accuracy of a uniform guess over the classes; labels are balanced by construction,
so the best constant answer also scores chance in expectation):

========================  ===========================================================  ======
name                      strings (negatives are near misses, same alphabet)            chance
========================  ===========================================================  ======
``parity``                uniform bit strings; class = number of 1s mod 2               1/2
``aa_star``               ``(aa)*`` over ``{a}``: even ``L`` accepted, odd rejected      1/2
``abab_star``             ``(abab)*``; negatives: two neighbours transposed (same ``L``  1/2
                          and counts), or the ``abab..`` pattern cut at ``L != 0 mod 4``
``anbn``                  ``a^n b^n``; negatives (even ``L``): ``a^(n+d) b^(n-d)``,       1/2
                          ``d != 0``, or equal counts with one a/b transposed
``anbncn``                ``a^n b^n c^n``; negatives (``L = 3n``): counts moved between   1/2
                          blocks (still ``a*b*c*``), or equal counts, one cross swap
``dyck1``                 balanced ``( )`` (uniform Dyck words); negatives (even ``L``):  1/2
                          equal counts with a prefix going below zero, or one flipped
``dyck2``                 balanced ``( ) [ ]``; negatives: shape error (counts kept),     1/2
                          two closers of different types swapped, or one bracket retyped
``modular_counting``      uniform bit strings given the class; class = number of 1s       1/5
                          mod 5 (needs ``lo >= 4`` so every class fits every length)
========================  ===========================================================  ======
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import comb

import numpy as np

from nested_jax.eval.seeds import as_rng
from nested_jax.eval.tasks import predicted_ids

SYMBOLS = ("0", "1", "a", "b", "c", "(", ")", "[", "]")


@dataclass(frozen=True)
class FormalVocab:
    """Token ids of the formal-language tasks (layout in the module docstring).

    Attributes:
      num_answers: answer tokens (classes); must cover the task's classes (5 for mod-5 counting).
      offset: id of PAD; every other id follows it (to embed the tasks in a larger vocabulary).
    """

    num_answers: int = 5
    offset: int = 0

    def __post_init__(self) -> None:
        if self.num_answers < 2:
            raise ValueError(f"vocab: num_answers must be >= 2, got {self.num_answers}")
        if self.offset < 0:
            raise ValueError(f"vocab: offset must be >= 0, got {self.offset}")

    @property
    def pad(self) -> int:
        return self.offset

    @property
    def bos(self) -> int:
        return self.offset + 1

    @property
    def query(self) -> int:
        return self.offset + 2

    def answer(self, k: int) -> int:
        """Token id of class ``k``."""
        if not 0 <= k < self.num_answers:
            raise ValueError(f"k: expected a class in [0, {self.num_answers}), got {k}")
        return self.offset + 3 + k

    @property
    def symbol_base(self) -> int:
        return self.offset + 3 + self.num_answers

    def symbol(self, ch: str) -> int:
        return self.symbol_base + SYMBOLS.index(ch)

    @property
    def size(self) -> int:
        """Smallest model vocabulary that holds every id."""
        return self.symbol_base + len(SYMBOLS)

    def encode(self, string: str) -> np.ndarray:
        return np.asarray([self.symbol(c) for c in string], np.int32)

    def decode(self, ids) -> str:
        """Symbols of ``ids`` as text (ids outside the symbol range are skipped)."""
        base = self.symbol_base
        return "".join(
            SYMBOLS[i - base] for i in np.asarray(ids).tolist() if 0 <= i - base < len(SYMBOLS)
        )


Generator = Callable[[np.random.Generator, int, int], tuple[str, int]]


@dataclass(frozen=True)
class FormalTask:
    """One task: ``generate(rng, lo, hi) -> (string, class)`` with ``lo <= len(string) <= hi``.

    Attributes:
      generate: the seeded generator (raises ``ValueError`` naming ``length_range`` when no
        length in ``[lo, hi]`` suits it).
      num_classes: answer classes (2 for recognition: 0 = reject, 1 = accept).
      alphabet: the symbols the strings use.
    """

    generate: Generator
    num_classes: int
    alphabet: str

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess (and, in expectation, of any constant answer)."""
        return 1.0 / self.num_classes

    def __call__(self, rng: np.random.Generator, lo: int, hi: int) -> tuple[str, int]:
        return self.generate(rng, lo, hi)


def _pick_length(rng, lo: int, hi: int, what: str, modulus: int = 1, residues=(0,), least=1):
    """A uniform length in ``[max(lo, least), hi]`` with ``L % modulus`` in ``residues``."""
    lengths = [n for n in range(max(lo, least), hi + 1) if n % modulus in residues]
    if not lengths:
        raise ValueError(f"length_range: ({lo}, {hi}) holds no length for {what}")
    return int(lengths[rng.integers(len(lengths))])


def _coin(rng) -> int:
    return int(rng.integers(2))


# ---- regular languages ------------------------------------------------------------------------


def gen_parity(rng, lo, hi):
    n = _pick_length(rng, lo, hi, "parity (L >= 1)")
    bits = rng.integers(0, 2, size=n)
    return "".join("01"[b] for b in bits), int(bits.sum() % 2)


def gen_aa_star(rng, lo, hi):
    # both classes must exist in the range, else the length alone would be the label's source
    _pick_length(rng, lo, hi, "(aa)* positives (even L >= 2)", 2, (0,), 2)
    _pick_length(rng, lo, hi, "(aa)* negatives (odd L)", 2, (1,))
    label = _coin(rng)
    n = _pick_length(rng, lo, hi, "(aa)*", 2, (0,) if label else (1,), 2 if label else 1)
    return "a" * n, label


def gen_abab_star(rng, lo, hi):
    label = _coin(rng)
    n_pos = _pick_length(rng, lo, hi, "(abab)* (L divisible by 4)", 4, (0,), 4)
    if label:
        return "ab" * (n_pos // 2), 1
    try:
        n_off = _pick_length(rng, lo, hi, "", 4, (1, 2, 3))
    except ValueError:  # no length outside 4N in the range: only transpositions
        n_off = None
    if n_off is None or _coin(rng):
        # two neighbours transposed: right length, right counts, broken alternation
        s = list("ab" * (n_pos // 2))
        i = int(rng.integers(n_pos - 1))
        s[i], s[i + 1] = s[i + 1], s[i]
        return "".join(s), 0
    return ("ab" * (n_off // 2 + 1))[:n_off], 0  # right alternation, wrong length


# ---- counter languages ------------------------------------------------------------------------


def gen_anbn(rng, lo, hi):
    n2 = _pick_length(rng, lo, hi, "a^n b^n (even L >= 2)", 2, (0,), 2)
    n = n2 // 2
    label = _coin(rng)
    if label:
        return "a" * n + "b" * n, 1
    if _coin(rng):  # counts off by 2d, still a*b*
        d = int(rng.integers(1, min(3, n) + 1)) * (1 if _coin(rng) else -1)
        return "a" * (n + d) + "b" * (n - d), 0
    s = list("a" * n + "b" * n)  # equal counts, one a and one b transposed
    i, j = int(rng.integers(n)), int(rng.integers(n, 2 * n))
    s[i], s[j] = s[j], s[i]
    return "".join(s), 0


def gen_anbncn(rng, lo, hi):
    n3 = _pick_length(rng, lo, hi, "a^n b^n c^n (L divisible by 3)", 3, (0,), 3)
    n = n3 // 3
    label = _coin(rng)
    if label:
        return "a" * n + "b" * n + "c" * n, 1
    if _coin(rng):  # move d symbols from one block to another, still a*b*c*
        counts = [n, n, n]
        src, dst = rng.choice(3, size=2, replace=False)
        d = int(rng.integers(1, min(3, n) + 1))
        counts[src] -= d
        counts[dst] += d
        return "a" * counts[0] + "b" * counts[1] + "c" * counts[2], 0
    s = list("a" * n + "b" * n + "c" * n)  # equal counts, one cross-block swap
    x, y = sorted(rng.choice(3, size=2, replace=False))
    i, j = int(x * n + rng.integers(n)), int(y * n + rng.integers(n))
    s[i], s[j] = s[j], s[i]
    return "".join(s), 0


# ---- Dyck languages ---------------------------------------------------------------------------


def dyck_shape(rng: np.random.Generator, n: int) -> np.ndarray:
    """A uniform Dyck word of even length ``n`` as a bool array (True = opening bracket).

    Cycle lemma: of the cyclic rotations of a sequence of ``n/2`` up-steps and ``n/2 + 1``
    down-steps, exactly one keeps every proper prefix sum >= 0 (the one that starts after the first
    minimum of the prefix sums); it ends with a down-step, and dropping it leaves a Dyck word. A
    uniform sequence therefore gives a uniform Dyck word.
    """
    k = n // 2
    steps = rng.permutation(np.array([1] * k + [-1] * (k + 1)))
    m = int(np.argmin(np.cumsum(steps)))  # first minimum
    rotated = np.concatenate([steps[m + 1 :], steps[: m + 1]])
    return rotated[:-1] > 0


def _is_dyck(s: str) -> bool:
    pairs, stack = {")": "(", "]": "["}, []
    for c in s:
        if c in "([":
            stack.append(c)
        elif not stack or stack.pop() != pairs[c]:
            return False
    return not stack


def _shape_error(rng, s: list[str], closers: str) -> str:
    """Swap an opener with a later closer (token counts kept) until the word is invalid."""
    opens = [i for i, c in enumerate(s) if c in "(["]
    for _ in range(32):
        i = opens[int(rng.integers(len(opens)))]
        later = [j for j in range(i + 1, len(s)) if s[j] in closers]
        j = later[int(rng.integers(len(later)))]
        t = list(s)
        t[i], t[j] = t[j], t[i]
        if not _is_dyck("".join(t)):
            return "".join(t)
    # swapping the first opener with any closer always breaks the first prefix
    t = list(s)
    j = [j for j, c in enumerate(t) if c in closers][0]
    t[0], t[j] = t[j], t[0]
    return "".join(t)


def gen_dyck1(rng, lo, hi):
    n = _pick_length(rng, lo, hi, "Dyck-1 (even L >= 2)", 2, (0,), 2)
    s = ["(" if o else ")" for o in dyck_shape(rng, n)]
    label = _coin(rng)
    if label:
        return "".join(s), 1
    if _coin(rng):
        return _shape_error(rng, s, ")"), 0
    i = int(rng.integers(n))  # one flipped bracket: counts differ by 2
    s[i] = ")" if s[i] == "(" else "("
    return "".join(s), 0


def _dyck2_word(rng, n: int) -> list[str]:
    shape = dyck_shape(rng, n)
    s, stack = [], []
    for o in shape:
        if o:
            kind = int(rng.integers(2))
            stack.append(kind)
            s.append("(["[kind])
        else:
            s.append(")]"[stack.pop()])
    return s


def gen_dyck2(rng, lo, hi):
    n = _pick_length(rng, lo, hi, "Dyck-2 (even L >= 2)", 2, (0,), 2)
    s = _dyck2_word(rng, n)
    label = _coin(rng)
    if label:
        return "".join(s), 1
    kind = int(rng.integers(3))
    closers = [j for j, c in enumerate(s) if c in ")]"]
    if kind == 1 and len({s[j] for j in closers}) == 2:
        # two closers of different types swapped: same shape, same counts, crossed nesting
        j1 = closers[int(rng.integers(len(closers)))]
        other = [j for j in closers if s[j] != s[j1]]
        j2 = other[int(rng.integers(len(other)))]
        s[j1], s[j2] = s[j2], s[j1]
        return "".join(s), 0
    if kind == 2:  # one bracket retyped: its partner no longer matches
        i = int(rng.integers(n))
        s[i] = {"(": "[", "[": "(", ")": "]", "]": ")"}[s[i]]
        return "".join(s), 0
    return _shape_error(rng, s, ")]"), 0


# ---- modular counting -------------------------------------------------------------------------


def make_modular_counting(modulus: int) -> Generator:
    """Generator of bit strings labelled ``#1 mod modulus``, the class drawn uniformly first.

    Given the class ``k`` and length ``L``, the string is uniform among the strings of length ``L``
    whose count of 1s is ``= k (mod modulus)`` (count ``c`` drawn with weight ``C(L, c)``).
    """
    if modulus < 2:
        raise ValueError(f"modulus: expected >= 2, got {modulus}")

    def gen(rng, lo, hi):
        if lo < modulus - 1:
            raise ValueError(
                f"length_range: counting mod {modulus} needs lengths >= {modulus - 1} so that "
                f"every class fits every length, got ({lo}, {hi})"
            )
        n = _pick_length(rng, lo, hi, f"counting mod {modulus}")
        k = int(rng.integers(modulus))
        counts = np.arange(k, n + 1, modulus)
        w = np.asarray([comb(n, int(c)) for c in counts], dtype=object)
        p = np.asarray([x / w.sum() for x in w], np.float64)
        c = int(rng.choice(counts, p=p / p.sum()))
        bits = np.zeros(n, np.int64)
        bits[rng.choice(n, size=c, replace=False)] = 1
        return "".join("01"[b] for b in bits), k

    return gen


FORMAL_TASKS: dict[str, FormalTask] = {
    "parity": FormalTask(gen_parity, 2, "01"),
    "aa_star": FormalTask(gen_aa_star, 2, "a"),
    "abab_star": FormalTask(gen_abab_star, 2, "ab"),
    "anbn": FormalTask(gen_anbn, 2, "ab"),
    "anbncn": FormalTask(gen_anbncn, 2, "abc"),
    "dyck1": FormalTask(gen_dyck1, 2, "()"),
    "dyck2": FormalTask(gen_dyck2, 2, "()[]"),
    "modular_counting": FormalTask(make_modular_counting(5), 5, "01"),
}


def _check_range(length_range) -> tuple[int, int]:
    ok = (
        isinstance(length_range, tuple | list)
        and len(length_range) == 2
        and all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in length_range)
    )
    if not ok or not 1 <= length_range[0] <= length_range[1]:
        raise ValueError(
            f"length_range: expected (lo, hi) ints with 1 <= lo <= hi, got {length_range!r}"
        )
    return int(length_range[0]), int(length_range[1])


def make_formal_batch(
    name: str,
    batch_size: int,
    length_range: tuple[int, int],
    rng_or_seed: int | np.random.Generator,
    vocab: FormalVocab | None = None,
    seq_len: int | None = None,
) -> dict[str, np.ndarray]:
    """One batch of task ``name`` (layout and vocabulary in the module docstring).

    Args:
      name: a key of :data:`FORMAL_TASKS`.
      batch_size: B.
      length_range: ``(lo, hi)``, inclusive bounds on the string length.
      rng_or_seed: a seed or a ``numpy.random.Generator`` (the batch is a function of it).
      vocab: token layout (default :class:`FormalVocab()`); its ``num_answers`` must cover the task.
      seq_len: T, the padded row length (default ``hi + 2``; at least that).

    Returns:
      ``{"inputs": int32[B, T], "targets": int32[B, T], "loss_mask": float32[B, T]}``;
      ``loss_mask`` is 1 at exactly one position per row (the query, whose target is the answer).
    """
    if name not in FORMAL_TASKS:
        raise ValueError(f"name: unknown formal task {name!r}; known: {sorted(FORMAL_TASKS)}")
    task = FORMAL_TASKS[name]
    vocab = FormalVocab() if vocab is None else vocab
    if not isinstance(vocab, FormalVocab):
        raise ValueError(f"vocab: expected a FormalVocab, got {type(vocab).__name__}")
    if vocab.num_answers < task.num_classes:
        raise ValueError(
            f"vocab: num_answers={vocab.num_answers} < {task.num_classes} classes of {name!r}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    lo, hi = _check_range(length_range)
    t = hi + 2 if seq_len is None else seq_len
    if t < hi + 2:
        raise ValueError(f"seq_len: needs >= hi + 2 = {hi + 2} (BOS, string, QUERY), got {seq_len}")
    rng = as_rng(rng_or_seed)
    inputs = np.full((batch_size, t), vocab.pad, np.int32)
    targets = np.full((batch_size, t), vocab.pad, np.int32)
    mask = np.zeros((batch_size, t), np.float32)
    for b in range(batch_size):
        string, label = task(rng, lo, hi)
        n = len(string)
        inputs[b, 0] = vocab.bos
        inputs[b, 1 : n + 1] = vocab.encode(string)
        inputs[b, n + 1] = vocab.query
        targets[b, n + 1] = vocab.answer(label)
        mask[b, n + 1] = 1.0
    return {"inputs": inputs, "targets": targets, "loss_mask": mask}


def formal_chance(name: str) -> float:
    """Chance accuracy of task ``name`` (1 / number of classes; classes are balanced)."""
    if name not in FORMAL_TASKS:
        raise ValueError(f"name: unknown formal task {name!r}; known: {sorted(FORMAL_TASKS)}")
    return FORMAL_TASKS[name].chance


def string_lengths(batch: dict) -> np.ndarray:
    """``int[B]`` string length of each row (the answer position minus 1)."""
    return np.asarray(batch["loss_mask"]).argmax(-1) - 1


def formal_correct(logits, batch: dict) -> np.ndarray:
    """``bool[B]``: whether each row's argmax at its answer position is the right answer.

    Args:
      logits: float[B, T, V], or the argmax ids int[B, T].
      batch: from :func:`make_formal_batch` (uses ``targets`` and ``loss_mask``).
    """
    targets, mask = np.asarray(batch["targets"]), np.asarray(batch["loss_mask"])
    ids = predicted_ids(logits, targets.shape)
    if not ((mask > 0).sum(-1) == 1).all():
        raise ValueError("batch: loss_mask must select exactly one answer position per row")
    pos = mask.argmax(-1)
    rows = np.arange(targets.shape[0])
    return ids[rows, pos] == targets[rows, pos]


def formal_accuracy(logits, batch: dict) -> float:
    """Sequence-level accuracy: the fraction of rows whose answer-position argmax is right."""
    return float(formal_correct(logits, batch).mean())
