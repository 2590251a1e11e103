"""`longfit bench keep-attention`: a real step's FLOPs counted, and its time, with memory.keep_attention on and off (#53).

Counted, not estimated: torch's FlopCounterMode runs one real training step on the CPU (one process, or --cp ranks of
gloo context parallelism, FLOPs of every rank summed) and adds up the FLOPs of every matmul and attention kernel it
runs. torch has no formula for the CPU attention kernel (aten's flash kernel for CPU, which SDPA and longfit's block
engine run), so `CPU_ATTENTION_FLOPS` gives it the convention of torch's SDPA formulas: 2 x (qk width + value width)
per (query, key) pair forward, 2.5 times that backward (the backward computes the scores again), over the pairs the
kernel visits (L (L + 1) / 2 of a causal square block).

Four counts of the same step (one document of --seq-len tokens, every layer checkpointed):
- model FLOPs: the step without checkpointing (forward and backward, nothing recomputed);
- the forward of the decoder layers, and of attention alone in it (counted inside longfit's attention function);
- hardware FLOPs with attention recomputed (memory.keep_attention=false) and kept (true).
Checkpointing recomputes each layer's forward up to the last tensor its backward needs (torch's checkpoint stops
there: a Llama layer's down projection is not run again); keeping attention takes attention's forward out of that:
kept = recomputed - attention's forward. The report prints each count and its ratio to the model FLOPs, the step
time of both checkpointed runs side by side (the median of --steps steps each, run in turns in this process so that
the machine's load weighs on both alike), the kept run's loss and every gradient against the recomputing run's, and
#53's checks, each within 2% (the command exits 1 where one fails): the kept count against that prediction, and
attention's forward counted over each whole checkpointed step, twice where it is recomputed and once where it is
kept. --fake-tensors runs the same steps on fake tensors (torch's FakeTensorMode: the same ops on shapes, without
values), so that a long step is counted in seconds; the counts depend on shapes alone (tests/test_bench_keep_attention.py
checks them against a real step's).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import statistics
import time
from pathlib import Path

from longfit.config import ConfigError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "keep-attention", help="a step's counted FLOPs and time with memory.keep_attention on and off (CPU)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", default="llama-tiny", help="preset or local model directory")
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens of the step's one document")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel gloo ranks (ring unless --set "
                        "parallel.cp_method=ulysses)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per run after the counted one (0: none)")
    parser.add_argument("--fake-tensors", action="store_true",
                        help="count the FLOPs on fake tensors: the same ops on shapes without values, seconds at any "
                        "length; no loss, gradients or times (one process only)")
    parser.add_argument("--out", required=True, help="directory the report keep_attention.md is written to")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every run")
    parser.set_defaults(run=run)


def _cpu_attention_flops(query_shape, key_shape, value_shape, is_causal: bool, backward: bool) -> int:
    """FLOPs of aten's CPU flash kernel on (B, H, Lq, D) queries, (B, Hkv, Lk, D) keys and (B, Hkv, Lk, Dv) values."""
    batch, heads, queries, width = query_shape
    keys, value_width = key_shape[-2], value_shape[-1]
    pairs = queries * (queries + 1) // 2 if is_causal and queries == keys else queries * keys
    forward = 2 * batch * heads * pairs * (width + value_width)
    return forward * 5 // 2 if backward else forward


def _cpu_forward_flops(query, key, value, dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs) -> int:
    return _cpu_attention_flops(query, key, value, is_causal, backward=False)


def _cpu_backward_flops(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
                        out_val=None, **kwargs) -> int:
    return _cpu_attention_flops(query, key, value, is_causal, backward=True)


def cpu_attention_flops() -> dict:
    """FlopCounterMode's custom_mapping for the CPU attention kernel (module docstring); formulas get shapes."""
    import torch

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_forward_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_backward_flops}


def flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=cpu_attention_flops())


