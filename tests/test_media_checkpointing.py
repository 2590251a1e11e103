"""The vision tower's blocks under activation checkpointing and the offload store (#54): a trained tower's blocks are
checkpointed as the language model's layers are (memory.activation_checkpointing), their inputs through a store of
their own (memory.offload_activations: host, or disk with memory.offload_dir), a frozen tower's run plainly; the loss
and every gradient, the tower's included, are those of the step without checkpointing, bit for bit, and the wrapper's
own forward's (fp32, and bf16 autocast within the bf16 bound), on one process and on cp=2 ring ranks (slow); the plan
counts the checkpointed tower's saved inputs (longfit.plan.media).

The tiny Qwen3.5 wrapper of tests/test_media.py with a tower of two blocks, so that a block's backward prefetches the
other's input from the store."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from test_media import ROWS, TOWER, as_wrapper_names, cp_share_step, image_batch, longfit_model, longfit_step, \
    wrapper_step, write_rows  # noqa: E402
from test_media_gemma3 import gemma3_batches, gemma3_images  # noqa: E402,F401  (session and module fixtures)
from test_media_llama4 import llama4_batches, llama4_images  # noqa: E402,F401  (session and module fixtures)
from test_wrappers import LINEAR, QWEN_VISION, TEXT  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.config import load_config  # noqa: E402

DEPTH = 2


@pytest.fixture(scope="session")
def two_blocks(tmp_path_factory) -> Path:
    """tests/test_media.py's tiny Qwen3.5 wrapper, its tower two blocks deep (a second)."""
    from document_qa import write_tiny_qwen3_5

    return write_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5-two-blocks"), dict(TEXT, **LINEAR),
                              dict(QWEN_VISION, depth=DEPTH))


@pytest.fixture(scope="module")
def packed(two_blocks, tmp_path_factory):
    """The packed rows of tests/test_media.py (four images in two rows)."""
    conversations, seq_len, micro_batch = ROWS["packed"]
    rows = write_rows(tmp_path_factory.mktemp("packed-rows"), conversations)
    return image_batch(two_blocks, rows, seq_len, micro_batch), rows


def checkpointed_model(checkpoint: Path, vision: str, offload: str, offload_dir: Path, depth: int = DEPTH):
    """longfit's objective of the wrapper with the memory techniques of a run (`apply_memory_techniques`, as
    `parallelize` applies them): every layer and tower block checkpointed, their inputs offloaded as `offload` says;
    every block input offloaded, however small (the tiny tower's are a few KiB)."""
    from longfit.memory.apply import apply_memory_techniques

    loss_module = longfit_model(checkpoint, vision)
    settings = {"none": ["memory.offload_activations=false"], "host": ["memory.offload_activations=true"],
                "disk": ["memory.offload_activations=true", f"memory.offload_dir={offload_dir}"]}[offload]
    cfg = load_config(None, [f"model={checkpoint}", *settings])
    applied = apply_memory_techniques(loss_module.model, cfg, "cpu", media_encoder=loss_module.media_encoder)
    assert applied.tower_blocks == depth
    offloader = tower_offloader(loss_module)
    if offloader is not None:
        offloader.min_offload_bytes = 0
    return loss_module


def tower_offloader(loss_module):
    """The offloader of the tower's blocks (None: checkpointed without offload)."""
    from longfit.memory.checkpointing import CHECKPOINT_ATTR

    vision = loss_module.media_encoder.vision
    specs = [getattr(m, CHECKPOINT_ATTR) for m in vision.modules() if hasattr(m, CHECKPOINT_ATTR)]
    offloaders = {id(spec.offloader): spec.offloader for spec in specs}
    (offloader,) = offloaders.values()
    return offloader


def assert_equal(got: parity.Step, plain: parity.Step) -> None:
    assert got.grads.keys() == plain.grads.keys()
    assert torch.equal(got.loss, plain.loss)
    assert all(torch.equal(got.grads[name], plain.grads[name]) for name in plain.grads)


