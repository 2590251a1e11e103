"""Resolve the `memory.*` switches of a Config and apply the model-side techniques.

Order: tiled decoder layers (the first `checkpoint_fraction` of the layers, when on: each is its own
checkpoint and runs its MLP per tile; the final norm then runs over tiles too) or else activation
checkpointing of those layers, and the tiled MLP on the layers that are not tiled whole; all in place,
so the parameter names stay the same. The
checkpointed layers' inputs (all but the first under tiled layers: `switches.stored_input_count`) go
through one `ActivationOffloader` whose `OffloadStore` follows the planner's `CheckpointPlacement` (GPU
first, host, disk). Call after peft wrapping or before (either
works, except with adapters on the input embedding: the first tiled layer's lookup hooks the embedding
module there is when it is applied, so wrap first) and before FSDP2 (`parallelize` wraps the already-checkpointed decoder layers). The loss
settings are only resolved here; the trainer passes `loss_chunk` to `chunked_cross_entropy`.
An image-text wrapper's vision tower (`media_encoder`, #54; Gemma 4's audio tower too, `MediaEncoder.towers`) has its
blocks checkpointed too whenever memory.activation_checkpointing is on (every block: checkpoint_fraction is the
language model's), each tower's inputs in a store of its own with memory.offload_activations (host, or disk with
memory.offload_dir; its slot the size of the first step's block input, or the planner's for the vision tower, larger
ones in plain host buffers), so the language model's planned placement is untouched.
The store holds its host arena and disk file from the first offloaded input on; whoever trains the model
calls `release_offload_stores` when its steps end (dropping the model releases them too, at the garbage
collector's pace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longfit.config import Config
from longfit.memory.checkpointing import (
    CHECKPOINT_ATTR,
    ActivationOffloader,
    apply_activation_checkpointing,
    apply_tower_checkpointing,
)
from longfit.memory.offload import OffloadStore
from longfit.memory.switches import (
    CheckpointPlacement,
    MemorySwitches,
    checkpointed_layer_count,
    kept_attention_bytes,
    resolve_memory_switches,
    stored_input_count,
)
from longfit.memory.tiled_layers import TILED_LAYER_ATTR, apply_tiled_layers
from longfit.memory.tiled_mlp import apply_tiled_final_norm, apply_tiled_mlp, untileable_mlp
from longfit.models.attention import layer_configs, layer_head_shape, layer_widths
from longfit.models.linear_attention import linear_attention_modules, untileable_layers
from longfit.models.structure import decoder_layers, unwrap_peft


@dataclass
class AppliedMemory:
    """What `apply_memory_techniques` did (for logs and the planner)."""

    switches: MemorySwitches
    checkpointed_layers: int
    total_layers: int
    offloader: ActivationOffloader | None
    """Counts offloaded bytes in `offloader.stats` and `offloader.store.stats` (None without offload)."""
    tiled_layers: int = 0
    """Of the checkpointed layers, those run over sequence tiles (all of them, or none)."""
    tower_blocks: int = 0
    """The vision tower's checkpointed blocks (#54; 0 without a tower or without checkpointing)."""

    def summary(self) -> str:
        s = self.switches
        if self.tiled_layers:
            checkpointing = f"tiled layers {self.tiled_layers}/{self.total_layers} ({s.layer_tiles or 'auto'} tiles)"
        else:
            checkpointing = f"checkpointing {self.checkpointed_layers}/{self.total_layers} layers"
        if self.offloader is not None:
            placement = self.offloader.store.placement
            checkpointing += " + offload" + (
                f" (GPU {placement.device}, host {placement.host}, disk {placement.disk} layers)" if placement else ""
            )
        if self.tower_blocks:
            checkpointing += f", the tower's {self.tower_blocks} blocks"
        parts = [
            checkpointing,
            f"tiled MLP ({s.mlp_tiles or 'auto'} tiles)" if s.tiled_mlp else "untiled MLP",
            f"chunked loss ({s.loss_chunk} tokens/chunk)" if s.chunked_loss else "full-logits loss",
            f"optimizer {s.optimizer}",
        ]
        return ", ".join(parts)


