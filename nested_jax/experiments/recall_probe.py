"""Why a recall table ranks its models as it does: what the gated delta layers choose to write,
and what HOLA's cache holds when the queries come.

    python -m nested_jax.experiments.recall_probe --dir runs/recall/hola \\
        --models hola hola@recency gdn --seed 0 --multipliers 1 4 16 --out runs/recall/probe_hola

A ``recall:kv`` row (:mod:`nested_jax.eval.recall`) has four kinds of token: filler, the pairs'
keys and values, and the query section (the QUERY marker and the queried keys and values). This
probe reloads the weights a finished table run kept (``.params.npz``, at the rate the table chose)
and, on held-out rows ``m ×`` the training length, reports per model and layer:

* the write strength and the retention of the memory, averaged over heads and tokens of each kind:
  ``β_t`` and ``α_t = exp(g_t)`` of a delta state (SPEC §1), the inner rate ``θ_t`` and
  ``1 − α_t`` of a Titans memory (SPEC §2) — a memory that keeps its pairs at any length writes
  the pairs (strong writes) and neither writes nor forgets on filler (write ≈ 0, retain ≈ 1);
* HOLA (SPEC §5): at the QUERY marker, which kinds of token fill the persistent cache (shares of
  its valid entries), the share of the rows' pairs whose value (and key) token sits in it in at
  least one head, and the mean eviction score ``m_t = β_t‖e_t‖`` of the kept entries per kind.

* the answers' accuracy split by where the queried pair sits among the filler: pairs ahead of
  the row's first filler token against the rest, and the rest by the count of filler tokens
  between the pair and the query (:func:`split_by_filler`) — a state that decays loses the pairs
  with the most filler after them; a model hurt by the filler itself loses every pair after it.

Writes ``<out>/recall_probe.json`` and ``.png`` (β by kind per model; HOLA's cache make-up by
length) and prints one line per model and length. ``--lr`` probes a run of a table whose summary
is not written yet, at that rate (the settings from the run's own record).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested_jax.eval.recall import RecallVocab
from nested_jax.experiments import _training
from nested_jax.experiments.formal_probe import load_recorded_run, load_run, probe_parser
from nested_jax.experiments.synthetic_data import recall_batch
from nested_jax.files import write_json
from nested_jax.layers.titans import NeuralMemory

KINDS = ("filler", "key", "value", "query")


def token_kinds(inputs: np.ndarray, vocab: RecallVocab) -> np.ndarray:
    """``int8 [B, T]``: the index in :data:`KINDS` of every input token (everything from the
    QUERY marker on is ``query``).

    Raises:
      ValueError: naming ``inputs`` when it is not ``int [B, T]`` with one QUERY per row.
    """
    inputs = np.asarray(inputs)
    marker = inputs == vocab.QUERY
    if inputs.ndim != 2 or not (marker.sum(-1) == 1).all():
        shape = inputs.shape
        raise ValueError(f"inputs: expected int [B, T] rows with one QUERY each, got {shape}")
    kinds = np.zeros(inputs.shape, np.int8)
    kinds[(inputs >= vocab.key_base) & (inputs < vocab.value_base)] = 1
    kinds[(inputs >= vocab.value_base) & (inputs < vocab.filler_base)] = 2
    kinds[np.cumsum(marker, axis=1) > 0] = 3
    return kinds


def mean_by_kind(x: np.ndarray, kinds: np.ndarray, per_head: bool = False) -> list:
    """Mean of ``x [B, T, ...]`` over the tokens of each kind, its trailing axes averaged too (None
    for an absent kind). ``per_head``: one mean per entry of the last axis instead (``x [B, T,
    H]``: a mean over heads can hide one head that keeps and one that forgets)."""
    x = np.asarray(x, np.float64).reshape(*kinds.shape, -1)
    x = x if per_head else x.mean(-1)
    return [
        x[kinds == i].mean(0).tolist() if (kinds == i).any() else None for i in range(len(KINDS))
    ]


@contextlib.contextmanager
def _recording_gates(model, store: list):
    """Within the block, every delta-rule layer of ``model`` hands its ``(β, exp g)`` and every
    Titans memory its ``(θ, 1 − α)`` to ``store`` — ``(write, retain)`` per layer and call, in
    order (``retain`` None without a decay)."""

    def record(write, retain):
        store.append((np.asarray(write), None if retain is None else np.asarray(retain)))

    mixer_cls = type(model.blocks.mixer)
    patches = [mock.patch.object(NeuralMemory, "gates", _recorded_titans_gates(record))]
    if hasattr(mixer_cls, "_rule"):
        patches.append(mock.patch.object(mixer_cls, "_rule", _recorded_rule(mixer_cls, record)))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _recorded_rule(mixer_cls, record):
    inner = mixer_cls._rule

    def rule(self, q, k, v, g, beta, **kw):
        jax.debug.callback(record, beta, None if g is None else jnp.exp(g), ordered=True)
        return inner(self, q, k, v, g, beta, **kw)

    return rule


def _recorded_titans_gates(record):
    inner = NeuralMemory.gates

    def gates(self, x):
        theta, eta, alpha = inner(self, x)
        jax.debug.callback(record, theta, 1.0 - alpha, ordered=True)
        return theta, eta, alpha

    return gates


def _model(trained):
    graphdef, state_def, rest, params = trained
    return nnx.merge(graphdef, jax.tree.unflatten(state_def, jax.tree.leaves(params)), rest)


def gate_statistics(trained, inputs: np.ndarray, kinds: np.ndarray) -> dict | None:
    """``{"write", "retain", "retain_by_head"}``: per layer, the mean write strength and retention
    of each token kind (lists ``[n_layers][len(KINDS)]``; ``retain_by_head`` adds a last axis of
    heads): ``β`` and ``exp(g)`` of a delta-rule layer, the inner rate ``θ`` and ``1 − α`` of a
    Titans memory (the retention None without a decay); None for a model with neither
    (attention)."""
    model = _model(trained)
    store: list = []
    with _recording_gates(model, store):
        # run eagerly: the patched gates are traced afresh, never taken from a cached trace
        jax.block_until_ready(model(jnp.asarray(inputs))[0])
        jax.effects_barrier()
    if not store:
        return None
    write = [mean_by_kind(w, kinds) for w, _ in store]
    if store[0][1] is None:
        return {"write": write, "retain": None, "retain_by_head": None}
    return {
        "write": write,
        "retain": [mean_by_kind(r, kinds) for _, r in store],
        "retain_by_head": [mean_by_kind(r, kinds, per_head=True) for _, r in store],
    }


def hola_cache_contents(trained, inputs: np.ndarray, kinds: np.ndarray) -> dict | None:
    """What HOLA's persistent cache holds after the haystack (the tokens before QUERY), per layer:
    ``entries`` (valid slots per head, mean), ``share`` of its valid entries of each kind,
    ``kept_values`` / ``kept_keys`` (share of the rows' pairs whose value / key token is in the
    cache of at least one head) and ``score`` (mean eviction score of the kept entries of each
    kind); None for a model without HOLA's cache."""
    model = _model(trained)
    prefix = int(np.argmax(kinds[0] == 3))  # the QUERY marker's index, the same in every row
    tokens = jnp.asarray(inputs[:, :prefix])
    cache = model.init_cache(tokens.shape[0], prefix)
    state = getattr(cache.layers, "state", None)
    if not hasattr(state, "cache_pos"):
        return None
    _, cache = model(tokens, cache=cache)
    st = jax.tree.map(np.asarray, cache.layers.state)
    rows = len(inputs)
    # one column past the haystack stands for an empty slot: kind -1, never a kept token
    hay = np.concatenate([kinds[:, :prefix], np.full((rows, 1), -1, kinds.dtype)], axis=1)
    out = {"entries": [], "share": [], "kept_values": [], "kept_keys": [], "score": []}
    for pos, valid, score in zip(st.cache_pos, st.cache_valid, st.cache_score, strict=True):
        slot = np.where(valid, pos, prefix).reshape(rows, -1)  # [B, H * w] haystack positions
        kind = np.take_along_axis(hay, slot, axis=1)
        out["entries"].append(float(valid.sum(-1).mean()))  # valid slots per head
        n = max(int((kind >= 0).sum()), 1)
        out["share"].append([float((kind == i).sum() / n) for i in range(len(KINDS))])
        out["score"].append(mean_by_kind(score.reshape(rows, -1), kind))
        held = np.zeros(hay.shape, bool)
        np.put_along_axis(held, slot, True, axis=1)
        out["kept_values"].append(float(held[hay == 2].mean()))
        out["kept_keys"].append(float(held[hay == 1].mean()))
    return out


