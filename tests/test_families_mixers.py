"""Families whose token mixers run per document (models/document_mixers.py): Mamba and a Mamba-2 hybrid against transformers' eager
model, each document of a packed row run alone (`parity.eager_step`), loss and every gradient, fp32 and bf16.

The tiny models are transformers' default configs shrunk by `longfit check` (check/shrink.py: Mamba-2 heads x head
dim = expand x hidden, groups, SSD chunks of 16 tokens so the check's documents cross chunk boundaries); the Bamba
copy gets an attention layer after its Mamba layer (`attn_layer_indices`), so both mixers run in one model; LFM2's a
short-convolution layer before its attention layer, as its checkpoints have (its default config is all attention).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from longfit.check import parity
from longfit.check.parity import Setup
from longfit.check.shrink import shrink_config
from longfit.config import ConfigError

CHECKPOINTED = ["memory.activation_checkpointing=true", "memory.tiled_mlp=false", "memory.loss_chunk=24"]
FAMILIES = {  # transformers' default configs with these values, shrunk by the check
    "mamba": dict(model_type="mamba"),
    "bamba": dict(model_type="bamba", num_hidden_layers=2, attn_layer_indices=[1]),
    "lfm2": dict(model_type="lfm2", num_hidden_layers=2, layer_types=["conv", "full_attention"]),  # as its checkpoints
}


def tiny(model_type: str, memory: list[str], dtype: torch.dtype = torch.float32) -> Setup:
    values = dict(FAMILIES[model_type])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    values = shrink_config(config, parity.ROW).config.to_dict()
    return Setup(values, [], memory, bool(memory), dtype, "ring", seed=0)


@pytest.mark.parametrize("model_type,packed", [
    ("mamba", True), ("bamba", True), *(pytest.param(*case, marks=pytest.mark.slow)
                                        for case in [("bamba", False), ("lfm2", True), ("mamba", False)])])
def test_per_document_mixers_match_eager(model_type: str, packed: bool) -> None:
    case = tiny(model_type, CHECKPOINTED)
    rows = parity.batches(case.config().vocab_size, seed=0)["packed" if packed else "one document per row"]
    ref = parity.eager_step(parity.build(tiny(model_type, []), "eager"), rows)
    got = parity.longfit_step(case, rows, techniques=True)
    assert got.grads.keys() == ref.grads.keys()
    assert all(grad.abs().max() > 0 for grad in ref.grads.values())
    comparison = parity.compare_fp32(model_type, got, ref)
    assert comparison.ok, comparison.line()


@pytest.mark.parametrize("model_type", [pytest.param("mamba", marks=pytest.mark.slow), "bamba"])
def test_per_document_mixers_match_eager_under_bf16(model_type: str) -> None:
    case = tiny(model_type, CHECKPOINTED, parity.BF16)
    rows = parity.batches(case.config().vocab_size, seed=0)["packed"]
    truth = parity.eager_step(parity.build(case, "eager"), rows)
    references = [parity.eager_step(parity._as_reference(case, attn), rows, autocast=parity.BF16)
                  for attn in parity.bf16_references(case)]
    got = parity.longfit_step(case, rows, techniques=True, autocast=True)
    comparison = parity.compare_bf16(model_type, got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_without_per_document_mixers_packed_rows_differ(monkeypatch) -> None:
    """transformers' Mamba mixer over a packed row carries state across its documents: the wrapping is what makes
    the packed step exact."""
    import longfit.models.linear_attention as linear_attention

    monkeypatch.setattr(linear_attention, "prepare_document_mixers", lambda model, routed: 0)
    case = tiny("mamba", CHECKPOINTED)
    rows = parity.batches(case.config().vocab_size, seed=0)["packed"]
    ref = parity.eager_step(parity.build(tiny("mamba", []), "eager"), rows)
    assert not parity.compare_fp32("mamba", parity.longfit_step(case, rows, techniques=True), ref).ok


def test_context_parallel_pipeline_and_tiled_layers_are_refused() -> None:
    from longfit.memory.loss import CausalLMLoss
    from longfit.memory.switches import resolve_memory_switches
    from longfit.models.linear_attention import prepare_linear_attention, untileable_layers
    from longfit.parallel.parallelize import apply_context_parallel
    from longfit.parallel.pipeline import cut_stage

    model = parity.build(tiny("bamba", []), "eager")
    prepare_linear_attention(model)
    with pytest.raises(ConfigError, match=r"decoder layer 0's BambaMixer runs per document on one rank.*parallel.cp=1"):
        apply_context_parallel(model, None, "ring")
    with pytest.raises(ConfigError, match=r"decoder layer 0's BambaMixer runs per document .*parallel.pp=1"):
        cut_stage(CausalLMLoss(model), [0], 2)
    reason = untileable_layers(model)
    assert reason.startswith("decoder layer 0's BambaMixer runs per document")
    cfg = tiny("bamba", ["memory.tiled_layers=true"]).check_config()
    with pytest.raises(ConfigError, match="memory.tiled_layers=true cannot tile"):
        resolve_memory_switches(cfg, "cuda", 512, untileable_layers=reason)


def test_the_check_refuses_context_parallelism_before_any_step(tmp_path) -> None:
    from longfit.check.parity import NotExact, rehearsal
    from longfit.config import load_config

    AutoConfig.for_model("granitemoehybrid").save_pretrained(tmp_path)
    cfg = load_config(overrides=[f"model={tmp_path}", "seq_len=512", "parallel.cp=2", "train.device=cpu"])
    with pytest.raises(NotExact, match=r"decoder layer 0's GraniteMoeHybridMambaLayer runs per document on one rank"):
        rehearsal(cfg, "cpu")
    assert rehearsal(load_config(overrides=[f"model={tmp_path}", "seq_len=512", "train.device=cpu"]), "cpu").checked_cp == 1
