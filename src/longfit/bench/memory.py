"""`longfit bench memory`: peak memory and step time of plain transformers vs longfit, side by side.

Configurations (each at every --lengths L, each (configuration, L) in a fresh process, see
`memory_worker`), on the same weights (same seed) and the same batch (one document of L random tokens):
- hf-sdpa (a): what a transformers user does: sdpa attention, transformers' own checkpointing
  (`activation_checkpointing_enable`, formerly `gradient_checkpointing_enable`, use_reentrant=False),
  `model(input_ids, labels=input_ids).loss` (full (L, V) logits, the built-in loss);
- lf-ckpt (b1): longfit attention (`CausalLMLoss`, full-logits loss) + longfit activation checkpointing;
- lf-chunked-loss (b2): + chunked lm_head/cross-entropy;
- lf-tiled-mlp (b3): + tiled MLP;
- lf-offload (b4): + host offload of the checkpointed layer inputs. Default on CUDA only: on CPU the "host
  copy" is a second CPU tensor, so it can only add memory and time;
- lf-tiled-layers (b5): sequence-tiled decoder layers (longfit.memory.tiled_layers), which replace the
  checkpointing and the tiled MLP of (b3), with the chunked loss; offload as (b4) on CUDA, none on CPU.
Every step is forward, backward, AdamW step (state allocated in the warm-up, so it sits in the baseline of
every configuration alike) and freeing the gradients. "peak" is the peak above that baseline (CPU: RSS,
CUDA: max_memory_allocated); "total" adds the baseline back. Step time is the median wall clock, and on
CPU also the process's CPU seconds (robust to other processes sharing the cores); on CUDA, MFU. Ratios
are against (a) at the same L. The losses must agree with (a): the techniques are exact. A run that does
not fit the device (CUDA out of memory, or killed) is reported as such; the exit code is 1 only for other
failures.

Largest L within --budget (compared with "total"): from a least-squares line total = a + b L through the
measured lengths (memory is linear in L: no configuration materialises anything quadratic), labelled
interpolated or extrapolated; with --search, found by real runs instead (gallop from the line's estimate,
then bisection to --search-resolution tokens).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from longfit.bench.memory_report import (
    CONFIG_LABELS,
    markdown_report,
    plot_report,
    text_table,
)
from longfit.bench.worker import run_in_fresh_process
from longfit.config import ConfigError
from longfit.launch import DEVICE_CHOICES, choose_device_type, visible_gpus

GiB = 2**30
CONFIG_NAMES = tuple(CONFIG_LABELS)
# The cumulative switches are what the configurations compare; --set may tune anything else.
SWITCH_KEYS = ("memory.activation_checkpointing", "memory.chunked_loss", "memory.tiled_mlp", "memory.offload_activations",
               "memory.tiled_layers")
SEARCH_LIMIT = 1 << 24  # tokens: --search never runs longer rows
UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '80GB' -> bytes; a bare number is GiB."""
    cleaned = text.strip().lower().replace(" ", "")
    for unit in sorted(UNITS, key=len, reverse=True):
        if cleaned.endswith(unit):
            return int(float(cleaned[: -len(unit)]) * UNITS[unit])
    return int(float(cleaned) * GiB)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "memory", help="peak memory and step time: plain transformers vs longfit techniques added one by one",
        description=__doc__.split("\n\n")[0],
        epilog="Configurations: " + "; ".join(f"{k} = {v}" for k, v in CONFIG_LABELS.items()),
    )
    parser.add_argument("--model", default="llama-60m", help="preset or local model directory")
    parser.add_argument("--lengths", default="4096,8192,16384", help="comma-separated sequence lengths L")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="cuda: one GPU; auto: cuda when this machine has one, as train.device")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help="parameter and compute dtype (auto: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run; step time is their median")
    parser.add_argument("--budget", default=None, help="memory budget for the largest-L column, e.g. 8GiB "
                        "(default: 8GiB on CPU, the GPU's memory on CUDA); compared with the total peak")
    parser.add_argument("--search", action="store_true", help="find the largest L within the budget by real runs")
    parser.add_argument("--search-resolution", type=int, default=1024, help="--search stops at this many tokens")
    parser.add_argument("--out", default="runs/bench-memory", help="directory for memory.md, memory.png, results.json")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated subset of {', '.join(CONFIG_NAMES)} (default: all; lf-offload on CUDA only)")
    parser.add_argument("--optimizer", choices=["adamw", "adamw_bf16", "none"], default="adamw",
                        help="optimizer stepped in every configuration (none: forward + backward only)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed of presets")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="device peak FLOP/s (TFLOP/s) for MFU (default on CUDA bf16: by the GPU's name, longfit.bench.flops)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the longfit configurations, e.g. --set memory.loss_chunk=1024")
    parser.set_defaults(run=run)


