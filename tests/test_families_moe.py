"""Mixture-of-experts families load, shard and train exactly: Qwen3-MoE, Mixtral, Llama 4 (text), gpt-oss, DeepSeek-V3.

Every model is a tiny random checkpoint written by transformers itself (`from_config` -> `save_pretrained`, in a
module fixture): Qwen3-MoE, Mixtral and DeepSeek-V3 in the per-expert layout transformers converts while loading
(`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`), Llama 4 and gpt-oss
in the fused one (`experts.gate_up_proj`), and a Qwen3-MoE saved fused by hand.

- Loading: every checkpoint read slice by slice equals `from_pretrained`, parameters and buffers; on 2 FSDP2
  ranks each rank reads exactly the bytes of the part it holds (expert slices of the per-expert tensors).
- Training against transformers' eager attention (loss and every gradient, fp32, longfit check's per-tensor bound): Qwen3-MoE, Mixtral and
  Llama 4 (its chunked attention off: that is the attention issue's), one document per row and packed; with
  the routers' load-balancing loss (output_router_logits, coef 0.1) added as transformers adds it; with
  checkpointing, the tiled MLP (experts per tile) and the chunked loss; tiled layers; under bf16 autocast
  within tests/test_bf16.py's bound.
- Two gloo ranks against the same one-process reference: cp=2 ring and Ulysses (FSDP2 over the experts),
  dp_shard=2 (different rows), the router loss's counts reduced over the ranks.
- Issue 34's attention on these checkpoints ("gpt_oss-sinks": sinks and a window of 13; "deepseek_v3-mla": MLA with
  query/key heads of 24 and value heads of 12, layer 1 of 2 MoE; "llama4-chunked": chunks of 12, top-1 of 4
  experts): loss and every gradient against transformers' eager model run on each document alone (gpt-oss's
  eager mask ignores packed position_ids), one process (one document per row and packed) and cp=2 ring and
  Ulysses in the shared spawned run; `longfit train model=DIR` on gpt-oss's checkpoint, the loss falling.
- `longfit train model=DIR` trains Qwen3-MoE from its per-expert checkpoint and exports a directory that
  `AutoModelForCausalLM` loads with the logits of the trained weights; what cannot be exact is refused.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).parent))
from batch_helpers import packed_rows, per_document_loss  # noqa: E402
from parallel_harness import run_distributed  # noqa: E402
from test_families import assert_matches as assert_steps_match  # noqa: E402
from family_runs import cp2_losses  # noqa: E402
from family_runs import one_rank_losses, short_documents  # noqa: E402,F401 (fixtures)
from test_families_attention import SINK_STD  # noqa: E402

from longfit.check.parity import Step
from longfit.config import load_config
from longfit.data.packing import PackedBatch
from longfit.memory.loss import CausalLMLoss, batch_loss_sum, step_router_counts

L, VOCAB = 64, 384
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
FAMILIES = {
    "qwen3_moe": dict(SMALL, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # A shared expert beside the routed ones, sigmoid router scores; chunked attention (#34) off.
    "llama4": dict(SMALL, model_type="llama4_text", num_local_experts=4, num_experts_per_tok=1,
                   intermediate_size_mlp=64, attention_chunk_size=None),
    # Loaded as they are; trained with their attention variants as "-sinks" / "-mla" (ATTENTION below).
    "gpt_oss": dict(SMALL, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(SMALL, model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
}
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # large enough to move every router gradient
# The attention variants of test_families_attention.VARIANTS (issue 34) on the MoE checkpoints: gpt-oss's sinks
# (std SINK_STD) and sliding window, DeepSeek-V3's MLA (query/key heads 24 wide, value heads 12; layer 1 MoE),
# Llama 4's chunks of 12 on its RoPE layer and temperature on its NoPE layer, top-1 of 4 experts.
ATTENTION = {"sinks": dict(sliding_window=13),
             "mla": dict(num_key_value_heads=4, head_dim=8, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                         v_head_dim=12),
             "chunked": dict(attention_chunk_size=12, no_rope_layer_interval=2)}
VARIANTS = {"aux": AUX, "every-expert": dict(num_experts_per_tok=4),  # "-every-expert": top-k of all 4 (bf16 test)
            # Every expert and the router loss (bf16 accumulation): its gradient is 0 in exact arithmetic (aux = E for
            # any logits), its bf16 rounding noise is not; coef 0.01 keeps that noise in the router's gradient below
            # the references' bf16 error of the cross-entropy's share.
            "every-expert-aux": dict(num_experts_per_tok=4, output_router_logits=True, router_aux_loss_coef=0.01),
            **ATTENTION}
ATTENTION_CASES = ["gpt_oss-sinks", "deepseek_v3-mla", "llama4-chunked"]
TRAINED = ["qwen3_moe", "mixtral", "llama4", "qwen3_moe-aux", "mixtral-aux"]
DOCS = [[10, 37, 17], [40, 24]]
TOLERANCE = dict(rtol=1e-5, atol=1e-5)

pytestmark = pytest.mark.usefixtures("one_thread")


def family_config(case: str):
    from transformers import AutoConfig

    family, _, variant = case.partition("-")
    values = dict(copy.deepcopy(FAMILIES[family]), **VARIANTS.get(variant, {}))
    return AutoConfig.for_model(values.pop("model_type"), **values)


def write_checkpoint(directory: Path, case: str) -> Path:
    """transformers' own checkpoint of `case` with std 0.1 random weights (routers far from ties) and a tokenizer."""
    from transformers import AutoModelForCausalLM

    from longfit.data.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(case))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, param in model.named_parameters():
            if name.endswith("sinks"):  # logits of a trained model's size, as test_families_attention draws them
                param.mul_(SINK_STD / 0.1)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Every case's checkpoint, and "qwen3_moe-fused": the same weights as qwen3_moe in the fused layout."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    cases = [*FAMILIES, "qwen3_moe-aux", "mixtral-aux", "qwen3_moe-every-expert", "mixtral-every-expert",
             "qwen3_moe-every-expert-aux", *ATTENTION_CASES]
    paths = {case: write_checkpoint(root / case, case) for case in cases}
    fused = root / "qwen3_moe-fused"
    fused.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (paths["qwen3_moe"] / name).is_file():
            (fused / name).write_bytes((paths["qwen3_moe"] / name).read_bytes())
    state = AutoModelForCausalLM.from_pretrained(paths["qwen3_moe"]).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, fused / "model.safetensors", metadata={"format": "pt"})
    paths["qwen3_moe-fused"] = fused
    return paths


