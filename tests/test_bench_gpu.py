"""`longfit bench gpu`: the harness end to end on the CPU (real worker processes), its rules and its FLOP counts."""

import json
import subprocess
import sys

import pytest

from longfit.bench.flops import peak_bf16_tflops
from longfit.plan.flops import attended_keys, step_flops
from longfit.bench.gpu import Row, _estimate, _skip_reason, device_slug
from longfit.bench.gpu_report import HEADER
from longfit.cli import main
from longfit.plan.shapes import model_shape


def run_gpu_bench(tmp_path, *argv) -> tuple[int, dict, str]:
    out = tmp_path / "results"
    # a loss chunk and MLP tiles small enough that llama-tiny's loss and MLP are really split at 128 tokens
    rc = main(["bench", "gpu", "--device", "cpu", "--lengths", "128", "--steps", "1", "--time-budget", "3000",
               "--out", str(out), "--set", "memory.loss_chunk=32", "--set", "memory.mlp_tiles=3", *argv])
    report = json.loads((out / "gpu_cpu.json").read_text())
    return rc, report, (out / "gpu_cpu.md").read_text()


def check_rows(report: dict, markdown: str, systems: set[str]) -> dict:
    rows = {(r["system"], r["length"]): r for r in report["rows"]}
    assert all(r["status"] == "ok" for r in report["rows"]), [r["detail"] for r in report["rows"]]
    assert {system for system, _ in rows} == systems
    plain = rows["plain", 128]
    for (system, length), r in rows.items():
        assert r["kernels"] == ["SDPA CPU flash"] and r["attention"] == "SDPA CPU flash"
        assert r["tokens_per_s"] == pytest.approx(length / r["step_s"])
        assert r["model_tflops"] == pytest.approx(r["model_flops"] / r["step_s"] / 1e12)
        assert "mfu" not in r  # no peak FLOP rate for a CPU
        if system == "plain":
            continue
        assert r["loss_chunk"] == 32 and r["mlp_tiles"] == 3
        assert r["hardware_flops"] > r["model_flops"] > 0  # recomputation: checkpointed layers, MLP tiles
        # measured against both plans: ratios of the numbers in the row
        assert r["peak_vs_analytic"] == pytest.approx(r["peak_bytes"] / r["planned_bytes"])
        assert r["peak_vs_traced"] == pytest.approx(r["peak_bytes"] / r["traced_bytes"])
        if length == 128:
            # the same weights and document: the techniques are exact (fp32 on the CPU)
            assert r["loss_diff"] == pytest.approx(abs(r["loss"] - plain["loss"])) and r["loss_diff"] < 1e-4
            assert r["time_vs_plain"] == pytest.approx(r["step_s"] / plain["step_s"])
            cells = [f"{r['peak_vs_analytic']:.3f}", f"{r['peak_vs_traced']:.3f}", f"{r['time_vs_plain']:.3f}",
                     f"{r['step_s']:.2f}", f"{r['loss']:.6f}"]
            assert any(all(c in line for c in cells) for line in markdown.splitlines()), cells
    return rows


@pytest.mark.slow  # 33 s; the default suite's 15 minutes (2026-11-27)
def test_cpu_smoke_full_fine_tuning(tmp_path):
    rc, report, markdown = run_gpu_bench(tmp_path, "--models", "llama-tiny:full", "--longest", "0")
    assert rc == 0
    rows = check_rows(report, markdown, {"plain", "longfit", "longfit-no-offload"})
    (offload,) = report["offload"]
    with_offload, without = rows["longfit", 128], rows["longfit-no-offload", 128]
    assert offload["added_s"] == pytest.approx(with_offload["step_s"] - without["step_s"])
    assert with_offload["offload"] and not without["offload"]
    # the row runs and traces the analytic plan's placement (a CPU plan has no device room: every input on the host)
    placement = with_offload["placement"]
    assert (placement["device"], placement["disk"]) == (0, 0) and placement["host"] > 0
    assert f"| {placement['device']} / {placement['host']} / 0 |" in markdown
    assert without["placement"] is None
    assert "| " + " | ".join(HEADER) + " |" in markdown
    assert f"Command: `{report['command']}`" in markdown and report["command"].startswith("longfit bench gpu --device cpu")
    device = report["device"]
    assert f"torch {device['torch']}, transformers {device['transformers']}" in markdown
    assert f"Date: {report['date']}" in markdown
    assert any(g["goal"].startswith("measured peak within 5% of the traced plan") for g in report["goals"])


@pytest.mark.slow
def test_cpu_smoke_lora_and_the_longest_row(tmp_path):
    rc, report, markdown = run_gpu_bench(tmp_path, "--models", "llama-tiny:lora", "--longest", "1")
    assert rc == 0
    rows = check_rows(report, markdown, {"plain", "longfit", "longfit-no-offload"})
    longest = rows["longfit", 256]
    assert longest["longest"] and "longfit, all techniques (longest)" in markdown
    assert rows["longfit", 128]["model_flops"] < longest["model_flops"]


