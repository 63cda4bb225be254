"""Titans neural long-term memory (SPEC §2): every form of the rule and its twin.

- :mod:`~nested_jax.core.titans.net`: the MLP memory ``M_θ``, its state, checks, forward pass and
  inner-gradient factors.
- :mod:`~nested_jax.core.titans.mlp`: the per-token forms (step, recurrent).
- :mod:`~nested_jax.core.titans.chunk`: the chunked dual form (scan across chunks).
- :mod:`~nested_jax.core.titans.linear`: the matrix memory (``L_M = 1``) API of SPEC §0.1.
- :mod:`~nested_jax.core.titans.memory`: the memory of one mixer (Proteus spans, packed rows,
  decode buffering), what ``ops.titans`` calls.
- :mod:`~nested_jax.core.titans.proteus`: the Proteus-wrapped forms (SPEC §4).
- :mod:`~nested_jax.core.titans.reference`: the independent twin the fast forms are tested against.

Every form takes the memory's static options whole, ``rule=TitansRule()``
(:class:`nested_jax.rules.TitansRule`, default the paper's rule), and the Proteus forms the
schedule whole, ``schedule=ProteusRule(blocks, context_len)``.

The public names are exported by :mod:`nested_jax.core`; import the modules for the rest.
"""