def make_batch(packed: bool) -> PackedBatch:
    batch = packed_rows(DOCS if packed else [[L], [L]], L, VOCAB, seed=1)
    return batch if packed else PackedBatch(batch.input_ids, batch.labels, batch.position_ids, None,
                                            batch.num_label_tokens)


def row_batch(full: PackedBatch, row: int) -> PackedBatch:
    """Row `row` of a packed batch alone, with its documents: a micro-batch, or a dp rank's share."""
    starts = full.cu_seqlens[(full.cu_seqlens >= row * L) & (full.cu_seqlens <= (row + 1) * L)] - row * L
    rows = slice(row, row + 1)
    return PackedBatch(full.input_ids[rows], full.labels[rows], full.position_ids[rows], starts,
                       int((full.labels[rows] != -100).sum()))


# -- loading ---------------------------------------------------------------------------------------------

def all_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered whole (a collective under FSDP2)."""
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_equal_values(actual: dict, expected: dict, where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{where}: {name}"


def stored_keys(directory: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_checkpoints_read_by_slices_equal_from_pretrained(checkpoints) -> None:
    from transformers import AutoModelForCausalLM

    from longfit.models.loading import load_model

    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in stored_keys(checkpoints["qwen3_moe"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in stored_keys(checkpoints["mixtral"])
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in stored_keys(checkpoints["deepseek_v3"])
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored_keys(checkpoints["qwen3_moe-fused"])
    for case in [*FAMILIES, "qwen3_moe-fused", *ATTENTION_CASES]:
        expected = all_values(AutoModelForCausalLM.from_pretrained(checkpoints[case]))
        assert_equal_values(all_values(load_model(str(checkpoints[case]))), expected, case)


# -- one process against transformers' eager attention ------------------------------------------------------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model):
    """peft's LoRA on the attention projections and (peft's fused-experts support: gate_proj/up_proj/down_proj
    become the experts' gate_up_proj and down_proj parameters) the experts, random A and B (with peft's zero B
    every lora_A gradient would be 0), the same on every call."""
    from peft import LoraConfig, get_peft_model

    from longfit.models.build import peft_quietly

    torch.manual_seed(1)
    with peft_quietly():
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False))


def random_adapters(model) -> None:
    """Every LoRA tensor of `model` (a peft model, possibly sharded) drawn by blocks of the global tensor: the same
    values on one process and on any sharding."""
    from longfit.models.init import fill_by_blocks

    for name, param in model.named_parameters():
        if "lora_" in name:
            fill_by_blocks(param, name, 7, lambda block, generator: block.normal_(0, 0.1, generator=generator))


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}


def eager_step(directory: Path, batch: PackedBatch, autocast: torch.dtype | None = None, attn: str = "eager",
               lora: bool = False, adapters_by_blocks: bool = False, bf16_parameters: bool = False):
    """transformers' own forward and loss: the mean token cross-entropy, plus coef x its own aux loss when the
    config asks for it (as its forward adds it). Returns (loss, gradients). `bf16_parameters`: FSDP2's bf16
    regime on one process (parameters cast to bf16, buffers left fp32, no autocast)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn)
    if bf16_parameters:
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    model = with_lora(model) if lora else model
    if adapters_by_blocks:
        random_adapters(model)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), batch.labels.flatten(), reduction="sum")
        loss = loss / batch.num_label_tokens
        if model.config.output_router_logits and out.aux_loss is not None:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return loss.detach().float(), gradients(model)


