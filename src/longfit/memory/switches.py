"""The `memory.*` switches with every "auto" decided; free of torch so the planner can use it instantly."""

from __future__ import annotations

import math
from dataclasses import dataclass

from longfit.config import Config, ConfigError

OFFLOAD_AUTO_MIN_SEQ_LEN = 32768
TILED_MLP_AUTO_MIN_SEQ_LEN = 8192


def default_loss_chunk(vocab_size: int, logits_budget_bytes: int = 1 << 27) -> int:
    """Tokens per loss chunk: a power of two (>= 64) whose fp32 logits fit in `logits_budget_bytes` (128 MiB).

    The loss holds a few chunk-sized temporaries at once (benchmarks/results/memory_cpu.md), so the chunk
    is kept well below the per-layer activations it would otherwise dominate at long L.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 1")
    tokens = logits_budget_bytes // (4 * vocab_size)
    return max(64, 1 << (tokens.bit_length() - 1)) if tokens else 64


def mlp_tile_count(
    seq_len: int, hidden: int, intermediate: int, live_intermediates: int = 4, min_tile_tokens: int = 1024
) -> int:
    """Tiles for `seq_len` tokens so that one tile's MLP activations fit in one (seq_len, hidden) tensor.

    A tile of t tokens keeps about `live_intermediates` tensors of (t, intermediate) alive in backward (gate,
    up, act(gate), their product); `t * intermediate * live_intermediates <= seq_len * hidden` gives
    tiles = ceil(live_intermediates * intermediate / hidden). Tiles never get shorter than
    `min_tile_tokens` (GEMM efficiency), so short sequences use fewer tiles (at least one).
    """
    if min(seq_len, hidden, intermediate, live_intermediates, min_tile_tokens) < 1:
        raise ValueError(
            f"mlp_tile_count: every size must be >= 1, got seq_len={seq_len}, hidden={hidden}, "
            f"intermediate={intermediate}, live_intermediates={live_intermediates}, min_tile_tokens={min_tile_tokens}"
        )
    by_memory = math.ceil(live_intermediates * intermediate / hidden)
    return max(1, min(by_memory, seq_len // min_tile_tokens))


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


def resolve_memory_switches(cfg: Config, device_type: str, vocab_size: int) -> MemorySwitches:
    """Decide the "auto" switches for a device type ("cuda", "cpu", ...).

    Both "auto" techniques trade compute for device memory, so they turn on where device memory is
    scarce: on CUDA, offload from seq_len 32768 and tiled MLP from seq_len 8192. On CPU the model
    lives in host memory already and the recomputation would only cost time.
    """
    memory = cfg.memory
    if memory.offload_activations == "auto":
        offload = memory.activation_checkpointing and device_type == "cuda" and cfg.seq_len >= OFFLOAD_AUTO_MIN_SEQ_LEN
    else:
        offload = memory.offload_activations
    if offload and not memory.activation_checkpointing:
        raise ConfigError(
            "memory.offload_activations=true offloads the checkpointed layer inputs: "
            "set memory.activation_checkpointing=true too"
        )
    if memory.tiled_mlp == "auto":
        tiled = device_type == "cuda" and cfg.seq_len >= TILED_MLP_AUTO_MIN_SEQ_LEN
    else:
        tiled = memory.tiled_mlp
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