class AttentionFlops:
    """While active, longfit's attention function counts the FLOPs run inside it (forward only: backward runs in
    autograd's Functions, outside the call) with a counter of its own, nested in the step's."""

    def __init__(self):
        self.flops = 0

    def __enter__(self):
        from transformers import AttentionInterface

        from longfit.models.attention import ATTENTION_NAME, longfit_attention_forward

        def counted(*args, **kwargs):
            with flop_counter() as counter:
                result = longfit_attention_forward(*args, **kwargs)
            self.flops += counter.get_total_flops()
            return result

        self._restore = lambda: AttentionInterface.register(ATTENTION_NAME, longfit_attention_forward)
        AttentionInterface.register(ATTENTION_NAME, counted)
        return self

    def __exit__(self, *exc):
        self._restore()


LAYER_KEY = re.compile(r"(^|\.)layers\.\d+$")  # FlopCounterMode's name of a decoder layer (model.layers.<i>)


def _config(args: argparse.Namespace, checkpointing: bool, keep: bool):
    from longfit.config import load_config

    overrides = [f"model={args.model}", f"seq_len={args.seq_len}", "train.dtype=fp32", "train.micro_batch=1",
                 f"parallel.cp={args.cp}", f"memory.activation_checkpointing={str(checkpointing).lower()}",
                 f"memory.keep_attention={str(keep).lower()}", "memory.tiled_layers=false", "memory.tiled_mlp=false",
                 *args.overrides]
    return load_config(None, overrides)


def _batch(args: argparse.Namespace, vocab: int):
    import torch

    from longfit.data.packing import PackedBatch

    generator = torch.Generator().manual_seed(0)
    return PackedBatch.of_documents(torch.randint(0, vocab, (1, args.seq_len), generator=generator),
                                    [[args.seq_len]])


def _prepare(world: int, args: argparse.Namespace, run: str):
    """(model, its step) of one run on this rank: "model" (no checkpointing), "recomputed" or "kept"."""
    import torch

    from longfit.memory.apply import apply_memory_techniques
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.loading import compute_dtype, load_model

    cfg = _config(args, checkpointing=run != "model", keep=run == "kept")
    model = load_model(cfg.model, compute_dtype(cfg.train.dtype, torch.device("cpu")), "cpu", seed=cfg.train.seed,
                       run=cfg)
    model.train()
    batch = _batch(args, model.config.get_text_config().vocab_size)
    if world > 1:
        from longfit.parallel.batch import cp_layout, shard_batch
        from longfit.parallel.dims import ParallelDims
        from longfit.parallel.parallelize import parallelize

        dims = ParallelDims.from_config(cfg, world, model.config.get_text_config().num_attention_heads)
        mesh = dims.build_mesh("cpu")
        loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh)
        batch = shard_batch(batch, mesh.cp_rank, dims.cp, cp_layout(cfg.parallel.cp_method))
    else:
        from longfit.parallel.tiled_attention import LocalTileAttention

        apply_memory_techniques(model, cfg, "cpu", tile_attention=LocalTileAttention.for_sequence)
        loss_module = CausalLMLoss.from_config(model, cfg)
    mode = _fake_weights(model) if args.fake_tensors else contextlib.nullcontext()

    def step(backward: bool = True, keep_grads: bool = False):
        """One step; with `keep_grads`, its loss and this rank's gradients (local shards), for the parity check."""
        with mode:
            loss = batch_loss_sum(loss_module, batch)
            if not backward:
                return None
            loss.backward()
        kept = (loss.detach(), {name: _local(p.grad).clone() for name, p in model.named_parameters()
                                if p.grad is not None}) if keep_grads and not args.fake_tensors else None
        model.zero_grad(set_to_none=True)
        return kept

    return model, step


