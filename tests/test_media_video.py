"""Rows with videos in them (#54): Qwen3.5's wrapper trained on video chats, exactly.

The checkpoint is tests/test_media.py's tiny Qwen3.5 wrapper with Qwen3.5's own video processor beside its image
processor (examples/video_qa.py's `write_tiny_qwen3_5_video`). Videos are made here as frame arrays: one a folder of
PNG frames, one an H.264 MP4 written and decoded by PyAV (sampled at the video processor's 2 frames a second). The
reference is transformers' own: `Qwen3VLProcessor` (Qwen3.5's processor) expands each conversation as rendered by the
checkpoint's chat template, with the timestamps of its frames, and the wrapper's own forward runs on its
`pixel_values_videos` / `video_grid_thw` / `mm_token_type_ids`, the MP4 decoded and sampled by transformers'
`load_video` (PyAV). Where torchvision is missing (these machines), the video processor class runs with its two
torchvision kernels done by Pillow (`longfit.data.video.pillow_video_processor`) on both sides, and the processor is
built past its class check of the video processor (which needs torchvision's classes to exist).

- longfit's rows hold the processor's ids, token types, patches and grids (every document of a packed row);
- the loss and every gradient (language model, and the tower and merger when they train) equal the wrapper's own
  forward on each conversation alone, fp32 and bf16 within the bound, one conversation and packed;
- cp=2 ring and Ulysses on gloo equal one process (slow);
- a video is never cut, and bad videos are one error line naming the file and the fix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from test_media import (  # noqa: E402
    IMAGE_SIZES, TEXT_ONLY, TOWER, as_wrapper_names, assert_ranks_equal_the_wrapper, cp_rank_step, image_batch,
    longfit_model, longfit_step,
)
from test_wrappers import LINEAR, QWEN_VISION, TEXT, WRAPPERS  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.data.documents import DataError  # noqa: E402
from longfit.data.media import IMAGE, VIDEO  # noqa: E402

FOLDER_FRAMES = (6, 64, 96)  # (frames, height, width): three temporal patches of 4 x 6 patches, 6 tokens each
CLIP_FRAMES, CLIP_FPS = (8, 48, 64), 4  # two seconds at 4 a second, sampled at 2 a second: frames 0, 2, 5, 7
VIDEO_CHAT = [{"role": "user", "content": [{"type": "video", "path": "clip"}, {"type": "text", "text": "what moves?"}]},
         {"role": "assistant", "content": "a dot"}]
MIXED = [{"role": "user", "content": [{"type": "text", "text": "both: "}, {"type": "image", "path": "im0.png"},
                                      {"type": "video", "path": "clip.mp4"}]},
         {"role": "assistant", "content": "noise"}]
ROWS = {"one conversation": ([VIDEO_CHAT], 96, 1), "packed": ([VIDEO_CHAT, TEXT_ONLY, MIXED, VIDEO_CHAT], 192, 2)}
"""Conversations -> (conversations, seq_len, rows a batch): a video chat alone, or two rows of packed chats (a video
chat, a text chat and a chat with an image and an MP4 video in the first; the video chat again in the second)."""
ROW_CASES = [pytest.param("one conversation", marks=pytest.mark.slow), "packed"]


@pytest.fixture(scope="session")
def qwen_video(tmp_path_factory) -> Path:
    from video_qa import write_tiny_qwen3_5_video

    return write_tiny_qwen3_5_video(tmp_path_factory.mktemp("qwen3_5-video"), dict(TEXT, **LINEAR), QWEN_VISION)


def frames(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    """(T, H, W, 3) uint8: a bright square moving over seeded noise, so that the frames differ."""
    count, height, width = shape
    video = np.random.default_rng(seed).integers(0, 128, (count, height, width, 3), dtype=np.uint8)
    for t in range(count):
        video[t, 8:24, 4 * t : 4 * t + 16] = 255
    return video


def write_rows(folder: Path, conversations: list) -> Path:
    """The conversations as a JSONL file beside their media: `clip` (a folder of frames), `clip.mp4`, the images."""
    from PIL import Image

    from video_qa import write_clip

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "clip").mkdir(exist_ok=True)
    for index, frame in enumerate(frames(FOLDER_FRAMES, 1)):
        Image.fromarray(frame).save(folder / "clip" / f"{index:03d}.png")
    write_clip(folder / "clip.mp4", list(frames(CLIP_FRAMES, 2)), CLIP_FPS)
    rng = np.random.default_rng(0)
    for index, (height, width) in enumerate(IMAGE_SIZES):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / f"im{index}.png")
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


@pytest.fixture(scope="module")
def video_rows(qwen_video, tmp_path_factory):
    """`video_rows(name)`: (the rows' JSONL file, the first batch longfit's reader makes of them), made once."""
    root, made = tmp_path_factory.mktemp("video-rows"), {}

    def rows(name: str):
        if name not in made:
            conversations, seq_len, micro_batch = ROWS[name]
            path = write_rows(root / name.replace(" ", "-"), conversations)
            made[name] = path, image_batch(qwen_video, path, seq_len, micro_batch)
        return made[name]

    return rows


# -- transformers' own processor and forward ------------------------------------------------------------------------

def transformers_processor(checkpoint: Path):
    """Qwen3.5's processor (`Qwen3VLProcessor`) of the checkpoint: its tokenizer and chat template, its Pillow image
    processor and its video processor (module docstring)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    from longfit.models.media import media_reader

    video_processor = media_reader(str(checkpoint)).video.processor
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)):
        return Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(checkpoint),
                                tokenizer=AutoTokenizer.from_pretrained(checkpoint), video_processor=video_processor)


