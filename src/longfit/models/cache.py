"""longfit's caches on disk, under `$XDG_CACHE_HOME/longfit` (`~/.cache/longfit`), and the digest of the code whose
results they keep: the converted GGUF checkpoints, the planner's traced layer costs, `longfit check`'s verdicts."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path


def cache_dir(name: str) -> Path:
    """The folder of one of longfit's caches (not created)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "longfit" / name


def store_json(path: Path, values) -> None:
    """Write `values` as JSON to `path` in one step: a concurrent reader finds the old file or the new one. A folder
    that cannot be written (a read-only home) keeps nothing: the result is computed again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(values))
        partial.replace(path)
    except OSError:
        pass


@functools.cache
def code_digest() -> str:
    """The versions of the libraries a traced layer or a check runs (torch, transformers, peft) and a digest of
    longfit's sources: a fix or an upgrade reopens every cached result."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for package in ("torch", "transformers", "peft"):
        try:
            digest.update(f"{package}={version(package)};".encode())
        except PackageNotFoundError:
            digest.update(f"{package}=none;".encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
