"""``TitansRule`` (SPEC §2): one frozen value from the YAML section to the core form.

The rule's defaults are the paper's rule and the core forms' default (``rule=TitansRule()``), and
the default core form equals the twin (``core.titans.reference``); ``TitansOptions`` (the
``model.titans`` section) *is* the rule plus the layer's fields, re-declaring only its training
defaults; the options a layer holds reach the op whole and give their training behaviour.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nested_jax.core as core
from nested_jax import ops
from nested_jax.core.titans import reference as ref
from nested_jax.layers.options import TitansOptions
from nested_jax.layers.titans import NeuralMemory
from nested_jax.ops import titans as ops_titans
from nested_jax.rules import TITANS_ACTIVATIONS, TitansRule

B, T, H, D, HID = 2, 37, 2, 6, 8  # T = 37: two whole chunks of 16 and a short one


def _inputs(seed=0, value_scale=1.0):
    r = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    q, k = (unit(r.normal(size=(B, T, H, D))) for _ in range(2))
    v = value_scale * r.normal(size=(B, T, H, D))
    gates = (r.uniform(0.05, 0.3, (B, T, H)), r.uniform(0.1, 0.9, (B, T, H)),
             r.uniform(0.01, 0.2, (B, T, H)))  # fmt: skip
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, *gates))


def _state(seed=1, dims=(D, HID, D)):
    return core.titans_mlp_state(core.titans_mlp_init_weights(jax.random.key(seed), H, dims), B)


def _close(a, b, tol=1e-4):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = max(1.0, float(np.max(np.abs(y))))
        assert float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) <= tol * scale


# --------------------------------------------------------------------------------------------------
# the rule


def test_defaults_are_the_papers_rule():
    rule = TitansRule()
    assert (rule.memory_chunk, rule.read_before_write, rule.per_chunk_gates) == (16, False, False)
    assert (rule.grad_clip, rule.activation, rule.grad_horizon, rule.remat) == (
        0.0, "silu", 0, True,
    )  # fmt: skip
    hash(rule)  # a jit static
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.memory_chunk = 4  # type: ignore[misc]
    assert set(TITANS_ACTIVATIONS) <= set(core.titans.net.ACTIVATIONS)
    assert core.TitansRule is ops.TitansRule is ops_titans.TitansRule is TitansRule  # one class


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("memory_chunk", 0, "must be an int >= 1"),
        ("memory_chunk", 2.0, "must be an int >= 1"),
        ("grad_horizon", -1, "must be an int >= 0"),
        ("read_before_write", 1, "expected bool"),
        ("per_chunk_gates", None, "expected bool"),
        ("remat", "yes", "expected bool"),
        ("grad_clip", -0.5, r"must be a float >= 0 \(0 = off\)"),
        ("grad_clip", None, r"must be a float >= 0 \(0 = off\)"),
        ("activation", "swish", "unknown 'swish'"),
    ],
)
def test_bad_fields_are_named(field, value, match):
    with pytest.raises(ValueError, match=rf"^TitansRule\.{field}: {match}"):
        TitansRule(**{field: value})
    with pytest.raises(ValueError, match=rf"^TitansOptions\.{field}: {match}"):
        TitansOptions(**{field: value})


def test_every_titans_form_defaults_to_the_rule():
    forms = [
        core.titans_linear_step, core.titans_linear_recurrent, core.titans_linear_chunked,
        core.titans_mlp_step, core.titans_mlp_recurrent, core.titans_mlp_chunked,
        core.titans_mlp_apply, core.proteus_titans_linear_step,
        core.proteus_titans_linear_recurrent, core.proteus_titans_linear_chunked,
        core.proteus_titans_mlp_step, core.proteus_titans_mlp_recurrent,
        core.proteus_titans_mlp_chunked, ref.chunk_rule, ref.per_token_rule,
    ]  # fmt: skip
    for fn in forms:
        assert inspect.signature(fn).parameters["rule"].default == TitansRule(), fn.__name__
    assert ops_titans.TitansMemorySpec((D, D)).rule == TitansRule()


# --------------------------------------------------------------------------------------------------
# the default rule is the twin's


def test_default_rule_equals_the_twin_values_and_grads():
    """``titans_mlp_chunked`` / ``titans_linear_chunked`` with ``TitansRule()`` (b = 16, no
    softclamp, read after write) equal ``reference.chunk_rule`` with the same default rule, and
    the per-token forms equal ``reference.per_token_rule``."""
    xs, st = _inputs(), _state()
    wy = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, H, D)), jnp.float32)

    def fast(st, xs):
        y, s = core.titans_mlp_chunked(*xs, initial_state=st)
        return jnp.sum(y * wy), (y, s.weights, s.momentum)

    def twin(st, xs):
        y, (w, m) = ref.chunk_rule(*xs, initial_state=st, residual=True)  # K == V, L = 2
        return jnp.sum(y * wy), (y, w, m)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))  # noqa: E731
    (_, out_f), g_f = grad(fast)(st, xs)
    (_, out_t), g_t = grad(twin)(st, xs)
    _close(out_f, out_t)
    _close(g_f, g_t)

    lin = core.TitansLinearState(st.weights[0][..., :D], st.momentum[0][..., :D])
    o, s = jax.jit(core.titans_linear_chunked)(*xs, initial_state=lin)
    o_t, (w_t, _) = jax.jit(ref.chunk_rule)(*xs, initial_state=((lin.M,), (lin.S,)))
    _close((o, s.M), (o_t, w_t[0]))
    y, s = jax.jit(core.titans_mlp_recurrent)(*xs, initial_state=st)
    y_t, (w_t, _) = jax.jit(
        lambda st, xs: ref.per_token_rule(*xs, initial_state=st, residual=True)
    )(st, xs)
    _close((y, s.weights), (y_t, w_t))


# --------------------------------------------------------------------------------------------------
# the config section is the rule, and reaches the op whole


def test_options_are_the_rule_with_training_defaults():
    assert issubclass(TitansOptions, TitansRule)
    rule_fields = {f.name for f in dataclasses.fields(TitansRule)}
    assert rule_fields <= {f.name for f in dataclasses.fields(TitansOptions)}
    opts, paper = TitansOptions(), TitansRule()
    changed = {n for n in rule_fields if getattr(opts, n) != getattr(paper, n)}
    assert changed == {"grad_clip", "grad_horizon"}
    assert (opts.grad_clip, opts.grad_horizon) == (10.0, 64)


def test_a_layer_passes_its_options_whole():
    opts = TitansOptions(memory_chunk=4, segment_len=8, memory_hidden=HID)
    mem = NeuralMemory(16, H, D, opts, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert mem.spec.rule is opts


def test_options_through_the_op_give_their_training_behaviour():
    """A config's ``TitansOptions`` (training softclamp ``grad_clip = 10``, here
    ``grad_horizon = 8``) passed to ``ops.titans.titans_memory`` runs the core form with exactly
    those values: large values make the softclamp bind (the paper's rule differs), and no
    gradient of an early key reaches an output past the horizon."""
    opts = TitansOptions(memory_chunk=4, segment_len=8, grad_horizon=8)
    training = TitansRule(memory_chunk=4, grad_clip=10.0, grad_horizon=8)
    xs, st = _inputs(3, value_scale=5.0), _state(4)
    spec = ops_titans.TitansMemorySpec((D, HID, D), rule=opts)

    def via_op(xs):
        return ops_titans.titans_memory(*xs, spec=spec, initial_state=st)[0]

    def via_core(xs, rule):
        return core.titans_mlp_chunked(*xs, initial_state=st, rule=rule)[0]

    y_op = jax.jit(via_op)(xs)
    np.testing.assert_array_equal(y_op, jax.jit(via_core, static_argnums=1)(xs, training))
    paper = jax.jit(via_core, static_argnums=1)(xs, TitansRule(memory_chunk=4))
    # the softclamp binds from the first chunk on (later, the unclamped memory runs away)
    first = paper[:, :4]
    assert bool(jnp.isfinite(first).all()) and float(jnp.max(jnp.abs(y_op[:, :4] - first))) > 1e-2

    def last_out(k0):
        k = xs[1].at[:, 0].set(k0)
        return jnp.sum(via_op((xs[0], k, *xs[2:]))[:, -1])

    assert float(jnp.max(jnp.abs(jax.grad(last_out)(xs[1][:, 0])))) == 0.0  # cut at t = 8, …
