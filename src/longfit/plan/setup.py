"""A Config resolved for one rank: every derived or `auto` setting decided as the trainer decides it on a GPU.

The memory switches come from longfit.memory.switches (torch-free), the parallel degrees from
longfit.parallel.dims, so the planner and the trainer decide the same way. The tile count of
longfit.memory.tiled_mlp (which imports torch) is mirrored in `mlp_tiles`; a test checks both agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from longfit.config import Config
from longfit.memory.switches import (
    OFFLOAD_AUTO_MIN_SEQ_LEN,
    TILED_LAYERS_AUTO_MIN_TOKENS,
    TILED_MLP_AUTO_MIN_SEQ_LEN,
    checkpointed_layer_count,
    mlp_tile_count,
    resolve_memory_switches,
)
from longfit.parallel.dims import ParallelDims
from longfit.plan.media import StepImages, eval_images, step_images
from longfit.plan.shapes import ModelShape, model_shape

__all__ = [
    "OFFLOAD_AUTO_MIN_SEQ_LEN",
    "TILED_LAYERS_AUTO_MIN_TOKENS",
    "TILED_MLP_AUTO_MIN_SEQ_LEN",
    "Setup",
    "Stage",
    "mlp_tiles",
    "pipeline_rank",
    "pipeline_stage",
    "resolve",
]


@dataclass(frozen=True)
class Setup:
    """A Config resolved for one rank of `world` GPUs (every `auto` decided as on CUDA)."""

    config: Config
    """The configuration this was resolved from."""
    dims: ParallelDims
    """Its parallel degrees on `world` ranks, checked against seq_len and the model's heads."""
    shape: ModelShape
    micro_batch: int
    seq_len: int
    regime: str  # "bf16" (FSDP2 mixed precision, or LoRA on a bf16 base), "autocast" (one rank, fp32 weights), "fp32"
    lora: bool
    qlora: bool
    lora_rank: int
    lora_targets: tuple[str, ...]
    checkpointed: int  # decoder layers, the first ones
    offload_activations: bool
    fsdp_offload: bool
    tiled_mlp: bool
    mlp_tiles: int  # 0: derived per call from the tokens (longfit.memory.switches.mlp_tile_count)
    loss_chunk: int | None  # None: full logits
    optimizer: str
    grad_accum: int
    reshard_after_forward: bool
    tiled_layers: bool = False  # the checkpointed layers run over sequence tiles (longfit.memory.tiled_layers)
    layer_tiles: int = 0  # 0: derived per call from the tokens (longfit.memory.switches.layer_tile_count)
    offload_dir: str | None = None  # offloaded layer inputs beyond host memory go to disk there
    checkpoint_dtype: str | None = None  # offloaded layer inputs stored in bf16 / fp8
    ranks_on_node: int = 0  # ranks sharing one machine's host memory and disk (0: min(world, 8), plan/storage.py)
    keep_attention: bool = False  # checkpointed layers keep attention's output and logsumexp (#53, plan/storage.py)
    replicated: bool = False
    """Model states whole on every rank: a Trainer under Accelerate's DDP (integrations/hf.py), no FSDP2; DDP's
    gradient buckets (allocated with the model, the gradients their views) are held for the whole run."""
    images: StepImages | None = None
    """The images of each row of a step on an image-text checkpoint (#54, plan/media.py); None: text rows."""
    eval_images: StepImages | None = None
    """The images of each row of an evaluation (plan/media.py `eval_images`); None: text eval rows, or none."""

    @property
    def world(self) -> int:
        return self.dims.world_size

    @property
    def dp_shard(self) -> int:
        return self.dims.dp_shard

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def cp_method(self) -> str:
        return self.dims.cp_method

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def shards(self) -> int:
        """Ranks the model states are sharded over."""
        return 1 if self.replicated else self.dims.fsdp_size

    @property
    def fsdp(self) -> bool:
        """FSDP2 runs (ParallelDims.fsdp_enabled), unless the model states are replicated."""
        return self.dims.fsdp_enabled and not self.replicated

    @property
    def tokens(self) -> int:
        """Tokens of this rank's cp shard (T): what attention and the MLP see, gathered over tp."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def sequence_tokens(self) -> int:
        """Tokens of the residual stream on this rank: T, split over tp by sequence parallelism."""
        return self.tokens // self.tp


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a run under parallel.pp (parallel/pipeline.py), as one of its ranks holds and runs it."""

    index: int
    layers: Sequence[int]
    """Its decoder layers (whole-model indices, ascending; under an interleaved or V schedule those of every stage its
    rank holds)."""
    first: bool
    """It holds the embeddings (its input is the token ids, not a previous stage's hidden states)."""
    last: bool
    """It holds the final norm, lm_head and the loss."""
    in_flight: int
    """Micro-batches whose activations it holds at once, at its first backward: 1F1B min(pp - index, grad_accum),
    GPipe grad_accum."""
    checkpointed: int
    """Its first layers that activation checkpointing wraps (apply_memory_techniques on the stage's layers)."""
    in_flight_later: int = 1
    """Micro-batches in flight at its later backwards, once the step's gradients exist (train.grad_accum > 1)."""
    held: int = 1
    """Pipeline stages its rank holds (several under interleaved and V schedules), each receiving and sending its own
    micro-batches."""


