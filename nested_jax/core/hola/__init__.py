"""HOLA (SPEC §5): gated delta state plus a persistent exact KV cache chosen by write magnitude.

- :mod:`~nested_jax.core.hola.forward`: the insertion scores, the residual pass and the
  block-parallel ``hola_forward`` (its docstring states every decision).
- :mod:`~nested_jax.core.hola.cache`: the cache path: softmax read, top-w merge, block scans.
- :mod:`~nested_jax.core.hola.decode`: the decoding state, the decode step, the per-token form.
- :mod:`~nested_jax.core.hola.reference`: the float64 numpy twin the fast forms are tested against.

The public names are exported by :mod:`nested_jax.core`; import the modules for the rest.
"""
