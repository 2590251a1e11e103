"""What the trainer prints (rank 0 alone): a few lines about the run, the progress bar, the outcome.

The resolved config itself goes to OUTPUT_DIR/config.yaml, not to the console. Other ranks print
nothing, and their Python warnings and transformers' log notes are the same as rank 0's, so they are
dropped there (`quiet_other_ranks`).
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING

from longfit.config import Config
from longfit.eval.scores import DEPTHS, RetrievalSize
from longfit.plan.result import GiB, PlanResult

if TYPE_CHECKING:
    from longfit.data.packing import EpochCount


def quiet_other_ranks(rank: int) -> None:
    """On ranks other than 0, drop the warnings and library log notes that rank 0 shows once."""
    if rank == 0:
        return
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("peft").setLevel(logging.ERROR)


def size(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count:,}"


def loss_text(chunk: int | None, tokens: int) -> str:
    """How the loss meets a rank's `tokens`: the chunk it computes at a time (the configured or derived chunk may
    exceed the tokens, and then the whole part is one chunk), or whole logits (memory.chunked_loss=false)."""
    if not chunk:
        return "full logits"
    if chunk < tokens:
        return f"loss in chunks of {chunk:,} tokens"
    return f"loss in one chunk of all {tokens:,} tokens per rank"


def run_summary(cfg: Config, plan: PlanResult, parameters: int, trainable: int, device,
                retrieval: RetrievalSize | None, epoch: EpochCount | None = None) -> str:
    """Model, data and length, parallel layout, memory techniques with the planned peak (and on CUDA the allocator
    settings in force), outputs."""
    from longfit.memory.optim import allocator_settings

    s = plan.setup
    tuned = "full fine-tuning" if trainable == parameters else f"{'QLoRA' if s.qlora else 'LoRA'} r={s.lora_rank}, {size(trainable)} trainable"
    # The synthetic task has no chats; for a data.path the policy is named here, its counts at the end (`data_outcome`).
    data = f"{cfg.data.path} (long chats: {cfg.data.long_chats})" if cfg.data.path else "the built-in synthetic retrieval task"
    per_step = s.micro_batch * s.grad_accum * s.dims.dp_size
    layers = s.shape.layers
    recompute = f"tiled layers {s.checkpointed}/{layers}" if s.tiled_layers else f"checkpointing {s.checkpointed}/{layers} layers"
    memory = [recompute + (" offloaded to host" if s.offload_activations else "")
              if s.checkpointed else "no checkpointing",
              f"tiled MLP {'on' if s.tiled_mlp else 'off'}",
              loss_text(s.loss_chunk, s.tokens),
              s.optimizer + (", FSDP2 CPU offload" if s.fsdp_offload else "")]
    stages = f", {s.dims.pp_stages_per_rank} stages per rank" if s.dims.pp_stages_per_rank > 1 else ""
    layout = (f"pp {s.dims.pp} ({s.config.parallel.pp_schedule}{stages}) x " if s.dims.pp > 1 else "") + f"dp_shard {s.dp_shard} x cp {s.cp}" + (f" ({s.cp_method})" if s.cp > 1 else "") + f" x tp {s.tp}" + (f", experts split over ep {s.dims.ep}" if s.dims.ep > 1 else "")
    return "\n".join([
        f"model   {cfg.model}: {size(parameters)} parameters, {tuned}, {s.regime}, on {device}",
        f"data    {data}: {per_step} row{'s' if per_step > 1 else ''} of {cfg.seq_len} tokens per step (micro_batch "
        f"{s.micro_batch} x grad_accum {s.grad_accum} x dp {s.dims.dp_size}), {cfg.train.steps} steps, lr {cfg.train.lr:g}"
        + (epoch_text(cfg, epoch, per_step) if epoch else ""),
        f"layout  {s.world} rank{'s' if s.world > 1 else ''}: {layout}"
        + (f"; {plan.stages_text()}" if plan.stages else ""),
        f"memory  {', '.join(memory)}; planned peak {plan.peak_bytes / GiB:.2f} GiB per rank"
        + (f"; CUDA allocator {allocator_settings()}" if str(device).startswith("cuda") else ""),
        f"output  {cfg.output_dir}: config.yaml, metrics.jsonl, checkpoints/"
        + (", final/" if cfg.train.export else "")
        + (f"; retrieval scored on {retrieval.samples * len(DEPTHS)} examples of {retrieval.length} tokens before and "
           "after training" if retrieval else ""),
    ])


def epoch_text(cfg: Config, epoch: EpochCount, rows_per_step: int) -> str:
    """What an epoch of the data holds and where the run ends in it (`count_data`), for the summary's data line."""
    rows = cfg.train.steps * rows_per_step
    if not epoch.complete:
        return (f"; the data holds over {size(epoch.tokens)} tokens, counted no further"
                + (f": the run's {counted(rows, 'row')} lie in its first epoch" if rows <= epoch.rows else ""))
    holds = (f"; an epoch is {counted(epoch.documents, 'document')}, {counted(epoch.tokens, 'token')}, "
             f"{counted(epoch.rows, 'row')}")
    if cfg.train.epochs:
        return holds + f": {cfg.train.epochs} epoch{'s' if cfg.train.epochs > 1 else ''} (train.epochs)"
    return holds + f": the run ends in epoch {-(-rows // epoch.rows)}"


