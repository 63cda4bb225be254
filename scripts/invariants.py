"""Dump (or compare) outputs and gradients of the core math, the ops and short training runs.

A restructure that only moves code must leave every number bit-identical. This script records, at
two awkward lengths (T = 13 and T = 37), the outputs and input gradients of the public
``nested_jax.core`` sequence and step functions, of every ``nested_jax.ops`` op at each ``impl``
that runs on the CPU (with and without ``segment_ids`` where the function takes them, and the
Proteus forms), of every registered LM mixer (loss and parameter gradients, packed and not, plus
a few decode tokens through the cache), and 30 training steps of the tiny hope, titans_lmm, hola
and gdn configs (the losses and the final parameters). ``compare`` then checks that a second dump
has the same keys and ``np.array_equal`` arrays.

    python scripts/invariants.py dump /tmp/before.npz
    python scripts/invariants.py compare /tmp/before.npz          # dumps again, then compares
    python scripts/invariants.py compare /tmp/before.npz /tmp/after.npz

Pallas is left out: ``impl="pallas"`` in interpret mode takes minutes per case on a CPU.
"""

# B023: every closure below is traced at once by record(), inside the loop that made it.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Import the checkout this script sits in, not whichever copy the environment has installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LENGTHS = (13, 37)
B, H, K, V = 2, 2, 4, 4
TRAIN_CONFIGS = ("tiny_hope", "tiny_titans_lmm", "tiny_hola", "tiny_gdn")
TRAIN_STEPS = 30

OUT: dict[str, np.ndarray] = {}


def _put(prefix: str, tree) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        arr = np.asarray(leaf)
        if arr.dtype == object:
            continue
        if jnp.issubdtype(arr.dtype, jax.dtypes.prng_key):
            arr = np.asarray(jax.random.key_data(leaf))
        OUT[prefix + jax.tree_util.keystr(path)] = arr


def _floats(tree):
    return jax.tree.map(lambda a: jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating), tree)


def record(name: str, fn: Callable, *args) -> None:
    """Stores ``fn(*args)`` and the gradient of ``Σ sin(every float output)`` w.r.t. every float
    leaf of ``args`` (integer leaves are held fixed)."""

    def loss(diff, rest):
        full = jax.tree.map(lambda d, r, f: d if f else r, diff, rest, mask)
        out = fn(*full)
        leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
        return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in leaves), out

    args = jax.tree.map(jnp.asarray, args)
    mask = _floats(args)
    diff = jax.tree.map(lambda a, f: a if f else jnp.zeros((), jnp.float32), args, mask)
    try:
        (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff, args)
    except Exception as err:  # a case this script calls wrongly: kept as a key, so both dumps
        # name it and its message must match too
        msg = f"{type(err).__name__}: {err}".split("\n")[0][:300]
        print(f"  case {name} failed: {msg}", file=sys.stderr)
        OUT[f"{name}/ERROR"] = np.asarray(msg)
        return
    _put(f"{name}/out", out)
    _put(f"{name}/grad", jax.tree.map(lambda g, f: g if f else None, grad, mask))


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _unit(a):
    return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)


def _seq(t: int, seed: int = 0) -> dict:
    r = _rng(seed)
    f = np.float32
    return dict(
        q=_unit(r.normal(size=(B, t, H, K))),
        k=_unit(r.normal(size=(B, t, H, K))),
        v=r.normal(size=(B, t, H, V)).astype(f),
        g=-r.uniform(0.01, 0.5, size=(B, t, H)).astype(f),
        beta=r.uniform(0.0, 1.0, size=(B, t, H)).astype(f),
        theta=r.uniform(0.05, 0.3, size=(B, t, H)).astype(f),
        eta=r.uniform(0.1, 0.9, size=(B, t, H)).astype(f),
        alpha=r.uniform(0.01, 0.3, size=(B, t, H)).astype(f),
        s0=(0.1 * r.normal(size=(B, H, K, V))).astype(f),
    )


def _segments(t: int) -> np.ndarray:
    cut = t // 3  # a document start inside a chunk for every chunk size used here
    return np.repeat([[1] * cut + [2] * (t - cut)], B, 0).astype(np.int32)


# --------------------------------------------------------------------------------------------------
# core


