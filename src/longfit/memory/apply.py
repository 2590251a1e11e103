"""Resolve the `memory.*` switches of a Config and apply the model-side techniques.

Order: tiled MLP, then activation checkpointing (which nests it), both in place so the parameter names
stay the same. Call after peft wrapping or before (either works) and before FSDP2 (`parallelize` wraps the
already-checkpointed decoder layers). The loss settings are only resolved here; the trainer passes
`loss_chunk` to `chunked_cross_entropy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longfit.config import Config
from longfit.memory.checkpointing import (
    ActivationOffloader,
    apply_activation_checkpointing,
)
from longfit.memory.switches import MemorySwitches, resolve_memory_switches
from longfit.memory.tiled_mlp import apply_tiled_mlp
from longfit.models.structure import decoder_layers, unwrap_peft


@dataclass
class AppliedMemory:
    """What `apply_memory_techniques` did (for logs and the planner)."""

    switches: MemorySwitches
    checkpointed_layers: int
    total_layers: int
    offloader: ActivationOffloader | None
    """Counts offloaded bytes in `offloader.stats` (None without offload)."""

    def summary(self) -> str:
        s = self.switches
        parts = [
            f"checkpointing {self.checkpointed_layers}/{self.total_layers} layers"
            + (" + host offload" if self.offloader is not None else ""),
            f"tiled MLP ({s.mlp_tiles or 'auto'} tiles)" if s.tiled_mlp else "untiled MLP",
            f"chunked loss ({s.loss_chunk} tokens/chunk)" if s.chunked_loss else "full-logits loss",
            f"optimizer {s.optimizer}",
        ]
        return ", ".join(parts)


def apply_memory_techniques(model: nn.Module, cfg: Config, device: torch.device | str) -> AppliedMemory:
    """Apply tiled MLP and activation checkpointing/offload to `model` in place, as `cfg.memory` asks."""
    vocab_size = unwrap_peft(model).config.get_text_config().vocab_size
    switches = resolve_memory_switches(cfg, torch.device(device).type, vocab_size)
    if switches.tiled_mlp:
        apply_tiled_mlp(model, switches.mlp_tiles, intermediate_shards=cfg.parallel.tp)
    total = len(decoder_layers(model))
    if not switches.activation_checkpointing:
        return AppliedMemory(switches, 0, total, None)
    applied = apply_activation_checkpointing(model, switches.checkpoint_fraction, offload=switches.offload_activations)
    return AppliedMemory(switches, len(applied.layer_indices), total, applied.offloader)
