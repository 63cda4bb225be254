"""Checkpointer restore classification: a mismatch is refused and moves nothing; a partial
(--reset-optimizer) restore reads only what it asks for; unreadable bytes are quarantined."""

from __future__ import annotations

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.train.checkpoint import (
    CORRUPT_DIR,
    Checkpointer,
    CheckpointMismatch,
    abstract_like,
    checkpoint_steps,
    save_limit_gb,
)


def _iterator():
    return iter(grain.MapDataset.range(100).to_iter_dataset())


def _state(scale: float, opt_shape=(3, 4)):
    return {
        "step": jnp.asarray(1, jnp.int32),
        "params": {"w": jnp.full((3, 4), scale)},
        "opt_state": {"mu": jnp.zeros(opt_shape)},
        "consecutive_skips": jnp.asarray(0, jnp.int32),
    }


@pytest.fixture
def saved(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    it = _iterator()
    for step in (1, 2):
        next(it)
        ckpt.save(step, _state(float(step)), it, {"step": step}, {"corpus": {}}, b"tok")
    ckpt.close()
    return tmp_path


def test_the_save_limit_lies_above_the_largest_array():
    def tree(n):
        return {"a": jax.ShapeDtypeStruct((n,), jnp.float32), "b": np.zeros(3, np.int8), "c": 1.0}

    # orbax refuses a write as large as the limit: 10**9 bytes need 2 GB.
    assert save_limit_gb(tree(250_000_000)) == 2
    assert save_limit_gb(tree(249_999_999)) == 1
    assert save_limit_gb(tree(1)) == 1


def test_a_save_with_a_byte_limit_restores_like_any_other(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False, save_concurrent_gb=1)
    ckpt.save(3, _state(3.0), _iterator(), {"step": 3})
    ckpt.close()
    ckpt = Checkpointer(tmp_path)
    step, state, _ = ckpt.restore_latest(abstract_like(_state(0.0)), _iterator)
    ckpt.close()
    assert step == 3
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.full((3, 4), 3.0))


def test_a_structure_mismatch_is_refused_and_nothing_moves(saved):
    other = abstract_like(_state(0.0, opt_shape=(5,)))  # e.g. another optimizer
    ckpt = Checkpointer(saved)
    with pytest.raises(CheckpointMismatch, match=r"checkpoint 2 .* does not match this config"):
        ckpt.restore_latest(other, _iterator)
    ckpt.close()
    assert checkpoint_steps(saved) == [1, 2] and not (saved / CORRUPT_DIR).exists()


def test_reset_optimizer_restores_weights_step_and_data_only(saved):
    other = abstract_like(_state(0.0, opt_shape=(5,)))
    ckpt = Checkpointer(saved)
    step, state, it = ckpt.restore_latest(other, _iterator, reset_optimizer=True)
    ckpt.close()
    assert step == 2 and set(state) == {"step", "params", "consecutive_skips"}
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.full((3, 4), 2.0))
    assert next(it) == 2  # the data iterator continues after the two batches read


def test_the_data_spec_travels_with_the_checkpoint(saved):
    ckpt = Checkpointer(saved, read_only=True)
    spec, payload = ckpt.restore_data_spec(2)
    ckpt.manager.close()
    assert spec == {"corpus": {}} and payload == b"tok"


def test_unreadable_bytes_are_quarantined_and_the_previous_step_restored(saved):
    for f in (saved / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file() and f.name != "_METADATA" and f.stat().st_size > 64:
            f.write_bytes(b"\0" * f.stat().st_size)
    ckpt = Checkpointer(saved)
    step, state, _ = ckpt.restore_latest(abstract_like(_state(0.0)), _iterator)
    ckpt.close()
    assert step == 1 and float(state["params"]["w"][0, 0]) == 1.0
    assert checkpoint_steps(saved) == [1]
    assert len(list((saved / CORRUPT_DIR).glob("step_2_*"))) == 1  # moved, never deleted


def test_running_out_of_memory_is_not_blamed_on_the_checkpoint(saved, monkeypatch):
    def oom(self, step, abstract_state, *, partial):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while restoring")

    monkeypatch.setattr(Checkpointer, "_restore_state", oom)
    ckpt = Checkpointer(saved)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        ckpt.restore_latest(abstract_like(_state(0.0)), _iterator)
    ckpt.close()
    assert checkpoint_steps(saved) == [1, 2] and not (saved / CORRUPT_DIR).exists()


def test_opening_read_only_logs_no_read_only_warnings(saved, caplog):
    """eval, generate and the resume checks open the checkpoints read-only on purpose: orbax's two
    warnings about it would be terminal noise, while other absl warnings still get through."""
    import logging

    with caplog.at_level(logging.INFO):
        Checkpointer(saved, read_only=True).close()
        logging.getLogger("absl").warning("an unrelated orbax warning")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["an unrelated orbax warning"], warnings
