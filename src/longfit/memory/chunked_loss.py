"""lm_head + cross-entropy over token chunks: the (tokens, vocab) logits never exist whole.

Convention shared by every path: the SUM of token losses over valid labels (-100 ignored), with each chunk's
logits upcast to fp32 before softmax; the trainer divides by the global number of valid labels.

Paths:
- Liger-Kernel's fused linear cross-entropy on CUDA when installed (its own chunking; `chunk_tokens` unused).
- `_LinearCrossEntropySum` everywhere else: per chunk it computes logits (c, V) in the compute dtype, upcasts
  them, and immediately turns them into d(loss)/d(logits) = softmax - onehot(label) (0 on ignored rows),
  from which the gradients w.r.t. hidden (c, H) and lm_head weight (V, H) follow, all during forward, like
  Liger. Three GEMMs per chunk and no recompute; checkpointing each chunk instead would need four (the
  logits twice). The price is memory held from the loss forward to its backward (which is the first thing
  backward runs): the (N, H) hidden gradient, which replaces the hidden states this function does not keep,
  and a (V, H) fp32 weight-gradient accumulator (summing bf16 per-chunk products in bf16 would round once
  per chunk) when lm_head is trainable; none with a frozen lm_head (LoRA). Peak extra memory is one chunk's
  (c, V) fp32 logits plus their gradient.
Tied embeddings need nothing special: the weight gradient flows into the shared parameter. lm_head bias and
final-logit softcapping (Gemma: logits = cap * tanh(logits / cap)) are supported on every path.

Split vocabulary (tensor parallelism, longfit.parallel.tp). Rank r of R holds rows [s_r, s_r + V_r) of the lm_head
weight and 1/R of the tokens of each row. The same chunk loop runs on the gathered tokens h (N, H) with z = h W_r^T
(c, V_r): logsumexp_v z = m + log sum_r sum_{v in r} exp(z_v - m) with m the row maximum over all ranks (only for
stability, no gradient flows through it), and the label's logit comes from the one rank that owns it (0 elsewhere),
so one all-reduce of a (2, c) tensor [partial sums of exp, owned label logits] per chunk, after one all-reduce of
the (c,) maxima, gives every rank the exact loss. d loss / d z_v = softmax_v - 1[v = label] is local to the owner
of column v: the weight gradient of W_r needs no communication, and d loss / d h = sum_r g_r W_r is a partial sum
that one reduce-scatter at the end both sums and returns to each rank's own tokens (the backward of the gather).
The full (N, V) logits exist nowhere, not even as one chunk. `VocabularySplit` is that communication; the whole
vocabulary on one rank is the same loop with no-op collectives.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class VocabularySplit(Protocol):
    """The lm_head rows and the tokens are split over `ranks` ranks (see the module docstring)."""

    ranks: int
    vocab_start: int
    """First vocabulary row of this rank's lm_head slice."""

    def gather_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, n, H) this rank's tokens of each row -> (B, R n, H) all of them, in row order."""

    def scatter_sum_sequence(self, grad: torch.Tensor) -> torch.Tensor:
        """(B, R n, H) partial gradients -> (B, n, H): summed over the ranks, this rank's tokens."""

    def all_reduce_max_(self, tensor: torch.Tensor) -> None: ...

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None: ...