def _fake_weights(model):
    """A FakeTensorMode in which `model`, its parameters and buffers swapped for fake copies (same shapes, no values),
    runs its steps: FlopCounterMode counts the ops they dispatch, which depend on shapes alone."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the batch's token ids stay real
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(mode.from_tensor(param), param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = mode.from_tensor(buffer)
    return mode


def _local(tensor):
    """A DTensor's local shard (parallelize's parameters under cp), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _difference(recomputed, kept) -> float:
    """The largest |difference| between two steps' (loss, gradients), inf when their parameters differ."""
    loss, grads = recomputed
    kept_loss, kept_grads = kept
    if grads.keys() != kept_grads.keys():
        return float("inf")
    pairs = [(loss, kept_loss), *((grad, kept_grads[name]) for name, grad in grads.items())]
    return max(float((a.float() - b.float()).abs().max()) for a, b in pairs)


def _rank_results(rank: int, world: int, args: argparse.Namespace) -> dict:
    """This rank's counts of every run (module docstring), then the two checkpointed runs timed in turns (the machine's
    load then weighs on both alike)."""
    from longfit.memory.apply import release_offload_stores

    results = {}
    model, step = _prepare(world, args, "model")
    with flop_counter() as counter, AttentionFlops() as attention:
        step(backward=False)
    layers = [sum(ops.values()) for key, ops in counter.get_flop_counts().items() if LAYER_KEY.search(key)]
    with flop_counter() as counter:
        step()
    results["model"] = dict(flops=counter.get_total_flops(), layers_forward=sum(layers),
                            attention_forward=attention.flops, layers=len(layers), seconds=None)
    del model, step
    runs = {run: _prepare(world, args, run) for run in ("recomputed", "kept")}
    steps = {}
    for run, (_, step) in runs.items():
        with flop_counter() as counter, AttentionFlops() as attention:
            steps[run] = step(keep_grads=True)
        results[run] = dict(flops=counter.get_total_flops(), attention_forward=attention.flops, times=[])
    if not args.fake_tensors:
        results["kept"]["difference"] = _difference(steps["recomputed"], steps["kept"])
        results["kept"]["gradients"] = len(steps["kept"][1])
    del steps
    for _ in range(args.steps):
        for run, (_, step) in runs.items():
            start = time.perf_counter()
            step()
            results[run]["times"].append(time.perf_counter() - start)
    for run, (model, _) in runs.items():
        times = results[run].pop("times")
        results[run]["seconds"] = statistics.median(times) if times else None
        release_offload_stores(model)
    return results


def measure(args: argparse.Namespace) -> dict:
    """{run: {flops, seconds[, layers_forward, attention_forward, layers][, difference, gradients]}}, FLOPs (and the
    gradient tensors compared) summed over the ranks, the largest difference of any rank, times of rank 0."""
    if args.seq_len < 2 or args.cp < 1 or args.steps < 0:
        raise ConfigError(f"--seq-len {args.seq_len}, --cp {args.cp}, --steps {args.steps}: need >= 2, >= 1, >= 0")
    if args.fake_tensors and (args.cp > 1 or args.steps):
        raise ConfigError("--fake-tensors counts one process's FLOPs (gloo cannot send fake tensors) and times nothing: "
                          "drop --cp or --fake-tensors, and pass --steps 0")
    if args.cp == 1:
        per_rank = [_rank_results(0, 1, args)]
    else:
        from longfit.check.ranks import run_on_ranks

        per_rank = run_on_ranks(_rank_results, args.cp, args)
    results = {}
    for run, first in per_rank[0].items():
        results[run] = dict(first)
        for key in ("flops", "layers_forward", "attention_forward", "gradients"):
            if key in first:
                results[run][key] = sum(rank[run][key] for rank in per_rank)
        if "difference" in first:
            results[run]["difference"] = max(rank[run]["difference"] for rank in per_rank)
    return results


def predicted(results: dict) -> dict:
    """Hardware FLOPs of the kept run from the counted ones: the recomputed run's less attention's forward."""
    return {"kept": results["recomputed"]["flops"] - results["model"]["attention_forward"]}


CHECK_BAND = 0.02  # #53's bound on a counted step against the sum of its parts