def processed(processor, conversation: list, folder: Path):
    """transformers' inputs of one conversation: its chat template's text, its images (Pillow) and videos (a folder's
    frames as sampled at the video processor's rate; a file through `load_video`'s PyAV decoder and the video
    processor's sampling), expanded and processed by the processor."""
    from PIL import Image
    from transformers.video_utils import VideoMetadata, load_video

    images, videos, metadata = [], [], []
    for message in conversation:
        for part in message["content"] if isinstance(message["content"], list) else ():
            path = folder / part.get("path", "")
            if part["type"] == "image":
                images.append(Image.open(path).convert("RGB"))
            elif part["type"] == "video" and path.is_dir():
                files = sorted(path.iterdir())
                videos.append(np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files]))
                metadata.append(VideoMetadata(total_num_frames=len(files), fps=float(processor.video_processor.fps),
                                              frames_indices=list(range(len(files)))))
            elif part["type"] == "video":
                video, meta = load_video(str(path), backend="pyav",
                                         sample_indices_fn=processor.video_processor.sample_frames)
                videos.append(video)
                metadata.append(meta)
    text = processor.tokenizer.apply_chat_template(conversation, tokenize=False)
    return processor(text=[text], images=images or None, videos=videos or None, video_metadata=metadata or None,
                     do_sample_frames=False, return_tensors="pt")


def documents(batch):
    """(row, start, end) of each conversation of the rows, in order (not the padding after them: one token
    repeated, no targets)."""
    for row, spans in enumerate(batch.documents.rows):
        for start, end in spans:
            if batch.input_ids[row, start:end].unique().numel() > 1:
                yield row, start, end


def test_rows_hold_what_transformers_processor_makes(qwen_video, video_rows) -> None:
    """Every document of the packed rows: the processor's ids (timestamps and frame markers included), token types,
    patches and grids; the video's patch count as the video processor counts it from the sizes alone."""
    from longfit.models.media import media_reader

    processor = transformers_processor(qwen_video)
    path, batch = video_rows("packed")
    conversations = ROWS["packed"][0]
    media, patch_starts = batch.media, [0, *batch.media.grid_thw.prod(-1).cumsum(0).tolist()]
    item = 0
    for conversation, (row, start, end) in zip(conversations, documents(batch)):
        want = processed(processor, conversation, path.parent)
        ids = batch.input_ids[row, start:end]
        assert torch.equal(ids, want["input_ids"][0]), processor.tokenizer.decode(ids)
        assert torch.equal(media.token_types[row, start:end], want["mm_token_type_ids"][0].int())
        items = media.items_in(row, start, end)
        kinds = [int(media.token_types[b, s]) for b, s in media.item_starts[item : item + items]]
        pixels = {kind: [media.pixel_values[patch_starts[item + i] : patch_starts[item + i + 1]]
                         for i, k in enumerate(kinds) if k == kind] for kind in (IMAGE, VIDEO)}
        grids = {kind: [g.tolist() for g, k in zip(media.grid_thw[item : item + items], kinds) if k == kind]
                 for kind in (IMAGE, VIDEO)}
        if "pixel_values_videos" in want:  # one video a conversation here: its temporal patches, one item each
            assert torch.equal(torch.cat(pixels[VIDEO]), want["pixel_values_videos"])
            (t, h, w), = want["video_grid_thw"].tolist()
            assert grids[VIDEO] == [[1, h, w]] * t
        if "pixel_values" in want:
            assert torch.equal(torch.cat(pixels[IMAGE]), want["pixel_values"])
            assert grids[IMAGE] == want["image_grid_thw"].tolist()
        assert len(kinds) == len(grids[IMAGE]) + len(grids[VIDEO]) and (items > 0) == (len(want) > 3)
        item += items
    assert item == media.images
    # the counts longfit checks rows with (headers only) are the video processor's own
    reader = media_reader(str(qwen_video)).video
    for video, (count, height, width) in (("clip", FOLDER_FRAMES), ("clip.mp4", (4, *CLIP_FRAMES[1:]))):
        patches = reader.processor.get_num_of_video_patches(count, height, width)
        assert reader.tokens(path.parent / video) == patches // reader.processor.merge_size ** 2


