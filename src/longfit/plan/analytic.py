"""Analytic per-GPU memory of one training step: the formulas are here, each decoder layer's costs traced off the model.

Notation (per rank): P parameters, P_l of one decoder layer, P_root outside the layers (embeddings,
final norm, untied lm_head) -- under tensor parallelism (tp) this rank's slices of them (`_tp_slice`);
S = dp_shard x cp ranks that FSDP2 shards over; T = micro_batch x seq_len / cp tokens of this rank's cp
shard, T / tp of them in the residual stream between layers (sequence parallelism); h hidden, V vocabulary
(V / tp under tp); r bytes of the residual stream (2 under FSDP2's
bf16 mixed precision; 4 for one GPU, whose fp32 parameters run under bf16 autocast, or in fp32);
c bytes of a matmul output (2, or 4 in fp32); g bytes of a gathered parameter (2 under bf16, else 4).
LoRA under bf16 is the "bf16" regime on any number of GPUs: its frozen base is stored in bf16.

Model states (what DeepSpeed's and accelerate's estimators count), sharded over S when S > 1 (whole on every rank under a
Trainer's DDP, `Setup.replicated`: no FSDP2 terms, and the gradients, DDP's buckets, there from the step's start):
  weights 4 P / S (fp32 master weights; LoRA: the frozen base in the compute dtype, 2 bytes under
  bf16, adapters 4; QLoRA's adapted projections NF4 with double-quantized absmax, about 0.516 B),
  gradients 4 P_train / S (fp32),
  optimizer state 8 (adamw) | 4 (adamw_bf16) | 2 + 8/256 (adamw8bit) x P_train / S.
  parallel.cpu_offload (FSDP2's CPUOffloadPolicy, on any number of ranks) moves all three to host.
Decoder layers, of every family alike: the costs of one layer of each kind, traced on fake tensors at the model's
real widths under the run's regime and techniques (plan/layer_trace.py: LoRA, tp and cp on a fake process
group, checkpointing, the tiled MLP, tiled decoder layers), as bytes = a + b T (+ c t with tiles of t tokens):
  a layer keeps `saved` x T from its forward to its backward (plus its input r h T when autograd keeps
  it); a checkpointed layer keeps only its input (where the offload store puts it, below), and its
  backward peak includes the recomputed layer. Ring / Ulysses buffers (K/V blocks in flight, fp32
  accumulators, all-to-all copies, a sliding window's halo) and tensor parallelism's gathered (T, h)
  inputs are in the traced peaks. On one GPU and under Ulysses, sliding-window layers measure longfit's
  blockwise window, which CUDA's windowed FlashAttention-2 call undercuts slightly.
Tiled decoder layers (memory.tiled_layers, plan/tiled.py): a tiled layer keeps only its input, and its peaks
are its sequence-long tensors plus one tile's working set (the c t term); the final norm then runs over tiles
too. The first tiled layer keeps nothing: its
backward looks its input up again from the token ids (r h T while it runs), and the embedding output,
which transformers' model forward holds until it returns, is freed before the loss; on image rows it keeps its input
as a checkpointed layer does (`looks_up_first_input`).
Offload store (memory.offload_activations, plan/storage.py): the checkpointed inputs are placed GPU first
(as many of the last layers as the GPU has room for after a first pass with none kept), then in exact-size
host slots, then on disk (memory.offload_dir). A compressed copy kept on the GPU (memory.checkpoint_dtype)
exists beside its layer's input during that layer's forward. In a layer's backward its input is a tensor
of its own (r h T, traced for as long as the layer's recompute refers to it) unless the GPU kept it uncompressed,
a kept attention (memory.keep_attention) that the store moved off the GPU is loaded back, and the previous layer's
input, when it is in host memory or on disk, is on the GPU already as stored (the offloader's prefetch: a host input
is copied in at once, a disk input as soon as its read into a host staging slot completes). Host memory counts those slots and FSDP2's CPU-offloaded model states.
A pipeline stage's store (below) holds its checkpointed layers' inputs of each micro-batch in flight
(`Stage.in_flight`): a slot per layer and micro-batch on every tier, placed GPU first within the GPU's room for all
of them.
The tensors the model hands its layers besides the hidden states (rotary tables of every layer kind, Gemma 3n's and
Gemma 4's per-layer inputs) are traced too (`Traced.tables`), live until the first layer's backward; under full
fine-tuning the per-layer inputs' gradient, summed over the layers' slices, from the last layer's backward to the
first's, and the keys and values each KV-storing layer writes into the mapping the model hands its layers, with what
its recompute saved to make them, from its backward to the first layer's (`_layer_inputs_gradient`,
`_kv_stored_bytes`). A kept attention is its own
layer's heads' width (Gemma 4's sliding layers: half its global layers'). What a layer hands the next besides the
hidden states, when nothing of its own keeps it (traced: `passed`, GLM-5's key selection), the next layer holds until
its backward.
At the embedding's backward the other root parameters' gradients are complete (per-layer input embeddings), and a
tied lm_head's gradient, waiting for the embedding's, is summed with it into a third (V, h) tensor.
Written out below: ids; one GPU's autocast copies of the weights (bf16 casts cached
for the whole forward, or saved by the matmul of a non-checkpointed layer: 2 x the layer's linear
weights); the final norm (an fp32 copy of its input); the loss -- full logits: (T, V) in c bytes + fp32
upcast + fp32 log-softmax in forward, 8 V T more in backward; chunked: one chunk of fp32 logits and
their bf16 gradient, the (T, h) hidden gradient and, when lm_head trains, an fp32 (V, h) accumulator;
under tp the vocabulary-parallel loss (one chunk of all tokens when chunked_loss is off): chunks of
(c, V / tp), plus the all-gathered (T, h) hidden states and their partial (T, h) gradient, listed as
communication; FSDP2: the root unit gathered for the whole step (its all-gather output too, over more than one
rank, until layer 0 is gathered: an image row's vision tower runs beside it), a layer gathered around its forward
and (with the next one prefetched) its backward (the last layer, and every layer without reshard_after_forward, from its
forward to the end of its backward), the all-gather buffer, the unsharded bf16 gradients of a layer, its
fp32 reduce-scatter input (FSDP2 keeps the previous one alive through the next layer's backward); the optimizer step (fused AdamW: no temporaries; the
bf16-state AdamW upcasts one tensor's moments at a time).
Pipeline parallelism (parallel.pp, parallel/pipeline.py): each stage is simulated as above on its own layers
(`Stage`): its model states (the embeddings on the first stage, the final norm and lm_head on the last) sharded over
its dp_shard x cp ranks; the loss events on the last stage alone, the embedding backward on the first; the
activations (layer inputs and saved tensors, rotary tables, the stage's output, or on the last stage what the norm
and the loss keep) of each micro-batch in flight; the step's ids, labels and positions; the receive buffers
torch.distributed.pipelining keeps for every micro-batch of the step (hidden states on all but the first stage, their
gradients on all but the last). Image rows (plan/media.py): the vision side on the first stage alone -- its model
states, each micro-batch's tower forward and backward, a trained tower's kept tensors of each micro-batch in flight
as the layers' are, its offload store's slots for them --, and every micro-batch's pixels, token types and embedding
rows on every stage, uncast (a stage's FSDP2 root is handed the token ids alone). A stage's step is simulated at its
first backward (the most micro-batches in flight, no gradient yet) and at its later ones (`Stage.in_flight_later`,
into the earlier micro-batches' gradients). The GPU's peak is its heaviest stage's; parallel.pp_layers cuts the stages, or `stage_cut` picks the cut whose heaviest
stage is lightest. A rank of an interleaved or V schedule, which holds several stages, is planned as one stage holding
their layers with every micro-batch in flight (`pipeline_rank`: an upper bound).
With train.grad_accum > 1 the earlier micro-batches' gradients are there from the start, and each layer's is added
into them in place.
The peak is the largest of the step's events -- each layer's forward, the loss, each layer's
backward and reduce-scatter, the embedding backward, the optimizer step -- so the breakdown names the
event and the terms that set it. `reserve` adds the CUDA context, NCCL buffers and allocator slack
(estimates, not measured here).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from longfit.config import Config
from longfit.memory.switches import (
    CheckpointPlacement,
    kept_attention_bytes,
    stored_input_count,
    stored_items_per_layer,
)
from longfit.models.cache import cache_dir, code_digest, store_json
from longfit.plan.layer_trace import layer_costs as traced_layer_costs
from longfit.plan.layer_trace import FRESH_TRACE_TIMEOUT_S, LoraCounts, lora_counts, padded_slots
from longfit.plan.media import eval_tower_costs, tower_costs
from longfit.plan.padding import row_padding, tile_padding
from longfit.plan.result import CATEGORIES, GiB, PlanResult
from longfit.plan.setup import Setup, Stage, pipeline_rank, pipeline_stage, resolve
from longfit.plan.shapes import (
    CountedParameters,
    ModelShape,
    count_parameters,
    counted_of_json,
    meta_model_of,
    text_config_of,
)
from longfit.plan.stage_cut import balanced_cut
from longfit.plan.storage import (
    checkpoint_placement,
    host_budget,
    attention_item_bytes,
    kept_on_device_bytes,
    model_state_host_bytes,
)
from longfit.plan.tiled import layer_tiles, looks_up_first_input, setup_fraction, tile_tokens

__all__ = ["GiB", "PlanResult", "Setup", "model_states", "plan_config", "plan_pipeline", "plan_run", "plan_setup", "resolve",
           "stage_cut"]

CUDA_CONTEXT_BYTES = 3 * GiB // 4  # CUDA context, cuBLAS/cuDNN workspaces (estimate)
NCCL_BYTES = GiB // 4  # NCCL communicator buffers when world > 1 (estimate)
ALLOCATOR_SLACK = 0.03  # caching-allocator fragmentation with expandable segments (estimate)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit weight, 8-bit absmax per 64, fp32 absmax per 256 blocks
OPTIMIZER_BYTES = {"adamw": 8.0, "adamw_bf16": 4.0, "adamw8bit": 2.0 + 8 / 256}


def _tp_slice(s: Setup) -> ModelShape:
    """The part of the model one tp rank holds, as a shape: its parameter counts are the rank's
    (`tensor_parallel_rank`), its widths those of the rank's activations: query heads, intermediate width and
    vocabulary rows divided by tp (torch.chunk's rounding up for an uneven vocabulary), key/value heads too unless
    tp exceeds them (k_proj and v_proj are then replicated)."""
    m, tp = s.shape, s.tp
    if tp == 1:
        return m
    kv_heads = m.kv_heads // tp if m.kv_heads % tp == 0 else m.kv_heads
    return dataclasses.replace(m, heads=m.heads // tp, kv_heads=kv_heads, intermediate=m.intermediate // tp,
                               vocab=-(-m.vocab // tp), counted=tensor_parallel_rank(s).params)


@dataclasses.dataclass(frozen=True)
class TensorParallelRank:
    """What one tp rank holds of a model (`tensor_parallel_rank`)."""

    params: CountedParameters
    """The model's parameters (under LoRA its frozen base) that the rank holds."""
    adapters: LoraCounts | None
    """The LoRA adapters' parameters that the rank holds; None without LoRA."""


_TP_RANKS: dict[tuple, TensorParallelRank] = {}


def tensor_parallel_rank(s: Setup) -> TensorParallelRank:
    """The parameters tp rank 0 holds (torch.chunk's slices: the first rank's are the largest), counted on the model
    that parallel/tp.py's `apply_tensor_parallel` splits over a fake process group of tp ranks on the meta device,
    peft's adapters on it as build_model adds them: what tensor parallelism divides and what it replicates on every
    rank (norms; k_proj and v_proj with fewer key/value heads than tp ranks; a Gated DeltaNet's fused in_proj_qkv and
    its conv1d) is read off the split, not restated. Once per config, tp and adapters, in this process and on disk
    (keyed by the code digest); a warm plan imports no torch for it."""
    lora = (s.lora_rank, s.lora_targets) if s.lora else None
    key = (s.shape.config_json, s.tp, lora)
    if key not in _TP_RANKS:
        path = cache_dir("tp_ranks") / f"{hashlib.sha256(json.dumps([code_digest(), key]).encode()).hexdigest()}.json"
        try:
            values = json.loads(path.read_text())
            _TP_RANKS[key] = TensorParallelRank(counted_of_json(values["params"]),
                                                LoraCounts(**values["adapters"]) if values["adapters"] else None)
        except (OSError, ValueError, TypeError, KeyError):  # not counted yet, or unreadable: count again
            _TP_RANKS[key] = _counted_tensor_parallel_rank(s)
            store_json(path, dataclasses.asdict(_TP_RANKS[key]))
    return _TP_RANKS[key]


def _adapters(s: Setup) -> LoraCounts:
    """The LoRA adapters' parameters one rank holds of a model outside the preset families, or of any under tp."""
    return tensor_parallel_rank(s).adapters if s.tp > 1 else lora_counts(s)


def _counted_tensor_parallel_rank(s: Setup) -> TensorParallelRank:
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # a rank of a run (`longfit train`'s preflight), whose default process group is taken: the fake one of the
        # count in a process of its own, as a layer trace's (layer_trace.py `_in_a_fresh_process`)
        from longfit.launch import run_in_fresh_interpreters

        (counted,) = run_in_fresh_interpreters(_counted_tensor_parallel_rank, [(s,)],
                                               f"counting a tp rank's parameters of {s.shape.model_type}",
                                               FRESH_TRACE_TIMEOUT_S)
        return counted
    from torch.distributed.tensor import DTensor

    from longfit.memory.loss import CausalLMLoss
    from longfit.models.build import lora_config, peft_quietly
    from longfit.models.linear_attention import prepare_linear_attention
    from longfit.models.structure import decoder_layers
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.tp import apply_tensor_parallel
    from longfit.plan.trace import fake_process_group, real_meshes

    model = meta_model_of(s.shape.name, text_config_of(s.shape.config_json))
    prepare_linear_attention(model)  # as loading routes a Gated DeltaNet, whose kernels tp wraps
    if s.lora:
        with peft_quietly(unquantized=True), torch.device("meta"):
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(s.config))
    with fake_process_group(s.tp), real_meshes():
        apply_tensor_parallel(CausalLMLoss(model), ParallelDims(1, 1, s.tp, "ring", tp=s.tp).build_mesh("cpu").tp_mesh)

        def held(p) -> int:
            return (p.to_local() if isinstance(p, DTensor) else p).numel()

        params = count_parameters(model, lambda p: 0 if s.lora and p.requires_grad else held(p))
        if not s.lora:
            return TensorParallelRank(params, None)

        def trained(module) -> int:
            return sum(held(p) for p in module.parameters() if p.requires_grad)

        layers = decoder_layers(model)
        # a parameter peft adapts as a parameter (fused experts) has no tp layout: tp refuses experts
        return TensorParallelRank(params, LoraCounts(
            trained(model), max(trained(layer) for layer in layers),
            max((trained(layer.mlp) for layer in layers if hasattr(layer, "mlp")), default=0), 0))


