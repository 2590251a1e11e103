"""longfit's attention on every backend it chooses, against float64: output, logsumexp and gradients.

What longfit runs (models/kernels.py, models/attention.py, models/blockwise.py):
- the blockwise kernels with logsumexp (ring attention's blocks, the sliding window's tiles): on the CPU
  aten's flash kernel for CPU; on CUDA FlashAttention-2 for 16-bit inputs with head_dim % 8 == 0 and
  <= 256 on sm80+, the memory-efficient kernel otherwise (fp32 here, 16-bit forced);
- sliding-window layers on CUDA in 16 bits: FlashAttention-2 with its window argument, else blockwise;
- one document per row: F.scaled_dot_product_attention, whichever SDPA backend torch picks (each one
  also forced here: another torch may pick it);
- packed documents: flash-attn's varlen kernel when installed (CUDA, 16 bits; flash-attn 3 on Hopper also takes
  one-document rows), else one SDPA call per document. Each flash-attn version is tested by itself when installed.
The CPU cases run by default; the CUDA ones with `python -m pytest -m gpu`. Tolerances: tests/gpu_helpers.py.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import (
    LSE_TOLERANCE,
    TOLERANCE,
    assert_close_to_reference,
    randn,
    reference_gradients,
    visible_pairs,
)

from longfit.data.packing import DocumentLayout
from longfit.models import attention, blockwise, kernels
from longfit.models.attention import local_attention
from longfit.models.kernels import (
    FULL,
    LOWER,
    UPPER,
    accumulation_dtype,
    attention_backward,
    attention_forward,
    merge_partial,
)

gpu = pytest.mark.gpu
D, SCALE = 64, 0.125  # scores of unit-variance q, k are then unit-variance too

KERNELS = [  # (device, dtype, the kernel longfit runs)
    pytest.param("cpu", torch.float32, "cpu", id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, "cpu", id="cpu-bf16"),
    pytest.param("cuda", torch.bfloat16, "flash", id="cuda-bf16-flash", marks=gpu),
    pytest.param("cuda", torch.float16, "flash", id="cuda-fp16-flash", marks=gpu),
    pytest.param("cuda", torch.float32, "efficient", id="cuda-fp32-efficient", marks=gpu),
    pytest.param("cuda", torch.bfloat16, "efficient", id="cuda-bf16-efficient", marks=gpu),
]
FORWARD = {"cpu": kernels._cpu_forward, "flash": kernels._flash_forward, "efficient": kernels._efficient_forward}


def use_kernel(monkeypatch, backend: str, q: torch.Tensor) -> None:
    """Make longfit choose `backend` for q, and check that it does."""
    if backend == "flash" and not kernels._use_cuda_flash(q):
        pytest.skip(f"no FlashAttention-2 for {q.dtype} on this GPU (sm{''.join(map(str, torch.cuda.get_device_capability()))})")
    if backend == "efficient" and q.dtype != torch.float32:
        # 16-bit inputs reach the efficient kernel where flash cannot take them (head_dim, pre-Ampere GPUs)
        monkeypatch.setattr(kernels, "_use_cuda_flash", lambda q: False)
    assert kernels._select(q)[0] is FORWARD[backend]


SHAPES = [  # (H, Hkv, Lq, Lk, mask); lengths off multiples of 32, where the efficient kernel pads its lse
    (8, 8, 50, 50, LOWER),
    (8, 2, 50, 50, LOWER),
    (8, 2, 37, 37, UPPER),
    (8, 1, 24, 70, FULL),
    (8, 4, 70, 24, FULL),
]


@pytest.mark.parametrize("H,Hkv,Lq,Lk,mask", SHAPES)
@pytest.mark.parametrize("device,dtype,backend", KERNELS)
def test_kernel_output_logsumexp_and_gradients(monkeypatch, device, dtype, backend, H, Hkv, Lq, Lk, mask):
    q, dout = randn(2, H, Lq, D, seed=0, dtype=dtype, device=device), randn(2, H, Lq, D, seed=3, dtype=dtype, device=device)
    k, v = (randn(2, Hkv, Lk, D, seed=s, dtype=dtype, device=device) for s in (1, 2))
    use_kernel(monkeypatch, backend, q)
    out, lse = attention_forward(q, k, v, mask, SCALE)
    assert out.dtype == dtype and lse.dtype == accumulation_dtype(dtype) and lse.shape == (2, H, Lq)
    grads = attention_backward(dout, q, k, v, out, lse, mask, SCALE)
    want = reference_gradients(q, k, v, dout, visible_pairs(Lq, Lk, None if mask == FULL else mask), SCALE)
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
        assert got.device.type == device and got.shape == ref.shape, name
        assert_close_to_reference(got, ref, (LSE_TOLERANCE if name == "lse" else TOLERANCE)[dtype], name)


@pytest.mark.parametrize("device,dtype,backend", KERNELS)
def test_key_blocks_merged_by_logsumexp_give_the_whole_attention(monkeypatch, device, dtype, backend):
    """The ring's and the sliding window's identity on each kernel: the forward over two key blocks merged by
    their logsumexp in fp32, then each block's backward with the FINAL output (in the input dtype, as the
    ring keeps it) and logsumexp, summed, give the attention over all keys and its gradients."""
    H, Hkv, L, half = 8, 2, 96, 48
    q, dout = randn(2, H, L, D, seed=4, dtype=dtype, device=device), randn(2, H, L, D, seed=7, dtype=dtype, device=device)
    k, v = (randn(2, Hkv, L, D, seed=s, dtype=dtype, device=device) for s in (5, 6))
    use_kernel(monkeypatch, backend, q)
    queries, blocks = slice(half, L), [(slice(0, half), FULL), (slice(half, L), LOWER)]
    qs, dout_s = q[:, :, queries], dout[:, :, queries]  # the later chunk: an earlier block and its own diagonal
    acc = accumulation_dtype(dtype)
    out = torch.zeros(2, H, half, D, dtype=acc, device=device)
    lse = torch.full((2, H, half), float("-inf"), dtype=acc, device=device)
    for keys, mask in blocks:
        out, lse = merge_partial(out, lse, *attention_forward(qs, k[:, :, keys], v[:, :, keys], mask, SCALE))
    out = out.to(dtype)
    dq = torch.zeros_like(qs, dtype=acc)
    dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for keys, mask in blocks:
        block_dq, block_dk, block_dv = attention_backward(dout_s, qs, k[:, :, keys], v[:, :, keys], out, lse, mask, SCALE)
        dq += block_dq
        dk[:, :, keys] += block_dk
        dv[:, :, keys] += block_dv
    want = reference_gradients(qs, k, v, dout_s, visible_pairs(L, L, LOWER)[queries], SCALE)
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        assert_close_to_reference(got, ref, (LSE_TOLERANCE if name == "lse" else TOLERANCE)[dtype], name)


# -- whole rows through longfit's attention function --------------------------------------------------

B, H, L = 2, 8, 160
DOCUMENTS = [[37, 90, 33], [160]]  # per row; row 0 has documents shorter and longer than WINDOW
WINDOW = 24


def rows_case(kv_heads: int, dtype: torch.dtype, device: str):
    q, dout = randn(B, H, L, D, seed=10, dtype=dtype, device=device), randn(B, H, L, D, seed=13, dtype=dtype, device=device)
    k, v = (randn(B, kv_heads, L, D, seed=s, dtype=dtype, device=device) for s in (11, 12))
    return q, k, v, dout


def cu_seqlens(device: str) -> torch.Tensor:
    """Document starts over the flattened B x L tokens (flash-attn's convention), as the packing makes them."""
    lengths = torch.tensor([n for row in DOCUMENTS for n in row])
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).to(device)


