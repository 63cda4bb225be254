"""BABILong-style generators (bAbI qa1-qa5 stories in Austen text) and their scorer."""

from __future__ import annotations

import re
import time
from collections import Counter

import numpy as np
import pytest

from nested_jax.data.corpus import austen_documents
from nested_jax.data.tokenizers import ByteTokenizer, train_sentencepiece
from nested_jax.eval.babilong import (
    ANSWER_PREFIX,
    QUESTION_PREFIX,
    babilong_grid,
    babilong_markdown,
    encode_haystack,
    make_babilong_example,
    score_babilong,
)
from nested_jax.eval.babilong_stories import (
    DEFAULT_N_FACTS,
    MIN_FACTS,
    OBJECTS,
    PEOPLE,
    PLACES,
    TASKS,
    babilong_chance,
    make_story,
)

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def austen() -> str:
    """About 200K characters of real text (the first Austen chapters, from the package cache)."""
    return "".join(austen_documents()[:12])


# ---- an independent reader of the stories -----------------------------------------------------

_W = r"([A-Za-z]+)"
_MOVE = re.compile(rf"{_W} (?:went|moved|journeyed|travelled) to the {_W}\.")
_PICK = re.compile(rf"{_W} (?:picked up|grabbed) the {_W}\.")
_DROP = re.compile(rf"{_W} (?:dropped|put down) the {_W}\.")
_GIVE = re.compile(rf"{_W} (?:gave|handed) the {_W} to {_W}\.")
_REL = re.compile(rf"The {_W} is (north|south|east|west) of the {_W}\.")
_P, _X, _O = ("(?:" + "|".join(words) + ")" for words in (PEOPLE, PLACES, OBJECTS))
# Any fact sentence in running text (none occurs in the Austen novels by themselves).
_ANY_FACT = re.compile(
    rf"(?<![A-Za-z])(?:{_P} (?:went|moved|journeyed|travelled) to the {_X}\."
    rf"|{_P} (?:picked up|grabbed|dropped|put down) the {_O}\."
    rf"|{_P} (?:gave|handed) the {_O} to {_P}\."
    rf"|The {_X} is (?:north|south|east|west) of the {_X}\.)"
)
_OPP = {"north": "south", "south": "north", "east": "west", "west": "east"}
_STEP = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}


def _replay(facts, question: str) -> set[str]:
    """Every answer the facts allow for ``question`` (a well-posed question has exactly one).

    Replays the facts on its own world state and checks each is physically possible.
    """
    at, holder, lies, path, gives, rel = {}, {}, {}, {}, [], []
    for f in facts:
        if m := _MOVE.fullmatch(f):
            p, x = m.groups()
            assert p in PEOPLE and x in PLACES and at.get(p) != x, f
            at[p] = x
            for o in [o for o, h in holder.items() if h == p]:
                if path[o][-1] != x:
                    path[o].append(x)
        elif m := _PICK.fullmatch(f):
            p, o = m.groups()
            assert p in at and o in OBJECTS and o not in holder, f
            assert lies.get(o, at[p]) == at[p], f"{f}: the {o} is in the {lies[o]}"
            holder[o] = p
            lies.pop(o, None)
            if not path.get(o) or path[o][-1] != at[p]:
                path.setdefault(o, []).append(at[p])
        elif m := _DROP.fullmatch(f):
            p, o = m.groups()
            assert holder.pop(o) == p, f
            lies[o] = at[p]
        elif m := _GIVE.fullmatch(f):
            p, o, q = m.groups()
            assert holder.get(o) == p and q != p and at.get(q) == at[p], f
            holder[o] = q
            gives.append((p, o, q))
        elif m := _REL.fullmatch(f):
            rel.append(m.groups())
        else:
            raise AssertionError(f"not a fact: {f!r}")
    if rel:
        # the relations must fit a grid with one place per cell
        cell = {rel[0][2]: (0, 0)}
        for _ in rel:
            for a, d, b in rel:
                if b in cell and a not in cell:
                    cell[a] = tuple(np.add(cell[b], _STEP[d]))
                if a in cell and b not in cell:
                    cell[b] = tuple(np.subtract(cell[a], _STEP[d]))
        assert len(set(cell.values())) == len(cell) and all(
            np.array_equal(np.subtract(cell[a], cell[b]), _STEP[d]) for a, d, b in rel
        )
    known = rel + [(b, _OPP[d], a) for a, d, b in rel]
    if m := re.fullmatch(r"Where is (\w+)\?", question):
        return {at[m[1]]}
    if m := re.fullmatch(r"Where is the (\w+)\?", question):
        return {at[holder[m[1]]] if m[1] in holder else lies[m[1]]}
    if m := re.fullmatch(r"Where was the (\w+) before the (\w+)\?", question):
        p = path[m[1]]
        return {p[i - 1] for i in range(1, len(p)) if p[i] == m[2]}
    if m := re.fullmatch(r"What is (\w+) of the (\w+)\?", question):
        return {a for a, d, b in known if d == m[1] and b == m[2]}
    if m := re.fullmatch(r"What is the (\w+) (\w+) of\?", question):
        return {b for a, d, b in known if a == m[1] and d == m[2]}
    if m := re.fullmatch(r"Who gave the (\w+) to (\w+)\?", question):
        return {g for g, o, q in gives if o == m[1] and q == m[2]}
    if m := re.fullmatch(r"What did (\w+) give to (\w+)\?", question):
        return {o for g, o, q in gives if g == m[1] and q == m[2]}
    if m := re.fullmatch(r"Who received the (\w+)\?", question):
        return {q for g, o, q in gives if o == m[1]}
    if m := re.fullmatch(r"Who did (\w+) give the (\w+) to\?", question):
        return {q for g, o, q in gives if g == m[1] and o == m[2]}
    raise AssertionError(f"unknown question {question!r}")


