"""Per family: longfit's loss and every gradient equal transformers' eager attention (fp32, 1e-5).

Llama, Qwen2 (q/k/v biases), Mistral (a sliding window on every layer, wider than a cp=2 chunk) and Gemma 3
(local and global layers, a window narrower than a chunk, q/k norms, query_pre_attn_scalar unlike head_dim,
final-logit softcapping, tied embeddings): tiny random models on rows of 64 tokens, longer than every window.
The reference is transformers' own model with attn_implementation="eager" -- transformers builds its masks
(causal, sliding window, and the documents it reads from restarting position_ids, with use_cache=False) --
and the cross-entropy of its logits. longfit runs its training objective (CausalLMLoss, chunked loss) on one
process, with one document per row and with packed documents, and on two gloo ranks with ring and Ulysses
context parallelism under FSDP2 (`parallelize`, activation checkpointing on), packed documents.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).parent))
from batch_helpers import packed_rows  # noqa: E402
from parallel_harness import run_distributed  # noqa: E402

from longfit.config import load_config
from longfit.data.packing import PackedBatch
from longfit.memory.loss import CausalLMLoss, batch_loss_sum
from longfit.models.attention import register_attention
from longfit.models.kernels import accumulation_dtype

L, VOCAB = 64, 384
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
FAMILIES = {
    "llama": dict(SMALL, model_type="llama"),
    "qwen2": dict(SMALL, model_type="qwen2"),
    "mistral": dict(SMALL, model_type="mistral", sliding_window=24),
    "gemma3": dict(SMALL, model_type="gemma3_text", num_hidden_layers=4, sliding_window=13, sliding_window_pattern=2,
                   query_pre_attn_scalar=24, final_logit_softcapping=2.0),
}
DOCS = [[10, 37, 17], [40, 24]]  # per row: shorter than, longer than and about the windows
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def build(family: str, attn_implementation: str):
    """The family's tiny model with the same random weights for every implementation (std 0.1: logits
    large enough for the softcap to bend them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = copy.deepcopy(FAMILIES[family])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.config.use_cache = False
    return model


def make_batch(packed: bool) -> PackedBatch:
    """Two rows of L tokens: DOCS packed, or one document per row (cu_seqlens None)."""
    batch = packed_rows(DOCS if packed else [[L], [L]], L, VOCAB, seed=1)
    return batch if packed else PackedBatch(batch.input_ids, batch.labels, batch.position_ids, None,
                                            batch.num_label_tokens)


def eager_reference(family: str, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build(family, "eager")
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum") / batch.num_label_tokens
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def longfit_step(family: str, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build(family, register_attention())
    loss = batch_loss_sum(CausalLMLoss(model, chunked_loss=True, loss_chunk=24), batch) / batch.num_label_tokens
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_matches(loss, grads, ref_loss, ref_grads, name: str) -> None:
    assert_close(loss, ref_loss, **TOLERANCE, msg=lambda m: f"{name} loss: {m}")
    assert grads.keys() == ref_grads.keys(), name
    for param, ref in ref_grads.items():
        assert ref.abs().max() > 0, f"{name}: {param} has no gradient to compare"
        assert_close(grads[param], ref, **TOLERANCE, msg=lambda m: f"{name} grad {param}: {m}")


@pytest.mark.parametrize("packed", [False, True], ids=["one-document-per-row", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_process_matches_eager(family: str, packed: bool) -> None:
    batch = make_batch(packed)
    assert_matches(*longfit_step(family, batch), *eager_reference(family, batch), f"{family}")


def test_the_families_really_exercise_windows_and_gemma_specifics() -> None:
    """Guards the configs above: windows shorter than the rows, local and global Gemma layers, the softcap bending."""
    mistral, gemma = build("mistral", "eager"), build("gemma3", "eager")
    assert mistral.config.sliding_window < L and gemma.config.sliding_window < L
    assert set(gemma.config.layer_types) == {"sliding_attention", "full_attention"}
    assert gemma.model.layers[0].self_attn.scaling != gemma.config.head_dim**-0.5
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight
    batch = make_batch(packed=True)
    logits = gemma(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    assert logits.abs().max() > 1.0  # tanh(x / 2) * 2 differs from x well beyond the tolerance there


def cp_worker(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    results = {}
    batch = make_batch(packed=True)
    for family, method in cases:
        cfg = load_config(None, [f"seq_len={L}", "parallel.cp=2", f"parallel.cp_method={method}", "train.dtype=fp32",
                                 "memory.tiled_mlp=false", "memory.loss_chunk=24"])
        model = build(family, register_attention())
        dims = ParallelDims.from_config(cfg, world_size, model.config.num_attention_heads)
        mesh = dims.build_mesh("cpu")
        loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh)
        shard = shard_batch(batch, mesh.cp_rank, dims.cp, cp_layout(method))
        count = global_valid_tokens(shard.labels, mesh.world_group)
        local_sum = batch_loss_sum(loss_module, shard)
        (local_sum / count).backward()
        loss = all_reduce_sum(local_sum.detach().clone(), mesh.world_group) / count
        grads = {name: p.grad.full_tensor() for name, p in loss_module.model.named_parameters()}
        results[f"{family}-{method}"] = (loss, grads)
    return results


CP_CASES = [(family, method) for family in FAMILIES for method in ("ring", "ulysses")]


@pytest.fixture(scope="module")
def cp_results() -> list[dict]:
    return run_distributed(cp_worker, 2, CP_CASES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,method", CP_CASES, ids=[f"{f}-{m}" for f, m in CP_CASES])
def test_context_parallel_matches_eager(cp_results, family: str, method: str) -> None:
    ref_loss, ref_grads = eager_reference(family, make_batch(packed=True))
    for rank, results in enumerate(cp_results):
        loss, grads = results[f"{family}-{method}"]
        assert loss.dtype == accumulation_dtype(torch.float32)
        assert_matches(loss, grads, ref_loss, ref_grads, f"rank {rank} {family}-{method}")
