"""`longfit bench gpu`: plain transformers (+ peft) and longfit side by side on one GPU, within a time budget.

Rows: for each --models entry (a preset or local directory, fine-tuned fully or with LoRA) and each of
--lengths, the --systems (by default all three, in this order) on one document of L tokens (`gpu_worker` says exactly what each runs):
- longfit: the trainer with every memory technique on (checkpointing, chunked loss, tiled MLP, the offload store,
  which keeps on the GPU the layer inputs the analytic plan finds room for, as the trainer);
- plain: transformers with sdpa and its own gradient checkpointing, full logits (+ peft for LoRA);
- longfit-no-offload: the same without the offload store, so the table shows what offload adds;
- longfit-host: longfit with every offloaded layer input in host memory, as the plan places them on a GPU without
  room for them (planned for a GPU of no spare capacity): what the offload store costs where it moves them all;
- longfit-kept, longfit-recomputed: longfit with whole (untiled) checkpointed layers, attention's output kept through
  the recompute beside each layer input (memory.keep_attention=true, #53) or recomputed (false): what keeping it
  saves of a step and costs in memory and host traffic.
Then the longest contexts: longfit at 2x, 4x, ... the longest listed length (--longest doublings) while
they fit in memory and in the time left. Or --rows: the rows themselves, in their order (no doublings).

Each row runs in a fresh process (nothing carries over: allocator, caches, peaks) and is killed if it
outlives the budget. Rows run shortest first, both models at one length before the next length; a row
whose estimated time exceeds what is left is skipped and said so. The estimate is the model's measured
set-up time plus (1 + --steps) steps of its hardware FLOPs at the rate the same model and system reached
on an earlier row (before any row: 30% of the device's peak). A system that ran out of memory at one
length is not tried at longer ones. For every longfit row the traced plan (`longfit plan --trace`, fake
tensors on the CPU) runs in the background while the next rows measure, from the memory the row found free.

Output: gpu_<device>.md and .json in --out (runs/bench-gpu by default), with the command, the date, the device and
the torch and transformers versions; `gpu_report` defines every column.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from longfit.bench.worker import run_in_fresh_process
from longfit.config import ConfigError

SYSTEMS = ("longfit", "plain", "longfit-no-offload", "longfit-host", "longfit-kept", "longfit-recomputed")
KEEP_ATTENTION = {"longfit-kept": "true", "longfit-recomputed": "false"}  # memory.keep_attention of those systems
KINDS = ("full", "lora")
DEFAULT_MODELS = "llama-3.2-1b:full,llama-3.1-8b:lora"
DEFAULT_LENGTHS = "32768,65536,131072"
DEFAULT_SETUP_S = 20.0  # a model's set-up time before one of its rows measured it
ASSUMED_PEAK_FRACTION = 0.3  # of the device's peak: the step-time estimate before any row measured a rate
KILL_GRACE_S = 10.0  # a row may overrun the budget by this much before it is killed
SWITCHES = ("memory.activation_checkpointing", "memory.chunked_loss", "memory.tiled_mlp", "memory.offload_activations")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "gpu", help="plain transformers vs longfit on one GPU: speed, MFU, measured vs planned peak, offload cost",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test of the harness")
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help="comma-separated MODEL:full|lora (a preset or a local model directory)")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated sequence lengths L")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated systems to measure at each length, in this order, of {', '.join(SYSTEMS)}")
    parser.add_argument("--rows", default=None, metavar="MODEL:KIND:SYSTEM:L,...",
                        help="the rows to measure, in this order, instead of --models x --lengths x --systems (and "
                             "no --longest doublings), e.g. llama-3.1-8b:lora:longfit:131072,"
                             "llama-3.2-1b:full:longfit-host:131072")
    parser.add_argument("--longest", type=int, default=3,
                        help="then longfit at up to this many doublings of the longest length, while time and memory allow")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per row after one warm-up step; their median")
    parser.add_argument("--time-budget", type=float, default=540.0, help="seconds for the whole run (default 9 minutes)")
    parser.add_argument("--out", default="runs/bench-gpu", help="directory for gpu_<device>.md and .json (never the tracked benchmarks/results: copy a run there by hand)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed of presets")
    parser.add_argument("--no-trace", dest="trace", action="store_false",
                        help="skip the traced plan of the longfit rows (a trace of an 8B model takes tens of seconds)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for both systems, e.g. --set lora.r=32 or --set memory.loss_chunk=4096")
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class Row:
    model: str
    kind: str
    system: str
    length: int
    longest: bool = False

    @property
    def name(self) -> str:
        return f"{self.model} {self.kind} {self.system} L={self.length}"


@dataclass
class Outcome:
    row: Row
    status: str  # "ok", "oom", "skipped", "failed", "killed"
    detail: str = ""
    result: dict = field(default_factory=dict)
    wall_s: float = 0.0


def _parse_models(text: str) -> list[tuple[str, str]]:
    models = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        model, _, kind = item.rpartition(":")
        if not model or kind not in KINDS:
            raise ConfigError(f"--models {text!r}: write MODEL:full or MODEL:lora, e.g. {DEFAULT_MODELS}")
        models.append((model, kind))
    if not models:
        raise ConfigError(f"--models {text!r}: name at least one, e.g. {DEFAULT_MODELS}")
    return models


def _parse_rows(text: str) -> list[Row]:
    rows = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        model, kind, system, length = (item.rsplit(":", 3) + ["", "", ""])[:4]
        if not model or kind not in KINDS or system not in SYSTEMS or not length.isdigit() or int(length) < 2:
            raise ConfigError(f"--rows {item!r}: write MODEL:KIND:SYSTEM:L, KIND one of {', '.join(KINDS)}, SYSTEM one "
                              f"of {', '.join(SYSTEMS)}, e.g. llama-3.1-8b:lora:longfit:131072")
        rows.append(Row(model, kind, system, int(length)))
    if not rows:
        raise ConfigError(f"--rows {text!r}: name at least one row, e.g. llama-3.1-8b:lora:longfit:131072")
    return rows


def _validate(args: argparse.Namespace) -> None:
    args.row_list = _parse_rows(args.rows) if getattr(args, "rows", None) else None
    if args.row_list is not None:  # the rows' models, lengths and systems, in order of appearance
        args.models = ",".join(dict.fromkeys(f"{r.model}:{r.kind}" for r in args.row_list))
        args.lengths = ",".join(dict.fromkeys(str(r.length) for r in args.row_list))
        args.systems = ",".join(dict.fromkeys(r.system for r in args.row_list))
        args.longest = 0
    args.model_list = _parse_models(args.models)
    try:
        lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 2:
        raise ConfigError(f"--lengths {args.lengths!r}: give comma-separated lengths >= 2, e.g. {DEFAULT_LENGTHS}")
    args.length_list = lengths
    args.system_list = list(dict.fromkeys(x.strip() for x in args.systems.split(",") if x.strip()))
    unknown = sorted(set(args.system_list) - set(SYSTEMS))
    if unknown or not args.system_list:
        raise ConfigError(f"--systems {args.systems!r}: name some of {','.join(SYSTEMS)}")
    for name, value, least in (("--steps", args.steps, 1), ("--longest", args.longest, 0)):
        if value < least:
            raise ConfigError(f"{name} {value}: must be >= {least}")
    if args.time_budget <= 0:
        raise ConfigError(f"--time-budget {args.time_budget}: give the seconds the run may take, e.g. 540")
    for text in args.overrides:
        key = text.split("=", 1)[0].strip()
        if "=" not in text:
            raise ConfigError(f"--set {text!r}: write KEY=VALUE, e.g. --set lora.r=32")
        if key in (*SWITCHES, "model", "seq_len", "lora.enabled", "train.seed"):
            raise ConfigError(f"--set {key}: set by the benchmark itself (--models, --lengths, --seed choose it)")


def row_overrides(row: Row, args: argparse.Namespace) -> list[str]:
    """The config overrides of a row: its fine-tuning kind, its memory techniques, the device's dtype, --set."""
    overrides = ["lora.enabled=true"] if row.kind == "lora" else []
    if row.system != "plain":
        overrides += [f"{key}=true" for key in SWITCHES[:3]]
        overrides.append(f"memory.offload_activations={'false' if row.system == 'longfit-no-offload' else 'true'}")
    if row.system in KEEP_ATTENTION:  # whole layers: tiled ones recompute attention tile by tile, kept or not
        overrides += ["memory.tiled_layers=false", f"memory.keep_attention={KEEP_ATTENTION[row.system]}"]
    if args.device == "cpu":
        overrides.append("train.dtype=fp32")  # as the trainer on a CPU; the traced plan then models the same
    return overrides + list(args.overrides)


