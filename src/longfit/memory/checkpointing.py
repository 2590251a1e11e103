"""Per-decoder-layer activation checkpointing, optionally keeping the checkpointed layer inputs in host memory.

Non-reentrant `torch.utils.checkpoint` keeps only a layer's positional tensor inputs (for a Hugging Face
decoder layer: the residual stream `hidden_states` (B, L, H)) and recomputes everything else in backward.
Keyword tensors (rotary cos/sin, position_ids, cu_seq_lens_q) are held by reference, once for all layers.
Those saved inputs go through the `saved_tensors_hooks` active around the `checkpoint` call, which is where
`ActivationOffloader` moves them to host memory:

- forward (pack): the side stream waits for the compute stream, copies the tensor into a pinned host buffer
  and `record_stream` keeps the device block from being reused before that copy has run;
- backward (unpack of layer i): the host->device copy of the previous checkpointed layer's input starts on
  the side stream, so it overlaps layer i's recompute and backward; layer i's own input was prefetched the
  same way when layer i+1 unpacked (the last layer, first in backward, loads on demand);
- a tensor handed to several layers (the same object, e.g. a rotary table passed positionally) is copied at
  most once: from its second sighting on, every layer keeps it by reference on the device;
- tensors below `min_offload_bytes` and non-contiguous ones stay where they are.
On CPU the same hooks run and the "host copy" is a plain CPU clone, so tests exercise the whole mechanism.

Layers are wrapped in place by overriding the instance's `forward`: parameter names, `state_dict` keys, peft
adapters and DCP checkpoints are the same with checkpointing on or off, and FSDP2's `fully_shard` (applied
later, per layer) keeps its hooks outside the checkpoint, so a recompute never all-gathers twice.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longfit.models.structure import decoder_layers

CHECKPOINT_ATTR = "longfit_activation_checkpoint"


@dataclass
class OffloadStats:
    """Counters of one `ActivationOffloader` since its creation."""

    offloaded_bytes: int = 0
    """Bytes copied device -> host in forward."""
    reloaded_bytes: int = 0
    """Bytes copied host -> device in backward."""
    offloaded_tensors: int = 0
    prefetched_tensors: int = 0
    """Reloads started ahead of their unpack (while the next layer's backward runs)."""
    deduplicated_tensors: int = 0
    """Repeat sightings of one tensor object by later layers, kept by reference instead of copied again."""
    kept_tensors: int = 0
    """Saved inputs left in place: small or non-contiguous."""


class _SavedInput:
    """One saved layer input: a host copy (plus its device copy while reloaded) or a device reference."""

    __slots__ = ("device", "layer", "host", "reloaded", "h2d_done", "on_device", "__weakref__")

    def __init__(self, device: torch.device, layer: _LayerSaves):
        self.device = device
        self.layer = layer
        self.host: torch.Tensor | None = None
        self.reloaded: torch.Tensor | None = None
        self.h2d_done: torch.cuda.Event | None = None
        self.on_device: torch.Tensor | None = None


@dataclass
class _LayerSaves:
    """One checkpointed layer call of a forward pass, linked to the previous one for the backward prefetch.

    Entries are held weakly (autograd owns them), so a layer's host copies die with its saved tensors.
    """

    layer_index: int
    previous: _LayerSaves | None
    entries: list[weakref.ref] = field(default_factory=list)


class ActivationOffloader:
    """saved_tensors_hooks moving checkpointed layer inputs to host memory (see the module docstring)."""

    def __init__(self, min_offload_bytes: int = 1 << 20):
        self.min_offload_bytes = min_offload_bytes
        self.stats = OffloadStats()
        self._stream: torch.cuda.Stream | None = None
        self._last_layer: _LayerSaves | None = None
        # id(tensor) -> (weakref to the tensor, weakref to its _SavedInput); identity is confirmed through the
        # tensor weakref, so an id reused by a new tensor after the old one died never matches.
        self._seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    @contextlib.contextmanager
    def layer_scope(self, layer_index: int):
        """Offload what is saved inside this scope as the inputs of checkpointed layer `layer_index`."""
        if self._last_layer is not None and layer_index <= self._last_layer.layer_index:
            # A new forward pass (or micro-batch): its backward prefetch chain starts fresh.
            self._last_layer = None
            self._seen.clear()
        layer = _LayerSaves(layer_index, self._last_layer)
        self._last_layer = layer
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, layer), self._unpack):
            yield

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, layer: _LayerSaves, tensor: torch.Tensor):
        known = self._seen.get(id(tensor))
        entry = known[1]() if known is not None and known[0]() is tensor else None
        if entry is not None:
            if entry.on_device is None:
                # Shared by several layers, hence alive on the device anyway: keep a reference and drop the
                # host copy (the pinned host allocator holds the block until the in-flight copy has run).
                entry.on_device, entry.host = tensor, None
            self.stats.deduplicated_tensors += 1
            return entry
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_offload_bytes or not tensor.is_contiguous():
            self.stats.kept_tensors += 1
            return tensor
        entry = _SavedInput(tensor.device, layer)
        if tensor.device.type == "cuda":
            stream = self._side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor has been produced
            with torch.cuda.stream(stream):
                entry.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                entry.host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its block is not reused before the copy has run
        else:
            entry.host = tensor.detach().clone()
        layer.entries.append(weakref.ref(entry))
        self._seen[id(tensor)] = (weakref.ref(tensor), weakref.ref(entry))
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += nbytes
        return entry

    def _unpack(self, packed):
        if not isinstance(packed, _SavedInput):
            return packed
        previous = packed.layer.previous
        if previous is not None:
            for ref in previous.entries:
                entry = ref()
                if entry is not None and entry.host is not None and entry.reloaded is None:
                    self._start_reload(entry)
                    self.stats.prefetched_tensors += 1
        return self._take(packed)

    def _start_reload(self, entry: _SavedInput) -> None:
        self.stats.reloaded_bytes += entry.host.numel() * entry.host.element_size()
        if entry.device.type == "cuda":
            # Same side stream as the device->host copy, so it reads a finished host buffer; allocated there,
            # so no compute-stream work can still be using the block.
            stream = self._side_stream(entry.device)
            with torch.cuda.stream(stream):
                entry.reloaded = entry.host.to(entry.device, non_blocking=True)
                entry.h2d_done = stream.record_event()
        else:
            entry.reloaded = entry.host.clone()

    def _take(self, entry: _SavedInput) -> torch.Tensor:
        if entry.on_device is not None:
            return entry.on_device
        if entry.reloaded is None:
            self._start_reload(entry)
        tensor, entry.reloaded = entry.reloaded, None
        if entry.device.type == "cuda":
            compute = torch.cuda.current_stream(entry.device)
            compute.wait_event(entry.h2d_done)
            tensor.record_stream(compute)  # freed by the compute stream once the recompute is done with it
            entry.h2d_done = None
        return tensor


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


