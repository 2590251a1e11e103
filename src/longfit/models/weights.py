"""A local checkpoint's safetensors read into a model of which this process holds only a part.

Each parameter and persistent buffer is matched to its checkpoint key by transformers' own loading
rules (`get_model_conversion_mapping` + `rename_source_key`, what `from_pretrained` applies: legacy
names, the base-model prefix). This process then reads from the file only
the box of the tensor it holds (`local_region`: its shard under FSDP2 or tensor parallelism, everything
in one process) through safetensors' lazy `get_slice`, and copies it into place on the parameter's
device, cast to the parameter's dtype. No rank reads what another rank holds and nothing is broadcast;
each file is opened per tensor, so host memory holds at most one slice and the file pages of one
tensor at a time. Checkpoints whose tensors transformers merges or splits while loading
(`WeightConverter`: fused MoE experts, ...) cannot be read by slices and are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from longfit.config import ConfigError
from longfit.models.init import canonical_name, local_region

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# Where a multimodal checkpoint keeps its language model: transformers' legacy layout (which
# save_pretrained still writes) and its current one, mapped onto the causal LM's own names. No key of a
# text-only checkpoint matches.
LANGUAGE_MODEL_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",
}


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (from the index of a multi-file checkpoint)."""
    from safetensors import safe_open

    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return {key: directory / file for key, file in weight_map.items()}
    if (directory / SINGLE).is_file():
        with safe_open(str(directory / SINGLE), framework="pt") as f:
            return {key: directory / SINGLE for key in f.keys()}
    raise ConfigError(
        f"model={str(directory)!r} has no {SINGLE} or {INDEX}: longfit reads safetensors checkpoints slice by slice. "
        f"Convert a pytorch_model*.bin checkpoint once with `python -c \"from transformers import AutoModelForCausalLM; "
        f"AutoModelForCausalLM.from_pretrained('{directory}').save_pretrained('{directory}-safetensors')\"` and point "
        f"`model` at the new directory"
    )


def checkpoint_keys(model: nn.Module, keys) -> dict[str, str]:
    """Canonical parameter or buffer name of `model` (a transformers PreTrainedModel, peft layers possibly
    inside) -> the checkpoint key that loads it, for the checkpoint keys `keys`."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model, LANGUAGE_MODEL_KEYS)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    names = {canonical_name(name): True for name in model.state_dict()}  # only membership is looked at
    prefix = model.base_model_prefix
    found = {}
    for key in sorted(keys, key=dot_natural_key):  # from_pretrained's order: a key can switch a renaming on
        # The prefix argument is positional: it is `prefix` in transformers 5.0, `base_model_prefix` later.
        name, converter = rename_source_key(key, renamings, converters, prefix, names)
        if converter is not None:
            raise ConfigError(
                f"checkpoint tensor {key!r} is converted by transformers while loading ({converter}): longfit cannot read "
                f"it slice by slice. Save the model in its own layout first (from_pretrained, then save_pretrained)"
            )
        if name not in names and key in names:  # from_pretrained's fallback: only the prefix rule applies
            name, _ = rename_source_key(key, [], [], prefix, names)
        found[name] = key
    return found


def checkpoint_sources(model: nn.Module, directory: Path) -> dict[str, tuple[Path, str]]:
    """Name of each parameter and persistent buffer of `model` found in the checkpoint (a tied parameter
    once, under its first name, found under any of its names) -> (file, key). Needs only the names: call it
    on the meta model, before anything is allocated."""
    files = checkpoint_files(directory)
    keys = checkpoint_keys(model, files)
    persistent = set(model.state_dict())
    aliases: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in persistent:
            aliases.setdefault(id(tensor), []).append(name)
    sources = {}
    for names in aliases.values():
        key = next((keys[canonical_name(n)] for n in names if canonical_name(n) in keys), None)
        if key is not None:
            sources[names[0]] = (files[key], key)
    return sources


@torch.no_grad()
def read_local_slices(model: nn.Module, sources: dict[str, tuple[Path, str]]) -> set[int]:
    """Copy into each tensor of `model` named in `sources` (allocated, possibly sharded) the part of its
    checkpoint tensor that this process holds. Returns the ids of the tensors read."""
    from safetensors import safe_open

    buffers = dict(model.named_buffers())
    loaded = set()
    for name, (file, key) in sources.items():
        tensor = buffers[name] if name in buffers else model.get_parameter(name)
        local, offset = local_region(tensor)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            stored = f.get_slice(key)
            if list(stored.get_shape()) != list(tensor.shape):
                raise ConfigError(
                    f"checkpoint tensor {key!r} has shape {list(stored.get_shape())}, the model's {name} "
                    f"{list(tensor.shape)}: config.json does not describe these weights"
                )
            if local.numel():
                local.copy_(stored[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])
        loaded.add(id(tensor))
    return loaded
