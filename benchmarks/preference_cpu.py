"""A preference pair's training step with its prompt computed once against the two separate sequences (#56), on CPU.

    PYTHONPATH=src python benchmarks/preference_cpu.py OUT_DIR [--prompt 16384] [--answer 1024] [--model llama-tiny]

One pair: a prompt of --prompt tokens, a chosen and a rejected answer of --answer tokens each, random ids. Two layouts of
the same pair, each one dpo step (LoRA, the reference the adapter off, no activation checkpointing) in a process of its
own, side by side in this run:
- shared: one row prompt + chosen + rejected, the rejected answer seeing the prompt as its prefix (longfit.data
  .preferences, models/blockwise.py);
- separate: one row of the two sequences prompt + chosen and prompt + rejected as two documents, as TRL and the other
  tools run them (the prompt twice).
FLOPs are counted by torch's FlopCounterMode over the real step (longfit.bench.keep_attention's CPU attention
formula); the peak is the step's resident-set high-water mark above the baseline after the model is built (longfit
.bench.meter, glibc's mmap threshold pinned so freed tensors leave the RSS); the losses must agree (the layouts compute
the same thing). Writes OUT_DIR/preference_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def pair_batches(prompt: int, answer: int, vocab: int):
    """(shared, separate) PairBatch of one pair of random ids: the same answers' targets in both layouts."""
    import numpy as np
    import torch

    from longfit.data.packing import DocumentLayout
    from longfit.data.preferences import Pair, PairLoader

    generator = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(1, vocab, (n,), generator=generator).numpy().astype(np.int64)  # noqa: E731
    pair = Pair(draw(prompt), draw(answer), draw(answer))
    shared = next(PairLoader([pair], "bench", len(pair), 1, pad_id=0, epochs=1))
    # The separate layout: prompt + chosen as the shared row's first document, then prompt + rejected.
    P, C, R = len(pair.prompt), len(pair.chosen), len(pair.rejected)
    length = 2 * P + C + R

    def row(values, fill):
        out = torch.full((1, length), fill, dtype=torch.int64)
        out[0, : len(values)] = torch.as_tensor(values)
        return out

    first = P + C
    ids = row(np.concatenate([pair.prompt, pair.chosen, pair.prompt, pair.rejected]), 0)
    positions = row(np.concatenate([np.arange(first), np.arange(P + R)]), 0)
    labels, sequences = row([], -100), row([], -1)
    labels[0, P - 1 : first - 1], sequences[0, P - 1 : first - 1] = torch.as_tensor(pair.chosen), 0
    labels[0, first + P - 1 : length - 1], sequences[0, first + P - 1 : length - 1] = torch.as_tensor(pair.rejected), 1
    layout = DocumentLayout((((0, first), (first, length)),), length)
    separate = type(shared)(
        input_ids=ids, labels=labels, position_ids=positions,
        cu_seqlens=torch.tensor(layout.cu_seqlens(), dtype=torch.int32), num_label_tokens=C + R, documents=layout,
        branch_labels=row([], -100), sequences=sequences, branch_sequences=row([], -1),
        answer_lengths=torch.tensor([C, R]), pairs=1,
    )
    return shared, separate


def worker(layout: str, prompt: int, answer: int, model: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from longfit.bench.keep_attention import flop_counter
    from longfit.bench.meter import MemoryMeter, return_freed_memory_to_os
    from longfit.memory.preference import PreferenceLoss, PreferenceObjective, StepPairs, pair_loss_sum
    from longfit.models.attention import register_attention
    from longfit.models.presets import preset_config

    return_freed_memory_to_os()
    torch.manual_seed(0)
    config = preset_config(model)
    net = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
    # Random adapters (peft's zero B would make the policy its reference and the loss log 2 in any layout).
    net = get_peft_model(net, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                         init_lora_weights=False))
    loss_module = PreferenceLoss(net, PreferenceObjective("dpo"))
    batch = dict(zip(("shared", "separate"), pair_batches(prompt, answer, config.vocab_size)))[layout]
    step = StepPairs(1, answer)
    meter = MemoryMeter(torch.device("cpu"))
    meter.start()
    started = time.perf_counter()
    with flop_counter() as counter:
        value, _ = pair_loss_sum(loss_module, batch, step)
        value.backward()
    return {"layout": layout, "tokens": batch.input_ids.shape[1], "flops": counter.get_total_flops(),
            "peak": meter.peak(), "loss": value.item(), "seconds": time.perf_counter() - started}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("out", type=Path)
    cli.add_argument("--prompt", type=int, default=16384)
    cli.add_argument("--answer", type=int, default=1024)
    cli.add_argument("--model", default="llama-tiny")
    cli.add_argument("--worker", help=argparse.SUPPRESS)
    args = cli.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.prompt, args.answer, args.model)))
        return
    results = []
    for layout in ("shared", "separate"):
        done = subprocess.run([sys.executable, __file__, str(args.out), "--prompt", str(args.prompt), "--answer",
                               str(args.answer), "--model", args.model, "--worker", layout],
                              capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.splitlines()[-1]))
    shared, separate = results
    lines = [
        f"# One dpo step: prompt {args.prompt:,} + two answers of {args.answer:,} tokens ({args.model}, LoRA, CPU)",
        "",
        f"`PYTHONPATH=src python benchmarks/preference_cpu.py {args.out} --prompt {args.prompt} --answer {args.answer} "
        f"--model {args.model}`: each layout one step in a process of its own (the module docstring says how).",
        "",
        "| layout | row tokens | FLOPs | vs separate | peak above the model (MiB) | vs separate | loss | step s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in results:
        lines.append(
            f"| {run['layout']} | {run['tokens']:,} | {run['flops']:.3e} | {run['flops'] / separate['flops']:.3f} | "
            f"{run['peak'] / 2**20:,.0f} | {run['peak'] / separate['peak']:.3f} | {run['loss']:.6f} | "
            f"{run['seconds']:.1f} |")
    lines += ["", f"The losses differ by {abs(shared['loss'] - separate['loss']):.1e} (the same step, two layouts)."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "preference_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
