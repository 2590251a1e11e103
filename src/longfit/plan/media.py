"""The vision side of an image-text checkpoint in `longfit plan` (#54): its weights, the activations of a step's images
(and audios: Gemma 4's audio tower) and their embeddings, per rank.

Where a step's images come from (`step_images`): the data, when `data.path` holds chats with image or video parts and
the checkpoint's images train (`longfit.models.media.image_reader`): the packed row with the most of them, found by
the packer itself (`longfit.data.packing.heaviest_media_row`: the epochs as the trainer packs them -- the first, and
under data.shuffle_buffer every epoch the run trains on, each its own draw (`trained_epochs`) --, several short
chats sharing a row, each chat's tokens and images read as the reader counts an epoch: from the tokenizer and the
headers, nothing decoded), each of its inputs planned at the size of the data's largest, in every row of the
micro-batch. A row of ten short chats with three images each holds thirty images, where its largest chat holds three.
A video is read by the tower as its temporal patches (`longfit.data.video`: `temporal_patch_size` frames each, each
the tower's input as an image is, the video processor's tokens a patch counted from the container's header), so a
row's inputs are its images and its videos' temporal patches; a family that reads no videos refuses their parts in
one line. Without data (or to plan other images), `data.plan_images=N data.plan_image_size=HxW` plans N images of that
size a row. The eval rows' images (`eval_images`: data.eval_path, read as the trainer's eval packs it) are planned
as an evaluation runs them, after a step and without autograd: the tower's forward on the eval data's heaviest row
(`eval_tower_costs`); where the training rows hold none, the trainer builds the vision side for the evaluations
alone, and its weights are counted for the whole run, trained by no row.

What a rank holds (`TowerCosts`), as `longfit.models.media` and `longfit.parallel.media` run it:
- the vision module's weights (fp32 master weights, sharded with the objective's root parameters by FSDP2 and
  gathered with them for the whole step), the gradients and optimizer state of what `train.vision` trains;
- the tower's activations of this rank's images: the images are dealt over the ranks holding the rows, cp x tp, by
  their work (`longfit.parallel.media.deal`; fewer images than ranks: every rank runs all of them; under tp the tower
  is replicated over the tp ranks, `longfit.parallel.tp.replicate_media`). A frozen tower keeps
  nothing for the backward, only its working set while it runs; a trained projector keeps its inputs; a trained
  tower every block's saved tensors, until the tower's backward at the very end of the step -- or, its blocks
  checkpointed (memory.activation_checkpointing, `longfit.memory.apply.checkpoint_tower`), each block's input alone
  (in host memory with memory.offload_activations), and one block's working set while it is recomputed;
- the embeddings (N, H) of every image of the batch (gathered over those ranks) and the input embeddings they are
  scattered into, at the start of the language model's forward;
- the batch's pixels, and under FSDP2's bf16 mixed precision their bf16 cast, made as the root's forward starts and
  freed when it returns after the loss (`longfit.plan.analytic._cast_pixels`).
The activations are traced, not derived: the family's own vision module at the checkpoint's widths with one and two
blocks, on one, two and three of the planned images made by the checkpoint's own image processor, in the run's dtype
(`_traced`: real tensors on the CPU, `LiveBytes`; the blocks checkpointed and offloaded, and adapted by LoRA, as the
run's are), then extended to the tower's depth (linearly) and the rank's images (quadratically: Pixtral's tower runs
every image in one sequence under a block-diagonal mask of its patches squared): a block's tensors of an image are the
same at any depth and beside any other image (the tower's attention never crosses two images, though Pixtral's mask
spans them), and what belongs to a block alone (its weights cast under autocast) or to the tower alone is told apart
by the six traces. What the tower keeps is a sum of such tensors, extended exactly; its forward's peak and its
backward's, taken window by window (projector, blocks, the rest), are each the largest over their moments of such
sums, and on more images than three the largest can move to a moment of more bytes an image (a block's weights cast
under autocast, or its weight gradients as they are made, outweigh three small images' tensors, not forty-eight). On
more than three a rank the tower is traced on more, doubling up to the rank's count, until the traces bracket the
forward's peak, and the backward's (the largest of its windows'), at that count within the plan's band (`_beyond`,
`_bracket`), planned at the bracket's top: never under the traced peaks, exact at a traced count. At 48 images a
rank the tiny wrappers' towers close it from their three traces (Mistral 3's Pixtral tower: exact) or two more, of 6
and 12 images (Qwen3.5's: 1.2% over the tower traced on 48); a two-block tower at Qwen3.5's widths on 448 x 448
images from two more, of 6 and 24 (56 s on two cores; 1.4% over). Through a checkpointed tower's blocks, the
backward's peak is where the last block recomputes, every other block's input waiting, or where the first block's
backward holds every block's weight gradients, whichever holds more with its gradients: the traces at one and two
blocks tell the second, and the first is planned where it outweighs it (`_part_costs`: a three-block tiny Qwen3.5
tower at 3 and 16 images exact and +2.7%, where every window was planned at least at the first, +5.6% and +9.7%).

Under pipeline parallelism (parallel.pp, `longfit.parallel.pipeline`) the vision side is the first stage's: its
weights and their training state, its forward and backward, what it keeps of each micro-batch the stage holds in
flight and its offload store's slots for them (`tower_costs`' `in_flight`) are planned there alone
(`longfit.plan.analytic`), an evaluation's tower too; every stage holds the pixels of every micro-batch of the step.

Gemma 4's audio tower (`_trace_table`'s `audio_frames`): the audios of the data's heaviest micro-batch
(`MediaRow.batch_audio_tokens`), each planned at the data's longest (the tower runs a step's audios padded to the
longest), traced the same way on seeded features of that many frames and added to the vision tower's (`_together`):
it runs after the vision tower and its backward before, each beside the other's kept tensors; its backward holds its
own gradients and, in a step without vision inputs, the idle vision side's zero gradients; the vision tower's
backward holds the audio side's gradients (their own, or idle zeros). Under context parallelism the step's images
and audios are dealt over the ranks together, in the step's order (`MediaRow.batch_audio`), as the run deals them
(`_ranks_inputs`), and each rank's towers run its own. Its store's slot is its first input's
(`longfit.memory.apply.checkpoint_tower`), planned at the heaviest.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path

from longfit.config import Config, ConfigError, plan_image_size


TRACED = ((1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3))
"""(blocks, images) of the tower's traces (`_trace_table`): three image counts, for a tower whose tensors grow with the
square of its images (Pixtral's block-diagonal mask over every image's patches, one sequence)."""


@dataclass(frozen=True)
class StepImages:
    """The tower's inputs in one row of a step, as planned: `count` of them (images, and videos' temporal patches),
    each as large as the largest: an image of `size` (height, width) pixels, or a temporal patch of `video_tokens`."""

    count: int
    size: tuple[int, int]
    source: str
    """Where they come from, for the plan's notes."""
    path: str | None = None
    """The image the tower is traced on (the data's largest); None: noise of `size` made for the trace."""
    video_patches: int = 0
    """Of `count`, the temporal patches of the row's videos."""
    video_tokens: int = 0
    """Not 0: the data's largest input is a video's temporal patch of this many tokens, and the tower is traced on
    one (`_tower_input`) rather than on an image."""
    batch_inputs: tuple[float, ...] = ()
    """The data's micro-batch whose inputs take the most tokens: each input's tokens over the largest input's, as the
    reader counts them from the headers (the tower's work, in traced inputs); empty: `count` inputs a row, each as
    large as the largest."""
    audio_frames: int = 0
    """The data's longest audio's feature frames (Gemma 4's audio tower, traced on one); 0: no audio."""
    batch_audios: tuple[float, ...] = ()
    """The audios of the data's micro-batch whose audios take the most tokens, each one's tokens over the longest's:
    the audio tower runs them padded to the longest (each its work), each keeping its own tokens."""
    batch_audio: tuple[bool, ...] = ()
    """Whether each input of that micro-batch (`batch_inputs`' and `batch_audios`'), in the step's order, is an audio:
    under context parallelism the run deals them over the ranks together (`_ranks_inputs`); empty: the vision
    inputs, then the audios."""

    @property
    def from_data(self) -> bool:
        """Whether these are the data's inputs, which a row need not hold all at the largest size (else
        `data.plan_images`')."""
        return self.path is not None or self.video_tokens > 0