def core_associative(t: int) -> None:
    from nested_jax import core as c

    x = _seq(t)
    q, k, v, g, beta, s0 = (x[n] for n in ("q", "k", "v", "g", "beta", "s0"))
    forms = {
        "linear_attention": ((q, k, v, g),),
        "delta_rule": ((q, k, v, beta),),
        "gated_delta": ((q, k, v, g, beta),),
    }
    for rule, arg_sets in forms.items():
        for j, args in enumerate(arg_sets):
            for seg in (None, _segments(t)):
                tag = f"core/{rule}{j}/T{t}/seg{seg is not None}"
                rec = getattr(c, f"{rule}_recurrent")
                chk = getattr(c, f"{rule}_chunked")
                record(f"{tag}/recurrent", lambda s0, *a, f=rec, s=seg: f(
                    *a, initial_state=s0, segment_ids=s), s0, *args)  # fmt: skip
                for cs in (4,):
                    record(
                        f"{tag}/chunked{cs}",
                        lambda s0, *a, f=chk, s=seg, cs=cs: f(
                            *a, initial_state=s0, segment_ids=s, chunk_size=cs
                        ),
                        s0,
                        *args,
                    )
            step = getattr(c, f"{rule}_step")
            one = tuple(a[:, 0] for a in args)
            record(f"core/{rule}{j}/step", step, s0, *one)


def core_titans(t: int) -> None:
    from nested_jax import core as c

    clip1, chunk4 = c.TitansRule(grad_clip=1.0), c.TitansRule(memory_chunk=4)
    clip10, chunk4_clip10 = (
        c.TitansRule(grad_clip=10.0),
        c.TitansRule(memory_chunk=4, grad_clip=10.0),
    )
    x = _seq(t, 1)
    xs = tuple(x[n] for n in ("q", "k", "v", "theta", "eta", "alpha"))
    s0 = c.TitansLinearState(x["s0"], jnp.zeros_like(x["s0"]))
    w0 = c.titans_mlp_init_weights(jax.random.key(3), H, (K, 8, K))
    m0 = c.titans_mlp_state(w0, B)
    for seg in (None, _segments(t)):
        tag = f"core/titans/T{t}/seg{seg is not None}"
        record(f"{tag}/linear_rec", lambda s, *a: c.titans_linear_recurrent(
            *a, initial_state=s, segment_ids=seg, rule=clip1), s0, *xs)  # fmt: skip
        record(f"{tag}/linear_chk", lambda s, *a: c.titans_linear_chunked(
            *a, initial_state=s, segment_ids=seg, rule=chunk4), s0, *xs)  # fmt: skip
        record(f"{tag}/mlp_rec", lambda s, *a: c.titans_mlp_recurrent(
            *a, initial_state=s, segment_ids=seg, rule=clip10), m0, *xs)  # fmt: skip
        record(f"{tag}/mlp_chk", lambda s, *a: c.titans_mlp_chunked(
            *a, initial_state=s, segment_ids=seg, rule=chunk4_clip10), m0, *xs)  # fmt: skip
    record(f"core/titans/T{t}/pool", lambda a: c.titans_pool_gates(a, 4), xs[3])
    one = tuple(a[:, 0] for a in xs)
    record("core/titans/linear_step", c.titans_linear_step, s0, *one)
    record("core/titans/mlp_step", lambda s, *a: c.titans_mlp_step(s, *a, rule=clip10), m0, *one)
    record("core/titans/mlp_apply", lambda w, z: c.titans_mlp_apply(w, z), m0.weights, x["q"])


