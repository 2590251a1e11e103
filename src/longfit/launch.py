"""Multi-process launch: `longfit train --nproc N` re-executes itself under torchrun; workers join here.

Kept free of top-level torch imports: `longfit train --nproc N` imports it before any rank starts.

One node: torchrun's `--standalone` (a c10d rendezvous on a free local port). Several nodes: `--nnodes N
--rdzv-endpoint HOST:PORT` on every node, handed to torchrun's c10d rendezvous, whose store the first agent
to arrive hosts at HOST:PORT; the rendezvous id defaults to one derived from output_dir, so the nodes of one
run meet and two runs on one endpoint do not. `--max-restarts K` lets torchrun restart every worker after
one dies (K times); the restarted ranks resume from the newest intact checkpoint like any other start.
torchrun's default static rendezvous cannot do that: its restarted workers wait in `init_process_group`
for ever, which is why longfit always uses c10d.

torchrun's launcher runs inside the `longfit` process (its `main`, with the arguments of
`torchrun_command`), so that how the workers ended becomes the exit status, not a launcher traceback:
a worker's `longfit: error: ...` (status 2) or its stop by a signal (130, 143). The workers run in
sessions of their own, so a terminal's Ctrl-C reaches only the launcher, which sends it on to each
worker once and gives them `GRACEFUL_STOP_S` to finish the step and checkpoint (on torch versions
whose torchrun has --shutdown-timeout; 30 s on older ones). A second signal is sent on to the workers
too, which then exit at once.

Work longfit does in processes of its own while it runs inside someone else's (the preflight's layer traces on a
rank of a run, `longfit check`'s two gloo ranks under `apply_longfit` in a user's TRL script) runs in fresh
interpreters of longfit's own (`run_in_fresh_interpreters`: `python -m longfit.launch`), never through
multiprocessing's spawn, whose children import the parent's main module again: a user's script without an
`if __name__ == "__main__":` guard would run once more in each of them and, under torchrun's environment, wait
for ever in `init_process_group` (#55).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
import typing
from dataclasses import dataclass

from longfit.config import ConfigError, Device

GRACEFUL_STOP_S = 600
DEVICE_CHOICES = typing.get_args(Device)


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun tells its workers (with TORCHELASTIC_*): a fresh interpreter started by a rank is no rank of its
job, and a library it imports that reads them (Accelerate's state) would join the job's rendezvous."""

LAUNCH_OPTIONS = ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--max-restarts")


@dataclass(frozen=True)
class Launch:
    """How `longfit train` starts its ranks: `nproc` on this node, of `nnodes` (each started the same way)."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc {self.nproc}: give the number of processes to start on this node, at least 1")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes {self.nnodes}: give the number of nodes, at least 1")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: give how often torchrun may restart the workers, 0 or more")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, a free port on a host every node "
                              "reaches (the first node's), the same on every node")
        if self.rdzv_endpoint and not _host_and_port(self.rdzv_endpoint):
            raise ConfigError(f"--rdzv-endpoint {self.rdzv_endpoint}: give HOST:PORT, e.g. node001:29500")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank}: give this node's index, 0 to {self.nnodes - 1} (or leave it out: "
                              "the rendezvous numbers the nodes)")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def needs_torchrun(self) -> bool:
        return self.world_size > 1 or self.max_restarts > 0 or self.rdzv_endpoint is not None


def _host_and_port(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def default_rendezvous_id(output_dir: str) -> str:
    """The same on every node of a run (its absolute output_dir, which they share) and different between runs."""
    return "longfit-" + hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]


def strip_launch_options(argv: list[str]) -> list[str]:
    """argv without the launch options (`--nproc N`, `--nnodes=N`, ...): the workers must not launch again."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in LAUNCH_OPTIONS)):
            out.append(arg)
    return out


def torchrun_command(launch: Launch, argv: list[str], rdzv_id: str) -> list[str]:
    """The command that runs `python -m longfit <argv>` on `launch.nproc` processes of this node."""
    if launch.rdzv_endpoint:
        rendezvous = ["--nnodes", str(launch.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", launch.rdzv_endpoint,
                      "--rdzv-id", launch.rdzv_id or rdzv_id]
        if launch.node_rank is not None:
            rendezvous += ["--node-rank", str(launch.node_rank)]
    else:
        rendezvous = ["--standalone"]
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(launch.nproc),
        "--max-restarts", str(launch.max_restarts), "-m", "longfit", *strip_launch_options(argv),
    ]


def threads_per_rank(nproc: int) -> int:
    """CPU threads each of `nproc` ranks of this node may use: the cores this process may run on, shared."""
    return max(1, len(os.sched_getaffinity(0)) // nproc)


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code  # a negative code: killed by that signal, as a shell reports it


def launch_torchrun(launch: Launch, argv: list[str], rdzv_id: str) -> int:
    """Run `longfit <argv>` (minus the launch options) on this node's ranks via torchrun; returns the exit status.

    OMP_NUM_THREADS (unless set) shares the cores among the ranks: torchrun would set 1 and print a banner
    about it on every launch."""
    import logging

    import psutil
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun_main

    args = torchrun_command(launch, argv, rdzv_id)[3:]
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(launch.nproc)))
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


