"""`longfit plan` on the command line: tables, JSON, --max-context, --plot, errors, no torch for --help."""

import json
import re
import subprocess
import sys

import pytest

from longfit.cli import main


def run_plan(argv: list[str]) -> int:
    return main(["plan", *argv])


@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_plan_usage_from_the_issue(capsys):
    assert run_plan(["model=llama-3.1-8b", "seq_len=131072", "parallel.cp=8", "--gpu", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    for word in (
        "weights",
        "gradients",
        "optimizer state",
        "activations",
        "working set",
        "communication",
        "reserve",
        "dominant term",
        "fits",
        "longest seq_len",
    ):
        assert word in out
    assert "8 GPU(s): dp_shard 1 x cp 8 (ring)" in out


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_plan_json_has_peak_and_max_seq_len(capsys):
    assert run_plan(["model=llama-3.1-8b", "seq_len=65536", "--gpus", "2,8", "--gpu-mem", "80GiB", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert [p["gpus"] for p in plans] == [2, 8]
    assert plans[1]["peak_bytes"] < plans[0]["peak_bytes"]
    assert all(isinstance(p["max_seq_len"], (int, type(None))) for p in plans)
    assert sum(plans[0]["breakdown"].values()) == plans[0]["peak_bytes"]


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_an_explicit_disk_bounds_the_suggested_offload_dir(capsys):
    base = ["model=llama-3.1-8b", "seq_len=1048576", "lora.enabled=true", "memory.offload_activations=true",
            "--gpu", "h100-80gb", "--host-mem", "64GiB"]
    assert run_plan([*base, "--disk", "1TiB"]) == 0
    assert "Set memory.offload_dir=PATH" in capsys.readouterr().out
    assert run_plan([*base, "--disk", "10GiB"]) == 0  # the inputs need far more than 10 GiB of disk
    assert "offload_dir" not in capsys.readouterr().out


@pytest.mark.slow  # every strategy's layer traces: minutes on a cold trace cache
def test_max_context_table_and_json(capsys):
    args = ["model=llama-3.1-8b", "--gpu", "a40-48gb", "--max-context", "--gpus", "1,2,4,8", "--host-mem", "128GiB",
            "--disk", "1TiB"]
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "FSDP + ring CP" in out and "FSDP + Ulysses, LoRA + offload" in out
    assert "FSDP shards only the model states" in out
    assert run_plan(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ring = data["strategies"]["FSDP + ring CP, LoRA"]
    assert ring["8"]["max_seq_len"] > ring["1"]["max_seq_len"] > 0
    assert ring["8"]["peak_bytes"] <= data["capacity_bytes"]


@pytest.mark.slow  # a curve per strategy: their layer traces take minutes on a cold trace cache
def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "peak.png"
    assert run_plan(["model=llama-3.2-1b", "--gpu", "h100-80gb", "--gpus", "4", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a curve per strategy: their layer traces take minutes on a cold trace cache
@pytest.mark.parametrize("lora", [False, True])
def test_plot_draws_what_the_config_trains(lora, tmp_path, monkeypatch, capsys):
    import longfit.plan.report as report

    drawn = {}
    monkeypatch.setattr(report, "plot", lambda curves, capacity, title, path: drawn.update(curves=curves, title=title))
    argv = ["model=llama-3.2-1b", f"lora.enabled={str(lora).lower()}", "--gpu", "h100-80gb", "--gpus", "4",
            "--plot", str(tmp_path / "peak.png")]
    assert run_plan(argv) == 0
    assert drawn["curves"] and all(name.endswith(", LoRA") == lora for name in drawn["curves"]), list(drawn["curves"])
    assert ("LoRA" if lora else "full fine-tuning") in drawn["title"]


def test_list_presets(capsys):
    assert run_plan(["--list-presets"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-8b" in out and "8.03B" in out and "h200-141gb" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["model=llama-3.1-8b", "--max-context"], "--max-context needs"),
        (["model=llama-3.1-8b", "--gpu", "rtx-1"], "not a preset"),
        (["model=llama-3.1-8b", "--gpu-mem", "lots"], "--gpu-mem"),
        (["model=llama-3.1-8b", "--gpus", "0"], "--gpus"),
        (["model=no-such-model"], "neither a preset"),
        (["seq_len=1000", "parallel.cp=8", "--gpus", "8"], "divisible"),
        (["model=llama-60m", "parallel.tp=2", "memory.tiled_layers=true", "--gpus", "2"],
         "memory.tiled_layers=true does not compose with tensor parallelism"),
    ],
)
def test_errors_name_the_fix(args, message, capsys):
    assert run_plan(args) == 2
    assert message in capsys.readouterr().err


def test_help_imports_no_torch():
    """`longfit plan --help` is instant; a plan imports torch where it traces a layer (plan/layer_trace.py)."""
    code = (
        "import sys\n"
        "from longfit.cli import main\n"
        "try:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "usage: longfit plan" in done.stdout


def test_longfit_cli_dispatches_plan(capsys):
    from longfit.cli import main

    assert main(["plan", "model=llama-60m", "seq_len=4096"]) == 0
    assert "llama-60m" in capsys.readouterr().out


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_overrides_may_follow_options(capsys):
    assert run_plan(["--gpu", "a40-48gb", "model=llama-3.1-8b", "--gpus", "8", "seq_len=131072",
                     "memory.chunked_loss=false", "memory.offload_activations=false"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "Set " in out and "full logits" in out


# ---- the machine planned for, the table's rows and unit, a CPU run ---------------------------------------


@pytest.mark.parametrize("gpu, host, machine", [
    ("h100-80gb", 2 << 40, "DGX H100 node: 2 TiB host memory and 30.7 TB NVMe for 8 GPUs (NVIDIA DGX H100 datasheet"),
    ("h200-141gb", 2 << 40, "DGX H200 node"),
    ("a40-48gb", None, "GPU memory only: --gpu a40-48gb names no typical machine"),
])
@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_a_named_gpu_is_planned_on_its_typical_machine_not_this_one(gpu, host, machine, capsys):
    args = ["model=llama-3.1-8b", "seq_len=131072", "parallel.cp=8", "memory.offload_activations=true", "--gpu", gpu]
    assert run_plan(args) == 0
    assert machine in capsys.readouterr().out
    assert run_plan([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert machine in data["machine"] and data["plans"][0]["host_capacity_bytes"] == host
    disk = data["plans"][0]["disk_capacity_bytes"]
    assert disk is None  # no memory.offload_dir: the disk bounds nothing
    assert run_plan([*args, "--host-mem", "64GiB", "--json"]) == 0  # given: that machine, whatever the GPU
    assert json.loads(capsys.readouterr().out)["plans"][0]["host_capacity_bytes"] == 64 << 30


def table_rows(out: str) -> dict[str, list[str]]:
    """The --max-context table printed: {row name: its cells}."""
    table = out.split("  GPUs\n", 1)[1].split("\n\n", 1)[0]
    return {name: cells for name, *cells in (re.split(r"\s{2,}", line.strip()) for line in table.splitlines())}


@pytest.mark.slow  # every strategy's layer traces: minutes on a cold trace cache
def test_max_context_shows_the_best_variant_per_family_in_one_unit():
    from longfit.config import load_config
    from longfit.plan.gpus import GPU_NODES, GPU_PRESETS
    from longfit.plan.report import max_context_text
    from longfit.plan.search import family_of, max_context_table

    node, counts = GPU_NODES["h100-80gb"], [1, 8]
    table = max_context_table(load_config(None, ["model=llama-3.1-8b"]), counts, GPU_PRESETS["h100-80gb"][0],
                              host_capacity=node.host_bytes, disk_capacity=node.disk_bytes)
    families = {family_of(name) for name in table}
    exact = {name: row for name, row in table.items() if not name.endswith(" fp8")}  # fp8 layer inputs: lossy
    best = table_rows(max_context_text(table, counts))
    assert {family_of(name) for name in best} == families and len(best) == len(families)
    for name, cells in best.items():  # each shown row reaches furthest of its family on 8 GPUs, exactly
        reach = table[name][8][0] or 0
        assert reach == max(row[8][0] or 0 for other, row in exact.items() if family_of(other) == family_of(name))
        assert all(cell == "-" or re.fullmatch(r"[\d,]+K\*?", cell) for cell in cells), cells
        assert cells[1].rstrip("*") == (f"{reach // 1024:,}K" if reach else "-")
    assert set(table_rows(max_context_text(table, counts, every_row=True))) == set(table)


@pytest.mark.slow  # every strategy's layer traces: minutes on a cold trace cache
def test_max_context_all_prints_every_row(capsys):
    from longfit.plan.search import STRATEGIES

    assert run_plan(["model=llama-3.1-8b", "--gpu", "h100-80gb", "--max-context", "--gpus", "8", "--all"]) == 0
    assert set(table_rows(capsys.readouterr().out)) == {s.name for s in STRATEGIES}


def test_a_cpu_run_is_planned_as_one(capsys):
    assert run_plan(["model=llama-tiny", "seq_len=4096", "train.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "CPU, 1 rank(s): dp_shard 1 x cp 1, full fine-tuning, fp32" in out and "per-rank peak (host memory)" in out
    assert "GPU" not in out.split("host memory and disk of this machine")[0] and "autocast" not in out


@pytest.mark.parametrize("args, message", [
    (["model=llama-3.1-8b", "--gpu", "h100-80gb", "--all"], "--all chooses the rows of the --max-context table"),
    (["model=llama-tiny", "train.device=cpu", "--gpu", "h100-80gb"], "train.device=cpu trains on the CPU"),
])
def test_plan_option_conflicts_name_the_fix(args, message, capsys):
    assert run_plan(args) == 2
    assert message in capsys.readouterr().err
