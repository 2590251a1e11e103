"""Expert parallelism: each rank holds 1/ep of every MoE layer's experts; tokens reach them by all-to-all.

transformers (>= 5.24, `transformers.distributed.expert_parallel`) carries the whole mechanism, planned per family
in the config's `base_model_ep_plan` (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3; Llama 4 has none: its experts take
every token, pre-scaled by the router): the experts' stacked weights become DTensors sharded on dim 0 over the ep
ranks (`grouped_gemm`: each rank keeps experts [r E/ep, (r+1) E/ep), and the module's `num_experts` becomes E/ep),
and the experts module's forward becomes a dispatch (`ep_dispatch_experts`, `AllToAllEP` in training):

    sort this rank's (token, expert) pairs by expert -> all-to-all of the counts, then of the token rows, to the
    experts' ranks -> the family's own experts forward on the rows received (local ids, weight 1) -> all-to-all
    back -> weighted by the routing weights and summed per token, on the rank that holds the token.

Both all-to-alls are differentiable (the backward of one is the other with the splits swapped), so the gradient of
every token's hidden state and routing weight returns to its rank, and each expert's weight gradient sums the
tokens of the whole ep group. This file maps that onto longfit's mesh and order; it adds no communication of its
own.

The ep ranks are ranks holding different tokens (dp_shard x cp, `ParallelDims.build_mesh`'s `expert_mesh`): an
ep group of cp ranks is exact too, since routing is per token. Gradients: `longfit.parallel.fsdp` shards the
experts over "efsdp" (the ranks holding the same experts) and sets the reduction so that, with the loss's N-fold
gradient scale, each expert's gradient is the sum over all N ranks' tokens (see there).
"""

from __future__ import annotations

import re

from torch import nn

from longfit.config import ConfigError
from longfit.models.structure import unwrap_peft


def expert_parallel_plan(model: nn.Module) -> dict[str, str]:
    """transformers' expert-parallel plan of `model` (its `ep_plan`, `*` standing for layer numbers), made concrete:
    each parameter and module name it covers -> its style. Empty for a model without one."""
    causal_lm = unwrap_peft(model)
    patterns = [(re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$"), style)
                for pattern, style in (getattr(causal_lm, "ep_plan", None) or {}).items()]
    names = [name for name, _ in causal_lm.named_parameters()] + [name for name, _ in causal_lm.named_modules()]
    return {name: style for name in names for pattern, style in patterns if pattern.match(name)}


def expert_count(model: nn.Module) -> int | None:
    """Experts per layer that the plan splits (dim 0 of the weights it shards), or None without a plan. Asked only
    under parallel.ep > 1: a transformers without expert parallelism is refused here, before anything is built."""
    import transformers

    try:
        import transformers.distributed.expert_parallel  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"parallel.ep needs transformers' expert parallelism (transformers >= 5.24), and this is transformers "
            f"{transformers.__version__}: pip install -U transformers, or set parallel.ep=1 (FSDP2 shards the experts)"
        ) from None
    plan = expert_parallel_plan(model)
    sharded = [unwrap_peft(model).get_parameter(name) for name, style in plan.items() if style == "grouped_gemm"]
    if not sharded or "ep_dispatch_experts" not in plan.values():
        return None
    return sharded[0].shape[0]


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules whose forward `apply_expert_parallel` made a dispatch (each a FSDP2 unit of its own)."""
    causal_lm = unwrap_peft(model)
    return [causal_lm.get_submodule(name) for name, style in expert_parallel_plan(model).items()
            if style == "ep_dispatch_experts"]


def apply_expert_parallel(model: nn.Module, expert_mesh) -> None:
    """Split `model`'s experts over `expert_mesh["ep"]` and route their tokens by all-to-all (module docstring).

    On the meta model, before FSDP2 and materialisation: the experts' weights become meta DTensors, whose part
    each rank later reads from the checkpoint (`longfit.models.weights`) or initialises.
    """
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    apply_expert_parallelism(unwrap_peft(model), expert_mesh["ep"], expert_mesh["etp"], expert_parallel_plan(model))
