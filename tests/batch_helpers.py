"""Packed batches made by hand for the parity tests: the layout the packer produces, on given document lengths."""

from __future__ import annotations

import torch

from longfit.data.packing import PackedBatch


def packed_rows(doc_lengths: list[list[int]], length: int, vocab: int, seed: int) -> PackedBatch:
    """Rows of `length` random tokens (drawn from `seed`), row b packing documents of doc_lengths[b] tokens, laid
    out as the packer does (PackedBatch.of_documents)."""
    input_ids = torch.randint(0, vocab, (len(doc_lengths), length), generator=torch.Generator().manual_seed(seed))
    return PackedBatch.of_documents(input_ids, doc_lengths)


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
