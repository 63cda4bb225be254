"""The one LM shell (SPEC §6): embedding → N × [RMSNorm → mixer → residual → RMSNorm → SwiGLU →
residual]
→ RMSNorm → head. Models differ only by the mixer picked from the registry by ``ModelConfig.name``.

The N blocks are built once with ``nnx.vmap`` so every parameter has a leading ``"layers"`` axis;
the forward walks
that axis with ``lax.scan`` (``scan_layers=True``: compile time independent of depth) or a Python
loop over the
same parameters (``scan_layers=False``), so both modes share checkpoints.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.cms import CMSFFN
from nested_jax.layers.common import dense, partitioned
from nested_jax.layers.mlp import SwiGLU
from nested_jax.layers.norm import RMSNorm
from nested_jax.layers.rope import segment_positions
from nested_jax.models.config import ModelConfig
from nested_jax.models.registry import get_mixer
from nested_jax.parallel.mesh import constrain

# The residual stream [B, T, d] lives on the batch axes and, with context parallelism, its tokens
# on the seq axis (features replicated): see nested_jax.parallel.mesh for why every block
# boundary pins it.
STREAM = ("batch", "seq", None)


class LMCache(NamedTuple):
    """Decode state of the whole LM: ``pos`` int32 scalar (tokens consumed) and ``layers``, the
    mixers' per-layer
    caches stacked on a leading ``n_layers`` axis (KV cache + position for attention; matrix state +
    conv states
    for DeltaNet / GDN)."""

    pos: jax.Array
    layers: Any


class Block(nnx.Module):
    """``x + mixer(RMSNorm(x))`` then ``x + FFN(RMSNorm(x))``.

    FFN: SwiGLU, or with ``cfg.resolved_ffn() == "cms"`` the CMS update ``CMS(z) − z``
    (:class:`nested_jax.layers.cms.CMSFFN`, SPEC §3.3).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = cfg.activation_dtype()
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.mixer = get_mixer(cfg.name).from_config(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        if cfg.resolved_ffn() == "cms":
            # CMSFFN returns CMS(z) − z, so the residual add below keeps one copy of the stream
            # (SPEC §3.3, §3.4; see nested_jax.layers.cms).
            self.mlp = CMSFFN.from_config(cfg, rngs=rngs)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.resolved_mlp_hidden(), dtype=dtype, rngs=rngs)

    def __call__(self, x, *, positions, segment_ids=None, cache=None):
        """Args: ``x [B, T, d_model]``, ``positions [B, T]``, ``segment_ids``, one layer's
        ``cache``.
        Returns ``(x [B, T, d_model], new_cache)``."""
        h, new_cache = self.mixer(
            self.mixer_norm(x), positions=positions, segment_ids=segment_ids, cache=cache
        )
        x = x + h.astype(x.dtype)
        x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
        return x, new_cache


