"""`longfit` command line: one argparse tree, one dispatch, one error format.

Each subcommand lives with the package it drives (`train.command`, `plan.command`, `eval.command`,
`bench.command`) and registers its own parser; those modules import nothing heavy at the top, so
`longfit --help` and every `longfit CMD --help` stay instant. Positional config items (CONFIG.yaml,
key.sub=value) may stand anywhere among the flags. A `ConfigError` (bad config, bad data, a run that
cannot start or cannot go on) is printed as `longfit: error: ...` with exit status 2 and no traceback;
`longfit --debug CMD ...` shows the traceback instead. Any other exception is a bug and keeps its
traceback. Ctrl-C outside a training loop (which handles it itself) exits with 130.

longfit never downloads at run time: `main` sets HF_HUB_OFFLINE=1 before any command imports transformers,
peft or huggingface_hub (which read it once, on import), so none of them looks anything up on the hub, not
even a model's name; torchrun's workers inherit it. The library reads local files only by itself
(`local_files_only`, peft told not to check the hub on export).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from longfit.bench import command as bench_command
from longfit.check import command as check_command
from longfit.config import ConfigError
from longfit.eval import command as eval_command
from longfit.plan import command as plan_command
from longfit.train import command as train_command
from longfit.train import export_command

COMMANDS = (train_command, plan_command, check_command, bench_command, eval_command, export_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longfit", description="Fine-tune Hugging Face causal LMs on very long contexts.")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error (before the command)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{train,plan,check,bench,eval,export}")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, with a command's positional `items` allowed after its flags too.

    argparse takes the first run of positionals and leaves later ones over; they are the rest of `items`,
    in order. (parse_intermixed_args does this for a flat parser but refuses subparsers.)
    """
    args, extra = parser.parse_known_args(argv)
    items = getattr(args, "items", None)
    unknown = [arg for arg in extra if items is None or arg.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.items = items + extra
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ["HF_HUB_OFFLINE"] = "1"
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(build_parser(), argv)
    run = vars(args).pop("run")  # the rest of `args` is plain data that reports may serialise
    args.argv = argv  # for reports that print the command, and for torchrun's workers
    try:
        return run(args)
    except ConfigError as e:
        if args.debug:
            raise
        if not getattr(e, "reported_by_rank_zero", False):
            print(f"longfit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("\nlongfit: interrupted", file=sys.stderr)
        return 130


# Python collects its oldest generation once in this many collections of the middle one (its default is 10)
FULL_COLLECTION_EVERY = 100


def console() -> None:
    """The `longfit` executable, `python -m longfit` and torchrun's workers: `main` in a process of its own, whose
    objects are nearly all its imports' (torch's, transformers' and peft's ~3,000 modules). Python's cycle collector
    walks every object at each full collection: by its default thresholds 7 times while a command imports them (0.3-0.4
    s of a cold `longfit plan` on a 2-core machine, #52), and again while the interpreter exits (0.8-1.1 s). So a full
    collection comes after 100 collections of the middle generation, not 10 (torchtitan turns the collector off for a
    whole run and collects every 50 steps), and the objects left at the end are frozen before the exit, which still runs
    the exit handlers and flushes the standard streams; every file longfit writes is closed where it is written."""
    threshold, middle, _ = gc.get_threshold()
    gc.set_threshold(threshold, middle, FULL_COLLECTION_EVERY)
    status = main()
    gc.freeze()
    sys.exit(status)


if __name__ == "__main__":
    console()
