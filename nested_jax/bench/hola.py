"""``nested-jax bench hola [--json]``: HOLA vs GDN throughput, and bounded decode memory (SPEC §5).

Measured in one process (the rule of :mod:`nested_jax.bench.common`):

1. **Mixer** fwd+bwd (gradients of ``sum(sin(y))`` w.r.t. all parameters) of
   :class:`~nested_jax.layers.hola.HolaMixer` vs :class:`~nested_jax.layers.gdn.GatedDeltaNet`
   with the same shapes (default B=1, T=2048, d_model=256, 4 heads of 64, w=64, C=256, chunk 64),
   timed A/B interleaved (median of ``--repeats``): tokens/s of both and the ratio; and the
   core forms alone (``hola_forward`` vs ``gated_delta_chunked``, same q, k, v, g, β), HOLA with
   every block's cache read at once (the default) and with the read inside the block scan.
2. **Model** (LM shell, 2 layers, d_model 128, byte vocabulary) fwd+bwd of the next-token loss
   at T=1024: tokens/s of HOLA vs GDN and the ratio; and the single-token **decode step** time.
3. **Decode memory** at a length budget of 2K and 32K tokens: the bytes of the decode state
   (``init_cache(1, max_len)``, from shapes only) and the compiled decode step's
   ``memory_analysis()`` (temporaries + arguments + outputs), for HOLA, GDN and — as the contrast
   that grows with T — a Transformer with a KV cache. HOLA's state is ``K·V + (w+C)(K+V)`` floats
   per head and layer plus conv taps, independent of the length (SPEC §5): the numbers at 2K and
   32K are equal. Nothing is decoded for 32K tokens: the step program and the state are the same
   for every position (the position is a traced scalar), so its compiled memory is the bound.

JSON keys (last stdout line with ``--json``): ``matmul_gflops``, ``mixer_{hola,gdn}_tokens_per_s``,
``mixer_hola_over_gdn_time``, ``core_hola_over_gdn_time``, ``core_hola_scan_read_over_gdn_time``,
``model_{hola,gdn}_tokens_per_s``, ``model_hola_over_gdn_time``,
``decode_step_hola_over_gdn_time``, and for ``{hola,gdn,transformer}`` × ``T ∈ {2048, 32768}``:
``decode_state_bytes_<model>_T<T>``, ``decode_step_peak_bytes_<model>_T<T>``; ``wall_s``.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested_jax.bench.common import emit, make_parser, matmul_gflops, progress, time_interleaved
from nested_jax.bench.core import gdn_inputs
from nested_jax.core.associative.forms import gated_delta_chunked
from nested_jax.core.hola.cache import read_blocks
from nested_jax.core.hola.decode import HolaReadParams
from nested_jax.core.hola.forward import HolaKernels, hola_forward
from nested_jax.layers.gdn import GatedDeltaNet
from nested_jax.layers.hola import HolaMixer
from nested_jax.layers.options import HolaOptions
from nested_jax.models import ModelConfig, build_model
from nested_jax.rules import HolaRule

DECODE_LENGTHS = (2048, 32768)


def _mixer_grad(layer):
    graphdef, params = nnx.split(layer)

    def loss(p, x):
        y, _ = nnx.merge(graphdef, p)(x)
        return jnp.sum(jnp.sin(y))

    return jax.jit(jax.grad(loss)), params


def _model_grad(model):
    graphdef, params = nnx.split(model)

    def loss(p, tokens):
        logits, _ = nnx.merge(graphdef, p)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return jax.jit(jax.grad(loss)), params


def _decode_step(model, donate: bool = True):
    graphdef, params = nnx.split(model)

    def step(p, tok, cache):
        logits, cache = nnx.merge(graphdef, p)(tok, cache=cache)
        return logits, cache

    return jax.jit(step, donate_argnums=(2,) if donate else ()), params


def _bytes(tree) -> int:
    return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def decode_memory(model, max_len: int) -> tuple[int, int]:
    """``(state bytes, compiled decode-step peak bytes)`` for a length budget of ``max_len``.

    Shapes only: the cache is ``jax.eval_shape(model.init_cache)`` and the step is lowered on
    ``ShapeDtypeStruct`` arguments, so a 32K KV cache is never allocated.
    """
    step, params = _decode_step(model)
    cache = jax.eval_shape(lambda: model.init_cache(1, max_len))
    tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    abstract_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    m = step.lower(abstract_params, tok, cache).compile().memory_analysis()
    peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    peak -= getattr(m, "alias_size_in_bytes", 0)  # donated cache: input and output share buffers
    return _bytes(cache), int(peak)


# The tiny LMs of measurements 2 and 3 (byte vocabulary + 1).
_MODEL_BASE = dict(vocab_size=257, d_model=128, n_layers=2, n_heads=2, chunk_size=64)


def _time_mixers(T, d_model, heads, head_dim, window, block_size, repeats, res) -> None:
    """Measurement 1: HOLA vs GDN mixer fwd+bwd at ``[1, T, d_model]``; fills ``res``."""
    common = dict(conv_size=4, chunk_size=64)
    hola = HolaMixer(
        d_model, heads, head_dim, HolaOptions(window=window, block_size=block_size),
        rngs=nnx.Rngs(0), **common,
    )  # fmt: skip
    gdn = GatedDeltaNet(d_model, heads, head_dim, rngs=nnx.Rngs(0), **common)
    x = jax.random.normal(jax.random.key(1), (1, T, d_model), jnp.float32)
    fh, ph = _mixer_grad(hola)
    fg, pg = _mixer_grad(gdn)
    t = time_interleaved(
        {"hola": functools.partial(fh, ph, x), "gdn": functools.partial(fg, pg, x)},
        repeats=repeats,
    )
    res["mixer_hola_tokens_per_s"] = T / t["hola"]
    res["mixer_gdn_tokens_per_s"] = T / t["gdn"]
    res["mixer_hola_over_gdn_time"] = t["hola"] / t["gdn"]
    progress(
        f"[bench hola] mixer fwd+bwd T={T}: HOLA {T / t['hola']:.0f} tok/s, GDN "
        f"{T / t['gdn']:.0f} tok/s (HOLA takes x{t['hola'] / t['gdn']:.2f} the GDN time)"
    )


def _time_core_reads(T, heads, head_dim, window, block_size, repeats, res) -> None:
    """Measurement 1b: fwd+bwd of the core ``hola_forward`` with every block's cache read at once
    (the default ``HolaKernels.cache_read``) and with the read inside the block scan
    (``cache_read=None``), against the GDN core ``gated_delta_chunked``; fills ``res``."""
    q, k, v, g, beta = gdn_inputs(T, 1, heads, head_dim, seed=3)
    params = HolaReadParams(
        jnp.ones((heads, head_dim)), jnp.ones((heads, head_dim)), jnp.zeros(heads),
        jnp.full((heads,), -4.0),
    )  # fmt: skip
    rule = HolaRule(window=window, block_size=block_size)

    def grad_of(forward):
        loss = lambda *a: jnp.sum(jnp.sin(forward(*a)[0]))  # noqa: E731
        return functools.partial(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))), q, k, v, g, beta)

    def hola(read):
        kernels = HolaKernels(cache_read=read)
        return grad_of(lambda *a: hola_forward(*a, params, rule=rule, kernels=kernels))

    t = time_interleaved(
        {"gdn": grad_of(gated_delta_chunked), "hola": hola(read_blocks), "scan": hola(None)},
        repeats=repeats,
    )
    res["core_hola_over_gdn_time"] = t["hola"] / t["gdn"]
    res["core_hola_scan_read_over_gdn_time"] = t["scan"] / t["gdn"]
    progress(
        f"[bench hola] core fwd+bwd T={T}: HOLA x{t['hola'] / t['gdn']:.2f} the GDN time "
        f"(all blocks read at once), x{t['scan'] / t['gdn']:.2f} (read inside the block scan)"
    )


def _time_models(models: dict, model_T: int, repeats: int, res) -> None:
    """Measurement 2: HOLA vs GDN LM fwd+bwd at ``model_T``, then one decode step; fills
    ``res``."""
    tokens = jax.random.randint(jax.random.key(2), (1, model_T + 1), 0, 257, jnp.int32)
    grads = {k: _model_grad(models[k]) for k in ("hola", "gdn")}
    t = time_interleaved(
        {k: functools.partial(f, p, tokens) for k, (f, p) in grads.items()}, repeats=repeats
    )
    res["model_hola_tokens_per_s"] = model_T / t["hola"]
    res["model_gdn_tokens_per_s"] = model_T / t["gdn"]
    res["model_hola_over_gdn_time"] = t["hola"] / t["gdn"]
    progress(
        f"[bench hola] model fwd+bwd T={model_T}: HOLA {model_T / t['hola']:.0f} tok/s, GDN "
        f"{model_T / t['gdn']:.0f} tok/s (x{t['hola'] / t['gdn']:.2f})"
    )
    steps = {}
    for k in ("hola", "gdn"):
        # Not donated here: the same cache is reused by every timed call.
        step, params = _decode_step(models[k], donate=False)
        steps[k] = functools.partial(step, params, tokens[:, :1], models[k].init_cache(1, 1))
    t = time_interleaved(steps, repeats=max(repeats, 20))
    res["decode_step_hola_over_gdn_time"] = t["hola"] / t["gdn"]
    progress(
        f"[bench hola] decode step: HOLA {1e3 * t['hola']:.2f} ms, GDN {1e3 * t['gdn']:.2f} ms "
        f"(x{t['hola'] / t['gdn']:.2f})"
    )


def _decode_memory_all(models: dict, res) -> None:
    """Measurement 3: decode state and compiled step bytes of every model at 2K and 32K."""
    for k, model in models.items():
        for n in DECODE_LENGTHS:
            state, peak = decode_memory(model, n)
            res[f"decode_state_bytes_{k}_T{n}"] = state
            res[f"decode_step_peak_bytes_{k}_T{n}"] = peak
        a, b = (res[f"decode_step_peak_bytes_{k}_T{n}"] for n in DECODE_LENGTHS)
        sa, sb = (res[f"decode_state_bytes_{k}_T{n}"] for n in DECODE_LENGTHS)
        progress(
            f"[bench hola] decode memory {k}: state {sa / 2**20:.2f} MiB @2K, {sb / 2**20:.2f} MiB"
            f" @32K; compiled step peak {a / 2**20:.2f} MiB @2K, {b / 2**20:.2f} MiB @32K"
        )


def run(
    *, T: int = 2048, d_model: int = 256, heads: int = 4, head_dim: int = 64, window: int = 64,
    block_size: int = 256, model_T: int = 1024, repeats: int = 5,
) -> dict:  # fmt: skip
    """All measurements; returns the results dict (keys in the module docstring)."""
    t0 = time.perf_counter()
    res: dict = {}
    gf = matmul_gflops()
    res["matmul_gflops"] = gf
    progress(f"[bench hola] f32 matmul: {gf:.1f} GFLOP/s")
    _time_mixers(T, d_model, heads, head_dim, window, block_size, repeats, res)
    _time_core_reads(T, heads, head_dim, window, block_size, repeats, res)
    base = _MODEL_BASE
    hopts = HolaOptions(window=window, block_size=block_size)
    models = {
        "hola": build_model(ModelConfig(name="hola", hola=hopts, **base), rngs=nnx.Rngs(0)),
        "gdn": build_model(ModelConfig(name="gdn", **base), rngs=nnx.Rngs(0)),
        "transformer": build_model(ModelConfig(name="transformer", **base), rngs=nnx.Rngs(0)),
    }
    _time_models(models, model_T, repeats, res)
    _decode_memory_all(models, res)
    K = base["d_model"] // base["n_heads"]
    spec = base["n_layers"] * base["n_heads"] * (K * K + (window + block_size) * 2 * K) * 4
    res["hola_spec_state_bytes"] = spec  # SPEC §5 formula (matrix + cache + block, f32)
    res["wall_s"] = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    p = make_parser(
        "hola", "HOLA vs GDN: tokens/s (mixer and model, same run) and bounded decode memory"
    )
    p.add_argument("--seq-len", type=int, default=2048, help="mixer benchmark length T")
    p.add_argument("--model-seq-len", type=int, default=1024, help="model benchmark length")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--block-size", type=int, default=256)
    args = p.parse_args([] if argv is None else argv)
    res = run(
        T=args.seq_len,
        model_T=args.model_seq_len,
        window=args.window,
        block_size=args.block_size,
        repeats=args.repeats,
    )
    emit(res, args.json)
    return 0
