"""``nested-jax eval``: evaluate the latest checkpoint of a workdir and write a report.

    nested-jax eval --workdir runs/tiny_gdn [--set eval.eval_batches=0]
                    [--set eval.niah_lengths=[256,512] ...]

Computes validation loss, perplexity and bits/byte (``eval.eval_batches`` batches, 0 = the whole
validation split) and a needle-in-a-haystack accuracy grid (``eval.niah_lengths`` ×
``eval.niah_depths``, ``eval.niah_per_cell`` examples per cell, teacher-forced exact match of the
passkey), writes ``workdir/eval_report.json`` and ``workdir/eval_report.md`` and prints the
Markdown. ``--suite validation,niah,ruler,babilong`` picks the sections (default
``validation,niah``): ``ruler`` runs the RULER-style retrieval kinds, ``babilong`` the bAbI-style
questions over facts scattered in the validation text (:mod:`nested_jax.eval.suites`, sizes in the
config's ``eval`` section), each with a plot ``workdir/eval_<suite>.png``. The workdir is only read
(plus the report files and plots).

The report accumulates: suites evaluated now replace their own entries and the suites of an
earlier report (same model) are kept, each with the checkpoint step and the settings it was
computed at (``computed``: ``{suite: {"step", "settings"}}``); the Markdown lists that step per
suite and marks the ones older than the checkpoint. ``--replace`` writes only this call's suites.
Progress (what is running, batches or examples done) goes to stderr.

Continual mode (``nested_jax.eval.stream_report``, on ``nested_jax.eval.continual``): ``--stream
val|FILE`` runs a long text through the model once, carrying every memory across the whole stream
(and, with ``--cms-periods``, updating the CMS levels online at those periods), and reports the
loss per consecutive segment;
``--state-in`` / ``--state-out`` resume and save the stream state (an orbax checkpoint), so a
stream can be continued across calls (and by ``nested-jax generate --state-in``). Writes
``workdir/stream_report.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

from nested_jax.eval.suites import (
    DEFAULT_SUITES,
    RUNNERS,
    SECTIONS,
    SUITES,
    parse_suites,
    plot_suite,
)
from nested_jax.files import PathError, as_path, atomic_write_text, write_json
from nested_jax.train.config import ConfigError, add_override_argument


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nested-jax eval", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workdir",
        required=True,
        help="a training workdir (config.json + checkpoints/); a local path or a gs:// URL",
    )
    add_override_argument(
        p, "override a field of the saved config, e.g. --set eval.niah_per_cell=8"
    )
    p.add_argument(
        "--suite",
        default=None,
        help=f"what to evaluate, names from {', '.join(SUITES)} joined by commas "
        f"(default {','.join(DEFAULT_SUITES)}; a run on a generated task (data.task): "
        "validation); sizes in the config's eval section",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="write only this call's suites (default: keep the other suites of the existing "
        "report, each marked with the step it was computed at)",
    )
    s = p.add_argument_group("continual stream (instead of the standard report)")
    s.add_argument("--stream", help="'val' (the validation documents) or a UTF-8 text file")
    s.add_argument("--max-tokens", type=int, default=0, help="stream at most this many tokens")
    s.add_argument(
        "--cms-periods",
        type=int,
        nargs="+",
        help="update the CMS levels online, level l every C_l tokens (one period per level; "
        "default: model.cms.periods when model.cms.mode=online)",
    )
    s.add_argument(
        "--cms-lr", type=float, default=None, help="online CMS rate (default model.cms.online_lr)"
    )
    s.add_argument("--chunk", type=int, default=256, help="tokens per model call (memories only)")
    s.add_argument(
        "--capacity",
        type=int,
        default=0,
        help="positions the stream's KV caches hold in all (default: the positions read, plus "
        "4096 free ones with --state-out; a continued stream is enlarged as needed)",
    )
    s.add_argument("--state-in", help="continue from a saved stream state directory")
    s.add_argument("--state-out", help="save the stream state to this new directory")
    s.add_argument("--segments", type=int, default=8, help="report rows (default 8)")
    return p


def run_eval(trained, suites: Sequence[str] = DEFAULT_SUITES) -> dict:
    """The report of ``suites`` (:data:`~nested_jax.eval.suites.SUITES`) for a
    :class:`~nested_jax.train.inference.TrainedModel`: validation metrics and each generated
    retrieval suite (NIAH, RULER-style, BABILong-style; :mod:`nested_jax.eval.suites`), with
    ``computed``: the step and settings of each suite (:func:`suite_settings`). Progress on
    stderr (process 0)."""
    from nested_jax.train.inference import sharded_argmax_fn

    cfg = trained.config
    report = {
        "workdir": str(trained.workdir),
        "step": trained.step,
        "model": cfg.model.name,
        "suites": list(suites),
        "computed": {
            name: {"step": trained.step, "settings": suite_settings(name, cfg)} for name in suites
        },
    }
    if "validation" in suites:
        report.update(validation_report(trained))
    generated = [n for n in suites if n in RUNNERS]
    if generated and trained.bundle.task is not None:
        raise ValueError(
            f"--suite: {', '.join(generated)} read text; this run trained on the generated task "
            f"{cfg.data.task!r} (use --suite validation)"
        )
    if "niah" in generated and not (
        cfg.eval.niah_per_cell > 0 and cfg.eval.niah_lengths and cfg.eval.niah_depths
    ):
        report["niah"] = None  # switched off in the config (eval.niah_per_cell = 0)
        generated.remove("niah")
    if generated:
        haystack = "\n\n".join(trained.bundle.val_docs or trained.bundle.train_docs)
        predict = sharded_argmax_fn(trained)
        for name in generated:
            bar = _progress(suite_examples(name, cfg.eval), f"eval {name}", "ex")
            try:
                counted = _counting(predict, bar)
                report[name] = RUNNERS[name](counted, trained.tokenizer, haystack, cfg.eval)
            finally:  # an error line then starts on a line of its own
                bar.close()
    return report


_SUITE_FIELDS = {
    "niah": ("niah_lengths", "niah_depths", "niah_per_cell", "niah_seed"),
    "ruler": (
        "ruler_kinds",
        "ruler_lengths",
        "niah_depths",
        "ruler_per_cell",
        "ruler_haystack",
        "niah_seed",
    ),
    "babilong": ("babilong_tasks", "babilong_lengths", "babilong_per_length", "niah_seed"),
}


def suite_settings(name: str, cfg) -> dict:
    """The config values suite ``name`` was computed with (JSON-able): ``eval.eval_batches`` and
    the batch shape for validation, the suite's ``eval.*`` fields (:mod:`.suites`) otherwise."""
    if name == "validation":
        out = {
            "eval_batches": cfg.eval.eval_batches,
            "seq_len": cfg.data.seq_len,
            "batch_size": cfg.data.batch_size,
        }
        return out | ({"task": cfg.data.task} if cfg.data.task else {})
    return {f: _plain(getattr(cfg.eval, f)) for f in _SUITE_FIELDS[name]}


