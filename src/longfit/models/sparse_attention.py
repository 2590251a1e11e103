"""Sparse indexed attention (DeepSeek Sparse Attention: DeepSeek-V3.2's `deepseek_v32`, GLM-5's `glm_moe_dsa`), #57,
linear in L and exact on packed documents.

transformers' layer (DeepseekV32Attention, GlmMoeDsaAttention) is multi-head latent attention whose keys a
"lightning indexer" picks per query. For query i the indexer scores every key j <= i,

    I[i, j] = sum_h w[i, h] relu(s q_I[i, h] . k_I[j]),    w = weights_proj(x) Hi^-1/2,  s = Di^-1/2,

(q_I from the query latent through wq_b, k_I = LayerNorm(wk(x)), both rotated on their first qk_rope_head_dim
dimensions), keeps the index_topk keys of the largest scores, and the attention runs over those alone. transformers
builds the L x L score matrix in fp32 and adds the top-k as a mask to dense attention: quadratic twice. Here:

1. The selection (`select_keys`), block by block: for each block of queries of a document, the scores against each
   block of that document's earlier keys join a running top-(k+1) per query, so the working set is a query block
   times (k + 1 + a key block), and what stays is (B, L, k) indices (-1 where a query has fewer than k keys). The
   selection is discrete: no gradient flows through it to the hidden states or the query latent. By default the
   indexer gets none either, as transformers' `@torch.no_grad` forward does: its weights (wq_b, wk, k_norm,
   weights_proj) stay as they are. `train.indexer_loss` trains them with DeepSeek-V3.2's KL loss instead (3.).
   Ties: the top-k of a query is unique unless its k-th and (k+1)-th largest scores are equal, which happens
   (mostly at 0, when every head's ReLU is) but where torch.topk picks among the tied keys by its own partial sort
   of the whole row. The running top-(k+1) sees exactly that case (its last two values equal), and those queries
   alone are redone as transformers does them: each one's full row of scores over its document (earlier keys
   masked), one torch.topk on it, so the same keys as transformers' model of the document on the same device. The
   scores are computed with transformers' operations in its order (fp32 matmul per head, scale, ReLU, the weighted
   sum as a matmul); the one difference is the size of the matrices, which can move the last bit of a score
   where the BLAS library reduces a block differently: two distinct scores within that rounding of each other at
   the k-th place may then order differently (never seen in the tests, which compare the indices). On CUDA each
   query block asks whether any of its queries tie (a device sync per block of the selection).
2. The attention (`LatentSparseAttention`) in MLA's latent form, as DeepSeek's sparse kernels (FlashMLA) run it:
   with kv_b_proj's weight split per head into W_k (nope x r) and W_v (dv x r) and c the key/value latent (r wide),
   q_nope . (W_k c) = (W_k^T q_nope) . c and sum_j p_j W_v c_j = W_v (sum_j p_j c_j), so each head attends over the
   SHARED latent keys [c, k_rope] (r + rope wide) with the absorbed query [W_k^T q_nope, q_rope] and its output is
   W_v applied to the latent average. The selected latents are gathered per block of queries (a block x k x
   (r + rope)); the backward recomputes them from the saved (B, L, H) logsumexp, flash-attention style, and
   scatters the latent's gradient back with index_add. The weight is read as kv_b_proj(I_r) (the module applied to
   the identity), so LoRA's adapters (tested on kv_b_proj) and autocast's cast act on it as on the keys they make.
   transformers' softmax over the masked dense row gives the selected keys exactly these weights (a masked score
   is finfo.min, whose exp is 0), so the two agree up to fp32 rounding.
3. The indexer's loss (`IndexerKL`, on under `train.indexer_loss`; DeepSeek-V3.2 report, section 2.1, its sparse
   training stage): per query t, over its selected keys S_t,

       KL(p[t, S_t] || softmax(I[t, S_t])),    p[t, s] = sum_h P[h, t, s] / sum_h sum_s' P[h, t, s'],

   P the main attention's weights (over S_t alone: the attention of 2.), so p is their mean over heads. As the
   report trains it, the main attention's part is detached (p is a target) and so are the indexer's inputs (x and the
   query latent): the indexer learns from this loss alone, the rest of the model from the cross-entropy alone.
   Each layer with an indexer adds its sum over queries; the objective (memory/loss.py) weighs it. Linear in L as
   the attention: blocks of queries, the index keys of their selection gathered per block, the probabilities
   recomputed from the attention's logsumexp (forward and backward: an attention's work twice more).
GLM-5's "shared" layers (`indexer_types`) reuse the previous layer's selection, as transformers' layers pass it on;
their attention takes no part in the indexer's loss (the selection is the previous layer's, whose loss trains it).

Context parallelism: each rank's queries select and attend among the latent and index keys of the whole rows,
all-gathered (parallel/gathered_keys.py says why that exchange and what it costs), ring and Ulysses layouts alike;
the latents' gradient (and the index keys', under the indexer's loss) is summed back over the ranks. Refused: tiled
layers (a tile's queries would select among the tile's keys only; `auto` leaves them off, in the plan too), pipeline
stages (`refuse_pipeline_stages`), a KV cache, an attention mask (as longfit's attention).
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from longfit.config import ConfigError
from longfit.data.packing import Spans, document_rows
from longfit.models import kernels
from longfit.models.attention import call_documents

INDEXED_ATTENTION = {"deepseek_v32": "apply_rotary_pos_emb", "glm_moe_dsa": "apply_rotary_pos_emb_interleave"}
"""The model types whose sparse attention longfit computes, with the rotary function of their indexer (DeepSeek-V3.2's
indexer rotates half-split, GLM-5's interleaved pairs; both rotate the attention's query and key interleaved)."""
SCORE_ELEMENTS = 2**24
"""The selection's working set of one block of queries, 64 MiB in fp32: per query its scores against a block of
keys (index heads x the block) and its candidates (the running top-(k+1) and the block's scores, with their keys:
about 6 x the block in 4-byte units)."""
MIN_KEY_BLOCK = 256
"""Keys of a block of the selection at least: a block merges with the running top-(k+1), so blocks of about k keys
(DeepSeek-V3.2's 2,048) amortise each merge over as many new keys."""
ATTENTION_ELEMENTS = 2**24
"""Gathered latents of one block of queries x selected keys x latent width: 64 MiB in fp32 (DeepSeek-V3.2's 2,048 x
576 a query: blocks of 14 queries)."""
INSTALLED = "longfit_indexed_attention"
INDEXER_LOSS = "longfit_indexer_loss"
"""Set on an indexed attention module whose indexer learns from the KL loss (`train_indexers`)."""
INDEXER_TERMS = "longfit_indexer_terms"
"""The list an indexed attention module appends its indexer loss to during a forward (`indexer_losses`)."""


SPARSE_ATTENTION_KEYS = ("index_topk", "index_topk_blocks", "indexer_budget", "compress_rates")
"""Config keys of attention that picks its keys per query (DeepSeek-V3.2's and GLM-5's lightning indexer, MiniMax-M3's
block indexer) or compresses them (DeepSeek-V4): set, they make the attention sparse."""
DIFFERING_PART = {
    "deepseek_v4": "its compressed attention (compress_rates: compressed_sparse_attention and "
                   "heavily_compressed_attention layers) and its hyper-connections",
    "hy_v4": "HYV4Indexer (its rotary dimensions last, the softmax scale folded into the head weights, an fp32 key "
             "norm) and DeepSeek-V4's hyper-connections",
    "axk2": "AXK2Attention's output gate (q_gate_proj over the query latent and its input, a gated norm)",
    "dots3_note_text": "Dots3NoteTextAttention's rescaled query and key/value latents (q_lora_scale) and its mix of "
                       "indexed and dense layers",
    "minimax_m3_vl_text": "its block top-k indexer (index_topk_blocks blocks of index_block_size keys chosen per "
                          "query, beside index_local_blocks)",
}
"""The part in which each sparse type longfit does not compute differs from DeepSeek-V3.2's indexed attention."""


def untileable_indexed_attention(model_type: str) -> str | None:
    """Why tiled layers cannot run a model of `model_type`: its sparse indexed attention, whose queries select among
    every earlier key; None for any other type (`models.linear_attention.untileable_layers` asks it)."""
    if model_type in INDEXED_ATTENTION:
        return (f"{model_type}'s sparse indexed attention selects each query's keys among every earlier key, which a "
                "sequence tile does not hold")
    return None


def refuse_pipeline_stages(config, pp: int) -> None:
    """Refuse parallel.pp > 1 for a model with indexed attention, naming the part: what a stage cut would have to
    carry between its stages is not carried (`parallel/pipeline.py` passes the hidden states alone)."""
    if config.model_type in INDEXED_ATTENTION:
        raise ConfigError(
            f"parallel.pp={pp}: {config.model_type}'s sparse indexed attention is not cut into pipeline stages: a "
            "stage passes on the hidden states alone, not the key selection a GLM-5 \"shared\" layer takes from the "
            "layer before it nor the indexers' loss terms (train.indexer_loss), and no stage cut of it is checked "
            "against one process; set parallel.pp=1 (parallel.cp and parallel.ep split it instead)"
        )


def refuse_sparse_attention(config) -> None:
    """Refuse, off the config before anything is built, attention whose keys an indexer picks per query or that
    compresses them (SPARSE_ATTENTION_KEYS), but for the types whose indexed attention longfit computes
    (INDEXED_ATTENTION); the line names the part that differs where it is known (DIFFERING_PART)."""
    if config.model_type in INDEXED_ATTENTION:
        return
    values = config.to_dict()
    found = [key for key in SPARSE_ATTENTION_KEYS if values.get(key) is not None]
    if found:
        part = DIFFERING_PART.get(config.model_type, "an indexer picks or compresses the keys of each query")
        raise ConfigError(
            f"the {config.model_type} model's attention is sparse ({', '.join(f'{k}={values[k]}' for k in found)}), "
            f"which longfit computes for {' and '.join(INDEXED_ATTENTION)} only; this one differs in {part}"
        )


# ---- the selection -------------------------------------------------------------------------------------------


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H, D) and weights (n, H) of n queries, k (m, D) of m keys, all fp32 -> (n, m) index scores, in
    transformers' operations and order (DeepseekV32Indexer.forward)."""
    scores = F.relu(torch.matmul(q.unsqueeze(0), k.T.unsqueeze(0).unsqueeze(1)) * scale)  # (1, n, H, m)
    return torch.matmul(weights.unsqueeze(0).unsqueeze(-2), scores).squeeze(-2).squeeze(0)  # (n, m)


