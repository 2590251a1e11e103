"""Single-device memory techniques, each switchable and exact (same loss and gradients on or off).

- checkpointing: per-decoder-layer activation checkpointing, optional host offload of the saved inputs;
- tiled_mlp: MLP over token tiles, recomputed per tile;
- tiled_layers: whole decoder layers over sequence tiles in forward, recompute and backward;
- offload: the store of offloaded layer inputs (GPU first, exact-size host arena, disk);
- chunked_loss: lm_head + cross-entropy without the full logits;
- optim: AdamW with fp32, bf16 or 8-bit state; the CUDA allocator setting;
- apply: `apply_memory_techniques(model, cfg, device)` resolving the `memory.*` config.

The names below are imported on first use, so `import longfit.memory` stays free of torch.
"""

import importlib

_EXPORTS = {
    "apply_activation_checkpointing": "checkpointing",
    "ActivationOffloader": "checkpointing",
    "OffloadStats": "checkpointing",
    "OffloadStore": "offload",
    "apply_tiled_layers": "tiled_layers",
    "apply_tiled_mlp": "tiled_mlp",
    "mlp_tile_count": "switches",
    "chunked_cross_entropy": "chunked_loss",
    "full_cross_entropy": "chunked_loss",
    "loss_chunk_tokens": "switches",
    "free_device_bytes": "loss",
    "build_optimizer": "optim",
    "BF16StateAdamW": "optim",
    "configure_cuda_allocator": "optim",
    "apply_memory_techniques": "apply",
    "release_offload_stores": "apply",
    "resolve_memory_switches": "switches",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'longfit.memory' has no attribute {name!r}")
    return getattr(importlib.import_module(f"longfit.memory.{_EXPORTS[name]}"), name)
