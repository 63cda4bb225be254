"""nested_jax.ops.titans (SPEC §2, §4): the Titans memory door — chunk 1 == recurrent on values and
gradients, Proteus packed rows through ops == the layer == the core wrapper per document, the
decode step == the sequence form, and explicit impl errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.core.titans.proteus import proteus_titans_mlp_chunked
from nested_jax.layers.options import ProteusOptions, TitansOptions
from nested_jax.models.config import ModelConfig
from nested_jax.models.registry import get_mixer
from nested_jax.ops import titans as T
from nested_jax.rules import ProteusRule, TitansRule

B, L, H, D = 2, 7, 2, 4  # T = 7: not a multiple of any chunk; 2-layer memory (D → 8 → D)
DIMS = (D, 8, D)


def _inputs(seed=0, t=L):
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    q, k = (unit(rng.normal(size=(B, t, H, D))).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(B, t, H, D)).astype(np.float32)
    th = rng.uniform(0.05, 0.3, size=(B, t, H)).astype(np.float32)
    et, al = (rng.uniform(0.1, 0.9, size=(B, t, H)).astype(np.float32) for _ in range(2))
    return tuple(jnp.asarray(a) for a in (q, k, v, th, et, al))


def _m0(seed=0):
    return T.titans_mlp_init_weights(jax.random.key(seed), H, DIMS)


def test_chunk_one_equals_recurrent_values_and_gradients():
    spec = T.TitansMemorySpec(DIMS, rule=TitansRule(memory_chunk=1))
    xs, m0 = _inputs(), _m0()

    def loss(m0, xs, impl):
        y, st = T.titans_memory(*xs, initial_state=T.titans_mlp_state(m0, B), spec=spec, impl=impl)
        return jnp.sum(jnp.sin(y)) + sum(jnp.sum(w) for w in st.weights), y

    @jax.jit
    def both(m0, xs):  # one program for both forms (one compile)
        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        return grad(m0, xs, "chunked"), grad(m0, xs, "recurrent")

    ((_, y_c), g_c), ((_, y_r), g_r) = both(m0, xs)
    np.testing.assert_allclose(np.asarray(y_c), np.asarray(y_r), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(g_c, g_r, rtol=1e-4, atol=1e-5)


def test_proteus_packed_rows_through_ops_equal_the_layer_and_the_core_wrapper():
    """E = 2 over N = 8 (Δ = 4) on a packed row of 2 + 9 tokens from a carried state. The
    layer's memory traces exactly the op (same jaxpr, so bit for bit), and the second document
    equals the core wrapper run alone from (M_0, 0) at its row position t0 = 2: mid-span, through
    the block opening at t = 5, with the carried locked coordinates reset too (SPEC §4)."""
    cfg = ModelConfig(
        name="titans_lmm", d_model=16, n_heads=H, head_dim=D, proteus=ProteusOptions(2, 8),
        titans=TitansOptions(memory_chunk=2, segment_len=8, memory_hidden=8),
    )  # fmt: skip
    mem = get_mixer("titans_lmm").from_config(cfg, rngs=nnx.Rngs(0)).branch.memory
    assert mem.spec.dims == DIMS and mem.spec.proteus.blocks == 2
    n, cut = 11, 2
    xs = _inputs(1, t=n)
    seg = jnp.asarray(np.repeat([[1] * cut + [2] * (n - cut)], B, 0), jnp.int32)
    carried = jax.tree.map(lambda a: a + 0.1, mem.initial_state(B))

    def via_ops(xs):  # what the layer documents: reset to the learned (M_0, 0)
        m0 = mem.initial_state(B)
        kw = dict(spec=mem.spec, impl=mem.impl, segment_ids=seg, reset_state=m0)
        return T.titans_memory(*xs, initial_state=carried, **kw)

    layer = jax.make_jaxpr(lambda xs: mem(*xs, state=carried, segment_ids=seg))(xs)
    assert str(layer) == str(jax.make_jaxpr(via_ops)(xs))

    @jax.jit
    def run(xs):
        y_ref, _ = proteus_titans_mlp_chunked(
            *(a[:, cut:] for a in xs), initial_state=mem.initial_state(B), rule=mem.spec.rule,
            schedule=ProteusRule(blocks=2, context_len=8), t0=cut,
        )  # fmt: skip
        return via_ops(xs)[0], y_ref

    y_ops, y_ref = run(xs)
    np.testing.assert_allclose(np.asarray(y_ops[:, cut:]), np.asarray(y_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,chunk", [("chunked", 2), ("recurrent", 4)])
def test_decode_step_equals_the_sequence_form(impl, chunk):
    """Proteus E = 2 over N = 8 (Δ = 4, chunk 2 divides it); T = 7 crosses the span start at 5.
    The recurrent impl decodes per token whatever ``spec.rule.memory_chunk``."""
    spec = T.TitansMemorySpec(DIMS, rule=TitansRule(memory_chunk=chunk), proteus=ProteusRule(2, 8))
    xs, m0 = _inputs(2), _m0(1)
    cache = T.titans_memory_init_cache(spec, B, H, impl=impl)
    assert cache.q.shape == (B, 1 if impl == "recurrent" else chunk, H, D)

    @jax.jit
    def run(cache, xs):  # the sequence form and a scan of decode steps, one compile
        y_seq, st_seq = T.titans_memory(
            *xs, initial_state=T.titans_mlp_state(m0, B), spec=spec, impl=impl
        )

        def body(c, tok):
            y, c = T.titans_memory_step(c, *tok, spec=spec, initial_weights=m0, impl=impl)
            return c, y

        cache, ys = jax.lax.scan(body, cache, tuple(jnp.moveaxis(a, 1, 0) for a in xs))
        return y_seq, st_seq, jnp.moveaxis(ys, 0, 1), cache

    y_seq, st_seq, ys, cache = run(cache, xs)
    np.testing.assert_allclose(np.asarray(ys), np.asarray(y_seq), atol=1e-5)
    if impl == "recurrent":  # every token commits: the cache holds the final state
        for a, b in zip(cache.weights, st_seq.weights, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_impl_errors_name_the_op():
    spec = T.TitansMemorySpec(DIMS, rule=TitansRule(memory_chunk=2))
    xs, m0 = _inputs(), _m0()
    st = T.titans_mlp_state(m0, B)
    cache = T.titans_memory_init_cache(spec, B, H)
    calls = {
        "titans_memory": lambda impl: T.titans_memory(*xs, initial_state=st, spec=spec, impl=impl),
        "titans_memory_step": lambda impl: T.titans_memory_step(
            cache, *(a[:, 0] for a in xs), spec=spec, initial_weights=m0, impl=impl
        ),
        "titans_memory_init_cache": lambda impl: T.titans_memory_init_cache(spec, B, H, impl=impl),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=f"{op}: impl='pallas' covers only the matrix memory"):
            call("pallas")
        with pytest.raises(ValueError, match=f"{op}: impl must be one of"):
            call("bogus")
    # the memory has no zero state: a missing initial_state names the constructor
    with pytest.raises(ValueError, match=r"^titans_memory: initial_state: .*titans_mlp_state\("):
        T.titans_memory(*xs, spec=spec)


def test_spec_is_hashable_and_checks():
    assert hash(T.TitansMemorySpec([4, 4])) == hash(T.TitansMemorySpec((4, 4)))
    assert T.TitansMemorySpec(DIMS).rule == TitansRule()  # the paper's rule by default
    chunk = lambda b: TitansRule(memory_chunk=b)  # noqa: E731
    with pytest.raises(ValueError, match=r"^TitansMemorySpec\.rule: must be a TitansRule"):
        T.TitansMemorySpec(DIMS, rule={"memory_chunk": 2})
    with pytest.raises(ValueError, match=r"^TitansMemorySpec\.proteus: must be a ProteusRule"):
        T.TitansMemorySpec(DIMS, proteus=(2, 8))
    with pytest.raises(ValueError, match="per_chunk_gates"):
        pooled = TitansRule(per_chunk_gates=True)
        T.titans_memory_init_cache(T.TitansMemorySpec(DIMS, rule=pooled), B, H)
    with pytest.raises(ValueError, match="memory_chunk"):  # chunk 4 does not divide Δ = 6
        T.titans_memory_init_cache(
            T.TitansMemorySpec(DIMS, rule=chunk(4), proteus=ProteusRule(4, 24)), B, H
        )
    cache = T.titans_memory_init_cache(T.TitansMemorySpec(DIMS, rule=chunk(2)), B, H)
    with pytest.raises(ValueError, match="decode chunk"):
        T.titans_memory_step(
            cache, *(a[:, 0] for a in _inputs()), spec=T.TitansMemorySpec(DIMS, rule=chunk(4)),
            initial_weights=_m0(),
        )  # fmt: skip