def longfit_model(directory: Path, lora: bool = False):
    from longfit.models.loading import load_model

    model = load_model(str(directory))
    return with_lora(model) if lora else model


def longfit_step(model, batch: PackedBatch, autocast: torch.dtype | None = None, loss_chunk: int = 24,
                 accumulate: bool = False):
    """The trainer's step (train/loop.py): `accumulate` makes each row a micro-batch of it (train.grad_accum)."""
    loss_module = CausalLMLoss(model, chunked_loss=True, loss_chunk=loss_chunk)
    micro_batches = [row_batch(batch, row) for row in range(batch.input_ids.shape[0])] if accumulate else [batch]
    tokens = torch.tensor(batch.num_label_tokens)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        router_counts = step_router_counts(loss_module, micro_batches)
    total = torch.zeros(())
    for micro_batch in micro_batches:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            micro = batch_loss_sum(loss_module, micro_batch, tokens, router_counts)
        (micro / tokens).backward()
        total += micro.detach().float()
    return total / tokens, gradients(model)


def assert_matches(loss, grads, ref_loss, ref_grads, name: str) -> None:
    """longfit check's fp32 comparison (test_families.assert_matches): every element within 1e-5 of its tensor's
    own scale, every reference gradient nonzero."""
    assert_steps_match(Step(loss, grads), Step(ref_loss, ref_grads), name)


@pytest.mark.parametrize("packed", [False, True], ids=["one-document-per-row", "packed"])
@pytest.mark.parametrize("case", TRAINED)
def test_single_process_matches_eager(checkpoints, case: str, packed: bool) -> None:
    batch = make_batch(packed)
    got = longfit_step(longfit_model(checkpoints[case]), batch)
    assert_matches(*got, *eager_step(checkpoints[case], batch), case)


def eager_per_document(directory: Path, batch: PackedBatch):
    """transformers' eager model from `directory` on each document alone (test_families_attention's reference:
    gpt-oss's eager mask ignores packed position_ids): (loss, gradients)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    loss = per_document_loss(model, batch)
    loss.backward()
    return loss.detach().float(), gradients(model)


@pytest.mark.parametrize("packed", [False, True], ids=["one-document-per-row", "packed"])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_variants_from_checkpoints_match_eager(checkpoints, case: str, packed: bool) -> None:
    """Issue 34's attention on issue 35's loading: the checkpoints transformers wrote, loaded on the meta-device
    path, train exactly (sinks, MLA widths, chunks, each beside routed experts)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoints[case])
    assert {"gpt_oss-sinks": lambda c: c.sliding_window == 13,
            "deepseek_v3-mla": lambda c: (c.v_head_dim, c.qk_nope_head_dim + c.qk_rope_head_dim,
                                          c.first_k_dense_replace, c.num_hidden_layers) == (12, 24, 1, 2),
            "llama4-chunked": lambda c: c.layer_types == ["chunked_attention", "full_attention"]}[case](config), config
    batch = make_batch(packed)
    got = longfit_step(longfit_model(checkpoints[case]), batch)
    assert_matches(*got, *eager_per_document(checkpoints[case], batch), case)


def test_lora_on_attention_and_experts_matches_eager(checkpoints) -> None:
    """LoRA on the attention projections and the fused experts (peft's ParamWrapper), router loss on, packed: every
    adapter's gradient equals transformers' eager model with the same adapters."""
    batch = make_batch(packed=True)
    got = longfit_step(longfit_model(checkpoints["qwen3_moe-aux"], lora=True), batch)
    assert any("experts.base_layer.lora_A" in name for name in got[1])  # gate_up_proj's adapter, inside down_proj's
    assert_matches(*got, *eager_step(checkpoints["qwen3_moe-aux"], batch, lora=True), "qwen3_moe-aux lora")


def test_the_router_loss_is_really_in_the_objective(checkpoints) -> None:
    """Guards the cases above: the "-aux" checkpoints hold the same weights, and with output_router_logits the
    loss grows by coef x transformers' own aux loss (about top_k = 2 for balanced routing), not by nothing."""
    from transformers import AutoModelForCausalLM

    batch = make_batch(packed=True)
    plain, _ = longfit_step(longfit_model(checkpoints["qwen3_moe"]), batch)
    with_aux, _ = longfit_step(longfit_model(checkpoints["qwen3_moe-aux"]), batch)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe-aux"])
    aux = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).aux_loss.detach()
    assert aux > 1.5
    assert_close(with_aux - plain, 0.1 * aux, **TOLERANCE)