@pytest.mark.parametrize("vision, offload", [("all", "none"), ("all", "host"), ("all", "disk"), ("projector", "host")])
def test_the_towers_blocks_are_checkpointed_exactly(two_blocks, packed, tmp_path, vision: str, offload: str,
                                                    one_thread) -> None:
    """A trained tower's blocks keep their inputs alone, in the store where offloaded, and the step is the
    un-checkpointed one bit for bit and the wrapper's; a frozen tower (train.vision=projector) stores nothing."""
    batch, _ = packed
    loss_module = checkpointed_model(two_blocks, vision, offload, tmp_path)
    got = longfit_step(loss_module, batch)
    plain = longfit_step(longfit_model(two_blocks, vision), batch)
    assert_equal(got, plain)
    offloader = tower_offloader(loss_module)
    if offloader is not None:  # each block's input (patches, hidden) went out and came back, and nothing else
        patches = int(batch.media.grid_thw.prod(-1).sum())
        block_input = patches * loss_module.media_encoder.config.vision_config.hidden_size * 4
        stored = DEPTH if vision == "all" else 0
        assert (offloader.stats.offloaded_tensors, offloader.stats.offloaded_bytes) == (stored, stored * block_input)
        assert offloader.stats.reloaded_bytes == offloader.stats.offloaded_bytes
        assert offloader.stats.prefetched_tensors == stored - (vision == "all")
        assert (offloader.store.stats.disk_written_bytes > 0) == (offload == "disk" and vision == "all")
        offloader.store.close()
    truth = wrapper_step(two_blocks, batch)
    got = as_wrapper_names(got, loss_module, truth.grads)
    assert any(name.startswith(TOWER + "blocks.") for name in got.grads) == (vision == "all")
    comparison = parity.compare_fp32(f"{vision}, {offload}", got, parity.Step(
        truth.loss, {name: grad for name, grad in truth.grads.items() if name in got.grads}))
    assert comparison.worst[1] <= 2, comparison.line()  # tests/test_media.py's bound


