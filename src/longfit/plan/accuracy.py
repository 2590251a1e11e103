"""Analytic vs traced peak on every preset at three lengths, and on the new families' published configs: the table in
benchmarks/results/plan_accuracy.md.

    python -m longfit.plan.accuracy > benchmarks/results/plan_accuracy.md
    python -m longfit.plan.accuracy families > benchmarks/results/plan_accuracy_families.md   (FAMILY_CASES only)
    python -m longfit.plan.accuracy families gemma-4-e2b   (the rows of the models named, to re-run a family's rows)

Each case is a realistic configuration for the model's size (defaults otherwise: activation
checkpointing, chunked loss, tiled MLP and offload as `auto` decides on a GPU): small models on one or
two GPUs, 7B+ models sharded over 8 GPUs, the longest length with ring or Ulysses context parallelism,
then tensor parallelism alone and with CP or LoRA. FAMILY_CASES plan architectures outside the preset families
(mixture of experts, attention sinks, linear attention, per-layer inputs and shared keys, latent attention) from
their config.json alone (benchmarks/configs/<name>/config.json, no weights), whose layers the planner traces
(plan/layer_trace.py).
tests/test_plan_accuracy.py asserts every case within SAFE_BAND (the small presets by default, all
with -m slow).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from longfit.plan.band import SAFE_BAND, TOLERANCE  # noqa: F401 -- the band every case is held to, and its tests'

SMALL_PRESETS = ("llama-tiny", "llama-60m", "gemma-3-tiny")

GiB = 1 << 30
H100_HOST = (81559 << 20, 128 * GiB)  # an 80 GB H100 in a machine with 128 GiB of RAM
A40_SMALL_HOST = (46068 << 20, 16 * GiB)  # a 48 GB A40 with 16 GiB of RAM: inputs on the GPU, on host and on disk

# (preset, GPUs, overrides, (GPU memory, machine host memory) or None). With a machine, the plan places the
# checkpointed inputs GPU first, then host, then disk, and the trace follows that placement.
CASES: list[tuple[str, int, tuple[str, ...], tuple[int, int] | None]] = [
    ("llama-tiny", 1, ("seq_len=2048",), None),
    ("llama-tiny", 1, ("seq_len=8192", "lora.enabled=true"), None),
    ("llama-tiny", 2, ("seq_len=32768", "parallel.cp=2"), None),
    ("llama-60m", 1, ("seq_len=4096", "memory.chunked_loss=false"), None),
    ("llama-60m", 1, ("seq_len=16384",), None),
    ("llama-60m", 4, ("seq_len=65536", "parallel.cp=4", "parallel.cp_method=ulysses"), None),
    ("llama-3.2-1b", 1, ("seq_len=8192", "memory.activation_checkpointing=false"), None),
    ("llama-3.2-1b", 2, ("seq_len=32768",), None),
    ("llama-3.2-1b", 4, ("seq_len=131072", "parallel.cp=4"), None),
    ("llama-3.1-8b", 1, ("seq_len=16384", "lora.enabled=true"), None),
    ("llama-3.1-8b", 8, ("seq_len=32768",), None),
    ("llama-3.1-8b", 8, ("seq_len=131072", "parallel.cp=8"), None),
    ("qwen2.5-7b", 1, ("seq_len=8192", "lora.enabled=true", "memory.tiled_mlp=false"), None),
    ("qwen2.5-7b", 8, ("seq_len=32768", "lora.enabled=true"), None),
    ("qwen2.5-7b", 8, ("seq_len=131072", "parallel.cp=4"), None),
    ("mistral-7b", 8, ("seq_len=16384", "memory.offload_activations=false"), None),
    ("mistral-7b", 8, ("seq_len=65536", "parallel.cp=2"), None),
    ("mistral-7b", 8, ("seq_len=131072", "parallel.cp=8", "parallel.cp_method=ulysses"), None),
    ("gemma-3-tiny", 1, ("seq_len=4096",), None),
    ("gemma-3-tiny", 1, ("seq_len=16384", "lora.enabled=true"), None),
    ("gemma-3-tiny", 2, ("seq_len=32768", "parallel.cp=2"), None),
    ("gemma-3-4b", 1, ("seq_len=16384", "lora.enabled=true"), None),
    ("gemma-3-4b", 4, ("seq_len=65536", "parallel.cp=4", "parallel.cp_method=ulysses"), None),
    ("gemma-3-4b", 8, ("seq_len=131072", "parallel.cp=8"), None),
    ("gemma-3-12b", 1, ("seq_len=8192", "lora.enabled=true"), None),
    ("gemma-3-12b", 8, ("seq_len=32768",), None),
    ("gemma-3-12b", 8, ("seq_len=131072", "parallel.cp=8"), None),
    ("gemma-3-27b", 8, ("seq_len=16384", "lora.enabled=true"), None),
    ("gemma-3-27b", 8, ("seq_len=65536", "parallel.cp=4"), None),
    ("gemma-3-27b", 8, ("seq_len=131072", "parallel.cp=8", "parallel.cp_method=ulysses"), None),
    ("yi-34b", 8, ("seq_len=16384", "lora.enabled=true"), None),
    ("yi-34b", 8, ("seq_len=65536", "parallel.cp=4"), None),
    ("yi-34b", 8, ("seq_len=131072", "parallel.cp=8"), None),
    # tensor parallelism (parallel.tp), alone and with CP, LoRA, replicated key/value heads (llama-tiny's 2 at tp=4)
    ("llama-tiny", 4, ("seq_len=8192", "parallel.tp=2", "lora.enabled=true"), None),
    ("llama-tiny", 4, ("seq_len=32768", "parallel.tp=4"), None),
    ("llama-60m", 2, ("seq_len=4096", "parallel.tp=2", "memory.chunked_loss=false"), None),
    ("llama-60m", 4, ("seq_len=16384", "parallel.tp=2", "parallel.cp=2", "parallel.cp_method=ulysses"), None),
    ("llama-3.1-8b", 8, ("seq_len=131072", "parallel.tp=4", "parallel.cp=2"), None),
    ("qwen2.5-7b", 8, ("seq_len=32768", "parallel.tp=4", "lora.enabled=true"), None),
    ("mistral-7b", 8, ("seq_len=16384", "parallel.tp=8", "memory.offload_activations=false"), None),
    ("yi-34b", 8, ("seq_len=65536", "parallel.tp=8"), None),
    # tiled decoder layers (memory.tiled_layers), their inputs placed GPU first, on host and on disk
    ("llama-tiny", 1, ("seq_len=16384", "memory.tiled_layers=true", "memory.offload_activations=true"), None),
    ("llama-60m", 1, ("seq_len=16384", "memory.tiled_layers=true"), None),
    ("llama-3.2-1b", 1, ("seq_len=262144", "lora.enabled=true"), H100_HOST),
    ("llama-3.1-8b", 1, ("seq_len=1048576", "lora.enabled=true", "memory.checkpoint_dtype=fp8"), H100_HOST),
    ("llama-3.1-8b", 8, ("seq_len=1048576", "parallel.cp=8", "lora.enabled=true"), H100_HOST),
    ("mistral-7b", 8, ("seq_len=1048576", "parallel.cp=8", "parallel.cp_method=ulysses"), H100_HOST),
    ("qwen2.5-7b", 1, ("seq_len=262144", "lora.enabled=true", "memory.offload_dir=offload"), A40_SMALL_HOST),
]

# Published architectures outside the preset families, by their directory under benchmarks/configs (config.json only).
CONFIGS = Path(__file__).resolve().parents[3] / "benchmarks" / "configs"
FAMILY_CASES: list[tuple[str, int, tuple[str, ...], tuple[int, int] | None]] = [
    ("qwen3-30b-a3b", 8, ("seq_len=32768",), None),
    ("qwen3-30b-a3b", 8, ("seq_len=131072", "parallel.cp=8"), None),
    ("qwen3-30b-a3b", 1, ("seq_len=16384", "lora.enabled=true"), None),
    ("gpt-oss-20b", 8, ("seq_len=32768",), None),
    ("gpt-oss-20b", 8, ("seq_len=131072", "parallel.cp=8", "parallel.cp_method=ulysses"), None),
    ("gpt-oss-20b", 1, ("seq_len=16384", "lora.enabled=true"), None),
    ("deepseek-v2-lite", 8, ("seq_len=32768",), None),
    ("deepseek-v2-lite", 8, ("seq_len=131072", "parallel.cp=8"), None),
    ("deepseek-v2-lite", 1, ("seq_len=16384", "lora.enabled=true"), None),
    # Gemma 4 E2B: its layers' per-layer-input gate beside the MLP is not tiled (memory.tiled_mlp refuses it)
    ("gemma-4-e2b", 1, ("seq_len=16384", "lora.enabled=true", "memory.tiled_mlp=false"), None),
    ("gemma-4-e2b", 2, ("seq_len=32768", "memory.tiled_mlp=false"), None),
    ("gemma-4-e2b", 8, ("seq_len=131072", "parallel.cp=8", "memory.tiled_mlp=false"), None),
    # Qwen3.5: the Gated DeltaNet layers' chunked scan runs chunk by chunk on fake tensors too, over the whole sequence
    # under cp (a rank scans its heads' share of every token): 4 min at 8K, 8 min at 16K on 2 CPU cores
    ("qwen3.5-27b", 8, ("seq_len=8192",), None),
    ("qwen3.5-27b", 8, ("seq_len=16384", "parallel.cp=8"), None),
]


def model_path(model: str) -> str:
    """`model=` of a case: a preset's name, or the directory of a config under benchmarks/configs."""
    return str(CONFIGS / model) if (CONFIGS / model / "config.json").is_file() else model


