"""Parallel degrees of a run and the device mesh built from them.

Ranks form one mesh ("pp", "dp_shard", "cp", "tp"), the last axis varying fastest. Tensor parallelism is
innermost because it communicates in every layer, twice per direction, on the critical path: its groups
are blocks of consecutive ranks (one NVLink domain on GPU clusters). Context parallelism comes next
(its ring / all-to-all traffic overlaps the attention kernels), then dp_shard. Without tp the mesh is
the 2-D ("dp_shard", "cp") one, cp varying fastest. Pipeline parallelism is outermost (torchtitan's order): it
sends one activation per micro-batch between neighbouring stages, the least traffic of all, so its groups may
span nodes; every pp coordinate is a whole (dp_shard, cp, tp) mesh holding one stage (parallel/pipeline.py).
Expert parallelism has a mesh of its own ("efsdp", "ep", "etp"), the same ranks regrouped; under pp it is per stage
(a stage's experts live on its ranks alone), so its all-to-alls never cross stages.

FSDP2 shards the parameters over ALL dp_shard x cp ranks of a tp coordinate: CP ranks hold different
tokens of the same rows, so for the parameters they are data-parallel peers like any other
(torchtitan's "dp_shard_cp"). tp ranks hold different slices of the same parameters and the same
tokens; FSDP2 shards each slice further over dp_shard x cp (2-D DTensors on ("dp_shard_cp", "tp")).

Everything is passed explicitly: `build_mesh` returns a `ParallelMesh` holding the process groups;
nothing lives in globals. On one process every group is None and the collectives of
`longfit.parallel.comm` are no-ops, so the trainer runs the same code for 1 and N ranks; only FSDP2 on
one rank (parallel.cpu_offload) builds a mesh of one rank, over a one-rank process group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from longfit.config import ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from longfit.config import Config

# Chunks of a row that each cp rank holds: the zigzag ring two (chunks r and 2cp-1-r), Ulysses one.
ROW_CHUNKS_PER_RANK = {"ring": 2, "ulysses": 1}
# The decoder projections tensor parallelism shards, and so the only modules LoRA may adapt under it.
TENSOR_PARALLEL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# Schedules of torch.distributed.pipelining by parallel.pp_schedule (parallel/pipeline.py): the torch class and where
# the stages sit: "single" one per rank, "loop" rank r holding stages r, r + pp, ... (interleaved), "v" rank r holding
# stages r and 2 pp - 1 - r (torchtitan's placements).
PIPELINE_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}
# Decoders whose transformers body a pipeline stage runs as it is (parallel/pipeline.py): the previous stage's hidden
# states given as inputs_embeds reach the first layer unchanged, and the layers are iterated as modules, not by their
# position in the body. Proven by tests/test_parallel_pipeline.py.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


def splits_backward(schedule: str) -> bool:
    """The zero-bubble schedules and DualPipeV run each stage's backward twice from the same incoming gradient: the
    input gradient first, the weight gradient later (torch.distributed.pipelining's stage_backward_input /
    stage_backward_weight)."""
    schedule_class = PIPELINE_SCHEDULES.get(schedule, ("",))[0]
    return schedule_class.endswith("ZeroBubble") or schedule_class == "ScheduleDualPipeV"


def pipeline_stages_per_rank(schedule: str, configured: int) -> int:
    """parallel.pp_stages_per_rank resolved: 0 is 1 under the one-stage schedules, 2 under the interleaved and V ones
    (torchtitan's default). An unknown schedule is left to `ParallelDims.check_pipeline` to name."""
    if configured:
        return configured
    return 1 if PIPELINE_SCHEDULES.get(schedule, ("", "single"))[1] == "single" else 2


def stage_layers(num_layers: int, stages: int, sizes: Sequence[int] = ()) -> list[range]:
    """The decoder layers of each pipeline stage, first to last: consecutive, `sizes` of them (parallel.pp_layers,
    checked by `ParallelDims.check_pipeline`), or with no sizes as equal as the count allows, the extra ones on the
    last stages (the first stage holds the embeddings and, under 1F1B, the most micro-batches in flight)."""
    if not sizes:
        base, extra = divmod(num_layers, stages)
        sizes = [base + (stage >= stages - extra) for stage in range(stages)]
    starts = [sum(sizes[:stage]) for stage in range(stages + 1)]
    return [range(starts[stage], starts[stage + 1]) for stage in range(stages)]


def window_fits_chunk(window: int, chunk: int) -> bool:
    """Whether a sliding window's W - 1 earlier keys of a zigzag chunk's first query lie in the chunk just
    before it: then ring attention exchanges that halo instead of passing K/V shards around (ring.py)."""
    return window - 1 <= chunk


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism and every rule that ties them to the world size, the sequence and the model.

    pp x dp_shard x cp x tp must equal the world size (dp_shard=-1 derives it). This class is the one owner
    of those rules: `from_config` checks them all at once, before anything is built, with messages that
    name the fix; the kernels below it only assert. dp_replicate (HSDP) is not implemented; it would
    become a further mesh axis in front of the present ones, with `world_size` their product.
    """

    dp_shard: int
    cp: int
    world_size: int
    cp_method: str = "ring"
    offload_model_states: bool = False
    """parallel.cpu_offload: FSDP2 keeps parameters, gradients and optimizer state in host memory."""
    tp: int = 1
    """parallel.tp: every decoder projection, the embedding and lm_head are split over this many ranks."""
    ep: int = 1
    """parallel.ep: every MoE layer's experts are split over this many of the dp_shard x cp ranks (parallel/expert.py),
    under pp of the stage holding the layer."""
    pp: int = 1
    """parallel.pp: the decoder layers are cut into stages held by this many groups of dp_shard x cp x tp ranks."""
    pp_stages_per_rank: int = 1
    """The pipeline stages each pp rank holds (`pipeline_stages_per_rank`): pp x this many stages in all."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size {self.world_size}: must be >= 1")
        if self.cp < 1:
            raise ConfigError(f"parallel.cp={self.cp}: must be >= 1")
        if self.tp < 1:
            raise ConfigError(f"parallel.tp={self.tp}: must be >= 1")
        if self.pp < 1:
            raise ConfigError(f"parallel.pp={self.pp}: must be >= 1")
        if self.cp_method not in ROW_CHUNKS_PER_RANK:
            raise ConfigError(f"parallel.cp_method={self.cp_method!r} is not one of {', '.join(ROW_CHUNKS_PER_RANK)}")
        inner = self.pp * self.cp * self.tp  # ranks per dp_shard coordinate
        named = [(name, degree) for name, degree in (("pp", self.pp), ("cp", self.cp), ("tp", self.tp)) if degree > 1 or name == "cp"]
        inner_words = (f"parallel.cp={self.cp}" if len(named) == 1 else
                       " x ".join(f"parallel.{n}" for n, _ in named) + " = " + " x ".join(str(d) for _, d in named) + f" = {inner}")
        if self.dp_shard == -1:
            if self.world_size % inner:
                nproc = inner * max(1, self.world_size // inner)
                keep = (
                    f"or set parallel.cp to one of {_divisors(self.world_size)}"
                    if len(named) == 1
                    else f"or choose {' x '.join(f'parallel.{n}' for n, _ in named)} among {_divisors(self.world_size)}"
                )
                raise ConfigError(
                    f"{inner_words} does not divide the world size {self.world_size}: launch a multiple of "
                    f"{inner} processes (`longfit train --nproc {nproc}` or `torchrun --nproc-per-node {nproc}`), {keep}"
                )
            object.__setattr__(self, "dp_shard", self.world_size // inner)
        if self.dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard}: use a positive degree or -1 (derive from the world size)")
        launched = self.dp_shard * inner
        if self.ep < 1:
            raise ConfigError(f"parallel.ep={self.ep}: must be >= 1")
        if self.ep > 1 and self.tp > 1:
            raise ConfigError(f"parallel.ep={self.ep} with parallel.tp={self.tp}: expert parallelism takes its ranks from "
                              f"dp_shard x cp, not tp; set parallel.tp=1")
        if self.ep > 1 and launched == self.world_size and (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must divide parallel.dp_shard x parallel.cp = {self.dp_shard * self.cp} (the ranks "
                f"holding different tokens, among which the experts are split): use parallel.ep in "
                f"{[d for d in _divisors(self.dp_shard * self.cp) if d > 1]}"
            )
        if launched != self.world_size:
            if self.world_size % inner == 0:
                derive = f"parallel.dp_shard={self.world_size // inner} (or -1)"
            elif len(named) == 1:
                derive = f"parallel.dp_shard=-1 with parallel.cp in {_divisors(self.world_size)}"
            else:
                derive = f"parallel.dp_shard=-1 with {' x '.join(f'parallel.{n}' for n, _ in named)} in {_divisors(self.world_size)}"
            pp_factor = f"parallel.pp ({self.pp}) x " if self.pp > 1 else ""
            tp_factor = f" x parallel.tp ({self.tp})" if self.tp > 1 else ""
            raise ConfigError(
                f"world size {self.world_size} != {pp_factor}parallel.dp_shard ({self.dp_shard}) x parallel.cp ({self.cp}){tp_factor} = "
                f"{launched}: launch {launched} processes (`longfit train --nproc {launched}` or "
                f"`torchrun --nproc-per-node {launched}`), or keep {self.world_size} processes with {derive}"
            )

    @classmethod
    def from_config(
        cls,
        cfg: "Config",
        world_size: int,
        num_attention_heads: int,
        *,
        num_key_value_heads: int | Sequence[int] | None = None,
        intermediate_size: int | None = None,
        num_experts: int | None = None,
        linear_value_heads: int | None = None,
        text_config=None,
    ) -> "ParallelDims":
        """The degrees of `cfg` on `world_size` ranks, checked against seq_len, the model and the other settings.

        The model's key/value heads (one count, or each layer's where they vary by layer) and intermediate width
        are needed when parallel.tp > 1 (key/value heads default to the query heads); its
        experts per layer when parallel.ep > 1 (None: the model has no expert-parallel plan,
        `parallel.expert.expert_count`); `linear_value_heads` are the value heads of its linear-attention
        layers (None: it has none). `text_config`: the model's transformers (text) config, needed when parallel.pp > 1
        or parallel.tp > 1 (tp reads the model's structure from it).
        """
        dims = cls(
            dp_shard=cfg.parallel.dp_shard,
            cp=cfg.parallel.cp,
            world_size=world_size,
            cp_method=cfg.parallel.cp_method,
            offload_model_states=cfg.parallel.cpu_offload,
            tp=cfg.parallel.tp,
            ep=cfg.parallel.ep,
            pp=cfg.parallel.pp,
            pp_stages_per_rank=pipeline_stages_per_rank(cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank),
        )
        dims.check_pipeline(cfg, text_config)
        dims.check_sequence(cfg.seq_len)
        dims.check_experts(cfg, num_experts)
        per_layer = num_key_value_heads if isinstance(num_key_value_heads, Sequence) else [num_key_value_heads]
        for kv_heads in dict.fromkeys(per_layer):
            dims.check_heads(num_attention_heads, kv_heads or num_attention_heads)
        dims.check_tensor_parallel(cfg, intermediate_size, text_config)
        dims.check_linear_attention(linear_value_heads)
        return dims

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages in all: pp x the stages each pp rank holds."""
        return self.pp * self.pp_stages_per_rank

    @property
    def fsdp_size(self) -> int:
        """Ranks each parameter (or, under tp, each tp slice of it) is sharded over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def row_ranks(self) -> int:
        """Ranks holding the same rows, over which their images are dealt (`ParallelMesh.rows_group`): cp x tp."""
        return self.cp * self.tp

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model: to shard it over several ranks, on one rank to offload its states, or under tp.

        Under tp it runs even over one dp_shard x cp rank: its MixedPrecisionPolicy is what casts the
        tp-sharded (DTensor) parameters to the compute dtype, so every tp run trains the same way. Under pp too: the
        activations a stage sends are then in the compute dtype on every stage, the dtype its neighbour expects.
        """
        return self.fsdp_size > 1 or self.offload_model_states or self.tp > 1 or self.pp > 1

    @property
    def dp_size(self) -> int:
        """Ranks that read different batches (the data loader's number of shards)."""
        return self.dp_shard

    @property
    def sequence_granule(self) -> int:
        """seq_len must be a multiple of this: every cp rank gets equal chunks, every tp rank an equal slice of them.

        Sequence parallelism splits each cp rank's L / cp tokens of a row over the tp ranks.
        """
        return math.lcm(ROW_CHUNKS_PER_RANK[self.cp_method] * self.cp, self.cp * self.tp)

    def check_sequence(self, seq_len: int) -> None:
        """seq_len must split into equal per-rank shards: 2 x cp chunks (zigzag ring) or cp (Ulysses), then tp."""
        unit = self.sequence_granule
        if seq_len % unit:
            if self.tp > 1:
                why = (
                    f"{unit} (every parallel.cp={self.cp} rank holds seq_len / {self.cp} tokens of a row, split "
                    f"over parallel.tp={self.tp} ranks by sequence parallelism"
                    + (", in two equal zigzag chunks)" if self.cp_method == "ring" and self.cp > 1 else ")")
                )
            elif self.cp_method == "ring":
                why = f"2 x parallel.cp = {unit} (the zigzag ring gives every rank two equal chunks)"
            else:
                why = f"parallel.cp = {unit} (Ulysses gives every rank an equal contiguous shard)"
            fit = max(unit, seq_len // unit * unit)
            raise ConfigError(f"seq_len={seq_len} must be divisible by {why}: e.g. seq_len={fit}")

    def check_pipeline(self, cfg: "Config", text_config) -> None:
        """What a stage cut needs of the model and the other settings (nothing when pp = 1; parallel/pipeline.py)."""
        if self.pp == 1:
            if cfg.parallel.pp_layers:
                raise ConfigError(f"parallel.pp_layers={cfg.parallel.pp_layers} cuts pipeline stages, which parallel.pp=1 "
                                  f"does not have: set parallel.pp, or parallel.pp_layers=[]")
            return
        schedule = cfg.parallel.pp_schedule
        if schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
        import torch
        from torch.distributed.pipelining import schedules

        schedule_class, placement = PIPELINE_SCHEDULES[schedule]
        if not hasattr(schedules, schedule_class):
            raise ConfigError(f"parallel.pp_schedule={schedule}: this torch ({torch.__version__}) has no {schedule_class}; "
                              f"upgrade torch or use parallel.pp_schedule=1f1b")
        per_rank = self.pp_stages_per_rank
        allowed = {"single": per_rank == 1, "loop": per_rank >= 2, "v": per_rank == 2}[placement]
        if not allowed:
            need = {"single": "1 (one stage per rank)", "loop": ">= 2 (or 0)", "v": "2 (or 0)"}[placement]
            raise ConfigError(f"parallel.pp_stages_per_rank={cfg.parallel.pp_stages_per_rank} with parallel.pp_schedule="
                              f"{schedule}: must be {need}")
        if splits_backward(schedule) and cfg.parallel.reshard_after_forward:
            raise ConfigError(
                f"parallel.pp_schedule={schedule} needs parallel.reshard_after_forward=false: it computes each weight "
                f"gradient after the input gradient, when FSDP2 would have resharded the weights it needs (torchtitan "
                f"keeps them gathered under pp too)"
            )
        if schedule_class == "ScheduleDualPipeV" and cfg.train.grad_accum < self.pipeline_stages:
            raise ConfigError(
                f"parallel.pp_schedule=dualpipev needs train.grad_accum >= {self.pipeline_stages}, a micro-batch per "
                f"stage (torch's DualPipeV feeds both arms of the V at once), not {cfg.train.grad_accum}: raise "
                f"train.grad_accum or use parallel.pp_schedule=zbv"
            )
        if text_config is None:
            raise ConfigError(f"parallel.pp={self.pp}: the model's config is needed to cut it into stages")
        layers, stages = text_config.num_hidden_layers, self.pipeline_stages
        per_rank_words = f" x parallel.pp_stages_per_rank={per_rank}" if per_rank > 1 else ""
        if stages > layers:
            fix = f"parallel.pp x parallel.pp_stages_per_rank <= {layers}" if per_rank > 1 else f"parallel.pp <= {layers}"
            raise ConfigError(f"parallel.pp={self.pp}{per_rank_words} stages need at least one decoder layer each; the "
                              f"model has {layers}: use {fix}")
        sizes = cfg.parallel.pp_layers
        if sizes and (len(sizes) != stages or min(sizes) < 1 or sum(sizes) != layers):
            raise ConfigError(f"parallel.pp_layers={sizes}: must list {stages} stage sizes (parallel.pp={self.pp}"
                              f"{per_rank_words}), each >= 1, summing to the model's {layers} decoder layers, e.g. "
                              f"parallel.pp_layers={[len(r) for r in stage_layers(layers, stages)]}")
        if getattr(text_config, "num_kv_shared_layers", 0):
            raise ConfigError(
                f"parallel.pp={self.pp}: the model's last {text_config.num_kv_shared_layers} layers reuse the keys and "
                f"values of earlier layers (num_kv_shared_layers), state a stage cut cannot pass between stages; "
                f"set parallel.pp=1 (parallel.cp and parallel.dp_shard split it instead)"
            )
        if getattr(text_config, "tie_word_embeddings", False):
            raise ConfigError(
                f"parallel.pp={self.pp}: the model ties lm_head to the input embeddings, which would live on the first "
                f"and the last stage at once (torchtitan refuses the same); set parallel.pp=1, or train a model "
                f"with tie_word_embeddings=false"
            )
        from longfit.models.sparse_attention import refuse_pipeline_stages

        refuse_pipeline_stages(text_config, self.pp)  # the part that differs, before the list of proven types
        if text_config.model_type not in PIPELINE_MODEL_TYPES:
            raise ConfigError(
                f"parallel.pp={self.pp}: pipeline stages are proven for {', '.join(PIPELINE_MODEL_TYPES)} decoders, "
                f"not model_type {text_config.model_type!r}; set parallel.pp=1"
            )

    def check_pipeline_memory(self, switches, schedule: str) -> None:
        """The memory techniques a stage runs under (`memory.switches.resolve_memory_switches`'s resolution). A tiled
        layer computes its input and weight gradients in one pass, which the zero-bubble schedules split. (The offload
        store keeps a slot per layer and micro-batch in flight: memory/offload.py.)"""
        if self.pp == 1:
            return
        if switches.tiled_layers and splits_backward(schedule):
            raise ConfigError(
                f"memory.tiled_layers with parallel.pp_schedule={schedule}: a tiled layer computes its input and "
                f"weight gradients in one pass, which zero bubble splits; set memory.tiled_layers=false or "
                f"parallel.pp_schedule=interleaved_1f1b"
            )

    def check_heads(self, num_heads: int, num_kv_heads: int | None = None) -> None:
        """tp splits the query heads, and the key/value heads or (fewer than tp) replicates them; Ulysses then
        scatters each tp rank's heads over the cp ranks.

        Key/value heads have no Ulysses rule: it repeats them up to a multiple of cp (ulysses.py). Under tp,
        with num_kv_heads < tp and tp a multiple of them, every tp rank computes the one key/value head its
        query heads use (longfit.parallel.tp).
        """
        num_kv_heads = num_kv_heads or num_heads
        if self.tp > 1:
            if num_heads % self.tp:
                fits = [d for d in _divisors(num_heads) if d > 1]
                raise ConfigError(
                    f"parallel.tp={self.tp} splits the {num_heads} attention heads over the tp ranks, which must "
                    f"divide them: use parallel.tp in {fits}"
                )
            if num_kv_heads % self.tp and self.tp % num_kv_heads:
                fits = [d for d in _divisors(num_heads) if d > 1 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)]
                raise ConfigError(
                    f"parallel.tp={self.tp} must divide the {num_kv_heads} key/value heads (each tp rank holds "
                    f"whole ones), or be a multiple of them (each tp rank then computes the one its query heads "
                    f"use): use parallel.tp in {fits}"
                )
        local_heads = num_heads // self.tp
        if self.cp == 1 or self.cp_method != "ulysses" or local_heads % self.cp == 0:
            return
        if self.tp > 1:
            fits = [d for d in _divisors(local_heads) if d > 1]
            raise ConfigError(
                f"parallel.cp_method=ulysses splits each tp rank's {local_heads} attention heads ({num_heads} / "
                f"parallel.tp={self.tp}) over parallel.cp={self.cp} ranks, so parallel.cp x parallel.tp must divide "
                f"{num_heads}: use parallel.cp in {fits}, a smaller parallel.tp, or parallel.cp_method=ring"
            )
        fits = [d for d in _divisors(num_heads) if d > 1]
        raise ConfigError(
            f"parallel.cp_method=ulysses splits the {num_heads} attention heads over parallel.cp={self.cp} ranks, "
            f"which must divide them: use parallel.cp in {fits} or parallel.cp_method=ring (no head constraint)"
        )

    def check_experts(self, cfg: "Config", num_experts: int | None) -> None:
        """parallel.ep needs a model whose experts transformers can split (its `ep_plan`), as many on every rank."""
        if self.ep == 1:
            return
        if num_experts is None:
            raise ConfigError(
                f"parallel.ep={self.ep}: the model has no experts that transformers can split across ranks (no "
                f"expert-parallel plan: a dense model, or Llama 4, whose experts take every token); set parallel.ep=1"
            )
        if num_experts % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must divide the model's {num_experts} experts per layer (each rank holds as many): "
                f"use parallel.ep in {[d for d in _divisors(num_experts) if d > 1 and (self.dp_shard * self.cp) % d == 0]}"
            )
        if cfg.lora.enabled:
            raise ConfigError(f"parallel.ep={self.ep} with lora.enabled=true: LoRA on experts split across ranks is not "
                              f"implemented; set parallel.ep=1 (FSDP2 shards the experts) or train without LoRA")

    @property
    def expert_fsdp_size(self) -> int:
        """Ranks that hold the same experts (one per ep group), over which FSDP2 shards them: dp_shard x cp / ep."""
        return self.fsdp_size // self.ep

    def check_linear_attention(self, value_heads: int | None) -> None:
        """A hybrid model's linear-attention layers run head-split under either cp method (parallel/linear.py), on
        the value heads of this rank's tp slice (parallel/tp.py): those must divide by cp."""
        if value_heads is not None and (value_heads // self.tp) % self.cp:
            fits = [d for d in _divisors(value_heads // self.tp) if d > 1]
            ranks = f" of a parallel.tp={self.tp} rank" if self.tp > 1 else ""
            raise ConfigError(
                f"parallel.cp={self.cp} splits the {value_heads // self.tp} value heads{ranks} of the linear-attention "
                f"layers over the cp ranks, which must divide them: use parallel.cp in {fits}"
            )

    def check_tensor_parallel(self, cfg: "Config", intermediate_size: int | None, text_config) -> None:
        """What tensor parallelism needs of the model and of the other settings (nothing when tp = 1). Which models
        it can split is a property of their structure, read by `longfit.parallel.tp.tensor_parallel_refusal`."""
        if self.tp == 1:
            return
        from longfit.parallel.tp import tensor_parallel_refusal

        refusal = tensor_parallel_refusal(text_config, self.tp, lora=cfg.lora.enabled)
        if refusal:
            raise ConfigError(f"parallel.tp={self.tp}: {refusal}")
        # None: no `intermediate_size` (a mixture of experts' config), whose widths the refusal read from the model
        if intermediate_size is not None and intermediate_size % self.tp:
            raise ConfigError(
                f"parallel.tp={self.tp} must divide the MLP's intermediate size {intermediate_size} (gate, up and "
                f"down projections are split into equal slices): use parallel.tp in "
                f"{[d for d in _divisors(intermediate_size) if d > 1]}"
            )
        if cfg.lora.quantize_base:
            raise ConfigError(
                f"lora.quantize_base=true (QLoRA) stores 4-bit weights that tensor parallelism cannot split: "
                f"set parallel.tp=1, or lora.quantize_base=false with parallel.tp={self.tp}"
            )
        if cfg.lora.enabled and cfg.lora.dropout > 0:
            raise ConfigError(
                f"lora.dropout={cfg.lora.dropout} with parallel.tp={self.tp}: the tp ranks would draw different "
                f"dropout masks on the input they share (DTensor keeps no common RNG state on every backend), so "
                f"set lora.dropout=0 or parallel.tp=1"
            )
        others = [name for name in cfg.lora.target_modules if name not in TENSOR_PARALLEL_PROJECTIONS]
        if cfg.lora.enabled and others:
            from longfit.parallel.tp import replicated_linear_maps

            replicated = replicated_linear_maps(text_config)
            others = [name for name in others if name not in replicated]
            if others:
                raise ConfigError(
                    f"lora.target_modules {others}: under parallel.tp={self.tp} adapters go on the decoder "
                    f"projections that tensor parallelism splits, {list(TENSOR_PARALLEL_PROJECTIONS)}"
                    + (f", or the linear maps it replicates, {sorted(replicated)}" if replicated else "")
                )

    def build_mesh(self, device_type: str) -> "ParallelMesh":
        """The mesh and process groups of this run.

        Several ranks need the default process group initialised (torchrun); a single process whose
        model FSDP2 wraps (parallel.cpu_offload) gets a one-rank group here.
        """
        if not self.fsdp_enabled:
            return ParallelMesh(self, None, None, None, None, cp_rank=0, dp_rank=0, rows_group=None)
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self.world_size == 1 and not dist.is_initialized():
            options = {"device_id": torch.device("cuda", torch.cuda.current_device())} if device_type == "cuda" else {}
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)

        pp_mesh = None
        if self.pp > 1:
            # The FSDP axis is one stage's dp_shard x cp flattened, which no longer spans every rank, so it comes from
            # the root as under tp. pp is outermost: the ranks of a pp group share their (dp_shard, cp, tp)
            # coordinate, so each tp rank exchanges its sequence shard with the same tp rank of the next stage.
            named = [("pp", self.pp), ("dp_shard", self.dp_shard), ("cp", self.cp)] + ([("tp", self.tp)] if self.tp > 1 else [])
            mesh = init_device_mesh(device_type, tuple(d for _, d in named), mesh_dim_names=tuple(n for n, _ in named))
            fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            tp_mesh = mesh["tp"] if self.tp > 1 else None
            pp_mesh = mesh["pp"]
        elif self.tp == 1:
            mesh = init_device_mesh(device_type, (self.dp_shard, self.cp), mesh_dim_names=("dp_shard", "cp"))
            # The FSDP axis is dp_shard x cp flattened. While those two axes span every rank, that is the
            # 1-D mesh over all ranks in rank order, which the public init_device_mesh builds.
            fsdp_mesh = init_device_mesh(device_type, (self.fsdp_size,), mesh_dim_names=("dp_shard_cp",))
            tp_mesh = None
        else:
            mesh = init_device_mesh(
                device_type, (self.dp_shard, self.cp, self.tp), mesh_dim_names=("dp_shard", "cp", "tp")
            )
            # FSDP2 + TP needs the FSDP mesh and the TP mesh to come from ONE root (torch 2.6-2.10 assert it),
            # so the FSDP axis is the root's dp_shard x cp flattened. DeviceMesh._flatten is private but
            # present since torch 2.5 (what torchtitan used through 2025). The mesh it returns is kept:
            # slicing the flattened name back out of the root (root["dp_shard_cp"]) warns since 2.11.
            fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            tp_mesh = mesh["tp"]
        rows_group = mesh["cp", "tp"]._flatten("cp_tp").get_group() if self.tp > 1 else mesh.get_group("cp")
        expert_mesh = None
        if self.ep > 1:
            # Its own root over all ranks (ep consecutive ranks per group, varying fastest), as transformers' expert
            # parallelism needs: an ep axis to split the experts on, the efsdp axis FSDP2 shards them over, and a
            # one-rank tp axis (no two ranks of an ep group hold the same tokens). Under pp the root has the pp axis
            # outermost, as the main mesh, and each rank takes its stage's slice: a stage's experts live on its
            # dp_shard x cp ranks alone, so its all-to-alls and its experts' FSDP2 stay among them.
            named = ([("pp", self.pp)] if self.pp > 1 else []) + [("efsdp", self.expert_fsdp_size), ("ep", self.ep), ("etp", 1)]
            expert_mesh = init_device_mesh(device_type, tuple(d for _, d in named), mesh_dim_names=tuple(n for n, _ in named))
            if self.pp > 1:
                expert_mesh = expert_mesh["efsdp", "ep", "etp"]
        return ParallelMesh(
            self,
            mesh,
            fsdp_mesh,
            cp_group=mesh.get_group("cp"),
            dp_group=mesh.get_group("dp_shard"),
            rows_group=rows_group,
            cp_rank=mesh.get_local_rank("cp"),
            dp_rank=mesh.get_local_rank("dp_shard"),
            tp_mesh=tp_mesh,
            expert_mesh=expert_mesh,
            pp_group=None if pp_mesh is None else pp_mesh.get_group(),
            pp_rank=0 if pp_mesh is None else pp_mesh.get_local_rank(),
        )


@dataclass(frozen=True)
class ParallelMesh:
    """Process groups of a run; all None on a single process.

    mesh: the (["pp", ]"dp_shard", "cp"[, "tp"]) DeviceMesh. fsdp_mesh: the 1-D "dp_shard_cp" DeviceMesh FSDP2
    shards over. cp_group: this rank's context-parallel peers (same rows, different tokens). dp_group:
    this rank's data-parallel peers (different rows, same token positions). tp_mesh: this rank's
    tensor-parallel peers (same tokens, different slices of every weight), None without tp. rows_group: every rank
    holding this rank's rows, its cp x tp peers (the cp group without tp), over which the rows' images are dealt
    (parallel/media.py).
    fsdp_mesh's group -- the dp_shard x cp ranks of this tp coordinate, which together hold every token
    once -- is the group of global reductions such as the valid-token count (`world_group`); the tp
    ranks hold copies of the same tokens and losses, so reducing over them would count everything tp times.
    """

    dims: ParallelDims
    mesh: "DeviceMesh | None"
    fsdp_mesh: "DeviceMesh | None"
    cp_group: "ProcessGroup | None"
    dp_group: "ProcessGroup | None"
    cp_rank: int
    dp_rank: int
    rows_group: "ProcessGroup | None"
    tp_mesh: "DeviceMesh | None" = None
    expert_mesh: "DeviceMesh | None" = None
    """("efsdp", "ep", "etp") over all ranks (under pp over this rank's stage) when parallel.ep > 1 (build_mesh says
    why), else None."""
    pp_group: "ProcessGroup | None" = None
    """This rank's pipeline peers (same tokens and shards, the other stages), None without pp."""
    pp_rank: int = 0
    """The pipeline stage this rank holds."""

    @property
    def world_group(self) -> "ProcessGroup | None":
        return None if self.fsdp_mesh is None else self.fsdp_mesh.get_group()
