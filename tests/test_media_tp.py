"""Image rows under tensor parallelism (#54): the vision tower and projector replicated on the tp ranks, the rows'
images dealt over them (and over the cp ranks).

The image families whose language model tensor parallelism can split (`longfit.parallel.tp.tensor_parallel_refusal`
reads it from the structure): Mistral 3 (a Llama-style `mistral` decoder), Gemma 3 (q/k norms per head, four norms a
layer, sliding windows, scaled embeddings, and both-way attention inside an image's tokens), Qwen3.5 (Gated DeltaNet
layers split by key head group, 3-D M-RoPE positions), Qwen3.5-MoE (its experts split too), Gemma 4 (per-layer inputs
looked up for each rank's tokens) and Llama 4 (its transposed experts, chunked attention); the two mixtures of experts
in bf16 with every expert chosen (their test says why). tests/test_media_mistral3.py's, tests/test_media_gemma3.py's,
tests/test_media_gemma4.py's, tests/test_media_llama4.py's and tests/test_media.py's tiny wrappers (written by
transformers from their default configs, shrunk) and packed rows: `parallelize` as the trainer runs it (tp=2, FSDP2 over
dp_shard x cp, the vocabulary-parallel loss, `DealtMedia` on the vision side), one step of every rank's shard, the loss
and every gradient (the language model's tp slices and the tower's shards gathered) against the wrapper's own eager
forward on one process: fp32 within compare_fp32, bf16 within the bf16 bound (tests/test_bf16.py), with the vision side
frozen and trained.
The tower's gradients are also equal on the tp ranks bit for bit: its replicas stay the same. Each rank runs the
tower on its share of the images alone: the ranks holding the same rows run each image once between them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_media import ROWS as QWEN3_5_ROWS  # noqa: E402
from test_media import as_wrapper_names, image_batch, longfit_model, write_rows  # noqa: E402
from test_media import qwen_images, qwen_moe_every_expert, qwen_moe_images  # noqa: E402,F401 -- the session fixtures
from test_media import wrapper_step as qwen3_5_wrapper_step  # noqa: E402
from test_media_gemma3 import ROWS as GEMMA3_ROWS  # noqa: E402
from test_media_gemma3 import gemma3_images  # noqa: E402,F401 -- the session fixture
from test_media_gemma3 import wrapper_step as gemma3_wrapper_step  # noqa: E402
from test_media_gemma4 import ROWS as GEMMA4_ROWS  # noqa: E402
from test_media_gemma4 import gemma4_images, processed_images  # noqa: E402,F401 -- the session fixture
from test_media_gemma4 import wrapper_step as gemma4_wrapper_step  # noqa: E402
from test_media_llama4 import ROWS as LLAMA4_ROWS  # noqa: E402
from test_media_llama4 import llama4_batch, llama4_images, write_tiny_llama4  # noqa: E402,F401 -- the session fixture
from test_media_llama4 import wrapper_step as llama4_wrapper_step  # noqa: E402
from test_media_mistral3 import ROWS as MISTRAL3_ROWS  # noqa: E402
from test_media_mistral3 import mistral3_images  # noqa: E402,F401 -- the session fixture
from test_media_mistral3 import wrapper_step as mistral3_wrapper_step  # noqa: E402

from longfit.check import parity  # noqa: E402

# the vision module's names in the wrapper: Mistral 3's and Gemma 3's tower and projector under `model`, Qwen3.5's
# tower and merger under `model.visual`
PREFIX = {"mistral3": "model.", "gemma3": "model.", "gemma4": "model.", "llama4": "", "qwen3_5": "model.visual.",
          "qwen3_5_moe": "model.visual."}
VISION = {"mistral3": ("model.vision_tower.", "model.multi_modal_projector."),
          "gemma3": ("model.vision_tower.", "model.multi_modal_projector."),
          "gemma4": ("model.vision_tower.", "model.embed_vision."),
          "llama4": ("vision_model.", "multi_modal_projector."), "qwen3_5": ("model.visual.",),
          "qwen3_5_moe": ("model.visual.",)}
FAMILIES = {"mistral3": (MISTRAL3_ROWS["packed"], mistral3_wrapper_step),
            "gemma3": (GEMMA3_ROWS["packed"], gemma3_wrapper_step),
            "gemma4": (GEMMA4_ROWS["packed"], gemma4_wrapper_step),
            "llama4": (LLAMA4_ROWS["packed"], llama4_wrapper_step),
            "qwen3_5": (QWEN3_5_ROWS["packed"], qwen3_5_wrapper_step),
            "qwen3_5_moe": (QWEN3_5_ROWS["packed"], qwen3_5_wrapper_step)}
"""family -> (its packed rows: conversations, seq_len, rows a batch; its wrapper's own step)."""


def tp_rank_steps(rank: int, world_size: int, family: str, checkpoint: Path, rows: Path, cases: list[tuple[str, str]],
                  cp: int, method: str) -> dict:
    """This rank's step of every (train.vision, train.dtype) case: parallelize with parallel.tp=2 (x cp), the
    rank's shard, backward of its loss sum over the step's valid tokens; the loss summed over the ranks, every
    trained gradient whole (`full_tensor`), under the causal LM's names and the wrapper's for the vision side."""
    from longfit.config import load_config
    from longfit.memory.loss import batch_loss_sum, positioned
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize
    from longfit.parallel.media import DealtMedia

    _, seq_len, micro_batch = FAMILIES[family][0]
    results = {}
    for vision, dtype in cases:
        cfg = load_config(None, [f"model={checkpoint}", f"seq_len={seq_len}", "parallel.tp=2", f"parallel.cp={cp}",
                                 f"parallel.cp_method={method}", f"train.dtype={dtype}", f"train.vision={vision}",
                                 "memory.activation_checkpointing=false", "memory.tiled_mlp=false"])
        loss_module = longfit_model(checkpoint, vision)
        text = loss_module.model.config
        dims = ParallelDims.from_config(cfg, world_size, text.num_attention_heads,
                                        num_key_value_heads=text.num_key_value_heads,
                                        intermediate_size=getattr(text, "intermediate_size", None), text_config=text,
                                        linear_value_heads=getattr(text, "linear_num_value_heads", None))
        mesh = dims.build_mesh("cpu")
        loss_module = parallelize(loss_module, dims, cfg, mesh)
        assert isinstance(loss_module.media_features, DealtMedia)
        encoder, ran = loss_module.media_encoder, []
        features = encoder.features
        encoder.features = lambda pixel_values, grid_thw: ran.append(len(grid_thw)) or features(pixel_values, grid_thw)
        batch = positioned(loss_module, image_batch(checkpoint, rows, seq_len, micro_batch))
        shard = shard_batch(batch, mesh.cp_rank, dims.cp, cp_layout(method))
        count = global_valid_tokens(shard.labels, mesh.world_group)
        local_sum = batch_loss_sum(loss_module, shard)
        (local_sum / count).backward()
        loss = all_reduce_sum(local_sum.detach().float().clone(), mesh.world_group) / count
        run_here = torch.tensor(float(sum(ran)))  # the images of the rows, run once between their ranks
        assert all_reduce_sum(run_here.clone(), mesh.rows_group) == batch.media.images > run_here, (ran, rank)
        named = [*loss_module.model.named_parameters(),
                 *((PREFIX[family] + n, p) for n, p in loss_module.media_encoder.vision.named_parameters())]
        # SigLIP's pooling head (Gemma 3's tower) is off the wrapper's path: no gradient there either
        grads = {n: p.grad.full_tensor().float() for n, p in named
                 if p.requires_grad and (p.grad is not None or ".head." not in n)}
        results[vision, dtype] = parity.Step(loss, grads)
    return results


def wrapper_steps(family: str, checkpoint: Path, batch, bf16: bool):
    """The wrapper's eager fp32 step (the truth) and, for bf16, its steps with bf16 weights, eager and sdpa (the
    references of a sharded bf16 step, as `longfit check` takes them under FSDP2)."""
    from transformers import AutoModelForImageTextToText

    from longfit.check.media import wrapper_step as reference_step
    from longfit.models.media import build_media_encoder

    truth = FAMILIES[family][1](checkpoint, batch)
    references = []
    for attention in ("eager", "sdpa") if bf16 else ():
        model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.bfloat16,
                                                            attn_implementation=attention)
        references.append(reference_step(model, build_media_encoder(str(checkpoint)), batch))
    return truth, references


