"""Multi-process launch: `longfit train --nproc N` re-executes itself under torchrun; workers join here.

Kept free of top-level torch imports: `longfit train --nproc N` imports it before any rank starts.
"""

from __future__ import annotations

import os
import subprocess
import sys


def strip_nproc(argv: list[str]) -> list[str]:
    """argv without `--nproc N` / `--nproc=N` (the workers must not launch again)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs `python -m longfit <argv>` on `nproc` local processes."""
    assert nproc >= 1, nproc
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "longfit", *strip_nproc(argv),
    ]


def launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Run `longfit <argv>` (minus --nproc) on `nproc` processes via torchrun; returns its exit code."""
    return subprocess.call(torchrun_command(nproc, argv))


def init_distributed():
    """Join the torchrun job if there is one: (rank, world_size, device).

    Under torchrun with WORLD_SIZE > 1 this initialises the default process group (NCCL on CUDA,
    gloo otherwise) and binds this process to GPU LOCAL_RANK. Otherwise nothing is initialised and
    the result is (0, 1, cuda or cpu); FSDP2 on one rank gets its group from `ParallelDims.build_mesh`.
    """
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return 0, 1, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                f"launch at most {torch.cuda.device_count()} processes per node (--nproc)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def shutdown_distributed() -> None:
    """Destroy the default process group if `init_distributed` created one.

    All ranks meet in a barrier first: a gloo rank tearing its connections down while a peer still
    uses them aborts that peer ("terminate called without an active exception").
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