def _checkpointed_forward(layer: nn.Module, *args, **kwargs):
    spec: _LayerCheckpoint = getattr(layer, CHECKPOINT_ATTR)
    if not args and "hidden_states" in kwargs:
        # Only positional tensors are saved through the hooks (and so offloaded): pass the activation that way.
        hidden_states = kwargs.pop("hidden_states")
        run = lambda hidden, **kw: type(layer).forward(layer, hidden_states=hidden, **kw)  # noqa: E731
        args = (hidden_states,)
    else:
        run = functools.partial(type(layer).forward, layer)
    scope = spec.offloader.layer_scope(spec.index) if spec.offloader is not None else contextlib.nullcontext()
    with scope:
        return checkpoint(run, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(
    model: nn.Module, fraction: float = 1.0, offload: bool = False, min_offload_bytes: int = 1 << 20
) -> ActivationCheckpointing:
    """Checkpoint the first `round(fraction * n_layers)` decoder layers in place (non-reentrant).

    With `offload`, their saved inputs live in host memory between forward and backward (tensors smaller
    than `min_offload_bytes` stay). Apply after context parallelism and before FSDP2; any order with peft.
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
    offloader = ActivationOffloader(min_offload_bytes) if offload and count else None
    for index in range(count):
        layer = layers[index]
        setattr(layer, CHECKPOINT_ATTR, _LayerCheckpoint(index, offloader))
        layer.forward = types.MethodType(_checkpointed_forward, layer)
    return ActivationCheckpointing(list(range(count)), len(layers), offloader)
