"""nested_jax.ops.hola / ops.cms: the one door to HOLA (SPEC §5) and CMS (SPEC §3.3).

Each op routes to the named core form bit for bit (the same traced program, values and gradients),
the two HOLA forms agree with each other (values, final state and gradients), decoding token by
token equals the sequence form, a config section passed as the rule is the core form with the
equivalent rule, and an ``impl`` that cannot run raises ``ValueError`` naming the op. The layers
import no core module.
"""

import ast
import dataclasses
import functools
import importlib
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax import rules
from nested_jax.core.cms import levels as core_cms_levels
from nested_jax.core.cms import online as core_cms
from nested_jax.core.hola import decode as core_hola_decode
from nested_jax.core.hola import forward as core_hola
from nested_jax.layers.options import CMSOptions, HolaOptions

# The modules themselves (a package-level re-export of the function ``hola`` would shadow the
# attribute ``nested_jax.ops.hola``; ``import_module`` reads ``sys.modules``).
ops_cms = importlib.import_module("nested_jax.ops.cms")
ops_hola = importlib.import_module("nested_jax.ops.hola")

# Awkward sizes: T is not a multiple of the block (C = 8) nor of the chunk (16); w < C; K ≠ V.
B, T, H, K, V = 2, 29, 2, 6, 5
C, W, CHUNK = 8, 3, 16
SEQ = ("q", "k", "v", "g", "beta")
PAR = ("gamma_q", "gamma_k", "sink_logit", "gate_logit")


def _l2(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _hola_inputs(seed=0):
    rng = np.random.default_rng(seed)
    f = np.float32
    x = dict(
        q=_l2(rng.normal(size=(B, T, H, K))).astype(f),
        k=_l2(rng.normal(size=(B, T, H, K))).astype(f),
        v=rng.normal(size=(B, T, H, V)).astype(f),
        g=-rng.uniform(0.01, 0.5, size=(B, T, H)).astype(f),
        beta=rng.uniform(0.0, 1.0, size=(B, T, H)).astype(f),
    )
    p = dict(
        gamma_q=rng.uniform(0.5, 2.0, size=(H, K)).astype(f),
        gamma_k=rng.uniform(0.5, 2.0, size=(H, K)).astype(f),
        sink_logit=rng.normal(size=(H,)).astype(f),
        gate_logit=rng.normal(size=(H,)).astype(f),
    )
    return x, p


RULE = ops_hola.HolaRule(window=W, block_size=C, eviction="beta_e", read_norm="rmsnorm")


def _same_program(f, g, *args):
    """``f`` and ``g`` trace to the same jaxpr: the same program, so equal bit for bit."""
    assert str(jax.make_jaxpr(f)(*args)) == str(jax.make_jaxpr(g)(*args))


def _grad_of(fn, w):
    """``∇ Σ w ⊙ o`` of ``o, _ = fn(*args)`` w.r.t. every input."""
    return jax.grad(lambda args: jnp.sum(fn(*args)[0] * w))


@functools.cache
def _fwd(impl):
    """Jitted ``ops.hola`` (one compile per ``impl``, shared by the tests)."""
    return jax.jit(functools.partial(ops_hola.hola, rule=RULE, chunk_size=CHUNK, impl=impl))


@functools.cache
def _vjp(impl):
    """Jitted ``(o, ∇_args Σ w ⊙ o)`` of ``ops.hola``."""
    fn = functools.partial(ops_hola.hola, rule=RULE, chunk_size=CHUNK, impl=impl)

    def run(args, w):
        (o, state), vjp = jax.vjp(lambda a: fn(*a), args)
        return o, vjp((w, jax.tree.map(jnp.zeros_like, state)))[0]

    return jax.jit(run)


def _args(x, p):
    """``(q, k, v, g, β, HolaReadParams)``: the positional arguments of ``ops.hola``."""
    return tuple(x[n] for n in SEQ) + (ops_hola.HolaReadParams(*(p[n] for n in PAR)),)


_W = np.random.default_rng(2).normal(size=(B, T, H, V)).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# HOLA


def test_hola_chunked_is_core_forward_values_and_gradients():
    args = _args(*_hola_inputs())
    ops_fn = functools.partial(ops_hola.hola, rule=RULE, chunk_size=CHUNK, impl="chunked")
    core_fn = functools.partial(core_hola.hola_forward, rule=RULE, chunk_size=CHUNK)
    _same_program(ops_fn, core_fn, *args)
    _same_program(_grad_of(ops_fn, _W), _grad_of(core_fn, _W), args)
    rec_fn = functools.partial(ops_hola.hola, rule=RULE, impl="recurrent")
    _same_program(rec_fn, functools.partial(core_hola_decode.hola_recurrent, rule=RULE), *args)


def _rule_part(section, rule_cls):
    """The rule a config section stands for: its ``rule_cls`` fields, as a plain rule."""
    return rule_cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(rule_cls)})


