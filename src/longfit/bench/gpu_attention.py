"""The attention kernels side by side at one long length: which one a long-context step should run (issue 46 item 3).

`python -m longfit.bench.gpu_attention --device cuda --length 131072 --out DIR` times the forward and backward of
causal self-attention over one L-token row of a model's head shape (by default llama-3.1-8b's: 32 query heads, 8
key/value heads of 128) in bf16, through each kernel the machine has:
- what longfit's `causal_attention` runs (PyTorch's own SDPA choice: cuDNN on Hopper with torch >= 2.10),
- each SDPA backend forced (FlashAttention-2, cuDNN, memory-efficient),
- flash-attn 2 and 3's varlen kernels where installed;
then softcapped scores (Gemma 2's cap of 50) at --capped-length: longfit's capped block kernel (fp32 products,
`kernels.slice_rows` slices) and flash-attn 2's softcap where installed. One warm-up call, then the median of
--repeats timed calls (CUDA events). TFLOP/s counts causal attention's own FLOPs: 4 D per visible (query, key) pair
and head forward, 2.5 times that backward (plan/flops.py's convention), L (L + 1) / 2 pairs.

Writes attention_<device>.md and .json under --out. On the CPU (`--device cpu`, a smoke test of the harness) only
the default kernel and the capped block kernel run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

BACKWARD_FLOPS = 2.5  # times the forward's: five products of the forward's two sizes


def attention_flops(length: int, heads: int, head_dim: int) -> float:
    """Forward and backward FLOPs of causal attention of one row: (1 + 2.5) x 4 D per visible pair and head."""
    return (1 + BACKWARD_FLOPS) * 4 * head_dim * heads * length * (length + 1) / 2


def _timed(run, repeats: int, device) -> float:
    """Median seconds of `run()` (forward and backward) after one warm-up call."""
    import torch

    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _candidates(device, capped: bool) -> list[tuple[str, object]]:
    """(name, attend(q, k, v) -> out) of the kernels to time: q (1, H, L, D), k/v (1, Hkv, L, D)."""
    import importlib
    import importlib.util

    import torch
    import torch.nn.functional as F

    from longfit.models.attention import _flash_varlen_attention, blockwise_attention, causal_attention

    def varlen(package: str):
        kernel = importlib.import_module(package).flash_attn_varlen_func

        def attend(q, k, v):
            L = q.shape[2]
            starts = torch.tensor([0, L], dtype=torch.int32, device=q.device)
            return _flash_varlen_attention(q, k, v, starts, L, None, kernel, softcap=50.0 if capped else None)
        return attend

    found = [(name, package) for name, package in (("flash-attn 2", "flash_attn"), ("flash-attn 3", "flash_attn_interface"))
             if device.type == "cuda" and importlib.util.find_spec(package) is not None]
    if capped:
        return [("longfit capped block kernel", lambda q, k, v: blockwise_attention(q, k, v, None, None, None, 50.0, None))] + [
            (f"{name} softcap", varlen(package)) for name, package in found if name == "flash-attn 2"]
    kernels = [("longfit causal_attention (SDPA's choice)", lambda q, k, v: causal_attention(q, k, v, None))]
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def forced(backend):
            def attend(q, k, v):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
            return attend

        kernels += [(f"SDPA {label} (forced)", forced(backend)) for label, backend in (
            ("FlashAttention-2", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION),
            ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION))]
        kernels += [(f"{name} varlen", varlen(package)) for name, package in found]
    return kernels


def measure(args: argparse.Namespace) -> dict:
    import torch

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for capped, length in ((False, args.length), (True, args.capped_length)):
        generator = torch.Generator(device=device).manual_seed(0)

        def tensor(heads: int) -> torch.Tensor:
            return torch.randn(1, heads, length, args.head_dim, generator=generator, device=device, dtype=dtype)

        q, k, v = tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads)
        dout = tensor(args.heads)
        flops = attention_flops(length, args.heads, args.head_dim)
        for name, attend in _candidates(device, capped):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def run():
                out = attend(*leaves)
                torch.autograd.grad(out, leaves, dout)

            try:
                seconds = _timed(run, args.repeats, device)
            except (RuntimeError, ValueError, TypeError) as e:  # a backend that refuses the shape or the machine
                rows.append(dict(kernel=name, length=length, capped=capped, error=str(e).splitlines()[0][:200]))
                continue
            rows.append(dict(kernel=name, length=length, capped=capped, seconds=seconds, tflops=flops / seconds / 1e12))
            print(f"{name} L={length}: {seconds * 1e3:.1f} ms, {flops / seconds / 1e12:.3g} TFLOP/s", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(device=name, torch=torch.__version__, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                dtype=str(dtype).removeprefix("torch."), repeats=args.repeats, rows=rows,
                command=" ".join(["python -m longfit.bench.gpu_attention", *sys.argv[1:]]))


def markdown(report: dict) -> str:
    lines = [f"# Attention kernels: {report['device']}", "",
             f"Command: `{report['command']}`. torch {report['torch']}; {report['heads']} query heads, "
             f"{report['kv_heads']} key/value heads of {report['head_dim']}, {report['dtype']}; forward and backward of "
             f"one causal row, median of {report['repeats']} after a warm-up call.", "",
             "| kernel | L | softcap | ms | TFLOP/s |", "| --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        timing = [f"{r['seconds'] * 1e3:.1f}", f"{r['tflops']:.3g}"] if "seconds" in r else [f"failed: {r['error']}", ""]
        lines.append("| " + " | ".join([r["kernel"], str(r["length"]), "50" if r["capped"] else "none", *timing]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--length", type=int, default=131072, help="tokens of the row (uncapped kernels)")
    parser.add_argument("--capped-length", type=int, default=16384, help="tokens of the row for the softcapped kernels")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True, help="directory for attention_<device>.md and .json")
    args = parser.parse_args(argv)
    report = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"attention_{args.device}.json").write_text(json.dumps(report, indent=1))
    (out / f"attention_{args.device}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
