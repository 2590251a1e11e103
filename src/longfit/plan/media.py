"""The vision side of an image-text checkpoint in `longfit plan` (#54): its weights, the activations of a step's images
and their embeddings, per rank.

Where a step's images come from (`step_images`): the data, when `data.path` holds chats with image parts and the
checkpoint's images train (`longfit.models.media.image_reader`): the conversation with the most image tokens, each
of its images planned at the size of the data's largest image (read from the headers, as the reader counts an
epoch: nothing decoded), in every row of the micro-batch. That is the heaviest step the data can make of one
conversation a row, as ms-swift's and LLaMA-Factory's users size a multimodal run by its longest sample. Without
data (or to plan other images), `data.plan_images=N data.plan_image_size=HxW` plans N images of that size a row. Video
parts are not counted (named in the plan's notes).

What a rank holds (`TowerCosts`), as `longfit.models.media` and `longfit.parallel.media` run it:
- the vision module's weights (fp32 master weights, sharded with the objective's root parameters by FSDP2 and
  gathered with them for the whole step), the gradients and optimizer state of what `train.vision` trains;
- the tower's activations of this rank's images: the images are dealt over the cp ranks by their work
  (`longfit.parallel.media.deal`; fewer images than ranks: every rank runs all of them). A frozen tower keeps
  nothing for the backward, only its working set while it runs; a trained projector keeps its inputs; a trained
  tower every block's saved tensors, until the tower's backward at the very end of the step;
- the embeddings (N, H) of every image of the batch (gathered over the cp ranks) and the input embeddings they are
  scattered into, at the start of the language model's forward.
The activations are traced, not derived: the family's own vision module at the checkpoint's widths with one and two
blocks, on one and two of the planned images made by the checkpoint's own image processor, in the run's dtype
(`_traced`: real tensors on the CPU, `LiveBytes`), then extended bilinearly to the tower's depth and the rank's
images: a block's tensors of an image are the same at any depth and beside any other image (the tower's attention
never crosses two images), and what belongs to a block alone (its weights cast under autocast) or to the tower alone
is told apart by the four traces.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path

from longfit.config import Config, ConfigError, plan_image_size


TRACED = ((1, 1), (1, 2), (2, 1), (2, 2))
"""(blocks, images) of the tower's traces (`_trace_table`)."""


@dataclass(frozen=True)
class StepImages:
    """The images of one row of a step, as planned: `count` images of `size` (height, width) pixels each."""

    count: int
    size: tuple[int, int]
    source: str
    """Where they come from, for the plan's notes."""
    path: str | None = None
    """The image the tower is traced on (the data's largest); None: noise of `size` made for the trace."""
    videos: int = 0
    """Video parts in the data, not counted."""


def step_images(cfg: Config) -> StepImages | None:
    """The images a row of `cfg`'s run holds (module docstring): read from `data.path`, else `data.plan_images` of
    `data.plan_image_size`; None for text rows, or a checkpoint whose images do not train."""
    from longfit.models.source import local_model_dir

    local = local_model_dir(cfg.model) is not None  # a preset or hub name holds no image processor: torch not imported
    from_data = _data_images(cfg.model, cfg.data.path, cfg.data.text_field, cfg.seq_len) if cfg.data.path and local \
        else None
    if from_data is not None or not cfg.data.plan_images:
        return from_data
    from longfit.models.media import media_reader

    unavailable = media_reader(cfg.model).unavailable  # a checkpoint whose images do not train: its one line
    if unavailable is not None:  # its image processor cannot run here: an image's tokens (Llama 4's tiles) unknown
        raise ConfigError(f"data.plan_images={cfg.data.plan_images}: the plan cannot count these images here: "
                          f"{unavailable} (data.plan_images=0 plans its text rows)")
    return StepImages(cfg.data.plan_images, plan_image_size(cfg.data),
                      f"data.plan_images={cfg.data.plan_images} of {cfg.data.plan_image_size}")


