"""A local checkpoint's safetensors read into a model of which this process holds only a part.

Each parameter and persistent buffer is matched to its checkpoint key by transformers' own loading
rules (`get_model_conversion_mapping` + `rename_source_key`, what `from_pretrained` applies: legacy
names, the base-model prefix). This process then reads from the file only
the box of the tensor it holds (`local_region`: its shard under FSDP2 or tensor parallelism, everything
in one process) through safetensors' lazy `get_slice`, and copies it into place on the parameter's
device, cast to the parameter's dtype. No rank reads what another rank holds and nothing is broadcast;
each file is opened per tensor, so host memory holds at most one slice and the file pages of one
tensor at a time.

Checkpoints whose tensors transformers merges while loading (its `WeightConverter`s: the per-expert
weights of every mixture-of-experts checkpoint on the Hub, `experts.{e}.gate_proj/up_proj/down_proj`,
stacked into one fused `experts.gate_up_proj` / `experts.down_proj` per layer) are read by slices too,
through transformers' own rules run on unread tensors (`Stored`): the converter collects the checkpoint
keys as `from_pretrained` does and runs its own operations, whose torch calls (stack, cat, transpose,
chunk, split) build a description of the fused tensor instead of computing it. Reading a box of it then
reads from each source tensor only the part that lands in the box: a rank holding experts 0-63 of a fused
weight (its FSDP2 shard) opens only those experts' tensors. An operation that is not a rearrangement of
whole slices (a dequantization, a permutation for rotary embeddings) cannot be read that way and is refused
in one line naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from longfit.config import ConfigError
from longfit.models.init import canonical_name, local_region

Box = tuple[slice, ...]  # a region of a tensor: one slice(start, stop) per dimension

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


class Stored:
    """A checkpoint tensor, or what transformers' conversion operations make of several of them, unread.

    `shape` is the tensor's; `read(box)` returns the values of one box of it (a tuple of slices with steps
    of 1), reading from the files only the parts of the source tensors that the box covers. transformers'
    operations call torch functions on their inputs; `__torch_function__` answers the rearrangements among
    them with a new `Stored` (the pieces and how they are laid out) and refuses everything else.
    """

    def __init__(self, shape, read, name: str):
        self.shape = torch.Size(shape)
        self._read = read
        self.name = name  # for messages: the checkpoint key, or the operation and its sources

    @classmethod
    def leaf(cls, file: Path, key: str, shape) -> "Stored":
        return cls(shape, lambda box: read_box(file, key, box), key)

    def read(self, box: Box) -> torch.Tensor:
        return self._read(box)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def contiguous(self) -> "Stored":
        return self

    def squeeze(self, dim: int) -> "Stored":
        if self.shape[dim] != 1:
            return self
        shape = self.shape[:dim] + self.shape[dim + 1 :]
        return Stored(shape, lambda box: self.read(box[:dim] + (slice(0, 1),) + box[dim:]).squeeze(dim), self.name)

    def transpose(self, dim0: int, dim1: int) -> "Stored":
        return _transpose(self, dim0, dim1)

    def __repr__(self) -> str:
        return f"Stored({self.name}, {list(self.shape)})"

    def __getattr__(self, attribute: str):
        """Any other tensor method an operation calls (reshape, view, a dtype cast) is no rearrangement of slices."""
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise UnreadableConversion(attribute)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operation = _OPERATIONS.get(getattr(func, "__name__", None))
        if operation is None:
            raise UnreadableConversion(getattr(func, "__name__", repr(func)))
        return operation(*args, **kwargs)


class UnreadableConversion(Exception):
    """A conversion operation that is not a rearrangement of slices (`Stored` cannot read it by parts)."""


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _stack(tensors, dim: int = 0) -> Stored:
    """torch.stack: tensor i of the list is the index i of the new dimension `dim`."""
    first = tensors[0]
    dim = _dim(dim, first.dim() + 1)
    shape = first.shape[:dim] + (len(tensors),) + first.shape[dim:]

    def read(box: Box) -> torch.Tensor:
        inner = box[:dim] + box[dim + 1 :]
        return torch.stack([tensors[i].read(inner) for i in range(box[dim].start, box[dim].stop)], dim)

    return Stored(shape, read, f"stack({tensors[0].name}, ... {len(tensors)})")


def _cat(tensors, dim: int = 0) -> Stored:
    """torch.cat: the tensors follow each other along `dim`; a box reads the part of each that it overlaps."""
    dim = _dim(dim, tensors[0].dim())
    starts = [0]
    for tensor in tensors:
        starts.append(starts[-1] + tensor.shape[dim])
    shape = tensors[0].shape[:dim] + (starts[-1],) + tensors[0].shape[dim + 1 :]

    def read(box: Box) -> torch.Tensor:
        parts = []
        for tensor, start, stop in zip(tensors, starts, starts[1:]):
            lo, hi = max(box[dim].start, start), min(box[dim].stop, stop)
            if lo < hi:
                parts.append(tensor.read(box[:dim] + (slice(lo - start, hi - start),) + box[dim + 1 :]))
        return torch.cat(parts, dim)

    return Stored(shape, read, f"cat({', '.join(t.name for t in tensors[:2])}{', ...' if len(tensors) > 2 else ''})")


def _transpose(tensor: Stored, dim0: int, dim1: int) -> Stored:
    dim0, dim1 = _dim(dim0, tensor.dim()), _dim(dim1, tensor.dim())
    order = list(range(tensor.dim()))
    order[dim0], order[dim1] = dim1, dim0
    shape = [tensor.shape[d] for d in order]
    return Stored(shape, lambda box: tensor.read(tuple(box[d] for d in order)).transpose(dim0, dim1), tensor.name)


def _narrow(tensor: Stored, dim: int, start: int, length: int) -> Stored:
    shape = tensor.shape[:dim] + (length,) + tensor.shape[dim + 1 :]

    def read(box: Box) -> torch.Tensor:
        return tensor.read(box[:dim] + (slice(box[dim].start + start, box[dim].stop + start),) + box[dim + 1 :])

    return Stored(shape, read, tensor.name)


def _split(tensor: Stored, split_size_or_sections, dim: int = 0) -> tuple[Stored, ...]:
    dim = _dim(dim, tensor.dim())
    total = tensor.shape[dim]
    if isinstance(split_size_or_sections, int):
        sizes = [min(split_size_or_sections, total - s) for s in range(0, total, split_size_or_sections)]
    else:
        sizes = list(split_size_or_sections)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(_narrow(tensor, dim, start, size) for start, size in zip(starts, sizes))


def _chunk(tensor: Stored, chunks: int, dim: int = 0) -> tuple[Stored, ...]:
    total = tensor.shape[_dim(dim, tensor.dim())]
    return _split(tensor, -(-total // chunks), dim)  # torch.chunk's sizes: ceil(total / chunks), the last smaller


_OPERATIONS = {
    "stack": _stack,
    "cat": _cat,
    "concat": _cat,
    "transpose": _transpose,
    "split": _split,
    "chunk": _chunk,
    "squeeze": Stored.squeeze,
}


def read_box(file: Path, key: str, box: Box) -> torch.Tensor:
    """The box `box` of checkpoint tensor `key` of `file`, read through safetensors' lazy slices."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_slice(key)[box]


