"""`longfit bench checkpoint-dtype`: what storing the offloaded layer inputs in bf16 or fp8 does to training.

`memory.checkpoint_dtype` compresses the checkpointed layer inputs while they wait in host memory or on
disk (longfit.memory.offload). The forward pass runs on the exact inputs, so the loss of a step is
unchanged; backward recomputes each layer from the decoded input, so the gradients are those of a
slightly perturbed layer input, and the parameters, and with them the later losses, drift from the
exact run. This benchmark measures both, in one process, on the same weights (seed) and the same
batches (the configured data, by default the built-in synthetic task):
- step 1: the relative L2 error of the whole gradient (every trainable parameter, concatenated)
  against the exact run, and the largest relative error of one parameter's gradient;
- the loss at every step of `--steps` optimizer steps, and its largest absolute difference from the
  exact run.
Every run offloads the layer inputs of all checkpointed layers (memory.offload_activations=true), so
the only difference between the runs is the stored dtype. On CPU in fp32, "bf16" rounds the fp32
inputs to bf16: what it does on one GPU, whose residual stream is fp32 under autocast (under FSDP2's
bf16 mixed precision the inputs are bf16 already and bf16 changes nothing).
"""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path

from longfit.config import ConfigError

DTYPES = ("none", "bf16", "fp8")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "checkpoint-dtype", help="gradient error and loss drift of memory.checkpoint_dtype=bf16|fp8 against exact",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", default="llama-60m", help="preset or local model directory")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (a visible drift needs a real step)")
    parser.add_argument("--dtypes", default="bf16,fp8", help="stored dtypes compared with the exact run")
    parser.add_argument("--output", help="also write the markdown report to this file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every run, e.g. --set data.path=corpus.jsonl")
    parser.set_defaults(run=run)


def _train(args: argparse.Namespace, checkpoint_dtype: str | None) -> tuple[list[float], dict]:
    """Losses of every step and the step-1 gradients of one run on CPU."""
    import torch

    from longfit.config import load_config
    from longfit.data.packing import build_dataloader
    from longfit.memory.apply import apply_memory_techniques, release_offload_stores
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.memory.optim import build_optimizer
    from longfit.models.loading import load_model, load_tokenizer

    overrides = [f"model={args.model}", f"seq_len={args.seq_len}", "train.dtype=fp32", f"train.lr={args.lr}",
                 "memory.activation_checkpointing=true", "memory.offload_activations=true", *args.overrides]
    if checkpoint_dtype is not None:
        overrides.append(f"memory.checkpoint_dtype={checkpoint_dtype}")
    cfg = load_config(None, overrides)
    torch.manual_seed(cfg.train.seed)
    model = load_model(cfg.model, torch.float32, "cpu", seed=cfg.train.seed)
    model.train()
    applied = apply_memory_techniques(model, cfg, "cpu")
    loss_module = CausalLMLoss.from_config(model, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                kind=cfg.memory.optimizer)
    loader = build_dataloader(cfg, load_tokenizer(cfg.model))
    losses, first_grads = [], {}
    for step in range(args.steps):
        batch = next(loader)
        loss = batch_loss_sum(loss_module, batch) / batch.num_label_tokens
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    release_offload_stores(model)  # the next run in this process builds a store of its own
    assert applied.offloader.stats.offloaded_tensors > 0, "run() checks that the layer inputs are offloaded"
    return losses, first_grads


def gradient_errors(grads: dict, exact: dict) -> tuple[float, float]:
    """(relative L2 error of all gradients together, largest relative L2 error of one parameter's gradient)."""
    import torch

    diff = math.sqrt(sum(float((grads[n] - g).double().square().sum()) for n, g in exact.items()))
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in exact.values()))
    worst = max(float((grads[n] - g).double().norm() / g.double().norm().clamp_min(torch.finfo(torch.float64).tiny))
                for n, g in exact.items())
    return diff / norm, worst


def measure(args: argparse.Namespace) -> list[tuple[str, list[float], float, float]]:
    """(stored dtype, losses of every step, step-1 gradient error all / worst parameter) per run, exact first."""
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES[1:] for d in dtypes):
        raise ConfigError(f"--dtypes {args.dtypes!r}: choose from bf16,fp8")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: must be >= 1")
    from longfit.memory.checkpointing import ActivationOffloader
    from longfit.models.loading import resolve_model_config

    input_bytes = args.seq_len * resolve_model_config(args.model).get_text_config().hidden_size * 4
    threshold = ActivationOffloader().min_offload_bytes
    if input_bytes < threshold:
        raise ConfigError(
            f"--seq-len {args.seq_len}: a layer input of {args.model} is {input_bytes} bytes, below the offloader's "
            f"{threshold}-byte threshold, so nothing would be stored compressed; use a longer --seq-len"
        )
    exact_losses, exact_grads = _train(args, None)
    rows = [("none (exact)", exact_losses, 0.0, 0.0)]
    for dtype in dtypes:
        losses, grads = _train(args, dtype)
        rows.append((dtype, losses, *gradient_errors(grads, exact_grads)))
    return rows


def run(args: argparse.Namespace) -> int:
    report = _markdown(measure(args), args)
    print(report)
    if args.output:
        Path(args.output).write_text(report + "\n")
    return 0


def _markdown(rows: list, args: argparse.Namespace) -> str:
    exact = rows[0][1]
    marks = sorted({1, min(5, args.steps), min(10, args.steps), args.steps})
    command = shlex.join(["longfit", *args.argv])
    lines = [
        f"`{command}`: {args.model}, seq_len {args.seq_len}, {args.steps} AdamW steps at lr {args.lr}, fp32 on CPU, "
        "every checkpointed layer input offloaded.",
        "",
        "| stored as | step-1 gradient error (all / worst parameter) | "
        + " | ".join(f"loss at step {s}" for s in marks)
        + " | max abs loss difference from exact |",
        "| --- | --- | " + " | ".join("---" for _ in marks) + " | --- |",
    ]
    for name, losses, total, worst in rows:
        drift = max(abs(a - b) for a, b in zip(losses, exact))
        lines.append(
            f"| {name} | {total:.2e} / {worst:.2e} | " + " | ".join(f"{losses[s - 1]:.6f}" for s in marks)
            + f" | {drift:.2e} |"
        )
    return "\n".join(lines)
