"""``nested-jax eval --stream``: a long text through a trained run, the loss per stream segment.

Reads the stream's tokens (:func:`stream_text_tokens`), streams them with
:mod:`nested_jax.eval.continual` (memories carried, optionally online CMS levels, optionally from /
to a saved stream state: :func:`run_stream`) and reports the mean loss and bits/byte over
consecutive segments (:func:`segment_report`, :func:`stream_markdown`).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np

from nested_jax.eval.continual import (
    init_stream,
    load_stream_state,
    resize_stream,
    save_stream_state,
    stream_capacity,
    stream_model,
    stream_tokens,
)


def stream_text_tokens(trained, source: str) -> np.ndarray:
    """Token ids ``[1, N]`` of a stream: ``"val"`` (the run's validation documents, separated as
    in training) or a UTF-8 text file path. One-line ``ValueError`` for a missing/empty file."""
    tok = trained.tokenizer
    if source == "val":
        docs = list(trained.bundle.val_docs or trained.bundle.train_docs)
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"stream: no such file {path}")
        docs = [path.read_text(encoding="utf-8", errors="replace")]
    bos = getattr(tok, "bos_id", None)
    ids: list[int] = []
    for doc in docs:
        ids += ([bos] if bos is not None else []) + list(tok.encode(doc))
    if len(ids) < 2:
        raise ValueError(f"stream: {source!r} holds fewer than 2 tokens")
    return np.asarray([ids], np.int32)


def segment_report(ce, target_ids, token_bytes, segments: int) -> list[dict]:
    """Mean loss and bits/byte over ``segments`` equal consecutive parts of a stream (how the loss
    moves as the memories / CMS levels adapt). ``ce``, ``target_ids``: ``[1, N]``."""
    ce, tgt = np.asarray(ce)[0], np.asarray(target_ids)[0]
    nbytes = np.asarray(token_bytes)[tgt]
    bounds = np.linspace(0, len(ce), min(segments, len(ce)) + 1).astype(int)
    rows = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        nb = float(nbytes[a:b].sum())
        rows.append(
            {
                "tokens": [int(a), int(b)],
                "loss": float(ce[a:b].mean()),
                "bits_per_byte": float(ce[a:b].sum() / math.log(2) / nb) if nb else float("nan"),
            }
        )
    return rows


def run_stream(trained, args) -> dict:
    """``nested-jax eval --stream``: stream a text through a trained run, return a report dict."""
    from nested_jax.train.progress import Progress

    toks = stream_text_tokens(trained, args.stream)
    if args.max_tokens:
        toks = toks[:, : args.max_tokens + 1]
    inputs, targets = toks[:, :-1], toks[:, 1:]
    model = trained.model()
    apply_fn, params = stream_model(model)
    cms = trained.config.model.cms if trained.config.model.resolved_ffn() == "cms" else None
    periods = tuple(args.cms_periods) if args.cms_periods else None
    if periods is None and cms is not None and cms.mode == "online":
        periods = cms.periods  # a model configured for online CMS streams that way by default
    lr = args.cms_lr if args.cms_lr is not None else (cms.online_lr if cms else 1e-3)
    if isinstance(lr, tuple):
        raise ValueError(
            f"model.cms.online_lr: streaming updates every level at one rate, got one per level "
            f"{lr}; set one float or pass --cms-lr"
        )
    if periods is not None and cms is not None and cms.online_inner != "sgd":
        raise ValueError(
            f"model.cms.online_inner: streaming updates the levels by SGD, got {cms.online_inner!r}"
        )
    save = bool(args.state_out)
    if args.state_in:
        state, saved_periods = load_stream_state(args.state_in, model.init_cache, params)
        if args.cms_periods and saved_periods != periods:
            raise ValueError(f"cms_periods: the saved stream uses {saved_periods}, got {periods}")
        periods = saved_periods
        saved = int(state.capacity)
        needed = int(state.pos) + inputs.shape[1]
        capacity = stream_capacity(args.capacity, needed=needed, saved=saved, save=save)
        state = resize_stream(state, model.init_cache, capacity)
    else:
        capacity = stream_capacity(args.capacity, needed=inputs.shape[1], save=save)
        state = init_stream(model.init_cache, params, capacity=capacity, periods=periods)
    start = int(state.pos)
    bar = Progress(inputs.shape[1], desc="stream", unit="tok", enabled=jax.process_index() == 0)

    def progress(done):
        bar.update(done - bar.n)

    ce, state = stream_tokens(
        apply_fn,
        params,
        state,
        inputs,
        targets,
        periods=periods,
        lr=lr,
        variant=cms.variant if cms is not None else "sequential",
        chunk=args.chunk,
        progress=progress,
    )
    bar.close()
    saved = None
    if args.state_out:
        saved = str(save_stream_state(args.state_out, state, periods=periods))
    return {
        "workdir": str(trained.workdir),
        "step": trained.step,
        "model": trained.config.model.name,
        "stream": args.stream,
        "start_pos": start,
        "end_pos": int(state.pos),
        "capacity": int(state.capacity),
        "online_cms": {"periods": list(periods), "lr": lr} if periods else None,
        "segments": segment_report(ce, targets, trained.tokenizer.token_bytes, args.segments),
        "state_out": saved,
    }


def stream_markdown(report: dict) -> str:
    """The stream report as a Markdown table (loss per consecutive segment of the stream)."""
    cms = report["online_cms"]
    how = f"online CMS periods {cms['periods']}, lr {cms['lr']:g}" if cms else "memories only"
    lines = [
        f"# Stream of `{report['stream']}` through `{report['workdir']}` "
        f"(model `{report['model']}`, step {report['step']}; {how})",
        "",
        f"positions {report['start_pos']} → {report['end_pos']}",
        "",
        "| tokens | loss (nats/token) | bits/byte |",
        "|---|---:|---:|",
    ]
    for row in report["segments"]:
        a, b = row["tokens"]
        lines.append(f"| {a}–{b} | {row['loss']:.4f} | {row['bits_per_byte']:.4f} |")
    if report["state_out"]:
        lines += ["", f"stream state saved to {report['state_out']}"]
    return "\n".join(lines) + "\n"