class _Peak:
    """Keeps the event with the largest total."""

    def __init__(self) -> None:
        self.total, self.parts, self.event, self.events = -1, {}, "", []

    def see(self, event: str, **parts: float) -> None:
        total = sum(parts.values())
        self.events.append((event, int(total)))
        if total > self.total:
            self.total, self.parts, self.event = total, {k.replace("_", " "): int(v) for k, v in parts.items()}, event


def model_states(s: Setup, stage: Stage | None = None) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of one rank, before any offload; of its `stage`'s part of the
    model under pipeline parallelism."""
    m = _tp_slice(s)
    whole = stage is None or len(stage.layers) == m.layers
    params = m.params if whole else m.stage_params(stage.layers, stage.first, stage.last)
    held = 1.0 if whole else len(stage.layers) / m.layers  # of the decoder layers, where the adapters are
    if s.lora:
        if m.counted is None:
            trainable = m.lora_params(s.lora_rank, list(s.lora_targets)) * held
        else:  # a stage: its layers' adapters, each counted as the largest layer's
            trainable = _adapters(s).total if whole else _adapters(s).largest_layer * len(stage.layers)
        frozen_bytes = 4.0 if s.regime == "fp32" else 2.0
        weights = frozen_bytes * params + 4.0 * trainable
        if s.qlora:
            quantized = m.lora_base_linear_params(list(s.lora_targets)) * held
            weights -= quantized * (frozen_bytes - NF4_BYTES)
    else:
        trainable = params
        weights = 4.0 * params
    # the vision side (plan/media.py), on the first stage only under parallel.pp: fp32 master weights, what
    # train.vision trains
    towers = (tower_costs(s) or eval_tower_costs(s)) if stage is None or stage.first else None
    if towers is not None:
        weights, trainable = weights + 4.0 * towers.params, trainable + towers.trained
    return weights / s.shards, 4.0 * trainable / s.shards, OPTIMIZER_BYTES[s.optimizer] * trainable / s.shards


def states_floor(s: Setup) -> int:
    """Bytes under every planned peak of `s`, at any seq_len: its model states, all live at the optimizer step (each
    rounded down into the breakdown: a byte a category at most), and the CUDA context; 0 where a rank may hold less
    of them (a pipeline stage, FSDP2's CPU offload). Where it exceeds the GPU nothing fits, read before any layer is
    traced (#52)."""
    if s.dims.pp > 1 or s.fsdp_offload:
        return 0
    return sum(int(part) for part in model_states(s)) + CUDA_CONTEXT_BYTES - len(CATEGORIES)


def plan_setup(
    s: Setup,
    capacity: int | None = None,
    host_capacity: int | None = None,
    disk_capacity: int | None = None,
    stage: Stage | None = None,
) -> PlanResult:
    """The peak and its breakdown, with the checkpointed inputs placed GPU first, then host, then disk.

    `capacity` is the GPU's memory; `host_capacity` and `disk_capacity` are the machine's host memory and
    free disk space, shared by its ranks (plan/storage.py). Offloaded inputs are placed twice: with none
    kept on the GPU, to learn what the GPU has left, then keeping as many as that allows. `stage`: the pipeline
    stage a rank of a run under parallel.pp holds (None: the whole model).
    """
    W, G, O = model_states(s, stage)
    state_host = model_state_host_bytes(s, _tp_slice(s), W, G, O)
    store_host_budget = host_budget(s, host_capacity, state_host)
    placement = checkpoint_placement(s, 0, store_host_budget, ALLOCATOR_SLACK, stage)
    if placement is not None and capacity is not None:
        without = _simulate(s, capacity, placement, state_host, stage)
        placement = checkpoint_placement(s, capacity - without.peak_bytes, store_host_budget, ALLOCATOR_SLACK, stage)
    result = _simulate(s, capacity, placement, state_host, stage)
    if stage is not None and s.grad_accum > 1:  # a stage's first backward, then its heaviest later one
        later = _simulate(s, capacity, placement, state_host, stage, later=True)
        result = max(result, later, key=lambda plan: plan.peak_bytes)
    result.host_capacity, result.disk_capacity = host_capacity, disk_capacity
    return result


def _simulate(
    s: Setup, capacity: int | None, placement: CheckpointPlacement | None, state_host: int, stage: Stage | None,
    later: bool = False,
) -> PlanResult:
    """Simulate the live bytes of one step (module docstring) and return the peak and its breakdown. A pipeline
    `stage` is simulated at its first backward, or `later`, at its heaviest backward into earlier gradients."""
    m, T, T_sp = _tp_slice(s), s.tokens, s.sequence_tokens
    # One process's step: its last micro-batch, into the earlier ones' gradients; or into DDP's gradient buckets,
    # which exist from the start (Setup.replicated).
    accumulated = s.grad_accum > 1 or s.replicated
    if stage is None:
        stage = Stage(0, range(m.layers), True, True, 1, s.checkpointed)
    elif not later:
        accumulated = False
    h, V, n = m.hidden, m.vocab, len(stage.layers)
    in_flight, checkpointed = stage.in_flight_later if later else stage.in_flight, stage.checkpointed
    fsdp = s.fsdp  # FSDP2 runs; on one rank only to offload the model states, or under tp; not under DDP
    r = 2 if s.regime == "bf16" else 4  # residual stream bytes
    c = 4 if s.regime == "fp32" else 2  # compute (matmul output) bytes
    g = 2 if s.regime == "bf16" else 4  # gathered parameter bytes
    autocast = s.regime == "autocast"
    W, G, O = model_states(s, stage)
    host = state_host + (placement.host_bytes if placement is not None else 0)
    if s.fsdp_offload:
        W = G = O = 0.0
    trains_root = not s.lora
    P_l = m.layer_params if m.counted is None else m.counted.gathered_layer(s.dims.ep)  # experts split over ep first
    P_train = m.lora_params(s.lora_rank, list(s.lora_targets)) / m.layers if s.lora else P_l  # trainable, per layer
    if s.lora and m.counted is not None:
        P_train = _adapters(s).largest_layer
    # FSDP2 shards a layer's adapters with its frozen weights, one unit: gathering it gathers both, g bytes an element
    # (the fp32 adapters cast to the bf16 param_dtype like the base). So at a layer's backward the gathered layer and
    # the one prefetched hold g (P_l + P_train) each, not g P_l.
    P_unit = P_l + P_train if s.lora else P_l
    P_lin = sum(i * o for i, o in m.linear_shapes().values())
    mlp = ("gate_proj", "up_proj", "down_proj")
    P_mlp_train = (
        _adapters(s).largest_mlp if s.lora and m.counted is not None
        else sum(s.lora_rank * (i + o) for k, (i, o) in m.linear_shapes().items() if k in mlp and k in s.lora_targets)
        if s.lora
        else m.counted.gathered_mlp(s.dims.ep) if m.counted is not None
        else sum(i * o for k, (i, o) in m.linear_shapes().items() if k in mlp)
    )
    biggest_linear = max(i * o for i, o in m.linear_shapes().values())
    # LoRA's weight-shaped tensors of the layer running, which its trace counts as weights (`ActivationBytes`): the
    # merged weight W + B A of each parameter peft adapts as a parameter (fused experts), c bytes an element, made in
    # the forward and the recompute and held until the backward has used it; on one process in bf16, the adapters'
    # bf16 casts of their fp32 weights (2 P_train; FSDP2 gathers them in bf16 instead).
    adapted_copies = 0.0
    if s.lora:
        merged = _adapters(s).largest_merged if m.counted is not None else 0
        adapted_copies = c * merged + (2.0 * P_train if s.regime == "bf16" and not fsdp else 0.0)
    head = m.head_params or m.embed_params  # the lm_head weight (shared with the embedding when tied)
    tied = not m.head_params and stage.first and stage.last  # one parameter, the loss's and the embedding's

    def trained(i: int) -> float:
        """Trainable parameters of the stage's layer i: its own count (layers differ: Gemma 4's global layers, dense
        and MoE layers); under LoRA the largest layer's adapters."""
        return m.counted.gathered(stage.layers[i], s.dims.ep) if m.counted is not None and not s.lora else P_train

    traced = traced_layer_costs(s, stage.layers[:checkpointed])
    per_token: dict[int, dict] = {}
    # the linear-attention scans' padding of the most padded row (plan/padding.py), which one document a row lacks
    row = row_padding(s.config, m.scan_chunk, s.dims.dp_size)
    padded = padded_slots(row.slots, s.micro_batch, s.cp)
    # tiled layers scan a tile at a time, each tile's pieces of documents on whole chunks (plan/padding.py)
    tile_padded = s.micro_batch * tile_padding(row, s.seq_len // s.cp, layer_tiles(s), m.scan_chunk) \
        if m.scan_chunk and s.tiled_layers else 0
    indexer_kl = _indexer_loss_bytes(s, c)

    def layer_costs(i: int) -> dict:
        """The traced costs of layer i's kind, evaluated at this rank's tokens and tiles (bytes per token)."""
        kind = traced.kind_of[stage.layers[i]]
        if kind not in per_token:
            costs = traced.costs[kind]
            scanned = tile_padded if s.tiled_layers and i < checkpointed else padded  # its checkpoint: tiled
            per_token[kind] = costs.at(T, tile_tokens(s, costs.tiling), scanned)
        return per_token[kind]

    peak = _Peak()

    # FSDP2 (S > 1): the root unit (embeddings, final norm, lm_head) is gathered from its pre-forward to
    # the end of backward; a layer is gathered around its forward and again (with the next one
    # prefetched) around its backward; gathering allocates the all-gather buffer and the parameters
    # (2 g P_unit: the layer's weights and adapters) plus the bf16 copy of the local shard (g P_unit / S; an fp32
    # host-to-device copy first under CPU offload).
    def gathered(units: int) -> float:
        return g * units * P_unit if fsdp else 0.0

    gather_buffers = g * P_unit * (1 + 1 / s.shards) + (4 * P_unit / s.shards if s.fsdp_offload else 0) if fsdp else 0.0
    root_params = m.stage_params(range(0), stage.first, stage.last)  # the stage's embeddings, final norm, lm_head
    root = g * root_params if fsdp else 0.0  # the root unit's gathered bytes, gathered for the whole step
    hidden = r * h * T_sp  # the residual stream between layers (first the embedding output)
    # Pipeline stages (parallel/pipeline.py): torch.distributed.pipelining receives each micro-batch of the step into
    # a buffer of its own, allocated for the whole step: the previous stage's hidden states (all but the first stage)
    # and the next stage's gradient of them (all but the last). A stage other than the last keeps each in-flight
    # micro-batch's output for its backward. Every stage holds the step's micro-batches (ids, labels, positions).
    pipelined = s.dims.pp > 1
    received, sent = hidden * (stage.held - stage.first), hidden * (stage.held - stage.last)
    p2p = s.grad_accum * (received + sent)
    comm = root + p2p
    # Earlier micro-batches' gradients, into which this one's are added in place; on the first, each layer's is new.
    grads = G if accumulated else 0.0
    # What the model hands its layers besides the hidden states (traced: rotary tables of each layer kind, per-layer
    # inputs), kept by the layers until their backward.
    tables = traced.table_bytes(T) * in_flight
    batches = 24.0 * T * (s.grad_accum if pipelined else 1)  # ids/labels/positions
    # The rows' images (plan/media.py): the vision side runs before the first layer, under parallel.pp on the first
    # stage alone; the step's micro-batches carry their pixels to every stage (the one the tower runs on counted by
    # its forward, `_towers_forward`).
    images = tower_costs(s, stage.in_flight)
    towers = images if stage.first else None
    if pipelined and images is not None:
        batches += _media_inputs(s, images) * (s.grad_accum - (towers is not None))
    live = batches + tables + (hidden if stage.first else 0.0)  # else in p2p

    # The offload store's tiers in forward and backward: module docstring.
    stored = kept_on_device_bytes(s)
    compressed = stored < r * h * T_sp

    first_stored = checkpointed - stored_input_count(checkpointed, s.tiled_layers)  # the store's layer 0
    looked_up = first_stored == 1 and looks_up_first_input(s)  # made again in its backward (not image rows')
    # memory.keep_attention (#53): each checkpointed layer's attention output and logsumexp, stored beside its input
    # (the store's item after it) or, without offload, on the device from its forward to its backward: the traced
    # layers keep it (`saved` holds it; their backward reads it in place of the recomputed output).
    items, attention = stored_items_per_layer(s.keep_attention), attention_item_bytes(s)

    def attention_of(i: int) -> float:
        """Bytes of layer i's kept attention: its own heads' width. The store's slots are the widest layer's
        (`attention_item_bytes`), the tensors each layer's own: Gemma 4's sliding layers keep half what its global
        layers (head_dim 256 against global_head_dim 512) keep."""
        width = m.value_width(stage.layers[i])
        return float(kept_attention_bytes(T, m.heads, width, 4 if s.regime == "fp32" else 2)) if attention else 0.0

    def stored_tier(i: int, item: int = 0) -> str | None:
        """Where the offload store keeps layer i's input (`item` 1: its kept attention): "device", "host", "disk", or
        None (not offloaded)."""
        if placement is None or not first_stored <= i < checkpointed:
            return None
        return placement.tier((i - first_stored) * items + item)

    def attention_moved(i: int) -> float:
        """Bytes of layer i's kept attention the store moves off the device between its forward and its backward: in
        its `saved` as traced, loaded back for its backward."""
        if not attention or i >= checkpointed:
            return 0.0
        return attention_of(i) if stored_tier(i, 1) in ("host", "disk") else 0.0

    def kept(i: int) -> float:
        """Device bytes layer i keeps from its forward to its backward; its input, if kept, is no longer `hidden`.
        An offloaded input is where the placement puts it: kept on the GPU (maybe compressed), or in a host slot
        or on disk (the arena and the file hold a slot of each micro-batch in flight: `placement.host_bytes`)."""
        costs, tier = layer_costs(i), stored_tier(i)
        saved = costs["saved"] * T - attention_moved(i) + (indexer_kl[stage.layers[i]] * T if i >= checkpointed else 0)
        if i == 0 and looked_up:
            return saved
        if tier is not None:
            return saved + (stored if tier == "device" else 0.0)
        input_kept = (i < checkpointed or costs["input_kept"]) and (i > 0 or stage.first)  # else a receive buffer
        return saved + (r * h * T_sp if input_kept else 0.0)

    # Final norm (RMSNorm computes in fp32), on the last layer's output (`hidden` in live): bf16 keeps an
    # fp32 copy of it (4h) and, when the weight trains, the normalized bf16 value (c h), and frees the
    # bf16 original; fp32/autocast keep the fp32 original and, when the weight trains, x * rsqrt (4h).
    # Its output (r h) feeds the loss.
    if r == 2:
        norm_saved = (4 * h + (c * h if trains_root else 0)) * T_sp
    else:
        norm_saved = (4 * h if trains_root else 0) * T_sp + hidden
    norm_working = 24.0 * h * T_sp
    if s.tiled_layers:  # tiled with the layers: keeps its input (checkpoint), one tile of temporaries
        norm_saved = hidden
        norm_working = r * h * T_sp + 24.0 * h * T_sp * setup_fraction(s)
    loss_working, loss_saved, loss_buffers = _loss(s, c, r, trains_root)
    loss_working += r * h * T_sp  # the final hidden states
    if s.loss_chunk is None and trains_root and s.tp == 1:
        loss_saved += r * h * T  # saved by lm_head for its weight gradient

    def passed(i: int) -> float:
        """Bytes layer i hands the next layer besides the hidden states that nothing of its own keeps (traced:
        `passed`), held by the next one until its backward has run: its checkpoint refers to its keyword inputs, or
        its attention saves them; the last layer's until the model forward returns. GLM-5's key selection (#57): a
        checkpointed layer's (B, T, min(index_topk, cp T)) int32 top-k, 4 index_topk bytes a token, which the next
        layer's checkpoint holds (its "shared" layers attend over it): 2,048 bytes a token of the shrunken copy
        (index_topk 512; 4 MiB at 2,048 tokens a rank), 8 KiB of the published config (index_topk 2,048). A plain
        layer after a checkpointed one lets it go after its forward: counted to its backward (one layer's, a bound)."""
        return layer_costs(i)["passed"] * T

    # The other micro-batches in flight: what their layers keep, and their outputs, kept for their backward: hidden
    # states to send, or on the last stage the norm's and loss's.
    live += (sum(kept(i) for i in range(n)) + sum(passed(i) for i in range(n - 1))
             + (norm_saved + loss_saved if stage.last else sent)) * (in_flight - 1)
    tower_kept = 0.0
    if towers is not None:
        host += towers.host  # its blocks' inputs in their own offload store
        # what the other micro-batches' tower keeps for their backward, as their layers do where it trains (a frozen
        # tower runs without autograd: nothing)
        live += (_tower_kept(s, towers) if towers.trained else 0.0) * (in_flight - 1)
        live, comm, tower_kept = _towers_forward(s, towers, peak, (W, grads, O), live, comm,
                                                 traced.table_bytes(T) + hidden, g, r, root)
    # Layers that skip resharding after forward (all without reshard_after_forward; the last one always, as
    # parallel/fsdp.py shards it) stay gathered until their backward has run.
    gathered_through = [fsdp and not (s.reshard_after_forward and i < n - 1) for i in range(n)]

    def regathered(*layers: int) -> float:
        return gathered(sum(1 for i in layers if i >= 0 and not gathered_through[i]))

    # The first layer's input, not kept by it, still outlives its forward: the model forward's local
    # `inputs_embeds` holds it until the forward returns.
    held_embedding = hidden if looked_up else 0.0
    resident = []  # per layer: device bytes kept from its forward to its backward
    autocast_saved = 0.0  # bf16 weight copies saved by autograd (one rank, autocast)
    autocast_cache = 0.0  # bf16 copies of trainable weights, cached until autocast exits
    for i in range(n):
        costs, ac = layer_costs(i), i < checkpointed
        if fsdp:
            peak.see(
                f"forward, gathering layer {i}",
                weights=W,
                gradients=grads,
                optimizer_state=O,
                activations=live + autocast_saved + autocast_cache,
                communication=comm + gather_buffers + gathered(1),
            )
        peak.see(
            f"forward, layer {i}",
            weights=W,
            gradients=grads,
            optimizer_state=O,
            activations=live + autocast_saved + autocast_cache,
            working_set=(costs["forward_peak"] + indexer_kl[stage.layers[i]]) * T + adapted_copies
            + (stored if stored_tier(i) == "device" and compressed else 0.0),
            communication=comm + gathered(1),
        )
        on_device = kept(i)  # its host slot is in the arena already
        resident.append(on_device)
        live += on_device + passed(i) + (held_embedding if i == 0 else 0.0)
        if i == 0 and not stage.first:  # its output takes the residual stream's place, a receive buffer until now
            live += hidden
        if autocast:  # casts of trainable weights are cached; casts of frozen ones saved by mm unless recomputed
            if not s.lora:
                autocast_cache += 2 * P_lin
            if not ac:
                autocast_saved += 2 * P_lin
        if gathered_through[i]:
            comm += g * P_unit
    if autocast and not s.lora:
        autocast_cache -= autocast_saved  # cached copies also saved are counted once, as saved
    grad_hidden = r * h * T_sp  # the gradient flowing back (a receive buffer's on a stage other than the last)
    held = 0.0
    live -= passed(n - 1)  # the model (or stage) forward has returned
    if stage.last:
        live -= hidden + held_embedding  # the model forward has returned
        live += norm_saved
        peak.see(
            "loss forward",
            weights=W,
            gradients=grads,
            optimizer_state=O,
            activations=live + autocast_saved + autocast_cache,
            working_set=loss_working,
            communication=comm + loss_buffers,
        )
        if towers is not None:  # the root's forward has returned: FSDP2's cast of its inputs is freed
            live -= _cast_pixels(s, towers)
        live += loss_saved
        lm_head_copy = 2.0 * V * h if autocast and trains_root and s.loss_chunk is None else 0.0  # saved by the mm
        autocast_cache = 0.0  # leaving the autocast region frees the cache
        if s.loss_chunk is None and s.tp == 1:
            peak.see(
                "loss backward",
                weights=W,
                gradients=grads,
                optimizer_state=O,
                activations=live + autocast_saved + lm_head_copy,
                working_set=8.0 * V * T,
                communication=comm,
            )
        live -= loss_saved
        # lm_head's gradient: one rank keeps it as .grad; FSDP holds the unsharded one until the root's reduce-scatter.
        # Tied to the embedding, it waits in autograd's input buffer for the embedding's gradient (accumulating too).
        if trains_root:
            if fsdp:
                held = g * head
            else:
                grads += 0.0 if accumulated and not tied else 4.0 * head
        peak.see(
            "final norm backward",
            weights=W,
            gradients=grads,
            optimizer_state=O,
            activations=live + autocast_saved,
            working_set=grad_hidden + norm_working,
            communication=comm + held,
        )
        live -= norm_saved
    rs_buffer = 0.0  # FSDP2 keeps the previous reduce-scatter input alive through the next layer's backward
    layer_inputs_grad = _layer_inputs_gradient(s, r) if trains_root else 0.0
    live += layer_inputs_grad
    storing = {i: _kv_stored_bytes(s, stage.layers[i], r, c, i < checkpointed) * T_sp
               for i in range(n) if stage.layers[i] in m.kv_storing_layers}
    for i in reversed(range(n)):
        costs, ac = layer_costs(i), i < checkpointed
        # Traced with the incoming gradient inside, for as long as the layer holds it; with this layer's input loaded
        # back, decoded or looked up again, for as long as its recompute refers to it (layer_trace's _measure).
        tier = stored_tier(i)
        reloaded = tier is not None and (tier != "device" or compressed) or i == 0 and looked_up
        working = (costs["reloaded_backward_peak" if reloaded else "backward_peak"] + indexer_kl[stage.layers[i]]) * T
        working += attention_moved(i) + adapted_copies  # its kept attention, loaded back; LoRA's weight copies
        working += storing.get(i, 0.0)  # its stored pair and what made it, through its backward (a bound)
        if ac and i > 0 and stored_tier(i - 1) in ("host", "disk"):  # only a checkpointed layer's hooks prefetch
            working += stored  # the previous layer's input, copied in ahead
        if ac and i > 0 and stored_tier(i - 1, 1) in ("host", "disk"):
            working += attention_of(i - 1)  # and its kept attention
        if autocast:
            working += (2 * P_lin if ac else 0.0) + (
                2 * biggest_linear if not s.lora else 0.0
            )  # recompute casts, bf16 weight grad
        layer_grads = 2 * P_mlp_train if fsdp else 0.0  # unsharded bf16 gradients (of the MLP, done at the peak)
        # A tiled layer's own gradients on one process: made by its first tile back (memory/tiled_layers.py
        # accumulates .grad tile by tile), they are there through every other tile's working set.
        own_grads = 4 * trained(i) if s.tiled_layers and ac and not fsdp and not accumulated else 0.0
        peak.see(
            f"backward, layer {i}",
            weights=W,
            gradients=grads + own_grads,
            optimizer_state=O,
            activations=live + autocast_saved,
            working_set=working,
            communication=comm + held + regathered(i, i - 1) + rs_buffer + layer_grads,
        )
        live -= resident[i] + (passed(i - 1) if i > 0 else 0.0)
        live += storing.get(i, 0.0)  # its stored keys and values stay to the end of the backward
        if gathered_through[i]:  # resharded after its backward
            comm -= g * P_unit
        if autocast and not ac:
            autocast_saved -= 2 * P_lin
        if fsdp:
            rs_buffer = 4 * trained(i)
            peak.see(
                f"backward, reduce-scatter layer {i}",
                weights=W,
                gradients=grads,
                optimizer_state=O,
                activations=live + autocast_saved,
                working_set=grad_hidden,
                communication=comm + held + regathered(i - 1) + 2 * trained(i) + rs_buffer * (1 + 1 / s.shards),
            )
            grads += 0.0 if s.fsdp_offload or accumulated else 4 * trained(i) / s.shards  # offloaded: copied to host
        else:
            grads += 0.0 if accumulated else 4 * trained(i)
    live -= tables + layer_inputs_grad  # freed by the first layer's backward, the last to read them
    live -= sum(storing.values())
    if trains_root and stage.first:
        embed_grad = (g if fsdp else 4) * m.embed_params  # dense (V, h) gradient of the embedding
        # The other root parameters' gradients are complete by now: autograd runs the input embedding, the first
        # node of the forward, last (the final norm; per-layer input embeddings and their projection: 2.0B of the
        # 5.1B parameters of transformers' default gemma4_text config). FSDP holds them unsharded until the root's
        # reduce-scatter. (A stage before the last holds the embedding alone.)
        whole = s.shape
        other_root = whole.root_params - whole.embed_params - whole.head_params if stage.last else 0
        if fsdp:
            held += g * other_root
        else:
            grads += 0.0 if accumulated else 4.0 * other_root
        peak.see(
            "embedding backward",
            weights=W,
            gradients=grads,
            optimizer_state=O,
            activations=live,
            working_set=grad_hidden + embed_grad * (2 if tied else 1),  # tied: the sum of the two gradients
            communication=comm + held + rs_buffer,
        )
    if towers is not None and towers.trained:  # the vision side's backward, the step's last (plan/media.py)
        peak.see("vision tower backward", weights=W, gradients=grads, optimizer_state=O,
                 activations=live - tower_kept, working_set=towers.backward + _gathered_gradient(s, towers),
                 communication=comm + held + rs_buffer)
        live -= tower_kept
        if fsdp:
            held += g * towers.trained
        else:
            grads += 0.0 if accumulated else 4.0 * towers.trained
        root_params += towers.trained
    if trains_root and fsdp and root_params:
        # the root's parameters are resharded first; its unsharded gradients are copied into an fp32 input and
        # freed before the output is allocated (torch's foreach_reduce)
        peak.see(
            "backward, reduce-scatter root",
            weights=W,
            gradients=grads,
            optimizer_state=O,
            activations=live,
            communication=p2p + max(g + 4, 4 + 4 / s.shards) * root_params,
        )
    peak.see("optimizer step", weights=W, gradients=G, optimizer_state=O, working_set=_optimizer_temp(s),
             communication=p2p)
    evaluated = eval_tower_costs(s) if stage.first else None
    if evaluated is not None:  # an evaluation's images (plan/media.py), after a step: zero_grad freed the gradients;
        # its micro-batch's ids, labels and positions as the step's (`batches`), the root gathered as in the step
        _towers_forward(s, evaluated, peak, (W, 0.0, O), 24.0 * T, root, 0.0, g, r, root, during="eval: ")
    tensor_bytes = int(peak.total)
    reserve = int(CUDA_CONTEXT_BYTES + (NCCL_BYTES if s.world > 1 else 0) + ALLOCATOR_SLACK * tensor_bytes)
    breakdown = {k: peak.parts.get(k, 0) for k in CATEGORIES if k != "reserve"}
    breakdown["reserve"] = reserve
    disk = placement.disk_bytes if placement is not None else 0
    return PlanResult(s, tensor_bytes, breakdown, peak.event, int(host), capacity, peak.events, disk, placement,
                      stage=stage if pipelined else None)


def _towers_forward(s: Setup, towers, peak: _Peak, states: tuple[float, float, float], live: float, comm: float,
                    not_yet: float, g: int, r: int, root: float, during: str = "") -> tuple[float, float, float]:
    """The vision side's forward before the first layer (plan/media.py): the batch's pixels and per-token tensors,
    the tower on this rank's images (`not_yet`: the language model's tensors that do not exist yet), then its
    embeddings scattered into the rank's input embeddings (`root`: the root unit's gathered bytes without the tower);
    `during`: the start of its points' names ("eval: ", an evaluation's). Returns (live, comm, the tower's bytes kept
    for its backward)."""
    W, G, O = states
    T, h = s.tokens, s.shape.hidden
    live += _media_inputs(s, towers)
    if s.fsdp:
        comm += g * towers.params  # gathered with the root parameters for the whole step
    # FSDP2's forward keeps a unit's all-gather output (its gathered size) until the next unit's all-gather is copied
    # out (implicit prefetching, over more than one rank): the root's, the tower's in it, lives until layer 0 gathers
    buffer = root + g * towers.params if s.fsdp and s.shards > 1 else 0.0
    peak.see(f"{during}vision tower forward", weights=W, gradients=G, optimizer_state=O, activations=live - not_yet,
             working_set=towers.forward + _own_pixels(s, towers), communication=comm + buffer)
    kept = _tower_kept(s, towers)
    live += kept
    features = towers.features  # (N, H) of every image of the batch
    ranks = s.dims.row_ranks  # the all-gather's padded pieces (parallel/media.py)
    gather = features * (1 + 1 / ranks) if ranks > 1 and towers.images < towers.batch_images else 0.0
    peak.see(f"{during}image embeddings into the sequence", weights=W, gradients=G, optimizer_state=O,
             activations=live - not_yet + r * h * T, working_set=features + gather + 2.0 * r * h * T,
             communication=comm + buffer)
    return live, comm, kept


def _media_inputs(s: Setup, towers) -> float:
    """Bytes of a micro-batch's image inputs on a rank, from the forward that reads them: its pixels (and their cast,
    `_cast_pixels`); token types (int32, whole rows) and embedding rows (int64) per token; M-RoPE's (4, B, L / cp)
    ids."""
    return (towers.pixels + _cast_pixels(s, towers) + 4.0 * s.micro_batch * s.seq_len + 8.0 * s.tokens
            + (32.0 * s.tokens if towers.positions else 0.0))


def _own_pixels(s: Setup, towers) -> float:
    """A rank's own images' pixels, copied out of the batch's under cp or tp (parallel/media.py); copied out of the
    bf16 cast (`_cast_pixels`), it is the tower's bf16 input, which the traced tower holds as its own cast of the
    pixels."""
    if s.dims.row_ranks > 1 and towers.images < towers.batch_images and not _cast_pixels(s, towers):
        return towers.pixels * towers.images / towers.batch_images
    return 0.0


def _tower_kept(s: Setup, towers) -> float:
    """Bytes the tower keeps from a micro-batch's forward to its backward beyond its output (scattered and freed): a
    trained tower's first layer keeps its input, in fp32 that copy itself (`_own_pixels`; bf16 and autocast keep
    their cast of it, which the traced tower holds)."""
    own = _own_pixels(s, towers) if towers.trained == towers.params and s.regime == "fp32" else 0.0
    return towers.kept - towers.output + own


def _cast_pixels(s: Setup, towers) -> float:
    """FSDP2's bf16 mixed precision casts the floating inputs of the root's forward: the batch's fp32 pixels (every
    image of the micro-batch, on every rank) are copied to bf16 when it starts and freed when it returns, after the
    loss. A pipeline stage's root is handed the token ids and the micro-batch's index alone (parallel/pipeline.py
    `VirtualStage`): the pixels it reads from the micro-batch are not cast."""
    return towers.pixels * 2 / 4 if s.regime == "bf16" and s.fsdp and s.dims.pp == 1 else 0.0


def _gathered_gradient(s: Setup, towers) -> float:
    """The gradient of every image's embeddings, all-reduced over the ranks holding the rows (parallel/media.py), and
    its copy."""
    if s.dims.row_ranks == 1 or towers.images == towers.batch_images:
        return 0.0
    return 2.0 * towers.features


def _text_config(s: Setup):
    """The transformers config object of the (text) model `s` plans."""
    import json

    from transformers import AutoConfig

    values = json.loads(s.shape.config_json)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _layer_inputs_gradient(s: Setup, r: int) -> float:
    """Bytes of the gradient of Gemma 3n's and Gemma 4's per-layer inputs under full fine-tuning: the model makes one
    (B, T, layers, hidden_size_per_layer_input) tensor of trained embeddings, in the embeddings' dtype (r), and hands
    each layer its slice; autograd sums the slices' gradients into one tensor of the whole (each layer's slice
    scattered into a zero tensor of that size, added to the sum), from the last layer's backward until the
    projection that made them runs its backward after the first layer's. The layer traces end at their own slice
    (plan/layer_trace.py). Gemma-4-E2B at 32K tokens a rank: 0.55 GiB in bf16."""
    width = s.shape.per_layer_input_width
    return float(r * s.tokens * s.shape.layers * width) if width else 0.0


def _kv_stored_bytes(s: Setup, layer: int, r: int, c: int, recomputed: bool) -> float:
    """Bytes a token of a KV-storing layer (`ModelShape.kv_storing_layers`) leaves from its backward to the first
    layer's in the `shared_kv_states` mapping that transformers' Gemma 3n and Gemma 4 models hand every layer and the
    checkpoints hold: its rotated keys (in the wider of c and the rotary tables' r) and normalized values, the latest
    pair of its attention type. A checkpointed layer's recompute makes the pair again through a graph no backward runs,
    which keeps what autograd saved to make it: the input norm's fp32 input, its two fp32 statistics a row and the
    projections' input (c bytes; autocast casts it once for each projection); the keys' and values' fp32 projections
    and their norms' statistics; with trained norm weights (not under LoRA) the input's and keys' fp32 normalized
    values. Its rotary tables are the model's, freed with them. Through the layer's own backward, whose traced cost
    frees these as it passes them, the mapping holds them too: counted whole there, a bound (#52: a tiny Gemma 4 stores
    a pair per attention type also without KV-shared layers; it planned 3.0% under its traced step in fp32, 4.6% in
    bf16, now 2.5% and 1.6% over)."""
    m = s.shape
    kv_heads = m.layer_kv_heads[layer] if m.layer_kv_heads else m.kv_heads
    width = kv_heads * (m.layer_head_dims[layer] if m.layer_head_dims else m.head_dim)  # of its keys and values
    pair = (max(c, r) + c) * width
    if not recomputed:
        return float(pair)
    casts = 2 if s.regime == "autocast" else 1
    normalized = 0 if s.lora else 4 * (m.hidden + width)
    return float(pair + (4 + c * casts) * m.hidden + 8 * width + normalized + 8 * (1 + 2 * kv_heads))


def _indexer_loss_bytes(s: Setup, c: int) -> list[float]:
    """Per decoder layer, the bytes per token that train.indexer_loss (#57) adds to a layer with a lightning indexer,
    which the traced layers run without: from its indexer to its backward the layer holds what the KL loss saves (the
    fp32 index queries, head weights and keys, these gathered over the whole rows under cp) and its key norm's input
    and statistics (models/sparse_attention.py). Measured: exactly the traced step's excess over the plan without it
    (a small DeepSeek-V3.2 on 2 GPUs, bf16, 4,096 tokens: 1,256 bytes a token)."""
    if not s.config.train.indexer_loss:
        return [0.0] * s.shape.layers
    config = _text_config(s)
    heads, width = getattr(config, "index_n_heads", None), getattr(config, "index_head_dim", None)
    if heads is None:
        return [0.0] * s.shape.layers
    per_token = 4.0 * (heads * width + heads) + 4.0 * width * s.dims.cp + c * width + 8.0
    kinds = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers  # GLM-5's "shared": none
    return [per_token if kind == "full" else 0.0 for kind in kinds]


def _loss(s: Setup, c: int, r: int, trains_root: bool) -> tuple[float, float, float]:
    """(forward working set, bytes kept for backward, tp communication buffers) of the loss on the final
    hidden states."""
    T, T_sp, V, h = s.tokens, s.sequence_tokens, -(-s.shape.vocab // s.tp), s.shape.hidden
    if s.loss_chunk is None and s.tp == 1:
        # logits (T, V) in the compute dtype + fp32 upcast (none in fp32) + fp32 log-softmax (saved)
        upcast = 0 if c == 4 else 4
        weight_copy = 2.0 * V * h if s.regime == "autocast" and trains_root else 0.0
        return (c + upcast + 4) * V * T + weight_copy, 4.0 * V * T, 0.0
    chunk = min(s.loss_chunk or T, T)  # tp without chunked_loss: one chunk of all tokens
    weight_copy = 2.0 * V * h if s.regime == "autocast" else 0.0  # weight.to(bf16) for the chunk GEMMs
    grad_weight = 4.0 * V * h if trains_root else 0.0  # fp32 accumulator, held until backward
    # One chunk at a time: its bf16 logits and their fp32 upcast, later the fp32 gradient and its bf16
    # copy (fp32: the logits, turned into their gradient in place). A trainable lm_head adds its (V, h)
    # weight-gradient product in bf16 and fp32 (in place in fp32) next to the chunk's bf16 gradient.
    one_chunk = (4 + c if c == 2 else 4) * V * chunk
    with_weight_grad = c * V * chunk + 6.0 * V * h if trains_root and c == 2 else 0.0
    per_chunk = max(one_chunk, with_weight_grad)
    grad_hidden = r * h * T_sp
    # tp: the (T, h) hidden states gathered from the sequence shards, and their partial gradient that is
    # reduce-scattered into `grad_hidden` at the end
    buffers = 2.0 * r * h * T if s.tp > 1 else 0.0
    return weight_copy + grad_weight + per_chunk + grad_hidden, grad_hidden + grad_weight, buffers


def _optimizer_temp(s: Setup) -> float:
    """Transient bytes of the optimizer step: fused AdamW none; bf16-state AdamW upcasts one tensor's moments."""
    if s.optimizer != "adamw_bf16":
        return 0.0
    m = _tp_slice(s)
    largest = max(max(i * o for i, o in m.linear_shapes().values()), m.embed_params if not s.lora else 0)
    return 8.0 * largest / s.shards


def plan_config(
    cfg: Config,
    world_size: int = 1,
    device_memory_bytes: int | None = None,
    device_type: str = "cuda",
    host_memory_bytes: int | None = None,
    disk_bytes: int | None = None,
    ranks_on_node: int = 0,
    replicated: bool = False,
) -> PlanResult:
    """The trainer's pre-flight check: predicted peak per rank of `cfg` on `world_size` GPUs.

    Host memory and disk are the machine's (None: not checked), shared by `ranks_on_node` ranks (0: up to 8
    per machine); see plan/storage.py. `replicated`: every rank holds the whole model (a Trainer under DDP).
    """
    s = resolve(cfg, world_size, device_type, free_at_start(device_memory_bytes), ranks_on_node, replicated)
    return plan_run(s, device_memory_bytes, host_memory_bytes, disk_bytes)


def plan_run(
    s: Setup, capacity: int | None = None, host_capacity: int | None = None, disk_capacity: int | None = None
) -> PlanResult:
    """The plan of `s` (`plan_pipeline` under parallel.pp, else `plan_setup`). memory.keep_attention=auto (#53) keeps
    attention where the run fits with it, or fits neither way; where only dropping it fits, the plan is that one
    (its `setup.keep_attention` false, the plan with it in `kept_attention`), so that keeping attention never
    shortens the context that fits."""
    plan = plan_pipeline if s.dims.pp > 1 else plan_setup
    result = plan(s, capacity, host_capacity, disk_capacity)
    if s.keep_attention and s.config.memory.keep_attention == "auto" and not result.fits and \
            (capacity is None or states_floor(s) <= capacity):  # else it fits neither way
        without = plan(dataclasses.replace(s, keep_attention=False), capacity, host_capacity, disk_capacity)
        if without.fits:
            return dataclasses.replace(without, kept_attention=result)
    return result


def plan_pipeline(
    s: Setup, capacity: int | None = None, host_capacity: int | None = None, disk_capacity: int | None = None
) -> PlanResult:
    """The plan of a run under parallel.pp (parallel/pipeline.py): its heaviest stage's, with every stage's in
    `PlanResult.stages`. Each stage is planned as the whole model is, from its own layers' traced costs
    (`pipeline_stage`: its share of the model states sharded by FSDP2 over its dp_shard x cp ranks, the activations
    of its micro-batches in flight, the embeddings on the first stage, the final norm, lm_head and loss on the last,
    the pipeline's receive buffers), cut by parallel.pp_layers or, when that is empty, by `stage_cut`."""
    from longfit.parallel.pipeline import stage_layers

    if s.dims.pp_stages_per_rank > 1:  # a rank holds several stages: planned per rank (`pipeline_rank`)
        cut = stage_layers(s.shape.layers, s.dims.pipeline_stages, s.config.parallel.pp_layers)
        held = [pipeline_rank(s, rank, cut) for rank in range(s.dims.pp)]
    else:
        sizes = s.config.parallel.pp_layers or stage_cut(s)
        held = [pipeline_stage(s, index, layers)
                for index, layers in enumerate(stage_layers(s.shape.layers, s.dims.pp, sizes))]
    stages = [plan_setup(s, capacity, host_capacity, disk_capacity, stage) for stage in held]
    heaviest = max(stages, key=lambda result: result.peak_bytes)
    # host memory and disk: what the rank needing the most of them needs (the first stages, with the most
    # micro-batches in flight under 1F1B, hold the most offloaded inputs)
    return dataclasses.replace(heaviest, stages=stages, host_bytes=max(p.host_bytes for p in stages),
                               disk_bytes=max(p.disk_bytes for p in stages))


def stage_cut(s: Setup) -> list[int]:
    """Decoder layers per stage of `s`'s pipeline whose heaviest stage's planned peak is lightest (plan/stage_cut.py):
    what `longfit train` runs when parallel.pp_layers is empty and each rank holds one stage (several: the even cut)."""
    return balanced_cut(s.shape.layers, s.dims.pp,
                        lambda index, layers: plan_setup(s, stage=pipeline_stage(s, index, layers)).peak_bytes)


def free_at_start(device_memory_bytes: int | None) -> int | None:
    """The memory a run finds free on an otherwise empty GPU of `device_memory_bytes`: all but the CUDA context."""
    return None if device_memory_bytes is None else device_memory_bytes - CUDA_CONTEXT_BYTES
