"""`longfit plan`: predict the per-GPU peak memory of a training config, and the longest context that fits.

    longfit plan model=llama-3.1-8b seq_len=131072 parallel.cp=8 --gpu h100-80gb
    longfit plan model=llama-3.1-8b --gpu a40-48gb --max-context --gpus 1,2,4,8
    longfit plan model=llama-3.1-8b lora.enabled=true --gpu h100-80gb --host-mem 128GiB --max-context
    longfit plan model=llama-3.2-1b seq_len=32768 --trace

Positional key=value overrides are the `longfit train` config keys. The analytic answer is instant;
--trace also runs one training step on fake tensors (no GPU needed) and prints what it measured.
Nothing here imports torch unless --trace is given, or the model is of none of the preset families (its parameters
are then counted on the model transformers builds on the meta device: `longfit.plan.shapes.counted_parameters`).
"""

from __future__ import annotations

import argparse
import json

from longfit.config import ConfigError, load_config, split_config_items

DEFAULT_GPU_COUNTS = [1, 2, 4, 8]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="predict peak memory per GPU and the largest context",
        description="Predict the per-GPU peak memory of a training configuration (weights, gradients, optimizer "
        "state, activations, working set, communication buffers, reserve) and the largest context that fits.",
        epilog="Config keys are those of `longfit train --help`, e.g. model=llama-3.1-8b seq_len=131072 "
        "parallel.cp=8 lora.enabled=true memory.offload_activations=true.",
    )
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml | key=value", help="config file, then overrides")
    parser.add_argument("--gpu", help="GPU preset: a40-48gb, a100-80gb, h100-80gb, h200-141gb")
    parser.add_argument("--gpu-mem", metavar="SIZE", help="GPU memory, e.g. 80GiB or 48GB (instead of --gpu)")
    parser.add_argument(
        "--host-mem",
        metavar="SIZE",
        help="host memory of one machine, e.g. 128GiB, shared by the GPUs of a node (up to 8). Default: with --gpu, "
        "a typical node of that GPU (DGX A100/H100/H200: 2 TiB), or none planned where there is no typical one "
        "(--gpu a40-48gb, --gpu-mem); without either, this machine's available RAM",
    )
    parser.add_argument(
        "--disk",
        metavar="SIZE",
        help="free disk space for memory.offload_dir. Default: as --host-mem (a DGX node's 30.7 TB of NVMe), or this "
        "machine's free space where memory.offload_dir (or the current directory) is",
    )
    parser.add_argument(
        "--gpus",
        metavar="N[,N...]",
        help="GPU counts (default: dp_shard x cp x tp of the config; with --max-context 1,2,4,8)",
    )
    parser.add_argument(
        "--max-context", action="store_true",
        help="the largest seq_len that fits, per GPU count, for the variant of each strategy that reaches furthest"
    )
    parser.add_argument("--all", action="store_true",
                        help="with --max-context: every variant (offload to host or disk, fp8 layer inputs) of every strategy")
    parser.add_argument(
        "--trace", action="store_true", help="also trace one real training step on fake tensors (slower)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of peak memory vs context length per strategy")
    parser.add_argument("--list-presets", action="store_true", help="list model and GPU presets")
    parser.set_defaults(run=run)


def _gpu_counts(text: str | None, default: list[int]) -> list[int]:
    if not text:
        return default
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ConfigError(f"--gpus {text!r}: give GPU counts such as 1,2,4,8")
    return counts


def run(args: argparse.Namespace) -> int:
    from longfit.plan.gpus import gpu_capacity

    if args.list_presets:
        print(_presets())
        return 0
    cfg = load_config(*split_config_items(args.items))
    if args.plot:
        from longfit.plan.report import require_matplotlib

        require_matplotlib()
    gpu = gpu_capacity(args.gpu, args.gpu_mem)
    capacity, label = gpu if gpu else (None, None)
    if args.all and not args.max_context:
        raise ConfigError("--all chooses the rows of the --max-context table: add --max-context")
    if args.max_context and capacity is None:
        raise ConfigError(
            "--max-context needs the GPU's memory: --gpu h100-80gb (or a40-48gb, a100-80gb, h200-141gb) or --gpu-mem 80GiB"
        )
    args.device_type = _device_type(cfg, gpu is not None)
    args.host_bytes, args.disk_bytes, args.machine = _host_and_disk(cfg, args)
    if args.max_context:
        return _max_context(cfg, _gpu_counts(args.gpus, DEFAULT_GPU_COUNTS), capacity, label, args)
    world_default = cfg.parallel.cp * cfg.parallel.tp * (cfg.parallel.dp_shard if cfg.parallel.dp_shard > 0 else 1)
    return _single(cfg, _gpu_counts(args.gpus, [world_default]), capacity, label, args)


