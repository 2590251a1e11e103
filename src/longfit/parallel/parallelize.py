"""`parallelize`: the pipeline stage cut, tensor, expert and context parallelism, then the memory techniques, then FSDP2,
on one CausalLMLoss."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from longfit.models.loading import compute_dtype, materialize_model
from longfit.models.source import local_model_dir
from longfit.models.structure import decoder_layers
from longfit.parallel.fsdp import apply_fsdp

if TYPE_CHECKING:
    from longfit.config import Config
    from longfit.memory.loss import CausalLMLoss
    from longfit.memory.switches import CheckpointPlacement
    from longfit.parallel.dims import ParallelDims, ParallelMesh


def apply_context_parallel(model: torch.nn.Module, group, method: str) -> str:
    """Route every decoder layer's token mixing through its context-parallel form over `group`.

    Attention modules (`self_attn`) get a ContextParallelAttention; the linear-attention layers of hybrid
    models (`config.layer_types`, models/linear_attention.py) a ContextParallelLinearAttention in the same
    sequence layout (parallel/linear.py). Returns the layout ("zigzag" or "contiguous") that the batches must be
    sharded in (`longfit.parallel.batch.shard_batch`).
    """
    from longfit.models.document_mixers import refuse_context_parallel
    from longfit.models.linear_attention import linear_attention_modules
    from longfit.parallel.context import ContextParallelAttention
    from longfit.parallel.linear import ContextParallelLinearAttention

    refuse_context_parallel(model)
    attention = ContextParallelAttention(group, method)
    linear = ContextParallelLinearAttention(group, attention.layout)
    mixers = {id(module) for module in linear_attention_modules(model)}
    for index, layer in enumerate(decoder_layers(model)):
        module = getattr(layer, "self_attn", None)
        linear_mixers = [child for child in layer.children() if id(child) in mixers]
        if module is not None:
            module.longfit_context_parallel = attention
        elif linear_mixers:
            linear_mixers[0].longfit_context_parallel = linear
        else:
            raise TypeError(f"decoder layer {index} ({type(layer).__name__}) has no `self_attn` attention module")
    return attention.layout


def autocast_dtype(dims: "ParallelDims", compute_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the forward runs under `torch.autocast`, or None for no autocast.

    Under FSDP2 (always under tensor parallelism) the MixedPrecisionPolicy gathers parameters in the compute
    dtype, so autocast would only add casts; in fp32 there is nothing to cast. Otherwise (one rank, fp32 master weights) autocast
    runs the matmuls in the compute dtype.
    """
    return None if dims.fsdp_enabled or compute_dtype == torch.float32 else compute_dtype


