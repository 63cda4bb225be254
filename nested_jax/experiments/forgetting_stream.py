"""The simulation of the two-language forgetting experiment (``experiments.forgetting``).

A latent Markov chain written in two disjoint token maps (languages A and B), a frozen embedding
and head around an online CMS (SPEC §3.3), optional outer-loop pretraining of the initial levels,
and :func:`run_arm`: one arm (CMS configuration) on one seed's alternating A/B stream, with the
held-out loss on both languages after every phase. The protocol and the metrics are in the
docstring of :mod:`nested_jax.experiments.forgetting`; its results in ``docs/RESULTS.md``.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nested_jax.core.cms.levels import cms_forward, cms_init_levels
from nested_jax.core.cms.online import cms_initial_state, cms_online, surprise_from_loss
from nested_jax.rules import CMSRule

__all__ = ["StreamSettings", "Arm", "level_lrs", "sample_chain", "run_arm"]

_SCALINGS = ("sum", "mean")


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """One continual stream protocol (shared by every arm it compares)."""

    n_symbols: int = 16  # n: latent symbols; vocabulary V = 2n
    concentration: float = 0.1  # Dirichlet α of each transition row (small = peaked)
    d_model: int = 32  # d
    d_hidden: int = 32  # h of every CMS level (equal per-level width)
    init_scale: float = 1.0  # cms_init_levels init_scale
    phase_len: int = 256  # tokens per phase
    n_phases: int = 8  # A, B, A, B, … (starts with A)
    n_streams: int = 8  # independent streams per seed (batch rows)
    n_eval: int = 32  # held-out sequences per language
    eval_len: int = 32  # tokens per held-out sequence
    lr: float = 0.03  # η of the fastest level (and of the one-level model)
    inner: str = "sgd"  # CMS inner optimizer: "sgd" | "dgd"
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    pretrain_steps: int = 0  # Adam steps on both languages before the stream (0: none)
    pretrain_lr: float = 3e-3  # Adam rate of that pretraining

    def __post_init__(self) -> None:
        for name in ("n_symbols", "d_model", "d_hidden", "phase_len", "n_streams", "n_eval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.n_phases < 2:
            raise ValueError(f"n_phases: expected >= 2 (an A and a B phase), got {self.n_phases}")
        if self.eval_len < 1:
            raise ValueError(f"eval_len: expected >= 1, got {self.eval_len}")
        if not self.concentration > 0:
            raise ValueError(f"concentration: expected > 0, got {self.concentration}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if self.inner not in ("sgd", "dgd"):
            raise ValueError(f"inner: expected 'sgd' or 'dgd', got {self.inner!r}")
        if not self.seeds:
            raise ValueError("seeds: expected at least one seed")
        if self.pretrain_steps < 0:
            raise ValueError(f"pretrain_steps: expected >= 0, got {self.pretrain_steps}")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One CMS configuration in the comparison."""

    name: str
    variant: str = "sequential"  # "sequential" | "nested" | "independent"
    periods: tuple[int, ...] = (1,)
    lr_scaling: str = "sum"  # "sum": η_ℓ = η;  "mean": η_ℓ = η C^(1)/C^(ℓ)
    lr_mult: float = 1.0  # multiplies the base η (e.g. a slow one-level baseline)

    def __post_init__(self) -> None:
        if self.lr_scaling not in _SCALINGS:
            raise ValueError(f"lr_scaling: expected one of {_SCALINGS}, got {self.lr_scaling!r}")
        if not self.lr_mult > 0:
            raise ValueError(f"lr_mult: expected > 0, got {self.lr_mult}")
        if not self.periods or self.periods[0] != 1:
            # The stream is scored token by token; a fastest level with period 1 keeps every
            # arm's chunking identical (gcd = 1) and the one-level baseline a per-token learner.
            raise ValueError(f"periods: expected (1, …), got {self.periods}")

    @property
    def k(self) -> int:
        return len(self.periods)


def level_lrs(arm: Arm, lr: float) -> tuple[float, ...]:
    """Per-level rates ``η_ℓ`` of ``arm`` for base rate ``lr`` (module docstring, ``lr_scaling``).

    Args:
      arm: the arm.
      lr: base ``η``.

    Returns:
      ``k`` floats: ``lr · lr_mult`` (``"sum"``) or ``lr · lr_mult · C^(1)/C^(ℓ)`` (``"mean"``).
    """
    base = lr * arm.lr_mult
    if arm.lr_scaling == "sum":
        return tuple(base for _ in arm.periods)
    return tuple(base * arm.periods[0] / c for c in arm.periods)


def sample_chain(key, trans, batch: int, length: int):
    """Sequences of a first-order Markov chain, uniform start state.

    Args:
      key: PRNG key.
      trans: ``[n, n]`` row-stochastic transition matrix.
      batch, length: output shape.

    Returns:
      int32 ``[batch, length]`` symbols in ``[0, n)``.
    """
    trans = jnp.asarray(trans)
    if trans.ndim != 2 or trans.shape[0] != trans.shape[1]:
        raise ValueError(f"trans must have shape [n, n], got {trans.shape}")
    n = trans.shape[0]
    k0, ks = jax.random.split(key)
    s0 = jax.random.randint(k0, (batch,), 0, n)
    logp = jnp.log(jnp.maximum(trans, 1e-30))

    def step(s, kk):
        nxt = jax.random.categorical(kk, logp[s], axis=-1).astype(jnp.int32)
        return nxt, nxt

    _, rest = lax.scan(step, s0.astype(jnp.int32), jax.random.split(ks, length - 1))
    return jnp.concatenate([s0[:, None].astype(jnp.int32), rest.T], axis=1)


