"""Host and disk in the plan: where each checkpointed layer input goes, and what host memory and disk a rank needs.

Offload store (longfit.memory.offload). The checkpointed layer inputs (all but the first under tiled
layers, `switches.stored_input_count`) are placed by
`memory.switches.place_checkpoints` -- the same function the store follows at run time:
  1. the GPU keeps the last layers' inputs while its memory lasts: the device budget is the GPU's
     capacity minus the plan's peak with every input moved out, divided by the allocator slack the
     reserve adds on top of each kept byte;
  2. the host takes one exact-size slot per layer (`switches.stored_input_bytes`: the input, in
     memory.checkpoint_dtype if set, rounded to a page) while this rank's share of host memory lasts;
     a pipeline stage (parallel.pp) takes one per layer and micro-batch in flight (`Stage.in_flight`), on every
     tier: its GPU keeps the last layers' inputs of each of them, its arena and disk file hold theirs;
  3. with memory.offload_dir the rest goes to disk (and two staging slots join the arena); without it
     the rest stays on the host and `fits` says whether that fits.
FSDP2's parallel.cpu_offload keeps the sharded parameters and gradients in PINNED host memory, which
torch's caching host allocator rounds up to a power of two per tensor (counted per tensor here), and
the optimizer state in ordinary host memory (exact).

Capacities are per machine: host memory (`longfit plan --host-mem`, default this machine's available
RAM) and the disk's free space are shared by the ranks of one node (min(world, GPUS_PER_NODE)), each of
which also needs HOST_RESERVE_BYTES for itself (Python, torch, the CUDA runtime and data loading:
an estimate, not measured here).
"""

from __future__ import annotations

import dataclasses

import math

from longfit.memory.switches import (
    CheckpointPlacement,
    kept_attention_bytes,
    place_checkpoints,
    stored_input_bytes,
    stored_input_count,
)
from longfit.plan.setup import Setup, Stage
from longfit.plan.shapes import ModelShape

GPUS_PER_NODE = 8
HOST_RESERVE_BYTES = 6 << 30


def ranks_per_node(s: Setup) -> int:
    """The ranks sharing one machine: the launcher's count on a run, up to GPUS_PER_NODE in a plan."""
    return s.ranks_on_node or min(s.world, GPUS_PER_NODE)


