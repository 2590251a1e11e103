"""Gemma 4's rows with audio and video (#54): its own audio tower and embedder on each audio's log-mel frames, its
vision tower on each sampled frame of a video, the embeddings in the audio and video tokens' place on each rank's
shard, exactly.

The family: test_media_gemma4's tiny `Gemma4ForConditionalGeneration` with transformers' default audio tower shrunk
(tests/test_wrappers.py's sizes), Gemma 4's audio tokens on the byte tokenizer, a chat template that writes an audio
part as the audio token, and Gemma 4's own feature extractor (`Gemma4AudioFeatureExtractor`, in processor_config.json
as Gemma4Processor saves it beside the image processor) and video processor (`Gemma4VideoProcessor`, loaded
with Pillow's resize in torchvision's place: `longfit.data.video.video_processor_class`). Audio is made here: sines
written as WAV files by the standard library's `wave`; a video is a folder of frames made from arrays, and the
wrapper's reference inputs of it are the video processor's own output on those arrays. The wrapper's reference features are the feature extractor's own output on the samples
`wave` reads (no PyAV), each conversation's audios padded as the feature extractor pads them; longfit's reader
decodes the files with PyAV. The loss and every gradient (the audio tower and its embedder included where they
train) equal the wrapper's own eager forward, each conversation of a packed row alone, in fp32 and within the bf16
bound; under cp=2 ring and Ulysses on gloo (slow) each rank's summed loss and gradients equal it too.
"""

from __future__ import annotations

import json
import sys
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from test_media import IMAGE_SIZES, ONE, TEXT_ONLY, as_wrapper_names, image_batch, longfit_model  # noqa: E402
from test_media_gemma3 import longfit_step  # noqa: E402
from test_media_gemma4 import GEMMA4_TOKENS, GLOBAL_SECOND, processed_images  # noqa: E402
from test_wrappers import WRAPPERS  # noqa: E402

from longfit.check import parity  # noqa: E402

AUDIO_TOKENS = ("<|audio>", "<audio|>", "<|audio|>")  # begin, end, the audio token
VIDEO_TOKEN = "<|video|>"
CLIP = (5, 64, 96)  # (frames, height, width) of the folder `clip`: 2 sampled (the processor's num_frames here)
RENDER = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<|image|>{%- elif part['type'] == 'audio' -%}<|audio|>"
    "{%- elif part['type'] == 'video' -%}<|video|>{%- else -%}"
    "{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)
"""Gemma 4's chat template's rendering of a content list (an image, audio or video part: its token), on the byte
tokenizer."""
AUDIOS = {"a0.wav": (0.5, 16_000, 1), "a1.wav": (0.9, 22_050, 2)}
"""name -> (seconds, sample rate, channels): one at the feature extractor's rate, one resampled and mixed to mono."""
HEARD = [{"role": "user", "content": [{"type": "audio", "path": "a0.wav"}, {"type": "text", "text": "what is it?"}]},
         {"role": "assistant", "content": "a tone"}]
BOTH = [{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image", "path": "im0.png"},
                                     {"type": "text", "text": " and hear: "}, {"type": "audio", "path": "a1.wav"}]},
        {"role": "assistant", "content": "a square and a tone"}]
SEEN = [{"role": "user", "content": [{"type": "video", "path": "clip"}, {"type": "text", "text": "what moves?"}]},
        {"role": "assistant", "content": "a square"}]
ROWS = {"one conversation": ([HEARD], 64, 1), "video": ([SEEN], 192, 1),
        "packed": ([HEARD, SEEN, TEXT_ONLY, BOTH, HEARD], 320, 2)}
KINDS = {"one conversation": [3], "video": [2, 2], "packed": [3, 2, 2, 1, 3, 3]}
"""The rows' items' token types: an audio (3), a video's two frames (2), an image (1)."""
AUDIO_TOWER = "model.audio_tower."


