"""Gemma 4's rows with images (#54): its own tower on each image's aspect ratio, the pad token's per-layer inputs, and
its image tokens attending both ways on the sliding-window layers only, exactly.

The family: a tiny `Gemma4ForConditionalGeneration` written by transformers from its default gemma4 config with the
language model and the vision tower shrunk (tests/test_wrappers.py's sizes: per-layer inputs, global layers with their
own head size, the second and the last, a sliding window of 16 that cuts inside the ~60-token images) and no audio
tower (as the larger Gemma 4s; transformers' audio tower has no sdpa attention, which the bf16 bound's references
run), its text config's `use_bidirectional_attention: vision` (the larger Gemma 4s'; the default leaves every layer
causal), longfit's byte tokenizer with Gemma 4's image tokens and a chat template that writes an image part as the
image token, and Gemma 4's own Pillow image processor (70 tokens at most an image). Images are made here with Pillow.
The loss and every gradient (tower and embedder included where they train) equal the wrapper's own eager forward
(which builds its masks from mm_token_type_ids and its per-layer inputs from the ids), each conversation of a packed
row alone, in fp32 and within the bf16 bound; under cp=2 ring and Ulysses on gloo (slow) each rank's summed loss and
gradients equal it too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from test_media import (  # noqa: E402
    IMAGE_SIZES, ONE, TEXT_ONLY, TWO, as_wrapper_names, batches_of_rows, compared as media_compared, image_batch,
    longfit_model, write_rows)
from test_media_gemma3 import cp_rank_step, longfit_step  # noqa: E402
from test_wrappers import WRAPPERS  # noqa: E402

from longfit.check import parity  # noqa: E402

GEMMA4_TOKENS = ("<|image>", "<image|>", "<|image|>")  # begin, end, the image token
RENDER_GEMMA4 = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<|image|>{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{%- endmacro -%}"
)
"""Gemma 4's chat template's rendering of a content list (an image part: the image token), on the byte tokenizer."""
ROWS = {"one conversation": ([ONE], 96, 1), "packed": ([ONE, TEXT_ONLY, TWO, ONE], 256, 2)}
"""(conversations, seq_len, rows a batch): one conversation alone, or two rows of packed conversations (ONE, the text
chat and TWO, then ONE)."""
ROW_CASES = [pytest.param("one conversation", marks=pytest.mark.slow), "packed"]
GLOBAL_SECOND = ["sliding_attention", "full_attention"] * 2
"""A global layer before the last: there its causal image tokens feed the later layers (the last layer's image tokens
feed no target)."""
TOKENS = [63, 64, 60]
"""IMAGE_SIZES' tokens: each resized to Gemma 4's 630-patch budget keeping its aspect ratio, pooled 3 x 3."""


def write_tiny_gemma4(path: Path, seed: int = 0) -> Path:
    """The tiny Gemma 4 wrapper checkpoint (module docstring). transformers initialises the vision embedder's matrix
    to zeros, like Gemma 3's projector (every image embedding 0, no gradient into the tower): drawn with std 0.02."""
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForImageTextToText, Gemma4ImageProcessorPil

    from longfit.data.tokenizer import CHAT_TEMPLATE, byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA4_TOKENS], special_tokens=True)
    tokenizer.chat_template = RENDER_GEMMA4 + CHAT_TEMPLATE.replace("message['content']", "render(message['content'])")
    ids = dict(zip(("boi_token_id", "eoi_token_id", "image_token_id"),
                   tokenizer.convert_tokens_to_ids(list(GEMMA4_TOKENS))))
    torch.manual_seed(seed)
    family = WRAPPERS["gemma4"]
    text = dict(family["text_config"], use_bidirectional_attention="vision", layer_types=GLOBAL_SECOND,
                per_layer_config={"01": {"head_dim": 32}, "03": {"head_dim": 32}})
    config = AutoConfig.for_model("gemma4", text_config=text,
                                  vision_config=family["vision_config"], audio_config=None, **ids)
    model = AutoModelForImageTextToText.from_config(config)
    torch.nn.init.normal_(model.model.embed_vision.embedding_projection.weight, std=0.02)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Gemma4ImageProcessorPil(max_soft_tokens=70).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gemma4_images(tmp_path_factory) -> Path:
    return write_tiny_gemma4(tmp_path_factory.mktemp("gemma4-images"))


