"""Hope mixer (SPEC §3.2): teacher-forced decoding == full forward across chunk ends of both chunk
sizes, chunk sizes 1 == the per-token core, packed rows == separate documents, causality, finite
gradients for every parameter, input and option validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.core.hope.state import hope_init_state
from nested_jax.core.hope.token import hope_recurrent
from nested_jax.layers.hope import HopeCache, HopeMixer
from nested_jax.layers.options import HopeOptions
from nested_jax.models.config import ModelConfig
from nested_jax.models.registry import get_mixer

D_MODEL, H, HD, B, T = 24, 2, 8, 2, 11
OPTS = dict(chunk_memory=4, chunk_other=2, memory_hidden=6)


def _mixer(seed=0, **opts):
    return HopeMixer(D_MODEL, H, HD, HopeOptions(**{**OPTS, **opts}), rngs=nnx.Rngs(seed))


def _x(seed=1, t=T):
    return jax.random.normal(jax.random.key(seed), (B, t, D_MODEL), jnp.float32)


@nnx.jit
def _full(m, x, seg=None):
    return m(x, segment_ids=seg)[0]


@nnx.jit
def _cached(m, x, cache):
    return m(x, cache=cache)


def _decode(m, x, prefill):
    cache = m.init_cache(B, x.shape[1])
    y, cache = _cached(m, x[:, :prefill], cache)
    outs = [y]
    for t in range(prefill, x.shape[1]):
        y, cache = _cached(m, x[:, t : t + 1], cache)
        outs.append(y)
    return jnp.concatenate(outs, 1), cache


def _close(a, b, tol=1e-4):
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())), rtol=0)


@pytest.mark.parametrize(
    "opts",
    [
        {},  # momentum on (default), chunk_memory 4, chunk_other 2
        pytest.param(
            {"adaptive_q": True, "momentum": False, "chunk_memory": 2, "chunk_other": 4},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_decode_equals_full_forward(opts):
    """Prefill of 5 tokens crosses a chunk_other end (2, 4), then single tokens cross 6, 8, 10 and
    the chunk_memory end 8; T = 11 ends mid-chunk."""
    m = _mixer(**opts)
    x = _x()
    full = _full(m, x)
    assert full.shape == (B, T, D_MODEL)
    got, cache = _decode(m, x, 5)
    _close(got, full)
    assert isinstance(cache, HopeCache) and int(cache.n) == T
    # the memories did move away from their initial values
    init = m.initial_memories().memory.w1
    assert float(jnp.abs(cache.state.memories.memory.w1 - init).max()) > 1e-4


def test_chunk_size_one_equals_per_token_core():
    m = _mixer(chunk_memory=1, chunk_other=1)
    x = _x(t=7)

    @nnx.jit
    def per_token(m, x):
        xm, q, _, _ = m._inputs(x, None, None)
        st = hope_init_state(m.initial_memories(), B, momentum=True)
        o, _ = hope_recurrent(xm, q, m.readout(), initial_state=st, rule=m.opts)
        return m._out(x, o)

    _close(_full(m, x), per_token(m, x), 1e-5)


def test_packed_rows_equal_separate_documents():
    """A document starting at t = 4 (a multiple of both chunk sizes) gives the same outputs as the
    document alone: the conv taps and the memories restart."""
    m = _mixer()
    x = _x()
    seg = jnp.asarray(np.repeat([[1] * 4 + [2] * (T - 4)], B, 0), jnp.int32)
    packed = _full(m, x, seg)
    _close(packed[:, :4], _full(m, x[:, :4]), 1e-5)
    _close(packed[:, 4:], _full(m, x[:, 4:]), 1e-5)
    assert float(jnp.abs(packed[:, 4:] - _full(m, x)[:, 4:]).max()) > 1e-4


def test_causality():
    m = _mixer()
    x = _x()
    y = _full(m, x)
    y2 = _full(m, x.at[:, 6].add(1.0))
    _close(y2[:, :6], y[:, :6], 0)
    assert float(jnp.abs(y2[:, 6:] - y[:, 6:]).max()) > 1e-4


def test_gradients_finite_for_every_parameter():
    m = _mixer()
    x = _x()
    seg = jnp.asarray(np.repeat([[1] * 5 + [2] * (T - 5)], B, 0), jnp.int32)

    @nnx.jit
    def grads(m, x):
        return nnx.grad(lambda m: jnp.sum(m(x, segment_ids=seg)[0] ** 2))(m)

    g = grads(m, x)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(g, nnx.Param))
    assert len(leaves) >= 20
    for path, leaf in leaves:
        a = np.asarray(leaf)
        assert np.isfinite(a).all(), path
        assert np.abs(a).max() > 0, path  # every outer parameter (initial memories too) learns


def test_registry_and_config():
    cfg = ModelConfig(name="hope", d_model=D_MODEL, n_heads=H)
    m = get_mixer("hope").from_config(cfg, rngs=nnx.Rngs(0))
    assert isinstance(m, HopeMixer) and m.head_dim == D_MODEL // H
    assert m.opts == cfg.hope == HopeOptions()
    names = {n for n, _ in nnx.state(m, nnx.Param).flat_state()}
    for n in ("k_w1", "memory_w2", "eta_w", "alpha_b"):
        assert any(n in str(p) for p in names), n


def test_bad_inputs_and_options_raise():
    m = _mixer()
    x = _x()
    with pytest.raises(ValueError, match="x: expected shape"):
        m(x[0])
    with pytest.raises(ValueError, match="x: expected shape"):
        m(x[..., :5])
    with pytest.raises(ValueError, match="segment_ids"):
        m(x, segment_ids=jnp.zeros((B, T - 1), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        m(x, segment_ids=jnp.zeros((B, T), jnp.int32), cache=m.init_cache(B, T))
    with pytest.raises(ValueError, match="opts"):
        HopeMixer(D_MODEL, H, HD, {"chunk_memory": 4}, rngs=nnx.Rngs(0))
    for field, value in [
        ("chunk_memory", 0),
        ("chunk_memory", 3),  # 3 and chunk_other=2: neither divides the other
        ("memory_hidden", -1),
        ("step", "newton"),
        ("momentum", 1),
        ("momentum_coef", 1.0),
        ("eta_init", 0.0),
        ("alpha_init", 1.5),
        ("memory_init", -0.1),
        ("grad_horizon", 6),  # not a multiple of chunk_memory=4
    ]:
        with pytest.raises(ValueError, match=f"HopeOptions.{field}"):
            HopeOptions(**{**OPTS, field: value})
    assert dataclasses.replace(HopeOptions(), chunk_other=8).chunk_other == 8
