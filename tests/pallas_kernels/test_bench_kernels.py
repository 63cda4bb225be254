"""``nested-jax bench kernels`` on CPU at a tiny size: interpret-mode errors, the AOT memory table
(libtpu's abstract v5e topology) and the JSON / text structure."""

from __future__ import annotations

import importlib.util
import json

import pytest

from nested_jax import cli
from nested_jax.bench import kernels
from nested_jax.bench.core import chunked_gdn_flops

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
TINY = ["--check-seq-len", "40", "--check-heads", "1", "--check-dim", "16", "--chunk", "16"]
AOT_TINY = ["--aot-seq-len", "256", "--aot-heads", "2", "--aot-dim", "128",
            "--aot-batch-per-chip", "1"]  # fmt: skip
F32_TOL = 1e-4  # the two paths differ in rounding only
BF16_TOL = 2e-2  # bf16 operands and bf16 o / dq / dk / dv: a few output ulps


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _check_errors(res: dict) -> None:
    names = ("o", "state", *kernels.GRAD_NAMES)
    for dtype, tol in (("float32", F32_TOL), ("bfloat16", BF16_TOL)):
        errs = [res[f"check_rel_err_{dtype}_{n}"] for n in names]
        assert all(0.0 <= e < tol for e in errs), (dtype, errs)
        assert res[f"check_max_rel_err_{dtype}"] == max(errs)


def test_cpu_mode_without_aot_prints_errors_and_json(capsys):
    assert cli.main(["bench", "kernels", "--no-aot", "--json", *TINY]) == 0
    out = capsys.readouterr().out
    res = _last_json(out)
    assert res["mode"] == "cpu" and res["backend"] == "cpu"
    assert res["aot_status"] == "skipped: --no-aot" and res["chunk"] == 16
    _check_errors(res)
    assert "[bench kernels] interpret check float32 T=40: max rel err o " in out


def test_the_check_sees_a_wrong_kernel(monkeypatch):
    """The error check is not vacuous: a perturbed Pallas output shows up as a large error."""
    real = kernels.gdn_fn

    def wrong(impl, chunk, interpret=False):
        f = real(impl, chunk, interpret)
        if impl != "pallas":
            return f
        return lambda q, k, v, g, beta: f(q, k, v * 1.01, g, beta)

    monkeypatch.setattr(kernels, "gdn_fn", wrong)
    errs = kernels.check_interpret(40, 1, 1, 16, 16, "float32")
    assert errs["o"] > 5e-3 and errs["dq"] > 5e-3 and errs["dg"] > 1e-3


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed: the AOT part needs it")
def test_cpu_mode_aot_table_for_v5e(capsys):
    argv = ["--json", *TINY, *AOT_TINY, "--topology", "v5e:2x2"]
    assert kernels.main(argv) == 0
    out = capsys.readouterr().out
    res = _last_json(out)
    assert res["aot_status"] == "ok" and res["aot_chips"] == 4 and res["aot_seq_len"] == 256
    for prog in kernels.PASSES:
        for impl in kernels.IMPLS:
            key = f"{impl}_{prog}"
            a, o, al, t = (
                res[f"aot_{n}_bytes_{key}"] for n in ("argument", "output", "alias", "temp")
            )
            assert a > 0 and o > 0 and t >= 0
            assert res[f"aot_peak_bytes_{key}"] == a + o - al + t
        assert res[f"aot_tpu_custom_call_pallas_{prog}"] is True  # Mosaic, not the interpreter
        # per chip: q, k, v bf16 [1, 256, 2, 128] + g, β f32 [1, 256, 2]
        assert res[f"aot_argument_bytes_pallas_{prog}"] == 3 * 256 * 2 * 128 * 2 + 2 * 256 * 2 * 4
    # The kernels' scoped VMEM comes from the compiled HLO (or the line says why not)
    for kernel in ("gated_delta_fwd", "gated_delta_bwd"):
        vmem = res.get(f"aot_vmem_bytes_pallas_fwdbwd_{kernel}")
        note = res.get(
            f"aot_vmem_note_pallas_fwdbwd_{kernel}", res.get("aot_vmem_note_pallas_fwdbwd")
        )
        assert (vmem is not None and 0 < vmem < 16 * 2**20) or note.startswith("unavailable")
    assert "[bench kernels] v5e:2x2 pallas_fwdbwd: temp " in out


