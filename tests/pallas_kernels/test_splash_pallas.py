"""Splash attention (``pallas_kernels.splash``, ``model.attention_impl: pallas``) against the XLA
attention it replaces: values and gradients in the Pallas interpreter on awkward sizes (T not a
multiple of the 128-wide blocks, grouped KV heads, packed segments, a sliding window, MAC's tiled
``[h̃ ‖ x]`` keys, persistent prefix keys), the layers with either impl, a mesh, and the Mosaic
kernel in a TPU program compiled ahead of time on this CPU."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers import Attention, attention_mask, softmax_attention
from nested_jax.layers.persistent_attention import PersistentSWA
from nested_jax.models.config import ModelConfig
from nested_jax.ops.attention import splash_attention as ops_splash
from pallas_kernels.splash import SplashBlocks, splash_attention

B, H, HK, D, P = 2, 4, 2, 16, 3
TOL = 2e-5  # relative, float32: the kernel's online softmax vs the reference's one-pass softmax


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _reference(q, k, v, pk, pv, *, window, tiles, seg):
    """The layer's XLA attention over ``[prefix ‖ k]`` (its mask, ``softmax_attention``)."""
    b, t = q.shape[:2]
    idx = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg_k = None if seg is None else jnp.tile(seg, (1, tiles))
    mask = attention_mask(idx, jnp.tile(idx, (1, tiles)), window=window, q_segment=seg,
                          k_segment=seg_k)  # fmt: skip
    if pk is not None:
        k, v = jnp.concatenate([pk, k], 1), jnp.concatenate([pv, v], 1)
        mask = jnp.concatenate([jnp.ones((b, t, pk.shape[1]), bool), mask], 2)
    return softmax_attention(q, k, v, mask)


def _inputs(t, tiles, segments, prefix, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    seg = None
    if segments:  # three documents per row at random cut points, ids 0, 1, 2
        seg = jnp.asarray(np.sort(r.integers(0, 3, size=(B, t)), axis=1), jnp.int32)
    pre = (f(B, P, HK, D), f(B, P, HK, D)) if prefix else (None, None)
    return f(B, t, H, D), f(B, tiles * t, HK, D), f(B, tiles * t, HK, D), *pre, seg, f(B, t, H, D)


CASES = [  # (T, window, tiles, segments, prefix)
    (150, 0, 1, False, False),
    (150, 37, 1, True, False),
    (63, 0, 1, True, False),
    (150, 0, 2, True, True),  # MAC: [persistent ‖ h̃ ‖ x] in a segment
    (150, 20, 1, True, True),  # MAG / MAL: persistent + sliding window
    (129, 0, 1, False, True),
]


@pytest.mark.parametrize("t, window, tiles, segments, prefix", CASES)
def test_values_and_gradients_equal_the_reference(t, window, tiles, segments, prefix):
    """Every mask the layers use, in the interpreter with 128-wide blocks (so ``T`` is padded and
    more than one block is visited): the output and the gradients of q, k, v and the prefix keys
    and values equal autodiff of the reference."""
    q, k, v, pk, pv, seg, w = _inputs(t, tiles, segments, prefix)
    kw = dict(window=window, tiles=tiles, seg=seg)

    def ours(q, k, v, pk, pv):
        o = splash_attention(q, k, v, window=window, tiles=tiles, q_segment=seg,
                             k_segment=None if seg is None else jnp.tile(seg, (1, tiles)),
                             prefix_k=pk, prefix_v=pv, blocks=SplashBlocks(128, 128),
                             interpret=True)  # fmt: skip
        return jnp.sum(o * w), o

    def theirs(q, k, v, pk, pv):
        o = _reference(q, k, v, pk, pv, **kw)
        return jnp.sum(o * w), o

    argnums = (0, 1, 2, 3, 4) if prefix else (0, 1, 2)
    (_, got), g_got = jax.value_and_grad(ours, argnums, has_aux=True)(q, k, v, pk, pv)
    (_, want), g_want = jax.value_and_grad(theirs, argnums, has_aux=True)(q, k, v, pk, pv)
    assert got.shape == (B, t, H, D) and _rel(got, want) < TOL
    for name, a, b in zip("q k v pk pv".split(), g_got, g_want, strict=False):
        assert a.shape == b.shape and _rel(a, b) < TOL, name


def test_bfloat16_operands_stay_close():
    """bf16 q, k, v (the pods' activation dtype): output in bf16, within bf16 rounding."""
    q, k, v, _, _, seg, _ = _inputs(150, 1, True, False)
    cast = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    got = splash_attention(cast(q), cast(k), cast(v), q_segment=seg, k_segment=seg,
                           blocks=SplashBlocks(128, 128), interpret=True)  # fmt: skip
    want = _reference(q, k, v, None, None, window=0, tiles=1, seg=seg)
    assert got.dtype == jnp.bfloat16 and _rel(got, want) < 2e-2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k=np.zeros((B, 10, HK, D), np.float32)), "k, v"),
        (dict(k=np.zeros((B, 16, 3, D), np.float32), v=np.zeros((B, 16, 3, D), np.float32)),
         "H_kv=3"),
        (dict(q_segment=np.zeros((B, 16), np.int32)), "pass both"),
        (dict(prefix_k=np.zeros((B, P, HK, D), np.float32)), "prefix_k, prefix_v"),
        (dict(window=-1), "window"),
        (dict(tiles=0), "tiles"),
    ],
)  # fmt: skip
def test_bad_arguments_name_themselves(kwargs, match):
    args = dict(q=np.zeros((B, 16, H, D), np.float32), k=np.zeros((B, 16, HK, D), np.float32),
                v=np.zeros((B, 16, HK, D), np.float32))  # fmt: skip
    args.update(kwargs)
    q, k, v = (jnp.asarray(args.pop(n)) for n in "qkv")
    with pytest.raises(ValueError, match=match):
        splash_attention(q, k, v, interpret=True, **args)