def _plain(x):
    return list(x) if isinstance(x, tuple) else x


def suite_examples(name: str, e) -> int:
    """Examples a generated suite scores with the ``eval`` config ``e`` (the progress total)."""
    if name == "niah":
        return len(e.niah_lengths) * len(e.niah_depths) * e.niah_per_cell
    if name == "ruler":
        return len(e.ruler_kinds) * len(e.ruler_lengths) * len(e.niah_depths) * e.ruler_per_cell
    return len(e.babilong_tasks) * len(e.babilong_lengths) * e.babilong_per_length


def _progress(total: int, desc: str, unit: str):
    """A progress bar / log lines on stderr (process 0) saying the first batch compiles."""
    import jax

    from nested_jax.train.progress import Progress

    bar = Progress(total, desc=desc, unit=unit, enabled=jax.process_index() == 0)
    bar.status("compiling…")
    return bar


def _counting(predict: Callable, bar) -> Callable:
    """``predict`` advancing ``bar`` by the rows of each call."""

    def call(tokens):
        ids = predict(tokens)
        bar.update(len(tokens))
        return ids

    return call


def _ticking(items: Iterable, bar) -> Iterator:
    """``items``, advancing ``bar`` when the consumer asks for the next (the last one is done)."""
    for item in items:
        yield item
        bar.update(1)


