"""`longfit check` of a run whose rows hold images (#54): the image path proven on a shrunken copy of the wrapper.

Where the run trains or evaluates image rows (`checks_media`: its training or eval data holds image or video parts
and the checkpoint's images train), `check_run` compares, after the text steps, longfit's step on image rows with the
wrapper's own eager forward:
- the copy (`image_copy`): the wrapper's own class, built from the checkpoint's wrapper config with the text check's
  copy of its language model (`longfit.check.shrink`) and its vision config shrunk through transformers' config
  object (`shrink_tower`: the tower's widths and depth small; its patch, merge, pooling and tile sizes, image size
  and position tables as they are, and the wrapper's own fields -- tokens per image, the text config's M-RoPE
  sections, Gemma's bidirectional image attention -- untouched); random weights (std 0.1, bf16 values, as the
  text copy's);
- the rows (`image_rows`): two images made here with Pillow from seeded arrays, two conversations holding one each,
  written as a .jsonl file and read by longfit's own reader with the checkpoint's own tokenizer, chat template and
  image processor (each image's size and tokens are the processor's rules), packed into one row; the row's ids
  renumbered into the copy's vocabulary, the config's special tokens with them;
- longfit's step (`image_step`, `image_cp_worker`): the language model (longfit's attention) and the family's
  MediaEncoder holding the copy's vision modules, the wrapper's weights under transformers' loading names,
  `CausalLMLoss` with the encoder, `train.vision` (`trainable_parts`), the run's memory techniques and dtype, and
  under parallel.cp > 1 `parallelize` on two gloo ranks with the images dealt over them, under parallel.tp > 1 on
  two tp ranks with the tower replicated and the images dealt over them (cp x tp ranks with both), as the trainer
  runs it;
- the reference (`wrapper_step`): the wrapper's forward on each conversation of the row alone with its own images
  (`MediaEncoder.wrapper_inputs`), the cross-entropy of its logits summed over the row's targets; its gradients of
  what longfit trains.
Every step takes the text check's `setup` (`longfit.check.parity.Setup`: the run's techniques, dtype, cp method, seed
as the copy runs them) and adds its comparisons to the text check's report. The bounds are the text check's
(`longfit.check.steps`: fp32 with its float64 rule, bf16 against the wrapper's eager and SDPA runs under autocast,
FSDP2's ceiling under cp; a mixture of experts under bf16 with every expert chosen). Where the one-process fp32 step
differs, the refusal names the first part of the image path that differs (`locate_image_part`): the images'
embeddings (tower and projector), the rows' input embeddings with the images scattered in, the positions, else the
language model over image rows.

With LoRA (`lora.enabled`) both sides carry adapters holding the same values (`draw_adapters`, std 0.1 in bf16
values, drawn by their names in the wrapper): longfit's on its language model (peft, the run's lora.r and lora.alpha,
its targets as the text check's) and on what `train.vision` trains of its vision module (`trainable_parts`); the
reference is peft on the wrapper with the same modules adapted (`_wrapper`), and the gradients compared are the
adapters'. Under bf16 both store
the language model's frozen base in bf16, as the trainer does (`_lora_storage`); the vision module stays fp32.

Where the run's rows hold videos its checkpoint reads (`row_parts`: Qwen3.5's families and Gemma 4; the others refuse
a video part in one line as they read it), the row holds a conversation with a video made here (a folder of
`VIDEO_FRAMES` seeded frames, sampled and patched by the checkpoint's video processor as the run samples), the
wrapper given it as its processor gives it (`MediaEncoder.wrapper_video_inputs`: Qwen's temporal patches with their
grids, Gemma 4's frames with their patch positions and frame count, through its vision tower), and the verdict's key
holds the video processor's settings (`image_architecture`). Where they hold audio parts (Gemma 4's audio tower), the
row holds a conversation with an audio made here (`AUDIO_SECONDS` of a seeded sine written as WAV by the standard
library's `wave`, read by longfit's audio reader with the checkpoint's feature extractor), the copy keeps the audio
tower, its config shrunk as the vision config is (`shrink_tower`), the wrapper is given the audio's features and mask
(`wrapper_audio_inputs`), a difference in the audios' embeddings (audio tower and embedder) is named as theirs, and
the verdict's key holds the feature extractor's settings: a verdict on rows without audio never answers for rows with
it. Image rows run under tensor parallelism (the tower replicated on the tp ranks, the images dealt over them);
pipeline parallelism with images is refused.
"""

from __future__ import annotations

import copy as copying
import json
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from longfit.check.steps import (
    AUTOCAST_CEILING, BF16, CHECK_CP, CHECK_TP, FSDP_CEILING, VISION_GRADS, Comparison, Step, _at_least_fp32, _close,
    _grads, _in_bf16, _missing, compare_bf16, compare_fp32, cp_step)
from longfit.config import Config, ConfigError, load_config

IMAGE_SIZES = ((40, 50), (33, 70))
"""(height, width) of the check's two images as made, before the image processor's resize: unequal sides, not
multiples of any patch."""
VIDEO_FRAMES = (4, 48, 64)
"""(frames, height, width) of the check's video where the run's rows hold videos: two temporal patches of Qwen's two
frames each, at the video processor's own rate (a folder of frames is read as already sampled)."""
AUDIO_SECONDS = 0.5
"""The check's audio where the run's rows hold audio parts: a sine (its pitch seeded) with seeded noise, at the
feature extractor's rate (Gemma 4's: 50 feature frames, 13 audio tokens)."""
QUESTION, ANSWER = "What does this page show?", "Noise of many colours."
VIDEO_QUESTION, AUDIO_QUESTION = "What moves?", "What is heard?"
VISION_WIDTHS = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_heads": 2,
                 "num_key_value_heads": 2, "head_dim": 16}
"""The vision tower's widths in the copy (two heads of 16), under the names transformers' vision configs use."""
VISION_LAYERS = ("num_hidden_layers", "depth")
VISION_DEPTH = 2  # two blocks: one feeds another
TOKEN_ID_SUFFIXES = ("_token_id", "_token_index")


class PartRefused(Exception):
    """The family's image path cannot be checked: the part and why."""


