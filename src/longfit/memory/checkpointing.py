"""Per-decoder-layer activation checkpointing, optionally moving the checkpointed layer inputs out of device memory.

Non-reentrant `torch.utils.checkpoint` keeps only a layer's positional tensor inputs (for a Hugging Face
decoder layer: the residual stream `hidden_states` (B, L, H)) and recomputes everything else in backward.
Keyword tensors (rotary cos/sin, position_ids, cu_seq_lens_q) are held by reference, once for all layers.
Those saved inputs go through the `saved_tensors_hooks` active around the `checkpoint` call (or around a
tiled layer, whose only saved tensor is its input), which is where `ActivationOffloader` hands them to
an `OffloadStore` (longfit.memory.offload: GPU first, then an exact-size host arena, then disk):

- forward (pack): the store copies the tensor out on a side stream, after the compute stream has produced
  it, and `record_stream` keeps the device block from being reused before that copy has run;
- backward (unpack of layer i): the previous checkpointed layer's input of the same forward pass (micro-batch) is
  prefetched (a host->device copy on the side stream; from disk, a read whose completion starts that copy), so it
  overlaps layer i's recompute and backward; layer i's own input was prefetched the same way when layer i+1
  unpacked (the last layer, first in backward, loads on demand, or stays on the GPU under the GPU-first placement);
- a tensor handed to several layers (the same object, e.g. a rotary table passed positionally) is stored
  at most once: from its second sighting on, every layer keeps it by reference on the device;
- tensors below `min_offload_bytes` and non-contiguous ones stay where they are.
On CPU the same hooks and store run and the "host copy" is a CPU copy, so tests exercise the whole mechanism.

Layers are wrapped in place by overriding the instance's `forward`: parameter names, `state_dict` keys, peft
adapters and DCP checkpoints are the same with checkpointing on or off, and FSDP2's `fully_shard` (applied
later, per layer) keeps its hooks outside the checkpoint, so a recompute never all-gathers twice.

An image-text wrapper's vision tower (#54) has blocks of its own: `apply_tower_checkpointing` wraps every one of them
the same way, with an offloader (and store) of their own, whose items are the blocks' inputs (patches, hidden). A
block checkpoints only where a gradient flows through it (its parameters or its input need one: the tower trains, or
LoRA adapts it); a frozen block runs plainly, keeping nothing (autograd records nothing there, and under the frozen
tower's `no_grad` nothing at all).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longfit.memory.offload import OffloadStore, Stored
from longfit.memory.switches import stored_items_per_layer
from longfit.models.kept_attention import keeping, replaying
from longfit.models.structure import decoder_layers

CHECKPOINT_ATTR = "longfit_activation_checkpoint"
MIN_OFFLOAD_BYTES = 1 << 20
"""Saved tensors smaller than this stay where they are (the planner's tower store counts the same rule)."""


@dataclass
class OffloadStats:
    """Counters of one `ActivationOffloader` since its creation."""

    offloaded_bytes: int = 0
    """Bytes moved out of device memory in forward (to host or disk; before compression)."""
    reloaded_bytes: int = 0
    """Bytes brought back in backward."""
    offloaded_tensors: int = 0
    prefetched_tensors: int = 0
    """Reloads started ahead of their unpack (while the next layer's backward runs)."""
    deduplicated_tensors: int = 0
    """Repeat sightings of one tensor object by later layers, kept by reference instead of stored again."""
    kept_tensors: int = 0
    """Saved inputs left in place: small or non-contiguous."""
    device_tensors: int = 0
    """Inputs the GPU-first placement keeps on the device."""


class _SavedInput:
    """One saved layer input: in the store (`stored`) or, once shared by several layers, a device reference."""

    __slots__ = ("layer", "stored", "on_device", "__weakref__")

    def __init__(self, layer: _LayerSaves, stored: Stored):
        self.layer = layer
        self.stored: Stored | None = stored
        self.on_device: torch.Tensor | None = None


@dataclass
class _LayerSaves:
    """One checkpointed layer call of a forward pass, linked to the previous one for the backward prefetch.

    Entries are held weakly (autograd owns them), so a layer's stored inputs die with its saved tensors.
    """

    layer_index: int
    previous: _LayerSaves | None
    entries: list[weakref.ref] = field(default_factory=list)


class ActivationOffloader:
    """saved_tensors_hooks moving checkpointed layer inputs into an `OffloadStore` (see the module docstring)."""

    def __init__(
        self, min_offload_bytes: int = MIN_OFFLOAD_BYTES, store: OffloadStore | None = None, layers: int = 0,
        keep_attention: bool = False,
    ):
        """`keep_attention`: the store keeps each layer's attention output beside its input (`keep`,
        `switches.stored_items_per_layer`); `layers` counts the checkpointed layers of a store made here."""
        self.min_offload_bytes = min_offload_bytes
        self.items_per_layer = stored_items_per_layer(keep_attention)
        self.store = store if store is not None else OffloadStore(layers=layers * self.items_per_layer)
        self.stats = OffloadStats()
        self._last_layer: _LayerSaves | None = None
        # id(tensor) -> (weakref to the tensor, weakref to its _SavedInput); identity is confirmed through the
        # tensor weakref, so an id reused by a new tensor after the old one died never matches.
        self._seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def start_pass(self) -> None:
        """A new forward pass: its layers' backward prefetch chain starts fresh. A layer's backward prefetches the
        previous layer of its own pass, so of its own micro-batch, whatever ran in between: a pipeline stage calls
        this before each forward (parallel/pipeline.py), where a rank holding several stages runs another stage's
        layers, of another micro-batch, right after a stage's last one."""
        self._last_layer = None
        self._seen.clear()

    @contextlib.contextmanager
    def layer_scope(self, layer_index: int):
        """Offload what is saved inside this scope as the inputs of the store's layer `layer_index` (the checkpointed
        layer's index; under tiled layers one less, the first layer storing nothing)."""
        if self._last_layer is not None and layer_index <= self._last_layer.layer_index:
            self.start_pass()  # a new forward pass (or micro-batch) of the same layers
        layer = _LayerSaves(layer_index, self._last_layer)
        self._last_layer = layer
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, layer), self.unpack):
            yield

    def _pack(self, layer: _LayerSaves, tensor: torch.Tensor):
        known = self._seen.get(id(tensor))
        entry = known[1]() if known is not None and known[0]() is tensor else None
        if entry is not None:
            if entry.on_device is None:
                # Shared by several layers, hence alive on the device anyway: keep a reference and release the
                # stored copy (the store frees its slot once nothing refers to it).
                entry.on_device, entry.stored = tensor, None
            self.stats.deduplicated_tensors += 1
            return entry
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_offload_bytes or not tensor.is_contiguous():
            self.stats.kept_tensors += 1
            return tensor
        entry = self._store(layer, layer.layer_index * self.items_per_layer, tensor)
        self._seen[id(tensor)] = (weakref.ref(tensor), weakref.ref(entry))
        return entry

    def _store(self, layer: _LayerSaves, item: int, tensor: torch.Tensor, exact: bool = False) -> _SavedInput:
        entry = _SavedInput(layer, self.store.put(item, tensor, exact))
        layer.entries.append(weakref.ref(entry))  # prefetched with the layer's other items
        if entry.stored.tier == "device":
            self.stats.device_tensors += 1
        else:
            self.stats.offloaded_tensors += 1
            self.stats.offloaded_bytes += tensor.numel() * tensor.element_size()
        return entry

    def keep(self, blob: torch.Tensor) -> _SavedInput | torch.Tensor:
        """Store the packed attention result `blob` of the layer running now (inside its `layer_scope`) as its kept
        attention item, exactly (no checkpoint_dtype), on the prefetch chain of its input; small ones stay put."""
        assert self.items_per_layer == 2, "keep_attention: the store was not planned for kept attention"
        if blob.numel() * blob.element_size() < self.min_offload_bytes:
            self.stats.kept_tensors += 1
            return blob
        layer = self._last_layer
        return self._store(layer, layer.layer_index * self.items_per_layer + 1, blob, exact=True)

    def unpack(self, packed):
        """A stored item back on the device (prefetching the previous layer's items on the way)."""
        if not isinstance(packed, _SavedInput):
            return packed
        previous = packed.layer.previous
        if previous is not None:
            for ref in previous.entries:
                entry = ref()
                if entry is not None and entry.stored is not None and self.store.prefetch(entry.stored):
                    self.stats.prefetched_tensors += 1
        if packed.on_device is not None:
            return packed.on_device
        stored = packed.stored
        if stored.tier != "device":
            self.stats.reloaded_bytes += stored.shape.numel() * stored.dtype.itemsize
        return self.store.load(stored)