class _WholeVocabulary:
    """One rank holds every row and every token: the collectives are no-ops."""

    ranks = 1
    vocab_start = 0

    def gather_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def scatter_sum_sequence(self, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def all_reduce_max_(self, tensor: torch.Tensor) -> None:
        pass

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        pass


WHOLE_VOCABULARY = _WholeVocabulary()


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.amp.autocast_mode.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum CE(hidden @ weight.T + bias, labels) over valid labels; gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens: int, softcap: float | None, vocab: VocabularySplit,
                backward_twice: bool):
        # hidden (B, n, H) this rank's tokens, weight (V_r, H), bias (V_r,) or None, labels (B, R n) every token
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        dtype = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            tokens = vocab.gather_sequence(hidden)  # (B, L, H)
            flat_hidden, flat_labels = tokens.reshape(-1, tokens.shape[-1]), labels.reshape(-1)  # (N, H), (N,)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_tokens = torch.empty_like(tokens) if want_hidden else None
            grad_flat = grad_tokens.view(flat_hidden.shape) if want_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
            for start in range(0, flat_hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                loss += _chunk_loss_and_grads(
                    flat_hidden[rows].to(dtype),
                    flat_labels[rows],
                    w,
                    b,
                    softcap,
                    vocab,
                    grad_flat[rows] if want_hidden else None,
                    grad_weight,
                    grad_bias,
                )
            del tokens, flat_hidden  # under tp the gathered tokens go before the reduce-scatter allocates
            grad_hidden = vocab.scatter_sum_sequence(grad_tokens) if want_hidden else None  # (B, n, H)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        ctx.backward_twice, ctx.ran = backward_twice, False
        ctx.backward_done = None  # under backward_twice: (the incoming gradient, the results) once backward ran
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_done is not None:
            # A zero-bubble pipeline schedule runs a backward twice from the same incoming gradient: once for the
            # hidden states' gradient, once for the weights' (torch.distributed.pipelining's stage_backward_weight).
            done_grad, results = ctx.backward_done
            if torch.equal(grad_loss, done_grad):
                return results
        if ctx.ran:
            raise RuntimeError(
                "chunked_cross_entropy computes its gradients in forward and scales them in place in backward, "
                "so its backward runs once: retain_graph=True is not supported with memory.chunked_loss=true"
            )
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.param_dtypes
        # In place: at the start of backward memory is at its peak, no room for a second (N, H) tensor.
        if grad_hidden is not None:
            # A bf16 copy of the scale (e.g. 1 / valid tokens) would be off by up to 2^-9 for every element;
            # a Python float is applied in fp32 (one host sync, as in Liger).
            grad_hidden.mul_(grad_loss if grad_hidden.dtype == torch.float32 else grad_loss.item())
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_loss).to(bias_dtype)
        results = grad_hidden, grad_weight, grad_bias, None, None, None, None, None
        ctx.ran = True
        if ctx.backward_twice:  # kept for the second backward only there: the rest of the step would hold them too
            ctx.backward_done = (grad_loss.detach().clone(), results)
        return results


def _chunk_loss_and_grads(h, y, w, b, softcap, vocab, grad_hidden_rows, grad_weight, grad_bias) -> torch.Tensor:
    """Summed loss of one chunk; writes d(loss)/d(h) into `grad_hidden_rows`, adds into the other gradients.

    A function of its own so that the chunk's (c, V_r) tensors are freed before the next chunk's exist.
    """
    # h (c, H) in the compute dtype, y (c,), w (V_r, H), b (V_r,) or None: this rank's vocabulary rows
    logits = F.linear(h, w, b).float()  # (c, V_r)
    if softcap is not None:
        logits = torch.tanh(logits / softcap).mul_(softcap)
    valid = y != IGNORE_INDEX
    local = y - vocab.vocab_start
    owned = valid & (local >= 0) & (local < logits.shape[1])  # the label's logit is in this rank's rows
    target = local.masked_fill(~owned, 0)
    label_logit = torch.where(owned, logits.gather(1, target.unsqueeze(1)).squeeze(1), 0.0)  # (c,)
    row_max = logits.amax(dim=1)  # (c,): a shift for stability only, it cancels in the loss
    vocab.all_reduce_max_(row_max)
    wants_grads = grad_hidden_rows is not None or grad_weight is not None or grad_bias is not None
    # d cap*tanh(z/cap) / dz = 1 - tanh^2, read off the capped logits before they are overwritten
    softcap_slope = 1 - (logits / softcap).square() if softcap is not None and wants_grads else None
    exp_shifted = logits.sub_(row_max.unsqueeze(1)).exp_()  # exp(z - m), in place of the logits
    del logits
    # [sum of exp over this rank's columns, the label's logit where this rank owns it]: one all-reduce for both
    stats = torch.stack([exp_shifted.sum(dim=1), label_logit])  # (2, c)
    vocab.all_reduce_sum_(stats)
    loss = torch.where(valid, row_max + stats[0].log() - stats[1], 0.0).sum()  # logsumexp - label logit
    if not wants_grads:
        return loss
    grad_logits = exp_shifted.div_(stats[0].unsqueeze(1))  # softmax, still in place of the logits
    del exp_shifted  # the fp32 chunk is freed as soon as its compute-dtype copy exists
    grad_logits[torch.arange(len(y), device=y.device), target] -= owned.to(grad_logits.dtype)
    grad_logits.mul_(valid.unsqueeze(1))
    if softcap_slope is not None:
        grad_logits.mul_(softcap_slope)
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    grad_logits = grad_logits.to(h.dtype)
    if grad_hidden_rows is not None:
        grad_hidden_rows.copy_(grad_logits @ w)  # (c, H)
    if grad_weight is not None:
        if h.dtype == torch.float32:
            grad_weight.addmm_(grad_logits.t(), h)
        else:
            grad_weight += (grad_logits.t() @ h).float()  # (V_r, H)
    return loss


