"""benchmarks/gpu_check.sh, the prepared GPU check (issue #33), run on the CPU as a smoke test of its harness:
every step runs under its own limit, the summary names each, and $OUT holds what a device run brings back."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("env", "kernels", "training", "prefetch", "bench32k", "bench128k", "bench512k")


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
