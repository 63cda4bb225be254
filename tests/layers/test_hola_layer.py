"""HOLA mixer (SPEC §5): decode == forward across block boundaries, σ(λ)→0 equals the GDN layer,
packed rows == documents alone (values and gradients), constant cache size, options and
gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.core.hola.decode import HolaState
from nested_jax.layers.gdn import GatedDeltaNet
from nested_jax.layers.hola import HolaMixer
from nested_jax.layers.options import HolaOptions

D_MODEL, H, D = 24, 2, 8
KW = dict(conv_size=4, chunk_size=8)


def _hola(seed=0, **kw):
    opts = dict(window=3, block_size=4, gate_init=1.0)  # a strong gate: the cache path matters
    opts.update(kw)
    return HolaMixer(D_MODEL, H, D, HolaOptions(**opts), rngs=nnx.Rngs(seed), **KW)


def _x(seed, b, t):
    return jax.random.normal(jax.random.key(seed), (b, t, D_MODEL), jnp.float32)


@nnx.jit
def _call(layer, x, segment_ids=None, cache=None):
    return layer(x, segment_ids=segment_ids, cache=cache)


@pytest.mark.parametrize(
    "eviction",
    ["beta_e"]
    + [pytest.param(e, marks=pytest.mark.slow) for e in ("recency", "cumulative_attention")],
)
def test_decode_equals_forward_over_block_boundaries(eviction):
    layer = _hola(eviction=eviction)
    x = _x(1, 2, 19)  # C=4: the cache is merged 4 times; T is not a multiple of C
    full, none = _call(layer, x)
    assert none is None and full.shape == (2, 19, D_MODEL)
    cache = layer.init_cache(2, 19)
    y, cache = _call(layer, x[:, :6], cache=cache)  # prefill ends inside a block
    outs = [y]
    for t in range(6, 19):
        y, cache = _call(layer, x[:, t : t + 1], cache=cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)
    assert isinstance(cache.state, HolaState) and int(cache.state.pos) == 19
    assert int(cache.state.cache_valid.sum()) == 2 * H * 3  # a full cache after 4 merges


def test_cache_size_is_independent_of_length():
    layer = _hola()
    small, big = layer.init_cache(1, 2048), layer.init_cache(1, 32768)
    chex.assert_trees_all_equal_shapes_and_dtypes(small, big)
    x = _x(2, 1, 9)
    _, after = _call(layer, x, cache=small)
    chex.assert_trees_all_equal_shapes_and_dtypes(after, small)
    floats = H * (D * D + (3 + 4) * (D + D))  # SPEC §5: K·V + (w + C)(K + V) per head
    s = small.state
    assert s.S.size + s.cache_k.size + s.cache_v.size + s.block_k.size + s.block_v.size == floats


def _gdn_twin(hola: HolaMixer) -> GatedDeltaNet:
    """A GDN layer with the HOLA layer's shared parameters (same seed: the extra HOLA parameters
    are drawn after the GDN ones)."""
    gdn = GatedDeltaNet(D_MODEL, H, D, rngs=nnx.Rngs(0), **KW)
    ref = nnx.state(hola)
    for path, value in nnx.to_flat_state(nnx.state(gdn)):
        assert np.array_equal(value[...], _at(ref, path)), path
    return gdn


def _at(state, path):
    node = state
    for p in path:
        node = node[p]
    return node[...]


def test_gate_minus_inf_equals_gdn_layer_exactly():
    hola = _hola(gate_init=-1e9)  # σ(−1e9) == 0.0 in f32
    gdn = _gdn_twin(hola)
    x = _x(3, 2, 21)
    # Eager (op by op): both layers run the same kernels on the same values, so equality is
    # bitwise. (Jitted, XLA may fuse the two different programs differently: ~1 ulp.)
    y_h, _ = hola(x)
    y_g, _ = gdn(x)
    np.testing.assert_array_equal(np.asarray(y_h), np.asarray(y_g))
    # The same holds for decoding (the step forms are different code: tolerance).
    ch, cg = hola.init_cache(2, 4), gdn.init_cache(2, 4)
    for t in range(2):
        yh, ch = _call(hola, x[:, t : t + 1], cache=ch)
        yg, cg = _call(gdn, x[:, t : t + 1], cache=cg)
        np.testing.assert_allclose(yh, yg, rtol=1e-5, atol=1e-6)


def test_packed_segments_reset_the_state_like_gdn():
    hola = _hola(gate_init=-1e9)
    gdn = _gdn_twin(hola)
    x = _x(4, 2, 20)
    seg = jnp.array([[0] * 7 + [1] * 13, [0] * 12 + [3] * 5 + [4] * 3], jnp.int32)
    y_h, _ = _call(hola, x, seg)
    y_g, _ = _call(gdn, x, seg)
    np.testing.assert_allclose(y_h, y_g, rtol=1e-4, atol=1e-5)


# Packed rows (SPEC §0): C = 4 never divides the starts 5, 18, 19 and 11; 8 is on a boundary;
# documents of 1, 3, 5, 8, 11 and 13 tokens.
LENGTHS = ((5, 13, 1, 11), (8, 3, 8, 11))
T_ROW, T_DOC = 30, 13
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _documents():
    return [
        (b, int(s), n)
        for b, row in enumerate(LENGTHS)
        for s, n in zip(np.cumsum((0,) + row[:-1]), row, strict=True)
    ]


def _to_alone(a, fill=None):
    """``[2, T_ROW, ...]`` -> one document per row ``[n_docs, T_DOC, ...]``, then ``fill`` (zeros
    by default) after each document."""
    out = np.zeros((len(_documents()), T_DOC) + a.shape[2:], a.dtype) if fill is None else fill
    for i, (b, s, n) in enumerate(_documents()):
        out[i, :n] = a[b, s : s + n]
    return out


def _y_and_vjp(layer, x, seg, r):
    """``(y, ∂⟨r, y⟩/∂params, ∂⟨r, y⟩/∂x)`` via jax.vjp, compiled once with XLA's cheapest pass."""
    graphdef, params = nnx.split(layer)

    def run(params, x, r):
        y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x, segment_ids=seg)[0], params, x)
        return (y, *vjp(r))

    return jax.jit(run).lower(params, x, r).compile(_FAST_COMPILE)(params, x, r)


