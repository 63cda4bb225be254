"""``nested-jax bench titans [--json]``: Titans (SPEC §2) chunked vs recurrent, vs GDN, memory.

Three measurements, all in one process (the rule of :mod:`nested_jax.bench.common`):

1. **Chunked vs recurrent** fwd+bwd at ``T`` (default 2048; B=1, H=4, K=V=64, f32) for the matrix
   memory (L_M = 1: ``titans_linear_chunked`` vs ``titans_linear_recurrent``) and the 2-layer MLP
   memory (L_M = 2, hidden ``2·D``: ``titans_mlp_chunked`` vs ``titans_mlp_recurrent``).
   Gradients w.r.t. q, k, v, θ, η, α (and the initial MLP weights) of
   ``sum(o) + sum(final memory)``, timed A/B interleaved (median of ``--repeats``).
2. **Tokens/s, Titans vs GDN**. When the ``titans_lmm`` mixer is registered in the LM shell, a tiny
   Titans LMM language model and a tiny GDN language model of the same widths are timed (fwd+bwd of
   the next-token loss, interleaved). The memory cores are always compared as well:
   ``titans_linear_chunked`` / ``titans_mlp_chunked`` vs ``gated_delta_chunked`` on the same q, k, v
   (fwd+bwd, ``T``). ``titans_lmm_registered`` says which case ran.
3. **Peak temporary memory vs T** of the compiled chunked fwd+bwd programs (L_M = 1 and 2) from
   ``compiled.memory_analysis().temp_size_in_bytes`` at ``T ∈ --mem-seq-lens`` (default 512, 1024,
   2048, 4096), reported as bytes and bytes/T: a constant bytes/T means memory linear in T (the
   chunk scan saves only the carried state per chunk; no ``[B, T/b, params]`` gradient stacks).

JSON keys (last stdout line with ``--json``): ``matmul_gflops``, ``T``, ``chunk_size``,
``titans_L{1,2}_chunked_over_recurrent_speedup``, ``time_titans_L{1,2}_{chunked,recurrent}_ms``,
``core_tokens_per_s_{gdn,titans_L1,titans_L2}``, ``core_titans_L{1,2}_over_gdn_time``,
``titans_lmm_registered`` and, when it is (and ``--skip-models`` is not given),
``model_tokens_per_s_{titans_lmm,gdn}``, ``model_titans_lmm_over_gdn_time``,
``model_params_{titans_lmm,gdn}``; per memory length
``temp_bytes_L{1,2}_T{T}``, ``temp_bytes_per_token_L{1,2}_T{T}`` and
``temp_bytes_slope_L{1,2}_T{a}_{b}`` (added bytes per added token between consecutive lengths)
and ``temp_bytes_slope_spread_L{1,2}`` (max/min of those slopes; 1.0 = exactly linear, a
quadratic program would give ≈ 2 per doubling), ``wall_s``.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from nested_jax.bench.common import (
    emit,
    make_parser,
    matmul_gflops,
    progress,
    temp_bytes,
    time_interleaved,
)
from nested_jax.core.associative.forms import gated_delta_chunked
from nested_jax.core.titans.chunk import titans_mlp_chunked
from nested_jax.core.titans.linear import titans_linear_chunked, titans_linear_recurrent
from nested_jax.core.titans.mlp import titans_mlp_init_weights, titans_mlp_recurrent
from nested_jax.core.titans.net import TitansMLPState
from nested_jax.rules import TitansRule

DEFAULT_MEM_SEQ_LENS = (512, 1024, 2048, 4096)


def titans_inputs(T: int, B: int = 1, H: int = 4, D: int = 64, seed: int = 0):
    """Unit-norm q, k, unit-variance v and gates in the ranges a Titans layer produces.

    Returns:
      ``(q, k, v, theta, eta, alpha)``: ``[B, T, H, D]`` ×3 and ``[B, T, H]`` ×3 (f32);
      θ ≈ 0.1, η ≈ 0.9, α ≈ 0.01 (sigmoids of jittered logits, as data-dependent gates are).
    """
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (B, T, H, D), jnp.float32))
    k = unit(jax.random.normal(ks[1], (B, T, H, D), jnp.float32))
    v = jax.random.normal(ks[2], (B, T, H, D), jnp.float32)

    def gate(key, logit):
        return jax.nn.sigmoid(logit + 0.5 * jax.random.normal(key, (B, T, H), jnp.float32))

    return q, k, v, gate(ks[3], -2.2), gate(ks[4], 2.2), gate(ks[5], -4.6)


def _linear_grad(fn):
    def loss(q, k, v, th, et, al):
        o, st = fn(q, k, v, th, et, al)
        return jnp.sum(o) + jnp.sum(st.M)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def _mlp_grad(fn):
    def loss(weights, q, k, v, th, et, al):
        B = q.shape[0]
        ws = tuple(jnp.broadcast_to(w, (B, *w.shape)) for w in weights)
        state = TitansMLPState(ws, tuple(jnp.zeros_like(w) for w in ws))
        o, st = fn(q, k, v, th, et, al, initial_state=state)
        return jnp.sum(o) + sum(jnp.sum(w) for w in st.weights)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6)))


def _gdn_grad(chunk_size: int):
    def loss(q, k, v, g, beta):
        o, S = gated_delta_chunked(q, k, v, g, beta, chunk_size=chunk_size)
        return jnp.sum(o) + jnp.sum(S)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def memory_programs(chunk_size: int, gdn_chunk_size: int = 64):
    """Jitted fwd+bwd programs: ``{"L1_chunked", "L1_recurrent", "L2_chunked", "L2_recurrent",
    "gdn_chunked"}``; the L2 ones take the initial weights ``[H, d_l, d_{l+1}]`` first. The matrix
    memory runs the paper's rule, the MLP memory the layers' softclamp (``grad_clip = 10``, the
    ``model.titans`` default), both in chunks of ``chunk_size``."""
    linear = TitansRule(memory_chunk=chunk_size)
    mlp = TitansRule(memory_chunk=chunk_size, grad_clip=10.0)
    return {
        "L1_chunked": _linear_grad(functools.partial(titans_linear_chunked, rule=linear)),
        "L1_recurrent": _linear_grad(titans_linear_recurrent),
        "L2_chunked": _mlp_grad(functools.partial(titans_mlp_chunked, rule=mlp)),
        "L2_recurrent": _mlp_grad(functools.partial(titans_mlp_recurrent, rule=mlp)),
        "gdn_chunked": _gdn_grad(gdn_chunk_size),
    }


def _gdn_gates(theta, alpha):
    # Same decay as the Titans forget gate (g = log(1 − α)), θ as β: comparable state dynamics.
    return jnp.log1p(-alpha), theta


def _model_tokens_per_s(T, B, repeats, results):
    """Tiny Titans LMM vs tiny GDN LM (same widths), fwd+bwd of the loss; fills ``results``."""
    from flax import nnx

    from nested_jax.models import ModelConfig, build_model

    times, fns = {}, {}
    for name in ("titans_lmm", "gdn"):
        cfg = ModelConfig(name=name, vocab_size=256, d_model=128, n_layers=2, n_heads=2)
        model = build_model(cfg, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        results[f"model_params_{name}"] = sum(int(x.size) for x in jax.tree.leaves(params))

        def loss(params, rest, tokens, graphdef=graphdef):
            logits, _ = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
            lp = jax.nn.log_softmax(logits, -1)
            return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], -1))

        tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T + 1), 0, 256)
        fns[name] = functools.partial(jax.jit(jax.grad(loss)), params, rest, tokens)
    times = time_interleaved(fns, repeats=repeats, warmup=1)
    for name, t in times.items():
        results[f"model_tokens_per_s_{name}"] = B * T / t
    results["model_titans_lmm_over_gdn_time"] = times["titans_lmm"] / times["gdn"]
    progress(
        f"[bench titans] tiny LM fwd+bwd (B={B}, T={T}): titans_lmm "
        f"{B * T / times['titans_lmm']:.0f} tok/s, gdn {B * T / times['gdn']:.0f} tok/s "
        f"(titans/gdn time x{times['titans_lmm'] / times['gdn']:.2f})"
    )


def _time_cores(progs, weights, T, B, H, D, chunk_size, repeats, results) -> None:
    """Measurements 1 and 2 (cores): chunked vs recurrent (L_M = 1, 2) and vs GDN, all timed
    interleaved in one round; fills ``results``."""
    q, k, v, th, et, al = titans_inputs(T, B, H, D)
    g, beta = _gdn_gates(th, al)
    fns = {
        "L1_chunked": functools.partial(progs["L1_chunked"], q, k, v, th, et, al),
        "L1_recurrent": functools.partial(progs["L1_recurrent"], q, k, v, th, et, al),
        "L2_chunked": functools.partial(progs["L2_chunked"], weights, q, k, v, th, et, al),
        "L2_recurrent": functools.partial(progs["L2_recurrent"], weights, q, k, v, th, et, al),
        "gdn_chunked": functools.partial(progs["gdn_chunked"], q, k, v, g, beta),
    }
    times = time_interleaved(fns, repeats=repeats, warmup=1)
    for L in (1, 2):
        c, r = times[f"L{L}_chunked"], times[f"L{L}_recurrent"]
        results[f"titans_L{L}_chunked_over_recurrent_speedup"] = r / c
        results[f"time_titans_L{L}_chunked_ms"] = 1e3 * c
        results[f"time_titans_L{L}_recurrent_ms"] = 1e3 * r
        progress(
            f"[bench titans] L_M={L} T={T} fwd+bwd: chunked(b={chunk_size}) {1e3 * c:.1f} ms, "
            f"recurrent {1e3 * r:.1f} ms (x{r / c:.2f})"
        )
    results["core_tokens_per_s_gdn"] = B * T / times["gdn_chunked"]
    for L in (1, 2):
        results[f"core_tokens_per_s_titans_L{L}"] = B * T / times[f"L{L}_chunked"]
        results[f"core_titans_L{L}_over_gdn_time"] = times[f"L{L}_chunked"] / times["gdn_chunked"]
    progress(
        "[bench titans] memory cores fwd+bwd tok/s: "
        f"gdn {results['core_tokens_per_s_gdn']:.0f}, titans L1 "
        f"{results['core_tokens_per_s_titans_L1']:.0f}, titans L2 "
        f"{results['core_tokens_per_s_titans_L2']:.0f}"
    )


def _temp_memory_vs_T(progs, weights, mem_seq_lens, B, H, D, results, t_start) -> None:
    """Measurement 3: peak temp bytes of the chunked fwd+bwd (L_M = 1, 2) at every length
    (compile only), per token and as added bytes per added token; fills ``results``."""
    for L in (1, 2):
        per_token = []
        for Tm in mem_seq_lens:
            args = titans_inputs(Tm, B, H, D)
            if L == 2:
                args = (weights, *args)
            tb = temp_bytes(progs[f"L{L}_chunked"], *args)
            results[f"temp_bytes_L{L}_T{Tm}"] = tb
            results[f"temp_bytes_per_token_L{L}_T{Tm}"] = tb / Tm
            per_token.append(tb / Tm)
        # Linear ⇔ equal increments per added token between consecutive T (a constant offset,
        # e.g. compile-time buffers, does not disturb this; a quadratic term doubles them).
        slopes = [
            (results[f"temp_bytes_L{L}_T{b}"] - results[f"temp_bytes_L{L}_T{a}"]) / (b - a)
            for a, b in zip(mem_seq_lens[:-1], mem_seq_lens[1:], strict=True)
        ]
        for i, s in enumerate(slopes):
            results[f"temp_bytes_slope_L{L}_T{mem_seq_lens[i]}_{mem_seq_lens[i + 1]}"] = s
        if slopes and min(slopes) > 0:
            results[f"temp_bytes_slope_spread_L{L}"] = max(slopes) / min(slopes)
        progress(
            f"[bench titans] L_M={L} chunked fwd+bwd temp bytes/T: "
            + ", ".join(f"T={Tm}: {b:.0f}" for Tm, b in zip(mem_seq_lens, per_token, strict=True))
            + "; added bytes per added token: "
            + ", ".join(f"{s:.0f}" for s in slopes)
            + f" ({time.perf_counter() - t_start:.0f} s)"
        )


def run(
    T: int = 2048,
    B: int = 1,
    H: int = 4,
    D: int = 64,
    chunk_size: int = 16,
    mem_seq_lens=DEFAULT_MEM_SEQ_LENS,
    repeats: int = 5,
    model_seq_len: int = 256,
    model_batch: int = 4,
    models: bool = True,
) -> dict:
    """All measurements; returns the results dict (keys in the module docstring)."""
    from nested_jax.models import available_mixers

    t_start = time.perf_counter()
    results: dict = {}
    gf = matmul_gflops()
    results["matmul_gflops"] = gf
    results["T"] = T
    results["chunk_size"] = chunk_size
    progress(f"[bench titans] f32 matmul: {gf:.1f} GFLOP/s")
    progs = memory_programs(chunk_size)
    weights = titans_mlp_init_weights(jax.random.PRNGKey(7), H, (D, 2 * D, D))
    _time_cores(progs, weights, T, B, H, D, chunk_size, repeats, results)

    # 2 (models): only when the LMM mixer exists in the registry.
    registered = "titans_lmm" in available_mixers()
    results["titans_lmm_registered"] = registered
    if registered and models:
        _model_tokens_per_s(model_seq_len, model_batch, repeats, results)
    elif not registered:
        progress("[bench titans] mixer 'titans_lmm' not registered: memory cores compared only")

    _temp_memory_vs_T(progs, weights, mem_seq_lens, B, H, D, results, t_start)
    results["wall_s"] = time.perf_counter() - t_start
    return results


def main(argv: list[str] | None = None) -> int:
    p = make_parser("titans", "Titans memory: chunked vs recurrent, vs GDN, temp memory vs T")
    p.add_argument("--seq-len", type=int, default=2048, help="T of the speed measurements")
    p.add_argument(
        "--mem-seq-lens",
        default=",".join(map(str, DEFAULT_MEM_SEQ_LENS)),
        help="comma-separated T of the memory measurement",
    )
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64, help="head dim (K = V)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--model-seq-len", type=int, default=256, help="T of the tiny-LM timing")
    p.add_argument("--model-batch", type=int, default=4)
    p.add_argument("--skip-models", action="store_true", help="skip the tiny-LM tokens/s")
    args = p.parse_args([] if argv is None else argv)
    results = run(
        T=args.seq_len,
        B=args.batch,
        H=args.heads,
        D=args.dim,
        chunk_size=args.chunk_size,
        mem_seq_lens=[int(t) for t in args.mem_seq_lens.split(",") if t],
        repeats=args.repeats,
        model_seq_len=args.model_seq_len,
        model_batch=args.model_batch,
        models=not args.skip_models,
    )
    emit(results, args.json)
    return 0