def _next_ids(tokens: np.ndarray) -> np.ndarray:
    """A perfect causal predictor as ids: at t it 'predicts' token t + 1."""
    return np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)


def _one_hot(ids: np.ndarray, vocab: int = 257) -> np.ndarray:
    out = np.zeros((*ids.shape, vocab), np.float32)
    np.put_along_axis(out, ids[..., None], 1.0, axis=-1)
    return out


def _always(word: str):
    """Predicts the context perfectly but always answers ``word`` (found after 'Answer:')."""
    guess = np.asarray(TOK.encode(" " + word), np.int32)
    marker = ANSWER_PREFIX.encode()

    def fn(tokens):
        ids = _next_ids(tokens)
        for row in range(tokens.shape[0]):
            raw = bytes(tokens[row, 1:].astype(np.uint8))  # the text after the bos
            # answer tokens start at 1 + (end of the last "Answer:"); predicted one step earlier
            span = ids[row, raw.rfind(marker) + len(marker) : -1]
            span[:] = TOK.bos_id  # never an answer token
            span[: min(guess.size, span.size)] = guess[: span.size]
        return ids

    return fn


# ---- tests ------------------------------------------------------------------------------------


def test_lengths_layout_and_seeds(austen):
    lengths = [400, 1000, 3001]
    for task in TASKS:
        exs = babilong_grid(task, austen, TOK, lengths, n_per_length=2, seed=0)
        assert [e.length for e in exs] == [400, 400, 1000, 1000, 3001, 3001]
        for ex in exs:
            assert ex.tokens.shape == (ex.length,) and ex.tokens.dtype == np.int32
            assert ex.tokens[0] == TOK.bos_id and ex.task == task
            assert ex.n_facts == len(ex.facts) == DEFAULT_N_FACTS[task]
            assert TOK.decode(ex.answer_tokens) == " " + ex.answer
            assert TOK.decode(ex.prompt).endswith(QUESTION_PREFIX + ex.question + ANSWER_PREFIX)
        again = babilong_grid(task, austen, TOK, lengths, n_per_length=2, seed=0)
        assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(exs, again, strict=True))
        other = babilong_grid(task, austen, TOK, lengths, n_per_length=2, seed=1)
        assert not any(np.array_equal(a.tokens, b.tokens) for a, b in zip(exs, other, strict=True))
        assert [e.facts for e in other] != [e.facts for e in exs]