def pipeline_stage(s: Setup, index: int, layers: range) -> Stage:
    """Stage `index` of `s`'s pipeline holding decoder `layers`. Its first backward comes with the most micro-batches
    in flight: under 1F1B min(pp - s, grad_accum) of them; under GPipe, and 1F1B with fewer micro-batches than stages
    (which parallel/pipeline.py runs as GPipe), all grad_accum. Its later backwards add into the gradients of the
    first: under 1F1B as many micro-batches stay in flight while forwards remain; under GPipe (and 1F1B with no
    forward left) each backward leaves one fewer in flight."""
    from longfit.parallel.pipeline import micro_batches_in_flight

    pp, accum = s.dims.pp, s.grad_accum
    one_f_one_b = s.config.parallel.pp_schedule == "1f1b" and accum >= pp
    in_flight = micro_batches_in_flight(s.config.parallel.pp_schedule, pp, index, accum)
    checkpointed = round(s.config.memory.checkpoint_fraction * len(layers)) if s.checkpointed else 0
    steady = one_f_one_b and accum > in_flight  # forwards remain after its first backward
    later = in_flight if steady else max(in_flight - 1, 1)
    return Stage(index, layers, index == 0, index == pp - 1, in_flight, checkpointed, later)


def pipeline_rank(s: Setup, rank: int, cut: list[range]) -> Stage:
    """Pipeline rank `rank` of a schedule holding several stages per rank (interleaved 1F1B, interleaved zero bubble,
    ZBV, DualPipeV; `rank_stages`), planned as one stage holding all its stages' layers with every micro-batch of the step in
    flight, GPipe's count: the most these schedules keep (they interleave the stages' micro-batches to hold fewer;
    zero bubble keeps the inputs of deferred weight gradients, within the same count)."""
    from longfit.parallel.dims import PIPELINE_SCHEDULES
    from longfit.parallel.pipeline import micro_batches_in_flight, rank_stages

    placement = PIPELINE_SCHEDULES[s.config.parallel.pp_schedule][1]
    held = rank_stages(rank, s.dims.pp, s.dims.pp_stages_per_rank, placement)
    layers = tuple(sorted(index for stage in held for index in cut[stage]))
    checkpointed = round(s.config.memory.checkpoint_fraction * len(layers)) if s.checkpointed else 0
    accum = s.grad_accum
    in_flight = micro_batches_in_flight(s.config.parallel.pp_schedule, s.dims.pp, rank, accum)
    return Stage(rank, layers, 0 in held, len(cut) - 1 in held, in_flight, checkpointed, max(accum - 1, 1), len(held))


def expert_parallel_experts(model: str) -> int | None:
    """Experts per layer that transformers' expert-parallel plan of `model` splits (None: no plan). Asked only under
    parallel.ep > 1: it builds the model on the meta device (torch, about a second)."""
    from longfit.models.loading import meta_model
    from longfit.parallel.expert import expert_count

    return expert_count(meta_model(model))


