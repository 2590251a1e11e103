"""The training objective as a module: one forward pass to the summed token loss.

Shared by the trainer, the planner's trace and the benchmarks. It lives in `memory/` because its one
design decision is a memory technique: the model body runs without its lm_head so that the logits are
produced by the loss itself, chunked (never L x V whole) when `memory.chunked_loss` is on, or as one
plain tensor otherwise.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from longfit.config import Config, ConfigError
from longfit.memory.chunked_loss import chunked_cross_entropy, full_cross_entropy
from longfit.memory.router_loss import RouterLoss, collect_router_prob_sums
from longfit.memory.switches import loss_chunk_tokens
from longfit.models.attention import batch_documents, remember_documents
from longfit.models.sparse_attention import indexer_losses, train_indexers
from longfit.models.structure import decoder_and_head, logit_multiplier, logit_softcap, prediction_head, unwrap_peft

if TYPE_CHECKING:
    from longfit.data.media import MediaBatch
    from longfit.data.packing import DocumentLayout, PackedBatch
    from longfit.models.media import MediaEncoder


def least_over_ranks(values: list[int | None], device: torch.device | str) -> list[int | None]:
    """Each value's minimum over the ranks of the default process group (None stays None), for quantities each
    rank measures itself but all must decide on alike; one process: as given. Call it on every rank at the
    same point."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values
    on_cuda = torch.device(device).type == "cuda" and "gloo" not in dist.get_backend()  # NCCL alone: CUDA tensors
    unknown = torch.iinfo(torch.int64).max  # None on every rank alike (the same config and device type)
    least = torch.tensor([unknown if v is None else v for v in values], dtype=torch.int64,
                         device=device if on_cuda else "cpu")
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return [None if v is None else int(m) for v, m in zip(values, least.tolist())]