def split_by_filler(
    inputs: np.ndarray, answers: np.ndarray, right: np.ndarray, vocab: RecallVocab, bands: int = 4
) -> dict:
    """The accuracy of recall answers by where their pair sits among the filler.

    Args:
      inputs: ``int [B, T]`` recall rows (one QUERY each).
      answers: ``bool [B, T]``, the scored positions (each holds a queried key; its answer is the
        next token).
      right: ``bool [B, T]``, whether the prediction at each position is the answer.
      vocab: the rows' :class:`~nested_jax.eval.recall.RecallVocab`.
      bands: equal bands of the filler count after a pair, over ``[0, the most in a row]``.

    Returns:
      ``{"before_filler": [accuracy, n], "after_filler": [accuracy, n], "by_filler_after":
      [[lo, hi, accuracy, n], ...]}``: pairs whose key precedes every filler token of its row,
      the others, and the others by the number of filler tokens between the pair and the QUERY
      marker (``lo <= count < hi``; the last band includes ``hi``). Accuracy None where n is 0.

    Raises:
      ValueError: naming ``answers`` or ``right`` when not the shape of ``inputs``.
    """
    inputs = np.asarray(inputs)
    kinds = token_kinds(inputs, vocab)
    for name, x in (("answers", answers), ("right", right)):
        if np.shape(x) != inputs.shape:
            raise ValueError(f"{name}: expected shape {inputs.shape} (inputs'), got {np.shape(x)}")
    filler_seen = np.cumsum(kinds == 0, axis=1)  # filler tokens up to and including t
    before, after = [], []  # (filler after the pair, right) per answer
    for b, t in zip(*np.nonzero(answers), strict=True):
        key = np.nonzero((inputs[b] == inputs[b, t]) & (kinds[b] == 1))[0][0]
        between = filler_seen[b, -1] - filler_seen[b, key]  # all filler lies before the query
        (before if filler_seen[b, key] == 0 else after).append((between, bool(right[b, t])))

    def rate(group):
        return [float(np.mean([r for _, r in group])) if group else None, len(group)]

    top = max([n for n, _ in after], default=0)
    edges = np.linspace(0, top, bands + 1)
    by = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        last = i == bands - 1
        group = [x for x in after if lo <= x[0] < hi or (last and x[0] == hi)]
        by.append([float(lo), float(hi), *rate(group)])
    return {"before_filler": rate(before), "after_filler": rate(after), "by_filler_after": by}


