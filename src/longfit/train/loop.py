"""The training loop: one loop for full fine-tuning and LoRA, for one process or many (torchrun).

Per optimizer step every rank reads `grad_accum` micro-batches, shards them along the sequence for
context parallelism, and backpropagates (sum of its token losses) / (valid label tokens over all
ranks and micro-batches), so the accumulated gradient is exactly that of the global mean loss.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from longfit.config import Config, ConfigError


@dataclass
class TrainSummary:
    output_dir: Path
    steps: int
    first_loss: float
    last_loss: float
    peak_mem_bytes: int
    export_dir: Path | None
    resumed_from: int
    is_main: bool


def lr_lambda(cfg: Config):
    """Linear warmup to train.lr, then cosine decay to train.min_lr_ratio * train.lr."""
    warmup, total, floor = cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def prepare_output_dir(output_dir: Path, resuming: bool) -> None:
    """Refuse to mix a fresh run into a directory that holds another run's results."""
    if resuming or not output_dir.exists():
        return
    leftovers = [p.name for p in output_dir.iterdir() if p.name in ("metrics.jsonl", "final")]
    if leftovers:
        raise ConfigError(
            f"output_dir={output_dir} already holds a finished run ({', '.join(leftovers)}) and no checkpoint "
            f"to resume from; choose a new output_dir or delete the old one"
        )


def train(cfg: Config, force: bool = False, stop_after_steps: int | None = None, log=print) -> TrainSummary:
    """Train per `cfg`, resuming from the newest checkpoint in `cfg.output_dir`.

    `stop_after_steps` ends this invocation early, with a checkpoint, after that many steps (for
    time-limited jobs); running again continues where it stopped.
    """
    from tqdm import tqdm

    from longfit.data.packing import build_dataloader
    from longfit.launch import init_distributed
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.memory.optim import build_optimizer, configure_cuda_allocator
    from longfit.models.build import build_model
    from longfit.models.loading import compute_dtype, load_tokenizer
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_max, all_reduce_sum
    from longfit.parallel.parallelize import autocast_dtype, parallelize
    from longfit.plan import preflight
    from longfit.train.checkpoint import (
        latest_checkpoint,
        load_checkpoint,
        rng_state,
        save_checkpoint,
        set_rng_state,
    )
    from longfit.train.export import export_model
    from longfit.train.metrics import peak_memory_bytes

    configure_cuda_allocator()
    rank, world, device = init_distributed()
    is_main = rank == 0
    if is_main:
        log(f"resolved config:\n{cfg.to_yaml()}")
    plan = preflight(cfg, world, device, check_fit=not force)
    dims = plan.setup.dims
    output_dir = Path(cfg.output_dir)
    resume_from = latest_checkpoint(output_dir)
    prepare_output_dir(output_dir, resume_from is not None)

    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.model)
    mesh = dims.build_mesh(device.type)
    loader = build_dataloader(cfg, tokenizer, dp_rank=mesh.dp_rank, dp_size=dims.dp_size)
    dtype = compute_dtype(cfg.train.dtype, device)
    model = build_model(cfg, dtype, device, dims.fsdp_enabled)
    loss_module = CausalLMLoss.from_config(model, cfg)
    loss_module = parallelize(loss_module, dims, cfg, mesh, param_dtype=dtype, checkpoint_placement=plan.placement)
    autocast = autocast_dtype(dims, dtype)
    trainable = [p for p in loss_module.parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, kind=cfg.memory.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    layout = cp_layout(cfg.parallel.cp_method)

    start_step = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, loss_module, optimizer, rank)
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        start_step = state["step"]
        log(f"resuming from {resume_from} (step {start_step})")
    end_step = cfg.train.steps if stop_after_steps is None else min(cfg.train.steps, start_step + stop_after_steps)

    def save(step: int) -> None:
        trainer_state = {"step": step, "scheduler": scheduler.state_dict(), "data": loader.state_dict(), "rng": rng_state()}
        save_checkpoint(output_dir, step, loss_module, optimizer, trainer_state, rank, cfg.train.keep_checkpoints)

    losses: list[float] = []
    metrics = None
    bar = tqdm(total=cfg.train.steps, initial=start_step, disable=not is_main, desc="train", dynamic_ncols=True)
    loss_module.train()
    for step in range(start_step, end_step):
        started = time.perf_counter()
        micro_batches = [
            shard_batch(next(loader), mesh.cp_rank, dims.cp, layout).to(device) for _ in range(cfg.train.grad_accum)
        ]
        if metrics is None:
            # Only now, with the model built and the first data read, does this run write into output_dir.
            metrics = start_run_files(cfg, output_dir, is_main, start_step)
        valid = global_valid_tokens([b.labels for b in micro_batches], mesh.world_group)
        loss_sum = torch.zeros((), device=device)
        for batch in micro_batches:
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                micro_loss = batch_loss_sum(loss_module, batch)
            (micro_loss / valid.clamp(min=1)).backward()
            loss_sum += micro_loss.detach().float()
        grad_norm = clip_and_measure(loss_module, cfg.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = (all_reduce_sum(loss_sum, mesh.world_group) / valid.clamp(min=1)).item()
        elapsed = time.perf_counter() - started
        tokens = cfg.train.grad_accum * cfg.train.micro_batch * cfg.seq_len * dims.dp_size
        row = {
            "step": step + 1,
            "loss": loss,
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "tokens_per_s": tokens / elapsed,
            "peak_mem_bytes": peak_memory_bytes(device),
            "step_time_s": elapsed,
        }
        losses.append(loss)
        if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps:
            metrics.log(row)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
        bar.update(1)
        if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0 and step + 1 < end_step:
            save(step + 1)
    bar.close()
    if end_step > start_step:
        save(end_step)
    export_dir = None
    if cfg.train.export and end_step == cfg.train.steps and (end_step > start_step or not (output_dir / "final").exists()):
        export_dir = export_model(cfg, loss_module.model, tokenizer, output_dir / "final", rank)
    if metrics is not None:
        metrics.close()
    peak = all_reduce_max(torch.tensor(float(peak_memory_bytes(device)), device=device), mesh.world_group)
    return TrainSummary(
        output_dir=output_dir,
        steps=end_step,
        first_loss=losses[0] if losses else float("nan"),
        last_loss=losses[-1] if losses else float("nan"),
        peak_mem_bytes=int(peak.item()),
        export_dir=export_dir,
        resumed_from=start_step,
        is_main=is_main,
    )


def start_run_files(cfg: Config, output_dir: Path, is_main: bool, start_step: int):
    from longfit.train.metrics import MetricsLogger

    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(cfg.to_yaml())
    metrics = MetricsLogger(output_dir, is_main, cfg.train.tensorboard)
    metrics.truncate_after(start_step)
    return metrics


def clip_and_measure(module: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm (over all shards), clipping to `max_norm` when it is > 0."""
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
