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

Continual mode (``nested_jax.eval.continual``): ``--stream val|FILE`` runs a long text through the
model once, carrying every memory across the whole stream (and, with ``--cms-periods``, updating
the CMS levels online at those periods), and reports the loss per consecutive segment;
``--state-in`` / ``--state-out`` resume and save the stream state (an orbax checkpoint), so a
stream can be continued across calls (and by ``nested-jax generate --state-in``). Writes
``workdir/stream_report.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

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
    retrieval suite (NIAH, RULER-style, BABILong-style; :mod:`nested_jax.eval.suites`)."""
    from nested_jax.train.inference import sharded_argmax_fn

    cfg = trained.config
    report = {
        "workdir": str(trained.workdir),
        "step": trained.step,
        "model": cfg.model.name,
        "suites": list(suites),
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
            report[name] = RUNNERS[name](predict, trained.tokenizer, haystack, cfg.eval)
    return report


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
    val = evaluate(trained.setup, trained.params, batches)
    if trained.bundle.task is not None:  # a generated task: its accuracy, no text statistics
        from nested_jax.train.setup import make_score_fn

        scores = make_score_fn(trained.setup, trained.bundle.task.score)(trained.params, batches)
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


_TASK_PLAIN = ("loss", "perplexity", "tokens", "batches")


def report_markdown(report: dict) -> str:
    """The report as Markdown: the validation table, then a section per generated suite."""
    lines = [
        f"# Evaluation of `{report['workdir']}` (model `{report['model']}`, step {report['step']})"
    ]
    v = report.get("validation")
    if v and report.get("task"):
        lines += [
            "",
            f"Generated task `{report['task']}` (held-out batches):",
            "",
            "| metric | value |",
            "|---|---:|",
            f"| validation loss (nats/scored token) | {v['loss']:.4f} |",
            *(f"| validation {k} | {v[k]:.4f} |" for k in v if k not in _TASK_PLAIN),
            f"| scored tokens / batches | {int(v['tokens'])} / {v['batches']} |",
        ]
    elif v:
        gap = report["unigram_entropy_bits_per_byte"] - v["bits_per_byte"]
        lines += [
            "",
            "| metric | value |",
            "|---|---:|",
            f"| validation loss (nats/token) | {v['loss']:.4f} |",
            f"| validation perplexity | {v['perplexity']:.3f} |",
            f"| validation bits/byte | {v['bits_per_byte']:.4f} |",
            f"| corpus unigram entropy (bits/byte) | "
            f"{report['unigram_entropy_bits_per_byte']:.4f} |",
            f"| bits/byte below unigram entropy | {gap:.4f} |",
            f"| validation tokens / bytes | {int(v['tokens'])} / {int(v['bytes'])} |",
        ]
    if report.get("corpus_change"):
        lines += ["", f"> warning: {report['corpus_change']} (evaluated on the current text)"]
    for name, section in SECTIONS.items():
        if report.get(name):
            lines += ["", *section(report[name])]
    return "\n".join(lines) + "\n"


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
            from nested_jax.eval.continual import run_stream, stream_markdown

            report = run_stream(trained, args)
            name, md = "stream_report", stream_markdown(report)
        else:
            if suites is None:
                suites = ("validation",) if trained.bundle.task is not None else DEFAULT_SUITES
            report = run_eval(trained, suites)
            if trained.corpus_change is not None:
                report["corpus_change"] = trained.corpus_change
            report["plots"] = write_plots(workdir, report)
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
