"""One typed, frozen options value per mechanism: ``HopeRule``, ``HolaRule``, ``CMSRule``,
``ProteusRule`` (all in the jax-free ``nested_jax.rules``).

Each config section's ``rule()`` builds its rule with the section's values, the section's defaults
are the rule's (and the core functions' keyword defaults), a rule is frozen and hashable (a jit
static), a bad field raises ``ValueError`` naming ``<Rule>.<field>``, and the ops and layers take
the rule (``rule=``) instead of loose keywords.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.core.cms import online as core_cms
from nested_jax.core.hola import decode as core_hola_decode
from nested_jax.core.hola import forward as core_hola
from nested_jax.core.hola.reference import hola_reference
from nested_jax.core.proteus import proteus_key_mask
from nested_jax.layers.cms import CMSFFN
from nested_jax.layers.hola import HolaMixer
from nested_jax.layers.options import CMSOptions, HolaOptions, HopeOptions, ProteusOptions
from nested_jax.models import ModelConfig
from nested_jax.ops import cms as ops_cms
from nested_jax.ops import hola as ops_hola
from nested_jax.ops import linear as ops_linear
from nested_jax.ops.cms import CMSRule
from nested_jax.ops.hola import HolaRule
from nested_jax.ops.hope import HopeRule
from nested_jax.ops.linear import ProteusRule

# --------------------------------------------------------------------------------------------------
# defaults written once: the sections', the rules' and the core keywords' agree


def _rule_part(section, rule_cls):
    """The plain rule a config section stands for (its ``rule_cls`` fields)."""
    return rule_cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(rule_cls)})


def test_option_defaults_are_the_rule_defaults():
    assert _rule_part(HolaOptions(), HolaRule) == HolaRule()
    assert _rule_part(CMSOptions(), CMSRule) == CMSRule()
    assert ProteusOptions().rule() == ProteusRule()
    assert ModelConfig().proteus.rule() == ProteusRule(blocks=1, context_len=0)


def test_rules_are_one_jax_free_module_that_core_ops_and_config_share():
    import nested_jax.rules as rules

    for rule in (HopeRule, HolaRule, CMSRule, ProteusRule):
        assert getattr(rules, rule.__name__) is rule  # core and ops re-export the same class
    code = "import sys, nested_jax.rules; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0  # plain Python values


def test_hope_and_proteus_sections_are_their_rules():
    # The rule's fields and checks are written once: the sections extend the rules.
    for section, rule in ((HopeOptions, HopeRule), (ProteusOptions, ProteusRule)):
        assert issubclass(section, rule)
        assert {f.name for f in dataclasses.fields(rule)} <= {
            f.name for f in dataclasses.fields(section)
        }
    assert ProteusOptions().rule() == ProteusRule() and type(ProteusOptions().rule()) is ProteusRule
    # HopeOptions is the rule the mixer passes; it re-declares the training defaults only (the
    # rule's are the paper's per-token rule) and no field of the rule under another name.
    training = dict(chunk_memory=16, chunk_other=4, momentum=True, remat=True,
                    chunk_updates="parallel", grad_clip=4.0)  # fmt: skip
    rule_fields = {f.name: f.default for f in dataclasses.fields(HopeRule)}
    section_fields = {f.name: f.default for f in dataclasses.fields(HopeOptions)}
    assert list(section_fields)[: len(rule_fields)] == list(rule_fields)
    assert {n: v for n, v in section_fields.items() if rule_fields.get(n, v) != v} == training
    assert {n: rule_fields[n] for n in training} == dict(
        chunk_memory=1, chunk_other=1, momentum=False, remat=False, chunk_updates="scan",
        grad_clip=0.0,
    )  # fmt: skip
    opts = HopeOptions(chunk_memory=8, chunk_other=2, momentum=False, memory_hidden=12)
    assert hash(opts) == hash(dataclasses.replace(opts))  # a jit static, like the rule


def test_hola_and_cms_sections_are_their_rules():
    # The rule's fields, defaults and checks are written once: the sections extend the rules and
    # add only the layer's own fields (no renamed field, no restated default).
    own = {HolaOptions: {"gate_init"}, CMSOptions: {"hidden", "gated", "mode", "accumulate"}}
    for section, rule in ((HolaOptions, HolaRule), (CMSOptions, CMSRule)):
        assert issubclass(section, rule)
        rule_fields = {f.name: f.default for f in dataclasses.fields(rule)}
        section_fields = {f.name: f.default for f in dataclasses.fields(section)}
        assert set(section_fields) == set(rule_fields) | own[section]
        assert {n: section_fields[n] for n in rule_fields} == rule_fields
        assert section.__dataclass_fields__.keys() - section.__annotations__.keys() == set(
            rule_fields
        )  # the section declares only its own fields


def _defaults(fn, names):
    params = inspect.signature(fn).parameters
    return {n: params[n].default for n in names}


def test_core_forms_take_the_rule_whole_with_its_defaults():
    """The HOLA and CMS core forms take ``rule=`` (default: the rule's defaults, SPEC §5 / §3.3)
    and none of the rule's fields as a keyword of their own."""
    forms = {
        HolaRule: (
            core_hola.hola_forward,
            core_hola_decode.hola_recurrent,
            core_hola_decode.hola_decode_step,
            hola_reference,
        ),
        CMSRule: (core_cms.cms_online,),
    }
    for rule, fns in forms.items():
        fields = {f.name for f in dataclasses.fields(rule)}
        for fn in fns:
            assert _defaults(fn, ["rule"]) == {"rule": rule()}, fn.__name__
            assert not fields & set(inspect.signature(fn).parameters), fn.__name__


# --------------------------------------------------------------------------------------------------
# the sections' values reach the rules


def test_rules_carry_the_section_values():
    h = HolaOptions(window=3, block_size=4, eviction="recency", read_norm="l2", gate_init=1.0)
    assert _rule_part(h, HolaRule) == HolaRule(
        window=3, block_size=4, eviction="recency", read_norm="l2"
    )
    c = CMSOptions(periods=(2, 8), variant="nested", online_lr=0.5, online_inner="dgd")
    assert _rule_part(c, CMSRule) == CMSRule(
        periods=(2, 8), variant="nested", online_lr=0.5, online_inner="dgd"
    )
    assert ProteusOptions(blocks=4, context_len=64).rule() == ProteusRule(4, 64)


def test_rules_are_frozen_and_hashable():
    listed = CMSRule(periods=[1, 2], online_lr=[0.1, 0.2])  # lists become tuples (hashable)
    sections = (HolaOptions(), CMSOptions(periods=[1, 2]))
    for rule in (HolaRule(), CMSRule(), ProteusRule(), listed, *sections):
        hash(rule)  # a valid jit static
        field = dataclasses.fields(rule)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(rule, field, getattr(rule, field))
    assert listed == CMSRule(periods=(1, 2), online_lr=(0.1, 0.2))
    assert CMSOptions(periods=[1, 2]).periods == (1, 2)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: HolaRule(window=0), r"^HolaRule\.window: must be a positive int"),
        (lambda: HolaRule(block_size=True), r"^HolaRule\.block_size: must be a positive int"),
        (lambda: HolaRule(eviction="lru"), r"^HolaRule\.eviction: unknown 'lru'"),
        (lambda: HolaRule(read_norm="ln"), r"^HolaRule\.read_norm: unknown 'ln'"),
        (lambda: HolaRule(scale=0.0), r"^HolaRule\.scale: must be None"),
        (lambda: HolaRule(cache_scale="1"), r"^HolaRule\.cache_scale: must be None"),
        (lambda: CMSRule(variant="parallel"), r"^CMSRule\.variant: unknown 'parallel'"),
        (lambda: CMSRule(periods=(4, 1)), r"^CMSRule\.periods: must be strictly increasing"),
        (lambda: CMSRule(periods=()), r"^CMSRule\.periods: must be a non-empty tuple"),
        (lambda: CMSRule(periods=(2, 3), variant="nested"), r"^CMSRule\.periods: for variant"),
        (lambda: CMSRule(online_lr=0.0), r"^CMSRule\.online_lr: must be a float > 0"),
        (lambda: CMSRule(online_lr=(0.1, 0.2)), r"^CMSRule\.online_lr: one rate per level \(3\)"),
        (lambda: CMSRule(online_inner="adam"), r"^CMSRule\.online_inner: unknown 'adam'"),
        (lambda: CMSRule(remat_every=0), r"^CMSRule\.remat_every: must be None or a positive"),
        (lambda: ProteusRule(blocks=0), r"^ProteusRule\.blocks: must be an int >= 1"),
        (lambda: ProteusRule(context_len=-1), r"^ProteusRule\.context_len: must be an int >= 0"),
        (lambda: ProteusRule(blocks=4), r"^ProteusRule\.context_len: must be > 0"),
        (lambda: HopeRule(chunk_memory=0), r"^HopeRule\.chunk_memory: must be an int >= 1"),
        (lambda: HopeRule(chunk_memory=16, chunk_other=3), r"^HopeRule\.chunk_memory: chunk_me"),
        (lambda: HopeRule(chunk_memory=16, grad_horizon=8), r"^HopeRule\.grad_horizon: must be"),
        (lambda: HopeRule(step="newton"), r"^HopeRule\.step: unknown 'newton'"),
        (lambda: HopeRule(dgd_target="u"), r"^HopeRule\.dgd_target: unknown 'u'"),
        (lambda: HopeRule(decay=1), r"^HopeRule\.decay: expected bool"),
        (lambda: HopeRule(eta_max=0.0), r"^HopeRule\.eta_max: must be in \(0, 1\]"),
        (lambda: HopeRule(eta_max=1.5), r"^HopeRule\.eta_max: must be in \(0, 1\]"),
        (lambda: HopeRule(grad_clip=-1.0), r"^HopeRule\.grad_clip: must be a float >= 0"),
        (lambda: HopeRule(remat_levels=1), r"^HopeRule\.remat_levels: must be an int >= 2"),
        (lambda: HopeRule(remat_levels=3, remat_every=4), r"^HopeRule\.remat_levels: 3 nested"),
        (lambda: HopeRule(momentum_coef=1.0), r"^HopeRule\.momentum_coef: must be in \[0, 1\)"),
        # a section reports its own name and its config field names
        (lambda: HopeOptions(remat=None), r"^HopeOptions\.remat: expected bool"),
        (lambda: ProteusOptions(blocks=4), r"^ProteusOptions\.context_len: must be > 0"),
        (lambda: HolaOptions(window=0), r"^HolaOptions\.window: must be a positive int"),
        (lambda: HolaOptions(eviction="lru"), r"^HolaOptions\.eviction: unknown 'lru'"),
        (lambda: CMSOptions(online_lr=0.0), r"^CMSOptions\.online_lr: must be a float > 0"),
        (lambda: CMSOptions(online_lr=(0.1,) * 2), r"^CMSOptions\.online_lr: one rate per level"),
        (lambda: CMSOptions(online_inner="adam"), r"^CMSOptions\.online_inner: unknown 'adam'"),
        (lambda: CMSOptions(remat_every=0), r"^CMSOptions\.remat_every: must be None or a pos"),
        (lambda: HolaOptions(scale=-1.0), r"^HolaOptions\.scale: must be None"),
        (lambda: CMSOptions(periods=(2, 3), variant="nested"), r"^CMSOptions\.periods: for var"),
    ],
)
def test_bad_fields_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --------------------------------------------------------------------------------------------------
# ops take the rule


