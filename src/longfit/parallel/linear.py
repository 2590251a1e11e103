"""The linear-attention (Gated DeltaNet) layers of hybrid models under context parallelism, exact for both
methods and packed documents.

A linear-attention layer is a short depthwise causal convolution (K taps) followed by the gated delta rule, a
recurrence along the GLOBAL sequence (longfit.models.linear_attention): the state of value head h after token t,
S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, restarting at each document.

What the zigzag layout means for the recurrence. The ring balances the full-attention layers by giving rank r
the chunks r and 2cp-1-r of 2cp. Passing the state along the sequence would visit the chunks in global order,
0 (rank 0), 1 (rank 1), ..., cp-1 (rank cp-1), cp (rank cp-1 again), ..., 2cp-1 (rank 0): a chain of 2cp
dependent chunk computations in which each rank works during two steps and waits during the others, forward
and (reversed) backward. Even the contiguous layout of Ulysses gives a chain of cp steps. Breaking the chain
needs each chunk's affine map S_out = A S_in + B (A the product of the chunk's Dk x Dk transitions, obtained by
running the rule a second time on the identity), a scan over the 2cp maps, and a third pass for the outputs.

The heads break it for free: every value head has its own state and the heads never mix inside the rule (each
q/k head is read by Hv / Hk value heads, never written). So the linear layers trade the sequence split for a
head split, as Ulysses does for attention (one all-to-all, ulysses.py): rank r then holds value heads
[r Hv/cp, (r+1) Hv/cp) (with their q/k heads) over the whole rows, runs the rule exactly as on one device with
the global document layout, and a second all-to-all returns the output to the sequence split. No state ever
crosses ranks, the work is balanced (L x Hv/cp per rank), and the same code serves both methods: the layout
only decides the ORDER of the gathered tokens. The all-to-all concatenates the ranks' shards in rank order;
contiguous shards are then the global order, zigzag shards are chunks (0, 2cp-1, 1, 2cp-2, ...), put into global
order before the rule (an index along the sequence) and back after it. The full-attention layers of the same
model keep their method (the ring or Ulysses): the batch is sharded once, in the method's layout.

Heads: Hv must divide by cp (ParallelDims.check_linear_attention). With Hk % cp != 0 the q/k heads are first
repeated to one per value head (repeat_interleave, whose backward sums the copies), so that each rank's value
heads meet their own q/k heads.

The convolution stays on the sequence split: its output at p reads x[p-K+1 .. p], so a local span needs the
K-1 inputs before it, held by the rank with the span before it (the halo; `span_causal_conv`, the span of
models/linear_attention.py that tiled layers also carry from one tile to the next, there in time):
- contiguous: rank r's span follows rank r-1's;
- zigzag: chunk r (rank r's first) follows chunk r-1, rank r-1's first chunk; chunk 2cp-1-r (rank r's second)
  follows chunk 2cp-2-r, rank r+1's second chunk, or for rank cp-1 its own first chunk (chunk cp-1).
Each rank sends the tail of every span to the span's successor and receives the halos of its own spans (one
batch of P2P messages of B x C x (K-1) elements); the backward returns each halo's gradient to the rank whose
inputs it came from, which adds it there. Documents restart the convolution from their GLOBAL offsets, so a
halo from another document is never read. Spans are at least K-1 tokens long (seq_len / (2cp) tokens is
thousands in practice).

Communication per linear layer and rank: forward, two all-to-alls in (q|k stacked, v|g|beta stacked) and one
out, plus the halos; backward, the reverse exchanges. With one rank (or no group) the same code runs locally.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from longfit.data.packing import DocumentLayout, device_cache
from longfit.models.linear_attention import gated_delta_rule, span_causal_conv
from longfit.parallel.comm import group_rank, group_size
from longfit.parallel.ring import _post
from longfit.parallel.sharding import Layout, shard_positions, shard_spans
from longfit.parallel.ulysses import _HeadsToSequence, _SequenceToHeads

_CONV_HALO_TAG = 4
_CONV_HALO_GRAD_TAG = 5


# ---- the convolution's halo --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _halo_routes(seq_len: int, cp: int, layout: Layout) -> list[tuple[int, int, int, int, int]]:
    """Every halo: (sender, start of the sender's local tail, receiver, receiver's span index, span start).

    The tail is the local slice of the K-1 tokens before the receiver's span ends at `start of tail` + K-1.
    Spans starting at 0 have no halo. Computed from the layout alone, the same on every rank.
    """
    owner = {}  # global span end -> (rank, local end of that span)
    for rank in range(cp):
        local = 0
        for start, end in shard_spans(seq_len, rank, cp, layout):
            local += end - start
            owner[end] = (rank, local)
    routes = []
    for rank in range(cp):
        for index, (start, _) in enumerate(shard_spans(seq_len, rank, cp, layout)):
            if start > 0:
                sender, local_end = owner[start]
                routes.append((sender, local_end, rank, index, start))
    return routes


def _exchange_halos(x: torch.Tensor, group, seq_len: int, layout: Layout, width: int) -> torch.Tensor:
    """x (B, C, n) local inputs -> (spans, B, C, width): the `width` inputs before each local span (zeros at 0)."""
    rank, cp = group_rank(group), group_size(group)
    spans = len(shard_spans(seq_len, rank, cp, layout))
    halos = x.new_zeros(spans, *x.shape[:2], width)
    sends, receives = [], []
    for sender, local_end, receiver, index, _ in _halo_routes(seq_len, cp, layout):
        tail = x[:, :, local_end - width : local_end]
        if sender == receiver == rank:
            halos[index] = tail
        elif sender == rank:
            sends.append((tail.contiguous(), receiver))
        elif receiver == rank:
            receives.append((halos[index], sender))
    for work in _post(group, _CONV_HALO_TAG, sends, receives):
        work.wait()
    return halos


def _return_halo_grads(halo_grads: torch.Tensor, group, seq_len: int, layout: Layout, local_len: int) -> torch.Tensor:
    """The reverse of `_exchange_halos`: (spans, B, C, width) halo gradients -> (B, C, n) gradient of the tails."""
    rank, cp = group_rank(group), group_size(group)
    width = halo_grads.shape[-1]
    grad = halo_grads.new_zeros(*halo_grads.shape[1:3], local_len)
    sends, receives = [], []
    for sender, local_end, receiver, index, _ in _halo_routes(seq_len, cp, layout):
        if sender == receiver == rank:
            grad[:, :, local_end - width : local_end] += halo_grads[index]
        elif receiver == rank:
            sends.append((halo_grads[index].contiguous(), sender))
        elif sender == rank:
            receives.append((halo_grads.new_empty(halo_grads.shape[1:]), receiver, local_end))
    works = _post(group, _CONV_HALO_GRAD_TAG, sends, [(buffer, peer) for buffer, peer, _ in receives])
    for work in works:
        work.wait()
    for buffer, _, local_end in receives:
        grad[:, :, local_end - width : local_end] += buffer
    return grad


class _Halos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_len, layout, width):
        ctx.group, ctx.seq_len, ctx.layout, ctx.local_len = group, seq_len, layout, x.shape[2]
        return _exchange_halos(x, group, seq_len, layout, width)

    @staticmethod
    def backward(ctx, halo_grads):
        return _return_halo_grads(halo_grads, ctx.group, ctx.seq_len, ctx.layout, ctx.local_len), None, None, None, None


# ---- the gated delta rule over a head split ----------------------------------------------------------------


@device_cache(64)
def _gathered_positions(seq_len: int, cp: int, layout: Layout, device: torch.device) -> torch.Tensor:
    """(seq_len,) on `device`: the global position of each token of the all-to-all's output (ranks' shards in rank
    order). Made once per shape and device."""
    return torch.cat([shard_positions(seq_len, rank, cp, layout) for rank in range(cp)]).to(device)


def _to_heads(x: torch.Tensor, group, order: torch.Tensor | None) -> torch.Tensor:
    """(B, n, h, D) sequence shard -> (B, L, h/cp, D) whole rows in global order."""
    x = _SequenceToHeads.apply(x.transpose(1, 2).contiguous(), group)  # (B, h/cp, L, D), gathered order
    if order is not None:
        x = x[:, :, torch.argsort(order)]  # the inverse permutation
    return x.transpose(1, 2)


def _to_sequence(x: torch.Tensor, group, order: torch.Tensor | None) -> torch.Tensor:
    """(B, L, h/cp, D) whole rows in global order -> (B, n, h, D) sequence shard."""
    x = x.transpose(1, 2)
    if order is not None:
        x = x[:, :, order]
    return _HeadsToSequence.apply(x.contiguous(), group).transpose(1, 2)


class ContextParallelLinearAttention:
    """The kernels of a linear-attention layer on a cp `group` whose shards are in `layout` (module docstring).

    `parallelize` puts it on each linear-attention module as `longfit_context_parallel`; the module's calls
    bring local (sequence-split) tensors and the GLOBAL document layout. group None: a single process.
    """

    def __init__(self, group: dist.ProcessGroup | None, layout: Layout):
        self.group, self.layout = group, layout

    def conv(self, x, weight, bias, activation, documents: DocumentLayout | None) -> torch.Tensor:
        """x (B, C, n) local inputs -> (B, C, n)."""
        n = x.shape[2]
        cp, rank = group_size(self.group), group_rank(self.group)
        seq_len = n * cp
        spans = shard_spans(seq_len, rank, cp, self.layout)
        halos = _Halos.apply(x, self.group, seq_len, self.layout, weight.shape[1] - 1)  # (spans, B, C, K-1)
        pieces, local = [], 0
        for index, (start, end) in enumerate(spans):
            piece = x[:, :, local : local + end - start]
            pieces.append(span_causal_conv(piece, weight, bias, activation, documents, seq_len, start, halos[index])[0])
            local += end - start
        return torch.cat(pieces, dim=2)

    def delta_rule(self, q, k, v, g, beta, documents: DocumentLayout | None, use_qk_l2norm: bool) -> torch.Tensor:
        """q, k (B, n, Hk, Dk), v (B, n, Hv, Dv), g, beta (B, n, Hv) local -> (B, n, Hv, Dv)."""
        cp = group_size(self.group)
        Hk, Hv = k.shape[2], v.shape[2]
        assert Hv % cp == 0, f"the {Hv} linear-attention value heads must divide by cp={cp} (ParallelDims)"
        if Hk % cp:
            q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
        seq_len = q.shape[1] * cp
        order = None if self.layout == "contiguous" else _gathered_positions(seq_len, cp, self.layout, q.device)
        Dk, Dv, v_dtype = q.shape[3], v.shape[3], v.dtype
        qk = _to_heads(torch.cat([q, k], dim=3), self.group, order)  # (B, L, Hk/cp, 2 Dk)
        vgb = _to_heads(torch.cat([v.float(), g.float()[..., None], beta.float()[..., None]], dim=3), self.group, order)
        q, k = qk.split(Dk, dim=3)
        v, g, beta = vgb[..., :Dv].to(v_dtype), vgb[..., Dv].to(g.dtype), vgb[..., Dv + 1].to(beta.dtype)
        out, _ = gated_delta_rule(q, k, v, g, beta, documents, use_qk_l2norm)  # (B, L, Hv/cp, Dv)
        return _to_sequence(out, self.group, order)

    def __deepcopy__(self, memo: dict) -> "ContextParallelLinearAttention":
        return self  # a process group cannot be copied (as ContextParallelAttention)

    def __repr__(self) -> str:
        return f"ContextParallelLinearAttention(layout={self.layout!r}, cp={group_size(self.group)})"
