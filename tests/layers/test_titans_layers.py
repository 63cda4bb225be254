"""Titans mixers (SPEC §2): decode == full forward for LMM / MAC / MAG / MAL (chunk and segment
boundaries, T not a multiple of either), causality, MAC order (retrieve → attend → store → read),
option and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers.options import TitansOptions
from nested_jax.layers.rope import segment_positions
from nested_jax.models.config import ModelConfig
from nested_jax.models.registry import get_mixer

D_MODEL, B, T = 32, 2, 21  # segments of 8 (N_s) and memory chunks of 4: T ends mid-chunk/segment
OPTS = dict(memory_chunk=4, segment_len=8, window=5, persistent_tokens=2, memory_hidden=24)


def _mixer(name, seed=0, **opts):
    cfg = ModelConfig(
        name=name, d_model=D_MODEL, n_heads=2, titans=TitansOptions(**{**OPTS, **opts})
    )
    return get_mixer(name).from_config(cfg, rngs=nnx.Rngs(seed))


def _x(seed=1, t=T):
    return jax.random.normal(jax.random.key(seed), (B, t, D_MODEL), jnp.float32)


def _pos(t0, t1):
    return jnp.broadcast_to(jnp.arange(t0, t1, dtype=jnp.int32), (B, t1 - t0))


@nnx.jit
def _full(m, x):
    return m(x, positions=_pos(0, x.shape[1]))[0]


@nnx.jit
def _cached_jit(m, x, cache, pos):
    return m(x, positions=pos, cache=cache)


def _cached(m, x, cache, t0):
    return _cached_jit(m, x, cache, _pos(t0, t0 + x.shape[1]))


def _decode(m, x, prefill):
    """Prefill ``prefill`` tokens in one cached call, then one token at a time."""
    cache = m.init_cache(B, x.shape[1])
    outs = []
    if prefill:
        y, cache = _cached(m, x[:, :prefill], cache, 0)
        outs.append(y)
    for t in range(prefill, x.shape[1]):
        y, cache = _cached(m, x[:, t : t + 1], cache, t)
        outs.append(y)
    return jnp.concatenate(outs, 1), cache


slow = pytest.mark.slow
CASES = [
    ("titans_lmm", {}, 5),  # L_M = 2; L_M = 1 runs in tests/models/test_titans_models.py
    ("titans_mac", {}, 3),
    ("titans_mag", {}, 0),
    ("titans_mal", {}, 0),
    pytest.param("titans_lmm", {"memory_layers": 1}, 0, marks=slow),
    pytest.param("titans_lmm", {"memory_layers": 3, "read_before_write": True}, 0, marks=slow),
    pytest.param("titans_lmm", {"memory_impl": "recurrent"}, 0, marks=slow),
    pytest.param(
        "titans_mac",
        {"memory_layers": 1, "memory_impl": "recurrent", "segment_len": 5},
        0,
        marks=slow,
    ),
    pytest.param("titans_mag", {"memory_layers": 4}, 6, marks=slow),
    pytest.param("titans_mal", {"memory_layers": 1}, 2, marks=slow),
]


@pytest.mark.parametrize("name,opts,prefill", CASES)
def test_decode_equals_full_forward(name, opts, prefill):
    m = _mixer(name, **opts)
    x = _x()
    full = _full(m, x)
    dec, _ = _decode(m, x, prefill)
    assert full.shape == (B, T, D_MODEL) and bool(jnp.isfinite(full).all())
    np.testing.assert_allclose(np.asarray(dec), np.asarray(full), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["titans_lmm", "titans_mac", "titans_mag", "titans_mal"])
def test_causal(name):
    m = _mixer(name)
    x = _x()
    x2 = x.at[:, 11:].add(jax.random.normal(jax.random.key(9), (B, T - 11, D_MODEL)))
    y, y2 = _full(m, x), _full(m, x2)
    np.testing.assert_array_equal(np.asarray(y[:, :11]), np.asarray(y2[:, :11]))
    assert float(jnp.abs(y[:, 11:] - y2[:, 11:]).max()) > 1e-3


def _seg_weights_per_token(m, x):
    """The retrieval state ``M_{s-1}`` (first memory layer) in the decode cache after each token;
    inside a segment it is the state that token retrieved from."""
    cache = m.init_cache(B, x.shape[1])
    used = []
    for t in range(x.shape[1]):
        _, cache = _cached(m, x[:, t : t + 1], cache, t)
        used.append(np.asarray(cache.seg_weights[0]))
    return np.stack(used), cache


def test_mac_retrieval_depends_only_on_earlier_segments():
    m = _mixer("titans_mac")
    x = _x(t=24)  # three segments of 8
    w, _ = _seg_weights_per_token(m, x)
    # One retrieval state per segment (kept until its last token); segment 0 uses the learned M_0.
    for s in range(3):
        assert np.array_equal(w[8 * s], w[8 * s + 6])
    m0 = np.broadcast_to(np.asarray(m.memory.w0[...]), w[0].shape)
    np.testing.assert_array_equal(w[0], m0)
    assert not np.allclose(w[8], w[0]) and not np.allclose(w[16], w[8])
    # Perturbing segment 1 leaves the retrieval of segments 0 and 1 alone, changes segment 2's.
    x2 = x.at[:, 8:16].add(1.0)
    w2, _ = _seg_weights_per_token(m, x2)
    np.testing.assert_array_equal(w2[:15], w[:15])
    assert float(np.abs(w2[16] - w[16]).max()) > 1e-4
    # And the forward agrees: outputs of segment 0 are unchanged.
    y, y2 = _full(m, x), _full(m, x2)
    np.testing.assert_array_equal(np.asarray(y[:, :8]), np.asarray(y2[:, :8]))


def test_mac_write_uses_the_segments_attention_output():
    """Order retrieve → attend → store: the state after segment 0 equals the memory rule applied
    to projections of the attention output over [persistent ‖ M_0(q) ‖ segment]; changing only
    attention parameters (persistent values) changes what is written."""
    m = _mixer("titans_mac")
    x = _x(t=8)
    _, cache = _seg_weights_per_token(m, x)  # exactly one segment: cache holds M_1
    pos = _pos(0, 8)
    qm, _ = m._retrieval_query(x)
    kh, vh = m._retrieved_kv(m.memory.initial_state(B).weights, qm, pos)
    qx, kx, vx = m.attn.qkv(x, pos)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (B, 8, 8))
    y = m.attn.attend(
        qx, jnp.concatenate([kh, kx], 1), jnp.concatenate([vh, vx], 1), jnp.concatenate(
            [causal, causal], 2)
    )  # fmt: skip
    _, st = m.memory(*m._store_inputs(y), state=m.memory.initial_state(B))
    for got, want in zip(cache.seg_weights, st.weights, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Persistent values enter only the attention output y; the write must follow them.
    m.attn.p_v[...] = m.attn.p_v[...] + 1.0
    _, cache2 = _seg_weights_per_token(m, x)
    assert float(jnp.abs(cache2.seg_weights[0] - cache.seg_weights[0]).max()) > 1e-4


def test_segment_ids_reset_attention_and_conv_and_stay_finite():
    m = _mixer("titans_mac")
    x = _x()
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 11], B, 0), jnp.int32)
    y, _ = nnx.jit(lambda m, x, s: m(x, positions=_pos(0, T), segment_ids=s))(m, x, seg)
    assert bool(jnp.isfinite(y).all())
    # Document 1 never sees document 2 (causal anyway) and its outputs equal the unpacked run.
    np.testing.assert_allclose(np.asarray(y[:, :10]), np.asarray(_full(m, x)[:, :10]), atol=1e-6)


@pytest.mark.parametrize(
    "opts,field",
    [
        ({"memory_layers": 5}, "memory_layers"),
        ({"memory_layers": True}, "memory_layers"),
        ({"memory_chunk": 0}, "memory_chunk"),
        ({"memory_impl": "pallas"}, "memory_impl"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"eta_init": 1.0}, "eta_init"),
        ({"window": -1}, "window"),
        ({"segment_len": 10, "memory_chunk": 4}, "segment_len"),
        ({"read_before_write": 1}, "read_before_write"),
    ],
)
def test_options_validation_names_the_field(opts, field):
    with pytest.raises(ValueError, match=f"TitansOptions.{field}"):
        TitansOptions(**opts)


def test_bad_inputs_raise_naming_the_argument():
    m = _mixer("titans_lmm")
    with pytest.raises(ValueError, match="x: expected shape"):
        m(jnp.zeros((B, D_MODEL)))
    with pytest.raises(ValueError, match="segment_ids"):
        m(_x(t=4), segment_ids=jnp.zeros((B, 4), jnp.int32), cache=m.init_cache(B, 4))
    with pytest.raises(ValueError, match="segment_ids"):
        m(_x(t=4), segment_ids=jnp.zeros((B, 5), jnp.int32))
    with pytest.raises(ValueError, match="per_chunk_gates"):
        _mixer("titans_mag", per_chunk_gates=True).init_cache(B, 4)


def test_grad_horizon_keeps_values_and_cuts_gradients():
    """Truncated backprop (``grad_horizon``) changes gradients only: values equal the full run."""
    m = _mixer("titans_lmm", grad_horizon=8)
    m_full = _mixer("titans_lmm", grad_horizon=0)
    x = _x()
    np.testing.assert_allclose(np.asarray(_full(m, x)), np.asarray(_full(m_full, x)), atol=1e-6)

    @nnx.jit
    def g(mod, x):  # d(last output) / d(first input), across two 8-token windows
        def f(mod, x0):
            return mod(x.at[:, 0].set(x0), positions=_pos(0, T))[0][:, -1].sum()

        return nnx.grad(f, argnums=1)(mod, x[:, 0])

    # Token 0 reaches token 20 only through the memory state (the short conv is 4 wide), so the
    # horizon cuts that gradient exactly.
    assert float(jnp.abs(g(m, x)).max()) == 0.0 and float(jnp.abs(g(m_full, x)).max()) > 0.0


def _packed_vs_separate(m, x, cut, *, grads=False):
    """Outputs (and optionally parameter gradients of a fixed random projection of them) of a
    packed row ``[doc 1 = x[:, :cut] | doc 2 = x[:, cut:]]`` and of each document run alone."""
    t = x.shape[1]
    seg = jnp.asarray(np.repeat([[1] * cut + [2] * (t - cut)], B, 0), jnp.int32)
    proj = jax.random.normal(jax.random.key(5), (B, t, D_MODEL))

    pos = segment_positions(seg, B, t, 0)  # RoPE restarts per document, as the LM shell does

    def packed(mod):
        y = mod(x, positions=pos, segment_ids=seg)[0]
        return jnp.sum(y * proj), y

    def separate(mod):
        y1 = mod(x[:, :cut], positions=_pos(0, cut))[0]
        y2 = mod(x[:, cut:], positions=_pos(0, t - cut))[0]
        y = jnp.concatenate([y1, y2], 1)
        return jnp.sum(y * proj), y

    if not grads:
        return nnx.jit(lambda m: packed(m)[1])(m), nnx.jit(lambda m: separate(m)[1])(m)
    vg = lambda f: nnx.jit(nnx.value_and_grad(f, has_aux=True))(m)  # noqa: E731
    (_, yp), gp = vg(packed)
    (_, ys), gs = vg(separate)
    return yp, ys, gp, gs


PACKED = [
    # (mixer, options, document boundary): chunks of 4, MAC segments of 8, T = 21. Boundaries
    # 7 and 9 are mid-chunk (each document keeps its own chunk grid); MAC segments stay on the
    # row's grid, so its documents are exact when they start at a multiple of segment_len.
    ("titans_lmm", {"memory_layers": 1}, 7),
    pytest.param("titans_lmm", {"memory_layers": 2}, 9, marks=slow),  # ~45 s; 1 layer stays
    ("titans_mac", {}, 8),
    pytest.param("titans_lmm", {"memory_layers": 1}, 12, marks=slow),
    pytest.param("titans_lmm", {"memory_layers": 2, "memory_impl": "recurrent"}, 9, marks=slow),
    pytest.param("titans_mag", {"memory_layers": 2}, 6, marks=slow),
    pytest.param("titans_mal", {"memory_layers": 1}, 5, marks=slow),
    pytest.param("titans_mac", {"memory_layers": 1, "memory_impl": "recurrent"}, 16, marks=slow),
]


@pytest.mark.parametrize("name,opts,cut", PACKED)
def test_packed_row_equals_separate_documents(name, opts, cut):
    """Exact memory reset (SPEC §0 packed sequences): each document of a packed row gets the
    outputs and the parameter gradients of running it alone (full-horizon backprop, so the
    truncation windows of the row and of the document agree)."""
    m = _mixer(name, grad_horizon=0, **opts)
    yp, ys, gp, gs = _packed_vs_separate(m, _x(), cut, grads=True)
    np.testing.assert_allclose(np.asarray(yp), np.asarray(ys), rtol=1e-5, atol=1e-5)
    flat_p, flat_s = jax.tree.leaves(gp), jax.tree.leaves(gs)
    for a, b in zip(flat_p, flat_s, strict=True):
        scale = max(float(jnp.abs(b).max()), 1e-3)
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=1e-5)
    # The memory's learned M_0 is trained (the reset target is M_0, not a zero memory).
    w0 = [v for path, v in jax.tree_util.tree_leaves_with_path(gp) if "'w0'" in str(path)]
    assert len(w0) == 1 and float(jnp.abs(w0[0]).max()) > 0


def test_packed_row_differs_from_carrying_the_memory_over():
    """The reset matters: without segment_ids document 2 reads document 1's memory."""
    m = _mixer("titans_lmm", memory_layers=1)
    x = _x()
    yp, ys = _packed_vs_separate(m, x, 8)
    unpacked = _full(m, x)
    assert float(jnp.abs(unpacked[:, 8:] - ys[:, 8:]).max()) > 1e-3
    np.testing.assert_allclose(np.asarray(yp), np.asarray(ys), rtol=1e-5, atol=1e-5)


def test_theta_max_caps_the_inner_learning_rate():
    """``θ_t = theta_max·σ(·)`` (TitansOptions.theta_max): starts at theta_init, never above the
    cap even for huge gate pre-activations; the other gates are unchanged."""
    m = _mixer("titans_lmm", theta_max=0.05, theta_init=0.02)
    mem = m.branch.memory
    th, et, al = mem.gates(_x())
    assert float(th.max()) < 0.05 and float(th.min()) > 0.0
    big = mem.gates(1e4 * _x())[0]
    assert float(big.max()) <= np.float32(0.05) and float(big.max()) > 0.049
    mem.gate_proj.kernel[...] = jnp.zeros_like(mem.gate_proj.kernel[...])
    th0, et0, al0 = mem.gates(_x())
    np.testing.assert_allclose(np.asarray(th0), 0.02, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(et0), 0.9, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(al0), 0.01, rtol=1e-5)
    with pytest.raises(ValueError, match="TitansOptions.theta_max"):
        TitansOptions(theta_max=1.5)
    with pytest.raises(ValueError, match="TitansOptions.theta_init"):
        TitansOptions(theta_max=0.05, theta_init=0.1)
