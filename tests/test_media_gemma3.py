"""Gemma 3's rows with images (#54): its image tokens attend to each other both ways, exactly, without a mask.

The kernels: a bidirectional span's later keys (models/blockwise.py's strict upper triangle) cover exactly the pairs
j > i of any rectangle, and local, ring and Ulysses attention with spans (packed documents, global and sliding
layers) equal a dense mask built as transformers builds Gemma 3's: OR(causal, same image), AND the window.

The family: a tiny `Gemma3ForConditionalGeneration` written by transformers from its default gemma3 config with the
language model and SigLIP tower shrunk (tests/test_wrappers.py's sizes; a sliding window of 8 that cuts inside the
16-token images; the projector pools 8 x 8 patches to 16 tokens), longfit's byte tokenizer with Gemma's image tokens
and a chat template that writes an image part as `<start_of_image>`, and Gemma 3's own Pillow image processor. Images
are made here with Pillow. The loss and every gradient (tower and projector included where they train) equal the
wrapper's own eager forward (which builds its bidirectional mask from token_type_ids), each conversation of a packed
row alone, in fp32 and within the bf16 bound; under cp=2 ring and Ulysses on gloo (slow) the summed loss and
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
    ONE, TEXT_ONLY, TWO, as_wrapper_names, batches_of_rows, image_batch, longfit_model, write_rows,
    compared as media_compared)
from test_wrappers import TEXT, VISION  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.data.packing import DocumentLayout  # noqa: E402

GEMMA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
RENDER_GEMMA = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}<start_of_image>{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{%- endmacro -%}"
)
"""Gemma 3's chat template's rendering of a content list (an image part: `<start_of_image>`), on the byte tokenizer."""
GEMMA_TEXT = dict(TEXT, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                  query_pre_attn_scalar=16)
GEMMA_VISION = dict(VISION, image_size=64, patch_size=8)
TOKENS_PER_IMAGE = 16  # 8 x 8 patches pooled 2 x 2
ROWS = {"one conversation": ([ONE], 80, 1), "packed": ([ONE, TEXT_ONLY, TWO, ONE], 128, 2)}
"""(conversations, seq_len, rows a batch): one conversation alone (ONE: 43 tokens, its image across the ring's chunk
edge at 20 under cp=2), or two rows of packed conversations (ONE, the text chat and TWO, then ONE; TWO's second image
across the chunk edge at 96)."""
ROW_CASES = [pytest.param("one conversation", marks=pytest.mark.slow), "packed"]
"""The default suite's exactness case is the packed rows with the vision side trained; the rest is slow (#54's
default-suite budget)."""
PREFIX = "model."


def write_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    """The tiny Gemma 3 wrapper checkpoint (module docstring). transformers initialises the projector's matrix to
    zeros (every image embedding 0, no gradient into the tower): drawn here with std 0.02, as its other matrices."""
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForImageTextToText, Gemma3ImageProcessorPil

    from longfit.data.tokenizer import CHAT_TEMPLATE, byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_TOKENS], special_tokens=True)
    tokenizer.chat_template = RENDER_GEMMA + CHAT_TEMPLATE.replace("message['content']", "render(message['content'])")
    ids = dict(zip(("boi_token_index", "eoi_token_index", "image_token_index"),
                   tokenizer.convert_tokens_to_ids(list(GEMMA_TOKENS))))
    torch.manual_seed(seed)
    config = AutoConfig.for_model("gemma3", text_config=GEMMA_TEXT, vision_config=GEMMA_VISION,
                                  mm_tokens_per_image=TOKENS_PER_IMAGE, **ids)
    model = AutoModelForImageTextToText.from_config(config)
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gemma3_images(tmp_path_factory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3-images"))


@pytest.fixture(scope="module")
def gemma3_batches(gemma3_images, tmp_path_factory):
    return batches_of_rows(gemma3_images, tmp_path_factory.mktemp("gemma3-rows"), ROWS)


def trained_grads(loss_module) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient: the language model's under its causal LM's names, the vision side's
    under the wrapper's. SigLIP's pooling head is not on Gemma 3's path (it takes the last hidden state): no
    gradient, as in the wrapper."""
    named = [*loss_module.model.named_parameters(),
             *((PREFIX + n, p) for n, p in loss_module.media_encoder.vision.named_parameters())]
    return {n: p.grad.float() for n, p in named if p.requires_grad and (p.grad is not None or ".head." not in n)}


