"""Where a trained model of a formal-language table goes wrong: accuracy by prefix length.

    python -m nested_jax.experiments.formal_probe --dir runs/paper_tables/formal/parity \\
        --models lstm transformer hope@token --seed 0 --out runs/probe_parity

A string of the next-character protocol is scored by *every* prediction (docs/RESULTS.md
"Formal-language protocol"), so a Bin1 score says that longer strings fail, not where. This
probe reloads the weights a finished run kept (``.params.npz``, see
:func:`~nested_jax.experiments.synthetic.run_file`) at the learning rate the table chose, predicts
every prefix of the Bin0 and Bin1 test strings and reports, per model:

* the accuracy of the prediction after a prefix of length ``p``, over all test strings at least
  that long (a curve over ``p``; the training window ends at the dashed line);
* the first wrong prefix length of each string that has one (median, and the share of those that
  lie past the longest training string).

A model that learned the language stays at 1 past the line; one that learned it only for the
lengths it saw falls there; one that never learned it is low everywhere. Writes
``<out>/probe_<task>.json`` and ``.png`` and prints a table.

With ``--hidden`` it also asks whether what the model loses is in its state or in its readout
(:func:`hidden_probe`): linear readouts of the final hidden states, fitted on half of the test
strings and scored on the other half, per band of prefix lengths. A readout fitted on a band's
own positions that reads them no better than the model does says the information is gone from
the hidden state; one that reads them well says the model's readout drifted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nested_jax.eval.formal_protocol import PROTOCOL_TASKS
from nested_jax.experiments import _training
from nested_jax.experiments.synthetic import run_file
from nested_jax.experiments.synthetic_data import SyntheticSettings, eval_sets
from nested_jax.files import write_json


def settings_of(result: dict) -> SyntheticSettings:
    """The :class:`SyntheticSettings` a ``synthetic`` result JSON was made with (lists back to
    the tuples the dataclass holds)."""

    def tuples(x):
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    return SyntheticSettings(**{k: tuples(v) for k, v in result["settings"].items()})


def load_run(directory: Path, result: dict, model: str, seed: int):
    """``(settings, trained)`` of ``model``'s run at ``seed`` and the table's chosen rate.

    Raises:
      ValueError: naming ``models`` when the table has no such model, or ``dir`` when the run or
        its weights are not on disk.
    """
    s = settings_of(result)
    rows = {r["model"]: r for r in result["rows"]}
    if model not in rows:
        raise ValueError(f"models: {model!r} is not in the table (has {list(rows)})")
    sweep = result.get("lr_sweep", {}).get(model, {})
    lr = sweep.get("chosen", rows[model]["lr"])
    wd = sweep.get("chosen_wd", s.weight_decay)
    mine = tuple(p for p in s.model_overrides if p[0] == model)
    si = dataclasses.replace(s, seed=seed, lr=lr, weight_decay=wd, model_overrides=mine)
    path = run_file(directory, s, model, seed, lr, wd).with_suffix(".params.npz")
    if not path.is_file():
        raise ValueError(f"dir: no weights for {model} seed {seed} at {path} (run the table first)")
    return si, restore(model, si, rows[model]["d_model"], path)


def load_recorded_run(directory: Path, model: str, seed: int, lr: float):
    """``(settings, trained)`` of ``model``'s run at ``seed`` and rate ``lr``, read from the run's
    own record (``<dir>/models/<task>/<model>-seed<k>*.json``, its settings and width) rather
    than from a table's summary: the probe of a table whose summary is not written yet.

    Raises:
      ValueError: naming ``lr`` when no run of ``model`` at ``seed`` and ``lr`` with its weights
        is kept under ``directory``.
    """
    for path in sorted(Path(directory).glob(f"models/*/{model}-seed{seed}*.json")):
        key = json.loads(path.read_text()).get("key", {})
        si = settings_of(key) if "settings" in key else None
        weights = path.with_suffix(".params.npz")
        if si and si.seed == seed and math.isclose(si.lr, lr) and weights.is_file():
            return si, restore(model, si, key["d_model"], weights)
    raise ValueError(
        f"lr: no kept run of {model} at seed {seed} and lr {lr:g} under {directory}/models"
    )


def restore(model: str, s: SyntheticSettings, d_model: int, weights: Path) -> _training.Trained:
    """``model`` built at settings ``s`` and width ``d_model`` with the weights kept at
    ``weights`` (a run's ``.params.npz``)."""
    graphdef, state_def, rest, _, state, _ = _training.build_training(model, s, d_model)
    params = _training.load_params(weights, state["params"])
    return _training.Trained(graphdef, state_def, rest, params)


def by_prefix(trained, s: SyntheticSettings) -> dict:
    """Per test bin, prefix-length accuracy and first-error lengths of ``trained`` on ``s``."""
    logits_fn = _training.make_logits_fn(trained)
    params = trained.params
    max_len = max(s.protocol_seq_len(w) for w in s.protocol_bins)
    right, seen, first = np.zeros(max_len), np.zeros(max_len), []
    for _, _, batches in eval_sets(s):
        for b in batches:
            pred = np.asarray(logits_fn(params, b["inputs"])).argmax(-1)
            ok = (pred == b["targets"]) & (b["loss_mask"] > 0)
            mask = b["loss_mask"] > 0
            t = mask.shape[1]
            right[:t] += ok.sum(0)
            seen[:t] += mask.sum(0)
            wrong = mask & ~ok
            first.extend(int(np.argmax(row)) for row in wrong if row.any())
    lengths = np.nonzero(seen)[0]
    return {
        "prefix_length": lengths.tolist(),
        "accuracy": (right[lengths] / seen[lengths]).tolist(),
        "strings": seen[lengths].astype(int).tolist(),
        "first_errors": first,
        # a window bounding n (aⁿbⁿ, ...) is not a prefix length: no line to draw
        "train_max": s.protocol_bins[0][1] if PROTOCOL_TASKS[s.name].window == "length" else None,
    }


def linear_readout(h, y, ridge: float = 1e-3):
    """The least-squares linear readout of classes ``y [n]`` from features ``h [n, d]``:
    ``W = argmin ‖[h, 1] W − Y‖² + λ‖W‖²`` with ``Y`` the one-hot targets and
    ``λ = ridge · tr(AᵀA) / (d + 1)``. Returns ``predict(h [m, d]) -> classes [m]`` (argmax)."""
    classes = np.unique(y)
    A = np.c_[h, np.ones(len(h))]
    gram = A.T @ A
    lam = ridge * np.trace(gram) / gram.shape[0]
    W = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), A.T @ (y[:, None] == classes))
    return lambda x: classes[(np.c_[x, np.ones(len(x))] @ W).argmax(-1)]


