"""`longfit bench gpu --rows` and its longfit-host system (issue 46): the rows in their order, what each runs, the
offload goal, and the attention kernels' benchmark harness. Decisions and derived numbers only (no worker process
but the attention harness's few milliseconds); tests/test_gpu_check.py runs them end to end on the CPU (slow)."""

from __future__ import annotations

import argparse

import pytest

from longfit.bench.gpu import Outcome, Row, _listed_rows, _parse_rows, _spec, _validate, row_overrides
from longfit.bench.gpu_report import derive, markdown_report
from longfit.cli import main

ROWS = ("llama-3.1-8b:lora:longfit:131072,llama-3.2-1b:full:longfit-no-offload:131072,"
        "llama-3.2-1b:full:longfit-host:131072,llama-3.1-8b:lora:longfit:262144")


def bench_args(**given) -> argparse.Namespace:
    values = dict(device="cuda", models="llama-tiny:full", lengths="128", systems="longfit", rows=None, longest=3,
                  steps=1, time_budget=60.0, overrides=[], seed=0)
    return argparse.Namespace(**(values | given))


def test_rows_run_in_their_order_without_doublings():
    args = bench_args(rows=ROWS)
    _validate(args)
    assert _listed_rows(args) == [Row("llama-3.1-8b", "lora", "longfit", 131072),
                                  Row("llama-3.2-1b", "full", "longfit-no-offload", 131072),
                                  Row("llama-3.2-1b", "full", "longfit-host", 131072),
                                  Row("llama-3.1-8b", "lora", "longfit", 262144)]
    assert args.longest == 0 and args.model_list == [("llama-3.1-8b", "lora"), ("llama-3.2-1b", "full")]


def test_a_longfit_host_row_runs_the_offload_store_planned_for_no_room_on_the_gpu():
    args = bench_args()
    host, plain_longfit, without = (Row("llama-tiny", "full", system, 128)
                                    for system in ("longfit-host", "longfit", "longfit-no-offload"))
    assert "memory.offload_activations=true" in row_overrides(host, args)
    assert "memory.offload_activations=false" in row_overrides(without, args)
    assert _spec(host, args)["inputs_on_host"] and _spec(host, args)["system"] == "longfit"
    assert not _spec(plain_longfit, args)["inputs_on_host"]


@pytest.mark.parametrize("rows", ["llama-tiny:full:longfit", "llama-tiny:half:longfit:128", "llama-tiny:full:fast:128",
                                  "llama-tiny:full:longfit:32k", ","])
def test_bad_rows_name_the_fix(rows, capsys, tmp_path):
    assert main(["bench", "gpu", "--device", "cpu", "--rows", rows, "--out", str(tmp_path / "never")]) == 2
    assert "--rows" in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_the_report_shows_each_rows_placement_and_the_offload_goal():
    """The 1B pair: offload with every input on the host adds 12% of the step (the goal: at most 10%); the 8B row at
    131,072 its placement (32 inputs on the GPU) in the table, and its MFU against the 40% goal."""
    def ok(row: Row, step_s: float, placement: dict | None) -> Outcome:
        return Outcome(row, "ok", result=dict(step_s=step_s, peak_bytes=2**34, planned_bytes=2**34, loss=1.0,
                                              kernels=["SDPA cuDNN"], model_flops=2e16, hardware_flops=3e16,
                                              placement=placement))

    outcomes = [ok(Row("llama-3.1-8b", "lora", "longfit", 131072), 50.0,
                   dict(device=32, host=0, disk=0, slot_bytes=2**30)),
                ok(Row("llama-3.2-1b", "full", "longfit-no-offload", 131072), 20.0, None),
                ok(Row("llama-3.2-1b", "full", "longfit-host", 131072), 22.4, dict(device=0, host=16, disk=0,
                                                                                  slot_bytes=2**30)),
                Outcome(Row("llama-3.1-8b", "lora", "longfit", 262144), "skipped",
                        "not run: would take about 510 s, 150 s of the budget left")]
    report = derive(outcomes, dict(device_type="cuda", device_name="NVIDIA H200"))
    goals = {g["goal"]: g for g in report["goals"]}
    offload = next(g for text, g in goals.items() if text.startswith("the offload store adds <= 10%"))
    assert offload["value"] == "+12.0%" and not offload["met"] and "0 / 16 / 0" in next(
        text for text in goals if text.startswith("the offload store"))
    mfu = goals["model MFU >= 40%: llama-3.1-8b lora at 131072"]
    assert mfu["value"] == f"{2e16 / 50.0 / 1e12 / 989.4:.1%}"
    report.update(command="longfit bench gpu --rows ...", date="today", time_budget_s=480, elapsed_s=400,
                  device=dict(device_type="cuda", device_name="NVIDIA H200", total_bytes=150e9, cuda="13.0", cudnn=91900,
                              torch="2.11", transformers="5.17"))
    text = markdown_report(report)
    assert "| llama-3.1-8b | LoRA | longfit, all techniques | 131072 | 32 / 0 / 0 |" in text
    assert "| llama-3.2-1b | full | longfit, layer inputs in host memory | 131072 | 0 / 16 / 0 |" in text
    assert "would take about 510 s" in text