def longfit_step(loss_module, batch, autocast: bool = False) -> parity.Step:
    from longfit.memory.loss import batch_loss_sum

    batch.media.positions = loss_module.media_encoder.rope_positions(batch.input_ids, batch.position_ids, batch.media)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = batch_loss_sum(loss_module, batch) / batch.num_label_tokens
    loss.backward()
    return parity.Step(loss.detach().float(), trained_grads(loss_module))


def wrapper_step(checkpoint: Path, batch, attention: str = "eager", autocast: bool = False) -> parity.Step:
    """The wrapper's own forward on each conversation of the rows alone, with its images and their token_type_ids
    (from which Gemma 3 builds the bidirectional mask): `longfit check`'s reference (`longfit.check.media`)."""
    from transformers import AutoModelForImageTextToText

    from longfit.check.media import wrapper_step as reference_step
    from longfit.models.media import build_media_encoder

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention)
    return reference_step(model, build_media_encoder(str(checkpoint)), batch, autocast=autocast)


def compared(checkpoint: Path, batch, vision: str, autocast: bool = False):
    """test_media's comparison with this family's steps, under autocast against the wrapper's eager and sdpa steps."""
    return media_compared(checkpoint, batch, vision, autocast, ("eager", "sdpa"), wrapper_step, longfit_step)


# -- the kernels ----------------------------------------------------------------------------------------------------

def test_later_keys_cover_exactly_the_pairs_after_each_query() -> None:
    from longfit.models.blockwise import _later_keys
    from longfit.models.kernels import FULL, LOWER, UPPER

    def pairs(piece) -> set[tuple[int, int]]:
        i0, i1, j0, j1, mask = piece
        assert mask != LOWER and (mask != UPPER or i1 - i0 == j1 - j0)
        return {(i0 + r, j0 + c) for r in range(i1 - i0) for c in range(j1 - j0) if mask == FULL or c >= r}

    for q0, q1, k0, k1 in [(a, b, c, d) for a in range(6) for b in range(a, 7) for c in range(6) for d in range(c, 7)]:
        covered = [pairs(p) for p in _later_keys(q0, q1, k0, k1)]
        assert sum(map(len, covered)) == len(set().union(*covered))  # no pair twice
        assert set().union(*covered) == {(i, j) for i in range(q0, q1) for j in range(k0, k1) if j > i}


DOCS = (((0, 18), (18, 40)), ((0, 40),))
SPANS = (((3, 9), (20, 31)), ((0, 5), (12, 30)))
"""Packed documents and the image spans in them: a span at a document's start, spans cut by the ring's chunk
edges (chunks of 10 tokens under cp=2), spans longer than the window."""


def dense_reference(q, k, v, dout, window):
    """Gemma 3's mask as transformers builds it, dense: per document, OR(j <= i, same span) AND (j > i - window)."""
    B, H, L, D = q.shape
    visible = torch.zeros(B, 1, L, L, dtype=torch.bool)
    position = torch.arange(L)
    for b in range(B):
        for start, end in DOCS[b]:
            inside = (position >= start) & (position < end)
            visible[b, 0] |= inside[:, None] & inside[None, :] & (position[None, :] <= position[:, None])
        for start, end in SPANS[b]:
            inside = (position >= start) & (position < end)
            visible[b, 0] |= inside[:, None] & inside[None, :]
    if window is not None:
        visible &= position[None, :] > position[:, None] - window
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    groups = H // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         attn_mask=visible)
    return {"out": out.detach(), **dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout)))}


def kernel_inputs():
    gen = torch.Generator().manual_seed(54)
    return [torch.randn(2, h, 40, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4)]