def core_proteus(t: int) -> None:
    from nested_jax import core as c

    x = _seq(t, 2)
    gdn = tuple(x[n] for n in ("q", "k", "v", "g", "beta"))
    tit = tuple(x[n] for n in ("q", "k", "v", "theta", "eta", "alpha"))
    s0 = x["s0"]
    ts0 = c.TitansLinearState(s0, jnp.zeros_like(s0))
    m0 = c.titans_mlp_state(c.titans_mlp_init_weights(jax.random.key(4), H, (K, 8, K)), B)
    sch = c.ProteusRule(blocks=4, context_len=16)
    chunk4, clip10 = c.TitansRule(memory_chunk=4), c.TitansRule(grad_clip=10.0)
    chunk4_clip10 = c.TitansRule(memory_chunk=4, grad_clip=10.0)
    for t0 in (0, 3):
        tag = f"core/proteus/T{t}/t0{t0}"
        record(f"{tag}/gdn_rec", lambda s, *a: c.proteus_gated_delta_recurrent(
            *a, initial_state=s, t0=t0, schedule=sch), s0, *gdn)  # fmt: skip
        record(f"{tag}/gdn_chk", lambda s, *a: c.proteus_gated_delta_chunked(
            *a, initial_state=s, t0=t0, chunk_size=4, schedule=sch), s0, *gdn)  # fmt: skip
        record(f"{tag}/tl_rec", lambda s, *a: c.proteus_titans_linear_recurrent(
            *a, initial_state=s, t0=t0, schedule=sch), ts0, *tit)  # fmt: skip
        record(f"{tag}/tl_chk", lambda s, *a: c.proteus_titans_linear_chunked(
            *a, initial_state=s, t0=t0, rule=chunk4, schedule=sch), ts0, *tit)  # fmt: skip
        record(f"{tag}/tm_rec", lambda s, *a: c.proteus_titans_mlp_recurrent(
            *a, initial_state=s, t0=t0, rule=clip10, schedule=sch), m0, *tit)  # fmt: skip
        record(f"{tag}/tm_chk", lambda s, *a: c.proteus_titans_mlp_chunked(
            *a, initial_state=s, t0=t0, rule=chunk4_clip10, schedule=sch), m0, *tit)  # fmt: skip
    one_g = tuple(a[:, 0] for a in gdn)
    one_t = tuple(a[:, 0] for a in tit)
    record("core/proteus/gdn_step", lambda s, *a: c.proteus_gated_delta_step(
        s, *a, t=jnp.asarray(5), schedule=sch), s0, *one_g)  # fmt: skip
    record("core/proteus/tl_step", lambda s, *a: c.proteus_titans_linear_step(
        s, *a, t=jnp.asarray(5), schedule=sch), ts0, *one_t)  # fmt: skip
    record("core/proteus/tm_step", lambda s, *a: c.proteus_titans_mlp_step(
        s, *a, t=jnp.asarray(5), rule=clip10, schedule=sch), m0, *one_t)  # fmt: skip
    for n in range(1, 20, 3):
        _put(f"core/proteus/masks/t{n}", (
            c.proteus_key_mask(jnp.asarray(n), 16, 4, K), c.proteus_hidden_mask(n, 16, 4, 8),
            c.proteus_mlp_masks(jnp.asarray(n), 16, 4, 8), c.proteus_active_blocks(n, 16, 4),
            c.proteus_block_mask(jnp.asarray(2), 8, 4), c.proteus_block_ids(8, 4),
        ))  # fmt: skip
    _put("core/proteus/spans", [np.asarray(s) for s in c.proteus_spans(t, 3, 16, 4)])


def _hope_setup(t: int, seed: int = 0, adaptive_q: bool = False):
    from nested_jax import core as c

    hid = 4
    ks = jax.random.split(jax.random.key(seed), 16)
    names = c.HopeMemories._fields[:5] + (("q",) if adaptive_q else ())
    mems = c.HopeMemories(**{
        n: c.MLPMemory(0.3 * jax.random.normal(ks[i], (H, K, hid)),
                       0.3 * jax.random.normal(ks[i + 6], (H, hid, K)))
        for i, n in enumerate(names)
    })  # fmt: skip
    ro = c.HopeReadout(
        jax.random.normal(ks[12], (H, K)),
        jnp.full((H,), -1.0),
        jax.random.normal(ks[13], (H, K)),
        jnp.full((H,), 1.0),
    )
    x = jax.random.normal(ks[14], (B, t, H, K))
    q = jax.random.normal(ks[15], (B, t, H, K))
    return mems, ro, x, q


def _hope_rule(**changes):
    """A ``HopeRule``: the training defaults of ``HopeOptions`` (chunks 16 / 4, momentum, remat,
    parallel chunk updates, inner-gradient softclamp 4) with ``changes``."""
    from nested_jax.rules import HopeRule

    training = dict(chunk_memory=16, chunk_other=4, momentum=True, remat=True,
                    chunk_updates="parallel", grad_clip=4.0)  # fmt: skip
    return HopeRule(**{**training, **changes})