def test_hola_options_passed_to_the_op_is_core_with_the_equivalent_rule():
    """A ``HolaOptions`` (the ``model.hola`` section, which the layer hands over whole) given to
    ``ops.hola`` / ``ops.hola_step`` is the core form called with the plain ``HolaRule`` of the same
    fields: the same program, the same values."""
    opts = HolaOptions(window=W, block_size=C, eviction="recency", read_norm="l2", gate_init=-1.0)
    rule = _rule_part(opts, ops_hola.HolaRule)
    assert type(rule) is ops_hola.HolaRule and rule == ops_hola.HolaRule(
        window=W, block_size=C, eviction="recency", read_norm="l2"
    )
    args = _args(*_hola_inputs(3))
    ops_fn = functools.partial(ops_hola.hola, rule=opts, chunk_size=CHUNK)
    core_fn = functools.partial(core_hola.hola_forward, rule=rule, chunk_size=CHUNK)
    _same_program(ops_fn, core_fn, *args)
    o_ops, s_ops = jax.jit(ops_fn)(*args)
    o_core, s_core = jax.jit(core_fn)(*args)
    np.testing.assert_array_equal(o_ops, o_core)
    chex.assert_trees_all_equal(s_ops, s_core)
    one = tuple(a[:, 0] for a in args[:5]) + args[5:]
    _same_program(
        functools.partial(ops_hola.hola_step, rule=opts),
        functools.partial(core_hola_decode.hola_decode_step, rule=rule),
        ops_hola.init_hola_state(B, H, K, V, W, C),
        *one,
    )


def test_hola_recurrent_equals_chunked_values_and_state():
    args = _args(*_hola_inputs())
    o_c, s_c = _fwd("chunked")(*args)
    o_r, s_r = _fwd("recurrent")(*args)
    np.testing.assert_allclose(o_r, o_c, atol=2e-5, rtol=1e-4)
    chex.assert_trees_all_close(s_r, s_c, atol=2e-5, rtol=1e-4)


@pytest.mark.slow  # two backward compiles (~25 s CPU)
def test_hola_recurrent_equals_chunked_gradients():
    args = _args(*_hola_inputs())
    o_c, g_c = _vjp("chunked")(args, _W)
    o_r, g_r = _vjp("recurrent")(args, _W)
    np.testing.assert_allclose(o_r, o_c, atol=2e-5, rtol=1e-4)
    chex.assert_trees_all_close(g_r, g_c, atol=5e-5, rtol=1e-4)
    assert np.abs(np.asarray(g_c[0])).max() > 0  # gradients reach q


@pytest.mark.slow  # two more compiles (~6 s CPU)
def test_hola_recurrent_continues_a_chunked_state():
    args = _args(*_hola_inputs())
    o_c, s_c = _fwd("chunked")(*args)
    t0 = 13  # mid-block: the state carries a partly filled block buffer
    head = tuple(a[:, :t0] for a in args[:5]) + args[5:]
    tail = tuple(a[:, t0:] for a in args[:5]) + args[5:]
    _, s_head = _fwd("chunked")(*head)
    o_tail, s_tail = _fwd("recurrent")(*tail, initial_state=s_head)
    np.testing.assert_allclose(o_tail, o_c[:, t0:], atol=2e-5, rtol=1e-4)
    chex.assert_trees_all_close(s_tail, s_c, atol=2e-5, rtol=1e-4)


