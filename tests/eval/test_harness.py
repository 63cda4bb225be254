"""lm-evaluation-harness adapter (:mod:`nested_jax.eval.harness`) on tiny trained workdirs: every
request type against an independent computation from the model's full-sequence logits, the long
context rules (streaming for GDN, left truncation / rolling windows for attention), and lm_eval
runs over a local task (no network)."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance  # the extra "hf" (scripts/test installs it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import (  # noqa: E402
    defaults_preset,
    subprocess_env,
    tiny_overrides,
    write_corpus,
)

from nested_jax import cli  # noqa: E402
from nested_jax.eval import harness  # noqa: E402
from nested_jax.models.generate import generate  # noqa: E402

CHUNK = 16  # tokens per streamed call: below the texts' lengths, so streaming is exercised
SEQ_LEN = 32  # data.seq_len of the tiny runs: the transformer's default max_length


@pytest.fixture(scope="module")
def offline():
    """No Hugging Face network access: the offline switches on, and any socket connect refused
    and recorded (the tests assert none was tried)."""
    attempts: list = []

    def refuse(self, address):
        attempts.append(address)
        raise OSError(f"network access attempted in a test: {address}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        import datasets.config
        import huggingface_hub.constants

        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(socket.socket, "connect", refuse)
        yield attempts


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """``{"transformer": workdir, "gdn": workdir}``: 4 training steps each."""
    root = tmp_path_factory.mktemp("harness")
    corpus = write_corpus(root / "corpus")
    out = {}
    for name in ("transformer", "gdn"):
        overrides = tiny_overrides(corpus, root / "data_cache", **{"model.name": name})
        argv = ["train", "--config", str(defaults_preset(root)), "--workdir", str(root / name)]
        for o in overrides:
            argv += ["--set", o]
        assert cli.main(argv) == 0
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def lms(workdirs):
    return {
        name: harness.NestedJaxLM(workdir=str(w), chunk=str(CHUNK), batch_size="4")
        for name, w in workdirs.items()
    }


REF_LEN = 192  # every reference pass is one forward over this many positions (one compile)


@functools.cache
def _forward(lm):
    """The restored model's jitted one-pass forward ``tokens [1, REF_LEN] -> logits``."""
    graphdef, state = nnx.split(lm.trained.model())
    forward = jax.jit(lambda st, tokens: nnx.merge(graphdef, st)(tokens)[0])
    return functools.partial(forward, state)


def _full_logits(lm, ids: list[int]) -> np.ndarray:
    """``[T, V]`` logits of one pass of the restored model over ``ids`` (no cache, no chunks;
    right-padded to ``REF_LEN``, which a causal model does not see)."""
    assert len(ids) <= REF_LEN
    padded = np.zeros((1, REF_LEN), np.int32)
    padded[0, : len(ids)] = ids
    return np.asarray(_forward(lm)(jnp.asarray(padded))[0, : len(ids)], np.float64)