def test_aot_part_skips_in_one_line_without_libtpu(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    res = kernels.run_aot("v5e:2x2", B_per_chip=1, T=64, H=1, D=16, chunk=16, dtype="bfloat16")
    assert res == {"aot_topology": "v5e:2x2", "aot_status": "skipped: libtpu not installed"}
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [
        "[bench kernels] AOT skipped: libtpu is not installed (pip install -e '.[tpu]')"
    ]


def test_scoped_vmem_reads_the_custom_call_line():
    hlo = (
        '  %gated_delta_bwd.1 = (f32[2]) custom-call(%a), custom_call_target="tpu_custom_call", '
        'backend_config={"custom_call_config":{"body":"x"},"used_scoped_memory_configs":'
        '[{"memory_space":"0","offset":"0","size":"7"},'
        '{"memory_space":"1","offset":"0","size":"1298432"}]}\n'
        '  %fusion.3 = f32[2] fusion(%b), backend_config={"used_scoped_memory_configs":'
        '[{"memory_space":"1","offset":"0","size":"999999999"}]}\n'
    )
    assert kernels.scoped_vmem(hlo, "gated_delta_bwd") == 1298432
    assert kernels.scoped_vmem(hlo, "gated_delta_fwd") is None


def test_peaks_flops_and_bytes():
    assert kernels.device_peak("TPU v5 lite") == (197e12, 819e9)
    assert kernels.device_peak("NVIDIA H200") == (989e12, 4.8e12)
    assert kernels.device_peak("cpu") is None
    # the forward alone (bench kernels' fwd pass) is a strict part of the fwd+bwd count
    both = chunked_gdn_flops(200, 2, 3, 64, 32, 64)
    assert 0 < chunked_gdn_flops(200, 2, 3, 64, 32, 64, backward=False) < both / 2
    # forward bytes at T=1, B=H=1, K=V=1, bf16: q, k, v, o 2 B each, g, β 4 B each, S_T 4 B
    assert kernels.gdn_bytes(1, 1, 1, 1, 1, 2, backward=False) == 4 * 2 + 2 * 4 + 4


def test_flags_are_validated():
    with pytest.raises(ValueError, match="--seq-lens"):
        kernels.main(["--seq-lens", "2048,x", "--no-aot"])
    with pytest.raises(ValueError, match="--check-seq-len must be positive"):
        kernels.main(["--check-seq-len", "0", "--no-aot"])


def test_cli_lists_the_bench():
    assert "kernels" in cli.BENCHES and "kernels" in cli.COMMANDS["bench"][1]


def test_device_mode_times_and_reports_the_roofline(monkeypatch, capsys):
    """Device mode's structure, run on the CPU: the Mosaic kernel does not compile here, which is
    reported per pass, and XLA is timed against a (stand-in) peak."""
    monkeypatch.setattr(kernels, "device_peak", lambda kind: (1e12, 1e11))
    argv = ["--mode", "device", "--seq-lens", "64", "--dims", "16", "--heads", "1"]
    assert kernels.main([*argv, "--chunk", "16", "--json"]) == 0
    out = capsys.readouterr().out
    res = _last_json(out)
    assert res["mode"] == "device" and res["peak_tflops"] == 1.0 and res["peak_gbps"] == 100.0
    for pas in kernels.PASSES:
        key = f"xla_{pas}_T64_D16"
        t = res[f"time_ms_{key}"] / 1e3
        flops = chunked_gdn_flops(64, 1, 1, 16, 16, 16, backward=pas == "fwdbwd")
        assert res[f"tflops_{key}"] == pytest.approx(flops / t / 1e12)
        assert res[f"pct_peak_flops_{key}"] == pytest.approx(100 * flops / t / 1e12)
        assert res[f"pct_peak_bw_{key}"] == pytest.approx(res[f"gbps_{key}"])  # 100 GB/s peak
        assert "interpret" in res[f"unavailable_pallas_{pas}_T64_D16"]
        assert f"pallas_over_xla_speedup_{pas}_T64_D16" not in res
    assert "[bench kernels] T64_D16 fwdbwd: xla " in out
