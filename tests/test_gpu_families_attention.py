"""Which kernel serves each attention variant of the 2026 families, and that it computes the variant (issue 34, item 7).

On CUDA in bf16 (`python -m pytest -m gpu`; the CPU cases, in fp32, run by default and check the references):
- attention sinks (gpt-oss, head size 64) and value heads narrower than query/key heads (DeepSeek-V3's 192 | 128,
  the values padded to 192 inside the call): the block kernels' FlashAttention-2 (head sizes up to 256);
- Gemma 4's global layers (head size 512): the block kernels' memory-efficient kernel (FlashAttention-2 stops at
  256), and for whole rows the SDPA backend `attention_kernel_name` predicts, which the profile must show;
- attention-logit softcapping (Gemma 2): flash-attn 2's varlen kernel with its `softcap` where flash-attn >= 2.6.2 is
  installed (the chooser's decisions tested on CPU too), else longfit's own capped block kernel, no aten attention
  kernel at all;
- the names `attention_kernel_name` gives sink and latent-attention layers: the block kernel a profile shows;
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
from longfit.models import attention, kernels
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
def test_softcapped_scores_run_in_longfits_own_kernel(monkeypatch, device, dtype):
    """Without a flash-attn that caps scores (and always under the ring) a capped block runs longfit's own kernel."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(attention, "_flash_varlen", lambda q, capped=False: None)
    q, dout = (randn(1, 4, L, 32, seed=s, dtype=dtype, device=device) for s in (0, 3))
    k, v = (randn(1, 2, L, 32, seed=s, dtype=dtype, device=device) for s in (1, 2))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        got = run(q, k, v, dout, 0.5, packed(), 9, softcap=1.0)
    assert kernels_in_profile(prof.events()) == []
    want = reference(q, k, v, dout, visible_pairs(L, L, "lower", DOCS, 9), 0.5, softcap=1.0)
    assert_matches(got, want, dtype, "softcap")


def test_the_chooser_sends_capped_layers_to_flash_attn_where_it_caps():
    """The decisions for a CUDA device (the installed flash-attn's name and version given as the argument they are):
    flash-attn 2.6.2 and later serve capped layers of one device and of Ulysses, with windows and documents; the ring,
    sinks, value heads of another width, heads over 256, flash-attn 2.6.1 (its backward ignores the cap), flash-attn 3,
    a CPU or an fp32 call (no flash-attn release) keep longfit's capped block kernel."""
    from longfit.models.attention import capped_by_flash_attn, capped_kernel_name, flash_attn_release

    release = ("flash-attn 2", (2, 6, 3))
    assert capped_by_flash_attn(release, 256, 256, sinks=False)
    assert capped_kernel_name(release, (256, 256), False, None) == "flash-attn 2 varlen with softcap"
    assert capped_kernel_name(release, (256, 256), False, "ulysses") == "ulysses over flash-attn 2 varlen with softcap"
    blocks = "softcapped blocks (longfit's block kernel)"
    assert capped_kernel_name(release, (256, 256), False, "ring") == f"ring over {blocks}"
    assert capped_kernel_name(("flash-attn 2", (2, 6, 1)), (256, 256), False, None) == blocks
    for refused in [(release, 256, 256, True), (release, 192, 128, False), (release, 512, 512, False),
                    (("flash-attn 2", (2, 6, 1)), 256, 256, False), (("flash-attn 3", (3, 0, 0)), 128, 128, False),
                    (None, 256, 256, False)]:
        assert not capped_by_flash_attn(*refused), refused
    assert flash_attn_release(attention._flash_varlen(torch.zeros(1, 4, 8, 32))) is None  # CPU tensors: none


def test_capped_layers_take_flash_attn_2_where_flash_attn_3_is_installed_too(monkeypatch):
    """flash-attn 3 has no softcap: on Hopper with both packages installed, capped layers ask for flash-attn 2 (and the
    other layers keep flash-attn 3)."""
    from types import SimpleNamespace

    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(attention.importlib, "import_module", lambda name: SimpleNamespace(flash_attn_varlen_func=name))
    chooser = attention._flash_attn_varlen.__wrapped__  # its cache would keep the real packages' answer
    assert chooser((9, 0)) == ("flash-attn 3", "flash_attn_interface")
    assert chooser((9, 0), capped=True) == ("flash-attn 2", "flash_attn")
    assert chooser((8, 0)) == chooser((8, 0), capped=True) == ("flash-attn 2", "flash_attn")


SOFTCAP_CASES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=gpu)]


