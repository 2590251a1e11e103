"""Gemma 4's vision side and its rule for images (#54), on `longfit.models.media`'s path.

What `Gemma4ForConditionalGeneration` does with images before and inside its language model, on longfit's packed rows:
- its tower (`model.vision_tower`: patches with 2-D positions, pooled by `pooling_kernel_size` squared) and embedder
  (`model.embed_vision`: a norm and a matrix) are siblings under `model`; the vision module here holds both, and where
  the config has an audio tower, it and its embedder too (`model.audio_tower`, `model.embed_audio`), so its names
  after `model.` are the checkpoint's and the export's. The audio tower trains with `train.vision=all`, as the vision
  tower does, and is frozen otherwise;
- an audio (`longfit.data.audio`) is one item of grid (0, frames, mel bins) whose features are its valid log-mel
  frames: the audio tower runs on the step's audios padded to the longest with their masks, then its embedder, as
  Gemma4Model.get_audio_features does, and each keeps its valid tokens (`features`); audio tokens attend causally;
- a video (`longfit.data.video`) is one item per sampled frame, each the tower's input as an image is (padded to the
  video processor's patch budget), its tokens those of an image (Gemma4Model.get_video_features);
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

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from longfit.config import ConfigError
from longfit.data.audio import subsampled
from longfit.data.media import IMAGE, VIDEO, MediaBatch, MediaSpec
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


AUDIO_PARTS = ("audio_tower", "embed_audio")
"""The vision module's audio side: the audio tower and its embedder (under `model.` in the checkpoint)."""


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

        # Gemma4Model's own construction (each tower from its config, each embedder from its tower's and the text's)
        modules = {"vision_tower": AutoModel.from_config(config.vision_config, dtype=torch.float32),
                   "embed_vision": Gemma4MultimodalEmbedder(config.vision_config, config.get_text_config()).float()}
        if config.audio_config is not None:
            modules |= {"audio_tower": AutoModel.from_config(config.audio_config, dtype=torch.float32),
                        "embed_audio": Gemma4MultimodalEmbedder(config.audio_config, config.get_text_config()).float()}
        return nn.ModuleDict(modules)

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

        return MediaSpec(image_token_id=config.image_token_id, video_token_id=config.video_token_id, merge_size=kernel,
                         prefix=(config.boi_token_id,), suffix=(config.eoi_token_id,), patch_positions=True,
                         size_tokens=size_tokens)

    @staticmethod
    def check_image_processor(processor, model: str) -> None:
        if not hasattr(processor, "max_soft_tokens"):
            raise ConfigError(f"model={model!r}: Gemma 4's image rows need its own image processor "
                              "(Gemma4ImageProcessor in its preprocessor_config.json)")

    def towers(self) -> list[tuple[nn.Module, int]]:
        """The vision tower's blocks, and the audio tower's where the config has one (each its own store under
        memory.offload_activations: an audio block's input is not an image block's size)."""
        towers = [(self.vision["vision_tower"], self.config.vision_config.num_hidden_layers)]
        if "audio_tower" in self.vision:
            towers.append((self.vision["audio_tower"], self.config.audio_config.num_hidden_layers))
        return towers

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The embeddings (N, H) of the items `pixel_values` (I, rows, width) on grids `grid_thw` (I, 3), items in
        order: images and video frames (padded patches, grid (1, rows, columns)) through the vision tower and its
        embedder, audios (features, grid (0, frames, mel bins)) through the audio tower and its embedder."""
        audio = grid_thw[:, 0] == 0  # (I,)
        tokens = self.image_tokens(grid_thw)
        pieces, untouched = [None] * len(grid_thw), []
        for kind, run, parts in ((False, self._vision_features, ("vision_tower", "embed_vision")),
                                 (True, self._audio_features, AUDIO_PARTS)):
            chosen = torch.nonzero(audio == kind).flatten().tolist()
            if chosen:
                out = run(pixel_values[chosen], grid_thw[chosen]).split([tokens[i] for i in chosen])
                pieces = [out[chosen.index(i)] if i in chosen else piece for i, piece in enumerate(pieces)]
            else:
                untouched += [p for name in parts if name in self.vision for p in self.vision[name].parameters()
                              if p.requires_grad]
        out = torch.cat(pieces)  # (N, H)
        # A trained tower with no item here still gets a (zero) gradient: under context parallelism the ranks deal
        # the items out, and every rank's reduction of the towers' gradients expects each of them.
        return out + sum(p.sum() for p in untouched) * 0 if untouched else out

    def _vision_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Gemma4Model.get_image_features (and get_video_features, frame by frame) of padded patches. An audio in
        the batch may have widened them: the patches keep a whole number of pooling windows (their padding is
        masked and dropped), and their own width."""
        dtype = next(self.vision.parameters()).dtype
        pixel_values = self._whole_windows(pixel_values)  # (I, max_patches, p*p*C)
        hidden = self.vision["vision_tower"](pixel_values=pixel_values.to(dtype),
                                             pixel_position_ids=patch_positions(pixel_values, grid_thw)
                                             ).last_hidden_state  # (N, Hv)
        return self.vision["embed_vision"](inputs_embeds=hidden)  # (N, H)

    def _audio_features(self, features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Gemma4Model.get_audio_features of the audios' valid frames (A, frames, mel bins), each audio's valid
        tokens in order (the wrapper's mask of the tower's output)."""
        frames = grid_thw[:, 1].to(features.device)  # (A,)
        features = features[:, : int(frames.max()), : int(grid_thw[0, 2])]  # (A, T, mel)
        mask = torch.arange(features.shape[1], device=features.device) < frames[:, None]  # (A, T)
        dtype = next(self.vision["audio_tower"].parameters()).dtype
        out = self.vision["audio_tower"](features.to(dtype), mask)
        embedded = self.vision["embed_audio"](inputs_embeds=out.last_hidden_state)  # (A, T / 4, H)
        return embedded[out.attention_mask]  # (N, H)

    def _whole_windows(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(I, max_patches, p*p*C) the padded patches `pixel_values` of images or frames, cut to a whole number of
        pooling windows (their padding is masked and dropped) and their own width: an audio in the batch may have
        widened them."""
        window = self.config.vision_config.pooling_kernel_size**2
        patch = self.config.vision_config.patch_size**2 * 3
        return pixel_values[:, : pixel_values.shape[1] // window * window, :patch]

    def wrapper_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor) -> dict:
        """The padded patches with their positions, and the token types from which the wrapper builds its masks."""
        pixel_values = self._whole_windows(pixel_values)
        return dict(pixel_values=pixel_values, image_position_ids=patch_positions(pixel_values, grid_thw),
                    mm_token_type_ids=token_types)

    def wrapper_video_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor
                             ) -> dict:
        """One video's frames as Gemma4VideoProcessor gives them: padded patches with their positions, the video's
        frame count, and the token types."""
        pixel_values = self._whole_windows(pixel_values)
        return dict(pixel_values_videos=pixel_values, video_position_ids=patch_positions(pixel_values, grid_thw),
                    num_frames_per_video=torch.tensor([len(grid_thw)]), mm_token_type_ids=token_types)

    @staticmethod
    def wrapper_audio_inputs(features: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor) -> dict:
        """One audio (grid (0, frames, mel bins)) as the feature extractor gives it, its valid frames alone: their
        features (1, frames, mel bins) and mask, all valid; and the token types."""
        features = features[:, : int(grid_thw[0, 1]), : int(grid_thw[0, 2])]
        return dict(input_features=features, input_features_mask=torch.ones(features.shape[:2], dtype=torch.bool),
                    mm_token_type_ids=token_types)

    def pixel_rows(self, grid_thw: torch.Tensor) -> list[int]:
        """One tensor per item, an image's, a frame's or an audio's (grid (0, frames, mel bins)): Gemma 3's count of
        an image and its pan-and-scan crops reads the grid's first entry, which an audio's holds at 0."""
        return [1] * len(grid_thw)

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Each item's embeddings: an image's or a frame's pooled patches, an audio's subsampled frames."""
        kernel = self.config.vision_config.pooling_kernel_size
        return [subsampled(int(g[1])) if g[0] == 0 else int(g.prod()) // kernel**2 for g in grid_thw]

    def language_model_inputs(self, body: nn.Module, input_ids: torch.Tensor, media: MediaBatch) -> dict:
        """The per-layer inputs (B, L, layers, width) of the text model `body`, every image token's that of the pad
        token (Gemma4Model.forward's `llm_input_ids`); none where the config has no per-layer inputs."""
        if not body.config.hidden_size_per_layer_input:
            return {}
        ids = torch.where(media.embedding_index >= 0, body.config.pad_token_id, input_ids)  # (B, L)
        return {"per_layer_inputs": body.get_per_layer_inputs(ids)}

    def attention_layout(self, documents: DocumentLayout | None, media: MediaBatch) -> DocumentLayout | None:
        """Gemma 3's spans (every run of a document's image or video frame tokens: transformers' block ids take both
        token types, not audio's) on the sliding-window layers where the config asks for them (module docstring);
        else `documents` as they are."""
        if not self.bidirectional_images:
            return documents
        vision = replace(media, token_types=torch.where(media.token_types == VIDEO, IMAGE, media.token_types))
        spans = super().attention_layout(documents, vision)
        return (documents or DocumentLayout.one_document_per_row(*media.token_types.shape)).with_bidirectional(
            spans.bidirectional or (), sliding_layers_only=True)

    @staticmethod
    def video_reader(processor, config):
        """Gemma 4's frames, each an image's tokens between `<boi>` and `<eoi>` (`longfit.data.video`)."""
        from longfit.data.video import Gemma4VideoReader

        return Gemma4VideoReader(processor, video_token_id=config.video_token_id,
                                 vision_start_token_id=config.boi_token_id, vision_end_token_id=config.eoi_token_id)

    @staticmethod
    def audio_reader(config, directory: Path):
        """How the checkpoint in `directory` reads audio parts: its feature extractor and audio tokens; None without
        an audio tower or a feature extractor."""
        from transformers import AutoFeatureExtractor

        from longfit.data.audio import AudioReader

        if config.audio_config is None:
            return None
        try:
            extractor = AutoFeatureExtractor.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError):
            return None
        return AudioReader(extractor, audio_token_id=config.audio_token_id, begin_token_id=config.boa_token_id,
                           end_token_id=config.eoa_token_index)


ENCODER = Gemma4MediaEncoder
