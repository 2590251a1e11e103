"""Gemma 4's audio tower beside its vision tower under the memory techniques (#54): its blocks checkpointed as the
vision tower's are (memory.activation_checkpointing, `MediaEncoder.towers`), their inputs in a store of their own
(memory.offload_activations: host, or disk with memory.offload_dir); the loss and every gradient, both towers'
included, are the un-checkpointed step's bit for bit and the wrapper's own eager forward's (fp32, and bf16 autocast
within the bf16 bound), on packed rows holding audios, a video and an image.

The family: tests/test_media_gemma4_av.py's tiny wrapper with an audio tower two blocks deep, so that a block's
backward prefetches the other's input from the store."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_media import as_wrapper_names, image_batch, longfit_model  # noqa: E402
from test_media_checkpointing import assert_equal  # noqa: E402
from test_media_gemma3 import longfit_step  # noqa: E402
from test_media_gemma4_av import ROWS, compared, fp32_comparison, references, write_rows, \
    write_tiny_gemma4_audio  # noqa: E402,F401  (a module fixture)
from test_media_gemma4_av import wrapper_step as av_wrapper_step  # noqa: E402

from longfit.check import parity  # noqa: E402
from longfit.config import load_config  # noqa: E402

AUDIO_DEPTH = 2


@pytest.fixture(scope="session")
def gemma4_audio(tmp_path_factory) -> Path:
    """The tiny Gemma 4 wrapper of tests/test_media_gemma4_av.py, its audio tower two blocks deep."""
    return write_tiny_gemma4_audio(tmp_path_factory.mktemp("gemma4-audio-two-blocks"), audio_depth=AUDIO_DEPTH)


@pytest.fixture(scope="module")
def packed(gemma4_audio, tmp_path_factory):
    """The packed rows of tests/test_media_gemma4_av.py: three audios, a video's two frames and an image."""
    conversations, seq_len, micro_batch = ROWS["packed"]
    return image_batch(gemma4_audio, write_rows(tmp_path_factory.mktemp("packed"), conversations), seq_len,
                       micro_batch)


def checkpointed_model(checkpoint: Path, vision: str, offload: str, offload_dir: Path):
    """longfit's objective of the wrapper with a run's memory techniques (`apply_memory_techniques`): every layer and
    both towers' blocks checkpointed, their inputs offloaded as `offload` says, however small."""
    from longfit.memory.apply import apply_memory_techniques
    from longfit.memory.checkpointing import CHECKPOINT_ATTR

    loss_module = longfit_model(checkpoint, vision)
    settings = {"none": ["memory.offload_activations=false"], "host": ["memory.offload_activations=true"],
                "disk": ["memory.offload_activations=true", f"memory.offload_dir={offload_dir}"]}[offload]
    cfg = load_config(None, [f"model={checkpoint}", *settings])
    applied = apply_memory_techniques(loss_module.model, cfg, "cpu", media_encoder=loss_module.media_encoder)
    audio_tower = loss_module.media_encoder.vision["audio_tower"]
    assert all(hasattr(block, CHECKPOINT_ATTR) for block in audio_tower.layers)
    assert applied.tower_blocks == loss_module.media_encoder.config.vision_config.num_hidden_layers + AUDIO_DEPTH
    for offloader in tower_offloaders(loss_module).values():
        offloader.min_offload_bytes = 0
    return loss_module


def tower_offloaders(loss_module) -> dict:
    """Each tower's offloader ("vision_tower", "audio_tower"); none where the blocks are not offloaded."""
    from longfit.memory.checkpointing import CHECKPOINT_ATTR

    found = {}
    for name, tower in loss_module.media_encoder.vision.items():
        specs = [getattr(m, CHECKPOINT_ATTR) for m in tower.modules() if hasattr(m, CHECKPOINT_ATTR)]
        for spec in specs:
            if spec.offloader is not None:
                found.setdefault(name, spec.offloader)
                assert found[name] is spec.offloader  # one store a tower
    return found


