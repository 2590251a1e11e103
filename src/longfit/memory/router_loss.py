"""The routers' load-balancing loss of a mixture-of-experts model, over every token of the step on every rank.

The transformers families that train their routers with it (Mixtral, Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE,
OLMoE, gpt-oss: the `load_balancing_loss_func` beside each modeling file, one formula, Switch Transformer
eqs. 4-6) add `router_aux_loss_coef x aux` to the loss when the config sets `output_router_logits`. Over the
N router rows of a batch (every token of every MoE layer, as transformers counts them without an attention
mask, which longfit's packed rows never need):

    aux = E x sum_e f_e P_e,   f_e = C_e / N,   P_e = S_e / N

C_e: the top-k assignments to expert e (counts: no gradient), S_e: the sum of its softmax probabilities.

Rows of preference pairs (#56) hold each prompt once for both of its answers, where TRL's DPOTrainer routes it in two
sequences, prompt + chosen and prompt + rejected, beside padding its attention mask leaves out. Each row then counts
as many times as it occurs there (`copies`: 2 for a prompt token, which routes alike in both since its hidden states
are the same, 1 for an answer's, 0 for padding) in C_e, N and S_e: the aux is TRL's exactly, and transformers' own
masked formula with those counts as its mask.

Derivation (why per-rank losses must not be averaged, and what is reduced instead). aux is not linear in the
tokens: the mean of the ranks' aux is not the aux of their union. It is linear in S once C and N are known,
and S is a sum over rows: with C, N the GLOBAL counts,

    aux = E / N^2 x sum_e C_e S_e = sum_r  E / N^2 x sum_e C_e S_e^(r)

where S^(r) sums rank r's rows only. So after its forward each rank all-reduces (C, N) -- E + 1 numbers,
no gradient -- over the ranks that hold different tokens (dp_shard x cp: `ParallelMesh.world_group`), and
adds its own term E / N^2 x sum_e C_e S_e^(r). The terms sum over the ranks to the global aux, and their
gradients, which FSDP2 sums (longfit.parallel.fsdp), to its gradient. The counts do not depend on how the
rows are grouped, so the tiled MLP (whose router runs per tile) changes nothing.

Gradient accumulation: the step's N and C_e also count the rows of its later micro-batches, whose forward has
not run when the first micro-batch's backward needs them. No exact shortcut exists: the gradient of the
term is sum_e (E C_e / N^2) dS_e^(m), linear in the unknown C, so deferring it would keep E gradients or
every micro-batch's graph alive. So a step of several micro-batches first counts: a forward of each
micro-batch without gradient (`step_router_counts`: the decoder body only, no logits or loss; without
gradient nothing outlives its layer, so it stays below the step's peak), its (C, N)
summed and all-reduced once; each micro-batch's forward then takes those step counts instead of its own.
Its cost: one more forward of the body per micro-batch -- about a third more compute than a step without
checkpointing (forward + backward = 3 forwards), a quarter with it (4) --, and that forward's FSDP2
all-gathers and context-parallel exchanges. A step of one micro-batch counts in its own forward, as above.
Routing is a function of the weights and the tokens alone, so the counting forward picks the same experts.

The step's loss or each micro-batch's (`train.router_loss`). The above is `step`: one aux over every token of the
step, invariant to how the step is split into micro-batches and ranks. transformers computes the aux of each forward
alone, and TRL's SFTTrainer adds coef x aux / (micro-batches accumulated) on every rank, which data parallelism
averages: the mean over the step's micro-batches of their own aux. `micro_batch` is that: each forward's counts, over
the cp ranks that hold its rows' shards (their terms sum to its aux; nothing waits for later micro-batches, so no
counting forward), weighted by 1 / (the step's micro-batches x the data-parallel ranks) (`micro_batch_share`). The two
differ whenever routing differs between micro-batches: aux is not linear in the counts.

Tiled decoder layers run their forward without gradient, so the logits their routers give transformers' recorder
carry none: their counts are right, their S_e^(r) has no path back. Each tiled layer therefore returns its
routers' S_e itself, as a second output of its autograd node (summed over its tiles in forward, collected here
through `collect_router_prob_sums` while the loss's forward runs): the term's gradient dL/dS_e = (E C_e / N^2) x
the objective's scale reaches that node by autograd, and its backward adds each tile's S_e, recomputed with
gradient, to the tile's backward (memory/tiled_layers.py). Exact, and no extra pass. The routers are found as
transformers finds them: the model's `_can_record_outputs["router_logits"]` (their class, which output).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from dataclasses import dataclass, field, replace

import torch

from longfit.config import ConfigError
from longfit.models.structure import unwrap_peft


@dataclass(frozen=True)
class RouterLoss:
    """What the family's own forward would add: coef x aux over `experts` experts, each token routed to `top_k`."""

    coef: float
    experts: int
    top_k: int
    router_class: type | None = None
    """The routers' module class and which of its outputs are the logits, as transformers' recorder reads them
    (None: not declared; tiled layers refused)."""
    logits_index: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module) -> RouterLoss | None:
        """The router loss `model`'s causal LM trains with, or None (a dense family, a MoE family whose forward adds
        none -- Llama 4, DeepSeek-V3 balance their routers otherwise --, or `output_router_logits` off).

        Read as transformers' forward reads it: the modeling module's `load_balancing_loss_func`, called with the
        causal LM's `num_experts`, `num_experts_per_tok` and `router_aux_loss_coef`.
        """
        causal_lm = unwrap_peft(model)
        module = sys.modules.get(type(causal_lm).__module__)
        if not getattr(causal_lm.config, "output_router_logits", False) or not hasattr(module, "load_balancing_loss_func"):
            return None
        recorder = getattr(type(causal_lm.model), "_can_record_outputs", None) or {}
        recorder = recorder.get("router_logits")
        router_class, logits_index = (recorder, 0) if isinstance(recorder, type) or recorder is None else (
            recorder.target_class, recorder.index)
        return cls(float(causal_lm.router_aux_loss_coef), int(causal_lm.num_experts), int(causal_lm.num_experts_per_tok),
                   router_class, logits_index)

    def counts(self, router_logits: tuple[torch.Tensor, ...], copies: torch.Tensor | None = None) -> torch.Tensor:
        """(C_1 .. C_E, N) of these router calls' (rows, E) logits: top-k assignments per expert, then rows; fp32,
        no gradient. `copies` (rows,) int64: how many times each row counts (module docstring's shared prompts)."""
        device = router_logits[0].device
        # Counted by scatter_add into E known bins: torch.bincount reads the indices' min and max on the host first,
        # a device synchronisation per router call on CUDA. Integer counts: exact, whatever order the adds run in.
        assignments = torch.zeros(self.experts, dtype=torch.int64, device=device)
        with torch.no_grad():
            for logits in router_logits:
                chosen = torch.topk(self._probs(logits), self.top_k, dim=-1).indices  # (rows, k)
                weights = torch.ones_like(chosen) if copies is None else copies.unsqueeze(1).expand_as(chosen)
                assignments.scatter_add_(0, chosen.flatten(), weights.flatten())
        counts = torch.empty(self.experts + 1, dtype=torch.float32, device=device)
        counts[: self.experts] = assignments
        if copies is None:
            counts[self.experts] = sum(logits.shape[0] for logits in router_logits)  # a fill with a host number
        else:
            counts[self.experts] = len(router_logits) * copies.sum()
        return counts

    def local_term(self, router_logits: tuple[torch.Tensor, ...], group, step_counts: torch.Tensor | None = None,
                   tiled: RouterProbSums | None = None, copies: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's term E / N^2 x sum_e C_e S_e^(r) of the global aux (module docstring), fp32.

        router_logits: every router call's (rows, E) logits of this rank's forward. `step_counts`: the step's
        (C, N) over every micro-batch and rank (`step_router_counts`); None: this forward's, all-reduced over
        `group` (None: one process, nothing reduced). `tiled`: the S_e of the routers whose logits carry no
        gradient, with it (tiled layers). `copies`: each row's count in C, N and S (`counts`)."""
        # Without gradient: the tiled layers' logits, whose S_e `tiled` holds (or a router with nothing to train)
        with_grad = [logits for logits in router_logits if logits.requires_grad or not torch.is_grad_enabled()]
        counts = step_counts
        if counts is None:
            counts = self.counts(router_logits, copies)
            if group is not None:
                import torch.distributed as dist

                dist.all_reduce(counts, group=group)
        prob_sums = sum(router_prob_sums(logits, copies) for logits in with_grad)
        if tiled is not None and tiled.sums:
            prob_sums = prob_sums + sum(tiled.sums)
        rows = counts[self.experts]
        return self.experts * (counts[: self.experts] * prob_sums).sum() / (rows * rows)

    def micro_batch_share(self, micro_batches: int) -> RouterLoss:
        """This loss weighed for `train.router_loss=micro_batch` (module docstring): each of the step's
        `micro_batches` forwards (over every data-parallel rank) adds coef / micro_batches x its own aux."""
        return replace(self, coef=self.coef / micro_batches)

    @staticmethod
    def _probs(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1)  # as load_balancing_loss_func: in the logits' (autocast's) dtype


def router_prob_sums(logits: torch.Tensor, copies: torch.Tensor | None = None) -> torch.Tensor:
    """S_e of one router call's (rows, E) logits: its softmax probabilities summed over the rows (each `copies` times),
    (E,) fp32."""
    probs = RouterLoss._probs(logits).float()
    return probs.sum(dim=0) if copies is None else (probs * copies.unsqueeze(1)).sum(dim=0)


@dataclass
class RouterProbSums:
    """The S_e that tiled layers return while the loss's forward collects them (module docstring)."""

    router_class: type
    logits_index: int
    sums: list[torch.Tensor] = field(default_factory=list)


_collecting: contextvars.ContextVar[RouterProbSums | None] = contextvars.ContextVar("router_prob_sums", default=None)


@contextlib.contextmanager
def collect_router_prob_sums(router: RouterLoss):
    """While the loss's forward runs with gradient: tiled layers hand their routers' S_e to the collector yielded."""
    collector = RouterProbSums(router.router_class, router.logits_index)
    token = _collecting.set(collector)
    try:
        yield collector
    finally:
        _collecting.reset(token)


def router_prob_sums_collector() -> RouterProbSums | None:
    """The collector of the forward running now, if it trains a router loss with gradient."""
    return _collecting.get() if torch.is_grad_enabled() else None


def check_router_loss(model: torch.nn.Module, tiled_layers: bool) -> None:
    """Refuse, before anything is allocated (`model` on the meta device), what would make the router loss inexact."""
    router = RouterLoss.of(model)
    if router is None:
        return
    if tiled_layers and router.router_class is None:
        raise ConfigError("the model's config sets output_router_logits, but its transformers class declares no router "
                          "module (_can_record_outputs['router_logits']) whose logits tiled decoder layers could give "
                          "their gradient: set memory.tiled_layers=false")
