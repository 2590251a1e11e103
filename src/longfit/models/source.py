"""Where a model comes from: a preset name or a local Hugging Face directory. Torch-free (the planner uses it).

longfit never downloads at run time: any other name is an error that says how to fetch the checkpoint
and point `model` at the local copy.
"""

from __future__ import annotations

from pathlib import Path

from longfit.config import ConfigError
from longfit.models.presets import PRESETS


def local_model_dir(model: str) -> Path | None:
    """None for a preset; else the local model directory, which must hold a config.json."""
    if model in PRESETS:
        return None
    path = Path(model)
    if not path.is_dir():
        raise ConfigError(
            f"model={model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory. "
            f"longfit never downloads at run time: fetch the checkpoint beforehand (e.g. "
            f"`hf download {model} --local-dir ./models/{path.name}`) and set model=./models/{path.name}"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"model={model!r}: {path / 'config.json'} is missing; point `model` at a Hugging Face model directory")
    return path