@pytest.fixture(scope="module")
def gemma4_batches(gemma4_images, tmp_path_factory):
    return batches_of_rows(gemma4_images, tmp_path_factory.mktemp("gemma4-rows"), ROWS)


def processed_images(checkpoint: Path, folder: Path) -> list[dict]:
    """The image processor's own output for each of write_rows' images: its padded patches and their positions."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(checkpoint)
    images = [Image.open(folder / f"im{i}.png").convert("RGB") for i in range(len(IMAGE_SIZES))]
    out = processor(images=images, return_tensors="pt")
    return [{"pixel_values": out["pixel_values"][i], "image_position_ids": out["image_position_ids"][i]}
            for i in range(len(images))]


def wrapper_step(checkpoint: Path, batch, attention: str = "eager", autocast: bool = False, images=None
                 ) -> parity.Step:
    """The wrapper's own forward on each conversation of the rows alone, with its images as the image processor made
    them (`images`: processed_images, matched to the batch's by their pixels) and mm_token_type_ids (from which
    Gemma 4 builds its masks)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention)
    media, loss, first = batch.media, torch.zeros((), dtype=torch.float64), 0
    positions = [next(i["image_position_ids"] for i in images if torch.equal(i["pixel_values"], pixels))
                 for pixels in media.pixel_values]
    for row, spans in enumerate(batch.documents.rows):
        for start, end in spans:
            count = media.items_in(row, start, end)
            inputs = dict(input_ids=batch.input_ids[row : row + 1, start:end], use_cache=False)
            if count:
                inputs |= dict(pixel_values=media.pixel_values[first : first + count],
                               image_position_ids=torch.stack(positions[first : first + count]),
                               mm_token_type_ids=media.token_types[row : row + 1, start:end])
                first += count
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(**inputs).logits
            part = F.cross_entropy(logits[0].float(), batch.labels[row, start:end], reduction="sum")
            (part / batch.num_label_tokens).backward()
            loss += part.detach().double() / batch.num_label_tokens
    return parity.Step(loss.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})


def compared(checkpoint: Path, batch, vision: str, images, autocast: bool = False):
    """test_media's comparison with this family's steps, under autocast against the wrapper's eager and sdpa steps."""
    def wrapper(*args, **kwargs):
        return wrapper_step(*args, **kwargs, images=images)

    return media_compared(checkpoint, batch, vision, autocast, ("eager", "sdpa"), wrapper, longfit_step)


