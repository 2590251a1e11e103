"""`longfit bench trl`: TRL's SFTTrainer alone vs SFTTrainer + longfit (`longfit.integrations.hf`), side by side:
peak memory and step time of the same rows, each configuration in a fresh process (`trl_worker`)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from longfit.bench.worker import run_in_fresh_process
from longfit.config import ConfigError

TRL_ALONE = "SFTTrainer (SDPA, TRL's gradient checkpointing and fused LM head)"
GiB = 2**30


def register(subparsers) -> None:
    parser = subparsers.add_parser("trl", help="peak memory and step time: TRL's SFTTrainer alone vs with longfit",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny", help="preset, local model directory or smollm2-135m")
    parser.add_argument("--length", type=int, default=16384, help="tokens per row (one document)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for apply_longfit, e.g. memory.tiled_mlp=true (repeatable)")
    parser.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    parser.set_defaults(run=run)


def configurations(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, apply_longfit settings or ["trl"] for none): TRL alone, with longfit's defaults, with --set."""
    runs = [(TRL_ALONE, ["trl"]), ("SFTTrainer + apply_longfit", [])]
    if args.sets:
        runs.append((f"SFTTrainer + apply_longfit({', '.join(args.sets)})", args.sets))
    return runs


def run_worker(label: str, sets: list[str], args: argparse.Namespace) -> dict:
    config = "trl" if sets == ["trl"] else "trl+longfit"
    spec = dict(config=config, model=args.model, length=args.length, steps=args.steps, sets=[] if config == "trl" else sets)
    run = run_in_fresh_process("longfit.bench.trl_worker", spec)
    if run.result is None:
        return dict(label=label, error=f"exit code {run.returncode}: " + "\n".join(run.stderr_tail(6)))
    return dict(label=label, **run.result)


def markdown(runs: list[dict], args: argparse.Namespace) -> str:
    command = " ".join(["longfit bench trl", f"--model {args.model}", f"--length {args.length}",
                        f"--steps {args.steps}", *(f"--set {s}" for s in args.sets)])
    lines = [f"`{command}`", "", "| configuration | peak above baseline | peak / SFTTrainer | step (s) "
             "| step CPU (s) | step CPU / SFTTrainer | losses |", "| --- | --- | --- | --- | --- | --- | --- |"]
    base = runs[0]
    for run in runs:
        if "error" in run:
            lines.append(f"| {run['label']} | failed: {run['error'].splitlines()[-1]} | | | | | |")
            continue
        step, cpu = statistics.median(run["step_s"]), statistics.median(run["step_cpu_s"])
        peak_ratio = cpu_ratio = ""
        if "error" not in base:
            peak_ratio = f"{run['peak_bytes'] / base['peak_bytes']:.3f}"
            cpu_ratio = f"{cpu / statistics.median(base['step_cpu_s']):.2f}"
        losses = " ".join(f"{loss:.4f}" for loss in run["losses"])
        lines.append(f"| {run['label']} | {run['peak_bytes'] / GiB:.3f} GiB | {peak_ratio} | {step:.2f} | {cpu:.2f} "
                     f"| {cpu_ratio} | {losses} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise ConfigError("longfit bench trl needs TRL: pip install 'longfit[hf]'")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: measure at least 1 step")
    runs = [run_worker(label, sets, args) for label, sets in configurations(args)]
    report = markdown(runs, args)
    print(report)
    if args.out:
        Path(args.out + ".md").write_text(report)
        Path(args.out + ".json").write_text(json.dumps(dict(args={k: v for k, v in vars(args).items() if k != "run"}, runs=runs), indent=1))
    return 1 if any("error" in run for run in runs) else 0
