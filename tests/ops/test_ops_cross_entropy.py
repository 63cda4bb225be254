"""``ops.chunked_cross_entropy``: values and gradients equal the plain loss (f32 logits of the
whole batch, then ``masked_cross_entropy``) without a ``[B, T, V]`` intermediate (issue 14)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.ops import chunked_cross_entropy
from nested_jax.train.step import masked_cross_entropy

_EINSUM = {"vd": "btd,vd->btv", "dv": "btd,dv->btv"}
# These programs run once: compile time rules (as in tests/core/titans/test_titans.py).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _data(b, t, v, d, layout, dtype=jnp.float32, seed=0):
    # numpy draws: no eager JAX ops to compile per case.
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((b, t, d), np.float32)).astype(dtype)
    shape = (v, d) if layout == "vd" else (d, v)
    weight = jnp.asarray(rng.standard_normal(shape, np.float32) * d**-0.5)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    # Zeros (ignored tokens), ones and a fractional weight.
    mask = jnp.asarray(rng.choice(np.array([0.0, 1.0, 1.0, 0.5], np.float32), (b, t)))
    return hidden, weight, targets, mask


def _plain(hidden, weight, targets, mask, layout):
    logits = jnp.einsum(
        _EINSUM[layout], hidden, weight.astype(hidden.dtype), preferred_element_type=jnp.float32
    )
    return masked_cross_entropy(logits, targets, mask)


def _compare(b, t, v, d, chunk, layout, dtype, rtol, atol):
    hidden, weight, targets, mask = _data(b, t, v, d, layout, dtype)

    def both(h, w):  # one compiled program for the two paths
        vg = jax.value_and_grad
        ref = vg(lambda h, w: _plain(h, w, targets, mask, layout), (0, 1), has_aux=True)(h, w)
        out = vg(
            lambda h, w: chunked_cross_entropy(
                h, w, targets, mask, chunk_tokens=chunk, weight_layout=layout
            ),
            (0, 1),
            has_aux=True,
        )(h, w)
        return ref, out

    ((ref_loss, ref_w), ref_g), ((loss, wsum), grads) = (
        jax.jit(both).lower(hidden, weight).compile(FAST_COMPILE)(hidden, weight)
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(wsum, ref_w)
    for got, want, name in zip(grads, ref_g, ("d hidden", "d weight"), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=atol,
            err_msg=name,
        )  # fmt: skip
    assert np.isfinite(np.asarray(grads[0], np.float32)).all()


# (B, T, V, d, chunk, layout): T not a multiple of the chunk and odd V, chunk 1 (T a multiple),
# chunk == T, chunk > T and chunk 0 (one chunk: the plain loss), T = 1.
CASES = [
    (2, 13, 257, 16, 4, "vd"),
    (2, 13, 257, 16, 1, "dv"),
    (2, 13, 257, 16, 13, "vd"),
    (2, 13, 257, 16, 100, "dv"),
    (1, 7, 33, 8, 0, "vd"),
    (1, 1, 5, 4, 3, "dv"),
]


@pytest.mark.parametrize("b,t,v,d,chunk,layout", CASES)
def test_chunked_equals_plain_f32(b, t, v, d, chunk, layout):
    # f32: only the summation order differs (per-chunk matmuls, dW summed over chunks).
    _compare(b, t, v, d, chunk, layout, jnp.float32, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("chunk,layout", [(5, "vd"), (3, "dv")])
def test_chunked_equals_plain_bf16(chunk, layout):
    # bf16 hidden: d hidden is bf16 in both paths; d weight is rounded to bf16 once per chunk and
    # summed in f32 (plain: rounded once), so up to a few bf16 ulps (2^-8 relative) apart.
    _compare(2, 19, 257, 16, chunk, layout, jnp.bfloat16, rtol=2e-2, atol=2e-3)


def _all_avals(jaxpr):
    """Every value of ``jaxpr`` and of its sub-jaxprs (scan / remat / pjit bodies)."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _all_avals(sub)


def test_no_batch_logits_intermediate():
    b, t, v, d, chunk = 2, 512, 4096, 32, 64
    hidden, weight, targets, mask = _data(b, t, v, d, "vd")

    def chunked(h, w):
        return chunked_cross_entropy(h, w, targets, mask, chunk_tokens=chunk, weight_layout="vd")[0]

    def plain(h, w):
        return _plain(h, w, targets, mask, "vd")[0]

    grad = jax.grad(chunked, argnums=(0, 1))
    sizes = [int(np.prod(a.shape)) for a in _all_avals(jax.make_jaxpr(grad)(hidden, weight).jaxpr)]
    assert max(sizes) <= b * chunk * v  # the largest value is one chunk's logits
    plain_sizes = _all_avals(jax.make_jaxpr(jax.grad(plain, argnums=(0, 1)))(hidden, weight).jaxpr)
    assert max(int(np.prod(a.shape)) for a in plain_sizes) == b * t * v  # the check can see it

    # Compiled scratch memory: the plain loss needs more than the f32 logits of the batch, the
    # chunked one a fraction of it.
    full = b * t * v * 4
    ma = jax.jit(grad).lower(hidden, weight).compile(FAST_COMPILE).memory_analysis()
    plain_grad = jax.jit(jax.grad(plain, argnums=(0, 1)))
    ma_plain = plain_grad.lower(hidden, weight).compile(FAST_COMPILE).memory_analysis()
    if ma is None or ma_plain is None:
        pytest.skip("memory_analysis unavailable on this backend")
    assert ma_plain.temp_size_in_bytes >= full
    assert ma.temp_size_in_bytes < full // 2


def test_bad_arguments_raise():
    hidden, weight, targets, mask = _data(2, 5, 11, 4, "vd")
    kw = dict(chunk_tokens=2, weight_layout="vd")
    with pytest.raises(ValueError, match="hidden"):
        chunked_cross_entropy(hidden[0], weight, targets, mask, **kw)
    with pytest.raises(ValueError, match=r"weight: expected shape \[V, d\]"):
        chunked_cross_entropy(hidden, weight.T, targets, mask, **kw)
    with pytest.raises(ValueError, match=r"weight: expected shape \[d, V\]"):
        chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=2, weight_layout="dv")
    with pytest.raises(ValueError, match="weight"):
        chunked_cross_entropy(hidden, weight[0], targets, mask, **kw)
    with pytest.raises(ValueError, match="weight_layout"):
        chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=2, weight_layout="x")
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(hidden, weight, targets[:, :4], mask, **kw)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(hidden, weight, targets.astype(jnp.float32), mask, **kw)
    with pytest.raises(ValueError, match="mask"):
        chunked_cross_entropy(hidden, weight, targets, mask[:1], **kw)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=2.5, weight_layout="vd")
    with pytest.raises(ValueError, match="chunked_cross_entropy.*pallas"):
        chunked_cross_entropy(hidden, weight, targets, mask, impl="pallas", **kw)
