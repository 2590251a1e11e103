"""Tiled layers (memory.tiled_layers) with image rows (#54): the first tiled layer's input holds the images'
embeddings written over their placeholders, which it cannot look up again from the token ids, so it saves its input
(memory/tiled_layers.py); the loss and every gradient, the tower's included, are the wrapper's own forward's (fp32,
and bf16 autocast within the bf16 bound), and `longfit check` proves a run of them. Gemma 3's images attend
both ways: on one rank a tile never cuts one (its edges moved to the image's end) and its attention plans their later
keys; under cp=2 ring and Ulysses on gloo (slow) every key is shared before a tile attends, so tiles cut images and the
summed loss and gradients equal the wrapper's too, fp32 and within the bf16 bound; so do Gemma 4's, whose images attend
both ways on its sliding-window layers alone (fp32).

tests/test_media.py's tiny Qwen3.5 wrapper (hybrid: Gated DeltaNet and attention layers, both tiled) and its packed
rows, cut into three tiles a layer, so tile boundaries fall inside images."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from test_media import as_wrapper_names, batches, longfit_model, longfit_step, qwen_images, \
    wrapper_step  # noqa: E402,F401  (session and module fixtures)
from test_media_gemma3 import gemma3_batches, gemma3_images  # noqa: E402,F401  (session and module fixtures)
from test_media_gemma4 import gemma4_images, images  # noqa: E402,F401  (session and module fixtures)

from longfit.check import parity  # noqa: E402
from longfit.config import load_config  # noqa: E402

TILES = 3


def tiled_model(checkpoint: Path, vision: str, tiles: int = TILES):
    """longfit's objective of the wrapper with its layers tiled as `parallelize` tiles them on one process."""
    from longfit.memory.apply import apply_memory_techniques
    from longfit.models.structure import decoder_layers
    from longfit.parallel.tiled_attention import LocalTileAttention

    loss_module = longfit_model(checkpoint, vision)
    cfg = load_config(None, [f"model={checkpoint}", "memory.tiled_layers=true", f"memory.layer_tiles={tiles}"])
    applied = apply_memory_techniques(loss_module.model, cfg, "cpu", tile_attention=LocalTileAttention.for_sequence,
                                      media_encoder=loss_module.media_encoder)
    assert applied.tiled_layers == len(decoder_layers(loss_module.model))
    return loss_module


def tiled_step(checkpoint: Path, batch, vision: str, autocast: bool = False) -> parity.Step:
    from longfit.memory.tiled_layers import TILED_LAYER_ATTR
    from longfit.models.structure import decoder_layers

    loss_module = tiled_model(checkpoint, vision)
    got = longfit_step(loss_module, batch, autocast)
    assert all(getattr(layer, TILED_LAYER_ATTR).tile_counts == [TILES] for layer in decoder_layers(loss_module.model))
    return loss_module, got


def trained(step: parity.Step, names) -> parity.Step:
    return parity.Step(step.loss, {n: g for n, g in step.grads.items() if n in names})


@pytest.mark.parametrize("vision", ["frozen", "all"])
def test_tiled_layers_with_image_rows_equal_the_wrapper(qwen_images, batches, vision: str, one_thread) -> None:
    batch = batches["packed"]
    loss_module, got = tiled_step(qwen_images, batch, vision)
    truth = wrapper_step(qwen_images, batch)
    got = as_wrapper_names(got, loss_module, truth.grads)
    assert any(n.startswith("model.visual.") for n in got.grads) == (vision == "all")
    comparison = parity.compare_fp32(f"tiled layers, {vision}", got, trained(truth, got.grads))
    assert comparison.worst[1] <= 2, comparison.line()  # tests/test_media.py's bound


