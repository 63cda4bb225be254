"""``nested-jax report``: several evaluated runs side by side in one Markdown table, with plots.

    nested-jax report runs/tf runs/gdn reports/hope.json [--out reports/cmp]

Each RUN is a workdir that ``nested-jax eval`` evaluated (its ``eval_report.json`` is read) or the
path of such a JSON file; a local path or a URL. A run is named by its workdir's basename (for a
file not called ``eval_report.json``: the file's stem); two runs with one name are told apart by
their parent folders (``a/tf``, ``b/tf``), or else by a suffix (``tf``, ``tf-2``). Written into
``--out`` (default: the current directory), atomically, and the Markdown printed:

=======================  ======================================================================
file                     content
=======================  ======================================================================
``report.md``            summary table (a row per run: model, step, validation bits/byte, NIAH,
                         one column per RULER kind, BABILong), the example counts, NIAH and
                         BABILong accuracy by length (a row per run), the plots
``report.json``          ``{"runs": [row, ...], "plots": [path, ...]}``, the rows of
                         :func:`comparison_rows` plus each run's ``source`` (RUN as given)
``report_niah.png``      NIAH accuracy vs length, a line per run (mean over depths)
``report_babilong.png``  BABILong accuracy vs length, a line per run (mean over tasks), the
                         run's mean chance dashed
``report_ruler.png``     RULER exact match, grouped bars: a group per kind, a bar per run
=======================  ======================================================================

A plot is drawn only when some run has its suite. The input (``eval_report.json``, written by
:func:`nested_jax.eval.main.run_eval`; lengths and depths are JSON string keys)::

    {"workdir": str, "step": int, "model": str, "suites": [str, ...],
     "computed": {suite: {"step": int, "settings": {...}}},
     "validation": {"loss", "perplexity", "bits_per_byte", "tokens", "bytes", "batches"},
     "niah": {"accuracy": {length: {depth: acc}}, "overall", "num_examples"} | null,
     "ruler": {"haystack": "text" | "noise",
               "kinds": {kind: {"accuracy": {length: {depth: acc}}, "recall": {...},
                                "overall", "overall_recall", "num_examples"}}},
     "babilong": {"by_task": {task: {length: acc}}, "chance": {task: p}, "overall",
                  "num_examples"}}

Every section may be missing (older reports have no ``suites``, ``computed``, ``ruler`` or
``babilong``) or ``null``, and a number may be ``null`` (strict JSON's NaN); the tables show ``—``
there. ``nested-jax eval`` accumulates suites over calls: a suite whose ``computed`` step is not
the report's ``step`` (an older checkpoint) has that step after each of its numbers, ``0.450
(step 200)``, so results of different checkpoints are never mixed silently (a report without
``computed`` has every suite at its ``step``). The per-length numbers are plain means of the
report's cells:

    NIAH(n) = mean_d accuracy[n][d]        BABILong(n) = mean_t by_task[t][n]
    BABILong chance = mean_t chance[t]

(every NIAH cell holds ``eval.niah_per_cell`` examples and every BABILong task
``eval.babilong_per_length`` per length, so these are the accuracies over all examples of length
n). Overall numbers are the report's own ``overall`` (all examples of the suite or kind).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence

from nested_jax.files import (
    PathError,
    as_path,
    atomic_write_bytes,
    atomic_write_text,
    is_remote,
    resolve_path,
    write_json,
)

REPORT_FILE = "eval_report.json"
SECTIONS = ("validation", "niah", "ruler", "babilong")
PLOT_FILES = {
    "niah": "report_niah.png",
    "babilong": "report_babilong.png",
    "ruler": "report_ruler.png",
}
MISSING = "—"


# ---- loading ------------------------------------------------------------------------------------


def _report_path(run):
    """RUN's report file: ``RUN/eval_report.json`` for a folder, RUN itself otherwise."""
    path = as_path(run, "run")
    return path / REPORT_FILE if path.is_dir() else path