def validation_report(trained) -> dict:
    """Validation loss / perplexity / bits per byte (``eval.eval_batches`` batches) and the
    corpus's unigram byte entropy, the bits/byte of a model that learned nothing but frequencies."""
    from nested_jax.data import pipeline
    from nested_jax.train.loop import evaluate

    cfg = trained.config
    batches = pipeline.make_eval_batches(
        cfg.data,
        trained.tokenizer,
        trained.bundle.val_docs,
        max_batches=cfg.eval.eval_batches or None,
    )
    bar = _progress(len(batches), "eval validation", "batch")
    try:
        val = evaluate(trained.setup, trained.params, _ticking(batches, bar))
    finally:
        bar.close()
    if trained.bundle.task is not None:  # a generated task: its accuracy, no text statistics
        from nested_jax.train.setup import make_score_fn

        bar = _progress(len(batches), "eval task scores", "batch")
        score = make_score_fn(trained.setup, trained.bundle.task.score)
        try:
            scores = score(trained.params, _ticking(batches, bar))
        finally:
            bar.close()
        return {
            "validation": {
                "loss": val["val_loss"],
                "perplexity": val["val_perplexity"],
                "tokens": val["val_tokens"],
                "batches": len(batches),
                **{k.removeprefix("val_"): v for k, v in scores.items()},
            },
            "task": cfg.data.task,
        }
    entropy = pipeline.unigram_byte_entropy(
        list(trained.bundle.train_docs) + list(trained.bundle.val_docs)
    )
    return {
        "validation": {
            "loss": val["val_loss"],
            "perplexity": val["val_perplexity"],
            "bits_per_byte": val["val_bits_per_byte"],
            "tokens": val["val_tokens"],
            "bytes": val["val_bytes"],
            "batches": len(batches),
        },
        "unigram_entropy_bits_per_byte": entropy,
    }


# The report keys each suite owns (validation also brings the corpus entropy or the task name).
SUITE_KEYS = {
    "validation": ("validation", "unigram_entropy_bits_per_byte", "task"),
    "niah": ("niah",),
    "ruler": ("ruler",),
    "babilong": ("babilong",),
}


def _computed(report: dict) -> dict:
    """``{suite: {"step", "settings"}}`` of a report; a report written before suites carried
    their step gets the report's step and no settings."""
    if isinstance(report.get("computed"), dict):
        return report["computed"]
    names = report.get("suites") or [n for n in SUITES if report.get(n) is not None]
    return {n: {"step": report.get("step"), "settings": None} for n in names if n in SUITES}


def merge_reports(old: dict | None, new: dict) -> dict:
    """``new`` plus the suites of ``old`` that ``new`` did not compute (when ``old`` is a report
    of the same model): their sections, ``computed`` entries and plots are kept as they were.

    Returns:
      the report: ``new``'s top-level fields (``step`` = the checkpoint evaluated now),
      ``suites`` and ``computed`` over both in :data:`SUITES` order, each suite's keys
      (:data:`SUITE_KEYS`) from the report that computed it.
    """
    if not old or old.get("model") != new["model"]:
        return new
    fresh, earlier = _computed(new), _computed(old)
    owner = {n: new if n in fresh else old for n in SUITES if n in fresh or n in earlier}
    merged = {k: v for k, v in new.items() if k not in {k for n in SUITES for k in SUITE_KEYS[n]}}
    merged["suites"] = list(owner)
    merged["computed"] = {n: (fresh if src is new else earlier)[n] for n, src in owner.items()}
    for name, src in owner.items():
        merged.update({k: src[k] for k in SUITE_KEYS[name] if k in src})
    kept = {f"eval_{n}.png" for n, src in owner.items() if src is old}
    plots = [p for p in old.get("plots") or [] if os.path.basename(str(p)) in kept]
    if "plots" in new or plots:
        order = {f"eval_{n}.png": i for i, n in enumerate(SUITES)}
        both = [*new.get("plots", []), *plots]
        merged["plots"] = sorted(both, key=lambda p: order.get(os.path.basename(str(p)), 99))
    return merged


def read_previous_report(workdir) -> dict | None:
    """The workdir's ``eval_report.json`` (None when there is none; a note on stderr and None
    when it cannot be read as a report: it is then replaced)."""
    from nested_jax.eval.report import REPORT_FILE, load_report

    path = as_path(workdir) / REPORT_FILE
    if not path.exists():
        return None
    try:
        return load_report(path)
    except ValueError as err:
        print(f"note: {str(err).splitlines()[0]}; it is replaced", file=sys.stderr)
        return None


_TASK_PLAIN = ("loss", "perplexity", "tokens", "batches")


