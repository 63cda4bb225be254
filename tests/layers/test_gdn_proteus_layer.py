"""Proteus GDN / DeltaNet layer (SPEC §4): model.proteus options, equality with the core Proteus
functions, decode == forward, packed rows, evaluation beyond the training context, E=1 bitwise."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.core.associative.proteus import (
    proteus_gated_delta_chunked,
    proteus_gated_delta_recurrent,
)
from nested_jax.layers import DeltaNet, GatedDeltaNet
from nested_jax.layers.options import OPTION_SECTIONS, ProteusOptions
from nested_jax.models.config import ModelConfig
from nested_jax.models.lm import build_model
from nested_jax.rules import ProteusRule

D_MODEL, H, D = 16, 2, 8
N, E = 16, 4  # training context and blocks: Δ = 4, fully open from t = 13


def _rand(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _make(cls=GatedDeltaNet, blocks=E, context_len=N, impl="chunked", chunk_size=4):
    return cls(
        D_MODEL, H, D, conv_size=4, chunk_size=chunk_size, impl=impl,
        proteus_blocks=blocks, proteus_context_len=context_len, rngs=nnx.Rngs(0),
    )  # fmt: skip


@nnx.jit
def _call(layer, x, positions=None, segment_ids=None, cache=None):
    return layer(x, positions=positions, segment_ids=segment_ids, cache=cache)


class _CoreReference(GatedDeltaNet):
    """The plain GDN layer whose memory is the core Proteus function (the layer under test must
    equal it): ``proteus_gated_delta_{chunked,recurrent}`` at ``t0 = 0``."""

    core_impl = "recurrent"

    def _rule(self, q, k, v, g, beta, *, state, segment_ids, single_step: bool):
        assert segment_ids is None and state is None and not single_step
        kw = dict(schedule=ProteusRule(blocks=E, context_len=N), t0=0)
        if self.core_impl == "chunked":
            return proteus_gated_delta_chunked(q, k, v, g, beta, chunk_size=4, **kw)
        return proteus_gated_delta_recurrent(q, k, v, g, beta, **kw)


def _reference(layer, core_impl):
    """A ``_CoreReference`` with ``layer``'s parameters (plain layer: E = 1)."""
    ref = _make(_CoreReference, blocks=1, context_len=0)
    ref.core_impl = core_impl
    nnx.update(ref, nnx.state(layer, nnx.Param))
    return ref


def test_options_section_and_validation():
    assert OPTION_SECTIONS["proteus"] is ProteusOptions
    assert ModelConfig().proteus == ProteusOptions(blocks=1, context_len=0)
    with pytest.raises(ValueError, match="model.proteus.context_len"):
        ProteusOptions(blocks=16)
    with pytest.raises(ValueError, match="ProteusOptions.blocks"):
        ProteusOptions(blocks=0)
    with pytest.raises(ValueError, match="ProteusOptions.context_len"):
        ProteusOptions(context_len=-1)
    cfg = ModelConfig(
        name="gdn", d_model=D_MODEL, n_heads=H, proteus=ProteusOptions(blocks=E, context_len=N)
    )
    layer = GatedDeltaNet.from_config(cfg, rngs=nnx.Rngs(0))
    assert (layer.proteus_blocks, layer.proteus_context_len) == (E, N)
    with pytest.raises(ValueError, match="proteus_context_len"):
        _make(blocks=4, context_len=0)
    with pytest.raises(ValueError, match="head_dim >= proteus_blocks"):
        _make(blocks=D + 1)
    layer = _make()
    x = _rand(0, (1, 3, D_MODEL))
    with pytest.raises(ValueError, match="positions: required with a cache"):
        layer(x, cache=layer.init_cache(1, 3))
    with pytest.raises(ValueError, match="positions: expected int"):
        layer(x, positions=jnp.zeros((1, 2), jnp.int32))