def parallelize(
    loss_module: "CausalLMLoss",
    dims: "ParallelDims",
    cfg: "Config",
    mesh: "ParallelMesh",
    param_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    checkpoint_placement: "CheckpointPlacement | None" = None,
    shard: bool = True,
) -> "CausalLMLoss":
    """Make `loss_module` (built on the caller's model, peft adapters already attached) train on `mesh`.

    `dims` come from `ParallelDims.from_config`, which has checked them against the sequence and the
    model's heads; nothing here checks a rule again.

    Order (torchtitan's: cut the pipeline stage, parallelize the math, then wrap for memory, then shard):
    0. The pipeline stage cut, when pp > 1 (`longfit.parallel.pipeline`): the model keeps only the decoder layers of
       this rank's stages (`mesh.pp_rank`'s in the schedule's placement, cut by parallel.pp_layers), under their
       whole-model names, the embeddings with the first stage, the final norm and lm_head with the last; everything
       below applies to that part alone (tensor parallelism to the layers, embeddings and lm_head the stage holds,
       on the tp ranks of its (pp, dp_shard, cp) coordinate), FSDP2's root being each of the rank's stages, and the
       rank's objective (a `PipelineStageLoss`) is returned in place of `loss_module`. It removes modules, so it comes
       first (torchtitan's order: the stage's module, then TP, then FSDP2).
    1. Tensor parallelism, when tp > 1 (`longfit.parallel.tp`): the embedding, every decoder projection and
       lm_head are split over `mesh.tp_mesh`, norms and residual stream over the sequence; the loss gets the
       vocabulary-parallel collectives. It replaces parameters by DTensors and adds module hooks, so it
       precedes everything that wraps the layers, and peft (which replaces Linear modules) precedes it.
    2. Expert parallelism, when ep > 1 (`longfit.parallel.expert`): each MoE layer's experts are split over the ep
       ranks (DTensors on `mesh.expert_mesh`) and reached by all-to-all. Like tensor parallelism it replaces
       parameters by DTensors, so it precedes the wrappers and FSDP2, which shards each experts module over the
       ranks holding the same experts.
    3. Context parallelism, when cp > 1: each attention module gets a ContextParallelAttention over
       `mesh.cp_group` (cfg.parallel.cp_method), and the objective's vision side (#54), when cp or tp > 1, a
       DealtMedia that deals the rows' images over `mesh.rows_group`, the cp x tp ranks holding them (under tp its
       weights replicated over tp by step 1, `replicate_media`). It attaches a callable and replaces no module, and it
       comes before the memory techniques so that a layer recomputed by activation checkpointing re-runs the same
       context-parallel attention, communication included (tensor parallelism's too).
    4. Memory techniques (`longfit.memory.apply_memory_techniques`: tiled decoder layers or activation
       checkpointing, offload of their inputs where `checkpoint_placement` (the planner's; under pp this rank's
       stage's, with a slot per micro-batch in flight) puts them, tiled MLP) -- they wrap or patch the decoder
       layers, so they must exist before FSDP decides its units. A tiled layer takes its attention from step 3's
       callable, or without CP from `parallel.tiled_attention`.
    5. FSDP2 over the flattened dp_shard x cp mesh, when it has more than one rank, offloads the model
       states (parallel.cpu_offload, also on one rank) or tp > 1: fully_shard on each
       (possibly checkpoint-wrapped) decoder layer, then on the root CausalLMLoss. Sharding the wrapper
       rather than wrapping a sharded layer keeps FSDP's all-gather outside the recomputed region: the
       forward gathers through the unit's pre-forward hook, the recomputation through its pre-backward
       hook, and no collective is replayed inside a checkpoint. peft must be applied before this call:
       it replaces Linear modules, which is impossible once FSDP turned parameters into DTensors.
       Frozen base weights and trainable adapters share FSDP units; FSDP2 tracks requires_grad per
       parameter and reduce-scatters only the gradients that exist. Under tp each parameter's tp slice is
       sharded further (2-D DTensors on ("dp_shard_cp", "tp")).
    6. Materialisation, when the model was built on the meta device (`longfit.models.build`): each rank
       allocates the part of every parameter it holds on `device` (in host memory when FSDP2 offloads
       the model states) and fills it: the checkpoint's slices, or the seeded initialisation, the same
       values as one process (`longfit.models.loading.materialize_model`). No rank ever holds the
       whole model.

    Batches must then be cut with `shard_batch(batch, mesh.cp_rank, dims.cp, layout)`, where layout is
    `cp_layout(cfg.parallel.cp_method)` (every tp rank of a (dp_shard, cp) coordinate feeds the same shard);
    the loss is `loss_module(shard, step_label_tokens=T) / T`, T = `global_valid_tokens(shard.labels, mesh.world_group)`.
    Gradients after backward are those of the global mean loss (see `longfit.parallel.fsdp`).
    `device`: where the model trains; default: where its parameters are (for a model not on the meta device).
    `shard=False` leaves out step 5: every rank keeps the whole model (the memory planner's trace of a Trainer under
    DDP, `longfit.plan.trace.trace_step(replicated=True)`).
    Returns `loss_module` (an FSDPModule when sharded), or under pp this rank's stage of it, which
    `longfit.parallel.pipeline.Pipeline` runs.
    """
    from longfit.memory import apply_memory_techniques
    from longfit.parallel.tiled_attention import LocalTileAttention

    in_flight = 1  # micro-batches whose checkpointed inputs the offload store holds at once
    if dims.pp > 1:
        from longfit.parallel.dims import PIPELINE_SCHEDULES, splits_backward
        from longfit.parallel.pipeline import cut_stage, micro_batches_in_flight, rank_stages

        placement = PIPELINE_SCHEDULES[cfg.parallel.pp_schedule][1]
        stages = rank_stages(mesh.pp_rank, dims.pp, dims.pp_stages_per_rank, placement)
        loss_module = cut_stage(loss_module, stages, dims.pipeline_stages, cfg.parallel.pp_layers)
        loss_module.backward_twice = splits_backward(cfg.parallel.pp_schedule)
        in_flight = micro_batches_in_flight(cfg.parallel.pp_schedule, dims.pp, mesh.pp_rank, cfg.train.grad_accum)
    model = loss_module.model
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if dims.cp > 1:  # before tp, whose linear-attention kernels run cp's on their heads (parallel/tp.py)
        apply_context_parallel(model, mesh.cp_group, dims.cp_method)
    if dims.tp > 1:
        from longfit.parallel.tp import apply_tensor_parallel

        apply_tensor_parallel(loss_module, mesh.tp_mesh)
        if loss_module.media_encoder is not None:
            from longfit.parallel.tp import replicate_media

            replicate_media(loss_module.media_encoder, mesh.tp_mesh)
    if dims.ep > 1:
        from longfit.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, mesh.expert_mesh)
    if (dims.cp > 1 or dims.tp > 1) and loss_module.media_encoder is not None:
        from longfit.parallel.media import DealtMedia

        loss_module.media_features = DealtMedia(mesh.rows_group)  # the rows' images dealt (parallel/media.py)
    loss_module.router_group = mesh.world_group  # a MoE router loss's counts are those of every token (router_loss.py)
    apply_memory_techniques(model, cfg, device, checkpoint_placement, tile_attention=LocalTileAttention.for_sequence,
                            in_flight=in_flight, media_encoder=getattr(loss_module, "media_encoder", None))
    if dims.fsdp_enabled and shard:
        apply_fsdp(
            loss_module,
            mesh.fsdp_mesh,
            param_dtype=param_dtype or compute_dtype(cfg.train.dtype, device),
            reshard_after_forward=cfg.parallel.reshard_after_forward,
            cpu_offload=cfg.parallel.cpu_offload,
            expert_mesh=mesh.expert_mesh,
            **({} if dims.pp == 1 else {
                "roots": loss_module.virtual_stages,
                "loss_root": next((v for v in loss_module.virtual_stages if v.index == dims.pipeline_stages - 1), None),
            }),
        )
        if dims.pp > 1:
            loss_module.gradient_scale = float(mesh.fsdp_mesh.size())
    params_device = torch.device("cpu") if dims.offload_model_states and shard else None
    materialize_model(model, device, cfg.train.seed, checkpoint=local_model_dir(cfg.model), params_device=params_device)
    return loss_module
