"""What the trainer prints (rank 0 alone): a few lines about the run, the progress bar, the outcome.

The resolved config itself goes to OUTPUT_DIR/config.yaml, not to the console. Other ranks print
nothing, and their Python warnings and transformers' log notes are the same as rank 0's, so they are
dropped there (`quiet_other_ranks`).
"""

from __future__ import annotations

import logging
import warnings

from longfit.config import Config
from longfit.eval.scores import DEPTHS, RetrievalSize
from longfit.plan.result import GiB, PlanResult


def quiet_other_ranks(rank: int) -> None:
    """On ranks other than 0, drop the warnings and library log notes that rank 0 shows once."""
    if rank == 0:
        return
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("peft").setLevel(logging.ERROR)


def size(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count:,}"


def run_summary(cfg: Config, plan: PlanResult, parameters: int, trainable: int, device,
                retrieval: RetrievalSize | None) -> str:
    """Model, data and length, parallel layout, memory techniques with the planned peak, outputs."""
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
              f"loss in chunks of {s.loss_chunk} tokens" if s.loss_chunk else "full logits",
              s.optimizer + (", FSDP2 CPU offload" if s.fsdp_offload else "")]
    layout = f"dp_shard {s.dp_shard} x cp {s.cp}" + (f" ({s.cp_method})" if s.cp > 1 else "") + f" x tp {s.tp}"
    return "\n".join([
        f"model   {cfg.model}: {size(parameters)} parameters, {tuned}, {s.regime}, on {device}",
        f"data    {data}: {per_step} row{'s' if per_step > 1 else ''} of {cfg.seq_len} tokens per step (micro_batch "
        f"{s.micro_batch} x grad_accum {s.grad_accum} x dp {s.dims.dp_size}), {cfg.train.steps} steps, lr {cfg.train.lr:g}",
        f"layout  {s.world} rank{'s' if s.world > 1 else ''}: {layout}",
        f"memory  {', '.join(memory)}; planned peak {plan.peak_bytes / GiB:.2f} GiB per rank",
        f"output  {cfg.output_dir}: config.yaml, metrics.jsonl, checkpoints/"
        + (", final/" if cfg.train.export else "")
        + (f"; retrieval scored on {retrieval.samples * len(DEPTHS)} examples of {retrieval.length} tokens before and "
           "after training" if retrieval else ""),
    ])


def progress_bar(cfg: Config, start_step: int, enabled: bool):
    """The step bar: steps done, the time so far and the ETA of the run's remaining steps, loss, lr, tok/s."""
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start_step, disable=not enabled, dynamic_ncols=True,
                bar_format="train {n_fmt}/{total_fmt} steps |{bar}| {elapsed}, ETA {remaining}{postfix}")


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
