"""Rows with images in them (#54): Qwen3.5's wrapper trained on image chats, exactly.

The checkpoint is written by transformers' own wrapper class (`Qwen3_5ForConditionalGeneration`) from transformers'
default qwen3_5 config with the language model and the tower shrunk (tests/test_wrappers.py's sizes), its tokenizer
longfit's byte tokenizer with the family's vision tokens and a chat template that renders image parts as Qwen's does,
its image processor Qwen's own Pillow one (examples/document_qa.py's `write_tiny_qwen3_5`). Images are made here with Pillow from arrays. The rows are read and packed
by longfit's own reader (`data.path` JSONL), and:
- the loss and every gradient -- the language model's, and the projector's and tower's where `train.vision` trains
  them -- equal the wrapper's own forward (eager attention, each conversation of a packed row run alone with its own
  images, `get_rope_index`'s M-RoPE positions), in fp32 and under bf16 autocast within the bf16 bound
  (`longfit.check.parity.compare_bf16`), for one conversation and for packed conversations;
- under context parallelism (cp=2 on gloo, ring and Ulysses; slow) each rank's shard gets exactly its image
  embeddings, the tower's work split over the ranks, and the summed loss and gradients are those of one process;
- bad rows are one error line naming the file and the fix, before anything trains.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from test_wrappers import LINEAR, QWEN_VISION, TEXT, WRAPPERS  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.config import ConfigError, load_config  # noqa: E402
from longfit.data.documents import DataError  # noqa: E402

IMAGE_SIZES = [(40, 50), (64, 64), (33, 70)]  # (height, width): 2, 4 and 2 tokens after Qwen's resize and merge
ONE = [{"role": "user", "content": [{"type": "image", "path": "im0.png"}, {"type": "text", "text": "what is it?"}]},
       {"role": "assistant", "content": "noise"}]
TWO = [{"role": "user", "content": [{"type": "text", "text": "two: "}, {"type": "image", "path": "im1.png"},
                                    {"type": "image", "path": "im2.png"}]},
       {"role": "assistant", "content": "both noise"}]
TEXT_ONLY = [{"role": "user", "content": "no image"}, {"role": "assistant", "content": "fine"}]
ROWS = {"one conversation": ([ONE], 32, 1), "packed": ([ONE, TEXT_ONLY, TWO, ONE, TWO], 64, 2)}
"""Conversations -> (the conversations, seq_len, rows a batch): one conversation alone in its row, or two rows of
packed conversations (ONE and a text chat, then TWO and ONE: a text chat is an image chat without images, and the
next TWO starts a third row)."""
ROW_CASES = [pytest.param("one conversation", marks=pytest.mark.slow), "packed"]
"""The default suite's exactness cases are the packed rows (which hold the lone conversation's row as their first
document); the lone conversation is slow (a few seconds each, #54's default-suite budget)."""


@pytest.fixture(scope="session")
def qwen_images(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 wrapper checkpoint that reads images (a second): examples/document_qa.py's, the language model
    and tower of tests/test_wrappers.py."""
    from document_qa import write_tiny_qwen3_5

    return write_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5-images"), dict(TEXT, **LINEAR), QWEN_VISION)


@pytest.fixture(scope="session")
def qwen_moe_images(tmp_path_factory) -> Path:
    """The same with Qwen3.5-MoE's language model (tests/test_wrappers.py's experts)."""
    from document_qa import write_tiny_qwen3_5

    return write_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_moe-images"), WRAPPERS["qwen3_5_moe"]["text_config"],
                              QWEN_VISION, model_type="qwen3_5_moe")


@pytest.fixture(scope="session")
def qwen_moe_every_expert(tmp_path_factory) -> Path:
    """The same with every token routed to all four experts: the bf16 cases. Under bf16 a top-k router flips the
    routes of near-tied tokens in any implementation (tests/test_families_moe.py), and a token routed elsewhere is no
    rounding error; with every expert chosen the routing weights, the experts and their sum are continuous."""
    from document_qa import write_tiny_qwen3_5

    text = WRAPPERS["qwen3_5_moe"]["text_config"]
    return write_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_moe-every-expert"),
                              dict(text, num_experts_per_tok=text["num_experts"]), QWEN_VISION,
                              model_type="qwen3_5_moe")


def write_rows(folder: Path, conversations: list) -> Path:
    """The conversations as a JSONL file beside their images (made from seeded arrays)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    from PIL import Image

    for index, (height, width) in enumerate(IMAGE_SIZES):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / f"im{index}.png")
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def image_batch(checkpoint: Path, rows: Path, seq_len: int, micro_batch: int = 1, **data):
    """The first packed batch longfit's reader makes of `rows`, with the checkpoint's image reader."""
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader

    cfg = load_config(None, [f"model={checkpoint}", f"data.path={rows}", f"seq_len={seq_len}",
                             f"train.micro_batch={micro_batch}", *(f"data.{k}={v}" for k, v in data.items())])
    return next(build_dataloader(cfg, load_tokenizer(str(checkpoint)), epochs=1, media=media_reader(str(checkpoint))))


