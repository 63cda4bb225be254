"""ops.hope (SPEC §3.2 Hope, §4 Proteus): the one door of the Hope mixer.

``impl="chunked"`` is bit for bit the core path the layer ran before (``hope_chunked``,
``proteus_hope_chunked`` and the packed-rows span runner), values and gradients at T = 13;
``impl="recurrent"`` (the per-token twin) equals it to rounding; decoding through the op equals the
sequence form token by token, plain and under Proteus (the layer tests check the packed-row
semantics through the op: documents alone, row positions); a ``HopeOptions`` passed as the rule
runs its training defaults; impl and decode checks name the op.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.hope.chunk import hope_chunked
from nested_jax.core.hope.proteus import proteus_hope_chunked, proteus_hope_masks
from nested_jax.core.proteus import (
    proteus_gate,
    proteus_gated_update,
    proteus_spans,
    run_proteus_spans_packed,
)
from nested_jax.layers.options import HopeOptions
from nested_jax.ops import hope as ops_hope
from nested_jax.ops.hope import HopeMemories, HopeReadout, HopeRule, MLPMemory
from nested_jax.rules import ProteusRule

B, T, H, D, HID = 2, 13, 2, 4, 4
# a training-like rule: momentum, the parallel chunk updates, the inner-gradient softclamp
RULE = HopeRule(chunk_memory=4, chunk_other=2, momentum=True, momentum_coef=0.7,
                chunk_updates="parallel", grad_clip=4.0)  # fmt: skip
PROTEUS = dict(proteus=ProteusRule(blocks=4, context_len=16))  # Δ = 4: k = 1, 2, 3, then open
CUT = 8  # a document start: a Proteus span start and a chunk start of both groups


def _setup(adaptive_q=False, seed=0):
    ks = jax.random.split(jax.random.key(seed), 16)
    names = HopeMemories._fields[:5] + (("q",) if adaptive_q else ())
    mems = HopeMemories(
        **{
            n: MLPMemory(
                0.3 * jax.random.normal(ks[i], (H, D, HID)),
                0.3 * jax.random.normal(ks[i + 6], (H, HID, D)),
            )
            for i, n in enumerate(names)
        }
    )
    ro = HopeReadout(
        jax.random.normal(ks[12], (H, D)),
        jnp.full((H,), -1.0),
        jax.random.normal(ks[13], (H, D)),
        jnp.full((H,), 1.0),
    )
    x = jax.random.normal(ks[14], (B, T, H, D))
    q = jax.random.normal(ks[15], (B, T, H, D))
    return mems, ro, x, q


SEG = jnp.asarray(np.repeat([[1] * CUT + [2] * (T - CUT)], B, 0), jnp.int32)


def _state(mems, rule):
    return ops_hope.hope_init_state(mems, B, momentum=rule.momentum)


def _old_packed(x, q, state, readout, rule, segment_ids, n, e):
    """The layer's former packed-rows Proteus path (its closures), verbatim."""
    reset = state

    def call(st, xs, seg, init):
        return hope_chunked(
            xs[0], xs[1], readout, initial_state=st, rule=rule, segment_ids=seg,
            initial_memories=init,
        )  # fmt: skip

    def span_fn(st, xs, seg, active):
        tree = proteus_hope_masks(st, active, e)
        out, cand = call(proteus_gate(st, tree), xs, seg, proteus_gate(reset, tree).memories)
        return out, proteus_gated_update(st, cand, tree)

    def open_fn(st, xs, seg):
        return call(st, xs, seg, reset.memories)

    masks_of = lambda k: proteus_hope_masks(state, k, e)  # noqa: E731
    spans = proteus_spans(x.shape[1], 0, n, e)
    return run_proteus_spans_packed(
        span_fn, open_fn, masks_of, state, reset, (x, q), segment_ids, spans, e
    )


def _core(x, q, state, ro, segment_ids, proteus):
    """What the layer computed before ops.hope, per case."""
    if not proteus:
        return hope_chunked(x, q, ro, initial_state=state, rule=RULE, segment_ids=segment_ids)
    schedule = PROTEUS["proteus"]
    n, e = schedule.context_len, schedule.blocks
    if segment_ids is None:
        return proteus_hope_chunked(
            x, q, ro, initial_state=state, schedule=schedule, t0=0, rule=RULE
        )
    return _old_packed(x, q, state, ro, RULE, segment_ids, n, e)


