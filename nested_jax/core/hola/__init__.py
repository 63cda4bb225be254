"""HOLA (SPEC §5): gated delta state plus a persistent exact KV cache chosen by write magnitude.

- :mod:`~nested_jax.core.hola.forward`: the insertion scores, the residual pass and the
  block-parallel ``hola_forward`` (its docstring states every decision).
- :mod:`~nested_jax.core.hola.decode`: the state and parameter types (``HolaState``,
  ``HolaReadParams``), the decode step, the per-token form.
- :mod:`~nested_jax.core.hola.cache`: the cache read (softmax over cache, block and sink) and the
  top-w merge.
- :mod:`~nested_jax.core.hola.stream`: the cache path of one stream (blocks on absolute
  positions, continuing a state).
- :mod:`~nested_jax.core.hola.packed`: the cache path of packed rows (one block grid and one
  cache per document).
- :mod:`~nested_jax.core.hola.reference`: the float64 numpy twin the fast forms are tested against.

Every form takes the static options as one ``HolaRule`` (``rule=``, :mod:`nested_jax.rules`) and
the learnable per-head arrays as one ``HolaReadParams``. The public names are exported by
:mod:`nested_jax.core`; import the modules for the rest.
"""