def batches_of_rows(checkpoint: Path, root: Path, rows_of: dict = ROWS) -> dict:
    """The batches of `rows_of` (a family's ROWS) for `checkpoint`'s wrapper, each one's conversations and images
    written under `root`."""
    return {name: image_batch(checkpoint, write_rows(root / name.replace(" ", "-"), rows), seq_len, micro_batch)
            for name, (rows, seq_len, micro_batch) in rows_of.items()}


@pytest.fixture(scope="module")
def batches(qwen_images, tmp_path_factory):
    return batches_of_rows(qwen_images, tmp_path_factory.mktemp("image-rows"))


TOWER = "model.visual."


def longfit_model(checkpoint: Path, vision: str):
    """longfit's objective of the wrapper: its language model (longfit attention) and its vision side."""
    from longfit.memory.loss import CausalLMLoss
    from longfit.models.loading import load_model
    from longfit.models.media import build_media_encoder, trainable_parts

    encoder = build_media_encoder(str(checkpoint))
    trainable_parts(encoder, vision)
    return CausalLMLoss(load_model(str(checkpoint)), media_encoder=encoder)


def longfit_step(loss_module, batch, autocast: bool = False) -> parity.Step:
    """longfit's step; the language model's gradients under its causal LM's names, the vision side's under the
    wrapper's (`as_wrapper_names` renames the first)."""
    from longfit.memory.loss import batch_loss_sum

    batch.media.positions = loss_module.media_encoder.rope_positions(batch.input_ids, batch.position_ids, batch.media)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = batch_loss_sum(loss_module, batch) / batch.num_label_tokens
    loss.backward()
    grads = {n: p.grad.float() for n, p in loss_module.model.named_parameters() if p.requires_grad}
    grads |= {TOWER + n: p.grad.float() for n, p in loss_module.media_encoder.vision.named_parameters()
              if p.requires_grad}
    return parity.Step(loss.detach().float(), grads)


def as_wrapper_names(got: parity.Step, loss_module, wrapper_keys) -> parity.Step:
    """`got` with the language model's gradients under the wrapper's checkpoint names."""
    from longfit.models.weights import source_names

    names = {name: key for key, (name, _) in source_names(loss_module.model, wrapper_keys).items()}
    return parity.Step(got.loss, {names.get(n, n): g for n, g in got.grads.items()})


def wrapper_step(checkpoint: Path, batch, attention: str = "eager", autocast: bool = False) -> parity.Step:
    """The wrapper's own forward on each conversation of the rows alone, with its images (packing's semantics):
    `longfit check`'s reference of image rows (`longfit.check.media.wrapper_step`)."""
    from transformers import AutoModelForImageTextToText

    from longfit.check.media import wrapper_step as reference_step
    from longfit.models.media import build_media_encoder

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention)
    return reference_step(model, build_media_encoder(str(checkpoint)), batch, autocast=autocast)


def compared(checkpoint: Path, batch, vision: str, autocast: bool = False, attentions=("eager",),
             wrapper=wrapper_step, longfit=longfit_step):
    """(longfit's step, the wrapper's steps under `attentions` and bf16 autocast, the wrapper's fp32 eager step): the
    wrapper's gradients of what longfit trains only, every gradient under the wrapper's names. `wrapper`, `longfit`:
    a family's own steps (its wrapper's image inputs, its gradients' names)."""
    loss_module = longfit_model(checkpoint, vision)
    got = longfit(loss_module, batch, autocast)
    truth = wrapper(checkpoint, batch)
    got = as_wrapper_names(got, loss_module, truth.grads)

    def trained(step: parity.Step) -> parity.Step:
        return parity.Step(step.loss, {n: g for n, g in step.grads.items() if n in got.grads})

    references = [trained(wrapper(checkpoint, batch, a, autocast=True)) for a in attentions] if autocast else []
    return got, references, trained(truth)


