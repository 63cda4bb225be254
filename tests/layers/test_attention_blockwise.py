"""``blockwise_softmax_attention`` equals ``softmax_attention(attention_mask(...))`` (values and
gradients) without a ``[..., T, S]`` intermediate, and the ``Attention`` module's blockwise path
equals its full-scores path (issue 14)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers import Attention, attention_mask, segment_positions, softmax_attention
from nested_jax.layers.attention import blockwise_softmax_attention

# f32 everywhere (conftest: "highest" matmul precision). Each query row's softmax is the same
# computation in both paths; only XLA's blocking of the einsums differs (observed <= 2e-6).
RTOL = ATOL = 1e-5
# These programs run once: compile time rules (as in tests/core/titans/test_titans.py).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _run_once(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def _case(b, t, s, h, hk, d, *, segments, cache_pos=None, seed=0):
    """q, k, v, a cotangent and the index / segment / validity arrays of one case."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    q, k, v, ct = f(b, t, h, d), f(b, s, hk, d), f(b, s, hk, d), f(b, t, h, d)
    kw = {}
    if cache_pos is None:  # self-attention over the T new tokens
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        kw.update(q_index=idx, k_index=idx)
        if segments:
            seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
            kw.update(q_segment=seg, k_segment=seg)
    else:  # T queries at slots pos..pos+T-1 of an S-slot cache; some filled slots invalid
        kw["q_index"] = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + cache_pos, (b, t))
        kw["k_index"] = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        valid = (np.arange(s) < cache_pos + t)[None] & (rng.random((b, s)) > 0.2)
        valid[:, 0] = True  # every query sees at least slot 0
        kw["k_valid"] = jnp.asarray(valid)
    return q, k, v, ct, kw


def _reference(q, k, v, *, window=0, scale=None, **kw):
    mask = attention_mask(
        kw["q_index"], kw["k_index"], window=window, q_segment=kw.get("q_segment"),
        k_segment=kw.get("k_segment"), k_valid=kw.get("k_valid"),
    )  # fmt: skip
    return softmax_attention(q, k, v, mask, scale=scale)


# (B, T, S, H, H_kv, D, block, window, segments, cache_pos)
CASES = [
    pytest.param(2, 37, 37, 4, 2, 8, 8, 0, False, None, id="T37-block8-gqa"),
    pytest.param(2, 37, 37, 4, 4, 8, 8, 5, True, None, id="T37-block8-window-segments"),
    pytest.param(1, 5, 5, 4, 2, 8, 8, 0, True, None, id="T-below-block"),
    pytest.param(1, 6, 6, 4, 1, 8, 1, 3, False, None, id="block1-window-mqa"),
    pytest.param(2, 13, 29, 4, 2, 8, 4, 6, False, 9, id="cache-S-gt-T-k_valid"),
]


@pytest.mark.parametrize("b,t,s,h,hk,d,block,window,segments,cache_pos", CASES)
def test_blockwise_equals_reference(b, t, s, h, hk, d, block, window, segments, cache_pos):
    q, k, v, ct, kw = _case(b, t, s, h, hk, d, segments=segments, cache_pos=cache_pos)
    scale = 0.3 if block == 1 else None

    def both(q, k, v):  # one compiled program for the two paths: (loss, o), (dq, dk, dv)
        def vg(fn):
            def loss(q, k, v):
                o = fn(q, k, v)
                return jnp.sum(o * ct), o

            return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

        ref = vg(lambda q, k, v: _reference(q, k, v, window=window, scale=scale, **kw))
        out = vg(
            lambda q, k, v: blockwise_softmax_attention(
                q, k, v, window=window, scale=scale, block=block, **kw
            )
        )
        return ref, out

    ((ref_l, ref_o), ref_g), ((out_l, out_o), out_g) = _run_once(both, q, k, v)
    assert out_o.shape == ref_o.shape == q.shape and out_o.dtype == q.dtype
    np.testing.assert_allclose(out_o, ref_o, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out_l, ref_l, rtol=RTOL, atol=ATOL)
    for got, want, name in zip(out_g, ref_g, ("dq", "dk", "dv"), strict=True):
        assert np.isfinite(np.asarray(got)).all(), name  # padded query rows leak no NaN
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)


