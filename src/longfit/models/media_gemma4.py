"""Gemma 4's vision side and its rule for images (#54), on `longfit.models.media`'s path.

What `Gemma4ForConditionalGeneration` does with images before and inside its language model, on longfit's packed rows:
- its tower (`model.vision_tower`: patches with 2-D positions, pooled by `pooling_kernel_size` squared) and embedder
  (`model.embed_vision`: a norm and a matrix) are siblings under `model`; the vision module here holds both, so its
  names after `model.` are the checkpoint's and the export's. The audio tower is not built: rows hold no audio parts;
- each image keeps its aspect ratio and takes (patch rows x patch columns) / kernel^2 tokens, written in the chat
  template's image token's place as Gemma4Processor writes them: `<boi>`, the image tokens, `<eoi>` (`media_spec`);
  its pixels are the image processor's own, padded to its patch budget, and the tower runs on them as the wrapper does
  (`features`: the padding keys masked, the pooled padding dropped), so any subset of the batch's images gives each
  of them the same embeddings;
- positions are those of text, and the per-layer inputs of the image tokens are those of the pad token
  (`language_model_inputs`: the wrapper looks up `embed_tokens_per_layer` with every image token replaced by it);
- where the text config says `use_bidirectional_attention: vision`, an image's tokens see each other both ways on
  the sliding-window layers only, the global layers staying causal (transformers' `create_masks_for_vision_model`):
  Gemma 3's spans (`longfit.models.media_gemma3`) held on the sliding-window layers alone
  (`DocumentLayout.global_layout`). Otherwise every layer is causal over images, as transformers' smaller Gemma 4s.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from longfit.config import ConfigError
from longfit.data.media import MediaBatch, MediaSpec
from longfit.data.packing import DocumentLayout
from longfit.models.media_gemma3 import Gemma3MediaEncoder


def patch_positions(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """(I, max_patches, 2) the (x, y) of each image's patches row by row, (-1, -1) on its padding: the image
    processor's `image_position_ids` of the padded patches `pixel_values` (I, max_patches, p*p*C) on grids `grid_thw`."""
    positions = torch.full((*pixel_values.shape[:2], 2), -1, dtype=torch.long, device=pixel_values.device)
    for image, (_, rows, columns) in enumerate(grid_thw.tolist()):
        y, x = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
        positions[image, : rows * columns] = torch.stack([x.flatten(), y.flatten()], dim=-1)
    return positions


class Gemma4MediaEncoder(Gemma3MediaEncoder):
    """Gemma 4's tower and embedder, its aspect-ratio image tokens, text positions, the pad token's per-layer inputs
    and, where its config says so, bidirectional image spans on the sliding-window layers."""

    def __init__(self, config, vision: nn.Module, family, rope_index):
        super().__init__(config, vision, family, rope_index)
        self.bidirectional_images = config.get_text_config().use_bidirectional_attention == "vision"

    @staticmethod
    def vision_module(config) -> nn.Module:
        from transformers import AutoModel
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

        # Gemma4Model's own construction of both (its tower from the vision config, its embedder from both configs)
        return nn.ModuleDict({"vision_tower": AutoModel.from_config(config.vision_config, dtype=torch.float32),
                              "embed_vision": Gemma4MultimodalEmbedder(config.vision_config,
                                                                       config.get_text_config()).float()})

    @staticmethod
    def media_spec(config, directory: Path) -> MediaSpec:
        from transformers import AutoImageProcessor
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        processor = AutoImageProcessor.from_pretrained(directory, local_files_only=True)
        patch, kernel = processor.patch_size, processor.pooling_kernel_size
        budget = processor.max_soft_tokens * kernel**2

        def size_tokens(height: int, width: int) -> int:  # Gemma4ImageProcessorPil's resize, then its pooling
            rows, columns = get_aspect_ratio_preserving_size(height, width, patch, budget, kernel)
            return (rows // patch) * (columns // patch) // kernel**2

        return MediaSpec(image_token_id=config.image_token_id, video_token_id=None, merge_size=kernel,
                         prefix=(config.boi_token_id,), suffix=(config.eoi_token_id,), patch_positions=True,
                         size_tokens=size_tokens)

    @staticmethod
    def check_image_processor(processor, model: str) -> None:
        if not hasattr(processor, "max_soft_tokens"):
            raise ConfigError(f"model={model!r}: Gemma 4's image rows need its own image processor "
                              "(Gemma4ImageProcessor in its preprocessor_config.json)")

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The embeddings (N, H) of the images whose padded patches are `pixel_values` (I, max_patches, p*p*C) on
        grids `grid_thw` (I, 3) (1, rows, columns): Gemma4Model.get_image_features, images in order."""
        dtype = next(self.vision.parameters()).dtype
        hidden = self.vision["vision_tower"](pixel_values=pixel_values.to(dtype),
                                             pixel_position_ids=patch_positions(pixel_values, grid_thw)
                                             ).last_hidden_state  # (N, Hv)
        return self.vision["embed_vision"](inputs_embeds=hidden)  # (N, H)

    def wrapper_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor) -> dict:
        """The padded patches with their positions, and the token types from which the wrapper builds its masks."""
        return dict(pixel_values=pixel_values, image_position_ids=patch_positions(pixel_values, grid_thw),
                    mm_token_type_ids=token_types)

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        kernel = self.config.vision_config.pooling_kernel_size
        return [int(g.prod()) // kernel**2 for g in grid_thw]

    def language_model_inputs(self, body: nn.Module, input_ids: torch.Tensor, media: MediaBatch) -> dict:
        """The per-layer inputs (B, L, layers, width) of the text model `body`, every image token's that of the pad
        token (Gemma4Model.forward's `llm_input_ids`); none where the config has no per-layer inputs."""
        if not body.config.hidden_size_per_layer_input:
            return {}
        ids = torch.where(media.embedding_index >= 0, body.config.pad_token_id, input_ids)  # (B, L)
        return {"per_layer_inputs": body.get_per_layer_inputs(ids)}

    def attention_layout(self, documents: DocumentLayout | None, media: MediaBatch) -> DocumentLayout | None:
        """Gemma 3's spans (every run of a document's image tokens) on the sliding-window layers where the config asks
        for them (module docstring); else `documents` as they are."""
        if not self.bidirectional_images:
            return documents
        spans = super().attention_layout(documents, media)
        return (documents or DocumentLayout.one_document_per_row(*media.token_types.shape)).with_bidirectional(
            spans.bidirectional or (), sliding_layers_only=True)


ENCODER = Gemma4MediaEncoder