def write_tiny_gemma4_audio(path: Path, seed: int = 0, audio_depth: int | None = None, **audio) -> Path:
    """The tiny Gemma 4 wrapper with its audio tower (module docstring), `audio_depth` blocks deep where given, its
    config's other `audio` settings changed.
    transformers initialises both embedders' matrices to zeros (every embedding 0, no gradient into the towers): drawn
    with std 0.02."""
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForImageTextToText, Gemma4ImageProcessorPil
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    from longfit.data.tokenizer import CHAT_TEMPLATE, byte_tokenizer
    from longfit.data.video import video_processor_class
    from longfit.models.media import GEMMA4_VIDEO

    tokenizer = byte_tokenizer()
    names = (*GEMMA4_TOKENS, *AUDIO_TOKENS, VIDEO_TOKEN)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in names], special_tokens=True)
    tokenizer.chat_template = RENDER + CHAT_TEMPLATE.replace("message['content']", "render(message['content'])")
    ids = dict(zip(("boi_token_id", "eoi_token_id", "image_token_id", "boa_token_id", "eoa_token_index",
                    "audio_token_id", "video_token_id"), tokenizer.convert_tokens_to_ids(list(names))))
    torch.manual_seed(seed)
    family = WRAPPERS["gemma4"]
    text = dict(family["text_config"], use_bidirectional_attention="vision", layer_types=GLOBAL_SECOND,
                per_layer_config={"01": {"head_dim": 32}, "03": {"head_dim": 32}})
    config = AutoConfig.for_model("gemma4", text_config=text, vision_config=family["vision_config"],
                                  audio_config=dict(family["audio_config"], **({"num_hidden_layers": audio_depth}
                                                                                 if audio_depth else {}), **audio),
                                  **ids)
    model = AutoModelForImageTextToText.from_config(config)
    for embedder in (model.model.embed_vision, model.model.embed_audio):
        torch.nn.init.normal_(embedder.embedding_projection.weight, std=0.02)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Gemma4ImageProcessorPil(max_soft_tokens=70).save_pretrained(path)
    extractor = json.loads(Gemma4AudioFeatureExtractor().to_json_string())
    (path / "processor_config.json").write_text(json.dumps({"feature_extractor": extractor}))
    video_processor_class(GEMMA4_VIDEO)(max_soft_tokens=70, num_frames=2).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gemma4_audio(tmp_path_factory) -> Path:
    return write_tiny_gemma4_audio(tmp_path_factory.mktemp("gemma4-audio"))


def write_audio(folder: Path) -> None:
    """AUDIOS as 16-bit PCM WAV files: a sine per channel (440 Hz, 660 Hz), seeded noise added."""
    rng = np.random.default_rng(0)
    for name, (seconds, rate, channels) in AUDIOS.items():
        t = np.arange(int(seconds * rate)) / rate
        waves = [np.sin(2 * np.pi * (440 + 220 * c) * t) * 0.5 + rng.normal(0, 0.05, len(t)) for c in range(channels)]
        pcm = (np.clip(np.stack(waves, axis=1), -1, 1) * 32767).astype("<i2")
        with wave.open(str(folder / name), "wb") as f:
            f.setnchannels(channels)
            f.setsampwidth(2)
            f.setframerate(rate)
            f.writeframes(pcm.tobytes())


def clip_frames() -> np.ndarray:
    """(T, H, W, 3) uint8: a bright square moving over seeded noise."""
    count, height, width = CLIP
    video = np.random.default_rng(3).integers(0, 128, (count, height, width, 3), dtype=np.uint8)
    for t in range(count):
        video[t, 8:24, 8 * t : 8 * t + 16] = 255
    return video


def write_rows(folder: Path, conversations: list) -> Path:
    """The conversations beside their images, audios and the folder of frames `clip`."""
    from PIL import Image
    from test_media import write_rows as write_image_rows

    path = write_image_rows(folder, conversations)
    write_audio(folder)
    (folder / "clip").mkdir(exist_ok=True)
    for index, frame in enumerate(clip_frames()):
        Image.fromarray(frame).save(folder / "clip" / f"{index:03d}.png")
    return path


def wave_samples(path: Path) -> np.ndarray:
    """The 16 kHz mono file's samples as float32, read by `wave` (no PyAV)."""
    with wave.open(str(path)) as f:
        assert (f.getframerate(), f.getnchannels()) == (16_000, 1)
        return np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").astype(np.float32) / 32768


