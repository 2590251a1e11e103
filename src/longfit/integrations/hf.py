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
  multiplies it by the number of processes, which Accelerate's DDP divides the gradients by again: the
  gradients are exactly those of the global mean loss over the step's tokens, as in longfit's own loop;
- a mixture-of-experts router loss (the model's config sets `output_router_logits`): a plain Trainer's loss adds
  it as longfit's trainer does, its routing counts all-reduced over the dp x cp ranks (memory/router_loss.py),
  equal to the model's own loss on one process; TRL's SFTTrainer adds its own (`router_aux_loss_coef`), each
  rank's over its own tokens, refused under cp > 1 where those are shards of the same sequences. The Trainer
  backpropagates each micro-batch before the next one's routes are counted, so gradient_accumulation_steps > 1
  is refused with it, and so is a padded batch, whose padding tokens transformers leaves out of the routers'
  counts (its attention mask) while longfit's loss has no mask.

Model states are replicated by Accelerate's DDP (longfit's FSDP2 and tensor parallelism are not available
here): the plan counts them sharded over the dp_shard x cp ranks as longfit's trainer does, so under cp > 1 it
is low by the unsharded part of the weights, gradients and optimizer state.
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


def refuse_trainer_options(trainer) -> None:
    """One line per Trainer option that cannot work with longfit, naming the fix (ConfigError)."""
    args = trainer.args
    refusals = [
        (bool(args.deepspeed), "DeepSpeed (deepspeed=...) replaces the model's training step; remove it: longfit's "
         "context parallelism and memory techniques take its place"),
        (bool(args.fsdp), "the Trainer's FSDP (fsdp=...) shards the model longfit has already routed; remove it "
         "(longfit runs under Accelerate's DDP here)"),
        (getattr(args, "parallelism_config", None) is not None, "Accelerate's ParallelismConfig (parallelism_config=...) "
         "brings its own context parallelism; remove it and set parallel.cp in apply_longfit"),
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


def trainer_config(trainer, overrides: tuple[str, ...]) -> Config:
    """The longfit Config of the trainer's run: its TrainingArguments, and `overrides` (SETTINGS only) on top."""
    from longfit.models.presets import PRESETS
    from longfit.models.source import local_model_dir
    from longfit.models.structure import unwrap_peft

    for text in overrides:
        key = parse_override(text)[0]
        if key != "memory.optimizer" and any(key == s or (s.endswith(".") and key.startswith(s)) for s in SETTINGS):
            continue
        if key.startswith("parallel."):
            why = f"{key} needs longfit's FSDP2, which Accelerate's DDP replaces under a Trainer: use parallel.cp"
        else:
            why = f"{key} is the trainer's to decide: set the matching TrainingArguments / SFTConfig field instead"
        raise ConfigError(f"apply_longfit: {why} (apply_longfit takes {', '.join(SETTINGS)}*)")
    args = trainer.args
    given = {parse_override(text)[0] for text in overrides}
    padding_free = getattr(trainer, "padding_free", False)
    rows = 1 if padding_free else args.per_device_train_batch_size
    derived = [
        f"train.micro_batch={rows}",
        f"train.grad_accum={args.gradient_accumulation_steps}",
        f"train.dtype={'bf16' if args.bf16 else 'fp32'}",
        f"train.seed={args.seed}",
        f"train.max_grad_norm={args.max_grad_norm or 0}",
    ]
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
    device = trainer.args.device
    plan = preflight(cfg, trainer.args.world_size, device, check_fit=check_fit)
    require_exact(cfg, device.type)
    dims = plan.setup.dims
    tiled = plan.setup.tiled_mlp or plan.setup.tiled_layers
    if tiled and trainer.args.world_size > 1 and trainer.args.gradient_accumulation_steps > 1:
        raise ConfigError(
            "apply_longfit: memory.tiled_mlp / memory.tiled_layers with gradient_accumulation_steps > 1 on several "
            "ranks: DDP's static graph, which the per-tile backward needs, cannot skip the gradient all-reduce of "
            "accumulation steps; set gradient_accumulation_steps=1 (longer rows or more ranks instead), or turn "
            "the tiling off"
        )
    mesh = dims.build_mesh(device.type)
    model = trainer.model
    _refuse_inexact_router_loss(trainer, dims)
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
    # Every parameter is used. The tiled MLP and tiled layers backpropagate each tile into the weights
    # (torch.autograd.backward per tile): DDP's static graph accepts a gradient hook firing once per tile.
    ddp = trainer.accelerator.ddp_handler
    ddp.find_unused_parameters = False
    ddp.static_graph = tiled
    model.forward = LossForward(model, cfg, plan.setup.loss_chunk)
    model.forward.loss.router_group = mesh.world_group  # the router loss's counts: those of every rank's tokens
    trainer.data_collator = ShardingCollator(trainer.data_collator, dims, mesh.cp_rank)
    if mesh.mesh is not None:
        trainer.accelerator.state.device_mesh = mesh.mesh
    # The forward divides by num_items_in_batch: the Trainer must count the tokens and leave accumulation alone.
    trainer.model_accepts_loss_kwargs = True
    trainer.loss_is_scaled_for_ga = True
    trainer.add_callback(_release_offload_stores_callback())
    return LongfitRun(cfg, plan, dims, mesh, memory)


def _refuse_inexact_router_loss(trainer, dims: "ParallelDims") -> None:
    """The router loss's rules under a Trainer (module docstring), one ConfigError line each."""
    from longfit.memory.router_loss import RouterLoss

    if RouterLoss.of(trainer.model) is None:
        return
    if trainer.args.gradient_accumulation_steps > 1:
        raise ConfigError(
            "apply_longfit: the model's config sets output_router_logits: its load-balancing loss is over the step's "
            "tokens, and the Trainer backpropagates each of its gradient_accumulation_steps micro-batches before the "
            "next one's routes are counted; set gradient_accumulation_steps=1 (a larger per-device batch instead), or "
            "train with `longfit train`, which counts them first"
        )
    if getattr(trainer, "aux_loss_enabled", False) and dims.cp > 1:
        raise ConfigError(
            "apply_longfit: TRL adds each rank's load-balancing loss over its own tokens, which under parallel.cp > 1 "
            "are shards of the same sequences, not the loss of the whole ones; set router_aux_loss_coef=0.0 in the "
            "SFTConfig, or parallel.cp=1"
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
    (`fused_lm_head=True`, its own chunked log-probabilities) and calls without labels go to the model's forward.

    A plain callable, not a Module: set as `model.forward` it must not become a submodule of the model it wraps.
    Slots, no `__dict__`: Accelerate wraps the forward for autocast with `functools.wraps`, which copies the
    wrapped object's `__dict__` onto its own wrapper, whose `model_forward` attribute it would then overwrite.
    """

    __slots__ = ("original_forward", "loss")

    def __init__(self, model, cfg: Config, loss_chunk: int | None):
        from longfit.memory.loss import CausalLMLoss

        self.original_forward = model.forward
        self.loss = CausalLMLoss(model, chunked_loss=cfg.memory.chunked_loss, loss_chunk=loss_chunk or 0)

    def __call__(self, input_ids=None, labels=None, shift_labels=None, num_items_in_batch=None, longfit_padded=False,
                 **kwargs):
        import torch
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if shift_labels is None or kwargs.get("fused_lm_head"):
            given = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return self.original_forward(input_ids=input_ids, **{k: v for k, v in given.items() if v is not None}, **kwargs)
        if longfit_padded and self.loss.router_loss is not None:
            raise ConfigError(
                "apply_longfit: this batch pads its rows (to their longest, or to the context-parallel granule), and "
                "the router loss would count the padding tokens that transformers leaves out; pack the rows to full "
                "length (TRL's packing / padding_free), or set output_router_logits=false in the model's config"
            )
        count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != -100).sum().clamp(min=1)
        # with a router loss: plus coef x its global aux, scaled by the tokens the sum is divided by
        loss_sum = self.loss(input_ids, shift_labels, kwargs["position_ids"], kwargs["cu_seq_lens_q"],
                             kwargs["longfit_documents"], torch.as_tensor(count))
        return CausalLMOutputWithPast(loss=loss_sum / count)


def _release_offload_stores_callback():
    from transformers import TrainerCallback

    class ReleaseOffloadStores(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            from longfit.memory.apply import release_offload_stores

            release_offload_stores(model)

    return ReleaseOffloadStores()
