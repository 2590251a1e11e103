"""Llama 4's vision side (#54), on `longfit.models.media`'s path.

What `Llama4ForConditionalGeneration` does with images before its language model, on longfit's packed rows:
- its image processor (`Llama4ImageProcessor`, torchvision's: transformers has no Pillow backend for it) picks each
  image a canvas of whole tiles of the tower's size (its aspect ratio, `aspect_ratios`), cuts the resized image into
  those tiles row by row and, when there are several, adds the whole image resized to one more tile (the global tile);
- its tower (`vision_model`: each tile alone, its class token, pixel shuffle and MLP) and projector
  (`multi_modal_projector`: one matrix) are top-level modules of the wrapper, held by one vision module here; every
  tile gives `tokens_per_tile` embeddings, the tiles of a batch in order, and the tower's attention never crosses two
  tiles, so any subset of the batch's images gives each of them the same embeddings;
- an image is written as Llama4Processor writes it in the template's `<|image|>`'s place
  (`Llama4Processor._prompt_split_image`, called here): `<|image_start|>`, each tile's `<|patch|>`s with
  `<|tile_x_separator|>` between the tiles of a row and `<|tile_y_separator|>` after each row, then `<|image|>` and
  the global tile's `<|patch|>`s, `<|image_end|>`; only the `<|patch|>`s (`image_token_id`) take embeddings, in order,
  as the wrapper's `masked_scatter` does;
- positions and attention are text's: transformers builds Llama 4's masks from the positions alone (causal on the
  global layers, causal inside each chunk of `attention_chunk_size` on the chunked ones), image tokens as any other,
  so longfit's chunked layers (`longfit.models.attention.layer_documents`: the chunks of each document of a packed row
  counted from its start) hold for image rows as they do for text; its NoPE layers take no positions at all.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from longfit.config import ConfigError
from longfit.data.media import MediaBatch, MediaSpec
from longfit.models.media import MediaEncoder


def tokens_per_tile(vision_config) -> int:
    """The embeddings of one tile: its patches after the pixel shuffle (Llama4Processor's `num_patches_per_chunk`)."""
    side = vision_config.image_size // vision_config.patch_size
    return side * side // round(1 / vision_config.pixel_shuffle_ratio**2)


def tiles_spec(config, tokenizer, tiles: Callable[[int, int], tuple[int, int]] | None) -> MediaSpec:
    """How Llama 4's rows place an image's tokens, with the checkpoint's `tokenizer`; `tiles`: an image's (tile rows,
    tile columns) from its (height, width), the image processor's choice of canvas (counting an epoch from the image
    headers), None where the image processor cannot run here (`Llama4MediaEncoder.missing_backend`)."""
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    per_tile = tokens_per_tile(config.vision_config)
    placeholder = inspect.signature(Llama4Processor).parameters["fake_image_token"].default  # the template's image

    def layout(grid: torch.Tensor) -> np.ndarray:
        # The processor's own text of an image (it reads nothing of the processor but its arguments).
        text = Llama4Processor._prompt_split_image(None, (int(grid[1]), int(grid[2])), per_tile)
        return np.array(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)

    if int((layout(torch.tensor([1, 1, 1])) == config.image_token_id).sum()) != per_tile:
        raise ConfigError(f"the tokenizer does not encode Llama 4's image layout with {per_tile} image tokens "
                          f"(image_token_id={config.image_token_id}) a tile; use the checkpoint's own tokenizer")

    def size_tokens(height: int, width: int) -> int:
        return len(layout(torch.tensor([1, *tiles(height, width)])))

    return MediaSpec(image_token_id=config.image_token_id, video_token_id=None, merge_size=1,
                     placeholder_id=tokenizer.convert_tokens_to_ids(placeholder), tiles=True, layout=layout,
                     size_tokens=None if tiles is None else size_tokens)


def processor_tiles(directory: Path, config) -> Callable[[int, int], tuple[int, int]]:
    """The (tile rows, tile columns) Llama4ImageProcessor in `directory` gives an image of (height, width): its own
    canvas choice (`get_best_fit` over `find_supported_resolutions`); its tiles must be the tower's size."""
    from transformers import AutoImageProcessor
    from transformers.models.llama4.image_processing_llama4 import find_supported_resolutions, get_best_fit

    processor = AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    size = processor.size  # a SizeDict
    if (size.height, size.width) != (config.vision_config.image_size,) * 2:
        raise ConfigError(f"Llama 4's image processor in {directory} makes tiles of {size.height} x {size.width}, its "
                          f"tower takes {config.vision_config.image_size}; use the checkpoint's own "
                          "preprocessor_config.json")
    canvases = torch.tensor(find_supported_resolutions(processor.max_patches, size))

    def tiles(height: int, width: int) -> tuple[int, int]:
        canvas = get_best_fit((height, width), canvases, resize_to_max_canvas=processor.resize_to_max_canvas)
        return int(canvas[0]) // size.height, int(canvas[1]) // size.width

    return tiles


class Llama4MediaEncoder(MediaEncoder):
    """Llama 4's tower and projector on each image's tiles, the tiles' separators, text positions and masks."""

    @staticmethod
    def vision_module(config) -> nn.Module:
        from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

        # Llama4ForConditionalGeneration's own construction of both, under its names (AutoModel has no class for
        # Llama 4's vision config)
        return nn.ModuleDict({"vision_model": Llama4VisionModel._from_config(config.vision_config, dtype=torch.float32),
                              "multi_modal_projector": Llama4MultiModalProjector(config).float()})

    @staticmethod
    def media_spec(config, directory: Path) -> MediaSpec:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        runs = Llama4MediaEncoder.missing_backend() is None
        return tiles_spec(config, tokenizer, processor_tiles(directory, config) if runs else None)

    @staticmethod
    def missing_backend() -> str | None:
        """Llama4ImageProcessor is torchvision's: without a torchvision built for this torch, its images are refused
        (a wheel built for another torch imports but fails on its operators, hence the RuntimeError)."""
        try:
            import torchvision  # noqa: F401
        except (ImportError, RuntimeError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return (f"Llama 4's image processor (Llama4ImageProcessor: its tiles) needs torchvision, which does not "
                    f"load here ({reason}); `pip install torchvision` built for this torch ({torch.__version__}), or "
                    "drop the row's image parts to train on its text")
        return None

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The embeddings (T * tokens_per_tile, H) of the tiles `pixel_values` (T, C, S, S), every image's in order:
        Llama4ForConditionalGeneration.forward's image path."""
        dtype = next(self.vision.parameters()).dtype
        hidden = self.vision["vision_model"](pixel_values.to(dtype)).last_hidden_state  # (T, tokens_per_tile, Hv)
        return self.vision["multi_modal_projector"](hidden.flatten(0, 1))  # (T * tokens_per_tile, H)

    def pixel_rows(self, grid_thw: torch.Tensor) -> list[int]:
        tiles = (grid_thw[:, 1] * grid_thw[:, 2]).tolist()
        return [n + (n > 1) for n in tiles]  # the global tile after several

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        return [n * tokens_per_tile(self.config.vision_config) for n in self.pixel_rows(grid_thw)]

    def wrapper_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor) -> dict:
        """The tiles alone (the wrapper reads their layout from the ids)."""
        return dict(pixel_values=pixel_values)

    def rope_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor, media: MediaBatch) -> None:
        """None: Llama 4's positions are the text's (`position_ids`)."""
        return None


ENCODER = Llama4MediaEncoder
