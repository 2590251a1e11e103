"""Mistral 3's rows with images (#54): its Pixtral tower at each image's own size, exactly.

A tiny `Mistral3ForConditionalGeneration` written by transformers from its default mistral3 config with the language
model and the Pixtral tower shrunk (tests/test_wrappers.py's sizes; 8-pixel patches merged 2 x 2), longfit's byte
tokenizer with Pixtral's image tokens and a chat template that writes an image part as `[IMG]`, and Pixtral's own
Pillow image processor (longest edge 64). The images made here with Pillow take 3 x 4, 4 x 4 and 2 x 4 merged patches:
rows of `[IMG]` tokens with their breaks, as PixtralProcessor writes them. The loss and every gradient (tower and
projector included where they train) equal the wrapper's own eager forward, each conversation of a packed row alone,
in fp32 and within the bf16 bound; under cp=2 ring and Ulysses on gloo (slow) too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_media import (  # noqa: E402
    ONE, TEXT_ONLY, TWO, as_wrapper_names, batches_of_rows, image_batch, longfit_model, write_rows,
    compared as media_compared)
from test_media_gemma3 import cp_rank_step, longfit_step  # noqa: E402
from test_wrappers import TEXT, VISION  # noqa: E402

from longfit.check import parity  # noqa: E402

PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
RENDER_PIXTRAL = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}[IMG]{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{%- endmacro -%}"
)
ROWS = {"one conversation": ([ONE], 48, 1), "packed": ([ONE, TEXT_ONLY, TWO, ONE], 96, 2)}
ROW_CASES = [pytest.param("one conversation", marks=pytest.mark.slow), "packed"]
PATCH = 8


def write_tiny_mistral3(path: Path, seed: int = 0, **wrapper) -> Path:
    """`wrapper`: more of the wrapper config's values (tie_word_embeddings=False: Mistral Small 3.1's, which pipeline
    stages take)."""
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForImageTextToText, PixtralImageProcessorPil

    from longfit.data.tokenizer import CHAT_TEMPLATE, byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in PIXTRAL_TOKENS], special_tokens=True)
    tokenizer.chat_template = RENDER_PIXTRAL + CHAT_TEMPLATE.replace("message['content']", "render(message['content'])")
    torch.manual_seed(seed)
    config = AutoConfig.for_model("mistral3", text_config=dict(TEXT, model_type="mistral"),
                                  vision_config=dict(VISION, head_dim=16, image_size=64, patch_size=PATCH),
                                  image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), **wrapper)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    PixtralImageProcessorPil(patch_size={"height": PATCH, "width": PATCH},
                             size={"longest_edge": 64}).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def mistral3_images(tmp_path_factory) -> Path:
    return write_tiny_mistral3(tmp_path_factory.mktemp("mistral3-images"))


@pytest.fixture(scope="session")
def untied_mistral3(tmp_path_factory) -> Path:
    """The tiny Mistral 3 with an lm_head of its own (pipeline stages refuse a tied one): Mistral Small 3.1's."""
    return write_tiny_mistral3(tmp_path_factory.mktemp("mistral3-untied"), tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mistral3_batches(mistral3_images, tmp_path_factory):
    return batches_of_rows(mistral3_images, tmp_path_factory.mktemp("mistral3-rows"), ROWS)


def wrapper_step(checkpoint: Path, batch, attention: str = "eager", autocast: bool = False) -> parity.Step:
    """The wrapper's own forward on each conversation of the rows alone, with its images at their sizes: `longfit
    check`'s reference (`longfit.check.media`)."""
    from transformers import AutoModelForImageTextToText

    from longfit.check.media import wrapper_step as reference_step
    from longfit.models.media import build_media_encoder

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention)
    return reference_step(model, build_media_encoder(str(checkpoint)), batch, autocast=autocast)