def _blocks(heads: int, width: int, budget: int) -> int:
    """Rows of a block whose (rows, heads, width) fp32 working set stays within `budget` elements (at least 16)."""
    return max(16, budget // max(1, heads * width))


def select_keys(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float, topk: int, rows: Spans,
    spans: list[tuple[int, int]] | None = None, query_block: int | None = None, key_block: int | None = None,
) -> torch.Tensor:
    """The indexer's top-k keys of every query (module docstring, 1.): q (B, n, H, D) and weights (B, n, H) of the
    queries at the global row positions `spans` ([start, end) in local order; None: the whole rows, n = L), k (B, L,
    D) the keys of the whole rows, fp32; `rows` the documents of each row ([start, end) spans): a query selects among
    the keys of its own document at or before it. Returns (B, n, topk) int32 row positions (transformers' dtype: half
    of int64's bytes), -1 in the slots of a query with fewer than topk keys. The blocks default to SCORE_ELEMENTS' worth of scores."""
    B, n, H, _ = q.shape
    spans = spans or [(0, k.shape[1])]
    key_block = key_block or max(topk, MIN_KEY_BLOCK)
    query_block = query_block or _blocks(H + 6, key_block, SCORE_ELEMENTS)
    selected = torch.full((B, n, topk), -1, dtype=torch.int32, device=q.device)
    for b, docs in enumerate(rows):
        offset = 0  # local index of the span's first token
        for span_start, span_end in spans:
            for start, end in docs:
                for q0 in range(max(start, span_start), min(end, span_end), query_block):
                    q1 = min(q0 + query_block, end, span_end)
                    local = slice(offset + q0 - span_start, offset + q1 - span_start)
                    selected[b, local] = _select_block(q[b, local], weights[b, local], k[b], scale, topk, (start, end),
                                                       q0, key_block)
            offset += span_end - span_start
    return selected


def _select_block(q, weights, k, scale: float, topk: int, document: tuple[int, int], q0: int, key_block: int):
    """(n, topk) selection of the n queries q (n, H, D), weights (n, H) at positions [q0, q0 + n) of the `document`
    [start, end) of a row whose keys are k (L, D) (`select_keys`)."""
    start, end = document
    positions = torch.arange(q0, q0 + len(q), device=q.device)
    best = q.new_empty(len(q), 0)  # (n, <= topk + 1) the running largest scores
    best_keys = torch.empty(len(q), 0, dtype=torch.long, device=q.device)
    for k0 in range(start, q0 + len(q), key_block):
        k1 = min(k0 + key_block, q0 + len(q))
        keys = torch.arange(k0, k1, device=q.device)
        scores = index_scores(q, k[k0:k1], weights, scale)  # (n, m)
        scores = scores.masked_fill(keys[None, :] > positions[:, None], float("-inf"))
        candidates, candidate_keys = torch.cat([best, scores], 1), torch.cat([best_keys, keys.expand(len(q), -1)], 1)
        best, order = candidates.topk(min(topk + 1, candidates.shape[1]), dim=1)
        best_keys = candidate_keys.gather(1, order)
    chosen = best_keys[:, :topk].masked_fill(best[:, :topk] == float("-inf"), -1)
    # A memory trace (plan/layer_trace.py), on fake or meta tensors, has no values to compare: it leaves out the redo
    # of tied queries, whose working set is at most SCORE_ELEMENTS (64 MiB), beside the block's own.
    if best.shape[1] > topk and not is_fake(best) and not best.is_meta:
        tied = ((best[:, topk - 1] == best[:, topk]) & (best[:, topk] > float("-inf"))).nonzero().flatten()
        if len(tied):
            chosen[tied] = _as_transformers(q[tied], weights[tied], positions[tied], k, scale, topk, document)
    return torch.cat([chosen, chosen.new_full((len(q), topk - chosen.shape[1]), -1)], 1)


def _as_transformers(q, weights, positions: torch.Tensor, k, scale: float, topk: int, document: tuple[int, int]):
    """The top-k of the queries q (m, H, D) at `positions` whose k-th and (k+1)-th scores tie, as transformers picks
    them: torch.topk over each one's row of scores over all the keys of its `document` [start, end), the later ones
    masked, as transformers' row of the document alone (torch.topk's choice among tied values depends on the whole
    row, its length included). Rows of SCORE_ELEMENTS at a time."""
    start, end = document
    keys = torch.arange(start, end, device=q.device)
    step = _blocks(q.shape[1], end - start, SCORE_ELEMENTS)
    pieces = []
    for i in range(0, len(q), step):
        at = slice(i, i + step)
        scores = index_scores(q[at], k[start:end], weights[at], scale)
        scores = scores.masked_fill(keys[None, :] > positions[at, None], float("-inf"))
        values, order = scores.topk(topk, dim=1)
        pieces.append((order + start).masked_fill(values == float("-inf"), -1))
    return torch.cat(pieces)


# ---- the attention over the selected keys --------------------------------------------------------------------


class LatentSparseAttention(torch.autograd.Function):
    """Attention of each head of each query over its selected latent keys (module docstring, 2.).

    q (B, L, H, R) absorbed queries, kv (B, L, R) latent keys whose first `value_width` dims are the values,
    selected (B, L, k) int32 row positions (-1: none) -> (B, L, H, value_width) in q's dtype and the (B, L, H)
    logsumexp of the scores (no gradient: the indexer's loss reads the probabilities off it). Computed in fp32 (or
    q's wider dtype), queries in blocks of ATTENTION_ELEMENTS' worth of gathered latents; saves q, kv, the
    selection, the output and the logsumexp.
    """

    @staticmethod
    def forward(ctx, q, kv, selected, scale: float, value_width: int):
        B, L, H, R = q.shape
        wide = torch.promote_types(q.dtype, torch.float32)
        out = q.new_empty(B, L, H, value_width, dtype=wide)
        lse = q.new_empty(B, L, H, dtype=wide)
        block = _blocks(selected.shape[2], R, ATTENTION_ELEMENTS)
        with kernels.without_autocast(q.device.type):
            for b, q0, q1 in _query_blocks(B, L, block, q):
                latents, probs, block_lse = _attend(q[b, q0:q1], kv[b], selected[b, q0:q1], scale)
                out[b, q0:q1] = torch.matmul(probs, latents[..., :value_width])  # (n, H, dv)
                lse[b, q0:q1] = block_lse
        ctx.save_for_backward(q, kv, selected, out, lse)
        ctx.scale, ctx.value_width, ctx.block = scale, value_width, block
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, _):
        q, kv, selected, out, lse = ctx.saved_tensors
        scale, value_width, block = ctx.scale, ctx.value_width, ctx.block
        B, L = q.shape[:2]
        grad_q = torch.zeros(q.shape, dtype=out.dtype, device=q.device)
        grad_kv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)
        with kernels.without_autocast(q.device.type):
            for b, q0, q1 in _query_blocks(B, L, block, q):
                latents, probs, _ = _attend(q[b, q0:q1], kv[b], selected[b, q0:q1], scale, lse[b, q0:q1])
                d_out = grad_out[b, q0:q1].to(out.dtype)  # (n, H, dv)
                # softmax backward: dS = P (dP - rowsum(dO * O))
                d_probs = torch.matmul(d_out, latents[..., :value_width].transpose(1, 2))  # (n, H, k)
                d_scores = probs * (d_probs - (d_out * out[b, q0:q1]).sum(-1, keepdim=True)) * scale
                grad_q[b, q0:q1] = torch.matmul(d_scores, latents)  # (n, H, R)
                d_latents = torch.matmul(d_scores.transpose(1, 2), q[b, q0:q1].to(out.dtype))  # (n, k, R)
                d_latents[..., :value_width] += torch.matmul(probs.transpose(1, 2), d_out)
                keys = selected[b, q0:q1].clamp(min=0).flatten().long()
                grad_kv[b].index_add_(0, keys, d_latents.flatten(0, 1))
        return grad_q.to(q.dtype), grad_kv.to(kv.dtype), None, None, None