@pytest.mark.parametrize("window", [3, 16])
def test_packed_row_equals_documents_alone_values_and_grads(window):
    """SPEC §0: each document of a packed row gets the outputs, input gradients and parameter
    gradients (every parameter, cache path included) of running it alone. w = 3 is smaller than
    most documents (the per-document block grid and top-w selection matter), w = 16 larger."""
    layer = _hola(window=window)
    x = np.asarray(_x(6, 2, T_ROW))
    seg = jnp.asarray(np.stack([np.repeat(np.arange(len(r)), r) for r in LENGTHS]), jnp.int32)
    r = np.asarray(jax.random.normal(jax.random.key(7), x.shape))
    y_p, gp_p, gx_p = _y_and_vjp(layer, x, seg, r)
    x_a = _to_alone(x, fill=np.array(_x(8, len(_documents()), T_DOC)))  # filler after: causal
    y_a, gp_a, gx_a = _y_and_vjp(layer, x_a, None, _to_alone(r))
    real = _to_alone(np.ones((2, T_ROW), bool))
    for what, a, b in (("y", y_p, y_a), ("dx", gx_p, gx_a)):
        a, b = _to_alone(np.asarray(a))[real], np.asarray(b)[real]
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(), err_msg=what)
    flat_p, flat_a = nnx.to_flat_state(gp_p), nnx.to_flat_state(gp_a)
    for (path, a), (_, b) in zip(flat_p, flat_a, strict=True):
        a, b = np.asarray(a[...]), np.asarray(b[...])
        scale = max(float(np.abs(b).max()), 1e-6)
        np.testing.assert_allclose(a / scale, b / scale, atol=2e-5, err_msg=str(path))
        assert np.abs(a).max() > 0, path


def test_options_are_validated():
    with pytest.raises(ValueError, match="impl"):
        HolaMixer(D_MODEL, H, D, rngs=nnx.Rngs(0), impl="recurrent")
    with pytest.raises(ValueError, match="eviction"):
        _hola(eviction="lru")
    with pytest.raises(ValueError, match="read_norm"):
        _hola(read_norm="layernorm")
    with pytest.raises(ValueError, match="window"):
        _hola(window=0)
    layer, x = _hola(), _x(9, 2, 5)
    with pytest.raises(ValueError, match="segment_ids"):
        layer(x, segment_ids=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids: packed segments cannot be combined"):
        layer(x, segment_ids=jnp.zeros((2, 5), jnp.int32), cache=layer.init_cache(2, 5))


def test_parameters_init_and_receive_gradients():
    layer = _hola(gate_init=-4.0)
    np.testing.assert_array_equal(layer.gate_logit[...], np.full((H,), -4.0, np.float32))
    np.testing.assert_array_equal(layer.gamma_q[...], np.ones((H, D), np.float32))
    np.testing.assert_array_equal(layer.sink_logit[...], np.zeros((H,), np.float32))
    x = _x(5, 1, 13)

    def loss(layer):
        y, _ = layer(x)
        return jnp.sum(jnp.sin(y))

    grads = nnx.jit(nnx.grad(loss))(layer)
    for name in ("gamma_q", "gamma_k", "sink_logit", "gate_logit", "q_proj"):
        leaves = jax.tree.leaves(getattr(grads, name))
        assert all(np.isfinite(np.asarray(a)).all() for a in leaves), name
        assert any(float(jnp.abs(a).max()) > 0 for a in leaves), name