def free_device_bytes(device: torch.device | str) -> int | None:
    """Bytes free on a CUDA device now, the least over the ranks of the default process group; None elsewhere.

    The smallest over the ranks because every rank must derive the same loss chunk from it: the
    vocabulary-parallel loss runs collectives per chunk. Call it on every rank at the same point.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return least_over_ranks([torch.cuda.mem_get_info(device)[0]], device)[0]


class CausalLMLoss(torch.nn.Module):
    """Wraps a causal LM so that one forward returns the summed token loss of a batch.

    It is the module that `parallelize` shards and checkpoints and the root FSDP2 module, so the root
    parameters (embeddings, final norm, lm_head) are gathered by the root's own forward hooks.
    `cu_seqlens` are the global document starts and `documents` their layout on the host (`PackedBatch.documents`);
    the model body gets them as `cu_seq_lens_q` and `longfit_documents`, which transformers hands through every
    decoder layer to the attention function (single process or context parallel). Without `documents` the
    layout is read from `cu_seqlens` once here, not at every layer.

    `indexer_loss` (train.indexer_loss, #57) > 0 adds that weight x the lightning indexers' KL loss (DeepSeek-V3.2's
    sparse stage: each indexed layer's sum over its queries, models/sparse_attention.py) to the summed token loss, so
    that divided by the label tokens it is a mean per label token as the cross-entropy; 0 leaves the indexers
    without gradient, as transformers trains them. It is in the loss while gradients are taken (training), not in
    an evaluation's.

    `loss_chunk` 0 derives the chunk (`loss_chunk_tokens`) at the first forward from the memory free on the
    device then; the trainer passes the chunk its plan derived before building anything instead.

    Under tensor parallelism `parallelize` sets `vocab_parallel` (longfit.parallel.tp.VocabParallel): lm_head's
    rows and the final hidden tokens are then split over the tp ranks, and the loss -- one chunk of all tokens
    when chunked_loss is off -- combines them across ranks without forming the logits.
    """

    def __init__(self, model: torch.nn.Module, chunked_loss: bool = False, loss_chunk: int = 0,
                 media_encoder: "MediaEncoder | None" = None, indexer_loss: float = 0.0):
        super().__init__()
        if indexer_loss and not train_indexers(model):
            raise ConfigError(f"train.indexer_loss={indexer_loss} is the KL loss of a lightning indexer (DeepSeek-V3.2,"
                              " GLM-5), and this model has none: set train.indexer_loss=0")
        self.indexer_loss = indexer_loss
        self.model = model
        self.media_encoder = media_encoder
        self.media_features = None  # cp and tp: the images dealt over the ranks holding the rows (parallel/media.py)
        self.chunked_loss = chunked_loss
        self.loss_chunk = loss_chunk
        self.vocab_parallel = None
        self.backward_twice = False  # a zero-bubble pipeline stage's (parallelize): the chunked loss keeps its gradients
        self.router_loss = RouterLoss.of(model)
        self.router_group = None

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: Config) -> "CausalLMLoss":
        """The loss module of a run: `memory.chunked_loss`, `memory.loss_chunk`, `train.indexer_loss` as configured."""
        return cls(model, chunked_loss=cfg.memory.chunked_loss, loss_chunk=cfg.memory.loss_chunk,
                   indexer_loss=cfg.train.indexer_loss)

    def _chunk(self, device: torch.device, vocab_size: int) -> int:
        if not self.loss_chunk:
            self.loss_chunk = loss_chunk_tokens(vocab_size, free_device_bytes(device))
        return self.loss_chunk

    def token_loss(self, hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of the final hidden states (B, L, H) against `labels` (B, L), through lm_head."""
        text_config = unwrap_peft(self.model).config.get_text_config()
        multiplier = logit_multiplier(text_config)
        if multiplier != 1.0:  # the causal LM's scale of the logits, outside any module: on the hidden states here
            if lm_head.bias is not None:
                raise ConfigError(f"the {text_config.model_type} model scales its logits by {multiplier:g} and its "
                                  "lm_head has a bias: longfit's loss cannot fold the scale into its input")
            hidden = hidden * multiplier  # (B, L, H)
        softcap = logit_softcap(text_config)
        if self.vocab_parallel is not None:
            chunk = self._chunk(hidden.device, lm_head.out_features) if self.chunked_loss else None
            return self.vocab_parallel.loss(hidden, lm_head, labels, chunk, softcap, self.backward_twice)
        if self.chunked_loss:
            chunk = self._chunk(hidden.device, lm_head.out_features)
            return chunked_cross_entropy(hidden, lm_head, labels, chunk, softcap=softcap,
                                         backward_twice=self.backward_twice)
        return full_cross_entropy(hidden, lm_head, labels, softcap=softcap)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        documents: "DocumentLayout | None" = None,
        step_label_tokens: torch.Tensor | None = None,
        step_router_counts: torch.Tensor | None = None,
        routes_only: bool = False,
        media: "MediaBatch | None" = None,
    ) -> torch.Tensor:
        """The summed token loss; with `step_label_tokens`, plus the router loss (see `batch_loss_sum`).
        `routes_only`: this batch's routing counts (`RouterLoss.counts`) instead, from the decoder body alone.
        `media`: the rows' images (#54), whose embeddings take their placeholders' place (`media_inputs`)."""
        body, lm_head = decoder_and_head(self.model)
        documents = batch_documents(cu_seqlens, documents, input_ids.shape[0])
        if self.media_encoder is not None and media is not None:  # the family's rule for images (Gemma 3's spans)
            documents = self.media_encoder.attention_layout(documents, media)
        remember_documents(position_ids, documents)
        routed = self.router_loss is not None and (step_label_tokens is not None or routes_only)
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        if self.media_encoder is not None:
            inputs = self.media_inputs(body, input_ids, position_ids, media)
        indexers = indexer_losses(self.model) if self.indexer_loss else contextlib.nullcontext([])
        with (collect_router_prob_sums(self.router_loss) if routed else contextlib.nullcontext() as tiled_prob_sums,
              indexers as indexer_terms):
            output = body(
                **inputs, cu_seq_lens_q=cu_seqlens, longfit_documents=documents,
                use_cache=False, **({"output_router_logits": True} if routed else {}),
            )
        if routes_only:
            return self.router_loss.counts(output.router_logits)
        hidden = output.last_hidden_state  # (B, L, H)
        head = prediction_head(self.model)
        loss = self.token_loss(hidden if head is None else head(hidden), lm_head, labels)
        if routed:
            term = self.router_loss.local_term(output.router_logits, self.router_group, step_router_counts,
                                               tiled_prob_sums)
            loss = loss + step_label_tokens.to(term) * self.router_loss.coef * term
        if indexer_terms:
            loss = loss + self.indexer_loss * torch.stack(indexer_terms).sum().to(loss.dtype)
        return loss

    def route_counts(self, batch: "PackedBatch") -> torch.Tensor:
        """The routing counts (C, N) of `batch` (`routes_only`), through the module's call as every forward."""
        return self(batch.input_ids, batch.labels, batch.position_ids, batch.cu_seqlens, batch.documents,
                    routes_only=True)

    def media_inputs(self, body: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     media: "MediaBatch | None") -> dict:
        """The body's inputs of a wrapper's rows (#54): input embeddings with every image's embeddings in its
        placeholders' place and the family's positions (`MediaBatch.positions`, computed on the whole rows). The
        images run through the vision side here on one process; under context parallelism each rank runs its
        share and they are exchanged (`media_features`, set by `parallelize`). A text batch (`media` None) takes
        the same path with no images."""
        encoder = self.media_encoder
        if media is None or not media.images:
            if media is not None and media.positions is not None:
                position_ids = media.positions
            return {"input_ids": input_ids, "position_ids": position_ids}
        trains = any(p.requires_grad for p in encoder.parameters())
        with contextlib.nullcontext() if trains else torch.no_grad():
            if self.media_features is not None:
                features = self.media_features(encoder, media.pixel_values, media.grid_thw)
            else:
                features = encoder.features(media.pixel_values, media.grid_thw)  # (N, H)
        embeds = encoder.input_embeddings(body.get_input_embeddings(), input_ids, media, features)
        positions = media.positions if media.positions is not None else position_ids
        return {"inputs_embeds": embeds, "position_ids": positions,
                **encoder.language_model_inputs(body, input_ids, media)}


