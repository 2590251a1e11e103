"""Local attention kernels that expose the softmax log-sum-exp, and the exact merge of partial results.

Blockwise attention (the ring's blocks, sliding windows) computes one query block against one key/value
block at a time, so it needs a kernel that returns, besides the output, the log-sum-exp of each query
row. With scores s_ij = scale * q_i . k_j over the block's keys j:

    lse_i = log sum_j exp(s_ij)                      out_i = sum_j exp(s_ij - lse_i) v_j

Forward merge (`merge_partial`, the online softmax of Milakov & Gimelshein 2018 / FlashAttention):
two results over disjoint key sets A and B combine exactly as

    lse = log(exp(lse_A) + exp(lse_B))               out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B

since exp(s_j - lse) = exp(lse_A - lse) exp(s_j - lse_A) for j in A; both weights lie in [0, 1], so
nothing overflows, and the accumulation is done in fp32 (fp64 for fp64 inputs).

Backward (FlashAttention-2, Dao 2023, Alg. 2): given the FINAL out and lse of the whole softmax,

    P_ij = exp(s_ij - lse_i)   D_i = dout_i . out_i   dS_ij = P_ij (dout_i . v_j - D_i)
    dq_i = scale sum_j dS_ij k_j   dk_j = scale sum_i dS_ij q_i   dv_j = sum_i P_ij dout_i

P and D only involve the global lse and out, so `attention_backward` run on one key block with the
final out/lse returns exactly that block's share of the gradient; summing over blocks gives the
gradient of the full attention. This is what the ring backward and the sliding window rely on.

Masks of one block, query r (row) against key c (column) in block coordinates:
- FULL: every key;
- LOWER: c <= r, on a square block: the causal mask when queries and keys are the same tokens;
- UPPER: c >= r, on a square block: the far edge of a sliding window (window.py). Reversing the order of
  the queries and of the keys maps (r, c) to (m-1-r, m-1-c), and c >= r to m-1-c <= m-1-r: the UPPER
  block is the LOWER kernel run on the reversed block, whose output and lse are reversed back (and in
  backward dout, out, lse in, the gradients out).
LOWER is the kernels' top-left aligned `is_causal`; on square blocks every kernel's convention agrees.

Backends (their op schemas are the same on torch 2.6 .. 2.13):
- CPU: aten._scaled_dot_product_flash_attention_for_cpu and its _backward. GQA (fewer K/V heads) is
  handled inside the kernel from torch 2.9 on (pytorch#157893); older versions expand K/V heads.
- CUDA, fp16/bf16 on sm80+ with head_dim % 8 == 0 and <= 256: aten._scaled_dot_product_flash_attention
  and its _backward (the FlashAttention-2 kernel), GQA native.
- CUDA otherwise (e.g. fp32): aten._scaled_dot_product_efficient_attention and its _backward; it needs
  equal head counts, so K/V heads are expanded and dk/dv summed back over each group; its 16-bit kernels read
  16-byte aligned rows, so 16-bit heads not a multiple of 8 are zero-padded at the call and cut back (exact).
The flash_attn package is not used: its private forward/backward signatures changed between releases,
while the aten FlashAttention-2 op above has a stable schema. Nor is cuDNN's attention, although it returns
a logsumexp too and PyTorch's SDPA prefers it on Hopper: a block's backward is given the MERGED logsumexp,
so most of its scores lie far below it, which is where cuDNN's backward has been reported to return NaN
(NVIDIA/cudnn-frontend#1072); without a GPU to check that on, blocks keep FlashAttention-2
(`block_kernel_name` names the kernel).

Sliding-window kernel (`window_kernel_forward` / `_backward`, CUDA only, used by window.py when
`has_window_kernel`): the same FlashAttention-2 kernel through aten._flash_attention_forward/_backward,
whose window_size_left/right arguments bound the keys of query i to [i - left, i + right]. A window of
W keys counting the query itself (transformers' `sliding_window`: i - W < j <= i) is left = W - 1,
right = 0, with is_causal on a square self-attention block. UNVERIFIED on a GPU (no GPU was available
to this work): the op schema is read from torch 2.13, and a torch whose schema lacks the window
arguments takes window.py's exact blockwise path instead.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F

FULL, LOWER, UPPER = "full", "lower", "upper"
MASKS = (FULL, LOWER, UPPER)
_CPU_NATIVE_GQA = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups()) >= (2, 9)
_EFFICIENT_LSE_ALIGN = 32  # the efficient kernel pads its lse rows to a multiple of 32


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16/32-bit inputs, fp64 for fp64: the dtype of lse and of merge/gradient accumulators."""
    return torch.promote_types(dtype, torch.float32)


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets (module docstring): returns (out, lse).

    out (..., Lq, D) and lse (..., Lq) are the running result in the accumulation dtype; a query that
    has seen no key yet carries lse = -inf (and any finite out). block_out / block_lse come from
    `attention_forward` and may be lower precision.
    """
    merged_lse = torch.logaddexp(lse, block_lse.to(lse.dtype))
    # Rows with no key on either side stay at -inf; shifting them by 0 keeps both weights 0, not nan.
    shift = merged_lse.masked_fill(torch.isneginf(merged_lse), 0.0)
    merged_out = torch.exp(lse - shift).unsqueeze(-1) * out + torch.exp(block_lse.to(lse.dtype) - shift).unsqueeze(
        -1
    ) * block_out.to(out.dtype)
    return merged_out, merged_lse


def check_one_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: str) -> None:
    """Every kernel here reads q, k and v as one element type: the CUDA memory-efficient kernel takes its type
    from q and does not check v, so a mixed call would read v's buffer as q's type (models/attention.py's
    `kernel_dtype` is the one place that decides the type)."""
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"{method} attention needs q, k and v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}: "
            "call it through longfit.models.attention, whose entry casts them to `kernel_dtype`"
        )


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k, v))
        raise ValueError(f"expected q (B, H, Lq, D) and k, v (B, Hkv, Lk, D); got {shapes}")
    check_one_dtype(q, k, v, "block")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    assert mask in MASKS, f"unknown block mask {mask!r}"
    assert mask == FULL or q.shape[2] == k.shape[2], f"a {mask} block is square, got {q.shape[2]} x {k.shape[2]}"


def check_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: str) -> None:
    """q (B, H, L, D) and k, v (B, Hkv, L, D) over the same tokens, H a multiple of Hkv."""
    B, H, L, D = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (L, D) or H % k.shape[1] != 0:
        raise ValueError(
            f"{method} attention expects q (B, H, L, D) and k, v (B, Hkv, L, D) with H a multiple of Hkv; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_one_dtype(q, k, v, method)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _expand_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, Hkv * groups, L, D); query head h uses K/V head h // groups."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv * groups, L, D) -> (B, Hkv, L, D): the gradient of `_expand_heads`."""
    B, H, L, D = t.shape
    return t if groups == 1 else t.view(B, H // groups, groups, L, D).sum(dim=2)


def _use_cuda_flash(q: torch.Tensor) -> bool:
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


def _cpu_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _flash_forward(q, k, v, causal, scale):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    results = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return results[0], results[1]  # output (B, H, Lq, D), logsumexp (B, H, Lq) fp32


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))
    # The philox seed/offset are read only when dropout_p > 0; cum_seq_q/k are undefined for dense
    # inputs, exactly as the forward returns them.
    seed = torch.empty(2, dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale
    )
    return dq, dk, dv


