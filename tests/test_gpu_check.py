"""benchmarks/gpu_check.sh, the prepared GPU check (issue #33), run on the CPU as a smoke test of its harness:
every step runs under its own limit, the summary names each, and $OUT holds what a device run brings back."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("env", "kernels", "training", "prefetch", "bench32k", "bench128k", "bench512k")


@pytest.mark.slow  # every step for real: 116 s on an idle 2-core machine, 190 s loaded
def test_the_gpu_check_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp_path), RESULTS=str(tmp_path / "results"),
               OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout[-3000:]
    assert [line.split(":")[0] for line in summary.splitlines()] == [*STEPS, "total"]
    assert all(": pass, " in line for line in summary.splitlines()[:-1]), summary
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir())  # a device run brings back 8 files
    assert files == ["gpu_check.tar.gz", "gpu_check_bench128k.md", "gpu_check_bench32k.md", "gpu_check_bench512k.md",
                     "pytest_kernels.xml", "pytest_training.xml", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        names = set(archive.getnames())
        versions = archive.extractfile("gpu_check/env.log").read().decode()
    assert {f"gpu_check/{step}.log" for step in STEPS} <= names and "gpu_check/bench32k/gpu_cpu.json" in names
    assert "torch " in versions and "flash-attn" in versions and "allocator:" in versions
    table = (out / "gpu_check_bench32k.md").read_text()
    assert "| llama-tiny | full | transformers sdpa + GC | 64 | " in table and "reserved (GiB)" in table
    assert "| llama-tiny | full | longfit, all techniques | 128 | " in (out / "gpu_check_bench128k.md").read_text()
    assert (tmp_path / "results/gpu_check_bench32k.md").read_text() == table


FAKE_PYTHON = """#!/usr/bin/env bash
# records its arguments; makes the files that pytest's junit xml and the bench's --out would hold
echo "$*" >>"$CALLS"
prev=""
for a in "$@"; do
  case "$a" in --junitxml=*) echo "<testsuites/>" >"${a#--junitxml=}" ;; esac
  if [ "$prev" = --out ]; then mkdir -p "$a" && echo "| row |" >"$a/gpu_cpu.md" && echo "{}" >"$a/gpu_cpu.json"; fi
  prev=$a
done
"""


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_rerun_runs_the_kernels_the_prefetch_and_two_bench_rows_within_250_s(tmp_path, device):
    """`gpu_check.sh --rerun`, its harness only (the Python it runs is a stub recording its arguments: a second):
    the steps, their order and arguments, and the files $OUT gets."""
    out, calls, fake = tmp_path / "out", tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), CALLS=str(calls), TMPDIR=str(tmp_path),
               RESULTS=str(tmp_path / "results"))
    args = ["--rerun"] if device == "cuda" else ["--device", "cpu", "--rerun"]
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout[-3000:] + done.stderr[-3000:]
    assert [line.split(":")[0] for line in summary.splitlines()] == ["kernels", "prefetch", "bench32k1b", "bench32k8b",
                                                                      "total"]
    assert int(summary.splitlines()[-1].split()[1]) < 30
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "gpu_check_bench32k1b.md",
                                                     "gpu_check_bench32k8b.md", "pytest_kernels.xml", "summary.txt"]
    kernels, prefetch, small, big = calls.read_text().splitlines()
    if device == "cuda":
        assert "tests/test_gpu_attention.py tests/test_gpu_memory.py" in kernels
        assert prefetch.endswith("offload_prefetch_memory.py --device cuda")
        assert "--models llama-3.2-1b:full --lengths 32768 --systems longfit-no-offload" in small
        assert "--models llama-3.1-8b:lora --lengths 32768 --systems longfit " in big
        budget = int(big.split("--time-budget ")[1].split()[0])
        assert budget >= 200, big  # the 250 s less a margin, the stub's steps taking no time
    assert small.endswith("--no-trace") and big.endswith("--no-trace") and "-m gpu" in kernels
    assert "-m longfit bench gpu --device " + device in big


def test_the_full_check_runs_its_seven_steps_in_order(tmp_path):
    """The full check's harness, with the stub Python (the slow test above runs it for real)."""
    out, calls, fake = tmp_path / "out", tmp_path / "calls.txt", tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), CALLS=str(calls), TMPDIR=str(tmp_path),
               RESULTS=str(tmp_path / "results"))
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout[-3000:] + done.stderr[-3000:]
    assert [line.split(":")[0] for line in summary.splitlines()] == [*STEPS, "total"]
    assert len(list(out.iterdir())) <= 8
    assert "--no-trace" not in calls.read_text()
