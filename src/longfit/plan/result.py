"""PlanResult: the predicted per-rank memory of one training step, its breakdown and verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

from longfit.config import Config
from longfit.plan.setup import Setup

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
    """Host (pinned) memory this rank needs for offloaded activations and FSDP2 CPU offload."""
    capacity: int | None = None
    events: list[tuple[str, int]] = field(default_factory=list)

    @property
    def config(self) -> Config:
        return self.setup.config

    @property
    def peak_bytes(self) -> int:
        """What the GPU must hold: the tensor peak plus the reserve."""
        return sum(self.breakdown.values())

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak_bytes <= self.capacity

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
            "capacity_bytes": self.capacity,
            "fits": self.fits,
        }