def rank_share(machine_bytes: int | None, s: Setup, reserve: int = 0) -> int | None:
    """One rank's share of a machine's host memory or disk (None: unknown, no limit)."""
    if machine_bytes is None:
        return None
    return max(0, machine_bytes // ranks_per_node(s) - reserve)


def residual_bytes(s: Setup) -> int:
    """Bytes per element of the residual stream, which is what a checkpointed layer saves."""
    return 2 if s.regime == "bf16" else 4


def slot_bytes(s: Setup) -> int:
    """One stored layer input of this rank (`stored_input_bytes`; under tp its sequence-parallel slice); with
    memory.keep_attention a slot holds the larger of it and a layer's kept attention (`attention_item_bytes`)."""
    stored = stored_input_bytes(s.sequence_tokens, s.shape.hidden, residual_bytes(s), s.checkpoint_dtype)
    return max(stored, attention_item_bytes(s)) if s.keep_attention else stored


def attention_item_bytes(s: Setup) -> int:
    """A checkpointed layer's kept attention (memory.keep_attention, #53; `switches.kept_attention_bytes`): the output of
    this rank's heads (1 / tp of them) over its T tokens in the compute dtype, its value heads as wide as the widest
    layer's (`ModelShape.value_width`), and their fp32 logsumexp."""
    if not s.keep_attention:
        return 0
    return kept_attention_bytes(s.tokens, s.shape.heads // s.tp, s.shape.value_width(),
                                4 if s.regime == "fp32" else 2)


def kept_on_device_bytes(s: Setup) -> float:
    """Device bytes of a layer input the GPU-first policy keeps: the input itself, or its compressed copy."""
    h, T, r = s.shape.hidden, s.sequence_tokens, residual_bytes(s)
    if s.checkpoint_dtype == "fp8":
        return (h + 4) * T
    if s.checkpoint_dtype == "bf16":
        return min(r, 2) * h * T
    return r * h * T


def _pinned(nbytes: float) -> int:
    """torch's caching host allocator: every pinned block is rounded up to a power of two."""
    nbytes = int(nbytes)
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


def model_state_host_bytes(
    s: Setup, m: ModelShape, weights: float, gradients: float, optimizer_state: float
) -> int:
    """parallel.cpu_offload: this rank's pinned sharded parameters and gradients, and its optimizer state.

    `m` is the part of the model this rank holds (its tp slice); `weights`, `gradients`, `optimizer_state`
    are this rank's exact bytes (analytic.model_states); the pinned ones are counted again per tensor,
    rounded as torch's pinned allocator rounds them.
    """
    if not s.fsdp_offload:
        return 0
    if s.qlora:  # NF4 storage: leave the per-tensor rounding out
        return int(weights + gradients + optimizer_state)
    shards = s.shards
    frozen_bytes = 2 if s.regime != "fp32" else 4
    tensors = []  # (rows, columns, bytes per element, trainable) of the parameter tensors of one layer
    for name, (fan_in, fan_out) in m.linear_shapes().items():
        tensors.append((fan_out, fan_in, frozen_bytes if s.lora else 4, not s.lora))
        if s.lora and name in s.lora_targets:
            tensors += [(s.lora_rank, fan_in, 4, True), (fan_out, s.lora_rank, 4, True)]
    norms = (4 * m.hidden + 2 * m.head_dim) if m.family == "gemma3" else 2 * m.hidden
    tensors.append((norms, 1, frozen_bytes if s.lora else 4, not s.lora))  # the small norms as one block
    root = [(m.vocab, m.hidden, frozen_bytes if s.lora else 4, not s.lora)] * (2 if m.head_params else 1)
    total = 0
    for group, copies in ((tensors, m.layers), (root, 1)):
        for rows, cols, size, trainable in group:
            shard = math.ceil(rows / shards) * cols  # FSDP2 pads dim 0 to a multiple of the shards
            total += copies * (_pinned(shard * size) + (_pinned(4 * shard) if trainable else 0))
    return total + int(optimizer_state)


def host_budget(s: Setup, host_capacity: int | None, model_state_host: int) -> int | None:
    """Host bytes this rank may give the offload store (None: unlimited)."""
    share = rank_share(host_capacity, s, HOST_RESERVE_BYTES)
    return None if share is None else max(0, share - model_state_host)


def checkpoint_placement(
    s: Setup, device_budget: float, store_host_budget: int | None, allocator_slack: float, stage: Stage | None = None
) -> CheckpointPlacement | None:
    """The placement of this rank's checkpointed inputs (None without offload); see the module docstring. A pipeline
    `stage` stores the inputs of its checkpointed layers for each of its micro-batches in flight."""
    checkpointed, in_flight = (s.checkpointed, 1) if stage is None else (stage.checkpointed, stage.in_flight)
    if not (s.offload_activations and checkpointed):
        return None
    slot = slot_bytes(s)
    # Each kept input costs its device bytes plus the reserve's slack on them; counted in whole slots.
    per_layer = max(kept_on_device_bytes(s) * (1 + allocator_slack), slot)
    device_slots = int(max(0.0, device_budget) // per_layer)
    from longfit.plan.media import tower_slots

    stored = stored_input_count(checkpointed, s.tiled_layers, s.keep_attention)
    placed = place_checkpoints(stored, slot, device_slots * slot, store_host_budget, disk=s.offload_dir is not None,
                               in_flight=in_flight)
    # the towers' stores beside (plan/media.py), on the first stage alone under parallel.pp
    return dataclasses.replace(placed, tower_slots=tower_slots(s) if stage is None or stage.first else ())
