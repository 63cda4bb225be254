"""RULER-style retrieval generators (every kind, both haystacks) and their scorer."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nested_jax.data.corpus import austen_documents
from nested_jax.data.tokenizers import ByteTokenizer, train_sentencepiece
from nested_jax.eval.ruler import (
    KEY_WORDS,
    KINDS,
    NOISE_TEXT,
    make_ruler_example,
    ruler_chance,
    ruler_grid,
    ruler_markdown,
    score_ruler,
)

TOK = ByteTokenizer()
V = TOK.vocab_size
_WORDS = "the letter was sent to her sister at the house before the ball in the evening".split()
NEEDLE_RE = re.compile(
    r" One of the special magic (?:numbers|pass keys|uuids) for (\w+) is: ([0-9a-f-]+)\. "
)
VT_RE = re.compile(r" VAR ([A-Z]{5}) = (\w+)\. ")


def _text(n_sentences: int = 400, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(
        " ".join(rng.choice(_WORDS, size=9)).capitalize() + "." for _ in range(n_sentences)
    )


def _oracle(tokens: np.ndarray) -> np.ndarray:
    """Logits whose argmax at t is token t + 1 (what a perfect causal model predicts)."""
    b, t = tokens.shape
    logits = np.zeros((b, t, V), np.float32)
    nxt = np.concatenate([tokens[:, 1:], np.zeros((b, 1), tokens.dtype)], axis=1)
    np.put_along_axis(logits, nxt[..., None], 1.0, axis=-1)
    return logits


def _constant(c: int):
    def fn(tokens):
        logits = np.zeros((*tokens.shape, V), np.float32)
        logits[..., c] = 1.0
        return logits

    return fn


def _derive_answer(ex) -> list[str]:
    """The answer read back from the decoded prompt alone (needles and question)."""
    prompt = TOK.decode(ex.prompt)
    question = prompt.rsplit("\n\n", 1)[1]
    if ex.kind == "variable_tracking":
        value = re.search(r"assigned the value (\d+)\?", question).group(1)
        holders: list[str] = []
        for name, rhs in VT_RE.findall(prompt):
            if rhs == value or rhs in holders:
                holders.append(name)
        return holders
    facts = NEEDLE_RE.findall(prompt)
    asked = re.search(r" for (.+?)\?", question).group(1).replace(" and ", ", ").split(", ")
    if ex.kind == "multivalue":
        return [v for k, v in facts if k == asked[0]]
    binding = dict(facts)
    assert len(binding) == len(facts)  # keys are distinct
    return [binding[k] for k in asked]


@pytest.mark.parametrize("kind", KINDS)
def test_exact_lengths_layout_and_parse_back(kind):
    for hay in (_text(), None):
        exs = ruler_grid(kind, hay, TOK, [600, 777], [0.0, 0.4, 1.0], n_per_cell=2, seed=0)
        assert len(exs) == 12
        for ex in exs:
            assert ex.tokens.shape == (ex.length,) and ex.tokens.dtype == np.int32
            assert ex.tokens[0] == TOK.bos_id and ex.kind == kind
            assert ex.haystack == ("noise" if hay is None else "text")
            assert TOK.decode(ex.answer) == " " + ex.answer_text
            assert ex.answer_text == ", ".join(ex.answers)
            assert _derive_answer(ex) == list(ex.answers)
            for start in ex.needle_starts:
                assert TOK.decode(ex.tokens[start : start + 12]).startswith((" One of ", " VAR "))
            assert list(ex.needle_starts) == sorted(ex.needle_starts)
            for (a, b), item in zip(ex.answer_spans, ex.answers, strict=True):
                assert TOK.decode(ex.answer[a:b]) in (" " + item, ", " + item)
            if hay is None:  # the haystack without the needles is the noise from its start
                body = TOK.decode(ex.prompt[1:]).split("\n\n")[1]
                body = re.sub(NEEDLE_RE if kind != "variable_tracking" else VT_RE, "", body)
                assert body == ((NOISE_TEXT + " ") * 20)[: len(body)]


@pytest.mark.parametrize(
    ("kind", "options", "n_needles", "n_answers"),
    [
        ("single", {}, 1, 1),
        ("multikey", {"num_distractors": 5}, 6, 1),
        ("multivalue", {"num_values": 3}, 3, 3),
        ("multiquery", {"num_queries": 2}, 2, 2),
        ("variable_tracking", {"hops": 2, "num_distractors": 2}, 9, 3),
    ],
)
def test_options_set_the_counts(kind, options, n_needles, n_answers):
    exs = ruler_grid(kind, None, TOK, [900], [0.3], 3, seed=2, **options)
    for ex in exs:
        prompt = TOK.decode(ex.prompt)
        found = (VT_RE if kind == "variable_tracking" else NEEDLE_RE).findall(prompt)
        assert len(found) == n_needles and len(ex.answers) == n_answers
        assert len(ex.needle_starts) == (3 if kind == "variable_tracking" else n_answers)


def test_value_and_key_types():
    forms = {"passkey": r"\d{5}", "number": r"\d{7}", "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}"}
    for value_type, form in forms.items():
        exs = ruler_grid("multiquery", None, TOK, [600], [0.5], 4, 1, value_type=value_type)
        for ex in exs:
            assert all(re.fullmatch(form, v) for v in ex.answers), ex.answers
            assert all(k in KEY_WORDS for k in ex.query)
    uuids = [v for ex in exs for v in ex.answers]
    assert len(set(uuids)) == len(uuids)
    exs = ruler_grid("multikey", None, TOK, [600], [0.5], 4, 1, key_type="letters")
    for ex in exs:
        keys = [k for k, _ in NEEDLE_RE.findall(TOK.decode(ex.prompt))]
        assert all(re.fullmatch(r"[a-z]{6}", k) for k in keys) and len(set(keys)) == len(keys)


@pytest.mark.parametrize("kind", ["single", "multivalue", "multiquery", "variable_tracking"])
def test_target_needles_spread_from_depth(kind):
    """Target i sits after round((d + i (1 - d) / m) n_fill) haystack tokens (no distractors)."""
    options = {"num_distractors": 0} if kind == "variable_tracking" else {}
    for depth in (0.0, 0.25, 0.9, 1.0):
        (ex,) = ruler_grid(kind, _text(), TOK, [1000], [depth], 1, seed=3, **options)
        head = 1 + TOK.decode(ex.prompt[1:]).index("\n\n") + 2
        pieces = [ex.tokens[s:] for s in ex.needle_starts]
        sizes = [TOK.decode(p).index(". ", 1) + 2 for p in pieces]  # " sentence. "
        n_fill = ex.prompt_len - head - sum(sizes) - len(TOK.decode(ex.prompt).rsplit("\n\n", 1)[1])
        n_fill -= 2
        m = len(sizes)
        for i, start in enumerate(ex.needle_starts):
            before = start - head - sum(sizes[:i])
            assert before == round((depth + i * (1 - depth) / m) * n_fill)


def test_variable_tracking_follows_the_chain():
    exs = ruler_grid("variable_tracking", _text(), TOK, [1200], [0.0, 0.7], 3, 5, hops=3)
    for ex in exs:
        statements = VT_RE.findall(TOK.decode(ex.prompt))
        assert len(statements) == 2 * 4  # target + one distractor chain, 4 statements each
        assign = dict(statements)
        names = list(ex.answers)
        assert len(names) == 4 and assign[names[0]] == ex.query[0]
        assert all(assign[b] == a for a, b in zip(names[:-1], names[1:], strict=True))
        order = [name for name, _ in statements]
        assert [order.index(n) for n in names] == sorted(order.index(n) for n in names)
        others = [n for n in order if n not in names]
        value = ex.query[0]
        assert all(not re.fullmatch(r"\d+", assign[n]) or assign[n] != value for n in others)


def test_determinism_and_seeds():
    def grid(seed):
        return ruler_grid("multikey", _text(), TOK, [500, 600], [0.2, 0.8], 2, seed)

    a, b, c = grid(7), grid(7), grid(8)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    assert [x.answers for x in a] == [y.answers for y in b]
    assert [x.answers for x in a] != [y.answers for y in c]
    from_rng = ruler_grid(
        "multikey", _text(), TOK, [500, 600], [0.2, 0.8], 2, np.random.default_rng(7)
    )
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, from_rng, strict=True))


def test_sentencepiece_lengths_exact():
    tok = train_sentencepiece([_text(60, seed=s) for s in range(10)], 320)
    for kind in KINDS:
        for hay in ("Short text. ", None):
            opts = {} if kind == "variable_tracking" else {"value_type": "uuid"}
            exs = ruler_grid(kind, hay, tok, [700, 701], [0.5], 1, seed=4, **opts)
            assert [e.tokens.size for e in exs] == [700, 701]
            for e in exs:
                assert tok.decode(e.answer) == " " + e.answer_text


def test_real_text_haystack():
    docs = austen_documents()  # the real corpus (installed by scripts/setup), never skipped
    text = "\n\n".join(docs[:5])
    exs = ruler_grid("multivalue", text, TOK, [3000], [0.1, 0.6], 2, seed=0)
    for ex in exs:
        assert ex.tokens.size == 3000 and _derive_answer(ex) == list(ex.answers)
        body = TOK.decode(ex.prompt[1:]).split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
        assert re.sub(NEEDLE_RE, "", body) in text  # a contiguous slice of the novel
    assert exs[0].tokens[200:400].tolist() != exs[1].tokens[200:400].tolist()  # random offsets


def test_score_oracle_constant_ids_and_partial_credit():
    exs = [
        ex
        for kind in KINDS
        for ex in ruler_grid(kind, _text(), TOK, [600, 700], [0.0, 1.0], 2, seed=1)
    ]
    res = score_ruler(_oracle, exs, batch_size=3)
    assert res["overall"] == res["overall_recall"] == res["overall_token_recall"] == 1.0
    assert res["num_examples"] == len(exs) == 40 and all(res["correct"])

    chance = ruler_chance(exs, V)
    assert chance["constant_exact"] == 0.0 and chance["exact"] < 1e-12
    assert chance["token_recall"] == 1 / V
    best = score_ruler(_constant(chance["constant_id"]), exs)
    assert best["overall"] == 0.0
    assert best["overall_token_recall"] == pytest.approx(chance["constant_token_recall"])
    assert 0.0 < best["overall_token_recall"] < 0.5
    for c in (0, ord("1"), ord(" ")):
        other = score_ruler(_constant(c), exs)["overall_token_recall"]
        assert other <= best["overall_token_recall"] + 1e-12

    def noisy(tokens):  # right at some answer positions only; deterministic in the tokens
        out = _oracle(tokens)
        r = np.random.default_rng(int(tokens.sum()))
        return out + r.normal(scale=0.7, size=out.shape).astype(np.float32)

    from_logits = score_ruler(noisy, exs, batch_size=4)
    from_ids = score_ruler(lambda t: noisy(t).argmax(-1).astype(np.int32), exs, batch_size=4)
    assert from_logits == from_ids
    assert 0.0 < from_logits["overall_token_recall"] < 1.0

    def last_wrong(tokens):  # perfect except the prediction of the last answer token
        out = _oracle(tokens)
        out[:, -2] = np.roll(out[:, -2], 1, axis=-1)
        return out

    res = score_ruler(last_wrong, exs)
    assert res["overall"] == 0.0
    for ex, tr, ir in zip(exs, res["token_recall"], res["item_recall"], strict=True):
        k = len(ex.answers)
        assert tr == pytest.approx(1 - 1 / ex.answer.size) and ir == pytest.approx(1 - 1 / k)


def test_score_table_and_markdown():
    exs = ruler_grid("single", _text(), TOK, [400, 800], [0.0, 0.5, 1.0], 2, seed=0)

    def shallow_only(tokens):  # perfect when the needle is in the first half, else constant 0
        out = _oracle(tokens)
        for row in range(tokens.shape[0]):
            if TOK.decode(tokens[row]).find("One of the special") >= tokens.shape[1] // 2:
                out[row] = _constant(0)(tokens[row : row + 1])[0]
        return out

    res = score_ruler(shallow_only, exs, batch_size=4)
    for length in (400, 800):
        assert res["accuracy"][length][0.0] == 1.0 and res["accuracy"][length][1.0] == 0.0
        assert res["recall"][length] == res["accuracy"][length]  # one item per answer
    md = ruler_markdown(res)
    assert "| 800 | 1.00 / 1.00 | 1.00 / 1.00 | 0.00 / 0.00 |" in md and "depth 0.5" in md
    assert f"over {len(exs)} examples" in md


_GOOD = {"haystack_text": None, "lengths": [500], "depths": [0.5], "n_per_cell": 1, "seed": 0}


@pytest.mark.parametrize(
    ("name", "kind", "change"),
    [
        ("kind", "multihop", {}),
        ("depths", "single", {"depths": [1.5]}),
        ("lengths", "single", {"lengths": [0]}),
        ("length", "multikey", {"lengths": [200]}),  # too short for the needles and question
        ("haystack_text", "single", {"haystack_text": "  "}),
        ("n_per_cell", "single", {"n_per_cell": 0}),
        ("seed", "single", {"seed": "zero"}),
        ("hops", "variable_tracking", {"hops": 0}),
        ("hops", "single", {"hops": 2}),  # not an option of this kind
        ("num_values", "multivalue", {"num_values": 0}),
        ("num_distractors", "multikey", {"num_distractors": 64}),  # more keys than words
        ("value_type", "single", {"value_type": "hex"}),
        ("key_type", "single", {"key_type": "num"}),
    ],
)
def test_bad_grid_arguments_name_the_argument(name, kind, change):
    args = {**_GOOD, **change}
    grid_args = [args.pop(k) for k in ("haystack_text", "lengths", "depths", "n_per_cell", "seed")]
    with pytest.raises(ValueError, match=f"^{name}:"):
        ruler_grid(kind, grid_args[0], TOK, *grid_args[1:], **args)


def test_bad_example_and_score_arguments_name_the_argument():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="^depth:"):
        make_ruler_example("single", None, TOK, 500, -0.1, rng)
    with pytest.raises(ValueError, match="^haystack_ids:"):
        make_ruler_example("single", np.zeros((2, 3)), TOK, 500, 0.5, rng)
    exs = ruler_grid("single", None, TOK, [300], [0.5], 2, 0)
    with pytest.raises(ValueError, match="^logits_fn:"):
        score_ruler(lambda t: np.zeros((t.shape[0], 3, V)), exs)
    with pytest.raises(ValueError, match="^batch_size:"):
        score_ruler(_oracle, exs, batch_size=0)
    with pytest.raises(ValueError, match="^examples:"):
        score_ruler(_oracle, [])
    with pytest.raises(ValueError, match="^vocab_size:"):
        ruler_chance(exs, 256)  # the bos id 256 does not fit
