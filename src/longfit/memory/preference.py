"""The preference objectives (train.objective: dpo, ipo, simpo, orpo): TRL's losses, each pair's prompt computed once.

A batch of pairs (longfit.data.preferences.PairBatch) lays each pair out as prompt, chosen answer, rejected answer in
one row, the rejected answer seeing the prompt as its prefix (longfit.data.packing.DocumentLayout.prefixes; the
attention that makes this exact is models/blockwise.py's). One forward of the model over such rows gives every answer's
token log-probabilities; `PreferenceLoss` sums them per answer (the log-probability of the answer given the prompt,
TRL's `chosen_logps` / `rejected_logps`). The one position two targets share, the prompt's last token (it predicts the
first token of either answer), is read twice: `labels` hold the chosen answer's first token there, `branch_labels` the
rejected answer's. Only the answer positions reach the output projection, answer by answer through CausalLMLoss's own
token loss (chunked under memory.chunked_loss, in memory.loss_chunk tokens), so the logits are never L x V.

The loss. With c, r the policy's summed log-probabilities of the chosen and rejected answers, c_ref, r_ref the
reference's, n_c, n_r their token counts, beta, eps (label_smoothing) and gamma (simpo_gamma) as TRL names them:
- `dpo`: -(1 - eps) logsig(beta d) - eps logsig(-beta d), d = (c - c_ref) - (r - r_ref): TRL DPOTrainer's `sigmoid`
  loss (eps = 0; TRL 1.16 moved label smoothing to its `robust` loss) with the conservative smoothing its CPOTrainer and
  earlier DPOTrainers apply; rewards beta (c - c_ref), beta (r - r_ref).
- `ipo`: ((c - c_ref) / n_c - (r - r_ref) / n_r - 1 / (2 beta))^2: DPOTrainer's length-normalised `ipo`.
- `simpo`: the smoothed sigmoid of beta (c / n_c - r / n_r - gamma / beta): CPOTrainer's `simpo` with cpo_alpha=0;
  rewards beta c / n_c, beta r / n_r.
- `orpo`: -beta logsig(log odds(c / n_c) - log odds(r / n_r)) + the chosen answers' mean token NLL over the step:
  ORPOTrainer's loss; rewards as simpo's.
The step's loss is the mean over its pairs (every micro-batch, every dp rank), as TRL's `per_sequence_loss.mean()`.

Context parallelism. A pair's tokens are spread over the cp ranks, so each rank holds a partial sum of every answer's
log-probabilities; the loss is not linear in them. Each rank all-reduces its partial sums (detached) to the totals,
which every cp rank then holds alike, evaluates the loss and its derivative g = dL/d(total) on them, and backpropagates
g . (its partial sums): the gradient reduction that sums every rank's gradient (FSDP2, longfit.parallel.fsdp) then
adds up g . (sum of the partials) = g . totals, exactly the one-process gradient. The value each cp rank returns is
the loss / cp, so that the trainer's sum over the world group counts every pair once.

The planner (`longfit plan`, the preflight) counts a row of pairs as a packed row of seq_len tokens: the activations
per token are the same; the rejected answer's block against its prompt's keys (models/blockwise.py) is time, |R| x |P|
scores, and holds nothing past its kernel call; the reference forward runs without gradient and keeps no activations.
The logits are those of the causal-LM loss's chunks (or, with memory.chunked_loss off, of one answer's tokens at a time,
fewer than the row's), so the plan of the row bounds them.

The router loss (a MoE config with output_router_logits). As TRL's DPOTrainer: the step's objective + coef x aux, aux
from the policy's forward (none from the reference's or without gradient: evaluation), over the tokens of prompt +
chosen and prompt + rejected as separate sequences: a prompt token counts twice (it routes alike in both, its hidden
states the same), an answer's once, padding never (`PairBatch.copies`, memory/router_loss.py's `copies`). Its
counts are summed over every rank and, in a step of several micro-batches, counted first (memory.loss's
`step_router_counts`, through `route_counts`), as the causal-LM loss's; each rank adds step.pairs x coef x its term to
its share, so that the step's sum divided by its pairs holds coef x aux once.

The reference. For dpo and ipo under LoRA the reference log-probabilities come from the same weights with the adapter
off (peft's `disable_adapter`): one forward without gradient per micro-batch, before the policy's, no second copy of
the model. A full fine-tune reads them from `stored_reference`, (pairs in the data, 2) sums that the initial weights
gave in a pass over the same shared-prompt rows before the first step, completed over the cp ranks as the policy's are
(`reference_sums`; longfit.train.reference keeps them in the run directory), looked up by each batch's `pair_ids`.
simpo and orpo have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from longfit.config import Config, ConfigError
from longfit.memory.loss import CausalLMLoss
from longfit.models.attention import batch_documents, remember_documents
from longfit.models.structure import decoder_and_head, prediction_head

if TYPE_CHECKING:
    from longfit.data.preferences import PairBatch

PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""TRL's DPOTrainer names for the means over a step's pairs (simpo and orpo: its CPOTrainer's and ORPOTrainer's)."""


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (as TRL's ORPOTrainer computes it)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass(frozen=True)
class PreferenceObjective:
    """One of PREFERENCE_OBJECTIVES with its coefficients (train.beta, train.label_smoothing, train.simpo_gamma)."""

    name: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @classmethod
    def from_config(cls, cfg: Config) -> "PreferenceObjective":
        return cls(cfg.train.objective, cfg.train.beta, cfg.train.label_smoothing, cfg.train.simpo_gamma)

    @property
    def needs_reference(self) -> bool:
        return self.name not in REFERENCE_FREE

    def _smoothed_sigmoid(self, logits: torch.Tensor) -> torch.Tensor:
        eps = self.label_smoothing
        return -(1 - eps) * F.logsigmoid(self.beta * logits) - eps * F.logsigmoid(-self.beta * logits)

    def pair_losses(
        self, logps: torch.Tensor, reference: torch.Tensor | None, lengths: torch.Tensor, nll_scale: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss (P,), rewards (P, 2), the log-probabilities TRL logs (P, 2)) of P pairs: `logps` (P, 2) the policy's
        summed answer log-probabilities (chosen, rejected), `reference` (P, 2) the reference's (None where the objective
        has none), `lengths` (P, 2) the answers' token counts. `nll_scale`: orpo's weight of a pair's chosen NLL sum,
        (pairs in the step) / (chosen tokens in the step): the step's mean over pairs then holds the mean token NLL."""
        logps = logps.float()
        if self.name in ("dpo", "ipo"):
            ratios = logps - reference.float()  # (P, 2)
            rewards = self.beta * ratios
            if self.name == "dpo":
                loss = self._smoothed_sigmoid(ratios[:, 0] - ratios[:, 1])
            else:
                normalised = ratios / lengths.clamp(min=1)
                loss = (normalised[:, 0] - normalised[:, 1] - 1 / (2 * self.beta)) ** 2
            return loss, rewards, logps
        average = logps / lengths.clamp(min=1)  # (P, 2): TRL's average_log_prob for simpo and orpo
        rewards = self.beta * average
        if self.name == "simpo":
            loss = self._smoothed_sigmoid(average[:, 0] - average[:, 1] - self.simpo_gamma / self.beta)
        else:
            log_odds = (average[:, 0] - average[:, 1]) - (log1mexp(average[:, 0]) - log1mexp(average[:, 1]))
            loss = -self.beta * F.logsigmoid(log_odds) - nll_scale * logps[:, 0]
        return loss, rewards, average


