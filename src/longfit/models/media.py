"""An image-text checkpoint's own vision side, for rows that hold images and videos (#54).

A video is a run of items, one per temporal patch of its frames (`longfit.data.video`): the tower's attention never
crosses two of them, and `get_rope_index` splits a video's grid into them too, so what follows for images holds for
each of them (`rope_positions` hands the documents' video grids to `get_rope_index` as `video_grid_thw`).

longfit trains the language model of a wrapper as a causal LM (`longfit.models.loading`); a row with images in it
also needs the wrapper's vision tower and projector, and the family's positions. `MediaEncoder` holds those modules,
built from the wrapper's own config and filled with the checkpoint's own tensors, and does what the wrapper's forward
does before its language model runs, on longfit's packed rows:
- the tower and projector turn every image of the batch into embeddings (`features`), image by image as the
  wrapper does (the tower's attention never crosses two images, so any subset of the batch's images gives each of
  them the same embeddings: context-parallel ranks split the images between them, `longfit.parallel.media`);
- those embeddings replace the placeholder tokens' input embeddings (`input_embeddings`: each token of a row knows
  from `MediaBatch.embedding_index` which embedding it takes, so a context-parallel shard takes exactly its own);
- the family's positions (`rope_positions`: Qwen3.5's 3-D M-RoPE, transformers' own `get_rope_index`) are computed
  per document of each packed row, on the whole rows, before any context-parallel split.

A text row is an image row with no images: the same path, its positions those of text. What trains is
`train.vision` (`trainable_parts`): the language model alone (the default, as LLaMA-Factory's and ms-swift's
multimodal fine-tuning freeze the vision side by default), also the projector, or also the tower.

Families (`FAMILIES`): Qwen3.5 and Qwen3.5-MoE (this module), Gemma 3 (`longfit.models.media_gemma3`: its own tower,
projector, placeholders and the bidirectional attention inside each image), Mistral 3 (`longfit.models.media_mistral3`:
its Pixtral tower at each image's size, rows of image tokens with breaks), Gemma 4 (`longfit.models.media_gemma4`: its
tower on each image's and video frame's aspect ratio, its audio tower on each audio, the pad token's per-layer inputs,
bidirectional image spans on the sliding-window layers where its config asks), Llama 4 (`longfit.models.media_llama4`: its tower on each image's tiles and the whole
image, the tiles' separators, chunked attention over images as over text); any other wrapper with image rows is refused
in one line naming its part.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import importlib
import re

import torch
from torch import nn

from longfit.config import ConfigError
from longfit.data.media import IMAGE, VIDEO, MediaBatch, MediaReader, MediaSpec
from longfit.models.model_config import checkpoint_class, read_config
from longfit.models.source import local_model_dir


@dataclass(frozen=True)
class MediaFamily:
    """Where a wrapper family keeps its vision side."""

    tower: str
    """The vision module's path in the wrapper (its checkpoint keys start with it); "" for the wrapper itself (Llama 4's
    tower and projector are its top-level modules)."""
    projector: str
    """The projector's path inside the vision module (Qwen3.5's merger lives in its tower)."""
    video_processor: str | None = None
    """The family's video processor class, "module:Class" (imported from its module: transformers' top level offers
    only a placeholder without torchvision); None: its rows hold no videos."""
    module: str = "longfit.models.media"
    """The module whose `ENCODER` is the family's MediaEncoder (its modules, placeholders, positions and masks)."""


QWEN3_VL_VIDEO = "transformers.models.qwen3_vl.video_processing_qwen3_vl:Qwen3VLVideoProcessor"
GEMMA4_VIDEO = "transformers.models.gemma4.video_processing_gemma4:Gemma4VideoProcessor"
FAMILIES = {
    "qwen3_5": MediaFamily(tower="model.visual", projector="merger", video_processor=QWEN3_VL_VIDEO),
    "qwen3_5_moe": MediaFamily(tower="model.visual", projector="merger", video_processor=QWEN3_VL_VIDEO),
    # Gemma 3's tower and projector are siblings under `model`: its vision module holds both (media_gemma3).
    "gemma3": MediaFamily(tower="model", projector="multi_modal_projector", module="longfit.models.media_gemma3"),
    "mistral3": MediaFamily(tower="model", projector="multi_modal_projector", module="longfit.models.media_mistral3"),
    # Gemma 4's towers (vision, and audio where it has one) and embedders are siblings under `model` (media_gemma4).
    "gemma4": MediaFamily(tower="model", projector="embed_vision", video_processor=GEMMA4_VIDEO,
                          module="longfit.models.media_gemma4"),
    "llama4": MediaFamily(tower="", projector="multi_modal_projector", module="longfit.models.media_llama4"),
}
"""model_type -> its vision side."""

