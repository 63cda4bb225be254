"""Hope sequence mixer ``hope`` (SPEC §3.2: self-modifying Titans with DGD-updated memories).

Per head (``H`` heads of width ``D``)::

    x_t = [L2](silu(conv4(x W_x)))        memory inputs (``norm_inputs``, default on)
    q_t = silu(conv4(x W_q))              (adaptive_q: q_t = M_{q,t−1}(x_t); the core L2-normalises
                                           q and k = M_{k,t−1}(x_t) itself)
    o_t = M_{memory,t−1}(q_t), memories written by DGD      (``ops.hope.hope_memories``)
    y_t = W_o [RMSNorm(o_t) ⊙ silu(x W_g)]_heads            (per-head gated RMSNorm, as GDN)

Outer (meta-learned) parameters: the initial memories ``M_□ = (W_1 [H, D, h], W_2 [H, h, D])`` for
``□ ∈ {k, v, η, α, memory}`` (+ ``q`` with ``adaptive_q``), broadcast over the batch, and the
scalar readouts of ``M_η``, ``M_α`` (:class:`nested_jax.ops.hope.HopeReadout`, biases at
``logit(eta_init / eta_max)``, ``logit(alpha_init)``). The CMS that follows the mixer in the Hope
model is the LM shell's FFN (SPEC §3.3), not part of this layer.

**Chunks.** ``chunk_other`` / ``chunk_memory`` (SPEC §3.2 Decision): chunk ``n`` produces its
projections, targets and DGD signals from the memories at the end of chunk ``n−1``; chunks are
aligned at the first token of the sequence.

**Packed rows** (``segment_ids``): the conv taps and the memories reset at a document start; the
memories restart at the learned initial memories (exact; see ``core.hope.chunk.hope_chunked``).

**The math is reached through** :mod:`nested_jax.ops.hope` only (``hope_memories``,
``hope_decode``, ``impl = ModelConfig.impl``): this layer holds the parameters, projections, convs
and the output; its ``HopeOptions`` *is* the typed ``HopeRule`` it passes (``rule=self.opts``).

**Decoding** equals the full forward: :class:`HopeCache` holds the running state (memories and
momenta), the chunk-start snapshots, the conv taps and the number ``n`` of tokens seen; every
cached call runs ``core.hope.token.hope_decode_step`` token by token (``ops.hope.hope_decode``; a
prefill is the same exact per-token loop). ``init_cache`` builds zero placeholders from static
attributes (the LM shell calls it on the layer-stacked module); the first step (``n = 0``)
substitutes the learned initial memories.

**Proteus** (``model.proteus``, SPEC §4): with ``blocks = E > 1`` the hidden units of every
memory (and of its momentum) open block by block over the training context ``N = context_len``
(``core.hope.proteus``): a token at 1-based position ``t`` reads and writes ``g_t ⊙ M`` and the
locked coordinates keep their bits; beyond ``N`` every block is open. The sequence form is
``proteus_hope_chunked`` (both chunk grids restart at every Δ-boundary); packed rows follow the
Titans layer's decision (``proteus_hope_packed``): the schedule follows the row position and a
document start resets the whole state, locked coordinates included. Decoding gates every
token with the mask of its position and needs both chunk sizes to divide ``Δ = N // E`` (else
the forward's restarted chunk grid is not the decode grid; ``init_cache`` raises).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.common import MEMORY_HEADS, check_rank, dense, partitioned
from nested_jax.layers.conv import ShortConv
from nested_jax.layers.deltanet import l2_normalize
from nested_jax.layers.norm import GatedRMSNorm
from nested_jax.layers.options import HopeOptions
from nested_jax.ops.hope import (
    HopeDecodeState,
    HopeMemories,
    HopeReadout,
    HopeState,
    MLPMemory,
    check_hope_decode,
    hope_decode,
    hope_init_state,
    hope_memories,
)
from nested_jax.ops.linear import ProteusRule

__all__ = ["HopeCache", "HopeMixer"]


class HopeCache(NamedTuple):
    """Decode state of one :class:`HopeMixer` layer.

    Attributes:
      state: running ``HopeState`` (memories ``[B, H, D, h] / [B, H, h, D]`` f32, momenta or None).
      snapshot: ``HopeMemories`` of the same shapes: the chunk-start snapshots of both groups.
      conv_x, conv_q: ``[B, W−1, H·D]`` conv taps (``conv_q`` has 0 channels with ``adaptive_q``).
      n: int32 scalar, tokens processed so far (the next token's position; chunks align at 0).
    """

    state: HopeState
    snapshot: HopeMemories
    conv_x: jax.Array
    conv_q: jax.Array
    n: jax.Array


def _logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


def _const(value):
    return lambda *_: value


class HopeMixer(nnx.Module):
    """Hope mixer (SPEC §3.2), registry name ``hope``; options ``ModelConfig.hope``.

    ``proteus`` (``ProteusOptions`` or None): with ``blocks = E > 1`` the memories are gated by
    the Proteus schedule (SPEC §4, module docstring); ``E = 1`` / None is the plain mixer.
    ``impl`` (``ModelConfig.impl``): ``"chunked"`` | ``"recurrent"`` (the per-token twin, slow),
    see :mod:`nested_jax.ops.hope`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        opts=None,
        *,
        conv_size: int = 4,
        norm_eps: float = 1e-6,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
        proteus=None,
        impl: str = "chunked",
    ):
        opts = HopeOptions() if opts is None else opts
        if not isinstance(opts, HopeOptions):
            raise ValueError(f"opts: expected a HopeOptions, got {type(opts).__name__}")
        self.d_model, self.n_heads, self.head_dim, self.dtype = d_model, n_heads, head_dim, dtype
        self.opts = opts
        self.impl = impl  # ops.hope's implementation, checked by the op ("pallas": ValueError)
        self.conv_size = conv_size
        self.hidden = h = opts.resolved_memory_hidden(head_dim)
        self.proteus_rule = ProteusRule() if proteus is None else proteus.rule()
        if h < self.proteus_rule.blocks:
            raise ValueError(
                f"ProteusOptions.blocks: {self.proteus_rule.blocks} blocks need the memory hidden "
                "width "
                f"(model.hope.memory_hidden or head_dim) >= blocks, got {h}"
            )
        self.names = HopeMemories._fields[:5] + (("q",) if opts.adaptive_q else ())
        hd = n_heads * head_dim
        self.x_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.x_conv = ShortConv(hd, conv_size, dtype=dtype, rngs=rngs)
        if not opts.adaptive_q:
            self.q_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
            self.q_conv = ShortConv(hd, conv_size, dtype=dtype, rngs=rngs)
        self.g_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, rngs=rngs)
        self.o_proj = dense(hd, d_model, ("heads", "embed"), dtype=dtype, rngs=rngs)
        # Initial memories: W_2 fan-in scaled, W_1 small so every memory starts near M(z) = z
        # (the residual path), which keeps the inner loop's first steps well conditioned.
        names3 = MEMORY_HEADS
        for n in self.names:
            w1 = (
                opts.memory_init
                * h**-0.5
                * jax.random.normal(rngs.params(), (n_heads, head_dim, h))
            )
            w2 = head_dim**-0.5 * jax.random.normal(rngs.params(), (n_heads, h, head_dim))
            setattr(self, f"{n}_w1", nnx.Param(partitioned(_const(w1), names3)(None)))
            setattr(self, f"{n}_w2", nnx.Param(partitioned(_const(w2), names3)(None)))
        ro = opts.readout_init * head_dim**-0.5
        # η = eta_max·σ(·): the bias starts η at eta_init
        for n, p in (("eta", opts.eta_init / opts.eta_max), ("alpha", opts.alpha_init)):
            w = ro * jax.random.normal(rngs.params(), (n_heads, head_dim))
            setattr(self, f"{n}_w", nnx.Param(partitioned(_const(w), ("heads", None))(None)))
            b = jnp.full((n_heads,), _logit(p), jnp.float32)
            setattr(self, f"{n}_b", nnx.Param(partitioned(_const(b), ("heads",))(None)))

    @staticmethod
    def seq_len_multiples(cfg) -> dict:
        """``data.seq_len`` must hold whole chunks of both Hope chunk sizes when chunked
        (``models.registry.mixer_seq_len_multiples``); ``model.chunk_size`` is not read."""
        if cfg.impl != "chunked":
            return {}
        h = cfg.hope
        return {"model.hope.chunk_memory": h.chunk_memory, "model.hope.chunk_other": h.chunk_other}

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs):
        """Build from a ``ModelConfig`` (registry ``hope``; options ``cfg.hope``, Proteus
        ``cfg.proteus``)."""
        return cls(
            cfg.d_model,
            cfg.n_heads,
            cfg.resolved_head_dim(),
            cfg.hope,
            conv_size=cfg.conv_size,
            norm_eps=cfg.norm_eps,
            dtype=cfg.activation_dtype(),
            rngs=rngs,
            proteus=cfg.proteus,
            impl=cfg.impl,
        )

    # ---------------------------------------------------------------- parameters as core pytrees

    def initial_memories(self) -> HopeMemories:
        """The learned initial memories, ``[H, D, h]`` / ``[H, h, D]`` f32."""
        return HopeMemories(
            **{
                n: MLPMemory(getattr(self, f"{n}_w1")[...], getattr(self, f"{n}_w2")[...])
                for n in self.names
            }
        )

    def readout(self) -> HopeReadout:
        """The outer η / α readouts."""
        return HopeReadout(self.eta_w[...], self.eta_b[...], self.alpha_w[...], self.alpha_b[...])

    # ---------------------------------------------------------------- decode state

    def init_cache(self, batch_size: int, max_len: int) -> HopeCache:
        """Zero decode state (size independent of ``max_len``); only static attributes are read."""
        del max_len
        check_hope_decode(self.opts, proteus=self.proteus_rule, owner="HopeOptions")
        b, h, d, k = batch_size, self.n_heads, self.head_dim, self.hidden
        zero = MLPMemory(jnp.zeros((b, h, d, k), jnp.float32), jnp.zeros((b, h, k, d), jnp.float32))
        mems = HopeMemories(**{n: zero for n in self.names})
        state = HopeState(mems, mems if self.opts.momentum else None)
        conv_x = self.x_conv.init_state(batch_size)
        conv_q = (
            jnp.zeros((b, self.conv_size - 1, 0), self.dtype)
            if self.opts.adaptive_q
            else self.q_conv.init_state(batch_size)
        )
        return HopeCache(state, mems, conv_x, conv_q, jnp.zeros((), jnp.int32))

    # ---------------------------------------------------------------- forward

    def _inputs(self, x, segment_ids, cache: HopeCache | None):
        """Per-head memory inputs and queries ``[B, T, H, D]`` f32 plus the new conv taps."""
        b, t, _ = x.shape
        h, d = self.n_heads, self.head_dim
        sx = None if cache is None else cache.conv_x
        xm, cx = self.x_conv(self.x_proj(x), state=sx, segment_ids=segment_ids)
        xm = jax.nn.silu(xm.astype(jnp.float32)).reshape(b, t, h, d)
        if self.opts.norm_inputs:
            xm = l2_normalize(xm)
        if self.opts.adaptive_q:
            return xm, None, cx, (None if cache is None else cache.conv_q)
        sq = None if cache is None else cache.conv_q
        q, cq = self.q_conv(self.q_proj(x), state=sq, segment_ids=segment_ids)
        q = jax.nn.silu(q.astype(jnp.float32)).reshape(b, t, h, d)
        return xm, q, cx, cq

    def _out(self, x, o):
        b, t, _ = x.shape
        gate = self.g_proj(x).reshape(b, t, self.n_heads, self.head_dim)
        y = self.o_norm(o.astype(self.dtype), gate)
        return self.o_proj(y.reshape(b, t, self.n_heads * self.head_dim))

    def __call__(self, x, *, positions=None, segment_ids=None, cache: HopeCache | None = None):
        """Mixer protocol (``nested_jax.models.registry``).

        Args:
          x: ``[B, T, d_model]``.
          positions: unused (chunks align at the sequence start / ``cache.n``).
          segment_ids: optional int ``[B, T]`` (packed rows; not with a cache).
          cache: optional :class:`HopeCache` (every cached call is the exact per-token loop).

        Returns:
          ``(y [B, T, d_model], new cache or None)``.
        """
        del positions
        check_rank("x", x, 3, "[B, T, d_model]")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected shape [B, T, {self.d_model}], got {tuple(x.shape)}")
        b, t, _ = x.shape
        if segment_ids is not None and jnp.shape(segment_ids) != (b, t):
            raise ValueError(
                f"segment_ids: expected int [B, T] = {(b, t)}, got {jnp.shape(segment_ids)}"
            )
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids: packed segments cannot be combined with a cache")
        x = x.astype(self.dtype)
        xm, q, cx, cq = self._inputs(x, segment_ids, cache)
        readout, init = self.readout(), self.initial_memories()
        if cache is None:
            state = hope_init_state(init, b, momentum=self.opts.momentum)
            out, _ = hope_memories(
                xm, q, readout, rule=self.opts, initial_state=state, proteus=self.proteus_rule,
                segment_ids=segment_ids, impl=self.impl,
            )  # fmt: skip
            return self._out(x, out), None
        out, (state, snap, n) = hope_decode(
            xm, q, readout, rule=self.opts,
            initial_state=HopeDecodeState(cache.state, cache.snapshot, cache.n),
            proteus=self.proteus_rule, initial_memories=init, impl=self.impl,
        )  # fmt: skip
        return self._out(x, out), HopeCache(state, snap, cx, cq, n)
