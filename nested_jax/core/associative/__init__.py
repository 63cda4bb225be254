"""Linear associative memories (SPEC §1): linear attention, delta rule, gated delta rule.

- :mod:`~nested_jax.core.associative.forms`: each rule's step, recurrent and chunked (WY/UT)
  forms; the chunk algebra is :mod:`nested_jax.core.wy`.
- :mod:`~nested_jax.core.associative.proteus`: the gated delta rule under the Proteus key-row
  schedule (SPEC §4).

The public names are exported by :mod:`nested_jax.core`; import the modules for the rest.
"""