def core_hope(t: int) -> None:
    from nested_jax import core as c
    from nested_jax.rules import ProteusRule

    rules = {
        "default": _hope_rule(chunk_memory=4, chunk_other=2, momentum_coef=0.7, remat=False),
        "parallel": _hope_rule(chunk_memory=4, chunk_other=2, chunk_updates="parallel"),
        "nomomentum": _hope_rule(chunk_memory=8, chunk_other=4, momentum=False, step="paper"),
    }
    schedule = ProteusRule(blocks=4, context_len=16)
    for adaptive in (False, True):
        mems, ro, x, q = _hope_setup(t, adaptive_q=adaptive)
        for rname, rule in rules.items():
            tag = f"core/hope/T{t}/aq{adaptive}/{rname}"

            def init(m, rule=rule):
                return c.hope_init_state(m, B, momentum=rule.momentum)

            for seg in (None, _segments(t)):
                record(f"{tag}/seg{seg is not None}/chunked", lambda x, q, m, r, rule=rule, s=seg,
                       i=init: c.hope_chunked(x, q, r, initial_state=i(m), rule=rule,
                                              segment_ids=s),
                       x, q, mems, ro)  # fmt: skip
            record(f"{tag}/recurrent", lambda x, q, m, r, rule=rule, i=init: c.hope_recurrent(
                x, q, r, initial_state=i(m), rule=rule), x, q, mems, ro)  # fmt: skip
            record(f"{tag}/proteus_chunked", lambda x, q, m, r, rule=rule, i=init: (
                c.proteus_hope_chunked(x, q, r, initial_state=i(m), t0=2, schedule=schedule,
                                       rule=rule)),
                x, q, mems, ro)  # fmt: skip
            record(f"{tag}/proteus_recurrent", lambda x, q, m, r, rule=rule, i=init: (
                c.proteus_hope_recurrent(x, q, r, initial_state=i(m), t0=2, schedule=schedule,
                                         rule=rule)),
                x, q, mems, ro)  # fmt: skip
            record(f"{tag}/decode", lambda x, q, m, r, rule=rule: c.hope_decode(
                x, q, r, rule=rule, initial_state=c.hope_decode_state(
                    m, B, momentum=rule.momentum), schedule=schedule),
                x, q, mems, ro)  # fmt: skip
    mems, ro, x, q = _hope_setup(t, 1)
    record(f"core/hope/T{t}/mlp_memory_apply", c.mlp_memory_apply, mems.k, x)
    r = _rng(t)
    m0 = (0.1 * r.normal(size=(B, H, K, V))).astype(np.float32)
    kv = _seq(t, 5)
    record(f"core/hope/T{t}/linear_chunk_update", lambda m, k, v, a, e: c.hope_linear_chunk_update(
        m, k, v, a, e, chunk_size=4), m0, kv["k"], kv["v"], kv["alpha"], kv["eta"])  # fmt: skip


def _hola_args(t: int, seed: int = 0):
    r = _rng(seed)
    f = np.float32
    x = _seq(t, seed)
    p = (
        r.uniform(0.5, 2.0, size=(H, K)).astype(f),
        r.uniform(0.5, 2.0, size=(H, K)).astype(f),
        r.normal(size=(H,)).astype(f),
        r.normal(size=(H,)).astype(f),
    )
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta")) + p


def core_hola(t: int) -> None:
    from nested_jax import core as c

    args = _hola_args(t)
    # the four read parameters travel flat through record (the same gradient keys) and are
    # bundled into one HolaReadParams at the call
    for ev in ("beta_e", "recency"):
        for seg in (None, _segments(t)):
            tag = f"core/hola/T{t}/{ev}/seg{seg is not None}"
            rule = c.HolaRule(window=3, block_size=8, eviction=ev)
            record(f"{tag}/forward", lambda *a, r=rule, s=seg: c.hola_forward(
                *a[:5], c.HolaReadParams(*a[5:]), rule=r, segment_ids=s, chunk_size=4),
                *args)  # fmt: skip
    for seg in (None, _segments(t)):
        for ev in ("beta_e", "e", "beta_v"):  # the magnitude evictions hola_scores accepts
            record(f"core/hola/T{t}/{ev}/seg{seg is not None}/scores", lambda *a, ev=ev, s=seg:
                   c.hola_scores(*a, eviction=ev, segment_ids=s, chunk_size=4),
                   *args[1:5])  # fmt: skip
        record(f"core/hola/T{t}/seg{seg is not None}/residuals", lambda *a, s=seg:
               c.gdn_residuals(*a, segment_ids=s, chunk_size=4), *args[1:5])  # fmt: skip
    s0 = c.init_hola_state(B, H, K, V, 3, 8)
    one = tuple(a[:, 0] for a in args[:5]) + args[5:]

    def steps(*a):
        st, outs = s0, []
        rule, params = c.HolaRule(window=3, block_size=8), c.HolaReadParams(*a[5:])
        for i in range(4):  # four tokens: the cache fills past its window
            o, st = c.hola_decode_step(st, *(x[:, i] for x in a[:5]), params, rule=rule)
            outs.append(o)
        return outs, st

    record(f"core/hola/T{t}/decode_steps", steps, *args)
    del one