@dataclass
class ImageCopy:
    """What every step of the image check needs, picklable for the gloo ranks."""

    config_values: dict
    """The wrapper copy's config (`config()`)."""
    state: dict[str, torch.Tensor]
    """The wrapper copy's random weights, under its own names."""
    batch: object
    """The packed row of the two conversations (a PackedBatch with its MediaBatch), ids in the copy's vocabulary."""
    vision: str
    """train.vision."""
    adapters: dict[str, torch.Tensor] = field(default_factory=dict)
    """With LoRA: the adapters' values under the peft-wrapped wrapper's names (`draw_adapters`); empty without."""
    vision_names: tuple[str, ...] = ()
    """With LoRA: the vision module's parameters under the peft-wrapped wrapper's names (`_lora_storage` keeps them
    fp32)."""
    lora: tuple[int, int] | None = None
    """With LoRA: the run's (lora.r, lora.alpha), the adapters' on both sides; None without."""
    adapted_weights: tuple[str, ...] = ()
    """With LoRA: the vision module's weights adapted without a linear layer (Gemma 3's projector), the wrapper's
    names (`vision_adapter_parameters`): peft's `target_parameters` on the wrapper."""

    def config(self):
        from transformers import AutoConfig

        values = dict(self.config_values)
        return AutoConfig.for_model(values.pop("model_type"), **values)


def shrink_tower(tower, full, text_hidden: int):
    """The tower config `tower` of the wrapper `full` (its vision config, Gemma 4's audio config) with the tower's
    widths (`VISION_WIDTHS`) and depth (`VISION_DEPTH`) small; a width equal to the language model's hidden size
    (Qwen's merger output) follows the copy's `text_hidden`; everything else (patch, merge, pooling, tile and image
    sizes, position tables, the audio's convolutions and attention chunks) as it is."""
    tower = copying.deepcopy(tower)
    full_hidden = full.get_text_config().hidden_size
    for key, value in tower.to_dict().items():
        if key in VISION_WIDTHS:
            setattr(tower, key, VISION_WIDTHS[key])
        elif key in VISION_LAYERS:
            setattr(tower, key, min(value, VISION_DEPTH))
        elif isinstance(value, int) and not isinstance(value, bool) and value == full_hidden:
            setattr(tower, key, text_hidden)
    return tower


def image_architecture(cfg: Config, unchecked: tuple[str, ...]) -> dict:
    """What of `cfg`'s run decides the image check's verdict beside its text config: the wrapper's config (its vision
    config, special tokens, tokens per image), its image processor's settings, where its rows hold videos
    (`row_parts`) its video processor's as the run samples frames, and where they hold audio parts its feature
    extractor's: a verdict on rows without videos or audio never answers for rows with them."""
    from longfit.models.media import media_reader
    from longfit.models.model_config import read_config

    config = read_config(cfg.model).config.to_dict()
    reader = media_reader(cfg.model)
    processor = reader.image_processor
    parts = row_parts(cfg)
    videos = reader.sampled(cfg.data).video.processor.to_dict() if "video" in parts else None
    audio = json.loads(reader.audio.feature_extractor.to_json_string()) if "audio" in parts else None
    return {"wrapper": {k: v for k, v in config.items() if k not in unchecked},
            "image_processor": processor.to_dict() if processor is not None else None, "videos": videos,
            "audio": audio}


def _special_ids(config) -> dict[str, int]:
    """The config's own token ids (`image_token_id`, `boi_token_index`, `pad_token_id`, ...) at its level."""
    return {key: value for key, value in config.to_dict().items()
            if key.endswith(TOKEN_ID_SUFFIXES) and type(value) is int and value >= 0}


def _renumbered(batch, ids: dict[int, int]):
    """`batch` with its ids and targets renumbered by `ids` (the checkpoint's -> the copy's)."""
    from longfit.data.packing import PackedBatch

    lookup = torch.full((max(ids) + 1,), -1, dtype=torch.long)
    lookup[list(ids)] = torch.tensor(list(ids.values()))
    labels = torch.where(batch.labels >= 0, lookup[batch.labels.clamp(min=0)], batch.labels)
    return PackedBatch(lookup[batch.input_ids], labels, batch.position_ids, batch.cu_seqlens, batch.num_label_tokens,
                       batch.documents, media=batch.media)


def _read_data(cfg: Config) -> list[Config]:
    """`cfg` as its training data's and, with data.eval_path, as its eval data's (the trainer reads both through the
    vision side: `EvalData.images`; data.eval_fraction holds rows of data.path out)."""
    return [cfg] + ([replace(cfg, data=replace(cfg.data, path=cfg.data.eval_path))] if cfg.data.eval_path else [])


def checks_media(cfg: Config) -> bool:
    """Whether `cfg`'s run reads rows with images or videos through the vision side, its training data's
    (`longfit.models.media.trains_media`) or its eval data's alone: the check then proves the image path (its eval
    runs the same forward)."""
    from longfit.models.media import trains_media

    return any(trains_media(read) for read in _read_data(cfg))


def row_parts(cfg: Config) -> set[str]:
    """The kinds of video and audio parts (`"video"`, `"audio"`) that `cfg`'s image rows (training or eval data's)
    hold and its checkpoint reads (a video processor: Qwen3.5's families, Gemma 4; an audio tower and feature
    extractor: Gemma 4; any other refuses such a part in one line as it reads the rows): the check's row then holds
    a video or an audio too (`image_rows`). The rows' JSON is read, nothing decoded."""
    from longfit.data.media import media_paths
    from longfit.data.sources import open_source
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import image_reader

    reader = image_reader(cfg.model) if cfg.data.path or cfg.data.eval_path else None
    readable = {kind for kind, part in (("video", reader and reader.video), ("audio", reader and reader.audio))
                if part is not None}
    found: set[str] = set()
    for read in _read_data(cfg) if readable else ():
        if read.data.path:
            rows = getattr(open_source(read, load_tokenizer(cfg.model), reader), "media_rows", tuple)()
            found |= {kind for _, folder, messages in rows for kind, _ in media_paths(messages, folder)}
    return found & readable


def _chat(part: dict, question: str) -> dict:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": ANSWER}]}