def trained_rows(cfg: Config, dp_size: int) -> int:
    """The global rows `cfg`'s run trains on by train.steps (train.epochs decides them from the packing itself)."""
    return cfg.train.steps * cfg.train.micro_batch * cfg.train.grad_accum * dp_size


def step_images(cfg: Config, dp_size: int = 1) -> StepImages | None:
    """The tower's inputs a row of `cfg`'s run on `dp_size` data-parallel ranks holds (module docstring): read from
    `data.path`, else `data.plan_images` of `data.plan_image_size`; None for text rows, or a checkpoint whose images do
    not train."""
    from longfit.models.source import local_model_dir

    local = local_model_dir(cfg.model) is not None  # a preset or hub name holds no image processor: torch not imported
    data = tuple(vars(cfg.data).items())  # the reader's and the packer's settings, hashable for the cache
    from_data = _data_images(cfg.model, cfg.seq_len, cfg.train.seed, data, cfg.train.epochs,
                             trained_rows(cfg, dp_size), cfg.train.micro_batch,
                             dp_size) if cfg.data.path and local else None
    if from_data is not None or not cfg.data.plan_images:
        return from_data
    from longfit.models.media import media_reader

    unavailable = media_reader(cfg.model).unavailable  # a checkpoint whose images do not train: its one line
    if unavailable is not None:  # its image processor cannot run here: an image's tokens (Llama 4's tiles) unknown
        raise ConfigError(f"data.plan_images={cfg.data.plan_images}: the plan cannot count these images here: "
                          f"{unavailable} (data.plan_images=0 plans its text rows)")
    return StepImages(cfg.data.plan_images, plan_image_size(cfg.data),
                      f"data.plan_images={cfg.data.plan_images} of {cfg.data.plan_image_size}")


def eval_images(cfg: Config, dp_size: int = 1) -> StepImages | None:
    """The tower's inputs a row of `cfg`'s eval data (data.eval_path) holds, as `step_images` reads the training
    data's: its packed row with the most of them, packed as `longfit.data.packing.EvalData` packs it (the data's
    order, one pass); None for text eval rows, and for a preference objective's (its held-out pairs)."""
    from longfit.models.source import local_model_dir

    if not cfg.data.eval_path or cfg.train.objective != "causal_lm" or local_model_dir(cfg.model) is None:
        return None
    data = replace(cfg.data, path=cfg.data.eval_path, eval_path=None, shuffle_buffer=0)
    return _data_images(cfg.model, cfg.seq_len, cfg.train.seed, tuple(vars(data).items()), epochs=1, rows=0,
                        micro_batch=cfg.train.micro_batch, dp_size=dp_size, read_from="data.eval_path")


@functools.lru_cache(maxsize=8)
def _data_images(model: str, seq_len: int, seed: int, data: tuple, epochs: int, rows: int, micro_batch: int = 1,
                 dp_size: int = 1, read_from: str = "data.path") -> StepImages | None:
    """The heaviest row the data packs in the epochs the run trains on (`longfit.data.packing.heaviest_media_row`,
    `trained_epochs`: train.epochs `epochs`, else train.steps' `rows` global rows), each of its inputs as large as the
    data's largest (`_largest_input`), and the tokens of its heaviest micro-batch of `micro_batch` rows on `dp_size`
    ranks; `data`: the run's `DataConfig` as (name, value) pairs, its rows `read_from` that setting."""
    from longfit.config import DataConfig, TrainSection
    from longfit.data.audio import subsampled
    from longfit.data.packing import COUNT_TOKENS, heaviest_media_row, trained_epochs
    from longfit.data.sources import open_source
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import image_reader

    reader = image_reader(model)
    if reader is None:
        return None
    cfg = Config(model=model, seq_len=seq_len, data=DataConfig(**dict(data)),
                 train=TrainSection(seed=seed, epochs=epochs, micro_batch=micro_batch))
    tokenizer = load_tokenizer(model)
    read_epochs = trained_epochs(cfg, tokenizer, reader, rows)
    row = heaviest_media_row(cfg, tokenizer, reader, COUNT_TOKENS, read_epochs, dp_size)  # as the trainer's rows
    if row is None:
        return None
    sampled = reader.sampled(cfg.data)  # the run's video frames a second
    (tokens, size, path, video), frames = _largest_input(open_source(cfg, tokenizer, sampled).media_rows(), sampled)
    epochs_read = "the first epoch" if read_epochs == 1 else f"the {read_epochs} epochs the run trains on"
    read = f"row {row.index + 1} of {epochs_read}" if row.complete else \
        f"row {row.index + 1} of the first {row.rows} rows of {epochs_read} (read up to {COUNT_TOKENS} tokens)"
    inputs = ", ".join([f"{row.images} images"] * bool(row.images)
                       + [f"{row.video_patches} video temporal patches"] * bool(row.video_patches)
                       + [f"{row.audios} audios"] * bool(row.audios))
    largest = "; ".join([f"its largest video's temporal patch ({tokens} tokens)" if video else
                         f"its largest image's size ({size[0]}x{size[1]})"] * bool(tokens)
                        + [f"its longest audio ({frames} frames)"] * bool(frames))
    shuffled = ", in train.seed's shuffle" if cfg.data.shuffle_buffer else ""
    return StepImages(row.images + row.video_patches, size,
                      f"{read_from}: its packed row with the most tower inputs, {read}{shuffled}: "
                      f"{row.documents} chats, {inputs}, {row.tokens} image and audio tokens; "
                      f"each planned at {largest}",
                      None if video or not tokens else str(path), row.video_patches, tokens if video else 0,
                      tuple(t / tokens for t in row.batch_tokens) if tokens else (), frames,
                      tuple(t / subsampled(frames) for t in row.batch_audio_tokens) if frames else (),
                      row.batch_audio)


