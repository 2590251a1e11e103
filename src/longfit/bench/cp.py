"""`longfit bench cp`: per-rank peak memory and step time of context parallelism at cp = 1, 2, 4.

Each cp degree runs in a fresh group of cp processes (gloo on CPU, NCCL on CUDA) that trains the same
model through `parallelize` (CP + the default memory techniques + FSDP2 over the cp ranks) on one row
of a single document: forward, backward of local_sum / global valid tokens, FSDP's gradient reduce
(no optimizer step, so optimizer state is not part of the numbers).

Memory, per rank, as the maximum over ranks:
- CPU: peak resident set size during the step above the rank's baseline (model sharded, one warm-up
  step done, gradients freed). The kernel's high-water mark is reset before the step (/proc/self/
  clear_refs "5") and glibc's mmap threshold is pinned to 64 KiB (mallopt) so that freed tensors go
  back to the OS instead of a malloc arena: the RSS then follows the live tensor bytes.
- CUDA: torch.cuda.max_memory_allocated above the allocated bytes at the same baseline.
"peak" includes what does not depend on L (this rank's gradient shards, a gathered layer, buffers).
"activation" removes it: the same peak at a short length L0 is subtracted and the difference scaled
by L / (L - L0), i.e. the part of the peak that grows linearly with the sequence. The target is
activation(cp=N) <= 1.15 x activation(cp=1) / N. The largest L fitting `--budget-mb` per rank comes
from the straight line through the two measured peaks (memory is linear in L: nothing quadratic is
ever materialised), rounded down to the layout's multiple; `--verify` runs it to confirm.
Step time is the mean of `--steps` timed steps. On CPU every rank runs one thread (a rank stands for
one device), so the time efficiency t(cp=1) / (N x t(cp=N)) is the parallel speed-up over N as long
as the machine has N free cores; beyond that the ranks share cores and it drops for that reason alone.
The CPU seconds a rank spends per step (time.process_time; waiting in a collective costs none) and
the CPU efficiency c(cp=1) / (N x c(cp=N)) measure the work split itself, also on a busy machine.

Mixture-of-experts models: `--ep 1,2` runs every cp degree also with each expert-parallel degree dividing it
(`parallel.ep`: each rank keeps 1/ep of every layer's experts and receives their tokens by all-to-all, where
FSDP2 alone gathers all of them), and the table adds each run's peak over the one-rank run's and its step time
over FSDP2 alone at the same cp, measured side by side in the one invocation.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from pathlib import Path

from longfit.config import ConfigError
from longfit.launch import DEVICE_CHOICES, choose_device_type, visible_gpus


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "cp", help="per-rank peak memory and step time for context-parallel degrees 1, 2, 4 (gloo on CPU)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", default="llama-tiny", help="preset or local model directory")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens of the benchmarked row (L)")
    parser.add_argument("--short-len", type=int, default=1024, help="L0, the short row that measures the L-independent memory")
    parser.add_argument("--cp", default="1,2,4", help="comma-separated context-parallel degrees")
    parser.add_argument("--method", choices=["ring", "ulysses"], default="ring", help="parallel.cp_method")
    parser.add_argument("--ep", default="1", help="comma-separated expert-parallel degrees (parallel.ep), each run "
                        "with every cp degree it divides; 1: FSDP2 alone")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per degree (after one warm-up step)")
    parser.add_argument("--budget-mb", type=float, default=1024.0, help="per-rank memory budget for the largest-L column")
    parser.add_argument("--verify", action="store_true", help="also run each largest L once and report its peak")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="cuda: one GPU per rank, NCCL; auto: cuda when there is a GPU for each rank, as train.device")
    parser.add_argument("--output", help="also write the markdown report (table + command) to this file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every run, e.g. --set memory.tiled_mlp=false")
    parser.set_defaults(run=run)


def _single_document_batch(length: int, vocab: int):
    import torch

    from longfit.data.packing import PackedBatch

    g = torch.Generator().manual_seed(length)
    input_ids = torch.randint(0, vocab, (1, length), generator=g)
    labels = torch.roll(input_ids, -1, dims=1)
    labels[:, -1] = -100
    position_ids = torch.arange(length).view(1, length)
    cu_seqlens = torch.tensor([0, length], dtype=torch.int32)
    return PackedBatch(input_ids, labels, position_ids, cu_seqlens, length - 1)


def _worker(rank: int, world: int, workdir: str, options: dict) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from longfit.bench.meter import MemoryMeter, return_freed_memory_to_os
    from longfit.config import load_config
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.loading import meta_model
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.parallelize import parallelize

    cuda = options["device"] == "cuda"
    if not cuda:
        return_freed_memory_to_os()
        torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
            timeout=datetime.timedelta(minutes=30),
        )
    try:
        cfg = load_config(None, _run_overrides(options["model"], options["seq_len"], world, options["ep"],
                                               options["method"], options["overrides"]))
        model = meta_model(cfg.model)  # its values come with parallelize, on each rank its own part
        dims = _parallel_dims(cfg, world, model)
        mesh = dims.build_mesh(device.type)
        loss_module = CausalLMLoss.from_config(model, cfg)
        loss_module = parallelize(loss_module, dims, cfg, mesh, device=device)
        layout = cp_layout(cfg.parallel.cp_method)
        vocab = model.config.get_text_config().vocab_size
        meter = MemoryMeter(device)

        def step(length: int) -> None:
            shard = shard_batch(_single_document_batch(length, vocab), mesh.cp_rank, dims.cp, layout).to(device)
            count = global_valid_tokens(shard.labels, mesh.world_group)
            (batch_loss_sum(loss_module, shard) / count).backward()
            loss_module.zero_grad(set_to_none=True)

        def measure(length: int, steps: int) -> tuple[int, float, float]:
            """(peak bytes, wall seconds per step, this process's CPU seconds per step)."""
            meter.start()
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(length)
            if cuda:
                torch.cuda.synchronize(device)
            return meter.peak(), (time.perf_counter() - started) / steps, (time.process_time() - cpu_started) / steps

        step(options["seq_len"])  # warm-up: FSDP's lazy init, first allocations
        result = {}
        result["short_peak"] = measure(options["short_len"], 1)[0]
        result["peak"], result["step_s"], result["cpu_s"] = measure(options["seq_len"], options["steps"])
        for length in options["verify_lengths"]:
            result.setdefault("verified", {})[length] = measure(length, 1)[0]
        write_rank_result(workdir, rank, world, result)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _run_overrides(model: str, seq_len: int, cp: int, ep: int, method: str, overrides: list[str]) -> list[str]:
    return [f"model={model}", f"seq_len={seq_len}", f"parallel.cp={cp}", f"parallel.cp_method={method}",
            f"parallel.ep={ep}", "train.dtype=fp32", *overrides]


def _parallel_dims(cfg, world: int, model):
    """The degrees of one run, checked by their owner (ParallelDims) against the model as the trainer checks them:
    its heads and each layer's key/value heads, linear-attention value heads (plan.shapes reads them), experts."""
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.expert import expert_count
    from longfit.plan.shapes import model_shape

    shape = model_shape(cfg.model)
    return ParallelDims.from_config(cfg, world, shape.heads, num_key_value_heads=shape.layer_kv_heads or shape.kv_heads,
                                    num_experts=expert_count(model) if cfg.parallel.ep > 1 else None,
                                    linear_value_heads=shape.linear_value_heads)


def _check_degrees(args: argparse.Namespace, runs: list[tuple[int, int]]) -> None:
    """Every run's degrees (`_parallel_dims`), before any is started."""
    from longfit.config import load_config
    from longfit.models.loading import meta_model

    model = meta_model(args.model)
    for cp, ep in runs:
        cfg = load_config(None, _run_overrides(args.model, args.seq_len, cp, ep, args.method, args.overrides))
        try:
            _parallel_dims(cfg, cp, model)
        except ConfigError as e:
            raise ConfigError(f"--cp {cp} --ep {ep}: {e}") from None


def run_degree(worker, cp: int, options: dict) -> list[dict]:
    """Every rank's result of `worker(rank, cp, workdir, options)` run in `cp` spawned processes, each written by
    `write_rank_result` into a folder of this run's own (its process group's file store too)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="longfit-bench-") as workdir:
        mp.spawn(worker, args=(cp, workdir, options), nprocs=cp, join=True)
        return [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(cp)]


def write_rank_result(workdir: str, rank: int, world: int, result: dict) -> None:
    """A rank's result for `run_degree`, written before the ranks part (none leaves the group while another writes)."""
    import torch.distributed as dist

    Path(workdir, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()


def _largest_fitting_length(short_len: int, short_peak: float, seq_len: int, peak: float, budget: float, unit: int) -> int:
    """Where the line through (short_len, short_peak) and (seq_len, peak) crosses the budget (0: no growth measured)."""
    per_token = (peak - short_peak) / (seq_len - short_len)
    if per_token <= 0:
        return 0
    length = short_len + (budget - short_peak) / per_token
    return max(0, int(length) // unit * unit)


def check_lengths(args: argparse.Namespace, degrees: list[int]) -> None:
    """--short-len below --seq-len, and both split as every --cp degree's ranks split a row (`ParallelDims`' rule)."""
    from longfit.parallel.dims import ParallelDims

    if args.short_len >= args.seq_len:
        raise ConfigError(f"--short-len {args.short_len} must be below --seq-len {args.seq_len}")
    for cp in degrees:
        for name, length in (("--seq-len", args.seq_len), ("--short-len", args.short_len)):
            try:
                ParallelDims(-1, cp, cp, args.method).check_sequence(length)
            except ConfigError as e:
                raise ConfigError(f"{name} {length}, cp={cp}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from longfit.parallel.dims import ParallelDims

    degrees = [int(x) for x in args.cp.split(",") if x.strip()]
    expert_degrees = [int(x) for x in args.ep.split(",") if x.strip()]
    runs = [(cp, ep) for cp in degrees for ep in expert_degrees if cp % ep == 0]
    if not runs:
        raise ConfigError(f"no --ep degree in {args.ep} divides a --cp degree in {args.cp}: add --ep 1")
    args.device = choose_device_type(args.device, max(degrees, default=1), visible_gpus(), "--device")
    check_lengths(args, degrees)
    _check_degrees(args, runs)
    MB = 2**20
    budget = args.budget_mb * MB
    rows = []
    for cp, ep in runs:
        unit = ParallelDims(-1, cp, cp, args.method).sequence_granule
        options = dict(model=args.model, seq_len=args.seq_len, short_len=args.short_len, method=args.method, ep=ep,
                       steps=args.steps, device=args.device, overrides=args.overrides, verify_lengths=[])
        ranks = run_degree(_worker, cp, options)
        peak, short_peak = max(r["peak"] for r in ranks), max(r["short_peak"] for r in ranks)
        activation = (peak - short_peak) * args.seq_len / (args.seq_len - args.short_len)
        largest = _largest_fitting_length(args.short_len, short_peak, args.seq_len, peak, budget, unit)
        verified = None
        if args.verify and largest > 0:
            options["verify_lengths"] = [largest]
            verified = max(r["verified"][str(largest)] for r in run_degree(_worker, cp, options))
        rows.append(dict(cp=cp, ep=ep, peak=peak, activation=activation, step_s=max(r["step_s"] for r in ranks),
                         cpu_s=max(r["cpu_s"] for r in ranks), largest=largest, verified=verified))
        print(f"cp={cp}, ep={ep}: peak {peak / MB:.1f} MB, activation {activation / MB:.1f} MB, "
              f"step {rows[-1]['step_s']:.2f} s, largest L within {args.budget_mb:.0f} MB: {largest}", flush=True)
    report = _markdown(rows, args)
    print(report)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(report)
    return 0


def _markdown(rows: list[dict], args: argparse.Namespace) -> str:
    MB = 2**20
    base = next((r for r in rows if r["cp"] == 1), None)
    fsdp_alone = {r["cp"]: r for r in rows if r["ep"] == 1}
    memory_kind = "peak RSS above the loaded baseline" if args.device == "cpu" else "max_memory_allocated above the baseline"
    lines = [
        f"| cp | ep | per-rank peak (MB) | peak / one rank | per-rank activation (MB) | activation x cp / activation(cp=1) "
        f"| step (s) | step / ep=1 | time efficiency t1 / (cp x t) | CPU s per rank | CPU efficiency c1 / (cp x c) "
        f"| largest L in {args.budget_mb:.0f} MB{' (verified peak MB)' if args.verify else ''} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        peak_ratio = f"{r['peak'] / base['peak']:.3f}" if base else "n/a"
        ratio = f"{r['activation'] * r['cp'] / base['activation']:.3f}" if base else "n/a"
        alone = fsdp_alone.get(r["cp"])
        step_ratio = f"{r['step_s'] / alone['step_s']:.3f}" if alone else "n/a"
        efficiency = f"{base['step_s'] / (r['cp'] * r['step_s']):.2f}" if base else "n/a"
        cpu_efficiency = f"{base['cpu_s'] / (r['cp'] * r['cpu_s']):.2f}" if base else "n/a"
        largest = f"{r['largest']}" + (f" ({r['verified'] / MB:.1f})" if r["verified"] is not None else "")
        lines.append(f"| {r['cp']} | {r['ep']} | {r['peak'] / MB:.1f} | {peak_ratio} | {r['activation'] / MB:.1f} | {ratio} "
                     f"| {r['step_s']:.2f} | {step_ratio} | {efficiency} | {r['cpu_s']:.2f} | {cpu_efficiency} | {largest} |")
    command = shlex.join(["longfit", *args.argv])
    return "\n".join([
        f"# Context parallelism: per-rank memory and step time ({args.device})",
        "",
        f"Command: `{command}`",
        "",
        f"Model {args.model}, one {args.seq_len}-token document, cp_method={args.method}, fp32, default memory "
        f"settings{' + ' + ', '.join(args.overrides) if args.overrides else ''}; memory = {memory_kind}, maximum over "
        f"ranks; activation = the part growing with L (peak at L minus peak at L0={args.short_len}, scaled by "
        f"L/(L-L0)); target: activation x cp / activation(cp=1) <= 1.15.",
        "",
        *lines,
        "",
    ])
