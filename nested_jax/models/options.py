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


@dataclass(frozen=True)
class HolaOptions:
    """HOLA cache path of the ``hola`` mixer (SPEC §5; ``model.hola.<field>``)."""

    window: int = 64  # persistent exact-cache capacity w (entries per head and layer)
    block_size: int = 256  # block length C: the cache is merged (top-w) at every block end
    eviction: str = "beta_e"  # beta_e | recency | e | beta_v | cumulative_attention
    read_norm: str = "rmsnorm"  # cache read normalisation of q, k: rmsnorm (learnable γ) | l2
    gate_init: float = -4.0  # initial per-head gate logit λ_h (cache read scaled by σ(λ_h))

    def __post_init__(self) -> None:
        from nested_jax.core.hola import EVICTIONS, READ_NORMS  # lazy: keeps config import light

        for name in ("window", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HolaOptions.{name}: must be a positive int, got {value!r}")
        if self.eviction not in EVICTIONS:
            raise ValueError(
                f"HolaOptions.eviction: unknown {self.eviction!r}; expected one of {EVICTIONS}"
            )
        if self.read_norm not in READ_NORMS:
            raise ValueError(
                f"HolaOptions.read_norm: unknown {self.read_norm!r}; expected one of {READ_NORMS}"
            )
        if isinstance(self.gate_init, bool) or not isinstance(self.gate_init, int | float):
            raise ValueError(f"HolaOptions.gate_init: expected float, got {self.gate_init!r}")


OPTION_SECTIONS["hola"] = HolaOptions