def write_audio(path: Path, rate: int, generator: np.random.Generator) -> None:
    """`AUDIO_SECONDS` of a sine (its pitch drawn from `generator`, seeded noise added) at `rate`, as 16-bit mono
    PCM WAV (the standard library's `wave`)."""
    import wave

    t = np.arange(int(AUDIO_SECONDS * rate)) / rate
    sine = np.sin(2 * np.pi * generator.uniform(200, 800) * t) * 0.5 + generator.normal(0, 0.05, len(t))
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(sine, -1, 1) * 32767).astype("<i2").tobytes())


def image_rows(cfg: Config, folder: Path, videos: bool = False, audio: bool = False):
    """The check's packed row (module docstring) in the checkpoint's own ids: its two images and conversations; with
    `videos` a conversation holding a video (a folder of `VIDEO_FRAMES` frames, sampled by the run's
    data.video_fps / data.video_max_frames); with `audio` one holding an audio (`write_audio`); written under
    `folder`, read by longfit's reader with the checkpoint's tokenizer, image processor, video processor and
    feature extractor."""
    from PIL import Image

    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader

    reader = media_reader(cfg.model)
    if reader.unavailable is not None:
        raise PartRefused(f"its image processor cannot run here: {reader.unavailable}")
    generator = np.random.default_rng(cfg.train.seed)
    chats = []
    for index, (height, width) in enumerate(IMAGE_SIZES):
        name = f"image{index}.png"
        Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / name)
        chats.append(_chat({"type": "image", "path": name}, QUESTION))
    room = sum(reader.image_tokens(folder / f"image{i}.png") + len(reader.spec.prefix) + len(reader.spec.suffix)
               for i in range(len(IMAGE_SIZES)))
    sampling = [f"data.video_fps={cfg.data.video_fps}"] * (cfg.data.video_fps is not None) + \
        [f"data.video_max_frames={cfg.data.video_max_frames}"] * (cfg.data.video_max_frames is not None)
    if videos:
        (folder / "video").mkdir()
        for index, frame in enumerate(generator.integers(0, 256, (*VIDEO_FRAMES, 3), dtype=np.uint8)):
            Image.fromarray(frame).save(folder / "video" / f"{index:03d}.png")
        chats.append(_chat({"type": "video", "path": "video"}, VIDEO_QUESTION))
        room += reader.sampled(cfg.data).video.tokens(folder / "video")
    if audio:
        write_audio(folder / "audio.wav", reader.audio.feature_extractor.sampling_rate, generator)
        chats.append(_chat({"type": "audio", "path": "audio.wav"}, AUDIO_QUESTION))
        room += reader.audio.tokens(folder / "audio.wav") + 2  # <boa>, the audio tokens, <eoa>
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    tokenizer = load_tokenizer(cfg.model)

    def packed(seq_len: int):
        run = load_config(None, [f"model={cfg.model}", f"data.path={path}", f"seq_len={seq_len}",
                                 "train.micro_batch=1", *sampling])
        return next(build_dataloader(run, tokenizer, epochs=1, media=reader))

    loose = packed(room + 4096)  # the images, videos and far more than the chats' text, padded after them
    end = loose.documents.rows[0][len(chats) - 1][1]
    batch = packed(-(-end // (4 * CHECK_CP)) * 4 * CHECK_CP)  # a row the ring's zigzag chunks divide
    if len(batch.documents.rows[0]) < len(chats) or not batch.media.images:
        raise RuntimeError("the check's image conversations were not packed into one row")
    return batch


def image_copy(cfg: Config, text_copy, setup, folder: Path) -> ImageCopy:
    """The wrapper copy and the check's row in its vocabulary (module docstring)."""
    from longfit.models.media import media_family
    from longfit.models.model_config import read_config

    full = read_config(cfg.model).config
    media_family(full)  # a family whose images do not train: its one line
    parts = row_parts(cfg)
    batch = image_rows(cfg, folder, "video" in parts, "audio" in parts)
    text_full = full.get_text_config()
    wanted = {**_special_ids(full), **_special_ids(text_full)}
    ids = {token: index for index, token in
           enumerate(sorted({*batch.input_ids.unique().tolist(), *wanted.values()}))}
    if len(ids) > text_copy.vocab_size:
        raise PartRefused(f"the check's row holds {len(ids)} distinct tokens, more than the copy's vocabulary of "
                          f"{text_copy.vocab_size}")
    text = text_copy.to_dict()
    text.update({key: ids[value] for key, value in _special_ids(text_full).items()})
    values = full.to_dict()
    for name in full.sub_configs:
        values[name] = None
    values.update({key: ids[value] for key, value in _special_ids(full).items()})
    text_key = next(name for name in full.sub_configs if getattr(full, name) is text_full)
    values |= {text_key: text, "vision_config": shrink_tower(full.vision_config, full, text_copy.hidden_size).to_dict()}
    if "audio" in parts:  # Gemma 4's audio tower, shrunk as the vision tower
        values["audio_config"] = shrink_tower(full.audio_config, full, text_copy.hidden_size).to_dict()
    for key in ("_name_or_path", "transformers_version", "auto_map", "quantization_config", "dtype", "torch_dtype"):
        values.pop(key, None)
    made = ImageCopy(values, {}, _renumbered(batch, ids), cfg.train.vision)
    wrapper = _wrapper(made, "eager")
    generator = torch.Generator().manual_seed(setup.seed)
    with torch.no_grad():
        for _, param in sorted(wrapper.named_parameters()):
            param.copy_((torch.randn(param.shape, generator=generator) * 0.1).to(BF16).float())
    made.state = {name: tensor.clone() for name, tensor in wrapper.state_dict().items()}
    return made


def _wrapper(made: ImageCopy, attn: str, disable_dropout: bool = True) -> torch.nn.Module:
    """transformers' wrapper class of the copy with `attn` attention, its weights `made.state` (when drawn)."""
    from longfit.models.dropout import disable_dropout_modules
    from longfit.models.model_config import checkpoint_class

    config = made.config()
    if getattr(config, "audio_config", None) is not None:  # Gemma 4's audio tower has eager attention alone
        attn = {**{name: attn for name in config.sub_configs}, "audio_config": "eager"}
    model = checkpoint_class(config)._from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    if made.state:
        model.load_state_dict(made.state, strict=True)
    if made.adapters:  # peft on the wrapper, the modules longfit adapts, longfit's values
        from longfit.models.build import peft_quietly

        with peft_quietly(unquantized=True):
            from peft import LoraConfig, get_peft_model

            weights = list(made.adapted_weights)
            targets = sorted({name.removeprefix(PEFT_PREFIX).split(".lora_", 1)[0] for name in made.adapters}
                             - {weight.rsplit(".", 1)[0] for weight in weights})
            rank, alpha = made.lora
            model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                     target_parameters=weights or None))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in made.adapters.items():
                params[name].copy_(value)
    if disable_dropout:
        disable_dropout_modules(model)
    return model


