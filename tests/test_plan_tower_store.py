"""The vision tower's offload store in `longfit plan` (#54): with a trained tower checkpointed and its blocks' inputs
offloaded (memory.activation_checkpointing, memory.offload_activations), the store holds a slot of a block's input for
every block in host memory. The plan's host figure counts it beside the language model's store, and sizes its slot
from the heaviest row the data packs (`CheckpointPlacement.tower_slots`), so that a later, heavier row than the
first step's does not fall to plain host buffers.

The checkpoint is a tiny Qwen3.5 wrapper whose tower (3 blocks of width 256) reads 256 x 256 images as 256 patches:
eight of them make a block input of 2 MiB in fp32, above the offloader's 1 MiB floor (`MIN_OFFLOAD_BYTES`); its
language model's layer inputs (1,024 tokens of width 64) stay below it, in place, in the plan's trace and the run
alike."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

from longfit.config import load_config  # noqa: E402

SIDE, IMAGES, SEQ_LEN = 256, 8, 1024


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory) -> Path:
    from test_wrappers import LINEAR, QWEN_VISION, TEXT
    from transformers import Qwen2VLImageProcessorPil
    from video_qa import TINY_VIDEO, write_tiny_qwen3_5_video

    path = tmp_path_factory.mktemp("qwen3_5-wide-tower")
    write_tiny_qwen3_5_video(path, dict(TEXT, **LINEAR), dict(QWEN_VISION, depth=3, hidden_size=256,
                                                                 intermediate_size=256), video=TINY_VIDEO)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
                             max_pixels=SIDE * SIDE).save_pretrained(path)
    return path


def image_chats(folder: Path, counts: list[int]) -> Path:
    """Chats of `counts` noise images of SIDE x SIDE each, one chat a row."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for index in range(max(counts)):
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(folder / f"p{index}.png")
    rows = [{"messages": [{"role": "user", "content": [*({"type": "image", "path": f"p{i}.png"} for i in range(n)),
                                                       {"type": "text", "text": "Which page?"}]},
                          {"role": "assistant", "content": "One."}]} for n in counts]
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder / "rows.jsonl"


def offloaded_run(wrapper: Path, rows: Path, dtype: str, seq_len: int = SEQ_LEN):
    return load_config(None, [f"model={wrapper}", f"data.path={rows}", f"seq_len={seq_len}", "train.vision=all",
                              f"train.dtype={dtype}", "memory.activation_checkpointing=true",
                              "memory.offload_activations=true", "memory.tiled_layers=false", "eval.retrieval=false"])


# measured on the shared 2-core machine at load 12: ~30 s CPU, ~110 s wall a case (the traced step of 8 images)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_plans_host_memory_holds_the_towers_store_as_the_step_allocates_it(wrapper, tmp_path, dtype) -> None:
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs
    from longfit.plan.trace import trace_image_step

    cfg = offloaded_run(wrapper, image_chats(tmp_path, [IMAGES]), dtype)
    planned = plan_config(cfg, 1)
    towers = tower_costs(planned.setup)
    traced = trace_image_step(cfg)  # the real step: its stores' arenas counted as host memory
    assert towers.host == traced.host_peak_bytes > 0
    assert planned.host_bytes == planned.placement.host_bytes + towers.host  # beside the language model's store
    assert planned.placement.tower_slots == (towers.slot, 0) and towers.slot == towers.host // 3  # a slot a block


