"""longfit attention against transformers' eager attention with an explicit mask (fp32, small L)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from longfit.models.attention import register_attention
from longfit.models.presets import preset_config

L = 48
DOCS = [0, 13, 30, 48]  # three documents in each row


def tiny_config(kv_heads: int):
    config = preset_config("llama-tiny")
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 64, 128, 2
    config.num_attention_heads, config.num_key_value_heads = 4, kv_heads
    return config


def model_pair(kv_heads: int):
    config = tiny_config(kv_heads)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=register_attention())
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def packed_inputs(batch: int, packed: bool):
    torch.manual_seed(1)
    ids = torch.randint(0, 384, (batch, L))
    bounds = DOCS if packed else [0, L]
    position_ids = torch.cat([torch.arange(e - s) for s, e in zip(bounds, bounds[1:])]).repeat(batch, 1)
    cu_seqlens = torch.tensor([b * L + s for b in range(batch) for s in bounds[:-1]] + [batch * L])
    doc_of = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    allowed = (doc_of[:, None] == doc_of[None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    mask = torch.zeros(L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return ids, position_ids, cu_seqlens, mask[None, None].expand(batch, 1, L, L)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["llama", "gqa"])
@pytest.mark.parametrize("packed", [False, True], ids=["single-doc", "packed"])
def test_logits_and_gradients_match_eager(kv_heads, packed):
    ours, reference = model_pair(kv_heads)
    ids, position_ids, cu_seqlens, mask = packed_inputs(batch=2, packed=packed)
    out = ours(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu_seqlens if packed else None, labels=ids)
    ref = reference(input_ids=ids, position_ids=position_ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits)
    out.loss.backward()
    ref.loss.backward()
    ref_grads = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, msg=lambda m: f"{name}: {m}")


def test_changing_one_document_leaves_the_others_unchanged():
    ours, _ = model_pair(kv_heads=2)
    ids, position_ids, cu_seqlens, _ = packed_inputs(batch=1, packed=True)
    edited = ids.clone()
    edited[0, DOCS[1] : DOCS[2]] = torch.randint(0, 384, (DOCS[2] - DOCS[1],))
    assert not torch.equal(edited, ids)

    def per_token(tokens):
        logits = ours(input_ids=tokens, position_ids=position_ids, cu_seq_lens_q=cu_seqlens).logits
        labels = torch.cat([tokens[:, 1:], torch.full((1, 1), -100)], dim=1)
        for end in DOCS[1:]:
            labels[0, end - 1] = -100  # no target across a boundary
        losses = torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="none")
        return logits, losses

    logits_a, loss_a = per_token(ids)
    logits_b, loss_b = per_token(edited)
    outside = torch.ones(L, dtype=torch.bool)
    outside[DOCS[1] : DOCS[2]] = False
    torch.testing.assert_close(logits_a[0, outside], logits_b[0, outside], rtol=0, atol=0)
    torch.testing.assert_close(loss_a[outside], loss_b[outside], rtol=0, atol=0)
    assert not torch.allclose(logits_a[0, ~outside], logits_b[0, ~outside])


def test_rejects_a_mask():
    ours, _ = model_pair(kv_heads=2)
    ids = torch.randint(0, 384, (1, 8))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        ours(input_ids=ids, attention_mask=torch.ones(1, 1, 8, 8))


def test_one_document_per_row_runs_the_dense_kernel_with_the_same_result():
    from longfit.data.packing import DocumentLayout
    from longfit.models.attention import local_attention

    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, L, 16), torch.randn(2, 2, L, 16), torch.randn(2, 2, L, 16)
    whole_rows = DocumentLayout.from_cu_seqlens([0, L, 2 * L], 2)
    packed = DocumentLayout.from_cu_seqlens([0, 13, L, 2 * L], 2)
    dense = local_attention(q, k, v, None)
    torch.testing.assert_close(local_attention(q, k, v, None, whole_rows), dense, rtol=0, atol=0)
    split = local_attention(q, k, v, None, packed)
    assert not torch.allclose(split[0, :, 13:], dense[0, :, 13:])
    torch.testing.assert_close(split[1], dense[1])


def test_an_attention_operator_inside_another_is_not_a_kernel_of_its_own():
    """On CUDA, SDPA's FlashAttention-2 operator calls aten::_flash_attention_forward, which longfit's window kernel
    calls directly: a profile names the window kernel only where nothing above it was an attention operator (the
    H200 run of 2026-11-27 listed both for one blockwise call). Profiler events stand in for CUDA's call tree."""
    from types import SimpleNamespace

    from longfit.models.attention import kernels_in_profile

    def event(name, parent=None):
        return SimpleNamespace(name=name, cpu_parent=parent)

    sdpa = event("aten::scaled_dot_product_attention")
    flash = event("aten::_scaled_dot_product_flash_attention", sdpa)
    inner = event("aten::_flash_attention_forward", event("aten::empty", flash))
    window = event("aten::_flash_attention_forward", event("longfit::local_attention"))
    assert kernels_in_profile([sdpa, flash, inner]) == ["SDPA FlashAttention-2"]
    assert kernels_in_profile([sdpa, flash, inner, window]) == ["SDPA FlashAttention-2", "FlashAttention-2 window (aten)"]


@pytest.mark.parametrize("packed", [False, True], ids=["single-doc", "packed"])
def test_kernel_name_is_the_kernel_that_runs(packed):
    from torch.profiler import ProfilerActivity, profile

    from longfit.models.attention import attention_kernel_name, kernels_in_profile

    ours, _ = model_pair(kv_heads=2)
    ids, position_ids, cu_seqlens, _ = packed_inputs(batch=1, packed=packed)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ours(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu_seqlens).logits.sum().backward()
    ran = kernels_in_profile(prof.events())
    name = attention_kernel_name(ours.config, "cpu", torch.float32, packed=packed)
    assert ran == ["SDPA CPU flash"] and name.startswith(ran[0])
    assert name.endswith("one call per document") == packed
    assert attention_kernel_name(ours.config, "cpu", torch.float32, cp_method="ring") == "ring over CPU flash (aten)"
    assert attention_kernel_name(ours.config, "cpu", torch.float32, packed, "ulysses") == f"ulysses over {name}"