def pipeline_text_config(model: str):
    """The model's transformers text config, which a pipeline stage cut is checked against (`check_pipeline`). Read
    only under parallel.pp > 1 (it imports transformers)."""
    from longfit.models.loading import resolve_model_config

    return resolve_model_config(model).get_text_config()


def resolve(
    cfg: Config, world_size: int, device_type: str = "cuda", free_bytes: int | None = None, ranks_on_node: int = 0,
    replicated: bool = False,
) -> Setup:
    """Decide every derived setting of `cfg` on `world_size` ranks (errors name the key to change).

    `free_bytes`: device memory free before the run builds anything (None: unknown), which sizes the loss chunk.
    `ranks_on_node`: the ranks of one machine, which share its host memory and disk (0: as `longfit plan`
    assumes, up to 8 per machine). `replicated`: every rank holds the whole model (`Setup.replicated`).
    """
    shape = model_shape(cfg.model)
    dims = ParallelDims.from_config(
        cfg,
        world_size,
        shape.heads,
        num_key_value_heads=shape.layer_kv_heads or shape.kv_heads,
        intermediate_size=shape.intermediate,
        num_experts=expert_parallel_experts(cfg.model) if cfg.parallel.ep > 1 else None,
        linear_value_heads=shape.linear_value_heads,
        text_config=pipeline_text_config(cfg.model) if cfg.parallel.pp > 1 or cfg.parallel.tp > 1 else None,
    )
    switches = resolve_memory_switches(
        cfg, device_type, shape.vocab, free_bytes, linear_attention=shape.linear_value_heads is not None,
        untileable_mlp=shape.untileable_mlp, untileable_layers=shape.untileable_layers,
    )
    dims.check_pipeline_memory(switches, cfg.parallel.pp_schedule)
    if cfg.train.dtype == "fp32" or (cfg.train.dtype == "auto" and device_type != "cuda"):
        regime = "fp32"
    elif (dims.fsdp_enabled and not replicated) or cfg.lora.enabled:
        regime = "bf16"  # bf16 weights in every matmul: FSDP2's gathered copies, or LoRA's bf16 frozen base
    else:
        regime = "autocast"
    checkpointed = checkpointed_layer_count(cfg, switches, shape.layers)
    return Setup(
        config=cfg,
        dims=dims,
        shape=shape,
        micro_batch=cfg.train.micro_batch,
        seq_len=cfg.seq_len,
        regime=regime,
        lora=cfg.lora.enabled,
        qlora=cfg.lora.enabled and cfg.lora.quantize_base,
        lora_rank=cfg.lora.r,
        lora_targets=tuple(cfg.lora.target_modules),
        checkpointed=checkpointed,
        offload_activations=bool(switches.offload_activations and checkpointed),
        fsdp_offload=cfg.parallel.cpu_offload,
        tiled_mlp=bool(switches.tiled_mlp),
        mlp_tiles=switches.mlp_tiles or 0,
        loss_chunk=switches.loss_chunk,
        optimizer=switches.optimizer,
        grad_accum=cfg.train.grad_accum,
        reshard_after_forward=cfg.parallel.reshard_after_forward,
        tiled_layers=bool(switches.tiled_layers and checkpointed),
        layer_tiles=switches.layer_tiles or 0,
        offload_dir=switches.offload_dir,
        checkpoint_dtype=switches.checkpoint_dtype,
        ranks_on_node=ranks_on_node,
        keep_attention=bool(switches.keep_attention and checkpointed),
        replicated=replicated,
        images=step_images(cfg, dims.dp_size),
        eval_images=eval_images(cfg, dims.dp_size),
    )


def mlp_tiles(s: Setup) -> int:
    """memory.mlp_tiles, or the tile count the tiled MLP derives for this rank's tokens (and intermediate slice)."""
    if s.mlp_tiles:
        return min(s.mlp_tiles, s.tokens)
    return mlp_tile_count(s.tokens, s.shape.hidden, s.shape.intermediate // s.tp)