def _validate(args: argparse.Namespace) -> str | None:
    """The first problem with the flags, phrased as the fix; None when they are fine."""
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        return f"--lengths {args.lengths!r}: give comma-separated integers, e.g. 4096,8192,16384"
    if not lengths or min(lengths) < 2:
        return f"--lengths {args.lengths!r}: every length must be >= 2"
    args.length_list = sorted(set(lengths))
    names = [c.strip() for c in args.configs.split(",") if c.strip()] if args.configs else [
        c for c in CONFIG_NAMES if c != "lf-offload" or args.device == "cuda"]
    unknown = [c for c in names if c not in CONFIG_NAMES]
    if unknown:
        return f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIG_NAMES)}"
    args.config_list = [c for c in CONFIG_NAMES if c in names]
    if args.steps < 1:
        return f"--steps {args.steps}: must be >= 1"
    if args.search_resolution < 1:
        return f"--search-resolution {args.search_resolution}: must be >= 1"
    for text in args.overrides:
        key = text.split("=", 1)[0].strip()
        if "=" not in text:
            return f"--set {text!r}: write KEY=VALUE, e.g. --set memory.loss_chunk=1024"
        if key in SWITCH_KEYS or key in ("model", "seq_len"):
            return f"--set {key}: set by the benchmark itself (pick configurations with --configs, lengths with --lengths)"
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    try:
        args.budget_bytes = parse_bytes(args.budget) if args.budget else None
    except ValueError:
        return f"--budget {args.budget!r}: give a size such as 8GiB, 512MiB or 80GB"
    return None


def run_worker(config: str, length: int, args: argparse.Namespace, steps: int | None = None) -> dict:
    """One measurement in a fresh `python -m longfit.bench.memory_worker` process; the result dict."""
    spec = dict(config=config, length=length, model=args.model, device=args.device, dtype=args.dtype,
                steps=steps or args.steps, optimizer=args.optimizer, seed=args.seed, overrides=args.overrides)
    run = run_in_fresh_process("longfit.bench.memory_worker", spec)
    if run.result is None:
        reason = "killed (out of memory?)" if run.killed else f"exit code {run.returncode}"
        return dict(config=config, length=length, error=f"{reason}: " + "\n".join(run.stderr_tail(6)), oom=run.killed)
    return dict(config=config, length=length, **run.result)


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of y = a + b x; None with fewer than two distinct x."""
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def fitted_length(line: tuple[float, float], budget: float, multiple: int = 1) -> int | None:
    """Largest L (a multiple of `multiple`) with a + b L <= budget; None if the line never fits or never grows."""
    intercept, slope = line
    if slope <= 0 or intercept > budget:
        return None
    return int((budget - intercept) / slope) // multiple * multiple or None


def gallop_search(fits, start: int, resolution: int, limit: int, known_fit: int = 0, known_fail: int | None = None) -> int:
    """Largest multiple of `resolution` in [resolution, limit] with fits(L), assuming fits is monotone; 0 if none.

    Probes `start` first, then steps away from it by resolution, 2 x resolution, ... until the answer is
    bracketed, then bisects: few runs when the estimate is good. known_fit / known_fail are lengths
    already measured (0 / None: unknown).
    """
    lo = known_fit // resolution * resolution
    hi = None if known_fail is None else -(-known_fail // resolution) * resolution  # fails too: fits is monotone
    top = limit // resolution * resolution if hi is None else min(limit // resolution * resolution, hi - resolution)
    probe = min(max(start // resolution * resolution, lo + resolution), top)
    if probe <= lo:
        return lo
    step = resolution
    if fits(probe):
        lo = probe
        while (hi is None or hi - lo > resolution) and lo < top:
            probe = min(lo + step, top)
            if not fits(probe):
                hi = probe
                break
            lo, step = probe, step * 2
    else:
        hi = probe
        while hi - lo > resolution and hi - step > lo:
            if fits(hi - step):
                lo = hi - step
                break
            hi, step = hi - step, step * 2
    while hi is not None and hi - lo > resolution:
        mid = lo + (hi - lo) // 2 // resolution * resolution
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def resolve_budget(args: argparse.Namespace, runs: list[dict]) -> int:
    """--budget, else the GPU's memory on CUDA, else 8 GiB."""
    measured = next((r["device_total_bytes"] for r in runs if "device_total_bytes" in r), None)
    return args.budget_bytes or measured or 8 * GiB