def test_hola_step_checks_the_state_against_the_rule():
    B, H, K = 1, 2, 4
    state = ops_hola.init_hola_state(B, H, K, K, 3, 4)
    x = jnp.zeros((B, H, K), jnp.float32)
    s = jnp.zeros((B, H), jnp.float32)
    par = ops_hola.HolaReadParams(
        jnp.ones((H, K)), jnp.ones((H, K)), jnp.zeros((H,)), jnp.zeros((H,))
    )
    o, _ = ops_hola.hola_step(state, x, x, x, s, s, par, rule=HolaRule(window=3, block_size=4))
    assert o.shape == (B, H, K)
    with pytest.raises(ValueError, match=r"^hola_decode_step: state holds window=3, block_size=4"):
        ops_hola.hola_step(state, x, x, x, s, s, par, rule=HolaRule())


def test_cms_forward_needs_one_period_per_level():
    d, h = 4, 6
    lv = ops_cms.CMSLevel(w_up=jnp.zeros((d, h)), w_down=jnp.zeros((h, d)))
    x = jnp.ones((1, 3, d))
    y = ops_cms.cms_forward((lv, lv), x, rule=CMSRule(periods=(1, 2)))
    np.testing.assert_array_equal(y, x)  # zero levels: the residual only
    with pytest.raises(ValueError, match=r"^cms_forward: rule\.periods has 3 entries"):
        ops_cms.cms_forward((lv, lv), x, rule=CMSRule())


