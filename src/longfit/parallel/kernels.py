"""Local attention kernels that expose the softmax log-sum-exp, and the exact merge of partial results.

Ring attention computes one query block against one visiting key/value block at a time, so it needs
a kernel that returns, besides the output, the log-sum-exp of each query row. With scores
s_ij = scale * q_i . k_j over the block's keys j:

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
gradient of the full attention. This is what the ring backward relies on.

Backends (their op schemas are the same on torch 2.6 .. 2.13):
- CPU: aten._scaled_dot_product_flash_attention_for_cpu and its _backward. GQA (fewer K/V heads) is
  handled inside the kernel from torch 2.9 on (pytorch#157893); older versions expand K/V heads.
- CUDA, fp16/bf16 on sm80+ with head_dim % 8 == 0 and <= 256: aten._scaled_dot_product_flash_attention
  and its _backward (the FlashAttention-2 kernel), GQA native.
- CUDA otherwise (e.g. fp32): aten._scaled_dot_product_efficient_attention and its _backward; it needs
  equal head counts, so K/V heads are expanded and dk/dv summed back over each group.
The flash_attn package is not used: its private forward/backward signatures changed between releases,
while the aten FlashAttention-2 op above has a stable schema.

`causal=True` masks top-left aligned (query i sees keys j <= i). Callers use it only on square blocks
whose queries and keys are the same tokens, where every kernel's convention agrees.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

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


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k, v))
        raise ValueError(f"expected q (B, H, Lq, D) and k, v (B, Hkv, Lk, D); got {shapes}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")


def check_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: str) -> None:
    """q (B, H, L, D) and k, v (B, Hkv, L, D) over the same tokens, H a multiple of Hkv."""
    B, H, L, D = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (L, D) or H % k.shape[1] != 0:
        raise ValueError(
            f"{method} attention expects q (B, H, L, D) and k, v (B, Hkv, L, D) with H a multiple of Hkv; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


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


def _efficient_forward(q, k, v, causal, scale):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))
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


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) fp32 (fp64 for fp64)."""
    _check(q, k, v)
    forward, _, native_gqa = _select(q)
    groups = q.shape[1] // k.shape[1]
    if not native_gqa:
        k, v = _expand_heads(k, groups), _expand_heads(v, groups)
    return forward(q, k, v, causal, scale)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attention_forward` for this block given the (possibly merged, final) out and lse.

    Shapes as in `attention_forward`; returns dq (B, H, Lq, D), dk and dv (B, Hkv, Lk, D).
    """
    _check(q, k, v)
    _, backward, native_gqa = _select(q)
    groups = q.shape[1] // k.shape[1]
    if native_gqa or groups == 1:
        return backward(dout, q, k, v, out, lse, causal, scale)
    dq, dk, dv = backward(dout, q, _expand_heads(k, groups), _expand_heads(v, groups), out, lse, causal, scale)
    return dq, _sum_heads(dk, groups), _sum_heads(dv, groups)