@pytest.mark.parametrize("technique", ["checkpointing+tiled-mlp", "offload+tiled-mlp", "tiled-layers"])
def test_memory_techniques_match_eager(checkpoints, technique: str, tmp_path) -> None:
    """Checkpointing with the tiled MLP (the experts run per token tile: routing is per token) and the chunked
    loss, with the router loss; the same with the checkpointed layer inputs in the offload store (one in host
    memory, one on disk); tiled decoder layers (the whole layer per tile), their routers' S_e returned by their
    autograd node."""
    from longfit.memory.apply import apply_memory_techniques
    from longfit.memory.switches import CheckpointPlacement, stored_input_bytes
    from longfit.parallel.tiled_attention import LocalTileAttention

    case = "qwen3_moe-aux"
    overrides = {
        "checkpointing+tiled-mlp": ["memory.tiled_mlp=true", "memory.mlp_tiles=5", "memory.tiled_layers=false"],
        "offload+tiled-mlp": ["memory.tiled_mlp=true", "memory.mlp_tiles=5", "memory.tiled_layers=false",
                              "memory.offload_activations=true", f"memory.offload_dir={tmp_path}"],
        "tiled-layers": ["memory.tiled_mlp=false", "memory.tiled_layers=true", "memory.layer_tiles=3"],
    }[technique]
    cfg = load_config(None, [f"model={checkpoints[case]}", f"seq_len={L}", "train.device=cpu", *overrides])
    model = longfit_model(checkpoints[case])
    placement = None
    if cfg.memory.offload_activations is True:  # the 2 layers' inputs: the first on disk, the second in host memory
        placement = CheckpointPlacement(0, 1, 1, stored_input_bytes(2 * L, model.config.hidden_size, 4, None))
    applied = apply_memory_techniques(model, cfg, torch.device("cpu"), placement,
                                      tile_attention=LocalTileAttention.for_sequence)
    if applied.offloader is not None:
        applied.offloader.min_offload_bytes = 1024  # the tiny layer inputs are below the 1 MiB default
    batch = make_batch(packed=True)
    assert_matches(*longfit_step(model, batch), *eager_step(checkpoints[case], batch), f"{case} {technique}")
    if placement is not None:  # the store really held them: one layer input in host memory, one written and read
        stats = applied.offloader.store.stats
        assert stats.host_bytes > 0 and stats.disk_written_bytes == stats.disk_read_bytes > 0, stats


@pytest.mark.parametrize("technique", ["checkpointing+tiled-mlp", "tiled-layers"])
@pytest.mark.parametrize("case", ["qwen3_moe-aux", "mixtral-aux"])
def test_gradient_accumulation_matches_one_step_of_the_whole_batch(checkpoints, case: str, technique: str) -> None:
    """train.grad_accum=2 with the router loss: each row a micro-batch, the step's routing counts from the
    counting forward (step_router_counts), against transformers on both rows at once (its aux over all of them);
    checkpointing with the tiled MLP, or tiled layers (the counting forward through them without gradient).
    Each row's own counts would differ: the micro-batches' routers are far from balanced alike."""
    from longfit.memory.apply import apply_memory_techniques
    from longfit.parallel.tiled_attention import LocalTileAttention

    overrides = {"checkpointing+tiled-mlp": ["memory.tiled_mlp=true", "memory.mlp_tiles=5", "memory.tiled_layers=false"],
                 "tiled-layers": ["memory.tiled_mlp=false", "memory.tiled_layers=true", "memory.layer_tiles=3"]}
    cfg = load_config(None, [f"model={checkpoints[case]}", f"seq_len={L}", "train.device=cpu", *overrides[technique]])
    model = longfit_model(checkpoints[case])
    apply_memory_techniques(model, cfg, torch.device("cpu"), None, tile_attention=LocalTileAttention.for_sequence)
    batch = make_batch(packed=True)
    loss_module = CausalLMLoss(longfit_model(checkpoints[case]))
    own = [loss_module(b.input_ids, b.labels, b.position_ids, b.cu_seqlens, routes_only=True)
           for b in (row_batch(batch, 0), row_batch(batch, 1))]
    assert not torch.allclose(own[0] / own[0][-1], own[1] / own[1][-1]), own  # f_e of the rows differ
    got = longfit_step(model, batch, accumulate=True)
    assert_matches(*got, *eager_step(checkpoints[case], batch), f"{case} {technique} accumulated")


@pytest.mark.parametrize("case,accumulate,tiled_layers", [
    ("qwen3_moe-every-expert", False, False), ("mixtral-every-expert", False, False),
    ("qwen3_moe-every-expert-aux", True, False), ("qwen3_moe-every-expert-aux", True, True)],
    ids=["qwen3_moe", "mixtral", "qwen3_moe-aux-accumulated", "qwen3_moe-aux-accumulated-tiled-layers"])
