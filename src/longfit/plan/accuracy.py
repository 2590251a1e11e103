"""Analytic vs traced peak on every preset at three lengths: the table in benchmarks/results/plan_accuracy.md.

    python -m longfit.plan.accuracy > benchmarks/results/plan_accuracy.md

Each case is a realistic configuration for the model's size (defaults otherwise: activation
checkpointing, chunked loss, tiled MLP and offload as `auto` decides on a GPU): small models on one or
two GPUs, 7B+ models sharded over 8 GPUs, the longest length with ring or Ulysses context parallelism,
then tensor parallelism alone and with CP or LoRA.
tests/test_plan_accuracy.py asserts every case within TOLERANCE (the small presets by default, all
with -m slow).
"""

from __future__ import annotations

import platform
import sys

TOLERANCE = 0.05
SMALL_PRESETS = ("llama-tiny", "llama-60m", "gemma-3-tiny")

# (preset, GPUs, overrides)
CASES: list[tuple[str, int, tuple[str, ...]]] = [
    ("llama-tiny", 1, ("seq_len=2048",)),
    ("llama-tiny", 1, ("seq_len=8192", "lora.enabled=true")),
    ("llama-tiny", 2, ("seq_len=32768", "parallel.cp=2")),
    ("llama-60m", 1, ("seq_len=4096", "memory.chunked_loss=false")),
    ("llama-60m", 1, ("seq_len=16384",)),
    ("llama-60m", 4, ("seq_len=65536", "parallel.cp=4", "parallel.cp_method=ulysses")),
    ("llama-3.2-1b", 1, ("seq_len=8192", "memory.activation_checkpointing=false")),
    ("llama-3.2-1b", 2, ("seq_len=32768",)),
    ("llama-3.2-1b", 4, ("seq_len=131072", "parallel.cp=4")),
    ("llama-3.1-8b", 1, ("seq_len=16384", "lora.enabled=true")),
    ("llama-3.1-8b", 8, ("seq_len=32768",)),
    ("llama-3.1-8b", 8, ("seq_len=131072", "parallel.cp=8")),
    ("qwen2.5-7b", 1, ("seq_len=8192", "lora.enabled=true", "memory.tiled_mlp=false")),
    ("qwen2.5-7b", 8, ("seq_len=32768", "lora.enabled=true")),
    ("qwen2.5-7b", 8, ("seq_len=131072", "parallel.cp=4")),
    ("mistral-7b", 8, ("seq_len=16384", "memory.offload_activations=false")),
    ("mistral-7b", 8, ("seq_len=65536", "parallel.cp=2")),
    ("mistral-7b", 8, ("seq_len=131072", "parallel.cp=8", "parallel.cp_method=ulysses")),
    ("gemma-3-tiny", 1, ("seq_len=4096",)),
    ("gemma-3-tiny", 1, ("seq_len=16384", "lora.enabled=true")),
    ("gemma-3-tiny", 2, ("seq_len=32768", "parallel.cp=2")),
    ("gemma-3-4b", 1, ("seq_len=16384", "lora.enabled=true")),
    ("gemma-3-4b", 4, ("seq_len=65536", "parallel.cp=4", "parallel.cp_method=ulysses")),
    ("gemma-3-4b", 8, ("seq_len=131072", "parallel.cp=8")),
    ("gemma-3-12b", 1, ("seq_len=8192", "lora.enabled=true")),
    ("gemma-3-12b", 8, ("seq_len=32768",)),
    ("gemma-3-12b", 8, ("seq_len=131072", "parallel.cp=8")),
    ("gemma-3-27b", 8, ("seq_len=16384", "lora.enabled=true")),
    ("gemma-3-27b", 8, ("seq_len=65536", "parallel.cp=4")),
    ("gemma-3-27b", 8, ("seq_len=131072", "parallel.cp=8", "parallel.cp_method=ulysses")),
    ("yi-34b", 8, ("seq_len=16384", "lora.enabled=true")),
    ("yi-34b", 8, ("seq_len=65536", "parallel.cp=4")),
    ("yi-34b", 8, ("seq_len=131072", "parallel.cp=8")),
    # tensor parallelism (parallel.tp), alone and with CP, LoRA, replicated key/value heads (llama-tiny's 2 at tp=4)
    ("llama-tiny", 4, ("seq_len=8192", "parallel.tp=2", "lora.enabled=true")),
    ("llama-tiny", 4, ("seq_len=32768", "parallel.tp=4")),
    ("llama-60m", 2, ("seq_len=4096", "parallel.tp=2", "memory.chunked_loss=false")),
    ("llama-60m", 4, ("seq_len=16384", "parallel.tp=2", "parallel.cp=2", "parallel.cp_method=ulysses")),
    ("llama-3.1-8b", 8, ("seq_len=131072", "parallel.tp=4", "parallel.cp=2")),
    ("qwen2.5-7b", 8, ("seq_len=32768", "parallel.tp=4", "lora.enabled=true")),
    ("mistral-7b", 8, ("seq_len=16384", "parallel.tp=8", "memory.offload_activations=false")),
    ("yi-34b", 8, ("seq_len=65536", "parallel.tp=8")),
]


