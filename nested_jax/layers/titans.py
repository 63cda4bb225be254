"""Titans sequence layers (SPEC §2): the neural memory branch, LMM, MAG and MAL mixers.

The memory math is reached through :mod:`nested_jax.ops.titans` only (``titans_memory``,
``titans_memory_step``, ...; the rule is ``core.titans.mlp``, ``L_M = 1`` the matrix memory); this
module holds the parameters, gates and projections and wires them into NNX layers:

- :class:`NeuralMemory`: learned initial memory ``M_0`` (per head, broadcast over the batch), the
  data-dependent gates ``θ_t, η_t, α_t = σ(x W + b)`` per head, the chunked / recurrent sequence
  form and an exact decode step (below).
- :class:`MemoryBranch`: ``k, q = L2(silu(conv(x W)))``, ``v = silu(conv(x W_v))`` → memory →
  per-head output ``[B, T, H, D]``.
- :class:`TitansLMM` (``titans_lmm``): memory branch, SiLU-gated RMSNorm, output projection.
- :class:`~nested_jax.layers.persistent_attention.PersistentSWA` (its own module): causal
  (sliding-window) softmax attention with RoPE and ``N_p`` learned persistent key/value tokens.
- :class:`TitansMAG` (``titans_mag``): ``o = RMSNorm(SWA(x)) ⊙ σ(RMSNorm(LMM(x)))`` per head.
- :class:`TitansMAL` (``titans_mal``): ``o = SWA(LMM(x))``.
- MAC lives in :mod:`nested_jax.layers.titans_mac`.

Decoding equals the full forward. The chunked rule takes all gradients of a chunk at the chunk
start, so a token's output depends on the state at the start of its chunk (aligned at position 0)
and on the earlier tokens of the chunk. :class:`MemoryCache` therefore holds the state at the
current chunk start plus a buffer of the chunk's tokens; each decode step re-runs the (causal)
chunk over the buffer, reads its own row, and commits the state when the chunk is full
(``ops.titans.titans_memory_step``). With ``memory_impl="recurrent"`` (or ``memory_chunk=1``) the
step is the per-token rule.

**Decisions / limitations.** ``per_chunk_gates`` mean-pools the gates over the *whole* chunk (the
paper's option), which looks at later tokens of the chunk: such models train but cannot decode
(``init_cache`` raises). Packed sequences (``segment_ids``): conv taps and attention reset exactly;
the memory uses the core's exact reset (``segment_ids`` of ``titans_mlp_chunked``): at every
document start the memory and its momentum return to the learned ``(M_0, 0)``, so nothing of the
previous document leaks into the next, and each document keeps its own chunk grid (chunks from
its first token), so every document of a packed row gets exactly the outputs of a separate run,
wherever it starts. Truncated backprop (``grad_horizon``) windows stay on the row's grid (this
changes gradients only, never values).

**Proteus** (``model.proteus``, SPEC §4): with ``blocks = E > 1`` the memory coordinates (key
rows for ``L_M = 1``, hidden units for ``L_M ≥ 2``) open block by block over the training context
``N = context_len``; a token's position ``t`` is its 1-based position in the row (decoding: tokens
already consumed + 1). The sequence form (``ops.titans.titans_memory``) runs one memory call
per span of constant mask (``proteus_spans``; spans of one length as one ``lax.scan``) from the
gated state and puts the locked coordinates back (``proteus_gated_update``), as
``core.titans.proteus.proteus_titans_mlp_*`` do; decoding uses the per-token
``proteus_titans_mlp_step`` (recurrent) or gates each chunk's buffer (chunked; needs
``memory_chunk`` to divide ``Δ = N // E``, since the forward's chunk grid restarts at every span).
**Decision (packed rows):** the schedule follows the row position (the row is the training
context) and the whole state, locked coordinates included, resets to ``(M_0, 0)`` at a document
start. ``E = 1`` is the plain path, bit for bit. MAC has no Proteus option (``ModelConfig``
refuses it).

**Inner learning rate cap.** ``θ_t = theta_max · σ(x W_θ + b_θ)`` (``TitansOptions.theta_max``,
default 0.1; the bias starts θ at ``theta_init``). Without the cap θ may drift towards 1 during
training; with the softclamp ``grad_clip = c`` every write is then bounded by ``c·theta_max``.

**Stability (measured, tiny LMM, L_M = 4, T = 4096).** With ``θ ≈ 0.1, η = 0.9`` (effective inner
step ``θ/(1−η) ≈ 1`` on 16 stale gradients per chunk) the forward stays finite but the backward
through the inner loop overflows (gradients ~1e35 at T = 4096 for L_M = 2, NaN in the model). The
defaults therefore start at ``θ = 0.02`` and truncate the backward through the memory state every
``grad_horizon = 64`` tokens (values unchanged). Measured over the first steps of the slow test:
horizon 256 → grad-norm spikes up to ~1e10 from step 33 on and the loss climbs back (5.99 → 0.09 →
3.80 in 60 steps); horizon 64 → max grad norm ~1e3, loss 5.99 → 0.97 in 45 steps, no NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.attention import AttentionCache
from nested_jax.layers.common import MEMORY_HEADS, check_rank, dense, partitioned
from nested_jax.layers.conv import ShortConv
from nested_jax.layers.deltanet import l2_normalize
from nested_jax.layers.norm import GatedRMSNorm, RMSNorm
from nested_jax.layers.persistent_attention import persistent_swa
from nested_jax.ops.titans import (
    MemoryCache,
    TitansMemorySpec,
    TitansMLPState,
    titans_memory,
    titans_memory_init_cache,
    titans_memory_start,
    titans_memory_step,
    titans_mlp_apply,
    titans_mlp_init_weights,
    titans_mlp_state,
)
from nested_jax.rules import ProteusRule

__all__ = [
    "NeuralMemory",
    "MemoryBranch",
    "BranchCache",
    "TitansLMM",
    "TitansMAG",
    "TitansMAL",
    "MAGCache",
    "MALCache",
    "scan_tokens",
    "titans_seq_len_multiples",
]


def titans_seq_len_multiples(cfg) -> dict:
    """``data.seq_len`` must hold whole memory chunks (``model.titans.memory_chunk``) when the
    memory is chunked or pallas (``models.registry.mixer_seq_len_multiples``);
    ``model.chunk_size`` is not read by the Titans mixers."""
    t = cfg.titans
    chunked = t.memory_impl in ("chunked", "pallas")  # pallas runs the same chunk rule
    return {"model.titans.memory_chunk": t.memory_chunk} if chunked else {}


def _logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


def scan_tokens(step, cache, x: jax.Array, positions: jax.Array):
    """Runs ``step(cache, x_t [B, 1, d], pos_t [B, 1]) -> (y_t [B, 1, d'], cache)`` over T tokens.

    The cache path of every Titans mixer is this per-token loop, so a prefill of any length and
    token-by-token decoding follow the same exact rule.
    """
    if x.shape[1] == 1:
        return step(cache, x, positions)

    def body(c, xs):
        xt, pt = xs
        y, c = step(c, xt[:, None], pt[:, None])
        return c, y[:, 0]

    cache, y = jax.lax.scan(body, cache, (jnp.moveaxis(x, 1, 0), jnp.moveaxis(positions, 1, 0)))
    return jnp.moveaxis(y, 0, 1), cache


# --------------------------------------------------------------------------------------------------
# The memory (outer parameters, gates, sequence and decode forms)
# --------------------------------------------------------------------------------------------------


class NeuralMemory(nnx.Module):
    """Titans memory ``M_θ`` of ``n_heads`` heads with key / value width ``head_dim`` (SPEC §2).

    Outer parameters: the initial memory ``w{l} [H, d_l, d_{l+1}]`` (``d = (D, h, ..., h, D)``,
    ``L_M`` layers; L_M = 1 is the matrix memory) and the gate map ``[θ, η, α] = σ(x W_g + b)``
    (``W_g [d_in, 3H]``, biases at ``logit(theta_init / eta_init / alpha_init)``). The memory
    rule runs through :mod:`nested_jax.ops.titans` with ``impl = opts.memory_impl`` and the static
    ``TitansMemorySpec`` built here once (``spec``): the memory's ``dims``, the options themselves
    as its rule (a ``TitansOptions`` is a ``TitansRule``, which reaches the core form whole) and
    the Proteus schedule.

    ``proteus`` (``ProteusOptions`` or None): with ``blocks = E > 1`` the memory is gated by the
    Proteus schedule (SPEC §4, see the module docstring); ``E = 1`` / None is the plain memory.
    """

    def __init__(self, d_in: int, n_heads: int, head_dim: int, opts, *, dtype, rngs: nnx.Rngs,
                 proteus=None):  # fmt: skip
        self.n_heads, self.head_dim, self.dtype = n_heads, head_dim, dtype
        self.n_layers = opts.memory_layers
        self.impl = opts.memory_impl
        self.theta_max = float(opts.theta_max)
        hidden = opts.resolved_memory_hidden(head_dim)
        self.dims = (head_dim,) + (hidden,) * (self.n_layers - 1) + (head_dim,)
        rule = ProteusRule() if proteus is None else proteus.rule()
        if rule.enabled:
            blocked = head_dim if self.n_layers == 1 else hidden
            what = "head_dim (key rows)" if self.n_layers == 1 else "memory_hidden (hidden units)"
            if blocked < rule.blocks:
                raise ValueError(
                    f"ProteusOptions.blocks: {rule.blocks} blocks need {what} >= blocks, "
                    f"got {blocked}"
                )
        self.spec = TitansMemorySpec(dims=self.dims, rule=opts, proteus=rule)
        init = titans_mlp_init_weights(rngs.params(), n_heads, self.dims)
        for i, w in enumerate(init):
            setattr(self, f"w{i}", nnx.Param(partitioned(lambda *_, w=w: w, MEMORY_HEADS)(None)))
        self.gate_proj = dense(d_in, 3 * n_heads, ("embed", None), dtype=dtype, rngs=rngs)
        # θ = θ_max·σ(z + b_θ): the bias starts θ at theta_init whatever the cap.
        th0 = opts.theta_init / opts.theta_max
        bias = jnp.array([_logit(th0), _logit(opts.eta_init), _logit(opts.alpha_init)])
        self.gate_bias = nnx.Param(
            partitioned(lambda *_: jnp.repeat(bias[:, None], n_heads, 1), (None, "heads"))(None)
        )

    def initial_weights(self) -> tuple:
        """The learned ``M_0``: tuple of ``[H, d_l, d_{l+1}]`` f32."""
        return tuple(getattr(self, f"w{i}")[...] for i in range(self.n_layers))

    def initial_state(self, batch_size: int) -> TitansMLPState:
        """``(M_0 broadcast to [B, H, ...], S = 0)``."""
        return titans_mlp_state(self.initial_weights(), batch_size)

    def gates(self, x: jax.Array):
        """``θ, η, α [B, T, H]`` f32 from ``x [B, T, d_in]``: ``θ = θ_max·σ(·)``; η, α = σ(·)."""
        b, t, _ = x.shape
        z = self.gate_proj(x).astype(jnp.float32).reshape(b, t, 3, self.n_heads)
        g = jax.nn.sigmoid(z + self.gate_bias[...])
        return self.theta_max * g[:, :, 0], g[:, :, 1], g[:, :, 2]

    def __call__(self, q, k, v, theta, eta, alpha, *, state: TitansMLPState | None = None,
                 segment_ids=None, reset_state: TitansMLPState | None = None):  # fmt: skip
        """Sequence form: ``(y [B, T, H, D] f32, final state)`` from ``q, k, v [B, T, H, D]`` and
        gates ``[B, T, H]`` (state None → :meth:`initial_state`); ``ops.titans.titans_memory``.

        ``segment_ids [B, T]`` (packed rows): the core's exact reset — the memory and momentum
        return to ``reset_state`` (default: the learned ``(M_0, 0)``) at every document start and
        each document keeps its own chunk grid (see the module docstring). With Proteus (SPEC §4)
        one memory call runs per span of constant mask at row positions ``t = 1 … T``.

        **Truncated backprop** (``grad_horizon = n > 0``, default 64): the carried memory state is
        a ``stop_gradient`` every ``n`` tokens (whole chunks, aligned at 0). Values are
        unchanged; gradients stop flowing through the inner loop after ``n`` tokens. Measured:
        with the full horizon the backward of a 2–4 layer memory overflows to inf/NaN at
        T = 2048–4096 (the inner update's Jacobian product grows exponentially with T).
        """
        b = q.shape[0]
        state = self.initial_state(b) if state is None else state
        if segment_ids is not None and reset_state is None:
            reset_state = self.initial_state(b)
        return titans_memory(
            q, k, v, theta, eta, alpha, spec=self.spec, initial_state=state,
            segment_ids=segment_ids, reset_state=reset_state, impl=self.impl,
        )  # fmt: skip

    def read(self, weights: tuple, z: jax.Array) -> jax.Array:
        """``M*(z)``: read without update (the rule's activation), ``z [B, T, H, D]`` →
        ``[B, T, H, D]`` f32."""
        return titans_mlp_apply(weights, z.astype(jnp.float32), rule=self.spec.rule)

    def init_cache(self, batch_size: int) -> MemoryCache:
        """Decode state at position 0: ``n = −1`` marks "not started" and the weights are zero
        placeholders, because the LM shell builds caches from static attributes only (on the
        layer-stacked module); the first :meth:`step` substitutes the learned ``M_0``. Refuses
        ``per_chunk_gates`` and Proteus with a chunk that does not divide ``Δ``."""
        return titans_memory_init_cache(self.spec, batch_size, self.n_heads, impl=self.impl)

    def start(self, cache: MemoryCache) -> MemoryCache:
        """``cache`` with ``(M_0, 0)`` substituted if it has not started (``n < 0``), ``n ≥ 0``."""
        return titans_memory_start(cache, self.initial_weights())

    def step(self, cache: MemoryCache, q, k, v, theta, eta, alpha, *, commit=None):
        """One token: ``q, k, v [B, H, D]``, gates ``[B, H]`` → ``(y [B, H, D] f32, cache)``.

        Equals row ``t`` of :meth:`__call__` (chunks aligned at position 0). ``commit`` (bool
        scalar, optional) forces the chunk to close after this token (MAC segment ends; the
        caller guarantees the chunk is then full).
        """
        return titans_memory_step(
            cache, q, k, v, theta, eta, alpha, spec=self.spec,
            initial_weights=self.initial_weights(), commit=commit, impl=self.impl,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Memory branch: projections + memory
# --------------------------------------------------------------------------------------------------


class BranchCache(NamedTuple):
    """Decode state of a :class:`MemoryBranch`: memory + conv states ``[B, W−1, H·D]``."""

    memory: MemoryCache
    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array


class MemoryBranch(nnx.Module):
    """``q, k = L2(silu(conv(x W_{q,k})))``, ``v = silu(conv(x W_v))``, gates from x, memory read.

    Returns per-head outputs ``[B, T, H, D]`` (f32). SPEC §2 (LMM projections).
    """

    def __init__(self, d_model, n_heads, head_dim, opts, *, conv_size, dtype, rngs: nnx.Rngs,
                 proteus=None):  # fmt: skip
        self.n_heads, self.head_dim, self.dtype = n_heads, head_dim, dtype
        hd = n_heads * head_dim
        self.q_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.v_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.q_conv = ShortConv(hd, conv_size, dtype=dtype, rngs=rngs)
        self.k_conv = ShortConv(hd, conv_size, dtype=dtype, rngs=rngs)
        self.v_conv = ShortConv(hd, conv_size, dtype=dtype, rngs=rngs)
        self.memory = NeuralMemory(
            d_model, n_heads, head_dim, opts, dtype=dtype, rngs=rngs, proteus=proteus
        )

    def init_cache(self, batch_size: int) -> BranchCache:
        """Zero conv taps and the memory at position 0."""
        return BranchCache(
            self.memory.init_cache(batch_size),
            self.q_conv.init_state(batch_size),
            self.k_conv.init_state(batch_size),
            self.v_conv.init_state(batch_size),
        )

    def _project(self, x, segment_ids=None, cache: BranchCache | None = None):
        b, t, _ = x.shape
        h, d = self.n_heads, self.head_dim
        sq, sk, sv = (None,) * 3 if cache is None else cache[1:]
        q, cq = self.q_conv(self.q_proj(x), state=sq, segment_ids=segment_ids)
        k, ck = self.k_conv(self.k_proj(x), state=sk, segment_ids=segment_ids)
        v, cv = self.v_conv(self.v_proj(x), state=sv, segment_ids=segment_ids)
        q = l2_normalize(jax.nn.silu(q).reshape(b, t, h, d))
        k = l2_normalize(jax.nn.silu(k).reshape(b, t, h, d))
        v = jax.nn.silu(v).reshape(b, t, h, d).astype(jnp.float32)
        return q, k, v, (cq, ck, cv)

    def __call__(self, x, *, segment_ids=None):
        """Full sequence from the learned ``M_0``: ``x [B, T, d]`` → ``[B, T, H, D]`` f32."""
        b, t, _ = x.shape
        if segment_ids is not None and segment_ids.shape != (b, t):
            raise ValueError(
                f"segment_ids: expected int [B, T] = {(b, t)}, got {segment_ids.shape}"
            )
        q, k, v, _ = self._project(x, segment_ids)
        y, _ = self.memory(q, k, v, *self.memory.gates(x), segment_ids=segment_ids)
        return y

    def step(self, cache: BranchCache, x_t):
        """One token ``x_t [B, 1, d]`` → ``(y [B, 1, H, D] f32, cache)``."""
        q, k, v, convs = self._project(x_t, None, cache)
        th, et, al = self.memory.gates(x_t)
        y, mem = self.memory.step(cache.memory, q[:, 0], k[:, 0], v[:, 0], th[:, 0], et[:, 0],
                                  al[:, 0])  # fmt: skip
        return y[:, None], BranchCache(mem, *convs)


def _titans_args(cfg):
    return dict(
        conv_size=cfg.conv_size, dtype=cfg.activation_dtype(), proteus=getattr(cfg, "proteus", None)
    )


class TitansLMM(nnx.Module):
    """LMM mixer (SPEC §2 "LMM"): memory branch, ``RMSNorm(y) ⊙ silu(x W_g)`` per head, ``W_o``."""

    seq_len_multiples = staticmethod(titans_seq_len_multiples)

    def __init__(self, d_model, n_heads, head_dim, opts, *, conv_size=4, norm_eps=1e-6,
                 dtype=jnp.float32, rngs: nnx.Rngs, proteus=None):  # fmt: skip
        self.d_model, self.n_heads, self.head_dim, self.dtype = d_model, n_heads, head_dim, dtype
        hd = n_heads * head_dim
        self.branch = MemoryBranch(
            d_model, n_heads, head_dim, opts, conv_size=conv_size, dtype=dtype, rngs=rngs,
            proteus=proteus,
        )  # fmt: skip
        self.g_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, rngs=rngs)
        self.o_proj = dense(hd, d_model, ("heads", "embed"), dtype=dtype, rngs=rngs)

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs):
        """Build from a ModelConfig (registry ``titans_lmm``; options ``cfg.titans``, Proteus
        ``cfg.proteus``)."""
        return cls(cfg.d_model, cfg.n_heads, cfg.resolved_head_dim(), cfg.titans,
                   norm_eps=cfg.norm_eps, rngs=rngs, **_titans_args(cfg))  # fmt: skip

    def init_cache(self, batch_size: int, max_len: int) -> BranchCache:
        """Decode state (size independent of ``max_len``)."""
        del max_len
        return self.branch.init_cache(batch_size)

    def _out(self, x, y):
        b, t, _ = x.shape
        gate = self.g_proj(x).reshape(b, t, self.n_heads, self.head_dim)
        o = self.o_norm(y.astype(self.dtype), gate)
        return self.o_proj(o.reshape(b, t, self.n_heads * self.head_dim))

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None):
        """Mixer protocol (``nested_jax.models.registry``): ``x [B, T, d]`` → ``(y, cache)``."""
        check_rank("x", x, 3, "[B, T, d_model]")
        x = x.astype(self.dtype)
        if cache is None:
            return self._out(x, self.branch(x, segment_ids=segment_ids)), None
        if segment_ids is not None:
            raise ValueError("segment_ids: packed segments cannot be combined with a cache")

        def step(c, xt, pt):
            y, c = self.branch.step(c, xt)
            return self._out(xt, y), c

        return scan_tokens(step, cache, x, _positions(positions, x))


def _positions(positions, x):
    b, t, _ = x.shape
    if positions is None:
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return positions


# --------------------------------------------------------------------------------------------------
# MAG and MAL
# --------------------------------------------------------------------------------------------------


class MAGCache(NamedTuple):
    """Decode state of MAG: memory branch + attention KV cache."""

    branch: BranchCache
    attn: AttentionCache


class TitansMAG(nnx.Module):
    """MAG mixer (SPEC §2 "MAG"): per head ``o = RMSNorm(SWA(x)) ⊙ σ(RMSNorm(LMM(x)))``, ``W_o``.

    The attention (sliding window, persistent tokens) and the memory branch read the same input in
    parallel; the memory output, normalised with its own gain, gates the normalised attention.
    """

    seq_len_multiples = staticmethod(titans_seq_len_multiples)

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        h, d = cfg.n_heads, cfg.resolved_head_dim()
        self.n_heads, self.head_dim, self.dtype = h, d, cfg.activation_dtype()
        self.branch = MemoryBranch(cfg.d_model, h, d, cfg.titans, rngs=rngs, **_titans_args(cfg))
        self.attn = persistent_swa(cfg, cfg.d_model, rngs)
        self.attn_norm = RMSNorm(d, eps=cfg.norm_eps, names=(None,), rngs=rngs)
        self.mem_norm = RMSNorm(d, eps=cfg.norm_eps, names=(None,), rngs=rngs)
        self.o_proj = dense(h * d, cfg.d_model, ("heads", "embed"), dtype=self.dtype, rngs=rngs)

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs):
        """Registry ``titans_mag``."""
        return cls(cfg, rngs=rngs)

    def init_cache(self, batch_size: int, max_len: int) -> MAGCache:
        """Memory decode state + a ``max_len``-slot KV cache."""
        return MAGCache(
            self.branch.init_cache(batch_size), self.attn.init_cache(batch_size, max_len)
        )

    def _combine(self, a, m):
        b, t = a.shape[:2]
        gate = jax.nn.sigmoid(self.mem_norm(m.astype(jnp.float32)))
        o = (self.attn_norm(a.astype(jnp.float32)) * gate).astype(self.dtype)
        return self.o_proj(o.reshape(b, t, self.n_heads * self.head_dim))

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None):
        """Mixer protocol: ``x [B, T, d]`` → ``(y [B, T, d], cache)``."""
        check_rank("x", x, 3, "[B, T, d_model]")
        x = x.astype(self.dtype)
        positions = _positions(positions, x)
        if cache is None:
            a, _ = self.attn(x, positions=positions, segment_ids=segment_ids)
            return self._combine(a, self.branch(x, segment_ids=segment_ids)), None
        if segment_ids is not None:
            raise ValueError("segment_ids: packed segments cannot be combined with a cache")

        def step(c, xt, pt):
            m, cb = self.branch.step(c.branch, xt)
            a, ca = self.attn(xt, positions=pt, cache=c.attn)
            return self._combine(a, m), MAGCache(cb, ca)

        return scan_tokens(step, cache, x, positions)


class MALCache(NamedTuple):
    """Decode state of MAL: LMM layer + attention KV cache."""

    lmm: BranchCache
    attn: AttentionCache


class TitansMAL(nnx.Module):
    """MAL mixer (SPEC §2 "MAL"): ``y = LMM(x)`` (full LMM layer), ``o = SWA(y) W_o`` with
    persistent tokens, inside one mixer."""

    seq_len_multiples = staticmethod(titans_seq_len_multiples)

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        h, d = cfg.n_heads, cfg.resolved_head_dim()
        self.n_heads, self.head_dim, self.dtype = h, d, cfg.activation_dtype()
        self.lmm = TitansLMM.from_config(cfg, rngs=rngs)
        self.attn = persistent_swa(cfg, cfg.d_model, rngs)
        self.o_proj = dense(h * d, cfg.d_model, ("heads", "embed"), dtype=self.dtype, rngs=rngs)

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs):
        """Registry ``titans_mal``."""
        return cls(cfg, rngs=rngs)

    def init_cache(self, batch_size: int, max_len: int) -> MALCache:
        """LMM decode state + a ``max_len``-slot KV cache."""
        return MALCache(
            self.lmm.init_cache(batch_size, max_len), self.attn.init_cache(batch_size, max_len)
        )

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None):
        """Mixer protocol: ``x [B, T, d]`` → ``(y [B, T, d], cache)``."""
        check_rank("x", x, 3, "[B, T, d_model]")
        x = x.astype(self.dtype)
        b, t, _ = x.shape
        positions = _positions(positions, x)
        hd = self.n_heads * self.head_dim
        if cache is None:
            y, _ = self.lmm(x, segment_ids=segment_ids)
            a, _ = self.attn(y, positions=positions, segment_ids=segment_ids)
            return self.o_proj(a.reshape(b, t, hd)), None
        if segment_ids is not None:
            raise ValueError("segment_ids: packed segments cannot be combined with a cache")
        y, cl = self.lmm(x, positions=positions, cache=cache.lmm)
        a, ca = self.attn(y, positions=positions, cache=cache.attn)
        return self.o_proj(a.reshape(b, t, hd)), MALCache(cl, ca)