def check_rows(q, k, v, dout, visible, dtype, cu_seqlens=None, window=None) -> None:
    """local_attention's output and autograd gradients against float64 with `visible` (B, L, L)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    documents = None if cu_seqlens is None else DocumentLayout.from_cu_seqlens(cu_seqlens, q.shape[0])
    out = local_attention(*leaves, SCALE, documents, window)
    assert out.dtype == dtype and out.shape == q.shape
    got = (out, *torch.autograd.grad(out, leaves, dout))
    out_ref, _, *grads_ref = reference_gradients(q, k, v, dout, visible, SCALE)
    for name, value, ref in zip(("out", "dq", "dk", "dv"), got, (out_ref, *grads_ref)):
        assert_close_to_reference(value, ref, TOLERANCE[dtype], name)


def row_visibility(causal_window: int | None = None, packed: bool = False) -> torch.Tensor:
    return torch.stack([
        visible_pairs(L, L, LOWER, documents=row if packed else None, window=causal_window) for row in DOCUMENTS
    ])


ROWS = [  # (device, dtype): longfit's own choice of backend
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=gpu),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=gpu),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=gpu),
]


@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("device,dtype", ROWS)
def test_causal_rows(device, dtype, kv_heads):
    check_rows(*rows_case(kv_heads, dtype, device), row_visibility(), dtype)


SDPA_BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]


@gpu
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_causal_rows_on_each_sdpa_backend(monkeypatch, backend, dtype, kv_heads):
    """One document per row goes to F.scaled_dot_product_attention, which picks its backend by torch version,
    GPU, dtype and shape: each one it may pick must give the same attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout = rows_case(kv_heads, dtype, "cuda")
    # with flash-attn 3 installed on Hopper one-document rows go to it, and the forced backend would never run
    monkeypatch.setattr(attention, "_flash_varlen", lambda q, capped=False: None)
    try:
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            check_rows(q, k, v, dout, row_visibility(), dtype)
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        pytest.skip(f"SDPA's {backend} takes no {dtype} with {kv_heads} K/V heads here, so torch never picks it")


