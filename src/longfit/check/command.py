"""`longfit check`: is this run's model computed exactly, under this run's techniques? Asked before any GPU is paid for.

    longfit check model=./models/Qwen3-8B parallel.cp=8 memory.tiled_layers=true
    longfit check run.yaml --device cpu

A shrunken copy of the model's own architecture (one layer of each kind, small widths, random weights) runs
longfit's forward and backward on the CPU against transformers' eager attention (`longfit.check.parity`): one
document per row and packed documents (the reference runs each document alone), with the run's memory techniques, LoRA, dtype, and its context-parallel
attention on two gloo ranks; where the run's rows hold images, the same steps on a packed row of image
conversations through a shrunken copy of the wrapper (`longfit.check.media`). It prints the largest loss and gradient errors against their bounds and
ends with "exact", or fails (exit status 2) naming the layer and part that differs. Nothing heavy is imported
until it runs. The verdict and its lines are cached (`longfit.check.gate`): asked again of the same run, it prints
them in well under a second, saying so; `longfit train` reads the same cache.
"""

from __future__ import annotations

import argparse

from longfit.config import ConfigError, load_config, split_config_items


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check",
        help="prove on a shrunken copy of the model that longfit computes it exactly under the run's techniques",
        description="Build a shrunken copy of the run's model (one layer of each kind, small widths, random weights) "
        "and compare longfit's loss and every gradient with transformers' eager attention on the CPU: one document "
        "per row and packed documents, under the run's memory techniques, LoRA, train.dtype and context "
        "parallelism (two gloo ranks). Ends with 'exact' or names the layer and part that differs.",
        epilog="Config keys are those of `longfit train --help`, e.g. model=./models/Qwen3-8B parallel.cp=8.",
    )
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | key=value", help="config file, then overrides")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="the device the run trains on, which decides the `auto` techniques and dtype (default: "
                        "cpu when train.device=cpu, else cuda); the check itself always runs on this machine's CPU")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from longfit.check.gate import checked
    from longfit.models.cache import cache_dir

    path, overrides = split_config_items(args.items)
    cfg = load_config(path, overrides)
    device = args.device or ("cpu" if cfg.train.device == "cpu" else "cuda")
    verdict = checked(cfg, device)
    if verdict.cached:
        print(f"longfit check: the verdict of this run's check, cached ({cache_dir('check_verdicts')})", flush=True)
    if verdict.lines:
        print("\n".join(verdict.lines), flush=True)
    if not verdict.exact:  # the check's one line (parity.NotExact's), raised without importing torch for it
        raise ConfigError(verdict.message)
    return 0