PEFT_PREFIX = "base_model.model."
"""peft's prefix of a wrapped model's parameter names."""


def draw_adapters(shapes: dict[str, torch.Size], seed: int) -> dict[str, torch.Tensor]:
    """The adapters' values (std 0.1, bf16 values as the copy's weights) drawn in the order of their names in the
    wrapper: longfit's side and the wrapper's hold the same ones, B not zero (every adapter's gradient is tested)."""
    generator = torch.Generator().manual_seed(seed + 1)
    return {name: (torch.randn(shape, generator=generator) * 0.1).to(BF16).float()
            for name, shape in sorted(shapes.items())}


def _lora_storage(model: torch.nn.Module, vision_names: tuple[str, ...]) -> torch.nn.Module:
    """The trainer's LoRA storage (`use_lora_storage`: the frozen base in bf16) on the language model of `model`, its
    vision module (`vision_names`) left in fp32 as the trainer's MediaEncoder is."""
    from longfit.models.build import use_lora_storage

    use_lora_storage(model, BF16)
    kept = set(vision_names)
    for name, param in model.named_parameters():
        if name in kept:
            param.data = param.data.float()
    return model


def longfit_side(made: ImageCopy, setup):
    """(the language model with longfit's attention, the family's MediaEncoder, the language model's name -> the
    wrapper's), the copy's weights on both, `train.vision` unfrozen."""
    from longfit.check.shrink import causal_lm
    from longfit.models.attention import register_attention
    from longfit.models.dropout import disable_dropout_modules
    from longfit.models.linear_attention import prepare_linear_attention
    from longfit.models.media import encoder_type, media_family, trainable_parts
    from longfit.models.sparse_attention import prepare_sparse_attention
    from longfit.models.weights import source_names

    config = made.config()
    family = media_family(config)
    model = causal_lm(config.get_text_config(), attn_implementation=register_attention(), dtype=torch.float32)
    model.config.use_cache = False
    prepare_sparse_attention(model)
    prepare_linear_attention(model)  # longfit's kernels, as loading routes them
    names = {name: key for key, (name, converter) in source_names(model, made.state).items() if converter is None}
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(names))
    if missing:
        raise PartRefused(f"the language model's {missing[0]} has no tensor of the wrapper under transformers' "
                          "loading names")
    model.load_state_dict({name: made.state[key] for name, key in names.items()}, strict=False)
    encoder = encoder_type(family)
    with torch.device("meta"):
        meta = _wrapper(replace(made, state={}, adapters={}), "eager")
    vision = encoder.vision_module(config)
    prefix = f"{family.tower}." if family.tower else ""
    vision.load_state_dict({name: made.state[prefix + name] for name in vision.state_dict()}, strict=True)
    made_encoder = encoder(config, vision, family, getattr(meta.base_model, "get_rope_index", None))
    if setup.disable_dropout:
        disable_dropout_modules(model)
        disable_dropout_modules(vision)
    if made.lora is None:
        trainable_parts(made_encoder, made.vision)
        return model, made_encoder, names, prefix
    model, names = with_adapters(model, made_encoder, made, setup, names, prefix)
    if setup.disable_dropout:
        disable_dropout_modules(model)
        disable_dropout_modules(vision)
    return model, made_encoder, names, PEFT_PREFIX + prefix


def with_adapters(model, encoder, made: ImageCopy, setup, names: dict[str, str], prefix: str):
    """(`model` with peft's adapters on the text check's targets, the adapters' names -> the peft-wrapped wrapper's),
    the vision module's adapters added on what `train.vision` trains (`trainable_parts`), every adapter holding
    `draw_adapters`' values."""
    from longfit.config import LoraSection
    from longfit.models.build import peft_quietly
    from longfit.models.media import trainable_parts

    rank, alpha = made.lora
    with peft_quietly(unquantized=True):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False,
                                                 target_modules=setup.lora_targets))
    trainable_parts(encoder, made.vision, LoraSection(enabled=True, r=rank, alpha=alpha))
    modules = {name.rsplit(".", 1)[0]: key.rsplit(".", 1)[0] for name, key in names.items()}
    params = dict(model.named_parameters())
    wrapper_names = {}  # longfit's adapters -> their names in the peft-wrapped wrapper
    for name, param in params.items():
        if param.requires_grad:
            module, adapter = name.removeprefix(PEFT_PREFIX).split(".lora_", 1)
            wrapper_names[name] = f"{PEFT_PREFIX}{modules[module]}.lora_{adapter}"
    adapters = {wrapper: params[name] for name, wrapper in wrapper_names.items()}
    adapters |= {PEFT_PREFIX + prefix + n: p for n, p in encoder.vision.named_parameters() if p.requires_grad}
    values = draw_adapters({name: param.shape for name, param in adapters.items()}, setup.seed)
    with torch.no_grad():
        for name, param in adapters.items():
            param.copy_(values[name])
    return model, wrapper_names


