"""The eval loss and perplexity on packed rows of held-out data: the trainer's `train.eval_every` and
`longfit eval --data FILE` compute it here, alike.

The rows are packed as training packs them, at the training seq_len, and run with the training's parallel
layout, in eval mode (no dropout) and without autograd: context parallelism shards each row's sequence, data
parallelism splits the rows, and every rank's summed token loss and target count are added over the ranks that
together hold every token once (`ParallelMesh.world_group`, as a training step does), so the loss is the mean over
every target token of the rows read, whatever the layout.
"""

from __future__ import annotations

import math
from itertools import islice
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from longfit.config import Config

if TYPE_CHECKING:
    from longfit.data.packing import PackedLoader
    from longfit.parallel.dims import ParallelMesh

EVAL_ROW_SHARE = 1 / 4  # of the rows trained between two evaluations, read by each (`eval_row_count`)
PROGRESS_LINES = 4  # in a log file, an evaluation's progress lines (a bar on a terminal)


@dataclass(frozen=True)
class EvalLoss:
    loss: float  # mean token loss over every target token read
    tokens: int  # target tokens read, over all ranks
    rows: int  # packed rows read, over all ranks (padding rows that complete the last batch included)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf  # exp overflows a float past ~709

    def metrics(self) -> dict[str, float]:
        """The metrics.jsonl fields of this evaluation."""
        return {"eval_loss": self.loss, "eval_ppl": self.perplexity, "eval_tokens": self.tokens, "eval_rows": self.rows}


def eval_row_count(cfg: Config, dp_size: int) -> int:
    """Rows one evaluation of a training run reads: data.eval_rows, else EVAL_ROW_SHARE of the rows the run trains on
    between two evaluations (train.eval_every steps, or all train.steps when it only evaluates at the end), at least
    one. A forward-only row costs less than a trained one (a forward, against a forward, a backward and usually a
    recomputation): measured on the shared 2-core CPU, 0.15x for llama-tiny with checkpointing and 0.4-0.65x for
    SmolLM2-135M LoRA without, so evaluations take at most about a sixth of the training they follow."""
    steps = cfg.train.eval_every or cfg.train.steps
    return cfg.data.eval_rows or max(1, int(steps * cfg.train.grad_accum * cfg.train.micro_batch * dp_size * EVAL_ROW_SHARE))


def evaluate_loss(loss_module: torch.nn.Module, loader: "PackedLoader", rows: int, device: torch.device,
                  autocast: torch.dtype | None = None, mesh: "ParallelMesh | None" = None,
                  show_progress: bool = True, known_rows: int | None = None, batch_loss=None) -> EvalLoss:
    """The mean token loss of the first `rows` rows of `loader` (fewer when it ends first), every rank of `mesh` taking
    part (None: one process). `loader` yields this rank's rows of each batch, the same batches on every rank;
    `known_rows`, the rows it holds when known, makes the progress display's total exact. `batch_loss`: a batch's
    summed token loss when `loss_module` is one pipeline stage (`parallel.pipeline.Pipeline.batch_loss`)."""
    from longfit.memory.loss import batch_loss_sum, positioned
    from longfit.models.progress import progress
    from longfit.parallel.batch import cp_layout, shard_batch
    from longfit.parallel.comm import all_reduce_sum

    dp_size = 1 if mesh is None else mesh.dims.dp_size
    rows_per_batch = loader.micro_batch * dp_size
    batches = math.ceil(rows / rows_per_batch)
    if known_rows is not None:
        batches = min(batches, math.ceil(known_rows / rows_per_batch))
    was_training = loss_module.training
    loss_module.eval()
    # loss sum, target tokens, rows; float64 so that a long eval's sum keeps the precision of its last batches
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    bar = progress(batches, "eval", "batches", every=max(1, batches // PROGRESS_LINES), enabled=show_progress)
    try:
        with torch.no_grad():
            for batch in islice(loader, batches):
                batch = positioned(loss_module, batch)
                if mesh is not None:
                    batch = shard_batch(batch, mesh.cp_rank, mesh.dims.cp, cp_layout(mesh.dims.cp_method))
                batch = batch.to(device)
                with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                    loss_sum = batch_loss_sum(loss_module, batch) if batch_loss is None else batch_loss(batch)
                totals[0] += loss_sum.double()
                totals[1] += batch.num_label_tokens
                totals[2] += batch.input_ids.shape[0] if mesh is None or mesh.cp_rank == 0 else 0
                bar.update(1)
    finally:
        bar.close()
        loss_module.train(was_training)
    loss_sum, tokens, read = all_reduce_sum(totals, None if mesh is None else mesh.world_group).tolist()
    return EvalLoss(loss_sum / tokens if tokens else math.nan, int(tokens), int(read))
