"""longfit inside a transformers `Trainer` or TRL `SFTTrainer` script, without a fork of their loop.

    trainer = SFTTrainer(model=model, args=SFTConfig(..., padding_free=True), train_dataset=dataset)
    apply_longfit(trainer, "parallel.cp=2", "memory.tiled_mlp=true")   # longfit's `key=value` settings
    trainer.train()                                                    # under torchrun / accelerate launch

Before paying for GPUs, `check_trainer(trainer, "parallel.cp=2", ...)` answers whether longfit computes the
trainer's model exactly under those settings (`longfit check` on a shrunken copy of it, on the CPU; one process
of the script is enough).

`apply_longfit` checks the run and changes the trainer through its extension points, before `train()`:
- the preflight (`longfit.plan.preflight`) of a longfit Config read off the trainer (seq_len, micro-batch,
  accumulation, dtype, model) and the given settings: every rule tying them to the world size, the model and
  the device, and the memory plan's refusal, before anything is built; then `longfit check`'s verdict on the model
  under those settings (`longfit.check.gate`: cached on disk, a model it does not call exact refused in one line
  unless train.accept_inexact=true);
- dropout off (train.disable_dropout, the default: p=0 on every dropout module and dropout number of the model's
  modules, peft's LoRA dropout excepted; its config, which the Trainer saves, unchanged);
- the model's attention becomes longfit's ("longfit"), routed through ring or Ulysses attention over the cp
  ranks of longfit's own mesh ("dp_shard", "cp") when parallel.cp > 1; the memory techniques (checkpointing
  with the offload store, tiled layers, tiled MLP) are applied to its decoder layers in place, so parameter
  names, saving and peft stay the user's;
- the data collator becomes `ShardingCollator`: it reads the documents of every row from its position_ids
  (restarting at 0 per document, as TRL's padding-free collator gives them) or its right padding, pads rows to
  the sequence granule, shifts the labels inside each document and cuts this rank's shard along the sequence
  (`parallel.batch.shard_batch`), with the global cu_seqlens and `DocumentLayout` the attention needs;
- the mesh is handed to Accelerate (`AcceleratorState.device_mesh`), whose data loader then gives the cp ranks
  of one dp coordinate the same batches;
- the loss: SFTTrainer's own fused (chunked) LM head scores the shifted shard labels (`shift_labels`); for a
  plain Trainer the model's forward becomes longfit's `CausalLMLoss` (chunked loss when memory.chunked_loss).
  Either way the Trainer divides the summed loss by its `num_items_in_batch`, the label tokens of every rank
  and micro-batch of the step (it counts the `shift_labels` of the shards and sums them over all ranks), and
  multiplies it by the number of processes, which Accelerate's DDP (or FSDP2's reduce-scatter, below) averages
  the gradients over again: the gradients are exactly those of the global mean loss over the step's tokens, as in
  longfit's own loop;
- a mixture-of-experts router loss (the model's config sets `output_router_logits`): TRL's SFTTrainer adds its own
  (`router_aux_loss_coef`, the config's by default), transformers' aux of each micro-batch's forward on each rank,
  divided by the micro-batches accumulated, which data parallelism averages: the mean over the step's micro-batches
  of their own aux, gradient accumulation included, as `longfit train train.router_loss=micro_batch` computes it
  (memory/router_loss.py says why that is not longfit's default). Under cp > 1 a rank's tokens are shards of the
  micro-batch's sequences, so the aux TRL reads is made that of the whole micro-batch (`LossForward`: the routing
  counts all-reduced over the cp ranks), and tiled layers, whose routers' logits carry no gradient, give their
  routers' probability sums to it as to longfit's loss. A plain Trainer's loss adds longfit's instead, its routing
  counts all-reduced over the dp x cp ranks (`train.router_loss=step`), equal to the model's own loss on one
  process; the Trainer backpropagates each micro-batch before the next one's routes are counted, so
  gradient_accumulation_steps > 1 is refused there. Either way a padded batch is refused: transformers leaves the
  padding tokens out of the routers' counts (its attention mask), longfit's rows have no mask.

Who holds the model states is the launch's (`launch_mode`):
- torchrun, or `accelerate launch` without FSDP: Accelerate's DDP, every rank holds the whole model, its gradients
  (the views of DDP's buckets, `gradient_as_bucket_view`) and optimizer state, and the plan counts them so
  (`Setup.replicated`: whole, fp32 weights under autocast in bf16, the gradients there from the step's start);
- `accelerate launch` with an FSDP2 config (distributed_type: FSDP, fsdp_version: 2, examples/accelerate/fsdp2.yaml):
  longfit shards them with FSDP2 over the dp_shard x cp ranks, as its own trainer does (`longfit.parallel.fsdp`: a
  unit per decoder layer, wrapped by the memory techniques first, then the root), under the plugin's mixed
  precision (bf16: parameters gathered in bf16, as Accelerate sets it), reshard_after_forward and CPU offload, before
  `train()`, and the plan is longfit's trainer's. Accelerate's `fsdp2_prepare_model` then leaves the FSDPModule as
  it is, so the Trainer's optimizer, clipping, save and resume take Accelerate's FSDP2 paths on longfit's units (with
  sharded state dicts, where the Trainer saves only the shards, a peft model's adapter is written beside them:
  `AdapterFromShards`). An Accelerate `parallelism_config` may set the degrees (dp_shard_size, cp_size; tp, sp and
  HSDP replicas are refused); Accelerate's FSDP1, its activation checkpointing and DeepSpeed (ZeRO-3 included) are
  refused in one line each.

One mesh: longfit's, handed to Accelerate, rather than Accelerate's adopted. longfit's `ParallelDims` owns the rules
its ring / Ulysses attention, the planner and the sharding collator rely on (the sequence granule, the heads, the
expert mesh) and builds the mesh they address by name ("dp_shard", "cp", the flattened FSDP axis); Accelerate builds
a mesh only with a `parallelism_config`, whose cp axis it wires to torch's context parallel (SDPA only, no packed
documents, windows or softcaps), and the Trainer then divides the label-token count by cp, where longfit's shards
count each token once. So Accelerate's degrees become longfit's settings, its `parallelism_config` is dropped, and
longfit's mesh is its `device_mesh`: the same ("dp_shard", "cp") layout, which its data loader reads.
On the CPU Accelerate 1.15 has no FSDP (an FSDP launch runs as MULTI_CPU and drops its plugin); apply_longfit builds
the plugin from the launch's environment as Accelerate would and makes the Trainer's an FSDP2 run (Accelerate's and
its PartialState's distributed_type FSDP, the Trainer's is_fsdp_enabled), so the same script and config run on gloo
ranks, saving and resuming included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from longfit.config import Config, ConfigError, load_config, parse_override

if TYPE_CHECKING:
    import torch

    from longfit.memory.apply import AppliedMemory
    from longfit.parallel.dims import ParallelDims, ParallelMesh
    from longfit.plan.result import PlanResult

# The settings apply_longfit takes; everything else about the run is the trainer's (its TrainingArguments).
SETTINGS = ("model", "seq_len", "parallel.cp", "parallel.cp_method", "memory.", "rope.",
            "train.disable_dropout", "train.accept_inexact")  # memory.optimizer: the Trainer's optim


PREFERENCE_TRAINERS = ("DPOTrainer", "CPOTrainer", "ORPOTrainer")
"""TRL's trainers of preference pairs, by class name (TRL is not imported to ask)."""