def test_bf16_autocast_within_the_bound_of_test_bf16(checkpoints, case: str, accumulate: bool,
                                                     tiled_layers: bool) -> None:
    """longfit under bf16 autocast against the fp32 truth, within FACTOR x the error of transformers' eager and
    SDPA attention under the same autocast (tests/test_bf16.py's rule, its constants); "-aux-accumulated": with
    the router loss over two micro-batches (its value coef x E here: each micro-batch's own counts would double it),
    with tiled layers or without.

    Every token is routed to all experts here: a top-k choice is discontinuous, and under bf16 each implementation
    flips the routes of its own near-tied tokens (with top-2 of 4, transformers' eager attention alone misses the
    fp32 router gradient by 57%), so no bf16-sized bound holds there; with every expert chosen, the router's
    softmax, the expert matmuls and their weighted sum are all continuous, and the bound is the families' one."""
    from test_bf16 import FACTOR, GRAD_FLOOR, LOSS_FLOOR, REFERENCE_CEILING, relative_error

    batch = make_batch(packed=True)
    truth = eager_step(checkpoints[case], batch)
    references = [eager_step(checkpoints[case], batch, torch.bfloat16, attn) for attn in ("eager", "sdpa")]
    model = longfit_model(checkpoints[case])
    if tiled_layers:
        from longfit.memory.tiled_layers import apply_tiled_layers
        from longfit.parallel.tiled_attention import LocalTileAttention

        apply_tiled_layers(model, LocalTileAttention.for_sequence, tiles=3)
    got = longfit_step(model, batch, torch.bfloat16, accumulate=accumulate)
    tensors = {"loss": (truth[0], got[0], [r[0] for r in references])}
    tensors.update({n: (g, got[1][n], [r[1][n] for r in references]) for n, g in truth[1].items()})
    changed = sum(max(relative_error(r, exact) for r in refs) > 0 for exact, _, refs in tensors.values())
    assert changed >= 0.9 * len(tensors), f"{case}: bf16 changed only {changed} of {len(tensors)} reference tensors"
    for name, (exact, value, refs) in tensors.items():
        reference = max(relative_error(r, exact) for r in refs)
        assert reference < REFERENCE_CEILING, f"{case} {name}: the references' bf16 error {reference:.2e}"
        floor = LOSS_FLOOR if name == "loss" else GRAD_FLOOR
        assert relative_error(value, exact) <= FACTOR * reference + floor, (
            f"{case} {name}: {relative_error(value, exact):.2e} against the fp32 truth, references {reference:.2e}")


# -- two gloo ranks against one process ---------------------------------------------------------------------

@contextlib.contextmanager
def counted_reads(weights_module):
    """Bytes each checkpoint key is read with inside (weights.read_box wrapped)."""
    counts: dict[str, int] = {}
    read_box = weights_module.read_box

    def counting(file, key, box):
        values = read_box(file, key, box)
        counts[key] = counts.get(key, 0) + values.numel() * values.element_size()
        return values

    weights_module.read_box = counting
    try:
        yield counts
    finally:
        weights_module.read_box = read_box


def parallel_worker(rank: int, world: int, checkpoints: dict[str, Path], cases: list[tuple[str, str]]) -> dict:
    from longfit.models import weights
    from longfit.models.build import build_model
    from longfit.models.init import local_region
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.expert import expert_count
    from longfit.parallel.parallelize import parallelize

    results = {}
    full = make_batch(packed=True)
    for case, layout in cases:
        parallel = {"ring": ["parallel.cp=2"], "ulysses": ["parallel.cp=2", "parallel.cp_method=ulysses"],
                    "dp_shard": ["parallel.dp_shard=2"],
                    "ring-lora": ["parallel.cp=2", "lora.enabled=true", "lora.r=4", "lora.alpha=8"],
                    "dp_shard-ep": ["parallel.dp_shard=2", "parallel.ep=2"],
                    "ring-ep": ["parallel.cp=2", "parallel.ep=2"],
                    "ring-accum": ["parallel.cp=2", "train.grad_accum=2"],
                    "ulysses-tiled-layers-accum": ["parallel.cp=2", "parallel.cp_method=ulysses", "train.grad_accum=2",
                                                   "memory.tiled_mlp=false", "memory.tiled_layers=true",
                                                   "memory.layer_tiles=2"],
                    "ring-ep-bf16": ["parallel.cp=2", "parallel.ep=2", "train.dtype=bf16"],
                    "dp_shard-ring-ep": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2"]}[layout]
        cfg = load_config(None, [f"model={checkpoints[case]}", f"seq_len={L}", "train.dtype=fp32", "train.device=cpu",
                                 "memory.tiled_mlp=true", "memory.mlp_tiles=3", "memory.loss_chunk=24", *parallel])
        model = build_model(cfg, torch.float32, "cpu", fsdp=True)
        dims = ParallelDims.from_config(cfg, world, 4, num_experts=expert_count(model))
        mesh = dims.build_mesh("cpu")
        with counted_reads(weights) as counts:
            loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh, device="cpu",
                                      param_dtype=torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32)
        if layout == "ring-lora":
            random_adapters(model)
        held = sum(local_region(p)[0].numel() for p in model.parameters())
        local_experts = None
        if layout.endswith("-ep"):
            experts = model.get_submodule("model.layers.0.mlp.experts")
            local_experts = (local_region(experts.down_proj)[0].shape[0], experts.num_experts)
        # dp_shard: each dp rank its own row; "-accum": each row a micro-batch of the step, as train.grad_accum=2
        micro_batches = [row_batch(full, mesh.dp_rank)] if dims.dp_shard > 1 else [full]
        if layout.endswith("-accum"):
            micro_batches = [row_batch(full, row) for row in range(full.input_ids.shape[0])]
        if dims.cp > 1:
            micro_batches = [shard_batch(b, mesh.cp_rank, dims.cp, cp_layout(cfg.parallel.cp_method))
                             for b in micro_batches]
        tokens = global_valid_tokens([b.labels for b in micro_batches], mesh.world_group)
        router_counts = step_router_counts(loss_module, micro_batches)
        local = torch.zeros(())
        for batch in micro_batches:
            micro = batch_loss_sum(loss_module, batch, tokens, router_counts)
            (micro / tokens).backward()
            local += micro.detach()
        loss = all_reduce_sum(local, mesh.world_group) / tokens
        grads = {name: p.grad.full_tensor() for name, p in loss_module.model.named_parameters() if p.requires_grad}
        results[f"{case}-{layout}"] = dict(loss=loss, grads=grads, read=counts, held=held, local_experts=local_experts)
    return results