@pytest.mark.parametrize("impl, core_impl", [("chunked", "chunked"), ("recurrent", "recurrent")])
def test_layer_equals_core_proteus_reference(impl, core_impl):
    # T = 2N covers every schedule step and the fully open evaluation beyond N.
    layer = _make(impl=impl)
    x = _rand(1, (2, 2 * N, D_MODEL))
    y, _ = _call(layer, x)
    y_ref, _ = _call(_reference(layer, core_impl), x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    # and Proteus changes the output inside the schedule (k < E) but not the first block's rows
    y_plain, _ = _call(_make(blocks=1, context_len=0, impl=impl), x)
    assert float(jnp.abs(y - y_plain)[:, : N - N // E].max()) > 1e-3


def test_locked_rows_stay_zero_and_open_beyond_context():
    layer = _make()
    x = _rand(2, (1, 3 * N, D_MODEL))
    delta, per = N // E, D // E
    cache = layer.init_cache(1, 3 * N)
    for t in range(1, 3 * N + 1):  # decode steps: one compilation, the state at every t
        _, cache = _call(layer, x[:, t - 1 : t], cache=cache, positions=jnp.full((1, 1), t - 1))
        k_open = min(E, 1 + (t - 1) // delta)
        rows = np.abs(np.asarray(cache.state)).sum(axis=(0, 1, 3))  # [K], per key row
        assert (rows[k_open * per :] == 0).all(), (t, rows)  # locked rows: exactly untouched
        assert (rows[: k_open * per] > 0).all(), (t, rows)  # open rows were written


@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
def test_decode_with_cache_equals_forward(cls):
    layer = _make(cls)
    T = N + 6  # decode runs past the training context
    x = _rand(3, (2, T, D_MODEL))
    full, _ = _call(layer, x)
    cache, outs = layer.init_cache(2, T), []
    # a 5-token prefill, a 3-token chunked continuation from the cache (traced t0), then steps
    for a, b in ((0, 5), (5, 8), *((i, i + 1) for i in range(8, T))):
        pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
        y, cache = _call(layer, x[:, a:b], positions=pos, cache=cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)


def test_packed_rows_restart_the_schedule_per_document():
    layer = _make()
    x = _rand(4, (1, 30, D_MODEL))
    seg = jnp.array([[0] * 7 + [1] * 23])
    packed, _ = _call(layer, x, segment_ids=seg)
    a, _ = _call(layer, x[:, :7])
    b, _ = _call(layer, x[:, 7:])
    np.testing.assert_allclose(packed, jnp.concatenate([a, b], 1), rtol=1e-4, atol=1e-5)
    # the second document alone equals the core Proteus reference started at t = 1
    b_ref, _ = _call(_reference(layer, "recurrent"), x[:, 7:])
    np.testing.assert_allclose(b, b_ref, rtol=1e-4, atol=1e-5)


def test_e1_is_the_backbone_bitwise_and_fully_open_positions_too():
    plain = _make(blocks=1, context_len=0)
    x = _rand(5, (2, 12, D_MODEL))
    y_plain, _ = _call(plain, x)
    # E = 1 ignores the positions entirely (q and k are not touched)
    y_pos, _ = _call(plain, x, positions=jnp.full((2, 12), 7, jnp.int32))
    np.testing.assert_array_equal(y_pos, y_plain)
    # E = 4 at positions beyond N (every block open): the same bits as the backbone
    prot = _make()
    y_open, _ = _call(prot, x, positions=N + jnp.broadcast_to(jnp.arange(12), (2, 12)))
    np.testing.assert_array_equal(y_open, y_plain)


@pytest.mark.slow  # ~60 s on the shared CPUs (LM compile: forward, prefill, step, grad)
def test_language_model_decode_equals_forward_and_packed_training_runs():
    cfg = ModelConfig(
        name="gdn", vocab_size=32, d_model=D_MODEL, n_layers=1, n_heads=H, chunk_size=4,
        proteus=ProteusOptions(blocks=E, context_len=N),
    )  # fmt: skip
    model = build_model(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(6), (1, N + 4), 0, 32)
    full, _ = nnx.jit(lambda m, t: m(t))(model, tokens)
    step = nnx.jit(lambda m, t, c: m(t, cache=c))
    cache, outs = model.init_cache(1, N + 4), []
    for a, b in ((0, 6), *((i, i + 1) for i in range(6, N + 4))):
        y, cache = step(model, tokens[:, a:b], cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-4)

    seg = jnp.array([[0] * 9 + [1] * (N + 4 - 9)])

    def loss(m):
        logits, _ = m(tokens, segment_ids=seg)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    grads = nnx.jit(nnx.grad(loss))(model)
    chex.assert_tree_all_finite(nnx.state(grads, nnx.Param))