@dataclass
class ActivationCheckpointing:
    """What `apply_activation_checkpointing` did."""

    layer_indices: list[int]
    """Indices of the checkpointed decoder layers (the first ones)."""
    total_layers: int
    offloader: ActivationOffloader | None
    """The host-offload hooks shared by those layers (None: no offload); `offloader.stats` counts bytes."""


@dataclass
class _LayerCheckpoint:
    index: int
    offloader: ActivationOffloader | None
    keep_attention: bool = False


class _KeptAttention:
    """The attention results of one checkpointed layer call (`AttentionKeeper`, models/kept_attention.py): each
    call's final lse and output packed into one byte tensor (lse first: fp32, so the output that follows starts
    aligned for any dtype), in the offloader's store as the layer's attention item, or on the device without one.
    The output (B, H, L, Dv) is kept in (B, L, H, Dv) order and given back as that memory's (B, H, L, Dv) view: the
    attention function hands it on to the output projection as (B, L, H, Dv), contiguous, so the recompute makes no
    copy of it, and the output projection saves the kept bytes themselves for its backward (as it saves the fused
    kernel's output, which has that layout).

    The checkpoint holds this object through its recompute closure, so the kept results live as long as the layer's
    graph: released after its backward, or with the graph."""

    def __init__(self, offloader: ActivationOffloader | None):
        self.offloader = offloader
        self.kept: list[tuple[object, torch.Size, torch.dtype, torch.Size, torch.dtype]] = []
        self.taken = 0

    def keep(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        split = lse.numel() * lse.element_size()
        blob = torch.empty(split + out.numel() * out.element_size(), dtype=torch.uint8, device=out.device)
        blob[:split].view(lse.dtype).view(lse.shape).copy_(lse.detach())
        _sequence_first(blob[split:], out.shape, out.dtype).copy_(out.detach())  # (B, L, H, Dv) in memory
        held = self.offloader.keep(blob) if self.offloader is not None else blob
        self.kept.append((held, out.shape, out.dtype, lse.shape, lse.dtype))

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        held, out_shape, out_dtype, lse_shape, lse_dtype = self.kept[self.taken]
        self.taken += 1
        blob = self.offloader.unpack(held) if self.offloader is not None else held
        split = lse_shape.numel() * lse_dtype.itemsize
        return _sequence_first(blob[split:], out_shape, out_dtype), blob[:split].view(lse_dtype).view(lse_shape)

    def __enter__(self):
        """The context of each recompute of the layer: the checkpoint enters the one object its context_fn gave every
        time it recomputes (a retained graph's second backward, zero bubble's weight gradient after the input
        gradient), so it starts again from the first call each time."""
        self.taken = 0
        self._replaying = replaying(self)
        self._replaying.__enter__()

    def __exit__(self, *exc):
        return self._replaying.__exit__(*exc)


def _sequence_first(data: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The (B, H, L, Dv) view `shape` of bytes `data` holding it in (B, L, H, Dv) order."""
    batch, heads, length, width = shape
    return data.view(dtype).view(batch, length, heads, width).transpose(1, 2)


@functools.cache
def _activation_name(forward) -> str:
    """The name of `forward`'s first parameter after self: the activation a layer or block takes first (a decoder
    layer's `hidden_states`, Llama 4's tower block's `hidden_state`)."""
    return list(inspect.signature(forward).parameters)[1]


def _checkpointed_forward(layer: nn.Module, *args, **kwargs):
    spec: _LayerCheckpoint = getattr(layer, CHECKPOINT_ATTR)
    name = _activation_name(type(layer).forward)
    if not args and name in kwargs:
        # Only positional tensors are saved through the hooks (and so offloaded): pass the activation that way, whatever
        # its caller calls it by keyword.
        activation = kwargs.pop(name)
        run = lambda hidden, **kw: type(layer).forward(layer, **{name: hidden}, **kw)  # noqa: E731
        args = (activation,)
    else:
        run = functools.partial(type(layer).forward, layer)
    scope = spec.offloader.layer_scope(spec.index) if spec.offloader is not None else contextlib.nullcontext()
    with scope:
        if spec.keep_attention:
            kept = _KeptAttention(spec.offloader)
            return checkpoint(run, *args, use_reentrant=False, context_fn=lambda: (keeping(kept), kept),
                              **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def _checkpointed_block_forward(block: nn.Module, *args, **kwargs):
    """A tower block's forward: checkpointed where a gradient flows through it, else plain (nothing to keep)."""
    inputs = [*args, *kwargs.values()]
    flows = any(p.requires_grad for p in block.parameters()) or any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    if torch.is_grad_enabled() and flows:
        return _checkpointed_forward(block, *args, **kwargs)
    return type(block).forward(block, *args, **kwargs)


def tower_blocks(vision: nn.Module, depth: int) -> nn.ModuleList:
    """The blocks of the vision module `vision`: its (outermost) list of `depth` modules, `depth` being its config's
    `num_hidden_layers`, so that no family's attribute path is named here."""
    for module in vision.modules():
        if isinstance(module, nn.ModuleList) and len(module) == depth:
            return module
    raise ValueError(f"{type(vision).__name__} has no list of its {depth} blocks: its tower cannot be checkpointed")


def apply_tower_checkpointing(
    vision: nn.Module, depth: int, offloader: ActivationOffloader | None = None,
) -> ActivationCheckpointing:
    """Checkpoint every block of the vision tower `vision` (its `depth` blocks, `tower_blocks`) in place, their saved
    inputs through `offloader` when given (its own: the tower runs before the language model's layers, on inputs
    whose size follows the step's images). A frozen block runs plainly (`_checkpointed_block_forward`)."""
    blocks = tower_blocks(vision, depth)
    if any(hasattr(block, CHECKPOINT_ATTR) for block in blocks):
        raise RuntimeError("the tower's blocks are already checkpointed: apply activation checkpointing once")
    for index, block in enumerate(blocks):
        setattr(block, CHECKPOINT_ATTR, _LayerCheckpoint(index, offloader))
        block.forward = types.MethodType(_checkpointed_block_forward, block)
    return ActivationCheckpointing(list(range(len(blocks))), len(blocks), offloader)


def remove_tower_checkpointing(vision: nn.Module, depth: int) -> None:
    """Undo `apply_tower_checkpointing`: the blocks run their own forward again (`longfit bench media` measures the
    tower both ways in one run of the trainer's setup)."""
    for block in tower_blocks(vision, depth):
        if hasattr(block, CHECKPOINT_ATTR):
            delattr(block, CHECKPOINT_ATTR)
            del block.forward  # the instance's override: the class's forward shows through again


def apply_activation_checkpointing(
    model: nn.Module,
    fraction: float = 1.0,
    offload: bool = False,
    min_offload_bytes: int = MIN_OFFLOAD_BYTES,
    offloader: ActivationOffloader | None = None,
    keep_attention: bool = False,
) -> ActivationCheckpointing:
    """Checkpoint the first `round(fraction * n_layers)` decoder layers in place (non-reentrant).

    With `offload`, their saved inputs leave device memory between forward and backward (tensors smaller
    than `min_offload_bytes` stay), into host memory, or where `offloader`'s store places them.
    `keep_attention` (#53): each layer's attention output and logsumexp are kept beside its input (with the
    offloader, in its store: it must be made with keep_attention too) and the recompute runs no attention kernel.
    Apply after context parallelism and before FSDP2; any order with peft.
    """
    assert 0.0 <= fraction <= 1.0, f"checkpoint fraction {fraction} outside [0, 1] (config.validate)"
    layers = decoder_layers(model)
    count = round(fraction * len(layers))
    if any(hasattr(layer, CHECKPOINT_ATTR) for layer in layers):
        raise RuntimeError("the decoder layers are already checkpointed: apply activation checkpointing once")
    if any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        raise RuntimeError(
            "transformers' own gradient checkpointing is enabled on this model: call "
            "model.gradient_checkpointing_disable() and let memory.activation_checkpointing do it"
        )
    if offloader is None and offload and count:
        offloader = ActivationOffloader(min_offload_bytes, layers=count, keep_attention=keep_attention)
    if keep_attention and offloader is not None and offloader.items_per_layer != 2:
        raise ValueError("keep_attention: make the offloader with keep_attention=True (its store keeps both)")
    for index in range(count):
        layer = layers[index]
        setattr(layer, CHECKPOINT_ATTR, _LayerCheckpoint(index, offloader, keep_attention))
        layer.forward = types.MethodType(_checkpointed_forward, layer)
    return ActivationCheckpointing(list(range(count)), len(layers), offloader)
