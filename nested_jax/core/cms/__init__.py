"""Continuum Memory System (SPEC §3.3, §3.4): MLP levels updated at several periods.

- :mod:`~nested_jax.core.cms.levels`: the levels, the variants (``sequential`` / ``independent`` /
  ``nested``) and the fixed-weight forward ``cms_forward``.
- :mod:`~nested_jax.core.cms.online`: the online update mode ``cms_online`` (local surprise,
  accumulated over each level's period and applied at its boundary).

The public names are exported by :mod:`nested_jax.core`; import the modules for the rest.
"""
