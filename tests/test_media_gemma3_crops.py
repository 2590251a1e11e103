"""Gemma 3's pan-and-scan crops (#54): with do_pan_and_scan in the checkpoint's image processor config, each image
part is the image and its crops, images of the part, written among Gemma3Processor's own words
(models/media_gemma3.py's `PanAndScan`); the loss and every gradient equal the wrapper's own forward (the
bidirectional attention inside each image's and each crop's tokens), fp32 and within the bf16 bound, one conversation
and packed, and on two cp ranks under the ring (1 s on forked ranks when quiet, 14 s at load 16).

tests/test_media_gemma3.py's tiny wrapper with pan-and-scan on and crops of 8 pixels at least: of
tests/test_media.py's images (height x width 40 x 50, 64 x 64, 33 x 70), the first and third are cut in two crops
each, the square one is not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_media import ONE, TEXT_ONLY, TWO, as_wrapper_names, batches_of_rows, image_batch, longfit_model, \
    write_rows  # noqa: E402
from test_media_gemma3 import TOKENS_PER_IMAGE, cp_rank_step, longfit_step, wrapper_step, \
    write_tiny_gemma3  # noqa: E402
from test_media_gemma3 import compared as gemma3_compared  # noqa: E402

from longfit.check import parity  # noqa: E402

ROWS = {"one conversation": ([ONE], 176, 1), "packed": ([ONE, TEXT_ONLY, TWO, ONE], 384, 2)}
"""(conversations, seq_len, rows a batch): ONE alone (its image and two crops), or packed conversations in two rows."""
CROPS = {"im0.png": 2, "im1.png": 0, "im2.png": 2}


@pytest.fixture(scope="session")
def crops_checkpoint(tmp_path_factory) -> Path:
    path = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3-crops"))
    config = json.loads((path / "preprocessor_config.json").read_text())
    config.update(do_pan_and_scan=True, pan_and_scan_min_crop_size=8)  # the other two settings: the processor's
    (path / "preprocessor_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def crops_batches(crops_checkpoint, tmp_path_factory):
    return batches_of_rows(crops_checkpoint, tmp_path_factory.mktemp("gemma3-crops-rows"), ROWS)


def test_an_image_part_is_the_image_and_its_crops_as_the_processor_writes_them(crops_checkpoint, crops_batches,
                                                                               tmp_path) -> None:
    """The pixels are Gemma3ImageProcessorPil's with pan-and-scan (the image, then its crops); the tokens are
    Gemma3Processor's text of the part, each image's 16 tokens a run of its own (its bidirectional span); the count
    from the image's header alone (what the check before the first step uses) is the tokens written."""
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    from longfit.models.media import build_media_encoder, media_reader

    config = AutoConfig.from_pretrained(crops_checkpoint)
    batch = crops_batches["one conversation"]
    write_rows(tmp_path, [ONE])
    processed = AutoImageProcessor.from_pretrained(crops_checkpoint)(
        images=[Image.open(tmp_path / "im0.png")], return_tensors="pt", pan_and_scan_min_ratio_to_activate=1.2,
        pan_and_scan_max_num_crops=4)
    assert processed["num_crops"].tolist() == [CROPS["im0.png"]]
    assert torch.equal(batch.media.pixel_values, processed["pixel_values"])  # (3, C, 64, 64)
    assert batch.media.grid_thw.tolist() == [[3, 1, TOKENS_PER_IMAGE]]
    (row, start), = batch.media.item_starts
    ids = batch.input_ids[row].tolist()
    image = [i for i, t in enumerate(ids) if t == config.image_token_id]
    assert len(image) == 3 * TOKENS_PER_IMAGE
    assert batch.media.token_types[row].nonzero().flatten().tolist() == image
    text = AutoTokenizer.from_pretrained(crops_checkpoint).decode(ids[start : image[-1] + 4])
    assert text.startswith("Here is the original image \n\n<start_of_image>")
    assert "<end_of_image>\n\n and here are some crops to help you see better \n\n<start_of_image>" in text
    assert text.endswith("<end_of_image>\n\n \n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n")
    runs = build_media_encoder(str(crops_checkpoint)).attention_layout(batch.documents, batch.media).bidirectional
    assert [end - begin for begin, end in runs[0]] == [TOKENS_PER_IMAGE] * 3
    reader = media_reader(str(crops_checkpoint))
    write_rows(tmp_path, [TWO])
    for name, crops in CROPS.items():
        length = len(reader.spec.layout(torch.tensor([1 + crops, 1, TOKENS_PER_IMAGE])))
        assert reader.image_tokens(tmp_path / name) == length
    no_crops = reader.spec.layout(torch.tensor([1, 1, TOKENS_PER_IMAGE]))
    assert len(no_crops) == TOKENS_PER_IMAGE + 6  # an image without crops: its markers as before


@pytest.mark.parametrize("rows", list(ROWS))
def test_loss_and_gradients_equal_the_wrapper(crops_checkpoint, crops_batches, rows: str, one_thread) -> None:
    batch = crops_batches[rows]
    assert int(batch.media.grid_thw[:, 0].sum()) == (3 if rows == "one conversation" else 3 + 1 + 3 + 3)
    got, _, want = gemma3_compared(crops_checkpoint, batch, "all")
    assert got.grads.keys() == want.grads.keys()
    comparison = parity.compare_fp32(f"gemma3 crops, {rows}", got, want)
    assert comparison.ok, comparison.line()


def test_bf16_loss_and_gradients_are_within_the_bf16_bound(crops_checkpoint, crops_batches, one_thread) -> None:
    got, references, truth = gemma3_compared(crops_checkpoint, crops_batches["packed"], "all", autocast=True)
    comparison = parity.compare_bf16("gemma3 crops, packed", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_context_parallel_ring_equals_the_wrapper(crops_checkpoint, tmp_path) -> None:
    from parallel_harness import run_distributed

    conversations, seq_len, micro_batch = ROWS["packed"]
    path = write_rows(tmp_path, conversations)
    batch = image_batch(crops_checkpoint, path, seq_len, micro_batch)
    truth = wrapper_step(crops_checkpoint, batch)
    loss_module = longfit_model(crops_checkpoint, "all")
    for rank, got in enumerate(run_distributed(cp_rank_step, 2, crops_checkpoint, path, seq_len, micro_batch, "ring")):
        got = as_wrapper_names(got, loss_module, truth.grads)
        want = parity.Step(truth.loss, {n: g for n, g in truth.grads.items() if n in got.grads})
        assert got.grads.keys() == want.grads.keys()
        comparison = parity.compare_fp32(f"gemma3 crops, rank {rank}, ring", got, want)
        assert comparison.ok, comparison.line()