def core_cms(t: int) -> None:
    from nested_jax import core as c

    r = _rng(0)
    d, h = 4, 6
    for gated in (False, True):
        levels = c.cms_init_levels(jax.random.key(7), d, h, 3, gated=gated)
        x, target = (0.5 * r.normal(size=(B, t, d)).astype(np.float32) for _ in range(2))
        mix = np.array([0.3, -0.2, 0.1], np.float32)
        for variant in ("sequential", "nested", "independent"):
            m = mix if variant == "independent" else None
            tag = f"core/cms/T{t}/g{gated}/{variant}"
            record(f"{tag}/forward", lambda lv, xx, v=variant, m=m: c.cms_forward(
                lv, xx, variant=v, mix_logits=m), levels, x)  # fmt: skip

            def sq(y, side):
                return 0.5 * jnp.sum(jnp.square(y - side), axis=-1)

            for inner in ("sgd", "dgd"):
                rule = c.CMSRule(periods=(1, 2, 4), variant=variant, online_lr=(0.1, 0.05, 0.02),
                                 online_inner=inner, remat_every=2)  # fmt: skip
                record(f"{tag}/online_{inner}", lambda lv, xx, tg, r=rule, m=m: (
                    c.cms_online(lv, xx, rule=r, mix_logits=m, delta_fn=c.surprise_from_loss(sq),
                                 side=tg)), levels, x, target)  # fmt: skip
    record("core/cms/apply", c.cms_level_apply, levels[0], x)
    record("core/cms/mix", c.cms_mix_weights, mix)
    _put("core/cms/state", c.cms_initial_state(levels, B))


def core_misc(t: int) -> None:
    from nested_jax import core as c

    r = _rng(t)
    f = np.float32
    w = r.normal(size=(B, H, K, V)).astype(f)
    xk = _unit(r.normal(size=(B, H, K)))
    gv = r.normal(size=(B, H, V)).astype(f)
    lr = r.uniform(0.1, 0.9, size=(B, H)).astype(f)
    for step in ("exact", "paper"):
        for target in ("gradient", "proximal"):
            record(f"core/dgd/{step}/{target}", lambda *a, s=step, tg=target: c.dgd_update(
                *a, 0.9, step=s, target=tg), w, xk, gv, lr)  # fmt: skip
        record(f"core/dgd/{step}/size", lambda a, b, s=step: c.dgd_step_size(a, b, step=s), lr, xk)
    ws = [r.normal(size=(K, 6)).astype(f), r.normal(size=(6, V)).astype(f)]
    ins = [r.normal(size=(6,)).astype(f), r.normal(size=(V,)).astype(f)]  # x_l [d_in_l]
    sig = [r.normal(size=(K,)).astype(f), r.normal(size=(6,)).astype(f)]  # g_l [d_out_l]
    record("core/dgd/layers", lambda *a: c.dgd_update_layers(*a, 0.3, 0.95), ws, ins, sig)
    a = r.uniform(0.5, 1.0, size=(t, 3)).astype(f)
    b = r.normal(size=(t, 3)).astype(f)
    for rev in (False, True):
        record(f"core/scan/T{t}/affine{rev}", lambda a, b, rv=rev: c.affine_scan(
            a, b, reverse=rv, initial=jnp.ones(3)), a, b)  # fmt: skip
    xs = r.normal(size=(B, t, 3)).astype(f)
    record(f"core/scan/T{t}/chunk", lambda x: c.unchunk(c.chunk(c.pad_to_multiple(x, 4), 4), t), xs)

    def cell(h, x):
        h = jnp.tanh(h + x)
        return h, h

    xs_t = np.swapaxes(xs, 0, 1)  # time-major: scan_remat walks axis 0
    record(f"core/scan/T{t}/remat", lambda h, x: c.scan_remat(cell, h, x, 3), xs[:, 0], xs_t)


# --------------------------------------------------------------------------------------------------
# ops


