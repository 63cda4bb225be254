"""``nested-jax bench momentum [--json]``: Titans' in-chunk momentum as coefficient matrices (the
library's dual form) against an associative scan over the chunk's tokens (SPEC §2).

The chunked Titans memory takes every surprise of a chunk at the chunk-start weights ``M⁰``; what
remains inside the chunk is linear (``u_t = k_t (M⁰ᵀk_t − v_t)ᵀ``)::

    S_t = η_t S_{t−1} − θ_t u_t ,   M_t = (1 − α_t) M_{t−1} + S_t ,   o_t = M_tᵀ q_t

Two ways to run it, equal up to rounding:

* **coefficients** (``titans_linear_chunked``, what every Titans memory runs): the products of
  ``η`` and ``1 − α`` over the chunk as ``[c, c]`` lower-triangular matrices (``P^η``, ``P^α``)
  that mix the chunk's ``[c, ·]`` keys, errors and queries; no per-token ``M_t`` or ``S_t`` exists.
* **associative scan** (here): the per-token ``S_t`` and ``M_t`` of the chunk by
  ``core.scan.affine_scan`` (``lax.associative_scan``, log depth), then ``o_t = M_tᵀ q_t``; the
  chunk holds ``c`` states of ``K × V``.

Measured in one process (:mod:`nested_jax.bench.common`) for the matrix memory (``L_M = 1``,
B 1, H 4, K = V 64, f32, ``T`` tokens) at each chunk size of ``--chunks`` (default 16, 64, 256):
forward and fwd+bwd (gradients of ``sum(o) + sum(M_T)`` w.r.t. q, k, v, θ, η, α) time, A/B
interleaved (medians of ``--repeats``), the compiled fwd+bwd temporaries and the largest relative
difference of the outputs and gradients.

JSON keys: ``matmul_gflops``, ``T``; per chunk ``c``: ``c{c}_{fwd,fwdbwd}_scan_over_coefficients``
(time ratio, > 1: the scan is slower), ``c{c}_temp_bytes_{coefficients,scan}``,
``c{c}_max_rel_diff``; ``wall_s``.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.bench.common import (
    emit,
    make_parser,
    matmul_gflops,
    max_err,
    progress,
    temp_bytes,
    time_interleaved,
)
from nested_jax.bench.titans import titans_inputs
from nested_jax.core.scan import affine_scan, from_head_chunks, to_head_chunks
from nested_jax.core.titans.linear import titans_linear_chunked
from nested_jax.rules import TitansRule

DEFAULT_CHUNKS = (16, 64, 256)


def titans_linear_by_scan(q, k, v, theta, eta, alpha, *, chunk_size: int):
    """The chunked matrix memory with its in-chunk momentum and decay by associative scans.

    Equal to ``titans_linear_chunked(..., rule=TitansRule(memory_chunk=chunk_size))`` up to
    rounding (zero initial state, the paper's rule: read after write, no softclamp).

    Args:
      q, k, v: ``[B, T, H, D]`` (T a multiple of ``chunk_size``); theta, eta, alpha: ``[B, T, H]``.

    Returns:
      ``(o [B, T, H, D], M_T [B, H, D, D])``.
    """
    T = q.shape[1]
    if T % chunk_size:
        raise ValueError(f"q: T = {T} must be a multiple of chunk_size = {chunk_size}")
    qc, kc, vc = (to_head_chunks(x.astype(jnp.float32), chunk_size) for x in (q, k, v))
    gates = [to_head_chunks(x.astype(jnp.float32), chunk_size) for x in (theta, eta, alpha)]
    B, H, D = q.shape[0], q.shape[2], q.shape[3]
    zero = jnp.zeros((B, H, D, D), jnp.float32)

    def one_chunk(carry, xs):
        M0, S0 = carry
        qb, kb, vb, th, et, al = xs  # [B, H, c, ·] and [B, H, c]
        err = jnp.einsum("bhck,bhkv->bhcv", kb, M0) - vb
        u = kb[..., :, None] * err[..., None, :]  # [B, H, c, D, D]: ∇ℓ at the chunk start
        S = affine_scan(et, -th[..., None, None] * u, axis=2, initial=S0)
        M = affine_scan(1.0 - al, S, axis=2, initial=M0)
        o = jnp.einsum("bhck,bhckv->bhcv", qb, M)
        return (M[:, :, -1], S[:, :, -1]), o

    (M_T, _), o = lax.scan(one_chunk, (zero, zero), (qc, kc, vc, *gates))
    return from_head_chunks(o, T), M_T


def _programs(chunk_size: int) -> dict:
    """``{name: (forward, fwd+bwd)}`` jitted, both forms at ``chunk_size``."""
    rule = TitansRule(memory_chunk=chunk_size)

    def coefficients(*xs):
        o, state = titans_linear_chunked(*xs, rule=rule)
        return o, state.M

    forms = {
        "coefficients": coefficients,
        "scan": functools.partial(titans_linear_by_scan, chunk_size=chunk_size),
    }

    def grad_of(fn):
        def loss(*xs):
            o, M = fn(*xs)
            return jnp.sum(o) + jnp.sum(M)

        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))

    return {name: (jax.jit(fn), grad_of(fn)) for name, fn in forms.items()}


def run(*, T: int = 2048, chunks=DEFAULT_CHUNKS, repeats: int = 5) -> dict:
    """All measurements; returns the results dict (keys in the module docstring)."""
    t0 = time.perf_counter()
    res: dict = {"matmul_gflops": matmul_gflops(), "T": T}
    progress(f"[bench momentum] f32 matmul: {res['matmul_gflops']:.1f} GFLOP/s")
    xs = titans_inputs(T)
    for c in chunks:
        progs = _programs(c)
        (fc, gc), (fs, gs) = progs["coefficients"], progs["scan"]
        diff = max(max_err(fs(*xs), fc(*xs)), max_err(gs(*xs), gc(*xs)))  # vs coefficients
        t = time_interleaved(
            {name: functools.partial(f, *xs) for name, f in
             (("fc", fc), ("fs", fs), ("gc", gc), ("gs", gs))},
            repeats=repeats,
        )  # fmt: skip
        res[f"c{c}_fwd_scan_over_coefficients"] = t["fs"] / t["fc"]
        res[f"c{c}_fwdbwd_scan_over_coefficients"] = t["gs"] / t["gc"]
        res[f"c{c}_temp_bytes_coefficients"] = temp_bytes(gc, *xs)
        res[f"c{c}_temp_bytes_scan"] = temp_bytes(gs, *xs)
        res[f"c{c}_max_rel_diff"] = diff
        progress(
            f"[bench momentum] chunk {c}: scan ÷ coefficients time: forward "
            f"x{t['fs'] / t['fc']:.2f}, fwd+bwd x{t['gs'] / t['gc']:.2f}; fwd+bwd temporaries "
            f"{res[f'c{c}_temp_bytes_scan'] / 2**20:.1f} vs "
            f"{res[f'c{c}_temp_bytes_coefficients'] / 2**20:.1f} MiB; max rel. diff {diff:.1e}"
        )
    res["wall_s"] = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    p = make_parser(
        "momentum",
        "Titans' in-chunk momentum: coefficient matrices vs an associative scan (time, memory)",
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--chunks", type=int, nargs="+", default=list(DEFAULT_CHUNKS))
    args = p.parse_args([] if argv is None else argv)
    emit(run(T=args.seq_len, chunks=tuple(args.chunks), repeats=args.repeats), args.json)
    return 0
