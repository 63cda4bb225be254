"""Registry of sequence mixers: ``ModelConfig.name`` → mixer class (SPEC §6: models differ only by
the mixer).

A mixer class follows this protocol (see :class:`nested_jax.layers.Attention`,
:class:`nested_jax.layers.DeltaNet`):

- ``cls.from_config(cfg: ModelConfig, *, rngs: nnx.Rngs) -> mixer``
- ``mixer(x [B, T, d_model], *, positions int32[B, T], segment_ids int32[B, T] | None, cache | None)
  -> (y [B, T, d_model], new_cache | None)``; ``cache=None`` starts from zero state and returns
  ``None``;
  ``segment_ids`` resets state / masks attention at segment starts.
- ``mixer.init_cache(batch_size: int, max_len: int) -> cache`` (a pytree of arrays for ONE layer; it
may only
  read static Python attributes, since the LM calls it on the layer-stacked module).

Later mechanisms (Titans, Hope, HOLA) call :func:`register_mixer` from their own module; the LM
shell needs no edit.
"""

from __future__ import annotations

from nested_jax.layers.attention import Attention
from nested_jax.layers.deltanet import DeltaNet
from nested_jax.layers.gdn import GatedDeltaNet

_MIXERS: dict[str, type] = {}
# ModelConfig option sections (``model.<section>``) each mixer reads: a resumed run may change the
# others, since they cannot alter the parameters or the math (train.workdir.config_changes).
_OPTIONS: dict[str, tuple[str, ...]] = {}


def register_mixer(
    name: str, cls: type, *, options: tuple[str, ...] = (), overwrite: bool = False
) -> None:
    """Make ``cls`` available as ``ModelConfig(name=name)``.

    Args:
      name: registry key (non-empty string).
      cls: a class following the mixer protocol in this module's docstring.
      options: the ``ModelConfig`` option sections (``"titans"``, ``"proteus"``, ...) the mixer
        reads; every name must be an option section.
      overwrite: allow replacing an existing entry (otherwise a duplicate name raises
      ``ValueError``).
    """
    from nested_jax.layers.options import OPTION_SECTIONS

    unknown = sorted(set(options) - set(OPTION_SECTIONS))
    if unknown:
        raise ValueError(
            f"options: unknown option sections {unknown}; known: {sorted(OPTION_SECTIONS)}"
        )
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    for attr in ("from_config", "init_cache", "__call__"):
        if not callable(getattr(cls, attr, None)):
            raise ValueError(f"cls: mixer {cls!r} lacks the protocol method {attr!r}")
    if name in _MIXERS and not overwrite and _MIXERS[name] is not cls:
        raise ValueError(f"name: mixer {name!r} is already registered as {_MIXERS[name]!r}")
    _MIXERS[name] = cls
    _OPTIONS[name] = tuple(options)


def get_mixer(name: str) -> type:
    """The mixer class registered under ``name`` (``ValueError`` listing the known names
    otherwise)."""
    try:
        return _MIXERS[name]
    except KeyError:
        raise ValueError(f"name: unknown mixer {name!r}; known: {sorted(_MIXERS)}") from None


def mixer_option_sections(name: str) -> tuple[str, ...]:
    """The ``ModelConfig`` option sections the mixer ``name`` reads (``ValueError`` if unknown)."""
    get_mixer(name)
    return _OPTIONS[name]


def mixer_seq_len_multiples(cfg) -> dict[str, int]:
    """The chunk sizes ``data.seq_len`` must be a multiple of for ``cfg`` (a ``ModelConfig``).

    Asked of the mixer class: ``cls.seq_len_multiples(cfg) -> {config field path: size}``, e.g.
    ``{"model.chunk_size": 64}`` for a chunked GDN, ``{"model.titans.memory_chunk": 16}`` for a
    chunked Titans memory. A mixer without the method (attention) needs nothing. Used by
    ``train.config``'s cross-field check, so each mixer states the knob it really reads.
    """
    ask = getattr(get_mixer(cfg.name), "seq_len_multiples", None)
    return {} if ask is None else dict(ask(cfg))


def available_mixers() -> tuple[str, ...]:
    """Names currently registered, sorted."""
    return tuple(sorted(_MIXERS))


register_mixer("transformer", Attention, options=("attention",))
register_mixer("deltanet", DeltaNet, options=("proteus",))
register_mixer("gdn", GatedDeltaNet, options=("proteus",))

from nested_jax.layers.hola import HolaMixer  # noqa: E402  (HOLA, SPEC §5)

register_mixer("hola", HolaMixer, options=("hola",))

from nested_jax.layers.titans import TitansLMM, TitansMAG, TitansMAL  # noqa: E402  (SPEC §2)
from nested_jax.layers.titans_mac import TitansMAC  # noqa: E402

register_mixer("titans_lmm", TitansLMM, options=("titans", "proteus"))
# MAC has no Proteus option: its memory runs segment by segment inside a lax.scan (traced segment
# start) while the Proteus span split needs static positions; ModelConfig refuses the combination.
register_mixer("titans_mac", TitansMAC, options=("titans",))
register_mixer("titans_mag", TitansMAG, options=("titans", "proteus"))
register_mixer("titans_mal", TitansMAL, options=("titans", "proteus"))

# Hope-Attention (SPEC §3.4): softmax attention; its CMS FFN comes from ModelConfig.ffn = auto/cms.
register_mixer("hope_attention", Attention, options=("attention",))

from nested_jax.layers.hope import HopeMixer  # noqa: E402  (Hope, SPEC §3.2)

register_mixer("hope", HopeMixer, options=("hope", "proteus"))

from nested_jax.layers.lstm import LSTMMixer  # noqa: E402  (the formal-language protocol's control)

register_mixer("lstm", LSTMMixer)