def compare(runs: list[dict], args: argparse.Namespace, budget: int) -> tuple[list[dict], list[dict]]:
    """Rows with ratios against (a) at the same L, and the largest-L-within-budget rows per configuration."""
    ok = [r for r in runs if "error" not in r]
    base = {r["length"]: r for r in ok if r["config"] == "hf-sdpa"}
    rows = []
    for r in runs:
        row = dict(r)
        ref = base.get(r["length"])
        if "error" not in r:
            row["tokens_per_s"] = r["length"] / r["step_s"]
            row["model_tflops"] = r["model_flops"] / r["step_s"] / 1e12
            peak = args.peak_tflops or (r.get("peak_bf16_tflops") if args.dtype == "bf16" else None)
            row["mfu"] = row["model_tflops"] / peak if peak else None
            if ref is not None:
                row["memory_ratio"] = r["peak_bytes"] / ref["peak_bytes"]
                row["total_ratio"] = r["total_bytes"] / ref["total_bytes"]
                row["time_ratio"] = r["step_s"] / ref["step_s"]
                row["cpu_ratio"] = r["cpu_s"] / ref["cpu_s"]
                row["loss_diff"] = abs(r["loss"] - ref["loss"])
        rows.append(row)
    largest = []
    for config in args.config_list:
        points = [(r["length"], r["total_bytes"]) for r in ok if r["config"] == config]
        line = fit_line(points)
        entry = dict(config=config, line=line, largest=None, how="n/a (needs two measured lengths)", probes=[])
        if line is not None:
            entry["fit_error"] = max(abs(y - (line[0] + line[1] * x)) / y for x, y in points)
            entry["largest"] = fitted_length(line, budget, multiple=128)
            inside = entry["largest"] is not None and entry["largest"] <= max(x for x, _ in points)
            entry["how"] = f"{'interpolated' if inside else 'extrapolated'} (linear fit)"
        if args.search:
            entry["largest"] = _search(config, points, entry["largest"], budget, args, entry["probes"])
            entry["how"] = f"searched ({len(entry['probes'])} runs, resolution {args.search_resolution})"
        largest.append(entry)
    return rows, largest


def _search(config: str, points: list[tuple[int, float]], estimate: int | None, budget: int,
            args: argparse.Namespace, probes: list[dict]) -> int:
    def fits(length: int) -> bool:
        result = run_worker(config, length, args, steps=1)
        probes.append(result)
        good = "error" not in result and result["total_bytes"] <= budget
        shown = f"{result['total_bytes'] / GiB:.2f} GiB total" if "error" not in result else result["error"].splitlines()[0]
        print(f"  search {config} L={length}: {shown} -> {'fits' if good else 'does not fit'}", flush=True)
        return good

    measured_fit = [x for x, y in points if y <= budget]
    measured_fail = [x for x, y in points if y > budget]
    start = estimate or (max(measured_fit) if measured_fit else args.search_resolution)
    return gallop_search(fits, start, args.search_resolution, limit=SEARCH_LIMIT,
                         known_fit=max(measured_fit, default=0), known_fail=min(measured_fail, default=None))


def run(args: argparse.Namespace) -> int:
    args.device = choose_device_type(args.device, 1, visible_gpus(), "--device")
    problem = _validate(args)
    if problem:
        raise ConfigError(problem)

    runs = []
    total = len(args.config_list) * len(args.length_list)
    for length in args.length_list:
        for config in args.config_list:
            result = run_worker(config, length, args)
            runs.append(result)
            if "error" in result:
                shown = f"FAILED {result['error']}"
            else:
                shown = (f"peak {result['peak_bytes'] / GiB:.3f} GiB ({result['peak_phase']}) above baseline "
                         f"{result['baseline_bytes'] / GiB:.3f} GiB, step {result['step_s']:.2f} s "
                         f"({result['cpu_s']:.1f} CPU s), loss {result['loss']:.6f}")
            print(f"[{len(runs)}/{total}] {config} L={length}: {shown}", flush=True)
    args.budget_bytes = resolve_budget(args, runs)
    rows, largest = compare(runs, args, args.budget_bytes)
    command = shlex.join(["longfit", *args.argv])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(text_table(rows, largest, args))
    (out / "memory.md").write_text(markdown_report(rows, largest, args, command))
    plot_report(rows, largest, args, out / "memory.png")
    (out / "results.json").write_text(json.dumps(dict(command=command, args=vars(args), rows=rows, largest=largest), indent=1))
    print(f"wrote {out / 'memory.md'}, {out / 'memory.png'}, {out / 'results.json'}")
    # Not fitting is a result (a length too long for plain transformers); any other failure is an error.
    return 0 if all("error" not in r or r.get("oom") for r in runs) else 1

