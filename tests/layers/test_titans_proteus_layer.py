"""Proteus option of the Titans layers (SPEC §4 on the SPEC §2 memory): E = 1 is the plain layer
bit for bit; with E = 4 the layer's memory equals the core ``proteus_titans_mlp_*`` wrappers and
never touches locked coordinates; decoding equals the forward; packed rows and option checks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.core.proteus import proteus_block_ids
from nested_jax.core.titans.proteus import proteus_titans_mlp_chunked, proteus_titans_mlp_recurrent
from nested_jax.layers.options import ProteusOptions, TitansOptions
from nested_jax.models.config import ModelConfig
from nested_jax.models.registry import get_mixer
from nested_jax.rules import ProteusRule
from tests.layers.test_titans_layers import D_MODEL, OPTS, B, T, _cached, _full, _pos, _x

# shapes, options, inputs and call helpers are those of the plain Titans layer tests
PROTEUS = ProteusOptions(blocks=4, context_len=32)  # Δ = 8: spans [0, 8), [8, 16), [16, 24) …


def _mixer(name, proteus=PROTEUS, seed=0, **opts):
    cfg = ModelConfig(
        name=name, d_model=D_MODEL, n_heads=2, titans=TitansOptions(**{**OPTS, **opts}),
        **({} if proteus is None else {"proteus": proteus}),
    )  # fmt: skip
    return get_mixer(name).from_config(cfg, rngs=nnx.Rngs(seed))


def _memory_inputs(m, x):
    """The LMM branch's memory inputs ``(q, k, v, θ, η, α)`` for ``x``."""
    q, k, v, _ = m.branch._project(x)
    return (q, k, v, *m.branch.memory.gates(x))


def test_one_block_is_the_plain_layer_bit_for_bit():
    x = _x()
    plain = _full(_mixer("titans_lmm", proteus=None), x)
    one = _full(_mixer("titans_lmm", proteus=ProteusOptions(blocks=1, context_len=32)), x)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(plain))
    four = _full(_mixer("titans_lmm"), x)
    assert float(jnp.abs(four - plain).max()) > 1e-4  # E = 4 does change the layer


@pytest.mark.parametrize(
    "opts",
    [{"memory_layers": 1}, {"memory_layers": 2}, {"memory_layers": 2, "memory_impl": "recurrent"}],
)
def test_memory_equals_core_proteus_and_keeps_locked_coordinates(opts):
    m = _mixer("titans_lmm", **opts)
    mem = m.branch.memory
    xs = _memory_inputs(m, _x())
    st0 = mem.initial_state(B)
    y, st = nnx.jit(lambda mem, xs: mem(*xs))(mem, xs)
    kw = dict(rule=mem.spec.rule, schedule=ProteusRule(blocks=4, context_len=32))
    if mem.impl == "recurrent":
        y_ref, st_ref = proteus_titans_mlp_recurrent(*xs, initial_state=st0, **kw)
    else:
        y_ref, st_ref = proteus_titans_mlp_chunked(*xs, initial_state=st0, **kw)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(st, st_ref, rtol=1e-5, atol=1e-5)
    # T = 21 < (E−1)Δ + 1 = 25: block 3 (the last) never opened, so its coordinates keep the
    # learned M_0 and zero momentum bit for bit; the open blocks did move.
    L = mem.n_layers
    blocked = mem.dims[0] if L == 1 else mem.dims[1]
    locked = proteus_block_ids(blocked, 4) == 3
    w_new, w_old = np.asarray(st.weights[0]), np.asarray(st0.weights[0])
    s_new = np.asarray(st.momentum[0])
    sel = (slice(None), slice(None), locked) if L == 1 else (Ellipsis, locked)
    np.testing.assert_array_equal(w_new[sel], w_old[sel])
    np.testing.assert_array_equal(s_new[sel], 0.0)
    opened = (slice(None), slice(None), ~locked) if L == 1 else (Ellipsis, ~locked)
    assert float(np.abs(w_new[opened] - w_old[opened]).max()) > 1e-4


