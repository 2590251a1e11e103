"""The loss by position: does a model predict as well past its original window as within it?

Rows are packed as training packs them; each target token is counted in the bucket of the position of the token that
predicts it (its document's `position_ids`: what the RoPE rotates by), so a bucket past the window holds the tokens
of documents longer than the window only. The buckets (`position_edges`) halve the window down to a quarter of it
and double it up to the row: [0, w/4), [w/4, w/2), [w/2, w), [w, 2w), [2w, 4w), ... One forward of the decoder per
batch, then lm_head and the cross-entropy over token chunks, so the (L, vocab) logits never exist whole.

Rows with images and videos (#54) run as the eval loss runs them (`CausalLMLoss.media_inputs`: the images'
embeddings in their placeholders, the family's positions and attention layout), and a token's position is the one its
RoPE rotates by: the family's M-RoPE positions where it has them (`MediaEncoder.rope_positions`: an image of h x w
tokens takes max(h, w) positions, so the text after it sits at fewer positions than tokens), the largest of its time,
height and width positions; the text positions for a family whose images take one position a token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice

import torch
import torch.nn.functional as F

LOGIT_CHUNK = 4096  # tokens per lm_head chunk: 4096 x a 152K vocabulary in fp32 is 2.3 GiB


@dataclass(frozen=True)
class PositionBucket:
    start: int
    end: int
    """Positions [start, end)."""
    loss: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


def position_edges(seq_len: int, window: int) -> list[int]:
    """Bucket edges from 0 to seq_len: a quarter and a half of `window`, the window, then doublings of it."""
    edges = {0, seq_len, *(e for e in (window // 4, window // 2) if e > 0)}
    edge = window
    while edge < seq_len:
        edges.add(edge)
        edge *= 2
    return sorted(e for e in edges if e <= seq_len)


def rotated_positions(position_ids: torch.Tensor, media) -> torch.Tensor:
    """The position (B, L) each token's RoPE rotates by (module docstring): the largest of the M-RoPE time, height and
    width positions (`MediaBatch.positions` (4, B, L): the text positions, then those three) where the rows' family
    has them, else `position_ids`."""
    if media is None or media.positions is None:
        return position_ids
    return media.positions[-3:].amax(0)


def loss_by_position(model, loader, rows: int, device: torch.device, edges: list[int],
                     autocast: torch.dtype | None = None, loss_module=None) -> list[PositionBucket]:
    """The mean token loss of `model` (a causal LM) in each bucket of positions [edges[i], edges[i+1]) over the first
    `rows` rows of `loader`, on one process; `loss_module`: the CausalLMLoss whose vision side reads the rows' images
    and videos (module docstring)."""
    from longfit.memory.loss import positioned
    from longfit.models.attention import batch_documents, remember_documents
    from longfit.models.structure import decoder_and_head, logit_softcap, prediction_head, unwrap_peft

    body, lm_head = decoder_and_head(model)
    encoder = getattr(loss_module, "media_encoder", None)
    head = prediction_head(model)
    softcap = logit_softcap(unwrap_peft(model).config.get_text_config())
    inner = torch.tensor(edges[1:-1], device=device)
    sums = torch.zeros(len(edges) - 1, dtype=torch.float64, device=device)
    counts = torch.zeros(len(edges) - 1, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in islice(loader, math.ceil(rows / loader.micro_batch)):
                batch = positioned(loss_module, batch).to(device) if encoder is not None else batch.to(device)
                media = batch.media if encoder is not None else None
                documents = batch_documents(batch.cu_seqlens, batch.documents, batch.input_ids.shape[0])
                if media is not None:  # the family's rule for images (Gemma 3's bidirectional spans)
                    documents = encoder.attention_layout(documents, media)
                remember_documents(batch.position_ids, documents)
                with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids} if encoder is None \
                        else loss_module.media_inputs(body, batch.input_ids, batch.position_ids, media)
                    hidden = body(**inputs, cu_seq_lens_q=batch.cu_seqlens, use_cache=False,
                                  longfit_documents=documents).last_hidden_state
                    hidden = (hidden if head is None else head(hidden)).flatten(0, 1)  # (B L, H)
                    labels = batch.labels.flatten()
                    buckets = torch.bucketize(rotated_positions(batch.position_ids, media).flatten(), inner,
                                              right=True)
                    for start in range(0, labels.numel(), LOGIT_CHUNK):
                        part = slice(start, start + LOGIT_CHUNK)
                        valid = labels[part] != -100
                        logits = lm_head(hidden[part][valid]).float()  # (T, V)
                        if softcap:
                            logits = torch.tanh(logits / softcap) * softcap
                        losses = F.cross_entropy(logits, labels[part][valid], reduction="none")
                        sums.index_add_(0, buckets[part][valid], losses.double())
                        counts.index_add_(0, buckets[part][valid], torch.ones_like(losses, dtype=torch.float64))
    finally:
        model.train(was_training)
    return [PositionBucket(start, end, (s / n) if n else math.nan, int(n))
            for start, end, s, n in zip(edges, edges[1:], sums.tolist(), counts.tolist())]


def format_positions(buckets: list[PositionBucket], window: int) -> str:
    """One line per bucket: its positions, where it stands against the window, its loss, perplexity and tokens."""
    lines = [f"{'positions':>17}  {'':14}{'loss':>8}{'ppl':>10}{'tokens':>10}"]
    for b in buckets:
        where = "within window" if b.end <= window else f"{b.end / window:.3g}x window"
        ppl = f"{b.perplexity:>10.2f}" if b.tokens else f"{'-':>10}"
        loss = f"{b.loss:>8.4f}" if b.tokens else f"{'-':>8}"
        lines.append(f"{b.start:>8}-{b.end - 1:<8}  {where:14}{loss}{ppl}{b.tokens:>10,}")
    return "\n".join(lines)