def audio_block_input(loss_module, batch) -> int:
    """Bytes of one audio block's input on the batch's audios: (audios, subsampled frames of the longest, hidden)
    fp32, as the tower pads them."""
    from longfit.data.audio import subsampled

    grid = batch.media.grid_thw
    audio = grid[grid[:, 0] == 0]
    width = loss_module.media_encoder.config.audio_config.hidden_size
    return len(audio) * subsampled(int(audio[:, 1].max())) * width * 4


@pytest.mark.parametrize("vision, offload", [("all", "none"), ("all", "host"), ("all", "disk"), ("projector", "host")])
def test_the_audio_towers_blocks_are_checkpointed_exactly(gemma4_audio, packed, tmp_path, vision: str, offload: str,
                                                          one_thread) -> None:
    """Both trained towers' blocks keep their inputs alone, each tower's in its own store where offloaded, and the
    step is the un-checkpointed one bit for bit; frozen towers (train.vision=projector) store nothing."""
    loss_module = checkpointed_model(gemma4_audio, vision, offload, tmp_path)
    got = longfit_step(loss_module, packed)
    assert_equal(got, longfit_step(longfit_model(gemma4_audio, vision), packed))
    assert any(n.startswith("model.audio_tower.layers.1.") for n in got.grads) == (vision == "all")
    offloaders = tower_offloaders(loss_module)
    assert offloaders.keys() == ({"vision_tower", "audio_tower"} if offload != "none" else set())
    if "audio_tower" in offloaders:  # each audio block's input (audios, frames / 4, hidden) went out and came back
        stats = offloaders["audio_tower"].stats
        stored = AUDIO_DEPTH if vision == "all" else 0
        assert (stats.offloaded_tensors, stats.offloaded_bytes) == (stored, stored * audio_block_input(loss_module,
                                                                                                         packed))
        assert stats.reloaded_bytes == stats.offloaded_bytes and stats.prefetched_tensors == stored - (vision == "all")
        assert (offloaders["audio_tower"].store.stats.disk_written_bytes > 0) == (offload == "disk" and vision == "all")
        assert offloaders["vision_tower"].stats.offloaded_tensors == (vision == "all")  # its one block
    for offloader in offloaders.values():
        offloader.store.close()


def test_the_checkpointed_audio_tower_equals_the_wrapper(gemma4_audio, packed, references, tmp_path,
                                                         one_thread) -> None:
    """fp32: the checkpointed, offloaded towers' step against the wrapper's own eager forward (its float64 step
    exact, its sdpa step the rounding bound: tests/test_media_gemma4_av.py's comparison)."""
    loss_module = checkpointed_model(gemma4_audio, "all", "host", tmp_path)
    got, others, truth = compared(gemma4_audio, packed, "all", references)  # the un-checkpointed step and the wrapper's
    checkpointed = as_wrapper_names(longfit_step(loss_module, packed), loss_module, truth.grads)
    assert tower_offloaders(loss_module)["audio_tower"].stats.offloaded_tensors == AUDIO_DEPTH
    checkpointed = parity.Step(checkpointed.loss, {n: g for n, g in checkpointed.grads.items() if n in truth.grads})
    assert_equal(checkpointed, parity.Step(got.loss, {n: g for n, g in got.grads.items() if n in truth.grads}))
    assert any(n.startswith("model.audio_tower.layers.1.") for n in checkpointed.grads)
    comparison = fp32_comparison("gemma4 audio, checkpointed towers", checkpointed, others, truth)
    assert comparison.ok, comparison.line()


