"""Autoregressive sampling with an explicit decode state (SPEC §6): prefill, then one exact step per
token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def _sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """Sample ids ``[B]`` from ``logits [B, V]``: greedy when ``temperature == 0``, else
    softmax(l/τ) with top-k."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k"))
def _generate(graphdef, state, prompt, rng, cache, *, max_new_tokens, temperature, top_k):
    model = nnx.merge(graphdef, state)
    b, p = prompt.shape
    if cache is None:
        cache = model.init_cache(b, p + max_new_tokens)
    logits, cache = model(prompt, cache=cache)
    keys = jax.random.split(rng, max_new_tokens)
    first = _sample(logits[:, -1], keys[0], temperature, top_k)

    def step(carry, key):
        tok, c = carry
        lg, c = model(tok[:, None], cache=c)
        nxt = _sample(lg[:, -1], key, temperature, top_k)
        return (nxt, c), nxt

    (last, cache), rest = jax.lax.scan(step, (first, cache), keys[1:])
    # The last sampled token is not yet in the cache: feed it so the returned state has read
    # every token of the output (a continued stream then starts after it).
    _, cache = model(last[:, None], cache=cache)
    return jnp.concatenate([prompt, first[:, None], rest.T.astype(jnp.int32)], axis=1), cache


def generate(
    model,
    prompt: jax.Array,
    max_new_tokens: int,
    *,
    rng: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
    cache=None,
    return_cache: bool = False,
):
    """Sample ``max_new_tokens`` tokens after ``prompt``.

    The prompt is run once through the full (chunked / parallel) forward into a fresh cache of
    ``P + max_new_tokens`` slots; then each new token is one exact single-token step carrying the
    state
    (KV cache for attention, matrix + conv state for DeltaNet / GDN), all inside one jitted
    ``lax.scan``.

    Args:
      model: a :class:`nested_jax.models.LanguageModel`.
      prompt: ``int32 [B, P]`` with ``P ≥ 1``.
      max_new_tokens: number of tokens to append (≥ 0).
      rng: a JAX PRNG key.
      temperature: softmax temperature; ``0`` means greedy (argmax).
      top_k: keep only the ``top_k`` most likely tokens (None = all).
      cache: continue from this :class:`~nested_jax.models.lm.LMCache` (e.g. a stream's memories,
        ``nested_jax.eval.continual``) instead of a fresh one; it must have room for
        ``P + max_new_tokens`` more positions.
      return_cache: also return the decode state after every output token has been read.

    Returns:
      ``int32 [B, P + max_new_tokens]``: the prompt followed by the sampled tokens (and the new
      cache when ``return_cache``).
    """
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(
            f"prompt: expected int [B, P] with P >= 1, got {prompt.dtype} {prompt.shape}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0, got {temperature}")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= model.cfg.vocab_size):
        raise ValueError(f"top_k: expected an int in [1, vocab_size], got {top_k!r}")
    prompt = prompt.astype(jnp.int32)
    if max_new_tokens == 0:
        if not return_cache:
            return prompt
        if cache is None:
            cache = model.init_cache(prompt.shape[0], prompt.shape[1])
        return prompt, model(prompt, cache=cache)[1]
    graphdef, state = nnx.split(model)
    out, cache = _generate(
        graphdef,
        state,
        prompt,
        rng,
        cache,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
    )
    return (out, cache) if return_cache else out
