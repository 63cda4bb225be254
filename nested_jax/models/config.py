"""Model configuration: one frozen dataclass shared by every mixer of the LM shell (SPEC §6).

The training system embeds :class:`ModelConfig` in its top-level config and fills it from YAML, so
field types stay
plain (int / float / str / bool) and every impossible value fails at construction with a message
naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nested_jax.layers import options as _options
from nested_jax.layers.attention import ATTENTION_IMPLS

_IMPLS = ("chunked", "recurrent", "pallas")
# Mixers whose memory rule has a Pallas kernel behind ``impl="pallas"`` (pallas_kernels/; hola: its
# gated delta state path).
PALLAS_MIXERS = frozenset({"deltanet", "gdn", "hola"})
_DTYPES = ("float32", "bfloat16")
_FFNS = ("auto", "swiglu", "cms")
# Models whose FFN is the Continuum Memory System when ``ffn = "auto"`` (SPEC §3.2, §3.4).
CMS_MODELS = frozenset({"hope", "hope_attention"})


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the LM shell and its mixer (see ``nested_jax.models.registry``)."""

    name: str = "gdn"  # registry key (nested_jax.models.available_mixers())
    vocab_size: int = 256  # number of token ids (byte-level default)
    d_model: int = 128  # residual stream width
    n_layers: int = 2  # number of [mixer, MLP] blocks
    n_heads: int = 2  # query / memory heads per mixer
    head_dim: int = 0  # per-head width; 0 -> d_model // n_heads
    n_kv_heads: int = 0  # attention only (GQA): key/value heads; 0 -> n_heads
    mlp_hidden: int = 0  # SwiGLU hidden width; 0 -> 8/3 * d_model rounded up to a multiple of 32
    # block FFN: swiglu | cms (SPEC §3.3, model.cms.*) | auto (cms for hope / hope_attention)
    ffn: str = "auto"
    tie_embeddings: bool = True  # output head reuses the token embedding matrix
    conv_size: int = 4  # width of the causal depthwise short conv on q, k, v (DeltaNet / GDN)
    chunk_size: int = 64  # chunk length C of the chunked (WY/UT) recurrent kernels
    impl: str = "chunked"  # full-sequence form: chunked | recurrent | pallas (gdn, deltanet, hola)
    window: int = 0  # attention sliding window: a query sees `window` keys incl. itself; 0 = global
    rope_theta: float = 10000.0  # RoPE base frequency
    # softmax attention scores this many queries at a time when T is longer (never [B, H, T, T]
    # scores; equal values, see layers.attention.blockwise_softmax_attention); 0 = all at once
    attention_block: int = 512
    # softmax attention of transformer, hope_attention and Titans MAC/MAG/MAL (no KV cache): xla
    # (the blockwise XLA form) | pallas (the splash TPU kernel, nested_jax.ops.attention)
    attention_impl: str = "xla"
    norm_eps: float = 1e-6  # epsilon of every RMSNorm
    dtype: str = (
        "float32"  # activation dtype: float32 | bfloat16 (params and memory states stay float32)
    )
    scan_layers: bool = (
        True  # run the stacked layers with lax.scan so compile time does not grow with depth
    )
    remat: bool = False  # rematerialise each block in the backward pass (jax.checkpoint)
    # HOLA cache options (read only by the `hola` mixer; SPEC §5)
    hola: _options.HolaOptions = dataclasses.field(default_factory=_options.HolaOptions)
    # Titans memory / architecture options (read only by the `titans_*` mixers; SPEC §2)
    titans: _options.TitansOptions = dataclasses.field(default_factory=_options.TitansOptions)
    # Proteus incremental memory activation (read by the GDN / Titans mixers; SPEC §4)
    proteus: _options.ProteusOptions = dataclasses.field(default_factory=_options.ProteusOptions)
    # Hope self-modifying memory options (read only by the `hope` mixer; SPEC §3.2)
    hope: _options.HopeOptions = dataclasses.field(default_factory=_options.HopeOptions)
    # Continuum Memory System FFN (read when ffn resolves to cms; SPEC §3.3, §3.4)
    cms: _options.CMSOptions = dataclasses.field(default_factory=_options.CMSOptions)
    # softmax attention: q/k/v bias and RoPE scaling (read by transformer / hope_attention; SPEC §6)
    attention: _options.AttentionOptions = dataclasses.field(
        default_factory=_options.AttentionOptions
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _options.OPTION_SECTIONS:  # a mixer's option section validates itself
                if not isinstance(value, _options.OPTION_SECTIONS[f.name]):
                    raise ValueError(
                        f"ModelConfig.{f.name}: expected a "
                        f"{_options.OPTION_SECTIONS[f.name].__name__}, got {value!r}"
                    )
                continue
            expected = {"int": int, "float": (int, float), "str": str, "bool": bool}[f.type]
            # bool is a subclass of int: reject it where an int is expected (a YAML `true` for
            # n_layers).
            if not isinstance(value, expected) or (f.type != "bool" and isinstance(value, bool)):
                raise ValueError(f"ModelConfig.{f.name}: expected {f.type}, got {value!r}")
        # lazy: the registry imports layers
        from nested_jax.models.registry import available_mixers, mixer_option_sections

        if self.name not in available_mixers():
            raise ValueError(
                f"ModelConfig.name: unknown model {self.name!r}; "
                f"known: {sorted(available_mixers())}"
            )
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "conv_size", "chunk_size"):
            if getattr(self, field) <= 0:
                raise ValueError(
                    f"ModelConfig.{field}: must be positive, got {getattr(self, field)}"
                )
        for field in ("head_dim", "n_kv_heads", "mlp_hidden", "window", "attention_block"):
            if getattr(self, field) < 0:
                raise ValueError(
                    f"ModelConfig.{field}: must be >= 0 (0 = default), got {getattr(self, field)}"
                )
        if self.head_dim == 0 and self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model: {self.d_model} is not divisible by n_heads={self.n_heads} "
                "(set head_dim explicitly or change d_model)"
            )
        if self.n_kv_heads and self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.n_kv_heads: n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.impl not in _IMPLS:
            raise ValueError(f"ModelConfig.impl: unknown {self.impl!r}; expected one of {_IMPLS}")
        if self.impl == "pallas" and self.name not in PALLAS_MIXERS:
            raise ValueError(
                f"ModelConfig.impl: 'pallas' has kernels for {sorted(PALLAS_MIXERS)} only, not "
                f"model.name={self.name!r} (use chunked or recurrent)"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"ModelConfig.attention_impl: unknown {self.attention_impl!r}; expected one of "
                f"{ATTENTION_IMPLS}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"ModelConfig.dtype: unknown {self.dtype!r}; expected one of {_DTYPES}"
            )
        if self.ffn not in _FFNS:
            raise ValueError(f"ModelConfig.ffn: unknown {self.ffn!r}; expected one of {_FFNS}")
        if self.name == "hope_attention" and self.ffn == "swiglu":
            raise ValueError(
                "ModelConfig.ffn: hope_attention is attention + CMS and needs ffn=cms (or auto); "
                "attention + SwiGLU is name=transformer"
            )
        if self.proteus.enabled and "proteus" not in self.read_option_sections():
            readers = sorted(n for n in available_mixers() if "proteus" in mixer_option_sections(n))
            raise ValueError(
                f"ModelConfig.proteus.blocks: {self.proteus.blocks} blocks, but the {self.name!r} "
                f"mixer has no Proteus option (it would train unchanged); Proteus mixers: {readers}"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta: must be positive, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"ModelConfig.norm_eps: must be positive, got {self.norm_eps}")

    def resolved_head_dim(self) -> int:
        """Per-head width: ``head_dim`` or ``d_model // n_heads`` when 0."""
        return self.head_dim or self.d_model // self.n_heads

    def resolved_kv_heads(self) -> int:
        """Key/value heads of attention (GQA): ``n_kv_heads`` or ``n_heads`` when 0."""
        return self.n_kv_heads or self.n_heads

    def resolved_mlp_hidden(self) -> int:
        """SwiGLU hidden width: ``mlp_hidden`` or ceil(8/3 · d_model) rounded up to a multiple of
        32."""
        if self.mlp_hidden:
            return self.mlp_hidden
        hidden = -(-8 * self.d_model // 3)
        return -(-hidden // 32) * 32

    def resolved_ffn(self) -> str:
        """Block FFN: ``ffn``; ``auto`` = ``"cms"`` for :data:`CMS_MODELS`, else ``"swiglu"``."""
        if self.ffn != "auto":
            return self.ffn
        return "cms" if self.name in CMS_MODELS else "swiglu"

    def read_option_sections(self) -> tuple[str, ...]:
        """The option sections (``titans``, ``proteus``, ``cms``, ...) this model reads: its
        mixer's (registry) plus ``cms`` when the block FFN is CMS. The others are inert."""
        from nested_jax.models.registry import mixer_option_sections

        cms = ("cms",) if self.resolved_ffn() == "cms" else ()
        return mixer_option_sections(self.name) + cms

    def resolved_cms_hidden(self) -> int:
        """Hidden width of each CMS level: ``cms.hidden`` or the SwiGLU width when 0."""
        return self.cms.hidden or self.resolved_mlp_hidden()

    def activation_dtype(self):
        """The jnp dtype of activations (params are always float32)."""
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)