def test_the_attention_benchmark_times_each_kernel_on_the_cpu(tmp_path):
    """`python -m longfit.bench.gpu_attention --device cpu`: the default kernel and the capped block kernel, each row
    timed, its FLOPs those of causal attention's forward and backward."""
    import json

    from longfit.bench import gpu_attention

    assert gpu_attention.attention_flops(4, 2, 8) == 3.5 * 4 * 8 * 2 * 10
    assert gpu_attention.main(["--device", "cpu", "--length", "64", "--capped-length", "32", "--heads", "2",
                               "--kv-heads", "1", "--head-dim", "8", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "attention_cpu.json").read_text())
    assert [(r["kernel"], r["length"], r["capped"]) for r in report["rows"]] == [
        ("longfit causal_attention (SDPA's choice)", 64, False), ("longfit capped block kernel", 32, True)]
    assert all(r["seconds"] > 0 and r["tflops"] > 0 for r in report["rows"])
    assert "| longfit capped block kernel | 32 | 50 |" in (tmp_path / "attention_cpu.md").read_text()


def test_the_kept_and_recomputed_rows_force_attention_and_count_their_flops():
    """#53: the pair runs whole layers with memory.keep_attention forced on and off; the kept row's hardware FLOPs
    leave out attention's second forward (the recomputed row's and plain's keep it), its model FLOPs the same."""
    from longfit.bench.gpu import row_flops

    args = bench_args()
    kept, recomputed, plain = (Row("llama-3.1-8b", "full", system, 131072)  # full: no LoRA count on the meta model
                               for system in ("longfit-kept", "longfit-recomputed", "plain"))
    assert {"memory.tiled_layers=false", "memory.keep_attention=true"} <= set(row_overrides(kept, args))
    assert {"memory.tiled_layers=false", "memory.keep_attention=false"} <= set(row_overrides(recomputed, args))
    assert _spec(kept, args)["system"] == "longfit"
    with_it, without, transformers = row_flops(kept, args), row_flops(recomputed, args), row_flops(plain, args)
    assert with_it.model == without.model == transformers.model
    # 32 layers of causal attention's forward at 131,072 tokens: 4 x 4096 x L (L + 1) / 2 each
    assert without.hardware - with_it.hardware == pytest.approx(32 * 4 * 4096 * 131072 * 131073 / 2)
    assert transformers.hardware > with_it.hardware


def test_the_report_sets_kept_attention_beside_recomputed():
    def ok(system: str, step_s: float, keep: bool, moved: int) -> Outcome:
        return Outcome(Row("llama-3.1-8b", "lora", system, 131072), "ok", result=dict(
            step_s=step_s, peak_bytes=2**35, planned_bytes=2**35, loss=1.0, kernels=["SDPA flash"], model_flops=2e16,
            hardware_flops=2.5e16 if keep else 3e16, placement=dict(device=0, host=32, disk=0, slot_bytes=2**30),
            keep_attention=keep, tiled_layers=False, host_bytes_moved=moved))

    report = derive([ok("longfit-kept", 40.0, True, 2**37), ok("longfit-recomputed", 50.0, False, 2**36)],
                    dict(device_type="cuda", device_name="NVIDIA H200"))
    (pair,) = report["kept_attention"]
    assert pair["time_ratio"] == 0.8
    goals = {g["goal"]: g for g in report["goals"]}
    assert goals["model MFU >= 40%: llama-3.1-8b lora at 131072 (longfit, attention kept)"]["value"] == (
        f"{2e16 / 40.0 / 1e12 / 989.4:.1%}")
    report.update(command="longfit bench gpu --rows ...", date="today", time_budget_s=480, elapsed_s=400,
                  device=dict(device_type="cuda", device_name="NVIDIA H200", total_bytes=150e9, cuda="13.0", cudnn=91900,
                              torch="2.11", transformers="5.17"))
    text = markdown_report(report)
    assert "| llama-3.1-8b | LoRA | longfit, attention kept | 131072 | 0 / 32 / 0 |" in text
    assert "| SDPA flash | yes | 128.00 |" in text and "| SDPA flash | no | 64.00 |" in text
    assert "| llama-3.1-8b | LoRA | 131072 | 40.00 / 50.00 | 0.800 |" in text and "| 128.00 / 64.00 |" in text