def compared_with_the_wrapper(name: str, got: parity.Step, truth: parity.Step, references: list[parity.Step],
                               dtype: str) -> parity.Comparison:
    """`got` (a sharded step's loss and trained gradients, under the wrapper's names) against the wrapper's fp32 step
    `truth`, and in bf16 within the bound of its bf16 `references` (FSDP2's regime), over the gradients `got` has:
    every one the wrapper trains among them."""

    def trained(step: parity.Step) -> parity.Step:
        return parity.Step(step.loss, {n: g for n, g in step.grads.items() if n in got.grads})

    assert got.grads.keys() == trained(truth).grads.keys()
    if dtype == "fp32":
        return parity.compare_fp32(name, got, trained(truth))
    return parity.compare_bf16(name, got, [trained(r) for r in references], trained(truth), parity.FSDP_CEILING)


def assert_ranks_equal_the_wrapper(family: str, checkpoint: Path, rows: Path, results: list[dict],
                                   cp: int) -> list[str]:
    """Every rank's every case against the wrapper; returns the comparisons' lines (their largest errors)."""
    _, seq_len, micro_batch = FAMILIES[family][0]
    batch = image_batch(checkpoint, rows, seq_len, micro_batch)
    assert batch.media.images == 4
    cases = results[0].keys()
    truth, references = wrapper_steps(family, checkpoint, batch, any(dtype == "bf16" for _, dtype in cases))
    names = longfit_model(checkpoint, "all")
    lines = []
    for vision, dtype in cases:
        for rank, result in enumerate(results):
            got = as_wrapper_names(result[vision, dtype], names, truth.grads)
            assert any(n.startswith(VISION[family]) for n in got.grads) == (vision == "all")
            name = f"{family}, tp=2 x cp={cp}, rank {rank}, train.vision={vision}, {dtype}"
            comparison = compared_with_the_wrapper(name, got, truth, references, dtype)
            assert comparison.ok, comparison.line()
            lines.append(comparison.line())
        for pair in range(0, len(results), 2):  # a tp group: consecutive ranks (ParallelDims' mesh)
            towers = [{n: g for n, g in r[vision, dtype].grads.items() if n.startswith(VISION[family])}
                      for r in results[pair : pair + 2]]
            assert towers[0].keys() == towers[1].keys() and bool(towers[0]) == (vision == "all")
            assert all(torch.equal(g, towers[1][n]) for n, g in towers[0].items()), "the tp ranks' towers differ"
    return lines


