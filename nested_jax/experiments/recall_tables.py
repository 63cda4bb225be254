"""The long-context retrieval claims, each one command on the task-trained recall family
(``recall:kv``, :mod:`nested_jax.eval.recall`): models trained at length ``L`` on key–value pairs
in a filler haystack, scored from 1× to 16× ``L`` and over the depth of the pairs.

    python -m nested_jax.experiments.recall_tables hola --scale cpu --out runs/recall
    python -m nested_jax.experiments.recall_tables titans --scale cpu --out runs/recall
    python -m nested_jax.experiments.recall_tables proteus --scale cpu --out runs/recall \\
        --models gdn+proteus1 gdn+proteus16 --seeds 0          # one piece of a table

Tables (:data:`TABLES`):

* ``hola``: HOLA's exact top-``w`` KV cache chosen by write magnitude (``beta_e``) against the same
  cache evicting the oldest entry (``hola@recency``, same ``w`` and ``C``) and plain GDN (Cui 2026:
  S-NIAH-1 at 16× the training length, HOLA 0.58, recency 0.24, GDN 0.14). The cache is made
  small beside the haystack (``w`` of :data:`HOLA_CACHE`), so what it keeps decides.
* ``hola_text``: the same three models with the pairs written over Austen text that the models
  also predict (``recall:kv_text``): the setting of a language model, whose memory must serve the
  text around the needle, where the ``hola`` table's random filler serves no prediction.
* ``titans``: Titans LMM and MAC against GDN and a sliding-window Transformer++ whose window is a
  quarter of ``L``, MAC's segments the same quarter (Titans: the neural memory keeps its accuracy
  as length grows).
* ``proteus``: Proteus' incremental activation, ``E ∈ {1, 4, 16, 32}`` blocks on GDN and Titans
  LMM, with many pairs per row (the ``gpu`` preset: far more than a head's state holds; the
  ``cpu`` preset: about what it holds, the most its budget learns; Proteus Fig. 3: 16 blocks
  beat 1, 32 is worse again). ``<m>+proteus<E>@half`` (not in the table's default list; name it
  with ``--models``) opens the blocks over the first half of ``L`` instead of all of it, so the
  second half of every training row writes with the whole state open. At the paper's 8K rows the
  last of 16 blocks opens 512 tokens before the end; at the cpu preset's 96 tokens the schedule
  over the row leaves the open state only the query section, and past ``L`` every token writes
  with every block open (docs/RESULTS.md, "What GDN lost at 2×").

Every run is one ``synthetic`` run (:func:`~nested_jax.experiments.synthetic.run_synthetic`),
cached under ``<out>/<table>/models/`` and reused when its settings are equal, so a table is filled
a piece at a time (``--models``, ``--seeds``) and is deterministic under its seeds; the first seed
sweeps the learning rate on a validation set at ``L`` (never on the scored grid). Writes
``<out>/<table>/recall_<task>.{json,md,png}`` and ``recall_<task>_depth.png`` (length × depth
heatmaps). Why a table ranks as it does: :mod:`nested_jax.experiments.recall_probe`.
``--scale``: ``cpu`` (what a 2-core CPU finishes in about an hour a table in the background) or
``gpu`` (wider models, longer rows, five seeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from nested_jax.experiments._training import print_table
from nested_jax.experiments.synthetic import add_finished_only_flag, add_lrs_flag, run_synthetic
from nested_jax.experiments.synthetic_data import SyntheticSettings

# HOLA's cache, the same for both evictions: w entries per head, blocks of C tokens. C is a quarter
# of the cpu preset's training length, so the eviction already decides during training (HOLA trains
# with C = 256 at 2K), and w = 16 holds every pair's two tokens of that preset's rows.
HOLA_CACHE = ("model.hola.window=16", "model.hola.block_size=16")

PROTEUS_MIXERS = ("gdn", "titans_lmm")
PROTEUS_BLOCKS = (1, 4, 16, 32)

TABLES: dict[str, tuple[str, ...]] = {
    "hola": ("hola", "hola@recency", "gdn"),
    "hola_text": ("hola", "hola@recency", "gdn"),
    "titans": ("gdn", "titans_lmm", "titans_mac", "transformer@swa"),
    "proteus": tuple(f"{m}+proteus{e}" for m in PROTEUS_MIXERS for e in PROTEUS_BLOCKS),
}


@dataclasses.dataclass(frozen=True)
class RecallScale:
    """A preset of the recall tables: model sizes, training, the task's sizes per table and the
    scored grid."""

    steps: int
    batch_size: int
    d_model: int
    n_layers: int
    n_heads: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    eval_batches: int
    multipliers: tuple[int, ...]
    depth_bins: int
    sizes: dict[str, int]  # recall:kv sizes of the hola and titans tables
    capacity_sizes: dict[str, int]  # the proteus table's: many pairs against a head's state
    note: str


SCALES = {
    "cpu": RecallScale(
        steps=2_000,
        batch_size=32,
        d_model=64,
        n_layers=2,
        n_heads=2,
        lrs=(1e-3, 3e-3),
        seeds=(0, 1, 2),
        eval_batches=2,
        multipliers=(1, 2, 4, 8, 16),
        depth_bins=5,
        # the size at which the sizing run's best model solved 1× (docs/RESULTS.md, "Sizing")
        sizes=dict(seq_len=64, pairs=4, queries=4, keys=32, values=32, filler=32),
        # 32 pairs against 32-wide heads (a head's state holds about 32 without interference),
        # 8 of them queried, in 40 slots: training rows hold filler too, or the longer scored rows
        # would bring filler ids never seen. 40 pairs (48 key ids) stayed at chance in this budget
        # (docs/RESULTS.md, "The Proteus table's pairs"); GDN learns this one
        capacity_sizes=dict(seq_len=96, pairs=32, queries=8, keys=32, values=32, filler=32),
        note="width 64, 2 layers, 2 000 steps of 32 rows at L = 64 (96 for proteus)",
    ),
    "gpu": RecallScale(
        steps=10_000,
        batch_size=64,
        d_model=256,
        n_layers=4,
        n_heads=4,
        lrs=(3e-4, 1e-3, 3e-3),
        seeds=(0, 1, 2, 3, 4),
        eval_batches=8,
        multipliers=(1, 2, 4, 8, 16),
        depth_bins=10,
        sizes=dict(seq_len=512, pairs=16, queries=8, keys=256, values=256, filler=256),
        capacity_sizes=dict(seq_len=1024, pairs=256, queries=32, keys=512, values=256, filler=64),
        note="width 256, 4 layers, 10 000 steps of 64 rows at L = 512 (1024 for proteus)",
    ),
}


# the recall task of each table (``recall:<name>``); the others are ``recall:kv``
TABLE_TASKS = {"hola_text": "recall:kv_text"}


def variants(seq_len: int) -> dict[str, tuple[str, ...]]:
    """The per-model options of the tables' ``<mixer>@<label>`` entries (and HOLA's cache)."""
    local = seq_len // 4  # what attention sees directly: the SWA window and MAC's segment
    # Proteus' schedule over half the row: the other half trains the fully open state
    half = {
        f"{m}+proteus{e}@half": (f"model.proteus.context_len={seq_len // 2}",)
        for m in PROTEUS_MIXERS
        for e in PROTEUS_BLOCKS
        if e > 1
    }
    return {
        **half,
        "hola": HOLA_CACHE,
        "hola@recency": (*HOLA_CACHE, "model.hola.eviction=recency"),
        "transformer@swa": (f"model.window={local}",),
        # MAC reads its memory only across segments: with one segment per training row the memory
        # would never be read in training, and MAC would be attention over L that stops at 2×.
        "titans_mac": (f"model.titans.segment_len={local}",),
    }


def table_settings(table: str, scale: RecallScale, models: Sequence[str]) -> SyntheticSettings:
    """The :class:`SyntheticSettings` of ``table`` at ``scale`` with the options of ``models``."""
    sizes = scale.capacity_sizes if table == "proteus" else scale.sizes
    options = variants(sizes["seq_len"])
    return SyntheticSettings(
        task=TABLE_TASKS.get(table, "recall:kv"),
        steps=scale.steps,
        batch_size=scale.batch_size,
        d_model=scale.d_model,
        n_layers=scale.n_layers,
        n_heads=scale.n_heads,
        eval_batches=scale.eval_batches,
        eval_multipliers=scale.multipliers,
        depth_bins=1 if table == "proteus" else scale.depth_bins,
        recall_sizes=tuple(sizes.items()),
        model_overrides=tuple((m, o) for m in models for o in options.get(m, ())),
    )


def run_table(
    table: str,
    scale: str,
    out: str | Path,
    models: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    finished_only: bool = False,
    lrs: Sequence[float] | None = None,
) -> dict:
    """Fill ``table`` at preset ``scale`` (the ``synthetic`` summary of its runs;
    ``finished_only``: train nothing, summarise the runs saved so far; ``lrs``: the rates swept on
    the first seed instead of the preset's, one rate to train every model at it).

    Raises:
      ValueError: naming ``table`` or ``scale`` when unknown.
    """
    if table not in TABLES:
        raise ValueError(f"table: expected one of {sorted(TABLES)}, got {table!r}")
    if scale not in SCALES:
        raise ValueError(f"scale: expected one of {sorted(SCALES)}, got {scale!r}")
    preset = SCALES[scale]
    models = list(models or TABLES[table])
    seeds = list(seeds if seeds is not None else preset.seeds)
    s = table_settings(table, preset, models)
    rates = preset.lrs if lrs is None else tuple(lrs)
    result = run_synthetic(
        models, s, seeds, Path(out) / table, lrs=rates, finished_only=finished_only
    )
    head = f"recall table `{table}`, scale `{scale}` ({preset.note})\n\n"
    return {**result, "markdown": head + result["markdown"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m nested_jax.experiments.recall_tables",
        description="task-trained long-context recall tables (HOLA, Titans, Proteus), one command "
        "each, resumable",
    )
    p.add_argument("table", choices=sorted(TABLES))
    p.add_argument("--scale", default="cpu", help="a preset: cpu or gpu (default cpu)")
    p.add_argument("--out", required=True, help="directory of the runs and the summaries")
    p.add_argument("--models", nargs="+", default=None, help="a subset or other models")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the preset's")
    add_lrs_flag(p, default="the preset's rates")
    add_finished_only_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return print_table(
        lambda: run_table(
            args.table, args.scale, args.out, args.models, args.seeds, args.finished_only, args.lrs
        )
    )


if __name__ == "__main__":
    sys.exit(main())
