"""Llama 4's rows with images (#54): its tower on each image's tiles and the whole image, exactly.

The family: a tiny `Llama4ForConditionalGeneration` written by transformers from its default llama4 config with the
language model and the tower shrunk (tests/test_wrappers.py's language model: MoE layers, chunked attention with
chunks of 16 on its RoPE layers, a NoPE global layer with temperature tuning; a tower on tiles of 64 pixels in
8-pixel patches, pixel-shuffled to 16 tokens a tile), longfit's byte tokenizer with Llama 4's image tokens and a chat
template that writes an image part as `<|image|>`.

Llama4ImageProcessor needs torchvision, which does not load on these CPU machines, so the tiles are made here as it
makes them (`Tiles`: each image's canvas of whole tiles, the resized image cut into them row by row, the whole image
as one more tile when there are several, rescaled and normalized in bf16), and an image is written by the processor's
own `_prompt_split_image` (longfit's reader calls it). The images of test_media's rows take 1 x 1, 1 x 1 and 1 x 2
tiles: 19, 19 and 53 tokens, each crossing a chunk edge. The loss and every gradient (tower and projector included
where they train) equal the wrapper's own eager forward, each conversation of a packed row alone, in fp32 and within
the bf16 bound; under cp=2 ring and Ulysses on gloo (slow) each rank's summed loss and gradients equal it too. Without
torchvision, an image row for Llama 4 is one error line naming the package and the fix, and its text rows train; where
torchvision loads, the checkpoint's own Llama4ImageProcessor makes the rows, their ids and pixels Llama4Processor's
own, and they train exactly.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from test_media import (  # noqa: E402
    ONE, TEXT_ONLY, TWO, as_wrapper_names, compared as media_compared, longfit_model, write_rows)
from test_wrappers import VISION, WRAPPERS  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.config import load_config  # noqa: E402

LLAMA4_TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                 "<|tile_y_separator|>")
RENDER_LLAMA4 = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<|image|>{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{%- endmacro -%}"
)
"""Llama 4's chat template's rendering of a content list (an image part: `<|image|>`), on the byte tokenizer."""
TILE = 64
LLAMA4_VISION = dict(VISION, intermediate_size=128, image_size=TILE, patch_size=8, vision_output_dim=64,
                     projector_input_dim=64, projector_output_dim=64)
"""The tower's MLP after the pixel shuffle takes 4 x hidden_size (its intermediate_size); 8 x 8 patches a tile."""
PER_TILE = 16  # 8 x 8 patches, pixel-shuffled by 1/2 on each side
ROWS = {"one conversation": ([ONE], 48, 1), "packed": ([ONE, TEXT_ONLY, TWO, ONE], 160, 2)}
"""(conversations, seq_len, rows a batch): one conversation alone, or two rows of packed conversations (ONE, the text
chat and TWO, then ONE)."""
ROW_CASES = [pytest.param("one conversation", marks=pytest.mark.slow), "packed"]


class Tiles:
    """Llama 4's tiles of images as Llama4ImageProcessor makes them, with Pillow for torchvision: a canvas of whole
    TILE x TILE tiles (here each side over TILE, rounded up, which is the processor's choice for these images), the
    image resized into it without distortion and padded below and right with zeros, cut into tiles row by row, and
    the whole image resized to one more tile after them when there are several; rescaled and normalized in bf16."""

    @staticmethod
    def tiles(height: int, width: int) -> tuple[int, int]:
        return math.ceil(height / TILE), math.ceil(width / TILE)

    def __call__(self, images, return_tensors: str = "pt") -> dict:
        from PIL import Image

        def normalized(image) -> torch.Tensor:  # (C, H, W) bf16, as the processor's rescale_and_normalize
            pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).to(torch.bfloat16) * (1 / 255)
            return (pixels - 0.5) / 0.5

        tiles, ratios = [], []
        for image in images:
            rows, columns = self.tiles(image.height, image.width)
            scale = min(columns * TILE / image.width, rows * TILE / image.height)
            canvas = Image.new("RGB", (columns * TILE, rows * TILE))
            canvas.paste(image.resize((math.floor(image.width * scale), math.floor(image.height * scale)),
                                      Image.Resampling.BILINEAR))
            pixels = normalized(canvas)
            tiles += [pixels[:, r * TILE : (r + 1) * TILE, c * TILE : (c + 1) * TILE]
                      for r in range(rows) for c in range(columns)]
            if rows * columns > 1:
                tiles.append(normalized(image.resize((TILE, TILE), Image.Resampling.BILINEAR)))
            ratios.append((rows, columns))
        return {"pixel_values": torch.stack(tiles), "aspect_ratios": torch.tensor(ratios)}