def _head_multiple(dtype: torch.dtype) -> int:
    """The head width the efficient kernel needs a multiple of: its 16-bit kernels read rows 16-byte aligned
    ("query is not correctly aligned (strideM)" on bf16 heads of 100, issue #33); fp32/fp64 take any width."""
    return 8 if dtype in (torch.float16, torch.bfloat16) else 1


def _pad_heads(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (..., D) with zero columns appended up to `width` (t itself when D == width)."""
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def _padded_head_forward(forward, q, k, v, causal, scale, multiple):
    """`forward` run on q, k, v zero-padded to a head width that is a multiple of `multiple`; exact: the scores
    q.k are unchanged by zero columns (the scale is passed explicitly, never 1/sqrt of the padded width), and
    out's padded columns, averages of v's zero columns, are cut off."""
    width = q.shape[-1]
    padded = -(-width // multiple) * multiple
    if padded == width:
        return forward(q, k, v, causal, scale)
    if scale is None:
        scale = width**-0.5
    out, lse = forward(*(_pad_heads(t, padded) for t in (q, k, v)), causal, scale)
    return out[..., :width], lse


def _padded_head_backward(backward, dout, q, k, v, out, lse, causal, scale, multiple):
    """The gradients of `_padded_head_forward`: dout and out padded with zeros too (D_i = dout_i . out_i is
    unchanged), and each gradient's padded columns cut off (dq, dk: dS times the zero columns; dv: P dout's zero
    columns)."""
    width = q.shape[-1]
    padded = -(-width // multiple) * multiple
    if padded == width:
        return backward(dout, q, k, v, out, lse, causal, scale)
    if scale is None:
        scale = width**-0.5
    grads = backward(*(_pad_heads(t, padded) for t in (dout, q, k, v, out)), lse, causal, scale)
    return tuple(g[..., :width] for g in grads)


def _efficient_forward(q, k, v, causal, scale):
    return _padded_head_forward(_efficient_forward_op, q, k, v, causal, scale, _head_multiple(q.dtype))


def _efficient_forward_op(q, k, v, causal, scale):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _sequence_major(t: torch.Tensor) -> torch.Tensor:
    """t (B, H, L, D) laid out (B, L, H, D)-contiguous, the layout the efficient forward returns its output in."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    multiple = _head_multiple(q.dtype)
    return _padded_head_backward(_efficient_backward_op, dout, q, k, v, out, lse, causal, scale, multiple)