def test_the_towers_store_takes_its_slot_from_the_heaviest_row(wrapper, tmp_path, one_thread) -> None:
    """A row of 4 images, then one of 8 (the data's heaviest): the store sized from the first step's block input puts
    the heavier row's in plain host buffers; sized by the plan, every input has its slot, the arena as planned."""
    import torch

    from longfit.memory.apply import checkpoint_tower, offloaders
    from longfit.memory.switches import resolve_memory_switches
    from longfit.models.media import build_media_encoder, media_reader, trainable_parts
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    cfg = offloaded_run(wrapper, image_chats(tmp_path, [IMAGES // 2, IMAGES]), "fp32", 768)  # a row each
    planned = plan_config(cfg, 1)
    assert planned.setup.images.count == IMAGES
    from PIL import Image

    processed = media_reader(str(wrapper)).image_processor(  # the checkpoint's own patches and grids
        images=[Image.open(tmp_path / f"p{i}.png") for i in range(IMAGES)], return_tensors="pt")
    switches = resolve_memory_switches(cfg, "cpu", 1)

    def unplanned(slot: int) -> tuple[int, int]:
        encoder = build_media_encoder(str(wrapper))
        trainable_parts(encoder, "all")
        checkpoint_tower(encoder, switches, slots=(slot,))
        (store,) = [offloader.store for offloader in offloaders(encoder)]
        patches = int(processed["image_grid_thw"][0].prod())  # an image's rows of pixel_values
        for count in (IMAGES // 2, IMAGES):  # the first step's row, then the heaviest
            out = encoder.features(processed["pixel_values"][: count * patches], processed["image_grid_thw"][:count])
            out.sum().backward()
        used = store.stats.unplanned_bytes, store.allocated_host_bytes
        store.close()
        return used

    assert unplanned(0)[0] > 0  # the first step's slot: the heavier row's inputs in plain host buffers
    assert unplanned(planned.placement.tower_slots[0]) == (0, tower_costs(planned.setup).host)


AUDIO_SECONDS, AUDIO_WIDTH = 14, 512
"""Gemma 4's audio tower 512 wide (3 blocks) on audios of 14 s (350 tokens): three of them make a block input above
the offloader's floor in fp32 and in bf16 alike (1.0 MiB in bf16), four of them a third more."""


@pytest.fixture(scope="module")
def wide_audio(tmp_path_factory) -> Path:
    from test_media_gemma4_av import write_tiny_gemma4_audio

    return write_tiny_gemma4_audio(tmp_path_factory.mktemp("gemma4-wide-audio"), audio_depth=3,
                                   hidden_size=AUDIO_WIDTH)


def audio_chats(folder: Path, counts: list[int]) -> Path:
    """Chats of `counts` noise audios of AUDIO_SECONDS each at 16 kHz, one chat a row."""
    import wave

    rng = np.random.default_rng(0)
    for index in range(max(counts)):
        with wave.open(str(folder / f"a{index}.wav"), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(16_000)
            f.writeframes(rng.integers(-8000, 8000, AUDIO_SECONDS * 16_000, dtype="<i2").tobytes())
    rows = [{"messages": [{"role": "user", "content": [*({"type": "audio", "path": f"a{i}.wav"} for i in range(n)),
                                                       {"type": "text", "text": "Which?"}]},
                          {"role": "assistant", "content": "One."}]} for n in counts]
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder / "rows.jsonl"


# the bf16 case is slow: the plan's trace of the tower under CPU bf16 autocast (~130 CPU s at 12 s audios)
# slow: fp32 ~43 s wall at load 5 (CI runs it), bf16 ~500 s (the plan traces the tower under CPU bf16 autocast)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_audio_towers_store_takes_its_slot_from_the_heaviest_row(wide_audio, tmp_path, one_thread, dtype) -> None:
    """Gemma 4's audio tower has a store of its own (`MediaEncoder.towers`), sized by the plan as the vision tower's:
    a row of 3 audios, then one of 4; the store sized from the first step's block input puts the heavier row's in
    plain host buffers; sized by the plan, every input has its slot, the arena as planned (under train.dtype=bf16,
    the run's autocast on one process)."""
    import torch

    from longfit.data.packing import build_dataloader
    from longfit.memory.apply import checkpoint_tower, offloaders
    from longfit.memory.switches import resolve_memory_switches
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import build_media_encoder, media_reader, trainable_parts
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import tower_costs

    cfg = offloaded_run(wide_audio, audio_chats(tmp_path, [3, 4]), dtype, 1536)  # a row each
    planned = plan_config(cfg, 1)
    towers = tower_costs(planned.setup)
    assert planned.placement.tower_slots == (0, towers.audio_slot) and towers.audio_slot > 0
    rows = [batch.media for batch in build_dataloader(cfg, load_tokenizer(cfg.model), epochs=1,
                                                       media=media_reader(cfg.model))]
    assert [len(media.grid_thw) for media in rows] == [3, 4]  # the first step's row, then the heaviest
    switches = resolve_memory_switches(cfg, "cpu", 1)

    def unplanned(slots: tuple[int, ...]) -> tuple[int, int]:
        encoder = build_media_encoder(str(wide_audio))
        trainable_parts(encoder, "all")
        checkpoint_tower(encoder, switches, slots=slots)
        (store,) = [offloader.store for offloader in offloaders(encoder.vision["audio_tower"])]
        for media in rows:
            with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
                out = encoder.features(media.pixel_values, media.grid_thw)
            out.float().sum().backward()
        used = store.stats.unplanned_bytes, store.allocated_host_bytes
        for offloader in offloaders(encoder):
            offloader.store.close()
        return used

    assert unplanned(())[0] > 0  # the first step's slot: the heavier row's inputs in plain host buffers
    assert unplanned(planned.placement.tower_slots) == (0, towers.host)