def _reference(lm, ids: list[int], m: int) -> tuple[float, bool]:
    """Σ log p and all-greedy of the last ``m`` ids of ``ids`` given the ones before, from the
    full-sequence logits (log_softmax computed here in float64)."""
    logits = _full_logits(lm, ids[:-1])
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    targets = np.asarray(ids[1:])
    rows = np.arange(len(targets))[-m:]
    return float(logp[rows, targets[rows]].sum()), bool(
        (logits[rows].argmax(-1) == targets[rows]).all()
    )


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.mark.parametrize("name", ["transformer", "gdn"])
def test_loglikelihood_equals_the_full_sequence_logits(lms, name):
    lm = lms[name]
    bos = lm.tokenizer.bos_id
    enc = lm.tokenizer.encode
    pairs = [
        ("The letter", " e"),
        ("", "Some words"),  # empty context: the separator conditions the continuation
        ("a b", " c d e f"),
        ("Letters and words of some length", " here"),  # 40 ids: > chunk (and > max_length)
        ("x y z," * 8, " w"),  # > max_length: the transformer reads only the last 32 inputs
    ]
    got = lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    for (ctx, cont), (lp, greedy) in zip(pairs, got, strict=True):
        ids = [bos] + enc(ctx + cont)
        if lm.bounded:
            assert lm.max_length == SEQ_LEN
            ids = ids[-(SEQ_LEN + 1) :]  # the documented left truncation
        want_lp, want_greedy = _reference(lm, ids, len(enc(cont)))
        assert lp == pytest.approx(want_lp, abs=2e-5, rel=1e-6)
        assert greedy == want_greedy
    assert lm.bounded == (name == "transformer")

    # is_greedy True: a continuation of the model's own argmax ids (token level).
    ctx = [bos] + enc("The letter of")
    cont = []
    for _ in range(3):
        cont.append(int(_full_logits(lm, ctx + cont)[-1].argmax()))
    wrong = [(cont[0] + 1) % lm.tokenizer.vocab_size] + cont[1:]
    (lp, greedy), (lp_wrong, greedy_wrong) = lm._loglikelihood_tokens(
        [(("", ""), ctx, cont), (("", ""), ctx, wrong)], disable_tqdm=True
    )
    assert greedy and not greedy_wrong
    assert lp == pytest.approx(_reference(lm, ctx + cont, 3)[0], abs=2e-5)
    assert lp_wrong == pytest.approx(_reference(lm, ctx + wrong, 3)[0], abs=2e-5)


def test_rolling_loglikelihood_streams_the_whole_text_for_gdn(lms):
    lm = lms["gdn"]
    text = "The quick brown fox jumps over the lazy dog; the dog does not mind. " * 2
    short = "A short one."
    ids = [lm.tokenizer.bos_id] + lm.tokenizer.encode(text)
    assert len(ids) - 1 > 4 * CHUNK and len(ids) - 1 > 4 * SEQ_LEN  # streamed in pieces
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,), (short,), ("",)]))
    want = _reference(lm, ids, len(ids) - 1)[0]
    assert got[0] == pytest.approx(want, rel=1e-6, abs=1e-4)  # one pass over every token
    short_ids = [lm.tokenizer.bos_id] + lm.tokenizer.encode(short)
    assert got[1] == pytest.approx(_reference(lm, short_ids, len(short_ids) - 1)[0], abs=2e-5)
    assert got[2] == 0.0  # nothing to score