def _attend(q, kv, selected, scale: float, lse: torch.Tensor | None = None):
    """One block of queries: q (n, H, R), kv (L, R) the row's latents, selected (n, k) -> the gathered latents
    (n, k, R), the probabilities (n, H, k) (a slot of no key gets 0) and their logsumexp (n, H), in fp32 (or q's
    wider dtype); `lse` given (the backward), the probabilities from it."""
    wide = torch.promote_types(q.dtype, torch.float32)
    latents = kv.to(wide)[selected.clamp(min=0).long()]  # (n, k, R)
    scores = torch.matmul(q.to(wide), latents.transpose(1, 2)) * scale  # (n, H, k)
    scores = scores.masked_fill((selected < 0)[:, None, :], float("-inf"))
    if lse is None:
        lse = scores.logsumexp(-1)
    return latents, torch.exp(scores - lse[..., None]), lse


class IndexerKL(torch.autograd.Function):
    """The indexer's loss of a layer (module docstring, 3.): the sum over its queries of KL(p || softmax(I)) over
    each one's selected keys, fp32.

    index_q (B, n, Hi, Di), index_k (B, L, Di), weights (B, n, Hi) the indexer's (its inputs detached), selected
    (B, n, k), and the attention's q (B, n, H, R), kv (B, L, R), lse (B, n, H) and scale, whose probabilities over
    the selection are the target (no gradient). Gradients go to index_q, index_k and weights only: with
    d = softmax(I) sum_s p_s - p over a query's selected keys, dI = g d; dw[h] = sum_s dI_s relu(c q_h . k_s), and
    through the ReLU's active scores dq_h, dk_s. Queries in blocks of ATTENTION_ELEMENTS' worth of gathered latents
    and index keys; the target and the scores are recomputed in the backward, nothing of L x k is kept.
    """

    @staticmethod
    def forward(ctx, index_q, index_k, weights, selected, q, kv, lse, scale: float, index_scale: float):
        B, n, Hi, Di = index_q.shape
        block = _blocks(selected.shape[2], q.shape[3] + q.shape[2] + Hi + Di, ATTENTION_ELEMENTS)
        total = index_q.new_zeros((), dtype=torch.float32)
        with kernels.without_autocast(q.device.type):
            for b, q0, q1 in _query_blocks(B, n, block, index_q):
                target, log_probs, _, _ = _indexer_kl_block(index_q[b, q0:q1], index_k[b], weights[b, q0:q1],
                                                            selected[b, q0:q1], q[b, q0:q1], kv[b], lse[b, q0:q1],
                                                            scale, index_scale)
                total += (torch.xlogy(target, target) - target * log_probs).sum()
        ctx.save_for_backward(index_q, index_k, weights, selected, q, kv, lse)
        ctx.scale, ctx.index_scale, ctx.block = scale, index_scale, block
        return total

    @staticmethod
    def backward(ctx, grad):
        index_q, index_k, weights, selected, q, kv, lse = ctx.saved_tensors
        B, n = index_q.shape[:2]
        grad_q, grad_k, grad_w = (torch.zeros_like(t, dtype=torch.float32) for t in (index_q, index_k, weights))
        with kernels.without_autocast(q.device.type):
            for b, q0, q1 in _query_blocks(B, n, ctx.block, index_q):
                target, log_probs, keys, relu = _indexer_kl_block(
                    index_q[b, q0:q1], index_k[b], weights[b, q0:q1], selected[b, q0:q1], q[b, q0:q1], kv[b],
                    lse[b, q0:q1], ctx.scale, ctx.index_scale)
                d_index = grad * (log_probs.exp() * target.sum(-1, keepdim=True) - target)  # (n, k)
                d_index = d_index.masked_fill(selected[b, q0:q1] < 0, 0.0)
                grad_w[b, q0:q1] = torch.matmul(relu, d_index.unsqueeze(-1)).squeeze(-1)  # (n, Hi)
                d_scores = weights[b, q0:q1].float().unsqueeze(-1) * d_index.unsqueeze(1) * (relu > 0)  # (n, Hi, k)
                d_scores = d_scores * ctx.index_scale
                grad_q[b, q0:q1] = torch.matmul(d_scores, keys)  # (n, Hi, Di)
                d_keys = torch.matmul(d_scores.transpose(1, 2), index_q[b, q0:q1].float())  # (n, k, Di)
                grad_k[b].index_add_(0, selected[b, q0:q1].clamp(min=0).flatten().long(), d_keys.flatten(0, 1))
        return (grad_q.to(index_q.dtype), grad_k.to(index_k.dtype), grad_w.to(weights.dtype),
                None, None, None, None, None, None)


