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
from test_media_gemma3 import longfit_step  # noqa: E402
from test_media_gemma4_av import ROWS, compared, fp32_comparison, references, write_rows, \
    write_tiny_gemma4_audio  # noqa: E402,F401  (a module fixture)

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


def assert_equal(got: parity.Step, plain: parity.Step) -> None:
    assert got.grads.keys() == plain.grads.keys()
    assert torch.equal(got.loss, plain.loss)
    assert all(torch.equal(got.grads[name], plain.grads[name]) for name in plain.grads)


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