def _loading_rules(model: nn.Module):
    """transformers' loading rules for `model`: (renamings, converters, base-model prefix, the canonical names of its
    state), the multimodal layouts of `LANGUAGE_MODEL_KEYS` included."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    transforms = get_model_conversion_mapping(model, LANGUAGE_MODEL_KEYS)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    names = {canonical_name(name): True for name in model.state_dict()}  # only membership is looked at
    return renamings, converters, model.base_model_prefix, names


def source_names(model: nn.Module, keys) -> dict[str, tuple[str, str | None]]:
    """Checkpoint key -> (the canonical name of the tensor of `model` it loads, the source pattern of the transformers
    converter that merges it with others, or None), for each of `keys` that loads a tensor of `model`, by
    `from_pretrained`'s rules and in its order (a key can switch a renaming on)."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters, prefix, names = _loading_rules(model)
    found = {}
    for key in sorted(keys, key=dot_natural_key):
        # The prefix argument is positional: it is `prefix` in transformers 5.0, `base_model_prefix` later.
        name, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if name not in names and key in names:  # from_pretrained's fallback: only the prefix rule applies
            name, pattern = rename_source_key(key, [], [], prefix, names)[0], None
        if name in names:
            found[key] = (name, pattern)
    return found


def checkpoint_keys(model: nn.Module, files: dict[str, Path]) -> dict[str, Stored]:
    """Canonical parameter or buffer name of `model` (a transformers PreTrainedModel, peft layers possibly
    inside) -> the checkpoint tensor that loads it, unread (`Stored`), for the checkpoint keys of `files`.

    A name that transformers loads through a `WeightConverter` gets what the converter's own operations
    make of the checkpoint tensors it collects, in `from_pretrained`'s order (one converter per target).
    """
    import copy

    converters = _loading_rules(model)[1]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    shapes = checkpoint_shapes(files)
    found: dict[str, Stored] = {}
    converting = {}  # target name -> its converter, collecting its sources
    for key, (name, pattern) in source_names(model, files).items():
        stored = Stored.leaf(files[key], key, shapes[key])
        if pattern is None:
            found[name] = stored
        else:
            converter = converting.setdefault(name, copy.deepcopy(by_pattern[pattern]))
            converter.add_tensor(name, key, pattern, stored)
    for name, converter in converting.items():
        try:
            converted = converter.convert(name, model=model, config=model.config)
        except UnreadableConversion as e:
            raise ConfigError(
                f"checkpoint tensors {sorted(converter.layer_targets[name])[:2]}... are converted by transformers while "
                f"loading with {e} ({', '.join(type(op).__name__ for op in converter.operations)}), which longfit cannot "
                f"read slice by slice. Save the model in its own layout first (from_pretrained, then save_pretrained)"
            ) from None
        found.update({target: value[0] if isinstance(value, list) else value for target, value in converted.items()})
    return found


