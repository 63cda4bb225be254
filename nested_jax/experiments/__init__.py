"""Experiment drivers: each trains several configs (or models) and writes one table.

They sit above evaluation (they call training and the evaluations) and are run as modules, e.g.
``python -m nested_jax.experiments.compare``, ``.mqar``, ``.proteus_table``, ``.forgetting``,
``.compare_hope`` (Hope and Hope-Attention against the baselines: ``compare`` plus ``mqar``),
``.synthetic`` (formal languages and MAD tasks: length generalisation and recall, docs/RESULTS.md;
its tasks and batches in ``.synthetic_data``, its tables and plots in ``.synthetic_report``),
``.class_incremental`` (its settings, classes and batches in ``.class_incremental_data``, its arms
in ``.class_incremental_arms``, its metrics and tables in ``.class_incremental_report``), and
``.claims``: the seed papers' five claims as prepared runs of the drivers above at a CPU size and
a GPU size (``python -m nested_jax.experiments.claims list``; ``run NAME --scale cpu|gpu --out DIR
[--dry-run]``).
"""