@pytest.mark.parametrize(
    "name,opts,prefill",
    [
        ("titans_lmm", {"memory_layers": 2}, 6),
        ("titans_lmm", {"memory_layers": 1, "memory_impl": "recurrent"}, 0),
        pytest.param("titans_mag", {"memory_layers": 1}, 3, marks=pytest.mark.slow),
        pytest.param("titans_mal", {"memory_layers": 2}, 0, marks=pytest.mark.slow),
    ],
)
def test_decode_equals_full_forward_with_proteus(name, opts, prefill):
    m = _mixer(name, **opts)
    x = _x()
    full = _full(m, x)
    cache = m.init_cache(B, T)
    outs = []
    if prefill:
        y, cache = _cached(m, x[:, :prefill], cache, 0)
        outs.append(y)
    for t in range(prefill, T):  # crosses the span starts at 8 and 16 (blocks 2 and 3 open)
        y, cache = _cached(m, x[:, t : t + 1], cache, t)
        outs.append(y)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_packed_rows_with_proteus():
    """Schedule by row position; a document start resets the whole state: one document per row
    equals the unpacked call, the first document of a packed row is unchanged, the second one
    differs from carrying the memory over and stays finite."""
    m = _mixer("titans_lmm", memory_layers=2)
    x = _x()
    seg1 = jnp.ones((B, T), jnp.int32)
    run = nnx.jit(lambda m, x, s: m(x, positions=_pos(0, T), segment_ids=s)[0])
    np.testing.assert_allclose(np.asarray(run(m, x, seg1)), np.asarray(_full(m, x)), atol=1e-6)
    seg = jnp.asarray(np.repeat([[1] * 11 + [2] * 10], B, 0), jnp.int32)
    y = run(m, x, seg)
    assert bool(jnp.isfinite(y).all())
    np.testing.assert_allclose(np.asarray(y[:, :11]), np.asarray(_full(m, x)[:, :11]), atol=1e-6)
    assert float(jnp.abs(y[:, 11:] - _full(m, x)[:, 11:]).max()) > 1e-4
    # Exact: the second document's memory output is the core wrapper run on that document alone
    # from (M_0, 0) at its row position t0 (mid-span at 11, and exactly at a span start at 16).
    # The row starts from another state (a carried one), so the coordinates still locked at the
    # reset must restart too: they hold the carried values, not M_0.
    mem = m.branch.memory
    carried = jax.tree.map(lambda a: a + 0.1, mem.initial_state(B))
    for cut in (11, 16):
        s = jnp.asarray(np.repeat([[1] * cut + [2] * (T - cut)], B, 0), jnp.int32)
        q, k, v, _ = m.branch._project(x, s)
        xs = (q, k, v, *mem.gates(x))
        y_mem, _ = nnx.jit(lambda mem, xs, s: mem(*xs, state=carried, segment_ids=s))(mem, xs, s)
        y_ref, _ = proteus_titans_mlp_chunked(
            *(a[:, cut:] for a in xs), initial_state=mem.initial_state(B), rule=mem.spec.rule,
            schedule=ProteusRule(blocks=4, context_len=32), t0=cut,
        )  # fmt: skip
        np.testing.assert_allclose(
            np.asarray(y_mem[:, cut:]), np.asarray(y_ref), rtol=1e-5, atol=1e-5, err_msg=str(cut)
        )


def test_proteus_option_checks():
    with pytest.raises(ValueError, match="'titans_mac' mixer has no Proteus option"):
        _mixer("titans_mac")
    with pytest.raises(ValueError, match="ProteusOptions.blocks"):
        _mixer("titans_lmm", proteus=ProteusOptions(blocks=64, context_len=128), memory_layers=1)
    m = _mixer("titans_lmm", proteus=ProteusOptions(blocks=4, context_len=24))  # Δ = 6
    _full(m, _x())  # the forward runs with any chunk size
    with pytest.raises(ValueError, match="memory_chunk"):
        m.init_cache(B, T)
