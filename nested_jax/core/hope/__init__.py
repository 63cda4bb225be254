"""Hope (SPEC §3.2): self-modifying Titans memories updated by Delta Gradient Descent.

- :mod:`~nested_jax.core.hope.state`: the memories and their read, the readout, the carried state,
  ``check_rule`` (every form takes the rule whole: ``rule=`` a ``nested_jax.rules.HopeRule``).
- :mod:`~nested_jax.core.hope.chunk`: the chunked form (``hope_chunked``), the driver.
- :mod:`~nested_jax.core.hope.rows`: its parallel chunk on the memories stacked as rows.
- :mod:`~nested_jax.core.hope.parallel`: one layer's chunk as a triangular solve.
- :mod:`~nested_jax.core.hope.token`: the decode step and the per-token forms.
- :mod:`~nested_jax.core.hope.decode`: the cached token loop, plain or under Proteus.
- :mod:`~nested_jax.core.hope.linear`: a linear-memory chunk through the gated delta kernel.
- :mod:`~nested_jax.core.hope.proteus`: the Proteus-wrapped memories (SPEC §4).
- :mod:`~nested_jax.core.hope.reference`: the independent twin the fast forms are tested against.

The public names are exported by :mod:`nested_jax.core`; import the modules for the rest.
"""
