"""Which kernel serves each attention variant of the 2026 families, and that it computes the variant (issue 34, item 7).

On CUDA in bf16 (`python -m pytest -m gpu`; the CPU cases, in fp32, run by default and check the references):
- attention sinks (gpt-oss, head size 64) and value heads narrower than query/key heads (DeepSeek-V3's 192 | 128,
  the values padded to 192 inside the call): the block kernels' FlashAttention-2 (head sizes up to 256);
- Gemma 4's global layers (head size 512): the block kernels' memory-efficient kernel (FlashAttention-2 stops at
  256), and for whole rows the SDPA backend `attention_kernel_name` predicts, which the profile must show;
- attention-logit softcapping (Gemma 2): longfit's own capped block kernel, no aten attention kernel at all;
- chunked attention (Llama 4): the chunks are documents, so the per-document kernel (flash-attn's varlen kernel
  when installed, else one SDPA call per chunk).
Each case: output and every gradient (sinks included) against float64 math on the same inputs, at the tolerance
of the dtype the kernel ran in (tests/gpu_helpers.py).
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import TOLERANCE, assert_close_to_reference, randn, visible_pairs

from longfit.data.packing import DocumentLayout
from longfit.models import kernels
from longfit.models.attention import attention_kernel_name, kernels_in_profile, local_attention

gpu = pytest.mark.gpu
CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
         pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=gpu)]
L, DOCS = 40, [13, 27]


def reference(q, k, v, dout, visible, scale, softcap=None, sinks=None) -> tuple[torch.Tensor, ...]:
    """float64 (out, dq, dk, dv[, dsinks]) of q (B, H, L, D) over k (B, Hkv, L, D), v (B, Hkv, L, Dv)."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v) + ((sinks,) if sinks is not None else ())]
    q, k, v = leaves[:3]
    groups = q.shape[1] // k.shape[1]
    scores = scale * q @ k.repeat_interleave(groups, 1).transpose(-1, -2)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more key of value 0 per head, its logit the sink
        sink_column = leaves[3].view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    weights = scores.softmax(-1)[..., : v.shape[2]]
    out = weights @ v.repeat_interleave(groups, 1)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout.detach().cpu().double()))


def run(q, k, v, dout, scale, documents=None, window=None, softcap=None, sinks=None) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v) + ((sinks,) if sinks is not None else ())]
    out = local_attention(*leaves[:3], scale, documents, window, softcap, leaves[3] if sinks is not None else None)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def assert_matches(got, want, dtype: torch.dtype, what: str) -> None:
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert_close_to_reference(g, w, TOLERANCE[dtype] * (4 if name == "dsinks" else 1), f"{what} {name}")


def packed(batch: int = 1) -> DocumentLayout:
    return DocumentLayout.from_cu_seqlens([0, DOCS[0], L], batch)


def expected_block_kernel(device: str, head_dim: int):
    if device == "cpu":
        return kernels._cpu_forward
    return kernels._flash_forward if head_dim <= 256 else kernels._efficient_forward


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("variant,D,Dv", [("sinks", 64, 64), ("mla", 192, 128), ("gemma4-global", 512, 512)])
def test_block_kernel_of_each_width_and_the_sinks(device, dtype, variant, D, Dv):
    q, dout = randn(1, 4, L, D, seed=0, dtype=dtype, device=device), randn(1, 4, L, Dv, seed=3, dtype=dtype, device=device)
    k, v = randn(1, 2, L, D, seed=1, dtype=dtype, device=device), randn(1, 2, L, Dv, seed=2, dtype=dtype, device=device)
    sinks = randn(4, seed=4, dtype=torch.float32, device=device) if variant == "sinks" else None
    width = max(D, Dv)
    assert kernels._select(q[..., :width])[0] is expected_block_kernel(device, width)
    window = 9 if variant != "mla" else None  # gpt-oss and Gemma 4 have sliding-window layers too
    visible = visible_pairs(L, L, "lower", DOCS, window)
    got = run(q, k, v, dout, D**-0.5, packed(), window, sinks=sinks)
    assert_matches(got, reference(q, k, v, dout, visible, D**-0.5, sinks=sinks), dtype, variant)


@pytest.mark.parametrize("device,dtype", CASES)
def test_softcapped_scores_run_in_longfits_own_kernel(device, dtype):
    from torch.profiler import ProfilerActivity, profile

    q, dout = (randn(1, 4, L, 32, seed=s, dtype=dtype, device=device) for s in (0, 3))
    k, v = (randn(1, 2, L, 32, seed=s, dtype=dtype, device=device) for s in (1, 2))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        got = run(q, k, v, dout, 0.5, packed(), 9, softcap=1.0)
    assert kernels_in_profile(event.name for event in prof.events()) == []
    want = reference(q, k, v, dout, visible_pairs(L, L, "lower", DOCS, 9), 0.5, softcap=1.0)
    assert_matches(got, want, dtype, "softcap")


@pytest.mark.parametrize("device,dtype", CASES)
def test_chunks_run_in_the_per_document_kernel(device, dtype):
    from transformers import AutoConfig

    q, dout = (randn(1, 4, L, 64, seed=s, dtype=dtype, device=device) for s in (0, 3))
    k, v = (randn(1, 2, L, 64, seed=s, dtype=dtype, device=device) for s in (1, 2))
    chunks = packed().chunked(12)
    assert chunks.rows == (((0, 12), (12, 13), (13, 25), (25, 37), (37, 40)),)
    got = run(q, k, v, dout, 0.125, chunks)
    assert_matches(got, reference(q, k, v, dout, visible_pairs(L, L, "lower", [12, 1, 12, 12, 3]), 0.125), dtype,
                   "chunks")
    config = AutoConfig.for_model("llama4_text", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=64, num_hidden_layers=2, no_rope_layer_interval=2, attention_chunk_size=12)
    name = attention_kernel_name(config, device, dtype)
    per_chunk = "varlen" if "varlen" in name.split("chunked-attention layers: ")[1] else "one call per chunk"
    assert name.split("chunked-attention layers: ")[1].endswith(per_chunk), name


@pytest.mark.parametrize("device,dtype", CASES)
def test_gemma4_global_head_size_runs_the_kernel_its_name_predicts(device, dtype):
    """Whole rows of head size 512: the SDPA backend torch picks (never FlashAttention-2, which stops at 256), named
    per head size for a Gemma 4 config by `attention_kernel_name`, as a profile of the call shows it."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma4_text", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=64, global_head_dim=512, num_hidden_layers=2, sliding_window=9,
                                  layer_types=["sliding_attention", "full_attention"])
    name = attention_kernel_name(config, device, dtype)
    global_name = name.split("layers of head size 512: ")[1]
    assert "FlashAttention-2" not in global_name or device == "cpu", name
    q, dout = (randn(1, 4, L, 512, seed=s, dtype=dtype, device=device) for s in (0, 3))
    k, v = (randn(1, 2, L, 512, seed=s, dtype=dtype, device=device) for s in (1, 2))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        got = run(q, k, v, dout, None)
    ran = kernels_in_profile(event.name for event in prof.events())
    assert ran and global_name.startswith(ran[0]), (ran, name)
    assert_matches(got, reference(q, k, v, dout, visible_pairs(L, L, "lower"), 512**-0.5), dtype, "head size 512")