def liger_available(device: torch.device) -> bool:
    """Whether the Liger-Kernel fused linear cross-entropy can run on `device` (CUDA with liger_kernel installed)."""
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def _liger_loss_sum(hidden, weight, bias, labels, softcap):
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss,
    )

    options = {"ignore_index": IGNORE_INDEX, "reduction": "sum"}
    accepted = inspect.signature(LigerFusedLinearCrossEntropyLoss.__init__).parameters
    if softcap is not None:
        if "softcap" not in accepted:
            raise RuntimeError("the installed liger-kernel has no logit softcapping: pip install -U liger-kernel")
        options["softcap"] = softcap
    if "accum_dtype" in accepted:
        options["accum_dtype"] = torch.float32  # weight-gradient accumulation across chunks, as the torch path
    dtype = _compute_dtype(hidden)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = bias.to(dtype) if bias is not None else None
    out = LigerFusedLinearCrossEntropyLoss(**options)(weight, hidden.contiguous(), labels, bias)
    out = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
    return out.float()


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    chunk_tokens: int,
    softcap: float | None = None,
    use_liger: bool | None = None,
    backward_twice: bool = False,
) -> torch.Tensor:
    """Sum of token cross-entropies of `lm_head(hidden)` against `labels` without materialising the logits.

    hidden (B, L, H), labels (B, L) already shifted, -100 ignored; returns an fp32 scalar. `use_liger`
    None picks Liger-Kernel on CUDA when installed, else the exact pure-torch path (`chunk_tokens` per chunk).
    """
    if not isinstance(lm_head, nn.Linear):
        raise TypeError(
            f"memory.chunked_loss=true needs lm_head to be a plain nn.Linear, got {type(lm_head).__name__} "
            "(is lm_head a LoRA target or in modules_to_save? drop it from lora.target_modules, or set "
            "memory.chunked_loss=false)"
        )
    return linear_cross_entropy(hidden, lm_head.weight, lm_head.bias, labels, chunk_tokens, softcap, use_liger,
                                backward_twice=backward_twice)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_tokens: int,
    softcap: float | None = None,
    use_liger: bool | None = None,
    vocab: VocabularySplit = WHOLE_VOCABULARY,
    backward_twice: bool = False,
) -> torch.Tensor:
    """`chunked_cross_entropy` of the head `weight` (V_r, H), `bias`, possibly a slice of the vocabulary.

    hidden (B, n, H): this rank's tokens of each row, labels (B, vocab.ranks x n): all of them (see the module
    docstring); with the whole vocabulary n is the row length. Liger runs only on the whole vocabulary.
    `backward_twice`: the backward may run a second time from the same incoming gradient and returns the same gradients
    (a zero-bubble pipeline stage's), which it then keeps until the graph goes; otherwise a second backward is an error.
    """
    if chunk_tokens < 1:
        raise ValueError(f"memory.loss_chunk={chunk_tokens}: must be >= 1 (0 in the config derives it)")
    tokens_shape = (hidden.shape[0], hidden.shape[1] * vocab.ranks)
    if hidden.dim() != 3 or tuple(labels.shape) != tokens_shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match hidden states {tuple(hidden.shape[:-1])} (x {vocab.ranks} ranks)"
        )
    if not torch.is_grad_enabled():
        # Both paths compute gradients in forward for inputs that require them, whatever the grad mode.
        hidden, weight = hidden.detach(), weight.detach()
        bias = bias.detach() if bias is not None else None
    if use_liger is None:
        use_liger = vocab.ranks == 1 and liger_available(hidden.device)
    if use_liger:
        assert vocab.ranks == 1, "Liger's fused loss needs the whole vocabulary on each rank"
        flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (N, H), (N,)
        return _liger_loss_sum(flat_hidden, weight, bias, flat_labels, softcap)
    return _LinearCrossEntropySum.apply(hidden, weight, bias, labels, chunk_tokens, softcap, vocab, backward_twice)


def full_cross_entropy(
    hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """Reference with the same sum convention: full (B, L, V) logits, upcast to fp32, then cross-entropy."""
    logits = lm_head(hidden).float()  # (B, L, V)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