def progress_bar(cfg: Config, start_step: int, enabled: bool):
    """The step bar: steps done, the time so far and the ETA of the run's remaining steps, loss, lr, tok/s; in a
    log file a line every train.log_every steps instead (`longfit.models.progress`)."""
    from longfit.models.progress import progress

    return progress(cfg.train.steps, "train", "steps", cfg.train.log_every, start_step, enabled)


def progress_text(loss: float, lr: float, tokens_per_s: float, no_target: bool = False) -> str:
    """`no_target`: the step had no token with a target, so it has no loss at all (not a NaN one) and ran no
    forward (no throughput)."""
    if no_target:
        return f"no target, lr {lr:.2e}"
    return f"loss {loss:.4f}, lr {lr:.2e}, {tokens_per_s:,.0f} tok/s"


def counted(count: int, thing: str) -> str:
    return f"{count:,} {thing}{'' if count == 1 else 's'}"


def data_outcome(cfg: Config, stats, no_target_steps: int) -> str:
    """One line at the end of the run: what packing did with the data (`PackingStats` summed over the dp ranks,
    over the whole run) and the steps that had no target. Counted as the data is read, so it comes after training."""
    parts = [f"{counted(stats.rows, 'row')}, {counted(stats.documents, 'document')}, "
             f"{counted(stats.label_tokens, 'target token')}"
             + (f", {stats.padding_tokens / (stats.rows * cfg.seq_len):.0%} padding" if stats.padding_tokens else "")]
    if stats.long_chats or stats.split_chats:
        cut = "kept their end" if cfg.data.long_chats == "keep_end" else "truncated"
        what = [f"{stats.long_chats_cut:,} {cut}" if stats.long_chats_cut else "",
                f"{stats.long_chats_dropped:,} dropped" if stats.long_chats_dropped else "",
                counted(stats.chat_tokens_cut, "token") + " cut" if stats.chat_tokens_cut else "",
                counted(stats.split_chats, "chat") + " split across rows" if stats.split_chats else ""]
        parts.append(f"{counted(stats.long_chats, 'chat')} longer than {cfg.seq_len} tokens "
                     f"(data.long_chats={cfg.data.long_chats}: {', '.join(w for w in what if w)})")
    if no_target_steps:
        parts.append(f"{counted(no_target_steps, 'step')} without a target (no update)")
    return "data    " + "; ".join(parts)


class StartupClock:
    """Where the time from `longfit train` to the end of its first step went, phase by phase, printed after that
    step (#52: a slow phase on a real checkpoint shows). `from_process_start`: the first phase is the interpreter's
    start and imports, from the process's creation (`longfit train`); else the clock starts now (`train()` called
    from Python). Each `mark(phase)` ends a phase there."""

    def __init__(self, from_process_start: bool) -> None:
        import psutil

        self.started = psutil.Process().create_time() if from_process_start else time.time()
        self.last = self.started
        self.phases: list[tuple[str, float]] = []
        if from_process_start:
            self.mark("start-up")

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases.append((phase, now - self.last))
        self.last = now

    def line(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phases)
        return f"time to the first step: {self.last - self.started:.1f} s ({parts})"