def test_tiled_layers_with_image_rows_are_within_the_bf16_bound(qwen_images, batches, one_thread) -> None:
    batch = batches["packed"]
    loss_module, got = tiled_step(qwen_images, batch, "all", autocast=True)
    truth = wrapper_step(qwen_images, batch)
    got = as_wrapper_names(got, loss_module, truth.grads)
    references = [trained(wrapper_step(qwen_images, batch, attention, autocast=True), got.grads)
                  for attention in ("eager", "sdpa")]
    comparison = parity.compare_bf16("bf16, tiled layers", got, references, trained(truth, got.grads),
                                     parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_the_check_proves_image_rows_under_tiled_layers(qwen_images, tmp_path, one_thread) -> None:
    """`longfit check` of a run of image rows with memory.tiled_layers=true: its step with the run's techniques tiles
    the layers, and is exact (before, the first tiled layer refused the images' embeddings as its input)."""
    from test_check_media import image_comparisons, image_run

    from longfit.check.parity import check_run

    cfg = image_run(qwen_images, tmp_path, "train.dtype=fp32", "memory.tiled_layers=true")
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    assert "image rows, fp32, techniques, packed" in [c.name for c in image_comparisons(report)]


def test_a_tile_edge_never_cuts_a_bidirectional_span() -> None:
    """Every tile edge inside an image's span (of any row) moves to the span's end, a moved edge falling in a later
    span moves again, and edges that meet merge."""
    from longfit.parallel.tiled_attention import even_tiles, whole_spans

    tiles = even_tiles(0, 30, 3)  # edges at 10 and 20
    assert whole_spans(tiles, None) == tiles
    assert whole_spans(tiles, ((), ((15, 18),))) == tiles
    assert whole_spans(tiles, (((8, 12),), ((19, 23),))) == [(0, 12), (12, 23), (23, 30)]
    assert whole_spans(tiles, (((5, 21), (20, 26)), ())) == [(0, 26), (26, 30)]


GEMMA3_TILES = 8
"""Even tiles of Gemma 3's packed rows (128 tokens, images at 5-21, 70-86 and 92-108 of the first row, 5-21 of the
second): edges at 16, 80 and 96 fall inside images, moved to 21, 86 and 108."""


def gemma3_tiled_step(checkpoint: Path, batch, autocast: bool):
    from test_media_gemma3 import longfit_step as gemma3_step

    from longfit.memory.tiled_layers import TILED_LAYER_ATTR
    from longfit.models.structure import decoder_layers

    loss_module = tiled_model(checkpoint, "all", GEMMA3_TILES)
    got = gemma3_step(loss_module, batch, autocast)
    counts = [getattr(layer, TILED_LAYER_ATTR).tile_counts for layer in decoder_layers(loss_module.model)]
    assert counts == [[GEMMA3_TILES]] * len(counts)
    return loss_module, got


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_gemma3s_images_under_tiled_layers_equal_the_wrapper(gemma3_images, gemma3_batches, autocast: bool,
                                                             one_thread) -> None:
    """Gemma 3's image tokens attend both ways: the tiles of its layers keep each image whole (their edges moved to
    an image's end) and plan its later keys as the untiled attention does; the loss and every gradient are the
    wrapper's (fp32, and within the bf16 bound under autocast)."""
    from test_media_gemma3 import wrapper_step as gemma3_wrapper_step

    batch = gemma3_batches["packed"]
    loss_module, got = gemma3_tiled_step(gemma3_images, batch, autocast)
    truth = gemma3_wrapper_step(gemma3_images, batch)
    got = as_wrapper_names(got, loss_module, truth.grads)
    if not autocast:
        comparison = parity.compare_fp32("gemma3, tiled layers", got, trained(truth, got.grads))
    else:
        references = [trained(gemma3_wrapper_step(gemma3_images, batch, attention, autocast=True), got.grads)
                      for attention in ("eager", "sdpa")]
        comparison = parity.compare_bf16("gemma3 bf16, tiled layers", got, references, trained(truth, got.grads),
                                         parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_gemma3s_tiles_cutting_an_image_are_not_the_wrappers(gemma3_images, gemma3_batches, monkeypatch,
                                                             one_thread) -> None:
    """The comparison can fail: with the even tiles' edges left inside the images, an image's earlier queries miss
    the keys of its part in the next tile."""
    from test_media_gemma3 import wrapper_step as gemma3_wrapper_step

    from longfit.parallel import tiled_attention

    batch = gemma3_batches["packed"]
    monkeypatch.setattr(tiled_attention, "whole_spans", lambda tiles, bidirectional: tiles)
    _, got = gemma3_tiled_step(gemma3_images, batch, False)
    assert abs(float(got.loss) - float(gemma3_wrapper_step(gemma3_images, batch).loss)) > 1e-4


def gemma3_tiled_cp_rank(rank: int, world_size: int, checkpoint: Path, rows: Path, seq_len: int, micro_batch: int,
                         method: str, autocast: bool):
    """One rank of a cp group on Gemma 3's (or Gemma 4's) packed rows, its layers tiled as `parallelize` tiles them
    after context parallelism: the loss and every trained gradient summed over the ranks (what FSDP2's reduction gives)."""
    import torch
    import torch.distributed as dist
    from test_media import image_batch
    from test_media_gemma3 import trained_grads

    from longfit.memory.apply import apply_memory_techniques
    from longfit.memory.loss import batch_loss_sum
    from longfit.memory.tiled_layers import TILED_LAYER_ATTR
    from longfit.models.structure import decoder_layers
    from longfit.parallel.batch import global_valid_tokens, shard_batch
    from longfit.parallel.media import DealtMedia
    from longfit.parallel.parallelize import apply_context_parallel
    from longfit.parallel.tiled_attention import LocalTileAttention

    group = dist.group.WORLD
    loss_module = longfit_model(checkpoint, "all")
    layout = apply_context_parallel(loss_module.model, group, method)
    cfg = load_config(None, [f"model={checkpoint}", f"parallel.cp={world_size}", f"parallel.cp_method={method}",
                             "memory.tiled_layers=true", f"memory.layer_tiles={GEMMA3_CP_TILES}"])
    apply_memory_techniques(loss_module.model, cfg, "cpu", tile_attention=LocalTileAttention.for_sequence,
                            media_encoder=loss_module.media_encoder)
    loss_module.media_features = DealtMedia(group)
    batch = image_batch(checkpoint, rows, seq_len, micro_batch)
    batch.media.positions = loss_module.media_encoder.rope_positions(batch.input_ids, batch.position_ids, batch.media)
    shard = shard_batch(batch, rank, world_size, layout)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = batch_loss_sum(loss_module, shard) / global_valid_tokens(shard.labels, group)
    loss.backward()
    dist.all_reduce(loss := loss.detach().float())
    grads = trained_grads(loss_module)
    for grad in grads.values():
        dist.all_reduce(grad)
    counts = [getattr(layer, TILED_LAYER_ATTR).tile_counts for layer in decoder_layers(loss_module.model)]
    return parity.Step(loss, grads), counts


GEMMA3_CP_TILES = 8
"""Tiles of a rank's 64 tokens (Gemma 3's packed rows under cp=2): 8 tokens each, so that every 16-token image is cut
by a tile edge (Ulysses: the first row's images at 5-21 and 70-86 hold rank 0's edges 8 and 16 and rank 1's 72 and 80;
the ring's zigzag chunks of 32 tokens, four tiles each, cut them too)."""


def tiled_cp_steps(results: list, loss_module, truth: parity.Step) -> list[parity.Step]:
    """Each cp rank's step of `gemma3_tiled_cp_rank` under the wrapper's names, after checking that its layers ran in
    GEMMA3_CP_TILES tiles and that it holds a gradient for every parameter the wrapper trains."""
    steps = []
    for got, counts in results:
        assert counts == [[GEMMA3_CP_TILES]] * len(counts)
        got = as_wrapper_names(got, loss_module, truth.grads)
        assert got.grads.keys() == trained(truth, got.grads).grads.keys()
        steps.append(got)
    return steps


def assert_ranks_equal_the_wrapper(name: str, results: list, checkpoint: Path, truth, references: list,
                                   fp32_bound: float = 1.0) -> None:
    """Each rank's step of `results` (`tiled_cp_steps`) against the wrapper's `truth`: within the bf16 bound of its
    autocast `references` where there are any, else within `fp32_bound` x the fp32 one."""
    for rank, got in enumerate(tiled_cp_steps(results, longfit_model(checkpoint, "all"), truth)):
        what = f"{name}, rank {rank}, tiled layers"
        if references:
            comparison = parity.compare_bf16(what, got, [trained(r, got.grads) for r in references],
                                             trained(truth, got.grads), parity.AUTOCAST_CEILING)
            assert comparison.ok, comparison.line()
        else:
            comparison = parity.compare_fp32(what, got, trained(truth, got.grads))
            assert comparison.worst[1] <= fp32_bound, comparison.line()


# measured on the shared 2-core machine (load 5-9): ~25 s a case (two gloo ranks, each building the model)
@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_gemma3s_images_under_tiled_layers_and_context_parallelism_equal_the_wrapper(
        gemma3_images, gemma3_batches, tmp_path, method: str, autocast: bool) -> None:
    """Under cp=2 a tiled layer's keys are all shared before its tiles attend, so its tiles may cut an image: the
    backends plan each image's later keys (across ranks too), and the summed loss and every gradient are the
    wrapper's (fp32, and within the bf16 bound under autocast). Before, refused in one line."""
    from parallel_harness import run_distributed
    from test_media import write_rows
    from test_media_gemma3 import ROWS
    from test_media_gemma3 import wrapper_step as gemma3_wrapper_step

    conversations, seq_len, micro_batch = ROWS["packed"]
    path = write_rows(tmp_path, conversations)
    batch = gemma3_batches["packed"]
    truth = gemma3_wrapper_step(gemma3_images, batch)
    references = [gemma3_wrapper_step(gemma3_images, batch, attention, autocast=True)
                  for attention in ("eager", "sdpa")] if autocast else []
    results = run_distributed(gemma3_tiled_cp_rank, 2, gemma3_images, path, seq_len, micro_batch, method, autocast)
    assert_ranks_equal_the_wrapper(f"gemma3, {method}", results, gemma3_images, truth, references)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_gemma4s_images_under_tiled_layers_equal_the_wrapper(gemma4_images, images, tmp_path, autocast: bool,
                                                             one_thread) -> None:
    """Gemma 4's image rows, everything trained, every layer tiled on one rank: the loss and every gradient are the
    wrapper's (fp32, and within the bf16 bound under autocast), the per-layer inputs' embedding and projection
    included (their gradient leaves each tiled layer beside its input's; before, they got none), and the first layer's
    input, which the per-layer projection also saves, is not overwritten by its gradient."""
    from test_media import image_batch, write_rows
    from test_media_gemma3 import longfit_step as gemma3_step
    from test_media_gemma4 import ROWS
    from test_media_gemma4 import wrapper_step as gemma4_wrapper_step

    conversations, seq_len, micro_batch = ROWS["packed"]
    batch = image_batch(gemma4_images, write_rows(tmp_path, conversations), seq_len, micro_batch)
    loss_module = tiled_model(gemma4_images, "all", GEMMA3_TILES)
    truth = gemma4_wrapper_step(gemma4_images, batch, images=images)
    got = as_wrapper_names(gemma3_step(loss_module, batch, autocast), loss_module, truth.grads)
    assert any("per_layer" in n for n in got.grads)
    assert got.grads.keys() == trained(truth, got.grads).grads.keys()
    if not autocast:
        comparison = parity.compare_fp32("gemma4, tiled layers", got, trained(truth, got.grads))
        assert comparison.worst[1] <= 2, comparison.line()  # tests/test_media_gemma4.py's bound
        return
    references = [trained(gemma4_wrapper_step(gemma4_images, batch, attention, autocast=True, images=images),
                          got.grads) for attention in ("eager", "sdpa")]
    comparison = parity.compare_bf16("gemma4 bf16, tiled layers", got, references, trained(truth, got.grads),
                                     parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


# measured on the shared 2-core machine (load 8): ~35 s a case (two gloo ranks, each building the model)
@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_gemma4s_images_under_tiled_layers_and_context_parallelism_equal_the_wrapper(gemma4_images, images, tmp_path,
                                                                                      method: str,
                                                                                      autocast: bool) -> None:
    """Gemma 4's images attend both ways on its sliding-window layers only (its global layers' tiles plan them causal):
    under cp=2 with GEMMA3_CP_TILES tiles of its 128 tokens a rank, each ~60-token image cut by several tile edges, the
    summed loss and every gradient are the wrapper's (fp32, and within the bf16 bound under autocast)."""
    from parallel_harness import run_distributed
    from test_media import image_batch, write_rows
    from test_media_gemma4 import ROWS
    from test_media_gemma4 import wrapper_step as gemma4_wrapper_step

    conversations, seq_len, micro_batch = ROWS["packed"]
    path = write_rows(tmp_path, conversations)
    batch = image_batch(gemma4_images, path, seq_len, micro_batch)
    truth = gemma4_wrapper_step(gemma4_images, batch, images=images)
    references = [gemma4_wrapper_step(gemma4_images, batch, attention, autocast=True, images=images)
                  for attention in ("eager", "sdpa")] if autocast else []
    results = run_distributed(gemma3_tiled_cp_rank, 2, gemma4_images, path, seq_len, micro_batch, method, autocast)
    assert_ranks_equal_the_wrapper(f"gemma4, {method}", results, gemma4_images, truth, references,
                                   fp32_bound=2)  # tests/test_media_gemma4.py's bound
