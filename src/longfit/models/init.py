"""Deterministic random initialisation of a model whose tensors were allocated after sharding.

A model is built on the meta device, sharded (FSDP2, tensor parallelism) and only then given storage
(`to_empty`), so every rank holds a part of each parameter and must fill that part alone -- with the
values it would have in one process, in every run, for a fixed seed.

Derivation. A random generator is a stream; splitting one stream among the ranks ties each value to the
world size (DTensor's offset-based RNG does that, and on a CPU mesh it even gives every shard the same
numbers). So the stream is cut by the GLOBAL tensor instead: a parameter is split into blocks of whole
rows (dim 0) of at most BLOCK elements, and block b is drawn by a generator of its own, seeded with
hash(seed, parameter name, b). A process draws the blocks that overlap the part of the global tensor it
holds (`local_region`) and keeps its part of each. One process draws every block once; N ranks draw the
same blocks with the same generators, so every value agrees bit for bit whatever the sharding.
Blocks are drawn in fp32 on the run's compute device (`draw_device`; by default the parameter's) and cast
and copied into place: a bf16 LoRA base is the rounding of the fp32 full fine-tuning weights of the same
seed, and parameters that FSDP2's CPU offload keeps in host memory get the values the same run draws on its
GPU without offload (issue #33: they were drawn by the CPU's generator, other values).

What is drawn is what transformers and peft draw: each family's own `_init_weights` (normal(0,
initializer_range) for Linear and Embedding, ones or zeros for norms, the RoPE frequencies, Gemma's
embedding scale) runs through `initialize_weights()`, and peft's `reset_lora_parameters` gives LoRA
its A (kaiming-uniform) and B (zero), with only the random fills of `transformers.initialization`
replaced by block fills. The name in the seed is the checkpoint name (peft's `.base_layer` removed), so
a LoRA base gets the weights of full fine-tuning. The values differ from `from_config`'s (drawn from the
global CPU generator in construction order) and between the CPU and each GPU model (other generator
algorithms), never between ranks or runs on one kind of device.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import re
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

BLOCK = 1 << 22  # elements per generator: 16 MiB of fp32 scratch; about 2,000 generators for an 8B model

# Random fills of transformers.initialization (which torch.nn.init's are routed to inside initialize_weights).
DRAWN = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_")
WHOLE_TENSOR = ("orthogonal_", "sparse_")  # random fills that need the whole tensor at once
DETERMINISTIC = ("constant_", "ones_", "zeros_", "eye_", "dirac_", "copy_")


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the part of `tensor` this process holds, the global index of its first element along each dim).

    For a DTensor, its local shard on any mesh and placements (FSDP2's Shard(0), tensor parallelism's
    Shard(0) / Shard(1) / Replicate, both on a 2-D mesh): always a box of the global tensor, the one DCP
    saves. A plain tensor is whole, at offset 0.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    assert tuple(local.shape) == tuple(shape), (tuple(local.shape), shape)
    return local, tuple(offset)


def canonical_name(name: str) -> str:
    """The checkpoint name of a parameter of a transformers model that peft may have wrapped (once per adapted
    parameter: peft nests one `base_layer` per adapted parameter of a module, e.g. fused MoE experts')."""
    return re.sub(r"(\.base_layer)+\.", ".", name)


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{name}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def fill_by_blocks(
    tensor: torch.Tensor, name: str, seed: int, draw: Callable[[torch.Tensor, torch.Generator], None],
    draw_device: torch.device | None = None,
) -> None:
    """Fill this process's part of `tensor` with the global tensor's blocks; draw(block, generator) fills
    one fp32 block of whole rows in place, on `draw_device` (None: the tensor's device)."""
    local, offset = local_region(tensor)
    draw_device = local.device if draw_device is None else torch.device(draw_device)
    shape = tuple(tensor.shape)
    if not shape:  # a scalar is one row
        local, offset, shape = local.view(1), (0,), (1,)
    if local.numel() == 0:
        return
    rows = max(1, BLOCK // max(1, math.prod(shape[1:])))
    first, last = offset[0], offset[0] + local.shape[0]
    columns = tuple(slice(start, start + size) for start, size in zip(offset[1:], local.shape[1:]))
    whole_rows = (tuple(local.shape[1:]) == shape[1:] and local.dtype == torch.float32 and local.is_contiguous()
                  and local.device == draw_device)
    for block in range(first // rows, (last - 1) // rows + 1):
        start, stop = block * rows, min((block + 1) * rows, shape[0])
        generator = torch.Generator(device=draw_device).manual_seed(block_seed(seed, name, block))
        lo, hi = max(start, first), min(stop, last)
        if whole_rows and (lo, hi) == (start, stop):  # inside this process's part: the same draw, without a copy
            draw(local[lo - first : hi - first], generator)
            continue
        values = torch.empty((stop - start, *shape[1:]), dtype=torch.float32, device=draw_device)
        draw(values, generator)
        local[lo - first : hi - first].copy_(values[(slice(lo - start, hi - start), *columns)])


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """torch.nn.init's fan_in and fan_out of a weight of the GLOBAL `shape` (a block has fewer rows)."""
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _sampler(kind: str, shape: tuple[int, ...], args: dict) -> Callable[[torch.Tensor, torch.Generator], None]:
    """The draw of one block for the call `kind(tensor, **args)` on a tensor of the global `shape`."""
    from transformers.initialization import TORCH_INIT_FUNCTIONS as torch_init

    if kind in ("normal_", "uniform_", "trunc_normal_"):
        return lambda block, generator: torch_init[kind](block, **args, generator=generator)
    fan_in, fan_out = _fans(shape)
    if kind.startswith("kaiming"):
        fan = fan_in if args["mode"] == "fan_in" else fan_out
        std = nn.init.calculate_gain(args["nonlinearity"], args["a"]) / math.sqrt(fan)
    else:
        std = args["gain"] * math.sqrt(2.0 / (fan_in + fan_out))
    if kind.endswith("uniform_"):
        bound = math.sqrt(3.0) * std
        return lambda block, generator: torch_init["uniform_"](block, -bound, bound, generator=generator)
    return lambda block, generator: torch_init["normal_"](block, 0.0, std, generator=generator)


@contextlib.contextmanager
def block_fills(names: dict[int, str], seed: int, written: set[int], draw_device: torch.device | None = None) -> Iterator[None]:
    """Replace transformers.initialization's random fills by block fills (drawn on `draw_device`) while inside.

    names: id(parameter) -> its checkpoint name (the seed of its blocks). `written` collects the id of
    every tensor an init function fills. Enter before `guard_torch_init_functions` (which reads these
    functions when entered); `initialize_weights` enters it itself.
    """
    import transformers.initialization as hf_init

    originals = {kind: getattr(hf_init, kind) for kind in (*DRAWN, *WHOLE_TENSOR, *DETERMINISTIC)}

    def drawn(kind: str):
        signature = inspect.signature(hf_init.TORCH_INIT_FUNCTIONS[kind])

        def fill(tensor, *args, **kwargs):
            if getattr(tensor, "_is_hf_initialized", False):
                return tensor
            name = names.get(id(tensor))
            if name is None:
                raise RuntimeError(f"{kind} on a tensor of shape {tuple(tensor.shape)} that is no parameter of the model")
            bound = signature.bind(tensor, *args, **kwargs)
            bound.apply_defaults()
            arguments = {k: v for k, v in bound.arguments.items() if k not in ("tensor", "generator")}
            fill_by_blocks(tensor, name, seed, _sampler(kind, tuple(tensor.shape), arguments), draw_device)
            written.add(id(tensor))
            return tensor

        return fill

    def whole_tensor(kind: str):
        def refuse(tensor, *args, **kwargs):
            raise NotImplementedError(f"{kind} needs the whole tensor at once; longfit initialises shard by shard")

        return refuse

    def recorded(kind: str):
        def fill(tensor, *args, **kwargs):
            written.add(id(tensor))
            return originals[kind](tensor, *args, **kwargs)

        return fill

    replacements = {
        **{kind: drawn(kind) for kind in DRAWN},
        **{kind: whole_tensor(kind) for kind in WHOLE_TENSOR},
        **{kind: recorded(kind) for kind in DETERMINISTIC},
    }
    try:
        for kind, function in replacements.items():
            setattr(hf_init, kind, function)
        yield
    finally:
        for kind, function in originals.items():
            setattr(hf_init, kind, function)


def _unfilled(named: Iterable[tuple[str, torch.Tensor]], done: set[int]) -> list[str]:
    return [name for name, tensor in named if id(tensor) not in done]


@torch.no_grad()
def initialize_weights(
    model: nn.Module, seed: int, skip: set[int] = frozenset(), draw_device: torch.device | None = None
) -> None:
    """Give every parameter and buffer of `model` (a transformers PreTrainedModel, peft layers possibly
    inside, tensors allocated and possibly sharded) except those whose id is in `skip` (loaded from a
    checkpoint, or LoRA adapters) the values of transformers' own initialisation, drawn by blocks on
    `draw_device` (the run's compute device; None: each tensor's own).

    The buffers are always recomputed (RoPE frequencies, Gemma's embedding scale: `to_empty` left them
    garbage). Raises if the model's `_init_weights` leaves any tensor unwritten.
    """
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor._is_hf_initialized = id(tensor) in skip  # transformers' init functions leave flagged tensors alone
    # transformers zeroes weight[padding_idx] through a view, which a sharded weight cannot give: the row is
    # zeroed here instead, in the part of it this process holds.
    padded = [
        (module, module.padding_idx)
        for module in model.modules()
        if isinstance(module, nn.Embedding) and module.padding_idx is not None and id(module.weight) not in skip
    ]
    written: set[int] = set()
    try:
        for module, _ in padded:
            module.padding_idx = None
        with block_fills(names, seed, written, draw_device):
            model.initialize_weights()
    finally:
        for module, row in padded:
            module.padding_idx = row
    for module, row in padded:
        local, offset = local_region(module.weight)
        if offset[0] <= row < offset[0] + local.shape[0]:
            local[row - offset[0]].zero_()
    unfilled = _unfilled([*model.named_parameters(), *model.named_buffers()], written | set(skip))
    if unfilled:
        raise RuntimeError(
            f"{type(model).__name__}._init_weights left {unfilled[:5]} unset: longfit cannot give them reproducible values"
        )


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The LoRA adapter parameters inside `model` (none without peft)."""
    from peft.tuners.lora import LoraLayer

    return [
        param
        for module in model.modules()
        if isinstance(module, LoraLayer)
        for layer_name in module.adapter_layer_names
        for param in getattr(module, layer_name).parameters()
    ]


@torch.no_grad()
def reset_lora(peft_model: nn.Module, seed: int, draw_device: torch.device | None = None) -> None:
    """peft's own initialisation of every LoRA adapter of `peft_model` (by default A kaiming-uniform, B zero,
    as each adapter's `init_lora_weights` asks), drawn by blocks on `draw_device` (None: each tensor's own)."""
    from peft.tuners.lora import LoraLayer
    from transformers.initialization import guard_torch_init_functions

    base = peft_model.get_base_model()
    names = {id(p): canonical_name(n) for n, p in base.named_parameters()}
    adapters = {id(param): param for param in lora_parameters(peft_model)}
    for param in adapters.values():
        param._is_hf_initialized = False  # initialize_weights skipped (and flagged) them
    written: set[int] = set()
    with block_fills(names, seed, written, draw_device), guard_torch_init_functions():  # peft calls torch.nn.init
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                for adapter, config in peft_model.peft_config.items():
                    module.reset_lora_parameters(adapter, config.init_lora_weights)
    unfilled = _unfilled(((n, p) for n, p in base.named_parameters() if id(p) in adapters), written)
    if unfilled:
        raise RuntimeError(f"peft's reset_lora_parameters left {unfilled[:5]} unset")