def _pretrain(key, trans, emb, head, levels, mix, s: StreamSettings, arm: Arm):
    """Initial CMS levels trained offline (fixed weights, ``cms_forward``) on both languages.

    Adam (``pretrain_lr``) for ``pretrain_steps`` steps on batches of ``n_streams`` sequences of
    ``eval_len + 1`` tokens per language. ``nested``: the one level that computes the output is
    trained and every level starts from it (the slower levels are its initial states).
    """
    import optax

    n = s.n_symbols
    train = (levels[0],) if arm.variant == "nested" else levels
    variant = "sequential" if arm.variant == "nested" else arm.variant
    opt = optax.adam(s.pretrain_lr)

    def loss(lv, tk):
        y = cms_forward(lv, emb[tk[:, :-1]], variant=variant, mix_logits=mix)
        return jnp.mean(_ce(head, y, tk[:, 1:]))

    def step(carry, kk):
        lv, st = carry
        lat = sample_chain(kk, trans, s.n_streams, s.eval_len + 1)
        tk = jnp.concatenate([lat, lat + n])  # both languages in every batch
        g = jax.grad(loss)(lv, tk)
        up, st = opt.update(g, st, lv)
        return (optax.apply_updates(lv, up), st), None

    (train, _), _ = lax.scan(
        step, (train, opt.init(train)), jax.random.split(key, s.pretrain_steps)
    )
    return (train[0],) * arm.k if arm.variant == "nested" else tuple(train)


def _ce(head, y, targets):
    """Per-token next-token cross-entropy of ``softmax(y W_o)``: ``[..., T]``."""
    logits = jnp.einsum("...td,dv->...tv", y, head)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - tgt


@partial(jax.jit, static_argnames=("s", "arm"))
def _run(key, offset, s: StreamSettings, arm: Arm):
    n, d, h, B, P = s.n_symbols, s.d_model, s.d_hidden, s.n_streams, s.phase_len
    V = 2 * n
    kc, ke, ko, kl, ks, kv = jax.random.split(key, 6)
    trans = jax.random.dirichlet(kc, jnp.full((n,), s.concentration), (n,))
    emb = jax.random.normal(ke, (V, d))
    head = jax.random.normal(ko, (d, V)) / math.sqrt(d)
    # Always draw three levels so the fastest level's init is the same for every arm of a seed.
    base = cms_init_levels(kl, d, h, 3, init_scale=s.init_scale)
    levels = (base[0],) * arm.k if arm.variant == "nested" else tuple(base[: arm.k])
    mix = jnp.zeros((arm.k,)) if arm.variant == "independent" else None
    if s.pretrain_steps:
        levels = _pretrain(jax.random.fold_in(key, 1), trans, emb, head, levels, mix, s, arm)

    lat = sample_chain(ks, trans, s.n_phases * B, P + 1).reshape(s.n_phases, B, P + 1)
    langs = jnp.arange(s.n_phases, dtype=jnp.int32) % 2  # 0 = A, 1 = B
    toks = lat + (langs * n)[:, None, None]
    ev = sample_chain(kv, trans, s.n_eval, s.eval_len + 1)
    ev_toks = jnp.stack([ev, ev + n])  # [2, N, L+1]
    floor = -jnp.mean(jnp.log(jnp.maximum(trans[ev[:, :-1], ev[:, 1:]], 1e-30)))

    delta_fn = surprise_from_loss(partial(_ce, head))
    rule = CMSRule(
        periods=arm.periods,
        variant=arm.variant,
        online_lr=level_lrs(arm, s.lr),
        online_inner=s.inner,
    )

    def evaluate(levels_b):
        def one(lv):
            def lang(tk):
                y = cms_forward(lv, emb[tk[:, :-1]], variant=arm.variant, mix_logits=mix)
                return jnp.mean(_ce(head, y, tk[:, 1:]))

            return jax.vmap(lang)(ev_toks)  # [2]

        return jnp.mean(jax.vmap(one)(levels_b), axis=0)  # [2]: (A, B)

    state0 = cms_initial_state(levels, B)._replace(pos=jnp.asarray(offset, jnp.int32))

    def phase(state, tk):
        y, st = cms_online(
            levels,
            emb[tk[:, :-1]],
            rule=rule,
            delta_fn=delta_fn,
            side=tk[:, 1:],
            mix_logits=mix,
            initial_state=state,
        )
        online = jnp.mean(_ce(head, y, tk[:, 1:]))
        return st, (online, evaluate(st.levels))

    init = evaluate(state0.levels)
    _, (online, ev_loss) = lax.scan(phase, state0, toks)
    return {"init": init, "online": online, "eval": ev_loss, "floor": floor}


def run_arm(s: StreamSettings, arm: Arm, seed: int) -> dict:
    """Runs one arm on one seed's stream.

    Args:
      s: the protocol; arm: the CMS configuration; seed: chain, model init, stream and clock offset.

    Returns:
      dict of numpy values: ``init`` ``[2]`` (loss on A, B before the stream), ``online``
      ``[n_phases]`` (mean next-token loss during each phase), ``eval`` ``[n_phases, 2]`` (held-out
      A and B loss after each phase), ``floor`` (true-chain loss on the held-out data), ``offset``.
    """
    # The clock offset comes from its own key so that it does not change the stream's draws.
    offset = int(np.random.default_rng([seed, 7]).integers(0, max(arm.periods)))
    out = _run(jax.random.PRNGKey(seed), offset, s, arm)
    out = {k: np.asarray(v, np.float64) for k, v in out.items()}
    if not np.all(np.isfinite(out["eval"])):
        out["diverged"] = True
    out["offset"] = offset
    return out
