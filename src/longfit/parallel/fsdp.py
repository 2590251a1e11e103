"""FSDP2 (`fully_shard`) over the flattened dp_shard x cp mesh, with exact summed gradients.

Units: one per decoder layer (whatever module sits in the decoder's layer list, i.e. the checkpoint
wrapper when activation checkpointing wrapped it) and the root `CausalLMLoss`, which owns the rest
(embeddings, final norm, lm_head) and whose forward hooks drive the whole schedule.

Gradient scale. FSDP2 reduces gradients by AVERAGING over its N = dp_shard x cp ranks. The trainer's
objective is  J = sum_r S_r / T  (S_r: rank r's summed token loss, T: the global valid-token count),
and rank r back-propagates S_r / T, so dJ/dw = sum_r d(S_r / T)/dw -- a SUM over ranks. The average
is therefore N times too small. FSDP's own knob cannot be used on every backend and version:
`set_reduce_scatter_divide_factor` (torch 2.6) / `set_gradient_divide_factor` (2.8+) turn the
reduction into ReduceOp.PREMUL_SUM, which gloo rejects ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
Instead the root's output carries an identity whose backward multiplies the incoming gradient by N
(`_ScaleGradient`): every local gradient is N x d(S_r / T)/dw, FSDP's average of them is the sum, the
loss value the trainer sees is untouched, and it works with NCCL, gloo and every torch >= 2.6.
N is a power of two in practice, so the scaling is exact in floating point.

Pipeline parallelism. Only the last stage's output is the loss; the gradient every earlier stage receives is the
next stage's input gradient, already N x d(S_r / T)/d(hidden) since it came back through that scaled loss. So the
identity sits on the last stage alone (`loss_root`): scaling every stage would multiply stage s's gradients by
N^(S - s).

Tensor parallelism. The tp ranks of a (dp_shard, cp) coordinate back-propagate the same S_r / T, each for its
slice of the parameters, so N counts dp_shard x cp only: FSDP2 shards every tp slice over those N ranks (2-D
DTensors on ("dp_shard_cp", "tp"), one mesh for all parameters, which clip_grad_norm_'s single foreach norm
needs), and the partial gradients of parameters replicated on tp are summed by DTensor before FSDP sees them.

Expert parallelism. Each experts module is a unit of its own on the expert mesh's "efsdp" axis (the N / ep ranks
holding the same experts), before its decoder layer's. Its local gradient already sums, through the all-to-all's
backward, the tokens of its ep group, each N x d(S_r / T)/dw; summed over efsdp it covers all N ranks once, so
the reduction must SUM and divide by N (not by its N / ep ranks): `set_gradient_divide_factor(N)`, with
`set_force_sum_reduction_for_comms` so that the division happens locally (gloo has no PREMUL_SUM) -- transformers'
own FSDP2 setup for its expert parallelism does the same. With one efsdp rank there is no reduction and FSDP2
divides by the factor itself. The experts unit reshards after forward as the layers do (parallel.reshard_after_forward):
the pipeline's zero-bubble schedules find the weights whose gradients they defer among the module's parameters as
the forward used them, so experts resharded in between would get none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

try:  # public since torch 2.6
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

from longfit.models.structure import decoder_layers


class _ScaleGradient(torch.autograd.Function):
    """Identity in forward (a copy of the loss: a pipeline's zero-bubble schedules detach it in place, which a view
    refuses); multiplies the gradient by `factor` in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def apply_fsdp(
    module: torch.nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
    roots: Sequence[torch.nn.Module] = (),
    loss_root: torch.nn.Module | None = None,
    model: torch.nn.Module | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    scale_gradient: bool = True,
) -> torch.nn.Module:
    """Shard `module` (a CausalLMLoss) over the 1-D `mesh`: one FSDP unit per decoder layer, then the root (`roots`
    instead where given: a pipeline rank's stages, each the root of its part, as torchtitan shards each model chunk).

    Under tensor parallelism `mesh` must be the flattened dp_shard x cp axis of the root mesh the tp mesh
    comes from (ParallelDims.build_mesh): torch 2.6-2.10 refuse FSDP and TP meshes of different roots.

    param_dtype below fp32 gathers parameters in that dtype for compute (the sharded master weights
    keep theirs) and reduces gradients in `reduce_dtype`. cpu_offload keeps the sharded parameters,
    gradients and optimizer state in host memory. `expert_mesh`: under expert parallelism (ParallelMesh.expert_mesh),
    each experts module is sharded over its "efsdp" axis first. `loss_root`: the root whose output is the loss whose
    gradient is scaled (default `module`; None under `roots` holds no pipeline's last stage). Returns `module` (an
    FSDPModule without `roots`).

    Inside a transformers Trainer (integrations/hf.py) `module` is the trainer's model itself and `model` the causal
    LM whose decoder layers and experts are the units (default `module.model`); `mp_policy` is then Accelerate's
    FSDP2 plugin's, used as it is, and `scale_gradient=False`: the Trainer already multiplies each rank's loss by
    its number of processes, which is N there.
    """
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    elif param_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    model = module.model if model is None else model
    if expert_mesh is not None:
        from longfit.parallel.expert import experts_modules

        for experts in experts_modules(model):
            fully_shard(experts, reshard_after_forward=reshard_after_forward, **{**kwargs, "mesh": expert_mesh["efsdp"]})
            experts.set_gradient_divide_factor(float(mesh.size()))
            if expert_mesh["efsdp"].size() > 1:
                experts.set_force_sum_reduction_for_comms(True)
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        # The last block's parameters would be gathered again at once by backward: keep them.
        fully_shard(layer, reshard_after_forward=reshard_after_forward and index < len(layers) - 1, **kwargs)
    for root in roots or [module]:
        fully_shard(root, reshard_after_forward=reshard_after_forward, **kwargs)
    loss_root = loss_root if roots else module
    world = mesh.size()
    if world > 1 and loss_root is not None and scale_gradient:
        loss_root.register_forward_hook(lambda _module, _inputs, loss: _ScaleGradient.apply(loss, float(world)))
    return module