def _op(x, q, state, ro, segment_ids, proteus, impl="chunked"):
    kw = PROTEUS if proteus else {}
    return ops_hope.hope_memories(
        x, q, ro, initial_state=state, rule=RULE, segment_ids=segment_ids, impl=impl, **kw
    )


def _loss(fn, packed, proteus, **extra):
    """Σ sin(o) + Σ final weights as a function of (x, q, initial memories, readout)."""

    def loss(x, q, mems, ro):
        o, st = fn(x, q, _state(mems, RULE), ro, SEG if packed else None, proteus, **extra)
        return jnp.sum(jnp.sin(o)) + sum(jnp.sum(w) for w in jax.tree.leaves(st.memories))

    return loss


def _close(a, b, tol=2e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())), rtol=0)


@pytest.mark.parametrize(
    "packed, proteus, grad", [(False, False, False), (True, False, False), (False, True, False),
                              (True, True, True)]
)  # fmt: skip
def test_chunked_is_the_former_core_path_bit_for_bit(packed, proteus, grad):
    """The op's program is the program of the core calls the layer made before (plain, packed
    rows, Proteus, Proteus on packed rows; T = 13): equal jaxprs, so equal bits on any backend.
    Tracing only, no compile (CPU budget). The packed Proteus form (the layer's closures moved
    into core) is compared with its gradients (x, q, initial memories, readout); the others are
    one core call each, whose gradients follow from the forward program."""
    mems, ro, x, q = _setup()

    def program(fn, **extra):
        f = _loss(fn, packed, proteus, **extra)
        if grad:
            f = jax.value_and_grad(f, argnums=(0, 1, 2, 3))
        return str(jax.make_jaxpr(f)(x, q, mems, ro))

    assert program(_op, impl="chunked") == program(_core)


def test_recurrent_is_the_per_token_twin_on_packed_proteus_rows():
    """impl="recurrent" (the twin hope_reference at the rule's chunk sizes, run span by span with
    the packed-row resets) equals impl="chunked" to rounding (Proteus, packed rows, T = 13)."""
    mems, ro, x, q = _setup()
    st = _state(mems, RULE)
    op = jax.jit(lambda x, q, impl: _op(x, q, st, ro, SEG, True, impl)[0], static_argnums=2)
    _close(op(x, q, "recurrent"), op(x, q, "chunked"))


@pytest.mark.parametrize(
    "proteus", [pytest.param(False, marks=pytest.mark.slow), True]
)  # plain decoding through the op: also tests/layers/test_hope_layer.py
def test_decode_equals_sequence_form_token_by_token(proteus):
    """Two cached calls of 6 tokens through ops.hope.hope_decode (the second starts mid
    chunk_memory and, with Proteus, mid span; placeholder zeros at n = 0 replaced by the initial
    memories) equal hope_memories on the 12-token row, outputs and final state. Proteus runs with
    adaptive_q (q = M_q(x))."""
    mems, ro, x, q = _setup(adaptive_q=proteus)
    x, q = x[:, :12], None if proteus else q[:, :12]
    rule = dataclasses.replace(RULE, adaptive_q=proteus)
    kw = PROTEUS if proteus else {}
    seq_o, seq_st = jax.jit(
        lambda x, q: ops_hope.hope_memories(
            x, q, ro, initial_state=_state(mems, rule), rule=rule, **kw
        )
    )(x, q)
    zero = jax.tree.map(lambda w: jnp.zeros((B, *w.shape)), mems)
    step = jax.jit(
        lambda x, q, ds: ops_hope.hope_decode(
            x, q, ro, rule=rule, initial_state=ds, initial_memories=mems, **kw
        )
    )
    part = lambda a, i: None if a is None else a[:, 6 * i : 6 * i + 6]  # noqa: E731
    n = jnp.zeros((), jnp.int32)
    ds = ops_hope.HopeDecodeState(ops_hope.HopeState(zero, zero), zero, n)
    o1, ds = step(part(x, 0), part(q, 0), ds)
    o2, (state, snap, n) = step(part(x, 1), part(q, 1), ds)
    assert int(n) == 12
    _close(jnp.concatenate([o1, o2], 1), seq_o)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(seq_st), strict=True):
        _close(a, b)


