"""Two-language continual-learning experiment (nested_jax.experiments.forgetting; SPEC §3.3
online CMS)."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.experiments.forgetting import compare, experiments, main, summarize, verdict
from nested_jax.experiments.forgetting_stream import (
    Arm,
    StreamSettings,
    level_lrs,
    run_arm,
    sample_chain,
)

# The CLI's --quick settings: reusing them (and equal Arm objects) shares jit compilations.
QUICK = experiments(True, StreamSettings.lr, StreamSettings.seeds)[0][1]


def test_nested_with_summed_rates_is_the_one_level_model():
    # SPEC §3.3 "sum" reading: the slow level's update Σ η g_t equals the fast level's displacement
    # over its period, so every nested reset is a no-op and the stream is the one-level stream.
    # Different clock offsets (k1: 0, nested: random in [0, 4)) must not matter either.
    one = run_arm(QUICK, Arm("k1"), seed=0)
    nested = run_arm(QUICK, Arm("n", "nested", (1, 2, 4), "sum"), seed=0)
    np.testing.assert_allclose(nested["eval"], one["eval"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(nested["online"], one["online"], rtol=1e-4, atol=1e-5)
    # ... whereas mean rates make the slow levels slower, which changes the stream.
    mean = run_arm(QUICK, Arm("k3 nested mean", "nested", (1, 2, 4), "mean"), seed=0)
    assert np.max(np.abs(mean["eval"] - one["eval"])) > 1e-3


@pytest.mark.slow  # ~60 s on 2 cores (three pretraining + stream arms)
def test_pretraining_on_both_languages_lowers_the_initial_loss():
    pre = dataclasses.replace(QUICK, pretrain_steps=20, pretrain_lr=1e-2)
    one = run_arm(pre, Arm("k1"), seed=0)
    assert np.mean(one["init"]) < np.mean(run_arm(QUICK, Arm("k1"), seed=0)["init"]) - 0.3
    # nested pretrains its one output level and starts every level there: with summed rates it is
    # still the one-level stream
    nested = run_arm(pre, Arm("n", "nested", (1, 2, 4), "sum"), seed=0)
    np.testing.assert_allclose(nested["eval"], one["eval"], rtol=1e-4, atol=1e-5)


def test_summarize_definitions():
    # eval[p] = (loss_A, loss_B) after phase p; phases A, B, A, B.
    ev = np.array([[1.0, 5.0], [1.5, 2.0], [0.8, 2.6], [1.2, 1.0]])
    m = summarize({"eval": ev, "online": np.array([3.0, 2.0, 1.0, 2.0])})
    assert m["forget_A"] == pytest.approx(((1.5 - 1.0) + (1.2 - 0.8)) / 2)
    assert m["forget_B"] == pytest.approx(2.6 - 2.0)
    assert m["retain_A"] == pytest.approx((1.5 + 1.2) / 2)
    assert m["current"] == pytest.approx((1.0 + 2.0 + 0.8 + 1.0) / 4)
    assert m["both"] == pytest.approx(np.mean([(1.5 + 2.0) / 2, (0.8 + 2.6) / 2, (1.2 + 1.0) / 2]))
    assert m["online"] == pytest.approx(2.0)


def test_sample_chain_follows_the_transitions():
    perm = np.array([2, 0, 3, 1])
    trans = np.eye(4)[perm]  # deterministic: s → perm[s]
    seq = np.asarray(sample_chain(jnp.zeros(2, jnp.uint32), trans, 5, 9))
    assert seq.shape == (5, 9) and seq.dtype == np.int32
    np.testing.assert_array_equal(seq[:, 1:], perm[seq[:, :-1]])
    # a two-successor chain never leaves the support
    two = np.zeros((4, 4))
    two[np.arange(4), perm] = 0.5
    two[np.arange(4), (np.arange(4) + 1) % 4] += 0.5
    seq = np.asarray(sample_chain(jnp.array([0, 3], jnp.uint32), two, 8, 50))
    assert np.all(two[seq[:, :-1], seq[:, 1:]] > 0)
    with pytest.raises(ValueError, match="trans"):
        sample_chain(jnp.zeros(2, jnp.uint32), np.ones((3, 4)) / 4, 1, 3)


def test_level_rates_and_validation():
    assert level_lrs(Arm("a", "nested", (1, 4, 16), "sum"), 0.1) == (0.1, 0.1, 0.1)
    np.testing.assert_allclose(
        level_lrs(Arm("a", "nested", (1, 4, 16), "mean", lr_mult=0.5), 0.1),
        (0.05, 0.0125, 0.003125),
    )
    with pytest.raises(ValueError, match="lr_scaling"):
        Arm("a", lr_scaling="avg")
    with pytest.raises(ValueError, match="periods"):
        Arm("a", periods=(2, 4))
    with pytest.raises(ValueError, match="n_phases"):
        StreamSettings(n_phases=1)
    with pytest.raises(ValueError, match="inner"):
        StreamSettings(inner="adam")
    with pytest.raises(ValueError, match="arms"):
        compare(QUICK, [])


def test_cli_quick_writes_tables_and_learns(tmp_path):
    assert main(["--out", str(tmp_path), "--quick"]) == 0
    payload = json.loads((tmp_path / "forgetting.json").read_text())
    (res,) = payload["experiments"]
    k1, k3 = res["arms"]
    assert k1["arm"]["periods"] == [1] and k3["arm"]["variant"] == "nested"
    assert len(k1["per_seed"]) == 2 and not k1["diverged"]
    # the online updates really learn: the current language ends below the untrained loss
    assert k1["mean"]["current"] < np.mean(k1["init"]) - 0.2
    v = res["verdict"]
    assert v["holds"] == (v["forget_A_k3"] < v["forget_A_k1"])
    md = (tmp_path / "forgetting.md").read_text()
    assert "| k1 |" in md and "Acceptance claim" in md
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "forgetting.png").stat().st_size > 0
    except ImportError:
        assert "plot: skipped" in md and payload["plot"] is None


def test_verdict_rejects_a_multi_level_first_arm():
    res = {
        "arms": [
            {"arm": dataclasses.asdict(Arm("x", "nested", (1, 2), "mean")), "mean": {}, "sem": {}},
            {"arm": dataclasses.asdict(Arm("k1")), "mean": {}, "sem": {}},
        ]
    }
    with pytest.raises(ValueError, match="one-level"):
        verdict(res)


# ---------------------------------------------------------------------------------------------
# slow: the full-size results reported in docs/RESULTS.md (4 seeds × 8 streams)

FULL = StreamSettings()


@pytest.mark.slow
def test_acceptance_protocol_result_is_the_reported_one():
    # The protocol fixed before measuring (nested, mean rates, periods (1,16,128), phase 256 × 8).
    # Measured: the claim does NOT hold (three levels forget more, and learn far less). This pins
    # the reported numbers so that docs/RESULTS.md cannot silently disagree with the code.
    title, s, arms = experiments(False, StreamSettings.lr, StreamSettings.seeds)[0]
    assert s == FULL and "acceptance" in title
    res = compare(s, arms)
    v = verdict(res)
    k1, k3 = res["arms"]
    assert k1["mean"]["current"] < np.mean(k1["init"]) - 1.0  # the one-level model does learn
    assert v["forget_A_k1"] == pytest.approx(0.141, abs=0.02)
    assert v["forget_A_k3"] == pytest.approx(0.281, abs=0.03)
    assert v["holds"] is False
    assert k3["mean"]["current"] > k1["mean"]["current"] + 1.0  # and it learns far less


@pytest.mark.slow
def test_equal_rate_grid_findings_as_reported():
    # Same stream, SPEC "sum" rates (η_ℓ = η): independent (head-wise) levels forget less than
    # one level and also less than a one-level model at a third of the rate while ending lower
    # on the current language; sequential levels forget about three times more.
    arms = [
        Arm("k1"),
        Arm("k1 lr/3", "sequential", (1,), "sum", 1.0 / 3),
        Arm("k3 sequential sum (1, 16, 128)", "sequential", (1, 16, 128), "sum"),
        Arm("k3 independent sum (1, 16, 128)", "independent", (1, 16, 128), "sum"),
    ]
    m = {a["arm"]["name"]: a["mean"] for a in compare(FULL, arms)["arms"]}
    k1, k1_3 = m["k1"], m["k1 lr/3"]
    seq, ind = m["k3 sequential sum (1, 16, 128)"], m["k3 independent sum (1, 16, 128)"]
    assert ind["forget_A"] < k1["forget_A"] - 0.03
    assert ind["forget_A"] < k1_3["forget_A"] - 0.02 and ind["current"] < k1_3["current"]
    assert seq["forget_A"] > k1["forget_A"] + 0.2