def _largest_input(rows, reader) -> tuple[tuple[int, tuple[int, int], Path | None, bool], int]:
    """((tokens, (height, width), path, whether a video) of the largest vision tower input of the chats `rows`
    ((where, folder, messages), `media_paths`): an image, or a temporal patch of a video (its frames' size), headers
    only; the feature frames of their longest audio, decoded as the reader counts it)."""
    from longfit.data.media import image_size, media_paths

    largest, frames = (0, (0, 0), None, False), 0
    for _, folder, messages in rows:
        for kind, path in media_paths(messages, folder):
            if kind == "audio":
                frames = max(frames, reader.audios(path).features(path).shape[1])
                continue
            if kind == "video":
                video = reader.videos(path)
                patches, _ = video.read(path, pixels=False)
                metadata = video.metadata(path)
                found = (max(tokens for _, tokens in patches), (metadata.height, metadata.width), path, True)
            else:
                found = (reader.image_tokens(path), image_size(path), path, False)
            if (found[0], found[1][0] * found[1][1]) > (largest[0], largest[1][0] * largest[1][1]):
                largest = found
    return largest, frames


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
    features: float
    """Bytes of every image's embeddings of the micro-batch (N, H), as gathered on every rank."""
    slot: int = 0
    """The slot of the vision tower's offload store: one block's input on this rank's images, page-rounded (0: nothing
    offloaded); the run's store is sized to it (`CheckpointPlacement.tower_slots`)."""
    audio_slot: int = 0
    """The slot of Gemma 4's audio tower's offload store: one block's input on this rank's audios, as `slot`."""
    host: float = 0.0
    """Host memory of the tower's offload store (its blocks checkpointed and their inputs offloaded,
    `longfit.memory.apply.checkpoint_tower`): a slot of this rank's block input for each block, in host memory; with
    memory.offload_dir the blocks' inputs on disk and its staging slots in host memory."""


def tower_costs(s, in_flight: int = 1) -> TowerCosts | None:
    """The vision side's bytes on a rank of the planned run `s` (`Setup.images`); None without images or audios.
    Gemma 4's audio tower is traced apart on the step's audios (`StepImages.batch_audios`) and added (`_together`).
    Under context parallelism the run deals the step's inputs, images and audios together, over the ranks
    (`_ranks_inputs`): each rank's costs are its own inputs' (a kind it has none of idle on it), and the plan holds,
    at each point of the step, the largest of the ranks' (one rank's where one is the busiest throughout).
    `in_flight`: the micro-batches whose blocks' inputs the tower's offload store holds at once (the first pipeline
    stage's, `Stage.in_flight`; 1 without parallel.pp)."""
    lora = s.config.lora
    adapters = (lora.r, lora.alpha, lora.dropout) if lora.enabled else None  # LoRA: the adapters train
    return _costs(s, s.images, s.config.train.vision, adapters, s.config.memory.activation_checkpointing,
                  s.offload_activations, in_flight)


def eval_tower_costs(s) -> TowerCosts | None:
    """The vision side's bytes on a rank of the planned run `s` evaluating the images of its eval rows
    (`Setup.eval_images`); None without them. The trainer builds the vision side for them (where the training rows
    hold none, for them alone: its weights on the device for the whole run, what train.vision trains getting no
    gradient), and an evaluation runs the tower on a micro-batch's images without autograd (`longfit.eval.loss`), as
    a frozen tower runs, not checkpointed, dealt over the cp ranks as training deals them."""
    return _costs(s, s.eval_images, "frozen", None, False, False)


def _costs(s, images: StepImages | None, vision: str, adapters: tuple | None, checkpointed: bool,
           offloaded: bool, in_flight: int = 1) -> TowerCosts | None:
    """The vision side's bytes on a rank of `s` running `images` (`tower_costs`), traced with `vision` trained, LoRA's
    `adapters`, its blocks `checkpointed` and their inputs `offloaded` into a store of `in_flight` micro-batches."""
    if images is None or not (images.count or images.batch_audios):
        return None
    # The tower runs in bf16 where FSDP2 gathers it in bf16; else its fp32 weights run under the run's autocast
    # (`longfit.parallel.parallelize.autocast_dtype`: LoRA's bf16 base on one rank leaves the vision side in fp32).
    dtype = "bf16" if s.regime == "bf16" and s.fsdp else "fp32" if s.regime == "fp32" else "autocast"
    trace = functools.partial(_trace_table, s.config.model, dtype, vision, adapters=adapters,
                              checkpointed=checkpointed, offloaded=offloaded)
    kinds = []  # (traced table, each input's work, each input's tokens, whether the audio tower's)
    if images.count:
        traced = trace(images.size, images.path, images.video_tokens)
        inputs = list(images.batch_inputs)  # the data's heaviest micro-batch, each input's share of the largest
        if not inputs:
            count, tokens = images.count, traced["tokens"]
            if tokens * count > s.seq_len:
                if not images.from_data:
                    raise ConfigError(f"{images.source}: {count} images of {tokens} tokens each are more than a "
                                      f"row of seq_len={s.seq_len} holds; raise seq_len or plan fewer "
                                      "(data.plan_images)")
                count = s.seq_len // tokens  # the data's images at their largest size: as many as a row holds
            inputs = [1.0] * (count * s.micro_batch)
        kinds.append((traced, inputs, inputs, False))
    if images.batch_audios:  # padded to the longest: each audio's work that of the longest, its tokens its own
        traced = trace((0, 0), None, 0, audio_frames=images.audio_frames)
        kinds.append((traced, [1.0] * len(images.batch_audios), list(images.batch_audios), True))
    ranks = [_rank_costs(s, kinds, own, dtype, adapters, in_flight)
             for own in _ranks_inputs(s, kinds, images.batch_audio)]
    return functools.reduce(_either, ranks)