def _spec(row: Row, args: argparse.Namespace) -> dict:
    return dict(system="plain" if row.system == "plain" else "longfit", model=row.model, length=row.length,
                device=args.device, seed=args.seed, steps=args.steps, overrides=row_overrides(row, args),
                inputs_on_host=row.system == "longfit-host")


def run_worker(mode: str, spec: dict, timeout: float) -> tuple[str, dict, str]:
    """(status, result, detail) of one `gpu_worker` process; status "ok", "oom", "failed" or "killed"."""
    try:
        run = run_in_fresh_process("longfit.bench.gpu_worker", spec, mode, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        phases = [line for line in stderr.splitlines() if line.startswith("longfit-bench: ")]
        reached = f" ({phases[-1].removeprefix('longfit-bench: ')})" if phases else ""
        return "killed", {}, f"stopped after {timeout:.0f} s: the time budget ran out{reached}"
    if run.result is None:
        return ("oom" if run.killed else "failed"), {}, f"exit code {run.returncode}: " + " | ".join(run.stderr_tail(4))
    result = run.result
    if result.get("oom"):
        return "oom", result, result["error"]
    return "ok", result, ""


class Tracer:
    """Runs the traced plans of longfit rows one after another in a background thread."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.queue: list[tuple[Outcome, dict]] = []
        self.lock = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._work, daemon=True, name="longfit-bench-trace")
        self.thread.start()

    def submit(self, outcome: Outcome, spec: dict) -> None:
        with self.lock:
            self.queue.append((outcome, spec))
            self.lock.notify()

    def _work(self) -> None:
        while True:
            with self.lock:
                while not self.queue and not self.closed:
                    self.lock.wait()
                if not self.queue:
                    return
                outcome, spec = self.queue.pop(0)
            status, result, detail = run_worker("trace", spec, self.deadline + KILL_GRACE_S - time.monotonic())
            outcome.result.update(result if status == "ok" else {"trace_error": detail})

    def finish(self) -> None:
        """Wait for the queued traces; each is killed at the deadline, and its row then says why it has none."""
        with self.lock:
            self.closed = True
            self.lock.notify()
        self.thread.join()


def _estimate(row: Row, args, setups: dict, rates: dict, peak_tflops: float | None) -> float | None:
    """Seconds the row should take (module docstring); None when nothing is known yet."""
    flops = row_flops(row, args).hardware
    rate = rates.get((row.model, row.system)) or next((r for (m, _), r in rates.items() if m == row.model), None)
    rate = rate or next(iter(rates.values()), None)
    if rate is None and peak_tflops:
        rate = ASSUMED_PEAK_FRACTION * peak_tflops * 1e12
    if rate is None:
        return None
    return setups.get(row.model, DEFAULT_SETUP_S) + (1 + args.steps) * flops / rate


def row_flops(row: Row, args: argparse.Namespace):
    """The model and hardware FLOPs of one step of `row` (longfit.plan.flops)."""
    from longfit.plan.flops import step_flops
    from longfit.config import load_config
    from longfit.plan.setup import mlp_tiles, resolve

    cfg = load_config(None, [f"model={row.model}", f"seq_len={row.length}", *row_overrides(row, args)])
    setup = resolve(cfg, 1, args.device)
    targets = tuple(cfg.lora.target_modules) if cfg.lora.enabled else ()
    longfit = row.system != "plain"  # plain: transformers' own checkpointing, attention recomputed
    tiles = mlp_tiles(setup) if longfit else 1
    return step_flops(setup.shape, row.length, targets, cfg.lora.r, checkpointed=True, mlp_tiles=tiles,
                      keep_attention=longfit and setup.keep_attention)


def _listed_rows(args) -> list[Row]:
    if getattr(args, "row_list", None):
        return list(args.row_list)
    return [Row(model, kind, system, length)
            for length in args.length_list for system in args.system_list for model, kind in args.model_list]


def _skip_reason(row: Row, oom_at: dict, estimate: float | None, left: float) -> str | None:
    shorter = oom_at.get((row.model, row.kind, row.system))
    if shorter is not None and shorter < row.length:
        return f"not run: out of memory at L={shorter}"
    if left <= 0:
        return "not run: the time budget is spent"
    if estimate is not None and estimate > left:
        return f"not run: would take about {estimate:.0f} s, {max(0.0, left):.0f} s of the budget left"
    return None


def measure_rows(args: argparse.Namespace, device: dict, deadline: float) -> list[Outcome]:
    """Every row in order, within the budget; traces of the longfit rows run alongside."""
    from longfit.bench.flops import peak_bf16_tflops

    peak_tflops = peak_bf16_tflops(device["device_name"]) if args.device == "cuda" else None
    begun = deadline - args.time_budget
    tracer = Tracer(deadline)
    outcomes: list[Outcome] = []
    setups: dict[str, float] = {}
    rates: dict[tuple[str, str], float] = {}
    oom_at: dict[tuple[str, str, str], int] = {}

    def attempt(row: Row) -> Outcome:
        left = deadline - time.monotonic()
        reason = _skip_reason(row, oom_at, _estimate(row, args, setups, rates, peak_tflops), left)
        if reason is not None:
            outcome = Outcome(row, "skipped", reason)
        else:
            spec = _spec(row, args)
            started = time.monotonic()
            status, result, detail = run_worker("measure", spec, left + KILL_GRACE_S)
            outcome = Outcome(row, status, detail, result, time.monotonic() - started)
            if status == "oom":
                oom_at.setdefault((row.model, row.kind, row.system), row.length)
            if status == "ok":
                flops = row_flops(row, args)
                result.update(model_flops=flops.model, hardware_flops=flops.hardware)
                setups[row.model] = max(setups.get(row.model, 0.0), result["setup_s"])
                rates[(row.model, row.system)] = flops.hardware / result["step_s"]
                if row.system != "plain" and getattr(args, "trace", True):
                    tracer.submit(outcome, dict(spec, free_bytes=result["free_at_start_bytes"], placement=result.get("placement")))
        shown = outcome.status if outcome.status == "ok" else f"{outcome.status}: {outcome.detail}"
        print(f"[{time.monotonic() - begun:5.0f} s] {row.name}: {shown}", flush=True)
        outcomes.append(outcome)
        return outcome

    for row in _listed_rows(args):
        attempt(row)
    growing = {(model, kind): True for model, kind in args.model_list}
    for doubling in range(1, args.longest + 1 if "longfit" in args.system_list else 1):
        for model, kind in args.model_list:
            if growing[(model, kind)]:
                row = Row(model, kind, "longfit", args.length_list[-1] << doubling, longest=True)
                growing[(model, kind)] = attempt(row).status == "ok"
    tracer.finish()
    return outcomes


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def run(args: argparse.Namespace) -> int:
    from longfit.bench.gpu_report import derive, markdown_report, text_table

    _validate(args)
    begun = time.monotonic()
    deadline = begun + args.time_budget
    status, device, detail = run_worker("probe", {"device": args.device}, min(300.0, args.time_budget))
    if status != "ok":
        raise ConfigError(f"--device {args.device}: the device could not be used ({detail}); on a machine without a "
                          f"GPU run `longfit bench gpu --device cpu` (a smoke test of the harness)")
    outcomes = measure_rows(args, device, deadline)
    command = shlex.join(["longfit", *args.argv])
    report = derive(outcomes, device)
    report.update(command=command, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), device=device,
                  time_budget_s=args.time_budget, elapsed_s=time.monotonic() - begun,
                  args={k: v for k, v in vars(args).items()
                        if k not in ("run", "argv", "model_list", "length_list", "system_list", "row_list")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu_{device_slug(device['device_name'])}"
    print(text_table(report))
    stem.with_suffix(".md").write_text(markdown_report(report))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=_jsonable))
    print(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.json')}")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def _jsonable(value):
    if isinstance(value, (Row, Outcome)):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