def tensors_as_saved(model: nn.Module, state: dict[str, torch.Tensor], keys) -> dict[str, torch.Tensor]:
    """Checkpoint key -> its value in `state` (the canonical names of `model`'s tensors -> values), for each of `keys`
    that loads a tensor of `model`: the inverse of loading, in the checkpoint's own layout and key names. A tensor
    transformers merged from several keys (per-expert weights) is split back by transformers' reverse operations."""
    from transformers.core_model_loading import rename_source_key, revert_weight_conversion

    renamings, _, prefix, names = _loading_rules(model)
    saved, merged = {}, {}
    for key, (name, pattern) in source_names(model, keys).items():
        if pattern is None:
            saved[key] = state[name]
        else:
            merged.setdefault(name, []).append(key)
    for name, sources in merged.items():
        reverted = revert_weight_conversion(model, {name: state[name]})
        for key in sources:
            unmerged = rename_source_key(key, renamings, [], prefix, names)[0]
            if unmerged not in reverted:
                raise ConfigError(f"checkpoint tensor {key!r}: transformers' reverse of its conversion into {name} "
                                  f"gives {sorted(reverted)[:3]}..., not it; export with --text-only")
            saved[key] = reverted[unmerged]
    return saved


def checkpoint_shapes(files: dict[str, Path]) -> dict[str, list[int]]:
    """Shape of every checkpoint key, from the safetensors headers (each file opened once)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({key: f.get_slice(key).get_shape() for key in f.keys()})
    return shapes


def checkpoint_sources(model: nn.Module, directory: Path) -> dict[str, Stored]:
    """Name of each parameter and persistent buffer of `model` found in the checkpoint (a tied parameter
    once, under its first name, found under any of its names) -> its checkpoint tensor, unread. Needs only
    the names and the safetensors headers: call it on the meta model, before anything is allocated."""
    keys = checkpoint_keys(model, checkpoint_files(directory))
    persistent = set(model.state_dict())
    aliases: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in persistent:
            aliases.setdefault(id(tensor), []).append(name)
    sources = {}
    for names in aliases.values():
        stored = next((keys[canonical_name(n)] for n in names if canonical_name(n) in keys), None)
        if stored is not None:
            sources[names[0]] = stored
    return sources


@torch.no_grad()
def read_local_slices(model: nn.Module, sources: dict[str, Stored]) -> set[int]:
    """Copy into each tensor of `model` named in `sources` (allocated, possibly sharded) the part of its
    checkpoint tensor that this process holds. Returns the ids of the tensors read."""
    buffers = dict(model.named_buffers())
    loaded = set()
    for name, stored in sources.items():
        tensor = buffers[name] if name in buffers else model.get_parameter(name)
        local, offset = local_region(tensor)
        if list(stored.shape) != list(tensor.shape):
            raise ConfigError(
                f"checkpoint tensor {stored.name!r} has shape {list(stored.shape)}, the model's {name} "
                f"{list(tensor.shape)}: config.json does not describe these weights"
            )
        if local.numel():
            local.copy_(stored.read(tuple(slice(o, o + n) for o, n in zip(offset, local.shape))))
        loaded.add(id(tensor))
    return loaded
