"""longfit's attention function, registered with transformers' AttentionInterface as "longfit".

transformers hands a custom attention function no mask at all (not even padding), so causality,
sliding windows and document boundaries are this module's job, and nothing quadratic in L is ever built:
- one document per row: the fused causal SDPA kernel (`is_causal=True`, GQA through `enable_gqa`);
- packed documents (`cu_seq_lens_q` passed to the model's forward, flash-attn convention over the
  flattened B x L tokens): flash-attn's varlen kernel on CUDA when installed, else one causal SDPA call
  per document, which has a backward on every device;
- sliding-window layers (transformers passes `sliding_window=W` on local layers, None on global ones:
  query i sees keys i - W < j <= i of its own document): blockwise.py's exact window, about L x W scores
  per document instead of L^2 / 2, the kernel's own window argument on CUDA;
- context parallelism: `parallelize` puts a callable on each attention module as
  `longfit_context_parallel`; the call is routed there with the same arguments.
Anything longfit cannot compute exactly (bidirectional attention, attention-logit softcapping, attention
sinks, dropout, a mask) is refused rather than silently ignored.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from longfit.models.blockwise import Segment, block_attention, plan_blocks
from longfit.models.kernels import check_self_attention

ATTENTION_NAME = "longfit"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, L, D) -> (B, H, L, D); causal, GQA without copying K/V heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _flash_varlen_available(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None


def row_documents(cu_seqlens: torch.Tensor, batch: int, length: int) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) positions of its documents, from `cu_seqlens` over the flattened B x L tokens."""
    rows: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
    starts = cu_seqlens.tolist()
    for start, end in zip(starts[:-1], starts[1:]):
        row, offset = divmod(start, length)
        if end - row * length > length:
            raise ValueError(f"cu_seqlens: document [{start}, {end}) crosses the boundary of row {row} (L={length})")
        if end > start:
            rows[row].append((offset, offset + end - start))
    return rows


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Exact per-document causal attention over packed rows.

    q (B, H, L, D), k/v (B, Hkv, L, D); `cu_seqlens` (n_docs + 1,) are document starts over the
    flattened B*L tokens, every row boundary being a document boundary. Returns (B, H, L, D).
    """
    B, H, L, D = q.shape
    if _flash_varlen_available(q):
        from flash_attn import flash_attn_varlen_func

        def flat(t: torch.Tensor) -> torch.Tensor:  # (B, h, L, D) -> (B*L, h, D)
            return t.transpose(1, 2).reshape(B * L, t.shape[1], D)

        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        max_len = int(lengths.max())
        out = flash_attn_varlen_func(
            flat(q), flat(k), flat(v), cu_seqlens.to(torch.int32), cu_seqlens.to(torch.int32),
            max_len, max_len, softmax_scale=scale, causal=True,
        )
        return out.reshape(B, L, H, D).transpose(1, 2)
    pieces = [
        causal_attention(*(t[row : row + 1, :, start:end] for t in (q, k, v)), scale)
        for row, docs in enumerate(row_documents(cu_seqlens, B, L))
        for start, end in docs
    ]
    # The pieces tile the flattened B*L tokens in order: (1, H, B*L, D) -> (H, B, L, D) -> (B, H, L, D)
    return torch.cat(pieces, dim=2).view(H, B, L, D).transpose(0, 1)


def sliding_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float | None, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """Exact causal attention of q (B, H, L, D) over k/v (B, Hkv, L, D) with keys i - window < j <= i, per document."""
    B, _, L, D = q.shape
    documents = [[(0, L)]] * B if cu_seqlens is None else row_documents(cu_seqlens, B, L)
    row = [Segment(0, L, 0)]
    return block_attention(q, k, v, plan_blocks(row, row, documents, window), D**-0.5 if scale is None else scale)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of whole rows on one device: (B, H, L, D) q, (B, Hkv, L, D) k/v -> (B, H, L, D).

    `cu_seqlens` packs documents (None: one per row); `window` is the layer's sliding window (None: global).
    Queries and keys are the same tokens: there is no key/value cache in training.
    """
    check_self_attention(q, k, v, "longfit")
    if window is not None:
        return sliding_window_attention(q, k, v, window, scale, cu_seqlens)
    if cu_seqlens is not None:
        return packed_attention(q, k, v, cu_seqlens, scale)
    return causal_attention(q, k, v, scale)


def longfit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface entry point: (B, H, L, D) inputs -> ((B, L, H, D) output, no weights)."""
    if attention_mask is not None:
        raise ValueError(
            "longfit attention takes no attention_mask: describe packed documents with position_ids and "
            "cu_seq_lens_q instead of padding masks"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError(
            f"{type(module).__name__} attends bidirectionally (e.g. use_bidirectional_attention=true); longfit trains "
            "causal language models only"
        )
    unsupported = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(
            f"{type(module).__name__} passes {', '.join(unsupported)} (attention-logit softcapping or attention "
            "sinks), which longfit's attention kernels do not compute"
        )
    if dropout:
        raise ValueError("attention dropout is not supported: set the model config's attention_dropout to 0")
    context_parallel = getattr(module, "longfit_context_parallel", None)
    if context_parallel is not None:
        out = context_parallel(query, key, value, scale=scaling, cu_seqlens=cu_seq_lens_q, window=sliding_window)
    else:
        out = local_attention(query, key, value, scaling, cu_seq_lens_q, sliding_window)
    return out.transpose(1, 2), None  # (B, L, H, D)


def register_attention() -> str:
    """Register "longfit" with transformers (idempotent) and return the name to use as attn_implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, longfit_attention_forward)
    return ATTENTION_NAME
