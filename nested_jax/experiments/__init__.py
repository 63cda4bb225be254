"""Experiment drivers: each trains several configs (or models) and writes one table.

They sit above evaluation (they call training and the evaluations) and are run as modules, e.g.
``python -m nested_jax.experiments.compare``, ``.mqar``, ``.proteus_table``, ``.forgetting``,
``.compare_hope`` (Hope and Hope-Attention against the baselines: ``compare`` plus ``mqar``),
``.synthetic`` (formal languages and MAD tasks: length generalisation and recall, docs/RESULTS.md).
"""
