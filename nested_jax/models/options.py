"""Mixer-specific option sections of :class:`nested_jax.models.config.ModelConfig`.

Each mechanism with options of its own (Titans, HOLA, Hope, Proteus, ...) gets one frozen dataclass here
and one field on ``ModelConfig`` (``model.<section>.<field>`` in YAML and ``--set``). A section is read
only by its mixer, so the shared shell stays free of mechanism flags. Field types stay plain
(int / float / str / bool / tuple) so the strict config loader can check them; each section validates
its own values in ``__post_init__`` and names the field (``ModelConfig.<section>.<field>``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPTION_SECTIONS"]

# name on ModelConfig -> dataclass; filled below by each mechanism's section.
OPTION_SECTIONS: dict[str, type] = {}
