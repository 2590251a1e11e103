"""Tensor parallelism (parallel.tp) of the families its structural rule admits beyond tests/test_tp_families.py's (#54):
Gemma 2, Granite, OLMo 1 and Llama 4's text model without MoE layers, each a tiny model transformers builds from its
default config shrunk (tests/test_bf16.py's seeded weights, rounded to bf16 values), with what sets the family apart
made to bite at this size: Gemma 2's attention and final logit softcaps, sliding window and query scale; Granite's
embedding, residual, attention and logit multipliers; OLMo 1's norms without weights; Llama 4's
chunked attention, a NoPE layer and its weightless q/k L2 norms over each head. One step on two gloo ranks with
`parallelize` as the trainer runs it: the loss and every gradient (gathered whole) equal one process (fp32; all four
families in one spawn), and are within the bf16 bound of transformers' own bf16 runs (parity.compare_bf16 under
FSDP_CEILING) under train.dtype=bf16 (slow, one spawn).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_bf16 import bf16_valued_model  # noqa: E402
from test_families import SMALL  # noqa: E402
from test_parallel_model import L, make_batch  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.config import load_config  # noqa: E402
from longfit.models.attention import register_attention  # noqa: E402

FAMILIES = {
    "gemma2": dict(SMALL, model_type="gemma2", sliding_window=13, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    # Granite 3's multipliers
    "granite": dict(SMALL, model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.0625, logits_scaling=8.0),
    # without clip_qkv (the default): its in-place clamp of q/k/v is refused under tp (tests/test_tp_families.py)
    "olmo": dict(SMALL, model_type="olmo", eos_token_id=0),
    # layer 1 NoPE and unchunked; layer 0 chunked at 12 tokens, shorter than every document
    "llama4_text": dict(SMALL, model_type="llama4_text", moe_layers=[], intermediate_size_mlp=128,
                        attention_chunk_size=12, no_rope_layer_interval=2),
}
BF16_REFERENCES = {"gemma2": ("eager",)}  # transformers' SDPA attention has no softcap
DOCS = [[17, 47], [40, 24]]


def tp_rank_steps(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    """This rank's step of every (family, train.dtype) case under parallel.tp=2: the mean loss, every gradient whole."""
    from torch.distributed.tensor import DTensor

    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    results = {}
    for family, dtype in cases:
        cfg = load_config(None, [f"seq_len={L}", "parallel.tp=2", f"train.dtype={dtype}", "memory.loss_chunk=24",
                                 "memory.activation_checkpointing=false", "memory.tiled_mlp=false"])
        model = bf16_valued_model(FAMILIES[family], register_attention())
        text = model.config
        dims = ParallelDims.from_config(cfg, world_size, text.num_attention_heads,
                                        num_key_value_heads=text.num_key_value_heads,
                                        intermediate_size=text.intermediate_size, text_config=text)
        mesh = dims.build_mesh("cpu")
        loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh)
        shard = shard_batch(make_batch(2, DOCS, seed=10), mesh.cp_rank, dims.cp, cp_layout("ring"))
        count = global_valid_tokens(shard.labels, mesh.world_group)
        local_sum = batch_loss_sum(loss_module, shard)
        (local_sum / count).backward()
        loss = all_reduce_sum(local_sum.detach().float().clone(), mesh.world_group) / count
        params = dict(loss_module.model.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values())
        results[family, dtype] = parity.Step(loss, {n: p.grad.full_tensor().float() for n, p in params.items()})
    return results


@pytest.fixture(scope="module")
def fp32_ranks() -> list[dict]:
    """Every family's fp32 step on each of two tp ranks: one spawn."""
    from parallel_harness import run_distributed

    return run_distributed(tp_rank_steps, 2, [(family, "fp32") for family in FAMILIES])


# one spawn of two gloo ranks for all four families: 14 s CPU (2 cores idle)
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_under_tp2_equals_one_process(fp32_ranks: list[dict], family: str) -> None:
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum

    model = bf16_valued_model(FAMILIES[family], register_attention())
    batch = make_batch(2, DOCS, seed=10)
    loss = batch_loss_sum(CausalLMLoss(model), batch) / batch.num_label_tokens
    loss.backward()
    for rank, result in enumerate(fp32_ranks):
        got, name = result[family, "fp32"], f"{family}, tp=2, rank {rank}"
        torch.testing.assert_close(got.loss, loss.detach(), rtol=1e-5, atol=1e-6, msg=f"{name}: loss")
        assert got.grads.keys() == {n for n, _ in model.named_parameters()}, name
        for param, ref in model.named_parameters():
            torch.testing.assert_close(got.grads[param], ref.grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {param}")


@pytest.fixture(scope="module")
def bf16_ranks() -> list[dict]:
    from parallel_harness import run_distributed

    return run_distributed(tp_rank_steps, 2, [(family, "bf16") for family in FAMILIES])


# slow: one spawn of two gloo ranks for all four families, and two or three reference steps a family
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_under_tp2_in_bf16_is_within_the_bound(bf16_ranks: list[dict], family: str) -> None:
    batch = make_batch(2, DOCS, seed=10)
    truth = parity.eager_step(bf16_valued_model(FAMILIES[family], "eager"), batch)
    references = [parity.eager_step(parity._in_bf16(bf16_valued_model(FAMILIES[family], attention)), batch)
                  for attention in BF16_REFERENCES.get(family, ("eager", "sdpa"))]
    for rank, result in enumerate(bf16_ranks):
        comparison = parity.compare_bf16(f"{family}, tp=2, rank {rank}, bf16", result[family, "bf16"], references,
                                         truth, parity.FSDP_CEILING)
        assert comparison.ok, comparison.line()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_families_are_admitted(family: str) -> None:
    from transformers import AutoConfig

    from longfit.parallel.tp import tensor_parallel_refusal

    values = dict(FAMILIES[family])
    assert tensor_parallel_refusal(AutoConfig.for_model(values.pop("model_type"), **values), 2) is None
