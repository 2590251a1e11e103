"""`longfit check` of runs whose rows hold images (#54): the image path proven on a shrunken copy of the wrapper.

The checkpoints are the tiny wrappers of tests/test_media.py (Qwen3.5, Qwen3.5-MoE), tests/test_media_gemma3.py
(Gemma 3), tests/test_media_gemma4.py (Gemma 4), tests/test_media_mistral3.py (Mistral 3) and
tests/test_media_llama4.py (Llama 4, whose image processor needs torchvision), their data a .jsonl of chats with
images made by Pillow (test_media.write_rows). The check of such a run compares longfit's step on a packed row of two
image conversations with the wrapper's own eager forward (`longfit.check.media`): exact at cp=1 in fp32 (default
suite), under bf16 and on two gloo ranks (slow); a broken image path is named; the verdict of image rows is not that
of text rows; `longfit train` on image rows asks the image verdict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_media import (  # noqa: E402,F401,F811 -- the session fixtures
    ONE, TEXT_ONLY, TWO, qwen_images, qwen_moe_images, write_rows)
from test_media_gemma3 import gemma3_images  # noqa: E402,F401,F811
from test_media_gemma4 import gemma4_images  # noqa: E402,F401,F811
from test_media_mistral3 import mistral3_images  # noqa: E402,F401,F811
from test_media_video import VIDEO_CHAT, qwen_video  # noqa: E402,F401,F811
from test_media_video import write_rows as write_video_rows  # noqa: E402

from longfit.check.parity import check_run  # noqa: E402
from longfit.config import ConfigError, load_config  # noqa: E402


def image_run(checkpoint: Path, folder: Path, *overrides: str, conversations=None):
    rows = write_rows(folder, conversations or [ONE, TWO, TEXT_ONLY])
    return load_config(None, [f"model={checkpoint}", f"data.path={rows}", "seq_len=128", "train.device=cpu",
                              "train.vision=all", *overrides])


def image_comparisons(report) -> list:
    return [c for c in report.comparisons if c.name.startswith("image rows")]


@pytest.fixture
def checkpoints(request) -> dict:
    """The tiny wrapper checkpoint of each family (their session fixtures), made when first asked."""
    return {family: lambda fixture=fixture: request.getfixturevalue(fixture) for family, fixture in
            [("qwen3_5", "qwen_images"), ("qwen3_5_moe", "qwen_moe_images"), ("gemma3", "gemma3_images"),
             ("gemma4", "gemma4_images"), ("mistral3", "mistral3_images")]}


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "gemma4", "mistral3"])
def test_the_image_rows_of_a_run_are_checked_exact(family, checkpoints, tmp_path, one_thread) -> None:
    checkpoint = checkpoints[family]()
    report = check_run(image_run(checkpoint, tmp_path, "train.dtype=fp32"), "cpu")
    assert report.exact, report.refusal
    names = [c.name for c in image_comparisons(report)]
    assert names[0] == "image rows, one process, fp32, packed", report.lines()
    assert any(line.startswith(f"  note: image rows (train.vision=all): the {family} wrapper's copy")
               for line in report.lines())


def test_the_check_runs_the_towers_blocks_checkpointed_as_the_trainer_does(qwen_images, tmp_path, monkeypatch,
                                                                          one_thread) -> None:
    """The step with the run's techniques checkpoints the trained tower's blocks, their inputs offloaded, as
    `parallelize` does in the trainer; and stays exact."""
    from longfit.memory import apply as memory_apply

    checkpointed = []
    checkpoint_tower = memory_apply.checkpoint_tower
    monkeypatch.setattr(memory_apply, "checkpoint_tower",
                        lambda *args, **kwargs: checkpointed.append(checkpoint_tower(*args, **kwargs)) or checkpointed[-1])
    cfg = image_run(qwen_images, tmp_path, "train.dtype=fp32", "memory.activation_checkpointing=true",
                    "memory.offload_activations=true", "memory.tiled_layers=false")
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    assert "image rows, fp32, techniques, packed" in [c.name for c in image_comparisons(report)]
    assert checkpointed and all(blocks > 0 for blocks in checkpointed)


@pytest.mark.slow  # the text and image steps under bf16, then two gloo ranks: ~50 s a case on a busy 2-core machine
@pytest.mark.parametrize("family, method", [("qwen3_5", "ring"), ("qwen3_5_moe", "ulysses"), ("gemma3", "ulysses"),
                                            ("gemma4", "ulysses"), ("mistral3", "ring")])
def test_the_image_rows_are_exact_under_bf16_and_context_parallelism(family, method, checkpoints, tmp_path,
                                                                     one_thread) -> None:
    checkpoint = checkpoints[family]()
    cfg = image_run(checkpoint, tmp_path, "train.dtype=bf16", "parallel.cp=2", f"parallel.cp_method={method}",
                    "memory.tiled_layers=false")
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    names = [c.name for c in image_comparisons(report)]
    assert "image rows, bf16 autocast, techniques, packed" in names
    assert f"image rows, rank 1 of 2, {method}, techniques, packed" in names


def test_a_broken_image_path_is_named(qwen_images, tmp_path, monkeypatch, one_thread) -> None:
    """Each placeholder given the next image token's embedding: the text steps agree, the image rows' input
    embeddings differ, and the check says so."""
    import torch

    from longfit.check.parity import NotExact
    from longfit.models.media import MediaEncoder

    scatter = MediaEncoder.input_embeddings

    def off_by_one(self, embedding, input_ids, media, features):
        return scatter(self, embedding, input_ids, media, torch.roll(features, 1, dims=0))

    monkeypatch.setattr(MediaEncoder, "input_embeddings", off_by_one)
    report = check_run(image_run(qwen_images, tmp_path, "train.dtype=fp32"), "cpu")
    assert not report.exact and not report.refused
    assert report.refusal.startswith("the rows' input embeddings with the images' embeddings scattered into their "
                                     "placeholders (`MediaEncoder.input_embeddings`) differ by "), report.refusal
    assert report.refusal.endswith("(image rows, one process, fp32, packed)")
    with pytest.raises(NotExact, match=r"is not computed exactly: the rows' input embeddings") as raised:
        report.raise_if_not_exact()
    assert "\n" not in str(raised.value)


def test_the_attention_over_images_is_named_where_it_differs(gemma3_images, tmp_path, monkeypatch, one_thread) -> None:
    """Gemma 3's images attending causally (its bidirectional spans taken off): the images' embeddings and their
    placement agree, the language model over the image rows does not."""
    from longfit.models.media import MediaEncoder
    from longfit.models.media_gemma3 import Gemma3MediaEncoder

    monkeypatch.setattr(Gemma3MediaEncoder, "attention_layout", MediaEncoder.attention_layout)
    report = check_run(image_run(gemma3_images, tmp_path, "train.dtype=fp32"), "cpu")
    assert not report.exact and not report.refused
    assert report.refusal.startswith("the language model over the image rows differs (image rows, one process, fp32, "
                                     "packed) (its attention over the images: `MediaEncoder.attention_layout`)")


def test_a_family_whose_image_path_cannot_be_checked_is_refused_in_one_line(tmp_path, monkeypatch, one_thread) -> None:
    """Llama 4's image processor needs torchvision, which does not load here: its image rows are refused by the
    check naming that part (its text rows alone are checked and train)."""
    from test_media_llama4 import write_tiny_llama4

    from longfit.check.gate import require_exact
    from longfit.models.media_llama4 import Llama4MediaEncoder

    if Llama4MediaEncoder.missing_backend() is None:
        pytest.skip("torchvision loads here: Llama 4's image processor runs")
    checkpoint = write_tiny_llama4(tmp_path / "llama4")
    cfg = image_run(checkpoint, tmp_path / "rows", "train.dtype=fp32", "train.vision=frozen")
    report = check_run(cfg, "cpu")
    assert report.refused
    assert report.refusal.startswith("its image rows cannot be checked: its image processor cannot run here: Llama "
                                     "4's image processor (Llama4ImageProcessor: its tiles) needs torchvision")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as refused:  # the trainer's preflight: nothing trains
        require_exact(cfg, "cpu")
    assert str(refused.value).startswith(f"{checkpoint} is refused by longfit: {report.refusal}; `longfit check`")
    assert "\n" not in str(refused.value)


def test_the_verdict_of_image_rows_is_not_that_of_text_rows(qwen_images, tmp_path) -> None:
    from longfit.check.gate import verdict_key

    text = load_config(None, [f"model={qwen_images}", f"data.path={write_rows(tmp_path / 'text', [TEXT_ONLY])}",
                              "seq_len=128", "train.device=cpu"])
    keys = {verdict_key(text, "cpu"),
            verdict_key(image_run(qwen_images, tmp_path / "images", "train.vision=all"), "cpu"),
            verdict_key(image_run(qwen_images, tmp_path / "images", "train.vision=frozen"), "cpu")}
    assert len(keys) == 3


def test_longfit_train_on_image_rows_asks_the_image_verdict(qwen_images, tmp_path, monkeypatch, capsys) -> None:
    """A cached verdict of the image rows (here planted: not exact) answers `longfit train` on them, not the text
    rows' (planted: exact)."""
    from longfit.check.gate import verdict_key
    from longfit.cli import main
    from longfit.models.cache import cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = [f"output_dir={tmp_path / 'out'}", "train.steps=1", "eval.retrieval=false"]
    text = load_config(None, [f"model={qwen_images}", f"data.path={write_rows(tmp_path / 'text', [TEXT_ONLY])}",
                              "seq_len=128", "train.device=cpu", *argv])
    images = image_run(qwen_images, tmp_path / "images", *argv)
    verdicts = cache_dir("check_verdicts")
    verdicts.mkdir(parents=True)
    planted = "the image rows' planted verdict"
    (verdicts / f"{verdict_key(images, 'cpu')}.json").write_text(json.dumps({"exact": False, "message": planted}))
    (verdicts / f"{verdict_key(text, 'cpu')}.json").write_text(json.dumps({"exact": True, "message": ""}))
    assert main(["train", f"model={qwen_images}", f"data.path={images.data.path}", "seq_len=128", "train.device=cpu",
                 "train.vision=all", *argv]) == 2
    assert f"longfit: error: {planted}; `longfit check` with this run's config" in capsys.readouterr().err