FLASH_ATTN = {"flash-attn 2": ("flash_attn", (8, 0)), "flash-attn 3": ("flash_attn_interface", (9, 0))}


def use_flash_attn(monkeypatch, version: str, q: torch.Tensor) -> None:
    """Make longfit run flash-attn `version`'s varlen kernel for q (both may be installed: each is tested)."""
    module, least = FLASH_ATTN[version]
    kernel = pytest.importorskip(module).flash_attn_varlen_func
    if torch.cuda.get_device_capability() < least or (version == "flash-attn 3" and torch.cuda.get_device_capability()[0] != 9):
        pytest.skip(f"{version} does not run on sm{''.join(map(str, torch.cuda.get_device_capability()))}")
    monkeypatch.setattr(attention, "_flash_varlen", lambda q, capped=False: (version, kernel))


@gpu
@pytest.mark.parametrize("version", FLASH_ATTN)
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_causal_rows_on_flash_attn(monkeypatch, version, kv_heads):
    """One document per row through flash-attn's varlen kernel (longfit sends them to flash-attn 3 on Hopper)."""
    q, k, v, dout = rows_case(kv_heads, torch.bfloat16, "cuda")
    use_flash_attn(monkeypatch, version, q)
    calls = []
    varlen = attention._flash_varlen_attention
    monkeypatch.setattr(attention, "_flash_varlen_attention", lambda *a: calls.append(1) or varlen(*a))
    check_rows(q, k, v, dout, row_visibility(), torch.bfloat16, cu_seqlens=None)
    assert calls or version == "flash-attn 2"  # flash-attn 2 leaves one-document rows to SDPA


PACKED = [  # (device, dtype, path)
    pytest.param("cpu", torch.float32, "per-document", id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, "per-document", id="cpu-bf16"),
    pytest.param("cuda", torch.bfloat16, "per-document", id="cuda-bf16-per-document", marks=gpu),
    pytest.param("cuda", torch.float32, "per-document", id="cuda-fp32-per-document", marks=gpu),
    pytest.param("cuda", torch.bfloat16, "flash-attn 2", id="cuda-bf16-flash-attn-2-varlen", marks=gpu),
    pytest.param("cuda", torch.bfloat16, "flash-attn 3", id="cuda-bf16-flash-attn-3-varlen", marks=gpu),
]


@pytest.mark.parametrize("device,dtype,path", PACKED)
def test_packed_documents(monkeypatch, device, dtype, path):
    q, k, v, dout = rows_case(2, dtype, device)
    if path in FLASH_ATTN:
        use_flash_attn(monkeypatch, path, q)
    else:
        monkeypatch.setattr(attention, "_flash_varlen", lambda q, capped=False: None)
    check_rows(q, k, v, dout, row_visibility(packed=True), dtype, cu_seqlens=cu_seqlens(device))