def report_markdown(report: dict) -> str:
    """The report as Markdown: the step and settings of each suite (suites computed at an older
    step than the report's are marked), the validation table, then a section per generated suite.
    A number stored as null (strict JSON's NaN) shows as ``nan``."""
    step = report["step"]
    computed = _computed(report)
    lines = [f"# Evaluation of `{report['workdir']}` (model `{report['model']}`, step {step})"]
    if computed:
        lines += ["", "| suite | computed at step | settings |", "|---|---:|---|"]
        for name, meta in computed.items():
            lines.append(f"| {name} | {_step_cell(meta.get('step'), step)} | {_settings(meta)} |")
    v = _nan_for_none(report["validation"]) if report.get("validation") else None
    if v:
        lines += ["", *_stale_note(computed.get("validation"), step)]
    if v and report.get("task"):
        lines += [
            f"Generated task `{report['task']}` (held-out batches):",
            "",
            "| metric | value |",
            "|---|---:|",
            f"| validation loss (nats/scored token) | {v['loss']:.4f} |",
            *(f"| validation {k} | {v[k]:.4f} |" for k in v if k not in _TASK_PLAIN),
            f"| scored tokens / batches | {int(v['tokens'])} / {v['batches']} |",
        ]
    elif v:
        entropy = _nan_for_none(report.get("unigram_entropy_bits_per_byte"))
        lines += [
            "| metric | value |",
            "|---|---:|",
            f"| validation loss (nats/token) | {v['loss']:.4f} |",
            f"| validation perplexity | {v['perplexity']:.3f} |",
            f"| validation bits/byte | {v['bits_per_byte']:.4f} |",
            f"| corpus unigram entropy (bits/byte) | {entropy:.4f} |",
            f"| bits/byte below unigram entropy | {entropy - v['bits_per_byte']:.4f} |",
            f"| validation tokens / bytes | {int(v['tokens'])} / {int(v['bytes'])} |",
        ]
    if report.get("corpus_change"):
        lines += ["", f"> warning: {report['corpus_change']} (evaluated on the current text)"]
    for name, section in SECTIONS.items():
        if report.get(name):
            head, *rest = section(_nan_for_none(report[name]))
            lines += ["", head, "", *_stale_note(computed.get(name), step), *rest[1:]]
    return "\n".join(lines) + "\n"


def _step_cell(suite_step, step) -> str:
    if suite_step == step:
        return str(step)
    return f"**{suite_step}** (older than {step})"


def _stale_note(meta: dict | None, step) -> list[str]:
    """A quoted line (and a blank one) when the suite was computed at another step."""
    if not meta or meta.get("step") == step:
        return []
    return [f"> computed at step {meta.get('step')}, not at this checkpoint's step {step}", ""]


def _settings(meta: dict) -> str:
    settings = meta.get("settings")
    if not isinstance(settings, dict):
        return "—"  # a report written before suites recorded their settings
    return ", ".join(f"{k}={_setting(v)}" for k, v in settings.items()).replace("|", "\\|")


def _setting(v) -> str:
    return ",".join(str(x) for x in v).join("[]") if isinstance(v, list) else str(v)


def _nan_for_none(x):
    """``x`` with every None (strict JSON's NaN) a float NaN, so that the formats print ``nan``."""
    if isinstance(x, dict):
        return {k: _nan_for_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_for_none(v) for v in x]
    return math.nan if x is None else x


def write_plots(workdir, report: dict) -> list[str]:
    """``eval_<suite>.png`` for every generated suite in the report (process 0 only)."""
    import jax

    if jax.process_index() != 0:
        return []
    workdir = as_path(workdir)
    title = f"{report['model']} step {report['step']}"
    paths = []
    for name in RUNNERS:
        if report.get(name):
            path = workdir / f"eval_{name}.png"
            plot_suite(name, report[name], path, title)
            paths.append(str(path))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        suites = parse_suites(args.suite) if args.suite is not None else None
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from nested_jax.parallel.distributed import maybe_initialize
    from nested_jax.train.inference import load_trained

    maybe_initialize()

    try:
        workdir = as_path(args.workdir, "--workdir")
        trained = load_trained(workdir, args.overrides)
        if args.stream:
            from nested_jax.eval.stream_report import run_stream, stream_markdown

            report = run_stream(trained, args)
            name, md = "stream_report", stream_markdown(report)
        else:
            if suites is None:
                suites = ("validation",) if trained.bundle.task is not None else DEFAULT_SUITES
            report = run_eval(trained, suites)
            if trained.corpus_change is not None:
                report["corpus_change"] = trained.corpus_change
                for meta in report["computed"].values():
                    meta["corpus_change"] = trained.corpus_change
            report["plots"] = write_plots(workdir, report)
            if not args.replace:
                report = merge_reports(read_previous_report(workdir), report)
            name, md = "eval_report", report_markdown(report)
    except (ConfigError, PathError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    write_report(workdir, name, report, md)
    return 0


def write_report(workdir: str | os.PathLike, name: str, report: dict, markdown: str) -> None:
    """Process 0 writes ``<name>.json`` (strict JSON) and ``<name>.md`` atomically and prints the
    Markdown; the other processes of a multi-process evaluation write and print nothing."""
    import jax

    if jax.process_index() != 0:
        return
    workdir = as_path(workdir)
    write_json(workdir / f"{name}.json", report)
    atomic_write_text(workdir / f"{name}.md", markdown)
    print(markdown, end="")


if __name__ == "__main__":
    sys.exit(main())
