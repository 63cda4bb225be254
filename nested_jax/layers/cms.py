"""Continuum Memory System as the FFN of the LM shell (SPEC §3.3, §3.4).

:class:`CMSFFN` owns ``k`` CMS levels (residual MLPs, plain or SwiGLU) as NNX parameters and runs
``nested_jax.ops.cms.cms_forward`` (``impl="chunked"``, its one form) for the three variants. Its
options are the ``model.cms`` section (:class:`~nested_jax.layers.options.CMSOptions`, one level
per period); a ``CMSOptions`` is a ``CMSRule``, so the layer passes it whole as the op's rule.
Parameter layout (per block)::

    mlp/levels/<ℓ>/w_up    [d, h]   ("embed", "mlp")
    mlp/levels/<ℓ>/w_gate  [d, h]   ("embed", "mlp")     gated levels only
    mlp/levels/<ℓ>/w_down  [h, d]   ("mlp", "embed")
    mlp/mix_logits         [k]      (None,)              variant="independent" only

so ``nested_jax.optim.multifreq.level_labels_by_index("levels")`` labels every leaf of level ℓ
with ``ℓ`` (pretrain mode) and FSDP shards the kernels like the SwiGLU ones.

**Residual convention (documented decision).** A CMS level is itself residual,
``MLP(z) = z + f(z)``, while the shell adds its FFN as a residual, ``x ← x + FFN(RMSNorm(x))``.
The module therefore returns the CMS *update* ``CMS(z) − z`` (``z = RMSNorm(x)``), so the block
computes ``x ← x + CMS(z) − z``. With this, a transformer FFN ``f`` copied into the levels gives
back the transformer exactly for one level (any variant: ``CMS(z) − z = f(z)``) and for any number
of levels with ``variant="independent"`` (``Σ_ℓ w_ℓ (z + f(z)) − z = f(z)`` since ``Σ w_ℓ = 1``)
and ``variant="nested"`` (only level 1 reads). ``sequential`` with ``k > 1`` copies composes the
FFN ``k`` times (SPEC §3.4's initialisation; not the same function).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested_jax.layers.common import partitioned
from nested_jax.layers.options import CMSOptions
from nested_jax.ops.cms import CMSLevel, cms_forward

__all__ = ["CMSFFN", "CMSLevelParams"]


class CMSLevelParams(nnx.Module):
    """One CMS level's kernels (row-major like ``nnx.Linear``: ``y = x W``; SPEC §3.3).

    ``w_up, w_gate [d_model, hidden]`` named ``("embed", "mlp")``; ``w_down [hidden, d_model]``
    named ``("mlp", "embed")``; ``w_gate`` is None for a plain (non-gated) level.
    """

    def __init__(self, d_model: int, hidden: int, *, gated: bool, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()  # the SwiGLU kernels' init (variance 1/fan_in)
        self.w_gate = (
            nnx.Param(partitioned(init, ("embed", "mlp"))(rngs.params(), (d_model, hidden)))
            if gated
            else None
        )
        self.w_up = nnx.Param(partitioned(init, ("embed", "mlp"))(rngs.params(), (d_model, hidden)))
        self.w_down = nnx.Param(
            partitioned(init, ("mlp", "embed"))(rngs.params(), (hidden, d_model))
        )

    def as_level(self, dtype=None) -> CMSLevel:
        """The :class:`~nested_jax.ops.cms.CMSLevel` (leaves cast to ``dtype`` if given)."""

        def get(p):
            if p is None:
                return None
            v = p[...]
            return v if dtype is None else v.astype(dtype)

        return CMSLevel(w_up=get(self.w_up), w_down=get(self.w_down), w_gate=get(self.w_gate))


class CMSFFN(nnx.Module):
    """CMS in place of the shell's FFN: returns ``CMS(z) − z`` for ``z [..., T, d_model]``.

    ``CMS`` is ``cms_forward`` (SPEC §3.3): ``sequential`` ``MLP_k(… MLP_1(z))``, ``nested``
    ``MLP_1(z)``, ``independent`` ``Σ_ℓ softmax(mix_logits)_ℓ MLP_ℓ(z)`` (``mix_logits`` start at 0:
    uniform weights). See the module docstring for why the update, not ``CMS(z)``, is returned.

    Args:
      d_model: residual width ``d``.
      hidden: per-level hidden width ``h``.
      opts: :class:`~nested_jax.layers.options.CMSOptions` (None = the defaults): one level per
        entry of ``periods``, ``variant``, ``gated`` (SwiGLU levels with ``w_gate``, as the
        transformer FFN; False = plain ``σ(x W_up) W_down``). A ``CMSOptions`` is a
        :class:`~nested_jax.ops.cms.CMSRule`: the layer hands it whole to ``ops.cms.cms_forward``.
      dtype: activation dtype (kernels are cast to it for the matmuls; params stay float32).
      rngs: NNX random streams.
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        opts: CMSOptions | None = None,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        opts = CMSOptions() if opts is None else opts
        if not isinstance(opts, CMSOptions):
            raise ValueError(f"opts: expected a CMSOptions, got {type(opts).__name__}")
        for name, value in (("d_model", d_model), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.d_model, self.hidden, self.dtype = d_model, hidden, dtype
        self.opts = opts
        num_levels = len(opts.periods)
        self.levels = nnx.List(
            [
                CMSLevelParams(d_model, hidden, gated=opts.gated, rngs=rngs)
                for _ in range(num_levels)
            ]
        )
        self.mix_logits = (
            nnx.Param(partitioned(nnx.initializers.zeros, (None,))(rngs.params(), (num_levels,)))
            if opts.variant == "independent"
            else None
        )

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs) -> CMSFFN:
        """Build from a :class:`nested_jax.models.config.ModelConfig` (``model.cms.*``)."""
        return cls(
            cfg.d_model, cfg.resolved_cms_hidden(), cfg.cms, dtype=cfg.activation_dtype(), rngs=rngs
        )

    def levels_tuple(self, dtype=None) -> tuple[CMSLevel, ...]:
        """The levels as :class:`CMSLevel` s (for ``ops.cms.cms_forward`` / ``cms_online``)."""
        return tuple(lv.as_level(dtype) for lv in self.levels)

    def __call__(self, z: jax.Array) -> jax.Array:
        """The FFN update ``CMS(z) − z`` (SPEC §3.3).

        Args:
          z: ``[B, T, d_model]`` (the normed residual stream).

        Returns:
          ``[B, T, d_model]`` in the activation dtype.
        """
        if z.ndim != 3 or z.shape[-1] != self.d_model:
            raise ValueError(f"z: expected shape [B, T, {self.d_model}], got {tuple(z.shape)}")
        z = z.astype(self.dtype)
        mix = None if self.mix_logits is None else self.mix_logits[...]
        levels = self.levels_tuple(self.dtype)
        y = cms_forward(levels, z, rule=self.opts, mix_logits=mix, impl="chunked")
        return y - z