def write_tiny_llama4(path: Path, seed: int = 0, **text) -> Path:
    """The tiny Llama 4 wrapper checkpoint (module docstring), with the preprocessor_config.json Llama 4 checkpoints
    ship (Llama4ImageProcessor's, which cannot be built here without torchvision); `text`: more of its text config's
    values."""
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForImageTextToText

    from longfit.data.tokenizer import CHAT_TEMPLATE, byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA4_TOKENS], special_tokens=True)
    tokenizer.chat_template = RENDER_LLAMA4 + CHAT_TEMPLATE.replace("message['content']", "render(message['content'])")
    ids = dict(zip(("boi_token_index", "eoi_token_index", "image_token_index"),
                   tokenizer.convert_tokens_to_ids(["<|image_start|>", "<|image_end|>", "<|patch|>"])))
    torch.manual_seed(seed)
    config = AutoConfig.for_model("llama4", text_config=dict(WRAPPERS["llama4"]["text_config"], **text),
                                  vision_config=LLAMA4_VISION, **ids)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Llama4ImageProcessor", "size": {"height": TILE, "width": TILE}, "max_patches": 4}))
    return path


@pytest.fixture(scope="session")
def llama4_images(tmp_path_factory) -> Path:
    return write_tiny_llama4(tmp_path_factory.mktemp("llama4-images"))


def tiles_reader(checkpoint: Path):
    """longfit's reader of Llama 4's image parts with `Tiles` for its image processor."""
    from transformers import AutoConfig, AutoTokenizer

    from longfit.data.media import MediaReader
    from longfit.models.media_llama4 import tiles_spec

    config = AutoConfig.from_pretrained(checkpoint)
    return MediaReader(tiles_spec(config, AutoTokenizer.from_pretrained(checkpoint), Tiles.tiles), Tiles())


def llama4_batch(checkpoint: Path, rows: Path, seq_len: int, micro_batch: int = 1, media=None):
    """The first packed batch longfit's reader makes of `rows` (test_media.image_batch's, with `tiles_reader`)."""
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer

    cfg = load_config(None, [f"model={checkpoint}", f"data.path={rows}", f"seq_len={seq_len}",
                             f"train.micro_batch={micro_batch}"])
    return next(build_dataloader(cfg, load_tokenizer(str(checkpoint)), epochs=1,
                                 media=media or tiles_reader(checkpoint)))


