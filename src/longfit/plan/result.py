"""PlanResult: the predicted per-rank memory of one training step, its breakdown and verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

from longfit.config import Config
from longfit.memory.switches import CheckpointPlacement
from longfit.plan.setup import Setup, Stage

GiB = 1 << 30
CATEGORIES = ("weights", "gradients", "optimizer state", "activations", "working set", "communication", "reserve")


@dataclass
class PlanResult:
    """Predicted per-rank memory of one training step."""

    setup: Setup
    tensor_bytes: int
    """Peak of live tensor bytes (torch.cuda.max_memory_allocated; what --trace measures)."""
    breakdown: dict[str, int]
    """Bytes per category at the peak event, including `reserve`; sums to peak_bytes."""
    peak_event: str
    host_bytes: int
    """Host memory this rank needs: the offload store's arena and FSDP2 CPU offload's model states (under
    parallel.pp: the most any stage's rank needs, each stage's in `stages`)."""
    capacity: int | None = None
    events: list[tuple[str, int]] = field(default_factory=list)
    disk_bytes: int = 0
    """Disk this rank's offloaded layer inputs need (memory.offload_dir; under parallel.pp the most of any stage)."""
    placement: CheckpointPlacement | None = None
    """Where the offload store keeps each checkpointed layer input: GPU, host, disk (None: no offload); under
    parallel.pp the heaviest stage's (each rank's store follows its own stage's, in `stages`)."""
    host_capacity: int | None = None
    """Host memory of the machine (None: not checked)."""
    disk_capacity: int | None = None
    """Free disk space where memory.offload_dir points (None: not checked)."""
    stage: Stage | None = None
    """The pipeline stage planned (parallel.pp > 1); None: the whole model."""
    stages: list[PlanResult] = field(default_factory=list)
    """Under parallel.pp: every stage's plan, first to last (this plan is the heaviest's)."""
    kept_attention: PlanResult | None = None
    """memory.keep_attention=auto (#53) where the run fits only with attention recomputed: the plan with it kept, which
    does not fit (`analytic.plan_run`); this plan is the one without it."""

    @property
    def config(self) -> Config:
        return self.setup.config

    @property
    def peak_bytes(self) -> int:
        """What the GPU must hold: the tensor peak plus the reserve."""
        return sum(self.breakdown.values())

    @property
    def fits_gpu(self) -> bool:
        return self.capacity is None or self.peak_bytes <= self.capacity

    @property
    def host_share(self) -> int | None:
        """What one rank may use of the machine's host memory (plan/storage.py)."""
        from longfit.plan.storage import HOST_RESERVE_BYTES, rank_share

        return rank_share(self.host_capacity, self.setup, HOST_RESERVE_BYTES)

    @property
    def disk_share(self) -> int | None:
        from longfit.plan.storage import rank_share

        return rank_share(self.disk_capacity, self.setup)

    @property
    def fits_host(self) -> bool:
        return self.host_share is None or self.host_bytes <= self.host_share

    @property
    def fits_disk(self) -> bool:
        return self.disk_share is None or self.disk_bytes <= self.disk_share

    @property
    def fits(self) -> bool:
        """The GPU, host memory and disk all hold what this plan puts on them (where their sizes are known)."""
        return self.fits_gpu and self.fits_host and self.fits_disk

    def stages_text(self) -> str:
        """A pipelined run's stage cut and each stage's planned peak: "stages: layers 0-9 | 10-19, peaks 30.12 /
        29.80 GiB"."""
        cut = " | ".join(_spans(p.stage.layers) for p in self.stages)
        return f"stages: layers {cut}, peaks {' / '.join(f'{p.peak_bytes / GiB:.2f}' for p in self.stages)} GiB"

    def dominant(self) -> str:
        """The largest term at the peak, in words."""
        name, value = max(((k, v) for k, v in self.breakdown.items() if k != "reserve"), key=lambda kv: kv[1])
        share = value / self.peak_bytes
        return f"{name} ({value / GiB:.1f} GiB, {share:.0%} of the peak, at {self.peak_event})"

    def to_dict(self) -> dict:
        s = self.setup
        return {
            "model": s.shape.name,
            "gpus": s.world,
            "dp_shard": s.dp_shard,
            "cp": s.cp,
            "cp_method": s.cp_method,
            "tp": s.tp,
            "seq_len": s.seq_len,
            "tokens_per_rank": s.tokens,
            "regime": s.regime,
            "lora": s.lora,
            "activation_checkpointing_layers": s.checkpointed,
            "offload_activations": s.offload_activations,
            "fsdp_cpu_offload": s.fsdp_offload,
            "tiled_mlp": s.tiled_mlp,
            "loss_chunk": s.loss_chunk,
            "peak_bytes": self.peak_bytes,
            "tensor_bytes": self.tensor_bytes,
            "breakdown": self.breakdown,
            "peak_event": self.peak_event,
            "host_bytes": self.host_bytes,
            "disk_bytes": self.disk_bytes,
            "tiled_layers": s.tiled_layers,
            "checkpoint_dtype": s.checkpoint_dtype,
            "checkpoint_placement": (
                {"gpu": self.placement.device, "host": self.placement.host, "disk": self.placement.disk}
                if self.placement is not None else None
            ),
            "capacity_bytes": self.capacity,
            "host_capacity_bytes": self.host_capacity,
            "disk_capacity_bytes": self.disk_capacity,
            "fits": self.fits,
            "fits_gpu": self.fits_gpu,
            "fits_host": self.fits_host,
            "fits_disk": self.fits_disk,
            "keep_attention": s.keep_attention,
            **({"kept_attention_peak_bytes": self.kept_attention.peak_bytes,
                "kept_attention_host_bytes": self.kept_attention.host_bytes} if self.kept_attention else {}),
            **({"pp": s.dims.pp, "pp_schedule": s.config.parallel.pp_schedule,
                "pp_layers": [len(plan.stage.layers) for plan in self.stages],
                "stage_peak_bytes": [plan.peak_bytes for plan in self.stages],
                "stage_host_bytes": [plan.host_bytes for plan in self.stages],
                "stage_disk_bytes": [plan.disk_bytes for plan in self.stages],
                "stage_checkpoint_placements": [
                    {"gpu": p.device, "host": p.host, "disk": p.disk, "in_flight": p.in_flight} if p else None
                    for p in (plan.placement for plan in self.stages)]} if self.stages else {}),
        }


def _spans(layers) -> str:
    """Ascending layer indices as their consecutive runs: "0-3", or "0-1 + 4-5" for a rank holding two stages."""
    runs: list[list[int]] = []
    for index in layers:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return " + ".join(f"{first}-{last}" if last > first else f"{first}" for first, last in runs)