VISION_PARTS = ("frozen", "projector", "all")
"""`train.vision`: what of the vision side trains beside the language model."""


def media_family(config) -> MediaFamily:
    """The vision side of a wrapper `config`; a one-line refusal for a family longfit cannot yet train images of."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ConfigError(
            f"the {config.model_type} checkpoint's image rows cannot be trained yet (#54: images train on "
            f"{', '.join(sorted(FAMILIES))}); give its data without image parts to train its language model on text"
        )
    return family


def encoder_type(family: MediaFamily) -> type[MediaEncoder]:
    """The family's MediaEncoder class (`MediaFamily.module`)."""
    return importlib.import_module(family.module).ENCODER


class MediaEncoder(nn.Module):
    """The wrapper's vision modules (tower with its projector) and its position rule, for one checkpoint (Qwen3.5's
    here; another family's subclass overrides what differs)."""

    bidirectional_images = False
    """Whether `attention_layout` lets image tokens see later ones (Gemma 3)."""

    @staticmethod
    def vision_module(config) -> nn.Module:
        """The family's vision modules, built from the wrapper `config` in fp32, their state dict's names those of
        the checkpoint after `MediaFamily.tower`."""
        from transformers import AutoModel

        return AutoModel.from_config(config.vision_config, dtype=torch.float32)

    @staticmethod
    def media_spec(config, directory: Path) -> MediaSpec:
        """How the family's rows place an image's tokens (`longfit.data.media.MediaSpec`)."""
        return MediaSpec(image_token_id=config.image_token_id, video_token_id=getattr(config, "video_token_id", None),
                         merge_size=config.vision_config.spatial_merge_size)

    @staticmethod
    def check_image_processor(processor, model: str) -> None:
        """Refuse, in one line, an image processor setting the family's reader does not follow (none for Qwen3.5)."""

    @staticmethod
    def video_reader(processor, config):
        """How the family reads video parts with the checkpoint's video `processor` (`longfit.data.video`: Qwen3.5's
        temporal patches with their timestamps here)."""
        import transformers

        from longfit.data.video import VideoReader

        version = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", transformers.__version__).groups())
        return VideoReader(processor, video_token_id=config.video_token_id,
                           vision_start_token_id=config.vision_start_token_id,
                           vision_end_token_id=config.vision_end_token_id,
                           replaces_template_markers=version >= (5, 25))

    @staticmethod
    def audio_reader(config, directory: Path):
        """How the checkpoint in `directory` reads audio parts (`longfit.data.audio.AudioReader`); None: it does not
        (only Gemma 4 has an audio tower)."""
        return None

    @staticmethod
    def missing_backend() -> str | None:
        """Why the family's image processor cannot run here (a package it needs, and the fix); None: it can (the
        Pillow image processors need Pillow alone)."""
        return None

    def __init__(self, config, vision: nn.Module, family: MediaFamily, rope_index):
        super().__init__()
        self.config = config
        self.family = family
        self.vision = vision
        self._rope_index = rope_index  # the wrapper's get_rope_index, bound to its base model on the meta device
        self.checkpoint_keys: dict[str, str] = {}  # vision parameter name -> its checkpoint key (the export's)

    @property
    def projector(self) -> nn.Module:
        return self.vision.get_submodule(self.family.projector)

    def towers(self) -> list[tuple[nn.Module, int]]:
        """The towers whose blocks activation checkpointing wraps, each with its depth (its config's
        `num_hidden_layers`, `longfit.memory.checkpointing.tower_blocks`): the vision module (Gemma 4 adds its audio
        tower)."""
        return [(self.vision, self.config.vision_config.num_hidden_layers)]

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The embeddings (N, H) of the images whose patches are `pixel_values` (P, C*T*p*p) on grids `grid_thw`
        (I, 3): the tower, then the projector, each image's tokens in order, images in order."""
        dtype = next(self.vision.parameters()).dtype
        return self.vision(pixel_values.to(dtype), grid_thw=grid_thw).pooler_output  # (N, H)

    def pixel_rows(self, grid_thw: torch.Tensor) -> list[int]:
        """The rows of `pixel_values` each image of `grid_thw` (I, 3) takes: its patches."""
        return [int(g.prod()) for g in grid_thw]

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """The embeddings (placeholder tokens) of each image of `grid_thw`: its patches merged."""
        return [int(g.prod()) // self.config.vision_config.spatial_merge_size**2 for g in grid_thw]

    def wrapper_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor) -> dict:
        """What the wrapper's own forward takes beside the input ids for one conversation's images: their pixels
        `pixel_values` (`pixel_rows` of each), grids `grid_thw` (I, 3) and the conversation's token types (1, L) --
        the reference `longfit check` compares the image path with (`longfit.check.media`)."""
        return dict(pixel_values=pixel_values, image_grid_thw=grid_thw, mm_token_type_ids=token_types)

    def wrapper_video_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, token_types: torch.Tensor
                             ) -> dict:
        """As `wrapper_inputs`, for one video's temporal patches: Qwen3-VL's processor's names, each temporal patch a
        video of one (the wrapper's tower and `get_rope_index` split a video's grid into them alike, and its
        timestamps are text in the ids)."""
        return dict(pixel_values_videos=pixel_values, video_grid_thw=grid_thw, mm_token_type_ids=token_types)

    def language_model_inputs(self, body: nn.Module, input_ids: torch.Tensor, media: MediaBatch) -> dict:
        """What the family's language model `body` takes beside the input embeddings of `input_ids` (B, L) (a
        context-parallel shard, or whole rows) with images (none here; Gemma 4's per-layer inputs)."""
        return {}

    def attention_layout(self, documents, media: MediaBatch):
        """The layout the language model's attention computes for rows with `media`: the documents as they are
        (Qwen3.5 attends causally over images); Gemma 3 adds its images' bidirectional spans."""
        return documents

    def rope_positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor, media: MediaBatch) -> torch.Tensor:
        """The family's position ids (4, B, L) of whole rows: text positions (position_ids: restarting in every
        document) first, then the 3-D M-RoPE ones of `get_rope_index`, each document of each row on its own with
        its own images (transformers computes them from a conversation's first token, so a document's are those of
        the conversation alone). Documents without images get their text positions three times, as
        `get_rope_index` would give them."""
        rope = position_ids.unsqueeze(0).repeat(3, 1, 1)  # (3, B, L)
        items = iter(zip(media.item_starts, media.grid_thw))
        for row, spans in enumerate(media.documents.rows):
            for start, end in spans:
                types = media.token_types[row : row + 1, start:end]
                if not types.any():
                    continue
                grids = {IMAGE: [], VIDEO: []}  # a video's temporal patches: its grid as get_rope_index splits it
                for (b, at), grid in (next(items) for _ in range(media.items_in(row, start, end))):
                    grids[int(media.token_types[b, at])].append(grid)
                image, video = (torch.stack(grids[kind]) if grids[kind] else None for kind in (IMAGE, VIDEO))
                positions, _ = self._rope_index(input_ids[row : row + 1, start:end], mm_token_type_ids=types,
                                                image_grid_thw=image, video_grid_thw=video)
                rope[:, row, start:end] = positions[:, 0]
        return torch.cat([position_ids.unsqueeze(0), rope])  # (4, B, L)

    def input_embeddings(self, embedding: nn.Module, input_ids: torch.Tensor, media: MediaBatch,
                         features: torch.Tensor) -> torch.Tensor:
        """The input embeddings (B, L, H) of `input_ids` (B, L) (a context-parallel shard, or whole rows), each
        placeholder token's replaced by its image embedding: row `media.embedding_index` of `features` (every
        image of the batch, N x H). The placeholders' own embedding rows get no gradient, as in the wrapper. A
        sequence-parallel embedding (`longfit.parallel.tp`) gives its tp rank's tokens of the rows: those take
        theirs."""
        embeds = embedding(input_ids)  # (B, L, H); under tensor parallelism this tp rank's L / T of them
        index = media.embedding_index  # (B, L), -1 on text
        part = getattr(embedding, "longfit_sequence_part", None)  # (tp rank, T): its contiguous slice of the row
        if part is not None:
            index = index.chunk(part[1], dim=1)[part[0]]  # (B, L / T)
        if not features.shape[0]:
            return embeds
        taken = features.to(embeds.dtype)[index.clamp(min=0)]  # (B, L, H)
        return torch.where((index >= 0).unsqueeze(-1), taken, embeds)


