"""The argument convention of every rule (SPEC §0; ``nested_jax/core/README.md`` §0).

A **sequence form** takes its per-token inputs ``[B, T, ...]`` first (positional), its parameters
next, and the state as the keyword-only ``initial_state=`` (required in practice by the MLP
memories, which have no zero state); it returns ``(output, final_state)``. A **step form**
(``*_step``) takes ``state`` first. The test reads the signatures (``inspect.signature``) of the
public names of ``nested_jax.core``, ``nested_jax.ops`` (and its modules), the reference twins and
the two module-level sequence forms the ops reach; a new public function with a ``state`` /
``initial_state`` parameter must be classified here (``HELPERS``), so none is forgotten.

Run against the package as it was before this convention (issue 18), 29 of these cases fail:
``test_sequence_forms_take_initial_state_as_keyword`` for the 17 functions whose state was
positional (``titans_mlp_*``, ``proteus_titans_mlp_*``, ``hope_chunked`` / ``_recurrent``,
``proteus_hope_*``, ``hope_decode`` of core and ops, ``titans_memory``, ``hope_memories``,
``titans_memory_sequence``, ``proteus_hope_packed``, the twins ``chunk_rule``,
``per_token_rule``, ``hope_reference``), and ``test_step_forms_take_state_first`` for
``hope_step``, ``proteus_hope_step``, ``hope_decode_step`` and ``titans_memory_step``
(``cache`` first); several are reached through two modules.
"""

from __future__ import annotations

import inspect

import pytest

import nested_jax.core as core
import nested_jax.ops as ops
from nested_jax.core.associative import reference as ref_associative
from nested_jax.core.hola import reference as ref_hola
from nested_jax.core.hope import proteus as proteus_hope
from nested_jax.core.hope import reference as ref_hope
from nested_jax.core.titans import memory as titans_memory
from nested_jax.core.titans import reference as ref_titans

# Where the public names live: (label, module, names).
SOURCES = [
    ("core", core, core.__all__),
    ("ops", ops, ops.__all__),
    *(
        (f"ops.{m}", getattr(ops, m), getattr(ops, m).__all__)
        for m in ops.__all__
        if inspect.ismodule(getattr(ops, m))
    ),  # fmt: skip
    ("core.titans.memory", titans_memory, titans_memory.__all__),
    ("core.hope.proteus", proteus_hope, proteus_hope.__all__),
    ("core.titans.reference", ref_titans, ("chunk_rule", "per_token_rule")),
    ("core.hope.reference", ref_hope, ref_hope.__all__),
    ("core.hola.reference", ref_hola, ("hola_reference",)),
    ("core.associative.reference", ref_associative, ref_associative.__all__),
]

# Sequence forms whose names do not end in _chunked / _recurrent, listed explicitly.
EXTRA_SEQUENCE = {
    "hope_decode",  # T cached tokens: initial_state is a HopeDecodeState (state, snapshot, n)
    "hola_forward",
    "gdn_residuals",
    "hola_scores",
    "cms_online",
    "linear_attention",
    "delta_rule",
    "gated_delta",
    "lstm",
    "proteus_gated_delta",
    "titans_memory",
    "hope_memories",
    "hola",
    "titans_memory_sequence",
    "proteus_hope_packed",
    "chunk_rule",
    "per_token_rule",
    "hope_reference",
    "associative_reference",
}

# Public functions with a ``state`` / ``initial_state`` parameter that are not rules, or rules
# that do not follow the convention, each with the reason.
HELPERS = {
    "proteus_gated_step": "combinator: the user's step function comes first, then its state",
    "proteus_gate": "elementwise g ⊙ state of any state pytree",
    "proteus_hope_masks": "builds the mask tree shaped like a Hope state",
    "run_proteus_spans": "span driver over user callables; the state is the scan carry",
    "run_proteus_spans_packed": "span driver over user callables; the state is the scan carry",
    "hola_reference": "float64 numpy twin of hola_forward from the zero state (no streaming)",
}


def _functions():
    """``{(label, name): callable}`` of every public function (classes and constants dropped)."""
    out = {}
    for label, mod, names in SOURCES:
        for name in names:
            obj = getattr(mod, name)
            if callable(obj) and not inspect.isclass(obj) and not inspect.ismodule(obj):
                out[(label, name)] = obj
    return out


FUNCS = _functions()
SEQUENCE = sorted(
    key
    for key in FUNCS
    if key[1] not in HELPERS
    and (key[1].endswith(("_chunked", "_recurrent")) or key[1] in EXTRA_SEQUENCE)
)
STEP = sorted(key for key in FUNCS if key[1].endswith("_step") and key[1] not in HELPERS)


def _ids(keys):
    return [f"{label}.{name}" for label, name in keys]


def test_the_lists_name_existing_functions():
    """No stale entry: every explicit name is a public function somewhere above, and the walk
    finds the forms it must (the step and sequence forms of every rule family)."""
    names = {name for _, name in FUNCS}
    assert not (EXTRA_SEQUENCE | set(HELPERS)) - names, (EXTRA_SEQUENCE | set(HELPERS)) - names
    assert len(SEQUENCE) >= 40 and len(STEP) >= 15, (len(SEQUENCE), len(STEP))


@pytest.mark.parametrize("key", SEQUENCE, ids=_ids(SEQUENCE))
def test_sequence_forms_take_initial_state_as_keyword(key):
    params = inspect.signature(FUNCS[key]).parameters
    positional = [
        p.name
        for p in params.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    assert not {"state", "initial_state"} & set(positional), f"positional state: {positional}"
    assert "initial_state" in params, f"no initial_state keyword: {list(params)}"
    assert params["initial_state"].kind is inspect.Parameter.KEYWORD_ONLY
    assert (
        params["initial_state"].default is None
    )  # None: zeros, or a ValueError naming the builder


@pytest.mark.parametrize("key", STEP, ids=_ids(STEP))
def test_step_forms_take_state_first(key):
    first = next(iter(inspect.signature(FUNCS[key]).parameters.values()))
    assert first.name == "state" and first.kind is first.POSITIONAL_OR_KEYWORD, first


def test_every_function_with_a_state_is_classified():
    """A public function taking ``state`` / ``initial_state`` is a sequence form, a step form or
    a listed helper (so a new rule cannot miss the convention)."""
    classified = set(SEQUENCE) | set(STEP)
    stray = sorted(
        f"{label}.{name}"
        for (label, name), fn in FUNCS.items()
        if {"state", "initial_state"} & set(inspect.signature(fn).parameters)
        and (label, name) not in classified
        and name not in HELPERS
    )
    assert not stray, stray