@functools.lru_cache(maxsize=8)
def _data_images(model: str, path: str, text_field: str, seq_len: int) -> StepImages | None:
    from longfit.config import load_config
    from longfit.data.media import check_media_rows, image_size, media_paths
    from longfit.data.sources import open_source
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import image_reader

    reader = image_reader(model)
    if reader is None:
        return None
    cfg = load_config(None, [f"model={model}", f"data.path={path}", f"data.text_field={text_field}",
                             f"seq_len={seq_len}"])
    source = open_source(cfg, load_tokenizer(model), reader)
    if not hasattr(source, "media_rows"):
        return None
    rows = list(source.media_rows())
    check_media_rows(rows, reader, seq_len)  # a missing or unreadable image: its one line, as the trainer's
    most, largest, videos = 0, None, 0
    for _, folder, messages in rows:
        parts = media_paths(messages, folder)
        images = [p for kind, p in parts if kind == "image"]
        videos += len(parts) - len(images)
        most = max(most, len(images))
        for image in images:
            size = image_size(image)
            if largest is None or size[0] * size[1] > largest[0][0] * largest[0][1]:
                largest = (size, image)
    if largest is None:
        return None
    return StepImages(most, largest[0], f"data.path: its chat with the most images ({most}), each at its largest "
                      f"image's size ({largest[0][0]}x{largest[0][1]})", str(largest[1]), videos)


@dataclass(frozen=True)
class TowerCosts:
    """A rank's bytes of the vision side (module docstring)."""

    params: int
    """The vision module's parameters (tower and projector)."""
    trained: int
    """Those `train.vision` trains."""
    images: int
    """This rank's images (the busiest rank's)."""
    batch_images: int
    """Every image of the micro-batch (their embeddings are gathered on every rank)."""
    embeddings: int
    """Image tokens of the micro-batch (rows of the gathered embeddings)."""
    kept: float
    """Bytes the tower keeps from its forward to its backward (its output's included while it is live)."""
    forward: float
    """The tower's forward peak over what was live before it (its kept bytes included)."""
    backward: float
    """Its backward peak over what was live before it (the incoming gradient, the parameters' gradients not)."""
    pixels: float
    """Bytes of the micro-batch's pixels (on every rank)."""
    positions: bool
    """Whether the rows carry the family's (4, B, L) position ids (Qwen3.5's M-RoPE)."""
    output: float
    """Bytes of this rank's images' embeddings as the tower returns them (freed once scattered)."""


def tower_costs(s) -> TowerCosts | None:
    """The vision side's bytes on a rank of the planned run `s` (`Setup.images`); None without images."""
    images = s.images
    if images is None or not images.count:
        return None
    from longfit.parallel.media import deal

    vision = s.config.train.vision
    # The tower runs in bf16 where FSDP2 gathers it in bf16; one rank's fp32 tower runs under autocast or in fp32
    # (LoRA's bf16 base on one rank leaves the vision side in fp32).
    dtype = "bf16" if s.regime == "bf16" and s.fsdp else "autocast" if s.regime == "autocast" else "fp32"
    traced = _trace_table(s.config.model, dtype, vision, images.size, images.path)
    count = images.count
    if traced["tokens"] * count > s.seq_len:
        if images.path is None:
            raise ConfigError(f"{images.source}: {count} images of {traced['tokens']} tokens each are more than a "
                              f"row of seq_len={s.seq_len} holds; raise seq_len or plan fewer (data.plan_images)")
        count = s.seq_len // traced["tokens"]  # the data's images at their largest size: as many as a row holds
    batch = count * s.micro_batch
    ranks = s.cp
    own = batch if batch < ranks else max(len(d) for d in deal([1] * batch, ranks))

    def at(quantity: str) -> float:
        """Bilinear in the blocks and the rank's images: a block's tensors of an image, a block's own (its weights
        cast under autocast), an image's outside the blocks (the projector's), and the rest."""
        one, two, deep, both = (traced[key][quantity] for key in TRACED)
        per_block_image = both - two - deep + one
        blocks, extra = traced["depth"] - 1, own - 1
        return one + extra * (two - one) + blocks * (deep - one) + blocks * extra * per_block_image

    return TowerCosts(params=traced["params"], trained=traced["trained"], images=own, batch_images=batch,
                      embeddings=traced["tokens"] * batch, kept=at("kept"), forward=at("forward"),
                      backward=at("backward"), pixels=traced["pixel_bytes"] * batch,
                      positions=traced["positions"], output=traced["output"] * own)


def tower_notes(s) -> list[str]:
    """The plan's lines on the vision side of `s` (none for text rows)."""
    towers = tower_costs(s)
    if towers is None:
        return []
    MiB = 1 << 20
    lines = [f"vision side counted for {towers.batch_images // s.micro_batch} images a row ({s.images.source}): "
             f"{towers.params / 1e6:.1f}M parameters ({towers.trained / 1e6:.1f}M train, train.vision="
             f"{s.config.train.vision}), {towers.images} images on the busiest rank keeping {towers.kept / MiB:.1f} "
             f"MiB to their backward, {towers.embeddings} image tokens a micro-batch"]
    if s.images.videos:
        lines.append(f"the data's {s.images.videos} video parts are not counted (#54)")
    return lines