def _ranks_inputs(s, kinds: list[tuple], order: tuple[bool, ...]) -> list[list[list[int]]]:
    """The inputs of the micro-batch of each rank holding its rows (cp x tp), per kind of `kinds` (indices into its
    inputs), as `longfit.parallel.media.DealtMedia` deals them: the step's inputs in their order (`order`: whether each
    is an audio, `StepImages.batch_audio`; empty: the vision tower's inputs, then the audios), all of them over the
    ranks together by their work (`longfit.parallel.media.rank_inputs`)."""
    from longfit.parallel.media import rank_inputs

    audio = [kind[3] for kind in kinds for _ in kind[1]]
    if sorted(order) == sorted(audio):  # else the vision inputs are data.plan_images', not the data's micro-batch's
        audio = list(order)
    kind_of = {kind[3]: k for k, kind in enumerate(kinds)}
    step = [(kind_of[is_audio], audio[:at].count(is_audio)) for at, is_audio in enumerate(audio)]  # (kind, index)
    work = [kinds[k][1][index] for k, index in step]
    dealt = rank_inputs(work, s.dims.row_ranks)
    return [[[index for k, index in (step[at] for at in own) if k == kind] for kind in range(len(kinds))]
            for own in dealt]


def _rank_costs(s, kinds: list[tuple], own: list[list[int]], dtype: str, adapters: tuple | None,
                in_flight: int = 1) -> TowerCosts:
    """A rank's bytes of the vision side running its inputs `own` of each of `kinds` (`tower_costs`). The audio
    side's gradients exist through the vision tower's backward, which follows the audio tower's: its own, or its zero
    gradients where the rank runs no audio (Gemma4MediaEncoder.features); the idle vision side's through the audio
    tower's backward where the rank runs no vision input. `dtype`, `adapters`, `in_flight`: the towers'
    (`tower_costs`)."""
    gradient = 2 if dtype == "bf16" else 4
    vision_runs = any(own[k] for k, kind in enumerate(kinds) if not kind[3])
    parts = []
    for (traced, work, tokens, audio), mine in zip(kinds, own):
        costs, traced = _part_costs(s, traced, work, tokens, mine, audio, in_flight)
        if audio:
            idle = 0 if vision_runs else gradient * (traced["trained"] - traced["audio_trained"])
            costs = replace(costs, slot=0, audio_slot=costs.slot, backward=costs.backward + idle if mine else 0.0)
        else:
            costs = replace(costs, backward=costs.backward + gradient * traced["audio_trained"] if mine else 0.0)
        parts.append((costs, traced))
    return _together(parts, keeps_input=adapters is None and dtype != "bf16", cast=dtype == "bf16")


def _either(first: TowerCosts, second: TowerCosts) -> TowerCosts:
    """The larger of two ranks' bytes at each point of the step (`TowerCosts`' fields of one rank; those of the
    micro-batch are the same on every rank)."""
    return replace(first, images=max(first.images, second.images), kept=max(first.kept, second.kept),
                   forward=max(first.forward, second.forward), backward=max(first.backward, second.backward),
                   output=max(first.output, second.output), slot=max(first.slot, second.slot),
                   audio_slot=max(first.audio_slot, second.audio_slot), host=max(first.host, second.host))