def compared(checkpoint: Path, batch, vision: str, autocast: bool = False):
    """test_media's comparison with this family's steps, under autocast against the wrapper's eager and sdpa steps."""
    return media_compared(checkpoint, batch, vision, autocast, ("eager", "sdpa"), wrapper_step, longfit_step)


def test_an_image_is_written_as_pixtrals_processor_writes_it(mistral3_images, mistral3_batches) -> None:
    """ONE's 40 x 50 image: 3 rows of 4 merged patches, each row's [IMG]s then [IMG_BREAK], the last [IMG_END]; only
    the [IMG]s take embeddings; the pixels at the image's own size."""
    from transformers import AutoTokenizer

    image, brk, end = AutoTokenizer.from_pretrained(mistral3_images).convert_tokens_to_ids(list(PIXTRAL_TOKENS))
    batch = mistral3_batches["one conversation"]
    (row, start), = batch.media.item_starts
    assert batch.input_ids[row, start : start + 15].tolist() == ([image] * 4 + [brk]) * 2 + [image] * 4 + [end]
    assert (batch.media.embedding_index[row] >= 0).nonzero().flatten().tolist() == [
        start + r * 5 + c for r in range(3) for c in range(4)]
    assert batch.media.grid_thw.tolist() == [[1, 6, 8]] and batch.media.pixel_values.shape == (1, 3, 48, 64)


def test_an_epoch_is_counted_from_the_image_headers(mistral3_images, tmp_path) -> None:
    """The headers' token counts (Pixtral's resize rule, breaks included) are the ones the pixels give."""
    from longfit.models.media import media_reader

    write_rows(tmp_path, [ONE])
    reader = media_reader(str(mistral3_images))
    assert [reader.image_tokens(tmp_path / f"im{i}.png") for i in range(3)] == [15, 20, 10]


@pytest.mark.parametrize("vision", [pytest.param("frozen", marks=pytest.mark.slow), "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
def test_loss_and_gradients_equal_the_wrapper(mistral3_images, mistral3_batches, rows: str, vision: str,
                                              one_thread) -> None:
    batch = mistral3_batches[rows]
    assert batch.media.images == (1 if rows == "one conversation" else 4)
    got, _, want = compared(mistral3_images, batch, vision)
    assert got.grads.keys() == want.grads.keys()
    assert any(n.startswith("model.vision_tower.") for n in got.grads) == (vision == "all")
    comparison = parity.compare_fp32(f"mistral3, {rows}", got, want)
    assert comparison.ok, comparison.line()


@pytest.mark.slow  # the wrapper three times and longfit once, a few seconds
@pytest.mark.parametrize("rows", ["packed"])
def test_bf16_loss_and_gradients_are_within_the_bf16_bound(mistral3_images, mistral3_batches, rows: str,
                                                           one_thread) -> None:
    got, references, truth = compared(mistral3_images, mistral3_batches[rows], "all", autocast=True)
    comparison = parity.compare_bf16(f"mistral3, {rows}", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


@pytest.mark.slow  # two gloo ranks, each building the model
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_equals_the_wrapper(mistral3_images, tmp_path, method: str) -> None:
    from parallel_harness import run_distributed

    conversations, seq_len, micro_batch = ROWS["packed"]
    path = write_rows(tmp_path, conversations)
    batch = image_batch(mistral3_images, path, seq_len, micro_batch)
    truth = wrapper_step(mistral3_images, batch)
    loss_module = longfit_model(mistral3_images, "all")
    for rank, got in enumerate(run_distributed(cp_rank_step, 2, mistral3_images, path, seq_len, micro_batch, method)):
        got = as_wrapper_names(got, loss_module, truth.grads)
        want = parity.Step(truth.loss, {n: g for n, g in truth.grads.items() if n in got.grads})
        assert got.grads.keys() == want.grads.keys()
        comparison = parity.compare_fp32(f"mistral3, rank {rank}, {method}", got, want)
        assert comparison.ok, comparison.line()

