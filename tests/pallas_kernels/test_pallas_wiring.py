"""The Pallas gated delta kernel behind ``impl="pallas"`` of HOLA and of the Proteus GDN (issue 16).

``ops.hola(impl="pallas")`` runs HOLA's state path with the kernel and its cache path with XLA;
``ops.linear.proteus_gated_delta(impl="pallas")`` runs the Proteus span form (initial state, static
``t0``, injection tokens) on the kernel; the Proteus GDN layer reaches it through
``ops.proteus_key_rows`` + ``ops.gated_delta``. Each equals ``impl="chunked"`` in f32 to
``TOL`` (max |a − b| / max |b|, per output and per gradient of every input, the initial state
included) at sizes that are not multiples of the chunk, with segment resets where the op takes
them. Interpret mode off TPU, so the shapes are small.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax import ops
from nested_jax.core.hola.forward import HolaKernels, hola_forward
from nested_jax.layers.gdn import GatedDeltaNet
from nested_jax.layers.hola import HolaMixer
from nested_jax.layers.options import HolaOptions
from nested_jax.models.config import PALLAS_MIXERS
from nested_jax.ops._impl import IMPLS
from nested_jax.train.config import load_config

ops_hola = importlib.import_module("nested_jax.ops.hola")  # the module, not the function

TOL = 1e-4
H, K, V = 2, 8, 6  # K ≠ V; small: the kernel is interpreted off TPU
SEQ = ("q", "k", "v", "g", "beta")


def _rel(a, b, floor=1e-2):
    """``max|a − b| / max|b|``; a leaf whose values are all below ``floor`` (the inputs are of
    order one: such a leaf is an analytically zero gradient, e.g. ``g``'s at ``T = 1`` from a zero
    state, where ``"chunked"`` leaves rounding of order 1e-8) is compared absolutely at
    ``TOL · floor``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor))


def _seq(T, *, B=2, seed=0):
    """Unit-norm q, k (as the layers give), ``g < 0``, ``β ∈ (0, 1)``, all f32."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return dict(
        q=unit(jax.random.normal(ks[0], (B, T, H, K))),
        k=unit(jax.random.normal(ks[1], (B, T, H, K))),
        v=jax.random.normal(ks[2], (B, T, H, V)),
        g=-0.5 * jax.nn.softplus(jax.random.normal(ks[3], (B, T, H))),
        beta=jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))),
    )


def _segments(T, B=2, seed=1):
    """A few documents per row, one of them starting at the chunk boundary ``t = 16``."""
    starts = jax.random.bernoulli(jax.random.PRNGKey(seed), 0.05, (B, T)).at[:, 16].set(True)
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def _readout(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _assert_close(got, want, what):
    """Every float leaf within ``TOL``, every int/bool leaf equal, same shapes and dtypes."""
    errors = {}
    leaves = jax.tree_util.tree_leaves_with_path(want)
    for (path, b), a in zip(leaves, jax.tree.leaves(got), strict=True):
        name = f"{what}{jax.tree_util.keystr(path)}"
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if jnp.issubdtype(b.dtype, jnp.floating):
            errors[name] = _rel(a, b)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, bad
    return errors


# --------------------------------------------------------------------------------------------------
# HOLA: ops.hola(impl="pallas") — the state path by the gated delta kernel; the cache read by the
# hola_cache kernel for one stream, by XLA for packed rows and cumulative_attention
# --------------------------------------------------------------------------------------------------

# The differentiable float leaves of a HolaState (scores, positions, flags are not differentiated).
_STATE_GRAD = ("S", "cache_k", "cache_v", "block_k", "block_v")
_CACHE_LEAVES = ("cache_k", "cache_v", "cache_score", "cache_pos", "cache_valid", "block_k",
                 "block_v", "block_score", "pos")  # fmt: skip


def _hola_params(seed=3):
    rng = np.random.default_rng(seed)
    return ops_hola.HolaReadParams(
        gamma_q=jnp.asarray(rng.uniform(0.5, 2.0, (H, K)), jnp.float32),
        gamma_k=jnp.asarray(rng.uniform(0.5, 2.0, (H, K)), jnp.float32),
        sink_logit=jnp.asarray(rng.normal(size=(H,)), jnp.float32),
        gate_logit=jnp.asarray(rng.normal(size=(H,)), jnp.float32),
    )


@functools.cache
def _hola_vg(impl, rule, chunk, packed, with_state):
    """Jitted ``((o, final HolaState), grads)`` of ``Σ w ⊙ o + Σ sin(S_T)`` w.r.t. q, k, v, g,
    β, the four cache-read parameters and (``with_state``) the initial state's float leaves."""

    def loss(x, p, s0_diff, s0, sid, w):
        s0 = s0._replace(**s0_diff) if with_state else None
        o, st = ops_hola.hola(
            *(x[n] for n in SEQ), p, rule=rule, initial_state=s0, segment_ids=sid,
            chunk_size=chunk, impl=impl,
        )  # fmt: skip
        return jnp.sum(o * w) + jnp.sum(jnp.sin(st.S)), (o, st)

    def run(x, p, s0, sid, w):
        s0_diff = {n: getattr(s0, n) for n in _STATE_GRAD} if with_state else {}
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            x, p, s0_diff, s0, sid if packed else None, w
        )
        return out, grads

    return jax.jit(run)


