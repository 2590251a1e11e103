"""The routers' load-balancing loss of a mixture-of-experts model, over every token of the step on every rank.

The transformers families that train their routers with it (Mixtral, Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE,
OLMoE, gpt-oss: the `load_balancing_loss_func` beside each modeling file, one formula, Switch Transformer
eqs. 4-6) add `router_aux_loss_coef x aux` to the loss when the config sets `output_router_logits`. Over the
N router rows of a batch (every token of every MoE layer, as transformers counts them without an attention
mask, which longfit's packed rows never need):

    aux = E x sum_e f_e P_e,   f_e = C_e / N,   P_e = S_e / N

C_e: the top-k assignments to expert e (counts: no gradient), S_e: the sum of its softmax probabilities.

Derivation (why per-rank losses must not be averaged, and what is reduced instead). aux is not linear in the
tokens: the mean of the ranks' aux is not the aux of their union. It is linear in S once C and N are known,
and S is a sum over rows: with C, N the GLOBAL counts,

    aux = E / N^2 x sum_e C_e S_e = sum_r  E / N^2 x sum_e C_e S_e^(r)

where S^(r) sums rank r's rows only. So after its forward each rank all-reduces (C, N) -- E + 1 numbers,
no gradient -- over the ranks that hold different tokens (dp_shard x cp: `ParallelMesh.world_group`), and
adds its own term E / N^2 x sum_e C_e S_e^(r). The terms sum over the ranks to the global aux, and their
gradients, which FSDP2 sums (longfit.parallel.fsdp), to its gradient. The counts do not depend on how the
rows are grouped, so the tiled MLP (whose router runs per tile) changes nothing.

Gradient accumulation would need the counts of the later micro-batches before the backward of the first;
it is refused (`check_router_loss`), as are tiled decoder layers, whose forward runs without gradient.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from longfit.config import Config, ConfigError
from longfit.models.structure import unwrap_peft


@dataclass(frozen=True)
class RouterLoss:
    """What the family's own forward would add: coef x aux over `experts` experts, each token routed to `top_k`."""

    coef: float
    experts: int
    top_k: int

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
        return cls(float(causal_lm.router_aux_loss_coef), int(causal_lm.num_experts), int(causal_lm.num_experts_per_tok))

    def local_term(self, router_logits: tuple[torch.Tensor, ...], group) -> torch.Tensor:
        """This rank's term E / N^2 x sum_e C_e S_e^(r) of the global aux (module docstring), fp32.

        router_logits: every router call's (rows, E) logits of this rank's forward. Collective over `group`
        (None: one process, nothing reduced)."""
        counts = torch.zeros(self.experts + 1, dtype=torch.float32, device=router_logits[0].device)  # C_e, then N
        prob_sums = torch.zeros(self.experts, dtype=torch.float32, device=counts.device)
        for logits in router_logits:
            if torch.is_grad_enabled() and not logits.requires_grad:
                raise ConfigError("the router's auxiliary loss needs the routers' logits with their gradient, which "
                                  "tiled decoder layers do not keep: set memory.tiled_layers=false")
            probs = torch.softmax(logits, dim=-1)  # as load_balancing_loss_func: in the logits' (autocast's) dtype
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
            counts[: self.experts] += torch.bincount(chosen.flatten(), minlength=self.experts).float()
            counts[self.experts] += probs.shape[0]
            prob_sums = prob_sums + probs.float().sum(dim=0)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=group)
        rows = counts[self.experts]
        return self.experts * (counts[: self.experts] * prob_sums).sum() / (rows * rows)


def check_router_loss(model: torch.nn.Module, cfg: Config, tiled_layers: bool) -> None:
    """Refuse, before anything is allocated (`model` on the meta device), what would make the router loss inexact."""
    router = RouterLoss.of(model)
    if router is None:
        return
    if cfg.train.grad_accum > 1:
        raise ConfigError(
            f"the model's config sets output_router_logits (router_aux_loss_coef={router.coef:g}): its load-balancing "
            f"loss is computed over the whole step, which train.grad_accum={cfg.train.grad_accum} would split before "
            f"all routing counts are known. Set train.grad_accum=1 (raise train.micro_batch instead), or "
            f"output_router_logits=false in the model's config.json"
        )
    if tiled_layers:
        raise ConfigError("the model's config sets output_router_logits: its load-balancing loss needs the routers' "
                          "logits with their gradient, which tiled decoder layers do not keep: set memory.tiled_layers=false")