class LanguageModel(nnx.Module):
    """Decoder-only LM over token ids (SPEC §6). Build with :func:`build_model`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg: expected a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        dtype = cfg.activation_dtype()
        # std d^-1/2: unit-norm token vectors, and O(1) logits when the head is tied.
        embed_init = nnx.initializers.normal(stddev=cfg.d_model**-0.5)
        self.embed = nnx.Param(
            partitioned(embed_init, ("vocab", "embed"))(
                rngs.params(), (cfg.vocab_size, cfg.d_model)
            )
        )

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(
            in_axes=0,
            out_axes=0,
            axis_size=cfg.n_layers,
            transform_metadata={nnx.PARTITION_NAME: "layers"},
        )
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = dense(
                cfg.d_model, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs
            )

    def init_cache(self, batch_size: int, max_len: int) -> LMCache:
        """Empty decode state for ``batch_size`` sequences of at most ``max_len`` tokens in total.

        Returns:
          :class:`LMCache` with ``pos = 0`` and each mixer's zero cache stacked over ``n_layers``.
        """
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        one = self.blocks.mixer.init_cache(batch_size, max_len)
        n = self.cfg.n_layers
        layers = jax.tree.map(lambda a: jnp.repeat(a[None], n, axis=0), one)
        return LMCache(jnp.zeros((), jnp.int32), layers)

    def hidden(
        self,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        cache: LMCache | None = None,
    ) -> tuple[jax.Array, LMCache | None]:
        """Final hidden states (after the last RMSNorm), the input of the output head.

        Args:
          tokens: ``int32 [B, T]``.
          segment_ids: optional ``int [B, T]`` packed-sequence ids: RoPE positions restart,
          attention is masked
            and recurrent states / conv taps reset at every segment start. Not combinable with
            ``cache``.
          cache: optional :class:`LMCache` from :meth:`init_cache` or a previous call; the call
          continues from it
            (positions start at ``cache.pos``). ``T == 1`` uses the mixers' exact single-step path.

        Returns:
          ``(h [B, T, d_model] in model.dtype, new_cache)``; ``new_cache`` is None when ``cache``
          is None.
        """
        cfg = self.cfg
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens: expected int [B, T], got {tokens.dtype} {tuple(tokens.shape)}"
            )
        b, t = tokens.shape
        if segment_ids is not None:
            if segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
                raise ValueError(
                    f"segment_ids: expected int [B, T] = {(b, t)}, got "
                    f"{segment_ids.dtype} {tuple(segment_ids.shape)}"
                )
            if cache is not None:
                raise ValueError("segment_ids: packed segments cannot be combined with a cache")
        if cache is not None and not isinstance(cache, LMCache):
            raise ValueError(
                f"cache: expected an LMCache from init_cache, got {type(cache).__name__}"
            )
        dtype = cfg.activation_dtype()
        # FSDP: gather the table and look up locally; a lookup into the feature-sharded table
        # would gather the GLOBAL batch's token ids on every chip instead. (f32 table: its
        # gradient, a scatter-add over every occurrence of a token, must accumulate in f32.)
        table = constrain(self.embed[...], ("vocab", None))
        x = constrain(jnp.take(table, tokens, axis=0).astype(dtype), STREAM)
        positions = segment_positions(segment_ids, b, t, 0 if cache is None else cache.pos)
        x, new_layers = self._run_blocks(
            x, positions, segment_ids, None if cache is None else cache.layers
        )
        new_cache = None if cache is None else LMCache(cache.pos + t, new_layers)
        return self.final_norm(x), new_cache

    def output_weight(self) -> tuple[jax.Array, str]:
        """The output projection and its layout: ``(embed [V, d], "vd")`` when the head is tied,
        else ``(head kernel [d, V], "dv")`` — what ``ops.chunked_cross_entropy`` takes."""
        if self.cfg.tie_embeddings:
            return self.embed[...], "vd"
        return self.head.kernel[...], "dv"

    def __call__(
        self,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        cache: LMCache | None = None,
    ) -> tuple[jax.Array, LMCache | None]:
        """Next-token logits ``z = h W_out`` over the final hidden states ``h`` of :meth:`hidden`.

        Args: as :meth:`hidden`.
        Returns:
          ``(logits f32 [B, T, vocab_size], new_cache)``; ``new_cache`` is None when ``cache`` is
          None. The product accumulates in f32 from activation-dtype operands.
        """
        x, new_cache = self.hidden(tokens, segment_ids=segment_ids, cache=cache)
        w, layout = self.output_weight()
        equation = "btd,vd->btv" if layout == "vd" else "btd,dv->btv"
        logits = jnp.einsum(equation, x, w.astype(x.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "vocab")), new_cache

    def _run_blocks(self, x, positions, segment_ids, layer_caches):
        graphdef, params = nnx.split(self.blocks)

        def body(h, xs):
            p, c = xs
            h, c = nnx.merge(graphdef, p)(h, positions=positions, segment_ids=segment_ids, cache=c)
            return constrain(h, STREAM), c

        if self.cfg.remat:
            # Inside lax.scan CSE cannot merge the recomputation with the forward, so prevent_cse is
            # not needed.
            body = jax.checkpoint(body, prevent_cse=not self.cfg.scan_layers)
        if self.cfg.scan_layers:
            return jax.lax.scan(body, x, (params, layer_caches))
        outs = []
        for i in range(self.cfg.n_layers):
            x, c = body(x, jax.tree.map(lambda a, i=i: a[i], (params, layer_caches)))
            outs.append(c)
        new = None if layer_caches is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
        return x, new


def build_model(cfg: ModelConfig, *, rngs: nnx.Rngs) -> LanguageModel:
    """Build the LM for ``cfg`` (mixer from the registry; parameters float32, stacked on
    ``"layers"``)."""
    return LanguageModel(cfg, rngs=rngs)