def lora_copy(made: ImageCopy, setup, lora) -> ImageCopy:
    """`made` with the run's LoRA (`lora`: its LoraSection) and the adapters longfit's side carries (`with_adapters`)
    and its vision module's names, for the wrapper's reference; `made` itself without LoRA."""
    from longfit.models.media import vision_adapter_parameters

    if not setup.lora_targets:
        return made
    made = replace(made, lora=(lora.r, lora.alpha))
    model, encoder, names, prefix = longfit_side(made, setup)
    adapters = {names[n]: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    adapters |= {prefix + n: p.detach().clone() for n, p in encoder.vision.named_parameters() if p.requires_grad}
    vision_names = tuple(prefix + n for n, _ in encoder.vision.named_parameters())
    return replace(made, adapters=adapters, vision_names=vision_names,
                   adapted_weights=tuple(vision_adapter_parameters(encoder)))


def _wrapper_names(grads: dict, names: dict[str, str], prefix: str) -> dict:
    """longfit's gradients under the wrapper's names: the language model's by `names`, the vision module's
    (`VISION_GRADS`) after the family's tower path."""
    return {(prefix + n[len(VISION_GRADS):] if n.startswith(VISION_GRADS) else names.get(n, n)): g
            for n, g in grads.items()}


def step_config(setup, made: ImageCopy, cp: int = 1, tp: int = 1) -> Config:
    """The check's run config for the image row (its width as seq_len) on `cp` x `tp` ranks."""
    cfg = setup.check_config(cp)
    return replace(cfg, seq_len=int(made.batch.input_ids.shape[1]), parallel=replace(cfg.parallel, tp=tp))


def image_step(made: ImageCopy, setup, techniques: bool, autocast: bool = False,
               record: dict | None = None) -> Step:
    """One process: longfit's step on the image row (the trainer's CausalLMLoss with the media encoder, positions of
    the whole rows), the run's memory techniques when `techniques`, bf16 autocast when `autocast`; `record`: the
    images' embeddings and the language model's input embeddings and positions."""
    from longfit.memory.apply import apply_memory_techniques, offloaders, release_offload_stores
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum, positioned
    from longfit.parallel.tiled_attention import LocalTileAttention

    model, encoder, names, prefix = longfit_side(made, setup)
    if autocast and made.lora:  # the trainer's LoRA storage: the language model's frozen base in bf16
        from longfit.models.build import use_lora_storage

        use_lora_storage(model, BF16)
    cfg = step_config(setup, made)
    if techniques:  # the tower's blocks checkpointed too, as the trainer's parallelize applies them
        apply_memory_techniques(model, cfg, "cpu", tile_attention=LocalTileAttention.for_sequence,
                                media_encoder=encoder)
        for offloader in [*offloaders(model), *offloaders(encoder)]:
            offloader.min_offload_bytes = 1024  # the copy's layer inputs are below the 1 MiB default
    loss_module = CausalLMLoss(model, chunked_loss=techniques and cfg.memory.chunked_loss,
                               loss_chunk=cfg.memory.loss_chunk, media_encoder=encoder)
    batch = positioned(loss_module, made.batch)
    audio = getattr(encoder.vision, AUDIO_MODULES[1], None)  # Gemma 4's audio embedder, where the copy has one
    handles = [] if record is None else _recording(encoder.projector, model.get_decoder(), record, audio)
    try:
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = batch_loss_sum(loss_module, batch) / batch.num_label_tokens
    finally:
        for handle in handles:
            handle.remove()
    loss.backward()
    offloaded = sum(o.stats.offloaded_bytes for o in [*offloaders(model), *offloaders(encoder)])
    release_offload_stores(model)
    release_offload_stores(encoder)
    grads = _grads(model) | {VISION_GRADS + n: g for n, g in _grads(encoder.vision).items()}
    return Step(loss.detach().float(), _wrapper_names(grads, names, prefix), offloaded_bytes=offloaded)


def _recording(projector: torch.nn.Module, decoder: torch.nn.Module, into: dict,
               audio_embedder: torch.nn.Module | None = None) -> list:
    """Hooks appending each call's projector output (the images' embeddings), the audio embedder's (the audios'
    embeddings, where the copy has an audio tower) and the language model's input embeddings and positions to
    `into`."""
    for name in ("features", "audio_features", "embeddings", "positions"):
        into.setdefault(name, [])

    def recorder(name: str):
        def hook(module, args, output):
            out = output if isinstance(output, torch.Tensor) else output[0]
            into[name].append(out.detach().double().reshape(-1, out.shape[-1]))

        return hook

    def decoded(module, args, kwargs):
        for key, name in (("inputs_embeds", "embeddings"), ("position_ids", "positions")):
            given = kwargs.get(key)  # None: the model makes its own (a text conversation's positions)
            into[name].append(given.detach().double() if isinstance(given, torch.Tensor) else None)

    audio = [] if audio_embedder is None else [audio_embedder.register_forward_hook(recorder("audio_features"))]
    return [projector.register_forward_hook(recorder("features")),
            decoder.register_forward_pre_hook(decoded, with_kwargs=True), *audio]


AUDIO_MODULES = ("audio_tower", "embed_audio")
"""Gemma 4's audio tower and its embedder, beside its vision tower in the wrapper and in the vision module."""


def _audio_modules(model: torch.nn.Module, encoder) -> list[torch.nn.Module]:
    """The audio tower and embedder (`AUDIO_MODULES`) of the wrapper `model` (peft's, with LoRA) where its copy has
    them; none otherwise."""
    from longfit.models.structure import unwrap_peft

    wrapper = unwrap_peft(model)
    tower = wrapper.get_submodule(encoder.family.tower) if encoder.family.tower else wrapper
    modules = [getattr(tower, name, None) for name in AUDIO_MODULES]
    return modules if all(isinstance(m, torch.nn.Module) for m in modules) else []


def _float64(model: torch.nn.Module, encoder) -> torch.nn.Module:
    """The exact reference of `compare_fp32`: the wrapper in float64, its audio tower and embedder in float32 as
    longfit's (transformers' audio attention computes in float32 whatever its weights' dtype, so the audios'
    embeddings are the same fp32 values on both sides and the float64 run is exact from them on)."""
    model = model.double()
    for module in _audio_modules(model, encoder):
        module.float()
    return model


def wrapper_step(model: torch.nn.Module, encoder, batch, autocast: bool = False, record: dict | None = None) -> Step:
    """The wrapper `model`'s own forward on each conversation of `batch`'s rows alone with its own images (the
    semantics of packing): the cross-entropy of its logits summed over the rows' targets, every gradient under the
    wrapper's names. `encoder`: the family's MediaEncoder, whose `wrapper_inputs` are what the wrapper takes of a
    conversation's images; `autocast`: under bf16 autocast; `record`: as `image_step`'s, a conversation at a time."""
    from longfit.models.structure import unwrap_peft

    dtype = model.get_input_embeddings().weight.dtype
    media, loss, first = batch.media, torch.zeros((), dtype=torch.float64), 0
    starts = [0, *np.cumsum(encoder.pixel_rows(media.grid_thw)).tolist()]
    wrapper = unwrap_peft(model)  # peft's adapters, with LoRA: its modules under the wrapper's own paths
    audio = _audio_modules(wrapper, encoder)
    audio_dtype = next(audio[0].parameters()).dtype if audio else dtype
    handles = [] if record is None else _recording(wrapper.get_submodule(_projector_path(encoder)),
                                                   wrapper.get_decoder(), record, audio[-1] if audio else None)
    try:
        for row, spans in enumerate(batch.documents.rows):
            for start, end in spans:
                count = media.items_in(row, start, end)
                inputs = dict(input_ids=batch.input_ids[row : row + 1, start:end], use_cache=False)
                if count:
                    items = _conversation_media(encoder, media, starts, range(first, first + count), row, start, end)
                    inputs |= {k: v.to(audio_dtype if k == "input_features" else dtype) if v.is_floating_point()
                               else v for k, v in items.items()}
                    first += count
                with torch.autocast("cpu", dtype=BF16, enabled=autocast):
                    logits = model(**inputs).logits
                part = F.cross_entropy(_at_least_fp32(logits[0]), batch.labels[row, start:end], reduction="sum")
                (part / batch.num_label_tokens).backward()
                loss += part.detach().double() / batch.num_label_tokens
    finally:
        for handle in handles:
            handle.remove()
    return Step(loss.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})