def _hola_case(T, *, chunk, packed=False, prefix=0, eviction="beta_e", window=3, block=8):
    """``impl="pallas"`` vs ``"chunked"``: values and gradients. ``prefix > 0``: continue a state
    built by ``prefix`` earlier tokens (a partly filled block buffer when ``prefix % block``)."""
    rule = ops_hola.HolaRule(window=window, block_size=block, eviction=eviction)
    x, p = _seq(T), _hola_params()
    s0 = None
    if prefix:
        pre = _seq(prefix, seed=7)
        _, s0 = ops_hola.hola(*(pre[n] for n in SEQ), p, rule=rule, chunk_size=chunk)
        s0 = s0._replace(S=s0.S + 0.3 * _readout(s0.S.shape, 9))  # a state of order one
    sid = _segments(T) if packed else None
    w = _readout((2, T, H, V), 5)
    args = (x, p, s0, sid, w)
    got = _hola_vg("pallas", rule, chunk, packed, prefix > 0)(*args)
    want = _hola_vg("chunked", rule, chunk, packed, prefix > 0)(*args)
    errors = _assert_close(got, want, "hola")
    if prefix:  # the initial state's gradient is there and not trivially zero
        assert float(jnp.max(jnp.abs(want[1][2]["S"]))) > 0
    return errors


@pytest.mark.parametrize(
    "T, chunk, packed, prefix",
    [
        (63, 16, True, 0),  # packed rows, resets inside chunks and at a chunk boundary
        (200, 64, False, 37),  # continuing a state with a half-filled block buffer
    ],
)
def test_hola_pallas_equals_chunked(T, chunk, packed, prefix):
    _hola_case(T, chunk=chunk, packed=packed, prefix=prefix)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("eviction", ["beta_e", "recency", "cumulative_attention"])
@pytest.mark.parametrize("mode", ["packed", "prefix"])
def test_hola_pallas_equals_chunked_grid(T, chunk, eviction, mode):
    packed = mode == "packed" and T > 16
    _hola_case(T, chunk=chunk, packed=packed, prefix=0 if packed else 21, eviction=eviction)


def test_hola_pallas_state_path_is_the_kernel_and_the_cache_path_is_not():
    """The only difference between the two impls is the state path: with ``σ(λ) = 0`` (gate logit
    −∞) the output is the state read alone and equals ``ops.gated_delta(impl="pallas")`` bit for
    bit; the cache leaves of the state equal the chunked ones bit for bit, but for the scores,
    equal up to rounding: the chunked impl takes ``β‖e‖`` as the norm of its state path's writes,
    the Pallas impl from the separate residual pass (packed rows; the compiled programs of
    ``test_hola_pallas_equals_chunked[63-16-True-0]``)."""
    T, chunk = 63, 16
    rule = ops_hola.HolaRule(window=3, block_size=8)
    x, p, sid, w = _seq(T), _hola_params(), _segments(T), _readout((2, T, H, V), 5)
    p = p._replace(gate_logit=jnp.full((H,), -jnp.inf, jnp.float32))  # not weak-typed
    (o, st), _ = _hola_vg("pallas", rule, chunk, True, False)(x, p, None, sid, w)
    (_, st_c), _ = _hola_vg("chunked", rule, chunk, True, False)(x, p, None, sid, w)
    seq = tuple(x[n] for n in SEQ)
    kernel = jax.jit(functools.partial(ops.gated_delta, chunk_size=chunk, impl="pallas"))
    o_k, S_k = kernel(*seq, segment_ids=sid)
    np.testing.assert_array_equal(o, o_k)
    np.testing.assert_array_equal(st.S, S_k)
    for name in _CACHE_LEAVES:
        if name.endswith("_score"):
            np.testing.assert_allclose(getattr(st, name), getattr(st_c, name), rtol=1e-6, atol=0)
        else:
            np.testing.assert_array_equal(getattr(st, name), getattr(st_c, name), err_msg=name)


