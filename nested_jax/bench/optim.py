"""``nested-jax bench optim [--json]``: AdamW vs Muon vs M3 on the tiny GDN LM; Proteus overhead.

All in one process (DESIGN.md "Benchmarks"):

1. **Optimizers** (SPEC §3.5). The tiny GDN language model (``d_model`` 128, 2 layers, 2 heads,
   byte vocabulary) is trained from the same initialisation on the same batches (random windows of
   Jane Austen's novels as bytes; ``--data synthetic`` uses MQAR batches with the loss on every
   token) with three optimizers, each behind ``clip_by_global_norm(1.0)`` with the same warmup +
   cosine schedule shape:

   - ``adamw``: the training registry's AdamW (``optimizer.name=adamw``, lr ``--adamw-lr``);
   - ``muon``: ``optax.contrib.muon`` (lr ``--muon-lr`` on matrices, AdamW at ``--adamw-lr`` on the
     rest), with the same matrix routing as M3 (``default_m3_mask``: ``ndim ≥ 2``, not the
     embedding; leading axes of stacked layers are batch axes);
   - ``m3``: the training registry's M3 (``optimizer.name=m3``, lr ``--m3-lr``, ``slow_every``
     ``--m3-slow-every``; AdamW at the same lr on the rest).

   The training steps themselves are the timing samples: every round runs one step of each
   optimizer (A/B/C interleaved), the first round is warm-up, and the median step time is reported
   with ratios to AdamW. The optimizer update alone (``tx.update`` on fixed gradients, jitted) is
   timed interleaved too. Losses: mean training loss of the last 10 steps and the held-out loss
   on ``--eval-batches`` fixed batches, in nats/token.
2. **Proteus overhead** (SPEC §4): fwd+bwd tokens/s of ``proteus_gated_delta_chunked`` with
   ``E = 16`` from a zero state, ``E = 16`` from a nonzero ``initial_state`` (15 blocks re-enter
   through injection tokens), ``E = 1`` (which dispatches to the backbone) and plain
   ``gated_delta_chunked`` at ``T = --proteus-seq-len`` (context ``N = T``, so all 16 blocks open
   during the sequence), H=4, K=V=64, interleaved. ``--proteus-only`` skips part 1.

JSON keys (last stdout line with ``--json``): ``matmul_gflops``, ``steps``, ``data``; per
optimizer ``o`` ∈ {adamw, muon, m3}: ``step_ms_{o}``, ``update_ms_{o}``,
``final_train_loss_{o}``, ``eval_loss_{o}``, ``lr_{o}``; ``step_time_{muon,m3}_over_adamw``,
``update_time_{muon,m3}_over_adamw``; ``proteus_tokens_per_s_{E16,E16_S0,E1,gdn}``,
``proteus_E16_over_E1_time``, ``proteus_E16_S0_over_E1_time``, ``proteus_E1_over_gdn_time``;
``wall_s`` (part 1's keys are absent with ``--proteus-only``).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nested_jax.bench.common import (
    emit,
    make_parser,
    matmul_gflops,
    progress,
    time_interleaved,
)
from nested_jax.core.associative import gated_delta_chunked
from nested_jax.core.proteus_memory import proteus_gated_delta_chunked
from nested_jax.optim.m3 import default_m3_mask

OPTIMIZER_NAMES = ("adamw", "muon", "m3")


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def austen_byte_stream() -> np.ndarray:
    """Jane Austen's novels as one int32 byte stream (documents joined by a blank line)."""
    from nested_jax.data.corpus import austen_documents

    text = "\n\n".join(austen_documents())
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def window_batches(stream: np.ndarray, n: int, batch_size: int, seq_len: int, seed: int):
    """``n`` batches of random ``seq_len + 1`` windows of ``stream`` (loss on every token)."""
    rng = np.random.default_rng(seed)
    if stream.shape[0] < seq_len + 2:
        raise ValueError(f"stream: needs more than {seq_len + 1} tokens, got {stream.shape[0]}")
    out = []
    for _ in range(n):
        starts = rng.integers(0, stream.shape[0] - seq_len - 1, size=batch_size)
        w = np.stack([stream[s : s + seq_len + 1] for s in starts])
        out.append(
            {
                "inputs": w[:, :-1],
                "targets": w[:, 1:],
                "loss_mask": np.ones((batch_size, seq_len), np.float32),
            }
        )
    return out


