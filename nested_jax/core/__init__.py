"""THE MATH of nested-jax: pure ``jnp`` functions over arrays and NamedTuple states.

No Flax, no configs, no sharding: import these into your own JAX code (SPEC §0.1 lists the
stable names). Shapes follow flash-linear-attention: ``[B, T, H, D]`` arrays, ``[B, T, H]`` gates
(``g`` is a *log* decay), ``[B, H, K, V]`` matrix states; every sequence function returns
``(output, state)``.

    from nested_jax.core import gated_delta_chunked, titans_linear_chunked, dgd_update
"""

from importlib import import_module

_MODULES = (
    "associative",
    "scan",
    "dgd",
    "proteus",
    "hola",
    "titans",
    "proteus_memory",
    "cms",
    "hope",
)

__all__: list[str] = []
for _name in _MODULES:
    _module = import_module(f"nested_jax.core.{_name}")
    # Upper-case constants (VARIANTS, EVICTIONS, ...) stay in their modules: at package level their
    # meaning would be ambiguous.
    for _symbol in (s for s in _module.__all__ if not s.isupper() and s not in __all__):
        globals()[_symbol] = getattr(_module, _symbol)
        __all__.append(_symbol)
del _name, _module, _symbol