def test_hope_options_are_the_rule_with_the_training_defaults():
    """A ``HopeOptions`` is the rule the op runs: passed whole, it gives the program of the
    explicit rule its training defaults name (chunks 16 / 4, momentum, remat, the parallel chunk
    updates, the inner-gradient softclamp 4), not the paper's per-token ``HopeRule()``. Tracing
    only (equal jaxprs, so equal bits)."""
    training = HopeRule(chunk_memory=16, chunk_other=4, momentum=True, remat=True,
                        chunk_updates="parallel", grad_clip=4.0)  # fmt: skip
    opts = HopeOptions()
    assert isinstance(opts, HopeRule)
    for f in dataclasses.fields(HopeRule):
        assert getattr(opts, f.name) == getattr(training, f.name), f.name
    assert opts.mu == 0.9 and HopeRule().mu == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.chunk_memory = 4
    mems, ro, x, q = _setup()

    def program(rule, fn=ops_hope.hope_memories):
        st = _state(mems, rule)
        return str(jax.make_jaxpr(lambda x, q: fn(x, q, ro, initial_state=st, rule=rule))(x, q))

    assert program(opts) == program(training)
    assert program(opts, hope_chunked) == program(training, hope_chunked)  # core reads it as well
    assert program(opts) != program(HopeRule(momentum=True))  # the options do change the model


@pytest.mark.parametrize("op", ["hope_memories", "hope_decode"])
@pytest.mark.parametrize("impl", ["pallas", "bogus"])
def test_bad_impl_raises_naming_the_op(op, impl):
    mems, ro, x, q = _setup()
    st = _state(mems, RULE)
    if op == "hope_memories":
        call = functools.partial(
            ops_hope.hope_memories, x, q, ro, initial_state=st, rule=RULE, impl=impl
        )
    else:
        ds = ops_hope.HopeDecodeState(st, st.memories, jnp.zeros((), jnp.int32))
        call = functools.partial(
            ops_hope.hope_decode, x, q, ro, initial_state=ds, rule=RULE, impl=impl
        )
    with pytest.raises(ValueError, match=f"^{op}: impl"):
        call()


def test_rule_checks():
    mems, ro, x, q = _setup()
    horizon = dataclasses.replace(RULE, grad_horizon=4)
    with pytest.raises(ValueError, match=r"^hope_memories: impl='recurrent'.*grad_horizon"):
        ops_hope.hope_memories(
            x, q, ro, initial_state=_state(mems, RULE), rule=horizon, impl="recurrent"
        )
    bad = dataclasses.replace(RULE, chunk_memory=8)  # Δ = 4: 8 does not divide it
    with pytest.raises(ValueError, match=r"^HopeOptions\.chunk_memory: decoding with Proteus"):
        ops_hope.check_hope_decode(bad, **PROTEUS, owner="HopeOptions")
    ops_hope.check_hope_decode(bad)  # no Proteus: any chunk sizes decode
    with pytest.raises(ValueError, match=r"^rule\.chunk_memory: decoding with Proteus"):
        ds = ops_hope.hope_decode_state(mems, B, momentum=RULE.momentum)
        ops_hope.hope_decode(x, q, ro, initial_state=ds, rule=bad, **PROTEUS)
    # The schedule is a ProteusRule, not a pair of ints.
    with pytest.raises(ValueError, match=r"^hope_memories: proteus must be a ProteusRule"):
        ops_hope.hope_memories(
            x, q, ro, initial_state=_state(mems, RULE), rule=RULE, proteus=(4, 16)
        )
    with pytest.raises(ValueError, match=r"^check_hope_decode: proteus must be a ProteusRule"):
        ops_hope.check_hope_decode(RULE, proteus=(4, 16))
    # no zero state: a missing initial_state names the constructor
    with pytest.raises(ValueError, match=r"^hope_memories: initial_state: .*hope_init_state\("):
        ops_hope.hope_memories(x, q, ro, rule=RULE)
    with pytest.raises(ValueError, match=r"^hope_decode: initial_state: .*hope_decode_state\("):
        ops_hope.hope_decode(x, q, ro, rule=RULE)
