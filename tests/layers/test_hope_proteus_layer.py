"""Proteus option of the Hope mixer (SPEC §4 on the SPEC §3.2 memories): E = 1 is the plain mixer
bit for bit; chunk sizes 1 equal the per-token core wrapper (also beyond N); decoding equals the
forward and never touches locked coordinates; packed rows follow the row-position rule; checks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.core.hope.proteus import proteus_hope_chunked, proteus_hope_recurrent
from nested_jax.core.hope.state import hope_init_state
from nested_jax.core.proteus import proteus_block_ids
from nested_jax.layers.hope import HopeMixer
from nested_jax.layers.options import HopeOptions, ProteusOptions
from nested_jax.models.config import ModelConfig
from nested_jax.models.registry import get_mixer
from nested_jax.rules import ProteusRule
from tests.layers.test_hope_layer import _cached, _close, _full

D_MODEL, H, HD, B, T = 24, 2, 8, 2, 21
OPTS = dict(chunk_memory=4, chunk_other=2, memory_hidden=8)  # 4 blocks of 2 hidden units
PROTEUS = ProteusOptions(blocks=4, context_len=32)  # Δ = 8: spans [0, 8), [8, 16), [16, 21)


def _mixer(proteus=PROTEUS, seed=0, **opts):
    return HopeMixer(
        D_MODEL, H, HD, HopeOptions(**{**OPTS, **opts}), rngs=nnx.Rngs(seed), proteus=proteus
    )


def _x(seed=1, t=T):
    return jax.random.normal(jax.random.key(seed), (B, t, D_MODEL), jnp.float32)


def _core_reference(m, x, t0, core):
    """The mixer's output computed with a core Proteus wrapper on its own inputs, from the learned
    initial state at row position ``t0``."""
    xm, q, _, _ = m._inputs(x, None, None)
    st = hope_init_state(m.initial_memories(), x.shape[0], momentum=m.opts.momentum)
    o, _ = core(xm, q, m.readout(), initial_state=st, schedule=m.proteus_rule, t0=t0, rule=m.opts)
    return m._out(x, o)


def test_one_block_is_the_plain_mixer_bit_for_bit():
    x = _x()
    plain = _full(_mixer(proteus=None), x)
    one = _full(_mixer(proteus=ProteusOptions(blocks=1, context_len=32)), x)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(plain))
    assert float(jnp.abs(_full(_mixer(), x) - plain).max()) > 1e-4  # E = 4 changes the mixer


def test_chunk_size_one_equals_the_per_token_core_beyond_n():
    """N = 8 (Δ = 2): positions 9 … 21 are beyond the training context, fully open."""
    m = _mixer(proteus=ProteusOptions(blocks=4, context_len=8), chunk_memory=1, chunk_other=1)
    x = _x()
    ref = nnx.jit(lambda m, x: _core_reference(m, x, 0, proteus_hope_recurrent))(m, x)
    _close(_full(m, x), ref, 1e-5)


def test_chunked_equals_the_core_chunked_wrapper():
    m = _mixer()
    x = _x()
    ref = nnx.jit(lambda m, x: _core_reference(m, x, 0, proteus_hope_chunked))(m, x)
    _close(_full(m, x), ref, 1e-5)


def test_decode_equals_forward_and_keeps_locked_coordinates():
    """Prefill 5 tokens, then single tokens across the span starts 8 and 16 (blocks 2 and 3
    open); T = 21 < 25, so block 4 never opens: its hidden units keep the learned weights and
    zero momenta bit for bit, while the open ones moved."""
    m = _mixer()
    x = _x()
    cache = m.init_cache(B, T)
    y, cache = _cached(m, x[:, :5], cache)
    outs = [y]
    for t in range(5, T):
        y, cache = _cached(m, x[:, t : t + 1], cache)
        outs.append(y)
    _close(jnp.concatenate(outs, 1), _full(m, x))
    locked = proteus_block_ids(8, 4) == 3
    for name in m.names:
        w1 = np.asarray(getattr(cache.state.memories, name).w1)  # [B, H, D, h]: hidden = columns
        w1_0 = np.asarray(getattr(m.initial_memories(), name).w1)
        np.testing.assert_array_equal(w1[..., locked], np.broadcast_to(w1_0, w1.shape)[..., locked])
        np.testing.assert_array_equal(
            np.asarray(getattr(cache.state.momentum, name).w2)[..., locked, :], 0.0
        )
        assert float(np.abs(w1[..., ~locked] - w1_0[..., ~locked]).max()) > 1e-5, name


# mid-span (multiple of both chunks; slow: ~30 s), a span start
@pytest.mark.parametrize("cut", [pytest.param(12, marks=pytest.mark.slow), 16])
def test_packed_rows_follow_the_row_position(cut):
    """The first document is the mixer on it alone; the second one equals the core wrapper run
    on it alone from the learned initial state at t0 = its row position (the whole state,
    locked coordinates included, restarts)."""
    m = _mixer()
    x = _x()
    seg = jnp.asarray(np.repeat([[1] * cut + [2] * (T - cut)], B, 0), jnp.int32)
    packed = _full(m, x, seg)
    _close(packed[:, :cut], _full(m, x[:, :cut]), 1e-5)
    ref = nnx.jit(lambda m, x: _core_reference(m, x, cut, proteus_hope_chunked))(m, x[:, cut:])
    _close(packed[:, cut:], ref, 1e-5)
    assert float(jnp.abs(packed[:, cut:] - _full(m, x)[:, cut:]).max()) > 1e-4


# ~90 s on 2 cores; the Hope model train-step tests check finite gradients end to end.
@pytest.mark.slow
def test_gradients_finite_for_every_parameter():
    m = _mixer()
    x = _x()
    seg = jnp.asarray(np.repeat([[1] * 9 + [2] * (T - 9)], B, 0), jnp.int32)

    def loss(m):
        return jnp.sum(m(x, segment_ids=seg)[0] ** 2)

    grads = nnx.grad(loss)(m)
    chex.assert_tree_all_finite(nnx.to_pure_dict(grads))  # names any non-finite leaf's path
    assert float(jnp.abs(nnx.to_pure_dict(grads)["memory_w1"]).max()) > 0


def test_config_and_option_checks():
    cfg = ModelConfig(
        name="hope", d_model=D_MODEL, n_heads=H, hope=HopeOptions(**OPTS), proteus=PROTEUS
    )
    m = get_mixer("hope").from_config(cfg, rngs=nnx.Rngs(0))
    assert m.proteus_rule == ProteusRule(4, 32)
    with pytest.raises(ValueError, match=r"^ProteusOptions.blocks: 16 blocks need"):
        _mixer(proteus=ProteusOptions(blocks=16, context_len=32))  # hidden 8 < 16
    m = _mixer(chunk_memory=6, chunk_other=3)  # Δ = 8: the forward runs, decoding cannot
    assert _full(m, _x()).shape == (B, T, D_MODEL)
    with pytest.raises(ValueError, match=r"^HopeOptions.chunk_memory: decoding with Proteus"):
        m.init_cache(B, T)
