"""The ``seq`` mesh axis (context parallelism, issue 15): a model's training trajectory with every
sequence split over devices equals the one-device trajectory."""

import jax
import numpy as np
import pytest

from nested_jax.parallel.mesh import global_batch_from_local, make_mesh
from nested_jax.train.config import ConfigError, MeshConfig, load_config
from nested_jax.train.loop import init_train_setup


def _batches(n: int, b: int = 4, t: int = 32):
    """Random tokens; row 0 packs documents starting mid-device (5) and at a device boundary
    (16 on a 4-way seq axis), the other rows one document."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tok = rng.integers(0, 256, size=(b, t + 1)).astype(np.int32)
        seg = np.ones((b, t), np.int32)
        seg[0, 5:] = 2
        seg[0, 16:] = 3
        out.append(
            {
                "inputs": tok[:, :-1],
                "targets": tok[:, 1:],
                "segment_ids": seg,
                "loss_mask": np.ones((b, t), np.float32),
            }
        )
    return out


def _losses(cfg, mesh, batches) -> np.ndarray:
    setup = init_train_setup(cfg, mesh, token_bytes=np.ones(257, np.int32))
    state, out = setup.state, []
    for b in batches:
        state, m = setup.train_step(state, global_batch_from_local(b, mesh))
        out.append(float(m["loss"]))
    return np.array(out)


# GDN is the context-parallel path (both folds); attention under a seq axis is plain GSPMD (slow
# set).
@pytest.mark.parametrize(
    ("model_name", "prefix_from"),
    [("gdn", 16), ("gdn", 2), pytest.param("transformer", 16, marks=pytest.mark.slow)],
    ids=["gdn", "gdn-prefix-fold", "transformer"],
)
def test_seq_axis_matches_one_device_trajectory(model_name, prefix_from, monkeypatch):
    from nested_jax.ops import linear

    # the 4-way seq axis folds by all-gather at the default threshold, by the prefix below it
    monkeypatch.setattr(linear, "PREFIX_FOLD_FROM", prefix_from)
    cfg = load_config(
        [],
        [
            f"model.name={model_name}",
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.chunk_size=8",
            "data.seq_len=32",
            "data.batch_size=4",
            "optimizer.warmup_steps=0",
            "optimizer.lr=0.01",
        ],
    )
    batches = _batches(3)
    one = _losses(cfg, make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1]), batches)
    assert np.all(np.isfinite(one))
    split = _losses(cfg, make_mesh(MeshConfig(data=1, fsdp=2, seq=4)), batches)
    np.testing.assert_allclose(split, one, rtol=2e-5)


def test_seq_axis_must_divide_the_sequence_length():
    with pytest.raises(ConfigError, match=r"data.seq_len: 30 is not divisible by mesh.seq = 4"):
        load_config([], ["mesh.seq=4", "mesh.fsdp=1", "data.seq_len=30", "model.chunk_size=2"])