def checks(results: dict) -> list[tuple[str, float, float]]:
    """(what, counted, expected) of #53's FLOP checks: the kept step is the model's forward and backward plus the
    recompute of everything but attention, and the checkpointed steps run attention's forward twice without it (the
    recompute) and once with it, as counted inside longfit's attention function over the whole step."""
    attention = results["model"]["attention_forward"]
    return [
        ("kept step's FLOPs, against model + recompute - attention's forward", results["kept"]["flops"],
         predicted(results)["kept"]),
        ("attention's forward in the recomputing step, against twice the model's",
         results["recomputed"]["attention_forward"], 2 * attention),
        ("attention's forward in the kept step, against the model's", results["kept"]["attention_forward"], attention),
    ]


def _within_band(counted: float, expected: float) -> bool:
    return abs(counted / expected - 1) <= CHECK_BAND


def failed_checks(results: dict) -> list[str]:
    return [what for what, counted, expected in checks(results) if not _within_band(counted, expected)]


def report(results: dict, args: argparse.Namespace) -> str:
    model, recomputed, kept = results["model"], results["recomputed"], results["kept"]
    recompute = recomputed["flops"] - model["flops"]
    command = shlex.join(["longfit", *getattr(args, "argv", ["bench", "keep-attention"])])
    dtype = _config(args, checkpointing=True, keep=True).train.dtype
    difference = kept.get("difference")

    def seconds(run: dict) -> str:
        return "-" if run["seconds"] is None else f"{run['seconds']:.2f}"

    lines = [
        f"`{command}`: {args.model}, one document of {args.seq_len} tokens, cp={args.cp}, {dtype} on CPU, every layer "
        "checkpointed; FLOPs counted by torch's FlopCounterMode over one real step (all ranks summed)"
        + (", its ops run on fake tensors (shapes, no values)." if args.fake_tensors else "."),
        "",
        f"- decoder layers' forward: {model['layers_forward']:.4g} FLOPs ({model['layers']} layers), attention's "
        f"forward in it: {model['attention_forward']:.4g} ({model['attention_forward'] / model['layers_forward']:.1%})",
        f"- recomputed by checkpointing: {recompute:.4g} ({recompute / model['layers_forward']:.1%} of the layers' "
        "forward: the checkpoint stops its recompute after the last tensor backward needs, so a layer's last "
        "projection is not run again)",
        "",
        "| run | hardware FLOPs | / model FLOPs | step time (s) |",
        "| --- | --- | --- | --- |",
        f"| no checkpointing (model FLOPs) | {model['flops']:.4g} | 1.000 | - |",
        f"| checkpointed, attention recomputed | {recomputed['flops']:.4g} | {recomputed['flops'] / model['flops']:.3f} "
        f"| {seconds(recomputed)} |",
        f"| checkpointed, attention kept | {kept['flops']:.4g} | {kept['flops'] / model['flops']:.3f} | {seconds(kept)} |",
        "",
        f"kept / recomputed: FLOPs {kept['flops'] / recomputed['flops']:.3f}"
        + ("" if kept["seconds"] is None else f", step time {kept['seconds'] / recomputed['seconds']:.3f} (median of "
           f"{args.steps} steps each, in turns)"),
    ]
    if difference is not None:
        lines.append(f"kept against recomputed, the loss and every gradient ({kept['gradients']} tensors, all ranks): "
                     + ("equal, bit for bit" if difference == 0 else f"largest |difference| {difference:.3g}"))
    lines += ["", f"Checks (within {CHECK_BAND:.0%}):",
              *(f"- {what}: {counted:.4g} / {expected:.4g} = {counted / expected:.4f}, "
                + ("pass" if _within_band(counted, expected) else "FAIL")
                for what, counted, expected in checks(results))]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    results = measure(args)
    text = report(results, args)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "keep_attention.md").write_text(text + "\n")
    failed = failed_checks(results)
    for what in failed:
        print(f"longfit: error: #53's check failed, {what}: outside {CHECK_BAND:.0%} (the report above has the counts)")
    return 1 if failed else 0