# The default case: two gloo ranks, 16 s of CPU for the file with its imports and checkpoint (22-32 s wall at load
# 15-17); the others slow.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cases", [[("all", "fp32")],
                                   pytest.param([("frozen", "fp32"), ("all", "bf16")], marks=pytest.mark.slow)],
                         ids=["trained-fp32", "frozen-fp32-trained-bf16"])
def test_tensor_parallel_image_rows_equal_the_wrapper(mistral3_images, tmp_path, cases) -> None:
    """tp=2: the vision side trained (its gradients summed over tp) and frozen, fp32 and bf16 (one spawn of two
    gloo ranks a parameter)."""
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, MISTRAL3_ROWS["packed"][0])
    results = run_distributed(tp_rank_steps, 2, "mistral3", mistral3_images, path, cases, 1, "ring")
    assert_ranks_equal_the_wrapper("mistral3", mistral3_images, path, results, cp=1)


# slow: two gloo ranks, four steps of the Gemma 3 wrapper: 51 s wall (27 s CPU) with its checkpoint at load 6
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gemma3_image_rows_under_tp_equal_the_wrapper(gemma3_images, tmp_path) -> None:
    """Gemma 3's language model under tp=2 (its per-head norms, sliding windows, scaled embeddings) with image rows,
    both-way attention inside each image's tokens: the vision side trained and frozen, fp32 and bf16."""
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, GEMMA3_ROWS["packed"][0])
    cases = [("all", "fp32"), ("frozen", "fp32"), ("all", "bf16"), ("frozen", "bf16")]
    results = run_distributed(tp_rank_steps, 2, "gemma3", gemma3_images, path, cases, 1, "ring")
    print(*assert_ranks_equal_the_wrapper("gemma3", gemma3_images, path, results, cp=1), sep="\n")


# slow: two gloo ranks, three steps of the Gemma 4 wrapper
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gemma4_image_rows_under_tp_equal_the_wrapper(gemma4_images, tmp_path, monkeypatch) -> None:
    """Gemma 4's language model under tp=2 (its per-layer inputs looked up for each rank's tokens, its global layers'
    own head size) with image rows, both-way attention inside each image's tokens: the vision side trained and
    frozen, fp32 and bf16."""
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, GEMMA4_ROWS["packed"][0])
    images = processed_images(gemma4_images, tmp_path)
    monkeypatch.setitem(FAMILIES, "gemma4", (GEMMA4_ROWS["packed"], lambda checkpoint, batch, *args, **kwargs:
                                             gemma4_wrapper_step(checkpoint, batch, *args, **kwargs, images=images)))
    cases = [("all", "fp32"), ("frozen", "fp32"), ("all", "bf16")]
    results = run_distributed(tp_rank_steps, 2, "gemma4", gemma4_images, path, cases, 1, "ring")
    print(*assert_ranks_equal_the_wrapper("gemma4", gemma4_images, path, results, cp=1), sep="\n")