def _conversation_media(encoder, media, starts: list[int], items: range, row: int, start: int, end: int) -> dict:
    """What the wrapper's forward takes of one conversation's `items` (in `media`, their pixels' rows from `starts`),
    by the family's rules: its images (`wrapper_inputs`), its video's temporal patches or frames
    (`wrapper_video_inputs`: the check's conversations hold one video at most) and its audio's features
    (`wrapper_audio_inputs`: one audio at most)."""
    from longfit.data.media import AUDIO, VIDEO

    types = media.token_types[row : row + 1, start:end]
    kinds = {i: int(media.token_types[media.item_starts[i]]) for i in items}
    videos, audios = ([i for i in items if kinds[i] == kind] for kind in (VIDEO, AUDIO))
    images = [i for i in items if i not in videos + audios]

    def pixels(chosen: list[int]) -> torch.Tensor:
        return torch.cat([media.pixel_values[starts[i] : starts[i + 1]] for i in chosen])

    inputs = encoder.wrapper_inputs(pixels(images), media.grid_thw[images], types) if images else {}
    if videos:
        inputs |= encoder.wrapper_video_inputs(pixels(videos), media.grid_thw[videos], types)
    if audios:
        inputs |= encoder.wrapper_audio_inputs(pixels(audios), media.grid_thw[audios], types)
    return inputs


def every_expert_chosen(made: ImageCopy) -> ImageCopy:
    """`made` with every expert of its language model chosen for every token (`longfit.check.shrink.every_expert`, as
    the text check compares a mixture of experts under bf16); `made` itself where it has none choosing fewer."""
    from longfit.check.shrink import every_expert

    config = made.config()
    text = config.get_text_config()
    routed = every_expert(text)
    if routed is None:
        return made
    text_key = next(name for name in config.sub_configs if getattr(config, name) is text)
    return replace(made, config_values={**made.config_values, text_key: routed})


def _autocast_reference(made: ImageCopy, attn: str, setup) -> torch.nn.Module:
    """The wrapper run under bf16 autocast: with LoRA its language model's frozen base in bf16 (`_lora_storage`)."""
    model = _wrapper(made, attn, setup.disable_dropout)
    return _lora_storage(model, made.vision_names) if made.adapters else model


def reference_attentions(made: ImageCopy) -> list[str]:
    """The wrapper's attention implementations whose rounding sets the bounds: eager, and SDPA where it has it."""
    with torch.device("meta"):
        model = _wrapper(replace(made, state={}, adapters={}), "eager")
    return ["eager", "sdpa"] if getattr(model, "_supports_sdpa", False) else ["eager"]


def _projector_path(encoder) -> str:
    family = encoder.family
    return f"{family.tower}.{family.projector}" if family.tower else family.projector


def _laid(pieces: list[torch.Tensor], docs: list[tuple[int, int, int]], shape: tuple[int, int]) -> torch.Tensor | None:
    """The conversations' tensors (..., 1, S, ...) laid into the rows (..., B, L, ...) along their token dimension
    (the one of each conversation's length), zero elsewhere; None when they do not line up."""
    B, L = shape
    lengths = [end - start for _, start, end in docs]
    if len(pieces) != len(docs) or not pieces:
        return None
    dims = [d for d in range(pieces[0].dim()) if all(p.dim() == pieces[0].dim() and p.shape[d] == n
                                                     for p, n in zip(pieces, lengths))]
    if not dims or dims[0] == 0 or pieces[0].shape[dims[0] - 1] != 1:
        return None
    token = dims[0]
    shape_out = list(pieces[0].shape)
    shape_out[token - 1 : token + 1] = [B, L]
    out = pieces[0].new_zeros(shape_out)
    for piece, (row, start, end) in zip(pieces, docs):
        index = [slice(None)] * piece.dim()
        index[token - 1], index[token] = row, slice(start, end)
        out[tuple(index)] = piece.select(token - 1, 0)
    return out