WINDOWED = [  # (device, dtype, path)
    pytest.param("cpu", torch.float32, "blockwise", id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, "blockwise", id="cpu-bf16"),
    pytest.param("cuda", torch.bfloat16, "window kernel", id="cuda-bf16-window-kernel", marks=gpu),
    pytest.param("cuda", torch.float16, "window kernel", id="cuda-fp16-window-kernel", marks=gpu),
    pytest.param("cuda", torch.bfloat16, "blockwise", id="cuda-bf16-blockwise", marks=gpu),
    pytest.param("cuda", torch.float32, "blockwise", id="cuda-fp32-blockwise", marks=gpu),
]


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
@pytest.mark.parametrize("device,dtype,path", WINDOWED)
def test_sliding_window(monkeypatch, device, dtype, path, packed):
    q, k, v, dout = rows_case(2, dtype, device)
    if path == "window kernel":
        if not kernels.has_window_kernel(q):
            pytest.skip("this torch's FlashAttention-2 op has no window arguments: longfit runs the blockwise window")
    else:
        monkeypatch.setattr(blockwise, "has_window_kernel", lambda q: False)
    check_rows(q, k, v, dout, row_visibility(WINDOW, packed), dtype, cu_seqlens=cu_seqlens(device) if packed else None,
               window=WINDOW)


def patch_efficient_op(monkeypatch, name: str, op) -> None:
    """Replace torch.ops.aten.<name> by a recording `op` for one test; torch.distributed.tensor is imported first,
    since it registers strategies for aten's real ops when imported (torch.testing.assert_close imports it lazily)."""
    import torch.distributed.tensor  # noqa: F401

    monkeypatch.setattr(torch.ops.aten, name, op)