def test_the_checkpointed_tower_is_within_the_bf16_bound(two_blocks, packed, tmp_path, one_thread) -> None:
    """Under bf16 autocast (train.dtype=bf16 on one process) the checkpointed, offloaded tower's step is the
    un-checkpointed one bit for bit, and within the bf16 bound of the wrapper's."""
    batch, _ = packed
    loss_module = checkpointed_model(two_blocks, "all", "host", tmp_path)
    got = longfit_step(loss_module, batch, autocast=True)
    assert tower_offloader(loss_module).stats.offloaded_tensors == DEPTH
    assert_equal(got, longfit_step(longfit_model(two_blocks, "all"), batch, autocast=True))
    truth = wrapper_step(two_blocks, batch)
    got = as_wrapper_names(got, loss_module, truth.grads)

    def trained(step: parity.Step) -> parity.Step:
        return parity.Step(step.loss, {name: grad for name, grad in step.grads.items() if name in got.grads})

    references = [trained(wrapper_step(two_blocks, batch, attention, autocast=True)) for attention in ("eager", "sdpa")]
    comparison = parity.compare_bf16("bf16, checkpointed tower", got, references, trained(truth),
                                     parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def cp_checkpointed_rank(rank: int, world_size: int, checkpoint: Path, rows: Path, offload_dir: Path):
    """tests/test_media.py's `cp_rank_step` (cp=2 ring, the images dealt over the ranks) with the tower's blocks
    checkpointed and offloaded to host memory (context parallelism applied first, as `parallelize` does); also
    how many block inputs this rank's store held."""
    import torch.distributed as dist

    from longfit.memory.apply import apply_memory_techniques
    from longfit.parallel.media import DealtMedia
    from longfit.parallel.parallelize import apply_context_parallel

    _, seq_len, micro_batch = ROWS["packed"]
    loss_module = longfit_model(checkpoint, "all")
    layout = apply_context_parallel(loss_module.model, dist.group.WORLD, "ring")
    loss_module.media_features = DealtMedia(dist.group.WORLD)
    cfg = load_config(None, [f"model={checkpoint}", "memory.offload_activations=true"])
    apply_memory_techniques(loss_module.model, cfg, "cpu", media_encoder=loss_module.media_encoder)
    tower_offloader(loss_module).min_offload_bytes = 0
    batch = image_batch(checkpoint, rows, seq_len, micro_batch)
    step = cp_share_step(loss_module, layout, batch, rank, world_size,
                         [*loss_module.model.named_parameters(),
                          *((TOWER + n, p) for n, p in loss_module.media_encoder.vision.named_parameters())])
    return step, tower_offloader(loss_module).stats.offloaded_tensors


@pytest.mark.slow  # two gloo ranks, then the wrapper's reference: 25-26 s at load 3.8-6.5 on the 2 shared cores
def test_the_checkpointed_tower_under_cp_ring_equals_the_wrapper(two_blocks, packed, tmp_path) -> None:
    from parallel_harness import run_distributed
    from test_media import assert_ranks_equal_the_wrapper

    batch, rows = packed
    results = run_distributed(cp_checkpointed_rank, 2, two_blocks, rows, tmp_path)
    assert [stored for _, stored in results] == [DEPTH, DEPTH]  # each rank's images through its blocks' store
    assert_ranks_equal_the_wrapper([step for step, _ in results], batch, wrapper_step(two_blocks, batch), two_blocks,
                                   "ring, the tower checkpointed")


def test_the_plan_counts_a_checkpointed_blocks_input_alone(two_blocks, one_thread) -> None:
    """The plan's traces of the trained tower (longfit.plan.media._traced) checkpoint its blocks as the run does: a
    second block keeps its input (patches x hidden, fp32) and nothing more, where un-checkpointed it keeps all its
    saved tensors; the plan of a run (memory.activation_checkpointing) counts the tower's kept bytes accordingly."""
    from longfit.models.model_config import read_config
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import _traced, _tower_input, tower_costs

    config = read_config(str(two_blocks)).config
    pixels, grid = _tower_input(str(two_blocks), config, (64, 64), None, 0)
    block_input = int(grid.prod()) * config.vision_config.hidden_size * 4

    def second_block(checkpointed: bool) -> int:
        one, two = (_traced(config, "fp32", "all", pixels, grid, blocks, 1, checkpointed)["kept"] for blocks in (1, 2))
        return two - one

    assert second_block(True) == block_input
    assert second_block(False) > 3 * block_input
    given = [f"model={two_blocks}", "seq_len=256", "train.vision=all", "data.plan_images=2",
             "data.plan_image_size=64x64", "eval.retrieval=false"]
    kept = {flag: tower_costs(plan_config(load_config(None, [*given, f"memory.activation_checkpointing={flag}"]),
                                          1).setup).kept for flag in ("true", "false")}
    assert kept["true"] < kept["false"]


def test_bench_media_refuses_an_unknown_tower_checkpointing(two_blocks, tmp_path, capsys) -> None:
    from longfit.cli import main

    assert main(["bench", "media", "--model", str(two_blocks), "--seq-len", "512", "--short-len", "256",
                 "--tower-checkpointing", "both", "--out", str(tmp_path)]) != 0
    assert "longfit: error: --tower-checkpointing 'both': give on, off or on,off" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_gemma3s_checkpointed_tower_equals_the_wrapper(gemma3_images, gemma3_batches, tmp_path, one_thread) -> None:
    """Gemma 3's SigLIP tower (its blocks found by its config's depth, not by a path) checkpointed and offloaded: the
    un-checkpointed step bit for bit, and the wrapper's (tests/test_media_gemma3.py's comparison)."""
    from test_media_gemma3 import longfit_step as gemma3_step
    from test_media_gemma3 import wrapper_step as gemma3_wrapper_step

    from longfit.models.model_config import read_config

    batch = gemma3_batches["packed"]
    depth = read_config(str(gemma3_images)).config.vision_config.num_hidden_layers
    loss_module = checkpointed_model(gemma3_images, "all", "host", tmp_path, depth)
    got = gemma3_step(loss_module, batch)
    stats = tower_offloader(loss_module).stats
    # SigLIP's first block input is its patch embeddings' transposed layout: non-contiguous, it stays where it is
    assert stats.offloaded_tensors + stats.kept_tensors == depth
    assert_equal(got, gemma3_step(longfit_model(gemma3_images, "all"), batch))
    truth = gemma3_wrapper_step(gemma3_images, batch)
    got = as_wrapper_names(got, loss_module, truth.grads)
    comparison = parity.compare_fp32("gemma3, checkpointed tower", got, parity.Step(
        truth.loss, {name: grad for name, grad in truth.grads.items() if name in got.grads}))
    assert comparison.ok, comparison.line()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_llama4s_tower_blocks_inputs_are_offloaded(llama4_images, llama4_batches, tmp_path, autocast: bool,
                                                   one_thread) -> None:
    """Llama 4's tower blocks are called with their hidden state by keyword (`hidden_state=`): the checkpoint takes it
    positionally, so each trained block's input goes through the store as other families' do, and the step (fp32,
    and under bf16 autocast) is the un-offloaded checkpointed one bit for bit."""
    from test_media_llama4 import longfit_step as llama4_step

    from longfit.models.model_config import read_config

    batch = llama4_batches["packed"]
    depth = read_config(str(llama4_images)).config.vision_config.num_hidden_layers
    offloaded = checkpointed_model(llama4_images, "all", "host", tmp_path, depth)
    got = llama4_step(offloaded, batch, autocast)
    stored = tower_offloader(offloaded)
    assert stored.stats.offloaded_tensors == depth
    assert stored.stats.reloaded_bytes == stored.stats.offloaded_bytes > 0
    assert_equal(got, llama4_step(checkpointed_model(llama4_images, "all", "none", tmp_path, depth), batch, autocast))
