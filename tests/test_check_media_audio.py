"""`longfit check` of Gemma 4 runs whose rows hold audio and video parts (#54): the check's packed row holds an audio
made in the check (a seeded sine written as WAV by `wave`, read by longfit's audio reader with the checkpoint's
feature extractor) and a video (a folder of seeded frames through its video processor) beside its two images, on a
shrunken copy that keeps the audio tower (`longfit.check.media`).

The checkpoint is tests/test_media_gemma4_av.py's tiny Gemma 4 wrapper with its audio tower, feature extractor and
video processor; the run's data its chats with an audio (HEARD), a video (SEEN) and text. Exact at cp=1 in fp32
(default suite); under bf16 with cp=2 (slow); a broken audio path is named as the audios' embeddings or their
placement, video frames attending causally as the attention over the images; the verdict of audio rows is not that
of image or video rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_media import ONE, TEXT_ONLY  # noqa: E402
from test_media_gemma4_av import AUDIO_TOWER, HEARD, SEEN, gemma4_audio, write_rows  # noqa: E402,F401,F811

from longfit.check.parity import check_run  # noqa: E402
from longfit.config import load_config  # noqa: E402


def av_run(checkpoint: Path, folder: Path, conversations: list, *overrides: str):
    rows = write_rows(folder, conversations)
    return load_config(None, [f"model={checkpoint}", f"data.path={rows}", "seq_len=384", "train.device=cpu",
                              "train.vision=all", *overrides])


def image_comparisons(report) -> list:
    return [c for c in report.comparisons if c.name.startswith("image rows")]


@pytest.mark.parametrize("lora", [False, True])
def test_audio_and_video_rows_are_checked_exact_with_an_audio_and_a_video_in_the_row(gemma4_audio, tmp_path,
                                                                                     monkeypatch, lora: bool,
                                                                                     one_thread) -> None:
    """Exact, the audio tower's and its embedder's gradients among those compared (train.vision=all; with LoRA its
    adapters' against peft on the wrapper)."""
    from longfit.check import media

    compared = []
    compare_fp32 = media.compare_fp32
    monkeypatch.setattr(media, "compare_fp32", lambda name, got, *args: compared.append(set(got.grads)) or
                        compare_fp32(name, got, *args))
    report = check_run(av_run(gemma4_audio, tmp_path, [HEARD, SEEN, TEXT_ONLY], "train.dtype=fp32",
                              f"lora.enabled={str(lora).lower()}"), "cpu")
    assert report.exact, report.refusal
    prefix = media.PEFT_PREFIX if lora else ""
    assert compared and all(any(n.startswith(prefix + AUDIO_TOWER) and ("lora_" in n) == lora for n in names) and
                            any(n.startswith(prefix + "model.embed_audio.") for n in names) for names in compared)
    assert [c.name for c in image_comparisons(report)][0] == "image rows, one process, fp32, packed"
    note = next(line for line in report.lines() if line.startswith("  note: image rows (train.vision=all)"))
    assert "and one of a video (4 frames 48x64, " in note and "and one of an audio (0.5 s, 13 audio tokens" in note, \
        note


@pytest.mark.parametrize("broken", ["tower", "scatter"])
def test_a_broken_audio_path_is_named(gemma4_audio, tmp_path, monkeypatch, broken: str, one_thread) -> None:
    """The audio tower given its frames one late (`tower`): the audios' embeddings differ, and the check names them;
    the audios' embeddings placed one token late (`scatter`): the rows' input embeddings differ at the audio's
    tokens. The images' rows agree: a check of image rows alone never saw either."""
    import torch

    from longfit.models.media_gemma4 import Gemma4MediaEncoder

    audio_features = Gemma4MediaEncoder._audio_features

    def late(self, features, grid_thw):
        if broken == "tower":
            return audio_features(self, features.roll(1, dims=1), grid_thw)
        return audio_features(self, features, grid_thw).roll(1, dims=0)

    monkeypatch.setattr(Gemma4MediaEncoder, "_audio_features", late)
    report = check_run(av_run(gemma4_audio, tmp_path, [HEARD, TEXT_ONLY], "train.dtype=fp32"), "cpu")
    assert not report.exact and not report.refused
    start = {"tower": "the audios' embeddings (the audio tower and its embedder, `MediaEncoder.features`) differ by ",
             "scatter": "the rows' input embeddings with the images' embeddings scattered into their placeholders "
                        "(`MediaEncoder.input_embeddings`) differ by "}[broken]
    assert report.refusal.startswith(start), report.refusal
    assert report.refusal.endswith(("" if broken == "tower" else " (most at an audio's tokens)") +
                                   " (image rows, one process, fp32, packed)"), report.refusal


def test_a_video_frame_attending_causally_is_named(gemma4_audio, tmp_path, monkeypatch, one_thread) -> None:
    """Gemma 4's video frames given no bidirectional spans (its images keep theirs): the embeddings agree, the language
    model over the rows does not, and the check says so; the frames ran through the wrapper's vision tower as its
    video processor gives them."""
    from dataclasses import replace

    import torch

    from longfit.data.media import TEXT, VIDEO
    from longfit.models.media_gemma4 import Gemma4MediaEncoder

    layout = Gemma4MediaEncoder.attention_layout

    def frames_causal(self, documents, media):
        return layout(self, documents, replace(media, token_types=torch.where(media.token_types == VIDEO, TEXT,
                                                                              media.token_types)))

    monkeypatch.setattr(Gemma4MediaEncoder, "attention_layout", frames_causal)
    report = check_run(av_run(gemma4_audio, tmp_path, [SEEN, TEXT_ONLY], "train.dtype=fp32"), "cpu")
    assert not report.exact and not report.refused
    assert report.refusal.startswith("the language model over the image rows differs (image rows, one process, fp32, "
                                     "packed) (its attention over the images: `MediaEncoder.attention_layout`)"), \
        report.refusal


def test_the_verdict_of_audio_rows_is_not_that_of_image_or_video_rows(gemma4_audio, tmp_path) -> None:
    """Rows with an image, a video, an audio: three verdicts; the same audio rows read with another feature
    extractor setting: a fourth."""
    import json
    import shutil

    from longfit.check.gate import verdict_key

    other = shutil.copytree(gemma4_audio, tmp_path / "other-extractor")
    settings = json.loads((other / "processor_config.json").read_text())
    settings["feature_extractor"]["dither"] = 0.5
    (other / "processor_config.json").write_text(json.dumps(settings))
    keys = [verdict_key(av_run(gemma4_audio, tmp_path / "images", [ONE, TEXT_ONLY]), "cpu"),
            verdict_key(av_run(gemma4_audio, tmp_path / "videos", [SEEN, TEXT_ONLY]), "cpu"),
            verdict_key(av_run(gemma4_audio, tmp_path / "audio", [HEARD, TEXT_ONLY]), "cpu"),
            verdict_key(av_run(other, tmp_path / "audio", [HEARD, TEXT_ONLY]), "cpu"),
            verdict_key(av_run(other, tmp_path / "images", [ONE, TEXT_ONLY]), "cpu")]
    assert len(set(keys[:4])) == 4
    assert keys[4] == keys[0]  # the extractor's settings key audio rows only


@pytest.mark.slow  # 24 s at load 6 on the shared 2-core machine (18 s CPU): the bf16 steps, then two gloo ranks
def test_audio_and_video_rows_are_exact_under_bf16_and_context_parallelism(gemma4_audio, tmp_path,
                                                                          one_thread) -> None:
    cfg = av_run(gemma4_audio, tmp_path, [HEARD, SEEN, TEXT_ONLY], "train.dtype=bf16", "parallel.cp=2",
                 "parallel.cp_method=ulysses", "memory.tiled_layers=false")
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    names = [c.name for c in image_comparisons(report)]
    assert {"image rows, bf16 autocast, techniques, packed",
            "image rows, rank 1 of 2, ulysses, techniques, packed"} <= set(names)