# slow: two gloo ranks, two steps of the Llama 4 wrapper
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llama4_image_rows_under_tp_equal_the_wrapper(llama4_images, tmp_path, monkeypatch) -> None:
    """Llama 4's language model under tp=2 (its transposed experts, chunked attention, a NoPE layer) with image rows,
    their tiles made as test_media_llama4 makes them (no torchvision here): the vision side trained and frozen, fp32
    (the wrapper's bf16 runs, the references of the bf16 bound, are not taken for Llama 4: test_media_llama4)."""
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, LLAMA4_ROWS["packed"][0])
    monkeypatch.setattr(sys.modules[__name__], "image_batch", llama4_batch)
    cases = [("all", "fp32"), ("frozen", "fp32")]
    results = run_distributed(tp_rank_steps, 2, "llama4", llama4_images, path, cases, 1, "ring")
    print(*assert_ranks_equal_the_wrapper("llama4", llama4_images, path, results, cp=1), sep="\n")


@pytest.fixture(scope="session")
def llama4_every_expert(tmp_path_factory) -> Path:
    """The tiny Llama 4 with every token routed to all four experts: its bf16 cases (`qwen_moe_every_expert` says
    why)."""
    return write_tiny_llama4(tmp_path_factory.mktemp("llama4-every-expert"), num_experts_per_tok=4)


# slow: two gloo ranks, a bf16 step each of the Llama 4 and the Qwen3.5-MoE wrappers
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_image_rows_under_tp_in_bf16_are_within_the_bf16_bound(llama4_every_expert, qwen_moe_every_expert,
                                                                  tmp_path, monkeypatch) -> None:
    """Qwen3.5-MoE's and Llama 4's image rows under tp=2 in bf16 (FSDP2's bf16 regime), every expert chosen: a
    top-k choice flips near-tied routes under bf16 in any implementation, as it did on these rows with the families'
    default top-k (two tokens of Qwen3.5-MoE's layer 2 on one process too), and a routed token is no rounding error.
    The vision sides trained."""
    from parallel_harness import run_distributed

    for family, checkpoint, vision in (("qwen3_5_moe", qwen_moe_every_expert, "all"),
                                       ("llama4", llama4_every_expert, "all")):
        path = write_rows(tmp_path / family, FAMILIES[family][0][0])
        if family == "llama4":
            monkeypatch.setattr(sys.modules[__name__], "image_batch", llama4_batch)
        results = run_distributed(tp_rank_steps, 2, family, checkpoint, path, [(vision, "bf16")], 1, "ring")
        print(*assert_ranks_equal_the_wrapper(family, checkpoint, path, results, cp=1), sep="\n")


# slow: two gloo ranks, four steps of the Qwen3.5 wrapper
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_qwen3_5_image_rows_under_tp_equal_the_wrapper(qwen_images, tmp_path) -> None:
    """Qwen3.5's language model under tp=2 (its Gated DeltaNet layers split by key head group, parallel/tp.py) with
    image rows and their 3-D M-RoPE positions: the vision side trained and frozen, fp32 and bf16."""
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, QWEN3_5_ROWS["packed"][0])
    cases = [("all", "fp32"), ("frozen", "fp32"), ("all", "bf16"), ("frozen", "bf16")]
    results = run_distributed(tp_rank_steps, 2, "qwen3_5", qwen_images, path, cases, 1, "ring")
    print(*assert_ranks_equal_the_wrapper("qwen3_5", qwen_images, path, results, cp=1), sep="\n")