@pytest.mark.parametrize("value", [0, 100, 96.0, True])
def test_block_sizes_validation(value):
    with pytest.raises(ValueError, match="multiple of 128"):
        SplashBlocks(q=value)


def test_attention_layer_pallas_equals_xla():
    """``Attention(impl="pallas")`` (transformer, hope_attention) with packed segments, GQA and a
    sliding window: the same values and parameter gradients as the blockwise XLA form; a KV cache
    (decoding) still runs the XLA form."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, 70, 32)), jnp.float32)
    seg = jnp.asarray(np.repeat([[0] * 30 + [1] * 40], B, 0), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(70), (B, 70))

    def layer(impl):
        return Attention(32, H, 8, n_kv_heads=HK, window=24, attention_block=32, impl=impl,
                         rngs=nnx.Rngs(0))  # fmt: skip

    def run(impl):
        m = layer(impl)

        def loss(m):
            y, _ = m(x, positions=pos, segment_ids=seg)
            return jnp.sum(jnp.sin(y)), y

        (_, y), g = nnx.value_and_grad(loss, has_aux=True)(m)
        return y, g

    (y1, g1), (y2, g2) = run("pallas"), run("xla")
    assert _rel(y1, y2) < TOL
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert _rel(a, b) < TOL
    cached = layer("pallas")
    y, cache = cached(x[:, :5], positions=pos[:, :5], cache=cached.init_cache(B, 8))
    assert cache is not None and int(cache.pos) == 5


def test_persistent_swa_pallas_equals_xla():
    """Titans MAG/MAL attention (``PersistentSWA``): window, 3 persistent tokens, segments."""
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, 50, 32)), jnp.float32)
    seg = jnp.asarray(np.repeat([[0] * 20 + [1] * 30], B, 0), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(50), (B, 50))

    def run(impl):
        m = PersistentSWA(32, H, 8, window=16, persistent=P, rope_theta=1e4, dtype=jnp.float32,
                          rngs=nnx.Rngs(0), impl=impl)  # fmt: skip

        def loss(m):
            o, _ = m(x, positions=pos, segment_ids=seg)
            return jnp.sum(jnp.sin(o)), o

        return nnx.value_and_grad(loss, has_aux=True)(m)

    ((_, o1), g1), ((_, o2), g2) = run("pallas"), run("xla")
    assert _rel(o1, o2) < TOL
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert _rel(a, b) < TOL


@pytest.mark.parametrize("name", ["titans_mac", "transformer"])
def test_model_attention_impl_pallas_equals_xla(name):
    """A whole LM (``model.attention_impl``): Titans MAC's per-segment ``[persistent ‖ h̃ ‖ x]``
    attention and the Transformer++ on the splash kernel give the XLA model's logits and
    gradients."""
    from nested_jax.models import LanguageModel

    base = ModelConfig(name=name, vocab_size=40, d_model=32, n_layers=1, n_heads=2, head_dim=16)
    if name == "titans_mac":
        base = dataclasses.replace(
            base, titans=dataclasses.replace(base.titans, segment_len=24, memory_chunk=8)
        )
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 40, size=(B, 48)), jnp.int32)

    def run(impl):
        model = LanguageModel(dataclasses.replace(base, attention_impl=impl), rngs=nnx.Rngs(0))

        def loss(m):
            logits, _ = m(tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

        return nnx.value_and_grad(loss, has_aux=True)(model)

    ((_, l1), g1), ((_, l2), g2) = run("pallas"), run("xla")
    assert _rel(l1, l2) < TOL
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert _rel(a, b) < 1e-4


def test_model_config_rejects_unknown_attention_impl():
    with pytest.raises(ValueError, match="attention_impl"):
        ModelConfig(attention_impl="flash")


def test_ops_door_on_a_mesh_equals_unsharded():
    """``ops.attention.splash_attention`` inside ``jax.set_mesh`` (batch over fsdp 2, heads over
    tensor 2): one kernel call per shard, the values and gradients of the call without a mesh."""
    from nested_jax.parallel.mesh import make_mesh
    from nested_jax.train.config import MeshConfig

    q, k, v, pk, pv, seg, w = _inputs(40, 1, True, True, seed=4)

    def vg(q, k, v, pk, pv):
        o = ops_splash(q, k, v, window=9, q_segment=seg, k_segment=seg, prefix_k=pk, prefix_v=pv)
        return jnp.sum(o * w)

    f = jax.jit(jax.value_and_grad(vg, argnums=(0, 1, 2, 3, 4)))
    want = f(q, k, v, pk, pv)
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        got = f(q, k, v, pk, pv)
        assert "shard_map" in str(jax.make_jaxpr(vg)(q, k, v, pk, pv))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert _rel(a, b) < TOL


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install -e '.[tpu]'; scripts/test does)",
)
@pytest.mark.parametrize("config", ["tiny_transformer", "tiny_titans_mag"])
def test_train_step_compiles_for_tpu_with_the_splash_kernel(config):
    """A tiny train step with ``model.attention_impl: pallas`` compiled for v5e:2x2 on this CPU
    (libtpu AOT): it fits and runs the Mosaic splash kernels (``tpu_custom_call``), forward and
    backward, not the interpreter."""
    from nested_jax.train import aot
    from nested_jax.train.config import load_config

    cfg = load_config(
        [f"configs/experiments/{config}.yaml"],
        ["model.attention_impl=pallas", "model.dtype=bfloat16", "data.seq_len=256",
         "mesh.topology=v5e:2x2"],
    )  # fmt: skip
    texts = []
    compile_step = aot.compile_step

    def keep_lowered(lowered, *args, **kwargs):
        texts.append(lowered.as_text())
        return compile_step(lowered, *args, **kwargs)

    # conftest sets "highest" for the float32 reference tests; JAX's splash kernel reads the
    # process-wide precision when lowered, and Mosaic has no highest-precision bf16 product.
    with pytest.MonkeyPatch.context() as mp, jax.default_matmul_precision("default"):
        mp.setattr(aot, "compile_step", keep_lowered)
        _, _, (train,) = aot.compile_for_topology(cfg, "v5e:2x2", per_device_batch=2)
    assert train.fits and not train.error, train
    kernels = [line for line in texts[0].splitlines() if "tpu_custom_call" in line]
    names = " ".join(kernels)
    assert "splash_mqa_fwd" in names and "splash_mqa_dkv" in names, names[:500]
