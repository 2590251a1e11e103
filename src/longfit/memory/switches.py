"""The `memory.*` switches with every "auto" decided; free of torch so the planner can use it instantly."""

from __future__ import annotations

import math
from dataclasses import dataclass

from longfit.config import Config, ConfigError

OFFLOAD_AUTO_MIN_SEQ_LEN = 32768
TILED_MLP_AUTO_MIN_SEQ_LEN = 8192
TILED_LAYERS_AUTO_MIN_TOKENS = 65536
MAX_LAYER_TILE_TOKENS = 8192  # tokens of one decoder-layer tile at most (layer_tile_count)
STORE_ALIGN = 4096  # bytes: every stored layer input starts on a page (pinning, O_DIRECT-sized disk I/O)
DISK_STAGING_SLOTS = 2  # host slots that disk writes and reads pass through (one in flight, one filling)


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


def layer_tile_count(
    tokens: int, hidden: int, intermediate: int, min_tile_tokens: int = 512, max_tile_tokens: int = MAX_LAYER_TILE_TOKENS
) -> int:
    """Tiles for a tiled decoder layer over `tokens` tokens (per rank): one tile's working set ~ one hidden row at
    most, and a tile of at most `max_tile_tokens` tokens.

    Recomputing and back-propagating one checkpointed layer holds about 12 h + 12 f + 4 q + 4 kv bytes per
    token in bf16 (a Llama layer's, as the planner's layer trace measures it); with q, kv <= h that is at most 2 h (8 + 6 f / h) bytes. A
    tile of tokens / (8 + 6 f / h) tokens therefore costs about one bf16 hidden row of the whole sequence
    (2 h bytes per token), small next to the tiled layer's own sequence-long tensors (its input, output,
    their gradients and K/V: several rows). On long rows even that grows without need: the tile's GEMMs
    are saturated long before, and the attention work does not depend on the tiles, so tiles stop growing
    at `max_tile_tokens` and the tile's working set stops growing with the sequence (Llama-3.1-8B at 1M
    tokens: 128 tiles of 8K tokens instead of 29 of 36K). Tiles never get shorter than `min_tile_tokens`
    (GEMM efficiency), so short sequences use fewer tiles (at least one); 512 tokens, so that a small
    model's tile stays near one hidden row down to 16K tokens (llama-60m: 26 tiles of 630 tokens).
    """
    if min(tokens, hidden, intermediate, min_tile_tokens, max_tile_tokens) < 1:
        raise ValueError(
            f"layer_tile_count: every size must be >= 1, got tokens={tokens}, hidden={hidden}, "
            f"intermediate={intermediate}, min_tile_tokens={min_tile_tokens}, max_tile_tokens={max_tile_tokens}"
        )
    by_row = max(math.ceil(8 + 6 * intermediate / hidden), math.ceil(tokens / max_tile_tokens))
    return max(1, min(by_row, tokens // min_tile_tokens))


def round_up(nbytes: int, align: int = STORE_ALIGN) -> int:
    return -(-nbytes // align) * align


def stored_input_bytes(tokens: int, hidden: int, itemsize: int, checkpoint_dtype: str | None) -> int:
    """Bytes of one layer input of `tokens` x `hidden` elements as the offload store keeps it (one slot).

    Stored as is, in bf16 (2 bytes; from fp32), or in fp8 e4m3 (1 byte) followed by one fp32 scale per
    token. Each slot is rounded up to STORE_ALIGN, nothing else: this is what the store allocates.
    """
    if checkpoint_dtype == "fp8":
        return round_up(tokens * hidden + 4 * tokens)
    if checkpoint_dtype == "bf16":
        return round_up(tokens * hidden * min(itemsize, 2))
    return round_up(tokens * hidden * itemsize)


def kept_attention_bytes(tokens: int, heads: int, value_width: int, itemsize: int) -> int:
    """Bytes of one layer's kept attention (`memory.keep_attention`, #53) as the offload store keeps it (one slot):
    the logsumexp of each of `tokens` x `heads` queries in fp32, then the output, `value_width` wide in the kernel
    dtype (`itemsize` bytes), never compressed (the recompute takes it as the output). Under context parallelism a
    rank keeps its own `tokens` (the ring) or the whole rows of its heads (Ulysses): the same bytes."""
    return round_up(tokens * heads * (4 + value_width * itemsize))


def stored_items_per_layer(keep_attention: bool) -> int:
    """What the offload store keeps of each checkpointed layer: its input, and with `keep_attention` its attention's
    output and logsumexp (one packed item; `kept_attention_bytes`). Item 2 i is layer i's input, 2 i + 1 its
    attention, so that the placement's GPU-first, host, disk order covers both."""
    return 2 if keep_attention else 1


@dataclass(frozen=True)
class CheckpointPlacement:
    """Where the offload store keeps each stored layer input (`stored_input_count`): GPU first, then host, then disk.

    The LAST `device` stored inputs stay on the device: their inputs live the shortest time (saved
    late in forward, consumed first in backward) and the first backward needs no reload. The FIRST
    `disk` layers go to disk: their writes have the whole forward to finish and their reads the whole
    backward to be prefetched. The `host` layers in between take exact-size slots.

    Each layer has a slot per micro-batch `in_flight`: the forwards whose backward has not run yet, 1 on one
    process (each micro-batch's backward follows its forward), more on a pipeline stage (the schedule's count,
    `longfit.parallel.pipeline.micro_batches_in_flight`), so every tier holds `in_flight` inputs of each of its
    layers.
    """

    device: int
    host: int
    disk: int
    slot_bytes: int
    """One stored layer input (`stored_input_bytes`)."""
    in_flight: int = 1
    """Micro-batches whose inputs are stored at once."""
    tower_slots: tuple[int, ...] = ()
    """The slot of each tower's own store (`longfit.memory.apply.checkpoint_tower`), in `MediaEncoder.towers` order
    (the vision tower, Gemma 4's audio tower): a block's input on the heaviest row the data packs
    (`longfit.plan.media.tower_slots`), so that no later row's outgrows the slot the first step would size; 0 or
    missing: the first input's size."""

    @property
    def layers(self) -> int:
        return self.device + self.host + self.disk

    def tier(self, index: int) -> str:
        """"disk", "host" or "device" for the stored input `index` (0-based, forward order)."""
        if index < self.disk:
            return "disk"
        return "host" if index < self.disk + self.host else "device"

    @property
    def host_slots(self) -> int:
        """Slots of host layer inputs in the arena: one per host layer and micro-batch in flight."""
        return self.host * self.in_flight

    @property
    def disk_regions(self) -> int:
        """Regions of the disk file: one per disk layer and micro-batch in flight."""
        return self.disk * self.in_flight

    @property
    def host_bytes(self) -> int:
        """The host arena: the host slots, plus the disk tier's staging slots."""
        return (self.host_slots + (DISK_STAGING_SLOTS if self.disk else 0)) * self.slot_bytes

    @property
    def disk_bytes(self) -> int:
        return self.disk_regions * self.slot_bytes

    @property
    def device_bytes(self) -> int:
        return self.device * self.in_flight * self.slot_bytes


def place_checkpoints(
    layers: int, slot_bytes: int, device_budget: int = 0, host_budget: int | None = None, disk: bool = False,
    in_flight: int = 1,
) -> CheckpointPlacement:
    """GPU first: as many layers as `device_budget` bytes hold, then host, then (with `disk`) the rest on disk; each
    layer takes `in_flight` slots of `slot_bytes` (`CheckpointPlacement.in_flight`).

    `host_budget` None is unlimited. Without `disk` every layer that does not stay on the device goes to
    the host, over budget or not: the caller (`plan.preflight`) refuses a host need above what is there.
    """
    if layers < 0 or slot_bytes < 1 or in_flight < 1:
        raise ValueError(f"place_checkpoints: layers={layers}, slot_bytes={slot_bytes}, in_flight={in_flight}")
    layer_bytes = slot_bytes * in_flight
    device = min(layers, max(0, device_budget) // layer_bytes)
    rest = layers - device
    host_layers = rest if host_budget is None else max(0, host_budget) // layer_bytes
    if not disk or rest <= host_layers:
        return CheckpointPlacement(device, rest, 0, slot_bytes, in_flight)
    # the staging slots come out of the same budget
    host = max(0, (max(0, host_budget) // slot_bytes - DISK_STAGING_SLOTS) // in_flight)
    return CheckpointPlacement(device, host, rest - host, slot_bytes, in_flight)


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
    tiled_layers: bool = False
    layer_tiles: int | None = None
    """None: derived per call from the tokens the layer sees (`layer_tile_count`)."""
    offload_dir: str | None = None
    checkpoint_dtype: str | None = None
    keep_attention: bool = False
    """The checkpointed layers keep their attention's output and logsumexp (#53; `kept_attention_bytes` each)."""


def stored_input_count(checkpointed: int, tiled_layers: bool, keep_attention: bool = False) -> int:
    """The items the offload store keeps: the inputs of the checkpointed layers, all but the first under tiled layers,
    whose first layer looks its input up again from the token ids (longfit.memory.tiled_layers); with
    `keep_attention` each layer's kept attention too (`stored_items_per_layer`)."""
    layers = checkpointed - 1 if tiled_layers and checkpointed else checkpointed
    return layers * stored_items_per_layer(keep_attention)


def checkpointed_layer_count(cfg: Config, switches: MemorySwitches, layers: int) -> int:
    """How many decoder layers are checkpointed: the first round(memory.checkpoint_fraction x layers).

    Offload and tiled layers act on those layers only; asked for explicitly (not `auto`) they need one at
    least, or the run would silently go without them."""
    if not switches.activation_checkpointing:
        return 0
    count = round(switches.checkpoint_fraction * layers)
    asked = [key for key in ("offload_activations", "tiled_layers") if getattr(cfg.memory, key) is True]
    if count == 0 and asked:
        raise ConfigError(
            f"memory.checkpoint_fraction={switches.checkpoint_fraction} checkpoints none of the {layers} decoder "
            f"layers, and {' and '.join('memory.' + key for key in asked)} act on the checkpointed ones: raise "
            f"memory.checkpoint_fraction to {1 / layers:.3g} (one layer) or more"
        )
    return count


def resolve_memory_switches(
    cfg: Config, device_type: str, vocab_size: int, free_bytes: int | None = None, linear_attention: bool = False,
    untileable_mlp: str | None = None, untileable_layers: str | None = None, keep_attention_fits: bool = True,
) -> MemorySwitches:
    """Decide the "auto" switches for a device type ("cuda", "cpu", ...) with `free_bytes` free on it at the
    start (None: unknown, e.g. CPU), which sizes the loss chunk (`loss_chunk_tokens`).

    The "auto" techniques trade compute for device memory, so they turn on where device memory is
    scarce: on CUDA, offload from seq_len 32768, tiled MLP from seq_len 8192 and tiled decoder layers
    from TILED_LAYERS_AUTO_MIN_TOKENS tokens per GPU (where a tiled layer's sequence-long tensors are
    small next to the untiled layer's working set). On CPU the model lives in host memory already and
    the recomputation would only cost time.

    Tiled decoder layers and tensor parallelism (parallel.tp > 1) do not compose: under sequence
    parallelism a layer's input is a 1/tp slice of the rows that the layer all-gathers before
    attention, so a tile of it is tp scattered pieces of the sequence, whose causal order the tiled
    layer's one-pass schedule relies on. auto leaves tiled layers off under tp; true is refused.
    Sliding-window layers (Gemma 3's local layers) compose: a tile's attention honours the window.
    `linear_attention`: the model has linear-attention (Gated DeltaNet) layers. On one rank of the sequence a tiled
    layer carries their convolution inputs and recurrent state from tile to tile (memory/tiled_layers.py); under
    context parallelism (parallel.cp > 1) they run head-split over the whole sequence (parallel/linear.py), which
    a local tile cannot carry in sequence order: auto leaves tiled layers off there, true is refused.
    `untileable_mlp`: why the tiled MLP cannot run the model (`longfit.memory.tiled_mlp.untileable_mlp`: Gemma 4's
    layers have more than one MLP-like module), None when it can: auto leaves the tiled MLP off, true is refused
    saying why.
    `untileable_layers`: why tiled layers cannot run the model (`longfit.models.linear_attention.untileable_layers`:
    a token mixer that runs per document), None when they can: auto leaves them off, true is refused saying why.
    `keep_attention_fits`: the planner's answer to whether keeping attention (memory.keep_attention, #53) leaves the
    longest context that fits as long as without it (`longfit.plan.preflight`); auto keeps attention on CUDA where it
    does, with activation checkpointing and without tiled layers (which recompute attention tile by tile; true is
    refused with them). On CPU auto leaves it off, as it leaves the other recomputation trades.
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
        tiled = device_type == "cuda" and cfg.seq_len >= TILED_MLP_AUTO_MIN_SEQ_LEN and untileable_mlp is None
    else:
        tiled = memory.tiled_mlp
    if tiled and untileable_mlp:
        raise ConfigError(
            f"memory.tiled_mlp=true: the tiled MLP cannot run {cfg.model} ({untileable_mlp}); set "
            "memory.tiled_mlp=auto (off for this model) or false"
        )
    tokens = cfg.train.micro_batch * cfg.seq_len // max(1, cfg.parallel.cp)
    tp = cfg.parallel.tp
    if memory.tiled_layers == "auto":
        tiled_layers = (
            memory.activation_checkpointing and device_type == "cuda" and tokens >= TILED_LAYERS_AUTO_MIN_TOKENS
            and tp == 1 and not (linear_attention and cfg.parallel.cp > 1) and untileable_layers is None
            and cfg.train.objective == "causal_lm"
        )
    else:
        tiled_layers = memory.tiled_layers
    if tiled_layers and cfg.train.objective != "causal_lm":
        raise ConfigError(
            f"memory.tiled_layers=true with train.objective={cfg.train.objective}: the tiled layers' attention does not "
            "compute answers that share their prompt yet (#56); set memory.tiled_layers=auto (off for it) or false"
        )
    if tiled_layers and untileable_layers:
        raise ConfigError(
            f"memory.tiled_layers=true cannot tile {cfg.model}: {untileable_layers}; set memory.tiled_layers=auto "
            "(off for this model) or false (activation checkpointing with offload is exact for it)"
        )
    if tiled_layers and linear_attention and cfg.parallel.cp > 1:
        raise ConfigError(
            f"memory.tiled_layers=true with parallel.cp={cfg.parallel.cp}: the model's linear-attention (Gated "
            "DeltaNet) layers run head-split over the whole sequence under context parallelism, which a sequence "
            "tile cannot carry; set memory.tiled_layers=auto or false (activation checkpointing with offload, the "
            "tiled MLP and the chunked loss apply), or parallel.cp=1"
        )
    if tiled_layers and tp > 1:
        raise ConfigError(
            f"memory.tiled_layers=true does not compose with tensor parallelism (parallel.tp={tp}): set "
            "memory.tiled_layers=auto (off under tp) or false, or split the sequence with parallel.cp instead of tp"
        )
    if tiled_layers and not memory.activation_checkpointing:
        raise ConfigError(
            "memory.tiled_layers=true tiles the checkpointed decoder layers (it recomputes them tile by tile): "
            "set memory.activation_checkpointing=true too"
        )
    keep_attention = keep_attention_rule(cfg, device_type, bool(tiled_layers), keep_attention_fits)
    for key, value in (("memory.offload_dir", memory.offload_dir), ("memory.checkpoint_dtype", memory.checkpoint_dtype)):
        if value is not None and not offload:
            raise ConfigError(
                f"{key}={value} applies to offloaded layer inputs: set memory.offload_activations=true "
                "(with memory.activation_checkpointing=true)"
            )
    return MemorySwitches(
        activation_checkpointing=memory.activation_checkpointing,
        checkpoint_fraction=memory.checkpoint_fraction,
        offload_activations=offload,
        tiled_mlp=tiled,
        mlp_tiles=memory.mlp_tiles or None,
        chunked_loss=memory.chunked_loss,
        loss_chunk=(memory.loss_chunk or loss_chunk_tokens(vocab_size, free_bytes)) if memory.chunked_loss else None,
        optimizer=memory.optimizer,
        tiled_layers=bool(tiled_layers),
        layer_tiles=memory.layer_tiles or None,
        offload_dir=memory.offload_dir if offload else None,
        checkpoint_dtype=memory.checkpoint_dtype if offload else None,
        keep_attention=keep_attention,
    )


def keep_attention_rule(cfg: Config, device_type: str, tiled_layers: bool, fits: bool = True) -> bool:
    """memory.keep_attention decided (`resolve_memory_switches`); `fits`: the planner's answer for auto."""
    asked = cfg.memory.keep_attention
    if asked is True and not cfg.memory.activation_checkpointing:
        raise ConfigError(
            "memory.keep_attention=true keeps the attention of the checkpointed layers through their recompute: set "
            "memory.activation_checkpointing=true too, or memory.keep_attention=auto"
        )
    if asked is True and tiled_layers:
        raise ConfigError(
            "memory.keep_attention=true: tiled layers recompute attention tile by tile and keep no layer-wide output; "
            "set memory.tiled_layers=false, or memory.keep_attention=auto (off under tiled layers)"
        )
    if asked == "auto":
        return cfg.memory.activation_checkpointing and device_type == "cuda" and not tiled_layers and fits
    return bool(asked)