@pytest.fixture(scope="module")
def images(gemma4_images, tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("gemma4-images-processed")
    write_rows(folder, [ONE])
    return processed_images(gemma4_images, folder)


def test_an_image_is_written_as_gemma4s_processor_writes_it(gemma4_images, gemma4_batches) -> None:
    """ONE's 40 x 50 image: <|image>, its 63 image tokens (21 x 27 patches pooled 3 x 3), <image|>; its pixels the
    processor's padded 630 patches; the same count from the file's header alone (counting an epoch)."""
    from transformers import AutoTokenizer

    from longfit.models.media import media_reader

    begin, end, image = AutoTokenizer.from_pretrained(gemma4_images).convert_tokens_to_ids(list(GEMMA4_TOKENS))
    batch = gemma4_batches["one conversation"]
    (row, start), = batch.media.item_starts
    assert batch.input_ids[row, start - 1 : start + 64].tolist() == [begin] + [image] * 63 + [end]
    assert batch.media.grid_thw.tolist() == [[1, 21, 27]] and batch.media.pixel_values.shape == (1, 630, 768)
    folder = gemma4_images.parent / "header-count"
    write_rows(folder, [ONE])
    reader = media_reader(str(gemma4_images))
    assert [reader.image_tokens(folder / f"im{i}.png") for i in range(3)] == TOKENS


def test_a_missing_video_is_one_line_naming_it(gemma4_images, tmp_path) -> None:
    """Gemma 4's video parts are read by its video processor (tests/test_media_gemma4_av.py; without a
    video_preprocessor_config.json, from the image processor's file, as transformers falls back): a missing video
    is one line naming the file and the fix."""
    from longfit.data.documents import DataError
    from longfit.data.media import check_media_rows
    from longfit.models.media import media_reader

    chat = [{"role": "user", "content": [{"type": "video", "path": "clip.mp4"}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": "a dot"}]
    with pytest.raises(DataError) as refused:
        check_media_rows([("rows.jsonl, line 1", tmp_path, chat)], media_reader(str(gemma4_images)), 256)
    message = str(refused.value)
    assert message == (f"rows.jsonl, line 1: video {tmp_path / 'clip.mp4'} does not exist; fix the path (a relative "
                       "path is relative to the folder of the .jsonl file) or drop that row")


@pytest.mark.parametrize("vision", [pytest.param("frozen", marks=pytest.mark.slow), "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
def test_loss_and_gradients_equal_the_wrapper(gemma4_images, gemma4_batches, images, rows: str, vision: str,
                                              one_thread) -> None:
    batch = gemma4_batches[rows]
    assert batch.media.images == (1 if rows == "one conversation" else 4)
    got, _, want = compared(gemma4_images, batch, vision, images)
    assert got.grads.keys() == want.grads.keys()
    assert any(n.startswith("model.vision_tower.") for n in got.grads) == (vision == "all")
    assert any("per_layer" in n for n in got.grads)
    comparison = parity.compare_fp32(f"gemma4, {rows}", got, want)
    # Twice longfit check's fp32 bound, as tests/test_wrappers.py's Gemma 4 (transformers' std-0.02 initialisation,
    # whose norm gradients cancel): measured 1.8x (one conversation) and 1.4x (packed), the wrapper's own sdpa step
    # against its eager one 1.6x and 1.1x on the same rows.
    assert comparison.worst[1] <= 2, comparison.line()


@pytest.mark.slow  # the wrapper three times and longfit once
@pytest.mark.parametrize("rows", list(ROWS))
def test_bf16_loss_and_gradients_are_within_the_bf16_bound(gemma4_images, gemma4_batches, images, rows: str,
                                                           one_thread) -> None:
    got, references, truth = compared(gemma4_images, gemma4_batches[rows], "all", images, autocast=True)
    comparison = parity.compare_bf16(f"gemma4, {rows}", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


@pytest.mark.parametrize("layers", ["every layer", pytest.param("none", marks=pytest.mark.slow)])
def test_with_the_spans_on_other_layers_the_loss_is_not_the_wrappers(gemma4_images, gemma4_batches, images,
                                                                     monkeypatch, layers: str, one_thread) -> None:
    """The comparison can fail: the images' spans on the global layers too (Gemma 3's rule), or on no layer."""
    from longfit.data.packing import DocumentLayout
    from longfit.models.media import MediaEncoder

    batch = gemma4_batches["packed"]
    truth = wrapper_step(gemma4_images, batch, images=images)
    if layers == "none":
        monkeypatch.setattr("longfit.models.media_gemma4.Gemma4MediaEncoder.attention_layout",
                            MediaEncoder.attention_layout)
    else:
        every = DocumentLayout.with_bidirectional
        monkeypatch.setattr(DocumentLayout, "with_bidirectional", lambda self, spans, sliding_layers_only=False:
                            every(self, spans))
    other = longfit_step(longfit_model(gemma4_images, "frozen"), batch)
    assert abs(float(other.loss) - float(truth.loss)) > 1e-4


@pytest.mark.slow  # two gloo ranks per case, each building the model
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_equals_the_wrapper(gemma4_images, images, tmp_path, method: str) -> None:
    from parallel_harness import run_distributed

    conversations, seq_len, micro_batch = ROWS["packed"]
    path = write_rows(tmp_path, conversations)
    batch = image_batch(gemma4_images, path, seq_len, micro_batch)
    truth = wrapper_step(gemma4_images, batch, images=images)
    loss_module = longfit_model(gemma4_images, "all")
    for rank, got in enumerate(run_distributed(cp_rank_step, 2, gemma4_images, path, seq_len, micro_batch, method)):
        got = as_wrapper_names(got, loss_module, truth.grads)
        want = parity.Step(truth.loss, {n: g for n, g in truth.grads.items() if n in got.grads})
        assert got.grads.keys() == want.grads.keys()
        comparison = parity.compare_fp32(f"gemma4, rank {rank}, {method}", got, want)
        assert comparison.worst[1] <= 2, comparison.line()  # test_loss_and_gradients_equal_the_wrapper's bound
