"""``nested-jax bench hope [--json]``: the Hope mixer (SPEC §3.2) in the tiny LM, vs Titans and GDN.

Two measurements, in one process (:mod:`nested_jax.bench.common`), after an in-run normaliser
(measured f32 matmul GFLOP/s):

1. **Tokens/s of the tiny LMs**: fwd+bwd of the next-token loss of the tiny ``hope``,
   ``titans_lmm`` and ``gdn`` language models of the same shell widths (``--d-model``,
   ``--layers``, ``--heads``), timed A/B interleaved (median of ``--repeats`` after a warm-up).
   Hope runs with the default ``HopeOptions`` (chunks 16 / 4, parallel chunk updates, the
   backward storing every ``⌈√N⌉``-th chunk carry), as ``hope_store_all`` with ``remat_every=1``
   (every carry stored: no extra forward, memory ∝ N) and as ``hope_scan`` with
   ``chunk_updates="scan"`` (the chunk's updates token by token).
2. **Chunk-size sweep** of Hope: the same tiny Hope LM at each ``(chunk_memory, chunk_other)`` of
   ``--sweep`` (default ``1:1,4:4,16:4,16:16,64:16``), interleaved among themselves.

JSON keys (last stdout line with ``--json``): ``matmul_gflops``, ``T``, ``B``,
``model_tokens_per_s_{hope,hope_store_all,hope_scan,titans_lmm,gdn}``, ``model_params_{...}``,
``model_hope_over_gdn_time``, ``model_hope_over_titans_lmm_time``,
``model_hope_{store_all,scan}_over_titans_lmm_time``, ``hope_ffn`` (the FFN the Hope
shell used), per sweep point ``sweep_tokens_per_s_cm{a}_co{b}`` and
``sweep_time_over_first_cm{a}_co{b}`` (time relative to the first sweep point), ``wall_s``.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from nested_jax.bench.common import emit, make_parser, matmul_gflops, progress, time_interleaved

DEFAULT_SWEEP = ((1, 1), (4, 4), (16, 4), (16, 16), (64, 16))


def hope_model_config(hope=None, **kw):
    """``ModelConfig(name="hope", hope=hope or HopeOptions(), **kw)``."""
    from nested_jax.layers.options import HopeOptions
    from nested_jax.models import ModelConfig

    return ModelConfig(name="hope", hope=HopeOptions() if hope is None else hope, **kw)


def _loss_program(cfg, B, T, vocab):
    """(zero-argument fwd+bwd callable, parameter count) of the LM for ``cfg``."""
    from flax import nnx

    from nested_jax.models import build_model

    model = build_model(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, tokens):
        logits, _ = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        lp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], -1))

    tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T + 1), 0, vocab)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    return functools.partial(jax.jit(jax.grad(loss)), params, rest, tokens), n_params


def run(
    T: int = 256,
    B: int = 4,
    d_model: int = 128,
    n_layers: int = 2,
    n_heads: int = 2,
    vocab: int = 256,
    sweep=DEFAULT_SWEEP,
    repeats: int = 5,
) -> dict:
    """All measurements; returns the results dict (keys in the module docstring)."""
    from nested_jax.layers.options import HopeOptions
    from nested_jax.models import ModelConfig

    t_start = time.perf_counter()
    results: dict = {}
    gf = matmul_gflops()
    results.update(matmul_gflops=gf, T=T, B=B)
    progress(f"[bench hope] f32 matmul: {gf:.1f} GFLOP/s")
    shell = dict(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads)
    shell_chunk = dict(chunk_size=min(64, T))  # GDN's kernel chunk; irrelevant to Hope
    hope_cfg = hope_model_config(**shell, **shell_chunk)
    results["hope_ffn"] = str(getattr(hope_cfg, "ffn", "swiglu"))
    cfgs = {
        "hope": hope_cfg,
        "hope_store_all": hope_model_config(HopeOptions(remat_every=1), **shell, **shell_chunk),
        "hope_scan": hope_model_config(HopeOptions(chunk_updates="scan"), **shell, **shell_chunk),
        "titans_lmm": ModelConfig(name="titans_lmm", **shell, **shell_chunk),
        "gdn": ModelConfig(name="gdn", **shell, **shell_chunk),
    }
    fns = {}
    for name, cfg in cfgs.items():
        fns[name], results[f"model_params_{name}"] = _loss_program(cfg, B, T, vocab)
    times = time_interleaved(fns, repeats=repeats, warmup=1)
    for name, t in times.items():
        results[f"model_tokens_per_s_{name}"] = B * T / t
    results["model_hope_over_gdn_time"] = times["hope"] / times["gdn"]
    results["model_hope_over_titans_lmm_time"] = times["hope"] / times["titans_lmm"]
    for variant in ("hope_store_all", "hope_scan"):
        results[f"model_{variant}_over_titans_lmm_time"] = times[variant] / times["titans_lmm"]
    progress(
        f"[bench hope] tiny LM fwd+bwd (B={B}, T={T}): "
        + ", ".join(f"{n} {B * T / t:.0f} tok/s" for n, t in times.items())
        + f" (hope/gdn time x{results['model_hope_over_gdn_time']:.2f}, "
        f"hope/titans x{results['model_hope_over_titans_lmm_time']:.2f}, "
        f"hope_store_all/titans x{results['model_hope_store_all_over_titans_lmm_time']:.2f}, "
        f"hope_scan/titans x{results['model_hope_scan_over_titans_lmm_time']:.2f})"
    )

    if sweep:
        fns = {}
        for cm, co in sweep:
            opts = HopeOptions(chunk_memory=cm, chunk_other=co)
            cfg = hope_model_config(opts, **shell, **shell_chunk)
            fns[f"cm{cm}_co{co}"], _ = _loss_program(cfg, B, T, vocab)
        times = time_interleaved(fns, repeats=repeats, warmup=1)
        first = times[next(iter(fns))]
        for key, t in times.items():
            results[f"sweep_tokens_per_s_{key}"] = B * T / t
            results[f"sweep_time_over_first_{key}"] = t / first
        progress(
            "[bench hope] chunk sweep (chunk_memory, chunk_other) fwd+bwd tok/s: "
            + ", ".join(f"{k} {B * T / t:.0f}" for k, t in times.items())
        )
    results["wall_s"] = time.perf_counter() - t_start
    return results


def _parse_sweep(text: str):
    out = []
    for item in text.split(","):
        if not item:
            continue
        try:
            cm, co = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"--sweep: expected 'cm:co,...' pairs of ints, got {item!r}") from None
        out.append((cm, co))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    p = make_parser("hope", "Hope tiny LM: tokens/s vs titans_lmm and gdn, chunk-size sweep")
    p.add_argument("--seq-len", type=int, default=256, help="T of the timed batches")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument(
        "--sweep",
        default=",".join(f"{a}:{b}" for a, b in DEFAULT_SWEEP),
        help="comma-separated chunk_memory:chunk_other pairs ('' = no sweep)",
    )
    args = p.parse_args([] if argv is None else argv)
    results = run(
        T=args.seq_len,
        B=args.batch,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        sweep=_parse_sweep(args.sweep),
        repeats=args.repeats,
    )
    emit(results, args.json)
    return 0