def _part_costs(s, traced: dict, work: list[float], tokens: list[float], own: list[int], audio: bool = False,
                in_flight: int = 1) -> tuple[TowerCosts, dict]:
    """One tower's bytes on a rank (`TowerCosts`) from its traces `traced` (`_trace_table`), the micro-batch's inputs
    each `work` traced inputs' work and `tokens` traced inputs' tokens, the rank running those of `own` (none: the
    tower idle there, holding nothing of its own); and its table. Gemma 4's `audio` tower's backward is not the
    step's last: its peak holds the gradients its parameters have there; and its blocks' kept inputs are counted in
    the window through its blocks alone (they are freed before the rest's, where its subsampling convolutions'
    backward peaks). `in_flight`: the micro-batches its offload store holds (`tower_costs`)."""
    batch = len(work)
    load = sum(work[i] for i in own)  # the rank's inputs as so many traced ones: its tensors follow the patches

    def at(quantity: str, window: int | None = None, depth: int = traced["depth"]) -> float:
        """Linear in the blocks, quadratic in the rank's images (Newton's form through 1, 2 and 3 images): a block's
        tensors of an image, a block's own (its weights cast under autocast), an image's outside the blocks (the
        projector's), what grows with the square of the images (an attention mask over all of them), and the rest
        (of the backward's `window`, `_traced`), for a tower `depth` blocks deep."""
        values = [traced[key][quantity] if window is None else traced[key][quantity][window] for key in TRACED]
        extra = load - 1

        def of_images(one: float, two: float, three: float) -> float:
            return one + extra * (two - one) + extra * (extra - 1) / 2 * (three - 2 * two + one)

        shallow, deep = of_images(*values[:3]), of_images(*values[3:])
        return shallow + (depth - 1) * (deep - shallow)

    waiting = at("kept") - at("kept", None, 1)  # the other blocks' kept inputs, beside the last block's recompute

    def recompute() -> float:
        """The bytes other than gradients while the checkpointed tower's last block recomputes, every other block's
        input `waiting`: the one-block tower's peak of them through its block (window 1, `_traced`'s "held") and
        theirs. At one or two images a constant temporary can hide this moment in the traced window's peak, which then
        does not grow with the blocks."""
        return at("held", 1, 1) + waiting

    def backward(window: int) -> float:
        """A window's peak (without the gradients it holds: planned as model states; the audio tower's with them).
        Through the blocks, the last block's recompute where, with the gradients made before it (the projector's,
        window 0's), it outweighs the window's traced peak with the gradients held there: by the time the first
        block's backward peaks, the blocks' weight gradients may outweigh the others' freed inputs."""
        peak = at("backward", window)
        if window == 1:
            recomputing = recompute()
            if recomputing + at("made", 0) > peak + at("gradients", window):
                peak = recomputing
        return peak + (at("gradients", window) if audio else 0.0)

    def bracketed(window: int):
        """`backward`'s bounds (low, high) as a function of the counts of inputs traced, beyond them (`_bracket`);
        through the blocks, where the bounds do not tell whether the last block's recompute or the traced peak
        outweighs the other, either's bytes (more traces tell)."""
        def bounds(counts: list[int]) -> tuple[float, float]:
            low, high, gradients = _bracket(traced, counts, load, traced["depth"], window)
            found = (low - gradients, high - gradients)
            if window == 1:
                made = at("made", 0)
                held_low, held_high, _ = _bracket(traced, counts, load, 1, window, held=True)
                recomputing = (held_low + waiting, held_high + waiting)
                if recomputing[0] + made > high:
                    found = recomputing
                elif recomputing[1] + made > low:
                    found = (min(found[0], recomputing[0]), max(found[1], recomputing[1]))
            held = gradients if audio else 0.0
            return found[0] + held, found[1] + held
        return bounds

    windows = traced[(1, 1)]["backward"]
    if load <= TRACED[-1][1]:
        forward_peak, backward_peak = at("forward"), max(map(backward, windows), default=0.0)
    else:  # peaks that can move to another moment beyond the traced inputs (`_beyond`)
        forward_peak = _beyond(traced, load, [lambda counts: _bracket(traced, counts, load, traced["depth"])[:2]])
        backward_peak = _beyond(traced, load, list(map(bracketed, windows))) if windows else 0.0
    embeddings = round(traced["tokens"] * sum(tokens))
    # whole images padded to the batch's largest (one pixel row each), or every input's patches
    pixels = traced["pixel_bytes"] * (batch if traced["padded"] else sum(work))
    runs = bool(own)
    return TowerCosts(params=traced["params"], trained=traced["trained"], images=len(own), batch_images=batch,
                      embeddings=embeddings, kept=at("kept") if runs else 0.0, forward=forward_peak if runs else 0.0,
                      backward=backward_peak if runs else 0.0, pixels=pixels, positions=traced["positions"],
                      output=traced["output"] * load,
                      features=traced["output"] / traced["tokens"] * embeddings,
                      **_tower_store(s, traced, load, in_flight)), traced


def _beyond(traced: dict, load: float, peaks: list) -> float:
    """The largest of the `peaks` of the tower on `load` traced inputs, more than `TRACED` holds: its forward's, or its
    backward's windows' (module docstring), each a function of the counts of inputs traced to its bounds (low, high)
    at `load` (`_bracket`). The tower is traced on more inputs, doubling up to `load`'s (its whole ones each side),
    until the largest high bound is within the plan's band (`longfit.plan.band.SAFE_BAND`) of the largest low
    one, and planned at it: never under the traced peaks, exact at a traced count. A window whose high bound is
    below another's low one is not traced further for itself."""
    from longfit.plan.band import SAFE_BAND

    counts = [images for blocks, images in TRACED if blocks == 1]
    while True:
        low, high = (max(bound) for bound in zip(*(peak(counts) for peak in peaks)))
        top = counts[-1]
        more = min(2 * top, math.ceil(load)) if top < load else math.floor(load)
        if high <= (1 + SAFE_BAND[1]) * low or more in counts:
            return high
        counts = sorted(counts + [more])


def _bracket(traced: dict, counts: list[int], load: float, depth: int, window: int | None = None,
             held: bool = False) -> tuple[float, float, float]:
    """(low, high, gradients): bounds of the live bytes at the peak of the forward of the tower `depth` blocks deep
    on `load` traced inputs, or of its backward's `window` (`_traced`), from its traces on `counts` inputs (`TRACED`'s
    and more, `_trace_table`'s "more"), and the parameters' gradients at the largest trace's peak. At any moment the
    live bytes are a sum of tensors, each of a block or the tower (constant), of an input (linear in the inputs) or of
    the mask over every input's patches (its square, Pixtral's), and the peak is the largest of these polynomials over
    the moments: beyond three inputs it can move to a moment of more bytes an input (a bf16 cast of a block's weights
    under autocast outweighs a few inputs' tensors, not many). Less the mask's bytes (the tower keeps it to the
    backward's end: the curvature of its kept bytes), the peak is a maximum of lines of nonnegative coefficients in
    the inputs, convex: at `load` beyond the largest trace, at least its last chord extended; between two traces at
    most their chord, at least their neighbours' chords extended (between two whole counts, their chord). Beyond the
    largest trace of K inputs, a moment's bytes are the parameters' gradients it holds (G, constant) and the rest,
    proportional at most (r, r(K) no more than the trace's peak of what is not gradients, `_traced`'s "held", H):
    G + r(K) load / K, with G + r(K) no more than the trace's peak P, at most P + H (load - K) / K. The backward's
    peak is taken with the gradients it holds (the plan holds the parameters' gradients as model states: less the
    largest trace's, what it plans for the window's peak is never under the window's); with `held`, the window's
    peak of what is not gradients ("held") instead, all of it proportional at most."""

    def of(images: int, quantity: str) -> float:
        """`quantity` of the trace on `images` inputs (the window's, of the backward), linear in the blocks."""
        tables = [traced[(blocks, images)] for blocks in (1, 2)] if images <= TRACED[-1][1] else \
            [traced["more"](images)[blocks] for blocks in (1, 2)]
        one, two = (table[quantity][window] if isinstance(table[quantity], dict) else table[quantity]
                    for table in tables)
        return one + (depth - 1) * (two - one)

    kept = [of(images, "kept") for images in (1, 2, 3)]
    square = max((kept[2] - 2 * kept[1] + kept[0]) / 2, 0.0)  # the mask's bytes over the inputs squared

    def line(images: int) -> float:
        if window is None:
            peak = of(images, "forward")
        else:
            peak = of(images, "held") if held else of(images, "backward") + of(images, "gradients")
        return peak - square * images**2

    values = [line(images) for images in counts]
    above = [at for at, images in enumerate(counts) if images > load]
    if not above:  # beyond the largest trace: its last chord extended, and P + H (load - K) / K
        low = values[-1] + (values[-1] - values[-2]) / (counts[-1] - counts[-2]) * (load - counts[-1])
        top = counts[-1]
        proportional = values[-1] if window is None or held else of(top, "held") - square * top**2
        high = values[-1] + proportional * (load - top) / top
    else:
        right = above[0]
        (a, va), (b, vb) = (counts[right - 1], values[right - 1]), (counts[right], values[right])
        high = va + (vb - va) * (load - a) / (b - a)
        low = high if b - a == 1 else \
            max([va] + [values[at] + (values[at] - values[at - 1]) / (counts[at] - counts[at - 1])
                        * (load - counts[at]) for at in (right - 1, right + 1) if 0 < at < len(counts)])
    gradients = 0.0 if window is None or held else of(counts[-1], "gradients")
    high = max(high, low)  # the lower where the traces break the model
    return low + square * load**2, high + square * load**2, gradients