def test_proteus_key_rows_takes_the_rule():
    B, T, H, K, E, N = 2, 9, 2, 8, 4, 8  # Δ = 2
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32) for _ in range(2))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    gq, gk = ops_linear.proteus_key_rows(q, k, pos, rule=ProteusRule(E, N))
    mask = proteus_key_mask(pos + 1, N, E, K, bool)[:, :, None, :]
    np.testing.assert_array_equal(gq, jnp.where(mask, q, 0.0))
    np.testing.assert_array_equal(gk, jnp.where(mask, k, 0.0))
    same_q, same_k = ops_linear.proteus_key_rows(q, k, pos, rule=ProteusRule())  # E = 1: off
    assert same_q is q and same_k is k


# --------------------------------------------------------------------------------------------------
# layers hand their section (a rule) over whole


def test_layers_hold_the_rule_of_their_section():
    opts = HolaOptions(window=3, block_size=4)
    hola = HolaMixer(16, 2, 8, opts, chunk_size=8, rngs=nnx.Rngs(0))
    assert hola.opts is opts and isinstance(hola.opts, HolaRule) and hola.chunk_size == 8
    assert hola.init_cache(1, 64).state.cache_k.shape == (1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"^opts: expected a HolaOptions"):
        HolaMixer(16, 2, 8, HolaRule(), rngs=nnx.Rngs(0))
    opts = CMSOptions(periods=(1, 4), variant="independent", online_lr=0.5)
    ffn = CMSFFN(8, 12, opts, rngs=nnx.Rngs(0))
    assert ffn.opts is opts and isinstance(ffn.opts, CMSRule)
    assert len(ffn.levels) == 2 and ffn.mix_logits is not None
    with pytest.raises(ValueError, match=r"^opts: expected a CMSOptions"):
        CMSFFN(8, 12, CMSRule(), rngs=nnx.Rngs(0))


def test_hope_eta_init_must_sit_below_its_cap():
    assert HopeOptions(eta_max=0.5, eta_init=0.1).eta_max == 0.5
    with pytest.raises(ValueError, match=r"^HopeOptions\.eta_init: must be below eta_max=0\.05"):
        HopeOptions(eta_max=0.05)