ENCODER = MediaEncoder  # Qwen3.5's and Qwen3.5-MoE's (`MediaFamily.module`)


def decoder_rules(encoder: type[MediaEncoder]) -> list[str]:
    """What a family's image rows hand every decoder layer beyond the input embeddings, from the rules its encoder
    class overrides: the base class's positions are the M-RoPE ones (the families with text positions override
    them), its attention layout and its language model's extra inputs are the text's."""
    rules = []
    if encoder.rope_positions is MediaEncoder.rope_positions:
        rules.append("M-RoPE position ids")
    if encoder.attention_layout is not MediaEncoder.attention_layout:
        rules.append("an attention layout of its images")
    if encoder.language_model_inputs is not MediaEncoder.language_model_inputs:
        rules.append("per-layer inputs")
    return rules


def image_reader(model: str) -> MediaReader | None:
    """The run's reader of image parts (`media_reader`) where `model` is a local wrapper checkpoint of a family whose
    images train (`FAMILIES`) with its image processor's file; None otherwise (a wrapper trained on text rows alone
    may come without one): its chats with image parts are then refused in one line."""
    from transformers.utils import IMAGE_PROCESSOR_NAME, PROCESSOR_NAME

    directory = local_model_dir(model)
    if directory is None or not any((Path(directory) / name).is_file()
                                    for name in (IMAGE_PROCESSOR_NAME, PROCESSOR_NAME)):
        return None
    read = read_config(model)
    return media_reader(model) if read.is_wrapper and read.config.model_type in FAMILIES else None