def _together(parts: list[tuple[TowerCosts, dict]], keeps_input: bool = False, cast: bool = False) -> TowerCosts:
    """The vision side's bytes of its towers' `parts` (vision, then audio: Gemma4MediaEncoder.features runs them in
    that order, and the backward the other way round, each beside the other's kept tensors). The batch's inputs are
    one tensor padded to the widest of them (Gemma 4's padded patches beside its audios' frames), and each tower
    reads its own inputs' rows of it (`pixel_values[chosen]`, a copy at the padded width, of which it takes a view):
    wider than the traced tower's own input by the other kind's padding, and, where its first layer keeps its input
    (`keeps_input`: the tower trained whole, not cast to bf16 first), kept to the backward at that width. Where FSDP2
    `cast` the batch's pixels to bf16 (`longfit.plan.analytic._cast_pixels`), both that copy and the rank's copy of
    its rows out of the cast, for which the traced tower holds its cast of its own input (`_traced`), are in bf16 at
    the padded width."""
    (first, table), *rest = parts
    if not rest:
        return first
    (second, other), = rest
    shape = [max(a, b) for a, b in zip(table["pixel_shape"], other["pixel_shape"])]  # (rows, width, itemsize)
    copies = 2 * 2 / shape[2] if cast else 1  # in the traced input's bytes
    first, second = (replace(part, forward=part.forward + widened, kept=part.kept + widened * keeps_input)
                     for part, widened in ((part, part.images * copies
                                            * (math.prod(shape) - math.prod(own["pixel_shape"])))
                                           for part, own in ((first, table), (second, other))))
    return replace(first, images=first.images + second.images, batch_images=first.batch_images + second.batch_images,
                   embeddings=first.embeddings + second.embeddings, kept=first.kept + second.kept,
                   forward=max(first.forward, first.kept + second.forward),
                   backward=max(second.backward + first.kept, first.backward),
                   pixels=float((first.batch_images + second.batch_images) * math.prod(shape)),
                   output=first.output + second.output, features=first.features + second.features,
                   audio_slot=second.audio_slot, host=first.host + second.host)


def _tower_store(s, traced: dict, images: float, in_flight: int = 1) -> dict:
    """The slot and host bytes of the tower's offload store on a rank of `images` traced inputs' work
    (`TowerCosts.slot`, `TowerCosts.host`): the store as the run makes it (`OffloadStore` with no placement: every
    block's input in a slot of each of the `in_flight` micro-batches, page-rounded; with an offload_dir every one on
    disk, through its staging slots)."""
    from longfit.memory.checkpointing import MIN_OFFLOAD_BYTES
    from longfit.memory.switches import CheckpointPlacement, round_up

    block_input = math.ceil(traced[(1, 1)]["block_input"] * images)
    if block_input < MIN_OFFLOAD_BYTES:  # not offloaded, a frozen tower, or an input the offloader keeps in place
        return {}
    depth, slot = traced["depth"], round_up(block_input)
    disk = depth if s.offload_dir else 0
    return {"slot": slot, "host": float(CheckpointPlacement(0, depth - disk, disk, slot, in_flight).host_bytes)}


def tower_slots(s) -> tuple[int, ...]:
    """`CheckpointPlacement.tower_slots` of the planned run `s`: the vision tower's store's slot, then the audio
    tower's (0 without its inputs or an offloaded tower)."""
    towers = tower_costs(s)
    return (towers.slot, towers.audio_slot) if towers is not None else ()


def tower_notes(s) -> list[str]:
    """The plan's lines on the vision side of `s`: its training rows' images, its eval rows' (none for text rows);
    under parallel.pp the first stage's."""
    MiB = 1 << 20
    busiest = "the busiest rank" + (" of the first pipeline stage" if s.dims.pp > 1 else "")
    notes = []
    towers = tower_costs(s)
    if towers is not None:
        unit, inputs = _units(s.images)
        tokens = "image and audio tokens" if s.images.batch_audios else "image tokens"
        notes.append(f"vision side counted for {towers.batch_images // s.micro_batch} {inputs} a row "
                     f"({s.images.source}): {towers.params / 1e6:.1f}M parameters ({towers.trained / 1e6:.1f}M train, "
                     f"train.vision={s.config.train.vision}), {towers.images} {unit} on {busiest} keeping "
                     f"{towers.kept / MiB:.1f} MiB to their backward, {towers.embeddings} {tokens} a micro-batch")
    evaluated = eval_tower_costs(s)
    if evaluated is not None:
        unit, inputs = _units(s.eval_images)
        weights = "" if towers is not None else (f", the training rows holding none: {evaluated.params / 1e6:.1f}M "
                                                 "parameters on the device for the whole run, trained by no row")
        notes.append(f"vision side counted for the eval rows' {evaluated.batch_images // s.micro_batch} {inputs} a row "
                     f"({s.eval_images.source}){weights}; each evaluation runs the tower on {evaluated.images} "
                     f"{unit} on {busiest}, its peak {evaluated.forward / MiB:.1f} MiB over what a step leaves")
    return notes