PARALLEL_CASES = [("qwen3_moe-aux", "ring"), ("qwen3_moe-aux", "ulysses"), ("mixtral-aux", "ring"),
                  ("qwen3_moe-aux", "dp_shard"), ("llama4", "ulysses"), ("qwen3_moe-aux", "ring-lora"),
                  ("qwen3_moe-aux", "dp_shard-ep"), ("mixtral-aux", "ring-ep"), ("mixtral-aux", "ring-accum"),
                  ("qwen3_moe-aux", "ulysses-tiled-layers-accum"),
                  *[(case, method) for case in ATTENTION_CASES for method in ("ring", "ulysses")]]
BF16_CASE = ("qwen3_moe-every-expert", "ring-ep-bf16")


@pytest.fixture(scope="module")
def parallel_results(checkpoints) -> list[dict]:
    return run_distributed(parallel_worker, 2, checkpoints, [*PARALLEL_CASES, BF16_CASE])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case,layout", PARALLEL_CASES, ids=[f"{c}-{m}" for c, m in PARALLEL_CASES])
def test_two_ranks_match_one_process(checkpoints, parallel_results, case: str, layout: str) -> None:
    """cp=2 (ring, Ulysses) and dp_shard=2 under FSDP2 with the tiled MLP, against transformers on the whole batch:
    the router loss over both ranks' tokens equals one process's."""
    full = make_batch(packed=True)
    lora = layout.endswith("lora")
    if case in ATTENTION_CASES:  # sinks, MLA, chunks: per document (gpt-oss's eager mask ignores position_ids)
        ref_loss, ref_grads = eager_per_document(checkpoints[case], full)
    else:
        ref_loss, ref_grads = eager_step(checkpoints[case], full, lora=lora, adapters_by_blocks=lora)
    for rank, results in enumerate(parallel_results):
        got = results[f"{case}-{layout}"]
        if layout.endswith("-ep"):  # 2 of the 4 experts on each rank, the module running only those
            assert got["local_experts"] == (2, 2), got["local_experts"]
        assert_matches(got["loss"], got["grads"], ref_loss, ref_grads, f"rank {rank} {case}-{layout}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallelism_composes_with_cp_and_dp_shard_on_four_ranks(checkpoints) -> None:
    """dp_shard=2 x cp=2 with ep=2: the experts split over 2 ranks and sharded by FSDP2 over the 2 others holding
    the same experts (efsdp=2, the reduction that sums and divides by N), against one process."""
    full = make_batch(packed=True)
    ref_loss, ref_grads = eager_step(checkpoints["qwen3_moe-aux"], full)
    results = run_distributed(parallel_worker, 4, checkpoints, [("qwen3_moe-aux", "dp_shard-ring-ep")])
    for rank, result in enumerate(results):
        got = result["qwen3_moe-aux-dp_shard-ring-ep"]
        assert got["local_experts"] == (1, 2), got["local_experts"]  # 2 experts per ep rank, FSDP2 halves them
        assert_matches(got["loss"], got["grads"], ref_loss, ref_grads, f"rank {rank} of 4")


def test_two_ranks_under_fsdp2_bf16_within_the_bound_of_test_bf16(checkpoints, parallel_results) -> None:
    """train.dtype=bf16 under FSDP2 (bf16 gathers, fp32 reduction) with cp=2 and ep=2 (tokens all-to-all'd in
    bf16): against the fp32 truth, within tests/test_bf16.py's bound of the same regime on one process (every
    expert chosen: see test_bf16_autocast_within_the_bound_of_test_bf16)."""
    from test_bf16 import FACTOR, GRAD_FLOOR, LOSS_FLOOR, REFERENCE_CEILING, relative_error

    case, layout = BF16_CASE
    full = make_batch(packed=True)
    truth = eager_step(checkpoints[case], full)
    reference = eager_step(checkpoints[case], full, bf16_parameters=True)
    for rank, results in enumerate(parallel_results):
        got = results[f"{case}-{layout}"]
        tensors = {"loss": (truth[0], got["loss"].float(), reference[0])}
        tensors.update({n: (g, got["grads"][n].float(), reference[1][n]) for n, g in truth[1].items()})
        for name, (exact, value, ref) in tensors.items():
            ceiling = 2 * REFERENCE_CEILING  # the residual stream is bf16 too (tests/test_bf16_dist.py)
            assert 0 < relative_error(ref, exact) < ceiling, f"{name}: the reference's bf16 error"
            floor = LOSS_FLOOR if name == "loss" else GRAD_FLOOR
            assert relative_error(value, exact) <= FACTOR * relative_error(ref, exact) + floor, (
                f"rank {rank} {name}: {relative_error(value, exact):.2e}, reference {relative_error(ref, exact):.2e}")


def test_each_rank_reads_only_the_experts_it_holds(checkpoints, parallel_results) -> None:
    """Loading the per-expert checkpoint on 2 FSDP2 ranks: each rank read exactly the bytes of the shard it holds
    (fp32 checkpoint, fp32 parameters), the experts 0-1 of every layer on rank 0, 2-3 on rank 1."""
    for rank, results in enumerate(parallel_results):
        got = results["qwen3_moe-aux-ring"]
        assert sum(got["read"].values()) == 4 * got["held"], f"rank {rank}"
        experts = {int(key.split(".experts.")[1].split(".")[0]) for key in got["read"] if ".experts." in key}
        assert experts == {2 * rank, 2 * rank + 1}, f"rank {rank} read experts {experts}"


# -- the command line ---------------------------------------------------------------------------------------

def test_train_and_export_a_moe_checkpoint(checkpoints, corpus, tmp_path) -> None:
    """`longfit train model=DIR` from the per-expert layout: the export loads in AutoModelForCausalLM (which
    converts it again) with the logits of longfit's trained weights."""
    from transformers import AutoModelForCausalLM

    from longfit.cli import main
    from longfit.models.loading import load_model

    out = tmp_path / "run"
    args = ["train", f"model={checkpoints['qwen3_moe-aux']}", f"data.path={corpus}", f"output_dir={out}",
            "seq_len=64", "train.device=cpu", "train.steps=2", "train.micro_batch=2", "train.lr=1e-2"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["loss"] == row["loss"] for row in rows)
    exported = AutoModelForCausalLM.from_pretrained(out / "final", attn_implementation="eager")
    original = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe-aux"], attn_implementation="eager")
    trained = load_model(str(out / "final"))
    ids = make_batch(packed=False).input_ids
    logits = exported(input_ids=ids).logits
    assert not torch.allclose(logits, original(input_ids=ids).logits)  # it trained
    assert_close(trained(input_ids=ids).logits, logits, **TOLERANCE)


def test_train_a_checkpoint_with_attention_sinks(checkpoints, corpus, tmp_path) -> None:
    """`longfit train model=DIR` on gpt-oss's checkpoint (sinks, sliding window, experts): a few steps on packed
    rows, the loss falls."""
    from longfit.cli import main

    out = tmp_path / "run"
    args = ["train", f"model={checkpoints['gpt_oss-sinks']}", f"data.path={corpus}", f"output_dir={out}",
            "seq_len=64", "train.device=cpu", "train.steps=6", "train.micro_batch=2", "train.lr=1e-2",
            "train.warmup_steps=0"]
    assert main(args) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def test_train_with_gradient_accumulation_logs_the_loss_of_one_micro_batch(checkpoints, corpus, tmp_path) -> None:
    """`longfit train` with the router loss: train.grad_accum=2 of one row each logs the losses (two steps: the
    second after an update) of train.micro_batch=2 on the same rows, in fp32 and under train.dtype=bf16."""
    from longfit.cli import main

    for dtype in ("fp32", "bf16"):
        losses = {}
        for name, batch in {"accumulated": ["train.micro_batch=1", "train.grad_accum=2"],
                            "one micro-batch": ["train.micro_batch=2", "train.grad_accum=1"]}.items():
            out = tmp_path / f"{dtype}-{name.replace(' ', '-')}"
            assert main(["train", f"model={checkpoints['qwen3_moe-aux']}", f"data.path={corpus}", f"output_dir={out}",
                         "seq_len=64", "train.device=cpu", "train.steps=2", "train.lr=1e-2", "train.warmup_steps=0",
                         f"train.dtype={dtype}", *batch]) == 0
            losses[name] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        # bf16: the same bf16 products, their fp32 gradients summed in another order
        assert_close(torch.tensor(losses["accumulated"]), torch.tensor(losses["one micro-batch"]),
                     rtol=1e-5 if dtype == "fp32" else 2.0**-9, atol=0, msg=lambda m: f"{dtype}: {losses} {m}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("case", ["qwen3_moe-aux", "mixtral-aux"])
def test_longfit_train_cp2_matches_one_rank(checkpoints, short_documents, one_rank_losses, tmp_path, case, method):
    """`longfit train --nproc 2 parallel.cp=2` on the per-expert checkpoint transformers wrote, packed rows of short
    documents, the router loss on (its counts reduced over both ranks): every step's logged loss that of one
    process within 1e-4 relative (README: the bound of the distributed CLI runs); each step after the first
    depends on the gradients before it."""
    losses = cp2_losses(checkpoints[case], short_documents, tmp_path / "cp2", method)
    assert len(losses) == 3, losses
    assert_close(torch.tensor(losses), torch.tensor(one_rank_losses(case)), rtol=1e-4, atol=0)


def test_tiled_layers_without_declared_routers_are_refused(checkpoints, monkeypatch) -> None:
    """A MoE class whose routers transformers' recorder does not declare: tiled layers could not give their logits
    a gradient, so the router loss with them is refused in one line, on the meta model (nothing built)."""
    from longfit.config import ConfigError
    from longfit.memory.router_loss import check_router_loss
    from longfit.models.loading import meta_model

    model = meta_model(str(checkpoints["qwen3_moe-aux"]))
    check_router_loss(model, tiled_layers=True)
    monkeypatch.setattr(type(model.model), "_can_record_outputs", {})
    check_router_loss(model, tiled_layers=False)
    with pytest.raises(ConfigError, match=re.escape("declares no router module")) as refused:
        check_router_loss(model, tiled_layers=True)
    assert "set memory.tiled_layers=false" in str(refused.value) and "\n" not in str(refused.value)


def test_expert_parallel_rules_name_the_fix(checkpoints) -> None:
    """parallel.ep's rules, checked by ParallelDims before anything is built, each naming the fix."""
    from longfit.config import ConfigError
    from longfit.models.loading import meta_model
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.expert import expert_count

    assert expert_count(meta_model(str(checkpoints["qwen3_moe"]))) == 4
    assert expert_count(meta_model(str(checkpoints["llama4"]))) is None  # its experts take every token: no ep plan

    def dims(world: int, experts: int | None, *overrides: str) -> ParallelDims:
        cfg = load_config(None, [f"seq_len={L}", *overrides])
        return ParallelDims.from_config(cfg, world, 4, num_experts=experts)

    assert dims(4, 4, "parallel.cp=2", "parallel.ep=2").expert_fsdp_size == 2
    refused = {
        "must divide parallel.dp_shard x parallel.cp = 2": (2, 4, "parallel.ep=4"),
        "must divide the model's 6 experts": (4, 6, "parallel.ep=4"),
        "no experts that transformers can split": (2, None, "parallel.ep=2"),
        "lora.enabled=true": (2, 4, "parallel.ep=2", "lora.enabled=true"),
        "not tp; set parallel.tp=1": (4, 4, "parallel.ep=2", "parallel.tp=2"),
    }
    for message, (world, experts, *overrides) in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            dims(world, experts, *overrides)


# -- the benchmark ------------------------------------------------------------------------------------------

def test_bench_cp_checks_expert_degrees_before_any_run(checkpoints, capsys) -> None:
    """`longfit bench cp --ep`: parallel.ep's rules (ParallelDims) for every run, before a process is started."""
    from longfit.cli import main

    base = ["bench", "cp", "--seq-len", "256", "--short-len", "64", "--device", "cpu"]
    refused = {"no experts that transformers can split": [f"--model={checkpoints['llama4']}", "--cp", "2", "--ep", "1,2"],
               "no --ep degree in 4 divides a --cp degree in 2: add --ep 1": [f"--model={checkpoints['qwen3_moe']}",
                                                                              "--cp", "2", "--ep", "4"]}
    for message, argv in refused.items():
        assert main([*base, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("longfit: error:") and message in err and err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_cp_compares_expert_parallelism_side_by_side(checkpoints, tmp_path) -> None:
    """`longfit bench cp --cp 1,2 --ep 1,2` on the Qwen3-MoE checkpoint: one table with one rank, FSDP2 alone and
    FSDP2 + ep=2, each 2-rank row's peak over the one-rank run's and ep=2's step time over FSDP2 alone's."""
    from longfit.cli import main

    out = tmp_path / "moe.md"
    assert main(["bench", "cp", f"--model={checkpoints['qwen3_moe']}", "--cp", "1,2", "--ep", "1,2", "--seq-len", "256",
                 "--short-len", "64", "--steps", "1", "--device", "cpu", "--output", str(out)]) == 0
    rows = {tuple(cells[:2]): cells for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                                  for line in out.read_text().splitlines() if line.startswith("| ")
                                                  and line[2].isdigit())}
    assert set(rows) == {("1", "1"), ("2", "1"), ("2", "2")}, rows
    one, alone, expert = rows[("1", "1")], rows[("2", "1")], rows[("2", "2")]
    assert one[3] == "1.000" and alone[7] == "1.000"
    # the ratios of the unrounded figures: within the rounding of the printed ones (0.05 MB, 0.005 s each)
    assert float(expert[3]) == pytest.approx(float(expert[2]) / float(one[2]), abs=0.1 / float(one[2]) + 1e-3)
    assert float(expert[7]) == pytest.approx(float(expert[6]) / float(alone[6]), abs=0.01 / float(alone[6]) + 1e-3)
