"""Mixer-specific option sections of :class:`nested_jax.models.config.ModelConfig`.

They live with the layers that read them (the models layer above imports them into its config).

Each mechanism with options of its own (Titans, HOLA, Hope, Proteus, ...) gets one frozen
dataclass here and one field on ``ModelConfig`` (``model.<section>.<field>`` in YAML and
``--set``). A section is read only by its mixer, so the shared shell stays free of mechanism
flags. Field types stay plain (int / float / str / bool / tuple) so the strict config loader can
check them; each section validates its own values in ``__post_init__`` and names the field
(``ModelConfig.<section>.<field>``). A mechanism whose math takes static options gets them as one
frozen value from ``<Section>.rule()`` (``HopeRule``, ``HolaRule``, ``CMSRule``, ``ProteusRule``,
defined next to their core code and re-exported by ``nested_jax.ops``); a test keeps each
section's defaults equal to its rule's.
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
        from nested_jax.ops.hola import EVICTIONS, READ_NORMS  # lazy: keeps config import light

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

    def rule(self, *, chunk_size: int | None = None):
        """The HOLA rule these options select (SPEC §5): a ``HolaRule`` with this section's
        ``window``, ``block_size``, ``eviction``, ``read_norm`` and the shell's ``chunk_size``
        (``model.chunk_size``; None: ``HolaRule``'s default). ``gate_init`` only initialises a
        parameter, so it is the layer's, not the rule's."""
        from nested_jax.ops.hola import HolaRule  # lazy: keeps config import light

        shell = {} if chunk_size is None else {"chunk_size": chunk_size}
        return HolaRule(
            window=self.window,
            block_size=self.block_size,
            eviction=self.eviction,
            read_norm=self.read_norm,
            **shell,
        )


OPTION_SECTIONS["hola"] = HolaOptions


@dataclass(frozen=True)
class TitansOptions:
    """Titans memory and architecture options (SPEC §2; ``model.titans.<field>``).

    Read by the ``titans_lmm``, ``titans_mac``, ``titans_mag`` and ``titans_mal`` mixers.
    """

    memory_layers: int = 2  # L_M ∈ {1, 2, 3, 4}; 1 = matrix memory
    memory_hidden: int = 0  # hidden width of an MLP memory (L_M ≥ 2); 0 -> 4 * head_dim
    memory_chunk: int = 16  # chunk size b of titans_mlp_chunked (gradients at chunk start)
    memory_impl: str = "chunked"  # chunked | recurrent (exact per-token rule)
    read_before_write: bool = False  # read y_t = M_{t-1}(q_t) instead of M_t(q_t)
    per_chunk_gates: bool = False  # θ, η, α mean-pooled per chunk (non-causal inside a chunk)
    grad_clip: float = 10.0  # softclamp of the inner gradient norm; 0 = off
    theta_init: float = 0.02  # initial inner lr θ; θ/(1−η) ≳ 1 makes the backward explode at T=4096
    theta_max: float = 0.1  # cap: θ_t = theta_max·σ(·), bias set so θ starts at theta_init
    eta_init: float = 0.9  # initial momentum η
    alpha_init: float = 0.01  # initial forget gate α
    persistent_tokens: int = 4  # N_p learned key/value tokens prepended to attention (MAC/MAG/MAL)
    segment_len: int = 64  # N_s, MAC segment length (a multiple of memory_chunk when chunked)
    window: int = 64  # sliding window of the MAG / MAL attention; 0 = global causal
    grad_horizon: int = 64  # truncated backprop: memory state gradients stop every n tokens; 0=off

    def __post_init__(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.memory_layers) or not 1 <= self.memory_layers <= 4:
            raise ValueError(
                f"TitansOptions.memory_layers: must be an int in 1..4, got {self.memory_layers!r}"
            )
        for name, low in (
            ("memory_hidden", 0),
            ("memory_chunk", 1),
            ("persistent_tokens", 0),
            ("segment_len", 1),
            ("window", 0),
            ("grad_horizon", 0),
        ):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"TitansOptions.{name}: must be an int >= {low}, got {value!r}")
        if self.memory_impl not in ("chunked", "recurrent"):
            raise ValueError(
                f"TitansOptions.memory_impl: unknown {self.memory_impl!r}; "
                "expected one of ('chunked', 'recurrent')"
            )
        for name in ("read_before_write", "per_chunk_gates"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise ValueError(f"TitansOptions.{name}: expected bool, got {value!r}")
        gc = self.grad_clip
        if isinstance(gc, bool) or not isinstance(gc, int | float) or gc < 0:
            raise ValueError(f"TitansOptions.grad_clip: must be a float >= 0, got {gc!r}")
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
        if self.memory_impl == "chunked" and self.segment_len % self.memory_chunk:
            raise ValueError(
                f"TitansOptions.segment_len: must be a multiple of memory_chunk="
                f"{self.memory_chunk} (MAC segments hold whole memory chunks), "
                f"got {self.segment_len}"
            )

        if self.memory_impl == "chunked" and self.grad_horizon % self.memory_chunk:
            raise ValueError(
                f"TitansOptions.grad_horizon: must be a multiple of memory_chunk="
                f"{self.memory_chunk} (windows hold whole chunks), got {self.grad_horizon}"
            )

    def resolved_memory_hidden(self, head_dim: int) -> int:
        """Hidden width of the MLP memory: ``memory_hidden`` or ``4 * head_dim`` when 0."""
        return self.memory_hidden or 4 * head_dim


OPTION_SECTIONS["titans"] = TitansOptions


@dataclass(frozen=True)
class ProteusOptions:
    """Proteus incremental memory activation (SPEC §4; ``model.proteus.<field>``).

    Read by the mixers whose memory Proteus wraps (GDN, Titans). The memory coordinates are split
    into ``blocks`` (``E``) contiguous blocks; with training context ``N = context_len`` the first
    ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` blocks are open at 1-based position ``t`` (``Δ = ⌊N/E⌋``) and
    everything is open beyond ``N``. ``blocks = 1`` is the plain backbone, bit for bit.
    """

    blocks: int = 1  # E; 1 = off (plain backbone). SPEC §4 default for Proteus runs is 16
    context_len: int = 0  # training context N; required > 0 when blocks > 1

    def __post_init__(self) -> None:
        for name, low in (("blocks", 1), ("context_len", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ProteusOptions.{name}: must be an int >= {low}, got {value!r}")
        if self.blocks > 1 and self.context_len < 1:
            raise ValueError(
                f"ProteusOptions.context_len: must be > 0 (the training context N, e.g. "
                f"data.seq_len) when blocks > 1, got {self.context_len} "
                f"(set model.proteus.context_len)"
            )

    @property
    def enabled(self) -> bool:
        """True when Proteus gates the memory (``blocks > 1``)."""
        return self.blocks > 1

    def rule(self):
        """The Proteus schedule these options select (SPEC §4): a ``ProteusRule(blocks,
        context_len)``."""
        from nested_jax.ops.linear import ProteusRule  # lazy: keeps config import light

        return ProteusRule(blocks=self.blocks, context_len=self.context_len)


OPTION_SECTIONS["proteus"] = ProteusOptions


@dataclass(frozen=True)
class HopeOptions:
    """Hope self-modifying memory mixer (SPEC §3.2; ``model.hope.<field>``), read by ``hope``."""

    chunk_memory: int = 16  # chunk size of M_memory (SPEC §3.2 two chunk sizes; 1 = per token)
    chunk_other: int = 4  # chunk size of M_k, M_v, M_η, M_α (M_q); max must be a multiple of min
    memory_hidden: int = 0  # hidden width h of every 2-layer residual memory; 0 -> head_dim
    dgd: bool = True  # DGD inner step (False: plain GD with retention; Table 6 ablation)
    step: str = "exact"  # DGD step size: exact (Sherman–Morrison γ) | paper (η/(1+η))
    momentum: bool = True  # inner momentum S_t = μ S_{t−1} + u_t (Table 6 ablation)
    momentum_coef: float = 0.9  # μ in [0, 1)
    decay: bool = True  # data-dependent retention α_t (False: α = 1)
    adaptive_q: bool = False  # q_t = M_q(x_t) (self-modifying) instead of q_t = W_q x_t
    inner_k: bool = True  # M_k adapts in the inner loop
    inner_v: bool = True  # M_v adapts in the inner loop
    inner_q: bool = True  # M_q adapts (only with adaptive_q)
    stop_gradient_targets: bool = False  # stop the outer gradient through v̂ = M_0(v)
    norm_inputs: bool = True  # L2-normalise the per-head memory inputs x (k, q always are)
    eta_init: float = 0.1  # initial inner rate η = σ(b_η)
    alpha_init: float = 0.99  # initial retention α = σ(b_α)
    memory_init: float = 0.1  # std of the initial W_1 times √h (W_2: std 1/√D); 0 = M(z) = z
    readout_init: float = 0.02  # std of the η / α readout weights w_η, w_α
    grad_horizon: int = 0  # truncated backprop every n tokens (multiple of the larger chunk); 0=off
    # rematerialise each chunk of the memory scan in the backward pass. Measured (core fwd+bwd,
    # B=4, T=256, H=2, D=h=64, CPU): 1.6x faster and 4.9x less temp memory than storing the
    # per-token weights of every chunk
    remat: bool = True

    def __post_init__(self) -> None:
        def bad_int(v, low):
            return isinstance(v, bool) or not isinstance(v, int) or v < low

        def bad_float(v):
            return isinstance(v, bool) or not isinstance(v, int | float)

        for name, low in (("chunk_memory", 1), ("chunk_other", 1), ("memory_hidden", 0),
                          ("grad_horizon", 0)):  # fmt: skip
            if bad_int(getattr(self, name), low):
                raise ValueError(
                    f"HopeOptions.{name}: must be an int >= {low}, got {getattr(self, name)!r}"
                )
        for name in ("dgd", "momentum", "decay", "adaptive_q", "inner_k", "inner_v", "inner_q",
                     "stop_gradient_targets", "norm_inputs", "remat"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HopeOptions.{name}: expected bool, got {getattr(self, name)!r}")
        if self.step not in ("exact", "paper"):
            raise ValueError(
                f"HopeOptions.step: unknown {self.step!r}; expected one of ('exact', 'paper')"
            )
        small, big = sorted((self.chunk_memory, self.chunk_other))
        if big % small:
            raise ValueError(
                f"HopeOptions.chunk_memory: chunk_memory={self.chunk_memory} and chunk_other="
                f"{self.chunk_other}: the larger must be a multiple of the smaller"
            )
        if self.grad_horizon % big:
            raise ValueError(
                f"HopeOptions.grad_horizon: must be a multiple of max(chunk_memory, chunk_other)="
                f"{big}, got {self.grad_horizon}"
            )
        mu = self.momentum_coef
        if bad_float(mu) or not 0 <= mu < 1:
            raise ValueError(f"HopeOptions.momentum_coef: must be in [0, 1), got {mu!r}")
        for name in ("eta_init", "alpha_init"):
            v = getattr(self, name)
            if bad_float(v) or not 0 < v < 1:
                raise ValueError(f"HopeOptions.{name}: must be in (0, 1), got {v!r}")
        for name in ("memory_init", "readout_init"):
            v = getattr(self, name)
            if bad_float(v) or v < 0:
                raise ValueError(f"HopeOptions.{name}: must be a float >= 0, got {v!r}")

    def resolved_memory_hidden(self, head_dim: int) -> int:
        """Hidden width ``h`` of the memories: ``memory_hidden`` or ``head_dim`` when 0."""
        return self.memory_hidden or head_dim

    def rule(self):
        """The memory rule these options select (SPEC §3.2): a ``HopeRule`` with this section's
        chunk sizes, ablation flags, ``grad_horizon`` and ``remat`` (its fields, by name)."""
        import dataclasses  # lazy, with the import below: keeps config import light

        from nested_jax.ops.hope import HopeRule

        return HopeRule(**{f.name: getattr(self, f.name) for f in dataclasses.fields(HopeRule)})


OPTION_SECTIONS["hope"] = HopeOptions


@dataclass(frozen=True)
class CMSOptions:
    """Continuum Memory System used as the block FFN (SPEC §3.3, §3.4; ``model.cms.<field>``).

    Read when ``model.ffn`` resolves to ``"cms"`` (the ``hope`` and ``hope_attention`` models).
    ``periods`` gives one entry per level (``k = len(periods)``, level 1 = fastest). Its unit
    depends on ``mode``: **optimizer steps** in ``pretrain`` (level ℓ's parameters take an outer
    step every ``C^(ℓ)`` steps from the gradients accumulated since its last step), **tokens** in
    ``online`` (the level learns from the local surprise at test time / in continual learning).
    """

    periods: tuple[int, ...] = (1, 4, 16)  # C^(1) < … < C^(k); pretrain: optimizer steps
    variant: str = "sequential"  # sequential | nested | independent
    hidden: int = 0  # per-level hidden width; 0 -> the SwiGLU rule (model.mlp_hidden or 8/3·d)
    gated: bool = (
        True  # SwiGLU levels (a transformer FFN copies in exactly); False = σ(xW_up)W_down
    )
    mode: str = "pretrain"  # pretrain (multi-frequency outer steps) | online (test-time updates)
    accumulate: str = "sum"  # pretrain: sum | mean of the gradients over a level's period
    online_lr: float = 1e-2  # online: inner learning rate η of every level
    online_inner: str = "sgd"  # online: inner optimizer, sgd | dgd (SPEC §3.1)

    def __post_init__(self) -> None:
        from nested_jax.ops.cms import check_periods  # lazy: keeps config import light

        variants = ("sequential", "nested", "independent")
        if self.variant not in variants:
            raise ValueError(
                f"CMSOptions.variant: unknown {self.variant!r}; expected one of {variants}"
            )
        try:
            if not isinstance(self.periods, tuple):
                raise ValueError(f"periods must be a tuple, got {self.periods!r}")
            check_periods(self.periods, variant=self.variant)
        except ValueError as err:  # core.cms's message, under the config field's name
            raise ValueError(f"CMSOptions.periods: {str(err).removeprefix('periods ')}") from None
        h = self.hidden
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"CMSOptions.hidden: must be an int >= 0 (0 = default), got {h!r}")
        if not isinstance(self.gated, bool):
            raise ValueError(f"CMSOptions.gated: expected bool, got {self.gated!r}")
        for name, allowed in (
            ("mode", ("pretrain", "online")),
            ("accumulate", ("sum", "mean")),
            ("online_inner", ("sgd", "dgd")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"CMSOptions.{name}: unknown {getattr(self, name)!r}; expected one of {allowed}"
                )
        lr = self.online_lr
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
            raise ValueError(f"CMSOptions.online_lr: must be a float > 0, got {lr!r}")

    def rule(self):
        """The CMS rule these options select (SPEC §3.3): a ``CMSRule`` with this section's
        ``periods`` and ``variant`` and the online inner step (``lr = online_lr``,
        ``inner = online_inner``). ``hidden`` and ``gated`` shape the levels (the layer's);
        ``mode`` and ``accumulate`` drive the pretrain optimizer (``nested_jax.optim``)."""
        from nested_jax.ops.cms import CMSRule  # lazy: keeps config import light

        return CMSRule(
            periods=self.periods, variant=self.variant, lr=self.online_lr, inner=self.online_inner
        )


OPTION_SECTIONS["cms"] = CMSOptions
