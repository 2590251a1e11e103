"""`longfit train`: parse the config, launch torchrun when asked, train, print the outcome."""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import signal
import sys
import textwrap

from longfit.config import (
    ConfigError,
    config_reference,
    load_config,
    split_config_items,
)


def _epilog() -> str:
    lines = ["config keys (set in CONFIG.yaml or as key.sub=value overrides):\n"]
    for key, default, doc in config_reference():
        lines.append(f"  {key} (default {default})")
        lines.extend(textwrap.wrap(doc, width=96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


_CONFIG_KEYS = "config keys"
"""The train parser's epilog until its help is written (`_ConfigKeysHelp`)."""


class _ConfigKeysHelp(argparse.RawDescriptionHelpFormatter):
    """Writes the config keys' reference (`_epilog`) as the epilog of `longfit train --help` only: it reads the docs
    from config.py's source (#52: 0.1 CPU s that every longfit command paid, `longfit check` and a warm plan too)."""

    def add_text(self, text):
        super().add_text(_epilog() if text is _CONFIG_KEYS else text)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train (with no CONFIG: the embedded default on this machine)",
        description="Train a model. CONFIG.yaml is optional; key.sub=value overrides follow it. "
        "Resumes automatically from the latest checkpoint in output_dir.",
        epilog=_CONFIG_KEYS,
        formatter_class=_ConfigKeysHelp,
    )
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | key=value", help="config file, then overrides")
    parser.add_argument("--nproc", type=int, default=1, help="start torchrun with N processes on this machine")
    nodes = parser.add_argument_group(
        "several nodes and restarts",
        "Run the same command on every node (output_dir on a file system they share); the nodes meet in torchrun's "
        "c10d rendezvous at --rdzv-endpoint, and the ranks of a failed attempt are restarted from the newest checkpoint.")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes taking part, each starting --nproc processes")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="where the nodes meet: a free port on a host every node reaches (the first node's)")
    nodes.add_argument("--rdzv-id", metavar="ID", help="the rendezvous id, the same on every node (default: one derived "
                       "from output_dir)")
    nodes.add_argument("--node-rank", type=int, metavar="R", help="this node's index (default: assigned by the rendezvous)")
    nodes.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="restart the workers up to K times when one of them fails (a crash, a kill, an out-of-memory "
                       "kill); they resume from the newest intact checkpoint")
    parser.add_argument("--force", action="store_true",
                        help="train even if the planner predicts it will not fit the device memory or the disk")
    parser.add_argument("--allow-changes", metavar="KEY,...",
                        help="when resuming, apply these config keys although they differ from the checkpoint's config "
                        "(e.g. train.lr); they are recorded in config.yaml and metrics.jsonl")
    parser.set_defaults(run=run)


def _format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def retrieval_line(before, after) -> str:
    """The run's eval.retrieval outcome, with the untrained model's score beside it."""
    was = f"{before.accuracy:.2f} before training -> " if before else ""
    return (f"retrieval accuracy at {after.length} tokens ({after.examples} examples, teacher-forced exact match): "
            f"{was}{after.accuracy:.2f} after")


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same arguments, and --nproc for the ranks of this job."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world > local:  # several nodes: the same launch on each
        return f"on every node, the command that started it (longfit {shlex.join(argv)} and its --nnodes options)"
    return shlex.join(["longfit", *argv, *(["--nproc", str(world)] if world > 1 else [])])


def lost_a_peer(error: RuntimeError) -> bool:
    """Whether `error` is a collective's report that another rank went away (gloo's transport, NCCL's backend)."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or "gloo/transport/tcp" in str(error)


def run(args: argparse.Namespace) -> int:
    from longfit.train.console import StartupClock
    from longfit.train.resume import parse_allowed

    clock = StartupClock(from_process_start=True)
    cfg = load_config(*split_config_items(args.items))
    clock.mark("config")
    from longfit.models.source import check_model_dir, local_model_dir

    local_model_dir(cfg.model)  # a GGUF file is converted here, once: a phase of its own
    check_model_dir(cfg.model)  # weights and tokenizer there before the check and the plan spend their seconds
    clock.mark("model files")
    allowed = parse_allowed(args.allow_changes)
    from longfit.launch import Launch

    from longfit.check.gate import require_exact
    from longfit.launch import choose_device_type, ranks_on_this_node, visible_gpus

    launch = Launch(args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id, args.max_restarts)
    if launch.needs_torchrun:
        from longfit.launch import default_rendezvous_id, launch_torchrun
        from longfit.plan import preflight

        # The device and the parallel layout must suit the whole world before any rank starts; the ranks check memory.
        # The preflight settles choices in the config it is given (an empty parallel.pp_layers becomes its cut): on a
        # copy, so that the verdict is stored under the inputs each rank reads it by, the config as given.
        device_type = choose_device_type(cfg.train.device, launch.nproc, visible_gpus())
        preflight(copy.deepcopy(cfg), launch.world_size, device_type, check_fit=False)
        require_exact(cfg, device_type)
        return launch_torchrun(launch, args.argv, default_rendezvous_id(cfg.output_dir))
    device_type = choose_device_type(cfg.train.device, ranks_on_this_node(), visible_gpus())
    clock.mark("devices")  # torch imported to count the GPUs: not the check's time, which a cached verdict makes ~0
    # Never train what `longfit check` does not call exact (the ranks the launcher started read its cached verdict).
    require_exact(cfg, device_type)
    clock.mark("check")
    from longfit.launch import shutdown_distributed
    from longfit.train.loop import train

    try:
        summary = train(cfg, force=args.force, allow_changes=allowed, startup=clock)
    except ConfigError as error:
        if getattr(error, "met_by_every_rank", False):  # all ranks stop here: they leave the process group together
            shutdown_distributed()
        raise
    except RuntimeError as error:
        if not lost_a_peer(error):
            raise
        # Another rank died in a collective (killed, crashed, out of memory): its own log says why, and torchrun
        # stops this attempt; a traceback of this rank's half of the collective would only bury that.
        print(f"longfit: rank {os.environ.get('RANK', 0)} lost its connection to a rank that stopped "
              f"({str(error).splitlines()[0][:200]}); see that rank's output for why", file=sys.stderr)
        return 1
    if summary.stopped_by:
        if summary.is_main:
            saved = f"checkpoint {summary.checkpoint}" if summary.checkpoint else "no new checkpoint (no step ran)"
            print(f"\nstopped by {signal.Signals(summary.stopped_by).name} after step {summary.steps}, {saved}; "
                  f"resume with: {resume_command(args.argv)}")
        shutdown_distributed()
        return 128 + summary.stopped_by
    if summary.is_main:
        if summary.resumed_from >= summary.steps and summary.export_dir:
            print(f"\n{summary.output_dir} already finished all {summary.steps} steps; exported its last checkpoint "
                  f"to {summary.export_dir}, the export this config asks for")
        elif summary.resumed_from >= summary.steps:
            print(f"\nnothing to do: {summary.output_dir} already finished all {summary.steps} steps")
        else:
            print(
                f"\ndone: steps {summary.resumed_from + 1}-{summary.steps}, loss {summary.first_loss:.4f} -> "
                f"{summary.last_loss:.4f}, peak memory {_format_bytes(summary.peak_mem_bytes)} per rank"
                + (f", {summary.skipped_steps} step(s) skipped (not finite)" if summary.skipped_steps else "")
                + "\n"
                f"outputs: {summary.output_dir} (metrics.jsonl, checkpoints/, config.yaml"
                + (f", exported model in {summary.export_dir}" if summary.export_dir else "")
                + ")"
            )
            if summary.retrieval_after:
                print(retrieval_line(summary.retrieval_before, summary.retrieval_after))
    shutdown_distributed()
    return 0
