"""Gemma 3's vision side and its rule for images (#54), on `longfit.models.media`'s path.

What `Gemma3ForConditionalGeneration` does before and inside its language model, on longfit's packed rows:
- its tower (SigLIP, `model.vision_tower`) and projector (`model.multi_modal_projector`: average pooling to
  `mm_tokens_per_image` tokens, a norm and a matrix) are siblings under `model`; the vision module here holds both,
  so its names after `model.` are the checkpoint's and the export's;
- every image takes `mm_tokens_per_image` tokens, written in the chat template's `<start_of_image>`'s place as
  Gemma3Processor writes them: "\\n\\n<start_of_image>", the image tokens, "<end_of_image>\\n\\n" (`media_spec`; the
  newlines as the checkpoint's tokenizer encodes them alone, which may differ from the processor's tokenization of
  the whole text where they meet other newlines); pan-and-scan crops are refused in one line;
- positions are those of text (the wrapper's 1-D position ids, restarting in every document);
- the language model's attention lets an image's tokens see each other both ways (`attention_layout`):
  transformers builds the mask OR(causal, same image) (AND the sliding window on local layers) from
  `token_type_ids` whenever they are given, in training as in generation (`create_masks_for_vision_model`). Here
  each run of image tokens of a document becomes a span of `DocumentLayout.bidirectional`, which every attention
  path that plans blocks computes exactly without a mask (models/blockwise.py's derivation: the causal blocks plus
  each span's strict upper triangle, merged by logsumexp); the ring and Ulysses get it as they get the documents.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from longfit.config import ConfigError
from longfit.data.media import IMAGE, MediaBatch, MediaSpec
from longfit.data.packing import DocumentLayout
from longfit.models.media import MediaEncoder


class Gemma3MediaEncoder(MediaEncoder):
    """Gemma 3's tower and projector, its fixed tokens per image, text positions and bidirectional image spans."""

    bidirectional_images = True

    @staticmethod
    def vision_module(config) -> nn.Module:
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        # Gemma3Model's own construction of both (its tower from the vision config, its projector from the wrapper's)
        return nn.ModuleDict({"vision_tower": AutoModel.from_config(config.vision_config, dtype=torch.float32),
                              "multi_modal_projector": Gemma3MultiModalProjector(config).float()})

    @staticmethod
    def media_spec(config, directory: Path) -> MediaSpec:
        from transformers import AutoTokenizer

        newlines = tuple(AutoTokenizer.from_pretrained(directory, local_files_only=True)
                         .encode("\n\n", add_special_tokens=False))
        return MediaSpec(image_token_id=config.image_token_id, video_token_id=None, merge_size=1,
                         placeholder_id=config.boi_token_id, prefix=(*newlines, config.boi_token_id),
                         suffix=(config.eoi_token_id, *newlines), tokens_per_image=config.mm_tokens_per_image)

    @staticmethod
    def check_image_processor(processor, model: str) -> None:
        if getattr(processor, "do_pan_and_scan", False):
            raise ConfigError(f"model={model!r}: Gemma 3's pan-and-scan crops (do_pan_and_scan in its "
                              "preprocessor_config.json) are not read yet (#54); set it to false")

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The embeddings (I * T, H) of the images `pixel_values` (I, C, S, S): Gemma3Model.get_image_features."""
        dtype = next(self.vision.parameters()).dtype
        hidden = self.vision["vision_tower"](pixel_values=pixel_values.to(dtype)).last_hidden_state  # (I, P, Hv)
        return self.vision["multi_modal_projector"](hidden).flatten(0, 1)  # (I * T, H)

    def pixel_rows(self, grid_thw: torch.Tensor) -> list[int]:
        return [1] * len(grid_thw)  # one (C, S, S) image each

    def wrapper_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor) -> dict:
        """The images and their token types, from which the wrapper builds its bidirectional mask."""
        return dict(pixel_values=pixel_values, token_type_ids=token_types)

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        return [self.config.mm_tokens_per_image] * len(grid_thw)

    def rope_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor, media: MediaBatch) -> None:
        """None: Gemma 3's positions are the text's (`position_ids`)."""
        return None

    def attention_layout(self, documents: DocumentLayout | None, media: MediaBatch) -> DocumentLayout:
        """`documents` (None: one per row) with every run of image tokens of a document as a bidirectional span:
        transformers' block ids (`get_block_sequence_ids_for_mask`) are the runs of token type 1, of each
        conversation alone. A one-token run sees no later key of its own: left out."""
        types = media.token_types  # (B, L) whole rows, on the host
        layout = documents or DocumentLayout.one_document_per_row(*types.shape)
        spans = []
        for row, docs in enumerate(layout.rows):
            image = np.asarray(types[row] == IMAGE, dtype=np.int8)
            row_spans = []
            for start, end in docs:
                edges = np.diff(np.concatenate([[0], image[start:end], [0]]))
                starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
                row_spans += [(start + int(a), start + int(b)) for a, b in zip(starts, ends) if b - a > 1]
            spans.append(tuple(row_spans))
        return layout.with_bidirectional(spans)


ENCODER = Gemma3MediaEncoder
