"""Tensor parallelism (parallel.tp) parity with single-process training: loss and EVERY gradient.

One training step on real gloo ranks -- `parallelize` with tp (composed with FSDP2 over dp_shard x cp, ring or
Ulysses CP, LoRA, activation checkpointing + offload, tiled MLP, the vocabulary-parallel loss), forward of this
rank's shard, backward of local_sum / global valid tokens -- must give the single-process loss and every
parameter's gradient (gathered with full_tensor()) on the same global batch. One spawn per world size runs all
the cases of that size.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402
from test_parallel_model import L, concat_rows, make_batch  # noqa: E402

from longfit.config import Config, load_config
from longfit.memory.loss import CausalLMLoss, batch_loss_sum
from longfit.models.build import use_lora_storage
from longfit.models.loading import resolve_model_config
from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
from longfit.parallel.comm import all_reduce_sum
from longfit.parallel.dims import TENSOR_PARALLEL_PROJECTIONS, ParallelDims
from longfit.parallel.parallelize import parallelize


def tiny_llama(tied: bool = False):
    """hidden 64, 2 layers, 4 query heads, 2 key/value heads (tp=4 replicates them), vocabulary 384."""
    from transformers import AutoModelForCausalLM

    config = resolve_model_config("llama-tiny")
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=config._attn_implementation)
    model.config.use_cache = False
    return model


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    # Random A and B on every projection tp splits (column- and row-parallel, replicated key/value heads).
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(TENSOR_PARALLEL_PROJECTIONS), init_lora_weights=False)
    return get_peft_model(model, config)


@dataclass(frozen=True)
class Case:
    name: str
    cp: int
    tp: int
    method: str = "ring"
    rows: int = 2  # rows per dp rank
    docs: tuple[int, ...] | None = (17, 47)  # document lengths of every row (None: one document per row)
    lora: bool = False
    tied: bool = False
    overrides: tuple[str, ...] = ()

    def config(self) -> Config:
        return load_config(None, [
            f"seq_len={L}", f"parallel.cp={self.cp}", f"parallel.tp={self.tp}", f"parallel.cp_method={self.method}",
            "train.dtype=fp32", "memory.activation_checkpointing=false", "memory.tiled_mlp=false",
            "memory.loss_chunk=24", *self.overrides,
        ])


def reference_step(global_batch, case: Case):
    """Single process, no parallelism, no memory techniques: mean loss and every gradient."""
    model = tiny_llama(case.tied)
    if case.lora:
        model = with_lora(model)
    loss = batch_loss_sum(CausalLMLoss(model), global_batch) / global_batch.num_label_tokens
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def parallel_step(case: Case, world_size: int, batches):
    cfg = case.config()
    model = tiny_llama(case.tied)
    text = model.config
    dims = ParallelDims.from_config(cfg, world_size, text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                                    intermediate_size=text.intermediate_size, text_config=text)
    mesh = dims.build_mesh("cpu")
    if case.lora:  # the trainer's storage: frozen base in the compute dtype, fp32 adapters
        model = use_lora_storage(with_lora(model), torch.float32)
    loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh)
    assert isinstance(loss_module, FSDPModule)
    base = loss_module.model.get_base_model() if case.lora else loss_module.model
    assert (base.lm_head.weight is base.model.embed_tokens.weight) == case.tied
    q_proj = base.model.layers[0].self_attn.q_proj
    q_weight = (q_proj.base_layer if case.lora else q_proj).weight
    assert q_weight.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp") and q_weight.placements[1] == Shard(0)
    shard = shard_batch(batches[mesh.dp_rank], mesh.cp_rank, dims.cp, cp_layout(case.method))
    count = global_valid_tokens(shard.labels, mesh.world_group)
    local_sum = batch_loss_sum(loss_module, shard)
    (local_sum / count).backward()
    loss = all_reduce_sum(local_sum.detach().clone(), mesh.world_group) / count
    grads = {}
    for name, param in loss_module.model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp"), name
        if param.requires_grad:
            grads[name] = param.grad.full_tensor()
        else:
            assert param.grad is None, f"frozen {name} got a gradient"
    return loss, grads


CASES = {
    2: [
        Case("tp2-packed", cp=1, tp=2),
        Case("tp2-lora-checkpointed-offload-tiled", cp=1, tp=2, lora=True, overrides=(
            "memory.activation_checkpointing=true", "memory.offload_activations=true", "memory.tiled_mlp=true",
            "memory.mlp_tiles=3")),
        Case("tp2-tied-full-logits-one-row", cp=1, tp=2, rows=1, docs=None, tied=True,
             overrides=("memory.chunked_loss=false",)),
    ],
    4: [
        Case("cp2-tp2-ring-lora", cp=2, tp=2, lora=True),
        Case("cp2-tp2-ulysses-checkpointed", cp=2, tp=2, method="ulysses", docs=(40, 24),
             overrides=("memory.activation_checkpointing=true",)),
        Case("dp2-tp2-lora-tiled", cp=1, tp=2, lora=True, overrides=("memory.tiled_mlp=true", "memory.mlp_tiles=2")),
        Case("tp4-replicated-kv-heads-lora", cp=1, tp=4, lora=True),
    ],
}


def vocab_parallel_loss_check(rank: int, tp: int) -> None:
    """The loss alone on an uneven vocabulary (101 rows over 2 ranks), with bias, softcap and several rows."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from longfit.parallel.tp import VocabParallel

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    B, n, H, V = 3, 8, 16, 101
    hidden = torch.randn(B, tp * n, H, generator=g)
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V)
    labels = torch.randint(0, V, (B, tp * n), generator=g)
    labels[0, :5] = -100
    for softcap in (None, 3.0):
        reference_hidden, reference_head = hidden.clone().requires_grad_(), copy.deepcopy(head)
        logits = reference_head(reference_hidden)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        (reference / 7).backward()
        sharded_head = copy.deepcopy(head)
        for name in ("weight", "bias"):
            param = getattr(sharded_head, name)
            sharded_head.register_parameter(name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
        local = hidden[:, rank * n:(rank + 1) * n].clone().requires_grad_()
        dtensor = DTensor.from_local(local, mesh, [Shard(1)])
        for chunk in (5, None):
            sharded_head.zero_grad(set_to_none=True)
            local.grad = None
            loss = VocabParallel(mesh, V).loss(dtensor, sharded_head, labels, chunk, softcap)
            (loss / 7).backward()
            torch.testing.assert_close(loss, reference.detach())
            torch.testing.assert_close(local.grad, reference_hidden.grad[:, rank * n:(rank + 1) * n])
            torch.testing.assert_close(sharded_head.weight.grad.full_tensor(), reference_head.weight.grad)
            torch.testing.assert_close(sharded_head.bias.grad.full_tensor(), reference_head.bias.grad)


def mesh_groups_check(rank: int, world_size: int) -> None:
    """dp_shard=1 x cp=2 x tp=2: tp groups are consecutive ranks, cp groups strided by tp; world_group = fsdp's."""
    from longfit.parallel.comm import group_size

    dims = ParallelDims(dp_shard=-1, cp=2, world_size=world_size, tp=2)
    mesh = dims.build_mesh("cpu")
    value = torch.tensor(rank + 1.0)
    assert all_reduce_sum(value.clone(), mesh.tp_mesh.get_group()).item() == {0: 3, 1: 7}[rank // 2]
    assert all_reduce_sum(value.clone(), mesh.cp_group).item() == {0: 4, 1: 6}[rank % 2]
    assert all_reduce_sum(value.clone(), mesh.world_group).item() == {0: 4, 1: 6}[rank % 2]
    assert (mesh.cp_rank, mesh.tp_mesh.get_local_rank(), group_size(mesh.dp_group)) == (rank // 2, rank % 2, 1)


def step_worker(rank: int, world_size: int) -> dict:
    if world_size == 2:
        vocab_parallel_loss_check(rank, world_size)
    else:
        mesh_groups_check(rank, world_size)
    results = {}
    for case in CASES[world_size]:
        dp = world_size // (case.cp * case.tp)
        batches = [make_batch(case.rows, case.docs and [list(case.docs)] * case.rows, seed=10 + d) for d in range(dp)]
        ref_loss, ref_grads = reference_step(concat_rows(batches), case)
        loss, grads = parallel_step(case, world_size, batches)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"{case.name}: loss")
        assert grads.keys() == ref_grads.keys(), case.name
        for param, ref in ref_grads.items():
            torch.testing.assert_close(grads[param], ref, rtol=1e-4, atol=1e-6, msg=f"{case.name}: grad {param}")
        results[case.name] = float(loss)
    return results


@pytest.mark.timeout(400)
# slow (14 s and 25 s on the 2-core machine), to keep the default suite inside its 15 minutes; CI runs this file's
# slow cases
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4],
                         ids=["world2-tp2", "world4-tp2-with-cp-or-dp-and-tp4"])
def test_one_step_matches_single_process(world_size):
    results = run_distributed(step_worker, world_size)
    assert results[0].keys() == {case.name for case in CASES[world_size]}
    for name in results[0]:
        assert len({r[name] for r in results}) == 1, f"{name}: ranks disagree on the loss"