@pytest.fixture(scope="module")
def llama4_batches(llama4_images, tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4-rows")
    return {name: llama4_batch(llama4_images, write_rows(root / name.replace(" ", "-"), rows), seq_len, micro_batch)
            for name, (rows, seq_len, micro_batch) in ROWS.items()}


def trained_grads(loss_module) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient: the language model's under its causal LM's names, the vision side's under
    the wrapper's (its top-level `vision_model.*`, `multi_modal_projector.*`)."""
    named = [*loss_module.model.named_parameters(), *loss_module.media_encoder.vision.named_parameters()]
    return {n: p.grad.float() for n, p in named if p.requires_grad}


def longfit_step(loss_module, batch, autocast: bool = False) -> parity.Step:
    from longfit.memory.loss import batch_loss_sum

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = batch_loss_sum(loss_module, batch) / batch.num_label_tokens
    loss.backward()
    return parity.Step(loss.detach().float(), trained_grads(loss_module))


def tile_starts(grid_thw: torch.Tensor) -> list[int]:
    """Where each image's tiles start in the batch's pixel_values (its tiles, and the global tile after several)."""
    tiles = (grid_thw[:, 1] * grid_thw[:, 2]).tolist()
    return [0, *np.cumsum([n + (n > 1) for n in tiles]).tolist()]


def wrapper_logits(model, **inputs) -> torch.Tensor:
    """The logits of the wrapper's own forward: transformers 5.24's Llama4ForConditionalGeneration.forward computes them
    (tower, projector, the embeddings scattered over `image_token_id`, its language model) and then fails to build its
    output object (its language model's output has no `image_outputs`, tests/test_wrappers.py's `text_model`), so
    they are read off its language model's output."""
    taken = []
    hook = model.language_model.register_forward_hook(lambda module, args, output: taken.append(output.logits))
    try:
        model(**inputs)
    except AttributeError as e:
        if "image_outputs" not in str(e):
            raise
    finally:
        hook.remove()
    return taken[0]


def wrapper_step(checkpoint: Path, batch, attention: str = "eager", autocast: bool = False) -> parity.Step:
    """The wrapper's own forward on each conversation of the rows alone, with its images' tiles (in fp32: the
    processor's are bf16, the fp32 wrapper's patch embedding takes its own dtype)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention)
    media, loss, first = batch.media, torch.zeros((), dtype=torch.float64), 0
    starts = tile_starts(media.grid_thw)
    for row, spans in enumerate(batch.documents.rows):
        for start, end in spans:
            images = media.items_in(row, start, end)
            inputs = dict(input_ids=batch.input_ids[row : row + 1, start:end], use_cache=False)
            if images:
                inputs |= dict(pixel_values=media.pixel_values[starts[first] : starts[first + images]].float())
                first += images
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = wrapper_logits(model, **inputs)
            part = F.cross_entropy(logits[0].float(), batch.labels[row, start:end], reduction="sum")
            (part / batch.num_label_tokens).backward()
            loss += part.detach().double() / batch.num_label_tokens
    return parity.Step(loss.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})


def compared(checkpoint: Path, batch, vision: str, autocast: bool = False):
    """test_media's comparison with this family's steps, under autocast against the wrapper's eager and sdpa steps."""
    return media_compared(checkpoint, batch, vision, autocast, ("eager", "sdpa"), wrapper_step, longfit_step)


def test_an_image_is_written_as_llama4s_processor_writes_it(llama4_images, llama4_batches) -> None:
    """TWO's 33 x 70 image: 1 x 2 tiles and the global tile, written `<|image_start|>`, 16 `<|patch|>`s,
    `<|tile_x_separator|>`, 16, `<|tile_y_separator|>`, `<|image|>`, the global tile's 16, `<|image_end|>`; only the
    `<|patch|>`s take embeddings, in the tiles' order; the same count from the file's header alone."""
    from transformers import AutoTokenizer

    start_, end_, image, patch, x_sep, y_sep = AutoTokenizer.from_pretrained(llama4_images).convert_tokens_to_ids(
        list(LLAMA4_TOKENS))
    media = llama4_batches["packed"].media
    assert media.grid_thw.tolist() == [[1, 1, 1], [1, 1, 1], [1, 1, 2], [1, 1, 1]]
    assert media.pixel_values.shape == (6, 3, TILE, TILE) and media.pixel_values.dtype == torch.bfloat16
    row, start = media.item_starts[2]
    want = [start_, *[patch] * 16, x_sep, *[patch] * 16, y_sep, image, *[patch] * 16, end_]
    ids = llama4_batches["packed"].input_ids[row, start : start + len(want)].tolist()
    assert ids == want
    index = media.embedding_index[row, start : start + len(want)]
    assert index[index >= 0].tolist() == list(range(32, 80))  # after the two 1 x 1 images' 16 each
    assert [i == patch for i in want] == (index >= 0).tolist()
    row, start = media.item_starts[0]
    assert llama4_batches["packed"].input_ids[row, start : start + 19].tolist() == [start_, image, *[patch] * 16, end_]
    folder = llama4_images.parent / "header-count"
    write_rows(folder, [ONE])
    reader = tiles_reader(llama4_images)
    assert [reader.image_tokens(folder / f"im{i}.png") for i in range(3)] == [19, 19, 53]


@pytest.mark.parametrize("vision", [pytest.param("frozen", marks=pytest.mark.slow), "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
def test_loss_and_gradients_equal_the_wrapper(llama4_images, llama4_batches, rows: str, vision: str,
                                              one_thread) -> None:
    batch = llama4_batches[rows]
    assert batch.media.images == (1 if rows == "one conversation" else 4)
    got, _, want = compared(llama4_images, batch, vision)
    assert got.grads.keys() == want.grads.keys()
    assert any(n.startswith("vision_model.") for n in got.grads) == (vision == "all")
    comparison = parity.compare_fp32(f"llama4, {rows}", got, want)
    assert comparison.ok, comparison.line()


def test_without_the_chunks_the_loss_is_not_the_wrappers(llama4_images, llama4_batches, monkeypatch,
                                                           one_thread) -> None:
    """The comparison can fail: Llama 4's chunked layers attending over whole documents (its images cross chunk
    edges) are not the wrapper's."""
    batch = llama4_batches["packed"]
    truth = wrapper_step(llama4_images, batch)
    monkeypatch.setattr("longfit.models.attention.attention_chunk", lambda module: None)
    whole = longfit_step(longfit_model(llama4_images, "frozen"), batch)
    assert abs(float(whole.loss) - float(truth.loss)) > 1e-4


@pytest.mark.parametrize("rows", ROW_CASES)  # the wrapper three times and longfit once: ~3 s packed
def test_bf16_loss_and_gradients_are_within_the_bf16_bound(llama4_images, llama4_batches, rows: str,
                                                           one_thread) -> None:
    got, references, truth = compared(llama4_images, llama4_batches[rows], "all", autocast=True)
    comparison = parity.compare_bf16(f"llama4, {rows}", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def cp_rank_step(rank: int, world_size: int, checkpoint: Path, rows: Path, seq_len: int, micro_batch: int,
                 method: str):
    """One rank of a cp group (test_media_gemma3.cp_rank_step's, with this family's reader and names)."""
    import torch.distributed as dist

    from longfit.memory.loss import batch_loss_sum
    from longfit.parallel.batch import global_valid_tokens, shard_batch
    from longfit.parallel.media import DealtMedia
    from longfit.parallel.parallelize import apply_context_parallel

    group = dist.group.WORLD
    loss_module = longfit_model(checkpoint, "all")
    layout = apply_context_parallel(loss_module.model, group, method)
    loss_module.media_features = DealtMedia(group)
    shard = shard_batch(llama4_batch(checkpoint, rows, seq_len, micro_batch), rank, world_size, layout)
    loss = batch_loss_sum(loss_module, shard) / global_valid_tokens(shard.labels, group)
    loss.backward()
    dist.all_reduce(loss := loss.detach())
    grads = trained_grads(loss_module)
    for grad in grads.values():
        dist.all_reduce(grad)
    return parity.Step(loss, grads)


@pytest.mark.slow  # two gloo ranks a case, each building the model: 43-53 s ring, 32-39 s Ulysses (load 11-12, 2 cores)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_equals_the_wrapper(llama4_images, tmp_path, method: str) -> None:
    from parallel_harness import run_distributed

    conversations, seq_len, micro_batch = ROWS["packed"]
    path = write_rows(tmp_path, conversations)
    truth = wrapper_step(llama4_images, llama4_batch(llama4_images, path, seq_len, micro_batch))
    loss_module = longfit_model(llama4_images, "all")
    for rank, got in enumerate(run_distributed(cp_rank_step, 2, llama4_images, path, seq_len, micro_batch, method)):
        got = as_wrapper_names(got, loss_module, truth.grads)
        want = parity.Step(truth.loss, {n: g for n, g in truth.grads.items() if n in got.grads})
        assert got.grads.keys() == want.grads.keys()
        comparison = parity.compare_fp32(f"llama4, rank {rank}, {method}", got, want)
        assert comparison.ok, comparison.line()


def torchvision_loads() -> bool:
    from longfit.models.media_llama4 import Llama4MediaEncoder

    return Llama4MediaEncoder.missing_backend() is None


@pytest.mark.skipif(not torchvision_loads(), reason="Llama4ImageProcessor needs torchvision (here `Tiles` stands in)")
def test_the_image_processor_makes_the_rows_longfit_reads_and_they_train_exactly(llama4_images, tmp_path,
                                                                                  one_thread) -> None:
    """Where torchvision loads: each conversation's ids and pixels from longfit's reader (the checkpoint's
    Llama4ImageProcessor) are Llama4Processor's own, an image's tokens counted from its header are those it takes,
    and the packed rows train exactly."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Llama4Processor

    from longfit.models.media import media_reader

    reader = media_reader(str(llama4_images))
    tokenizer = AutoTokenizer.from_pretrained(llama4_images)
    processor = Llama4Processor(image_processor=AutoImageProcessor.from_pretrained(llama4_images), tokenizer=tokenizer,
                                patch_size=LLAMA4_VISION["patch_size"], chat_template=tokenizer.chat_template)
    folder = tmp_path / "chats"
    write_rows(folder, [ONE])
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (120, 100, 3), dtype=np.uint8)).save(folder / "im3.png")
    tiled = [{"role": "user", "content": [{"type": "image", "path": "im3.png"}, {"type": "text", "text": "and?"},
                                          {"type": "image", "path": "im2.png"}]}, {"role": "assistant", "content": "2"}]
    for chat in (ONE, TWO, tiled):  # 1 x 1, 1 x 1 and 1 x 2, 2 x 2 and 1 x 2 tiles
        batch = llama4_batch(llama4_images, write_rows(folder, [chat]), 256, media=reader)
        (start, end), *_ = batch.documents.rows[0]
        paths = [folder / part["path"] for message in chat if isinstance(message["content"], list)
                 for part in message["content"] if part["type"] == "image"]
        want = processor(text=tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False,
                         images=[Image.open(path).convert("RGB") for path in paths], return_tensors="pt")
        assert batch.input_ids[0, start:end].tolist() == want["input_ids"][0].tolist()
        assert torch.equal(batch.media.pixel_values, want["pixel_values"])
        assert [reader.image_tokens(path) for path in paths] == [len(reader.spec.layout(grid))
                                                                  for grid in batch.media.grid_thw]
    conversations, seq_len, micro_batch = ROWS["packed"]
    batch = llama4_batch(llama4_images, write_rows(tmp_path / "packed", conversations), seq_len, micro_batch,
                         media=reader)
    got, _, want = compared(llama4_images, batch, "all")
    comparison = parity.compare_fp32("llama4, the image processor's rows", got, want)
    assert comparison.ok, comparison.line()


@pytest.mark.skipif(torchvision_loads(), reason="torchvision loads here: Llama 4's image processor runs")
def test_without_torchvision_an_image_row_is_one_line_and_text_rows_train(llama4_images, tmp_path, capsys) -> None:
    from longfit.cli import main
    from longfit.data.documents import DataError
    from longfit.models.media import image_reader

    path = write_rows(tmp_path / "images", [ONE])
    with pytest.raises(DataError, match=r"rows\.jsonl, line 1: image .*im0\.png: Llama 4's image processor "
                                        r"\(Llama4ImageProcessor: its tiles\) needs torchvision, .*`pip install "
                                        r"torchvision` built for this torch"):
        llama4_batch(llama4_images, path, 64, media=image_reader(str(llama4_images)))
    assert main(["train", f"model={llama4_images}", f"data.path={path}", "seq_len=64", "train.device=cpu",
                 f"output_dir={tmp_path / 'out'}"]) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("longfit: error: ") and "pip install torchvision" in error[0]
    text = llama4_batch(llama4_images, write_rows(tmp_path / "text", [TEXT_ONLY]), 64,
                        media=image_reader(str(llama4_images)))
    assert text.media is None and int((text.labels != -100).sum()) > 0


@pytest.mark.skipif(torchvision_loads(), reason="torchvision loads here: Llama 4's image processor runs")
def test_without_torchvision_the_plan_of_images_is_one_line(llama4_images, tmp_path, capsys) -> None:
    """`longfit plan` of Llama 4 images cannot count its tiles without the image processor: planned images
    (data.plan_images) and the data's image rows are each one line naming torchvision; its text rows plan."""
    from longfit.cli import main

    rows = write_rows(tmp_path / "images", [ONE])
    given = ["plan", f"model={llama4_images}", "seq_len=256", "train.vision=all", "eval.retrieval=false"]
    for images in (["data.plan_images=2", "data.plan_image_size=100x130"], [f"data.path={rows}"]):
        assert main([*given, *images]) != 0
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and error[0].startswith("longfit: error: ") and "pip install torchvision" in error[0]
        assert images[0].split("=")[0] in error[0] or "im0.png" in error[0]
    assert main(given) == 0