def refuse_trainer_options(trainer) -> None:
    """One line per Trainer option that cannot work with longfit, naming the fix (ConfigError)."""
    from longfit.models.structure import unwrap_peft

    args = trainer.args
    tp_size = getattr(unwrap_peft(trainer.model), "tp_size", None) or 1  # from_pretrained(tp_plan=...) sets it
    refusals = [
        (any(cls.__name__ in PREFERENCE_TRAINERS for cls in type(trainer).__mro__), f"{type(trainer).__name__} trains "
         "on preference pairs, which apply_longfit does not route: run `longfit train train.objective=dpo` (or ipo, "
         "simpo, orpo) on the pairs' JSONL, each prompt computed once for both answers (#56)"),
        (bool(args.fsdp), "the Trainer's FSDP (fsdp=...) wraps the model with FSDP1 or its own FSDP2 units; remove it "
         "and launch with an Accelerate config of fsdp_version: 2 (longfit shards the model with FSDP2 there)"),
        (tp_size > 1, f"the model was loaded with a tp_plan (tensor parallelism over {tp_size} ranks), which longfit's "
         "attention and memory techniques do not run inside a Trainer; load it without tp_plan and shard it with an "
         "Accelerate FSDP2 launch, or train with `longfit train parallel.tp=N`"),
        (args.n_gpu > 1, f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel): launch one process per GPU with "
         "torchrun or accelerate launch"),
        (args.fp16, "fp16=True: use bf16=True (longfit trains in bf16 or fp32)"),
        (getattr(args, "use_liger_kernel", False), "use_liger_kernel=True patches the model's layers that longfit "
         "wraps; set it to False"),
        (args.torch_compile, "torch_compile=True: set it to False (longfit's attention and memory techniques are not "
         "traced by torch.compile)"),
        (not args.average_tokens_across_devices, "average_tokens_across_devices=False: set it to True, the loss is "
         "normalised by the label tokens of all ranks"),
        (args.label_smoothing_factor > 0, "label_smoothing_factor > 0: set it to 0 (longfit's loss is the plain "
         "token cross-entropy)"),
        (trainer.compute_loss_func is not None, "compute_loss_func=...: remove it, the loss is longfit's"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"apply_longfit: {why}")


