"""A Config resolved for one rank: every derived or `auto` setting decided as the trainer decides it on a GPU.

The rules that live in longfit.memory (which imports torch) are mirrored here so that planning needs
no torch; tests/test_plan_analytic.py checks that both agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from longfit.config import Config
from longfit.plan.shapes import ModelShape, model_shape

OFFLOAD_AUTO_MIN_SEQ_LEN = 32768  # longfit.memory.apply
TILED_MLP_AUTO_MIN_SEQ_LEN = 8192  # longfit.memory.apply


def default_loss_chunk(vocab: int, budget: int = 1 << 28) -> int:
    """longfit.memory.chunked_loss.default_loss_chunk: a power of two of fp32 logits within 256 MiB."""
    tokens = budget // (4 * vocab)
    return max(64, 1 << (tokens.bit_length() - 1)) if tokens else 64


@dataclass(frozen=True)
class Setup:
    """A Config resolved for one rank of `world` GPUs (every `auto` decided as on CUDA)."""

    shape: ModelShape
    world: int
    dp_shard: int
    cp: int
    cp_method: str
    micro_batch: int
    seq_len: int
    regime: str  # "bf16" (FSDP2 mixed precision), "autocast" (one rank, bf16 autocast), "fp32"
    lora: bool
    qlora: bool
    lora_rank: int
    lora_targets: tuple[str, ...]
    checkpointed: int  # decoder layers, the first ones
    offload_activations: bool
    fsdp_offload: bool
    tiled_mlp: bool
    mlp_tiles: int  # 0: derived per call from the tokens (longfit.memory.tiled_mlp.mlp_tile_count)
    loss_chunk: int | None  # None: full logits
    optimizer: str
    grad_accum: int
    reshard_after_forward: bool

    @property
    def shards(self) -> int:
        return self.dp_shard * self.cp

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len // self.cp


def resolve(cfg: Config, world_size: int, device_type: str = "cuda") -> Setup:
    """Decide every derived setting of `cfg` on `world_size` ranks (errors name the key to change)."""
    from longfit.parallel.dims import ParallelDims

    shape = model_shape(cfg.model)
    dims = ParallelDims.from_config(cfg, world_size)
    dims.validate_sequence(cfg.seq_len, cfg.parallel.cp_method)
    dims.validate_heads(shape.heads, cfg.parallel.cp_method)
    memory = cfg.memory
    on_gpu = device_type == "cuda"
    if cfg.train.dtype == "fp32" or (cfg.train.dtype == "auto" and not on_gpu):
        regime = "fp32"
    else:
        regime = "bf16" if dims.fsdp_size > 1 else "autocast"
    offload = memory.offload_activations
    if offload == "auto":
        offload = memory.activation_checkpointing and on_gpu and cfg.seq_len >= OFFLOAD_AUTO_MIN_SEQ_LEN
    tiled = cfg.seq_len >= TILED_MLP_AUTO_MIN_SEQ_LEN if memory.tiled_mlp == "auto" else memory.tiled_mlp
    checkpointed = round(memory.checkpoint_fraction * shape.layers) if memory.activation_checkpointing else 0
    return Setup(
        shape=shape,
        world=world_size,
        dp_shard=dims.dp_shard,
        cp=dims.cp,
        cp_method=cfg.parallel.cp_method,
        micro_batch=cfg.train.micro_batch,
        seq_len=cfg.seq_len,
        regime=regime,
        lora=cfg.lora.enabled,
        qlora=cfg.lora.enabled and cfg.lora.quantize_base,
        lora_rank=cfg.lora.r,
        lora_targets=tuple(cfg.lora.target_modules),
        checkpointed=checkpointed,
        offload_activations=bool(offload and checkpointed),
        fsdp_offload=cfg.parallel.cpu_offload and dims.fsdp_size > 1,
        tiled_mlp=bool(tiled),
        mlp_tiles=memory.mlp_tiles,
        loss_chunk=(memory.loss_chunk or default_loss_chunk(shape.vocab)) if memory.chunked_loss else None,
        optimizer=memory.optimizer,
        grad_accum=cfg.train.grad_accum,
        reshard_after_forward=cfg.parallel.reshard_after_forward,
    )


def mlp_tiles(s: Setup) -> int:
    """memory.mlp_tiles, or longfit.memory.tiled_mlp.mlp_tile_count for this rank's tokens."""
    m = s.shape
    if s.mlp_tiles:
        return min(s.mlp_tiles, s.tokens)
    return max(1, min(math.ceil(4 * m.intermediate / m.hidden), s.tokens // 1024))
