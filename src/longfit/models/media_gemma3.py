"""Gemma 3's vision side and its rule for images (#54), on `longfit.models.media`'s path.

What `Gemma3ForConditionalGeneration` does before and inside its language model, on longfit's packed rows:
- its tower (SigLIP, `model.vision_tower`) and projector (`model.multi_modal_projector`: average pooling to
  `mm_tokens_per_image` tokens, a norm and a matrix) are siblings under `model`; the vision module here holds both,
  so its names after `model.` are the checkpoint's and the export's;
- every image takes `mm_tokens_per_image` tokens, written in the chat template's `<start_of_image>`'s place as
  Gemma3Processor writes them: "\\n\\n<start_of_image>", the image tokens, "<end_of_image>\\n\\n" (`media_spec`; the
  newlines as the checkpoint's tokenizer encodes them alone, which may differ from the processor's tokenization of
  the whole text where they meet other newlines); with pan-and-scan an image's crops are further images of its part,
  among the processor's own words (`PanAndScan`);
- positions are those of text (the wrapper's 1-D position ids, restarting in every document);
- the language model's attention lets an image's tokens see each other both ways (`attention_layout`):
  transformers builds the mask OR(causal, same image) (AND the sliding window on local layers) from
  `token_type_ids` whenever they are given, in training as in generation (`create_masks_for_vision_model`). Here
  each run of image tokens of a document becomes a span of `DocumentLayout.bidirectional`, which every attention
  path that plans blocks computes exactly without a mask (models/blockwise.py's derivation: the causal blocks plus
  each span's strict upper triangle, merged by logsumexp); the ring and Ulysses get it as they get the documents.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

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

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        crops = PanAndScan.of(config, tokenizer, directory)
        if crops is not None:  # an image part is its image and its crops, among the processor's words
            return MediaSpec(image_token_id=config.image_token_id, video_token_id=None, merge_size=1,
                             placeholder_id=config.boi_token_id, tokens_per_image=config.mm_tokens_per_image,
                             processor_kwargs=crops.processor_kwargs, size_tokens=crops.size_tokens,
                             layout=crops.layout)
        newlines = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
        return MediaSpec(image_token_id=config.image_token_id, video_token_id=None, merge_size=1,
                         placeholder_id=config.boi_token_id, prefix=(*newlines, config.boi_token_id),
                         suffix=(config.eoi_token_id, *newlines), tokens_per_image=config.mm_tokens_per_image)

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The embeddings (I * T, H) of the images `pixel_values` (I, C, S, S): Gemma3Model.get_image_features."""
        dtype = next(self.vision.parameters()).dtype
        hidden = self.vision["vision_tower"](pixel_values=pixel_values.to(dtype)).last_hidden_state  # (I, P, Hv)
        return self.vision["multi_modal_projector"](hidden).flatten(0, 1)  # (I * T, H)

    def pixel_rows(self, grid_thw: torch.Tensor) -> list[int]:
        return [int(g[0]) for g in grid_thw]  # one (C, S, S) image each, and one per pan-and-scan crop of it

    def wrapper_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor) -> dict:
        """The images and their token types, from which the wrapper builds its bidirectional mask."""
        return dict(pixel_values=pixel_values, token_type_ids=token_types)

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        return [self.config.mm_tokens_per_image * int(g[0]) for g in grid_thw]  # its crops' too

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


class PanAndScan:
    """Gemma 3's pan-and-scan (do_pan_and_scan in the checkpoint's image processor config): its image processor cuts
    an image of a long enough side into crops (`Gemma3ImageProcessorPil.pan_and_scan`) and gives them after the image
    (`num_crops` of each); Gemma3Processor writes such an image part as "Here is the original image", the image's
    tokens, "and here are some crops to help you see better" and each crop's tokens, each crop with its own markers
    (`Gemma3Processor.replace_image_token`). Here the crops are images of the part: the part's grid is
    (1 + crops, 1, tokens per image), its pixels the image's and its crops', its tokens that text tokenized whole
    (`layout`), the images' tokens taking their embeddings in order; each crop's run of image tokens is its own
    bidirectional span (`attention_layout`), as transformers' block ids make it."""

    SETTINGS = ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate")

    def __init__(self, config, tokenizer, processor):
        from transformers import Gemma3Processor

        self.tokenizer, self.processor, self.tokens = tokenizer, processor, config.mm_tokens_per_image
        boi, eoi, image = tokenizer.convert_ids_to_tokens([config.boi_token_id, config.eoi_token_id,
                                                            config.image_token_id])
        # Gemma3Processor's full_image_sequence, and its own text of an image part with its crops
        self._writer = types.SimpleNamespace(full_image_sequence=f"\n\n{boi}{image * self.tokens}{eoi}\n\n")
        self._replace = Gemma3Processor.replace_image_token
        # The settings the image processor's config leaves null take the processor's defaults, as Gemma3Processor
        # passes them
        defaults = Gemma3Processor.images_kwargs
        self.settings = {key: defaults[key] if getattr(processor, key, None) is None else getattr(processor, key)
                         for key in self.SETTINGS}
        self.processor_kwargs = (("do_pan_and_scan", True), *self.settings.items())
        self._layouts: dict[int, np.ndarray] = {}

    @classmethod
    def of(cls, config, tokenizer, directory: Path) -> PanAndScan | None:
        """The checkpoint's pan-and-scan, None where its image processor does not crop (or cannot be loaded here:
        `media_reader` says why)."""
        from transformers import AutoImageProcessor

        try:
            processor = AutoImageProcessor.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError, ImportError):
            return None
        return cls(config, tokenizer, processor) if getattr(processor, "do_pan_and_scan", False) else None

    def layout(self, grid_thw: torch.Tensor) -> np.ndarray:
        """The tokens of an image part of grid (1 + crops, 1, T): the processor's text of it, tokenized whole."""
        crops = int(grid_thw[0]) - 1
        if crops not in self._layouts:
            text = self._replace(self._writer, {"num_crops": [crops]}, 0)
            self._layouts[crops] = np.array(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        return self._layouts[crops]

    def size_tokens(self, height: int, width: int) -> int:
        """An image part's tokens from the image's size: its crops counted by the image processor's own rule, on an
        array of that shape that holds no pixels."""
        shape = np.broadcast_to(np.zeros((), dtype=np.uint8), (3, height, width))  # channels first, as it reads them
        crops = len(self.processor.pan_and_scan(shape, **self.settings))
        return len(self.layout(torch.tensor([1 + crops, 1, self.tokens])))


ENCODER = Gemma3MediaEncoder