def load_report(run: str | os.PathLike) -> dict:
    """The ``eval_report.json`` of RUN (a workdir, or the path of the JSON file itself).

    Raises:
      ValueError: one line naming RUN, when there is no report, it is not valid JSON, or it is
        not an eval report (an object with ``model``, ``step`` and one of the sections
        validation / niah / ruler / babilong, each in the layout of the module docstring).
      PathError: see :func:`nested_jax.files.as_path` (a URL whose backend is missing).
    """
    path = _report_path(run)
    if not path.exists():
        if os.fspath(run).endswith(".json"):
            raise ValueError(f"run {run}: no such file")
        raise ValueError(
            f"run {run}: no {REPORT_FILE} (run `nested-jax eval --workdir {run}` first)"
        )
    try:
        report = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"run {run}: {path.name} is not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"run {run}: {path.name} is not valid JSON (line {err.lineno} column {err.colno}: "
            f"{err.msg})"
        ) from None
    except OSError as err:
        raise ValueError(f"run {run}: cannot read {path.name} ({err.strerror or err})") from None
    if not (
        isinstance(report, dict)
        and {"model", "step"} <= report.keys()
        and any(key in report for key in SECTIONS)
    ):
        raise ValueError(
            f"run {run}: {path.name} is not an eval report (expected an object with model, step "
            f"and one of {', '.join(SECTIONS)})"
        )
    try:
        report_row(report, "")  # every later table and plot reads the report through this
    except ValueError as err:
        raise ValueError(f"run {run}: {path.name} is not an eval report ({err})") from None
    return report


def _label(run) -> tuple[str, str]:
    """(the workdir's basename, its parent folder's name) for RUN."""
    path = as_path(run, "run")
    if not is_remote(path):
        path = resolve_path(path)  # "." and "runs/x/" have a name then
    if path.is_dir():
        return path.name, path.parent.name
    if path.name == REPORT_FILE:
        return path.parent.name, path.parent.parent.name
    return path.stem, path.parent.name


def unique_names(labels: Sequence[tuple[str, str]]) -> list[str]:
    """Distinct names from ``(basename, parent)`` pairs: a basename shared by several runs becomes
    ``parent/basename`` when that tells them apart, and a name still taken gets ``-2``, ``-3``."""
    bases = [base or "run" for base, _ in labels]
    groups: dict[str, list[int]] = {}
    for i, base in enumerate(bases):
        groups.setdefault(base, []).append(i)
    names = list(bases)
    for base, members in groups.items():
        parents = [labels[i][1] for i in members]
        if len(members) > 1 and all(parents) and len(set(parents)) == len(members):
            for i, parent in zip(members, parents, strict=True):
                names[i] = f"{parent}/{base}"
    out: list[str] = []
    for name in names:
        candidate, k = name, 1
        while candidate in out:
            k += 1
            candidate = f"{name}-{k}"
        out.append(candidate)
    return out


def run_names(runs: Sequence[str | os.PathLike]) -> list[str]:
    """:func:`unique_names` of the RUN arguments (see the module docstring)."""
    return unique_names([_label(run) for run in runs])


# ---- rows ---------------------------------------------------------------------------------------


def _number(x) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise ValueError(f"expected a number, got {x!r}")
    return float(x) if math.isfinite(x) else None


def _count(x) -> int | None:
    x = _number(x)
    return None if x is None else int(x)


