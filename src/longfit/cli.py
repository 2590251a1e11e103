"""`longfit` command line. Heavy modules (torch, transformers) are imported only by the subcommand that runs."""

from __future__ import annotations

import argparse
import sys
import textwrap

from longfit.config import ConfigError, config_reference, load_config

TRAIN_EPILOG_HEAD = "config keys (set in CONFIG.yaml or as key.sub=value overrides):\n"


def _train_epilog() -> str:
    lines = [TRAIN_EPILOG_HEAD]
    for key, default, doc in config_reference():
        lines.append(f"  {key} (default {default})")
        lines.extend(textwrap.wrap(doc, width=96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    config_path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(config_path, overrides)
    if args.nproc and args.nproc > 1:
        from longfit.launch import launch_torchrun

        return launch_torchrun(args.nproc, argv)
    from longfit.launch import shutdown_distributed
    from longfit.train.loop import train

    summary = train(cfg, force=args.force)
    if summary.is_main:
        if summary.resumed_from >= summary.steps:
            print(f"\nnothing to do: {summary.output_dir} already finished all {summary.steps} steps")
        else:
            print(
                f"\ndone: steps {summary.resumed_from + 1}-{summary.steps}, loss {summary.first_loss:.4f} -> "
                f"{summary.last_loss:.4f}, peak memory {_format_bytes(summary.peak_mem_bytes)} per rank\n"
                f"outputs: {summary.output_dir} (metrics.jsonl, checkpoints/, config.yaml"
                + (f", exported model in {summary.export_dir}" if summary.export_dir else "")
                + ")"
            )
    shutdown_distributed()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longfit",
        description="Fine-tune Hugging Face causal LMs on very long contexts.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train (with no CONFIG: the embedded default on this machine)",
        description="Train a model. CONFIG.yaml is optional; key.sub=value overrides follow it. "
        "Resumes automatically from the latest checkpoint in output_dir.",
        epilog=_train_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("items", nargs="*", metavar="CONFIG.yaml | key=value", help="config file, then overrides")
    train.add_argument("--nproc", type=int, default=0, help="start torchrun with N processes on this machine")
    train.add_argument("--force", action="store_true", help="train even if the planner predicts it will not fit")
    sub.add_parser("plan", help="predict peak memory per GPU and the largest context", add_help=False)
    sub.add_parser("bench", help="side-by-side measurements: `longfit bench memory|cp --help`", add_help=False)
    sub.add_parser("eval", help="synthetic retrieval accuracy per context length and depth", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        from longfit.plan.command import run_plan

        return run_plan(argv[1:])
    if argv and argv[0] == "eval":
        from longfit.eval.command import run_eval

        return run_eval(argv[1:])
    if argv and argv[0] == "bench":
        from longfit.bench.command import run_bench

        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return cmd_train(args, argv)
    except ConfigError as e:
        print(f"longfit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