def _query_blocks(B: int, n: int, block: int, like: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, first query, end) of each block of `block` of the n queries of B rows; on a memory trace (`like` a fake or
    meta tensor: no values) the first two and the last alone (kernels._traced_slices): the outputs and gradients are
    allocated whole before the first block, and a block's tensors, which depend on its length alone, are held until
    the next block's replace them, so every full block from the second on holds what the second holds. The published
    GLM-5's layer at 3,216 tokens: 230 blocks of 14 queries, forward, recompute and backward."""
    blocks = [(b, q0, min(q0 + block, n)) for b in range(B) for q0 in range(0, n, block)]
    return kernels._traced_slices(blocks, like)


def _indexer_kl_block(index_q, index_k, weights, selected, q, kv, lse, scale: float, index_scale: float):
    """One block of queries of `IndexerKL`: the target p (n, k), the indexer's log-probabilities (n, k) (0 at slots of
    no key, whose target is 0), the gathered index keys (n, k, Di) and the ReLU'd scores (n, Hi, k), fp32."""
    _, probs, _ = _attend(q, kv, selected, scale, lse)  # (n, H, k), 0 at slots of no key
    target = probs.sum(1)
    target = target / target.sum(-1, keepdim=True)
    keys = index_k.float()[selected.clamp(min=0).long()]  # (n, k, Di)
    relu = F.relu(torch.matmul(index_q.float(), keys.transpose(1, 2)) * index_scale)  # (n, Hi, k)
    scores = torch.matmul(weights.float().unsqueeze(1), relu).squeeze(1)  # (n, k)
    empty = selected < 0
    log_probs = scores.masked_fill(empty, float("-inf")).log_softmax(-1).masked_fill(empty, 0.0)
    return target, log_probs, keys, relu


