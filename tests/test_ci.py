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


def slow_selections() -> list[str]:
    """The files and cases the `python -m pytest -m slow ...` lines of .ci/run select (continuations joined, comments
    cut; an option such as `-k EXPR` filters a file named whole, which is collected whole here)."""
    script = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    selected: list[str] = []
    for line in script.splitlines():
        if not line.startswith(SLOW_RUN):
            continue
        words = shlex.split(line.split(SLOW_RUN, 1)[1], comments=True)
        options_with_values = {index + 1 for index, word in enumerate(words) if word in ("-k", "-m")}
        selected += [word for index, word in enumerate(words)
                     if not word.startswith("-") and index not in options_with_values and word not in selected]
    return selected


def test_every_slow_case_ci_names_exists() -> None:
    selected = slow_selections()
    assert len(selected) > 20
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # One collection of them all (one interpreter, each test module imported once)
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "-m", "slow", *selected], cwd=ROOT, env=environment, capture_output=True, text=True,
                               timeout=600)
    # pytest exits 4 where it cannot find a path or case, 5 where every case selected is deselected (none slow)
    assert collected.returncode == 0, f".ci/run selects what pytest cannot collect:\n{collected.stdout[-2000:]}"