def _units(images: StepImages) -> tuple[str, str]:
    """(what a tower's input is called, the inputs with their kinds) of `images`, for the plan's lines."""
    video, audio = bool(images.video_patches), bool(images.batch_audios)
    kinds = (["images", "videos' temporal patches"] if video else ["images"] * bool(images.count)) + ["audios"] * audio
    unit = "tower inputs" if video or audio else "images"
    return unit, f"{unit} ({' and '.join(kinds)})" if video or audio else unit


@functools.lru_cache(maxsize=16)
def _trace_table(model: str, regime: str, vision: str, size: tuple[int, int], path: str | None,
                 video_tokens: int, adapters: tuple[int, int, float] | None = None, checkpointed: bool = False,
                 offloaded: bool = False, audio_frames: int = 0) -> dict:
    """The traced tower (`_traced`) at 1 and 2 blocks and 1 to 3 inputs (`_tower_input`), with its full depth and
    parameters; `adapters`: LoRA's (r, alpha, dropout) when `vision`'s parts train as adapters (traced with them: the
    frozen layers they adapt keep no input for a weight gradient, and those before the first adapter pass back no
    input gradient); its blocks `checkpointed`, their inputs `offloaded`, as the run's. `audio_frames`: Gemma 4's
    audio tower instead, on an audio of that many feature frames (`_audio_input`)."""
    import torch

    from longfit.models.media import MediaEncoder, encoder_type, media_family
    from longfit.models.model_config import read_config

    config = read_config(model).config
    audio = bool(audio_frames)
    depth = (config.audio_config if audio else config.vision_config).num_hidden_layers
    pixels, grid = _audio_input(model, audio_frames) if audio else _tower_input(model, config, size, path,
                                                                                video_tokens)
    table = {key: _traced(config, regime, vision, pixels, grid, *key, checkpointed, offloaded, audio, adapters)
             for key in TRACED}

    @functools.lru_cache(maxsize=None)
    def more(images: int) -> dict:  # the tower at 1 and 2 blocks on more inputs, where a peak asks (`_beyond`)
        return {blocks: _traced(config, regime, vision, pixels, grid, blocks, images, checkpointed, offloaded, audio,
                                adapters) for blocks in (1, 2)}

    table["more"] = more
    with torch.device("meta"):
        whole = _vision(config, depth, vision, torch.float32, adapters, audio)
    table |= {"audio_trained": _audio_trained(whole.vision)}
    table |= {"depth": depth, "params": sum(p.numel() for p in whole.vision.parameters()),
              "trained": sum(p.numel() for p in whole.vision.parameters() if p.requires_grad),
              "tokens": table[(1, 1)]["tokens"], "pixel_bytes": table[(1, 1)]["pixel_bytes"],
              "output": table[(1, 1)]["output"], "padded": pixels.dim() > 2,
              "pixel_shape": (*pixels.shape[-2:], pixels.element_size()),
              # the base class's positions are the M-RoPE ones; the families with text positions override them
              "positions": encoder_type(media_family(config)).rope_positions is MediaEncoder.rope_positions}
    return table


def _tower_input(model: str, config, size: tuple[int, int], path: str | None, video_tokens: int):
    """(pixels, grid (1, 3)) of one planned input as the tower reads it: the data's image file or seeded noise of
    `size`, made by the checkpoint's own image processor; or a video's temporal patch of `video_tokens` tokens: its
    patches (tokens x merge^2, each `temporal_patch_size` frames of patch x patch pixels) as seeded noise on a grid
    one merged patch tall (the tower's tensors of an input follow its patches alone: its attention, rotary and
    position tables are per patch)."""
    import numpy as np
    import torch
    from PIL import Image

    from longfit.data.media import open_image
    from longfit.models.media import media_reader

    if video_tokens:
        vision = config.vision_config
        merge = vision.spatial_merge_size
        patches = video_tokens * merge**2
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        noise = np.random.default_rng(0).standard_normal((patches, width), dtype=np.float32)
        return torch.from_numpy(noise), torch.tensor([[1, merge, video_tokens * merge]])
    image = open_image(Path(path)) if path is not None else \
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8))
    spec = (reader := media_reader(model)).spec
    processed = reader.image_processor(images=[image], return_tensors="pt", **dict(spec.processor_kwargs))
    grid = spec.grids(processed)  # (1, 3)
    pixels = processed["pixel_values"][: spec.pixel_rows(grid[0])]
    if spec.row_break is not None:  # without the padding, as the reader keeps it
        pixels = pixels[..., : grid[0, 1] * spec.patch_size, : grid[0, 2] * spec.patch_size]
    return pixels, grid


def _audio_trained(vision) -> int:
    """The trained parameters of the vision module `vision`'s audio side (Gemma 4's audio tower and embedder; 0 for
    the families without one)."""
    from torch import nn

    from longfit.models.media_gemma4 import AUDIO_PARTS

    parts = [vision[name] for name in AUDIO_PARTS if isinstance(vision, nn.ModuleDict) and name in vision]
    return sum(p.numel() for part in parts for p in part.parameters() if p.requires_grad)


def _audio_input(model: str, frames: int):
    """(features (1, frames, mel bins), grid (1, 3)) of one planned audio as the audio tower reads it: seeded noise of
    the checkpoint's feature extractor's mel bins, every frame valid (the tower's tensors follow its frames alone)."""
    import numpy as np
    import torch

    from longfit.models.media import media_reader

    mel = media_reader(model).audio.feature_extractor.feature_size
    noise = np.random.default_rng(0).standard_normal((1, frames, mel), dtype=np.float32)
    return torch.from_numpy(noise), torch.tensor([[0, frames, mel]])


def _vision(config, depth: int, vision: str, dtype, adapters: tuple[int, int, float] | None = None,
            audio: bool = False):
    """The family's vision side of the wrapper `config` with `depth` blocks (Gemma 4's audio tower's, with `audio`),
    `vision` of it trainable, in `dtype`; with `adapters` (LoRA's r, alpha, dropout) as LoRA adapters on its linear
    layers."""
    from transformers.initialization import no_init_weights

    from longfit.config import LoraSection
    from longfit.models.media import encoder_type, media_family, trainable_parts

    config = copy.deepcopy(config)
    (config.audio_config if audio else config.vision_config).num_hidden_layers = depth
    family = media_family(config)
    encoder = encoder_type(family)

    with no_init_weights():  # the weights' values do not change what is allocated (buffers are made as ever)
        module = encoder.vision_module(config).to(dtype)
    made = encoder(config, module, family, None)
    lora = LoraSection(enabled=True, r=adapters[0], alpha=adapters[1], dropout=adapters[2]) if adapters else None
    trainable_parts(made, vision, lora)
    return made