def locate_image_part(got: dict, truth: dict, batch, what: str) -> str | None:
    """The first part of the image path whose values differ between longfit's recorded step `got` and the wrapper's
    `truth` (module docstring), or None where they agree."""
    docs = [(row, start, end) for row, spans in enumerate(batch.documents.rows) for start, end in spans]
    shape = tuple(batch.input_ids.shape)
    features = torch.cat(truth["features"]) if truth["features"] else None
    if features is not None and got["features"]:
        ours = torch.cat(got["features"])
        if ours.shape == features.shape and not _close(ours, features):
            error = float((ours - features).abs().max())
            return (f"the images' embeddings (the vision tower and projector, `MediaEncoder.features`) differ by "
                    f"{error:.1e} {what}")
    audio = [torch.cat(side.get("audio_features") or [torch.zeros(0)]) for side in (got, truth)]
    if audio[1].numel() and audio[0].shape == audio[1].shape and not _close(*audio):
        error = float((audio[0] - audio[1]).abs().max())
        return (f"the audios' embeddings (the audio tower and its embedder, `MediaEncoder.features`) differ by "
                f"{error:.1e} {what}")
    for name, part in (("embeddings", "the rows' input embeddings with the images' embeddings scattered into their "
                                      "placeholders (`MediaEncoder.input_embeddings`)"),
                       ("positions", "the positions of the image rows (`MediaEncoder.rope_positions`)")):
        if len(truth[name]) != len(docs):
            continue
        given = [(piece, doc) for piece, doc in zip(truth[name], docs) if piece is not None]  # a text conversation's
        want = _laid([piece for piece, _ in given], [doc for _, doc in given], shape)  # positions may be the model's
        ours = got[name][0] if got[name] else None
        if want is not None and ours is not None and ours.dim() == want.dim() and ours.shape[0] == want.shape[0] + 1:
            ours = ours[1:]  # longfit's positions (4, B, L): the text positions, then the wrapper's M-RoPE (3, B, L)
        if want is None or ours is None or ours.shape != want.shape:
            continue
        inside = torch.zeros(shape, dtype=torch.bool)
        for _, (row, start, end) in given:
            inside[row, start:end] = True
        mask = inside.view(*inside.shape, *([1] * (want.dim() - 2))) if want.shape[:2] == shape \
            else inside.view(*([1] * (want.dim() - 2)), *shape)
        mask = mask.expand_as(want)
        if not _close(ours[mask], want[mask]):
            error = float((ours[mask] - want[mask]).abs().max())
            return f"{part} differ by {error:.1e}{_worst_tokens(ours, want, mask, batch)} {what}"
    return None


def _worst_tokens(ours: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, batch) -> str:
    """Where rows with videos or audios are checked: which tokens (text, an image's, a video's, an audio's) differ
    most, from the error of `ours` against `want` (their (B, L) token dimensions first or last, `mask` the
    conversations' tokens)."""
    from longfit.data.media import AUDIO, IMAGE, TEXT, VIDEO

    types = batch.media.token_types
    if not bool(((types == VIDEO) | (types == AUDIO)).any()):
        return ""
    error = ((ours - want).abs() * mask).flatten(0, -3) if want.shape[-2:] == types.shape \
        else ((ours - want).abs() * mask).flatten(2)  # (..., B, L) or (B, L, ...)
    error = error.amax(0) if want.shape[-2:] == types.shape else error.amax(-1)  # (B, L)
    worst = int(error.flatten().argmax())
    kind = {TEXT: "text", IMAGE: "an image's", VIDEO: "a video's", AUDIO: "an audio's"}[int(types.flatten()[worst])]
    return f" (most at {kind} tokens)"


def check_images(cfg: Config, setup, text_copy, report) -> None:
    """The image steps of `check_run` for `cfg`'s image rows (module docstring), appended to `report`; the first
    that differs, or a family whose image path cannot be checked, ends it with the refusal."""
    from longfit.data.media import AUDIO, IMAGE, VIDEO

    folder = Path(tempfile.mkdtemp(prefix="longfit-check-images-"))
    try:
        made = lora_copy(image_copy(cfg, text_copy, setup, folder), setup, cfg.lora)
        reference = _wrapper(made, "eager", setup.disable_dropout)
        _, encoder, _, _ = longfit_side(made, setup)
    except PartRefused as error:
        report.refused, report.refusal = True, f"its image rows cannot be checked: {error}"
        return
    except ConfigError:  # the run's config is wrong for its image rows: not a verdict
        raise
    except Exception as error:  # noqa: BLE001 -- the family's copy cannot be built: its image path is not proven
        report.refused, report.refusal = True, (f"its image rows cannot be checked: the {cfg.model} wrapper's "
                                                f"shrunken copy cannot be built ({type(error).__name__}: "
                                                f"{_first_line(error)})")
        return
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    batch = made.batch
    images = ", ".join("x".join(map(str, size)) for size in IMAGE_SIZES)
    parameters = sum(p.numel() for p in reference.parameters())
    video_tokens = int((batch.media.token_types == VIDEO).sum())
    video = (f" and one of a video ({VIDEO_FRAMES[0]} frames {VIDEO_FRAMES[1]}x{VIDEO_FRAMES[2]}, "
             f"{video_tokens} video tokens by its video processor)") if video_tokens else ""
    audio_tokens = int((batch.media.token_types == AUDIO).sum())
    video += (f" and one of an audio ({AUDIO_SECONDS} s, {audio_tokens} audio tokens by its feature extractor, "
              "the audio tower shrunk as the vision tower)") if audio_tokens else ""
    report.notes.append(f"image rows (train.vision={made.vision}): the {made.config_values['model_type']} wrapper's "
                        f"copy, its tower {VISION_DEPTH} blocks of {VISION_WIDTHS['hidden_size']} "
                        f"({parameters / 1e6:.2f}M parameters in all); two conversations of one image each (made "
                        f"{images}, {int((batch.media.token_types == IMAGE).sum())} image tokens by the checkpoint's "
                        f"image processor){video} packed in a row of {batch.input_ids.shape[1]} tokens; against the "
                        "wrapper's eager forward, each conversation alone")
    if setup.lora_targets:
        vision_names = set(made.vision_names)
        layers = ({n.split(".lora_", 1)[0] for n in made.adapters if n in vision_names}
                  - {PEFT_PREFIX + weight.rsplit(".", 1)[0] for weight in made.adapted_weights})
        report.notes.append(f"image rows with LoRA: adapters on the language model's {', '.join(setup.lora_targets)}"
                            + (f" and the {made.vision} linear layers of the vision side" if layers else "")
                            + "".join(f" and the vision side's {weight} (peft's target_parameters)"
                                    for weight in made.adapted_weights)
                            + ", against peft on the wrapper")
    try:
        truth_record: dict = {}
        truth = wrapper_step(reference, encoder, batch, record=truth_record)
    except Exception as error:  # noqa: BLE001 -- the wrapper's own forward does not run on the copy
        report.refused, report.refusal = True, ("its image rows cannot be checked: the wrapper's eager forward of the "
                                                f"shrunken copy fails ({type(error).__name__}: {_first_line(error)})")
        return
    try:
        _image_steps(cfg, setup, made, encoder, truth, truth_record, report)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 -- longfit's step on image rows fails: that is the answer
        report.refusal = f"longfit's step on the image rows fails: {type(error).__name__}: {_first_line(error)}"


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _trained(truth: Step, got: Step) -> Step:
    """`truth` with the gradients of what longfit trains only."""
    return Step(truth.loss, {n: g for n, g in truth.grads.items() if n in got.grads})