# -- exactness, one process ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("vision", ["frozen", "all"])
@pytest.mark.parametrize("rows", ROW_CASES)
def test_loss_and_gradients_equal_the_wrapper(qwen_images, batches, rows: str, vision: str, one_thread) -> None:
    batch = batches[rows]
    assert batch.media.images == (1 if rows == "one conversation" else 4)
    got, _, want = compared(qwen_images, batch, vision)
    assert got.grads.keys() == want.grads.keys()
    assert any(n.startswith(TOWER) for n in got.grads) == (vision == "all")
    comparison = parity.compare_fp32(rows, got, want)
    # Twice longfit check's fp32 bound, as tests/test_wrappers.py's (transformers' std-0.02 initialisation): the
    # gated-delta layers' A_log and dt_bias gradients, longfit's kernel against transformers' reference loop.
    assert comparison.worst[1] <= 2, comparison.line()


def test_qwen3_5_moe_loss_and_gradients_equal_the_wrapper(qwen_moe_images, tmp_path, one_thread) -> None:
    conversations, seq_len, micro_batch = ROWS["packed"]
    batch = image_batch(qwen_moe_images, write_rows(tmp_path, conversations), seq_len, micro_batch)
    got, _, want = compared(qwen_moe_images, batch, "all")
    assert got.grads.keys() == want.grads.keys() and any(n.startswith(TOWER) for n in got.grads)
    comparison = parity.compare_fp32("qwen3_5_moe, packed", got, want)
    assert comparison.worst[1] <= 2, comparison.line()  # test_loss_and_gradients_equal_the_wrapper's bound


