"""HOLA in the LM shell (SPEC §5, §6): cached decoding == full forward over several block
boundaries, σ(λ)→0 equals the GDN model with the same shared parameters, a finite training step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.layers.options import HolaOptions
from nested_jax.models import ModelConfig, build_model
from nested_jax.parallel.mesh import global_batch_from_local, make_mesh
from nested_jax.train.config import MeshConfig, load_config
from nested_jax.train.loop import init_train_setup

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, chunk_size=8)


def _tokens(seed, b, t):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL["vocab_size"], jnp.int32)


@nnx.jit
def _forward(model, tokens, cache=None):
    return model(tokens, cache=cache)


def test_teacher_forced_decoding_equals_full_forward():
    hola = HolaOptions(window=3, block_size=4, gate_init=1.0)  # C=4: merges at 4, 8, 12, 16
    model = build_model(ModelConfig(name="hola", hola=hola, **SMALL), rngs=nnx.Rngs(0))
    tokens = _tokens(1, 2, 18)
    full, _ = _forward(model, tokens)
    cache = model.init_cache(2, 18)
    logits, cache = _forward(model, tokens[:, :5], cache=cache)
    outs = [logits]
    for t in range(5, 18):
        logits, cache = _forward(model, tokens[:, t : t + 1], cache=cache)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-4)
    # The decode state has the same shapes whatever the length budget (bounded memory).
    chex.assert_trees_all_equal_shapes(cache, model.init_cache(2, 18), model.init_cache(2, 32768))


def test_gate_minus_inf_equals_gdn_model_exactly():
    common = dict(SMALL, scan_layers=False)  # eager, layer by layer: the same kernels run
    gdn = build_model(ModelConfig(name="gdn", **common), rngs=nnx.Rngs(0))
    hola = build_model(
        ModelConfig(name="hola", hola=HolaOptions(window=3, block_size=4), **common),
        rngs=nnx.Rngs(1),
    )
    nnx.update(hola, nnx.state(gdn))  # every GDN parameter is shared; HOLA adds γ, sink, gate
    hola.blocks.mixer.gate_logit[...] = jnp.full((2, 2), -1e9)  # σ(−1e9) == 0.0 in f32
    tokens = _tokens(2, 2, 13)
    y_g, _ = gdn(tokens)
    y_h, _ = hola(tokens)
    np.testing.assert_array_equal(np.asarray(y_h), np.asarray(y_g))
    # Sanity: with the default gate the cache path changes the logits.
    hola.blocks.mixer.gate_logit[...] = jnp.zeros((2, 2))
    assert float(jnp.abs(hola(tokens)[0] - y_g).max()) > 1e-4


@pytest.mark.slow  # ~45 s; test_hola_packed.py checks packed rows in the default suite
def test_training_step_is_finite_with_packed_segments():
    cfg = load_config(
        [],
        [
            "model.name=hola",
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.chunk_size=16",
            "model.hola.window=4",
            "model.hola.block_size=8",
            "data.seq_len=32",
            "data.batch_size=4",
            "optimizer.warmup_steps=0",
        ],
    )
    mesh = make_mesh(MeshConfig(data=1, fsdp=1), devices=jax.devices()[:1])
    setup = init_train_setup(cfg, mesh, token_bytes=np.ones(257, np.int32))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(4, 33)).astype(np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.repeat(np.array([[1] * 20 + [2] * 12]), 4, 0).astype(np.int32),
        "loss_mask": np.ones((4, 32), np.float32),
    }
    before = jax.tree.map(np.asarray, setup.state["params"])
    state, m = setup.train_step(setup.state, global_batch_from_local(batch, mesh))
    assert bool(m["finite"]) and np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
    after = jax.tree.map(np.asarray, state["params"])
    chex.assert_tree_all_finite(after)
    mixer_before, mixer_after = before["blocks"]["mixer"], after["blocks"]["mixer"]
    for name in ("gamma_q", "gamma_k", "sink_logit", "gate_logit"):
        assert not np.array_equal(mixer_before[name], mixer_after[name]), name
