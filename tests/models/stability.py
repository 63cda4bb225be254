"""The long-context stability protocol shared by the Titans and Hope slow tests (issues 4, 17).

A tiny preset trained ``steps`` steps at ``T`` tokens on its real training data (Austen chapters,
byte tokens, packed rows with ``segment_ids`` / ``loss_mask`` exactly as the trainer builds them),
one sequence per step, on one device. Every step must be finite; the caller bounds the gradient
norm and checks that the loss went down.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import chex
import jax
import numpy as np

from nested_jax.parallel.mesh import global_batch_from_local, make_mesh
from nested_jax.train.config import MeshConfig
from nested_jax.train.loop import init_train_setup


def stability_run(cfg, steps: int, verbose: bool = False, probe: Callable | None = None):
    """Trains ``cfg`` for ``steps`` steps; returns ``(losses, grad_norms)`` (asserts finiteness).

    ``probe(state, batch) -> str`` adds to the per-step line printed with ``verbose``.
    """
    from nested_jax.data import pipeline

    mesh = make_mesh(MeshConfig(data=1, fsdp=1), devices=jax.devices()[:1])
    bundle = pipeline.prepare_data(cfg.data)
    token_bytes = np.asarray(bundle.tokenizer.token_bytes)
    token_bytes = np.pad(token_bytes, (0, cfg.model.vocab_size - token_bytes.shape[0]))
    setup = init_train_setup(cfg, mesh, token_bytes=token_bytes)
    batches = pipeline.make_train_iterator(
        cfg.data, bundle.tokenizer, bundle.train_docs, process_index=0, process_count=1
    )
    state, losses, norms, t0 = setup.state, [], [], time.time()
    for i in range(steps):
        batch = next(batches)
        state, m = setup.train_step(state, global_batch_from_local(batch, mesh))
        loss, norm = float(m["loss"]), float(m["grad_norm"])
        if verbose:
            extra = probe(state, batch) if probe else ""
            print(f"step {i} loss {loss:.4f} grad_norm {norm:.4g} "
                  f"t {time.time() - t0:.0f}s {extra}", flush=True)  # fmt: skip
        assert bool(m["finite"]) and np.isfinite(loss) and np.isfinite(norm), f"step {i}"
        losses.append(loss)
        norms.append(norm)
    first, last = float(np.mean(losses[:20])), float(np.mean(losses[-20:]))
    print(f"stability: {steps} steps T={cfg.data.seq_len} in {time.time() - t0:.0f}s, loss "
          f"{losses[0]:.3f} -> {losses[-1]:.3f} (min {min(losses):.3f}; mean first 20 {first:.3f}, "
          f"last 20 {last:.3f}), max grad norm {max(norms):.4g} at step {int(np.argmax(norms))}",
          flush=True)  # fmt: skip
    chex.assert_tree_all_finite(state["params"])
    return losses, norms