def compare(preset: str, gpus: int, overrides: tuple[str, ...], machine: tuple[int, int] | None = None,
            replicated: bool = False) -> dict:
    """Analytic and traced peak (live tensor bytes per GPU) of one case; `preset` may name a config of FAMILY_CASES.
    `replicated`: the model whole on every rank, as a Trainer under DDP holds it (`Setup.replicated`)."""
    from longfit.config import load_config
    from longfit.plan.analytic import free_at_start, plan_config
    from longfit.plan.trace import trace_step

    cfg = load_config(None, [f"model={model_path(preset)}", *overrides])
    capacity, host = machine or (None, None)
    analytic = plan_config(cfg, gpus, capacity, host_memory_bytes=host, replicated=replicated)
    traced = trace_step(cfg, gpus, free_bytes=free_at_start(capacity), placement=analytic.placement,
                        replicated=replicated)
    return {
        "analytic": analytic.tensor_bytes,
        "traced": traced.peak_bytes,
        "error": analytic.tensor_bytes / traced.peak_bytes - 1,
        "analytic_event": analytic.peak_event,
        "traced_phase": traced.peak_phase,
        "seconds": traced.seconds,
        "host_analytic": analytic.host_bytes,
        "host_traced": traced.host_peak_bytes,
        "disk_analytic": analytic.disk_bytes,
        "disk_traced": traced.disk_bytes,
        "placement": analytic.placement,
        "keep_attention": analytic.setup.keep_attention,
    }


