"""A GGUF file as a model source: dequantized once, by transformers' GGUF loader, into a cached Hugging Face directory.

longfit reads a model's weights slice by slice from safetensors (`longfit.models.weights`), each rank only
its own part, and transformers' GGUF loader can only produce whole dequantized tensors. So a `.gguf` file
is converted once -- config, fp32 safetensors (the dequantized values exactly) and the tokenizer with its
chat template -- and from then on trains like any local model directory.

The converted directory lives under the user's cache, `$XDG_CACHE_HOME/longfit/gguf` (`~/.cache/...`
by default), not beside the file, which may sit in a read-only place (a package's site-packages). Its
name is the file's stem and a key made of the file's absolute path, size and modification time: cheap
enough to compute on every resolution of `model` (hashing the contents of a multi-GB file would cost
seconds each time), and a file replaced in place gets a fresh conversion.

Every rank of a torchrun job resolves `model` at the same time (the planner reads its config in preflight),
so a file lock lets one process convert while the others wait for its result instead of each holding the
whole model in memory. The conversion is written to a temporary directory beside the target and renamed
into place when complete: an interrupted conversion never leaves a directory that looks finished, and
processes on machines whose shared file system ignores the lock still see either nothing or all of it.

What can be checked before converting is: the `gguf` package (the `gguf` extra), the tensor quantization
types (each must be one that gguf-py dequantizes, tried on one row of each), the architecture
(transformers must load it from GGUF, and longfit must train it: `presets.MODEL_TYPES`).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

from longfit.config import ConfigError
from longfit.models.cache import cache_dir
from longfit.models.presets import MODEL_TYPES

OTHER_SOURCE = "or point `model` at the model's Hugging Face directory (config.json, safetensors, tokenizer)"


def cache_root() -> Path:
    """Where converted GGUF files go: the XDG cache directory, as Hugging Face and torch keep theirs."""
    return cache_dir("gguf")


def converted_dir_name(path: Path) -> str:
    """The cache entry's name: the file's stem and a key of its absolute path, size and modification time."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{key}"


def converted_model_dir(path: Path, model: str) -> Path:
    """The Hugging Face directory of the GGUF file `path`, converted on first use (checked first, then locked)."""
    target = cache_root() / converted_dir_name(path)
    if target.is_dir():
        return target
    from filelock import FileLock

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{target}.lock"):
            if not target.is_dir():  # else another process converted it while this one waited
                check_gguf(path, model)
                print(f"longfit: converting {path} into {target} (once)", file=sys.stderr, flush=True)
                started = time.perf_counter()
                staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
                try:
                    convert(path, staging)
                    _move_into_place(staging, target)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
                print(f"longfit: converted in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    except OSError as e:  # a full disk, or a cache directory that cannot be written
        raise ConfigError(
            f"model={model!r}: converting the GGUF file into {target.parent} failed ({e}); it needs room for the "
            f"fp32 weights (4 bytes per parameter). Free space there, or set XDG_CACHE_HOME to a disk with room"
        ) from e
    return target


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished conversion to `target`, unless a process the lock did not reach (another machine on
    a shared file system) has put its own, identical one there first."""
    try:
        staging.rename(target)
    except OSError:
        if not target.is_dir():
            raise


def check_gguf(path: Path, model: str) -> None:
    """What can be refused before the conversion: the gguf package, quantization types, the architecture."""
    from transformers.utils import is_gguf_available
    from transformers.utils.import_utils import GGUF_MIN_VERSION

    if not is_gguf_available():
        raise ConfigError(
            f"model={model!r} is a GGUF file, which needs the gguf package (>= {GGUF_MIN_VERSION}): "
            f"pip install 'longfit[gguf]'"
        )
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError) as e:  # a bad magic number, an unknown type code in a newer file, a short file
        raise ConfigError(
            f"model={model!r} cannot be read as a GGUF file by gguf {_version('gguf')} ({e}): if the file is "
            f"complete, upgrade gguf (pip install -U gguf), {OTHER_SOURCE}"
        ) from e
    unreadable = sorted({tensor.tensor_type.name for tensor in reader.tensors if not _dequantizes(tensor)})
    if unreadable:
        raise ConfigError(
            f"model={model!r}: its tensors are quantized as {', '.join(unreadable)}, which gguf "
            f"{_version('gguf')} (transformers' GGUF reader) cannot dequantize. Use a GGUF file of another "
            f"quantization (e.g. Q8_0, Q4_K_M, F16), upgrade gguf (pip install -U gguf), {OTHER_SOURCE}"
        )
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        model_type = load_gguf_checkpoint(str(path), return_tensors=False)["config"]["model_type"]
    except ValueError as e:  # "GGUF model with architecture X is not supported yet."
        raise ConfigError(
            f"model={model!r}: transformers {_version('transformers')} cannot load this GGUF file ({e}); "
            f"longfit trains {', '.join(sorted(MODEL_TYPES))}: {OTHER_SOURCE}"
        ) from e
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model={model!r} is a {model_type} model, an architecture longfit does not train; it trains "
            f"{', '.join(sorted(MODEL_TYPES))}. Use a GGUF file of one of those"
        )


def _dequantizes(tensor) -> bool:
    """Whether gguf-py dequantizes this tensor's type: tried on its first row, which costs nothing."""
    from gguf import dequantize

    try:
        dequantize(tensor.data.reshape(-1, tensor.data.shape[-1])[:1], tensor.tensor_type)
    except NotImplementedError:
        return False
    return True


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def convert(path: Path, destination: Path) -> None:
    """Dequantize `path` with transformers into `destination`: config, fp32 safetensors, tokenizer.

    transformers refuses to save a model loaded from GGUF (its config carries the GGUF quantization_config),
    so the weights move, without a copy, into the same architecture built from the config without it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longfit.models.progress import without_library_bars

    with without_library_bars():  # the conversion is announced and timed (`converted_model_dir`)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                      local_files_only=True)
        config = loaded.config
        del config.quantization_config
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict(), assign=True)
        plain.save_pretrained(destination)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True).save_pretrained(destination)