def capped_under_autocast(path: str, device: str) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of a softcapped causal block, bf16 inputs under bf16 autocast on `device` (the backward, as
    autograd runs it, outside), through longfit's capped block kernel: one device (`blockwise`), the ring on one
    process, or two tiles of tiled layers (whose backward recomputes under the forward's autocast). Scores of std ~9
    against Gemma 2's cap of 50 (q.k of unit-variance heads of 32, scaled by 1.6)."""
    from longfit.parallel.ring import ring_attention
    from longfit.parallel.tiled_attention import LocalTileAttention

    q, dout = (randn(1, 4, 128, 32, seed=s, dtype=torch.bfloat16, device=device) for s in (10, 13))
    k, v = (randn(1, 2, 128, 32, seed=s, dtype=torch.bfloat16, device=device) for s in (11, 12))
    if path == "tiled":
        tiles = LocalTileAttention.for_sequence(1, 128, None)
        spans = tiles.tiles(2)
        with torch.autocast(device, dtype=torch.bfloat16):
            for start, end in spans:
                tiles.store(k[:, :, start:end], v[:, :, start:end], start, end)
            attended = [tiles.attend(q[:, :, start:end], start, end, 1.6, softcap=50.0) for start, end in spans]
            tiles.start_gradients()
            dq = [tiles.attend_backward(dout[:, :, start:end], saved, start, end, 1.6, softcap=50.0)[0]
                  for (start, end), (_, saved) in reversed(list(zip(spans, attended)))][::-1]
        return torch.cat([out for out, _ in attended], dim=2), torch.cat(dq, dim=2), *tiles.key_gradients(0, 128)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.autocast(device, dtype=torch.bfloat16):
        if path == "blockwise":
            out = attention.blockwise_attention(*leaves, 1.6, None, None, 50.0, None)
        else:
            out = ring_attention(*leaves, None, scale=1.6, softcap=50.0)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("device", SOFTCAP_CASES)
@pytest.mark.parametrize("path", ["blockwise", "ring", "tiled"])
def test_softcapped_blocks_under_bf16_autocast_compute_in_fp32(device, path):
    """The capped block kernel runs with autocast off: under bf16 autocast its output and gradients are the float64
    values on the same bf16 inputs, rounded to bf16 once (norm error ~2^-9). Before, the forward's products ran in
    bf16 under the caller's autocast and the backward in fp32 against that forward's logsumexp: errors of 5-10% here."""
    from gpu_helpers import relative_error

    got = capped_under_autocast(path, device)
    q, k, v, dout = (randn(*shape, seed=s, dtype=torch.bfloat16, device="cpu")
                     for shape, s in (((1, 4, 128, 32), 10), ((1, 2, 128, 32), 11), ((1, 2, 128, 32), 12),
                                      ((1, 4, 128, 32), 13)))
    want = reference(q, k, v, dout, visible_pairs(128, 128, "lower"), 1.6, softcap=50.0)
    errors = {name: relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    assert max(errors.values()) <= 1e-2, errors


def test_the_capped_kernel_slices_by_bytes_on_cuda():
    """A capped block's slices on CUDA hold up to 64 MiB of scores (CPU: 65,536 query-key pairs a head): a 131,072-key
    block of 8 fp32 heads in 8,192 slices of 16 query rows, not 131,072 slices of one row (launch-bound)."""
    keys = 131072
    rows = kernels.slice_rows("cuda", 8, keys, 4)
    assert rows == 16 and -(-keys // rows) == 8192
    assert kernels.slice_rows("cpu", 8, keys, 4) == 1  # memory linear in the keys, as before
    for heads in (1, 8, 32, 128):  # every slice between half the budget and the budget: few launches, bounded memory
        scores = kernels.slice_rows("cuda", heads, keys, 4) * heads * keys * 4
        assert kernels._CUDA_SLICE_BYTES // 2 < scores <= kernels._CUDA_SLICE_BYTES, heads
    q, k = torch.empty(1, 8, 300, 16), torch.empty(1, 4, 100_000, 16)
    assert [s.stop - s.start for s in kernels._query_slices(q, k)][:1] == [1]  # CPU tensors: the CPU rule


@gpu
def test_a_capped_block_of_131072_keys_on_cuda_takes_8192_slices(monkeypatch):
    """The slice plan of a real CUDA block (bf16 inputs, fp32 scores): Gemma 2 2B's 8 query heads of 256 at 131,072
    keys in 8,192 slices (131,072 before), each call of the score kernel 16 rows; forward and backward at 8,192 keys
    run the same plan, counted."""
    q, k = torch.empty(1, 8, 131072, 256, dtype=torch.bfloat16, device="cuda"), torch.empty(
        1, 4, 131072, 256, dtype=torch.bfloat16, device="cuda")
    slices = kernels._query_slices(q, k)
    assert len(slices) == 8192 and {s.stop - s.start for s in slices} == {16}
    del q, k
    calls = []
    scores = kernels._capped_scores
    q, dout = (randn(1, 8, 8192, 256, seed=s, dtype=torch.bfloat16, device="cuda") for s in (0, 3))
    k, v = (randn(1, 4, 8192, 256, seed=s, dtype=torch.bfloat16, device="cuda") for s in (1, 2))
    monkeypatch.setattr(kernels, "_capped_scores", lambda *a: calls.append(a[0].shape[-2]) or scores(*a))
    out, lse = kernels.attention_forward(q, k, v, kernels.LOWER, 0.0625, 50.0)
    kernels.attention_backward(dout, q, k, v, out, lse, kernels.LOWER, 0.0625, 50.0)
    rows = kernels.slice_rows("cuda", 8, 8192, 4)
    assert calls == [rows] * (2 * 8192 // rows), (rows, len(calls))


@gpu
def test_capped_layers_run_in_flash_attn_with_its_softcap():
    """Gemma 2's cap, window and packed documents in flash-attn's varlen kernel (bf16 on CUDA, flash-attn >= 2.6.2
    installed): the kernel the profile shows is the one `attention_kernel_name` names, output and gradients against
    float64."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    flash_attn = pytest.importorskip("flash_attn")
    q, dout = (randn(1, 4, L, 64, seed=s, dtype=torch.bfloat16, device="cuda") for s in (0, 3))
    k, v = (randn(1, 2, L, 64, seed=s, dtype=torch.bfloat16, device="cuda") for s in (1, 2))
    if not attention.capped_by_flash_attn(attention.flash_attn_release(attention._flash_varlen(q, capped=True)), 64, 64, False):
        pytest.skip(f"flash-attn {flash_attn.__version__} is not chosen for capped scores here (2.6.2 or later, sm80+)")
    config = AutoConfig.for_model("gemma2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  num_hidden_layers=2, sliding_window=9, attn_logit_softcapping=1.0)
    name = attention_kernel_name(config, "cuda", torch.bfloat16, packed=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        got = run(q, k, v, dout, 0.5, packed(), 9, softcap=1.0)
    ran = kernels_in_profile(prof.events())
    assert ran == ["flash-attn 2 varlen"] and name == "flash-attn 2 varlen with softcap", (ran, name)
    want = reference(q, k, v, dout, visible_pairs(L, L, "lower", DOCS, 9), 0.5, softcap=1.0)
    assert_matches(got, want, torch.bfloat16, "flash-attn softcap")


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
    ran = kernels_in_profile(prof.events())
    assert ran and global_name.startswith(ran[0]), (ran, name)
    assert_matches(got, reference(q, k, v, dout, visible_pairs(L, L, "lower"), 512**-0.5), dtype, "head size 512")


# What a profile calls each block kernel (`kernels_in_profile`).
BLOCK_KERNEL_OPS = {"CPU flash (aten)": "SDPA CPU flash", "FlashAttention-2 (aten)": "SDPA FlashAttention-2",
                    "memory-efficient (aten)": "SDPA memory-efficient"}


@pytest.mark.parametrize("device,dtype", CASES)
def test_sink_and_latent_layers_are_named_by_the_block_kernel_that_serves_them(device, dtype):
    """gpt-oss's layers with sinks and DeepSeek-V3's (query/key heads of 192, values of 128) run blockwise (the sinks
    need the logsumexp, SDPA takes one head width): `attention_kernel_name` names the block kernel at the padded width,
    and a profile of the call shows that kernel."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    oss = AutoConfig.for_model("gpt_oss", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                               num_hidden_layers=2, sliding_window=9)
    deepseek = AutoConfig.for_model("deepseek_v3", hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_hidden_layers=2)
    for config, sinks, (D, Dv, kv) in [(oss, frozenset({0, 1}), (64, 64, 2)), (deepseek, frozenset(), (192, 128, 4))]:
        block = kernels.block_kernel_name(torch.empty(1, 4, 8, D, dtype=dtype, device=device))
        name = attention_kernel_name(config, device, dtype, packed=True, sink_layers=sinks)
        assert name.startswith(f"blockwise over {block}"), name
        note = "sinks merged into the blocks' logsumexp" if sinks else "values zero-padded from 128 to 192"
        assert name.endswith(note), name
        like = dict(dtype=dtype, device=device)
        q, dout = randn(1, 4, L, D, seed=0, **like), randn(1, 4, L, Dv, seed=3, **like)
        k, v = randn(1, kv, L, D, seed=1, **like), randn(1, kv, L, Dv, seed=2, **like)
        sink_logits = randn(4, seed=4, dtype=torch.float32, device=device) if sinks else None
        with profile(activities=activities) as prof:
            run(q, k, v, dout, D**-0.5, packed(), sinks=sink_logits)
        assert kernels_in_profile(prof.events()) == [BLOCK_KERNEL_OPS[block]], (name, block)
