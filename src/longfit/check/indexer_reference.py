"""The plain reference of `train.indexer_loss` (#57) that `longfit check` and tests/test_sparse_attention.py compare
longfit's step with: DeepSeek-V3.2's sparse-stage objective (its report, section 2.1) written out densely on
transformers' eager model, L x L, one document at a time.

    loss = (cross-entropy + weight x sum over indexed layers and queries t of KL(p[t, S_t] || softmax(I[t, S_t])))
           / the label tokens,

I the index scores computed from the indexer's weights on its detached inputs, S_t transformers' top-k of query t
(its future keys masked), p transformers' eager attention weights of the layer (detached) summed over heads,
restricted to S_t and L1-normalised. Nothing of longfit's runs here: the selection is transformers' indexer's
output, the target its attention's weights, the scores its indexer's modules applied in the formula's order.

The indexers' weights get their gradient from this loss alone, and on a checked copy (weights of std 0.1, near-uniform
index scores and attention) it is small: entries of about 1e-8, at the floor of the fp32 bound, which would pass
any of them, a wrong one included. So `indexer_gradients_judged` holds each of them to the float64 run instead, as
the check's rounding rule does (within FP32_FACTOR x transformers' own fp32 error against float64: the fp32
reference's is 2e-5 to 2e-4 of the tensor's largest entry, measured; longfit's 0.2 to 0.6 x the allowance).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

from longfit.check.parity import (
    FP32_FACTOR, ROW, Comparison, Step, _at_least_fp32, _grads, _laid_out, documents, recording, rounding_excess,
)
from longfit.models.sparse_attention import INDEXED_ATTENTION


def _index_scores(indexer: torch.nn.Module, hidden, q_latent, cos, sin) -> torch.Tensor:
    """(S, S) index scores of one document, every query against every key, in the reference's precision (float64 in
    a float64 model, else fp32)."""
    rotate = getattr(sys.modules[type(indexer).__module__], INDEXED_ATTENTION[indexer.config.model_type])
    S, rope, Di, Hi = hidden.shape[1], indexer.qk_rope_head_dim, indexer.head_dim, indexer.n_heads
    q = indexer.wq_b(q_latent).view(1, S, Hi, Di)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = rotate(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    wide = torch.promote_types(q.dtype, torch.float32)
    q, k = torch.cat([q_rot, q[..., rope:]], -1).to(wide), torch.cat([k_rot, k[..., rope:]], -1)[:, :, 0].to(wide)
    relu = F.relu(torch.einsum("bshd,btd->bsht", q, k) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).to(wide) * Hi**-0.5
    return torch.einsum("bsh,bsht->bst", weights, relu)[0]


def _kl(indexer: torch.nn.Module, call: dict) -> torch.Tensor:
    """The layer's sum over its queries of KL(p[t, S_t] || softmax(I[t, S_t]))."""
    scores = _index_scores(indexer, *call["inputs"])
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, call["picked"], True) & call["causal"]
    target = call["weights"].sum(0) * chosen
    target = target.to(torch.promote_types(target.dtype, torch.float32))
    target = target / target.sum(-1, keepdim=True)
    log_probs = scores.masked_fill(~chosen, float("-inf")).log_softmax(-1).masked_fill(~chosen, 0.0)
    return (torch.xlogy(target, target) - target * log_probs).sum()


def indexer_loss_step(model: torch.nn.Module, batch, weight: float, autocast: bool = False,
                      record: bool = False) -> Step:
    """transformers' `model` (eager or SDPA attention) on `batch`, each document alone (the semantics of packing), its
    loss the module docstring's; under bf16 autocast when `autocast`. SDPA returns no weights: p is then transformers'
    eager attention on the same inputs. `record`: each module's first inputs and output, laid back into the rows."""
    spans = documents(batch) if batch.cu_seqlens is not None else [(b, 0, ROW) for b in range(len(batch.input_ids))]
    attentions = [m for m in model.modules() if getattr(m, "indexer", None) is not None and hasattr(m, "kv_b_proj")]
    total, pieces = torch.zeros((), dtype=torch.float64), []
    for row, start, end in spans:
        calls: dict[torch.nn.Module, dict] = {}

        def indexer_call(indexer, args, kwargs, output):
            hidden, q_latent, (cos, sin), mask = args[:4]
            causal = mask[0] if mask.dtype == torch.bool else mask[0] == 0  # (S, S) the keys each query may see
            calls.setdefault(indexer, {}).update(inputs=(hidden.detach(), q_latent.detach(), cos, sin),
                                                 picked=output[0].long(), causal=causal)

        def attention_call(attention, args, kwargs, output):
            weights = output[1]
            if weights is None:  # SDPA's: the weights of transformers' eager attention on the same inputs
                implementation, attention.config._attn_implementation = attention.config._attn_implementation, "eager"
                with torch.no_grad():
                    weights = type(attention).forward(attention, *args, **kwargs)[1]
                attention.config._attn_implementation = implementation
            calls.setdefault(attention.indexer, {})["weights"] = weights.detach()[0]  # (H, S, S)

        handles = [a.indexer.register_forward_hook(indexer_call, with_kwargs=True) for a in attentions]
        handles += [a.register_forward_hook(attention_call, with_kwargs=True) for a in attentions]
        modules: dict = {}
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                    recording(model, modules) if record else contextlib.nullcontext():
                logits = model(input_ids=batch.input_ids[row : row + 1, start:end],
                               position_ids=batch.position_ids[row : row + 1, start:end], use_cache=False).logits
                loss = F.cross_entropy(_at_least_fp32(logits[0]), batch.labels[row, start:end], reduction="sum")
                if len(calls) != len(attentions) or not all("weights" in call for call in calls.values()):
                    raise RuntimeError("transformers' indexed attention was not called as the reference expects")
                for indexer, call in calls.items():
                    loss = loss + weight * _kl(indexer, call)
        finally:
            for handle in handles:
                handle.remove()
        (loss / batch.num_label_tokens).backward()
        total += loss.detach().double() / batch.num_label_tokens
        pieces.append(modules)
    return Step(total.float(), _grads(model), _laid_out(pieces, spans, batch.input_ids.shape) if record else {})


def indexer_gradients_judged(comparison: Comparison, got: Step, truth: Step, exact: Step) -> Comparison:
    """`comparison` (`compare_fp32` of `got` against `truth`) with every indexer weight's gradient judged against the
    float64 run `exact` alone: within FP32_FACTOR x the fp32 reference's own error against it (module docstring)."""
    excess = {n: rounding_excess(got.grads[n], [ref], exact.grads[n]) for n, ref in truth.grads.items()
              if ".indexer." in n and ref is not None and got.grads.get(n) is not None}
    return replace(comparison, worst=max([comparison.worst, *excess.items()], key=lambda item: item[1]),
                   bound=f"{comparison.bound}; the indexers' gradients within {FP32_FACTOR:g}x transformers' own fp32 "
                         "error against float64")
