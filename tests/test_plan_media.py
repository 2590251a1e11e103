"""`longfit plan` counts the vision side of an image-text checkpoint (#54, longfit.plan.media): the towers' weights,
gradients and optimizer state as `train.vision` trains them, the activations of a step's images on each rank (dealt
over the cp ranks) and their embeddings; the images read from the data (the packed row with the most images and
videos' temporal patches, as the packer packs it) or `data.plan_images`. The analytic plan is held to a real step of a
tiny Qwen3.5 wrapper with an image-heavy row, a row of short image chats and a row of video chats
(`longfit.plan.trace.trace_image_step`: gloo ranks, `LiveBytes`) within plan/accuracy.py's band, at cp=1 and cp=2,
and of a tiny Mistral 3 wrapper (its Pixtral tower, images of three sizes) at tp=1 and tp=2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

from longfit.config import ConfigError, load_config  # noqa: E402
from longfit.plan.accuracy import SAFE_BAND  # noqa: E402
from test_media import qwen_images  # noqa: E402,F401 -- the session fixture
from test_media_mistral3 import mistral3_images  # noqa: E402,F401 -- the session fixture

IMAGES, SIDE, SEQ_LEN = 8, 128, 512
SHORT_CHATS, CHAT_IMAGES = 20, 3
"""The packed data: 20 short chats of three images each, six of which share a row of SEQ_LEN tokens."""
VIDEO_FRAMES, VIDEO_CHATS = 8, 3
"""The video data: three short chats of a video each, a folder of eight 128 x 128 frames (four temporal patches of 8 x 8
patches, 16 tokens each)."""


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 wrapper whose tower has 3 blocks (the plan extends a trace of 1 and 2 to them) and reads images
    up to 128 x 128 pixels (64 patches, 16 tokens), and videos with Qwen3.5's video processor, up to 128 x 128 x 16
    pixels a video."""
    from test_wrappers import LINEAR, QWEN_VISION, TEXT
    from transformers import Qwen2VLImageProcessorPil
    from video_qa import TINY_VIDEO, write_tiny_qwen3_5_video

    path = tmp_path_factory.mktemp("qwen3_5-towers")
    write_tiny_qwen3_5_video(path, dict(TEXT, **LINEAR), dict(QWEN_VISION, depth=3, hidden_size=64,
                                                                 intermediate_size=128),
                             video=dict(TINY_VIDEO, size={"shortest_edge": 32 * 32 * 2, "longest_edge": SIDE * SIDE * 16}))
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
                             max_pixels=SIDE * SIDE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """One chat: long text, then IMAGES noise pages and a question; longer than a row, so that its end (keep_end)
    fills the row as one document."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("image-rows")
    rng = np.random.default_rng(0)
    parts = [{"type": "text", "text": "context " * 300}]
    for index in range(IMAGES):
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(folder / f"p{index}.png")
        parts.append({"type": "image", "path": f"p{index}.png"})
    parts.append({"type": "text", "text": "Which page holds the key?"})
    chat = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Page 1."}]}
    (folder / "rows.jsonl").write_text(json.dumps(chat) + "\n")
    return folder / "rows.jsonl"


def noise_images(folder: Path, names: list[str], seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name in names:
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(folder / name)


def chat(parts: list[dict], question: str, answer: str) -> str:
    content = [*parts, {"type": "text", "text": question}]
    return json.dumps({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]})


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """SHORT_CHATS chats of CHAT_IMAGES noise images each: no chat is longer than a fifth of a row, so the packer puts
    several of them in one."""
    folder = tmp_path_factory.mktemp("packed-image-rows")
    names = [f"p{index}.png" for index in range(CHAT_IMAGES)]
    noise_images(folder, names, 1)
    parts = [{"type": "image", "path": name} for name in names]
    (folder / "rows.jsonl").write_text("".join(chat(parts, f"Which page, {index}?", "The first.") + "\n"
                                               for index in range(SHORT_CHATS)))
    return folder / "rows.jsonl"


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """VIDEO_CHATS chats of one video each (a folder of VIDEO_FRAMES noise frames), packed into one row."""
    folder = tmp_path_factory.mktemp("video-rows")
    (folder / "clip").mkdir()
    noise_images(folder / "clip", [f"{index:03d}.png" for index in range(VIDEO_FRAMES)], 2)
    (folder / "rows.jsonl").write_text("".join(chat([{"type": "video", "path": "clip"}], f"What moves, {index}?",
                                                    "Noise.") + "\n" for index in range(VIDEO_CHATS)))
    return folder / "rows.jsonl"


def first_row(given: list[str]):
    """The trainer's first row of `given`'s data (the row the traced step runs)."""
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader

    cfg = load_config(None, given)
    return next(build_dataloader(cfg, load_tokenizer(cfg.model), epochs=1, media=media_reader(cfg.model)))


def test_the_plan_counts_the_heaviest_row_the_packer_makes(wrapper, packed) -> None:
    """Six short chats share the first row: the plan counts their 18 images (not one chat's 3), as many as the
    trainer's row holds, and names the row."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    given = overrides(wrapper, packed, 1, "frozen")
    row = first_row(given)
    planned = plan_config(load_config(None, given), 1).setup
    towers = tower_costs(planned)
    chats = row.media.images // CHAT_IMAGES
    assert row.media.images == CHAT_IMAGES * chats and chats > 1
    assert (planned.images.count, towers.batch_images) == (row.media.images, row.media.images)
    assert towers.embeddings == int((row.media.embedding_index >= 0).sum())
    assert f"row 1 of the first epoch: {chats} chats, {row.media.images} images" in planned.images.source


def test_the_heaviest_row_is_the_packers_row_with_the_most_images(wrapper, tmp_path) -> None:
    """Chats of one image, then chats of three, drawn through a shuffle buffer: `heaviest_media_row` is the row of the
    trainer's epoch with the most images (not the first), and reading fewer tokens says so."""
    from longfit.data.packing import build_dataloader, heaviest_media_row
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader

    names = [f"p{index}.png" for index in range(CHAT_IMAGES)]
    noise_images(tmp_path, names, 3)
    counts = [1] * SHORT_CHATS + [CHAT_IMAGES] * SHORT_CHATS  # the rows of three-image chats come later
    (tmp_path / "rows.jsonl").write_text("".join(
        chat([{"type": "image", "path": name} for name in names[:count]], f"Which page, {index}?", "One.") + "\n"
        for index, count in enumerate(counts)))
    cfg = load_config(None, overrides(wrapper, tmp_path / "rows.jsonl", 1, "frozen") + ["data.shuffle_buffer=4"])
    tokenizer, reader = load_tokenizer(str(wrapper)), media_reader(str(wrapper))
    rows = [batch.media.images for batch in build_dataloader(cfg, tokenizer, epochs=1, media=reader)]
    heaviest = heaviest_media_row(cfg, tokenizer, reader)
    assert (heaviest.index, heaviest.images, heaviest.rows, heaviest.complete) == \
        (rows.index(max(rows)), max(rows), len(rows), True) and rows.index(max(rows)) > 0
    first = heaviest_media_row(cfg, tokenizer, reader, max_tokens=1)
    assert (first.index, first.images, first.rows, first.complete) == (0, rows[0], 1, False)


SHUFFLED_COUNTS, SHUFFLED_SEED = (1, 3, 1, 1, 2, 1, 3, 1, 1, 1, 2, 1), 1
"""Chats of these many images, drawn through a shuffle buffer of 4 under train.seed=1: the second epoch's draw packs a
row with more images than any of the first epoch's (asserted)."""


def test_the_plan_reads_every_epoch_a_shuffled_run_trains_on(wrapper, tmp_path) -> None:
    """Under data.shuffle_buffer each epoch packs its own rows: the heaviest row and the most padded row are those of
    every epoch the run trains (train.epochs, or the epochs train.steps' rows reach), not the first epoch's alone."""
    from longfit.data.packing import build_dataloader, heaviest_media_row, trained_epochs
    from longfit.models.linear_attention import CHUNK
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader
    from longfit.plan.analytic import plan_config
    from longfit.plan.padding import padded, row_padding

    names = [f"p{index}.png" for index in range(CHAT_IMAGES)]
    noise_images(tmp_path, names, 3)
    (tmp_path / "rows.jsonl").write_text("".join(
        chat([{"type": "image", "path": name} for name in names[:count]], f"Which page, {index}?", "One.") + "\n"
        for index, count in enumerate(SHUFFLED_COUNTS)))
    given = overrides(wrapper, tmp_path / "rows.jsonl", 1, "frozen") + ["data.shuffle_buffer=4",
                                                                        f"train.seed={SHUFFLED_SEED}"]
    tokenizer, reader = load_tokenizer(str(wrapper)), media_reader(str(wrapper))
    cfg = load_config(None, given + ["train.epochs=2", "train.steps=0"])
    first = list(build_dataloader(cfg, tokenizer, epochs=1, media=reader))
    both = list(build_dataloader(cfg, tokenizer, epochs=2, media=reader))
    images = [batch.media.images for batch in both]
    assert max(images) > max(images[: len(first)])  # the data's premise: the second epoch packs a heavier row
    assert trained_epochs(cfg, tokenizer, reader, 0) == 2
    assert heaviest_media_row(cfg, tokenizer, reader, epochs=2).images == max(images)
    planned = plan_config(cfg, 1).setup.images
    assert planned.count == max(images)
    assert f"row {images.index(max(images)) + 1} of the 2 epochs the run trains on" in planned.source
    lengths = [[end - start for start, end in batch.documents.rows[0]] for batch in both]
    assert row_padding(cfg, CHUNK).slots == max(padded(row, CHUNK) for row in lengths)
    # train.steps: one step a row here, so a step past the first epoch's rows reads the second epoch's draw
    assert plan_config(load_config(None, given + [f"train.steps={len(first) + 1}"]), 1).setup.images.count == \
        max(images)
    assert trained_epochs(load_config(None, given + [f"train.steps={len(first)}"]), tokenizer, reader,
                          len(first)) == 1
    unshuffled = load_config(None, given[:-2] + ["train.epochs=2", "train.steps=0"])
    assert trained_epochs(unshuffled, tokenizer, reader, 0) == 1  # each epoch packs the first one's rows again


def test_the_plan_counts_a_rows_videos_as_the_reader_does(wrapper, videos) -> None:
    """A video's temporal patches are the tower's inputs: the plan counts the row's patches and their tokens, as
    many as the reader gives (from the frames' headers) and the trainer's row holds."""
    from longfit.data.video import VideoReader
    from longfit.models.media import media_reader
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs, tower_notes

    given = overrides(wrapper, videos, 1, "frozen")
    row = first_row(given)
    video: VideoReader = media_reader(str(wrapper)).videos(videos.parent / "clip")
    tokens = video.tokens(videos.parent / "clip")
    planned = plan_config(load_config(None, given), 1).setup
    towers = tower_costs(planned)
    assert tokens == (VIDEO_FRAMES // 2) * 16 and row.media.images == VIDEO_CHATS * VIDEO_FRAMES // 2
    assert (planned.images.count, planned.images.video_patches, planned.images.video_tokens) == \
        (row.media.images, row.media.images, 16)
    assert towers.embeddings == int((row.media.embedding_index >= 0).sum()) == VIDEO_CHATS * tokens
    assert tower_notes(planned)[0].startswith(f"vision side counted for {row.media.images} tower inputs (images and "
                                              f"videos' temporal patches) a row (data.path: its packed row with the "
                                              f"most tower inputs, row 1 of the first epoch: {VIDEO_CHATS} chats, "
                                              f"{row.media.images} video temporal patches")


def test_a_video_patch_is_traced_on_its_patch_count(wrapper, videos) -> None:
    """The plan traces a video's temporal patch on a grid one merged patch tall: the tower holds what it holds on the
    grid the video processor makes (8 x 8 patches here), kept, forward and backward, in fp32 and bf16."""
    from longfit.models.model_config import read_config
    from longfit.plan.media import _tower_input, _traced

    row = first_row(overrides(wrapper, videos, 1, "all"))
    made = row.media.grid_thw[:1]  # (1, 3)
    config = read_config(str(wrapper)).config
    pixels, planned = _tower_input(str(wrapper), config, (SIDE, SIDE), None, 16)
    assert made.tolist() == [[1, 8, 8]] and planned.tolist() == [[1, 2, 32]]
    assert pixels.shape == row.media.pixel_values[: 64].shape and pixels.dtype == row.media.pixel_values.dtype
    for regime in ("fp32", "bf16"):
        assert _traced(config, regime, "all", pixels, planned, 2, 2) == _traced(config, regime, "all", pixels, made, 2, 2)


def overrides(wrapper: Path, rows: Path | None, cp: int, vision: str, dtype: str = "fp32") -> list[str]:
    data = [f"data.path={rows}"] if rows else []
    return [f"model={wrapper}", *data, f"seq_len={SEQ_LEN}", f"parallel.cp={cp}", f"train.vision={vision}",
            f"train.dtype={dtype}", "eval.retrieval=false"]


def test_the_data_decides_the_images_and_the_plan_counts_the_towers(wrapper, rows, tmp_path) -> None:
    """The chat's 8 images are planned; the image run's plan holds the towers' weights and their activations beside
    the language model's, the trained tower more than the frozen one."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    # a text row of one document filling the row, as the image chat's (a row's documents are padded: plan/padding.py)
    long_text = {"messages": [{"role": "user", "content": "context " * 600}, {"role": "assistant", "content": "1."}]}
    (tmp_path / "text.jsonl").write_text(json.dumps(long_text) + "\n")
    text = plan_config(load_config(None, overrides(wrapper, tmp_path / "text.jsonl", 1, "frozen")), 1)
    frozen = plan_config(load_config(None, overrides(wrapper, rows, 1, "frozen")), 1)
    trained = plan_config(load_config(None, overrides(wrapper, rows, 1, "all")), 1)
    assert text.setup.images is None
    assert (frozen.setup.images.count, frozen.setup.images.size) == (IMAGES, (SIDE, SIDE))
    towers = tower_costs(frozen.setup)
    assert (towers.images, towers.embeddings, towers.trained) == (IMAGES, IMAGES * 16, 0)
    assert frozen.breakdown["weights"] == text.breakdown["weights"] + 4 * towers.params
    assert text.tensor_bytes < frozen.tensor_bytes < trained.tensor_bytes


def test_planned_images_without_data_and_their_refusals(wrapper) -> None:
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    planned = plan_config(load_config(None, overrides(wrapper, None, 2, "all")
                                      + ["data.plan_images=3", f"data.plan_image_size={SIDE}x{SIDE}"]), 2)
    towers = tower_costs(planned.setup)
    assert (towers.batch_images, towers.images) == (3, 2)  # dealt over the two ranks, the busiest holds two
    with pytest.raises(ConfigError, match=r"^data.plan_image_size='448': give HEIGHTxWIDTH in pixels"):
        load_config(None, [f"model={wrapper}", "data.plan_images=2", "data.plan_image_size=448"])
    with pytest.raises(ConfigError, match=r"^data.plan_images=40 of 448x448: 40 images of 16 tokens each are more "
                                          r"than a row of seq_len=512 holds"):
        plan_config(load_config(None, overrides(wrapper, None, 1, "all") + ["data.plan_images=40"]), 1)
    with pytest.raises(ConfigError, match=r"the llama checkpoint's image rows cannot be trained yet"):
        plan_config(load_config(None, ["model=llama-tiny", "data.plan_images=2"]), 1)


def _traced_rank(rank: int, world: int, workdir: str, options: dict) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from longfit.bench.cp import write_rank_result
    from longfit.plan.trace import trace_image_step

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=10))
    try:
        result = trace_image_step(load_config(None, options["overrides"]))
        write_rank_result(workdir, rank, world, {"peak": result.peak_bytes})
    finally:
        if world > 1:
            dist.destroy_process_group()


TRACED_ROWS = [(data, cp, vision, dtype) for cp in (1, 2) for vision in ("frozen", "all") for dtype in ("fp32", "bf16")
               for data in ("rows",)] + [
    (data, cp, "all", dtype) for data in ("packed", "videos") for cp, dtype in ((1, "fp32"), (2, "fp32"), (2, "bf16"))]
"""(data, cp, train.vision, train.dtype): the long chat's row in every setting; the packed row of short chats and the
row of video chats with the tower trained (their Gated DeltaNet layers' padding of each chat to whole chunks counted,
plan/padding.py: before, 9-16% and 4-5% low), at cp=1 and cp=2 in fp32 and at cp=2 in bf16,
where FSDP2's cast of the batch's pixels to bf16 lives until the loss (`_cast_pixels`: this wrapper's peak)."""


# measured on the shared 2-core machine (load 10-12, 613 s wall for the 8 `rows`): cp=1 28-63 s, cp=2 75-123 s a case
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("data, cp, vision, dtype", TRACED_ROWS)
def test_the_plan_of_an_image_row_is_the_traced_steps(request, wrapper, data: str, cp: int, vision: str,
                                                      dtype: str) -> None:
    """The plan of a row (a long chat's 8 images, 6 short chats' 18 images sharing a row, 3 chats' videos) within the
    band of a real traced step of it."""
    assert_plan_within_the_band(overrides(wrapper, request.getfixturevalue(data), cp, vision, dtype), cp)


def assert_plan_within_the_band(given: list[str], cp: int) -> None:
    """The analytic plan of `given` within plan/accuracy.py's band of its traced step on `cp` gloo ranks."""
    from longfit.bench.cp import run_degree
    from longfit.plan.analytic import plan_config

    traced = max(rank["peak"] for rank in run_degree(_traced_rank, cp, {"overrides": given}))
    analytic = plan_config(load_config(None, given), cp).tensor_bytes
    under, over = SAFE_BAND
    assert under <= analytic / traced - 1 <= over, (analytic, traced)


# measured on the shared 2-core machine (load 8-10): 345 s wall, 55 CPU s for the two
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_plan_of_a_lora_image_row_on_one_rank_is_the_traced_steps(wrapper, rows, dtype: str) -> None:
    """The long chat's row with LoRA on one rank, the tower trained: the bf16 run holds its base in bf16 and its
    adapters in fp32 under autocast (`longfit.models.build.use_lora_storage`, `autocast_dtype`), which also runs the
    Gated DeltaNet's fp32 scan in bf16, as its layers are traced (`TraceKey.lora_autocast`; before, traced in bf16
    without autocast: 5.6% over)."""
    assert_plan_within_the_band(overrides(wrapper, rows, 1, "all", dtype) + ["lora.enabled=true"], 1)


WRITERS = {"qwen3_5_moe": ("document_qa", "write_tiny_qwen3_5"), "gemma3": ("test_media_gemma3", "write_tiny_gemma3"),
           "gemma4": ("test_media_gemma4", "write_tiny_gemma4"),
           "mistral3": ("test_media_mistral3", "write_tiny_mistral3")}


# measured under load 10-12 beside another test run: 19-49 s a case (mistral3-fp32 20 s)
@pytest.mark.parametrize("family, dtype", [
    pytest.param(family, dtype, marks=() if (family, dtype) == ("mistral3", "fp32") else (pytest.mark.slow,))
    for family in sorted(WRITERS) for dtype in ("fp32", "bf16")])
def test_every_family_with_images_has_its_towers_planned(tmp_path, family: str, dtype: str) -> None:
    """Each image family's vision side is traced by its own encoder and image processor (its pixels' layout: whole
    images, padded patches, rows with breaks) and counted at cp=2, the tower trained."""
    import importlib

    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    module, name = WRITERS[family]
    if family == "qwen3_5_moe":
        from document_qa import write_tiny_qwen3_5
        from test_wrappers import WRAPPERS

        checkpoint = write_tiny_qwen3_5(tmp_path / family, WRAPPERS[family]["text_config"],
                                        WRAPPERS[family]["vision_config"], model_type=family)
    else:
        checkpoint = getattr(importlib.import_module(module), name)(tmp_path / family)
    given = [f"model={checkpoint}", "seq_len=1024", "parallel.cp=2", "train.vision=all", f"train.dtype={dtype}",
             "data.plan_images=3", "data.plan_image_size=64x48", "eval.retrieval=false"]
    text = plan_config(load_config(None, given[:-3] + ["eval.retrieval=false"]), 2)
    planned = plan_config(load_config(None, given), 2)
    towers = tower_costs(planned.setup)
    assert (towers.batch_images, towers.images) == (3, 2) and towers.trained == towers.params > 0
    assert towers.kept > 0 and towers.embeddings > 0
    assert planned.breakdown["weights"] > text.breakdown["weights"]
    assert planned.tensor_bytes > text.tensor_bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_images_of_the_eval_data_are_planned_as_the_evaluation_runs_them(wrapper, rows, packed, tmp_path,
                                                                         dtype: str) -> None:
    """Text-only training rows, eval rows with images (data.eval_path): the trainer builds the vision side for them,
    so the plan counts its weights for the whole run (no gradient, no optimizer state: no training row runs it) and
    an evaluation's tower forward on the eval data's heaviest row after a step, without autograd; beside training
    rows with images, the evaluation's forward alone. That forward's planned peak is the one `LiveBytes` counts running
    the tower without autograd on the first eval batch (the heaviest: 18 images of 6 chats) or up to a fifth over it:
    a frozen tower's fp32 trace holds its first block's input through its forward (`_traced`'s hook), one hidden
    state an image, doubled by the extension from one and two blocks to three (16% here; 0.01% under in bf16)."""
    from dataclasses import replace

    import torch

    from longfit.data.packing import EvalData
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import build_media_encoder, media_reader
    from longfit.plan.analytic import model_states, plan_config
    from longfit.plan.media import eval_images, eval_tower_costs, tower_costs, tower_notes
    from longfit.plan.tracker import LiveBytes

    long_text = {"messages": [{"role": "user", "content": "context " * 600}, {"role": "assistant", "content": "1."}]}
    (tmp_path / "text.jsonl").write_text(json.dumps(long_text) + "\n")
    given = overrides(wrapper, tmp_path / "text.jsonl", 1, "frozen", dtype)
    text = plan_config(load_config(None, given), 1)
    assert tower_notes(text.setup) == []
    cfg = load_config(None, given + [f"data.eval_path={packed}"])
    planned = plan_config(cfg, 1)
    assert planned.setup.images is None and tower_costs(planned.setup) is None
    # a preference objective's eval_path holds pairs, read as held-out pairs without images
    assert eval_images(replace(cfg, train=replace(cfg.train, objective="dpo"))) is None
    towers = eval_tower_costs(planned.setup)
    assert (towers.batch_images, towers.images, towers.trained) == (6 * CHAT_IMAGES, 6 * CHAT_IMAGES, 0)
    (weights, gradients, optimizer), (text_weights, *text_rest) = map(model_states, (planned.setup, text.setup))
    assert weights == text_weights + 4 * towers.params and [gradients, optimizer] == text_rest
    assert {"eval: vision tower forward", "eval: image embeddings into the sequence"} <= {
        event for event, *_ in planned.events}
    (note,) = tower_notes(planned.setup)
    assert note.startswith(f"vision side counted for the eval rows' 18 images a row (data.eval_path: its packed row "
                           f"with the most tower inputs, row 1 of the first epoch: 6 chats, 18 images, 288 image and "
                           f"audio tokens; each planned at its largest image's size ({SIDE}x{SIDE})), the training rows "
                           f"holding none: {towers.params / 1e6:.1f}M parameters")

    trained = overrides(wrapper, rows, 1, "frozen", dtype)  # the training rows' 8 images beside the eval rows'
    training, both = (plan_config(load_config(None, items), 1) for items in (trained, trained + [
        f"data.eval_path={packed}"]))
    assert model_states(both.setup) == model_states(training.setup) and len(tower_notes(both.setup)) == 2
    assert "eval: vision tower forward" in {event for event, *_ in both.events}

    media = media_reader(cfg.model)
    batch = next(iter(EvalData(cfg, load_tokenizer(cfg.model), media).loader(1)))
    encoder = build_media_encoder(cfg.model, "cpu")
    tracker = LiveBytes()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"), tracker:
        tracker.adopt([*encoder.parameters(), *encoder.buffers(), batch.media.pixel_values], "before")
        before = tracker.live
        encoder.features(batch.media.pixel_values, batch.media.grid_thw)
    measured = tracker.peak - before
    assert (1 + SAFE_BAND[0]) * measured <= towers.forward <= 1.2 * measured


@pytest.mark.parametrize("family, dtype", [(family, dtype) for family in ("qwen3_5", "mistral3")
                                           for dtype in ("fp32", "bf16")])
def test_the_towers_costs_at_many_images_a_rank_are_its_traces_there(request, family: str, dtype: str) -> None:
    """At 16 and 48 images a rank (a row of page images), beyond the three the tower is traced on, the plan's tower
    (its blocks checkpointed and trained, 64 x 64 images; one block, whose checkpointed backward holds no other
    block's input) keeps, peaks in its forward and in its backward within the plan's band of the tower traced on as
    many (`_traced`). Before (#54), each backward window was extended quadratically from one to three images: the
    Qwen3.5 wrapper's backward 0.80 MB at 48 where it holds 2.12 MB, Mistral 3's 98.9 MB where 48.8."""
    from transformers import AutoConfig

    from longfit.plan import media

    checkpoint = str(request.getfixturevalue({"qwen3_5": "qwen_images", "mistral3": "mistral3_images"}[family]))
    table = media._trace_table(checkpoint, dtype, "all", (64, 64), None, 0, checkpointed=True)
    config = AutoConfig.from_pretrained(checkpoint)
    pixels, grid = media._tower_input(checkpoint, config, (64, 64), None, 0)
    for images in (16, 48):
        # one rank running them all; not offloaded, so nothing of the planned run but the traces is read
        costs, _ = media._part_costs(None, table, [1.0] * images, [1.0] * images, list(range(images)))
        held = media._traced(config, dtype, "all", pixels, grid, table["depth"], images, checkpointed=True)
        for planned, measured in ((costs.kept, held["kept"]), (costs.forward, held["forward"]),
                                  (costs.backward, max(held["backward"].values()))):
            assert SAFE_BAND[0] <= planned / measured - 1 <= SAFE_BAND[1], (images, planned, measured)


@pytest.fixture(scope="module")
def qwen_three_blocks(tmp_path_factory) -> Path:
    """The tiny Qwen3.5 wrapper (`qwen_images`'s) with its tower three blocks deep."""
    from document_qa import write_tiny_qwen3_5
    from test_wrappers import LINEAR, QWEN_VISION, TEXT

    return write_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5-three-blocks"), dict(TEXT, **LINEAR),
                              dict(QWEN_VISION, depth=3))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_deeper_checkpointed_towers_backward_is_its_trace(qwen_three_blocks, dtype: str) -> None:
    """A checkpointed, trained tower three blocks deep (the plan traces one and two): its backward at 3 images a rank
    is the tower traced as deep on as many, at 16 within the plan's band over it. Through the blocks the first block's
    backward, holding the blocks' weight gradients, peaks here, not the last block's recompute with the other blocks'
    inputs waiting; before (#54) every backward window was planned at least at the second: fp32 +5.6% at 3 images and
    +9.7% at 16, bf16 +2.4% and +2.9%."""
    from transformers import AutoConfig

    from longfit.plan import media

    checkpoint = str(qwen_three_blocks)
    table = media._trace_table(checkpoint, dtype, "all", (64, 64), None, 0, checkpointed=True)
    config = AutoConfig.from_pretrained(checkpoint)
    pixels, grid = media._tower_input(checkpoint, config, (64, 64), None, 0)
    assert table["depth"] == 3
    for images in (3, 16):
        costs, _ = media._part_costs(None, table, [1.0] * images, [1.0] * images, list(range(images)))
        held = media._traced(config, dtype, "all", pixels, grid, 3, images, checkpointed=True)
        over = costs.backward / max(held["backward"].values()) - 1
        assert abs(over) < 1e-9 if images == 3 else 0 <= over <= SAFE_BAND[1], (images, over)


def mistral3_rows(folder: Path, rows: str) -> Path:
    """Mistral 3's packed rows (tests/test_media_mistral3.py: images of three sizes, one row of one, one of three),
    or rows that are all alike (chats of its largest image twice)."""
    from test_media import write_rows
    from test_media_mistral3 import ROWS

    parts = [*[{"type": "image", "path": "im1.png"}] * 2, {"type": "text", "text": "what?"}]
    twice = [{"role": "user", "content": parts}, {"role": "assistant", "content": "noise"}]
    return write_rows(folder, ROWS["packed"][0] if rows == "packed" else [twice] * 4)


MISTRAL3_ROWS = [("alike", tp, dtype) for tp in (1, 2) for dtype in ("fp32", "bf16")] + [("packed", 1, "fp32")]
"""(rows, tp, train.dtype) of the tiny Mistral 3 wrapper, two rows a micro-batch, its tower trained: its Pixtral
tower runs every image in one sequence under a mask over all of their patches (traced at 1, 2 and 3 images: before,
2.1-2.5% low at 4 images), and the packed rows' images of three sizes are planned as the heaviest micro-batch holds
them (before, each row as the heaviest at the largest size: 9.3% high)."""


# measured on the shared 2-core machine (load 2-4): tp=1 10-16 s, tp=2 21-27 s a case
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("rows, tp, dtype", MISTRAL3_ROWS)
def test_the_plan_of_a_mistral3_image_row_is_the_traced_steps(mistral3_images, tmp_path, rows: str, tp: int,
                                                              dtype: str) -> None:
    """Mistral 3's image rows, its language model under tensor parallelism, within the band of a real traced step."""
    from longfit.bench.cp import run_degree
    from longfit.plan.analytic import plan_config

    given = [f"model={mistral3_images}", f"data.path={mistral3_rows(tmp_path, rows)}", "seq_len=96",
             "train.micro_batch=2", f"parallel.tp={tp}", "train.vision=all", f"train.dtype={dtype}",
             "eval.retrieval=false"]
    traced = max(rank["peak"] for rank in run_degree(_traced_rank, tp, {"overrides": given}))
    analytic = plan_config(load_config(None, given), tp).tensor_bytes
    under, over = SAFE_BAND
    assert under <= analytic / traced - 1 <= over, (analytic, traced)


def test_a_micro_batchs_images_are_dealt_over_its_tp_ranks(mistral3_images, tmp_path) -> None:
    """The tp ranks hold the same rows: the run deals their images over them (`DealtMedia` over cp x tp), and so does
    the plan (before, every tp rank ran them all): the busiest rank's tower runs half of the micro-batch's images."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    given = [f"model={mistral3_images}", f"data.path={mistral3_rows(tmp_path, 'alike')}", "seq_len=96",
             "train.micro_batch=2", "train.vision=all", "eval.retrieval=false"]
    alone, split = (tower_costs(plan_config(load_config(None, [*given, f"parallel.tp={tp}"]), tp).setup)
                    for tp in (1, 2))
    assert alone.images == alone.batch_images == split.batch_images == 2 * split.images > 0
    assert split.kept < alone.kept and split.features == alone.features


@pytest.mark.parametrize("micro_batch, dp", [(2, 1), (1, 2)])
def test_the_heaviest_micro_batch_is_a_dp_ranks_batch_of_the_trainer(mistral3_images, tmp_path, micro_batch: int,
                                                                     dp: int) -> None:
    """The tower's work is planned for the trainer's micro-batch (a dp rank's rows) whose inputs take the most tokens,
    each input at its own size: Mistral 3's packed rows hold 1 and 3 images of three sizes."""
    from longfit.data.packing import build_dataloader, heaviest_media_row
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader
    from longfit.plan.media import step_images

    given = [f"model={mistral3_images}", f"data.path={mistral3_rows(tmp_path, 'packed')}", "seq_len=96",
             f"train.micro_batch={micro_batch}", "eval.retrieval=false"]
    cfg = load_config(None, given)
    tokenizer, reader = load_tokenizer(str(mistral3_images)), media_reader(str(mistral3_images))
    batches = [batch for rank in range(dp) for batch in build_dataloader(cfg, tokenizer, rank, dp, 1, reader)]
    heaviest = max(batches, key=lambda batch: int((batch.media.embedding_index >= 0).sum()))
    planned = heaviest_media_row(cfg, tokenizer, reader, dp_size=dp).batch_tokens
    assert len(planned) == heaviest.media.images == (4 if dp == 1 else 3)
    assert sorted(planned) == sorted(reader.image_tokens(tmp_path / f"im{index}.png") for index in
                                     ([0, 1, 2, 0] if dp == 1 else [1, 2, 0]))
    assert step_images(cfg, dp).batch_inputs == tuple(tokens / max(planned) for tokens in planned)
