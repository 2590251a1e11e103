"""Packed batches made by hand for the parity tests: the layout the packer produces, on given document lengths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longfit.data.packing import PackedBatch


def packed_rows(doc_lengths: list[list[int]], length: int, vocab: int, seed: int) -> PackedBatch:
    """Rows of `length` random tokens (drawn from `seed`), row b packing documents of doc_lengths[b] tokens, laid
    out as the packer does (PackedBatch.of_documents)."""
    input_ids = torch.randint(0, vocab, (len(doc_lengths), length), generator=torch.Generator().manual_seed(seed))
    return PackedBatch.of_documents(input_ids, doc_lengths)


def per_document_loss(model, batch: PackedBatch) -> torch.Tensor:
    """A transformers model on each document of each row alone (one document per row where cu_seqlens is None):
    the token-mean cross-entropy of the whole batch, from fp32 logits."""
    from longfit.check.parity import documents

    length = batch.input_ids.shape[1]
    whole_rows = [(row, 0, length) for row in range(batch.input_ids.shape[0])]
    spans = documents(batch) if batch.cu_seqlens is not None else whole_rows
    total = 0.0
    for row, start, end in spans:
        logits = model(input_ids=batch.input_ids[row : row + 1, start:end],
                       position_ids=batch.position_ids[row : row + 1, start:end], use_cache=False).logits
        total = total + F.cross_entropy(logits[0].float(), batch.labels[row, start:end], reduction="sum")
    return total / batch.num_label_tokens


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