# ---- the layer -----------------------------------------------------------------------------------------------


def _indexer_inputs(indexer: nn.Module, hidden: torch.Tensor, q_latent: torch.Tensor, cos, sin, rotate):
    """The indexer's queries (B, L, Hi, Di), keys (B, L, Di) and head weights (B, L, Hi), fp32, computed as
    DeepseekV32Indexer.forward computes them."""
    B, L, _ = hidden.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_latent).view(B, L, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # (B, L, 1, Di)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads**-0.5
    return q.float(), k.float(), weights


def indexed_attention_forward(
    self: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None, cache=None, position_ids: torch.Tensor | None = None,
    prev_topk_indices: torch.Tensor | None = None, **kwargs,
):
    """longfit's forward of a DeepseekV32Attention / GlmMoeDsaAttention module (module docstring): the selection
    linear in L, the attention over it in the latent form. Returns what the module returns: (output, None), and on
    GLM-5 the selection too, for the "shared" layer after it."""
    _refuse(self, attention_mask, cache, kwargs)
    modeling = sys.modules[type(self).__module__]
    B, L, _ = hidden_states.shape  # L: this rank's tokens
    cos, sin = position_embeddings
    # Under context parallelism (`parallelize` sets the hook) this rank's queries select and attend among the keys
    # of the whole rows, all-gathered (parallel/gathered_keys.py: why that exchange); the layout is global.
    context_parallel = getattr(self, "longfit_context_parallel", None)
    length = L * context_parallel.cp_size if context_parallel is not None else L
    spans = context_parallel.token_spans(length) if context_parallel is not None else None
    whole_rows = context_parallel.gather_tokens if context_parallel is not None else (lambda x: x)

    q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))  # (B, L, q_lora_rank)
    q = self.q_b_proj(q_latent).view(B, L, -1, self.qk_head_dim)  # (B, L, H, nope + rope)
    q_nope, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], -1)
    latent = self.kv_a_layernorm(kv_nope)  # (B, L, r)
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot.unsqueeze(2), cos, sin, unsqueeze_dim=2)

    selected = prev_topk_indices
    # Under train.indexer_loss (and a gradient) the indexer's outputs keep theirs, from its detached inputs
    learns = getattr(self, INDEXER_LOSS, False) and torch.is_grad_enabled()
    if getattr(self, "indexer", None) is not None:
        documents = call_documents(kwargs.get("cu_seq_lens_q"), kwargs.get("longfit_documents"), position_ids, B)
        with torch.enable_grad() if learns else torch.no_grad():
            rotate = getattr(sys.modules[type(self.indexer).__module__], INDEXED_ATTENTION[self.config.model_type])
            index_q, index_k, weights = _indexer_inputs(self.indexer, hidden_states.detach(), q_latent.detach(), cos,
                                                        sin, rotate)
            index_k = whole_rows(index_k)
        with torch.no_grad():
            selected = select_keys(index_q.detach(), index_k.detach(), weights.detach(), self.indexer.softmax_scale,
                                   min(self.indexer.index_topk, length), document_rows(documents, B, length), spans)
    elif selected is None:
        raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")

    # kv_b_proj's weight per head, as the module applies it: (r, H, nope + dv)
    identity = torch.eye(self.kv_lora_rank, dtype=latent.dtype, device=latent.device)
    weight = self.kv_b_proj(identity).view(self.kv_lora_rank, -1, self.qk_nope_head_dim + self.v_head_dim)
    w_key, w_value = torch.split(weight, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    q_absorbed = torch.cat([torch.einsum("blhn,rhn->blhr", q_nope, w_key), q_rot], dim=-1)  # (B, L, H, r + rope)
    keys = torch.cat([latent, k_rot.squeeze(2)], dim=-1)  # (B, L, r + rope)
    q_absorbed, keys = (t.to(torch.promote_types(q_absorbed.dtype, keys.dtype)) for t in (q_absorbed, keys))
    keys = whole_rows(keys)
    out, lse = LatentSparseAttention.apply(q_absorbed, keys, selected, self.scaling, self.kv_lora_rank)
    if learns and getattr(self, "indexer", None) is not None:
        # Computed on a recompute of a checkpointed layer too (the same saved tensors), collected on the first run
        term = IndexerKL.apply(index_q, index_k, weights, selected, q_absorbed.detach(), keys.detach(), lse,
                               self.scaling, self.indexer.softmax_scale)
        terms = getattr(self, INDEXER_TERMS, None)
        if terms is not None:
            terms.append(term)
    out = torch.einsum("blhr,rhv->blhv", out.to(w_value.dtype), w_value).reshape(B, L, -1)  # (B, L, H x dv)
    out = self.o_proj(out)
    return (out, None, selected) if hasattr(self, "skip_topk") else (out, None)


def _refuse(module: nn.Module, attention_mask, cache, kwargs: dict) -> None:
    name = type(module).__name__
    hook = getattr(module, "longfit_context_parallel", None)
    if hook is not None and not hasattr(hook, "gather_tokens"):  # a tile run's attention (memory/tiled_layers.py)
        raise ConfigError(f"{name}'s sparse indexed attention cannot run on tiled layers (a tile's queries select "
                          "among every earlier key): set memory.tiled_layers=false")
    if attention_mask is not None or cache is not None:
        raise ConfigError(f"{name}'s sparse indexed attention takes no attention_mask and no cache: describe packed "
                          "documents with position_ids and cu_seq_lens_q")
    if module.training and module.attention_dropout:
        raise ConfigError(f"attention dropout ({module.attention_dropout}) is not supported (it draws random masks): "
                          "train with train.disable_dropout=true, the default")


def indexed_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of `model` with an indexer (or sharing one: GLM-5's "shared" layers)."""
    return [m for m in model.modules()
            if getattr(getattr(m, "config", None), "model_type", None) in INDEXED_ATTENTION
            and hasattr(m, "kv_b_proj") and hasattr(m, "indexer")]


def prepare_sparse_attention(model: nn.Module) -> int:
    """Route every indexed attention module of `model` through `indexed_attention_forward`; returns how many.
    Idempotent."""
    modules = indexed_attention_modules(model)
    for module in modules:
        if not getattr(module, INSTALLED, False):
            module.forward = types.MethodType(indexed_attention_forward, module)
            setattr(module, INSTALLED, True)
    return len(modules)


def train_indexers(model: nn.Module) -> int:
    """Make the indexers of `model`'s indexed attention (routed by `prepare_sparse_attention`) compute their KL
    loss (module docstring, 3.) whenever the forward takes gradients; returns how many. Idempotent."""
    modules = [m for m in indexed_attention_modules(model)
               if getattr(m, INSTALLED, False) and getattr(m, "indexer", None) is not None]
    for module in modules:
        setattr(module, INDEXER_LOSS, True)
    return len(modules)


@contextlib.contextmanager
def indexer_losses(model: nn.Module):
    """The indexer losses of the layers of `model` that compute one (`train_indexers`) during the forward in the
    block, in the order of the layers: each the sum over its queries (a 0-dim fp32 tensor)."""
    modules = [m for m in indexed_attention_modules(model) if getattr(m, INDEXER_LOSS, False)]
    terms: list[torch.Tensor] = []
    for module in modules:
        setattr(module, INDEXER_TERMS, terms)
    try:
        yield terms
    finally:
        for module in modules:
            delattr(module, INDEXER_TERMS)
