"""The typed rules: one frozen, validated value per mechanism's static options (docs/SPEC.md).

- :class:`HopeRule` (SPEC §3.2): chunk sizes, ablation flags, truncated backprop, remat.
- :class:`ProteusRule` (SPEC §4): the schedule ``(E, N)``.
- :class:`TitansRule` (SPEC §2): chunk, read order, gates, softclamp, activation, backprop.
- :class:`HolaRule` (SPEC §5): cache capacity, block length, eviction, read, scales.
- :class:`CMSRule` (SPEC §3.3): periods, variant, online inner step; :func:`check_periods`.

Plain Python (no jax), at the bottom of the layer map, so that both sides of the one door use the
same values: the core functions and ops take a rule (``rule=``), and the config sections of
``nested_jax.layers.options`` are built on them: ``HopeOptions``, ``TitansOptions``,
``HolaOptions``, ``CMSOptions`` and ``ProteusOptions`` *are* their rules plus the layer's own
fields (defaults written once, here; a section re-declares only its training defaults). Every
rule is frozen and hashable (a jit static) and checks itself in ``__post_init__``, raising
``ValueError("<Class>.<field>: ...")``; a config section that inherits a rule reports its own
class name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CMS_INNERS",
    "CMS_VARIANTS",
    "DGD_TARGETS",
    "EVICTIONS",
    "READ_NORMS",
    "TITANS_ACTIVATIONS",
    "CMSRule",
    "HolaRule",
    "HopeRule",
    "ProteusRule",
    "TitansRule",
    "check_periods",
]

EVICTIONS = ("beta_e", "recency", "e", "beta_v", "cumulative_attention")
READ_NORMS = ("rmsnorm", "l2")
CMS_VARIANTS = ("sequential", "nested", "independent")
CMS_INNERS = ("sgd", "dgd")  # inner optimizers of the online mode (``core.cms.online.cms_online``)


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_float(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fail(owner, field: str, message: str):
    """``ValueError("<Class>.<field>: message")``; ``owner`` is the instance being checked."""
    raise ValueError(f"{type(owner).__name__}.{field}: {message}")


def _check_ints(owner, lows: dict[str, int]) -> None:
    for name, low in lows.items():
        if not _is_int(getattr(owner, name), low):
            _fail(owner, name, f"must be an int >= {low}, got {getattr(owner, name)!r}")


def _check_choices(owner, choices: dict[str, tuple[str, ...]]) -> None:
    for name, allowed in choices.items():
        if getattr(owner, name) not in allowed:
            _fail(owner, name, f"unknown {getattr(owner, name)!r}; expected one of {allowed}")


# --------------------------------------------------------------------------------------------------
# Hope (SPEC §3.2)

DGD_TARGETS = ("gradient", "proximal")  # SPEC §3.2 Decision (DGD target)
_HOPE_BOOLS = (
    "dgd",
    "momentum",
    "decay",
    "inner_k",
    "inner_v",
    "inner_q",
    "adaptive_q",
    "stop_gradient_targets",
    "remat",
)


def _remat_blocks(n_chunks: int, remat_every: int, levels: int) -> tuple[int, ...]:
    """The nested ``scan_remat`` block sizes for a scan over ``n_chunks`` chunks (outer first;
    ``(1,)`` stores every carry): ``(remat_every,)``, or with ``remat_every = 0``
    ``r^(L−1), …, r`` with ``r = ⌈N^(1/L)⌉`` for ``L = levels`` (2: ``(⌈√N⌉,)``)."""
    if remat_every:
        return (remat_every,)
    r = max(1, round(n_chunks ** (1 / levels)))
    while r**levels < n_chunks:  # the smallest r with r^L >= N (no float rounding at cubes)
        r += 1
    while r > 1 and (r - 1) ** levels >= n_chunks:
        r -= 1
    return tuple(r**i for i in range(levels - 1, 0, -1)) if r > 1 else (1,)


@dataclass(frozen=True)
class HopeRule:
    """The Hope memory rule as one typed value (SPEC §3.2): chunk sizes, ablation flags, backprop.

    The defaults are the paper's plain rule: exact per-token Hope (both chunk sizes 1), the DGD
    step with the Sherman–Morrison ``γ`` on eq. 88's target, data-dependent retention, every
    memory adapting, no momentum, no bound on the inner rate or gradient. Every core form
    (``hope_chunked``, ``hope_reference``, ``hope_step``, ``hope_decode_step``, the Proteus forms)
    and ``ops.hope`` take one value of this class as ``rule=``; the config section
    ``HopeOptions`` (``model.hope``) extends it and re-declares the training defaults only.

    Fields of the rule (SPEC §3.2; they choose the model):

      chunk_memory: chunk size of ``M_memory``; chunk_other: of ``M_k, M_v, M_η, M_α`` (``M_q``);
        the larger a multiple of the smaller. Chunk ``n`` of a group takes its projections,
        targets and signals at the group's state at the end of chunk ``n−1`` (SPEC §3.2 Decision,
        the paper's chunk-wise training, §8.2); 1 = exact per-token Hope.
      dgd: the DGD inner step (SPEC §3.1); False: plain GD with retention ``αW − η g xᵀ``
        (Table 6 ablation).
      dgd_target: what the DGD step regresses ``W x`` onto (SPEC §3.2 Decision): ``gradient``
        (``u = −g``, eq. 88 as printed: ``αW − γ(W x + g)xᵀ``) or ``proximal`` (``u = W x − g``,
        the proximal step on the inner loss itself: ``αW − γ g xᵀ``).
      step: DGD step size, ``exact`` (Sherman–Morrison ``γ = η/(1+η‖x‖²)``) or ``paper``
        (eq. 57's ``η/(1+η)``, exact when ``‖x‖ = 1``).
      momentum, momentum_coef: inner momentum ``S_t = μ S_{t−1} + u_t``, ``W_t = α_t W_{t−1} +
        S_t`` with ``μ ∈ [0, 1)`` (SPEC §3.2: optional, a Table 6 ablation; off: ``S_t = u_t``).
      decay: data-dependent retention ``α_t`` (False: ``α = 1``; Table 6 ablation).
      inner_k, inner_v, inner_q: whether ``M_k``, ``M_v``, ``M_q`` adapt in the inner loop
        (Table 6); ``M_η``, ``M_α``, ``M_memory`` always do.
      adaptive_q: ``q_t = M_q(x_t)`` (self-modifying) instead of the paper's ``q_t = W_q x_t``.
      stop_gradient_targets: stop the outer gradient through ``v̂ = M_0(v)`` (SPEC §3.2 option).

    Engineering knobs (not in the paper; off or neutral by default):

      eta_max: cap of the inner rate, ``η_t = eta_max · σ(w_ηᵀ M_η(x_t) + b_η)`` in ``(0, 1]``
        (1 = the paper's plain sigmoid). Changes the model.
      grad_clip: softclamp ``c`` of each layer's inner gradient ``G_ℓ = g_ℓ x_ℓᵀ`` (as Titans'
        ``grad_clip``): the layer's rate becomes ``η_t · c·tanh(n/c)/n`` with ``n = ‖g_ℓ‖‖x_ℓ‖``,
        so ``‖η G‖ ≤ η c`` (0 = off, the paper's rule). Changes the model; it keeps the inner
        loop finite where self-generated targets ``M_v(M_v(x))`` grow (docs/RESULTS.md, "Hope
        engineering defaults").
      grad_horizon: truncated backprop, the carried state a ``stop_gradient`` after every
        ``grad_horizon`` tokens, a multiple of the larger chunk (0 = full backprop). Values
        unchanged, gradients cut.
      remat: rematerialise each chunk in the backward pass (``jax.checkpoint``); values and
        gradients unchanged, temporary memory per chunk instead of per token.
      remat_every: with ``remat``, the backward stores the carry (memories, momenta, snapshot) of
        every ``remat_every``-th chunk and recomputes the chunks between (``core.scan.scan_remat``);
        0 = ``⌈√N⌉`` for ``N`` chunks (memory ∝ √N), 1 = every chunk (no extra forward).
      remat_levels: with ``remat_every = 0``, the levels of nested checkpoints: ``L`` blocks of
        ``r^(L−1), …, r`` chunks with ``r = ⌈N^(1/L)⌉``, so the backward holds about ``L·r`` carries
        (2: ``2√N``; 3: ``3∛N``, one more recomputed forward). Values unchanged.
      chunk_updates: how a chunk's in-order updates run: ``scan`` (token by token) or
        ``parallel`` (one triangular solve per memory layer, ``core.hope.parallel``). Values
        equal up to rounding.

    The per-token forms (``hope_step``, ``hope_recurrent``) read the fields of the rule but not
    the chunk sizes and the backprop knobs (a token is its own chunk); decoding reads the chunk
    sizes and the fields of the rule.
    """

    chunk_memory: int = 1
    chunk_other: int = 1
    dgd: bool = True
    dgd_target: str = "gradient"
    step: str = "exact"
    momentum: bool = False
    momentum_coef: float = 0.9
    decay: bool = True
    inner_k: bool = True
    inner_v: bool = True
    inner_q: bool = True
    adaptive_q: bool = False
    stop_gradient_targets: bool = False
    grad_horizon: int = 0
    remat: bool = False
    remat_every: int = 0
    remat_levels: int = 2
    chunk_updates: str = "scan"
    eta_max: float = 1.0
    grad_clip: float = 0.0

    def __post_init__(self) -> None:
        _check_ints(
            self,
            {"chunk_memory": 1, "chunk_other": 1, "grad_horizon": 0, "remat_every": 0,
             "remat_levels": 2},
        )  # fmt: skip
        if self.remat_every and self.remat_levels != 2:
            _fail(
                self,
                "remat_levels",
                f"{self.remat_levels} nested levels need the automatic block sizes "
                f"(remat_every=0), got remat_every={self.remat_every}",
            )
        if not _is_float(self.eta_max) or not 0 < self.eta_max <= 1:
            _fail(self, "eta_max", f"must be in (0, 1], got {self.eta_max!r}")
        if not _is_float(self.grad_clip) or not self.grad_clip >= 0:
            _fail(self, "grad_clip", f"must be a float >= 0 (0 = off), got {self.grad_clip!r}")
        for name in _HOPE_BOOLS:
            if not isinstance(getattr(self, name), bool):
                _fail(self, name, f"expected bool, got {getattr(self, name)!r}")
        _check_choices(
            self,
            {"step": ("exact", "paper"), "dgd_target": DGD_TARGETS,
             "chunk_updates": ("scan", "parallel")},
        )  # fmt: skip
        if self.big_chunk % self.small_chunk:
            _fail(
                self,
                "chunk_memory",
                f"chunk_memory={self.chunk_memory} and chunk_other={self.chunk_other}: the "
                "larger must be a multiple of the smaller",
            )
        if self.grad_horizon % self.big_chunk:
            _fail(
                self,
                "grad_horizon",
                f"must be a multiple of max(chunk_memory, chunk_other)={self.big_chunk} (the "
                f"state is cut between chunks), got {self.grad_horizon}",
            )
        mu = self.momentum_coef
        if not _is_float(mu) or not 0 <= mu < 1:
            _fail(self, "momentum_coef", f"must be in [0, 1), got {mu!r}")

    @property
    def small_chunk(self) -> int:
        """``min(chunk_memory, chunk_other)``: the chunk the scan walks."""
        return min(self.chunk_memory, self.chunk_other)

    @property
    def big_chunk(self) -> int:
        """``max(chunk_memory, chunk_other)``."""
        return max(self.chunk_memory, self.chunk_other)

    def remat_blocks(self, n_chunks: int) -> tuple[int, ...]:
        """The nested ``scan_remat`` block sizes for ``n_chunks`` chunks (:func:`_remat_blocks`)."""
        return _remat_blocks(n_chunks, self.remat_every, self.remat_levels)

    @property
    def mu(self):
        """The momentum coefficient in effect: ``μ`` with ``momentum``, else 0."""
        return self.momentum_coef if self.momentum else 0.0


# --------------------------------------------------------------------------------------------------
# Proteus (SPEC §4)


@dataclass(frozen=True)
class ProteusRule:
    """The Proteus schedule as one typed value (SPEC §4): ``E`` blocks opened over context ``N``.

    These defaults are the ``model.proteus`` config defaults (``ProteusOptions`` is this class
    under its config name). The Proteus-wrapped memories (``proteus_titans_*``,
    ``proteus_gated_delta_*``) take it whole as ``schedule=``; the block-schedule helpers of
    ``core.proteus`` (``proteus_active_blocks``, ``proteus_spans``, the masks) keep their plain
    ``(context_len, num_blocks)`` arguments.

    Attributes:
      blocks: ``E``; 1 = off (the plain backbone, bit for bit). SPEC §4's default for Proteus
        runs is 16.
      context_len: training context ``N``; must be ``> 0`` when ``blocks > 1`` (0 = unset).
    """

    blocks: int = 1
    context_len: int = 0

    def __post_init__(self) -> None:
        _check_ints(self, {"blocks": 1, "context_len": 0})
        if self.blocks > 1 and self.context_len < 1:
            _fail(
                self,
                "context_len",
                f"must be > 0 (the training context N, e.g. data.seq_len; in a config "
                f"model.proteus.context_len) when blocks={self.blocks} > 1, got "
                f"{self.context_len}",
            )

    @property
    def enabled(self) -> bool:
        """True when the schedule gates the memory (``blocks > 1``)."""
        return self.blocks > 1


# --------------------------------------------------------------------------------------------------
# Titans (SPEC §2)

# The elementwise σ between the layers of an MLP memory, by name (``core.titans.net`` maps each
# to its function); a name keeps the rule hashable and comparable.
TITANS_ACTIVATIONS = ("silu", "gelu", "relu", "tanh", "sigmoid")


@dataclass(frozen=True)
class TitansRule:
    """The Titans memory rule as one typed value (SPEC §2): chunk, read order, gates, softclamp.

    The defaults are the paper's rule (SPEC §2): the chunked parallel form with ``b = 16`` (SPEC
    §0.1), read after write, per-token gates, no softclamp, SiLU, full backprop. Every Titans
    form of ``nested_jax.core`` takes it whole (``rule=TitansRule()``), and so do the Proteus
    forms, the context-parallel form, the twin (``core.titans.reference``), ``ops.titans`` and
    the Pallas kernel. The ``model.titans`` config section ``TitansOptions`` extends it: its
    fields are these under the same names (the YAML keys), with the training defaults
    ``grad_clip = 10`` and ``grad_horizon = 64``.

    Attributes:
      memory_chunk: chunk size ``b`` of the chunked forms: every surprise of a chunk is taken at
        the chunk-start weights (SPEC §2 parallel form); ``1`` is the exact per-token rule. The
        per-token forms (``*_step``, ``*_recurrent``) have no chunks and ignore it.
      read_before_write: read ``y_t = M_{t-1}(q_t)`` instead of the paper's ``M_t(q_t)`` (SPEC §2
        option).
      per_chunk_gates: ``θ, η, α`` replaced by their means over each chunk (SPEC §2 option the
        paper allows; a chunked form sees later tokens of the chunk). The per-token forms ignore
        it (they have no chunks).
      grad_clip: softclamp ``c`` of the inner gradient, ``u ← u·c·tanh(‖u‖/c)/‖u‖`` with ``‖u‖``
        the norm over all layers; ``0`` = off, the paper's rule.
      activation: ``σ`` between the layers of an MLP memory, one of ``TITANS_ACTIVATIONS`` (SPEC
        §2: default SiLU); the matrix memory (``L_M = 1``) has none.
      grad_horizon: truncated backprop: the carried state is a ``stop_gradient`` before every
        position that is a positive multiple of it (a multiple of ``memory_chunk`` in the
        chunked forms); ``0`` = full backprop. Values unchanged, gradients change.
      remat: recompute each chunk in the backward pass of the chunked forms, storing only the
        carried state per chunk (values and gradients unchanged; an engineering knob, on: the
        cheaper memory).
      remat_every: with ``remat``, the backward stores the carried state of every
        ``remat_every``-th chunk only and recomputes the chunks between (``core.scan.scan_remat``):
        ``1`` = every chunk (no extra forward), ``0`` = ``⌈√N⌉`` for ``N`` chunks (the stored
        states grow like √N; one more forward). An MLP memory's carry is weight-sized per (row,
        head), so at long contexts these per-chunk stacks are what fills the chip. Values and
        gradients unchanged.
    """

    memory_chunk: int = 16
    read_before_write: bool = False
    per_chunk_gates: bool = False
    grad_clip: float = 0.0
    activation: str = "silu"
    grad_horizon: int = 0
    remat: bool = True
    remat_every: int = 1

    def __post_init__(self) -> None:
        _check_ints(self, {"memory_chunk": 1, "grad_horizon": 0, "remat_every": 0})
        for name in ("read_before_write", "per_chunk_gates", "remat"):
            if not isinstance(getattr(self, name), bool):
                _fail(self, name, f"expected bool, got {getattr(self, name)!r}")
        if not _is_float(self.grad_clip) or not self.grad_clip >= 0:
            _fail(self, "grad_clip", f"must be a float >= 0 (0 = off), got {self.grad_clip!r}")
        _check_choices(self, {"activation": TITANS_ACTIVATIONS})

    def remat_block(self, n_chunks: int) -> int:
        """Chunks per checkpointed block of the chunk scan (1: every chunk's carry is stored;
        :func:`_remat_blocks` with one level)."""
        return _remat_blocks(n_chunks, self.remat_every, 2)[0] if self.remat else 1


# --------------------------------------------------------------------------------------------------
# HOLA (SPEC §5)


@dataclass(frozen=True)
class HolaRule:
    """The HOLA rule as one typed value (SPEC §5): cache capacity, block length, eviction, read.

    The defaults are SPEC §5's (``w = 64``, ``C = 256``, eviction by ``m_t = β_t‖e_t‖``, RMSNorm
    read, both scales ``K ** -0.5``). ``HolaOptions`` (the ``model.hola`` config section) extends
    this class, so a config section is a rule. The core functions (``hola_forward``,
    ``hola_recurrent``, ``hola_decode_step``, ``hola_reference``) and ``ops.hola`` take it whole
    (``rule=``). The chunk of the WY/UT state path is not part of the rule: it changes speed and
    memory, not values (up to rounding), so it is the plain ``chunk_size`` keyword of the
    block-parallel form, as in ``gated_delta_chunked`` (in a config ``model.chunk_size``).

    Attributes:
      window: cache capacity ``w`` (entries per head); block_size: block length ``C`` (the cache
        is merged, top-w, at every block end).
      eviction: one of ``EVICTIONS``; read_norm: one of ``READ_NORMS``.
      scale: state-path query scale; cache_scale: cache logit scale (None: ``K ** -0.5``).
    """

    window: int = 64
    block_size: int = 256
    eviction: str = "beta_e"
    read_norm: str = "rmsnorm"
    scale: float | None = None
    cache_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("window", "block_size"):
            if not _is_int(getattr(self, name), 1):
                _fail(self, name, f"must be a positive int, got {getattr(self, name)!r}")
        _check_choices(self, {"eviction": EVICTIONS, "read_norm": READ_NORMS})
        for name in ("scale", "cache_scale"):
            value = getattr(self, name)
            if value is not None and (not _is_float(value) or not value > 0):
                _fail(self, name, f"must be None (K ** -0.5) or a float > 0, got {value!r}")

    def scales(self, key_dim: int) -> tuple[float, float]:
        """``(scale, cache_scale)`` for keys of width ``key_dim``; None stands for
        ``key_dim ** -0.5`` (SPEC §0, §5)."""
        default = key_dim**-0.5
        return (
            default if self.scale is None else self.scale,
            default if self.cache_scale is None else self.cache_scale,
        )


# --------------------------------------------------------------------------------------------------
# CMS (SPEC §3.3)


def check_periods(periods, k: int | None = None, variant: str | None = None) -> tuple[int, ...]:
    """Validate CMS periods ``C^(1) < … < C^(k)`` (SPEC §3.3) and return them as a tuple.

    Shared by :class:`CMSRule`, the online core, the pretrain optimizer wrapper and LM streaming.

    Args:
      periods: a non-empty tuple/list of positive ints, strictly increasing.
      k: the number of levels, when known (one period per level).
      variant: ``"nested"`` also needs each period to divide the next.
    """
    if not isinstance(periods, (tuple, list)) or not periods:
        raise ValueError(f"periods must be a non-empty tuple of positive ints, got {periods!r}")
    periods = tuple(periods)
    if not all(_is_int(p, 1) for p in periods):
        raise ValueError(f"periods must be positive ints, got {periods!r}")
    pairs = list(zip(periods, periods[1:], strict=False))
    if any(b <= a for a, b in pairs):
        raise ValueError(f"periods must be strictly increasing (C^(1) < … < C^(k)), got {periods}")
    if k is not None and len(periods) != k:
        raise ValueError(f"periods must have one entry per level ({k}), got {len(periods)}")
    if variant == "nested" and any(b % a for a, b in pairs):
        raise ValueError(
            f"periods for variant='nested' must each divide the next (a level's context is whole "
            f"periods of the faster level), got {periods}"
        )
    return periods


@dataclass(frozen=True)
class CMSRule:
    """The CMS rule as one typed value (SPEC §3.3): periods, variant and the online inner step.

    ``CMSOptions`` (the ``model.cms`` config section) extends this class, so a config section is a
    rule; the online step's fields carry the config's names (``online_lr``, ``online_inner``): they
    are read by the ``online`` mode only. ``ops.cms`` and ``core.cms.online.cms_online`` take the
    rule whole (``rule=``); the fixed-weight forward reads ``variant``. Lists become tuples
    (hashable). The level widths, ``gated`` and the pretrain optimizer's ``mode`` /
    ``accumulate`` are the config section's: they shape the parameters and the outer optimizer,
    not the CMS function.

    Attributes:
      periods: ``(C^(1), …, C^(k))``, one per level, strictly increasing (``nested``: each divides
        the next); tokens in the online mode.
      variant: one of ``CMS_VARIANTS``.
      online_lr: online inner rate ``η > 0``, one float or one per level.
      online_inner: online inner optimizer, one of ``CMS_INNERS`` (SPEC §3.1).
      remat_every: online: checkpoint the chunk scan every n chunks (None: no checkpoints; values
        unchanged).
    """

    periods: tuple[int, ...] = (1, 4, 16)
    variant: str = "sequential"
    online_lr: float | tuple[float, ...] = 1e-2
    online_inner: str = "sgd"
    remat_every: int | None = None

    def __post_init__(self) -> None:
        _check_choices(self, {"variant": CMS_VARIANTS, "online_inner": CMS_INNERS})
        try:
            periods = check_periods(self.periods, variant=self.variant)
        except ValueError as err:  # check_periods' message, under the field's name
            _fail(self, "periods", str(err).removeprefix("periods "))
        object.__setattr__(self, "periods", periods)
        lr = self.online_lr
        per_level = isinstance(lr, tuple | list)
        if per_level:
            if len(lr) != len(periods):
                _fail(
                    self,
                    "online_lr",
                    f"one rate per level ({len(periods)}) or one float, got {lr!r}",
                )
            object.__setattr__(self, "online_lr", tuple(lr))
        for v in self.online_lr if per_level else (lr,):
            if not _is_float(v) or not v > 0:
                _fail(self, "online_lr", f"must be a float > 0 (or one per level), got {v!r}")
        r = self.remat_every
        if r is not None and not _is_int(r, 1):
            _fail(self, "remat_every", f"must be None or a positive int, got {r!r}")
