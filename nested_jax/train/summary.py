"""The summary of a training run (step 5 of :mod:`nested_jax.train.loop`): what the steps did
(:class:`StepStats`), the summary dict (:func:`build_summary`), ``summary.json`` and the printed
summary (:func:`write_summary`)."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax

from nested_jax.files import write_json
from nested_jax.parallel.distributed import say
from nested_jax.train.metrics import read_metrics


@dataclasses.dataclass
class StepStats:
    """What one invocation of :func:`run_steps` did."""

    steps_run: int = 0
    last_loss: float = float("nan")  # loss of the last finite step
    val: dict = dataclasses.field(default_factory=dict)  # the last validation
    skipped: int = 0  # non-finite steps skipped
    stopped_by: str | None = None  # "SIGTERM" / "SIGINT" / "preemption" when stopped early
    timed_tokens: float = 0.0  # tokens of the steps after the first (which compiles)
    timed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_s if self.timed_s else float("nan")


def _earlier_training_numbers(workdir: Path) -> dict:
    """Train loss and throughput of the run that trained `workdir` before (for a re-run)."""
    import json

    out: dict = {"final_train_loss": None, "tokens_per_s": None}
    path = workdir / "summary.json"
    if path.is_file():
        try:
            earlier = json.loads(path.read_text())
            out.update({k: earlier.get(k) for k in out})
        except json.JSONDecodeError:
            pass
    if out["final_train_loss"] is None:
        losses = [r["loss"] for r in read_metrics(workdir, "train") if r.get("loss") is not None]
        out["final_train_loss"] = losses[-1] if losses else None
    return out


def build_summary(
    workdir: Path, stats: StepStats, state: dict, start: int, entropy: float, t_start: float
) -> dict:
    """The run's summary; a re-run that trained nothing keeps the earlier train numbers."""
    summary = {
        "final_train_loss": stats.last_loss,
        **stats.val,
        "unigram_entropy_bits_per_byte": entropy,
        "tokens_per_s": stats.tokens_per_s,
        "steps": int(jax.device_get(state["step"])),
        "start_step": start,
        "steps_this_run": stats.steps_run,
        "skipped_steps": stats.skipped,
        "preempted": stats.stopped_by is not None,
        "stopped_by": stats.stopped_by,
        "wall_time_s": time.time() - t_start,
        "workdir": str(workdir),
    }
    if stats.steps_run == 0:
        summary.update(_earlier_training_numbers(workdir))
    return summary


def _num(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) and math.isfinite(v) else "n/a"


def format_summary(summary: dict) -> str:
    """Human-readable multi-line summary of a run (missing numbers print as ``n/a``)."""
    bpb, entropy = summary.get("val_bits_per_byte"), summary["unigram_entropy_bits_per_byte"]
    gap = entropy - bpb if isinstance(bpb, int | float) else None
    data = (  # a generated task (nested_jax.data.task_source) has a score, not a byte entropy
        f"validation accuracy        {_num(summary['val_accuracy'], '.4f')}"
        if "val_accuracy" in summary
        else f"corpus unigram entropy     {_num(entropy, '.4f')} bits/byte "
        f"(model is {_num(gap, '.3f')} below)"
    )
    return "\n".join(
        [
            "== summary ==",
            f"steps                      {summary['steps']} "
            f"(this run started at {summary['start_step']})",
            f"final train loss           {_num(summary['final_train_loss'], '.4f')} nats/token",
            f"validation loss            {_num(summary.get('val_loss'), '.4f')} nats/token",
            f"validation bits/byte       {_num(bpb, '.4f')}",
            data,
            f"throughput                 {_num(summary['tokens_per_s'], '.0f')} tokens/s",
            f"wall time                  {summary['wall_time_s']:.1f} s",
        ]
    )


def write_summary(workdir: Path, summary: dict) -> None:
    """Process 0 writes ``summary.json`` (strict JSON); every process prints the summary."""
    if jax.process_index() == 0:
        write_json(workdir / "summary.json", summary)
    say(format_summary(summary))