def _machine(machine: tuple[int, int] | None) -> str:
    return f"{machine[0] / GiB:.1f} GiB, {machine[1] / GiB:.0f} GiB" if machine else "-"


def main(argv: list[str] | None = None) -> None:
    """The table of CASES and FAMILY_CASES; of FAMILY_CASES alone with the first argument `families`; of the cases of
    the models named after it alone, where any are."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m longfit.plan.accuracy", description=main.__doc__)
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="`families` first for FAMILY_CASES alone; then the models whose rows to run (all if none)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv).models
    families = args[:1] == ["families"]
    cases = FAMILY_CASES if families else CASES + FAMILY_CASES
    named = set(args[1:] if families else args)
    unknown = sorted(named - {case[0] for case in cases})
    if unknown:
        parser.error(f"no case of {', '.join(unknown)}; name one of {', '.join(dict.fromkeys(c[0] for c in cases))}")
    cases = [case for case in cases if case[0] in named] if named else cases

    import torch
    import transformers

    print("# longfit plan: analytic vs traced peak memory per GPU\n")
    print(
        f"Reproduce: `python -m longfit.plan.accuracy{' families' if families else ''} > "
        f"benchmarks/results/plan_accuracy{'_families' if families else ''}.md` "
        f"(torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()} CPU, no GPU).\n"
    )
    print(
        "Both columns are the peak of live tensor bytes on one GPU (`torch.cuda.max_memory_allocated`, without "
        "the planner's reserve for the CUDA context, NCCL and allocator slack). *Traced* runs one training step of "
        "longfit's code path (load_model, peft, CausalLMLoss, parallelize: TP + CP + memory techniques + FSDP2, the "
        "optimizer) on fake tensors with torch's fake process group of that many ranks; *analytic* is the instant "
        "formula. Defaults apply unless listed (checkpointing, chunked loss, tiled MLP from 8K and activation "
        "offload from 32K tokens, tiled decoder layers from 64K tokens per GPU, as `auto` decides on a GPU). "
        "Rows with a machine (a GPU of that memory and that much host RAM) place the checkpointed layer inputs GPU first, "
        "then in host memory, then on disk (`inputs GPU/host/disk`, layers), and the trace follows that placement; "
        "host and disk columns are per rank. Models named in lower case with their size (qwen3-30b-a3b, gpt-oss-20b, "
        "qwen3.5-27b, gemma-4-e2b, deepseek-v2-lite) are published architectures outside the preset families, planned "
        "from their config.json alone (benchmarks/configs), their decoder layers traced one of each kind "
        "(plan/layer_trace.py).\n"
    )
    print(
        "| model | GPUs | overrides | machine (GPU, host) | analytic GiB | traced GiB | error | analytic peak at | "
        "inputs GPU/host/disk | host GiB (analytic / traced) | disk GiB (analytic / traced) | trace s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for preset, gpus, overrides, machine in cases:
        row = compare(preset, gpus, overrides, machine)
        worst = max(worst, abs(row["error"]))
        placement = row["placement"]
        where = f"{placement.device}/{placement.host}/{placement.disk}" if placement else "-"
        print(
            f"| {preset} | {gpus} | {' '.join(overrides)} | {_machine(machine)} | "
            f"{row['analytic'] / GiB:.2f} | {row['traced'] / GiB:.2f} | {row['error']:+.1%} | {row['analytic_event']} | "
            f"{where} | {row['host_analytic'] / GiB:.2f} / {row['host_traced'] / GiB:.2f} | "
            f"{row['disk_analytic'] / GiB:.2f} / {row['disk_traced'] / GiB:.2f} | {row['seconds']:.0f} |",
            flush=True,
        )
    under, over = SAFE_BAND
    print(f"\nLargest error: {worst:.1%} (band {under:+.0%}..{over:+.0%}, asserted by tests/test_plan_accuracy.py).")
    print(
        "\nGPU comparison (analytic or traced vs `torch.cuda.max_memory_allocated` of a real step): the peak / plan "
        "columns of `longfit bench gpu` and tests/test_gpu_plan.py (`-m gpu`), measured on an H200 in "
        "benchmarks/results/gpu_check_h200.md."
    )


if __name__ == "__main__":
    main()