def trains_media(cfg) -> bool:
    """Whether `cfg`'s run trains rows with images or videos: its data (`data.path`) holds chats with such parts and
    `cfg.model` is a wrapper checkpoint whose images train (`image_reader`), the rows for which the trainer builds the
    vision side (the training source's `images`). The rows' JSON is read, nothing rendered or decoded."""
    from longfit.data.sources import open_source
    from longfit.models.loading import load_tokenizer

    if not cfg.data.path or cfg.train.objective != "causal_lm":
        return False
    reader = image_reader(cfg.model)
    if reader is None:
        return False
    source = open_source(cfg, load_tokenizer(cfg.model), reader)
    return any(True for _ in getattr(source, "media_rows", tuple)())


def media_reader(model: str) -> MediaReader:
    """How the wrapper checkpoint directory `model` reads image parts: its placeholder rule and its own image
    processor (`AutoImageProcessor`, which takes the Pillow backend where torchvision is not installed). transformers'
    full processors are not built: several refuse to be without a video processor, which needs torchvision."""
    from transformers import AutoImageProcessor

    read = read_config(model)
    family = media_family(read.config)  # a family without image rows: refused here, before any data is read
    directory = local_model_dir(model)
    if directory is None:
        raise ConfigError(f"model={model!r}: image rows need the wrapper checkpoint's own image processor; point "
                          "`model` at its local directory")
    encoder = encoder_type(family)
    missing = encoder.missing_backend()
    if missing is not None:  # its text rows train; its first image part is one error line (MediaReader.available)
        return MediaReader(encoder.media_spec(read.config, Path(directory)), None, unavailable=missing)
    try:
        processor = AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"model={model!r}: its image processor cannot be loaded ({e}); image rows need the "
                          "checkpoint's preprocessor_config.json, and transformers' Pillow image processors "
                          "(`pip install pillow`)") from e
    encoder.check_image_processor(processor, model)
    videos = sorted(name for name, known in FAMILIES.items() if known.video_processor)
    unread = {} if family.video_processor else {"no_video": (
        f"longfit does not read {read.config.model_type} video parts yet, with or without its video processor "
        f"(#54: videos train on {', '.join(videos)}); give the video's frames as image parts")}
    return MediaReader(encoder.media_spec(read.config, Path(directory)), processor,
                       video=video_reader(directory, read.config, family),
                       audio=encoder.audio_reader(read.config, Path(directory)), **unread)