def test_the_checkpointed_audio_tower_is_within_the_bf16_bound(gemma4_audio, packed, references, tmp_path,
                                                               one_thread) -> None:
    """Under bf16 autocast (train.dtype=bf16 on one process) the checkpointed, offloaded towers' step is the
    un-checkpointed one bit for bit, and within the bf16 bound of the wrapper's eager and sdpa steps."""
    loss_module = checkpointed_model(gemma4_audio, "all", "host", tmp_path)
    got, others, truth = compared(gemma4_audio, packed, "all", references, autocast=True)
    checkpointed = as_wrapper_names(longfit_step(loss_module, packed, autocast=True), loss_module, truth.grads)
    assert tower_offloaders(loss_module)["audio_tower"].stats.offloaded_tensors == AUDIO_DEPTH
    checkpointed = parity.Step(checkpointed.loss, {n: g for n, g in checkpointed.grads.items() if n in truth.grads})
    assert_equal(checkpointed, parity.Step(got.loss, {n: g for n, g in got.grads.items() if n in truth.grads}))
    comparison = parity.compare_bf16("gemma4 audio, checkpointed towers, bf16", checkpointed, others, truth,
                                     parity.AUTOCAST_CEILING)
    assert comparison.ok, comparison.line()


def test_a_checkpointed_audio_block_keeps_its_input_alone(gemma4_audio, packed, one_thread) -> None:
    """The memory saved: the audio tower's forward on the batch's audios keeps, checkpointed, each block's input and
    nothing else of its blocks; un-checkpointed, several times more (LiveBytes, real tensors)."""
    from longfit.memory.checkpointing import apply_tower_checkpointing
    from longfit.plan.tracker import LiveBytes

    def kept(checkpointed: bool) -> int:
        encoder = longfit_model(gemma4_audio, "all").media_encoder
        if checkpointed:
            ((tower, depth),) = [(t, d) for t, d in encoder.towers() if t is encoder.vision["audio_tower"]]
            apply_tower_checkpointing(tower, depth)
        audio = torch.nonzero(packed.media.grid_thw[:, 0] == 0).flatten().tolist()
        features, grid = packed.media.pixel_values[audio], packed.media.grid_thw[audio]
        tracker = LiveBytes()
        with tracker:
            tracker.adopt(encoder.parameters(), "weights")
            tracker.adopt(encoder.buffers(), "weights")
            tracker.adopt([features, grid], "batch")
            base = tracker.live
            out = encoder._audio_features(features, grid)
            held = tracker.live - base
        del out
        return held

    block_input = audio_block_input(longfit_model(gemma4_audio, "all"), packed)
    plain, checkpointed = kept(False), kept(True)
    # what the blocks no longer keep: 16,113,155 -> 14,426,163 B here, 1,686,992 B or 191 block inputs of 8,832 B
    # (most of both is the subsampling convolutions' saved tensors, outside the blocks)
    assert plain - checkpointed > AUDIO_DEPTH * 50 * block_input


# -- LoRA on the audio tower ---------------------------------------------------------------------------------------

