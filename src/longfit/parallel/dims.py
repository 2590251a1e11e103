"""Parallel degrees of a run and the device mesh built from them.

Ranks form a 2-D mesh ("dp_shard", "cp"), cp varying fastest, so that a context-parallel group is a
block of consecutive ranks (one node on GPU clusters, where the ring / all-to-all traffic is heaviest).
FSDP2 shards the parameters over ALL dp_shard x cp ranks: CP ranks hold different tokens of the same
rows, so for the parameters they are data-parallel peers like any other (torchtitan's "dp_shard_cp").

Everything is passed explicitly: `build_mesh` returns a `ParallelMesh` holding the process groups;
nothing lives in globals. On one process every group is None and the collectives of
`longfit.parallel.comm` are no-ops, so the trainer runs the same code for 1 and N ranks; only FSDP2 on
one rank (parallel.cpu_offload) builds a mesh of one rank, over a one-rank process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from longfit.config import ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from longfit.config import Config

# Chunks of a row that each cp rank holds: the zigzag ring two (chunks r and 2cp-1-r), Ulysses one.
ROW_CHUNKS_PER_RANK = {"ring": 2, "ulysses": 1}


def window_fits_chunk(window: int, chunk: int) -> bool:
    """Whether a sliding window's W - 1 earlier keys of a zigzag chunk's first query lie in the chunk just
    before it: then ring attention exchanges that halo instead of passing K/V shards around (ring.py)."""
    return window - 1 <= chunk


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism and every rule that ties them to the world size, the sequence and the heads.

    dp_shard x cp must equal the world size (dp_shard=-1 derives it). This class is the one owner of
    those rules: `from_config` checks them all at once, before anything is built, with messages that
    name the fix; the kernels below it only assert. dp_replicate (HSDP) and tp are not implemented; they
    would become further mesh axes in front of (dp_replicate) and behind (tp) the present two, with
    `world_size` their product.
    """

    dp_shard: int
    cp: int
    world_size: int
    cp_method: str = "ring"
    offload_model_states: bool = False
    """parallel.cpu_offload: FSDP2 keeps parameters, gradients and optimizer state in host memory."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size {self.world_size}: must be >= 1")
        if self.cp < 1:
            raise ConfigError(f"parallel.cp={self.cp}: must be >= 1")
        if self.cp_method not in ROW_CHUNKS_PER_RANK:
            raise ConfigError(f"parallel.cp_method={self.cp_method!r} is not one of {', '.join(ROW_CHUNKS_PER_RANK)}")
        if self.dp_shard == -1:
            if self.world_size % self.cp:
                nproc = self.cp * max(1, self.world_size // self.cp)
                raise ConfigError(
                    f"parallel.cp={self.cp} does not divide the world size {self.world_size}: launch a multiple of "
                    f"{self.cp} processes (`longfit train --nproc {nproc}` or `torchrun --nproc-per-node {nproc}`), "
                    f"or set parallel.cp to one of {_divisors(self.world_size)}"
                )
            object.__setattr__(self, "dp_shard", self.world_size // self.cp)
        if self.dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard}: use a positive degree or -1 (derive from the world size)")
        if self.dp_shard * self.cp != self.world_size:
            launched = self.dp_shard * self.cp
            derive = (
                f"parallel.dp_shard={self.world_size // self.cp} (or -1)"
                if self.world_size % self.cp == 0
                else f"parallel.dp_shard=-1 with parallel.cp in {_divisors(self.world_size)}"
            )
            raise ConfigError(
                f"world size {self.world_size} != parallel.dp_shard ({self.dp_shard}) x parallel.cp ({self.cp}) = "
                f"{launched}: launch {launched} processes (`longfit train --nproc {launched}` or "
                f"`torchrun --nproc-per-node {launched}`), or keep {self.world_size} processes with {derive}"
            )

    @classmethod
    def from_config(cls, cfg: "Config", world_size: int, num_attention_heads: int) -> "ParallelDims":
        """The degrees of `cfg` on `world_size` ranks, checked against seq_len and the model's query heads."""
        dims = cls(
            dp_shard=cfg.parallel.dp_shard,
            cp=cfg.parallel.cp,
            world_size=world_size,
            cp_method=cfg.parallel.cp_method,
            offload_model_states=cfg.parallel.cpu_offload,
        )
        dims.check_sequence(cfg.seq_len)
        dims.check_heads(num_attention_heads)
        return dims

    @property
    def fsdp_size(self) -> int:
        """Ranks the parameters are sharded over (the flattened dp_shard x cp axis)."""
        return self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model: to shard it over several ranks, or on one rank to offload its states."""
        return self.fsdp_size > 1 or self.offload_model_states

    @property
    def dp_size(self) -> int:
        """Ranks that read different batches (the data loader's number of shards)."""
        return self.dp_shard

    @property
    def sequence_granule(self) -> int:
        """seq_len must be a multiple of this: every cp rank gets equal chunks of every row."""
        return ROW_CHUNKS_PER_RANK[self.cp_method] * self.cp

    def check_sequence(self, seq_len: int) -> None:
        """seq_len must split into equal per-rank shards: 2 x cp chunks (zigzag ring) or cp (Ulysses)."""
        unit = self.sequence_granule
        if seq_len % unit:
            why = (
                f"2 x parallel.cp = {unit} (the zigzag ring gives every rank two equal chunks)"
                if self.cp_method == "ring"
                else f"parallel.cp = {unit} (Ulysses gives every rank an equal contiguous shard)"
            )
            fit = max(unit, seq_len // unit * unit)
            raise ConfigError(f"seq_len={seq_len} must be divisible by {why}: e.g. seq_len={fit}")

    def check_heads(self, num_heads: int) -> None:
        """Ulysses scatters the attention heads over the cp ranks: cp must divide them.

        Key/value heads have no such rule: Ulysses repeats them up to a multiple of cp (ulysses.py).
        """
        if self.cp == 1 or self.cp_method != "ulysses" or num_heads % self.cp == 0:
            return
        fits = [d for d in _divisors(num_heads) if d > 1]
        raise ConfigError(
            f"parallel.cp_method=ulysses splits the {num_heads} attention heads over parallel.cp={self.cp} ranks, "
            f"which must divide them: use parallel.cp in {fits} or parallel.cp_method=ring (no head constraint)"
        )

    def build_mesh(self, device_type: str) -> "ParallelMesh":
        """The mesh and process groups of this run.

        Several ranks need the default process group initialised (torchrun); a single process whose
        model FSDP2 wraps (parallel.cpu_offload) gets a one-rank group here.
        """
        if not self.fsdp_enabled:
            return ParallelMesh(self, None, None, None, None, cp_rank=0, dp_rank=0)
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self.world_size == 1 and not dist.is_initialized():
            options = {"device_id": torch.device("cuda", torch.cuda.current_device())} if device_type == "cuda" else {}
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)

        mesh = init_device_mesh(device_type, (self.dp_shard, self.cp), mesh_dim_names=("dp_shard", "cp"))
        # The FSDP axis is dp_shard x cp flattened. While those two axes span every rank, that is the 1-D
        # mesh over all ranks in rank order, which the public init_device_mesh builds; DeviceMesh._flatten
        # (private, and slicing the flattened axis back out of the root mesh is deprecated since torch
        # 2.11) is needed only once a dp_replicate or tp axis exists.
        fsdp_mesh = init_device_mesh(device_type, (self.fsdp_size,), mesh_dim_names=("dp_shard_cp",))
        return ParallelMesh(
            self,
            mesh,
            fsdp_mesh,
            cp_group=mesh.get_group("cp"),
            dp_group=mesh.get_group("dp_shard"),
            cp_rank=mesh.get_local_rank("cp"),
            dp_rank=mesh.get_local_rank("dp_shard"),
        )


@dataclass(frozen=True)
class ParallelMesh:
    """Process groups of a run; all None on a single process.

    mesh: the 2-D ("dp_shard", "cp") DeviceMesh. fsdp_mesh: the 1-D "dp_shard_cp" DeviceMesh FSDP2
    shards over. cp_group: this rank's context-parallel peers (same rows, different tokens). dp_group:
    this rank's data-parallel peers (different rows, same token positions). fsdp_mesh's group (all
    ranks) is the group of global reductions such as the valid-token count (`world_group`).
    """

    dims: ParallelDims
    mesh: "DeviceMesh | None"
    fsdp_mesh: "DeviceMesh | None"
    cp_group: "ProcessGroup | None"
    dp_group: "ProcessGroup | None"
    cp_rank: int
    dp_rank: int

    @property
    def world_group(self) -> "ProcessGroup | None":
        return None if self.fsdp_mesh is None else self.fsdp_mesh.get_group()
