"""Reference twin of CMS online mode (SPEC §3.3): one row, one token at a time, SGD.

``cms_online`` (``nested_jax.core.cms.online``) is tested against :func:`cms_reference`. It is
written from the SPEC text and shares no code with it: each level is its MLP written out again,
the per-token parameter gradient comes from ``jax.grad`` of ``⟨δ_t, y_t⟩``, and the period
boundaries are the plain test ``p mod C^(ℓ) = 0`` on the 1-based token count ``p`` — no chunk grid,
no ``gcd``, no ``lax.scan``. Per row ``b`` and token ``t`` (``θ`` the weights in force before
``t``)::

    y_t = CMS(θ; x_t)                           sequential: MLP_k(… MLP_1(x_t)); nested: MLP_1(x_t);
                                                independent: Σ_ℓ softmax(mix)_ℓ MLP_ℓ(x_t)
    δ_t = ∂ loss(y_t, side_t) / ∂y_t            (or the given δ_t)
    acc_ℓ += η_ℓ ∂⟨δ_t, y_t⟩/∂θ_ℓ               (nested: every level takes level 1's gradient)
    if p mod C^(ℓ) = 0:  θ_ℓ −= acc_ℓ,  acc_ℓ = 0
    nested, slowest to fastest: if p mod C^(ℓ+1) = 0:  θ_ℓ = θ_{ℓ+1},  acc_ℓ = 0

with ``MLP(x) = x + (silu(x W_up) [⊙ x W_gate-gated]) W_down``. Only the SGD inner rule: the DGD
rule is checked per layer against ``core.dgd.dgd_update_layers`` (``tests/core/cms/test_cms.py``).
Differentiable w.r.t. ``levels`` (the loop is plain JAX), so meta-gradients can be compared too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nested_jax.rules import CMSRule

__all__ = ["cms_reference"]


def _mlp(level, x):
    up = x @ level.w_up
    hidden = jax.nn.silu(up) if level.w_gate is None else jax.nn.silu(x @ level.w_gate) * up
    return x + hidden @ level.w_down


def _cms(levels, x, variant, mix_logits):
    if variant == "sequential":
        for level in levels:
            x = _mlp(level, x)
        return x
    if variant == "nested":
        return _mlp(levels[0], x)
    weights = jax.nn.softmax(mix_logits)
    return sum(weights[j] * _mlp(level, x) for j, level in enumerate(levels))


@functools.partial(jax.jit, static_argnames=("variant", "loss_fn"))
def _token(levels, x_t, side_t, delta_t, mix_logits, *, variant, loss_fn):
    """``(y_t, ∂⟨δ_t, y_t⟩/∂θ per level)``, ``δ_t = ∂ loss_fn(y_t, side_t)/∂y_t`` or ``delta_t``
    (jitted per token only to keep the loop quick; nothing is shared with ``cms_online``)."""
    y_t = _cms(levels, x_t, variant, mix_logits)
    d = delta_t if loss_fn is None else jax.grad(loss_fn)(y_t, side_t)
    grads = jax.grad(lambda lv: jnp.vdot(_cms(lv, x_t, variant, mix_logits), d))(levels)
    return y_t, grads


def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _scaled_add(acc, grad, rate):
    return jax.tree.map(lambda a, g: a + rate * g, acc, grad)


def _row(levels, x, side, delta, loss_fn, rule, rates, mix_logits, pos0):
    """One row: outputs ``[T, d]``, final levels and accumulators (lists of ``CMSLevel``)."""
    k, variant, periods = len(levels), rule.variant, rule.periods
    levels, acc, ys = list(levels), [_zeros(lv) for lv in levels], []
    for t in range(x.shape[0]):
        y_t, grads = _token(tuple(levels), x[t], None if side is None else side[t],
                            None if delta is None else delta[t], mix_logits, variant=variant,
                            loss_fn=loss_fn)  # fmt: skip
        ys.append(y_t)
        for j in range(k):
            acc[j] = _scaled_add(acc[j], grads[0] if variant == "nested" else grads[j], rates[j])
        p = pos0 + t + 1
        for j in range(k):
            if p % periods[j] == 0:
                levels[j] = jax.tree.map(jnp.subtract, levels[j], acc[j])
                acc[j] = _zeros(acc[j])
        if variant == "nested":
            for j in range(k - 2, -1, -1):
                if p % periods[j + 1] == 0:
                    levels[j], acc[j] = levels[j + 1], _zeros(acc[j])
    return jnp.stack(ys), levels, acc


def cms_reference(
    levels, x, *, rule=CMSRule(), loss_fn=None, side=None, delta=None, mix_logits=None, pos0=0
):
    """CMS online mode token by token (SPEC §3.3), the twin of ``cms_online`` (SGD inner rule).

    Args:
      levels: tuple of ``k`` ``CMSLevel`` (unbatched), the initial weights of every row.
      x: ``[B, T, d]``.
      rule: ``CMSRule`` with ``online_inner="sgd"``: periods, variant and rates.
      loss_fn: ``(y_t [d], side_t [d]) -> scalar``, the per-token loss whose ``∂/∂y_t`` is ``δ_t``
        (kept differentiable: meta-gradients see the second-order path). With ``side [B, T, d]``.
      delta: ``[B, T, d]`` precomputed ``δ`` instead of ``loss_fn``.
      mix_logits: ``[k]`` for ``variant="independent"``.
      pos0: tokens already seen (the boundaries count from there).

    Returns:
      ``(y [B, T, d], levels, accum)``: ``levels`` and ``accum`` are tuples of ``k`` ``CMSLevel``
      whose arrays have a leading batch axis, like ``CMSState.levels`` / ``CMSState.accum``.
    """
    if rule.online_inner != "sgd":
        raise ValueError(
            f"cms_reference: rule.online_inner: only 'sgd' has this twin, got "
            f"{rule.online_inner!r} (DGD is checked per layer against dgd_update_layers)"
        )
    if (loss_fn is None) == (delta is None):
        raise ValueError("cms_reference: give exactly one of loss_fn (with side) or delta")
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"cms_reference: x: expected [B, T, d], got {getattr(x, 'shape', None)}")
    k = len(levels)
    lr = rule.online_lr
    rates = tuple(lr) if isinstance(lr, tuple | list) else (lr,) * k
    rows = [
        _row(levels, x[b], None if side is None else side[b], None if delta is None else delta[b],
             loss_fn, rule, rates, mix_logits, pos0)
        for b in range(x.shape[0])
    ]  # fmt: skip

    def stack(i):  # rows' level lists -> one tuple of batched levels
        return tuple(
            jax.tree.map(lambda *a: jnp.stack(a), *(r[i][j] for r in rows)) for j in range(k)
        )

    return jnp.stack([r[0] for r in rows]), stack(1), stack(2)