@pytest.mark.parametrize("window", [None, 5, 16])
def test_bidirectional_spans_equal_the_dense_mask_on_one_device(window) -> None:
    from longfit.models.attention import local_attention

    q, k, v, dout = kernel_inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = local_attention(q, k, v, None, DocumentLayout(DOCS, 40).with_bidirectional(SPANS), window)
    out.backward(dout)
    want = dense_reference(q, k, v, dout, window)
    for name, got in {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        torch.testing.assert_close(got, want[name], msg=name)


def cp_kernel_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from longfit.parallel.context import ContextParallelAttention
    from longfit.parallel.sharding import gather_sequence, shard_sequence

    results = {}
    for method in ("ring", "ulysses"):
        attention = ContextParallelAttention(dist.group.WORLD, method)
        for window in (None, 5, 16):
            q, k, v, dout = kernel_inputs()
            local = [shard_sequence(t, 2, rank, world_size, attention.layout).clone().requires_grad_()
                     for t in (q, k, v)]
            out = attention(*local, documents=DocumentLayout(DOCS, 40).with_bidirectional(SPANS), window=window)
            out.backward(shard_sequence(dout, 2, rank, world_size, attention.layout))
            tensors = {"out": out, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
            results[method, window] = {n: gather_sequence(t.detach(), 2, dist.group.WORLD, attention.layout)
                                       for n, t in tensors.items()}
    return results


@pytest.mark.slow  # one spawn of two gloo ranks, six calls each
def test_bidirectional_spans_under_ring_and_ulysses_equal_the_dense_mask() -> None:
    from parallel_harness import run_distributed

    q, k, v, dout = kernel_inputs()
    for results in run_distributed(cp_kernel_rank, 2):
        for (method, window), got in results.items():
            want = dense_reference(q, k, v, dout, window)
            for name in want:
                torch.testing.assert_close(got[name], want[name], msg=f"{method}, window {window}: {name}")


def test_the_ring_keeps_its_halo_where_no_span_crosses_a_chunk() -> None:
    from longfit.parallel.ring import _ring_schedule

    inside = DocumentLayout(DOCS, 40).with_bidirectional(((((3, 9),)), ((12, 19),)))
    assert _ring_schedule(0, 2, 2, 20, inside, 5).halo == 4
    assert _ring_schedule(0, 2, 2, 20, DocumentLayout(DOCS, 40).with_bidirectional(SPANS), 5).halo is None


# -- the family -----------------------------------------------------------------------------------------------------

def test_an_image_is_written_as_gemma3s_processor_writes_it(gemma3_images, gemma3_batches) -> None:
    """"\\n\\n<start_of_image>", 16 image tokens (type 1, each its own embedding), "<end_of_image>\\n\\n"."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gemma3_images)
    batch = gemma3_batches["one conversation"]
    (row, start), = batch.media.item_starts
    ids = batch.input_ids[row].tolist()
    assert ids[start - 3 : start] == [10, 10, config.boi_token_id]
    assert ids[start : start + TOKENS_PER_IMAGE] == [config.image_token_id] * TOKENS_PER_IMAGE
    assert ids[start + TOKENS_PER_IMAGE : start + TOKENS_PER_IMAGE + 3] == [config.eoi_token_id, 10, 10]
    assert batch.media.token_types[row].nonzero().flatten().tolist() == list(range(start, start + TOKENS_PER_IMAGE))
    assert batch.media.pixel_values.shape == (1, 3, 64, 64)


def test_an_image_fits_a_row_with_its_markers(gemma3_images, tmp_path) -> None:
    """The check before the first step counts an image with the markers kept or left out with it (6 tokens here):
    a row of the image's tokens and fewer than its markers is refused, naming the row."""
    from PIL import Image

    from longfit.data.media import check_media_rows
    from longfit.data.sources import DataError
    from longfit.models.media import media_reader

    Image.new("RGB", (32, 32)).save(tmp_path / "page.png")
    rows = [("row 1", tmp_path, [{"role": "user", "content": [{"type": "image", "path": "page.png"}]}])]
    reader = media_reader(str(gemma3_images))
    assert check_media_rows(rows, reader, TOKENS_PER_IMAGE + 6) == 1
    with pytest.raises(DataError, match=f"row 1: its images take {TOKENS_PER_IMAGE + 6} tokens"):
        check_media_rows(rows, reader, TOKENS_PER_IMAGE + 5)


@pytest.mark.parametrize("vision", [pytest.param("frozen", marks=pytest.mark.slow), "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
def test_loss_and_gradients_equal_the_wrapper(gemma3_images, gemma3_batches, rows: str, vision: str,
                                              one_thread) -> None:
    batch = gemma3_batches[rows]
    assert batch.media.images == (1 if rows == "one conversation" else 4)
    got, _, want = compared(gemma3_images, batch, vision)
    assert got.grads.keys() == want.grads.keys()
    assert any(n.startswith(PREFIX + "vision_tower.") for n in got.grads) == (vision == "all")
    comparison = parity.compare_fp32(f"gemma3, {rows}", got, want)
    assert comparison.ok, comparison.line()


@pytest.mark.slow  # the wrapper three times and longfit once: ~5 s a case
@pytest.mark.parametrize("rows", list(ROWS))
def test_bf16_loss_and_gradients_are_within_the_bf16_bound(gemma3_images, gemma3_batches, rows: str,
                                                           one_thread) -> None:
    got, references, truth = compared(gemma3_images, gemma3_batches[rows], "all", autocast=True)
    comparison = parity.compare_bf16(f"gemma3, {rows}", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_without_the_image_spans_the_loss_is_not_the_wrappers(gemma3_images, gemma3_batches, monkeypatch,
                                                                one_thread) -> None:
    """The comparison can fail: causal attention over the images (the spans taken off) is not Gemma 3's."""
    from longfit.models.media import MediaEncoder
    from longfit.models.media_gemma3 import Gemma3MediaEncoder

    batch = gemma3_batches["packed"]
    truth = wrapper_step(gemma3_images, batch)
    monkeypatch.setattr(Gemma3MediaEncoder, "attention_layout", MediaEncoder.attention_layout)
    causal = longfit_step(longfit_model(gemma3_images, "frozen"), batch)
    assert abs(float(causal.loss) - float(truth.loss)) > 1e-4


def test_the_trained_vision_side_is_exported_under_the_checkpoints_keys(gemma3_images) -> None:
    """transformers 5 writes Gemma 3 in its older layout (`vision_tower.*`, `multi_modal_projector.*`): the tower is
    read from those keys by transformers' own loading rules, and the export writes what trained back under them."""
    from safetensors import safe_open

    from longfit.models.media import build_media_encoder, trainable_parts
    from longfit.models.weights import checkpoint_files
    from longfit.train.export import trained_vision

    encoder = build_media_encoder(str(gemma3_images))
    trained = {id(p) for p in trainable_parts(encoder, "projector")}
    assert trained == {id(p) for p in encoder.vision["multi_modal_projector"].parameters()}
    trainable_parts(encoder, "all")
    state = trained_vision(encoder)
    files = checkpoint_files(gemma3_images)
    assert state.keys() <= files.keys()
    assert {key.split(".")[0] for key in state} == {"vision_tower", "multi_modal_projector"}
    with safe_open(str(files["multi_modal_projector.mm_input_projection_weight"]), framework="pt") as f:
        assert torch.equal(state["multi_modal_projector.mm_input_projection_weight"],
                           f.get_tensor("multi_modal_projector.mm_input_projection_weight"))


def cp_rank_step(rank: int, world_size: int, checkpoint: Path, rows: Path, seq_len: int, micro_batch: int,
                 method: str):
    import torch.distributed as dist

    from longfit.memory.loss import batch_loss_sum
    from longfit.parallel.batch import global_valid_tokens, shard_batch
    from longfit.parallel.media import DealtMedia
    from longfit.parallel.parallelize import apply_context_parallel

    group = dist.group.WORLD
    loss_module = longfit_model(checkpoint, "all")
    layout = apply_context_parallel(loss_module.model, group, method)
    loss_module.media_features = DealtMedia(group)
    batch = image_batch(checkpoint, rows, seq_len, micro_batch)
    shard = shard_batch(batch, rank, world_size, layout)
    loss = batch_loss_sum(loss_module, shard) / global_valid_tokens(shard.labels, group)
    loss.backward()
    dist.all_reduce(loss := loss.detach())
    grads = trained_grads(loss_module)
    for grad in grads.values():
        dist.all_reduce(grad)
    return parity.Step(loss, grads)


@pytest.mark.slow  # two gloo ranks per case, each building the model
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("rows", list(ROWS))
def test_context_parallel_equals_the_wrapper(gemma3_images, tmp_path, rows: str, method: str) -> None:
    from parallel_harness import run_distributed

    conversations, seq_len, micro_batch = ROWS[rows]
    path = write_rows(tmp_path, conversations)
    batch = image_batch(gemma3_images, path, seq_len, micro_batch)
    truth = wrapper_step(gemma3_images, batch)
    loss_module = longfit_model(gemma3_images, "all")
    for rank, got in enumerate(run_distributed(cp_rank_step, 2, gemma3_images, path, seq_len, micro_batch, method)):
        got = as_wrapper_names(got, loss_module, truth.grads)
        want = parity.Step(truth.loss, {n: g for n, g in truth.grads.items() if n in got.grads})
        assert got.grads.keys() == want.grads.keys()
        comparison = parity.compare_fp32(f"gemma3, rank {rank}, {method}, {rows}", got, want)
        assert comparison.ok, comparison.line()