AUDIO_ADAPTERS = "base_model.model.model.audio_tower."
SDPA = {"text_config": "sdpa", "vision_config": "sdpa", "audio_config": "eager"}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_audio_tower_adapters_equal_peft_on_the_wrapper(gemma4_audio, packed, autocast: bool, one_thread) -> None:
    """train.vision=all with lora.enabled: adapters on every linear layer of both towers and their embedders (the
    audio tower's attention, feed-forward, convolution and subsampling projections, its output projection), as peft
    puts them on transformers' wrapper; the loss and every adapter gradient equal peft's on the wrapper's eager
    forward (fp32: `longfit check`'s rule, its float64 run and its sdpa run giving the wrapper's own rounding -- the
    audio adapters' gradients cancel: 6.3x the plain bound, as the wrapper's own runs are; bf16 autocast: the bf16
    bound of its eager and sdpa steps), each audio adapter's gradient non-zero."""
    from test_media_lora import longfit_lora, longfit_step as lora_step, peft_wrapper, reference_step, wrapper_names

    from longfit.check.media import _float64, wrapper_step

    loss_module = longfit_lora(gemma4_audio, "all")
    names = wrapper_names(gemma4_audio, loss_module)
    truth = reference_step(gemma4_audio, loss_module, packed)
    got = lora_step(loss_module, packed, autocast)
    got = parity.Step(got.loss, {names[n]: g for n, g in got.grads.items()})
    references = [reference_step(gemma4_audio, loss_module, packed, a, autocast=True) for a in ("eager", SDPA)] \
        if autocast else []  # (the audio tower has its eager attention alone)
    assert got.grads.keys() == truth.grads.keys()
    audio = [n for n in got.grads if n.startswith(AUDIO_ADAPTERS)]
    for module in ("layers.1.self_attn.q_proj.linear", "layers.1.feed_forward2.ffw_layer_2.linear",
                   "layers.0.lconv1d.linear_start.linear", "subsample_conv_projection.input_proj_linear",
                   "output_proj"):
        assert f"{AUDIO_ADAPTERS}{module}.lora_A.default.weight" in audio, module
    assert all(got.grads[n].abs().sum() > 0 for n in audio)
    assert any(n.startswith("base_model.model.model.embed_audio.") for n in got.grads)
    if autocast:
        comparison = parity.compare_bf16("gemma4 audio adapters, bf16", got, references, truth,
                                         parity.AUTOCAST_CEILING)
        assert comparison.ok, comparison.line()
    else:
        exact = wrapper_step(_float64(peft_wrapper(gemma4_audio, loss_module), loss_module.media_encoder),
                             loss_module.media_encoder, packed)
        others = [reference_step(gemma4_audio, loss_module, packed, SDPA)]
        comparison = parity.compare_fp32("gemma4 audio adapters", got, truth, exact, others)
        assert comparison.ok, comparison.line()