@functools.lru_cache(maxsize=16)
def _trace_table(model: str, regime: str, vision: str, size: tuple[int, int], path: str | None) -> dict:
    """The traced tower (`_traced`) at 1 and 2 blocks and 1 and 2 images, with its full depth and parameters."""
    import torch

    from longfit.models.media import MediaEncoder, encoder_type, media_family
    from longfit.models.model_config import read_config

    config = read_config(model).config
    depth = config.vision_config.num_hidden_layers
    image = _image(size, path)
    table = {key: _traced(model, config, regime, vision, image, *key) for key in TRACED}
    with torch.device("meta"):
        whole = _vision(config, depth, vision, torch.float32)
    table |= {"depth": depth, "params": sum(p.numel() for p in whole.vision.parameters()),
              "trained": sum(p.numel() for p in whole.vision.parameters() if p.requires_grad),
              "tokens": table[(1, 1)]["tokens"], "pixel_bytes": table[(1, 1)]["pixel_bytes"],
              "output": table[(1, 1)]["output"],
              # the base class's positions are the M-RoPE ones; the families with text positions override them
              "positions": encoder_type(media_family(config)).rope_positions is MediaEncoder.rope_positions}
    return table


def _image(size: tuple[int, int], path: str | None):
    """The planned image: the data's file, or seeded noise of `size`."""
    import numpy as np
    from PIL import Image

    from longfit.data.media import open_image

    if path is not None:
        return open_image(Path(path))
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8))


def _vision(config, depth: int, vision: str, dtype):
    """The family's vision side of the wrapper `config` with `depth` blocks, `vision` of it trainable, in `dtype`."""
    from longfit.models.media import encoder_type, media_family, trainable_parts

    import torch

    config = copy.deepcopy(config)
    config.vision_config.num_hidden_layers = depth
    family = media_family(config)
    encoder = encoder_type(family)
    from transformers.initialization import no_init_weights

    with no_init_weights():  # the weights' values do not change what is allocated (buffers are made as ever)
        module = encoder.vision_module(config).to(dtype)
    made = encoder(config, module, family, None)
    trainable_parts(made, vision)
    return made


def _traced(model: str, config, regime: str, vision: str, image, blocks: int, images: int) -> dict:
    """Live bytes of the tower of `blocks` blocks on `images` copies of `image` (real tensors, the run's dtype)."""
    import contextlib

    import torch

    from longfit.models.media import media_reader
    from longfit.plan.tracker import LiveBytes

    reader = media_reader(model)
    spec = reader.spec
    processed = reader.image_processor(images=[image], return_tensors="pt", **dict(spec.processor_kwargs))
    grid = spec.grids(processed)  # (1, 3)
    pixels = processed["pixel_values"][: spec.pixel_rows(grid[0])]
    if spec.row_break is not None:  # without the padding, as the reader keeps it
        pixels = pixels[..., : grid[0, 1] * spec.patch_size, : grid[0, 2] * spec.patch_size]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if regime == "bf16" else torch.float32
    encoder = _vision(config, blocks, vision, dtype)
    trains = any(p.requires_grad for p in encoder.parameters())
    pixel_values, grid_thw = torch.cat([pixels] * images), grid.repeat(images, 1)
    tracker = LiveBytes()
    with tracker:
        tracker.adopt(encoder.parameters(), "weights")
        tracker.adopt(encoder.buffers(), "weights")
        tracker.adopt([pixel_values, grid_thw], "batch")
        base = tracker.live
        tracker.reset_peak()
        grad = contextlib.nullcontext() if trains else torch.no_grad()
        with grad, torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
            out = encoder.features(pixel_values, grid_thw)  # (N, H)
        kept, forward = tracker.live - base, tracker.peak - base
        backward = 0
        if trains:
            incoming = torch.ones_like(out)
            before = tracker.live
            hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.retag([p.grad], "gradients"))
                     for p in encoder.parameters() if p.requires_grad]
            tracker.reset_peak()
            with tracker.region("tower backward"):
                out.backward(incoming)
            # the parameters' gradients at the peak (planned as model states) left out
            backward = max(tracker.peak - before, 0) + before - base - tracker.peak_by_tag.get("gradients", 0)
            for hook in hooks:
                hook.remove()
    return {"kept": kept, "forward": forward, "backward": backward, "tokens": out.shape[0] // images,
            "output": out.numel() * out.element_size() // images,
            "pixel_bytes": pixels.numel() * pixels.element_size()}