@pytest.mark.parametrize("rows", ROW_CASES)
def test_bf16_loss_and_gradients_are_within_the_bf16_bound(qwen_images, batches, rows: str, one_thread) -> None:
    got, references, truth = compared(qwen_images, batches[rows], "all", autocast=True, attentions=("eager", "sdpa"))
    comparison = parity.compare_bf16(rows, got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_qwen3_5_moe_bf16_loss_and_gradients_are_within_the_bf16_bound(qwen_moe_every_expert, tmp_path,
                                                                      one_thread) -> None:
    """Qwen3.5-MoE's image rows under bf16 autocast, every expert chosen (`qwen_moe_every_expert`)."""
    conversations, seq_len, micro_batch = ROWS["packed"]
    batch = image_batch(qwen_moe_every_expert, write_rows(tmp_path, conversations), seq_len, micro_batch)
    got, references, truth = compared(qwen_moe_every_expert, batch, "all", autocast=True, attentions=("eager", "sdpa"))
    assert any(n.startswith(TOWER) for n in got.grads) and any(".experts." in n for n in got.grads)
    comparison = parity.compare_bf16("qwen3_5_moe, packed", got, references, truth, parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_the_projector_alone_trains_when_asked(qwen_images) -> None:
    from longfit.models.media import build_media_encoder, trainable_parts

    encoder = build_media_encoder(str(qwen_images))
    assert not any(p.requires_grad for p in encoder.parameters())  # frozen by default
    trained = trainable_parts(encoder, "projector")
    assert {id(p) for p in trained} == {id(p) for p in encoder.projector.parameters()}
    with pytest.raises(ConfigError, match="train.vision='towers': use one of frozen, projector, all"):
        trainable_parts(encoder, "towers")


# -- exactness under context parallelism ----------------------------------------------------------------------------

def cp_rank_step(rank: int, world_size: int, checkpoint: Path, rows: Path, seq_len: int, micro_batch: int,
                 method: str, vision: str):
    """One rank of a cp group: the whole rows read, their positions computed, then cut to this rank's shard; the
    tower's work dealt over the ranks. Returns the summed loss and every gradient summed over the ranks (what FSDP2's
    reduction gives the trainer)."""
    import torch.distributed as dist

    from longfit.parallel.media import DealtMedia
    from longfit.parallel.parallelize import apply_context_parallel

    loss_module = longfit_model(checkpoint, vision)
    layout = apply_context_parallel(loss_module.model, dist.group.WORLD, method)
    loss_module.media_features = DealtMedia(dist.group.WORLD)
    batch = image_batch(checkpoint, rows, seq_len, micro_batch)
    return cp_share_step(loss_module, layout, batch, rank, world_size,
                         [*loss_module.model.named_parameters(),
                          *((TOWER + n, p) for n, p in loss_module.media_encoder.vision.named_parameters())])


def cp_share_step(loss_module, layout, batch, rank: int, world_size: int, parameters) -> tuple:
    """This rank's share of the step on `batch` (context parallelism applied with `layout`): positions of the whole
    rows, the rank's shard, the loss over the group's tokens; (the loss and the gradients of the trained ones of
    `parameters`, (name, parameter) pairs, summed over the ranks; the shard's image embedding index)."""
    import torch.distributed as dist

    from longfit.memory.loss import batch_loss_sum
    from longfit.parallel.batch import global_valid_tokens, shard_batch

    group = dist.group.WORLD
    batch.media.positions = loss_module.media_encoder.rope_positions(batch.input_ids, batch.position_ids, batch.media)
    shard = shard_batch(batch, rank, world_size, layout)
    loss = batch_loss_sum(loss_module, shard) / global_valid_tokens(shard.labels, group)
    loss.backward()
    dist.all_reduce(loss := loss.detach())
    grads = {}
    for name, param in parameters:
        if param.requires_grad:
            dist.all_reduce(grad := param.grad.clone())
            grads[name] = grad
    return parity.Step(loss, grads), shard.media.embedding_index


@pytest.mark.slow  # two gloo ranks per case, each building the model: ~20 s a case on a busy 2-core machine
@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("rows", list(ROWS))
def test_context_parallel_equals_the_wrapper(qwen_images, tmp_path, rows: str, method: str) -> None:
    from parallel_harness import run_distributed

    conversations, seq_len, micro_batch = ROWS[rows]
    path = write_rows(tmp_path, conversations)
    results = run_distributed(cp_rank_step, 2, qwen_images, path, seq_len, micro_batch, method, "all")
    batch = image_batch(qwen_images, path, seq_len, micro_batch)
    assert_ranks_equal_the_wrapper(results, batch, wrapper_step(qwen_images, batch), qwen_images, method)


def assert_ranks_equal_the_wrapper(results, batch, truth: parity.Step, checkpoint: Path, method: str) -> None:
    """Every image token is on exactly one rank, each rank's tokens take their own images' embeddings, and each
    rank's summed loss and gradients (`cp_rank_step`) equal the wrapper's `truth`."""
    taken = sorted(i for _, index in results for i in index[index >= 0].tolist())
    assert taken == list(range(int((batch.media.embedding_index >= 0).sum())))
    loss_module = longfit_model(checkpoint, "all")
    for rank, (got, _) in enumerate(results):
        got = as_wrapper_names(got, loss_module, truth.grads)
        want = parity.Step(truth.loss, {n: g for n, g in truth.grads.items() if n in got.grads})
        assert got.grads.keys() == want.grads.keys()
        comparison = parity.compare_fp32(f"rank {rank}, {method}", got, want)
        assert comparison.worst[1] <= 2, comparison.line()


def test_the_images_are_dealt_evenly_and_alike_on_every_rank() -> None:
    from longfit.parallel.media import deal

    assert deal([8, 16, 8, 8], 2) == [[1, 3], [0, 2]]  # the packed rows' four images: 24 patches on each rank
    assert deal([9, 1, 1, 1, 8], 3) == [[0], [4], [1, 2, 3]]
    assert sorted(i for rank in deal([3, 1, 2, 5, 5, 2], 4) for i in rank) == list(range(6))


# -- reading image rows ---------------------------------------------------------------------------------------------

def test_a_long_conversation_is_cut_only_between_images(qwen_images, tmp_path) -> None:
    """keep_end's window ends at the answer; where its start falls inside an image, it moves past that image, which
    is left out whole with its pixels."""
    path = write_rows(tmp_path, [TWO])
    whole = image_batch(qwen_images, path, 96)
    end = int((whole.labels != -100).nonzero()[-1, 1]) + 2  # the chat's tokens up to its last target
    first_image = whole.media.item_starts[0][1]
    cut = image_batch(qwen_images, path, end - first_image - 1)  # the window starts one token inside the 1st image
    assert cut.media.images == 1 and torch.equal(cut.media.grid_thw, whole.media.grid_thw[1:])
    second_image = whole.media.item_starts[1][1] - first_image - 4  # after the 1st image's 4 tokens, in the cut row
    assert cut.media.item_starts == ((0, second_image),)
    assert torch.equal(cut.input_ids[0, : end - first_image - 4], whole.input_ids[0, first_image + 4 : end])


@pytest.mark.parametrize("problem, message", [
    ("missing", r"rows\.jsonl, line 1: image .*nowhere\.png does not exist; fix the path"),
    ("unreadable", r"rows\.jsonl, line 1: image .*broken\.png cannot be read .*re-save it as PNG or JPEG"),
    ("too many tokens", r"rows\.jsonl, line 1: its images take 6 tokens, more than a row of seq_len=5 holds"),
    ("split", r"data\.long_chats=split would cut chats with images between rows"),
])
def test_bad_image_rows_are_one_line_before_training(qwen_images, tmp_path, problem: str, message: str) -> None:
    chat = [dict(TWO[0], content=list(TWO[0]["content"])), TWO[1]]
    parts = chat[0]["content"]
    if problem == "missing":
        parts[1] = {"type": "image", "path": "nowhere.png"}
    if problem == "unreadable":
        parts[1] = {"type": "image", "path": "broken.png"}
    path = write_rows(tmp_path, [chat])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    seq_len = {"too many tokens": 5}.get(problem, 96)
    with pytest.raises(DataError, match=message):
        image_batch(qwen_images, path, seq_len, **({"long_chats": "split"} if problem == "split" else {}))


def test_image_rows_need_an_image_text_checkpoint(tmp_path) -> None:
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer

    path = write_rows(tmp_path, [ONE])
    cfg = load_config(None, ["model=llama-tiny", f"data.path={path}", "seq_len=64"])
    with pytest.raises(DataError, match="line 1: this chat has image or video parts, which this run cannot read"):
        next(build_dataloader(cfg, load_tokenizer("llama-tiny"), epochs=1))


# -- longfit train ----------------------------------------------------------------------------------------------------

def train_argv(checkpoint: Path, rows: Path, out: Path) -> list[str]:
    return [f"model={checkpoint}", f"data.path={rows}", f"output_dir={out}", "seq_len=128", "train.device=cpu",
            "train.steps=3", "train.lr=1e-2", "train.warmup_steps=0", "train.vision=all", "eval.retrieval=false"]


def train_on_two_ranks(*argv: str) -> str:
    """`longfit train --nproc 2 argv` in a fresh process, as a user launches it; its output (stdout, then stderr)."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "longfit", "train", "--nproc", "2", *argv], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def logged_losses(out: Path) -> list[float]:
    """The step losses the run in `out` wrote to its metrics.jsonl, in order."""
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow  # a one-process run and a --nproc 2 run, each with its preflight check: ~2-3 min on 2 busy cores
@pytest.mark.timeout(1800)
def test_longfit_train_on_image_rows_under_cp_equals_one_process_and_exports_the_trained_wrapper(
        qwen_images, tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from longfit.cli import main

    rows = write_rows(tmp_path / "data", [[ONE, TWO, TEXT_ONLY][i % 3] for i in range(12)])
    assert main(["train", *train_argv(qwen_images, rows, tmp_path / "one")]) == 0
    train_on_two_ranks(*train_argv(qwen_images, rows, tmp_path / "cp2"), "parallel.cp=2")
    losses = [logged_losses(tmp_path / run) for run in ("one", "cp2")]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-4)
    # the export is the wrapper with its tower as trained, and runs on an image
    export = tmp_path / "one" / "final"
    before, after = load_file(qwen_images / "model.safetensors"), load_file(export / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(not torch.equal(before[k], after[k]) for k in before if k.startswith(TOWER) and "weight" in k)
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    batch = image_batch(export, rows, 128)
    processor = AutoImageProcessor.from_pretrained(export)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    (start, end), patches = batch.documents.rows[0][0], int(batch.media.grid_thw[0].prod())  # ONE: the row's first
    logits = model(input_ids=batch.input_ids[:, start:end], pixel_values=batch.media.pixel_values[:patches],
                   image_grid_thw=batch.media.grid_thw[:1], mm_token_type_ids=batch.media.token_types[:, start:end]).logits
    assert torch.isfinite(logits).all()


LONG = [{"role": "user", "content": [{"type": "text", "text": "context " * 60}, {"type": "image", "path": "im1.png"},
                                     {"type": "text", "text": "which?"}]},
        {"role": "assistant", "content": "noise"}]
"""A chat longer than a row of 128 tokens: its end (keep_end) fills the row as one document, the layout the plan's
layer trace runs (a row of seq_len tokens, one document)."""


@pytest.mark.slow  # two runs in fresh processes, each planning and checking on an empty cache: ~45 s each
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_longfit_train_on_image_rows_with_an_empty_cache(qwen_images, tmp_path, monkeypatch, dtype: str) -> None:
    """With nothing cached, the run's preflight traces the layers on fake tensors, on the row layout of the first
    step: what it made must not reach the step (a cached fake layout made the step's gradients fake, and the run
    failed in its gradient clipping). A fresh process, as a user's run: this one's caches may be warm."""
    import subprocess

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rows = write_rows(tmp_path / "data", [LONG] * 3)
    done = subprocess.run([sys.executable, "-m", "longfit", "train", *train_argv(qwen_images, rows, tmp_path / "out"),
                           "train.steps=1", f"train.dtype={dtype}"], capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]
    (loss,) = logged_losses(tmp_path / "out")
    assert np.isfinite(loss)


def test_layouts_made_under_fake_tensors_are_not_kept_for_the_real_step() -> None:
    """The device copies of a row layout that the layers cache (linear attention's, the starts of the one-document
    layout) are kept from real steps only: a plan's trace on fake tensors before the run's first step of the same
    layout handed its fake tensors to that step."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from longfit.data.packing import DocumentLayout
    from longfit.models import linear_attention
    from longfit.parallel.linear import _gathered_positions

    rows, cpu = (((0, 97),),), torch.device("cpu")
    made = [lambda: [linear_attention.document_offsets(rows, 97, cpu)],
            lambda: list(linear_attention._chunk_layout(rows, 97, cpu, None)),
            lambda: [DocumentLayout.one_document_per_row(1, 97).starts_on(cpu)],
            lambda: [_gathered_positions(96, 2, "zigzag", cpu)]]
    with FakeTensorMode():
        assert all(isinstance(t, FakeTensor) for make in made for t in make())
    assert not any(isinstance(t, FakeTensor) for make in made for t in make())


def test_an_epoch_is_counted_from_the_image_headers_as_it_packs(qwen_images, tmp_path) -> None:
    """count_epoch reads no pixels (each image's tokens from its header's size by the processor's resize rule), and
    packs the rows the trainer packs."""
    from longfit.data.packing import build_dataloader, count_epoch
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader

    rows = write_rows(tmp_path, [[ONE, TWO, TEXT_ONLY][i % 3] for i in range(7)])
    cfg = load_config(None, [f"model={qwen_images}", f"data.path={rows}", "seq_len=64"])
    tokenizer, reader = load_tokenizer(str(qwen_images)), media_reader(str(qwen_images))
    loader = build_dataloader(cfg, tokenizer, epochs=1, media=reader)
    packed = list(loader)
    count = count_epoch(cfg, tokenizer, media=reader)
    assert (count.rows, count.tokens, count.documents) == (len(packed), loader.stats.tokens, 7)
    assert sum(batch.media.images for batch in packed if batch.media) == 7  # ONE, TWO, -, ONE, TWO, -, ONE


@pytest.mark.slow  # three runs of 2-4 steps, each with its preflight check: ~4 min on 2 busy cores
@pytest.mark.timeout(1800)
def test_a_resumed_image_run_is_bit_identical(qwen_images, tmp_path) -> None:
    from safetensors.torch import load_file

    from longfit.train.loop import train

    rows = write_rows(tmp_path / "data", [[ONE, TWO, TEXT_ONLY][i % 3] for i in range(12)])
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(load_config(None, [*train_argv(qwen_images, rows, whole), "train.steps=4"]))
    cfg = load_config(None, [*train_argv(qwen_images, rows, resumed), "train.steps=4"])
    train(cfg, stop_after_steps=2)
    train(cfg)
    losses = [logged_losses(run) for run in (whole, resumed)]
    assert len(losses[0]) == 4 and losses[1] == losses[0]
    exports = [load_file(run / "final" / "model.safetensors") for run in (whole, resumed)]
    assert exports[0].keys() == exports[1].keys()
    assert all(torch.equal(exports[0][key], exports[1][key]) for key in exports[0])