def compare(preset: str, gpus: int, overrides: tuple[str, ...]) -> dict:
    """Analytic and traced peak (live tensor bytes per GPU) of one case."""
    from longfit.config import load_config
    from longfit.plan.analytic import plan_config
    from longfit.plan.trace import trace_step

    cfg = load_config(None, [f"model={preset}", *overrides])
    analytic = plan_config(cfg, gpus)
    traced = trace_step(cfg, gpus)
    return {
        "analytic": analytic.tensor_bytes,
        "traced": traced.peak_bytes,
        "error": analytic.tensor_bytes / traced.peak_bytes - 1,
        "analytic_event": analytic.peak_event,
        "traced_phase": traced.peak_phase,
        "seconds": traced.seconds,
        "host_analytic": analytic.host_bytes,
        "host_traced": traced.host_peak_bytes,
    }


def main() -> None:
    import torch
    import transformers

    GiB = 1 << 30
    print("# longfit plan: analytic vs traced peak memory per GPU\n")
    print(
        "Reproduce: `python -m longfit.plan.accuracy > benchmarks/results/plan_accuracy.md` "
        f"(torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()} CPU, no GPU).\n"
    )
    print(
        "Both columns are the peak of live tensor bytes on one GPU (`torch.cuda.max_memory_allocated`, without "
        "the planner's reserve for the CUDA context, NCCL and allocator slack). *Traced* runs one training step of "
        "longfit's code path (load_model, peft, CausalLMLoss, parallelize: TP + CP + memory techniques + FSDP2, the "
        "optimizer) on fake tensors with torch's fake process group of that many ranks; *analytic* is the instant "
        "formula. Defaults apply unless listed (checkpointing, chunked loss, tiled MLP from 8K and activation "
        "offload from 32K tokens, as `auto` decides on a GPU).\n"
    )
    print(
        "| model | GPUs | overrides | analytic GiB | traced GiB | error | analytic peak at | host GiB (analytic / traced) | trace s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for preset, gpus, overrides in CASES:
        row = compare(preset, gpus, overrides)
        worst = max(worst, abs(row["error"]))
        print(
            f"| {preset} | {gpus} | {' '.join(overrides)} | {row['analytic'] / GiB:.2f} | {row['traced'] / GiB:.2f} | "
            f"{row['error']:+.1%} | {row['analytic_event']} | {row['host_analytic'] / GiB:.2f} / {row['host_traced'] / GiB:.2f} | "
            f"{row['seconds']:.0f} |",
            flush=True,
        )
    print(f"\nLargest error: {worst:.1%} (tolerance {TOLERANCE:.0%}, asserted by tests/test_plan_accuracy.py).")
    print(
        "\nGPU comparison (analytic or traced vs `torch.cuda.max_memory_allocated` of a real step): not measured; "
        "no GPU was available to this work.",
        file=sys.stdout,
    )


if __name__ == "__main__":
    main()
