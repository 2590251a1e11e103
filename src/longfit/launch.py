"""Multi-process launch: `longfit train --nproc N` re-executes itself under torchrun; workers join here.

Kept free of top-level torch imports: `longfit train --nproc N` imports it before any rank starts.

torchrun's launcher runs inside the `longfit` process (its `main`, with the arguments of
`torchrun_command`), so that how the workers ended becomes the exit status, not a launcher traceback:
a worker's `longfit: error: ...` (status 2) or its stop by a signal (130, 143). The workers run in
sessions of their own, so a terminal's Ctrl-C reaches only the launcher, which sends it on to each
worker once and gives them `GRACEFUL_STOP_S` to finish the step and checkpoint (on torch versions
whose torchrun has --shutdown-timeout; 30 s on older ones). A second signal is sent on to the workers
too, which then exit at once.
"""

from __future__ import annotations

import os
import sys
import typing

from longfit.config import ConfigError, Device

GRACEFUL_STOP_S = 600
DEVICE_CHOICES = typing.get_args(Device)


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


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code  # a negative code: killed by that signal, as a shell reports it


def launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Run `longfit <argv>` (minus --nproc) on `nproc` processes via torchrun; returns the exit status."""
    import logging

    import psutil
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun_main

    args = torchrun_command(nproc, argv)[3:]
    if "--shutdown-timeout" in get_args_parser()._option_string_actions:
        args = ["--shutdown-timeout", str(GRACEFUL_STOP_S), *args]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its notes of what the workers report
    try:
        torchrun_main(args)
        return 0
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        return _exit_status(failure.exitcode)
    except SignalException as e:  # a second signal, while the workers were finishing: pass it on
        workers = psutil.Process().children(recursive=True)
        for worker in workers:
            worker.send_signal(e.sigval)
        psutil.wait_procs(workers, timeout=30)
        return 128 + int(e.sigval)


def visible_gpus() -> int:
    """CUDA GPUs this process can use (0 without CUDA); counting them does not initialise CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device_type(requested: str, local_ranks: int, gpus: int, option: str = "train.device") -> str:
    """cuda or cpu: the device type of `requested` (auto, cpu, cuda) for `local_ranks` ranks on a node of `gpus` GPUs.

    Each CUDA rank needs a GPU of its own. `auto` takes CUDA when every local rank gets one and the CPU
    on a machine without any; with some GPUs but too few it refuses, as `cuda` does, rather than train
    on the CPU when a GPU was expected. `option` is how the user set it (train.device, --device), for
    the message.
    """
    assert requested in DEVICE_CHOICES, f"{option}={requested!r} (the config's or the parser's choices)"
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return "cpu"
    if gpus >= local_ranks:
        return "cuda"
    if gpus == 0:
        raise ConfigError(f"{option}={requested}: torch sees no CUDA GPU on this machine; use {option}=cpu (or auto)")
    raise ConfigError(
        f"{option}={requested}: {local_ranks} processes on this node need one GPU each but {gpus} "
        f"{'is' if gpus == 1 else 'are'} visible; start at most {gpus} per node (--nproc {gpus}), or set "
        f"{option}=cpu to run {local_ranks} ranks on the CPU (gloo)"
    )


def ranks_on_this_node() -> int:
    """The ranks torchrun started on this machine (LOCAL_WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def init_distributed(requested_device: str = "auto"):
    """Join the torchrun job if there is one: (rank, world_size, device).

    The device type is `choose_device_type` of `requested_device` (train.device) for this node's
    LOCAL_WORLD_SIZE ranks. Under torchrun with WORLD_SIZE > 1 this initialises the default process
    group (NCCL on CUDA, gloo on the CPU) and binds this process to GPU LOCAL_RANK. Otherwise nothing
    is initialised and the device is the current GPU or the CPU; FSDP2 on one rank gets its group from
    `ParallelDims.build_mesh`.
    """
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = choose_device_type(requested_device, ranks_on_this_node(), visible_gpus()) == "cuda"
    if world == 1:
        return 0, 1, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
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