def test_the_efficient_backward_gets_out_and_dout_in_its_forward_layout(monkeypatch):
    """The CUDA memory-efficient backward reads out and dout as (B, L, H, D)-contiguous (its delta kernel in
    16 bits); longfit's merged outputs are (B, H, L, D)-contiguous, so `_efficient_backward` must lay them out
    (issue #33: dq and dk were wrong, reading past the tensor). The op is recorded, not run: a CPU check."""
    seen = {}

    def recording_op(dout, q, k, v, bias, out, lse, *args, **kwargs):
        seen.update(dout=dout, out=out)
        return q, k, v, None

    patch_efficient_op(monkeypatch, "_scaled_dot_product_efficient_attention_backward", recording_op)
    q, k, v, out, dout = (randn(2, 4, 40, D, seed=s, dtype=torch.bfloat16, device="cpu") for s in range(5))
    assert out.is_contiguous()  # (B, H, L, D)-contiguous, as merged outputs are
    kernels._efficient_backward(dout, q, k, v, out, torch.zeros(2, 4, 40), True, SCALE)
    for name, given in (("dout", dout), ("out", out)):
        assert seen[name].transpose(1, 2).is_contiguous(), name
        torch.testing.assert_close(seen[name], given, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [SCALE, None], ids=["scale", "default-scale"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_heads_zero_padded_for_the_efficient_kernel_give_the_unpadded_result(dtype, scale, causal):
    """The padding the CUDA efficient path wraps its op in (16-bit heads to a multiple of 8, issue #33), run here
    around the CPU kernel on heads of 100 -> 104: output, lse and the three gradients equal the unpadded kernel's,
    widths cut back to 100 (the default scale stays 1/sqrt(100), not 1/sqrt(104))."""
    H, L, width = 4, 37, 100
    q, dout = (randn(2, H, L, width, seed=s, dtype=dtype, device="cpu") for s in (0, 3))
    k, v = (randn(2, H, L, width, seed=s, dtype=dtype, device="cpu") for s in (1, 2))
    out, lse = kernels._cpu_forward(q, k, v, causal, scale)
    padded_out, padded_lse = kernels._padded_head_forward(kernels._cpu_forward, q, k, v, causal, scale, 8)
    assert padded_out.shape == out.shape
    tolerance = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(padded_out, out, **(dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else tolerance))
    torch.testing.assert_close(padded_lse, lse, rtol=1e-6, atol=1e-6)
    want = kernels._cpu_backward(dout, q, k, v, out, lse, causal, scale)
    got = kernels._padded_head_backward(kernels._cpu_backward, dout, q, k, v, out, lse, causal, scale, 8)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2, msg=name)


def test_the_efficient_op_gets_16_bit_heads_padded_to_a_multiple_of_8(monkeypatch):
    """bf16 heads of 100 reach the efficient op 104 wide, 16-byte aligned rows (the op is recorded, not run: a CPU
    check); fp32 heads go as they are; what longfit returns is 100 wide again."""
    seen = {}

    def forward_op(q, k, v, bias, compute_lse, dropout, causal, scale=None):
        seen["forward"] = (q, k, v, scale)
        return torch.zeros_like(q), torch.zeros(*q.shape[:3]), None, None

    def backward_op(dout, q, k, v, bias, out, lse, *args, scale=None):
        seen["backward"] = (dout, q, k, v, out, scale)
        return q * 0 + 1, k * 0 + 1, v * 0 + 1, None

    patch_efficient_op(monkeypatch, "_scaled_dot_product_efficient_attention", forward_op)
    patch_efficient_op(monkeypatch, "_scaled_dot_product_efficient_attention_backward", backward_op)
    for dtype, sent in ((torch.bfloat16, 104), (torch.float16, 104), (torch.float32, 100)):
        q, k, v, dout = (randn(2, 4, 40, 100, seed=s, dtype=dtype, device="cpu") for s in range(4))
        out, lse = kernels._efficient_forward(q, k, v, True, SCALE)
        assert out.shape == q.shape and lse.shape == q.shape[:3]
        assert all(t.shape[-1] == sent and t.stride(-2) * t.element_size() % 16 == 0 for t in seen["forward"][:3])
        assert seen["forward"][3] == SCALE
        if sent != 100:
            torch.testing.assert_close(seen["forward"][0][..., :100], q, rtol=0, atol=0)
            assert not seen["forward"][2][..., 100:].any()
        grads = kernels._efficient_backward(dout, q, k, v, out, lse, True, SCALE)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert all(t.shape[-1] == sent for t in seen["backward"][:5]) and seen["backward"][5] == SCALE
        if sent != 100:
            assert not seen["backward"][0][..., 100:].any() and not seen["backward"][4][..., 100:].any()


@gpu
@pytest.mark.parametrize("head_dim", [100, 320, 512], ids=["d100", "d320", "d512"])
@pytest.mark.parametrize("mask", [LOWER, UPPER, FULL])
def test_16_bit_heads_flash_cannot_take_go_to_the_efficient_kernel_exactly(head_dim, mask):
    """bf16 heads not a multiple of 8 or above 256 (Gemma 4's global layers: 512) run the memory-efficient kernel,
    chosen by longfit itself; its backward given a merged, (B, H, L, D)-contiguous output (as blockwise, the
    ring and tiled layers give it) matches float64, and so does the same output laid out as its forward made it."""
    dtype, Lq = torch.bfloat16, 50
    q, dout = randn(2, 4, Lq, head_dim, seed=0, dtype=dtype, device="cuda"), randn(2, 4, Lq, head_dim, seed=3, dtype=dtype, device="cuda")
    k, v = (randn(2, 2, Lq, head_dim, seed=s, dtype=dtype, device="cuda") for s in (1, 2))
    assert kernels._select(q)[0] is kernels._efficient_forward
    scale = head_dim**-0.5
    out, lse = attention_forward(q, k, v, mask, scale)
    want = reference_gradients(q, k, v, dout, visible_pairs(Lq, Lq, None if mask == FULL else mask), scale)
    for layout in ("merged", "forward"):
        given = out.contiguous() if layout == "merged" else out
        grads = attention_backward(dout.contiguous(), q, k, v, given, lse, mask, scale)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
            assert_close_to_reference(got, ref, TOLERANCE[dtype], f"{layout} {name}")
