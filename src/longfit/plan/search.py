"""The largest context that fits, per strategy and GPU count, and the change that makes a plan fit.

Strategies: FSDP over all GPUs, with ring or Ulysses context parallelism over all of them, with tensor
parallelism (within a node: tp up to 8, dp_shard over the rest) alone or with ring CP over the rest (tp up to
8 and half the GPUs), each with and without offload and LoRA; and pipeline parallelism (parallel.pp, up to 8 stages,
each sharded by FSDP2 over its dp_shard ranks) alone or with ring CP over the rest (2 stages), with and without LoRA,
planned stage by stage from traces at the cut `longfit train` runs (`plan_pipeline`, plan/stage_cut.py).

`max_seq_len` binary-searches seq_len in granules of 1024 x 2cp x tp tokens (every granule is a valid
zigzag / Ulysses / sequence-parallel length). Whether a plan fits changes once with seq_len except where an `auto`
memory switch turns on (tiled MLP at 8K tokens, activation offload at 32K, tiled decoder layers at 64K tokens per GPU),
so each range between those thresholds is searched on its own and the largest fitting length of any range wins: the
longest range first, so that a range fitting at its start ends the search (the shorter ranges' switches are not
planned, nor their layers traced). The peak itself is not monotonic: the offload store keeps on the GPU as many layer
inputs as fit (`storage.checkpoint_placement`), so it falls by about one input wherever one more moves to the host, as
the traced step's does (Phi-4-mini with LoRA on an H100, 329,728 -> 331,776 tokens: traced 78.04 -> 76.43 GB, 31 -> 30
inputs on the GPU, #52); what fits does not turn back, as the GPU's share is what is left of it and the host's grows.
The offload rows come per target of the offloaded layer inputs: host memory, then disk beyond it
(memory.offload_dir), each as they are or stored in fp8 (memory.checkpoint_dtype); a row fits when the
GPU, the machine's host memory and the disk hold it (plan/storage.py). FSDP2's CPU offload of the model
states (parallel.cpu_offload) is searched both on and off in each offload cell, and the longer context
is kept: it frees the GPU of the model states but takes host memory from the layer inputs, and for full
fine-tuning its fp32 parameters, gradients and Adam state (16 bytes per parameter, 120 GiB for an 8B
model) do not fit a small host at all, where activation offload alone still does.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from longfit.config import Config, ConfigError
from longfit.plan.analytic import plan_config
from longfit.plan.result import GiB, PlanResult
from longfit.plan.setup import (
    OFFLOAD_AUTO_MIN_SEQ_LEN,
    TILED_LAYERS_AUTO_MIN_TOKENS,
    TILED_MLP_AUTO_MIN_SEQ_LEN,
    resolve,
)
from longfit.plan.shapes import model_shape

MAX_SEQ_LEN = 1 << 24  # 16M tokens: the search's ceiling


TP_MAX = 8  # GPUs of one node: tensor parallelism's collectives are on the critical path of every layer
PP_MAX = 8  # a deeper pipeline idles most of a step unless train.grad_accum is far above its stages


@dataclass(frozen=True)
class Strategy:
    name: str
    cp: bool  # context parallelism over all GPUs (or, with tp, over those tp leaves), else FSDP data parallel only
    cp_method: str = "ring"
    offload: bool = False  # activation offload; FSDP2 CPU offload as `configure` is told
    lora: bool = False
    tp: bool = False  # tensor parallelism: the largest degree the model admits, at most TP_MAX (and gpus / 2 with cp)
    pp: bool = False  # pipeline stages: the most the model admits, at most PP_MAX (2 with cp), FSDP2 over the rest
    disk: bool = False  # offloaded layer inputs beyond host memory go to memory.offload_dir
    checkpoint_dtype: str | None = None  # offloaded layer inputs stored as memory.checkpoint_dtype

    def configure(self, cfg: Config, gpus: int, cpu_offload: bool = False) -> Config | None:
        """`cfg` set up for this strategy on `gpus` GPUs; None where it needs more GPUs or the model admits no tp.

        `cpu_offload`: an offload row's parallel.cpu_offload (ignored by rows without offload)."""
        out = copy.deepcopy(cfg)
        out.parallel.dp_shard = -1
        out.parallel.cp_method = self.cp_method
        out.parallel.tp = 1
        out.parallel.cp = gpus if self.cp else 1
        out.parallel.pp = 1
        if self.offload:
            out.memory.activation_checkpointing = True
            out.memory.offload_activations = True
            out.parallel.cpu_offload = cpu_offload
            out.memory.offload_dir = (cfg.memory.offload_dir or ".") if self.disk else None
            out.memory.checkpoint_dtype = self.checkpoint_dtype
        else:
            out.memory.offload_activations = False
            out.parallel.cpu_offload = False
            out.memory.offload_dir = out.memory.checkpoint_dtype = None
        # The row is what its label says: LoRA (with the config's rank and targets) or full fine-tuning.
        out.lora.enabled = self.lora
        out.lora.quantize_base = self.lora and cfg.lora.quantize_base
        if self.pp:
            return self._pipelined(out, gpus)
        if not self.tp:
            return out
        most = min(TP_MAX, gpus // 2 if self.cp else gpus)
        for tp in (d for d in range(most, 1, -1) if gpus % d == 0):
            out.parallel.tp, out.parallel.cp = tp, gpus // tp if self.cp else 1
            out.seq_len = _granule(out)
            try:
                resolve(out, gpus)  # ParallelDims' rules decide which degrees the model admits
            except ConfigError:
                continue
            out.seq_len = cfg.seq_len
            return out
        return None


    def _pipelined(self, out: Config, gpus: int) -> Config | None:
        """`out` cut into the most pipeline stages (at most PP_MAX; 2 with cp over the rest) that the model and
        `gpus` admit, at parallel.pp_layers' balanced cut; None where none does. The offload store and tiled layers
        are off in these rows (both run under pp, planned per stage with every micro-batch in flight; the search does
        not try them)."""
        out.memory.offload_activations = out.memory.tiled_layers = False
        out.parallel.pp_layers = []
        most = min(PP_MAX, 2 if self.cp else gpus, model_shape(out.model).layers)
        for pp in (d for d in range(most, 1, -1) if gpus % d == 0 and not (self.cp and gpus // d < 2)):
            out.parallel.pp, out.parallel.cp = pp, gpus // pp if self.cp else 1
            seq_len, out.seq_len = out.seq_len, _granule(out)
            try:
                resolve(out, gpus)  # ParallelDims' rules: the model's layers, heads, tie and family
            except ConfigError:
                continue
            finally:
                out.seq_len = seq_len
            return out
        return None


OFFLOAD_VARIANT = " + offload"  # where a row's offload variant starts in its name
# Offload: to host memory (" + offload") or beyond it to disk (" + disk"), inputs as they are or in fp8.
OFFLOAD_TARGETS = (("", False, None), (" + disk", True, None), (" fp8", False, "fp8"), (" + disk fp8", True, "fp8"))

STRATEGIES = [
    Strategy(f"{base}{suffix}{target}", cp=cp, cp_method=method, offload=offload, lora=lora, tp=tp, disk=disk,
             checkpoint_dtype=dtype)
    for base, cp, method, tp in (
        ("FSDP", False, "ring", False),
        ("FSDP + ring CP", True, "ring", False),
        ("FSDP + Ulysses", True, "ulysses", False),
        ("FSDP + TP", False, "ring", True),
        ("TP + ring CP", True, "ring", True),
    )
    for suffix, offload, lora in (
        ("", False, False),
        (OFFLOAD_VARIANT, True, False),
        (", LoRA", False, True),
        (f", LoRA{OFFLOAD_VARIANT}", True, True),
    )
    for target, disk, dtype in (OFFLOAD_TARGETS if offload else OFFLOAD_TARGETS[:1])
] + [
    Strategy(f"{base}{suffix}", cp=cp, lora=lora, pp=True)
    for base, cp in (("PP + FSDP", False), ("PP + ring CP", True))
    for suffix, lora in (("", False), (", LoRA", True))
]


def family_of(name: str) -> str:
    """A row's strategy family, its name without the offload variant: its parallelism and what it trains."""
    return name.split(OFFLOAD_VARIANT)[0]


def best_per_family(table: dict, gpu_counts: list[int]) -> dict:
    """The exact row of `max_context_table` that reaches furthest in each family: the longest context on the most GPUs,
    then on fewer; on a tie the simpler variant (the first, without offload). Rows storing the layer inputs in fp8
    (memory.checkpoint_dtype, lossy) are not chosen: a family's best is what trains exactly."""
    lossy = {strategy.name for strategy in STRATEGIES if strategy.checkpoint_dtype}
    best: dict[str, str] = {}
    for name, row in table.items():
        if name in lossy:
            continue
        reach = [row[g][0] or 0 for g in sorted(gpu_counts, reverse=True)]
        current = best.get(family_of(name))
        if current is None or reach > [table[current][g][0] or 0 for g in sorted(gpu_counts, reverse=True)]:
            best[family_of(name)] = name
    return {name: table[name] for name in best.values()}


def _granule(cfg: Config) -> int:
    return 1024 * 2 * cfg.parallel.cp * cfg.parallel.tp


def _plan(
    cfg: Config, gpus: int, capacity: int, seq_len: int, host: int | None = None, disk: int | None = None,
    ranks_on_node: int = 0,
) -> PlanResult | None:
    trial = copy.deepcopy(cfg)
    trial.seq_len = seq_len
    try:
        return plan_config(trial, gpus, capacity, host_memory_bytes=host, disk_bytes=disk, ranks_on_node=ranks_on_node)
    except ConfigError:
        return None


def _states_overflow(cfg: Config, gpus: int, capacity: int, seq_len: int, ranks_on_node: int = 0) -> bool:
    """Whether the plan of `cfg` at `seq_len` cannot fit `capacity` whatever its activations (`states_floor`): read off
    the setup, before any layer is traced. Qwen3-Coder-Next's search on one H100 traced its layers at four lengths,
    28 of a cold plan's 45 CPU s, to find what its 160 GB of bf16 weights say (#52)."""
    from longfit.plan.analytic import free_at_start, states_floor

    trial = copy.deepcopy(cfg)
    trial.seq_len = seq_len
    try:
        s = resolve(trial, gpus, free_bytes=free_at_start(capacity), ranks_on_node=ranks_on_node)
    except ConfigError:
        return False  # the plan refuses it (`_plan`)
    return states_floor(s) > capacity


def max_seq_len(
    cfg: Config,
    gpus: int,
    capacity: int,
    host_capacity: int | None = None,
    disk_capacity: int | None = None,
    ranks_on_node: int = 0,
) -> int | None:
    """The largest seq_len (a multiple of the granule) whose plan fits `capacity` per GPU, and the machine's
    host memory and disk where given, shared by `ranks_on_node` ranks (plan/storage.py); None if none does.
    """
    granule = _granule(cfg)
    bounds = [granule]
    tiled_layers_from = TILED_LAYERS_AUTO_MIN_TOKENS * cfg.parallel.cp // cfg.train.micro_batch
    for threshold, switch in (
        (TILED_MLP_AUTO_MIN_SEQ_LEN, cfg.memory.tiled_mlp),
        (OFFLOAD_AUTO_MIN_SEQ_LEN, cfg.memory.offload_activations),
        (tiled_layers_from, cfg.memory.tiled_layers),
    ):
        if switch == "auto":
            bounds.append(-(-threshold // granule) * granule)
    bounds = sorted(set(bounds)) + [MAX_SEQ_LEN + granule]

    def fits(n: int) -> bool:
        if _states_overflow(cfg, gpus, capacity, n, ranks_on_node):
            return False
        result = _plan(cfg, gpus, capacity, n, host_capacity, disk_capacity, ranks_on_node)
        return result is not None and result.fits

    # The longest range first: where its shortest length fits, every length of a shorter range is shorter than the
    # answer, and their plans (other switches: layer traces of their own) are not needed.
    for lo, next_lo in reversed(list(itertools.pairwise(bounds))):
        hi_limit = next_lo - granule
        if lo > hi_limit or not fits(lo):
            continue
        good, step = lo, granule  # grow until it no longer fits, then bisect
        while good + step <= hi_limit and fits(good + step):
            good, step = good + step, step * 2
        bad = min(good + step, hi_limit + granule)
        while bad - good > granule:
            mid = (good + bad) // 2 // granule * granule
            if mid <= good:
                break
            good, bad = (mid, bad) if fits(mid) else (good, mid)
        return good
    return None


def max_context_table(
    cfg: Config,
    gpu_counts: list[int],
    capacity: int,
    strategies: list[Strategy] = STRATEGIES,
    host_capacity: int | None = None,
    disk_capacity: int | None = None,
):
    """{strategy name: {gpus: (max seq_len or None, PlanResult at it or None)}}; host and disk per machine.

    An offload cell is the longer of parallel.cpu_offload off and on (module docstring), off on a tie."""
    table: dict[str, dict[int, tuple[int | None, PlanResult | None]]] = {}
    machine = (host_capacity, disk_capacity)
    for strategy in strategies:
        row = table.setdefault(strategy.name, {})
        for gpus in gpu_counts:
            row[gpus] = (None, None)
            for cpu_offload in (False, True) if strategy.offload else (False,):
                trial = strategy.configure(cfg, gpus, cpu_offload)
                if trial is None:
                    continue
                # None where ParallelDims refuses the layout (e.g. heads)
                best = max_seq_len(trial, gpus, capacity, *machine)
                if best and best > (row[gpus][0] or 0):
                    row[gpus] = (best, _plan(trial, gpus, capacity, best, *machine))
    return table


def suggest_fix(result: PlanResult) -> str:
    """A sentence naming one config change that makes `result` fit its device (or why nothing does)."""
    if result.fits:
        return "It fits as configured."
    cfg, s = result.config, result.setup
    capacity = result.capacity
    world = s.world
    candidates: list[tuple[str, list[str]]] = _storage_candidates(result)
    if not cfg.memory.activation_checkpointing:
        candidates.append(("memory.activation_checkpointing=true", ["memory.activation_checkpointing=true"]))
    if not cfg.memory.chunked_loss:
        candidates.append(("memory.chunked_loss=true", ["memory.chunked_loss=true"]))
    if not s.tiled_mlp:
        candidates.append(("memory.tiled_mlp=true", ["memory.tiled_mlp=true"]))
    if not s.offload_activations:
        candidates.append(
            (
                "memory.offload_activations=true (with activation checkpointing)",
                ["memory.activation_checkpointing=true", "memory.offload_activations=true"],
            )
        )
    if not s.tiled_layers and cfg.memory.activation_checkpointing and s.tp == 1:
        candidates.append(("memory.tiled_layers=true (decoder layers over sequence tiles)", ["memory.tiled_layers=true"]))
    for cp in sorted(d for d in range(s.cp + 1, world // s.tp + 1) if (world // s.tp) % d == 0):
        candidates.append(
            (
                f"parallel.cp={cp} (context parallelism over {cp} of the {world} GPUs)",
                [f"parallel.cp={cp}", "parallel.dp_shard=-1"],
            )
        )
    for tp in sorted(d for d in range(s.tp + 1, min(TP_MAX, world // s.cp) + 1) if (world // s.cp) % d == 0):
        candidates.append(
            (
                f"parallel.tp={tp} (tensor parallelism over {tp} of the {world} GPUs: weights and activations split)",
                [f"parallel.tp={tp}", "parallel.dp_shard=-1"],
            )
        )
    if not s.fsdp_offload:  # FSDP2 offloads on one rank too (a one-rank mesh)
        candidates.append(
            (
                "parallel.cpu_offload=true (FSDP2 keeps weights, gradients and optimizer state in host memory)",
                ["parallel.cpu_offload=true"],
            )
        )
    elif not result.fits_host:
        candidates.append(
            ("parallel.cpu_offload=false (the model states back on the GPU, out of host memory)",
             ["parallel.cpu_offload=false"])
        )
    if cfg.memory.optimizer == "adamw":
        candidates.append(("memory.optimizer=adamw_bf16", ["memory.optimizer=adamw_bf16"]))
    if not cfg.lora.enabled:
        candidates.append(("lora.enabled=true (train a LoRA adapter instead of every weight)", ["lora.enabled=true"]))
    for words, overrides in candidates:
        trial = _override(cfg, overrides)
        # a change that leaves the model states alone over the GPU fits at no length: not planned (DeepSeek-V3.2 on one
        # H100 traced its layers for a tiled MLP, tiled layers and the offload store to learn that, #52)
        if trial is None or capacity is not None and _states_overflow(trial, world, capacity, trial.seq_len,
                                                                      s.ranks_on_node):
            continue
        try:
            planned = plan_config(trial, world, capacity, host_memory_bytes=result.host_capacity,
                                  disk_bytes=result.disk_capacity, ranks_on_node=s.ranks_on_node)
        except ConfigError:
            continue
        if planned.fits:
            need = f"{planned.peak_bytes / GiB:.1f} GiB per GPU" + (f" of {capacity / GiB:.1f} GiB" if capacity else "")
            if planned.host_bytes:
                need += f", {planned.host_bytes / GiB:.1f} GiB host"
            if planned.disk_bytes:
                need += f", {planned.disk_bytes / GiB:.1f} GiB disk"
            return f"Set {words}: predicted {need} (per rank)."
    longest = max_seq_len(cfg, world, capacity, host_capacity=result.host_capacity, disk_capacity=result.disk_capacity,
                          ranks_on_node=s.ranks_on_node)
    if longest:
        return f"Shorten seq_len to {longest} (the longest that fits {world} GPU(s) as configured), or use more GPUs."
    if result.fits_gpu:
        return "Nothing fits this machine's host memory and disk as configured, even at the shortest length."
    states = sum(result.breakdown[k] for k in ("weights", "gradients", "optimizer state"))
    untried = ["more GPUs"] + [name for name, on in (("LoRA", cfg.lora.enabled), ("parallel.cpu_offload=true", s.fsdp_offload))
                               if not on]
    return (
        f"Nothing fits {capacity / GiB:.1f} GiB per GPU on {world} GPU(s), even at the shortest length"
        + (f": the model states alone need {states / GiB:.1f} GiB on each GPU" if states else "")
        + f"; use {', '.join(untried[:-1]) + ' or ' + untried[-1] if len(untried) > 1 else untried[0]}."
    )


def _storage_candidates(result: PlanResult) -> list[tuple[str, list[str]]]:
    """Changes that move offloaded layer inputs off the host first, when host memory or disk is short."""
    s = result.setup
    if result.fits_host and result.fits_disk or not s.offload_activations:
        return []
    candidates = []
    if s.checkpoint_dtype != "fp8":
        candidates.append(("memory.checkpoint_dtype=fp8 (layer inputs stored in 8 bits with a per-token scale)",
                           ["memory.checkpoint_dtype=fp8"]))
    if s.offload_dir is None:
        # planned with no limit on the disk: the sentence names the space it needs
        candidates.append(("memory.offload_dir=PATH (a directory on a local disk; the inputs beyond host memory go there)",
                           ["memory.offload_dir=offload"]))
    return candidates


def _override(cfg: Config, overrides: list[str]) -> Config | None:
    """A copy of `cfg` with dotted `key=value` overrides applied and validated (None if invalid)."""
    from longfit.config import parse_override, validate

    trial = copy.deepcopy(cfg)
    try:
        for text in overrides:
            key, value = parse_override(text)
            section, name = key.split(".")
            setattr(getattr(trial, section), name, value)
        validate(trial)
    except ConfigError:
        return None
    return trial
