"""`.ci/run` names slow cases one by one: a case renamed or removed must fail here, in the default suite, rather
than stop CI after its first 15 minutes with pytest's "not found" (exit 4)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOW_RUN = "python -m pytest -m slow"


def slow_selections() -> list[list[str]]:
    """The arguments of each `python -m pytest -m slow ...` line of .ci/run (continuations joined, comments cut)."""
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    return [shlex.split(line.split(SLOW_RUN, 1)[1], comments=True)
            for line in script.splitlines() if line.startswith(SLOW_RUN)]


def test_every_slow_case_ci_names_exists() -> None:
    selections = slow_selections()
    assert len(selections) >= 3
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for arguments in selections:
        collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                    "-m", "slow", *arguments], cwd=ROOT, env=environment, capture_output=True,
                                   text=True, timeout=600)
        # pytest's exit 4 is a path or case it cannot find, 5 a selection whose cases are all deselected (not slow)
        assert collected.returncode == 0, f".ci/run selects what pytest cannot collect:\n{collected.stdout[-2000:]}"