@dataclass
class StepPairs:
    """What normalises a step: its pairs and chosen-answer tokens over every micro-batch and dp rank."""

    pairs: int
    chosen_tokens: int


def _sum_over(values: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return values


def step_pairs(micro_batches: list["PairBatch"], dp_group) -> StepPairs:
    """The step's StepPairs over its micro-batches and the dp ranks (the cp ranks of a dp rank hold the same pairs):
    counted on the host, one all-reduce. Call it on every rank."""
    counts = torch.tensor([[b.pairs, int(b.answer_lengths.view(-1, 2)[:, 0].sum())] for b in micro_batches]).sum(0)
    pairs, chosen = _sum_over(counts, dp_group).tolist()
    return StepPairs(pairs, chosen)


def pair_metric_means(sums: dict[str, torch.Tensor], dp_group, step: StepPairs) -> dict[str, float]:
    """METRICS as TRL logs them: the means over the step's pairs, from `pair_loss_sum`'s sums of every micro-batch
    (the same on the cp ranks of a dp rank), summed over the dp ranks. Call it on every rank."""
    totals = _sum_over(torch.stack([sums[name].float() for name in METRICS]), dp_group)
    return {name: value / step.pairs for name, value in zip(METRICS, totals.tolist())}


class PreferenceLoss(CausalLMLoss):
    """The objective module of a preference run: the model (parallelized as CausalLMLoss is) whose forward returns each
    answer's partial summed log-probability (this rank's tokens). `pair_group`: the cp group (the loop sets it),
    over which those partial sums are completed."""

    def __init__(self, model: torch.nn.Module, objective: PreferenceObjective, chunked_loss: bool = False,
                 loss_chunk: int = 0):
        super().__init__(model, chunked_loss, loss_chunk)
        self.objective = objective
        self.pair_group = None
        self.stored_reference: torch.Tensor | None = None  # (pairs in the data, 2), a full fine-tune's (docstring)

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: Config, loss_chunk: int = 0) -> "PreferenceLoss":
        """`loss_chunk`: the plan's (0: memory.loss_chunk, derived at the first forward when that is 0 too)."""
        return cls(model, PreferenceObjective.from_config(cfg), cfg.memory.chunked_loss,
                   loss_chunk or cfg.memory.loss_chunk)

    def answer_log_probs(self, hidden: torch.Tensor, lm_head: torch.nn.Module, batch: "PairBatch") -> torch.Tensor:
        """(2 P,) sums of log p(target) per answer over this rank's positions with a target: `hidden` (B, L, H); the
        targets and their answers are the batch's `labels` / `sequences` and `branch_labels` / `branch_sequences`."""
        sequences = torch.cat([batch.sequences.flatten(), batch.branch_sequences.flatten()])  # (2 B L,)
        targets = torch.cat([batch.labels.flatten(), batch.branch_labels.flatten()])
        positions = torch.arange(hidden.shape[0] * hidden.shape[1], device=hidden.device).repeat(2)
        kept = sequences >= 0
        sequences, order = sequences[kept].sort(stable=True)
        targets, positions = targets[kept][order], positions[kept][order]
        counts = torch.bincount(sequences, minlength=2 * batch.pairs).tolist()  # one host read per micro-batch
        picked = hidden.flatten(0, 1)[positions]  # (N, H): the answers' positions only, answer by answer
        # An answer without a token on this rank (under cp its tokens may all lie in other ranks' shards, and a rank
        # may hold no answer token of the batch at all), and a batch of padding alone (a dp rank's share of a data
        # set's last step), still give results tied to the model, so that this rank's backward runs as every other
        # rank's does: through the body and lm_head alike, since FSDP2 reduces the gradients of the parameters that
        # have one, which must be the same on every rank.
        nothing = lm_head(picked[:0]).float().sum()  # 0, from no token
        sums = [-self.token_loss(part.unsqueeze(0), lm_head, answer.unsqueeze(0)) if len(part) else nothing
                for part, answer in zip(picked.split(counts), targets.split(counts))]
        return torch.stack(sums) if sums else nothing.expand(0)

    def forward(self, batch: "PairBatch", step_router_counts: torch.Tensor | None = None,
                routes_only: bool = False) -> torch.Tensor:
        """(2 P + 1,): this rank's partial summed log-probabilities of the batch's answers, pair p's chosen at 2p and
        its rejected at 2p + 1, then its term of the step's router load-balancing loss (0 without a router loss or
        without gradient). One tensor, the loss root's output whose gradient FSDP2 scales (parallel/fsdp.py): both
        parts are this rank's shares of sums over the ranks. `step_router_counts`: the step's routing counts over its
        micro-batches (`step_router_counts`), None in a step of one. `routes_only`: the batch's routing counts
        instead (`route_counts`), from the decoder body alone."""
        if self.vocab_parallel is not None:
            raise ConfigError("the preference objectives do not run under tensor parallelism yet: set parallel.tp=1")
        body, lm_head = decoder_and_head(self.model)
        documents = batch_documents(batch.cu_seqlens, batch.documents, batch.input_ids.shape[0])
        remember_documents(batch.position_ids, documents)
        routed = self.router_loss is not None and (torch.is_grad_enabled() or routes_only)
        output = body(input_ids=batch.input_ids, position_ids=batch.position_ids, cu_seq_lens_q=batch.cu_seqlens,
                      longfit_documents=documents, use_cache=False,
                      **({"output_router_logits": True} if routed else {}))
        copies = batch.copies.flatten() if routed else None  # (B L,): the router rows' order
        if routes_only:
            return self.router_loss.counts(output.router_logits, copies)
        hidden = output.last_hidden_state  # (B, L, H)
        head = prediction_head(self.model)
        logps = self.answer_log_probs(hidden if head is None else head(hidden), lm_head, batch)
        if not routed:
            return torch.cat([logps, logps.new_zeros(1)])
        term = self.router_loss.local_term(output.router_logits, self.router_group, step_router_counts, copies=copies)
        return torch.cat([logps, term.to(logps.dtype).reshape(1)])

    def route_counts(self, batch: "PairBatch") -> torch.Tensor:
        """The routing counts (C, N) of `batch`'s rows as the separate sequences route them (module docstring)."""
        return self(batch, routes_only=True)

    def reference_log_probs(self, batch: "PairBatch") -> torch.Tensor | None:
        """(P, 2) the reference's summed log-probabilities of the batch's answers, whole (over the cp ranks): the
        stored ones of a full fine-tune, else the weights' with the LoRA adapter off; None for reference-free
        objectives."""
        if not self.objective.needs_reference:
            return None
        if hasattr(self.model, "disable_adapter"):
            with self.model.disable_adapter():
                return self.reference_sums(batch)
        if self.stored_reference is None:
            raise ConfigError(f"train.objective={self.objective.name} in a full fine-tune reads the reference "
                              "log-probabilities stored before the first step (longfit.train.reference): none were "
                              "given to this objective; use lora.enabled=true, or train through `longfit train`")
        return self.stored_reference[batch.pair_ids.to(self.stored_reference.device)]

    def reference_sums(self, batch: "PairBatch") -> torch.Tensor:
        """(P, 2) the model's summed answer log-probabilities without gradient, completed over `pair_group`: what a
        reference computes, and what a full fine-tune's pass before training stores."""
        with torch.no_grad():
            return _completed(self(batch)[:-1], self.pair_group).view(-1, 2)