# slow: two gloo ranks, two steps of the Qwen3.5-MoE wrapper
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_qwen3_5_moe_image_rows_under_tp_equal_the_wrapper(qwen_moe_images, tmp_path) -> None:
    """Qwen3.5-MoE's language model under tp=2 (every expert's and the shared expert's intermediate width split,
    the routers replicated: `TensorParallelExperts`) with image rows, whose embeddings each tp rank places in its
    tokens: the vision side trained and frozen, fp32 (bf16, every expert chosen:
    `test_moe_image_rows_under_tp_in_bf16_are_within_the_bf16_bound`)."""
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, QWEN3_5_ROWS["packed"][0])
    cases = [("all", "fp32"), ("frozen", "fp32")]
    results = run_distributed(tp_rank_steps, 2, "qwen3_5_moe", qwen_moe_images, path, cases, 1, "ring")
    print(*assert_ranks_equal_the_wrapper("qwen3_5_moe", qwen_moe_images, path, results, cp=1), sep="\n")


def tp_and_cp_steps_equal_the_wrapper(family: str, checkpoint: Path, tmp_path: Path) -> None:
    """tp=2 x cp=2 ring: each cp rank's tp pair runs that cp rank's share of the images (parallel/media.py)."""
    from parallel_harness import run_distributed

    path = write_rows(tmp_path, FAMILIES[family][0][0])
    cases = [("all", "fp32"), ("all", "bf16")]
    results = run_distributed(tp_rank_steps, 4, family, checkpoint, path, cases, 2, "ring")
    print(*assert_ranks_equal_the_wrapper(family, checkpoint, path, results, cp=2), sep="\n")


@pytest.mark.slow  # four gloo ranks, each building the model twice: 75-80 s a case at load 10
@pytest.mark.timeout(900)
def test_tensor_and_context_parallel_image_rows_equal_the_wrapper(mistral3_images, tmp_path) -> None:
    tp_and_cp_steps_equal_the_wrapper("mistral3", mistral3_images, tmp_path)


@pytest.mark.slow  # four gloo ranks, each building the model twice: 48 s wall (17 s CPU) at load 6
@pytest.mark.timeout(900)
def test_gemma3_image_rows_under_tp_and_cp_equal_the_wrapper(gemma3_images, tmp_path) -> None:
    """Gemma 3's both-way image spans under the ring with tp=2 on each cp rank."""
    tp_and_cp_steps_equal_the_wrapper("gemma3", gemma3_images, tmp_path)


@pytest.mark.slow  # the text check, the image steps, then two gloo ranks: Mistral 3 32 s wall (8 s CPU) at load 12,
# Gemma 3 42 s wall (15 s CPU) at load 13
@pytest.mark.parametrize("family,dtype", [pytest.param("mistral3", "fp32", id="fp32"),
                                          pytest.param("mistral3", "bf16", id="bf16"),
                                          pytest.param("gemma3", "fp32", id="gemma3-fp32")])
def test_longfit_check_proves_the_image_rows_under_tensor_parallelism(family, request, tmp_path, dtype,
                                                                      one_thread) -> None:
    """`longfit check` with parallel.tp=2 rehearses the image rows' step on two tp ranks (`longfit.check.media`), and
    then does not say tp is not rehearsed."""
    from longfit.check.parity import check_run
    from longfit.config import load_config

    checkpoint = request.getfixturevalue(f"{family}_images")
    rows = write_rows(tmp_path, FAMILIES[family][0][0])
    cfg = load_config(None, [f"model={checkpoint}", f"data.path={rows}", "seq_len=128", "train.device=cpu",
                             "train.vision=all", f"train.dtype={dtype}", "parallel.tp=2"])
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    names = [c.name for c in report.comparisons]
    assert [f"image rows, rank {r} of 2, tp=2, techniques, packed" for r in range(2)] == names[-2:], report.lines()
    assert not any("parallel.tp=2 is not rehearsed" in line for line in report.lines()), report.lines()


@pytest.mark.slow  # a one-process run and a --nproc 2 run, each with its preflight check: 67 s + 141 s at load 14
@pytest.mark.timeout(1800)
def test_longfit_train_on_image_rows_under_tp_equals_one_process(mistral3_images, tmp_path) -> None:
    """`longfit train --nproc 2 parallel.tp=2` on image rows (refused before, #54) logs the one-process losses."""
    from test_media import logged_losses, train_argv, train_on_two_ranks

    from longfit.cli import main

    rows = write_rows(tmp_path / "data", MISTRAL3_ROWS["packed"][0])
    assert main(["train", *train_argv(mistral3_images, rows, tmp_path / "one"), "train.dtype=fp32"]) == 0
    train_on_two_ranks(*train_argv(mistral3_images, rows, tmp_path / "tp2"), "train.dtype=fp32", "parallel.tp=2")
    losses = [logged_losses(tmp_path / run) for run in ("one", "tp2")]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-4)
