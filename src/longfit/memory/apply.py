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

from longfit.config import Config, ConfigError
from longfit.memory.checkpointing import ActivationOffloader, apply_activation_checkpointing
from longfit.memory.chunked_loss import default_loss_chunk
from longfit.memory.tiled_mlp import apply_tiled_mlp
from longfit.models.structure import decoder_layers, unwrap_peft

OFFLOAD_AUTO_MIN_SEQ_LEN = 32768
TILED_MLP_AUTO_MIN_SEQ_LEN = 8192


@dataclass
class MemorySwitches:
    """The `memory.*` settings with every "auto" decided."""

    activation_checkpointing: bool
    checkpoint_fraction: float
    offload_activations: bool
    tiled_mlp: bool
    mlp_tiles: int | None
    """None: derived per call from the tokens the MLP sees."""
    chunked_loss: bool
    loss_chunk: int | None
    """Tokens per loss chunk (None: full logits)."""
    optimizer: str


def resolve_memory_switches(cfg: Config, device: torch.device | str, vocab_size: int) -> MemorySwitches:
    """Decide the "auto" switches: offload on CUDA when seq_len >= 32768, tiled MLP when seq_len >= 8192."""
    memory = cfg.memory
    device = torch.device(device)
    if memory.mlp_tiles < 0:
        raise ConfigError(f"memory.mlp_tiles={memory.mlp_tiles}: use a positive tile count or 0 (derive)")
    if memory.loss_chunk < 0:
        raise ConfigError(f"memory.loss_chunk={memory.loss_chunk}: use a positive token count or 0 (derive)")
    if memory.offload_activations == "auto":
        offload = memory.activation_checkpointing and device.type == "cuda" and cfg.seq_len >= OFFLOAD_AUTO_MIN_SEQ_LEN
    else:
        offload = memory.offload_activations
    if offload and not memory.activation_checkpointing:
        raise ConfigError(
            "memory.offload_activations=true offloads the checkpointed layer inputs: "
            "set memory.activation_checkpointing=true too"
        )
    tiled = cfg.seq_len >= TILED_MLP_AUTO_MIN_SEQ_LEN if memory.tiled_mlp == "auto" else memory.tiled_mlp
    return MemorySwitches(
        activation_checkpointing=memory.activation_checkpointing,
        checkpoint_fraction=memory.checkpoint_fraction,
        offload_activations=offload,
        tiled_mlp=tiled,
        mlp_tiles=memory.mlp_tiles or None,
        chunked_loss=memory.chunked_loss,
        loss_chunk=(memory.loss_chunk or default_loss_chunk(vocab_size)) if memory.chunked_loss else None,
        optimizer=memory.optimizer,
    )


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
    switches = resolve_memory_switches(cfg, device, vocab_size)
    if switches.tiled_mlp:
        apply_tiled_mlp(model, switches.mlp_tiles)
    total = len(decoder_layers(model))
    if not switches.activation_checkpointing:
        return AppliedMemory(switches, 0, total, None)
    applied = apply_activation_checkpointing(model, switches.checkpoint_fraction, offload=switches.offload_activations)
    return AppliedMemory(switches, len(applied.layer_indices), total, applied.offloader)