def _efficient_backward_op(dout, q, k, v, out, lse, causal, scale):
    # In 16 bits the kernel computes D_i = dout_i . out_i assuming out and dout are (B, L, H, D)-contiguous, as
    # its forward made out; longfit's merged outputs (blockwise, ring, the flipped UPPER blocks) are
    # (B, H, L, D)-contiguous, which it would read with the wrong stride (issue #33): give it its layout.
    dout, out = _sequence_major(dout), _sequence_major(out)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    padding = -lse.shape[-1] % _EFFICIENT_LSE_ALIGN
    lse = F.pad(lse, (0, padding)).contiguous()  # the layout the forward produced
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


def _select(q: torch.Tensor):
    """(forward, backward, handles GQA natively) for q's device and dtype."""
    if q.device.type == "cpu":
        return _cpu_forward, _cpu_backward, _CPU_NATIVE_GQA
    if q.device.type == "cuda":
        if _use_cuda_flash(q):
            return _flash_forward, _flash_backward, True
        return _efficient_forward, _efficient_backward, False
    raise NotImplementedError(f"longfit's attention kernels run on CPU and CUDA tensors, got device {q.device}")


def block_kernel_name(q: torch.Tensor) -> str:
    """The kernel `attention_forward` and `attention_backward` run for blocks like q (device, dtype, head_dim)."""
    forward, _, _ = _select(q)
    names = {_cpu_forward: "CPU flash (aten)", _flash_forward: "FlashAttention-2 (aten)",
             _efficient_forward: "memory-efficient (aten)"}
    return names[forward]


def _forward(q, k, v, causal, scale):
    forward, _, native_gqa = _select(q)
    groups = q.shape[1] // k.shape[1]
    if not native_gqa:
        k, v = _expand_heads(k, groups), _expand_heads(v, groups)
    return forward(q, k, v, causal, scale)


def _backward(dout, q, k, v, out, lse, causal, scale):
    _, backward, native_gqa = _select(q)
    groups = q.shape[1] // k.shape[1]
    if native_gqa or groups == 1:
        return backward(dout, q, k, v, out, lse, causal, scale)
    dq, dk, dv = backward(dout, q, _expand_heads(k, groups), _expand_heads(v, groups), out, lse, causal, scale)
    return dq, _sum_heads(dk, groups), _sum_heads(dv, groups)


def _reversed(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor with its sequence axis (dim 2: (B, h, L, D) and (B, H, L) alike) in reverse order."""
    return [t.flip(2) for t in tensors]


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) fp32 (fp64 for fp64).

    `mask` is FULL, LOWER or UPPER (module docstring; LOWER and UPPER on square blocks).
    """
    _check(q, k, v, mask)
    if mask == UPPER:
        out, lse = _forward(*_reversed(q, k, v), True, scale)
        return out.flip(2), lse.flip(2)
    return _forward(q, k, v, mask == LOWER, scale)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attention_forward` for this block given the (possibly merged, final) out and lse.

    Shapes as in `attention_forward`; returns dq (B, H, Lq, D), dk and dv (B, Hkv, Lk, D).
    """
    _check(q, k, v, mask)
    if mask == UPPER:
        return tuple(_reversed(*_backward(*_reversed(dout, q, k, v, out, lse), True, scale)))
    return _backward(dout, q, k, v, out, lse, mask == LOWER, scale)


@functools.cache
def _flash_op_has_window() -> bool:
    return "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)


def has_window_kernel(q: torch.Tensor) -> bool:
    """Whether `window_kernel_forward` runs for q: a FlashAttention-2 dtype on CUDA, and an op with window arguments."""
    return q.device.type == "cuda" and _use_cuda_flash(q) and _flash_op_has_window()


def window_kernel_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window causal self-attention (i - window < j <= i) of q (B, H, L, D), k/v (B, Hkv, L, D), one call.

    Returns out (B, H, L, D) and lse (B, H, L) fp32, as `attention_forward`. CUDA only (`has_window_kernel`).
    """
    check_one_dtype(q, k, v, "sliding-window")
    length = q.shape[2]
    q, k, v = (_last_dim_contiguous(t.transpose(1, 2)) for t in (q, k, v))  # (B, L, h, D): the op's layout
    results = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, length, length, 0.0, True, False,
        scale=scale, window_size_left=window - 1, window_size_right=0,
    )
    return results[0].transpose(1, 2), results[1]


def window_kernel_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `window_kernel_forward` given the final out and lse; shapes as `attention_backward`."""
    length = q.shape[2]
    dout, q, k, v, out = (_last_dim_contiguous(t.transpose(1, 2)) for t in (dout, q, k, v, out))
    # The rng state is read only when dropout_p > 0; cum_seq_q/k are undefined for dense inputs.
    seed = torch.empty(2, dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    grads = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, length, length, 0.0, True, seed, offset,
        scale=scale, window_size_left=window - 1, window_size_right=0,
    )
    return tuple(g.transpose(1, 2) for g in grads)