def test_hola_pallas_errors():
    x, p = _seq(20), _hola_params()
    args = (*(x[n] for n in SEQ), p)
    rule = ops_hola.HolaRule(window=3, block_size=8)
    with pytest.raises(ValueError, match="BlockSizes: chunk must be a positive multiple of 8"):
        ops_hola.hola(*args, rule=rule, chunk_size=12, impl="pallas")
    with pytest.raises(ValueError, match="^hola: impl must be one of"):
        ops_hola.hola(*args, rule=rule, impl="auto")
    with pytest.raises(ValueError, match="^hola_forward: kernels.state_path must be a function"):
        hola_forward(*args, kernels=HolaKernels(state_path="pallas"))
    with pytest.raises(ValueError, match="^hola_forward: kernels must be a HolaKernels"):
        hola_forward(*args, kernels=dict(state_path=ops.gated_delta))


# --------------------------------------------------------------------------------------------------
# HOLA mixer and config
# --------------------------------------------------------------------------------------------------


def layer_value_and_grads(layer, x, sid, w):
    """``(y, ∇_params Σ w ⊙ y)`` of a mixer over packed rows (test_pallas_mesh uses it too)."""

    def loss(m):
        y, _ = m(x, segment_ids=sid)
        return jnp.sum(y * w), y

    (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
    return y, grads


_layer_vg = nnx.jit(layer_value_and_grads)


@nnx.jit
def _prefill_and_step(layer, x):
    """A prefill of all but the last token from an empty cache, then the last token decoded."""
    y, cache = layer(x[:, :-1], cache=layer.init_cache(x.shape[0], x.shape[1]))
    y1, _ = layer(x[:, -1:], cache=cache)
    return y, y1


def _hola_mixers(d=16):
    opts = HolaOptions(window=3, block_size=8)
    make = lambda impl: HolaMixer(d, H, K, opts, chunk_size=16, impl=impl, rngs=nnx.Rngs(0))  # noqa: E731
    return make("pallas"), make("chunked")


def test_hola_mixer_pallas_equals_chunked():
    """The layer built with ``impl="pallas"`` equals ``"chunked"`` over packed rows: output and
    every parameter gradient; ``"recurrent"`` is still refused."""
    T, d = 63, 16
    pallas, chunked = _hola_mixers(d)
    x, w, sid = _readout((2, T, d), 11), _readout((2, T, d), 12), _segments(T)
    got = _layer_vg(pallas, x, sid, w)
    want = _layer_vg(chunked, x, sid, w)
    _assert_close(got, want, "hola_mixer")
    with pytest.raises(ValueError, match="^impl: the hola mixer supports 'chunked' and 'pallas'"):
        HolaMixer(d, H, K, HolaOptions(), impl="recurrent", rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_hola_mixer_pallas_prefill_and_decode():
    """A pallas layer prefills (``ops.hola`` continuing the empty cache state) and decodes one
    token (``hola_step`` takes ``"pallas"``) as the chunked layer does."""
    T, d = 63, 16
    pallas, chunked = _hola_mixers(d)
    x = _readout((1, T, d), 11)
    _assert_close(_prefill_and_step(pallas, x), _prefill_and_step(chunked, x), "hola_decode")


def test_hola_step_takes_every_impl():
    """One token has one form: ``hola_step`` gives the same bits for every ``impl``."""
    rule = ops_hola.HolaRule(window=3, block_size=8)
    x, p = _seq(1), _hola_params()
    st = ops_hola.init_hola_state(2, H, K, V, rule.window, rule.block_size)
    st = st._replace(S=_readout(st.S.shape, 8))
    one = tuple(x[n][:, 0] for n in SEQ)
    step = jax.jit(ops_hola.hola_step, static_argnames=("rule", "impl"))
    outs = {i: step(st, *one, p, rule=rule, impl=i) for i in IMPLS}
    for impl in ("recurrent", "pallas"):
        for a, b in zip(jax.tree.leaves(outs[impl]), jax.tree.leaves(outs["chunked"]), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=impl)
    with pytest.raises(ValueError, match="^hola_step: impl must be one of"):
        ops_hola.hola_step(st, *one, p, rule=rule, impl="auto")


def test_hola_config_accepts_pallas():
    assert "hola" in PALLAS_MIXERS
    cfg = load_config(["configs/experiments/tiny_hola.yaml"], ["model.impl=pallas"])
    assert cfg.model.name == "hola" and cfg.model.impl == "pallas"


# --------------------------------------------------------------------------------------------------
# Proteus GDN: the span form (ops.linear.proteus_gated_delta) and the layers' key-row path
# --------------------------------------------------------------------------------------------------


@functools.cache
def _proteus_vg(impl, rule, t0, chunk, with_state):
    def loss(x, s0, w):
        o, S = ops.linear.proteus_gated_delta(
            *(x[n] for n in SEQ), rule=rule, initial_state=s0, t0=t0, chunk_size=chunk, impl=impl
        )
        return jnp.sum(o * w) + jnp.sum(jnp.sin(S)), (o, S)

    argnums = (0, 1) if with_state else 0
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def _proteus_case(T, *, t0, context_len, chunk, blocks=4, init=True):
    """``impl="pallas"`` vs ``"chunked"`` of the span form, values and gradients (the initial
    state's included). Blocks open inside the call, so injection tokens run through the kernel."""
    rule = ops.ProteusRule(blocks, context_len)
    x = _seq(T)
    s0 = _readout((2, H, K, V), 4) if init else None
    w = _readout((2, T, H, V), 6)
    (_, got), g_got = _proteus_vg("pallas", rule, t0, chunk, init)(x, s0, w)
    (_, want), g_want = _proteus_vg("chunked", rule, t0, chunk, init)(x, s0, w)
    _assert_close((got, g_got), (want, g_want), "proteus")
    if init:
        # locked rows of the initial state keep their exact bits (restored, not recomputed)
        delta = context_len // blocks
        k_end = min(blocks, 1 + (t0 + T - 1) // delta)
        locked = np.arange(K) >= k_end * (K // blocks)
        np.testing.assert_array_equal(
            np.asarray(got[1])[:, :, locked], np.asarray(s0)[:, :, locked]
        )


@pytest.mark.parametrize(
    "T, t0, context_len, chunk",
    [
        (63, 5, 64, 16),  # openings at t = 17, 33, 49 inside the call: three injection spans
        (200, 0, 480, 64),  # openings at t = 121 only; rows of the last block stay locked
    ],
)
def test_proteus_gdn_pallas_equals_chunked(T, t0, context_len, chunk):
    _proteus_case(T, t0=t0, context_len=context_len, chunk=chunk)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("t0", [0, 7, 150])
@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("init", [False, True])
def test_proteus_gdn_pallas_equals_chunked_grid(T, t0, chunk, init):
    _proteus_case(T, t0=t0, context_len=160, chunk=chunk, init=init)


def test_proteus_gated_delta_dispatch():
    """``"chunked"`` is ``core.associative.proteus.proteus_gated_delta_chunked`` (same program),
    ``"recurrent"`` agrees with it, ``E = 1`` is ``ops.gated_delta`` and bad arguments raise."""
    from nested_jax.core.associative.proteus import proteus_gated_delta_chunked

    x, s0 = _seq(40), _readout((2, H, K, V), 4)
    rule = ops.ProteusRule(4, 32)
    args = tuple(x[n] for n in SEQ)
    kw = dict(initial_state=s0, t0=3, chunk_size=16)
    o_c, S_c = ops.linear.proteus_gated_delta(*args, rule=rule, impl="chunked", **kw)
    o_ref, S_ref = proteus_gated_delta_chunked(*args, schedule=rule, **kw)
    np.testing.assert_array_equal(o_c, o_ref)
    np.testing.assert_array_equal(S_c, S_ref)
    o_r, S_r = ops.linear.proteus_gated_delta(*args, rule=rule, impl="recurrent", **kw)
    assert _rel(o_r, o_c) < TOL and _rel(S_r, S_c) < TOL
    off = ops.ProteusRule()
    o1, S1 = ops.linear.proteus_gated_delta(*args, rule=off, impl="pallas", **kw)
    kw1 = dict(initial_state=s0, chunk_size=16, impl="pallas")
    o1_ref, S1_ref = ops.gated_delta(*args, **kw1)
    np.testing.assert_array_equal(o1, o1_ref)
    np.testing.assert_array_equal(S1, S1_ref)
    with pytest.raises(ValueError, match="^proteus_gated_delta: impl must be one of"):
        ops.linear.proteus_gated_delta(*args, rule=rule, impl="auto")
    with pytest.raises(ValueError, match="^proteus_gated_delta: rule must be a ProteusRule"):
        ops.linear.proteus_gated_delta(*args, rule=(4, 32))
    with pytest.raises(ValueError, match="BlockSizes: chunk must be a positive multiple of 8"):
        ops.linear.proteus_gated_delta(*args, rule=rule, chunk_size=12, impl="pallas", t0=3)
    with pytest.raises(ValueError, match="backbone must be a function"):
        proteus_gated_delta_chunked(*args, schedule=rule, t0=3, backbone=None)


def test_proteus_gdn_layer_pallas_equals_chunked():
    """The Proteus GDN layer (``proteus_key_rows`` + ``ops.gated_delta``) with ``impl="pallas"``
    equals ``"chunked"`` over packed rows (each document restarts its schedule): output and every
    parameter gradient."""
    T, d = 63, 16
    make = lambda impl: GatedDeltaNet(  # noqa: E731
        d, H, K, chunk_size=16, impl=impl, proteus_blocks=4, proteus_context_len=32,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    x, w, sid = _readout((2, T, d), 13), _readout((2, T, d), 14), _segments(T)
    got = _layer_vg(make("pallas"), x, sid, w)
    want = _layer_vg(make("chunked"), x, sid, w)
    _assert_close(got, want, "proteus_gdn_layer")


# Hope's linear-memory chunk: ops.hope.hope_linear_chunk(impl="pallas") — the gated delta kernel


def test_hope_linear_chunk_pallas_equals_chunked():
    """A chunk of a linear Hope memory (SPEC §3.2 as §1's gated delta rule, β = γ/α may exceed 1)
    by the kernel equals the chunked rule: ``M_T`` and the gradients of ``M_0``, ``k``, ``v̂``,
    ``α``, ``η`` at an awkward T; an unknown impl names the op."""
    from nested_jax.ops.hope import hope_linear_chunk

    B, T, V = 2, 37, 12
    rng = np.random.default_rng(5)
    k = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    args = (
        jnp.asarray(0.3 * rng.normal(size=(B, H, V, K)), jnp.float32),
        k,
        jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32),
        jnp.asarray(rng.uniform(0.8, 1.0, size=(B, T, H)), jnp.float32),
        jnp.asarray(rng.uniform(0.1, 0.9, size=(B, T, H)), jnp.float32),
    )
    w = jnp.asarray(rng.normal(size=(B, H, V, K)), jnp.float32)

    def value_and_grads(impl):
        f = lambda *a: jnp.sum(w * hope_linear_chunk(*a, chunk_size=16, impl=impl))  # noqa: E731
        return jax.jit(jax.value_and_grad(f, argnums=tuple(range(5))))(*args)

    (v_p, g_p), (v_c, g_c) = value_and_grads("pallas"), value_and_grads("chunked")
    jaxpr = lambda impl: str(jax.make_jaxpr(functools.partial(hope_linear_chunk, impl=impl))(*args))  # noqa: E731
    assert "pallas_call" in jaxpr("pallas") and "pallas_call" not in jaxpr("chunked")
    assert _rel(v_p, v_c) < TOL
    for name, a, b in zip(("M0", "k", "v_hat", "alpha", "eta"), g_p, g_c, strict=True):
        assert _rel(a, b) < TOL, name
    with pytest.raises(ValueError, match="^hope_linear_chunk: impl must be one of"):
        hope_linear_chunk(*args, impl="auto")