MEDIA_INPUTS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
"""The pixels and grids of a conversation's processed inputs, in the order the wrapper's forward runs its tower on
them: its images, then its videos."""


def wrapper_step(checkpoint: Path, batch, rows: Path, conversations: list, autocast: bool = False,
                 attention: str = "eager", tower_at_once: bool = False) -> parity.Step:
    """The wrapper's own forward on each conversation alone, on transformers' processor's inputs; the labels
    (assistant turns) longfit's, on the same ids. `tower_at_once`: the wrapper's tower runs once, on every image and
    video of the batch, as longfit's does (`MediaEncoder.features`), each conversation's forward taking its part
    of that call's embeddings (a forward hook on the tower), and the tower's backward runs once after the last."""
    from transformers import AutoModelForImageTextToText

    processor = transformers_processor(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention)
    every_inputs = [dict(processed(processor, conversation, rows.parent)) for conversation in conversations]
    hook = None
    if tower_at_once:
        tower = model.model.visual
        parts = [(inputs[pixel_key], inputs[grid_key]) for inputs in every_inputs
                 for pixel_key, grid_key in MEDIA_INPUTS if pixel_key in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            pixels, grids = torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])
            embeddings = tower(pixels, grid_thw=grids).pooler_output  # (N, H): every item's embeddings in turn
        taken = embeddings.detach().requires_grad_()
        calls = iter(taken.split([int(g.prod(-1).sum()) // tower.spatial_merge_size**2 for _, g in parts]))

        def part_of_the_call(module, args, output):
            output.pooler_output = next(calls)
            return output

        hook = tower.register_forward_hook(part_of_the_call)
    loss = torch.zeros((), dtype=torch.float64)
    for inputs, (row, start, end) in zip(every_inputs, documents(batch)):
        assert torch.equal(inputs["input_ids"][0], batch.input_ids[row, start:end])
        inputs.pop("attention_mask", None)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(**inputs, use_cache=False).logits
        part = F.cross_entropy(logits[0].float(), batch.labels[row, start:end], reduction="sum")
        (part / batch.num_label_tokens).backward()
        loss += part.detach().double() / batch.num_label_tokens
    if hook is not None:
        hook.remove()
        assert next(calls, None) is None  # every part of the call taken by the forward that runs its images
        embeddings.backward(taken.grad)
    return parity.Step(loss.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})


def compared(checkpoint: Path, rows: str, video_rows, vision: str, autocast: bool = False):
    path, batch = video_rows(rows)
    conversations = ROWS[rows][0]
    loss_module = longfit_model(checkpoint, vision)
    got = longfit_step(loss_module, batch, autocast)
    truth = wrapper_step(checkpoint, batch, path, conversations)
    got = as_wrapper_names(got, loss_module, truth.grads)

    def trained(step: parity.Step) -> parity.Step:
        return parity.Step(step.loss, {n: g for n, g in step.grads.items() if n in got.grads})

    # bf16: transformers' own error also with its tower run once on all the batch's images and videos, as longfit
    # runs it: the CPU's LayerNorm backward on bf16 inputs sums its weight and bias gradients over the call's rows
    # with an error that grows with them (transformers' Qwen3.5 tower: block 0's norm1.bias 0.7% off the fp32
    # gradient image by image, 5.9% on ten images at once), which a GPU's sums in fp32 do not
    references = ([trained(wrapper_step(checkpoint, batch, path, conversations, True, a)) for a in ("eager", "sdpa")]
                  + [trained(wrapper_step(checkpoint, batch, path, conversations, True, tower_at_once=True))]
                  if autocast else [])
    return got, references, trained(truth)


@pytest.mark.parametrize("vision", [pytest.param("frozen", marks=pytest.mark.slow), "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
def test_loss_and_gradients_equal_the_wrapper(qwen_video, video_rows, rows: str, vision: str, one_thread) -> None:
    got, _, want = compared(qwen_video, rows, video_rows, vision)
    assert got.grads.keys() == want.grads.keys()
    assert any(n.startswith(TOWER) for n in got.grads) == (vision == "all")
    comparison = parity.compare_fp32(rows, got, want)
    assert comparison.worst[1] <= 2, comparison.line()  # tests/test_media.py's bound (the gated-delta layers)


@pytest.mark.slow  # five forwards of the wrapper beside longfit's: ~15 s on a busy 2-core machine
@pytest.mark.parametrize("rows", ["one conversation", "packed"])
def test_bf16_loss_and_gradients_are_within_the_bf16_bound(qwen_video, video_rows, rows: str, one_thread) -> None:
    got, references, truth = compared(qwen_video, rows, video_rows, "all", autocast=True)
    comparison = parity.compare_bf16(rows, got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()
    # the reference with the tower run once is the wrapper's computation: in fp32 it is the wrapper's step
    path, batch = video_rows(rows)
    at_once = wrapper_step(qwen_video, batch, path, ROWS[rows][0], tower_at_once=True)
    assert parity.compare_fp32(rows, at_once, truth).worst[1] <= 1


@pytest.mark.slow  # Qwen3.5-MoE's wrapper: the same as Qwen3.5's (its experts), ~10 s
def test_qwen3_5_moe_video_rows_equal_the_wrapper(tmp_path_factory, video_rows, one_thread) -> None:
    from video_qa import write_tiny_qwen3_5_video

    checkpoint = write_tiny_qwen3_5_video(tmp_path_factory.mktemp("qwen3_5_moe-video"),
                                          WRAPPERS["qwen3_5_moe"]["text_config"], QWEN_VISION, model_type="qwen3_5_moe")
    path = video_rows("packed")[0]
    conversations, seq_len, micro_batch = ROWS["packed"]
    batch = image_batch(checkpoint, path, seq_len, micro_batch)
    loss_module = longfit_model(checkpoint, "all")
    got = longfit_step(loss_module, batch)
    truth = wrapper_step(checkpoint, batch, path, conversations)
    got = as_wrapper_names(got, loss_module, truth.grads)
    want = parity.Step(truth.loss, {n: g for n, g in truth.grads.items() if n in got.grads})
    comparison = parity.compare_fp32("qwen3_5_moe, packed videos", got, want)
    assert comparison.worst[1] <= 2, comparison.line()


# -- under context parallelism --------------------------------------------------------------------------------------

@pytest.mark.slow  # two gloo ranks per case, each building the model and reading the videos
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_video_rows_equal_one_process(qwen_video, video_rows, method: str) -> None:
    from parallel_harness import run_distributed

    path, batch = video_rows("packed")
    conversations, seq_len, micro_batch = ROWS["packed"]
    results = run_distributed(cp_rank_step, 2, qwen_video, path, seq_len, micro_batch, method, "all")
    assert_ranks_equal_the_wrapper(results, batch, wrapper_step(qwen_video, batch, path, conversations), qwen_video,
                                   method)


# -- reading video rows ---------------------------------------------------------------------------------------------

def test_a_long_conversation_leaves_a_video_out_whole(qwen_video, tmp_path) -> None:
    """keep_end's window starting inside the video's placeholder (between two of its temporal patches) moves past the
    whole video, timestamps included, which is left out with all its frames."""
    chat = [{"role": "user", "content": [{"type": "video", "path": "clip"}, {"type": "text", "text": "and? "},
                                         {"type": "image", "path": "im1.png"}]}, {"role": "assistant", "content": "x"}]
    path = write_rows(tmp_path, [chat])
    whole = image_batch(qwen_video, path, 160)
    end = int((whole.labels != -100).nonzero()[-1, 1]) + 2
    second_patch = whole.media.item_starts[1][1]
    cut = image_batch(qwen_video, path, end - second_patch)  # the window starts at the video's second patch
    assert cut.media.images == 1 and cut.media.grid_thw.tolist() == whole.media.grid_thw[3:].tolist()
    video_end = whole.media.item_starts[2][1] + int(whole.media.grid_thw[2, 1:].prod()) // 4 + 1  # + <|vision_end|>
    assert torch.equal(cut.input_ids[0, : end - video_end], whole.input_ids[0, video_end:end])


def test_video_sampling_follows_data_video_fps_and_max_frames(qwen_video, video_rows) -> None:
    """The video processor's sampling (headers only): 8 frames at 4 a second are 2 seconds, 4 frames at its 2 a
    second, all 8 at data.video_fps=4, the first and last at data.video_max_frames=2; a folder's 6 frames all."""
    from longfit.config import load_config
    from longfit.models.media import media_reader

    folder = video_rows("packed")[0].parent
    reader = media_reader(str(qwen_video))
    sampled = {}
    for name, options in {"default": [], "fps": ["data.video_fps=4"], "max": ["data.video_max_frames=2"]}.items():
        video = reader.sampled(load_config(None, options).data).video
        sampled[name] = video.metadata(folder / "clip.mp4").frames_indices.tolist()
        patches, _ = video.read(folder / "clip.mp4", pixels=False)
        assert len(patches) == -(-len(sampled[name]) // 2)  # two frames a temporal patch, the last one filled
    assert sampled == {"default": [0, 2, 5, 7], "fps": list(range(8)), "max": [0, 7]}
    assert reader.video.metadata(folder / "clip").frames_indices.tolist() == list(range(FOLDER_FRAMES[0]))


@pytest.mark.parametrize("problem, message", [
    ("missing", r"rows\.jsonl, line 1: video .*nowhere\.mp4 does not exist; fix the path"),
    ("undecodable", r"rows\.jsonl, line 1: video .*broken\.mp4 cannot be decoded .*re-encode it \(H\.264 MP4\)"),
    ("no decoder", r"rows\.jsonl, line 1: video .*clip\.mp4 needs a decoder: `pip install av` \(PyAV\)"),
    ("empty folder", r"rows\.jsonl, line 1: video folder .*empty holds no frame images"),
    ("one frame", r"rows\.jsonl, line 1: video .*single gives 1 frame\(s\), fewer than the 2 of one temporal patch"),
    ("too many tokens", r"rows\.jsonl, line 1: its images and videos take \d+ tokens, more than a row of "
                        r"seq_len=9 holds .*sample fewer frames \(data\.video_fps, data\.video_max_frames\)"),
])
def test_bad_video_rows_are_one_line_before_training(qwen_video, tmp_path, problem: str, message: str) -> None:
    from PIL import Image

    chat = json.loads(json.dumps(MIXED))
    video = {"missing": "nowhere.mp4", "undecodable": "broken.mp4", "empty folder": "empty", "one frame": "single"}
    if problem in video:
        chat[0]["content"][2]["path"] = video[problem]
    path = write_rows(tmp_path, [chat])
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    (tmp_path / "empty").mkdir()
    (tmp_path / "single").mkdir()
    Image.fromarray(frames((1, 32, 32), 3)[0]).save(tmp_path / "single" / "0.png")
    with mock.patch.dict(sys.modules, {"av": None} if problem == "no decoder" else {}):
        with pytest.raises(DataError, match=message):
            image_batch(qwen_video, path, {"too many tokens": 9}.get(problem, 256))


def test_a_checkpoint_without_a_video_processor_refuses_video_parts(tmp_path) -> None:
    from longfit.data.media import MediaReader, MediaSpec, check_media_rows

    reader = MediaReader(MediaSpec(image_token_id=1, video_token_id=2, merge_size=2), image_processor=None)
    rows = [("rows.jsonl, line 1", tmp_path, VIDEO_CHAT)]
    with pytest.raises(DataError, match=r"line 1: video .*clip: this checkpoint has no video processor"):
        check_media_rows(rows, reader, 64)


def test_an_epoch_of_video_rows_is_counted_from_the_headers_as_it_packs(qwen_video, video_rows) -> None:
    """count_epoch decodes no frame (each video's frames and size from its header, the video processor's sampling
    and resize rule), and packs the rows the trainer packs."""
    from longfit.config import load_config
    from longfit.data.packing import build_dataloader, count_epoch
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader

    path, _ = video_rows("packed")
    conversations, seq_len, _ = ROWS["packed"]
    cfg = load_config(None, [f"model={qwen_video}", f"data.path={path}", f"seq_len={seq_len}"])
    tokenizer, reader = load_tokenizer(str(qwen_video)), media_reader(str(qwen_video))
    loader = build_dataloader(cfg, tokenizer, epochs=1, media=reader)
    packed = list(loader)
    count = count_epoch(cfg, tokenizer, media=reader)
    assert (count.rows, count.tokens, count.documents) == (len(packed), loader.stats.tokens, len(conversations))