def ops_all(t: int) -> None:
    from nested_jax import ops
    from nested_jax.core import cms_init_levels as core_cms_init_levels
    from nested_jax.ops import cms as ops_cms
    from nested_jax.ops import hola as ops_hola
    from nested_jax.ops import hope as ops_hope
    from nested_jax.ops import titans as ops_titans

    x = _seq(t, 3)
    q, k, v, g, beta, s0 = (x[n] for n in ("q", "k", "v", "g", "beta", "s0"))
    lin = {
        "linear_attention": (q, k, v, g),
        "delta_rule": (q, k, v, beta),
        "gated_delta": (q, k, v, g, beta),
    }
    for impl in ("chunked", "recurrent"):
        for name, args in lin.items():
            for seg in (None, _segments(t)):
                op = getattr(ops, name)
                record(f"ops/{name}/T{t}/{impl}/seg{seg is not None}", lambda s0, *a, f=op, s=seg,
                       i=impl: f(*a, initial_state=s0, segment_ids=s, chunk_size=8, impl=i),
                       s0, *args)  # fmt: skip
        rule = ops.ProteusRule(blocks=4, context_len=16)
        record(f"ops/proteus_gdn/T{t}/{impl}", lambda s0, *a, i=impl: ops.proteus_gated_delta(
            *a, rule=rule, initial_state=s0, t0=3, chunk_size=8, impl=i),
            s0, *lin["gated_delta"])  # fmt: skip
        pos = np.broadcast_to(np.arange(t, dtype=np.int32), (B, t))
        record(f"ops/proteus_key_rows/T{t}", lambda a, b: ops.proteus_key_rows(
            a, b, pos, rule=rule), q, k)  # fmt: skip

        tit = tuple(x[n] for n in ("q", "k", "v", "theta", "eta", "alpha"))
        for dims in ((K, K), (K, 8, K)):
            for prot in (ops.ProteusRule(), ops.ProteusRule(2, 8)):
                rule_t = ops.TitansRule(memory_chunk=4, grad_clip=10.0)
                spec = ops_titans.TitansMemorySpec(dims, rule=rule_t, proteus=prot)
                w0 = ops_titans.titans_mlp_init_weights(jax.random.key(1), H, dims)
                for seg in (None, _segments(t)):
                    tag = f"ops/titans/T{t}/{impl}/L{len(dims) - 1}/E{prot.blocks}"
                    tag += f"/seg{seg is not None}"
                    record(tag, lambda w, *a, sp=spec, s=seg, i=impl: ops_titans.titans_memory(
                        *a, initial_state=ops_titans.titans_mlp_state(w, B), spec=sp,
                        segment_ids=s, reset_state=ops_titans.titans_mlp_state(w, B), impl=i),
                        w0, *tit)  # fmt: skip

                def decode(w, *a, sp=spec, i=impl):
                    cache = ops_titans.titans_memory_init_cache(sp, B, H, impl=i)
                    ys = []
                    for j in range(6):
                        y, cache = ops_titans.titans_memory_step(
                            cache, *(z[:, j] for z in a), spec=sp, initial_weights=w, impl=i
                        )
                        ys.append(y)
                    return ys, cache

                tag = f"ops/titans_step/T{t}/{impl}/L{len(dims) - 1}/E{prot.blocks}"
                record(tag, decode, w0, *tit)

        rule_h = _hope_rule(chunk_memory=4, chunk_other=2, momentum_coef=0.7, remat=False)
        mems, ro, hx, hq = _hope_setup(t, 2)
        for prot in (ops.ProteusRule(), ops.ProteusRule(4, 16)):
            for seg in (None, _segments(t)):
                tag = f"ops/hope/T{t}/{impl}/E{prot.blocks}/seg{seg is not None}"
                record(tag, lambda x_, q_, m, r, p=prot, s=seg, i=impl: ops_hope.hope_memories(
                    x_, q_, r, rule=rule_h, initial_state=ops_hope.hope_init_state(
                        m, B, momentum=True), proteus=p, segment_ids=s, impl=i),
                    hx, hq, mems, ro)  # fmt: skip
            record(f"ops/hope_decode/T{t}/{impl}/E{prot.blocks}", lambda x_, q_, m, r, p=prot,
                   i=impl: ops_hope.hope_decode(x_, q_, r, rule=rule_h, proteus=p, impl=i,
                   initial_state=ops_hope.hope_decode_state(m, B, momentum=True)),
                   hx, hq, mems, ro)  # fmt: skip

        hrule = ops_hola.HolaRule(window=3, block_size=8)
        hargs = _hola_args(t, 4)
        for seg in (None, _segments(t)) if impl == "chunked" else (None,):
            record(f"ops/hola/T{t}/{impl}/seg{seg is not None}", lambda *a, s=seg, i=impl: (
                ops_hola.hola(*a[:5], ops.HolaReadParams(*a[5:]), rule=hrule, segment_ids=s,
                              chunk_size=4, impl=i)), *hargs)  # fmt: skip
        if impl == "chunked":
            st = ops_hola.init_hola_state(B, H, K, V, 3, 8)
            one = tuple(a[:, 0] for a in hargs[:5]) + hargs[5:]
            record("ops/hola_step", lambda s, *a: ops_hola.hola_step(
                s, *a[:5], ops.HolaReadParams(*a[5:]), rule=hrule), st, *one)  # fmt: skip
            levels = core_cms_init_levels(jax.random.key(2), 4, 6, 2, gated=True)
            xc = (0.5 * _rng(9).normal(size=(B, t, 4))).astype(np.float32)
            crule = ops_cms.CMSRule(periods=(2, 4), online_lr=(0.1, 0.05), online_inner="dgd")
            record(f"ops/cms_forward/T{t}", lambda lv, xx: ops.cms_forward(
                lv, xx, rule=crule), levels, xc)  # fmt: skip
            record(f"ops/cms_online/T{t}", lambda lv, xx: ops.cms_online(
                lv, xx, rule=crule, delta=jnp.sin(xx)), levels, xc)  # fmt: skip
            hid = (0.5 * _rng(8).normal(size=(B, t, 8))).astype(np.float32)
            wv = (0.5 * _rng(7).normal(size=(11, 8))).astype(np.float32)
            tg = _rng(6).integers(0, 11, size=(B, t)).astype(np.int32)
            mask = np.ones((B, t), np.float32)
            record(f"ops/ce/T{t}", lambda h, w: ops.chunked_cross_entropy(
                h, w, tg, mask, chunk_tokens=8, weight_layout="vd"), hid, wv)  # fmt: skip
        one = tuple(a[:, 0] for a in lin["gated_delta"])
        record("ops/gated_delta_step", ops.gated_delta_step, s0, *one)
        record(
            "ops/delta_rule_step", ops.delta_rule_step, s0, *(a[:, 0] for a in lin["delta_rule"])
        )
        record("ops/linear_attention_step", ops.linear_attention_step, s0,
               *(a[:, 0] for a in lin["linear_attention"]))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# mixers through the LM