def test_hola_step_token_by_token_equals_the_sequence_form():
    x, p = _hola_inputs()
    o_seq, s_seq = _fwd("chunked")(*_args(x, p))
    ops_step = functools.partial(ops_hola.hola_step, rule=RULE)
    step = jax.jit(ops_step)
    state = ops_hola.init_hola_state(B, H, K, V, W, C)
    assert isinstance(state, ops_hola.HolaState)
    params = _args(x, p)[-1]
    one = [x[n][:, 0] for n in SEQ] + [params]
    core_step = functools.partial(core_hola_decode.hola_decode_step, rule=RULE)
    _same_program(ops_step, core_step, state, *one)
    outs = []
    for t in range(T):
        o_t, state = step(state, *[x[n][:, t] for n in SEQ], params)
        outs.append(o_t)
    np.testing.assert_allclose(np.stack(outs, axis=1), o_seq, atol=2e-5, rtol=1e-4)
    chex.assert_trees_all_close(state, s_seq, atol=2e-5, rtol=1e-4)


def test_hola_reexports_are_core_names():
    assert ops_hola.EVICTIONS == rules.EVICTIONS
    assert ops_hola.READ_NORMS == rules.READ_NORMS
    assert ops_hola.HolaState is core_hola_decode.HolaState
    assert ops_hola.HolaReadParams is core_hola_decode.HolaReadParams
    assert ops_hola.HolaRule is rules.HolaRule
    assert ops_hola.__all__ == ["hola", "hola_step"]  # the module lists what it defines


# --------------------------------------------------------------------------------------------------
# CMS