def positioned(loss_module: torch.nn.Module, batch):
    """`batch` with its family's positions computed on the whole rows, before any context-parallel split (#54): the
    M-RoPE positions of its images and videos, by the loss module's vision side (the trainer's steps, its
    evaluations and the plan's traced steps alike)."""
    encoder = getattr(loss_module, "media_encoder", None)
    if batch.media is not None and encoder is not None:
        batch.media.positions = encoder.rope_positions(batch.input_ids, batch.position_ids, batch.media)
    return batch


def batch_loss_sum(
    loss_module: CausalLMLoss, batch: "PackedBatch", step_label_tokens: torch.Tensor | None = None,
    step_router_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of the cross-entropy of every valid label token of `batch` (this rank's shard under CP); with
    `step_label_tokens` (the step's valid labels on all ranks), plus the router loss scaled by them (CausalLMLoss),
    over the routing counts `step_router_counts` when the step has several micro-batches (`step_router_counts`)."""
    return loss_module(batch.input_ids, batch.labels, batch.position_ids, batch.cu_seqlens, batch.documents,
                       step_label_tokens, step_router_counts, media=batch.media)


def step_router_counts(loss_module: CausalLMLoss, micro_batches: list["PackedBatch"]) -> torch.Tensor | None:
    """The routing counts (C, N) of a step of several micro-batches, over all of them and every rank: a forward
    of each without gradient, then one all-reduce (memory/router_loss.py: why, and what it costs). None when the
    model has no router loss or the step one micro-batch (its forward counts them itself). Collective over the
    ranks holding different tokens: call it on every rank, under the step's autocast."""
    if loss_module.router_loss is None or len(micro_batches) < 2:
        return None
    with torch.no_grad():
        counts = sum(loss_module.route_counts(b) for b in micro_batches)
    if loss_module.router_group is not None:
        import torch.distributed as dist

        dist.all_reduce(counts, group=loss_module.router_group)
    return counts