@pytest.fixture(scope="module")
def batches(gemma4_audio, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-audio-rows")
    return {name: image_batch(gemma4_audio, write_rows(root / name.replace(" ", "-"), rows), seq_len, micro_batch)
            for name, (rows, seq_len, micro_batch) in ROWS.items()}


@pytest.fixture(scope="module")
def references(gemma4_audio) -> dict:
    """The processors' own inputs of every image and audio of the rows: the image processor's padded patches and
    positions, and each audio's feature extractor output (its frames and mask), the 22.05 kHz stereo one on the
    samples longfit decoded (resampling has no reference without PyAV; its features are checked by their count)."""
    from transformers import AutoFeatureExtractor

    from longfit.models.media import media_reader
    from test_media import write_rows as write_image_rows

    root = gemma4_audio.parent
    extractor = AutoFeatureExtractor.from_pretrained(gemma4_audio)
    images_folder = root / "av-images"
    write_image_rows(images_folder, [ONE])
    write_audio(images_folder)
    reader = media_reader(str(gemma4_audio)).audio
    samples = {"a0.wav": wave_samples(images_folder / "a0.wav"), "a1.wav": reader.samples(images_folder / "a1.wav")}
    audios = {name: extractor([s], sampling_rate=16_000, return_tensors="pt") for name, s in samples.items()}
    from transformers.video_utils import VideoMetadata

    video_processor = media_reader(str(gemma4_audio)).video.processor
    frames = clip_frames()
    metadata = VideoMetadata(total_num_frames=len(frames), fps=24.0, height=CLIP[1], width=CLIP[2])
    video = video_processor(videos=[frames], video_metadata=[metadata], return_metadata=True, return_tensors="pt")
    return {"images": processed_images(gemma4_audio, images_folder), "audios": audios, "samples": samples,
            "extractor": extractor, "video": video}


def wrapper_inputs(media, first: int, count: int, refs: dict) -> dict:
    """The wrapper's media inputs of items [first, first + count): images as the image processor made them, audios
    as the feature extractor made them, a video's frames as the video processor made them (matched to longfit's by
    their pixels and valid frames)."""
    images, audios, frames = [], [], []
    video = refs["video"]
    for i in range(first, first + count):
        grid, pixels = media.grid_thw[i], media.pixel_values[i]
        if grid[0] == 0:
            length = int(grid[1])
            audios.append(next(a for a in refs["audios"].values()
                               if torch.equal(a["input_features"][0, :length], pixels[:length, : int(grid[2])])
                               and int(a["input_features_mask"][0].sum()) == length))
        elif int(media.token_types[media.item_starts[i]]) == 2:
            frames.append(next(f for f in range(len(video["pixel_values_videos"]))
                               if torch.equal(video["pixel_values_videos"][f], pixels[:630, :768])))
        else:
            images.append(next(im for im in refs["images"]
                               if torch.equal(im["pixel_values"], pixels[: im["pixel_values"].shape[0], :768])))
    inputs = {}
    if images:
        inputs |= dict(pixel_values=torch.stack([im["pixel_values"] for im in images]),
                       image_position_ids=torch.stack([im["image_position_ids"] for im in images]))
    if audios:
        (audio,) = audios  # one audio a conversation here
        inputs |= dict(input_features=audio["input_features"], input_features_mask=audio["input_features_mask"])
    if frames:
        assert frames == list(range(len(video["pixel_values_videos"])))  # the whole video, in order
        inputs |= dict(pixel_values_videos=video["pixel_values_videos"],
                       video_position_ids=video["video_position_ids"],
                       num_frames_per_video=video["num_frames_per_video"])
    return inputs


def wrapper_step(checkpoint: Path, batch, refs: dict, attention: str = "eager", autocast: bool = False,
                 dtype: torch.dtype = torch.float32) -> parity.Step:
    """The wrapper's own forward on each conversation of the rows alone, with its images and audios as the
    processors made them and mm_token_type_ids (from which Gemma 4 builds its masks); in `dtype`. In float64 (the
    exact reference of `compare_fp32`) the audio tower and its embedder stay in float32 as longfit's: transformers'
    audio attention computes in float32 whatever the weights' dtype, so the audios' embeddings are the same fp32
    values in both, and the float64 reference is exact from them on."""
    from transformers import AutoModelForImageTextToText

    implementation = {"text_config": attention, "vision_config": attention, "audio_config": "eager"}
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32,
                                                        attn_implementation=implementation).to(dtype)  # buffers too
    model.model.audio_tower.float()
    model.model.embed_audio.float()
    media, loss, first = batch.media, torch.zeros((), dtype=torch.float64), 0
    for row, spans in enumerate(batch.documents.rows):
        for start, end in spans:
            count = media.items_in(row, start, end)
            inputs = dict(input_ids=batch.input_ids[row : row + 1, start:end], use_cache=False)
            if count:
                inputs |= {k: v.to(dtype) if k.startswith("pixel_values") else v
                           for k, v in wrapper_inputs(media, first, count, refs).items()}
                inputs["mm_token_type_ids"] = media.token_types[row : row + 1, start:end]
                first += count
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(**inputs).logits
            part = F.cross_entropy(logits[0].to(dtype), batch.labels[row, start:end], reduction="sum")
            (part / batch.num_label_tokens).backward()
            loss += part.detach().double() / batch.num_label_tokens
    return parity.Step(loss.to(dtype), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def compared(checkpoint: Path, batch, vision: str, refs: dict, autocast: bool = False):
    """(longfit's step, the wrapper's other steps, its fp32 eager step), the wrapper's gradients of what longfit
    trains only, every gradient under the wrapper's names. The other steps: in fp32, its float64 step (exact) and
    its fp32 sdpa step (`compare_fp32`'s rounding bound: the vision tower's norm gradients cancel, and the wrapper's
    own fp32 error on them is several times the plain bound); under bf16 autocast, its eager and sdpa steps."""
    loss_module = longfit_model(checkpoint, vision)
    got = longfit_step(loss_module, batch, autocast)
    truth = wrapper_step(checkpoint, batch, refs)
    got = as_wrapper_names(got, loss_module, truth.grads)

    def trained(step: parity.Step) -> parity.Step:
        return parity.Step(step.loss, {n: g for n, g in step.grads.items() if n in got.grads})

    if autocast:
        others = [wrapper_step(checkpoint, batch, refs, a, autocast=True) for a in ("eager", "sdpa")]
    else:
        others = [wrapper_step(checkpoint, batch, refs, dtype=torch.float64), wrapper_step(checkpoint, batch, refs,
                                                                                           "sdpa")]
    return got, [trained(step) for step in others], trained(truth)


def fp32_comparison(name: str, got: parity.Step, others: list[parity.Step], truth: parity.Step):
    exact, sdpa = others
    return parity.compare_fp32(name, got, truth, exact, [sdpa])


def test_an_audio_is_written_as_gemma4s_processor_writes_it(gemma4_audio, batches, references) -> None:
    """HEARD's 0.5 s audio: <|audio>, its audio tokens (Gemma4Processor's count from its samples and from its
    feature extractor's mask), <audio|>; its features the feature extractor's valid frames of the samples `wave`
    reads; the 22.05 kHz stereo audio decoded, resampled and mixed to 0.9 s at 16 kHz."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    begin, end, token = AutoTokenizer.from_pretrained(gemma4_audio).convert_tokens_to_ids(list(AUDIO_TOKENS))
    batch = batches["one conversation"]
    (row, start), = batch.media.item_starts
    processor = SimpleNamespace(feature_extractor=references["extractor"], audio_seq_length=750,
                                boa_token="B", eoa_token="E", audio_token="A")
    tokens = Gemma4Processor._compute_audio_num_tokens(processor, references["samples"]["a0.wav"], 16_000)
    written = Gemma4Processor.replace_audio_token(processor, {"input_features_mask": [
        references["audios"]["a0.wav"]["input_features_mask"][0].numpy()]}, 0)
    assert written == "B" + "A" * tokens + "E" and tokens == 13
    assert batch.input_ids[row, start - 1 : start + tokens + 1].tolist() == [begin] + [token] * tokens + [end]
    frames = int(batch.media.grid_thw[0, 1])
    assert batch.media.grid_thw.tolist() == [[0, frames, 128]] and batch.media.token_types[row, start] == 3
    assert torch.equal(batch.media.pixel_values[0, :frames], references["audios"]["a0.wav"]["input_features"][0,
                                                                                                          :frames])
    assert len(references["samples"]["a1.wav"]) == int(0.9 * 16_000)


def test_a_video_is_written_as_gemma4s_processor_writes_it(gemma4_audio, batches, references) -> None:
    """SEEN's folder of 5 frames: the video processor's 2 frames (0 and 2, at the 24 frames a second
    Gemma4Processor assumes), each its time, <|image>, its video tokens, <image|> as `Gemma4Processor.
    replace_video_token` writes them, tokenised; each frame's patches the video processor's own."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    tokenizer = AutoTokenizer.from_pretrained(gemma4_audio)
    begin, end = tokenizer.convert_tokens_to_ids(list(GEMMA4_TOKENS[:2]))
    video = references["video"]
    processor = SimpleNamespace(boi_token=GEMMA4_TOKENS[0], eoi_token=GEMMA4_TOKENS[1], video_token=VIDEO_TOKEN)
    text = Gemma4Processor.replace_video_token(processor, video, 0)
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    batch = batches["video"]
    (row, first), (_, second) = batch.media.item_starts
    start = first - len(tokenizer("00:00 ", add_special_tokens=False)["input_ids"]) - 1
    assert batch.input_ids[row, start : start + len(want)].tolist() == want
    assert want[-1] == end and want.count(begin) == 2
    assert video["video_metadata"][0].frames_indices.tolist() == [0, 2]
    assert batch.media.grid_thw.tolist() == [[1, 18, 30]] * 2  # 64 x 96 resized to 288 x 480: 60 tokens a frame
    assert torch.equal(batch.media.pixel_values, video["pixel_values_videos"])
    assert second - first == 60 + 1 + len(tokenizer(" 00:00 ", add_special_tokens=False)["input_ids"]) + 1


@pytest.mark.parametrize("vision", [pytest.param("frozen", marks=pytest.mark.slow), "all"])
@pytest.mark.parametrize("rows", [pytest.param("one conversation", marks=pytest.mark.slow),
                                  pytest.param("video", marks=pytest.mark.slow), "packed"])
def test_loss_and_gradients_equal_the_wrapper(gemma4_audio, batches, references, rows: str, vision: str,
                                              one_thread) -> None:
    batch = batches[rows]
    assert [int(batch.media.token_types[r, s]) for r, s in batch.media.item_starts] == KINDS[rows]
    got, others, want = compared(gemma4_audio, batch, vision, references)
    # A trained tower with no item in the rows gets zero gradients (the wrapper: none), which every rank's reduction
    # under context parallelism expects (`Gemma4MediaEncoder.features`).
    idle = {n: g for n, g in got.grads.items() if n not in want.grads}
    assert not any(g.any() for g in idle.values())
    towers = {"one conversation": ("model.vision_tower.", "model.embed_vision."),
              "video": ("model.audio_tower.", "model.embed_audio."), "packed": ()}[rows] if vision == "all" else ()
    assert {n.split(".")[1] for n in idle} == {t.split(".")[1] for t in towers}
    got = parity.Step(got.loss, {n: g for n, g in got.grads.items() if n in want.grads})
    assert got.grads.keys() == want.grads.keys()
    assert any(n.startswith(AUDIO_TOWER) for n in got.grads) == (vision == "all" and rows != "video")
    assert any(n.startswith("model.vision_tower.") for n in got.grads) == (vision == "all" and rows != "one conversation")
    comparison = fp32_comparison(f"gemma4 audio, {rows}", got, others, want)
    assert comparison.ok, comparison.line()


@pytest.mark.slow  # the wrapper three times and longfit once
@pytest.mark.parametrize("rows", list(ROWS))
def test_bf16_loss_and_gradients_are_within_the_bf16_bound(gemma4_audio, batches, references, rows: str,
                                                           one_thread) -> None:
    got, others, truth = compared(gemma4_audio, batches[rows], "all", references, autocast=True)
    comparison = parity.compare_bf16(f"gemma4 audio, {rows}", got, others, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def cp_rank_step(rank: int, world_size: int, checkpoint: Path, rows: Path, seq_len: int, micro_batch: int,
                 method: str):
    """test_media_gemma3's rank of a cp group (the items dealt over the ranks), its trained gradients summed."""
    from test_media_gemma3 import cp_rank_step as gemma3_rank_step

    return gemma3_rank_step(rank, world_size, checkpoint, rows, seq_len, micro_batch, method)


@pytest.mark.slow  # two gloo ranks per case, each building the model
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_equals_the_wrapper(gemma4_audio, batches, references, tmp_path, method: str) -> None:
    from parallel_harness import run_distributed

    conversations, seq_len, micro_batch = ROWS["packed"]
    path = write_rows(tmp_path, conversations)
    batch = image_batch(gemma4_audio, path, seq_len, micro_batch)
    truth = wrapper_step(gemma4_audio, batch, references)
    others = [wrapper_step(gemma4_audio, batch, references, dtype=torch.float64),
              wrapper_step(gemma4_audio, batch, references, "sdpa")]
    loss_module = longfit_model(gemma4_audio, "all")
    for rank, got in enumerate(run_distributed(cp_rank_step, 2, gemma4_audio, path, seq_len, micro_batch, method)):
        got = as_wrapper_names(got, loss_module, truth.grads)

        def trained(step: parity.Step) -> parity.Step:
            return parity.Step(step.loss, {n: g for n, g in step.grads.items() if n in got.grads})

        assert got.grads.keys() == trained(truth).grads.keys()
        comparison = fp32_comparison(f"gemma4 audio, rank {rank}, {method}", got, [trained(o) for o in others],
                                     trained(truth))
        assert comparison.ok, comparison.line()


def test_the_export_writes_the_trained_audio_tower(gemma4_audio) -> None:
    """train.vision=all: the audio tower and its embedder are in what the export writes, under the checkpoint's
    keys; frozen: nothing of them (the export copies the source's bytes)."""
    from longfit.models.media import build_media_encoder, trainable_parts
    from longfit.train.export import trained_vision

    encoder = build_media_encoder(str(gemma4_audio))
    assert trained_vision(encoder) == {}
    trainable_parts(encoder, "all")
    written = trained_vision(encoder)
    assert any(k.startswith(AUDIO_TOWER) for k in written) and any(k.startswith("model.embed_audio.") for k in written)


@pytest.mark.parametrize("problem", ["missing", "undecodable", "no decoder", "no audio tower", "too long"])
def test_bad_audio_rows_are_one_line_before_training(gemma4_audio, tmp_path, monkeypatch, problem: str) -> None:
    from longfit.data.documents import DataError
    from longfit.data.media import check_media_rows
    from longfit.models.media import media_reader

    checkpoint = gemma4_audio
    write_audio(tmp_path)
    if problem == "undecodable":
        (tmp_path / "a0.wav").write_bytes(b"RIFF not a wave file")
    elif problem == "missing":
        (tmp_path / "a0.wav").unlink()
    elif problem == "no decoder":
        monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed: its import fails
    elif problem == "too long":  # 31 s: the feature extractor would keep its first 30 s alone
        with wave.open(str(tmp_path / "a0.wav"), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(16_000)
            f.writeframes(np.zeros(31 * 16_000, dtype="<i2").tobytes())
    else:
        from test_media_gemma4 import write_tiny_gemma4

        checkpoint = write_tiny_gemma4(tmp_path / "images-only")
    with pytest.raises(DataError) as refused:
        check_media_rows([("rows.jsonl, line 1", tmp_path, HEARD)], media_reader(str(checkpoint)), 256)
    message = str(refused.value)
    assert message.startswith(f"rows.jsonl, line 1: audio {tmp_path / 'a0.wav'}") and "\n" not in message
    assert {"missing": "does not exist; fix the path", "undecodable": "cannot be decoded",
            "no decoder": "needs a decoder: `pip install av` (PyAV)", "no audio tower": "has no audio tower",
            "too long": "is 31.0 s, longer than the 30 s the checkpoint's feature extractor reads"}[problem] \
        in message


@pytest.mark.parametrize("fps, max_frames, indices", [(None, None, [0, 4]), (2, None, [0, 2, 4, 6]),
                                                      (2, 3, [0, 2, 5]), (20, None, list(range(8)))])
def test_an_mp4_is_sampled_as_the_video_processor_samples_it(gemma4_audio, tmp_path, fps, max_frames,
                                                             indices) -> None:
    """An 8-frame MP4 at 4 frames a second (PyAV): the processor's 2 frames evenly; `data.video_fps=2` two a second;
    `data.video_max_frames` caps the count; a count above the video's frames takes them all (the processor would
    refuse it). The frames' patches are
    the video processor's own on the decoded frames, and their times those Gemma4Processor writes."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_utils import VideoMetadata
    from video_qa import write_clip

    from longfit.models.media import media_reader

    clip = write_clip(tmp_path / "clip.mp4", list(np.repeat(clip_frames(), 2, axis=0)[:8]), 4)
    reader = media_reader(str(gemma4_audio)).video.sampled(fps, max_frames)
    metadata = reader.metadata(clip)
    assert metadata.frames_indices.tolist() == indices
    patches, frames = reader.read(clip)
    decoded = reader.frames(clip, metadata)
    video = reader.processor(videos=[decoded], video_metadata=[VideoMetadata(
        total_num_frames=len(decoded), fps=4.0 * len(decoded) / 8, height=CLIP[1], width=CLIP[2])],
        do_sample_frames=False, return_metadata=True, return_tensors="pt")
    assert torch.equal(torch.cat([f.pixel_values for f in frames]), video["pixel_values_videos"])
    assert [stamp for stamp, _ in patches] == [i / 4 for i in indices]
    processor = SimpleNamespace(boi_token="B", eoi_token="E", video_token="V")
    written = Gemma4Processor.replace_video_token(processor, dict(video, video_metadata=[metadata]), 0)
    assert written.split(" ")[::2] == [f"00:{int(i / 4):02d}" for i in indices]


@pytest.mark.slow  # a one-process run and a --nproc 2 run, each with its preflight: ~7 min wall at load 15 (2 cores)
@pytest.mark.timeout(1800)
def test_longfit_train_on_audio_and_video_rows_under_cp_equals_one_process_and_exports_the_towers(
        gemma4_audio, tmp_path) -> None:
    import subprocess

    from safetensors.torch import load_file

    rows = write_rows(tmp_path / "data", [[HEARD, SEEN, BOTH, TEXT_ONLY][i % 4] for i in range(8)])

    def run(name: str, *extra: str) -> list[float]:
        argv = [f"model={gemma4_audio}", f"data.path={rows}", f"output_dir={tmp_path / name}", "seq_len=384",
                "train.device=cpu", "train.steps=2", "train.lr=1e-2", "train.warmup_steps=0", "train.vision=all",
                "eval.retrieval=false"]
        done = subprocess.run([sys.executable, "-m", "longfit", "train", *extra, *argv], capture_output=True,
                              text=True, timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in metrics if '"loss"' in line]

    one = run("one")
    assert len(one) == 2 and run("cp2", "--nproc", "2", "parallel.cp=2") == pytest.approx(one, rel=1e-4)
    before, after = load_file(gemma4_audio / "model.safetensors"), load_file(tmp_path / "one" / "final" /
                                                                              "model.safetensors")
    assert before.keys() == after.keys()
    trained = [k for k in before if k.startswith((AUDIO_TOWER, "model.embed_audio.")) and k.endswith("proj.weight")]
    assert trained and all(not torch.equal(before[k], after[k]) for k in trained)