# measured on the shared 2-core machine (load 10): 41 s wall, 15 CPU s (two gloo ranks)
@pytest.mark.slow
def test_the_check_proves_gemma3s_images_under_tiled_layers_and_context_parallelism(gemma3_images, tmp_path,
                                                                                      one_thread) -> None:
    """Gemma 3's image rows (attending both ways) with tiled layers under cp=2: the check runs them on gloo ranks and
    finds them exact (before, the trainer's and the check's one line refused the run)."""
    cfg = image_run(gemma3_images, tmp_path, "train.dtype=fp32", "memory.tiled_layers=true", "parallel.cp=2")
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    assert "image rows, rank 1 of 2, ring, techniques, packed" in [c.name for c in image_comparisons(report)]


def video_run(checkpoint: Path, folder: Path, *overrides: str):
    """A run on tests/test_media_video.py's rows: a chat with a video (a folder of frames) and a text chat."""
    rows = write_video_rows(folder, [VIDEO_CHAT, TEXT_ONLY])
    return load_config(None, [f"model={checkpoint}", f"data.path={rows}", "seq_len=128", "train.device=cpu",
                              "train.vision=all", *overrides])


def test_video_rows_are_checked_exact_with_a_video_in_the_row(qwen_video, tmp_path, one_thread) -> None:
    report = check_run(video_run(qwen_video, tmp_path, "train.dtype=fp32"), "cpu")
    assert report.exact, report.refusal
    note = next(line for line in report.lines() if line.startswith("  note: image rows (train.vision=all)"))
    assert "and one of a video (4 frames 48x64, " in note, note


