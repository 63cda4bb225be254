"""``nested-jax bench peers``: the comparison machinery on a stand-in peer, and the one-line reports
of peers that cannot be had (the real peers are not installed in CI: scripts/bench_peers_setup)."""

from __future__ import annotations

import json
import math

from nested_jax.bench import peers
from nested_jax.core.associative.forms import gated_delta_recurrent


def test_compare_shape_measures_a_peer_and_its_agreement():
    # our per-token scan stands in for a peer's chunked form: another algorithm, the same function
    stand_in = {"chunked": gated_delta_recurrent, "recurrent": gated_delta_recurrent}
    out = peers.compare_shape("other", stand_in, T=40, D=8, repeats=1, recurrent=True)
    assert out["other_max_err_T40_D8"] < 1e-5  # outputs, final state and all five gradients
    for key in ("forward", "fwd+bwd", "temps", "recurrent_fwd+bwd", "recurrent_temps"):
        value = out[f"other_{key}_T40_D8"]
        assert math.isfinite(value) and value > 0, key
    assert out["ours_gflops_T40_D8"] > 0 and out["ours_temp_mib_T40_D8"] > 0
    assert out["chunk_matmul_gflops_T40_D8"] > 0  # the chunk's matmul shapes alone
    table = peers.report(out, [40], [8], {"other": "ok", "gone": "not installed"})
    assert "| other | 40 | 8 |" in table and "| gone | – | – | not installed |" in table
    header, rule, row = table.splitlines()[:3]
    assert header.count("|") == rule.count("|") == row.count("|")  # every column filled


def test_max_err_sees_a_wrong_gradient():
    (q, k, v, g, beta), weights = peers.inputs(16, 4)
    _, grads = peers.forward_and_grad(gated_delta_recurrent, weights)
    good = grads(q, k, v, g, beta)
    assert peers.max_err(good, good) == 0.0
    bad = (*good[:-1], good[-1] * 1.01)
    assert 0.009 < peers.max_err(bad, good) < 0.011


def test_without_peers_it_says_why_in_one_line_each(tmp_path, capsys):
    argv = ["--peers-dir", str(tmp_path), "--seq-lens", "16", "--dims", "4", "--json"]
    assert peers.main(argv) == 2
    printed = capsys.readouterr().out
    assert "levanter: not installed in" in printed and "bench_peers_setup" in printed
    assert "maxtext: not installable here" in printed
    result = json.loads(printed.strip().splitlines()[-1])
    assert set(result["peers"]) == {"levanter", "maxtext"} and result["matmul_gflops"] > 0
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    assert peers.load_levanter(tmp_path, broken) == (
        None,
        f"failed to load {broken}: RuntimeError: boom",
    )


def test_a_peer_with_tpu_kernels_runs_its_xla_path_off_tpu():
    def with_flash(q, use_flash=True):
        return q

    def without(q):
        return q

    assert peers._xla_path(with_flash) == {"use_flash": False}  # the tests run on CPU
    assert peers._xla_path(without) == {}
