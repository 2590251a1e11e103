"""The `memory.*` switches with every "auto" decided; free of torch so the planner can use it instantly."""

from __future__ import annotations

import math
from dataclasses import dataclass

from longfit.config import Config, ConfigError

OFFLOAD_AUTO_MIN_SEQ_LEN = 32768
TILED_MLP_AUTO_MIN_SEQ_LEN = 8192


LOSS_CHUNK_FREE_FRACTION = 1 / 32
LOSS_CHUNK_MIN_TOKENS = 256
LOSS_CHUNK_MAX_TOKENS = 16384
LOSS_LOGIT_BYTES = 8  # per (token, vocabulary) entry of a chunk: its fp32 logits, then their gradient next to a bf16 copy
HOST_LOSS_LOGITS_BYTES = 1 << 27  # fp32 logits of one chunk when the free device memory is unknown (CPU)


def loss_chunk_tokens(vocab_size: int, free_bytes: int | None = None) -> int:
    """Tokens per loss chunk (`memory.loss_chunk=0`), from the vocabulary and the device memory free at the start.

    A chunk of c tokens holds its (c, V) logits in fp32, turned into their gradient in place next to a
    compute-dtype copy: at most LOSS_LOGIT_BYTES per entry. Every chunk also pays fixed costs -- three GEMMs
    with c rows, and, when lm_head trains, adding its (V, H) weight-gradient product into the fp32 accumulator
    (about 20 bytes of memory traffic per weight whatever c is) -- so on a GPU the chunk is as large as
    memory allows:
    c = LOSS_CHUNK_FREE_FRACTION x free / (LOSS_LOGIT_BYTES x V), rounded down to a power of two (small
    differences in free memory between ranks or runs then rarely change it), within
    [LOSS_CHUNK_MIN_TOKENS, LOSS_CHUNK_MAX_TOKENS] (beyond 16K rows the GEMMs are saturated and only memory
    grows). E.g. 80 GB free and Llama 3's 128256 entries: 2048 tokens, a 2 GiB chunk.

    `free_bytes` None (CPU: the logits come out of host memory, nothing is gained by larger chunks and the
    CPU measurements stay comparable): fp32 logits within HOST_LOSS_LOGITS_BYTES, a power of two >= 64.
    The trainer measures `free_bytes` before it builds anything and the planner assumes an empty GPU, so
    both derive the same chunk (`longfit.plan.setup.resolve`).
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 1")
    if free_bytes is None:
        tokens = HOST_LOSS_LOGITS_BYTES // (4 * vocab_size)
        return max(64, 1 << (tokens.bit_length() - 1)) if tokens else 64
    tokens = int(LOSS_CHUNK_FREE_FRACTION * max(0, free_bytes)) // (LOSS_LOGIT_BYTES * vocab_size)
    tokens = min(max(tokens, LOSS_CHUNK_MIN_TOKENS), LOSS_CHUNK_MAX_TOKENS)
    return 1 << (tokens.bit_length() - 1)


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


def resolve_memory_switches(
    cfg: Config, device_type: str, vocab_size: int, free_bytes: int | None = None
) -> MemorySwitches:
    """Decide the "auto" switches for a device type ("cuda", "cpu", ...) with `free_bytes` free on it at the
    start (None: unknown, e.g. CPU), which sizes the loss chunk (`loss_chunk_tokens`).

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
        loss_chunk=(memory.loss_chunk or loss_chunk_tokens(vocab_size, free_bytes)) if memory.chunked_loss else None,
        optimizer=memory.optimizer,
    )