# measured on the shared 2-core machine at load 14: 63 s wall (the text and video rows' bf16 steps, two gloo ranks)
@pytest.mark.slow
def test_video_rows_are_exact_under_bf16_and_context_parallelism(qwen_video, tmp_path, one_thread) -> None:
    cfg = video_run(qwen_video, tmp_path, "train.dtype=bf16", "parallel.cp=2", "parallel.cp_method=ring",
                    "memory.tiled_layers=false")
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    names = [c.name for c in image_comparisons(report)]
    assert {"image rows, bf16 autocast, techniques, packed", "image rows, rank 1 of 2, ring, techniques, packed"} <= \
        set(names)


def test_a_broken_video_position_is_named(qwen_video, tmp_path, monkeypatch, one_thread) -> None:
    """The video's temporal positions moved on by one (its tokens' M-RoPE time index): the images' rows agree, the
    video's do not, and the check names the positions; a check of image rows alone never saw it."""
    from longfit.data.media import VIDEO
    from longfit.models.media import MediaEncoder

    positions = MediaEncoder.rope_positions

    def late_video(self, input_ids, position_ids, media):
        out = positions(self, input_ids, position_ids, media)
        out[1] += (media.token_types == VIDEO).long()  # (4, B, L): text, then M-RoPE's time, height, width
        return out

    monkeypatch.setattr(MediaEncoder, "rope_positions", late_video)
    report = check_run(video_run(qwen_video, tmp_path, "train.dtype=fp32"), "cpu")
    assert not report.exact and not report.refused
    assert report.refusal.startswith("the positions of the image rows (`MediaEncoder.rope_positions`) differ by "
                                     "1.0e+00 (most at a video's tokens) (image rows, one process, fp32, packed)"), \
        report.refusal


