"""The held-out pairs of a preference run (train.objective dpo, ipo, simpo, orpo; #56): the objective's mean loss and
TRL's reward metrics, as TRL's DPOTrainer logs its evaluation (`eval_loss`, `eval_rewards/chosen`,
`eval_rewards/rejected`, `eval_rewards/accuracies`, `eval_rewards/margins`, `eval_logps/chosen`, `eval_logps/rejected`).

The pairs are packed as training packs them (longfit.data.preferences.PairLoader, in data order, one pass) and run
with the training's parallel layout through the training's own `pair_loss_sum`, in eval mode and without the
policy's gradient: the reference is the training's (the LoRA adapter off, or a full fine-tune's stored log-probabilities
of the held-out pairs, longfit.train.reference), the means are over every pair read, over the dp ranks, and each
pair's sums are whole over the cp ranks, so the figures are those of one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

import torch

from longfit.memory.preference import METRICS


@dataclass(frozen=True)
class PairEval:
    loss: float  # the objective's mean over the pairs read
    pairs: int  # pairs read, over all ranks
    rows: int  # rows read, over all ranks (padding rows that complete the last batch included)
    means: dict[str, float]  # METRICS, means over the pairs read

    def metrics(self) -> dict[str, float]:
        """The metrics.jsonl fields of this evaluation, TRL's names with its `eval_` prefix."""
        return {"eval_loss": self.loss, **{f"eval_{name}": value for name, value in self.means.items()},
                "eval_pairs": self.pairs, "eval_rows": self.rows}


def evaluate_pairs(loss_module, loader, rows: int, device: torch.device, autocast: torch.dtype | None, mesh,
                   stored_reference: torch.Tensor | None = None) -> PairEval:
    """The first `rows` rows of `loader` (this dp rank's rows of each batch; fewer when it ends first) through
    `loss_module` (a PreferenceLoss, parallelized as the training's), every rank of `mesh` taking part.
    `stored_reference`: a full fine-tune's reference log-probabilities of the loader's pairs."""
    from longfit.memory.preference import pair_loss_sum, pair_metric_means, step_pairs
    from longfit.parallel.batch import cp_layout, shard_batch
    from longfit.parallel.comm import all_reduce_sum

    dims = mesh.dims
    batches = [shard_batch(batch, mesh.cp_rank, dims.cp, cp_layout(dims.cp_method)).to(device)
               for batch in islice(loader, max(1, -(-rows // (loader.micro_batch * dims.dp_size))))]
    step = step_pairs(batches, mesh.dp_group)  # what the means divide by (orpo's NLL term too), as a step's
    was_training, training_reference = loss_module.training, loss_module.stored_reference
    loss_module.eval()
    loss_module.stored_reference = stored_reference
    totals, sums = torch.zeros((), dtype=torch.float64, device=device), {name: 0.0 for name in METRICS}
    try:
        with torch.no_grad():
            for batch in batches:
                with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                    loss_sum, batch_sums = pair_loss_sum(loss_module, batch, step)
                totals += loss_sum.detach().double()
                sums = {name: sums[name] + batch_sums[name] for name in METRICS}
    finally:
        loss_module.train(was_training)
        loss_module.stored_reference = training_reference
    loss_sum = all_reduce_sum(totals, mesh.world_group).item()  # each cp rank holds its share (pair_loss_sum)
    read = torch.tensor(sum(b.input_ids.shape[0] for b in batches) if mesh.cp_rank == 0 else 0, device=device)
    means = pair_metric_means({name: torch.as_tensor(value, device=device) for name, value in sums.items()},
                              mesh.dp_group, step)
    return PairEval(loss_sum / max(step.pairs, 1), step.pairs, int(all_reduce_sum(read, mesh.world_group)), means)
