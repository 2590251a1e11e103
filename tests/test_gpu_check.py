"""benchmarks/gpu_check.sh, the prepared GPU check (issues #33, #46), run on the CPU as a smoke test of its harness:
every step runs under its own limit, the summary names each, and $OUT holds what a device run brings back; nothing
is written into the repository."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LONG_STEPS = ("env", "kernels", "attention", "long")
SHORT_STEPS = ("env", "kernels", "training", "prefetch", "bench32k")


def tracked_results() -> str:
    """The state of benchmarks/results in git (tracked changes and untracked files): a check must leave it as it was."""
    return subprocess.run(["git", "status", "--porcelain", "--", "benchmarks/results"], cwd=ROOT, capture_output=True,
                          text=True).stdout


@pytest.mark.slow  # every step for real: about 200 s on a loaded 2-core machine
def test_the_long_check_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    before = tracked_results()
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp_path),
               OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout[-3000:]
    assert [line.split(":")[0] for line in summary.splitlines()] == [*LONG_STEPS, "total"]
    assert all(": pass, " in line for line in summary.splitlines()[:-1]), summary
    files = sorted(p.name for p in out.iterdir())
    assert files == ["attention_cpu.md", "gpu_check.tar.gz", "gpu_check_long.md", "pytest_kernels.xml", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        names = set(archive.getnames())
        versions = archive.extractfile("gpu_check/env.log").read().decode()
        rows = json.loads(archive.extractfile("gpu_check/long/gpu_cpu.json").read())["rows"]
    assert {f"gpu_check/{step}.log" for step in LONG_STEPS} <= names and "gpu_check/long/gpu_cpu.json" in names
    assert "flash-linear-attention" in versions and "allocator:" in versions
    table = (out / "gpu_check_long.md").read_text()
    for row in ("| llama-tiny | LoRA | longfit, attention kept | 128 | ",
                "| llama-tiny | LoRA | longfit, attention recomputed | 128 | ",
                "| llama-tiny | full | longfit without offload | 128 | n/a |",
                "| llama-tiny | full | longfit, layer inputs in host memory | 128 | 0 / "):
        assert row in table, row
    assert "| longfit capped block kernel | 128 | 50 |" in (out / "attention_cpu.md").read_text()
    # #53: the pair side by side, each with its choice and what the offload store moved per step
    assert "| llama-tiny | LoRA | 128 | " in table.split("What keeping attention through the recompute changes")[1]
    kept, recomputed = (next(line for line in table.splitlines() if line.startswith(f"| llama-tiny | LoRA | {label} "))
                        for label in ("longfit, attention kept", "longfit, attention recomputed"))
    assert "| yes | " in kept and "| no | " in recomputed
    pair = {r["system"]: r for r in rows if r["system"] in ("longfit-kept", "longfit-recomputed")}
    assert pair["longfit-kept"]["keep_attention"] and not pair["longfit-recomputed"]["keep_attention"]
    # what MFU and HFU divide by the step time (on CUDA, by the device's peak too; n/a on the CPU): the same model
    # FLOPs, and the kept row's hardware FLOPs without attention's second forward
    assert pair["longfit-kept"]["model_flops"] == pair["longfit-recomputed"]["model_flops"] > 0
    assert pair["longfit-kept"]["model_flops"] < pair["longfit-kept"]["hardware_flops"]
    assert pair["longfit-kept"]["hardware_flops"] < pair["longfit-recomputed"]["hardware_flops"]
    assert "| MFU kept / recomputed | HFU kept / recomputed |" in table and "| n/a / n/a | n/a / n/a |" in table
    # llama-tiny's items at 128 tokens are below the store's 1 MiB least size: they stay put, nothing is moved
    assert pair["longfit-kept"]["host_bytes_moved"] == pair["longfit-recomputed"]["host_bytes_moved"] == 0
    assert tracked_results() == before


FAKE_PYTHON = """#!/usr/bin/env bash
# records its arguments; makes the files that pytest's junit xml, the bench's and the attention benchmark's --out hold
echo "$*" >>"$CALLS"
prev=""
for a in "$@"; do
  case "$a" in --junitxml=*) echo "<testsuites/>" >"${a#--junitxml=}" ;; esac
  if [ "$prev" = --out ]; then
    mkdir -p "$a" && echo "| row |" >"$a/gpu_cpu.md" && echo "{}" >"$a/gpu_cpu.json" && echo "| k |" >"$a/attention_cpu.md"
  fi
  prev=$a
done
"""


def run_with_stub(tmp_path, *args) -> tuple[str, list[str], list[str]]:
    """gpu_check.sh with a stub Python recording its arguments (a second): (summary, calls, files in $OUT)."""
    out, calls, fake = tmp_path / "out", tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), CALLS=str(calls), TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout[-3000:] + done.stderr[-3000:]
    return summary, calls.read_text().splitlines(), sorted(p.name for p in out.iterdir())


def test_the_long_check_runs_the_issue_46_tests_the_kernels_and_the_long_rows_in_order(tmp_path):
    """On CUDA (its harness: the stub Python): the 8B LoRA rows at 131,072 first (attention kept and recomputed, #53;
    then as the trainer runs it), the 1B pair, the 8B at 262,144 last, one bench run (each row's estimate from the
    earlier rows' rates), its budget what is left of 570 s."""
    before = tracked_results()
    summary, calls, files = run_with_stub(tmp_path)
    assert [line.split(":")[0] for line in summary.splitlines()] == [*LONG_STEPS, "total"]
    assert int(summary.splitlines()[-1].split()[1]) < 30
    assert files == ["attention_cpu.md", "gpu_check.tar.gz", "gpu_check_long.md", "pytest_kernels.xml", "summary.txt"]
    env, kernels, attention, long = calls
    assert "-m gpu tests/test_gpu_hybrid.py tests/test_host_sync.py tests/test_gpu_families_attention.py" in kernels
    assert "-m longfit.bench.gpu_attention --device cuda --length 131072 --capped-length 16384" in attention
    assert ("--rows llama-3.1-8b:lora:longfit-kept:131072,llama-3.1-8b:lora:longfit-recomputed:131072,"
            "llama-3.1-8b:lora:longfit:131072,llama-3.2-1b:full:longfit-no-offload:131072,"
            "llama-3.2-1b:full:longfit-host:131072,llama-3.1-8b:lora:longfit:262144") in long
    budget = int(long.split("--time-budget ")[1].split()[0])
    assert 500 <= budget <= 550, long  # 570 s less a 20 s margin, the stub's steps taking no time
    assert tracked_results() == before


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_short_check_runs_its_five_steps_in_order(tmp_path, device):
    args = ["--short"] + (["--device", "cpu"] if device == "cpu" else [])
    summary, calls, files = run_with_stub(tmp_path, *args)
    assert [line.split(":")[0] for line in summary.splitlines()] == [*SHORT_STEPS, "total"]
    assert files == ["gpu_check.tar.gz", "gpu_check_bench32k.md", "pytest_kernels.xml", "pytest_training.xml",
                     "summary.txt"]
    env, kernels, training, prefetch, bench = calls
    if device == "cuda":
        assert "tests/test_gpu_attention.py tests/test_gpu_memory.py" in kernels
        assert "--models llama-3.2-1b:full,llama-3.1-8b:lora --lengths 32768 --systems longfit,longfit-no-offload,plain" in bench
    assert prefetch.endswith(f"offload_prefetch_memory.py --device {device}" + (" --mib 1 --layers 3" if device == "cpu" else ""))