def test_the_verdict_of_video_rows_is_not_that_of_image_rows(qwen_video, tmp_path) -> None:
    from longfit.check.gate import verdict_key

    images = image_run(qwen_video, tmp_path / "images", conversations=[ONE, TEXT_ONLY])
    videos = video_run(qwen_video, tmp_path / "videos")
    fewer_frames = video_run(qwen_video, tmp_path / "videos", "data.video_max_frames=2")
    assert len({verdict_key(images, "cpu"), verdict_key(videos, "cpu"), verdict_key(fewer_frames, "cpu")}) == 3


def test_image_rows_of_the_eval_data_alone_are_checked(qwen_images, tmp_path, one_thread) -> None:
    """Text-only training data, eval data with images (data.eval_path): the trainer runs the eval rows through the
    vision side, so the check proves the image path and keys its verdict apart from the text rows'."""
    from longfit.check.gate import verdict_key

    text = [f"model={qwen_images}", f"data.path={write_rows(tmp_path / 'text', [TEXT_ONLY])}", "seq_len=128",
            "train.device=cpu", "train.vision=frozen", "train.dtype=fp32"]
    evals = text + [f"data.eval_path={write_rows(tmp_path / 'evals', [ONE, TWO])}"]
    report = check_run(load_config(None, evals), "cpu")
    assert report.exact, report.refusal
    assert [c.name for c in image_comparisons(report)][0] == "image rows, one process, fp32, packed"
    assert verdict_key(load_config(None, evals), "cpu") != verdict_key(load_config(None, text), "cpu")


def test_tiled_layers_with_gemma3s_images_check_exact_on_one_rank(gemma3_images, tmp_path, one_thread) -> None:
    cfg = image_run(gemma3_images, tmp_path, "train.dtype=fp32", "memory.tiled_layers=true")
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    assert "image rows, fp32, techniques, packed" in [c.name for c in image_comparisons(report)]
