"""``nested-jax bench core [--json]``: chunked vs recurrent gated delta rule, and vs attention.

For each T (default 512, 2048, 8192; H=4, D=64, B=1, f32), fwd+bwd (gradients w.r.t. q, k, v, g, β
of ``sum(o) + sum(S_T)``) of:

- ``gated_delta_chunked`` (WY/UT, chunk C) vs ``gated_delta_recurrent`` (per-token ``lax.scan``),
- ``gated_delta_chunked`` vs causal softmax attention (``jax.nn.dot_product_attention``,
  ``implementation="xla"``, same q, k, v shapes; gradients w.r.t. q, k, v),

timed A/B interleaved (median of ``--repeats``; one interleaved loop per pair, so the
memory-heavy attention runs do not disturb the chunked-vs-recurrent pair), the peak temporary memory
of both compiled GDN fwd+bwd programs (``memory_analysis().temp_size_in_bytes``), the achieved
GFLOP/s of the chunked GDN and the in-run f32 matmul GFLOP/s.

FLOPs of the chunked GDN (counted from the algorithm in ``core/associative/forms.py``; per chunk and
head, C chunk size, K = V = D; multiply-add = 2 FLOPs; elementwise work not counted)::

    forward   [Q;K]Kᵀ 4C²K + inverse (2/3)C³ + T[βK|βV] 2C²(K+V) + scan 4CKV + O 2CKV + 2C²V
    backward  Pᵀ dO 2C²V + Qᵀ dO 2CKV + reverse scan 4CKV + dQ, dKdec, dW 6CKV + dP 2C²V
              + Tᵀ dY 2C²(K+V) + dA 2C²(K+V) + d[Q;K] 8C²K

times ``N·B·H`` chunks·heads (N = ceil(T / C), padding included).

JSON keys (last stdout line with ``--json``): ``matmul_gflops`` and per T
``gdn_chunked_over_recurrent_speedup_T{T}``, ``gdn_recurrent_over_chunked_temp_bytes_T{T}``,
``gdn_over_attention_speedup_T{T}``, ``gdn_gflops_T{T}``.
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
from nested_jax.core.associative.forms import gated_delta_chunked, gated_delta_recurrent
from nested_jax.core.wy import chunk_flops

DEFAULT_SEQ_LENS = (512, 2048, 8192)


def chunked_gdn_flops(
    T: int, B: int, H: int, K: int, V: int, C: int, backward: bool = True
) -> float:
    """Matmul FLOPs of one fwd+bwd (``backward=False``: forward only) of the chunked gated delta
    rule (formula in the module docstring; ``bench kernels`` counts both of its paths with it)."""
    return -(-T // C) * B * H * chunk_flops(C, K, V, backward)


def chunk_matmul_gflops(n: int, C: int, K: int, V: int, repeats: int = 5) -> float:
    """GFLOP/s of the batched matmuls the chunk form is made of, ``n`` chunks·heads at once: the
    Grams ``[C, K]×[K, C]``, the triangular products ``[C, C]×[C, K]``, the state reads
    ``[C, K]×[K, V]`` and writes ``[K, C]×[C, V]``, each timed alone (medians of ``repeats``),
    total FLOPs over total time.

    What a form that batches these products over ``n`` chunks·heads would reach if it were
    nothing but them; this over the big matmul's says how much of the big matmul such small
    batched products get on this backend. (``wy_delta_core`` runs them chunk by chunk instead, in
    batches of ``B·H``, so at large ``n`` it can exceed this.)
    """
    key = jax.random.PRNGKey(0)

    def operands(m, k, p):
        a = jax.random.normal(key, (n, m, k), jnp.float32)
        return a, jax.random.normal(jax.random.fold_in(key, 1), (n, k, p), jnp.float32)

    shapes = {"gram": (C, K, C), "tri": (C, C, K), "read": (C, K, V), "write": (K, C, V)}
    pairs = {name: operands(*mkp) for name, mkp in shapes.items()}
    matmul = jax.jit(lambda a, b: a @ b)
    times = time_interleaved(
        {name: functools.partial(matmul, *ab) for name, ab in pairs.items()}, repeats=repeats
    )
    flops = sum(2 * n * m * k * p for m, k, p in shapes.values())
    return flops / sum(times.values()) / 1e9


def gdn_inputs(T, B, H, D, seed=0):
    """``(q, k, v, g, beta)`` f32 of a gated delta layer's ranges: unit q, k ``[B, T, H, D]``,
    unit-variance v, log decay ``g ∈ (−0.1, 0]`` and ``β ∈ (0, 1)`` ``[B, T, H]``."""
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, H, D), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # GDN layers feed L2-normalised keys
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, D), jnp.float32)
    g = -0.1 * jax.random.uniform(ks[3], (B, T, H), jnp.float32)
    beta = jax.random.uniform(ks[4], (B, T, H), jnp.float32)
    return q, k, v, g, beta


def _gdn_grad(fn):
    def loss(q, k, v, g, beta):
        o, S = fn(q, k, v, g, beta)
        return jnp.sum(o) + jnp.sum(S)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def _attention_grad():
    def loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(o)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(seq_lens, B=1, H=4, D=64, chunk_size=32, repeats=5, attention=True) -> dict:
    """All measurements; returns the results dict (keys as documented in the module docstring)."""
    t_start = time.perf_counter()
    results: dict = {}
    gf = matmul_gflops()
    results["matmul_gflops"] = gf
    progress(f"[bench core] f32 matmul: {gf:.1f} GFLOP/s")
    f_chunk = _gdn_grad(lambda *a: gated_delta_chunked(*a, chunk_size=chunk_size))
    f_rec = _gdn_grad(gated_delta_recurrent)
    f_att = _attention_grad()
    for T in seq_lens:
        q, k, v, g, beta = gdn_inputs(T, B, H, D)
        args = (q, k, v, g, beta)
        # compile once; the same executables are measured for memory and timed
        c_chunk = f_chunk.lower(*args).compile()
        c_rec = f_rec.lower(*args).compile()
        tb_chunk, tb_rec = temp_bytes(c_chunk), temp_bytes(c_rec)
        progress(
            f"[bench core] T={T}: temp bytes chunked {tb_chunk / 2**20:.1f} MiB, "
            f"recurrent {tb_rec / 2**20:.1f} MiB"
        )
        chunked = functools.partial(c_chunk, *args)
        # Each ratio comes from its own A/B interleaved loop: the attention runs (GiBs of scores)
        # disturb whatever runs next, so they are not mixed into the chunked-vs-recurrent loop.
        # No warm-up round: everything is compiled above.
        times = time_interleaved(
            {"chunked": chunked, "recurrent": functools.partial(c_rec, *args)},
            repeats=repeats,
            warmup=0,
        )
        flops = chunked_gdn_flops(T, B, H, D, D, chunk_size)
        speed = times["recurrent"] / times["chunked"]
        gflops = flops / times["chunked"] / 1e9
        results[f"gdn_chunked_over_recurrent_speedup_T{T}"] = speed
        results[f"gdn_recurrent_over_chunked_temp_bytes_T{T}"] = tb_rec / tb_chunk
        results[f"gdn_gflops_T{T}"] = gflops
        results[f"time_chunked_ms_T{T}"] = 1e3 * times["chunked"]
        results[f"time_recurrent_ms_T{T}"] = 1e3 * times["recurrent"]
        progress(
            f"[bench core] T={T}: fwd+bwd chunked {1e3 * times['chunked']:.1f} ms, "
            f"recurrent {1e3 * times['recurrent']:.1f} ms (x{speed:.2f}); "
            f"chunked {gflops:.1f} GFLOP/s ({gflops / gf:.0%} of matmul)"
        )
        if attention:
            c_att = f_att.lower(q, k, v).compile()
            t2 = time_interleaved(
                {"chunked": chunked, "attention": functools.partial(c_att, q, k, v)},
                repeats=repeats,
                warmup=0,
            )
            att = t2["attention"] / t2["chunked"]
            results[f"gdn_over_attention_speedup_T{T}"] = att
            results[f"time_chunked_vs_attention_ms_T{T}"] = 1e3 * t2["chunked"]
            results[f"time_attention_ms_T{T}"] = 1e3 * t2["attention"]
            progress(
                f"[bench core] T={T}: fwd+bwd chunked {1e3 * t2['chunked']:.1f} ms, "
                f"attention {1e3 * t2['attention']:.1f} ms (x{att:.2f})"
            )
        results[f"temp_bytes_chunked_T{T}"] = tb_chunk
        results[f"temp_bytes_recurrent_T{T}"] = tb_rec
    results["chunk_size"] = chunk_size
    results["wall_s"] = time.perf_counter() - t_start
    return results


def main(argv: list[str] | None = None) -> int:
    p = make_parser(
        "core", "chunked vs recurrent gated delta rule, and vs causal softmax attention"
    )
    p.add_argument(
        "--seq-lens",
        default=",".join(map(str, DEFAULT_SEQ_LENS)),
        help="comma-separated sequence lengths T",
    )
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64, help="head dim (K = V)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--chunk-size", type=int, default=32, help="C for the chunked GDN (32: fastest here)"
    )
    args = p.parse_args([] if argv is None else argv)
    seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
    results = run(
        seq_lens,
        B=args.batch,
        H=args.heads,
        D=args.dim,
        chunk_size=args.chunk_size,
        repeats=args.repeats,
    )
    emit(results, args.json)
    return 0