def _device_type(cfg, gpu_named: bool) -> str:
    """What the plan is for: a GPU run when a GPU is named, else what `longfit train` would use on this machine."""
    if gpu_named and cfg.train.device == "cpu":
        raise ConfigError("--gpu / --gpu-mem plan a GPU run, and train.device=cpu trains on the CPU: drop one of them")
    if gpu_named or cfg.train.device == "cuda":
        return "cuda"
    from longfit.launch import choose_device_type, visible_gpus

    return choose_device_type(cfg.train.device, 1, visible_gpus())


def _host_and_disk(cfg, args) -> tuple[int | None, int | None, str]:
    """--host-mem and --disk in bytes (None: not planned), and a sentence saying whose they are.

    A plan for a named GPU is a plan for the machine that GPU sits in, not this one: a typical node of the GPU preset
    (`GPU_NODES`), or the GPU memory alone where there is no typical node. Otherwise the run is this machine's."""
    from longfit.plan.gpus import GPU_NODES, parse_size
    from longfit.plan.preflight import disk_free_bytes, host_memory_bytes

    host = parse_size(args.host_mem, "--host-mem") if args.host_mem else None
    disk = parse_size(args.disk, "--disk") if args.disk else None
    given = " and ".join(flag for flag, value in (("--host-mem", host), ("--disk", disk)) if value is not None)
    if host is not None and disk is not None:
        return host, disk, f"host memory and disk as given ({given})"
    node = GPU_NODES.get((args.gpu or "").lower())
    if node is not None:
        return (host or node.host_bytes, disk or node.disk_bytes,
                f"host memory and disk of the typical machine of this GPU, {node.describe()}"
                + (f"; {given} as given" if given else "; --host-mem and --disk plan another machine"))
    if args.gpu or args.gpu_mem:
        gpu = f"--gpu {args.gpu}" if args.gpu else "--gpu-mem"
        return (host, disk, f"GPU memory only: {gpu} names no typical machine, so "
                + (f"only {given} is planned as given" if given else "host memory and disk are not planned")
                + "; --host-mem and --disk plan them")
    where = cfg.memory.offload_dir or "."
    return (host or host_memory_bytes(), disk or disk_free_bytes(where),
            f"host memory and disk of this machine (available RAM, free space at {where})"
            + (f"; {given} as given" if given else ""))


def _single(cfg, gpu_counts: list[int], capacity: int | None, label: str | None, args) -> int:
    from longfit.plan.analytic import plan_config
    from longfit.plan.report import gib, plan_text, tokens
    from longfit.plan.layer_trace import layer_costs
    from longfit.plan.media import tower_notes
    from longfit.plan.padding import padding_notes
    from longfit.plan.search import max_seq_len
    from longfit.plan.shapes import model_shape

    out = []
    # the disk bounds memory.offload_dir, or, given explicitly, the offload_dir a fix would suggest
    disk = args.disk_bytes if cfg.memory.offload_dir or args.disk else None
    shape = model_shape(cfg.model)
    for gpus in gpu_counts:
        result = plan_config(cfg, gpus, capacity, args.device_type, host_memory_bytes=args.host_bytes, disk_bytes=disk)
        entry = result.to_dict()
        untraced = layer_costs(result.setup).untraced if shape.counted is not None else None  # traced by plan_config
        notes = [f"{shape.model_type}: parameters counted on the model transformers builds on the meta device "
                 f"({shape.params / 1e9:.2f}B, every layer kind and expert)"] if shape.counted is not None else []
        if untraced:
            notes.append(f"activations planned as a Llama-style decoder's of the same widths (an approximation: "
                         f"{untraced})")
        notes += tower_notes(result.setup) + padding_notes(result.setup)
        if notes:
            entry["notes"] = notes
        if capacity is not None:
            entry["max_seq_len"] = max_seq_len(cfg, gpus, capacity, host_capacity=args.host_bytes, disk_capacity=disk)
            if _auto_keeps_attention(cfg, result, args.device_type):
                entry["max_seq_len_keeping_attention"] = max_seq_len(
                    _keeping_attention(cfg), gpus, capacity, host_capacity=args.host_bytes, disk_capacity=disk)
        # the text only where it is printed: a plan that does not fit plans the changes that would (`suggest_fix`)
        text = "" if args.json else plan_text(result, label, args.device_type) + f"\n  {args.machine}"
        text += "".join(f"\n  note: {note}" for note in entry.get("notes", []))
        if capacity is not None:
            longest = entry["max_seq_len"]
            text += f"\n  longest seq_len that fits as configured: " + (f"{tokens(longest)} (seq_len={longest})" if longest else "none")
            kept = entry.get("max_seq_len_keeping_attention", longest)
            if longest and (kept or 0) < longest:
                text += (f"\n  keeping attention through the recompute (memory.keep_attention=true) fits up to "
                         f"{tokens(kept) if kept else 'no length'}: memory.keep_attention=auto recomputes it beyond, "
                         "to the longer context")
        if args.trace:
            from longfit.plan.analytic import free_at_start
            from longfit.plan.trace import trace_step

            traced = trace_step(cfg, gpus, free_bytes=free_at_start(capacity), placement=result.placement,
                                device_type=args.device_type)
            entry["traced_peak_bytes"] = traced.peak_bytes
            entry["traced_host_bytes"] = traced.host_peak_bytes
            entry["traced_disk_bytes"] = traced.disk_bytes
            entry["trace_seconds"] = round(traced.seconds, 1)
            entry["trace_notes"] = traced.notes
            diff = result.tensor_bytes / traced.peak_bytes - 1
            text += (
                f"\n  traced step (fake tensors, {traced.seconds:.0f} s): peak {gib(traced.peak_bytes)} of live tensors "
                f"at {traced.peak_phase}, host {gib(traced.host_peak_bytes)}, disk {gib(traced.disk_bytes)}; analytic tensor peak "
                f"{gib(result.tensor_bytes)} ({diff:+.1%})"
            )
            text += "".join(f"\n  note: {note}" for note in traced.notes)
        out.append((entry, text))
    if args.json:
        print(json.dumps({"plans": [e for e, _ in out], "machine": args.machine}, indent=2))
    else:
        print("\n\n".join(t for _, t in out))
    if args.plot:
        _plot(cfg, max(gpu_counts), capacity, args.plot)
        if not args.json:
            print(f"\nwrote {args.plot}")
    return 0


