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

Query/key and value head sizes may differ (DeepSeek-V3's multi-head latent attention: 192 and 128). The
aten kernels take one head size, so a call pads the narrower side with zeros up to the wider (`_same_width`):
zero columns of q and k add 0 to every score, zero columns of v give output columns of 0 that are cut off,
and in backward zero columns of dout and out leave D_i = dout_i . out_i unchanged; the gradients of the
padding are dropped. Nothing else changes, and the caller (ring exchange, Ulysses all-to-all) moves K and
V at their own widths.

Attention-logit softcapping (Gemma 2: s'_ij = c tanh(s_ij / c) replaces every score before the softmax).
The softmax identities above hold for s' as for s, so the merge and the final-lse backward are unchanged;
only a block's own kernel changes. No aten kernel caps its scores, so a capped block runs `_softcap_forward`
/ `_softcap_backward`: the scores of a slice of the block's queries at a time (memory linear in the block's keys,
never Lq x Lk; `slice_rows`), in the accumulation dtype, with the chain rule through the cap:

    t_ij = tanh(s_ij / c)   s'_ij = c t_ij   P_ij = exp(s'_ij - lse_i)   dS'_ij = P_ij (dout_i . v_j - D_i)
    dS_ij = dS'_ij (1 - t_ij^2)   dq_i = scale sum_j dS_ij k_j   dk_j = scale sum_i dS_ij q_i   dv_j = sum_i P_ij dout_i

Both run with autocast off, on the inputs as given and in the accumulation dtype: under a caller's bf16 autocast
(the Trainer's, Accelerate's, longfit's own on fp32 weights) the forward's products would otherwise be rounded to
bf16 while the backward, which autograd runs outside that autocast, recomputes them in fp32 against the bf16
forward's logsumexp (probability rows summing to 1.2 at score std ~9: gradients 7-10% off).

Attention sinks (gpt-oss: a learned logit z_h per head that joins every query's softmax denominator and
carries no value). The sink is one more key of value 0 and score z_h, so it merges like any block
(`merge_sinks`): lse' = log(exp(lse) + exp(z)), out' = exp(lse - lse') out = out sigmoid(lse - z). Merged
once into the FINAL (out, lse) of a query -- after the ring, the Ulysses call or the tiles -- it leaves the
backward of every real block as it is (given out' and lse'), and its own share is the gradient of its
score: dz_h = sum_i dS_i,sink = -sum_i exp(z_h - lse'_i) D_i, D_i = dout_i . out'_i (`sink_gradient`).

Sliding-window kernel (`window_kernel_forward` / `_backward`, CUDA only, used by window.py when
`has_window_kernel`): the same FlashAttention-2 kernel through aten._flash_attention_forward/_backward,
whose window_size_left/right arguments bound the keys of query i to [i - left, i + right]. A window of
W keys counting the query itself (transformers' `sliding_window`: i - W < j <= i) is left = W - 1,
right = 0, with is_causal on a square self-attention block. UNVERIFIED on a GPU (no GPU was available
to this work): the op schema is read from torch 2.13, and a torch whose schema lacks the window
arguments takes window.py's exact blockwise path instead.
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch
import torch.nn.functional as F

FULL, LOWER, UPPER = "full", "lower", "upper"
MASKS = (FULL, LOWER, UPPER)
_CPU_NATIVE_GQA = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups()) >= (2, 9)
_EFFICIENT_LSE_ALIGN = 32  # the efficient kernel pads its lse rows to a multiple of 32
_SCORE_ELEMENTS = 1 << 16  # CPU: a softcapped block forms the scores of at most this many query-key pairs per (B, H)
# CUDA: at most this many bytes of scores a slice, over every (B, H). A slice is ~30 kernel launches (~150 us), so
# slices of 65,536 pairs a head were one query row at 64K keys (131,072 slices of a 128K block, launch-bound); 64 MiB
# is 16 rows of 8 fp32 heads of 256 at 131,072 keys (8,192 slices), whose product alone is 8.6 GFLOP (~170 us of
# fp32 on an H100/H200), and the slice's few fp32 temporaries stay near 300 MiB (the traced plan, on CPU fake
# tensors, sees the CPU's slices).
_CUDA_SLICE_BYTES = 1 << 26


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


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the attention sinks (module docstring) into a FINAL out (B, H, L, Dv) and lse (B, H, L): the
    sink of head h, sinks[h], is a key of value 0 seen by every query of the head. Returns (out', lse')."""
    sink = sinks.detach().to(lse.dtype).view(1, -1, 1)
    merged = torch.logaddexp(lse, sink)
    return torch.exp(lse - merged).unsqueeze(-1) * out, merged


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (H,) given dout and the sink-merged final out (B, H, L, Dv) and lse (B, H, L) of the
    queries at hand: -sum_i exp(z_h - lse_i) dout_i . out_i (module docstring)."""
    acc = lse.dtype
    weight = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse)
    return -(weight * (dout.to(acc) * out.to(acc)).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)


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
    if q.dim() != 4 or k.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k, v))
        raise ValueError(f"expected q (B, H, Lq, D), k (B, Hkv, Lk, D) and v (B, Hkv, Lk, Dv); got {shapes}")
    check_one_dtype(q, k, v, "block")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    assert mask in MASKS, f"unknown block mask {mask!r}"
    assert mask == FULL or q.shape[2] == k.shape[2], f"a {mask} block is square, got {q.shape[2]} x {k.shape[2]}"


