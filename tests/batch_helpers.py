"""Packed batches made by hand for the parity tests: the layout the packer produces, on given document lengths."""

from __future__ import annotations

import torch

from longfit.data.packing import PackedBatch


def packed_rows(doc_lengths: list[list[int]], length: int, vocab: int, seed: int) -> PackedBatch:
    """Rows of `length` random tokens (drawn from `seed`), row b packing documents of doc_lengths[b] tokens:
    position_ids restart in every document, each label is the next token of its document (-100 at the
    document's end, so nothing is predicted across a boundary), and cu_seqlens holds the document starts over
    the flattened rows."""
    rows = len(doc_lengths)
    input_ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    labels = torch.full((rows, length), -100)
    position_ids = torch.empty((rows, length), dtype=torch.long)
    starts = [0]
    for b, lengths in enumerate(doc_lengths):
        assert sum(lengths) == length, (lengths, length)
        offset = 0
        for n in lengths:
            position_ids[b, offset : offset + n] = torch.arange(n)
            labels[b, offset : offset + n - 1] = input_ids[b, offset + 1 : offset + n]
            offset += n
            starts.append(b * length + offset)
    cu_seqlens = torch.tensor(starts, dtype=torch.int32)
    return PackedBatch(input_ids, labels, position_ids, cu_seqlens, int((labels != -100).sum()))


def target_spans(tokenizer, labels: torch.Tensor) -> list[str]:
    """The decoded runs of consecutive target tokens of one packed row's labels (-100: no target)."""
    spans, current = [], []
    for label in labels.tolist() + [-100]:
        if label != -100:
            current.append(label)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans
