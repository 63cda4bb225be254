"""HOLA mixer (SPEC §5): the Gated DeltaNet layer plus a persistent exact KV cache.

Everything the GDN layer has (projections, short convs, L2-normalised q/k, β, decay, SiLU-gated
output RMSNorm; :class:`nested_jax.layers.gdn.GatedDeltaNet`) is inherited unchanged; only the
memory rule is replaced by ``nested_jax.ops.hola`` (the math: ``nested_jax.core.hola.forward``)::

    o_t = S_tᵀ (q_t/√K) + σ(λ_h) · Σ_{j∈V_t} softmax_j(q̃_tᵀ k̃_j/√K) v_j     (sink: logit s_h, v = 0)

with the learnable cache-read parameters ``γ_q, γ_k [H, K]`` (RMSNorm scales, init 1), the sink
logit ``s [H]`` (init 0) and the gate logit ``λ [H]`` (init ``gate_init`` = −4), handed to the op
as one ``HolaReadParams``. Options (``ModelConfig.hola``, a
:class:`~nested_jax.layers.options.HolaOptions`, which is a ``HolaRule``): ``window`` w,
``block_size`` C, ``eviction``, ``read_norm``, the two scales, ``gate_init``; the layer passes the
section whole as the rule of ``ops.hola`` and the shell's ``chunk_size`` as its WY/UT chunk.
``impl`` (``model.impl``):
``"chunked"`` (default) or ``"pallas"`` (the gated delta state path by the Pallas kernel, the cache
path unchanged; ``ops.hola``).

Decoding: the layer cache is a :class:`~nested_jax.layers.deltanet.DeltaCache` whose ``state`` is a
:class:`~nested_jax.ops.hola.HolaState` (GDN state + persistent cache + current block buffer);
a single token runs ``ops.hola.hola_step``, a longer call (prefill) ``ops.hola.hola`` continuing
from the state, so token-by-token decoding equals the block-parallel forward. Its size does not
depend on the number of tokens: per head ``K·V + (w + C)(K + V)`` floats (+ conv taps).

Packed sequences (``segment_ids``, SPEC §0): exact. ``ops.hola.hola`` runs every document of a
packed row as if alone — the gated delta state and the eviction scores restart from zero at its
start, its blocks are counted from its first token, its cache starts empty and holds only its own
tokens, and a query reads only its own document's cache entries and block tokens (plus the sink);
the short convs reset as in GDN. So a packed row gives each document the outputs and gradients it
gets alone (tested). Packed rows cannot be combined with a cache (``ValueError``, as in the LM
shell); decoding is one stream.
"""

from __future__ import annotations

from flax import nnx

from nested_jax.layers.common import partitioned
from nested_jax.layers.deltanet import DeltaCache
from nested_jax.layers.gdn import GatedDeltaNet
from nested_jax.layers.options import HolaOptions
from nested_jax.ops.hola import HolaReadParams, HolaState, hola, hola_step, init_hola_state

__all__ = ["HolaMixer"]


class HolaMixer(GatedDeltaNet):
    """HOLA layer (SPEC §5): GDN state read + ``σ(λ_h)`` · exact top-w cache read.

    Args (beyond :class:`~nested_jax.layers.deltanet.DeltaNet`'s):
      opts: :class:`~nested_jax.layers.options.HolaOptions` (``window`` w, ``block_size`` C,
        ``eviction``, ``read_norm``, the scales, ``gate_init`` = the initial gate logit ``λ_h`` of
        all heads); None = the defaults. A ``HolaOptions`` is a
        :class:`~nested_jax.ops.hola.HolaRule`: the layer hands it whole to ``ops.hola`` /
        ``ops.hola_step`` as ``rule``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        opts: HolaOptions | None = None,
        *,
        rngs: nnx.Rngs,
        **kwargs,
    ):
        opts = HolaOptions() if opts is None else opts
        if not isinstance(opts, HolaOptions):
            raise ValueError(f"opts: expected a HolaOptions, got {type(opts).__name__}")
        if kwargs.get("impl", "chunked") not in ("chunked", "pallas"):
            # The layer runs ops.hola's block-parallel form, its state path by XLA ("chunked") or
            # by the Pallas kernel ("pallas"); never switch silently.
            raise ValueError(
                f"impl: the hola mixer supports 'chunked' and 'pallas' only, got {kwargs['impl']!r}"
            )
        super().__init__(d_model, n_heads, head_dim, rngs=rngs, **kwargs)
        self.opts = opts
        hk = (n_heads, head_dim)
        ones = partitioned(nnx.initializers.ones, ("heads", None))
        self.gamma_q = nnx.Param(ones(rngs.params(), hk))
        self.gamma_k = nnx.Param(ones(rngs.params(), hk))
        self.sink_logit = nnx.Param(
            partitioned(nnx.initializers.zeros, ("heads",))(rngs.params(), (n_heads,))
        )
        self.gate_logit = nnx.Param(
            partitioned(nnx.initializers.constant(float(opts.gate_init)), ("heads",))(
                rngs.params(), (n_heads,)
            )
        )

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs):
        """Build from a ``ModelConfig`` (registry entry ``hola``; options in ``cfg.hola``)."""
        return cls(
            cfg.d_model,
            cfg.n_heads,
            cfg.resolved_head_dim(),
            cfg.hola,
            **cls.shell_kwargs(cfg),
            rngs=rngs,
        )

    def init_cache(self, batch_size: int, max_len: int) -> DeltaCache:
        """Empty decode state: a ``HolaState`` (its size is independent of ``max_len``) + conv
        taps."""
        del max_len
        h, d, r = self.n_heads, self.head_dim, self.opts
        return DeltaCache(
            init_hola_state(batch_size, h, d, d, r.window, r.block_size),
            self.q_conv.init_state(batch_size),
            self.k_conv.init_state(batch_size),
            self.v_conv.init_state(batch_size),
        )

    def _rule(self, q, k, v, g, beta, *, state, segment_ids, single_step: bool):
        if segment_ids is not None and state is not None:
            raise ValueError("segment_ids: packed segments cannot be combined with a cache")
        params = HolaReadParams(
            self.gamma_q[...], self.gamma_k[...], self.sink_logit[...], self.gate_logit[...]
        )
        if single_step:
            xs = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            o, s = hola_step(state, *xs, params, rule=self.opts, impl=self.impl)
            return o[:, None], s
        if state is not None and not isinstance(state, HolaState):
            raise ValueError(f"cache: expected a HolaState in the layer cache, got {type(state)}")
        return hola(
            q, k, v, g, beta, params, rule=self.opts, initial_state=state,
            segment_ids=segment_ids, chunk_size=self.chunk_size, impl=self.impl,
        )  # fmt: skip