def check_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: str) -> None:
    """q (B, H, L, D), k (B, Hkv, L, D) and v (B, Hkv, L, Dv) over the same tokens, H a multiple of Hkv."""
    B, H, L, D = q.shape
    if (
        k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[2:] != (L, D)
        or H % k.shape[1] != 0
    ):
        raise ValueError(
            f"{method} attention expects q (B, H, L, D) and k, v (B, Hkv, L, D) and (B, Hkv, L, Dv) over the same "
            "tokens, H a multiple of Hkv; "
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
    if q.device.type in ("cpu", "meta"):
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


def _pad_width(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def _forward(q, k, v, causal, scale):
    forward, _, native_gqa = _select(q)
    groups = q.shape[1] // k.shape[1]
    if not native_gqa:
        k, v = _expand_heads(k, groups), _expand_heads(v, groups)
    width, value_width = max(q.shape[-1], v.shape[-1]), v.shape[-1]
    out, lse = forward(_pad_width(q, width), _pad_width(k, width), _pad_width(v, width), causal, scale)
    return out[..., :value_width], lse


def _backward(dout, q, k, v, out, lse, causal, scale):
    _, backward, native_gqa = _select(q)
    groups = q.shape[1] // k.shape[1]
    expand = not native_gqa and groups > 1
    if expand:
        k, v = _expand_heads(k, groups), _expand_heads(v, groups)
    qk_width, value_width = q.shape[-1], v.shape[-1]
    width = max(qk_width, value_width)
    padded = [_pad_width(t, width) for t in (dout, q, k, v, out)]
    dq, dk, dv = backward(padded[0], *padded[1:4], padded[4], lse, causal, scale)
    dq, dk, dv = dq[..., :qk_width], dk[..., :qk_width], dv[..., :value_width]
    if expand:
        return dq, _sum_heads(dk, groups), _sum_heads(dv, groups)
    return dq, dk, dv


def _capped_scores(q, k, scale, softcap, mask, first_query):
    """The capped scores of queries [first_query, + Lq) of a block against all its keys, in the accumulation
    dtype, GQA grouped: q (B, Hkv, g, Lq, D), k (B, Hkv, 1, Lk, D) -> (scores (B, Hkv, g, Lq, Lk) with
    invisible pairs at -inf, tanh(s / c))."""
    tanh = torch.tanh(scale * (q @ k.transpose(-1, -2)) / softcap)
    scores = softcap * tanh
    if mask != FULL:
        rows = torch.arange(first_query, first_query + q.shape[-2], device=q.device).unsqueeze(1)
        cols = torch.arange(k.shape[-2], device=q.device).unsqueeze(0)
        hidden = cols > rows if mask == LOWER else cols < rows
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores, tanh


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, Hkv, H / Hkv, L, D): query head h meets K/V head h // (H / Hkv)."""
    B, H, L, D = t.shape
    return t.view(B, kv_heads, H // kv_heads, L, D)


def slice_rows(device_type: str, batch_heads: int, keys: int, element_bytes: int) -> int:
    """Query rows a softcapped block scores at a time against its `keys` keys, for `batch_heads` = B x H query heads
    whose scores take `element_bytes` each: on CUDA as many as fit in _CUDA_SLICE_BYTES (launches dominate small
    slices), elsewhere _SCORE_ELEMENTS pairs a head (memory linear in the keys)."""
    if device_type == "cuda":
        return max(1, _CUDA_SLICE_BYTES // (batch_heads * max(1, keys) * element_bytes))
    return max(1, _SCORE_ELEMENTS // max(1, keys))


def _query_slices(q: torch.Tensor, k: torch.Tensor) -> list[slice]:
    element_bytes = accumulation_dtype(q.dtype).itemsize
    rows = slice_rows(q.device.type, q.shape[0] * q.shape[1], k.shape[2], element_bytes)
    # the slices' starts, a range: a traced block keeps three of them, not a list of every slice made first (a capped
    # global layer of Gemma 2's traces at 49,152 keys: a slice a row, #52)
    starts = range(0, q.shape[2], rows)
    traced = _traced_slices(starts, q)
    if len(traced) < len(starts) and q.shape[2] % rows == 0:
        traced = traced[:2]  # the last slice is as long as the second, and holds what it holds (`_traced_slices`)
    return [slice(i, min(i + rows, q.shape[2])) for i in traced]


def _traced_slices(slices, q: torch.Tensor):
    """The query `slices` (a sequence) a capped block runs: all of them, or on fake tensors (the planner's traces: no
    values, only allocations) the first two and the last. A slice's tensors depend on its length alone and are
    allocated anew each time, the previous slice's held until they are replaced, so every full slice from the second
    on holds what the second holds, and the outputs are allocated whole before the first: the live bytes of the three
    are those of all of them, at every peak (`test_a_capped_block_traced_in_three_slices_holds_what_all_its_slices_hold`).
    Every slice cost Gemma 2's traced layers (a window of 4,096 keys: 16 rows a slice) thousands of slices a length."""
    if len(slices) > 3 and (q.device.type == "meta" or isinstance(q, torch._subclasses.fake_tensor.FakeTensor)):
        return [*slices[:2], *slices[-1:]]
    return slices


def without_autocast(device_type: str):
    """Autocast turned off on `device_type`. The meta device has none of its own: a memory trace runs meta tensors in
    the place of the CPU's under the CPU's autocast (plan/layer_trace.py `_autocast_products_on_meta`), so that one
    is turned off, and the trace sees these products kept in their dtype as the run keeps them."""
    device_type = "cpu" if device_type == "meta" else device_type
    if not torch.amp.autocast_mode.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _autocast_off(function):
    """`function` run with autocast off on its tensors' device (module docstring: the capped block's products stay in
    the accumulation dtype whatever autocast the caller runs under)."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with without_autocast(next(a for a in args if isinstance(a, torch.Tensor)).device.type):
            return function(*args, **kwargs)

    return run


@_autocast_off
def _softcap_forward(q, k, v, mask, scale, softcap):
    """A softcapped block (module docstring): out (B, H, Lq, Dv) in q's dtype, lse (B, H, Lq) accumulated."""
    acc = accumulation_dtype(q.dtype)
    B, H, Lq, _ = q.shape
    Hkv = k.shape[1]
    keys, values = (t.to(acc).unsqueeze(2) for t in (k, v))  # (B, Hkv, 1, Lk, D)
    out, lse = q.new_empty((B, H, Lq, v.shape[-1])), q.new_empty((B, H, Lq), dtype=acc)
    for rows in _query_slices(q, k):
        queries = _grouped(q[:, :, rows].to(acc), Hkv)
        scores, _ = _capped_scores(queries, keys, scale, softcap, mask, rows.start)
        row_lse = torch.logsumexp(scores, dim=-1)  # every row of a block sees a key
        out[:, :, rows] = (torch.exp(scores - row_lse.unsqueeze(-1)) @ values).flatten(1, 2).to(q.dtype)
        lse[:, :, rows] = row_lse.flatten(1, 2)
    return out, lse


@_autocast_off
def _softcap_backward(dout, q, k, v, out, lse, mask, scale, softcap):
    """Gradients of `_softcap_forward` given the final out and lse (module docstring)."""
    acc = accumulation_dtype(q.dtype)
    Hkv = k.shape[1]
    keys, values = (t.to(acc).unsqueeze(2) for t in (k, v))
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(keys.squeeze(2)), torch.zeros_like(values.squeeze(2))
    for rows in _query_slices(q, k):
        queries, dout_rows = (_grouped(t[:, :, rows].to(acc), Hkv) for t in (q, dout))
        delta = (dout_rows * _grouped(out[:, :, rows].to(acc), Hkv)).sum(-1, keepdim=True)
        scores, tanh = _capped_scores(queries, keys, scale, softcap, mask, rows.start)
        probs = torch.exp(scores - _grouped(lse[:, :, rows].unsqueeze(-1).to(acc), Hkv))
        dscores = probs * (dout_rows @ values.transpose(-1, -2) - delta) * (1 - tanh * tanh) * scale
        dq[:, :, rows] = (dscores @ keys).flatten(1, 2).to(q.dtype)
        dk += (dscores.transpose(-1, -2) @ queries).sum(2)
        dv += (probs.transpose(-1, -2) @ dout_rows).sum(2)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _reversed(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor with its sequence axis (dim 2: (B, h, L, D) and (B, H, L) alike) in reverse order."""
    return [t.flip(2) for t in tensors]


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str, scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) -> out (B, H, Lq, Dv) in q's dtype, lse (B, H, Lq)
    fp32 (fp64 for fp64).

    `mask` is FULL, LOWER or UPPER (module docstring; LOWER and UPPER on square blocks); `softcap` the
    attention-logit cap c (None: scores as they are).
    """
    _check(q, k, v, mask)
    if softcap is not None:
        return _softcap_forward(q, k, v, mask, scale, softcap)
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
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attention_forward` for this block given the (possibly merged, final) out and lse.

    Shapes as in `attention_forward`; returns dq (B, H, Lq, D), dk (B, Hkv, Lk, D) and dv (B, Hkv, Lk, Dv).
    """
    _check(q, k, v, mask)
    if softcap is not None:
        return _softcap_backward(dout, q, k, v, out, lse, mask, scale, softcap)
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
