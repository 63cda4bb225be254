"""DeltaNet mixer (SPEC §1): short conv + SiLU on q, k, v, L2-normalised q, k, β = σ(W_β x), delta
rule,
SiLU-gated RMSNorm output. :class:`nested_jax.layers.gdn.GatedDeltaNet` adds the decay ``g``.

**Proteus** (SPEC §4; ``model.proteus.blocks = E > 1``, ``model.proteus.context_len = N``): the key
rows of the memory ``S [B, H, K, V]`` are split into ``E`` contiguous blocks and at the 1-based
position ``t`` only the first ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` are open (``Δ = ⌊N/E⌋``; fully open
beyond ``N``). The layer implements it by masking the L2-normalised query and key with the key-row
mask ``g_t`` and running the plain backbone kernel (chunked, recurrent or the decode step):

- **Why this equals** ``core.associative.proteus.proteus_gated_delta_*``: the memory starts at zero
  (``init_cache``, and every segment reset) and ``k(t)`` never decreases, so a row locked at ``t``
  was locked at every earlier position and is still exactly zero. Then ``g_t ⊙ S_{t-1} = S_{t-1}``,
  ``(g_t ⊙ S)ᵀ k = Sᵀ(g_t ⊙ k)``, a masked key writes no locked row (the decay scales zeros) and
  ``(g_t ⊙ S_t)ᵀ q = S_tᵀ(g_t ⊙ q)``: the backbone on ``(g ⊙ q, g ⊙ k)`` is the Proteus recurrence
  (tested against the core functions to rounding). It needs no static spans, so it runs at the
  backbone's speed and takes a per-token (traced) position.
- **Positions** ``t = positions + 1`` with the mixer protocol's ``positions`` (the LM passes the
  cache position for decoding, ``t0 = cache.pos``, and the position inside the document for packed
  rows). Called without ``positions`` the layer uses the position in the row (inside the document
  with ``segment_ids``); with a cache ``positions`` is then required.
- **Decision — packed rows** (``segment_ids``): each document runs its own schedule from ``t = 1``
  (positions restart at a document start, where the backbone also resets the memory), i.e. a packed
  row gives every document exactly the output it would get alone. Training on packed data thus sees
  the same schedule as unpacked training on documents of the same lengths.
- ``E = 1`` (default) does not touch q or k: the plain backbone, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax import ops
from nested_jax.layers.common import check_rank, dense
from nested_jax.layers.conv import ShortConv
from nested_jax.layers.norm import GatedRMSNorm
from nested_jax.layers.rope import segment_positions


class DeltaCache(NamedTuple):
    """Per-layer decode state: matrix memory ``state [B, H, K, V]`` (float32) and the three conv
    states
    ``conv_q, conv_k [B, W−1, H·K]``, ``conv_v [B, W−1, H·V]`` (activation dtype)."""

    state: jax.Array
    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(‖x‖² + eps)`` over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class DeltaNet(nnx.Module):
    """DeltaNet layer (SPEC §1): ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ
    (q_t/√K)``.

    ``q, k = L2(silu(conv(x W_q|k)))``, ``v = silu(conv(x W_v))``, ``β = σ(x W_β)``,
    ``y = (RMSNorm(o) ⊙ silu(x W_g)) W_o``. With ``K = V = head_dim``.

    ``proteus_blocks = E > 1`` with ``proteus_context_len = N`` gates the key rows of the memory
    with the Proteus schedule (SPEC §4; module docstring). ``E = 1`` is the plain layer.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        conv_size: int = 4,
        chunk_size: int = 64,
        impl: str = "chunked",
        norm_eps: float = 1e-6,
        dtype=jnp.float32,
        proteus_blocks: int = 1,
        proteus_context_len: int = 0,
        rngs: nnx.Rngs,
    ):
        try:  # the rule checks E and N; its messages are renamed to this layer's arguments
            self.proteus_rule = ops.linear.ProteusRule(proteus_blocks, proteus_context_len)
        except ValueError as err:
            raise ValueError("proteus_" + str(err).removeprefix("ProteusRule.")) from None
        if proteus_blocks > 1 and head_dim < proteus_blocks:
            raise ValueError(
                f"proteus_blocks: {proteus_blocks} blocks of key rows need head_dim >= "
                f"proteus_blocks, got head_dim={head_dim}"
            )
        self.proteus_blocks, self.proteus_context_len = proteus_blocks, proteus_context_len
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.conv_size, self.chunk_size, self.impl, self.dtype = conv_size, chunk_size, impl, dtype
        hd = n_heads * head_dim
        self.q_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.v_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.b_proj = dense(d_model, n_heads, ("embed", None), dtype=dtype, rngs=rngs)
        self.g_proj = dense(d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.o_proj = dense(hd, d_model, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.q_conv = ShortConv(hd, conv_size, dtype=dtype, rngs=rngs)
        self.k_conv = ShortConv(hd, conv_size, dtype=dtype, rngs=rngs)
        self.v_conv = ShortConv(hd, conv_size, dtype=dtype, rngs=rngs)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, rngs=rngs)

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs):
        """Build from a :class:`nested_jax.models.config.ModelConfig` (registry entries
        ``deltanet``/``gdn``)."""
        return cls(
            cfg.d_model,
            cfg.n_heads,
            cfg.resolved_head_dim(),
            **cls.shell_kwargs(cfg),
            **cls.proteus_kwargs(cfg),
            rngs=rngs,
        )

    @staticmethod
    def seq_len_multiples(cfg) -> dict:
        """``data.seq_len`` must hold whole WY/UT chunks of ``model.chunk_size`` when chunked
        (``models.registry.mixer_seq_len_multiples``); the recurrent form has no chunk."""
        return {"model.chunk_size": cfg.chunk_size} if cfg.impl == "chunked" else {}

    @staticmethod
    def proteus_kwargs(cfg) -> dict:
        """``proteus_blocks`` / ``proteus_context_len`` from ``cfg.proteus`` (SPEC §4)."""
        return dict(proteus_blocks=cfg.proteus.blocks, proteus_context_len=cfg.proteus.context_len)

    @staticmethod
    def shell_kwargs(cfg) -> dict:
        """The keyword arguments every DeltaNet-family layer takes from a ``ModelConfig``."""
        return dict(
            conv_size=cfg.conv_size,
            chunk_size=cfg.chunk_size,
            impl=cfg.impl,
            norm_eps=cfg.norm_eps,
            dtype=cfg.activation_dtype(),
        )

    def init_cache(self, batch_size: int, max_len: int) -> DeltaCache:
        """Zero decode state (``max_len`` is unused: the state size does not grow with length)."""
        del max_len
        h, d = self.n_heads, self.head_dim
        return DeltaCache(
            jnp.zeros((batch_size, h, d, d), jnp.float32),
            self.q_conv.init_state(batch_size),
            self.k_conv.init_state(batch_size),
            self.v_conv.init_state(batch_size),
        )

    def _log_decay(self, x: jax.Array) -> jax.Array | None:
        """Log decay ``g [B, T, H]`` (None: DeltaNet has no decay)."""
        del x
        return None

    def _proteus_qk(self, q, k, positions, segment_ids, cache):
        """Masks ``q, k [B, T, H, K]`` with the Proteus key-row mask ``g_t`` (SPEC §4).

        ``t = positions + 1``; without ``positions``: the position in the row / the document.
        Identity (the same arrays) when ``proteus_blocks == 1``.
        """
        if self.proteus_blocks == 1:
            return q, k
        b, t = q.shape[:2]
        if positions is None:
            if cache is not None:
                raise ValueError(
                    "positions: required with a cache when Proteus is on (proteus_blocks > 1): "
                    "the block schedule needs the cache position"
                )
            positions = segment_positions(segment_ids, b, t)
        elif getattr(positions, "shape", None) != (b, t) or not jnp.issubdtype(
            positions.dtype, jnp.integer
        ):
            raise ValueError(
                f"positions: expected int [B, T] = {(b, t)}, got "
                f"{getattr(positions, 'dtype', None)} {getattr(positions, 'shape', None)}"
            )
        return ops.proteus_key_rows(q, k, positions, rule=self.proteus_rule)

    def _rule(self, q, k, v, g, beta, *, state, segment_ids, single_step: bool):
        """The memory recurrence: one exact step when decoding a single token, else ``ops`` over
        T."""
        if single_step:
            o, s = ops.delta_rule_step(state, q[:, 0], k[:, 0], v[:, 0], beta[:, 0])
            return o[:, None], s
        return ops.delta_rule(
            q,
            k,
            v,
            beta,
            initial_state=state,
            segment_ids=segment_ids,
            chunk_size=self.chunk_size,
            impl=self.impl,
        )

    def __call__(
        self,
        x: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: DeltaCache | None = None,
    ) -> tuple[jax.Array, DeltaCache | None]:
        """Args:
          x: ``[B, T, d_model]``.
          positions: optional ``int [B, T]`` 0-based token positions (the LM's: cache position
            when decoding, position in the document with ``segment_ids``); read only by Proteus
            (``proteus_blocks > 1``), which then needs them with a cache.
          segment_ids: optional ``[B, T]``: conv taps and the memory reset at segment starts.
          cache: optional :class:`DeltaCache` to continue from; with ``T == 1`` the exact step form
          runs.

        Returns:
          ``(y [B, T, d_model], new_cache or None)``.
        """
        check_rank("x", x, 3, "[B, T, d_model]")
        b, t, _ = x.shape
        h, d = self.n_heads, self.head_dim
        x = x.astype(self.dtype)
        c = cache
        sq, sk, sv = (None, None, None) if c is None else (c.conv_q, c.conv_k, c.conv_v)
        q, cq = self.q_conv(self.q_proj(x), state=sq, segment_ids=segment_ids)
        k, ck = self.k_conv(self.k_proj(x), state=sk, segment_ids=segment_ids)
        v, cv = self.v_conv(self.v_proj(x), state=sv, segment_ids=segment_ids)
        # The memory recurrence always runs in float32, whatever the activation dtype.
        q = l2_normalize(jax.nn.silu(q).reshape(b, t, h, d))
        k = l2_normalize(jax.nn.silu(k).reshape(b, t, h, d))
        v = jax.nn.silu(v).reshape(b, t, h, d).astype(jnp.float32)
        q, k = self._proteus_qk(q, k, positions, segment_ids, c)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        g = self._log_decay(x)
        o, s = self._rule(
            q,
            k,
            v,
            g,
            beta,
            state=None if c is None else c.state,
            segment_ids=segment_ids,
            single_step=c is not None and t == 1,
        )
        gate = self.g_proj(x).reshape(b, t, h, d)
        o = self.o_norm(o.astype(self.dtype), gate)
        y = self.o_proj(o.reshape(b, t, h * d))
        return y, (None if c is None else DeltaCache(s, cq, ck, cv))