def test_cuda_without_a_gpu_is_an_error_naming_the_cpu_smoke_test(tmp_path, capsys):
    assert main(["bench", "gpu", "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "longfit: error: --device cuda: the device could not be used" in err and "--device cpu" in err
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("argv, message", [
    (["--models", "llama-tiny"], "MODEL:full or MODEL:lora"),
    (["--lengths", "32k"], "--lengths"),
    (["--set", "memory.tiled_mlp=false"], "set by the benchmark"),
    (["--set", "lora.r"], "KEY=VALUE"),
    (["--steps", "0"], "--steps"),
    (["--time-budget", "0"], "--time-budget"),
    (["--systems", "longfit,fast"], "--systems"),
])
def test_bad_flags_name_the_fix(argv, message, capsys, tmp_path):
    assert main(["bench", "gpu", "--device", "cpu", *argv, "--out", str(tmp_path / "never")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_rows_beyond_the_budget_or_a_shorter_oom_are_skipped():
    import argparse

    args = argparse.Namespace(device="cuda", steps=1, overrides=[])
    row = Row("llama-3.2-1b", "full", "longfit", 65536)
    flops = step_flops(model_shape("llama-3.2-1b"), 65536, checkpointed=True, mlp_tiles=16).hardware
    rate = 300e12
    expected = 25.0 + 2 * flops / rate  # set-up plus warm-up and one timed step at the rate measured before
    assert _estimate(row, args, {"llama-3.2-1b": 25.0}, {("llama-3.2-1b", "longfit"): rate}, 989.4) == pytest.approx(expected)
    assert _estimate(row, args, {}, {}, None) is None  # nothing measured, no peak: run it
    assert _skip_reason(row, {}, expected, expected + 1) is None
    assert _skip_reason(row, {}, None, 0.0) == "not run: the time budget is spent"
    assert "would take about" in _skip_reason(row, {}, expected, expected - 1)
    assert _skip_reason(row, {("llama-3.2-1b", "full", "longfit"): 32768}, None, 1e9) == "not run: out of memory at L=32768"
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_flops_follow_their_definition():
    shape = model_shape("llama-3.2-1b")
    L, layers, d = 4096, shape.layers, shape.q_dim
    weights = sum(i * o for i, o in shape.linear_shapes().values())
    mlp = sum(i * o for name, (i, o) in shape.linear_shapes().items() if name in ("gate_proj", "up_proj", "down_proj"))
    attention = 2 * d * L * (L + 1)  # 4 d per (query, key) pair, L (L + 1) / 2 causal pairs, forward
    full = step_flops(shape, L, checkpointed=False)
    assert full.model == full.hardware == pytest.approx(6 * (layers * weights + shape.vocab * shape.hidden) * L + 3 * layers * attention)
    tiled = step_flops(shape, L, checkpointed=True, mlp_tiles=4)
    assert tiled.hardware - tiled.model == pytest.approx(layers * (2 * weights * L + attention) + layers * 0.75 * 2 * mlp * L)
    lora = step_flops(shape, L, ("q_proj", "v_proj"), 8, checkpointed=False)
    adapters = 8 * (shape.linear_shapes()["q_proj"][0] + shape.linear_shapes()["q_proj"][1] + sum(shape.linear_shapes()["v_proj"]))
    assert lora.model == pytest.approx(4 * (layers * weights + shape.vocab * shape.hidden) * L + 6 * layers * adapters * L
                                       + 3 * layers * attention)
    assert attended_keys(10, 4) == 1 + 2 + 3 + 4 * 7 and attended_keys(10, None) == 55
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4 and peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and peak_bf16_tflops("Some New GPU") is None


def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom longfit.cli import main\n"
        "try:\n    main(['bench', 'gpu', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--time-budget" in proc.stdout


def test_a_row_killed_at_the_budget_names_the_last_phase_its_worker_reached(monkeypatch):
    """Issue #33: the first H200 run killed llama-3.1-8b LoRA at 32K after 67 s and said nothing of where it was."""
    from longfit.bench import gpu as bench_gpu

    def killed(*args, timeout, **kwargs):
        raise subprocess.TimeoutExpired("worker", timeout, stderr=b"warning\nlongfit-bench: model built in 41 s\n"
                                        b"longfit-bench: set up in 44 s, warm-up step started\nanother line\n")

    monkeypatch.setattr(bench_gpu, "run_in_fresh_process", killed)
    status, result, detail = bench_gpu.run_worker("measure", {}, 67.0)
    assert (status, result) == ("killed", {})
    assert detail == "stopped after 67 s: the time budget ran out (set up in 44 s, warm-up step started)"