def _auto_keeps_attention(cfg, result, device_type: str) -> bool:
    """memory.keep_attention=auto and the run is one where auto keeps attention where it fits (memory.switches'
    rule): then the longest context with it kept may be shorter than the longest that fits (`plan_run`)."""
    from longfit.memory.switches import keep_attention_rule

    return cfg.memory.keep_attention == "auto" and keep_attention_rule(cfg, device_type, result.setup.tiled_layers)


def _keeping_attention(cfg):
    import copy

    kept = copy.deepcopy(cfg)
    kept.memory.keep_attention = True
    return kept


def _max_context(cfg, gpu_counts: list[int], capacity: int, label: str, args) -> int:
    from longfit.plan.report import max_context_json, max_context_text
    from longfit.plan.search import max_context_table

    table = max_context_table(
        cfg, gpu_counts, capacity, host_capacity=args.host_bytes, disk_capacity=args.disk_bytes
    )
    if args.json:
        print(json.dumps({**max_context_json(table, gpu_counts, capacity), "machine": args.machine}, indent=2))
    else:
        print(f"{cfg.model}: {label}; {args.machine}\n")
        print(max_context_text(table, gpu_counts, every_row=args.all))
    if args.plot:
        _plot(cfg, max(gpu_counts), capacity, args.plot)
        if not args.json:
            print(f"\nwrote {args.plot}")
    return 0


def _plot(cfg, gpus: int, capacity: int | None, path: str) -> None:
    """Peak vs context length for FSDP, FSDP + ring CP and FSDP + Ulysses on `gpus` GPUs, training what `cfg`
    trains (a LoRA adapter or every weight)."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.report import plot
    from longfit.plan.search import STRATEGIES

    curves = {}
    for strategy in STRATEGIES:
        if strategy.offload or strategy.lora != cfg.lora.enabled or strategy.tp or strategy.pp:
            continue
        trial = strategy.configure(cfg, gpus)
        points = []
        seq_len = 1024 * 2 * trial.parallel.cp
        while seq_len <= 1 << 24:
            trial.seq_len = seq_len
            try:
                points.append((seq_len, plan_config(trial, gpus, capacity).peak_bytes))
            except ConfigError:
                break
            if capacity and points[-1][1] > 2 * capacity:
                break
            seq_len *= 2
        curves[strategy.name] = points
    trained = "LoRA" if cfg.lora.enabled else "full fine-tuning"
    plot(curves, capacity, f"{cfg.model}, {trained}, on {gpus} GPU(s)", path)


def _presets() -> str:
    from longfit.models.presets import PRESETS
    from longfit.plan.gpus import GPU_PRESETS
    from longfit.plan.shapes import model_shape

    lines = ["model presets:"]
    for name in PRESETS:
        m = model_shape(name)
        lines.append(
            f"  {name:<14} {m.params / 1e9:6.2f}B params, {m.layers} layers, hidden {m.hidden}, "
            f"{m.heads}/{m.kv_heads} heads, vocab {m.vocab}"
        )
    lines.append("GPU presets (--gpu):")
    for name, (capacity, label) in GPU_PRESETS.items():
        lines.append(f"  {name:<14} {capacity / (1 << 30):6.1f} GiB  {label}")
    return "\n".join(lines)