def _bands(top: int, width: int) -> list[tuple[int, int]]:
    """Prefix-length bands ``[lo, hi]`` of ``width`` covering ``1..top``; a remainder shorter
    than half a width joins the last band."""
    bands = [(lo, min(lo + width - 1, top)) for lo in range(1, top + 1, width)]
    if len(bands) > 1 and bands[-1][1] - bands[-1][0] + 1 < width / 2:
        bands[-2:] = [(bands[-2][0], top)]
    return bands


def hidden_probe(trained, s: SyntheticSettings, band_width: int = 10, ridge: float = 1e-3) -> dict:
    """Linear readouts of ``trained``'s final hidden states (the output head's input) per band of
    prefix lengths.

    The Bin0 and Bin1 test strings are split in halves (fixed seed). On the first half, one
    :func:`linear_readout` is fitted on every position of the Bin0 strings, and one on each
    band's own positions (bands of ``band_width`` prefix lengths); both are scored on the second
    half.

    Returns ``{"bands": [[lo, hi], ...], "model": the model's own accuracy, "probe_bin0",
    "probe_band": the two readouts' accuracies, "hidden_norm": mean ‖h‖}``, lists per band.
    """
    params = trained.params
    hidden_fn = _training.make_hidden_fn(trained)
    logits_fn = _training.make_logits_fn(trained)
    parts = {k: [] for k in ("h", "y", "pos", "right", "bin", "string")}
    n_strings = 0
    for b_idx, (_, _, batches) in enumerate(eval_sets(s)):
        for b in batches:
            h = np.asarray(hidden_fn(params, b["inputs"]))
            right = np.asarray(logits_fn(params, b["inputs"])).argmax(-1) == b["targets"]
            rows, cols = np.nonzero(b["loss_mask"] > 0)  # every scored position, string by string
            for key, x in (
                ("h", h[rows, cols]),
                ("y", b["targets"][rows, cols]),
                ("pos", cols),  # the prefix length, as in by_prefix
                ("right", right[rows, cols]),
                ("bin", np.full(rows.size, b_idx)),
                ("string", n_strings + rows),
            ):
                parts[key].append(x)
            n_strings += h.shape[0]
    h, y, pos, right, in_bin, string = (np.concatenate(parts[k]) for k in parts)
    fit_half = (np.random.default_rng(0).permutation(n_strings) < n_strings // 2)[string]

    def fit(sel):
        return linear_readout(h[sel], y[sel], ridge)

    def score(readout, sel):
        return float(np.mean(readout(h[sel]) == y[sel]))

    read_bin0 = fit(fit_half & (in_bin == 0))
    out = {"bands": [], "model": [], "probe_bin0": [], "probe_band": [], "hidden_norm": []}
    for lo, hi in _bands(int(pos.max()), band_width):
        band = (pos >= lo) & (pos <= hi)
        fit_sel, test_sel = band & fit_half, band & ~fit_half
        if not fit_sel.any() or not test_sel.any():
            continue
        out["bands"].append([lo, hi])
        out["model"].append(float(right[test_sel].mean()))
        out["probe_bin0"].append(score(read_bin0, test_sel))
        out["probe_band"].append(score(fit(fit_sel), test_sel))
        out["hidden_norm"].append(float(np.linalg.norm(h[test_sel], axis=1).mean()))
    return out


def _hidden_lines(model: str, x: dict) -> str:
    head = f"== {model} hidden-state readouts (prefix band: model / fitted on Bin0 / on the band)"
    cells = zip(x["bands"], x["model"], x["probe_bin0"], x["probe_band"], strict=True)
    lines = [f"   {lo}-{hi}: {a:.3f} / {b:.3f} / {c:.3f}" for (lo, hi), a, b, c in cells]
    return "\n".join([head, *lines])


def probe(
    directory: str | Path, models: Sequence[str], seed: int, out: str | Path, hidden: bool = False
) -> dict:
    """Probe every model of ``models`` in the table folder ``directory`` (module docstring);
    ``hidden``: add :func:`hidden_probe` per model (key ``hidden``)."""
    directory = Path(directory)
    found = sorted(directory.glob("protocol_*.json"))
    if len(found) != 1:
        raise ValueError(f"dir: expected one protocol_<task>.json in {directory}, found {found}")
    result = json.loads(found[0].read_text())
    per_model, s = {}, None
    for model in models:
        s, trained = load_run(directory, result, model, seed)
        per_model[model] = by_prefix(trained, s)
        print(f"== {model}: {_summary(per_model[model])}", flush=True)
        if hidden:
            per_model[model]["hidden"] = hidden_probe(trained, s)
            print(_hidden_lines(model, per_model[model]["hidden"]), flush=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"task": result["task"], "seed": seed, "models": per_model}
    report["plot"] = str(_plot(per_model, s, out / f"probe_{s.name}.png"))
    write_json(out / f"probe_{s.name}.json", report)
    return report


def _summary(x: dict) -> str:
    first = np.asarray(x["first_errors"])
    if not first.size:
        return "no wrong prediction"
    line = f"{first.size} strings wrong, the first error at prefix length {np.median(first):.0f}"
    line += " (median)"
    if x["train_max"] is not None:
        line += f", {np.mean(first > x['train_max']):.0%} of them past {x['train_max']}"
    return line


def _plot(per_model: dict, s: SyntheticSettings, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for model, x in per_model.items():
        ax.plot(x["prefix_length"], x["accuracy"], label=model, lw=1.3)
    train_max = next(iter(per_model.values()))["train_max"]
    if train_max is not None:
        ax.axvline(train_max + 0.5, color="k", ls="--", lw=0.8, label="longest training string")
    ax.set_xlabel("prefix length p")
    ax.set_ylabel("accuracy of the prediction after p")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{s.task}: accuracy by prefix length (test strings of Bin0 and Bin1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def probe_parser(module: str, description: str, dir_help: str) -> argparse.ArgumentParser:
    """The arguments every probe of a table's kept runs takes: ``--dir`` (the table's folder),
    ``--models``, ``--seed``, ``--out``."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    p.add_argument("--dir", required=True, help=dir_help)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    p = probe_parser(
        "nested_jax.experiments.formal_probe",
        "accuracy by prefix length of trained formal-language models",
        "a table's task folder (has protocol_<task>.json)",
    )
    p.add_argument(
        "--hidden", action="store_true",
        help="also fit linear readouts of the final hidden states per band of prefix lengths",
    )  # fmt: skip
    args = p.parse_args(argv)
    return _training.print_table(
        lambda: probe(args.dir, args.models, args.seed, args.out, hidden=args.hidden)
    )


if __name__ == "__main__":
    sys.exit(main())