def _mixer_configs():
    import dataclasses

    from nested_jax.layers.options import HopeOptions, ProteusOptions, TitansOptions
    from nested_jax.models.config import ModelConfig
    from nested_jax.models.registry import available_mixers

    base = dict(vocab_size=31, d_model=16, n_layers=2, n_heads=2, chunk_size=8)
    small = dict(
        titans=TitansOptions(memory_chunk=4, segment_len=8, memory_hidden=8),
        hope=HopeOptions(chunk_memory=4, chunk_other=2),
    )
    out = {}
    for name in available_mixers():
        cfg = ModelConfig(name=name, **base, **small)
        out[name] = cfg
        if name in ("gdn", "deltanet", "hola", "hope", "titans_lmm"):
            out[f"{name}_recurrent"] = dataclasses.replace(cfg, impl="recurrent")
        if name in ("gdn", "titans_lmm", "hope", "titans_mag"):
            out[f"{name}_proteus"] = dataclasses.replace(cfg, proteus=ProteusOptions(4, 16))
    return out


def mixers(t: int) -> None:
    from flax import nnx

    from nested_jax.models.lm import build_model

    tokens = _rng(t).integers(0, 31, size=(B, t)).astype(np.int32)
    for name, cfg in _mixer_configs().items():
        try:
            model = build_model(cfg, rngs=nnx.Rngs(0))
        except ValueError as err:  # an option combination this mixer refuses: say so, skip
            print(f"  mixer {name}: {err}", file=sys.stderr)
            continue
        graph, params = nnx.split(model)
        for seg in (None, _segments(t)):

            def loss(p, s=seg, gr=graph):
                m = nnx.merge(gr, p)
                h, _ = m.hidden(jnp.asarray(tokens), segment_ids=s)
                return jnp.sum(jnp.sin(h))

            try:
                val, grad = jax.jit(jax.value_and_grad(loss))(params)
            except ValueError as err:
                print(f"  mixer {name} seg={seg is not None}: {err}", file=sys.stderr)
                continue
            _put(f"mixer/{name}/T{t}/seg{seg is not None}/loss", val)
            _put(f"mixer/{name}/T{t}/seg{seg is not None}/grad", nnx.to_pure_dict(grad))
        if t == LENGTHS[0]:
            model = nnx.merge(graph, params)
            try:
                cache = model.init_cache(B, 16)
            except (ValueError, NotImplementedError) as err:
                print(f"  mixer {name} decode: {err}", file=sys.stderr)
                continue
            hs = []
            h, cache = model.hidden(jnp.asarray(tokens[:, :5]), cache=cache)
            hs.append(h)
            for j in range(5, 9):
                h, cache = model.hidden(jnp.asarray(tokens[:, j : j + 1]), cache=cache)
                hs.append(h)
            _put(f"mixer/{name}/decode", hs)


# --------------------------------------------------------------------------------------------------
# training


