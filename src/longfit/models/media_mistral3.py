"""Mistral 3's (and Ministral 3's) vision side (#54), on `longfit.models.media`'s path.

What `Mistral3ForConditionalGeneration` does before its language model, on longfit's packed rows:
- its Pixtral tower (`model.vision_tower`) runs each image at its own size (`image_sizes`: the tower crops each
  padded image to it, and its attention never crosses two images), the projector (`model.multi_modal_projector`:
  a norm, the patch merger of `spatial_merge_size`^2 patches, two linears) maps the tower's `vision_feature_layer`
  output to the language model; both are siblings under `model`, held by one vision module here;
- an image is written as PixtralProcessor writes it in the template's `[IMG]`'s place: each row of merged patches as
  its `[IMG]` tokens then `[IMG_BREAK]`, the last `[IMG_BREAK]` made `[IMG_END]`; only the `[IMG]` tokens take the
  image's embeddings (`MediaItem.row_width`), as the wrapper's `masked_scatter` over `image_token_id` does; the image
  processor resizes to whole merged patches (`patch_size` x `spatial_merge_size` pixels, the processor's
  `_process_images`);
- positions and attention are text's: causal, 1-D positions restarting in every document.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from longfit.data.media import MediaBatch, MediaSpec
from longfit.models.media import MediaEncoder


class Mistral3MediaEncoder(MediaEncoder):
    """Mistral 3's Pixtral tower and projector, its images' rows of tokens with breaks, text positions."""

    @staticmethod
    def vision_module(config) -> nn.Module:
        from transformers import AutoModel
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        return nn.ModuleDict({"vision_tower": AutoModel.from_config(config.vision_config, dtype=torch.float32),
                              "multi_modal_projector": Mistral3MultiModalProjector(config).float()})

    @staticmethod
    def media_spec(config, directory: Path) -> MediaSpec:
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        patch, merge = config.vision_config.patch_size, config.spatial_merge_size
        longest = AutoImageProcessor.from_pretrained(directory, local_files_only=True).size["longest_edge"]

        def size_tokens(height: int, width: int) -> int:
            # PixtralImageProcessor's resize (get_resize_output_image_size: the longest edge down to `longest`, then
            # up to whole merged patches), then a break or end token after each row.
            ratio = max(height / longest, width / longest)
            if ratio > 1:
                height, width = math.floor(height / ratio), math.floor(width / ratio)
            rows, columns = (-(-n // (patch * merge)) for n in (height, width))
            return rows * (columns + 1)

        return MediaSpec(image_token_id=config.image_token_id, video_token_id=None, merge_size=merge,
                         row_break=tuple(tokenizer.convert_tokens_to_ids(["[IMG_BREAK]", "[IMG_END]"])),
                         patch_size=patch, processor_kwargs=(("patch_size", {"height": patch * merge,
                                                                             "width": patch * merge}),),
                         size_tokens=size_tokens)

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The embeddings (N, H) of the images `pixel_values` (I, C, H, W), each padded below and right, of patch
        grids `grid_thw` (I, 3): Mistral3Model.get_image_features."""
        dtype = next(self.vision.parameters()).dtype
        sizes = grid_thw[:, 1:] * self.config.vision_config.patch_size  # (I, 2) pixels
        out = self.vision["vision_tower"](pixel_values.to(dtype), image_sizes=sizes, output_hidden_states=True)
        layer = self.config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else layer
        hidden = torch.cat([out.hidden_states[i] for i in layers], dim=-1)  # (1, P, Hv x layers)
        return self.vision["multi_modal_projector"](hidden.squeeze(0), sizes)  # (N, H)

    def pixel_rows(self, grid_thw: torch.Tensor) -> list[int]:
        return [1] * len(grid_thw)  # one padded (C, H, W) image each

    def wrapper_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor) -> dict:
        """The padded images with their own sizes in pixels."""
        return dict(pixel_values=pixel_values, image_sizes=grid_thw[:, 1:] * self.config.vision_config.patch_size)

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        return [int(g.prod()) // self.config.spatial_merge_size**2 for g in grid_thw]

    def rope_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor, media: MediaBatch) -> None:
        """None: Mistral 3's positions are the text's (`position_ids`)."""
        return None


ENCODER = Mistral3MediaEncoder