def test_the_export_writes_the_audio_adapters_that_peft_loads(gemma4_audio, packed, tmp_path, one_thread) -> None:
    """The run's adapter, written by `longfit export`'s writer, holds the audio tower's adapters under the wrapper's
    names; peft loads it onto transformers' wrapper, which then gives the loss and every adapter gradient of peft's
    wrapper holding longfit's adapters, bit for bit."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from test_media_lora import longfit_lora, lora_run, reference_step
    from transformers import AutoModelForImageTextToText

    from longfit.check.media import wrapper_step
    from longfit.models.loading import load_tokenizer
    from longfit.train.export import export_model

    loss_module = longfit_lora(gemma4_audio, "all")
    cfg = lora_run("all", f"model={gemma4_audio}")
    out = export_model(cfg, loss_module.model, load_tokenizer(str(gemma4_audio)), tmp_path / "export", rank=0,
                       media_encoder=loss_module.media_encoder)
    written = load_file(out / "adapter_model.safetensors")
    assert any(".audio_tower.layers.1." in k for k in written) and any(".embed_audio." in k for k in written)
    truth = reference_step(gemma4_audio, loss_module, packed)
    wrapper = AutoModelForImageTextToText.from_pretrained(gemma4_audio, dtype=torch.float32,
                                                          attn_implementation="eager")
    got = wrapper_step(PeftModel.from_pretrained(wrapper, out, is_trainable=True), loss_module.media_encoder, packed)
    assert got.grads.keys() == truth.grads.keys() and any(n.startswith(AUDIO_ADAPTERS) for n in got.grads)
    torch.testing.assert_close(got.loss, truth.loss, rtol=0, atol=0)
    for name, grad in truth.grads.items():
        torch.testing.assert_close(got.grads[name], grad, rtol=0, atol=0, msg=name)


# -- FSDP2 -----------------------------------------------------------------------------------------------------------

def fsdp_rank_steps(rank: int, world_size: int, checkpoint: Path, rows: Path, dtypes: list[str]) -> dict:
    """This rank's step of the packed rows under parallel.dp_shard=2 (FSDP2 over both ranks, each its own row of the
    trainer's deal: `build_dataloader`'s dp_rank), with a run's memory techniques (both towers' blocks checkpointed,
    their inputs offloaded); the loss summed over the ranks, every trained gradient whole (`full_tensor`)."""
    from test_media_gemma3 import trained_grads

    from longfit.bench.cp import _parallel_dims
    from longfit.data.packing import build_dataloader
    from longfit.memory.loss import batch_loss_sum
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader
    from longfit.parallel.batch import global_valid_tokens
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.parallelize import parallelize

    _, seq_len, _ = ROWS["packed"]
    results = {}
    for dtype in dtypes:
        cfg = load_config(None, [f"model={checkpoint}", f"data.path={rows}", f"seq_len={seq_len}",
                                 "parallel.dp_shard=2", f"train.dtype={dtype}", "train.vision=all",
                                 "memory.activation_checkpointing=true", "memory.offload_activations=true"])
        loss_module = longfit_model(checkpoint, "all")
        dims = _parallel_dims(cfg, world_size, loss_module.model)
        mesh = dims.build_mesh("cpu")
        loss_module = parallelize(loss_module, dims, cfg, mesh)
        assert sum(hasattr(m, "longfit_activation_checkpoint") for m in
                   loss_module.media_encoder.vision["audio_tower"].layers) == AUDIO_DEPTH
        batch = next(build_dataloader(cfg, load_tokenizer(str(checkpoint)), rank, world_size, epochs=1,
                                      media=media_reader(str(checkpoint))))
        batch.media.positions = loss_module.media_encoder.rope_positions(batch.input_ids, batch.position_ids,
                                                                         batch.media)
        count = global_valid_tokens(batch.labels, mesh.world_group)
        local_sum = batch_loss_sum(loss_module, batch)
        (local_sum / count).backward()
        loss = all_reduce_sum(local_sum.detach().float().clone(), mesh.world_group) / count
        grads = {n: g.full_tensor().float() for n, g in trained_grads(loss_module).items()}
        results[dtype] = parity.Step(loss, grads)
    return results


# two gloo ranks building the model twice, then the one-process and wrapper references
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp2_audio_rows_equal_one_process(gemma4_audio, packed, references, tmp_path) -> None:
    """parallel.dp_shard=2: each rank trains its row (the audios of its chats through its shard of both towers),
    FSDP2 sums the gradients; fp32: the loss and every gradient (both towers' included) those of one process on the
    two rows, within the fp32 bound; bf16 (FSDP2's bf16 parameters): within the bf16 bound of the wrapper's bf16 steps.
    """
    from parallel_harness import run_distributed

    conversations, _, _ = ROWS["packed"]
    rows = write_rows(tmp_path, conversations)
    results = run_distributed(fsdp_rank_steps, 2, gemma4_audio, rows, ["fp32", "bf16"])
    one = longfit_step(longfit_model(gemma4_audio, "all"), packed)
    for rank, result in enumerate(results):
        got = result["fp32"]
        assert got.grads.keys() == one.grads.keys() and any(".audio_tower.layers.1." in n for n in got.grads)
        comparison = parity.compare_fp32(f"gemma4 audio, dp_shard=2, rank {rank}", got, one)
        assert comparison.ok, comparison.line()
    truth = av_wrapper_step(gemma4_audio, packed, references)
    bf16 = [av_wrapper_step(gemma4_audio, packed, references, attention, dtype=torch.bfloat16)
            for attention in ("eager", "sdpa")]
    names = longfit_model(gemma4_audio, "all")
    for rank, result in enumerate(results):
        got = as_wrapper_names(result["bf16"], names, truth.grads)

        def trained(step: parity.Step) -> parity.Step:
            return parity.Step(step.loss, {n: g for n, g in step.grads.items() if n in truth.grads})

        got = trained(got)
        assert got.grads.keys() == truth.grads.keys()
        comparison = parity.compare_bf16(f"gemma4 audio, dp_shard=2, rank {rank}, bf16", got,
                                         [trained(r) for r in bf16], truth, parity.FSDP_CEILING)
        assert comparison.ok, comparison.line()