def _mean(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _niah_row(s: dict) -> dict:
    acc = s["accuracy"]
    by_length = {
        str(int(n)): _mean(_number(a) for a in acc[n].values()) for n in sorted(acc, key=int)
    }
    return {
        "overall": _number(s["overall"]),
        "num_examples": _count(s["num_examples"]),
        "by_length": by_length,
    }


def _ruler_row(s: dict) -> dict:
    kinds = {
        str(kind): {
            "exact": _number(r["overall"]),
            "recall": _number(r["overall_recall"]),
            "num_examples": _count(r["num_examples"]),
        }
        for kind, r in s["kinds"].items()
    }
    haystack = s.get("haystack")
    return {"haystack": None if haystack is None else str(haystack), "kinds": kinds}


def _babilong_row(s: dict) -> dict:
    table = {t: {int(n): _number(a) for n, a in row.items()} for t, row in s["by_task"].items()}
    lengths = sorted({n for row in table.values() for n in row})
    return {
        "overall": _number(s["overall"]),
        "num_examples": _count(s["num_examples"]),
        "chance": _mean(_number(p) for p in s["chance"].values()),
        "by_length": {str(n): _mean(row.get(n) for row in table.values()) for n in lengths},
    }


_EXTRACT = {"niah": _niah_row, "ruler": _ruler_row, "babilong": _babilong_row}


def report_row(report: dict, name: str) -> dict:
    """One run's row: what the tables and plots show.

    Returns:
      ``{"name", "workdir", "model", "step", "steps": {suite: step computed at}, "bits_per_byte",
      "val_bytes",
      "niah": {"overall", "num_examples", "by_length": {length: mean over depths}} | None,
      "ruler": {"haystack", "kinds": {kind: {"exact", "recall", "num_examples"}}} | None,
      "babilong": {"overall", "num_examples", "chance": mean over tasks,
      "by_length": {length: mean over tasks}} | None}``; a missing number is None.
    Raises:
      ValueError: naming the section whose layout is not the module docstring's.
    """
    step = report.get("step")
    row = {
        "name": name,
        "workdir": None if report.get("workdir") is None else str(report["workdir"]),
        "model": str(report.get("model")),
        "step": None if step is None else _count(step),
    }
    row["steps"] = _suite_steps(report, row["step"])
    v = report.get("validation") or {}
    if not isinstance(v, dict):
        raise ValueError("validation: expected an object")
    row["bits_per_byte"] = _number(v.get("bits_per_byte"))
    row["val_bytes"] = _count(v.get("bytes"))
    for key, extract in _EXTRACT.items():
        section = report.get(key)
        try:
            row[key] = None if section is None else extract(section)
        except KeyError as err:
            raise ValueError(f"{key}: no {err}") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{key}: unexpected layout ({err})") from None
    return row


def _suite_steps(report: dict, step: int | None) -> dict[str, int | None]:
    """``{suite: the step it was computed at}`` for each section (``step`` without ``computed``).

    Raises:
      ValueError: naming ``computed`` when it is not ``{suite: {"step": int, ...}}``.
    """
    computed = report.get("computed")
    if computed is None:
        return {key: step for key in SECTIONS if report.get(key) is not None}
    try:
        return {str(k): _count(meta.get("step")) for k, meta in computed.items()}
    except (AttributeError, TypeError, ValueError) as err:
        raise ValueError(f"computed: expected {{suite: {{step, settings}}}} ({err})") from None


def comparison_rows(reports: Sequence[dict], names: Sequence[str]) -> list[dict]:
    """:func:`report_row` of each report, in order.

    Raises:
      ValueError: naming ``names`` when it is not one distinct name per report.
    """
    if len(names) != len(reports) or len(set(names)) != len(names):
        raise ValueError(
            f"names: expected {len(reports)} distinct names (one per report), got {list(names)}"
        )
    return [report_row(r, n) for r, n in zip(reports, names, strict=True)]


# ---- Markdown -----------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return MISSING if x is None else f"{x:.3f}"


def _at(row: dict, suite: str, cell: str) -> str:
    """``cell`` followed by ``(step N)`` when ``suite`` was computed at another step than the
    run's (and the cell holds a result)."""
    step = row["steps"].get(suite, row["step"])
    return cell if cell == MISSING or step == row["step"] else f"{cell} (step {_int(step)})"


def _int(x: int | None) -> str:
    return MISSING if x is None else str(x)


def _text(x: str) -> str:
    return str(x).replace("|", "\\|")


def _table(header: Sequence[str], aligns: str, rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table; ``aligns`` has one letter per column: ``l`` left, ``r`` right."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "".join("---|" if a == "l" else "---:|" for a in aligns),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _ruler_kinds(rows: Sequence[dict]) -> list[str]:
    kinds: list[str] = []
    for row in rows:
        for kind in (row["ruler"] or {}).get("kinds", {}):
            if kind not in kinds:
                kinds.append(kind)
    return kinds


def _lengths(rows: Sequence[dict], suite: str) -> list[str]:
    found = {int(n) for row in rows if row[suite] for n in row[suite]["by_length"]}
    return [str(n) for n in sorted(found)]


def _by_length_table(rows: Sequence[dict], suite: str, chance: bool) -> list[str]:
    lengths = _lengths(rows, suite)
    header = ["run", *lengths] + (["chance"] if chance else [])
    body = []
    for row in rows:
        s = row[suite]
        if s is None:
            continue
        cells = [_fmt(s["by_length"].get(n)) for n in lengths]
        name = _at(row, suite, _text(row["name"]))
        body.append([name, *cells] + ([_fmt(s["chance"])] if chance else []))
    return _table(header, "l" + "r" * (len(header) - 1), body)


def comparison_markdown(
    reports: Sequence[dict], names: Sequence[str], plots: Sequence[str] = ()
) -> str:
    """The comparison as Markdown: the summary table (a row per run), the example counts, NIAH
    and BABILong accuracy by length (when some run has them), then ``plots`` as images (paths
    relative to where the Markdown is written). Numbers have 3 decimals; ``—`` where a run lacks
    a suite or a number."""
    rows = comparison_rows(reports, names)
    kinds = _ruler_kinds(rows)

    def kind_cell(row, kind, fmt):
        r = (row["ruler"] or {}).get("kinds", {}).get(kind)
        return MISSING if r is None else fmt(r)

    summary = []
    for row in rows:
        niah, bab = row["niah"], row["babilong"]
        summary.append(
            [
                _text(row["name"]),
                _text(row["model"]),
                _int(row["step"]),
                _at(row, "validation", _fmt(row["bits_per_byte"])),
                _at(row, "niah", _fmt(niah and niah["overall"])),
                *(
                    _at(
                        row,
                        "ruler",
                        kind_cell(row, k, lambda r: f"{_fmt(r['exact'])} / {_fmt(r['recall'])}"),
                    )
                    for k in kinds
                ),
                _at(row, "babilong", _fmt(bab and bab["overall"])),
            ]
        )
    ruler_head = [f"RULER {k}" for k in kinds]
    header = ["run", "model", "step", "val bits/byte", "NIAH", *ruler_head, "BABILong"]
    lines = [
        f"# Comparison of {len(rows)} evaluated run{'s' * (len(rows) != 1)}",
        "",
        *_table(header, "llr" + "r" * (len(header) - 3), summary),
        "",
        "NIAH: passkey exact match over all lengths and depths. RULER: exact match / recall over "
        "all lengths and depths of the kind. BABILong: exact match over all tasks and lengths. "
        f"{MISSING}: not evaluated (or no number in the report). (step N): computed at an "
        "older checkpoint step N than the run's step.",
    ]

    has_ruler = any(row["ruler"] for row in rows)
    counts = []
    for row in rows:
        niah, bab, ruler = row["niah"], row["babilong"], row["ruler"]
        counts.append(
            [
                _text(row["name"]),
                _int(row["val_bytes"]),
                _int(niah and niah["num_examples"]),
                *(kind_cell(row, k, lambda r: _int(r["num_examples"])) for k in kinds),
                *([_text(ruler["haystack"] or MISSING) if ruler else MISSING] * has_ruler),
                _int(bab and bab["num_examples"]),
            ]
        )
    header = ["run", "val bytes", "NIAH", *ruler_head]
    header += ["RULER haystack"] * has_ruler + ["BABILong"]
    aligns = "l" + "r" * (2 + len(kinds)) + "l" * has_ruler + "r"
    lines += ["", "## Examples scored", "", *_table(header, aligns, counts)]

    if any(row["niah"] for row in rows):
        lines += ["", "## NIAH accuracy by length (tokens; mean over depths)", ""]
        lines += _by_length_table(rows, "niah", chance=False)
    if any(row["babilong"] for row in rows):
        lines += ["", "## BABILong accuracy by length (tokens; mean over tasks)", ""]
        lines += _by_length_table(rows, "babilong", chance=True)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{os.path.basename(p)}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


# ---- plots --------------------------------------------------------------------------------------


def _length_axes(ax, rows: Sequence[dict], suite: str, title: str) -> None:
    """Accuracy vs length (log2 axis), a line per run that has ``suite`` (run i in colour ``C{i}``);
    BABILong adds each run's mean chance as a dashed line of the run's colour."""
    for i, row in enumerate(rows):
        s = row[suite]
        if s is None:
            continue
        points = [(int(n), a) for n, a in s["by_length"].items() if a is not None]
        if not points:
            continue
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, "o-", color=f"C{i % 10}", label=row["name"])
        if suite == "babilong" and s["chance"] is not None:
            ax.axhline(s["chance"], color=f"C{i % 10}", lw=0.8, ls="--")
    ticks = [int(n) for n in _lengths(rows, suite)]
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.minorticks_off()
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("exact match" + (" (dashed: chance)" if suite == "babilong" else ""))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _ruler_axes(ax, rows: Sequence[dict]) -> None:
    """Grouped bars: a group per RULER kind, a bar per run that has RULER (exact match over the
    kind); run i has the colour ``C{i}`` in every plot."""
    kinds = _ruler_kinds(rows)
    runs = [(i, row) for i, row in enumerate(rows) if row["ruler"]]
    width = 0.8 / len(runs)
    for slot, (i, row) in enumerate(runs):
        offset = (slot - (len(runs) - 1) / 2) * width
        bars = [
            (j + offset, r["exact"])
            for j, k in enumerate(kinds)
            if (r := row["ruler"]["kinds"].get(k)) is not None and r["exact"] is not None
        ]
        xs, ys = zip(*bars, strict=True) if bars else ((), ())
        ax.bar(xs, ys, width=width, color=f"C{i % 10}", label=row["name"])
    ax.set_xticks(range(len(kinds)), kinds, fontsize=8)
    ax.set_ylim(0.0, 1.02)
    ax.set_ylabel("exact match")
    ax.set_title("RULER-style retrieval: exact match per kind", fontsize=9)
    ax.legend(fontsize=7)


def plot_comparison(reports: Sequence[dict], names: Sequence[str], out_dir) -> list[str]:
    """Writes the PNGs of the module table that some run has data for into ``out_dir`` (a folder,
    local or URL; created if missing) and returns their paths, in the order niah, babilong,
    ruler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = comparison_rows(reports, names)
    out_dir = as_path(out_dir, "--out")
    paths = []
    for suite, file in PLOT_FILES.items():
        if not any(row[suite] for row in rows):
            continue
        if suite == "ruler":
            width = max(5.6, 1.2 * len(_ruler_kinds(rows)) * max(1, len(rows)) ** 0.5)
            fig, ax = plt.subplots(figsize=(width, 3.8), layout="constrained")
            _ruler_axes(ax, rows)
        else:
            fig, ax = plt.subplots(figsize=(5.6, 3.8), layout="constrained")
            title = {"niah": "NIAH passkey (mean over depths)", "babilong": "BABILong-style"}
            _length_axes(ax, rows, suite, f"{title[suite]}: accuracy vs length")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        atomic_write_bytes(out_dir / file, buf.getvalue())
        paths.append(os.fspath(out_dir / file))
    return paths


# ---- command ------------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and rc 2 instead of usage text and SystemExit
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nested-jax report", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help=f"an evaluated workdir (its {REPORT_FILE}) or such a JSON file; local or gs://",
    )
    p.add_argument(
        "--out",
        default=".",
        metavar="DIR",
        help="where report.md, report.json and the plots go (default: the current directory)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        out = as_path(args.out, "--out")
    except (_UsageError, PathError) as err:
        print(f"nested-jax report: error: {err}", file=sys.stderr)
        return 2
    try:
        reports = [load_report(run) for run in args.runs]
    except ValueError as err:  # PathError included: a run's URL is the run's fault
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    names = run_names(args.runs)
    rows = comparison_rows(reports, names)
    for row, run in zip(rows, args.runs, strict=True):
        row["source"] = os.fspath(run)
    try:
        plots = plot_comparison(reports, names, out)
        md = comparison_markdown(reports, names, [os.path.basename(p) for p in plots])
        write_json(out / "report.json", {"runs": rows, "plots": plots})
        atomic_write_text(out / "report.md", md)
    except OSError as err:
        print(f"error: --out {args.out}: cannot write ({err.strerror or err})", file=sys.stderr)
        return 1
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