def _cms_setup(k=2, d=4, h=6, t=13):
    """``k`` SwiGLU levels ``[d, h]``, inputs and targets ``[B, t, d]`` (numpy: nothing to
    compile)."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return (0.5 / np.sqrt(shape[0]) * rng.normal(size=shape)).astype(np.float32)

    levels = tuple(ops_cms.CMSLevel(w_up=w(d, h), w_down=w(h, d), w_gate=w(d, h)) for _ in range(k))
    x, target = (0.5 * rng.normal(size=(B, t, d)).astype(np.float32) for _ in range(2))
    return levels, x, target


@pytest.mark.parametrize("variant", ["sequential", "nested", "independent"])
def test_cms_forward_is_core(variant):
    levels, x, _ = _cms_setup()
    mix = np.array([0.3, -0.2], np.float32) if variant == "independent" else None

    def ops_fn(lv, xx):
        rule = ops_cms.CMSRule(periods=(1, 2), variant=variant)
        return ops_cms.cms_forward(lv, xx, rule=rule, mix_logits=mix, impl="chunked")

    def core_fn(lv, xx):
        return core_cms_levels.cms_forward(lv, xx, variant=variant, mix_logits=mix)

    _same_program(ops_fn, core_fn, levels, x)


def test_cms_online_is_core():
    levels, x, target = _cms_setup()

    def sq_loss(y, side):
        return 0.5 * jnp.sum(jnp.square(y - side), axis=-1)

    rule = ops_cms.CMSRule(periods=(2, 4), online_lr=(0.1, 0.05), online_inner="dgd")
    kw = dict(delta_fn=ops_cms.surprise_from_loss(sq_loss), side=target)
    _same_program(
        lambda lv, xx: ops_cms.cms_online(lv, xx, rule=rule, **kw),
        lambda lv, xx: core_cms.cms_online(lv, xx, rule=rule, **kw),
        levels,
        x,
    )
    assert ops_cms.CMSState is core_cms.CMSState
    assert ops_cms.check_periods((2, 4)) == (2, 4)
    assert (
        ops_cms.VARIANTS == core_cms_levels.VARIANTS
        and ops_cms.CMSLevel is core_cms_levels.CMSLevel
    )
    assert ops_cms.__all__ == ["cms_forward", "cms_online"]  # the module lists what it defines


def test_cms_options_passed_to_the_op_is_core_with_the_equivalent_rule():
    """A ``CMSOptions`` (the ``model.cms`` section; its ``online_lr`` / ``online_inner`` are the
    rule's fields) given to ``ops.cms_online`` / ``ops.cms_forward`` is the core form called with
    the plain ``CMSRule`` of the same fields: the same program, the same values."""
    levels, x, target = _cms_setup()
    opts = CMSOptions(
        periods=(2, 4), variant="independent", online_lr=0.1, online_inner="dgd", remat_every=1,
        hidden=6, mode="online",
    )  # fmt: skip
    rule = _rule_part(opts, ops_cms.CMSRule)
    assert type(rule) is ops_cms.CMSRule and rule == ops_cms.CMSRule(
        periods=(2, 4), variant="independent", online_lr=0.1, online_inner="dgd", remat_every=1
    )
    mix = np.array([0.3, -0.2], np.float32)
    kw = dict(delta=np.sin(x), mix_logits=mix)
    ops_fn = functools.partial(ops_cms.cms_online, rule=opts, **kw)
    core_fn = functools.partial(core_cms.cms_online, rule=rule, **kw)
    _same_program(ops_fn, core_fn, levels, x)
    y_ops, st_ops = ops_fn(levels, x)
    y_core, st_core = core_fn(levels, x)
    np.testing.assert_array_equal(y_ops, y_core)
    chex.assert_trees_all_equal(st_ops, st_core)
    _same_program(
        lambda lv, xx: ops_cms.cms_forward(lv, xx, rule=opts, mix_logits=mix),
        lambda lv, xx: core_cms_levels.cms_forward(lv, xx, variant=rule.variant, mix_logits=mix),
        levels,
        x,
    )


# --------------------------------------------------------------------------------------------------
# impl errors


def _calls():
    x, p = _hola_inputs()
    seq = _args(x, p)
    one = tuple(a[:, 0] for a in seq[:5]) + seq[5:]
    s0 = ops_hola.init_hola_state(B, H, K, V, W, C)
    levels, xc, _ = _cms_setup()
    cms_rule = ops_cms.CMSRule(periods=(2, 4))
    return {
        "hola": lambda impl: ops_hola.hola(*seq, rule=RULE, impl=impl),
        "hola_step": lambda impl: ops_hola.hola_step(s0, *one, rule=RULE, impl=impl),
        "cms_forward": lambda impl: ops_cms.cms_forward(levels, xc, rule=cms_rule, impl=impl),
        "cms_online": lambda impl: ops_cms.cms_online(
            levels, xc, rule=cms_rule, delta=np.zeros_like(xc), impl=impl
        ),
    }


@pytest.mark.parametrize("impl", ["pallas", "bogus"])
def test_unavailable_impls_raise_naming_the_op(impl):
    for op, call in _calls().items():
        if impl == "pallas" and op.startswith("hola"):
            continue  # HOLA's state path runs on the gated delta kernel (tests/pallas_kernels)
        with pytest.raises(ValueError, match=f"^{op}: impl"):
            call(impl)


def test_no_recurrent_cms_and_no_packed_recurrent_hola():
    calls = _calls()
    for op in ("cms_forward", "cms_online"):
        with pytest.raises(ValueError, match=f"^{op}: impl='recurrent'"):
            calls[op]("recurrent")
    seq = _args(*_hola_inputs())
    seg = np.zeros((B, T), np.int32)
    with pytest.raises(ValueError, match="^hola: impl='recurrent'.*segment_ids"):
        ops_hola.hola(*seq, rule=RULE, segment_ids=seg, impl="recurrent")


# --------------------------------------------------------------------------------------------------
# the door


@pytest.mark.parametrize("name", ["hola", "cms", "options"])
def test_layers_import_no_core_module(name):
    path = Path(__file__).resolve().parents[2] / "nested_jax" / "layers" / f"{name}.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("nested_jax.core"), (name, node.module)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("nested_jax.core") for a in node.names), name