def launch_mode(trainer) -> str:
    """Who holds the model states, as the script was launched: "fsdp2" under an Accelerate config of
    `distributed_type: FSDP` and `fsdp_version: 2` (longfit shards them over its dp_shard x cp ranks), else "ddp"
    (torchrun, `accelerate launch` without FSDP, one process: every rank holds them whole). DeepSpeed and FSDP1 are
    refused in one line. On the CPU Accelerate 1.15 runs an FSDP launch as MULTI_CPU and drops its FSDP plugin, so
    the launch is read from the environment `accelerate launch` sets (ACCELERATE_USE_FSDP, FSDP_VERSION, FSDP_*).
    Accelerate's own activation checkpointing is refused too: longfit's wraps the layers."""
    import os

    state = trainer.accelerator.state
    if (trainer.args.deepspeed or getattr(state, "deepspeed_plugin", None) is not None
            or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"):
        raise ConfigError(
            "apply_longfit: DeepSpeed (ZeRO-3 or another stage) runs the model inside its own engine, whose "
            "partitioned parameters and gradient hooks longfit's attention, memory techniques and sharding are not "
            "wired to; launch with an Accelerate config of distributed_type: FSDP and fsdp_version: 2 instead, whose "
            "sharded model states are ZeRO-3's (examples/accelerate/fsdp2.yaml)"
        )
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return "ddp"
    version = plugin.fsdp_version if plugin is not None else int(os.environ.get("FSDP_VERSION", "1"))
    if version != 2:
        raise ConfigError(
            f"apply_longfit: the Accelerate config sets fsdp_version: {version}; set fsdp_version: 2 (FSDP1 flattens "
            "the parameters longfit's techniques and peft address by name)"
        )
    if fsdp2_plugin(trainer).activation_checkpointing:
        raise ConfigError(
            "apply_longfit: fsdp_activation_checkpointing: true in the Accelerate config wraps the layers longfit "
            "has wrapped; set it to false (memory.activation_checkpointing, with the offload store, does it)"
        )
    # one process holds the whole model whatever the launch: nothing to shard
    return "fsdp2" if trainer.args.world_size > 1 else "ddp"


def fsdp2_plugin(trainer):
    """Accelerate's FSDP2 plugin of the launch: the accelerator's, or on the CPU, where Accelerate drops it
    (`launch_mode`), the one Accelerate builds from the launch's FSDP_* environment, its mixed precision set from
    the accelerator's as Accelerate sets it on CUDA."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is None:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
    return plugin


def accelerate_degrees(parallelism_config, world_size: int) -> dict[str, str]:
    """longfit's settings for the degrees an Accelerate `ParallelismConfig` sets under FSDP2 (its dp_shard x cp
    ranks are longfit's mesh), refusing in one line the axes longfit has no place for here."""
    if parallelism_config is None:
        return {}
    pc = parallelism_config
    refusals = [
        (pc.dp_replicate_size > 1 and (pc.dp_shard_size > 1 or pc.cp_size > 1 or pc.tp_size > 1),
         f"parallelism_config_dp_replicate_size={pc.dp_replicate_size} (HSDP): longfit shards over every dp x cp "
         "rank; set dp_shard_size instead"),
        (pc.sp_size > 1, f"parallelism_config_sp_size={pc.sp_size} is DeepSpeed's Ulysses; use cp_size (longfit's "
         "ring or Ulysses, parallel.cp_method)"),
        (pc.tp_size > 1, f"parallelism_config_tp_size={pc.tp_size}: tensor parallelism is not available inside a "
         "Trainer yet; set tp_size: 1 and shard over dp_shard x cp"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"apply_longfit: {why}")
    if pc.dp_shard_size * pc.cp_size not in (1, world_size):
        raise ConfigError(
            f"apply_longfit: parallelism_config's dp_shard_size x cp_size = {pc.dp_shard_size * pc.cp_size} but "
            f"{world_size} processes were launched; make their product the number of processes"
        )
    return {"parallel.cp": str(pc.cp_size)} if pc.cp_size > 1 else {}


def trainer_config(trainer, overrides: tuple[str, ...]) -> Config:
    """The longfit Config of the trainer's run: its TrainingArguments, and `overrides` (SETTINGS only) on top."""
    from longfit.models.presets import PRESETS
    from longfit.models.source import local_model_dir
    from longfit.models.structure import unwrap_peft

    for text in overrides:
        key = parse_override(text)[0]
        if key != "memory.optimizer" and any(key == s or (s.endswith(".") and key.startswith(s)) for s in SETTINGS):
            continue
        if key in ("parallel.reshard_after_forward", "parallel.cpu_offload"):
            why = (f"{key} is the Accelerate config's under FSDP2 (fsdp_reshard_after_forward, fsdp_offload_params); "
                   "set it there")
        elif key.startswith("parallel."):
            why = (f"{key} is not available inside a Trainer: use parallel.cp (and an Accelerate FSDP2 launch to "
                   "shard the model states)")
        else:
            why = f"{key} is the trainer's to decide: set the matching TrainingArguments / SFTConfig field instead"
        raise ConfigError(f"apply_longfit: {why} (apply_longfit takes {', '.join(SETTINGS)}*)")
    args = trainer.args
    given = {parse_override(text)[0]: parse_override(text)[1] for text in overrides}
    launch = launch_mode(trainer)
    pc = trainer.accelerator.parallelism_config
    if launch == "ddp" and pc is not None and (pc.cp_size > 1 or pc.tp_size > 1 or pc.dp_shard_size > 1):
        raise ConfigError(
            "apply_longfit: Accelerate's parallelism_config (cp / tp / dp_shard sizes) needs an FSDP2 launch "
            "(distributed_type: FSDP, fsdp_version: 2); or remove it and set parallel.cp in apply_longfit"
        )
    degrees = accelerate_degrees(pc, args.world_size) if launch == "fsdp2" else {}
    for key, value in degrees.items():
        if key in given and str(given[key]) != value:
            raise ConfigError(
                f"apply_longfit: {key}={given[key]} but the Accelerate config's parallelism_config sets {value}; "
                "set one of them"
            )
    padding_free = getattr(trainer, "padding_free", False)
    rows = 1 if padding_free else args.per_device_train_batch_size
    derived = [
        f"train.micro_batch={rows}",
        f"train.grad_accum={args.gradient_accumulation_steps}",
        f"train.dtype={'bf16' if args.bf16 else 'fp32'}",
        f"train.seed={args.seed}",
        f"train.max_grad_norm={args.max_grad_norm or 0}",
    ] + [f"{key}={value}" for key, value in degrees.items() if key not in given]
    if launch == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin = fsdp2_plugin(trainer)
        derived += [f"parallel.reshard_after_forward={str(plugin.reshard_after_forward).lower()}",
                    f"parallel.cpu_offload={str(isinstance(plugin.cpu_offload, CPUOffloadPolicy)).lower()}"]
    if "model" not in given:
        name = unwrap_peft(trainer.model).config.name_or_path
        if not (name in PRESETS or (name and local_model_dir(name) is not None)):
            raise ConfigError(
                f"apply_longfit: the model's name_or_path {name!r} is neither a longfit preset nor a local directory, "
                "so the planner cannot read its shape: pass model=<its local directory or preset>"
            )
        derived.append(f"model={name}")
    if "seq_len" not in given:
        max_length = getattr(args, "max_length", None)
        if not max_length:
            raise ConfigError("apply_longfit: the rows' length is unknown: pass seq_len=<the longest row, in tokens>")
        # padding-free rows concatenate the batch's packed sequences into one row
        derived.append(f"seq_len={max_length * (args.per_device_train_batch_size if padding_free else 1)}")
    return load_config(None, derived + list(overrides))


@dataclass
class LongfitRun:
    """What `apply_longfit` set up on a trainer."""

    config: Config
    plan: "PlanResult"
    dims: "ParallelDims"
    mesh: "ParallelMesh"
    memory: "AppliedMemory"


def apply_longfit(trainer, *overrides: str, check_fit: bool = True) -> LongfitRun:
    """Make `trainer` (a transformers Trainer or TRL SFTTrainer, before `train()`) train with longfit.

    `overrides` are longfit settings as on the command line ("parallel.cp=2", "memory.tiled_layers=true",
    "seq_len=16384", "model=<dir>"); the rest comes from the trainer's arguments. `check_fit=False` trains even
    if the planner predicts that the run does not fit (`longfit train --force`). Call it on every rank.
    """
    from longfit.check.gate import require_exact
    from longfit.memory.apply import apply_memory_techniques
    from longfit.models.attention import register_attention
    from longfit.models.dropout import disable_dropout_modules
    from longfit.models.linear_attention import prepare_linear_attention
    from longfit.models.sparse_attention import prepare_sparse_attention
    from longfit.models.rope import apply_rope_to_model
    from longfit.models.structure import unwrap_peft
    from longfit.parallel.parallelize import apply_context_parallel
    from longfit.parallel.tiled_attention import LocalTileAttention
    from longfit.plan import preflight

    refuse_trainer_options(trainer)
    cfg = trainer_config(trainer, overrides)
    launch = launch_mode(trainer)
    plugin = fsdp2_plugin(trainer) if launch == "fsdp2" else None
    device = trainer.args.device
    world = trainer.args.world_size
    replicated = launch == "ddp" and world > 1
    _warm_up_once_per_node(trainer, lambda: (preflight(cfg, world, device.type, check_fit=False, replicated=replicated),
                                             require_exact(cfg, device.type)))
    plan = preflight(cfg, world, device, check_fit=check_fit, replicated=replicated)
    require_exact(cfg, device.type)
    dims = plan.setup.dims
    tiled = plan.setup.tiled_mlp or plan.setup.tiled_layers
    if launch == "ddp" and tiled and trainer.args.world_size > 1 and trainer.args.gradient_accumulation_steps > 1:
        raise ConfigError(
            "apply_longfit: memory.tiled_mlp / memory.tiled_layers with gradient_accumulation_steps > 1 on several "
            "ranks: DDP's static graph, which the per-tile backward needs, cannot skip the gradient all-reduce of "
            "accumulation steps; set gradient_accumulation_steps=1 (longer rows or more ranks instead), or turn "
            "the tiling off"
        )
    mesh = dims.build_mesh(device.type)
    model = trainer.model
    _refuse_inexact_router_loss(trainer, plan.setup.tiled_layers)
    # TRL turns it on by default: longfit's checkpointing (memory.activation_checkpointing, with the offload store)
    # does its job
    trainer.args.activation_checkpointing = False
    apply_rope_to_model(model, cfg)
    if cfg.train.disable_dropout:  # its modules only: the config stays the checkpoint's, which the Trainer saves
        disable_dropout_modules(model)
    unwrap_peft(model).set_attn_implementation(register_attention())
    prepare_linear_attention(model)
    prepare_sparse_attention(model)
    if dims.cp > 1:
        apply_context_parallel(model, mesh.cp_group, dims.cp_method)
    memory = apply_memory_techniques(model, cfg, device, plan.placement, tile_attention=LocalTileAttention.for_sequence)
    model.forward = LossForward(model, cfg, plan.setup.loss_chunk, mesh.cp_group, dims.cp)
    model.forward.loss.router_group = mesh.world_group  # the router loss's counts: those of every rank's tokens
    trainer.data_collator = ShardingCollator(trainer.data_collator, dims, mesh.cp_rank)
    if launch == "fsdp2":
        _shard_for_accelerate(trainer, plugin, mesh)
    else:
        # Every parameter is used. The tiled MLP and tiled layers backpropagate each tile into the weights
        # (torch.autograd.backward per tile): DDP's static graph accepts a gradient hook firing once per tile.
        # The gradients are views of DDP's buckets, which exist anyway: one copy of them, as the plan counts.
        ddp = trainer.accelerator.ddp_handler
        ddp.find_unused_parameters = False
        ddp.static_graph = tiled
        ddp.gradient_as_bucket_view = True
    if mesh.mesh is not None:
        trainer.accelerator.state.device_mesh = mesh.mesh
    # The forward divides by num_items_in_batch: the Trainer must count the tokens and leave accumulation alone.
    trainer.model_accepts_loss_kwargs = True
    trainer.loss_is_scaled_for_ga = True
    trainer.add_callback(_release_offload_stores_callback())
    return LongfitRun(cfg, plan, dims, mesh, memory)


def _warm_up_once_per_node(trainer, warm_up) -> None:
    """`warm_up()` on each node's first rank while the node's other ranks wait: the preflight's layer traces and
    `longfit check`'s ranks run once per node on a cold cache (as `longfit train` runs them once before torchrun starts
    its ranks), not on every rank at once; every rank's own preflight and check then read the node's cache.
    `warm_up` must hold no collective, the other ranks being in a barrier (the preflight's memory checks gather over
    the ranks; with check_fit=False it has none). The first rank reaches the barrier even when it fails, so none
    waits for ever; the others then meet the same refusal in their own preflight or check.

    The barrier is on a gloo group of its own, whose wait ends after the Trainer's ddp_timeout with an exception on
    any device (NCCL's watchdog would abort the process instead), turned into one line naming what the ranks waited
    for and the fix."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    if trainer.args.world_size == 1 or not dist.is_initialized():
        return
    timeout = trainer.args.ddp_timeout
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    start = time.monotonic()
    try:
        if trainer.args.local_process_index == 0:
            warm_up()
    finally:
        try:
            dist.barrier(group=group)
        except RuntimeError as error:  # c10d's timeout, or a closed connection: a rank stopped
            waited = time.monotonic() - start
            why = (f"did not finish within the Trainer's ddp_timeout ({timeout} s)" if waited >= timeout else
                   "stopped before it finished (its own error is above)")
            raise ConfigError(
                "apply_longfit: the node's ranks wait for its first rank's warm-up (the preflight's layer traces and "
                f"`longfit check`, run once per node on an empty cache), which {why}; fill the cache before launching "
                "(`longfit plan` and `longfit check` of the same model and settings, in one process with the same "
                "XDG_CACHE_HOME) or raise ddp_timeout in the TrainingArguments"
            ) from error
        dist.destroy_process_group(group)


def _shard_for_accelerate(trainer, plugin, mesh: "ParallelMesh") -> None:
    """Shard the trainer's model with FSDP2 over longfit's dp_shard x cp mesh, as `longfit.parallel.fsdp.apply_fsdp`
    shards longfit's own (a unit per decoder layer, then the root), under Accelerate's FSDP2 plugin's mixed precision,
    reshard_after_forward and CPU offload; then make the Trainer's Accelerate an FSDP2 one holding this mesh.

    Accelerate's `fsdp2_prepare_model` leaves a model that is already an FSDPModule as it is, and maps the optimizer
    to its parameters by name, so the Trainer's `prepare` keeps these units, and its save, resume and clipping take
    Accelerate's FSDP2 paths. Accelerate's own `parallelism_config` is dropped after its degrees became longfit's
    (`accelerate_degrees`): with cp > 1 in it, the Trainer would run torch's context parallel and divide the
    label-token count by cp, where longfit's shards count each token once.
    """
    import torch
    from accelerate import PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    from longfit.models.structure import unwrap_peft
    from longfit.parallel.fsdp import apply_fsdp

    model = trainer.model
    if trainer.accelerator.mixed_precision != "no":
        # Accelerate's rule (fsdp2_prepare_model): trainable parameters in fp32, the policy's param_dtype computes
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
    apply_fsdp(model, mesh.fsdp_mesh, reshard_after_forward=plugin.reshard_after_forward,
               cpu_offload=isinstance(plugin.cpu_offload, CPUOffloadPolicy), expert_mesh=mesh.expert_mesh, model=model,
               mp_policy=plugin.mixed_precision_policy, scale_gradient=False)
    if unwrap_peft(model) is not model and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        trainer.save_model = AdapterFromShards(trainer.save_model, trainer)
    state = trainer.accelerator.state
    state.fsdp_plugin, state.parallelism_config = plugin, None
    # Every later AcceleratorState() (Accelerate's optimizer wrapper makes one) copies PartialState's distributed_type
    # over its own: on the CPU, where Accelerate made it MULTI_CPU, both must say FSDP
    for shared in (state, PartialState()):
        shared.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


class AdapterFromShards:
    """The Trainer's `save_model` under FSDP2 with sharded state dicts, for a peft model: the Trainer writes nothing
    there (its checkpoints hold the model's and optimizer's DCP shards, which resume reads), so this also writes peft's
    adapter files, gathered from the shards (the adapter only: small), into the directory, as a full state dict
    checkpoint holds them: `PeftModel.from_pretrained` on the base model loads every checkpoint and the final save.
    Called on every rank (the gather is collective); the main process writes."""

    def __init__(self, save_model, trainer):
        self.save_model, self.trainer = save_model, trainer

    def __call__(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        from torch.distributed.tensor import DTensor

        self.save_model(output_dir, _internal_call)
        model = self.trainer.model
        adapter = {name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().cpu()
                   for name, param in model.named_parameters() if param.requires_grad}
        if self.trainer.args.should_save:
            model.save_pretrained(output_dir or self.trainer.args.output_dir, state_dict=adapter)


def _refuse_inexact_router_loss(trainer, tiled_layers: bool) -> None:
    """The router loss's rules under a Trainer (module docstring), one ConfigError line each."""
    from longfit.memory.router_loss import RouterLoss, check_router_loss

    if RouterLoss.of(trainer.model) is None:
        return
    check_router_loss(trainer.model, tiled_layers)
    if not getattr(trainer, "aux_loss_enabled", False):  # a plain Trainer: longfit's loss, over the step's tokens
        if trainer.args.gradient_accumulation_steps > 1:
            raise ConfigError(
                "apply_longfit: the model's config sets output_router_logits: its load-balancing loss is over the "
                "step's tokens, and the Trainer backpropagates each of its gradient_accumulation_steps micro-batches "
                "before the next one's routes are counted; set gradient_accumulation_steps=1 (a larger per-device "
                "batch instead), or train with `longfit train`, which counts them first"
            )


def check_trainer(trainer, *overrides: str, device_type: str | None = None):
    """`longfit check` of the run `apply_longfit(trainer, *overrides)` would make: the report
    (`longfit.check.parity.CheckReport`; `.exact`, `.lines()`, `.raise_if_not_exact()`). `device_type`: the
    device the run trains on (default: the trainer's), which decides the `auto` techniques and dtype."""
    from longfit.check.parity import check_run

    cfg = trainer_config(trainer, overrides)
    return check_run(cfg, device_type or trainer.args.device.type)


def _documents_starts(position_ids: "torch.Tensor", attention_mask: "torch.Tensor | None") -> list[list[int]]:
    """Each row's document starts: where position_ids do not continue the previous token's (TRL's padding-free
    rows restart them at 0 per document), and where the right padding begins."""
    import torch

    breaks = torch.ones_like(position_ids, dtype=torch.bool)
    breaks[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if attention_mask is not None:
        if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
            raise ConfigError(
                "apply_longfit: the collator pads on the left; set the tokenizer's padding_side='right' (longfit's "
                "attention takes no mask: padding must follow the tokens it pads)"
            )
        breaks[:, 1:] |= attention_mask[:, 1:] != attention_mask[:, :-1]
    return [row.nonzero().flatten().tolist() for row in breaks]


class ShardingCollator:
    """Wraps the trainer's collator: its rows become this cp rank's shard of a longfit packed batch.

    Output: input_ids, position_ids, labels and shift_labels (the next token inside each document, -100 where
    none; both names for the same shard: the Trainer counts `shift_labels`, TRL's fused head scores them), the
    global cu_seq_lens_q and its host layout longfit_documents. Rows are padded at the end to a multiple of
    the sequence granule (2 x cp for the ring, cp for Ulysses) with a padding document without labels.
    """

    def __init__(self, collator, dims: "ParallelDims", cp_rank: int):
        self.collator, self.dims, self.cp_rank = collator, dims, cp_rank

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch
        import torch.nn.functional as F

        from longfit.data.packing import IGNORE_INDEX, PackedBatch
        from longfit.parallel.batch import cp_layout, shard_batch

        batch = self.collator(features)
        input_ids, labels = batch["input_ids"], batch["labels"]
        B, L = input_ids.shape
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(L).expand(B, L)
        starts = _documents_starts(position_ids, batch.get("attention_mask"))
        granule = self.dims.sequence_granule
        padded = -(-L // granule) * granule
        if padded > L:
            extra = padded - L
            input_ids = F.pad(input_ids, (0, extra), value=0)
            labels = F.pad(labels, (0, extra), value=IGNORE_INDEX)
            position_ids = torch.cat([position_ids, torch.arange(extra).expand(B, extra)], dim=1)
            starts = [row + [L] for row in starts]
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        for b, row in enumerate(starts):
            shifted[b, [s - 1 for s in row[1:]]] = IGNORE_INDEX  # no target across a document boundary
        cu_seqlens = torch.tensor([b * padded + s for b, row in enumerate(starts) for s in row] + [B * padded],
                                  dtype=torch.int32)
        packed = PackedBatch(input_ids, shifted, position_ids.contiguous(), cu_seqlens,
                             int((shifted != IGNORE_INDEX).sum()))
        shard = shard_batch(packed, self.cp_rank, self.dims.cp, cp_layout(self.dims.cp_method))
        mask = batch.get("attention_mask")
        return {
            "input_ids": shard.input_ids, "position_ids": shard.position_ids, "labels": shard.labels,
            "shift_labels": shard.labels, "cu_seq_lens_q": shard.cu_seqlens, "longfit_documents": shard.documents,
            "longfit_padded": padded > L or (mask is not None and not bool(mask.all())),
        }


class LossForward:
    """The model's forward under apply_longfit: a Trainer's call with `shift_labels` runs longfit's `CausalLMLoss`
    (chunked when memory.chunked_loss) and returns its sum divided by `num_items_in_batch`; TRL's fused-head calls
    (`fused_lm_head=True`, its own chunked log-probabilities) and calls without labels go to the model's forward,
    with TRL's router loss over the whole micro-batch under context parallelism (`with_micro_batch_aux`).

    A plain callable, not a Module: set as `model.forward` it must not become a submodule of the model it wraps.
    Slots, no `__dict__`: Accelerate wraps the forward for autocast with `functools.wraps`, which copies the
    wrapped object's `__dict__` onto its own wrapper, whose `model_forward` attribute it would then overwrite.
    """

    __slots__ = ("original_forward", "loss", "cp_group", "cp")

    def __init__(self, model, cfg: Config, loss_chunk: int | None, cp_group=None, cp: int = 1):
        from longfit.memory.loss import CausalLMLoss

        self.original_forward = model.forward
        self.loss = CausalLMLoss(model, chunked_loss=cfg.memory.chunked_loss, loss_chunk=loss_chunk or 0)
        self.cp_group, self.cp = cp_group, cp

    def __call__(self, input_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, longfit_padded=False,
                 **kwargs):
        import torch
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if longfit_padded and self.loss.router_loss is not None:  # longfit's router loss, or TRL's (fused_lm_head)
            raise ConfigError(
                "apply_longfit: this batch pads its rows (to their longest, or to the context-parallel granule), and "
                "the router loss would count the padding tokens that transformers leaves out; pack the rows to full "
                "length (TRL's packing / padding_free), or turn the router loss off (router_aux_loss_coef=0.0 in TRL's "
                "SFTConfig, output_router_logits=false in the model's config)"
            )
        if shift_labels is None or kwargs.get("fused_lm_head"):
            given = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            given = {k: v for k, v in given.items() if v is not None}
            if kwargs.get("output_router_logits") and self.loss.router_loss is not None:
                return self.with_micro_batch_aux(input_ids=input_ids, **given, **kwargs)
            return self.original_forward(input_ids=input_ids, **given, **kwargs)
        count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != -100).sum().clamp(min=1)
        # with a router loss: plus coef x its global aux, scaled by the tokens the sum is divided by
        loss_sum = self.loss(input_ids, shift_labels, kwargs["position_ids"], kwargs["cu_seq_lens_q"],
                             kwargs["longfit_documents"], torch.as_tensor(count))
        return CausalLMOutputWithPast(loss=loss_sum / count)

    def with_micro_batch_aux(self, **inputs):
        """TRL's fused-head forward with its router loss (`aux_loss`, which SFTTrainer weighs by router_aux_loss_coef
        and divides by the micro-batches accumulated) made that of the whole micro-batch under context parallelism:
        this rank's term of transformers' aux over the micro-batch's rows on all its cp ranks (memory/router_loss.py:
        the counts all-reduced over the cp group, this rank's probability sums), times cp. Data parallelism averages
        the gradients over the dp x cp ranks, so the cp ranks' terms add up to the micro-batch's aux / dp, as TRL's
        one rank of a micro-batch gives; the aux TRL logs, averaged over the ranks, is the micro-batches' mean. On
        one cp rank it is transformers' aux itself."""
        from longfit.memory.router_loss import collect_router_prob_sums
        from longfit.models.structure import decoder_and_head

        router = self.loss.router_loss
        body = decoder_and_head(self.loss.model)[0]
        router_logits: list = []
        hook = body.register_forward_hook(lambda module, args, output: router_logits.append(output.router_logits))
        try:
            with collect_router_prob_sums(router) as tiled:  # tiled layers' routers: their S_e, with gradient
                output = self.original_forward(**inputs)
        finally:
            hook.remove()
        term = router.local_term(router_logits[-1], self.cp_group if self.cp > 1 else None, tiled=tiled)
        output.aux_loss = self.cp * term
        return output


def _release_offload_stores_callback():
    from transformers import TrainerCallback

    class ReleaseOffloadStores(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            from longfit.memory.apply import release_offload_stores

            release_offload_stores(model)

    return ReleaseOffloadStores()