def test_facts_in_order_at_sentence_starts_and_answer_replayed(austen):
    depths = []
    for task in TASKS:
        for ex in babilong_grid(task, austen, TOK, [1500, 4000], n_per_length=4, seed=7):
            text = TOK.decode(ex.prompt)
            # the facts, read back from the text alone, in the story's order
            assert _ANY_FACT.findall(text) == list(ex.facts)
            assert list(ex.fact_starts) == sorted(ex.fact_starts)
            for start, fact in zip(ex.fact_starts, ex.facts, strict=True):
                piece = ex.tokens[start : start + len(TOK.encode(" " + fact))]
                assert TOK.decode(piece) == " " + fact
                before = TOK.decode(ex.tokens[1:start]).rstrip()
                # after the bos, another fact, or a sentence end of the haystack
                assert start == 1 or before[-1] in ".!?\"')]\u201d\u2019", before[-40:]
            assert _replay(_ANY_FACT.findall(text), ex.question) == {ex.answer}
            depths += [s / ex.prompt_len for s in ex.fact_starts]
    assert min(depths) < 0.1 and max(depths) > 0.9  # facts spread through the haystack


@pytest.mark.parametrize("task", TASKS)
def test_generator_answer_agrees_with_an_independent_replay(task):
    sizes = [MIN_FACTS[task], DEFAULT_N_FACTS[task], 5 if task == "qa4" else 30]
    answers = Counter()
    for n in sizes:
        for seed in range(120):
            story = make_story(task, n, seed)
            assert story.task == task and len(story.facts) == n
            assert _replay(story.facts, story.question) == {story.answer}
            answers[story.answer] += 1
    kinds = {"qa5": set(PEOPLE) | set(OBJECTS)}.get(task, set(PLACES))
    assert set(answers) == kinds  # every candidate word occurs as an answer
    forms = {
        "qa4": {"What is", "What is the"},
        "qa5": {"Who gave", "What did", "Who received", "Who did"},
    }.get(task, {"Where is" if task != "qa3" else "Where was"})
    asked = set()
    for seed in range(60):
        words = make_story(task, None, seed).question.split()
        asked.add(
            " ".join(words[:3]) if words[:3] == ["What", "is", "the"] else " ".join(words[:2])
        )
    assert asked == forms  # every question form is asked


def test_scores_oracle_ids_logits_constant_and_chance(austen):
    exs = [
        ex
        for task in TASKS
        for ex in babilong_grid(task, austen, TOK, [500, 800], n_per_length=12, seed=3)
    ]
    oracle = score_babilong(_next_ids, exs, batch_size=5)
    assert oracle["overall"] == 1.0 and oracle["num_examples"] == len(exs) == 120
    assert oracle["accuracy"] == {500: 1.0, 800: 1.0}
    assert oracle["by_task"] == {t: {500: 1.0, 800: 1.0} for t in TASKS}
    logits = score_babilong(lambda t: _one_hot(_next_ids(t)), exs, batch_size=7)
    assert logits == oracle
    # Ids and logits also agree on a predictor that is wrong on some rows.
    half = _always("kitchen")
    assert score_babilong(half, exs) == score_babilong(lambda t: _one_hot(half(t)), exs)

    # A constant answer scores exactly its frequency among the answers; averaged over the
    # candidate words of each answer kind it scores the chance of babilong_chance.
    for task in TASKS:
        rows = [i for i, e in enumerate(exs) if e.task == task]
        freq = Counter(exs[i].answer for i in rows)
        scores = {}
        for word in (*PLACES, *PEOPLE, *OBJECTS):
            ok = score_babilong(_always(word), [exs[i] for i in rows], batch_size=8)["correct"]
            scores[word] = float(np.mean(ok))
            assert scores[word] == freq[word] / len(rows), (task, word)
        assert max(scores.values()) < 0.6
        kinds = [PEOPLE, OBJECTS] if task == "qa5" else [PLACES]
        uniform = sum(np.mean([scores[w] for w in kind]) for kind in kinds)
        assert uniform == pytest.approx(babilong_chance(task))
    assert babilong_chance("qa1") == pytest.approx(1 / 6)
    assert babilong_chance("qa5") == pytest.approx(1 / 4)

    def short_only(tokens):  # perfect at 500 tokens, a constant wrong answer at 800
        return _next_ids(tokens) if tokens.shape[1] == 500 else _always("nowhere")(tokens)

    res = score_babilong(short_only, exs, batch_size=4)
    assert res["accuracy"] == {500: 1.0, 800: 0.0} and res["overall"] == 0.5
    assert res["correct"] == [e.length == 500 for e in exs]
    md = babilong_markdown(res)
    assert "| qa1 | 1.00 | 0.00 | 0.17 |" in md and "| qa5 | 1.00 | 0.00 | 0.25 |" in md
    assert "| task | 500 | 800 | chance |" in md