def training() -> None:
    import json

    from nested_jax.train import config as tc
    from nested_jax.train import loop
    from nested_jax.train.workdir import plan_resume, record_run

    root = Path(__file__).resolve().parents[1]
    for name in TRAIN_CONFIGS:
        cfg = tc.load_config(
            [root / "configs" / "experiments" / f"{name}.yaml"],
            [
                f"train.steps={TRAIN_STEPS}",
                "train.log_every=1",
                "train.eval_every=1000",
                "train.checkpoint_every=1000",
                "eval.eval_batches=1",
                "data.batch_size=4",
                "data.seq_len=64",
            ],
        )
        with tempfile.TemporaryDirectory(prefix="invariants-") as wd:
            workdir = Path(wd)
            plan = plan_resume(cfg, workdir)
            prep = loop.prepare_data(cfg, workdir, plan, None)
            ckpt, start, state, iterator = loop.restore_or_start(
                cfg, workdir, prep.setup, prep.make_iterator, plan
            )
            record_run(cfg, workdir, plan, prep.spec, prep.bundle.tokenizer, start)
            run = loop.open_run(cfg, workdir, prep, ckpt, iterator, state, start)
            state, _ = loop.run_and_close(run, state, start)
            rows = [
                json.loads(line)
                for line in (workdir / "metrics.jsonl").read_text().split("\n")
                if line
            ]
            losses = [r["loss"] for r in rows if "loss" in r]
            _put(f"train/{name}/losses", np.asarray(losses, np.float64))
            _put(f"train/{name}/params", state["params"])


# --------------------------------------------------------------------------------------------------

SECTIONS = {
    "core": (
        core_associative,
        core_titans,
        core_proteus,
        core_hope,
        core_hola,
        core_cms,
        core_misc,
    ),
    "ops": (ops_all,),
    "mixers": (mixers,),
}


def dump(path: Path, only: list[str], lengths: tuple[int, ...], skip: list[str]) -> None:
    import nested_jax

    print(f"nested_jax from {nested_jax.__file__}", file=sys.stderr)
    OUT.clear()
    for section, fns in SECTIONS.items():
        if only and section not in only:
            continue
        for fn in fns:
            if fn.__name__ in skip:
                continue
            for t in lengths:
                t0 = time.time()
                try:
                    fn(t)
                except Exception as err:  # a setup error outside record(): kept as a key
                    msg = f"{type(err).__name__}: {err}".split("\n")[0][:300]
                    print(f"  {fn.__name__} T={t} failed: {msg}", file=sys.stderr)
                    OUT[f"{fn.__name__}/T{t}/ERROR"] = np.asarray(msg)
                print(f"{fn.__name__} T={t}: {time.time() - t0:.1f}s", file=sys.stderr)
    if (not only or "train" in only) and "training" not in skip:
        t0 = time.time()
        try:
            training()
        except Exception as err:  # kept as a key, so both dumps must fail the same way
            msg = f"{type(err).__name__}: {err}".split("\n")[0][:300]
            print(f"  training failed: {msg}", file=sys.stderr)
            OUT["train/ERROR"] = np.asarray(msg)
        print(f"training: {time.time() - t0:.1f}s", file=sys.stderr)
    np.savez(path, **OUT)
    print(f"wrote {len(OUT)} arrays to {path}")


def compare(a: Path, b: Path) -> int:
    x, y = np.load(a), np.load(b)
    ka, kb = set(x.files), set(y.files)
    bad = sorted(ka ^ kb)
    for key in sorted(ka & kb):
        a, b = x[key], y[key]
        # NaN equals NaN for floats; the ERROR keys hold strings, which have no NaN
        same = a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        if not same:
            bad.append(key)
    for key in bad[:50]:
        print(f"DIFFERS: {key}")
    print(f"{len(ka & kb)} common arrays, {len(ka ^ kb)} keys in one dump only, "
          f"{len(bad)} differences: {'IDENTICAL' if not bad else 'NOT IDENTICAL'}")  # fmt: skip
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("dump", "compare"))
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--only", nargs="*", default=[], help="sections: core ops mixers train")
    p.add_argument("--skip", nargs="*", default=[], help="section functions to leave out")
    p.add_argument("--lengths", nargs="*", type=int, default=list(LENGTHS))
    args = p.parse_args(argv)
    if args.mode == "dump":
        dump(args.paths[0], args.only, tuple(args.lengths), args.skip)
        return 0
    if len(args.paths) == 1:
        fresh = Path(tempfile.mkdtemp(prefix="invariants-")) / "after.npz"
        dump(fresh, args.only, tuple(args.lengths), args.skip)
        args.paths.append(fresh)
    return compare(args.paths[0], args.paths[1])


if __name__ == "__main__":
    sys.exit(main())
