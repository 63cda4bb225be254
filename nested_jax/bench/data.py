"""``nested-jax bench data [--config F] [--set k=v] [--json]``: input pipeline batches/s with and
without prefetch.

For the data section of the config (``--config`` YAMLs and ``--set`` overrides as in ``train``;
default the tiny Austen preset), two training iterators are timed A/B interleaved, each freshly
built per round and warmed up by one batch: ``off`` (``data.prefetch = 0``: grain reads on the
consumer's thread) and ``on`` (``data.prefetch = --prefetch`` reader threads and buffered
batches). A consumer that sleeps ``--step-ms`` per batch stands in for the training step (the host
waits on the device, and prefetch threads fill that wait). Reported: the median batches/s of each,
``on / off``, and the in-run f32 matmul GFLOP/s normaliser. With ``data.prepared_dir`` set the
batches come from ``nested-jax prepare-data`` shards, otherwise from in-process tokenisation.

JSON keys (the last stdout line with ``--json``): ``source``, ``batches_per_s_off``,
``batches_per_s_on``, ``on_over_off``, ``prefetch``, ``step_ms``, ``matmul_gflops``.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from nested_jax.bench.common import emit, make_parser, matmul_gflops, progress, time_interleaved
from nested_jax.data.pipeline import make_train_iterator, prepare_data
from nested_jax.train.config import load_config

DEFAULT_CONFIG = "configs/experiments/tiny_gdn.yaml"


def _consume(data_cfg, tokenizer, train_docs, prefetch: int, batches: int, step_ms: float):
    """A zero-argument callable reading ``batches`` batches from a fresh iterator."""

    def run():
        it = make_train_iterator(
            dataclasses.replace(data_cfg, prefetch=prefetch),
            tokenizer,
            train_docs,
            process_index=0,
            process_count=1,
        )
        next(it)  # warm-up: the iterator's threads start and the first window is read
        for _ in range(batches):
            next(it)
            if step_ms:
                time.sleep(step_ms / 1e3)
        it.close()

    return run


def prefetch_rates(data_cfg, *, prefetch=4, batches=50, repeats=5, step_ms=0.0) -> dict:
    """Median batches/s without and with ``prefetch`` reader threads (module doc)."""
    if prefetch < 1 or batches < 1 or repeats < 1 or step_ms < 0:
        raise ValueError(
            f"prefetch/batches/repeats must be >= 1 and step_ms >= 0, got {prefetch}/{batches}/"
            f"{repeats}/{step_ms}"
        )
    bundle = prepare_data(data_cfg)
    docs = None if data_cfg.prepared_dir else bundle.train_docs
    fns = {
        name: _consume(data_cfg, bundle.tokenizer, docs, p, batches, step_ms)
        for name, p in (("off", 0), ("on", prefetch))
    }
    seconds = time_interleaved(fns, repeats=repeats, warmup=0)
    off, on = batches / seconds["off"], batches / seconds["on"]
    return {
        "source": "prepared" if data_cfg.prepared_dir else "in-process",
        "batches_per_s_off": off,
        "batches_per_s_on": on,
        "on_over_off": on / off,
        "prefetch": prefetch,
        "step_ms": step_ms,
    }


def main(argv: list[str] | None = None) -> int:
    p = make_parser("data", "input pipeline batches/s with and without prefetch")
    p.add_argument("--config", action="append", default=None, help="YAML config (repeatable)")
    p.add_argument("--set", action="append", default=[], help="override key=value (repeatable)")
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--step-ms", type=float, default=0.0)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config or [DEFAULT_CONFIG], args.set)
    progress(f"bench data: {args.repeats} rounds of {args.batches} batches, off vs on")
    results = {"matmul_gflops": matmul_gflops()}
    results.update(
        prefetch_rates(
            cfg.data,
            prefetch=args.prefetch,
            batches=args.batches,
            repeats=args.repeats,
            step_ms=args.step_ms,
        )  # fmt: skip
    )
    emit(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
