"""Continual streaming (nested_jax.eval.continual): memories carried across calls, online CMS
levels, exact resumption through an orbax stream-state checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nested_jax.eval.continual import (
    HEADROOM,
    _pieces,
    init_stream,
    load_stream_state,
    resize_stream,
    save_stream_state,
    stream_capacity,
    stream_model,
    stream_tokens,
)
from nested_jax.models import ModelConfig, build_model

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2)


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 64, (1, n + 1)).astype(np.int32)


def _full_forward_ce(model, toks):
    logits, _ = model(jnp.asarray(toks[:, :-1]))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, jnp.asarray(toks[:, 1:])[..., None], -1)[..., 0]


# titans_lmm: ~70 s on 2 cores, so slow (run with -m slow)
@pytest.mark.parametrize("name", ["gdn", pytest.param("titans_lmm", marks=pytest.mark.slow)])
def test_memory_stream_split_over_calls_equals_one_forward(name):
    model = build_model(ModelConfig(name=name, **SMALL), rngs=nnx.Rngs(0))
    apply_fn, params = stream_model(model)
    toks = _tokens(70)
    ref = _full_forward_ce(model, toks)
    state = init_stream(model.init_cache, params, capacity=80)
    ce_a, state = stream_tokens(apply_fn, params, state, toks[:, :29], toks[:, 1:30], chunk=16)
    ce_b, state = stream_tokens(apply_fn, params, state, toks[:, 29:-1], toks[:, 30:], chunk=16)
    assert int(state.pos) == 70
    np.testing.assert_allclose(jnp.concatenate([ce_a, ce_b], 1), ref, rtol=1e-5, atol=1e-5)


def test_stream_state_checkpoint_round_trip_resumes_exactly(tmp_path):
    model = build_model(ModelConfig(name="gdn", **SMALL), rngs=nnx.Rngs(0))
    apply_fn, params = stream_model(model)
    toks = _tokens(48, seed=3)
    state = init_stream(model.init_cache, params, capacity=64)
    _, mid = stream_tokens(apply_fn, params, state, toks[:, :24], toks[:, 1:25], chunk=8)
    ce_direct, _ = stream_tokens(apply_fn, params, mid, toks[:, 24:-1], toks[:, 25:], chunk=8)

    path = save_stream_state(tmp_path / "state", mid)
    back, periods = load_stream_state(path, model.init_cache, params)
    assert int(back.pos) == 24 and int(back.capacity) == 64 and periods is None
    ce_resumed, _ = stream_tokens(apply_fn, params, back, toks[:, 24:-1], toks[:, 25:], chunk=8)
    np.testing.assert_array_equal(ce_resumed, ce_direct)

    with pytest.raises(ValueError, match="exists"):
        save_stream_state(path, mid)  # never overwrites a saved state
    with pytest.raises(ValueError, match="no stream state"):
        load_stream_state(tmp_path / "missing", model.init_cache, params)
    (path / "state").rename(tmp_path / "moved")  # metadata without the arrays
    with pytest.raises(ValueError, match="cannot read the stream state"):
        load_stream_state(path, model.init_cache, params)


def test_capacity_and_shape_errors_name_the_argument():
    model = build_model(ModelConfig(name="gdn", **SMALL), rngs=nnx.Rngs(0))
    apply_fn, params = stream_model(model)
    state = init_stream(model.init_cache, params, capacity=16)
    toks = _tokens(20)
    with pytest.raises(ValueError, match="holds 16 positions"):
        stream_tokens(apply_fn, params, state, toks[:, :-1], toks[:, 1:])
    with pytest.raises(ValueError, match="tokens, targets"):
        stream_tokens(apply_fn, params, state, toks[:, :5], toks[:, :4])
    with pytest.raises(ValueError, match="capacity"):
        init_stream(model.init_cache, params, capacity=0)
    with pytest.raises(ValueError, match="no CMS levels"):
        init_stream(model.init_cache, params, capacity=8, periods=(1, 4))


def test_a_kv_cache_stream_enlarged_mid_way_equals_one_forward():
    model = build_model(ModelConfig(name="transformer", **SMALL), rngs=nnx.Rngs(0))
    apply_fn, params = stream_model(model)
    toks = _tokens(50, seed=5)
    ref = _full_forward_ce(model, toks)
    state = init_stream(model.init_cache, params, capacity=20)
    ce_a, state = stream_tokens(apply_fn, params, state, toks[:, :20], toks[:, 1:21], chunk=8)
    with pytest.raises(ValueError, match="holds 20 positions"):
        stream_tokens(apply_fn, params, state, toks[:, 20:-1], toks[:, 21:], chunk=8)
    big = resize_stream(state, model.init_cache, 56)
    assert int(big.capacity) == 56 and big.cache.layers.k.shape[2] == 56
    np.testing.assert_array_equal(big.cache.layers.k[:, :, :20], state.cache.layers.k)
    ce_b, big = stream_tokens(apply_fn, params, big, toks[:, 20:-1], toks[:, 21:], chunk=8)
    assert int(big.pos) == 50
    np.testing.assert_allclose(jnp.concatenate([ce_a, ce_b], 1), ref, rtol=1e-5, atol=1e-5)
    assert resize_stream(big, model.init_cache, 56) is big
    with pytest.raises(ValueError, match="capacity: 40 is below the stream's 56 positions"):
        resize_stream(big, model.init_cache, 40)


def test_stream_capacity_defaults_leave_headroom_and_errors_name_the_flag():
    assert stream_capacity(0, needed=65) == 65
    assert stream_capacity(0, needed=65, save=True) == 65 + HEADROOM
    assert stream_capacity(0, needed=109, saved=65) == 109  # a continued stream grows
    # a saved stream keeps HEADROOM free positions after every call
    assert stream_capacity(0, needed=109, saved=65 + HEADROOM, save=True) == 109 + HEADROOM
    assert stream_capacity(200, needed=109, saved=150) == 200
    with pytest.raises(ValueError, match="raise --capacity to at least 109$"):
        stream_capacity(100, needed=109)
    with pytest.raises(ValueError, match="already holds 150; give at least 150"):
        stream_capacity(120, needed=109, saved=150)
    with pytest.raises(ValueError, match="--capacity: expected an int >= 0"):
        stream_capacity(-1, needed=10)


def test_pieces_cover_the_stream_on_the_absolute_grid():
    assert _pieces(0, 10, 4) == [(0, 2, 4), (8, 1, 2)]
    assert _pieces(6, 10, 4) == [(0, 1, 2), (2, 2, 4)]
    assert _pieces(5, 2, 4) == [(0, 1, 2)]
    for pos in range(9):
        for length in range(13):
            ps = _pieces(pos, length, 4)
            assert sum(n * s for _, n, s in ps) == length
            ends = [pos + st + n * s for st, n, s in ps[:-1]]
            assert all(e % 4 == 0 for e in ends)


def _cms_model(variant="sequential", periods=(2, 4)):
    from nested_jax.layers.options import CMSOptions

    cms = CMSOptions(periods=periods, variant=variant, hidden=16, mode="online")
    cfg = ModelConfig(name="gdn", ffn="cms", cms=cms, **SMALL)
    return build_model(cfg, rngs=nnx.Rngs(0))


def _level_leaves(fast, level):
    return {k: v for k, v in fast.items() if f"/levels/{level}/" in k}


@pytest.mark.slow  # ~75 s; tests/core/cms/test_cms.py checks the period boundaries of cms_online
def test_online_cms_levels_change_only_at_their_period_boundaries():
    model = _cms_model()
    apply_fn, params = stream_model(model)
    toks = _tokens(9, seed=1)
    state = init_stream(model.init_cache, params, capacity=16, periods=(2, 4))
    assert _level_leaves(state.fast, 0) and _level_leaves(state.fast, 1)
    changed = []  # (level-0 changed, level-1 changed) after each token
    for t in range(8):
        prev = state.fast
        _, state = stream_tokens(
            apply_fn, params, state, toks[:, t : t + 1], toks[:, t + 1 : t + 2],
            periods=(2, 4), lr=0.5,
        )  # fmt: skip
        changed.append(
            tuple(
                any(not np.array_equal(prev[k], state.fast[k]) for k in _level_leaves(prev, j))
                for j in (0, 1)
            )
        )
    # tokens consumed 1..8: level 0 (period 2) fires at 2, 4, 6, 8; level 1 (period 4) at 4, 8.
    assert changed == [(False, False), (True, False), (False, False), (True, True)] * 2


def test_online_cms_update_is_sgd_on_the_chunk_loss_and_resumes_across_calls():
    model = _cms_model(periods=(4, 8))
    apply_fn, params = stream_model(model)
    toks = _tokens(12, seed=2)
    state = init_stream(model.init_cache, params, capacity=16, periods=(4, 8))

    # One chunk of c = 4 tokens: level 0 steps by -lr * d(sum of the chunk's CE)/d(theta_0).
    def chunk_loss(fast):
        from nested_jax.eval.continual import _token_loss, _with_fast

        logits, _ = apply_fn(_with_fast(params, fast), jnp.asarray(toks[:, :4]), state.cache)
        return _token_loss(logits, jnp.asarray(toks[:, 1:5])).sum()

    grads = jax.grad(chunk_loss)(state.fast)
    _, after = stream_tokens(
        apply_fn, params, state, toks[:, :4], toks[:, 1:5], periods=(4, 8), lr=0.1
    )
    for k in _level_leaves(state.fast, 0):
        np.testing.assert_allclose(after.fast[k], state.fast[k] - 0.1 * grads[k], atol=1e-6)
    for k in _level_leaves(state.fast, 1):  # not at its boundary: accumulates only
        np.testing.assert_array_equal(after.fast[k], state.fast[k])
        np.testing.assert_allclose(after.accum[k], 0.1 * grads[k], atol=1e-6)

    # A stream split at a multiple of c equals one call.
    kw = dict(periods=(4, 8), lr=0.1)
    ce_one, one = stream_tokens(apply_fn, params, state, toks[:, :-1], toks[:, 1:], **kw)
    ce_a, mid = stream_tokens(apply_fn, params, state, toks[:, :4], toks[:, 1:5], **kw)
    ce_b, two = stream_tokens(apply_fn, params, mid, toks[:, 4:-1], toks[:, 5:], **kw)
    np.testing.assert_allclose(jnp.concatenate([ce_a, ce_b], 1), ce_one, rtol=1e-6, atol=1e-6)
    for k in one.fast:
        np.testing.assert_allclose(two.fast[k], one.fast[k], rtol=1e-6, atol=1e-7)


def test_online_cms_nested_resets_the_fast_level_to_the_slow_one():
    model = _cms_model(variant="nested", periods=(2, 4))
    apply_fn, params = stream_model(model)
    toks = _tokens(4, seed=4)
    state = init_stream(model.init_cache, params, capacity=8, periods=(2, 4))
    kw = dict(periods=(2, 4), lr=0.5, variant="nested")
    _, s2 = stream_tokens(apply_fn, params, state, toks[:, :2], toks[:, 1:3], **kw)
    _, s4 = stream_tokens(apply_fn, params, s2, toks[:, 2:4], toks[:, 3:5], **kw)
    for k in _level_leaves(state.fast, 0):
        slow = k.replace("/levels/0/", "/levels/1/")
        assert not np.array_equal(s2.fast[k], state.fast[k])  # level 1 learned at token 2
        np.testing.assert_array_equal(s2.fast[slow], state.fast[slow])  # level 2 not yet
        assert not np.array_equal(s4.fast[slow], state.fast[slow])  # level 2 stepped at 4 ...
        np.testing.assert_array_equal(s4.fast[k], s4.fast[slow])  # ... and level 1 reset to it
