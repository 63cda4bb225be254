"""Mixer-specific option sections of :class:`nested_jax.models.config.ModelConfig`.

They live with the layers that read them (the models layer above imports them into its config).

Each mechanism with options of its own (Titans, HOLA, Hope, Proteus, ...) gets one frozen
dataclass here and one field on ``ModelConfig`` (``model.<section>.<field>`` in YAML and
``--set``). A section is read only by its mixer, so the shared shell stays free of mechanism
flags. Field types stay plain (int / float / str / bool / tuple) so the strict config loader can
check them; each section validates its values in ``__post_init__`` and names the field
(``<Section>.<field>: ...``). A mechanism whose math takes static options gets them as one frozen
value: the typed rules of :mod:`nested_jax.rules` (``HopeRule``, ``TitansRule``,
``HolaRule``, ``CMSRule``, ``ProteusRule``; re-exported by ``nested_jax.ops``).
``HopeOptions``, ``TitansOptions``, ``HolaOptions``, ``CMSOptions`` and ``ProteusOptions``
extend their rules (the rule's fields, defaults and checks are written once, there; a section
re-declares only its training defaults), so a section is a rule plus its layer's own fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from nested_jax.layers.rope import ROPE_SCALINGS, RopeScaling
from nested_jax.rules import CMSRule, HolaRule, HopeRule, ProteusRule, TitansRule

__all__ = ["OPTION_SECTIONS"]

# name on ModelConfig -> dataclass; filled below by each mechanism's section.
OPTION_SECTIONS: dict[str, type] = {}


@dataclass(frozen=True)
class HolaOptions(HolaRule):
    """HOLA cache path of the ``hola`` mixer (SPEC §5; ``model.hola.<field>``).

    The rule's fields (``window``, ``block_size``, ``eviction``, ``read_norm``, ``scale``,
    ``cache_scale``), their defaults and their checks are :class:`HolaRule`'s; the layer passes the
    section whole as its rule. ``gate_init`` only initialises a parameter, so it is the layer's.
    The WY/UT chunk of the state path is the shell's ``model.chunk_size``.
    """

    gate_init: float = -4.0  # initial per-head gate logit λ_h (cache read scaled by σ(λ_h))

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.gate_init, bool) or not isinstance(self.gate_init, int | float):
            raise ValueError(f"HolaOptions.gate_init: expected float, got {self.gate_init!r}")


OPTION_SECTIONS["hola"] = HolaOptions


@dataclass(frozen=True)
class TitansOptions(TitansRule):
    """Titans memory and architecture options (SPEC §2; ``model.titans.<field>``).

    Read by the ``titans_lmm``, ``titans_mac``, ``titans_mag`` and ``titans_mal`` mixers. The
    memory rule's fields (``memory_chunk``, ``read_before_write``, ``per_chunk_gates``,
    ``grad_clip``, ``activation``, ``grad_horizon``, ``remat``) and their checks are
    :class:`TitansRule`'s, under the same names; this section re-declares the two whose training
    default is not the paper's (``grad_clip``, ``grad_horizon``; ``layers.titans`` says why) and
    adds the layer's own fields. The layers pass the section itself as the rule.
    """

    grad_clip: float = 10.0  # softclamp of the inner gradient norm; 0 = off (the paper's rule)
    grad_horizon: int = 64  # truncated backprop: memory state gradients stop every n tokens; 0=off
    memory_layers: int = 2  # L_M ∈ {1, 2, 3, 4}; 1 = matrix memory
    memory_hidden: int = 0  # hidden width of an MLP memory (L_M ≥ 2); 0 -> 4 * head_dim
    memory_impl: str = "chunked"  # chunked | recurrent (exact per-token rule) | pallas (L_M = 1)
    theta_init: float = 0.02  # initial inner lr θ; θ/(1−η) ≳ 1 makes the backward explode at T=4096
    theta_max: float = 0.1  # cap: θ_t = theta_max·σ(·), bias set so θ starts at theta_init
    eta_init: float = 0.9  # initial momentum η
    alpha_init: float = 0.01  # initial forget gate α
    persistent_tokens: int = 4  # N_p learned key/value tokens prepended to attention (MAC/MAG/MAL)
    segment_len: int = 64  # N_s, MAC segment length (a multiple of memory_chunk when chunked)
    window: int = 64  # sliding window of the MAG / MAL attention; 0 = global causal

    def __post_init__(self) -> None:
        super().__post_init__()

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.memory_layers) or not 1 <= self.memory_layers <= 4:
            raise ValueError(
                f"TitansOptions.memory_layers: must be an int in 1..4, got {self.memory_layers!r}"
            )
        for name, low in (
            ("memory_hidden", 0),
            ("persistent_tokens", 0),
            ("segment_len", 1),
            ("window", 0),
        ):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"TitansOptions.{name}: must be an int >= {low}, got {value!r}")
        if self.memory_impl not in ("chunked", "recurrent", "pallas"):
            raise ValueError(
                f"TitansOptions.memory_impl: unknown {self.memory_impl!r}; "
                "expected one of ('chunked', 'recurrent', 'pallas')"
            )
        if self.memory_impl == "pallas" and self.memory_layers != 1:
            raise ValueError(
                "TitansOptions.memory_impl: 'pallas' covers only the matrix memory "
                f"(memory_layers=1), got memory_layers={self.memory_layers}"
            )
        if self.memory_impl == "pallas" and self.memory_chunk % 8:
            raise ValueError(
                "TitansOptions.memory_chunk: memory_impl='pallas' needs a multiple of 8 (the "
                f"kernel's chunk is a whole number of TPU sublanes), got {self.memory_chunk}"
            )
        for name in ("theta_init", "eta_init", "alpha_init"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
                raise ValueError(f"TitansOptions.{name}: must be in (0, 1), got {value!r}")
        tm = self.theta_max
        if isinstance(tm, bool) or not isinstance(tm, int | float) or not 0 < tm <= 1:
            raise ValueError(f"TitansOptions.theta_max: must be in (0, 1], got {tm!r}")
        if self.theta_init >= tm:
            raise ValueError(
                f"TitansOptions.theta_init: must be below theta_max={tm} "
                f"(θ = theta_max·sigmoid(·)), got {self.theta_init}"
            )
        chunked = self.memory_impl in ("chunked", "pallas")  # both run the chunk rule
        if chunked and self.segment_len % self.memory_chunk:
            raise ValueError(
                f"TitansOptions.segment_len: must be a multiple of memory_chunk="
                f"{self.memory_chunk} (MAC segments hold whole memory chunks), "
                f"got {self.segment_len}"
            )

        if chunked and self.grad_horizon % self.memory_chunk:
            raise ValueError(
                f"TitansOptions.grad_horizon: must be a multiple of memory_chunk="
                f"{self.memory_chunk} (windows hold whole chunks), got {self.grad_horizon}"
            )

    def resolved_memory_hidden(self, head_dim: int) -> int:
        """Hidden width of the MLP memory: ``memory_hidden`` or ``4 * head_dim`` when 0."""
        return self.memory_hidden or 4 * head_dim


OPTION_SECTIONS["titans"] = TitansOptions


@dataclass(frozen=True)
class ProteusOptions(ProteusRule):
    """Proteus incremental memory activation (SPEC §4; ``model.proteus.<field>``).

    Read by the mixers whose memory Proteus wraps (GDN, DeltaNet, Titans, Hope). The memory
    coordinates are split into ``blocks`` (``E``) contiguous blocks; with training context
    ``N = context_len`` the first ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` blocks are open at 1-based
    position ``t`` (``Δ = ⌊N/E⌋``) and everything is open beyond ``N``. ``blocks = 1`` is the plain
    backbone, bit for bit. The fields, defaults, checks and ``enabled`` are :class:`ProteusRule`'s.
    """

    def rule(self) -> ProteusRule:
        """The Proteus schedule these options select (SPEC §4): ``ProteusRule(blocks,
        context_len)``."""
        return ProteusRule(blocks=self.blocks, context_len=self.context_len)


OPTION_SECTIONS["proteus"] = ProteusOptions


@dataclass(frozen=True)
class HopeOptions(HopeRule):
    """Hope self-modifying memory mixer (SPEC §3.2; ``model.hope.<field>``), read by ``hope``.

    A ``HopeOptions`` *is* the :class:`HopeRule` the mixer passes to ``ops.hope`` (the rule's
    fields and checks are written once, there). It re-declares the training defaults only: the
    rule's defaults are the paper's per-token rule, training runs chunk-wise (``chunk_memory=16``,
    ``chunk_other=4``) with inner momentum, the inner-gradient softclamp ``grad_clip=4.0``,
    per-chunk remat and the parallel chunk updates (docs/RESULTS.md, "Hope engineering
    defaults"). The fields after them shape and initialise the layer.
    """

    chunk_memory: int = 16
    chunk_other: int = 4
    momentum: bool = True
    remat: bool = True
    chunk_updates: str = "parallel"
    grad_clip: float = 4.0
    memory_hidden: int = 0  # hidden width h of every 2-layer residual memory; 0 -> head_dim
    norm_inputs: bool = True  # L2-normalise the per-head memory inputs x (k, q always are)
    eta_init: float = 0.1  # initial inner rate η = σ(b_η)
    alpha_init: float = 0.99  # initial retention α = σ(b_α)
    memory_init: float = 0.1  # std of the initial W_1 times √h (W_2: std 1/√D); 0 = M(z) = z
    readout_init: float = 0.02  # std of the η / α readout weights w_η, w_α

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.memory_hidden, bool)
            or not isinstance(self.memory_hidden, int)
            or (self.memory_hidden < 0)
        ):
            raise ValueError(
                f"HopeOptions.memory_hidden: must be an int >= 0, got {self.memory_hidden!r}"
            )
        if not isinstance(self.norm_inputs, bool):
            raise ValueError(f"HopeOptions.norm_inputs: expected bool, got {self.norm_inputs!r}")
        for name in ("eta_init", "alpha_init", "memory_init", "readout_init"):
            v = getattr(self, name)
            rate = name in ("eta_init", "alpha_init")  # σ of a bias: strictly inside (0, 1)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not (0 < v < 1 if rate else v >= 0)
            ):
                expected = "in (0, 1)" if rate else "a float >= 0"
                raise ValueError(f"HopeOptions.{name}: must be {expected}, got {v!r}")
        if self.eta_init >= self.eta_max:
            raise ValueError(
                f"HopeOptions.eta_init: must be below eta_max={self.eta_max} "
                f"(η = eta_max·sigmoid(·)), got {self.eta_init}"
            )

    def resolved_memory_hidden(self, head_dim: int) -> int:
        """Hidden width ``h`` of the memories: ``memory_hidden`` or ``head_dim`` when 0."""
        return self.memory_hidden or head_dim


OPTION_SECTIONS["hope"] = HopeOptions


@dataclass(frozen=True)
class CMSOptions(CMSRule):
    """Continuum Memory System used as the block FFN (SPEC §3.3, §3.4; ``model.cms.<field>``).

    Read when ``model.ffn`` resolves to ``"cms"`` (the ``hope`` and ``hope_attention`` models).
    The rule's fields (``periods``, ``variant``, ``online_lr``, ``online_inner``, ``remat_every``),
    their defaults and their checks are :class:`CMSRule`'s; the fields below shape the levels and
    drive the pretrain optimizer. ``periods`` gives one entry per level (``k = len(periods)``,
    level 1 = fastest). Its unit depends on ``mode``: **optimizer steps** in ``pretrain`` (level
    ℓ's parameters take an outer step every ``C^(ℓ)`` steps from the gradients accumulated since
    its last step), **tokens** in ``online`` (the level learns from the local surprise at test
    time / in continual learning, with the rule's ``online_lr`` and ``online_inner``).
    """

    hidden: int = 0  # per-level hidden width; 0 -> the SwiGLU rule (model.mlp_hidden or 8/3·d)
    gated: bool = (
        True  # SwiGLU levels (a transformer FFN copies in exactly); False = σ(xW_up)W_down
    )
    mode: str = "pretrain"  # pretrain (multi-frequency outer steps) | online (test-time updates)
    accumulate: str = "sum"  # pretrain: sum | mean of the gradients over a level's period

    def __post_init__(self) -> None:
        super().__post_init__()
        h = self.hidden
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"CMSOptions.hidden: must be an int >= 0 (0 = default), got {h!r}")
        if not isinstance(self.gated, bool):
            raise ValueError(f"CMSOptions.gated: expected bool, got {self.gated!r}")
        for name, allowed in (("mode", ("pretrain", "online")), ("accumulate", ("sum", "mean"))):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"CMSOptions.{name}: unknown {getattr(self, name)!r}; expected one of {allowed}"
                )


OPTION_SECTIONS["cms"] = CMSOptions


@dataclass(frozen=True)
class AttentionOptions:
    """Softmax-attention details of Llama / Qwen2-style checkpoints (``model.attention.<field>``).

    Read by the ``transformer`` and ``hope_attention`` mixers (SPEC §6, Transformer++); the
    defaults are the project's own Transformer++ (no projection bias, plain RoPE). A Hugging Face
    import (``nested-jax import-hf``) fills them from the checkpoint's ``config.json``.

    ``rope_scaling``: ``none``, ``linear`` or ``llama3`` (see
    :class:`nested_jax.layers.rope.RopeScaling` for the frequency rule and the other ``rope_*``
    fields).
    """

    qkv_bias: bool = False  # a learned bias on the q, k and v projections (Qwen2)
    rope_scaling: str = "none"  # none | linear | llama3
    rope_factor: float = 1.0  # linear / llama3: the stretch of the long wavelengths
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_len: int = 8192  # llama3: the context length the frequencies were made for

    def __post_init__(self) -> None:
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"AttentionOptions.qkv_bias: expected bool, got {self.qkv_bias!r}")
        kinds = ("none", *ROPE_SCALINGS)
        if self.rope_scaling not in kinds:
            raise ValueError(
                f"AttentionOptions.rope_scaling: unknown {self.rope_scaling!r}; expected one of "
                f"{kinds}"
            )
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"AttentionOptions.{name}: must be a number > 0, got {value!r}")
        n = self.rope_original_max_len
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(
                f"AttentionOptions.rope_original_max_len: must be an int > 0, got {n!r}"
            )
        if (
            self.rope_scaling == "llama3"
            and self.rope_high_freq_factor <= self.rope_low_freq_factor
        ):
            raise ValueError(
                "AttentionOptions.rope_high_freq_factor: must exceed rope_low_freq_factor "
                f"({self.rope_low_freq_factor}) for llama3 scaling, "
                f"got {self.rope_high_freq_factor}"
            )

    def scaling(self) -> RopeScaling | None:
        """The RoPE frequency stretch these options select (None: plain RoPE)."""
        if self.rope_scaling == "none":
            return None
        return RopeScaling(
            self.rope_scaling,
            float(self.rope_factor),
            float(self.rope_low_freq_factor),
            float(self.rope_high_freq_factor),
            self.rope_original_max_len,
        )


OPTION_SECTIONS["attention"] = AttentionOptions