def _first_tensor(values):
    """The first tensor of a module's output or inputs (a block's hidden states)."""
    import torch

    return values if isinstance(values, torch.Tensor) else next(v for v in values if isinstance(v, torch.Tensor))


def _held_bytes():
    """`LiveBytes` that also holds `held_peak`, the peak of the live bytes other than the parameters' gradients (the
    "gradients" tag), since the last `reset_peak` (`_bracket`)."""
    from longfit.plan.tracker import LiveBytes

    class HeldBytes(LiveBytes):
        held_peak = 0

        def _add(self, nbytes: int, tag: str) -> None:
            super()._add(nbytes, tag)
            self.held_peak = max(self.held_peak, self.live - self.by_tag["gradients"])

        def reset_peak(self) -> None:
            super().reset_peak()
            self.held_peak = self.live - self.by_tag["gradients"]

    return HeldBytes()


def _traced(config, regime: str, vision: str, pixels, grid, blocks: int, images: int, checkpointed: bool = False,
            offloaded: bool = False, audio: bool = False, adapters: tuple[int, int, float] | None = None) -> dict:
    """Live bytes of the tower of `blocks` blocks (Gemma 4's audio tower, with `audio`) on `images` copies of the
    input `pixels` on `grid` (real tensors, the run's dtype), its blocks `checkpointed` (their inputs `offloaded`, the
    store's memory counted as host memory) as `longfit.memory.apply.checkpoint_tower` does in the run, with LoRA's
    `adapters` (`_trace_table`)."""
    import contextlib

    import torch

    from longfit.memory.checkpointing import ActivationOffloader, apply_tower_checkpointing, tower_blocks
    from longfit.memory.offload import OffloadStore
    from longfit.plan.tracker import count_as_host

    torch.manual_seed(0)
    dtype = torch.bfloat16 if regime == "bf16" else torch.float32
    encoder = _vision(config, blocks, vision, dtype, adapters, audio)
    tower = encoder.towers()[-1 if audio else 0][0]
    if audio:  # the idle vision side keeps no (zero) gradients here: `tower_costs` adds them where a step has them
        from longfit.models.media_gemma4 import AUDIO_PARTS

        for name, part in encoder.vision.items():
            if name not in AUDIO_PARTS:
                part.requires_grad_(False)
    trains = any(p.requires_grad for p in encoder.parameters())
    pixel_values, grid_thw = torch.cat([pixels] * images), grid.repeat(images, 1)
    tracker = _held_bytes()
    offloader = ActivationOffloader(store=OffloadStore(layers=blocks)) if checkpointed and offloaded else None
    if offloader is not None:
        count_as_host(offloader, tracker)
    if checkpointed:
        apply_tower_checkpointing(tower, blocks, offloader)
    # The backward's peak is taken in three windows, each growing with the blocks and the images on its own (a
    # weight gradient's temporary, constant, outgrows a block's recompute on one image, not on many): through the
    # projector, until the last block's output has its gradient; through the blocks, until the first one's input has
    # its gradient (the last block's recompute holds every other block's saved input); the rest.
    ends = []  # the last block's output, the first block's input
    listed = tower_blocks(tower, blocks)
    blocks_train = any(p.requires_grad for block in listed for p in block.parameters())  # else they save nothing
    catches = [listed[-1].register_forward_hook(lambda _, args, out: ends.insert(0, _first_tensor(out))),
               listed[0].register_forward_pre_hook(
                   lambda _, args, kwargs: ends.append(_first_tensor((*args, *kwargs.values()))), with_kwargs=True)]
    with tracker:
        tracker.adopt(encoder.parameters(), "weights")
        tracker.adopt(encoder.buffers(), "weights")
        tracker.adopt([pixel_values, grid_thw], "batch")
        base = tracker.live
        tracker.reset_peak()
        grad = contextlib.nullcontext() if trains else torch.no_grad()
        with grad, torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
            # In bf16 the run's towers read their rows of FSDP2's bf16 cast of the batch's pixels (copied out of it:
            # `pixel_values[chosen]`, the cp deal's): this cast, freed once the towers return, stands for the rank's
            # copy of its rows, and the family's own copies are then in bf16 too.
            out = encoder.features(pixel_values.to(dtype), grid_thw)  # (N, H)
        for catch in catches:
            catch.remove()
        kept, forward = tracker.live - base, tracker.peak - base
        windows, gradients, held, made = [], [], [], []  # the backward's peaks in its windows, the gradients held
        # at each, the windows' peaks of what is not the parameters' gradients (`_bracket`), the gradients made by
        # each window's end
        if trains:
            incoming = torch.ones_like(out)
            before = tracker.live

            def window(*_) -> None:
                # the parameters' gradients at the peak (planned as model states) left out
                windows.append(max(tracker.peak - before, 0) + before - base - tracker.peak_by_tag.get("gradients", 0))
                gradients.append(tracker.peak_by_tag.get("gradients", 0))
                held.append(tracker.held_peak - base)
                made.append(tracker.by_tag["gradients"])
                tracker.reset_peak()

            hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.retag([p.grad], "gradients"))
                     for p in encoder.parameters() if p.requires_grad]
            hooks += [end.register_hook(window) for end in ends if end.requires_grad]
            tracker.reset_peak()
            with tracker.region("tower backward"):
                out.backward(incoming)
            window()
            for hook in hooks:
                hook.remove()
    if offloader is not None:
        offloader.store.close()
    # extended apart (`tower_costs`); a tower whose blocks take no gradient has one window, a frozen one none
    first = ends[-1] if ends else None  # the first block's input (its hidden states)
    return {"kept": kept, "forward": forward, "backward": dict(enumerate(windows)),
            "gradients": dict(enumerate(gradients)), "held": dict(enumerate(held)), "made": dict(enumerate(made)),
            "block_input": (first.numel() * first.element_size() // images  # of one image, as the blocks take it
                            if offloader is not None and first is not None and blocks_train else 0),
            "tokens": out.shape[0] // images,
            "output": out.numel() * out.element_size() // images,
            "pixel_bytes": pixels.numel() * pixels.element_size()}