def _all_shapes(jaxpr):
    """Shapes of every value of ``jaxpr`` and of its sub-jaxprs (map / remat / pjit bodies)."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(var.aval.shape)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _all_shapes(sub)


def _has_scores(fn, args, t, s, block):
    """Whether the forward + backward jaxpr of ``fn`` holds a value ending in ``(T, S)``
    (``T`` also rounded up to the block)."""
    tp = -(-t // block) * block
    grad = jax.grad(lambda *a: jnp.sum(fn(*a)), (0, 1, 2))
    shapes = list(_all_shapes(jax.make_jaxpr(grad)(*args).jaxpr))
    return any(len(sh) >= 2 and sh[-2:] in ((t, s), (tp, s)) for sh in shapes)


@pytest.mark.parametrize("cache_pos", [None, 9])
def test_blockwise_has_no_t_by_s_intermediate(cache_pos):
    t, s, block = (37, 37, 8) if cache_pos is None else (13, 29, 4)
    q, k, v, _, kw = _case(2, t, s, 4, 2, 8, segments=cache_pos is None, cache_pos=cache_pos)
    assert _has_scores(lambda q, k, v: _reference(q, k, v, window=5, **kw), (q, k, v), t, s, 8)
    blockwise = lambda q, k, v: blockwise_softmax_attention(q, k, v, window=5, block=block, **kw)
    assert not _has_scores(blockwise, (q, k, v), t, s, block)


def _layer(attention_block, window):
    return Attention(
        16, 4, 8, n_kv_heads=2, window=window, attention_block=attention_block, rngs=nnx.Rngs(0)
    )


def test_attention_module_blockwise_equals_full_scores():
    b, t = 2, 37
    x = jnp.asarray(np.random.default_rng(1).standard_normal((b, t, 16), np.float32))
    seg = jnp.asarray(np.sort(np.random.default_rng(2).integers(0, 3, (b, t)), axis=1), jnp.int32)
    layer = _layer(8, 5)
    reference = nnx.clone(layer)  # the same parameters, full-scores path
    reference.attention_block = 0
    assert layer.attention_block == 8

    def run(layer):
        def loss(x):
            y, _ = layer(x, positions=segment_positions(seg, b, t), segment_ids=seg)
            return jnp.sum(y**2), y

        (_, y), g = jax.value_and_grad(loss, has_aux=True)(x)
        # T = 37 > block new tokens into a 48-slot cache at pos 3.
        cache = layer.init_cache(b, 48)._replace(pos=jnp.asarray(3, jnp.int32))
        p, c = layer(x, positions=segment_positions(None, b, t, 3), cache=cache)
        return y, g, p, c

    def both(x):
        return run(reference), run(layer)

    def scores_shaped(layer):  # trace only: does the layer's forward hold a [..., T, T] value?
        def fwd(x):
            return layer(x, positions=segment_positions(seg, b, t), segment_ids=seg)[0]

        return any(sh[-2:] == (t, t) for sh in _all_shapes(jax.make_jaxpr(fwd)(x).jaxpr))

    assert scores_shaped(reference) and not scores_shaped(layer)
    ref, out = _run_once(both, x)
    for got, want, name in zip(out[:3], ref[:3], ("y", "dx", "prefill y"), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)
    for got, want in zip(out[3], ref[3], strict=True):
        np.testing.assert_array_equal(got, want)


def test_bad_arguments_raise():
    q, k, v, _, kw = _case(1, 6, 6, 2, 2, 4, segments=True)
    with pytest.raises(ValueError, match="attention_block"):
        _layer(-1, 0)
    with pytest.raises(ValueError, match="q_segment, k_segment"):
        blockwise_softmax_attention(
            q, k, v, q_index=kw["q_index"], k_index=kw["k_index"], q_segment=kw["q_segment"]
        )
    with pytest.raises(ValueError, match="k_index"):
        blockwise_softmax_attention(q, k, v, q_index=kw["q_index"], k_index=kw["k_index"][:, :5])
    with pytest.raises(ValueError, match="k_valid"):
        blockwise_softmax_attention(
            q, k, v, q_index=kw["q_index"], k_index=kw["k_index"], k_valid=jnp.ones((1, 5), bool)
        )