def _synthetic_batches(n, batch_size, seq_len, seed):
    from nested_jax.eval.tasks import make_mqar_batch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = make_mqar_batch(rng, batch_size, seq_len, max(1, min(8, (seq_len + 1) // 4)), 256)
        b["loss_mask"] = np.ones_like(b["loss_mask"])
        out.append(b)
    return out


# --------------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------------


def _muon_dims(params):
    # Same routing as M3: stacked [layers, d_in, d_out] matrices are orthogonalised per layer.
    mask = default_m3_mask(params)
    return jax.tree.map(
        lambda p, m: optax.contrib.MuonDimensionNumbers(p.ndim - 2, p.ndim - 1) if m else None,
        params,
        mask,
    )


def build_optimizers(steps: int, adamw_lr: float, muon_lr: float, m3_lr: float, slow_every: int):
    """``{name: (tx, lr)}`` for AdamW, Muon and M3, each clipped at global norm 1.0."""
    from nested_jax.train.config import OptimizerConfig
    from nested_jax.train.optimizer import build_optimizer, learning_rate_schedule

    warmup = max(1, steps // 10)
    common = dict(warmup_steps=warmup, decay="cosine", min_lr_ratio=0.1, weight_decay=0.1)
    adamw, _ = build_optimizer(OptimizerConfig(name="adamw", lr=adamw_lr, **common), steps)
    m3, _ = build_optimizer(
        OptimizerConfig(name="m3", lr=m3_lr, extra={"slow_every": slow_every}, **common), steps
    )
    muon_sched = learning_rate_schedule(OptimizerConfig(lr=muon_lr, **common), steps)
    adam_sched = learning_rate_schedule(OptimizerConfig(lr=adamw_lr, **common), steps)
    muon = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.contrib.muon(
            muon_sched,
            weight_decay=0.1,
            adam_learning_rate=adam_sched,
            adam_b2=0.95,
            adam_weight_decay=0.1,
            muon_weight_dimension_numbers=_muon_dims,
        ),
    )
    return {"adamw": (adamw, adamw_lr), "muon": (muon, muon_lr), "m3": (m3, m3_lr)}


def tiny_gdn(vocab_size: int = 256, d_model: int = 128, n_layers: int = 2, n_heads: int = 2):
    """The tiny GDN LM of the benchmark: ``(graphdef, state_def, params (pure dict), rest)``."""
    from nested_jax.models import ModelConfig, build_model

    cfg = ModelConfig(
        name="gdn", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads
    )
    graphdef, params, rest = nnx.split(build_model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    return graphdef, jax.tree.structure(params), nnx.to_pure_dict(params), rest


def compare_optimizers(
    steps: int = 100,
    batch_size: int = 16,
    seq_len: int = 128,
    data: str = "austen",
    adamw_lr: float = 3e-3,
    muon_lr: float = 0.02,
    m3_lr: float = 3e-4,
    m3_slow_every: int = 10,
    eval_batches: int = 8,
    repeats: int = 5,
    seed: int = 0,
    d_model: int = 128,
    n_layers: int = 2,
) -> dict:
    """Trains the tiny GDN with each optimizer (interleaved) and returns the results dict."""
    from nested_jax.train.step import make_eval_step, make_train_step

    if steps < 2:
        raise ValueError(f"steps: expected >= 2 (one warm-up round), got {steps}")
    if data == "austen":
        stream = austen_byte_stream()
        split = int(0.95 * stream.shape[0])
        train = window_batches(stream[:split], steps, batch_size, seq_len, seed)
        held = window_batches(stream[split:], eval_batches, batch_size, seq_len, seed + 1)
    elif data == "synthetic":
        train = _synthetic_batches(steps, batch_size, seq_len, seed)
        held = _synthetic_batches(eval_batches, batch_size, seq_len, seed + 1)
    else:
        raise ValueError(f"data: expected 'austen' or 'synthetic', got {data!r}")
    graphdef, state_def, params0, rest = tiny_gdn(d_model=d_model, n_layers=n_layers)
    txs = build_optimizers(steps, adamw_lr, muon_lr, m3_lr, m3_slow_every)
    eval_step = jax.jit(make_eval_step(graphdef, state_def))
    results: dict = {"steps": steps, "data": data}
    states, step_fns, losses, cursor = {}, {}, {}, {}
    for name, (tx, lr) in txs.items():
        results[f"lr_{name}"] = lr
        step_fns[name] = jax.jit(make_train_step(graphdef, state_def, tx, lambda _: 0.0))
        states[name] = {
            "step": jnp.zeros((), jnp.int32),
            "params": params0,
            "opt_state": tx.init(params0),
            "consecutive_skips": jnp.zeros((), jnp.int32),
        }
        losses[name], cursor[name] = [], 0

    def advance(name):
        batch = train[cursor[name]]
        cursor[name] += 1
        states[name], m = step_fns[name](states[name], rest, batch)
        losses[name].append(m["loss"])
        return m["loss"]

    times = time_interleaved(
        {name: functools.partial(advance, name) for name in txs}, repeats=steps - 1, warmup=1
    )
    for name in txs:
        tail = np.asarray(jax.device_get(losses[name][-10:]), np.float64)
        sums = [eval_step(states[name]["params"], rest, b) for b in held]
        ev = float(sum(s["loss_sum"] for s in sums) / sum(s["tokens"] for s in sums))
        results[f"step_ms_{name}"] = 1e3 * times[name]
        results[f"final_train_loss_{name}"] = float(tail.mean())
        results[f"eval_loss_{name}"] = ev
        progress(
            f"[bench optim] {name:<5} lr {txs[name][1]:g}: step {1e3 * times[name]:.1f} ms, "
            f"train loss (last 10) {tail.mean():.3f}, held-out loss {ev:.3f} nats/token"
        )

    # The optimizer update alone, on fixed gradients, interleaved.
    grads = jax.grad(lambda p: _plain_loss(graphdef, state_def, p, rest, train[0]))(params0)
    upd = {}
    for name, (tx, _) in txs.items():
        f = jax.jit(tx.update)
        upd[name] = functools.partial(f, grads, tx.init(params0), params0)
    utimes = time_interleaved(upd, repeats=repeats, warmup=1)
    for name in txs:
        results[f"update_ms_{name}"] = 1e3 * utimes[name]
    for name in ("muon", "m3"):
        results[f"step_time_{name}_over_adamw"] = times[name] / times["adamw"]
        results[f"update_time_{name}_over_adamw"] = utimes[name] / utimes["adamw"]
    progress(
        "[bench optim] update only: "
        + ", ".join(f"{n} {1e3 * utimes[n]:.2f} ms" for n in txs)
        + f"; step time vs adamw: muon x{results['step_time_muon_over_adamw']:.2f}, "
        f"m3 x{results['step_time_m3_over_adamw']:.2f}"
    )
    return results


def _plain_loss(graphdef, state_def, params, rest, batch):
    from nested_jax.train.step import make_loss_fn

    return make_loss_fn(graphdef, state_def)(params, rest, batch)[0]


# --------------------------------------------------------------------------------------------------
# Proteus overhead
# --------------------------------------------------------------------------------------------------


def proteus_overhead(T: int = 2048, B: int = 1, H: int = 4, D: int = 64, repeats: int = 5):
    """fwd+bwd tokens/s of Proteus GDN (E=16 from a zero and from a nonzero state, E=1) and of
    plain GDN, interleaved; the gradient includes the initial state's where there is one."""
    from nested_jax.bench.core import _inputs

    q, k, v, g, beta = _inputs(T, B, H, D)
    s0 = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (B, H, D, D), jnp.float32)

    def grad_of(fn, with_state=False):
        def loss(q, k, v, g, beta, s0):
            o, S = fn(q, k, v, g, beta, initial_state=s0 if with_state else None)
            return jnp.sum(o) + jnp.sum(S)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))

    e16 = functools.partial(proteus_gated_delta_chunked, context_len=T, num_blocks=16)
    fns = {
        "E16": grad_of(e16),
        "E16_S0": grad_of(e16, with_state=True),
        "E1": grad_of(functools.partial(proteus_gated_delta_chunked, context_len=T, num_blocks=1)),
        "gdn": grad_of(gated_delta_chunked),
    }
    times = time_interleaved(
        {n: functools.partial(f, q, k, v, g, beta, s0) for n, f in fns.items()},
        repeats=repeats,
        warmup=1,
    )
    results = {f"proteus_tokens_per_s_{n}": B * T / t for n, t in times.items()}
    results["proteus_T"] = T
    results["proteus_E16_over_E1_time"] = times["E16"] / times["E1"]
    results["proteus_E16_S0_over_E1_time"] = times["E16_S0"] / times["E1"]
    results["proteus_E1_over_gdn_time"] = times["E1"] / times["gdn"]
    progress(
        f"[bench optim] Proteus GDN fwd+bwd T={T}: E=16 {B * T / times['E16']:.0f} tok/s "
        f"(from a state {B * T / times['E16_S0']:.0f}), E=1 {B * T / times['E1']:.0f} tok/s, "
        f"plain GDN {B * T / times['gdn']:.0f} tok/s "
        f"(E16/E1 time x{results['proteus_E16_over_E1_time']:.2f})"
    )
    return results


def main(argv: list[str] | None = None) -> int:
    p = make_parser("AdamW vs Muon vs M3 on the tiny GDN LM; Proteus GDN overhead")
    p.add_argument("--steps", type=int, default=100, help="training steps per optimizer")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--data", choices=("austen", "synthetic"), default="austen")
    p.add_argument("--adamw-lr", type=float, default=3e-3)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--m3-lr", type=float, default=3e-4)
    p.add_argument("--m3-slow-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--proteus-seq-len", type=int, default=2048)
    p.add_argument(
        "--proteus-only", action="store_true", help="only the Proteus overhead (skip optimizers)"
    )
    args = p.parse_args([] if argv is None else argv)
    t0 = time.perf_counter()
    results: dict = {"matmul_gflops": matmul_gflops()}
    progress(f"[bench optim] f32 matmul: {results['matmul_gflops']:.1f} GFLOP/s")
    if args.proteus_only:
        results.update(proteus_overhead(T=args.proteus_seq_len, repeats=args.repeats))
        results["wall_s"] = time.perf_counter() - t0
        emit(results, args.json)
        return 0
    results.update(
        compare_optimizers(
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            data=args.data,
            adamw_lr=args.adamw_lr,
            muon_lr=args.muon_lr,
            m3_lr=args.m3_lr,
            m3_slow_every=args.m3_slow_every,
            eval_batches=args.eval_batches,
            repeats=args.repeats,
        )
    )
    results.update(proteus_overhead(T=args.proteus_seq_len, repeats=args.repeats))
    results["wall_s"] = time.perf_counter() - t0
    emit(results, args.json)
    return 0