def test_rolling_loglikelihood_of_attention_uses_disjoint_windows(lms, workdirs):
    lm = lms["transformer"]
    text = "The quick brown fox jumps over the lazy dog; the dog does not mind."
    toks = lm.tokenizer.encode(text)
    n, size = len(toks), SEQ_LEN
    assert n > 2 * size
    # The documented rule, written out: the first window predicts toks[:L] after the separator;
    # each next one predicts up to L new ids with the L inputs ending just before the last one.
    want = _reference(lm, [lm.tokenizer.bos_id] + toks[:size], size)[0]
    done = size
    while done < n:
        end = min(done + size, n)
        want += _reference(lm, toks[end - size - 1 : end], end - done)[0]
        done = end
    (got,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    assert got == pytest.approx(want, abs=1e-4, rel=1e-6)

    # With a context limit above the text, one window: the one-pass sum.
    wide = harness.NestedJaxLM(workdir=str(workdirs["transformer"]), max_length="128")
    assert wide.max_length == 128
    (one,) = wide.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    ids = [lm.tokenizer.bos_id] + toks
    assert one == pytest.approx(_reference(lm, ids, n)[0], abs=1e-4, rel=1e-6)
    assert abs(one - got) > 1e-3  # the windows did cut the context


def _greedy_reference(lm, prompt_ids: list[int], max_new: int) -> list[int]:
    """``nested_jax.models.generate`` greedy ids after the prompt, cut at the separator/EOS."""
    out = generate(
        lm.trained.model(), jnp.asarray([prompt_ids]), max_new, rng=jax.random.key(0),
        temperature=0.0,
    )  # fmt: skip
    ids = [int(i) for i in np.asarray(out[0, len(prompt_ids) :])]
    eos = lm.tokenizer.eos_id
    return ids[: ids.index(eos)] if eos in ids else ids


PROMPTS = ["The letter of", "Words, words and more words of some length", "x y z," * 8]


def _greedy_texts(lm, prompts, g):
    """The reference continuations: ``generate`` greedy from each (documented-truncated) prompt."""
    texts = []
    for prompt in prompts:
        ids = [lm.tokenizer.bos_id] + lm.tokenizer.encode(prompt)
        if lm.bounded:
            ids = ids[-(SEQ_LEN - g) :]  # the documented left truncation of the prompt
        texts.append(lm.tokenizer.decode(_greedy_reference(lm, ids, g)))
    return texts


@pytest.mark.parametrize("name", ["transformer", "gdn"])
def test_generate_until_matches_greedy_generate(lms, name):
    lm, g = lms[name], 12
    # Prompts of 14, 43 and 49 ids in one batch: rows of different lengths share the decode steps
    # (the gdn reads the shortest in chunks first; the transformer's are cut to 20 ids).
    got = lm.generate_until(
        _requests("generate_until", [(p, {"until": [], "max_gen_toks": g}) for p in PROMPTS]),
        disable_tqdm=True,
    )
    assert got == _greedy_texts(lm, PROMPTS, g)


def test_generate_until_stops_at_the_until_strings(lms):
    lm, g = lms["gdn"], 12
    texts = _greedy_texts(lm, PROMPTS, g)
    # For each text, its first two-character piece that first occurs after the start: the answer
    # is the text before it (several rows, so each row stops on its own).
    args, cuts = [], []
    for prompt, text in zip(PROMPTS, texts, strict=True):
        k = next((k for k in range(1, len(text) - 1) if text.find(text[k : k + 2]) == k), None)
        if k is not None:
            args.append((prompt, {"until": ["\x00never", text[k : k + 2]], "max_gen_toks": g}))
            cuts.append(text[:k])
    assert len(args) >= 2, f"the greedy texts {texts!r} repeat from their first character"
    assert lm.generate_until(_requests("generate_until", args), disable_tqdm=True) == cuts
    # max_gen_toks from the request, a single until string, and the refusal of sampling.
    (short,) = lm.generate_until(
        _requests("generate_until", [(PROMPTS[0], {"until": "\x00", "max_gen_toks": 3})])
    )
    first = _greedy_reference(lm, [lm.tokenizer.bos_id] + lm.tokenizer.encode(PROMPTS[0]), 3)
    assert short == lm.tokenizer.decode(first)
    with pytest.raises(ValueError, match="^do_sample: "):
        lm.generate_until(_requests("generate_until", [("a", {"do_sample": True})]))


def test_bounded_model_refuses_what_does_not_fit(lms):
    lm = lms["transformer"]
    with pytest.raises(ValueError, match="^continuation: 40 tokens exceed max_length=32"):
        lm.loglikelihood(_requests("loglikelihood", [("a", "b" * 40)]))
    with pytest.raises(ValueError, match="^max_gen_toks: 32 leaves no room"):
        lm.generate_until(_requests("generate_until", [("a", {"max_gen_toks": 32})]))


@pytest.mark.parametrize(
    "args, message",
    [
        ({}, "workdir: required model argument"),
        ({"workdir": "w", "pretrained": "gpt2"}, "pretrained: unknown model argument"),
        ({"workdir": "w", "chunk": "0"}, "chunk: expected an integer >= 1, got '0'"),
        ({"workdir": "w", "batch_size": "auto"}, "batch_size: 'auto' is not supported"),
        ({"workdir": "w", "max_length": 1.5}, "max_length: expected an integer >= 0"),
    ],
)
def test_bad_model_args_name_the_argument(args, message):
    with pytest.raises(ValueError) as err:
        harness.NestedJaxLM(**args)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_main_hands_argv_to_the_lm_eval_command_line(capsys):
    assert harness.main(["--help"]) == 0
    assert "lm-eval" in capsys.readouterr().out
    assert harness.main(["run", "--no-such-flag", "x"]) == 2  # argparse's status, not an exit
    assert "--no-such-flag" in capsys.readouterr().err


def test_lm_eval_keeps_its_own_models():
    from lm_eval.api.registry import get_model

    assert get_model("nested_jax") is harness.NestedJaxLM
    assert get_model("dummy").__name__ == "DummyLM"  # lm_eval's table still resolves


def _write_tasks(directory: Path) -> tuple[list[dict], list[dict]]:
    """A multiple-choice and a generation task over JSONL files in ``directory`` (YAML configs
    with ``dataset_path: json``: read locally by ``datasets``)."""
    directory.mkdir(parents=True, exist_ok=True)
    mc = [
        {"q": "The letter", "choices": [" e", " z", " q"], "answer": 0},
        {"q": "Words and", "choices": [" more", " qqqq"], "answer": 0},
        {"q": "A b c", "choices": [" d", " xz"], "answer": 1},
        {"q": "", "choices": ["the", "zzz"], "answer": 0},
    ]
    gen = [{"q": "The letter of", "a": "e"}, {"q": "Words", "a": " "}]
    for name, docs in (("mc", mc), ("gen", gen)):
        lines = "".join(json.dumps(d) + "\n" for d in docs)
        (directory / f"{name}.jsonl").write_text(lines)
    (directory / "nj_mc.yaml").write_text(
        "task: nj_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {directory / 'mc.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )
    (directory / "nj_gen.yaml").write_text(
        "task: nj_gen\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {directory / 'gen.jsonl'}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{q}}"\n'
        'doc_to_target: "{{a}}"\n'
        'target_delimiter: ""\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 1\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return mc, gen


def test_simple_evaluate_runs_local_tasks_in_process(lms, tmp_path, offline):
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm = lms["gdn"]
    mc, gen = _write_tasks(tmp_path / "tasks")
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["nj_mc", "nj_gen"],
        # include_defaults=False: lm_eval's own ~10k task files are not indexed (seconds)
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
        num_fewshot=0,
    )
    assert offline == []
    acc = out["results"]["nj_mc"]["acc,none"]
    em = out["results"]["nj_gen"]["exact_match,none"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= em <= 1.0
    # The accuracy is the argmax of this model's loglikelihoods over each question's choices.
    right = 0
    for doc in mc:
        pairs = [(doc["q"], c) for c in doc["choices"]]
        lps = [lp for lp, _ in lm.loglikelihood(_requests("loglikelihood", pairs))]
        right += int(np.argmax(lps)) == doc["answer"]
    assert acc == pytest.approx(right / len(mc))
    answers = lm.generate_until(
        _requests("generate_until", [(d["q"], {"until": ["\n"], "max_gen_toks": 1}) for d in gen])
    )
    assert em == pytest.approx(np.mean([a == d["a"] for a, d in zip(answers, gen, strict=True)]))


@pytest.mark.slow  # lm_eval's command line indexes all its own task files first (~10 s)
def test_command_line_run_writes_the_results_json(workdirs, tmp_path, offline, capsys, monkeypatch):
    forks = []
    fork = os.fork

    def recording_fork():
        forks.append(1)
        return fork()

    monkeypatch.setattr(os, "fork", recording_fork)
    _write_tasks(tmp_path / "tasks")
    out = tmp_path / "out"
    base = ["--model", "nested_jax", "--tasks", "nj_mc", "--include_path", str(tmp_path / "tasks")]
    argv = base + [
        "--model_args", f"workdir={workdirs['transformer']},chunk=16",
        "--batch_size", "8",
        "--output_path", str(out),
    ]  # fmt: skip
    assert harness.main(argv) == 0
    assert offline == [] and forks == []  # no process forked from JAX's (the results table)
    (path,) = out.rglob("results_*.json")
    acc = json.loads(path.read_text())["results"]["nj_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    capsys.readouterr()
    assert harness.main(base + ["--model_args", "pretrained=x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: pretrained: unknown model argument of nested_jax")
    # `python -m nested_jax.eval.harness` is the same command (the model registered once).
    run = subprocess.run(
        [sys.executable, "-m", "nested_jax.eval.harness", "--help"],
        env=subprocess_env(tmp_path, devices=1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "lm-eval" in run.stdout
