"""Titans MAC mixer — memory as context (SPEC §2 "MAC", Titans eqs. 21–25).

The sequence is split into segments of ``N_s`` tokens (aligned at position 0). For segment ``s``
with memory state ``M_{s-1}`` (the state after segment ``s−1``; ``M_0`` learned)::

    q_t = L2(silu(conv(x_t W_Q)))                       retrieval queries from the input
    h_t = M*_{s-1}(q_t)                                 (21) read without update
    h̃_t = h_t W_h                                        back to model width, one token per h_t
    ỹ = Attn([persistent ‖ h̃_seg ‖ x_seg])             (22, 23) softmax attention, RoPE
    M_s = write(M_{s-1}; k, v projected from y)         (24) the segment's writes (chunked rule)
    o_t = RMSNorm(y_t) ⊙ σ(RMSNorm(M_t(q'_t)))          (25) read of the updated memory, gate

Order: retrieve → attend → store → read. ``y`` are the per-head attention outputs of the segment's
tokens; the memory keys / values / queries / gates are projections of ``y``
(``k' , q' = L2(silu(y W))``, ``v' = silu(y W_v)``). The store and the read are one call of the
memory rule over the segment (read after write), so ``M_t`` in (25) is the memory after the
segment's writes up to token t.

**Decision (causality).** An LM must not see later tokens, so inside a segment query ``i`` sees all
persistent tokens, the retrieved tokens ``h̃_j`` and the inputs ``x_j`` for ``j ≤ i`` only, and the
gate in (25) reads ``M_t`` (writes up to t) rather than the end-of-segment memory. The memory
projections of ``y`` have no short conv (``y`` is produced segment by segment).

Decoding carries ``M_{s-1}`` (retrieval), the memory's chunk state and buffer, the current
segment's keys / values (retrieved and input tokens) and the conv taps, so token-by-token
generation equals the full forward across segment boundaries.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.common import check_rank, dense
from nested_jax.layers.conv import ShortConv
from nested_jax.layers.deltanet import l2_normalize
from nested_jax.layers.norm import RMSNorm
from nested_jax.layers.persistent_attention import persistent_swa
from nested_jax.layers.titans import (
    NeuralMemory,
    _positions,
    scan_tokens,
    titans_seq_len_multiples,
)
from nested_jax.ops.titans import MemoryCache

__all__ = ["MACCache", "TitansMAC"]


class MACCache(NamedTuple):
    """Decode state of MAC.

    Attributes:
      memory: :class:`~nested_jax.ops.titans.MemoryCache` (state at the chunk start + buffer).
      seg_weights: tuple of ``[B, H, d_l, d_{l+1}]``, ``M_{s-1}`` used for retrieval in segment s.
      conv_q: ``[B, W−1, H·D]`` taps of the retrieval-query conv.
      k_h, v_h, k_x, v_x: ``[B, N_s, H, D]`` keys / values of the current segment's retrieved and
        input tokens (slot ``j`` = position ``j`` in the segment).
      pos: int32 scalar, tokens processed so far.
    """

    memory: MemoryCache
    seg_weights: tuple
    conv_q: jax.Array
    k_h: jax.Array
    v_h: jax.Array
    k_x: jax.Array
    v_x: jax.Array
    pos: jax.Array


class TitansMAC(nnx.Module):
    """MAC mixer (registry ``titans_mac``); options ``cfg.titans`` (segment_len, persistent_tokens,
    memory_*). See the module docstring for the equations."""

    seq_len_multiples = staticmethod(titans_seq_len_multiples)

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        opts = cfg.titans
        h, d = cfg.n_heads, cfg.resolved_head_dim()
        hd = h * d
        dtype = cfg.activation_dtype()
        self.n_heads, self.head_dim, self.dtype, self.d_model = h, d, dtype, cfg.d_model
        self.segment_len = opts.segment_len
        self.q_proj = dense(cfg.d_model, hd, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.q_conv = ShortConv(hd, cfg.conv_size, dtype=dtype, rngs=rngs)
        self.h_proj = dense(hd, cfg.d_model, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.attn = persistent_swa(cfg, cfg.d_model, rngs)
        self.mq_proj = dense(hd, hd, ("heads", None), dtype=dtype, rngs=rngs)
        self.mk_proj = dense(hd, hd, ("heads", None), dtype=dtype, rngs=rngs)
        self.mv_proj = dense(hd, hd, ("heads", None), dtype=dtype, rngs=rngs)
        self.memory = NeuralMemory(hd, h, d, opts, dtype=dtype, rngs=rngs)
        self.attn_norm = RMSNorm(d, eps=cfg.norm_eps, names=(None,), rngs=rngs)
        self.mem_norm = RMSNorm(d, eps=cfg.norm_eps, names=(None,), rngs=rngs)
        self.o_proj = dense(hd, cfg.d_model, ("heads", "embed"), dtype=dtype, rngs=rngs)

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs):
        """Registry ``titans_mac``."""
        return cls(cfg, rngs=rngs)

    def init_cache(self, batch_size: int, max_len: int) -> MACCache:
        """Decode state at position 0 (size independent of ``max_len``)."""
        del max_len
        mem = self.memory.init_cache(batch_size)
        z = jnp.zeros((batch_size, self.segment_len, self.n_heads, self.head_dim), self.dtype)
        return MACCache(
            mem, mem.weights, self.q_conv.init_state(batch_size), z, z, z, z,
            jnp.zeros((), jnp.int32),
        )  # fmt: skip

    # -- pieces shared by the sequence and decode forms --------------------------------------------

    def _heads(self, a):
        return a.reshape(*a.shape[:2], self.n_heads, self.head_dim)

    def _retrieval_query(self, x, segment_ids=None, state=None):
        q, cq = self.q_conv(self.q_proj(x), state=state, segment_ids=segment_ids)
        return l2_normalize(jax.nn.silu(self._heads(q))), cq

    def _retrieved_kv(self, weights, qm, positions):
        """(21) ``h = M*(q)`` and the keys / values of the retrieved tokens ``h̃ = h W_h``."""
        hm = self.memory.read(weights, qm)  # [B, t, H, D] f32
        tok = self.h_proj(hm.reshape(*hm.shape[:2], -1).astype(self.dtype))
        _, k, v = self.attn.qkv(tok, positions)
        return k, v

    def _store_inputs(self, y):
        """Memory q', k', v' ``[B, t, H, D]`` and gates ``[B, t, H]`` projected from ``y``."""
        yf = y.reshape(*y.shape[:2], -1).astype(self.dtype)
        q = l2_normalize(jax.nn.silu(self._heads(self.mq_proj(yf))))
        k = l2_normalize(jax.nn.silu(self._heads(self.mk_proj(yf))))
        v = jax.nn.silu(self._heads(self.mv_proj(yf))).astype(jnp.float32)
        return (q, k, v, *self.memory.gates(yf))

    def _gate(self, y, m):
        """(25) per head ``RMSNorm(y) ⊙ σ(RMSNorm(m))`` (before ``W_o``)."""
        g = jax.nn.sigmoid(self.mem_norm(m.astype(jnp.float32)))
        return (self.attn_norm(y.astype(jnp.float32)) * g).astype(self.dtype)

    def _out(self, o):
        return self.o_proj(o.reshape(*o.shape[:2], self.n_heads * self.head_dim))

    # -- sequence form -----------------------------------------------------------------------------

    def _forward(self, x, positions, segment_ids):
        b, t, _ = x.shape
        ns = self.segment_len
        n_seg = -(-t // ns)
        pad = n_seg * ns - t
        packed = segment_ids is not None
        if packed and segment_ids.shape != (b, t):
            raise ValueError(
                f"segment_ids: expected int [B, T] = {(b, t)}, got {segment_ids.shape}"
            )
        qm, _ = self._retrieval_query(x, segment_ids)
        qx, kx, vx = self.attn.qkv(x, positions)
        seg = jnp.zeros((b, t), jnp.int32) if not packed else segment_ids.astype(jnp.int32)
        # A document start anywhere in the row (t > 0); the first token never resets.
        starts = jnp.pad(seg[:, 1:] != seg[:, :-1], ((0, 0), (1, 0)))
        # Pad to whole segments; padding is after every real token, so causality hides it.
        pos_p = jnp.concatenate(
            [positions, positions[:, -1:] + 1 + jnp.arange(pad, dtype=positions.dtype)], 1
        )
        padt = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        seg = jnp.concatenate([seg, jnp.repeat(seg[:, -1:], pad, 1)], 1)
        split = (
            lambda a: jnp.moveaxis(  # noqa: E731
                a.reshape(b, n_seg, ns, *a.shape[2:]), 1, 0
            )
        )
        xs = tuple(split(a) for a in (padt(qm), padt(qx), padt(kx), padt(vx)))
        xs += (split(pos_p), split(seg), split(padt(starts)))
        init = self.memory.initial_state(b)

        def body(state, inp):
            qm_s, qx_s, kx_s, vx_s, pos_s, seg_s, st_s = inp
            if packed:
                # Exact reset (SPEC §0): a document starting at the segment's first token starts
                # from (M_0, 0); one starting inside the segment is reset by the memory core, and
                # its tokens retrieve from M_0 (the memory "before" their document) too.
                first = st_s[:, 0][:, None, None, None]
                state = jax.tree.map(lambda a, o: jnp.where(first, a, o), init, state)
                kh, vh = self._retrieved_kv(state.weights, qm_s, pos_s)
                kh0, vh0 = self._retrieved_kv(init.weights, qm_s, pos_s)
                new_doc = (jnp.cumsum(st_s[:, 1:], axis=1) > 0)[:, :, None, None]
                new_doc = jnp.pad(new_doc, ((0, 0), (1, 0), (0, 0), (0, 0)))
                kh, vh = jnp.where(new_doc, kh0, kh), jnp.where(new_doc, vh0, vh)
                seg_mem = seg_s
            else:
                kh, vh = self._retrieved_kv(state.weights, qm_s, pos_s)  # retrieve (M_{s-1})
                seg_mem = None
            y = self.attn.attend_causal(  # attend over [persistent ‖ h̃ ‖ x], both causal
                qx_s, jnp.concatenate([kh, kx_s], 1), jnp.concatenate([vh, vx_s], 1), tiles=2,
                segment_ids=seg_s,
            )  # fmt: skip
            m, state = self.memory(  # store + read
                *self._store_inputs(y), state=state, segment_ids=seg_mem, reset_state=init
            )
            return state, self._gate(y, m)

        body = jax.checkpoint(body, prevent_cse=False)
        _, o = jax.lax.scan(body, init, xs)
        o = jnp.moveaxis(o, 0, 1).reshape(b, n_seg * ns, self.n_heads, self.head_dim)[:, :t]
        return self._out(o)

    # -- decode ------------------------------------------------------------------------------------

    def _step(self, c: MACCache, xt, pt):
        ns = self.segment_len
        p = c.pos % ns
        # Before the first token the caches hold placeholders (built from static attributes):
        # the memory substitutes M_0, and segment 0 retrieves from M_0 too.
        c = c._replace(memory=self.memory.start(c.memory))
        first = c.pos == 0
        seg_w = jax.tree.map(lambda a, o: jnp.where(first, a, o), c.memory.weights, c.seg_weights)
        c = c._replace(seg_weights=seg_w)
        qm, cq = self._retrieval_query(xt, state=c.conv_q)
        kh, vh = self._retrieved_kv(c.seg_weights, qm, pt)
        qx, kx, vx = self.attn.qkv(xt, pt)
        put = lambda buf, a: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, a.astype(buf.dtype), p, 1
        )
        k_h, v_h, k_x, v_x = put(c.k_h, kh), put(c.v_h, vh), put(c.k_x, kx), put(c.v_x, vx)
        b = xt.shape[0]
        vis = jnp.broadcast_to((jnp.arange(ns) <= p)[None, None], (b, 1, ns))
        mask = jnp.concatenate([vis, vis], axis=2)
        y = self.attn.attend(
            qx, jnp.concatenate([k_h, k_x], 1), jnp.concatenate([v_h, v_x], 1), mask
        )
        q, k, v, th, et, al = self._store_inputs(y)
        m, mem = self.memory.step(c.memory, q[:, 0], k[:, 0], v[:, 0], th[:, 0], et[:, 0],
                                  al[:, 0])  # fmt: skip
        # After the segment's last token the committed memory is M_s: retrieval state for s+1.
        end = p == ns - 1
        seg_w = jax.tree.map(lambda a, o: jnp.where(end, a, o), mem.weights, c.seg_weights)
        out = self._out(self._gate(y, m[:, None]))
        return out, MACCache(mem, seg_w, cq, k_h, v_h, k_x, v_x, c.pos + 1)

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None):
        """Mixer protocol: ``x [B, T, d]`` → ``(y [B, T, d], cache)``; any T (last segment padded).

        Args:
          x: ``[B, T, d_model]``.
          positions: ``[B, T]`` RoPE positions (default ``0..T−1``).
          segment_ids: optional ``[B, T]`` packed documents: attention masked per document; the
            memory resets exactly to ``(M_0, 0)`` at every document start and the tokens of a
            document that started inside the current segment retrieve from ``M_0``. Segments stay
            on the row's grid (aligned at 0), so a document gets exactly the outputs of a separate
            run when it starts at a multiple of ``segment_len``. Not with a cache.
          cache: optional :class:`MACCache`; the tokens run one by one with the exact decode rule.
        """
        check_rank("x", x, 3, "[B, T, d_model]")
        x = x.astype(self.dtype)
        positions = _positions(positions, x)
        if cache is None:
            return self._forward(x, positions, segment_ids), None
        if segment_ids is not None:
            raise ValueError("segment_ids: packed segments cannot be combined with a cache")
        return scan_tokens(self._step, cache, x, positions)
