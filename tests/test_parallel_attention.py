"""Single-process tests of the context-parallel building blocks: kernels with lse, the online-softmax
merge, sequence layouts, document layouts and the ring's block plans. The multi-process parity tests
are in test_parallel_attention_dist.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from longfit.data.packing import DocumentLayout, document_rows
from longfit.models import kernels
from longfit.models.kernels import (
    FULL,
    LOWER,
    UPPER,
    attention_backward,
    attention_forward,
    merge_partial,
)
from longfit.parallel.context import ContextParallelAttention
from longfit.parallel.ring import _ring_schedule, ring_attention
from longfit.parallel.sharding import (
    shard_positions,
    shard_sequence,
    shard_spans,
    unshard_sequence,
)
from longfit.parallel.ulysses import ulysses_attention


def _randn(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _math_attention(q, k, v, mask: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit scores -> (out, lse), K/V heads repeated for GQA; differentiable."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = scale * q @ k.transpose(-1, -2)
    if mask != FULL:
        visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
        visible = visible.tril() if mask == LOWER else visible.triu()
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


SHAPES = [  # (H, Hkv, Lq, Lk, mask)
    (4, 4, 24, 24, LOWER),
    (4, 2, 24, 24, LOWER),
    (4, 1, 17, 17, LOWER),
    (4, 2, 24, 24, UPPER),
    (4, 1, 17, 17, UPPER),
    (4, 2, 8, 24, FULL),
    (4, 4, 24, 8, FULL),
]


@pytest.mark.parametrize("native_gqa", [True, False], ids=["kernel-gqa", "expanded-kv"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("H,Hkv,Lq,Lk,mask", SHAPES)
def test_kernels_match_math_attention(monkeypatch, native_gqa, dtype, H, Hkv, Lq, Lk, mask) -> None:
    monkeypatch.setattr(kernels, "_CPU_NATIVE_GQA", native_gqa and kernels._CPU_NATIVE_GQA)
    q, dout = _randn(2, H, Lq, 16, dtype=dtype), _randn(2, H, Lq, 16, dtype=dtype, seed=3)
    k, v = _randn(2, Hkv, Lk, 16, dtype=dtype, seed=1), _randn(2, Hkv, Lk, 16, dtype=dtype, seed=2)
    scale = 0.3
    out, lse = attention_forward(q, k, v, mask, scale)
    assert lse.dtype == kernels.accumulation_dtype(dtype) and lse.shape == (2, H, Lq)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _math_attention(q64, k64, v64, mask, scale)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
    assert_close(out, ref_out.detach().to(dtype))
    assert_close(lse, ref_lse.detach().to(lse.dtype))
    grads = attention_backward(dout, q, k, v, out, lse, mask, scale)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape
        assert_close(got, want.to(dtype))


def test_kernels_accept_the_sequence_major_views_transformers_passes() -> None:
    """q/k/v and dout arrive as (B, L, H, D) tensors transposed to (B, H, L, D): strided, not contiguous."""
    q, k, v, dout = (_randn(2, 24, h, 16, seed=s).transpose(1, 2) for s, h in enumerate((4, 2, 2, 4)))
    out, lse = attention_forward(q, k, v, LOWER, 0.25)
    grads = attention_backward(dout, q, k, v, out, lse, LOWER, 0.25)
    contiguous = [t.contiguous() for t in (q, k, v, dout)]
    want_out, want_lse = attention_forward(*contiguous[:3], LOWER, 0.25)
    want_grads = attention_backward(contiguous[3], *contiguous[:3], want_out, want_lse, LOWER, 0.25)
    assert_close(out, want_out)
    for got, want in zip(grads, want_grads):
        assert_close(got, want)


def test_backward_of_each_key_block_with_merged_statistics_sums_to_full_gradient() -> None:
    """The ring's identity: per-block backward with the FINAL out/lse gives that block's exact share."""
    H, Hkv, L, scale = 4, 2, 32, 0.25
    q, k, v = _randn(2, H, L, 16), _randn(2, Hkv, L, 16, seed=1), _randn(2, Hkv, L, 16, seed=2)
    dout = _randn(2, H, L, 16, seed=3)
    # Queries are the last 16 tokens; keys split into an earlier block (fully visible) and the
    # queries' own block (causal diagonal).
    qs = q[:, :, 16:]
    blocks = [(slice(0, 16), FULL), (slice(16, 32), LOWER)]
    out = torch.zeros(2, H, 16, 16, dtype=torch.float64)
    lse = torch.full((2, H, 16), float("-inf"), dtype=torch.float64)
    for span, mask in blocks:
        block_out, block_lse = attention_forward(qs, k[:, :, span], v[:, :, span], mask, scale)
        out, lse = merge_partial(out, lse, block_out, block_lse)
    dq = torch.zeros_like(qs)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for span, mask in blocks:
        bdq, bdk, bdv = attention_backward(dout[:, :, 16:], qs, k[:, :, span], v[:, :, span], out, lse, mask, scale)
        dq += bdq
        dk[:, :, span] += bdk
        dv[:, :, span] += bdv

    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _math_attention(q_ref, k_ref, v_ref, LOWER, scale)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref_out[:, :, 16:], (q_ref, k_ref, v_ref), dout[:, :, 16:])
    assert_close(out, ref_out[:, :, 16:].detach())
    assert_close(lse, ref_lse[:, :, 16:].detach())
    assert_close(dq, ref_dq[:, :, 16:])
    assert_close(dk, ref_dk)
    assert_close(dv, ref_dv)


def test_merge_partial_of_disjoint_key_sets_equals_attention_over_their_union() -> None:
    q, k, v = _randn(2, 4, 8, 16), _randn(2, 4, 20, 16, seed=1), _randn(2, 4, 20, 16, seed=2)
    scale = 3.0  # large logits: the merge must not overflow
    parts = [attention_forward(q, k[:, :, span], v[:, :, span], FULL, scale) for span in (slice(0, 7), slice(7, 20))]
    want_out, want_lse = attention_forward(q, k, v, FULL, scale)
    empty = (torch.zeros(2, 4, 8, 16, dtype=torch.float64), torch.full((2, 4, 8), float("-inf"), dtype=torch.float64))
    for order in (parts, parts[::-1]):
        out, lse = empty
        for block_out, block_lse in order:
            out, lse = merge_partial(out, lse, block_out, block_lse)
        assert_close(out, want_out)
        assert_close(lse, want_lse)


def test_merge_partial_keeps_rows_without_keys_finite_and_accumulates_low_precision_in_fp32() -> None:
    out = torch.zeros(1, 1, 3, 4)
    lse = torch.full((1, 1, 3), float("-inf"))
    block_out = torch.randn(1, 1, 3, 4).to(torch.bfloat16)
    block_lse = torch.tensor([[[0.5, float("-inf"), 2.0]]])  # the middle query sees no key in this block
    merged_out, merged_lse = merge_partial(out, lse, block_out, block_lse)
    assert merged_out.dtype == torch.float32 and not merged_out.isnan().any()
    assert_close(merged_out[:, :, [0, 2]], block_out[:, :, [0, 2]].float())
    assert_close(merged_out[:, :, 1], torch.zeros(1, 1, 4))
    assert_close(merged_lse, block_lse)


def test_zigzag_layout_pairs_an_early_and_a_late_chunk() -> None:
    assert shard_positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert shard_spans(16, 1, 4, "zigzag") == [(2, 4), (12, 14)]
    assert shard_positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_and_unshard_round_trip(layout: str, cp: int) -> None:
    x = torch.arange(2 * 3 * 16).view(2, 3, 16)
    shards = [shard_sequence(x, 2, r, cp, layout) for r in range(cp)]
    assert all(s.shape == (2, 3, 16 // cp) for s in shards)
    assert torch.equal(unshard_sequence(shards, 2, layout), x)
    positions = torch.cat([shard_positions(16, r, cp, layout) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(16))
    for r, shard in enumerate(shards):
        assert torch.equal(shard, x[:, :, shard_positions(16, r, cp, layout)])


def _documents(docs) -> DocumentLayout | None:
    """The layout of rows of `docs` (per row, its documents' lengths); None: one document per row."""
    if docs is None:
        return None
    return DocumentLayout.from_cu_seqlens(torch.tensor([0] + [n for row in docs for n in row]).cumsum(0), len(docs))


def test_document_layout_from_global_cu_seqlens() -> None:
    cu = torch.tensor([0, 3, 8, 8, 10, 16], dtype=torch.int32)  # an empty document at 8
    layout = DocumentLayout.from_cu_seqlens(cu, 2)
    assert layout.rows == (((0, 3), (3, 8)), ((0, 2), (2, 8))) and layout.length == 8
    assert layout.cu_seqlens() == [0, 3, 8, 10, 16] and layout.longest == 6 and not layout.one_per_row
    assert DocumentLayout.from_cu_seqlens([0, 8, 16], 2).one_per_row
    assert document_rows(layout, 2, 8) is layout.rows and document_rows(None, 2, 8) == (((0, 8),), ((0, 8),))
    with pytest.raises(ValueError, match="crosses the end of row 0"):
        DocumentLayout.from_cu_seqlens(torch.tensor([0, 3, 10, 16]), 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        DocumentLayout.from_cu_seqlens([0, 5, 3, 16], 2)
    with pytest.raises(ValueError, match="GLOBAL"):
        DocumentLayout.from_cu_seqlens([0, 4, 9], 2)
    with pytest.raises(ValueError, match="GLOBAL"):  # a shard's length, not the whole row's
        document_rows(DocumentLayout.from_cu_seqlens(torch.tensor([0, 4, 8]), 2), 2, 8)


def _block_pairs(block, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """(queries, keys) 0/1: the pairs one block computes; global positions -1 are never touched."""
    qi, ki = q_pos[block.q], kv_pos[block.kv]
    assert (qi >= 0).all() and (ki >= 0).all(), "a block reads outside the K/V it was planned for"
    visible = torch.ones(len(qi), len(ki), dtype=torch.long)
    if block.mask == LOWER:
        visible = visible.tril()
    elif block.mask == UPPER:
        visible = visible.triu()
    if block.window is not None:
        assert torch.equal(qi, ki), "a sliding-window block attends its own tokens"
        visible = visible * (qi.unsqueeze(1) - ki.unsqueeze(0) < block.window)
    return visible


def _schedule_kv_positions(schedule, rank: int, step: int, cp: int, seq_len: int) -> torch.Tensor:
    """Global positions of the K/V a rank holds at `step` (-1: a halo slot without a neighbour)."""
    if schedule.halo is None or step == 0:
        return shard_positions(seq_len, (rank - step) % cp, cp, "zigzag")
    chunk, width = seq_len // (2 * cp), schedule.halo
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    previous = torch.arange(first - width, first) if rank > 0 else torch.full((width,), -1)
    following = torch.arange(second - width, second) if rank < cp - 1 else torch.full((width,), -1)
    return torch.cat([previous, following])


def _covered_pairs(
    cp: int, seq_len: int, documents: DocumentLayout | None, batch: int, window: int | None = None
) -> torch.Tensor:
    """How often each (row, query, key) global pair is computed by the ring's blocks, all ranks and steps."""
    count = torch.zeros(batch, seq_len, seq_len, dtype=torch.long)
    local = seq_len // cp
    for rank in range(cp):
        q_pos = shard_positions(seq_len, rank, cp, "zigzag")
        schedule = _ring_schedule(rank, cp, batch, local, documents, window)
        for step, blocks in enumerate(schedule.steps):
            kv_pos = _schedule_kv_positions(schedule, rank, step, cp, seq_len)
            for block in blocks:
                qi, ki = q_pos[block.q], kv_pos[block.kv]
                count[block.rows, qi.unsqueeze(1), ki.unsqueeze(0)] += _block_pairs(block, q_pos, kv_pos)
    return count


def _visible_pairs(docs, seq_len: int, window: int | None) -> torch.Tensor:
    doc_id = torch.zeros(2, seq_len, dtype=torch.long)
    for b, lengths in enumerate(docs or ((seq_len,), (seq_len,))):
        doc_id[b] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(seq_len)
    distance = position.unsqueeze(1) - position.unsqueeze(0)
    visible = (doc_id.unsqueeze(2) == doc_id.unsqueeze(1)) & (distance >= 0)
    return (visible & (distance < window) if window else visible).long()


# Every document at most 12 tokens (a packed row cut into chunks of 12), each row 64.
SHORT_DOCS = ((12, 12, 12, 12, 12, 4), (7, 12, 12, 12, 12, 9))


@pytest.mark.parametrize("window", [None, 1, 5, 8, 9, 20])
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("docs", [None, ((5, 20, 3, 36), (1, 30, 17, 16)), ((10, 22, 32), (10, 22, 32)), SHORT_DOCS])
def test_ring_blocks_cover_exactly_the_visible_pairs(cp: int, docs, window) -> None:
    """Every visible pair once, nothing else: causal, per document, within the window; with cp=4 and a
    window up to 9 (W - 1 <= C = 8) through the halo, beyond it through ring hops that skip far blocks; documents
    of at most 12 tokens (Llama 4's chunks of 12) through the halo of 11 from cp=2 (C = 16), through hops at cp=4."""
    seq_len = 64
    assert torch.equal(_covered_pairs(cp, seq_len, _documents(docs), 2, window), _visible_pairs(docs, seq_len, window))


def test_short_documents_exchange_the_halo_their_longest_reaches() -> None:
    """Without a window, no key of a document of at most S tokens is S or more back: the halo of S - 1 = 11 serves
    chunks of C >= 11 (cp=2: 16), ring hops smaller ones (cp=4: 8); a window narrower than S keeps its own halo."""
    documents = _documents(SHORT_DOCS)
    assert all(_ring_schedule(rank, 2, 2, 32, documents, None).halo == 11 for rank in range(2))
    assert all(_ring_schedule(rank, 4, 2, 16, documents, None).halo is None for rank in range(4))
    assert all(_ring_schedule(rank, 4, 2, 16, documents, 5).halo == 4 for rank in range(4))


@pytest.mark.parametrize("cp,window,halo", [(4, 9, True), (4, 10, False), (2, 16, True), (1, 5, True)])
def test_sliding_layers_exchange_a_halo_when_the_window_fits_a_chunk(cp: int, window: int, halo: bool) -> None:
    schedules = [_ring_schedule(rank, cp, 2, 64 // cp, None, window) for rank in range(cp)]
    if halo:
        assert all(s.halo == window - 1 and len(s.steps) == 2 for s in schedules)
    else:  # ring hops; a step whose shard no window reaches computes nothing
        assert all(s.halo is None and len(s.steps) == cp for s in schedules)
        assert any(not blocks for s in schedules for blocks in s.steps)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work_each_step(cp: int) -> None:
    local = 64 // cp
    for step in range(cp):
        work = set()
        for rank in range(cp):
            (block,) = _ring_schedule(rank, cp, 1, local, None, None).steps[step]
            q_len, kv_len = block.q.stop - block.q.start, block.kv.stop - block.kv.start
            work.add(q_len * (kv_len + 1) // 2 if block.mask == LOWER else q_len * kv_len)
        assert len(work) == 1


def test_context_parallel_attention_layout_and_method_errors() -> None:
    ring = ContextParallelAttention(None, "ring")
    assert ring.layout == "zigzag" and copy.deepcopy(ring) is ring
    assert ContextParallelAttention(None, "ulysses").layout == "contiguous"
    with pytest.raises(ValueError, match="parallel.cp_method='striped'"):
        ContextParallelAttention(None, "striped")


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("attention", [ring_attention, ulysses_attention], ids=["ring", "ulysses"])
@pytest.mark.parametrize("docs", [None, ((5, 20, 3, 4), (32,))])
def test_single_process_without_group_matches_per_document_attention(attention, docs, window) -> None:
    """group=None (no distributed run): the context-parallel code path runs locally, no communication."""
    q, k, v = _randn(2, 4, 32, 16), _randn(2, 2, 32, 16, seed=1), _randn(2, 2, 32, 16, seed=2)
    dout = _randn(2, 4, 32, 16, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, None, scale=0.3, documents=_documents(docs), window=window)
    grads = torch.autograd.grad(out, leaves, dout)

    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = 2
    scores = 0.3 * refs[0] @ refs[1].repeat_interleave(groups, 1).transpose(-1, -2)
    scores = scores.masked_fill(~_visible_pairs(docs, 32, window).bool().unsqueeze(1), float("-inf"))
    want = scores.softmax(-1) @ refs[2].repeat_interleave(groups, 1)
    assert_close(out, want)
    for got, ref in zip(grads, torch.autograd.grad(want, refs, dout)):
        assert_close(got, ref)