def probe_model(trained, s, multipliers: Sequence[int]) -> dict:
    """Gate statistics (and HOLA's cache contents) of ``trained`` on one held-out batch of its
    task ``s`` (its haystack, ``batch_size`` rows) at each length ``m × L`` of ``multipliers``,
    the pairs drawn over the whole haystack, and its answers on that batch split by the filler
    around their pairs (:func:`split_by_filler`)."""
    sizes = s.recall_batch_sizes()
    vocab = RecallVocab(sizes["keys"], sizes["values"], sizes["filler"])
    logits_fn = _training.make_logits_fn(trained)
    per_length = {}
    for m in multipliers:
        batch = recall_batch(s, np.random.default_rng(10_000 + m), m)
        kinds = token_kinds(batch["inputs"], vocab)
        predicted = np.asarray(logits_fn(trained.params, batch["inputs"])).argmax(-1)
        answers = batch.get("score_mask", batch["loss_mask"]) > 0
        right = predicted == batch["targets"]
        per_length[f"{m}x"] = {
            "gates": gate_statistics(trained, batch["inputs"], kinds),
            "cache": hola_cache_contents(trained, batch["inputs"], kinds),
            "answers": split_by_filler(batch["inputs"], answers, right, vocab),
        }
    return per_length


def probe(
    directory: str | Path,
    models: Sequence[str],
    seed: int,
    multipliers: Sequence[int],
    out,
    lr: float | None = None,
) -> dict:
    """Probe every model of ``models`` in the recall table folder ``directory`` (module
    docstring): the runs at the table's chosen rates, or at ``lr`` when given (read from the
    runs' own records, so the table's summary need not exist).

    Raises:
      ValueError: naming ``dir`` without a table result (``lr`` None), ``multipliers`` when not
        ints >= 1, ``models`` (:func:`~nested_jax.experiments.formal_probe.load_run`) or ``lr``
        (:func:`~nested_jax.experiments.formal_probe.load_recorded_run`).
    """
    directory = Path(directory)
    if not multipliers or any(not isinstance(m, int) or m < 1 for m in multipliers):
        raise ValueError(f"multipliers: expected ints >= 1, got {list(multipliers)}")
    if lr is None:
        found = sorted(directory.glob("recall_*.json"))
        if len(found) != 1:
            raise ValueError(f"dir: expected one recall_<task>.json in {directory}, found {found}")
        result = json.loads(found[0].read_text())
    report = {"dir": str(directory), "seed": seed, "lr": lr, "models": {}}
    for model in models:
        if lr is None:
            s, trained = load_run(directory, result, model, seed)
        else:
            s, trained = load_recorded_run(directory, model, seed, lr)
        report["models"][model] = probe_model(trained, s, multipliers)
        for length, x in report["models"][model].items():
            print(f"== {model} {length}: {summary(x)}", flush=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report["plot"] = str(_plot(report["models"], out / "recall_probe.png"))
    write_json(out / "recall_probe.json", report)
    return report


def summary(x: dict) -> str:
    """One line: the last layer's write strength (and retention) on filler vs values, HOLA's
    cache make-up, and the answers' accuracy ahead of and after the row's first filler token."""

    def number(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}"

    def pair(v: list) -> str:  # a kind absent from the rows (no filler at all) has None
        return f"{number(v[0])} filler / {number(v[2])} value"

    parts = []
    if x["gates"] is not None:
        parts.append(f"write {pair(x['gates']['write'][-1])}")
        if x["gates"]["retain"] is not None:
            parts.append(f"retain {pair(x['gates']['retain'][-1])}")
    if x["cache"] is not None:
        share = x["cache"]["share"][-1]
        kept = x["cache"]["kept_values"][-1]
        parts.append(
            f"cache {x['cache']['entries'][-1]:.0f} entries/head, {share[1] + share[2]:.0%} pair "
            f"tokens, {kept:.0%} of values kept"
        )
    text = "; ".join(parts) + " (last layer)" if parts else "no delta-rule mixer"
    before, after = x["answers"]["before_filler"], x["answers"]["after_filler"]
    return (
        f"{text}; answers {number(before[0])} ahead of the first filler (n {before[1]}), "
        f"{number(after[0])} after it (n {after[1]})"
    )


def _plot(models: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    lengths = list(next(iter(models.values())))
    width = 0.8 / max(len(models), 1)
    for i, (name, per_length) in enumerate(models.items()):
        gates = per_length[lengths[-1]]["gates"]
        if gates is not None:
            write = np.asarray(gates["write"], dtype=float).mean(0)  # over layers
            ax.bar(np.arange(len(KINDS)) + i * width, write, width, label=name)
        cache = [per_length[n]["cache"] for n in lengths]
        if cache[0] is not None:
            bx.plot(lengths, [np.mean(c["kept_values"]) for c in cache], marker="o", label=name)
    ax.set_xticks(np.arange(len(KINDS)) + 0.4 - width / 2, KINDS)
    ax.set_ylabel("mean write strength β or θ (layers averaged)")
    ax.set_title(f"what the delta state writes, {lengths[-1]} rows")
    ax.legend(fontsize=7)
    bx.set_ylim(-0.02, 1.02)
    bx.set_xlabel("row length (× training length)")
    bx.set_ylabel("share of values in the cache at QUERY")
    bx.set_title("HOLA's persistent cache (layers averaged)")
    if bx.lines:
        bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = probe_parser(
        "nested_jax.experiments.recall_probe",
        "what trained recall models write and what HOLA's cache keeps",
        "a recall table's folder (has recall_<task>.json)",
    )
    p.add_argument("--multipliers", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument(
        "--lr", type=float, default=None,
        help="probe the runs at this rate, from their own records (default: the table's choice)",
    )  # fmt: skip
    args = p.parse_args(argv)
    return _training.print_table(
        lambda: probe(args.dir, args.models, args.seed, args.multipliers, args.out, args.lr)
    )


if __name__ == "__main__":
    sys.exit(main())