def video_reader(directory: str, config, family: MediaFamily):
    """How the checkpoint in `directory` reads video parts (its own video processor, on Pillow frames, and its
    family's placeholder rule: `MediaEncoder.video_reader`); None when its family or the checkpoint has no video
    processor."""
    from longfit.data.video import load_video_processor

    processor = None if family.video_processor is None else load_video_processor(directory, family.video_processor)
    return None if processor is None else encoder_type(family).video_reader(processor, config)


def build_media_encoder(model: str, device: torch.device | str = "cpu") -> MediaEncoder:
    """The vision side of the wrapper checkpoint directory `model` on `device`, in fp32 (the master weights, as the
    language model's), its tensors read from the checkpoint; frozen (`trainable_parts` unfreezes).

    Built directly on `device` from the wrapper's vision config (its buffers computed as transformers computes them)
    rather than on the meta device: the tower is small beside the language model (Qwen3.5's 0.4B of 27B); under FSDP2
    each rank then keeps its shard of it, with the objective's root parameters."""
    from safetensors import safe_open

    from longfit.models.weights import checkpoint_files, source_names

    read = read_config(model)
    if not read.is_wrapper:
        raise ConfigError(f"model={model!r} is a causal LM without a vision tower: its rows cannot hold images")
    family = media_family(read.config)
    directory = local_model_dir(model)
    if directory is None:
        raise ConfigError(f"model={model!r}: image rows need the wrapper checkpoint's own vision weights; point "
                          "`model` at its local directory")
    with torch.device("meta"):
        wrapper = checkpoint_class(read.config)._from_config(read.config)  # names, and get_rope_index
    encoder = encoder_type(family)
    with torch.device(device):
        vision = encoder.vision_module(read.config)
    files = checkpoint_files(Path(directory))
    # The checkpoint's key of each wrapper name by transformers' own loading rules: a checkpoint saved in a family's
    # older layout (Gemma 3's and Mistral 3's `vision_tower.*`, as transformers 5 still writes them) loads the same.
    keys = {name: key for key, (name, converter) in source_names(wrapper, files).items() if converter is None}
    prefix = f"{family.tower}." if family.tower else ""
    state, checkpoint_keys = {}, {}
    for name in vision.state_dict():
        key = keys.get(prefix + name)
        if key is None:
            raise ConfigError(f"model={model!r}: the checkpoint has no {prefix + name}; point `model` at the complete "
                              "wrapper checkpoint")
        with safe_open(str(files[key]), framework="pt", device=str(torch.device(device))) as f:
            state[name] = f.get_tensor(key).float()
        checkpoint_keys[name] = key
    vision.load_state_dict(state, strict=True)
    vision.requires_grad_(False)
    made = encoder(read.config, vision, family, getattr(wrapper.base_model, "get_rope_index", None))
    made.checkpoint_keys = checkpoint_keys
    return made


def trainable_parts(encoder: MediaEncoder, vision: str, lora=None, seed: int = 0) -> list[nn.Parameter]:
    """Unfreeze what `train.vision` trains: nothing (`frozen`), the projector (`projector`), the tower with its
    projector (`all`); where `lora` (the run's `LoraSection`) is enabled, LoRA adapters on those parts' linear
    layers (and a projector's weight held by no linear layer) instead (`add_vision_adapters`, drawn from `seed`).
    The parameters that train."""
    if vision not in VISION_PARTS:
        raise ConfigError(f"train.vision={vision!r}: use one of {', '.join(VISION_PARTS)}")
    adapters = lora is not None and lora.enabled
    encoder.vision.requires_grad_(vision == "all" and not adapters)
    if adapters and vision != "frozen":
        add_vision_adapters(encoder, vision, lora, seed)
    elif vision == "projector":
        encoder.projector.requires_grad_(True)
    return [p for p in encoder.vision.parameters() if p.requires_grad]


def vision_lora_targets(encoder: MediaEncoder, vision: str) -> tuple[list[str], list[str]]:
    """What of the vision module `train.vision=vision` adapts under LoRA: (its linear layers, its weights held by no
    linear layer). The linear layers are the projector's, and with `all` the tower's too (every one, as peft's
    `all-linear`: `lora.target_modules` names the language model's projections, which the towers name otherwise --
    Qwen's `qkv`, SigLIP's `out_proj`); a layer of a `nn.MultiheadAttention` is left out: peft adapts that module
    whole, not its output projection. The weights are the projector's matrices that its own forward multiplies by
    (Gemma 3's `mm_input_projection_weight`), adapted as peft's `target_parameters`; the tower's (position tables,
    class embeddings) are not projections."""
    inside = "" if vision == "all" else f"{encoder.family.projector}."
    attention = {name for name, module in encoder.vision.named_modules() if isinstance(module, nn.MultiheadAttention)}
    layers = [name for name, module in encoder.vision.named_modules()
              if isinstance(module, nn.Linear) and name.startswith(inside) and name.rsplit(".", 1)[0] not in attention]
    weights = [f"{encoder.family.projector}.{name}" for name, param in encoder.projector.named_parameters()
               if param.ndim == 2 and not isinstance(encoder.projector.get_submodule(name.rpartition(".")[0]),
                                                     (nn.Linear, nn.Embedding))]
    return layers, weights


