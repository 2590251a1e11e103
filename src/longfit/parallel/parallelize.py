"""`parallelize`: context parallelism, then the memory techniques, then FSDP2, on one CausalLMLoss."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from longfit.models.loading import compute_dtype
from longfit.models.structure import decoder_layers
from longfit.parallel.fsdp import apply_fsdp

if TYPE_CHECKING:
    from longfit.config import Config
    from longfit.memory.loss import CausalLMLoss
    from longfit.memory.switches import CheckpointPlacement
    from longfit.parallel.dims import ParallelDims, ParallelMesh


def apply_context_parallel(model: torch.nn.Module, group, method: str) -> str:
    """Route every decoder layer's attention through context-parallel attention over `group`.

    Returns the sequence layout ("zigzag" or "contiguous") that the batches must be sharded in
    (`longfit.parallel.batch.shard_batch`).
    """
    from longfit.parallel.context import ContextParallelAttention

    attention = ContextParallelAttention(group, method)
    for index, layer in enumerate(decoder_layers(model)):
        module = getattr(layer, "self_attn", None)
        if module is None:
            raise TypeError(f"decoder layer {index} ({type(layer).__name__}) has no `self_attn` attention module")
        module.longfit_context_parallel = attention
    return attention.layout


def autocast_dtype(dims: "ParallelDims", compute_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the forward runs under `torch.autocast`, or None for no autocast.

    Under FSDP2 the MixedPrecisionPolicy gathers parameters in the compute dtype, so autocast would only
    add casts; in fp32 there is nothing to cast. Otherwise (one rank, fp32 master weights) autocast
    runs the matmuls in the compute dtype.
    """
    return None if dims.fsdp_enabled or compute_dtype == torch.float32 else compute_dtype


def parallelize(
    loss_module: "CausalLMLoss",
    dims: "ParallelDims",
    cfg: "Config",
    mesh: "ParallelMesh",
    param_dtype: torch.dtype | None = None,
    checkpoint_placement: "CheckpointPlacement | None" = None,
) -> "CausalLMLoss":
    """Make `loss_module` (built on the caller's model, peft adapters already attached) train on `mesh`.

    `dims` come from `ParallelDims.from_config`, which has checked them against the sequence and the
    model's heads; nothing here checks a rule again.

    Order (torchtitan's: parallelize the math, then wrap for memory, then shard):
    1. Context parallelism, when cp > 1: each attention module gets a ContextParallelAttention over
       `mesh.cp_group` (cfg.parallel.cp_method). It attaches a callable and replaces no module, and it
       comes first so that a layer recomputed by activation checkpointing re-runs the same
       context-parallel attention, communication included.
    2. Memory techniques (`longfit.memory.apply_memory_techniques`: tiled decoder layers or activation
       checkpointing, offload of their inputs where `checkpoint_placement` (the planner's) puts them,
       tiled MLP) -- they wrap or patch the decoder layers, so they must exist before FSDP decides its
       units. A tiled layer takes its attention from step 1's callable, or without CP from
       `parallel.tiled_attention`.
    3. FSDP2 over the flattened dp_shard x cp mesh, when it has more than one rank or offloads the model
       states (parallel.cpu_offload, also on one rank): fully_shard on each
       (possibly checkpoint-wrapped) decoder layer, then on the root CausalLMLoss. Sharding the wrapper
       rather than wrapping a sharded layer keeps FSDP's all-gather outside the recomputed region: the
       forward gathers through the unit's pre-forward hook, the recomputation through its pre-backward
       hook, and no collective is replayed inside a checkpoint. peft must be applied before this call:
       it replaces Linear modules, which is impossible once FSDP turned parameters into DTensors.
       Frozen base weights and trainable adapters share FSDP units; FSDP2 tracks requires_grad per
       parameter and reduce-scatters only the gradients that exist.

    Batches must then be cut with `shard_batch(batch, mesh.cp_rank, dims.cp, layout)`, where layout is
    `cp_layout(cfg.parallel.cp_method)`; the loss is `loss_module(shard) / global_valid_tokens(...)`.
    Gradients after backward are those of the global mean loss (see `longfit.parallel.fsdp`).
    Returns `loss_module` (an FSDPModule when sharded).
    """
    from longfit.memory import apply_memory_techniques
    from longfit.parallel.tiled_attention import LocalTileAttention

    model = loss_module.model
    device = next(model.parameters()).device
    if dims.cp > 1:
        apply_context_parallel(model, mesh.cp_group, dims.cp_method)
    apply_memory_techniques(model, cfg, device, checkpoint_placement, tile_attention=LocalTileAttention.for_sequence)
    if dims.fsdp_enabled:
        apply_fsdp(
            loss_module,
            mesh.fsdp_mesh,
            param_dtype=param_dtype or compute_dtype(cfg.train.dtype, device),
            reshard_after_forward=cfg.parallel.reshard_after_forward,
            cpu_offload=cfg.parallel.cpu_offload,
        )
    return loss_module