def _image_steps(cfg: Config, setup, made: ImageCopy, encoder, truth: Step, truth_record: dict,
                 report) -> None:
    batch = made.batch
    attentions = reference_attentions(made)
    rounding: list[Step] = []

    def fp32(name: str, got: Step) -> Comparison:
        """`compare_fp32`, with the wrapper's float64 and SDPA runs where a tensor is beyond the fixed bound."""
        want = _trained(truth, got)
        comparison = compare_fp32(name, got, want)
        if comparison.ok:
            return comparison
        if not rounding:  # the float64 run, then the wrapper's other fp32 runs (SDPA where it has it)
            rounding.append(wrapper_step(_float64(_wrapper(made, "eager", setup.disable_dropout), encoder), encoder,
                                         batch))
            rounding.extend(wrapper_step(_wrapper(made, attn, setup.disable_dropout), encoder, batch)
                            for attn in attentions[1:])
        exact, *others = (_trained(step, got) for step in rounding)
        return compare_fp32(name, got, want, exact, others)

    def compared(comparison: Comparison, got: Step, what: str, record: dict | None = None) -> bool:
        comparison.offloaded_bytes = got.offloaded_bytes
        report.comparisons.append(comparison)
        missing = _missing(got, _trained(truth, got))
        if missing:
            report.refusal = f"{missing} {what}"
        elif not comparison.ok:
            part = locate_image_part(record, truth_record, batch, what) if record is not None else None
            tensor, excess = comparison.worst
            report.refusal = part or (
                f"the language model over the image rows differs {what} (its attention over the images: "
                f"`MediaEncoder.attention_layout`): {tensor}, {excess:.1f}x its bound; the images' embeddings, their "
                "placement and positions agree" if record is not None
                else f"{tensor} differs on the image rows {what}, {excess:.1f}x its bound")
        return report.refusal is None

    what = "(image rows, one process, fp32, packed)"
    record: dict = {}
    got = image_step(made, setup, techniques=False, record=record)
    if not compared(fp32("image rows, one process, fp32, packed", got), got, what, record):
        return
    if setup.memory_techniques:
        what = "(image rows, one process, fp32, packed, with the run's memory techniques)"
        got = image_step(made, setup, techniques=True)
        if not compared(fp32("image rows, fp32, techniques, packed", got), got, what):
            return
    bf16_made, bf16_truth = made, truth
    if setup.dtype == BF16:
        bf16_made = every_expert_chosen(made)  # the text check's rule: no top-k flip between experts bf16 ties
        if bf16_made is not made:
            bf16_truth = wrapper_step(_wrapper(bf16_made, "eager", setup.disable_dropout), encoder, batch)
        what = "(image rows, one process, bf16 autocast, techniques, packed)"
        references = [wrapper_step(_autocast_reference(bf16_made, attn, setup), encoder, batch, autocast=True)
                      for attn in attentions]
        got = image_step(bf16_made, setup, techniques=True, autocast=True)
        comparison = compare_bf16("image rows, bf16 autocast, techniques, packed", got,
                                  [_trained(r, got) for r in references], _trained(bf16_truth, got), AUTOCAST_CEILING)
        if not compared(comparison, got, what):
            return
    cp, tp = (CHECK_CP if cfg.parallel.cp > 1 else 1), (CHECK_TP if cfg.parallel.tp > 1 else 1)
    if cp * tp > 1:  # the run's context and tensor parallelism on cp x tp gloo ranks
        from longfit.check.ranks import run_on_ranks

        ranks = " x ".join([cfg.parallel.cp_method] * (cp > 1) + [f"tp={tp}"] * (tp > 1))
        what = f"(image rows, {cp * tp} ranks, {ranks}, {'bf16' if setup.dtype == BF16 else 'fp32'}, packed)"
        results = run_on_ranks(image_cp_worker, cp * tp, bf16_made, setup, cp, tp)
        if setup.dtype == BF16:
            references = [wrapper_step(_in_bf16(_wrapper(bf16_made, attn, setup.disable_dropout)), encoder, batch)
                          for attn in attentions]
        for rank, got in enumerate(results):
            name = f"image rows, rank {rank} of {cp * tp}, {ranks}, techniques, packed"
            comparison = (compare_bf16(name, got, [_trained(r, got) for r in references], _trained(bf16_truth, got),
                                       FSDP_CEILING) if setup.dtype == BF16 else fp32(name, got))
            if not compared(comparison, got, what):
                return


def image_cp_worker(rank: int, world_size: int, made: ImageCopy, setup, cp: int, tp: int = 1) -> Step:
    """One rank of the context- and tensor-parallel step on the image row (`parity.cp_step` with the media
    encoder)."""
    model, encoder, names, prefix = longfit_side(made, setup)
    if setup.dtype == BF16 and made.lora:  # the trainer's LoRA storage, as `image_step`'s
        from longfit.models.build import use_lora_storage

        use_lora_storage(model, BF16)
    got = cp_step(world_size, model, step_config(setup, made, cp=cp, tp=tp), made.batch, setup.dtype,
                  media_encoder=encoder)
    return Step(got.loss, _wrapper_names(got.grads, names, prefix), offloaded_bytes=got.offloaded_bytes)