def apply_memory_techniques(
    model: nn.Module,
    cfg: Config,
    device: torch.device | str,
    placement: CheckpointPlacement | None = None,
    tile_attention=None,
    in_flight: int = 1,
    media_encoder: nn.Module | None = None,
) -> AppliedMemory:
    """Apply tiled layers or activation checkpointing/offload, and the tiled MLP, to `model` in place.

    `placement` is the planner's (`PlanResult.placement`: GPU-first, host, disk); None keeps every offloaded
    input on the host (or, with memory.offload_dir, on disk), `in_flight` micro-batches' of them at once (more than
    one on a pipeline stage: `longfit.parallel.pipeline.micro_batches_in_flight`). `tile_attention` builds a tiled
    layer's attention without context parallelism (longfit.parallel.tiled_attention.LocalTileAttention.for_sequence,
    which `parallelize` passes); it is needed only when memory.tiled_layers is on. `media_encoder`: the run's vision
    side (`longfit.models.media.MediaEncoder`), whose tower's blocks are checkpointed as well (module docstring).
    """
    vocab_size = unwrap_peft(model).config.get_text_config().vocab_size
    linear = bool(linear_attention_modules(model))
    switches = resolve_memory_switches(cfg, torch.device(device).type, vocab_size, linear_attention=linear,
                                       untileable_mlp=untileable_mlp(model), untileable_layers=untileable_layers(model))
    total = len(decoder_layers(model))
    checkpointed = checkpointed_layer_count(cfg, switches, total)
    offloader = None
    keep = switches.keep_attention
    if switches.offload_activations and checkpointed:
        stored = stored_input_count(checkpointed, switches.tiled_layers, keep)
        slot = kept_attention_slot(model, cfg) if keep and placement is None else 0
        store = OffloadStore(placement, stored, switches.offload_dir, switches.checkpoint_dtype, in_flight=in_flight,
                             slot_bytes=slot)
        offloader = ActivationOffloader(store=store, keep_attention=keep)
    tiled = checkpointed if switches.tiled_layers else 0
    if tiled:
        if tile_attention is None:
            raise ValueError(
                "memory.tiled_layers needs longfit.parallel's tile attention: call longfit.parallelize, or pass "
                "tile_attention=longfit.parallel.tiled_attention.LocalTileAttention.for_sequence"
            )
        apply_tiled_layers(model, tile_attention, tiled, switches.layer_tiles, offloader)
        apply_tiled_final_norm(model, switches.layer_tiles)
    if switches.tiled_mlp and tiled < total:
        apply_tiled_mlp(model, switches.mlp_tiles, start=tiled, intermediate_shards=cfg.parallel.tp)
    if checkpointed and not tiled:
        apply_activation_checkpointing(model, switches.checkpoint_fraction, offloader=offloader, keep_attention=keep)
    slots = placement.tower_slots if placement is not None else ()
    tower = checkpoint_tower(media_encoder, switches, in_flight, slots) if media_encoder is not None else 0
    return AppliedMemory(switches, checkpointed, total, offloader, tiled, tower)


def checkpoint_tower(media_encoder: nn.Module, switches: MemorySwitches, in_flight: int = 1,
                     slots: tuple[int, ...] = ()) -> int:
    """Checkpoint the blocks of `media_encoder`'s towers (`MediaEncoder.towers`: the vision tower, Gemma 4's audio
    tower) as `switches` say (module docstring), each tower's inputs in a store of its own; how many. `slots`: the
    least slot of each tower's store, in that order (`CheckpointPlacement.tower_slots`, the planner's heaviest row;
    0 or missing: the first input's size)."""
    if not switches.activation_checkpointing:
        return 0
    blocks = 0
    for index, (tower, depth) in enumerate(media_encoder.towers()):
        offloader = None
        if switches.offload_activations:
            store = OffloadStore(None, depth, switches.offload_dir, switches.checkpoint_dtype, in_flight=in_flight,
                                 slot_bytes=slots[index] if index < len(slots) else 0)
            offloader = ActivationOffloader(store=store)
        blocks += len(apply_tower_checkpointing(tower, depth, offloader).layer_indices)
    return blocks


def kept_attention_slot(model: nn.Module, cfg: Config) -> int:
    """The largest kept attention of a layer of `model` at this rank's tokens of `cfg` (`switches.kept_attention_bytes`)
    for a store planned without the planner; the kernel dtype taken as wide as the widest parameter (an upper bound:
    a slot that is too large only wastes host memory, one too small sends the item to an unplanned buffer)."""
    config = unwrap_peft(model).config.get_text_config()
    tokens = cfg.train.micro_batch * cfg.seq_len // max(1, cfg.parallel.cp)
    itemsize = max((p.element_size() for p in model.parameters() if p.is_floating_point()), default=4)
    widest = 0
    for layer in layer_configs(config):
        heads, _, head_dim = layer_head_shape(layer)
        widest = max(widest, kept_attention_bytes(tokens, heads // cfg.parallel.tp, layer_widths(layer, head_dim)[1],
                                                  itemsize))
    return widest


def offloaders(model: nn.Module) -> list[ActivationOffloader]:
    """The activation offloaders of `model`'s checkpointed and tiled layers, read from the layers themselves, so
    that `model` may be any wrapper of them (peft, `CausalLMLoss`, FSDP2)."""
    found = {}
    for module in model.modules():
        spec = getattr(module, CHECKPOINT_ATTR, None) or getattr(module, TILED_LAYER_ATTR, None)
        if spec is not None and spec.offloader is not None:
            found[id(spec.offloader)] = spec.offloader
    return list(found.values())


def release_offload_stores(model: nn.Module) -> None:
    """Give back the host arena (pinned on CUDA) and the disk file of every offload store in `model`, once its
    training steps are over; a later step would allocate them again."""
    for offloader in offloaders(model):
        offloader.store.close()
