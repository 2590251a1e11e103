"""One measurement in a fresh process: `python -m MODULE [ARGS...] SPEC.json RESULT.json`.

Every benchmark measures each configuration in a process of its own, so that peaks, allocator caches and
imported kernels of one do not leak into the next; the spec goes in as a JSON file and the result comes
back as one. Kept free of torch: the benchmarks' commands import it for `--help`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerRun:
    result: dict | None  # what the worker wrote; None when it failed before writing it
    returncode: int
    stderr: str

    @property
    def killed(self) -> bool:
        """SIGKILL: on a CPU run almost always the kernel's out-of-memory killer."""
        return self.returncode == -9

    def stderr_tail(self, lines: int) -> list[str]:
        return self.stderr.strip().splitlines()[-lines:]


def run_in_fresh_process(module: str, spec: dict, *args: str, timeout: float | None = None) -> WorkerRun:
    """Run `module` on `spec` in a new Python process (subprocess.TimeoutExpired past `timeout` seconds)."""
    with tempfile.TemporaryDirectory(prefix="longfit-bench-") as tmp:
        spec_path, result_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-m", module, *args, str(spec_path), str(result_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        written = proc.returncode == 0 and result_path.exists()
        return WorkerRun(json.loads(result_path.read_text()) if written else None, proc.returncode, proc.stderr)
