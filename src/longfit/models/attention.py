"""longfit's attention function, registered with transformers' AttentionInterface as "longfit".

transformers hands a custom attention function no mask at all (not even padding), so causality and
document boundaries are this module's job, and nothing quadratic in L is ever built:
- one document per row: the fused causal SDPA kernel (`is_causal=True`, GQA through `enable_gqa`);
- packed documents (`cu_seq_lens_q` passed to the model's forward, flash-attn convention over the
  flattened B x L tokens): flash-attn's varlen kernel on CUDA when installed, else one causal SDPA call
  per document, which has a backward on every device;
- context parallelism: `parallelize` puts a callable on each attention module as
  `longfit_context_parallel`; the call is routed there with the same arguments.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

ATTENTION_NAME = "longfit"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hkv, L, D) -> (B, H, L, D); causal, GQA without copying K/V heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _flash_varlen_available(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None


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
    starts = cu_seqlens.tolist()
    pieces = []
    for start, end in zip(starts[:-1], starts[1:]):
        row, offset = divmod(start, L)
        if end - row * L > L:
            raise ValueError(f"cu_seqlens: document [{start}, {end}) crosses the boundary of row {row} (L={L})")
        span = slice(offset, offset + end - start)
        pieces.append(causal_attention(q[row : row + 1, :, span], k[row : row + 1, :, span], v[row : row + 1, :, span], scale))
    # The pieces tile the flattened B*L tokens in order: (1, H, B*L, D) -> (H, B, L, D) -> (B, H, L, D)
    return torch.cat(pieces, dim=2).view(H, B, L, D).transpose(0, 1)


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
    if sliding_window is not None:
        raise NotImplementedError(
            f"{type(module).__name__} uses sliding-window attention (window {sliding_window}); longfit trains "
            "full-attention layers only. Such presets are supported by `longfit plan`."
        )
    if dropout:
        raise ValueError("attention dropout is not supported: set the model config's attention_dropout to 0")
    context_parallel = getattr(module, "longfit_context_parallel", None)
    if context_parallel is not None:
        out = context_parallel(query, key, value, scale=scaling, cu_seqlens=cu_seq_lens_q)
    elif cu_seq_lens_q is not None:
        out = packed_attention(query, key, value, cu_seq_lens_q, scaling)
    else:
        out = causal_attention(query, key, value, scaling)
    return out.transpose(1, 2), None  # (B, L, H, D)


def register_attention() -> str:
    """Register "longfit" with transformers (idempotent) and return the name to use as attn_implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, longfit_attention_forward)
    return ATTENTION_NAME