def test_long_example_is_fast_and_short_text_is_tiled(austen):
    hay = encode_haystack(austen, TOK)
    t0 = time.perf_counter()
    ex = make_babilong_example(hay, TOK, "qa3", 65536, np.random.default_rng(0), n_facts=30)
    built = time.perf_counter() - t0
    assert ex.tokens.size == 65536 and built < 2.0, built
    t0 = time.perf_counter()
    (grid_ex,) = babilong_grid("qa5", austen, TOK, [65536], 1, seed=0, n_facts=20)
    assert grid_ex.tokens.size == 65536 and time.perf_counter() - t0 < 2.0
    assert _replay(_ANY_FACT.findall(TOK.decode(ex.prompt)), ex.question) == {ex.answer}

    text = "It rained all day. She stayed at home! Did he write? "
    exs = babilong_grid("qa2", text, TOK, [2000], 3, seed=0, n_facts=6)
    for e in exs:
        assert e.tokens.size == 2000
        assert _ANY_FACT.findall(TOK.decode(e.prompt)) == list(e.facts)
        for s in e.fact_starts:
            assert s == 1 or TOK.decode(e.tokens[1:s]).rstrip()[-1] in ".!?"
    # a raw id array (no sentence starts) is accepted too
    raw = make_babilong_example(np.arange(65, 91), TOK, "qa1", 500, np.random.default_rng(1))
    assert raw.tokens.size == 500 and raw.tokens[0] == TOK.bos_id


def test_bpe_tokenizer_lengths_exact(austen):
    tok = train_sentencepiece([austen[:40_000]], 400)
    exs = babilong_grid("qa5", austen[:60_000], tok, [700, 701], 2, seed=0)
    assert [e.tokens.size for e in exs] == [700, 700, 701, 701]
    for e in exs:
        assert tok.decode(e.answer_tokens) == " " + e.answer
        assert _ANY_FACT.findall(tok.decode(e.prompt)) == list(e.facts)


def test_bad_arguments(austen):
    text = austen[:5000]
    with pytest.raises(ValueError, match="task"):
        babilong_grid("qa6", text, TOK, [500], 1, 0)
    with pytest.raises(ValueError, match="task"):
        make_story("QA1", 3, 0)
    for task in TASKS:
        with pytest.raises(ValueError, match="n_facts"):
            babilong_grid(task, text, TOK, [500], 1, 0, n_facts=MIN_FACTS[task] - 1)
    with pytest.raises(ValueError, match="n_facts"):
        make_story("qa4", 6, 0)  # six places hold at most five tree relations
    with pytest.raises(ValueError, match="n_facts"):
        make_story("qa1", 2.5, 0)
    with pytest.raises(ValueError, match="length"):
        babilong_grid("qa1", text, TOK, [200], 1, 0)  # ten facts alone are longer
    with pytest.raises(ValueError, match="lengths"):
        babilong_grid("qa1", text, TOK, [], 1, 0)
    with pytest.raises(ValueError, match="lengths"):
        babilong_grid("qa1", text, TOK, [0], 1, 0)
    with pytest.raises(ValueError, match="n_per_length"):
        babilong_grid("qa1", text, TOK, [500], 0, 0)
    with pytest.raises(ValueError, match="haystack_text"):
        babilong_grid("qa1", "  \n", TOK, [500], 1, 0)
    with pytest.raises(ValueError, match="seed"):
        babilong_grid("qa1", text, TOK, [500], 1, "zero")
    with pytest.raises(ValueError, match="haystack"):
        make_babilong_example(np.zeros((2, 3), np.int32), TOK, "qa1", 500, np.random.default_rng())
    exs = babilong_grid("qa1", text, TOK, [500], 2, 0)
    with pytest.raises(ValueError, match="examples"):
        score_babilong(_next_ids, [])
    with pytest.raises(ValueError, match="batch_size"):
        score_babilong(_next_ids, exs, batch_size=0)
    with pytest.raises(ValueError, match="logits_fn"):
        score_babilong(lambda t: np.zeros((t.shape[0], 3, 257)), exs)
    with pytest.raises(ValueError, match="logits_fn"):
        score_babilong(lambda t: t.astype(np.float32), exs)  # float ids: neither form