def elastic_restart() -> tuple[int, int] | None:
    """(this attempt's restart number, torchrun's --max-restarts) when torchrun restarted the workers, else None."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return (restart, int(os.environ["TORCHELASTIC_MAX_RESTARTS"])) if restart else None


def process_group_backend(device_type: str, cpu_collectives: bool) -> str:
    """The default process group's backend: gloo on the CPU; NCCL on CUDA, with gloo beside it for CPU tensors
    when `cpu_collectives` (parallel.cpu_offload: FSDP2's gradients are then DTensors in host memory, whose
    norm the gradient clip all-reduces, and NCCL has no CPU backend: "No backend type associated with device
    type cpu")."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def init_distributed(requested_device: str = "auto", cpu_collectives: bool = False):
    """Join the torchrun job if there is one: (rank, world_size, device).

    The device type is `choose_device_type` of `requested_device` (train.device) for this node's
    LOCAL_WORLD_SIZE ranks. Under torchrun with WORLD_SIZE > 1 this initialises the default process
    group (`process_group_backend`) and binds this process to GPU LOCAL_RANK. Otherwise nothing
    is initialised and the device is the current GPU or the CPU; FSDP2 on one rank gets its group from
    `ParallelDims.build_mesh`.
    """
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = choose_device_type(requested_device, ranks_on_this_node(), visible_gpus()) == "cuda"
    if world == 1:
        return 0, 1, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    store, rank, world = next(dist.rendezvous("env://"))
    # Every key this attempt writes goes under its own prefix: after an elastic restart the new workers meet
    # in a store that may still hold the keys of the attempt before, and gloo would dial the dead ranks'
    # addresses left there ("connectFullMesh failed ... Connection refused").
    store = dist.PrefixStore(f"longfit/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = process_group_backend("cuda", cpu_collectives)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(process_group_backend("cpu", cpu_collectives), store=store, rank=rank, world_size=world)
    return dist.get_rank(), dist.get_world_size(), device


def shutdown_distributed() -> None:
    """Destroy the default process group, if one is initialised (by `init_distributed`, or by a launcher: Accelerate).

    All ranks meet in a barrier first: a gloo rank tearing its connections down while a peer still
    uses them aborts that peer ("terminate called without an active exception").
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class ChildTraceback(Exception):
    """The traceback of an exception raised in a child of `run_in_fresh_interpreters`, as text."""


def _fresh_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if name not in TORCHRUN_VARIABLES and not name.startswith("TORCHELASTIC_")}


def run_in_fresh_interpreters(fn: typing.Callable[..., typing.Any], calls: list[tuple], what: str,
                              timeout_s: float) -> list[typing.Any]:
    """`fn(*call)` for each of `calls`, each in a fresh `python -m longfit.launch` process at once, torchrun's
    variables removed; their results in order. `fn` is a module-level function (the children import it by name,
    with this process's sys.path). A child that raises: its exception is raised here (the others are stopped), from
    a ChildTraceback holding the child's traceback; one that dies without a word, or `timeout_s` passing (every
    child stopped): a RuntimeError or a TimeoutError naming `what`."""
    with tempfile.TemporaryDirectory(prefix="longfit-fresh-") as workdir:
        children = []
        for index, call in enumerate(calls):
            request, answer = os.path.join(workdir, f"call{index}.pkl"), os.path.join(workdir, f"result{index}.pkl")
            with open(request, "wb") as file:
                pickle.dump(sys.path, file)  # first: the children find `fn`'s module (a test's, a script's) with it
                pickle.dump((fn, call), file)
            process = subprocess.Popen([sys.executable, "-m", "longfit.launch", request, answer],
                                       env=_fresh_environment(), stdin=subprocess.DEVNULL, start_new_session=True)
            children.append((process, answer))
        deadline = time.monotonic() + timeout_s
        try:
            while any(process.poll() is None for process, _ in children):
                if any(process.poll() not in (None, 0) for process, _ in children):
                    break  # the others may wait for it in a collective
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s; its processes were stopped")
                time.sleep(0.05)
        finally:
            for process, _ in children:
                if process.poll() is None:
                    os.killpg(process.pid, 9)  # its session: the gloo ranks or workers it started, too
                    process.wait()
        outcomes = [_outcome(answer) for _, answer in children]
        for index, outcome in enumerate(outcomes):
            if outcome is not None and outcome[0] == "raised":
                _, error, text = outcome
                raise error from ChildTraceback(f"{what}, process {index}:\n{text}")
        for index, outcome in enumerate(outcomes):
            if outcome is None:
                raise RuntimeError(f"{what}: process {index} ended with exit status {children[index][0].returncode} "
                                   "and no result")
        return [value for _, value in outcomes]


def _outcome(answer: str) -> tuple | None:
    """("returned", value) or ("raised", error, traceback text) as a child wrote it; None if it wrote nothing."""
    try:
        with open(answer, "rb") as file:
            return pickle.load(file)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _answer(request: str, answer: str) -> int:
    """A child of `run_in_fresh_interpreters`: run the pickled call, pickle what it returned or raised; the exit status
    (1 when it raised: the parent then stops the other children, which may wait for this one in a collective)."""
    with open(request, "rb") as file:
        sys.path[:] = pickle.load(file)
        fn, call = pickle.load(file)
    try:
        outcome = ("returned", fn(*call))
    except BaseException as error:  # noqa: BLE001 -- every failure goes back to the parent, which raises it
        text = traceback.format_exc()
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 -- an exception that does not pickle: its text still goes back
            error = RuntimeError(text.strip().splitlines()[-1])
        outcome = ("raised", error, text)
    partial = f"{answer}.tmp"
    with open(partial, "wb") as file:
        pickle.dump(outcome, file)
    os.replace(partial, answer)
    return 0 if outcome[0] == "returned" else 1


if __name__ == "__main__":
    sys.exit(_answer(*sys.argv[1:3]))