def add_vision_adapters(encoder: MediaEncoder, vision: str, lora, seed: int) -> None:
    """LoRA adapters (peft's, `lora`'s rank, alpha and dropout) on `vision_lora_targets`, in fp32 as the language
    model's adapters; refused in one line where the part has nothing to adapt, or where a weight held by no linear
    layer would take dropout (peft's `ParamWrapper` adds B A to the weight: no input to drop).
    peft's initialisation is drawn by blocks seeded by `seed` and each adapter's wrapper name, as the language
    model's adapters are (`longfit.models.init.reset_lora`): the same values on every rank and at any cp, whatever
    the global generator drew before."""
    from longfit.models.build import peft_quietly

    layers, weights = vision_lora_targets(encoder, vision)
    if not layers and not weights:
        raise ConfigError(f"train.vision={vision} with lora.enabled=true: the {encoder.config.model_type} projector "
                          "has no linear layer or weight matrix for an adapter; set train.vision=all (adapters on its "
                          "tower too), or lora.enabled=false to train the projector whole")
    if weights and lora.dropout:
        raise ConfigError(f"train.vision={vision} with lora.dropout={lora.dropout}: the {encoder.config.model_type} "
                          f"projector's {weights[0].rsplit('.', 1)[-1]} is a weight without a linear layer, whose "
                          "adapter takes no dropout; set lora.dropout=0")
    with peft_quietly():
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules="|".join(re.escape(name) for name in layers) or None,
                            target_parameters=weights or None)
        inject_adapter_in_model(config, encoder.vision)
    for name, param in encoder.vision.named_parameters():
        param.requires_grad_(".lora_" in name)
        if param.requires_grad:
            param.data = param.data.float()
    _draw_adapters(encoder, seed)


@torch.no_grad()
def _draw_adapters(encoder: MediaEncoder, seed: int) -> None:
    from peft.tuners.lora import LoraLayer
    from transformers.initialization import guard_torch_init_functions

    from longfit.models.init import block_fills, canonical_name

    prefix = f"{encoder.family.tower}." if encoder.family.tower else ""
    adapters = [(name, p) for name, p in encoder.vision.named_parameters() if p.requires_grad]
    if adapters[0][1].is_meta:  # a plan's shapes: no values to draw
        return
    names = {id(p): prefix + canonical_name(name) for name, p in adapters}
    for _, param in adapters:
        param._is_hf_initialized = False
    written: set[int] = set()
    with block_fills(names, seed, written), guard_torch_init_functions():  # peft calls torch.nn.init
        for module in encoder.vision.modules():
            if isinstance(module, LoraLayer):
                module.reset_lora_parameters("default", True)


def vision_adapter_modules(encoder: MediaEncoder) -> dict[str, str]:
    """The vision module's adapted layers -> their module names in the wrapper (the tower's path before them), what
    the export names the adapter's vision tensors by."""
    from peft.tuners.lora import LoraLayer

    prefix = f"{encoder.family.tower}." if encoder.family.tower else ""
    return {name: prefix + name for name, module in encoder.vision.named_modules() if isinstance(module, LoraLayer)}


def vision_adapter_parameters(encoder: MediaEncoder) -> list[str]:
    """The wrapper names of the weights the vision module's adapters adapt without a linear layer (peft's
    `ParamWrapper`, `vision_lora_targets`' second list): what the export writes as `target_parameters`."""
    from peft.tuners.lora import ParamWrapper

    prefix = f"{encoder.family.tower}." if encoder.family.tower else ""
    return [f"{prefix}{name}.{module.parameter_name}" for name, module in encoder.vision.named_modules()
            if isinstance(module, ParamWrapper)]
