"""The vision tower's offload store in `longfit plan` (#54): with a trained tower checkpointed and its blocks' inputs
offloaded (memory.activation_checkpointing, memory.offload_activations), the store holds a slot of a block's input for
every block in host memory. The plan's host figure counts it beside the language model's store, and sizes its slot
from the heaviest row the data packs (`CheckpointPlacement.tower_slot_bytes`), so that a later, heavier row than the
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
    assert planned.placement.tower_slot_bytes == towers.slot == towers.host // 3  # a slot a block


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
        checkpoint_tower(encoder, switches, slot_bytes=slot)
        (store,) = [offloader.store for offloader in offloaders(encoder)]
        patches = int(processed["image_grid_thw"][0].prod())  # an image's rows of pixel_values
        for count in (IMAGES // 2, IMAGES):  # the first step's row, then the heaviest
            out = encoder.features(processed["pixel_values"][: count * patches], processed["image_grid_thw"][:count])
            out.sum().backward()
        used = store.stats.unplanned_bytes, store.allocated_host_bytes
        store.close()
        return used

    assert unplanned(0)[0] > 0  # the first step's slot: the heavier row's inputs in plain host buffers
    assert unplanned(planned.placement.tower_slot_bytes) == (0, tower_costs(planned.setup).host)
