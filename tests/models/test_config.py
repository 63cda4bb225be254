"""ModelConfig validation: every bad value raises ValueError naming the field (SPEC §6, DESIGN
configs)."""

import dataclasses

import pytest

from nested_jax.models import ModelConfig


def test_defaults_and_resolved_sizes():
    cfg = ModelConfig()
    assert cfg.resolved_head_dim() == 64
    assert cfg.resolved_kv_heads() == 2
    assert cfg.resolved_mlp_hidden() == 352  # ceil(8/3 * 128) = 342 -> 352
    cfg = ModelConfig(d_model=96, n_heads=4, head_dim=32, n_kv_heads=2, mlp_hidden=100)
    assert (cfg.resolved_head_dim(), cfg.resolved_kv_heads(), cfg.resolved_mlp_hidden()) == (
        32,
        2,
        100,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3  # frozen: configs are values


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"name": "nope"}, "name"),
        ({"impl": "fast"}, "impl"),
        ({"dtype": "float16"}, "dtype"),
        ({"d_model": 100, "n_heads": 3}, "d_model"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads"),
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"conv_size": 0}, "conv_size"),
        ({"window": -2}, "window"),
        ({"head_dim": -1}, "head_dim"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"n_layers": 2.5}, "n_layers"),
        ({"n_layers": True}, "n_layers"),
        ({"scan_layers": 1}, "scan_layers"),
        ({"name": 3}, "name"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}\b"):
        ModelConfig(**kwargs)


def test_explicit_head_dim_allows_indivisible_d_model_and_int_float_fields():
    cfg = ModelConfig(d_model=100, n_heads=3, head_dim=32, rope_theta=500000)
    assert cfg.resolved_head_dim() == 32 and cfg.rope_theta == 500000


@pytest.mark.parametrize("name", ["transformer", "hope_attention", "hola", "titans_mac"])
def test_proteus_on_a_mixer_without_the_option_is_refused(name):
    from nested_jax.layers.options import ProteusOptions

    proteus = ProteusOptions(blocks=4, context_len=64)
    with pytest.raises(ValueError, match=rf"^ModelConfig.proteus.blocks: .*'{name}' mixer has no"):
        ModelConfig(name=name, proteus=proteus)
    ModelConfig(name=name, proteus=ProteusOptions(blocks=1, context_len=64))  # E = 1 is off


def test_read_option_sections_follow_the_mixer_and_the_ffn():
    assert ModelConfig(name="gdn").read_option_sections() == ("proteus",)
    assert ModelConfig(name="titans_mag").read_option_sections() == ("titans", "proteus")
    assert ModelConfig(name="hope").read_option_sections() == ("hope", "proteus", "cms")
    assert ModelConfig(name="gdn", ffn="cms").read_option_sections() == ("proteus", "cms")
    assert ModelConfig(name="transformer").read_option_sections() == ("attention",)
    assert ModelConfig(name="hope_attention").read_option_sections() == ("attention", "cms")


def _proteus_readers():
    from nested_jax.models.registry import available_mixers, mixer_option_sections

    readers = [n for n in available_mixers() if "proteus" in mixer_option_sections(n)]
    # titans_mag (~45 s) shares its Proteus memory call with titans_lmm (default suite).
    return [pytest.param(n, marks=pytest.mark.slow) if n == "titans_mag" else n for n in readers]


@pytest.mark.parametrize("name", _proteus_readers())
def test_every_mixer_listing_proteus_reads_it(name):
    """The registry's option list is a promise: with E > 1 the logits of a freshly initialised
    model differ from the E = 1 model's (same seed) somewhere inside the training context."""
    import jax
    import numpy as np
    from flax import nnx

    from nested_jax.layers.options import HopeOptions, ProteusOptions, TitansOptions
    from nested_jax.models import build_model

    kw = dict(vocab_size=32, d_model=32, n_layers=1, n_heads=2, chunk_size=8, scan_layers=False)
    kw["titans"] = TitansOptions(memory_chunk=4, segment_len=8, window=8, memory_hidden=16)
    kw["hope"] = HopeOptions(chunk_memory=4, chunk_other=2, memory_hidden=16)
    tokens = jax.random.randint(jax.random.key(0), (1, 16), 0, 32)
    logits = [
        np.asarray(
            build_model(ModelConfig(name=name, proteus=p, **kw), rngs=nnx.Rngs(0))(tokens)[0]
        )
        for p in (ProteusOptions(blocks=4, context_len=16), ProteusOptions())
    ]
    assert np.abs(logits[0] - logits[1]).max() > 1e-6