def _completed(partial: torch.Tensor, group) -> torch.Tensor:
    """The sums over the cp group of every rank's partial sums, detached (module docstring)."""
    import torch.distributed as dist

    total = partial.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def pair_loss_sum(loss_module: PreferenceLoss, batch: "PairBatch", step: StepPairs,
                  step_router_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """(this rank's share of the batch's summed pair losses, with the gradient of the whole sum (module docstring),
    plus, with gradient, step.pairs x coef x its router term; the metrics' sums over the batch's pairs, the same on
    every cp rank). Divided by step.pairs it is the step's mean (+ coef x aux). `step_router_counts`: the step's
    routing counts when it has several micro-batches (memory.loss.step_router_counts). Call it on every cp rank."""
    import torch.distributed as dist

    group = loss_module.pair_group
    cp = dist.get_world_size(group) if group is not None else 1
    reference = loss_module.reference_log_probs(batch)
    output = loss_module(batch, step_router_counts)  # (2 P + 1,)
    partial = output[:-1]
    coef = 0.0 if loss_module.router_loss is None else loss_module.router_loss.coef
    router = step.pairs * coef * output[-1]  # its gradient: this rank's share of coef x aux's, step.pairs times
    if not batch.pairs:
        return partial.sum() + router, {name: torch.zeros((), device=partial.device) for name in METRICS}
    total = _completed(partial, group).requires_grad_()
    lengths = batch.answer_lengths.to(total.device).view(-1, 2)
    nll_scale = step.pairs / max(step.chosen_tokens, 1)
    with torch.enable_grad():
        losses, rewards, logps = loss_module.objective.pair_losses(total.view(-1, 2), reference, lengths, nll_scale)
        loss_sum = losses.sum()
        (slope,) = torch.autograd.grad(loss_sum, total)
    share = (slope * partial).sum()  # its gradient: this rank's part of d(loss_sum)
    value = share - share.detach() + loss_sum.detach() / cp + router
    rewards, logps = rewards.detach(), logps.detach()
    sums = {
        "rewards/chosen": rewards[:, 0].sum(), "rewards/rejected": rewards[:, 1].sum(),
        "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().sum(),
        "rewards/margins": (rewards[:, 0] - rewards[:, 1]).sum(),
        "logps/chosen": logps[:, 0].sum(), "logps/rejected": logps[:, 1].sum(),
    }
    return value, sums
