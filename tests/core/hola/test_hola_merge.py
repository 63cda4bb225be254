"""HOLA top-w merge (SPEC §5): ``merge_top_w`` (a ``lax.top_k`` for the evictions with scores
fixed at insertion, a 2-key sort for ``cumulative_attention``) equals an independent numpy sort on
caches built by repeated merges with heavy ties: scores from a few values, ±0.0, invalid entries,
partly filled blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.hola.cache import merge_top_w

B, H, W, C, D = 2, 3, 8, 16, 3
N_MERGES = 10
EVICTIONS = ("beta_e", "e", "beta_v", "recency", "cumulative_attention")
LEVELS = np.array([0.0, -0.0, 0.25, 0.25, 1.0, 1.0, 1.0], np.float32)  # ties, ±0.0


def _reference(cache, blk, window, eviction):
    """Per row, Python's ``sorted`` of the valid candidates by (score desc, position asc)
    (``recency``: position desc), then the invalid ones; the first ``window`` kept, invalid ones
    zeroed. −0.0 and +0.0 compare equal as Python floats."""
    k, v, s, p, val = (np.concatenate([a, b], axis=2) for a, b in zip(cache, blk, strict=True))
    out_k = np.zeros(k.shape[:2] + (window, k.shape[3]), np.float32)
    out_v = np.zeros(v.shape[:2] + (window, v.shape[3]), np.float32)
    out_s = np.zeros(k.shape[:2] + (window,), np.float32)
    out_p = np.full(k.shape[:2] + (window,), -1, np.int32)
    out_val = np.zeros(k.shape[:2] + (window,), bool)
    for b in range(k.shape[0]):
        for h in range(k.shape[1]):
            ids = [i for i in range(k.shape[2]) if val[b, h, i]]
            if eviction == "recency":
                ids.sort(key=lambda i: -int(p[b, h, i]))
            else:
                ids.sort(key=lambda i: (-float(s[b, h, i]), int(p[b, h, i])))
            for j, i in enumerate(ids[:window]):
                out_k[b, h, j], out_v[b, h, j] = k[b, h, i], v[b, h, i]
                out_s[b, h, j], out_p[b, h, j], out_val[b, h, j] = s[b, h, i], p[b, h, i], True
    return out_k, out_v, out_s, out_p, out_val


def _block(rng, start, eviction):
    """A block of ``C`` candidates at positions ``start + [0, C)``; a random subset valid (some
    blocks full, some partly filled, some empty), the rest with garbage fields."""
    pos = start + np.arange(C, dtype=np.int32)
    kind = rng.integers(3)
    if kind == 0:
        val = np.ones((B, H, C), bool)
    elif kind == 1:  # partly filled: a prefix per row
        val = np.arange(C)[None, None, :] < rng.integers(0, C + 1, size=(B, H, 1))
    else:
        val = rng.random((B, H, C)) < 0.5
    if eviction == "recency":
        s = np.broadcast_to(pos.astype(np.float32), (B, H, C)).copy()
    elif eviction == "cumulative_attention":
        s = np.zeros((B, H, C), np.float32)
    else:
        s = rng.choice(LEVELS, size=(B, H, C))
    s = np.where(val, s, rng.choice(LEVELS, size=(B, H, C)))  # garbage under invalid entries
    p = np.where(val, pos[None, None, :], rng.integers(-1, 5 * C, size=(B, H, C)))
    k = rng.normal(size=(B, H, C, D)).astype(np.float32)
    v = rng.normal(size=(B, H, C, D)).astype(np.float32)
    return k, v, s.astype(np.float32), p.astype(np.int32), val


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_merge_equals_sorted_reference_over_repeated_merges(eviction):
    rng = np.random.default_rng(EVICTIONS.index(eviction))
    merge = jax.jit(lambda c, b: merge_top_w(c, b, W, eviction))
    cache = (
        np.zeros((B, H, W, D), np.float32),
        np.zeros((B, H, W, D), np.float32),
        np.zeros((B, H, W), np.float32),
        np.full((B, H, W), -1, np.int32),
        np.zeros((B, H, W), bool),
    )
    n_ties = 0
    for n in range(N_MERGES):
        blk = _block(rng, 100 + n * C, eviction)
        if eviction == "cumulative_attention":
            # masses grow after insertion (breaking the stored order) and tie often, ±0.0 too
            cache = cache[:2] + (cache[2] + rng.choice(LEVELS, size=cache[2].shape),) + cache[3:]
            blk = blk[:2] + (rng.choice(LEVELS, size=blk[2].shape),) + blk[3:]
        want = _reference(cache, blk, W, eviction)
        got = [np.asarray(x) for x in merge(cache, blk)]
        for name, g, w in zip(("k", "v", "score", "pos", "valid"), got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"merge {n}, {name}")
        s_all = np.concatenate([cache[2], blk[2]], axis=2)[np.concatenate([cache[4], blk[4]], 2)]
        n_ties += s_all.size - np.unique(np.abs(s_all)).size
        cache = want
    if eviction != "recency":
        assert n_ties > 100  # the ties are really there


def test_merge_output_is_in_selection_order_and_keeps_gradients_to_chosen_entries():
    """The output is sorted by (score desc, position asc), valid first, and the gradient of the
    merged ``k`` reaches exactly the chosen candidates (selection itself is not differentiated)."""
    rng = np.random.default_rng(7)
    cache = tuple(jnp.asarray(x[..., :W, :] if x.ndim == 4 else x[..., :W]) for x in
                  _block(rng, 0, "beta_e"))  # fmt: skip
    cache = merge_top_w(cache, _block(rng, C, "beta_e"), W, "beta_e")
    blk = _block(rng, 2 * C, "beta_e")
    out = merge_top_w(cache, blk, W, "beta_e")
    s, p, val = (np.asarray(x) for x in out[2:])
    for b in range(B):
        for h in range(H):
            nv = int(val[b, h].sum())
            assert val[b, h, :nv].all() and not val[b, h, nv:].any()
            keys = list(zip(-s[b, h, :nv], p[b, h, :nv], strict=True))
            assert keys == sorted(keys)

    def f(ck, bk):
        return jnp.sum(merge_top_w((ck, *cache[1:]), (bk, *blk[1:]), W, "beta_e")[0])

    gc, gb = jax.grad(f, argnums=(0, 1))(cache[0], jnp.asarray(blk[0]))
    chosen = np.zeros((B, H, W + C), bool)
    cand_p = np.concatenate([np.asarray(cache[3]), blk[3]], axis=2)
    cand_val = np.concatenate([np.asarray(cache[4]), blk[4]], axis=2)
    for b in range(B):
        for h in range(H):
            for j in range(W):
                if val[b, h, j]:
                    chosen[b, h] |= cand_val[b, h] & (cand_p[b, h] == p[b, h, j])
    g = np.concatenate([np.asarray(gc), np.asarray(gb)], axis=2)
    np.testing.assert_array_equal(g, np.where(chosen[..., None], 1.0, 0.0) + 0 * g)
