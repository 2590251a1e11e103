"""`longfit export` of an image-text run's checkpoint (#54): the vision side the run trained (its tower and projector
whole, or their LoRA adapters, merged with `--merge`) is read from the checkpoint as the language model's, and the
export is the trainer's own, byte for byte. The tiny Qwen3.5 wrapper and the image rows of tests/test_media.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from test_media import ONE, TEXT_ONLY, TWO, qwen_images, write_rows  # noqa: E402,F401 -- the session fixture

from longfit.cli import main  # noqa: E402

LORA = ["lora.enabled=true", "lora.r=4", "lora.alpha=8"]


def image_run(checkpoint: Path, folder: Path, *overrides: str) -> list[str]:
    """`longfit train`'s arguments for two steps on image rows, the vision side trained (`train.vision=all`), its
    checkpoint saved at the last step."""
    rows = write_rows(folder / "data", [[ONE, TWO, TEXT_ONLY][i % 3] for i in range(6)])
    return [f"model={checkpoint}", f"data.path={rows}", f"output_dir={folder / 'run'}", "seq_len=128",
            "train.device=cpu", "train.steps=2", "train.lr=1e-2", "train.warmup_steps=0", "train.vision=all",
            "eval.retrieval=false", *overrides]


def same_files(ours: Path, trainers: Path, suffix: str) -> list[str]:
    """The names of the `suffix` files of both exports, asserting each byte for byte the same."""
    names = sorted(p.name for p in trainers.glob(f"*{suffix}"))
    assert names and names == sorted(p.name for p in ours.glob(f"*{suffix}"))
    for name in names:
        assert (ours / name).read_bytes() == (trainers / name).read_bytes(), name
    return names


@pytest.mark.slow  # three `longfit train` runs (two steps, then two exports) and two exports: 42 s fp32 (load 13)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_of_a_checkpoint_writes_the_trained_vision_adapters_as_the_run_did(qwen_images, tmp_path,
                                                                                 dtype: str) -> None:
    args = image_run(qwen_images, tmp_path, *LORA, f"train.dtype={dtype}")
    run = tmp_path / "run"
    assert main(["train", *args]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "adapter")]) == 0
    same_files(tmp_path / "adapter", run / "final", ".safetensors")
    tower = [k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors") if ".visual.blocks." in k]
    assert tower
    # The run asked again with lora.merge_on_export=true merges its last checkpoint through the trainer's own export.
    assert main(["train", *args, "lora.merge_on_export=true"]) == 0
    assert main(["export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0
    same_files(tmp_path / "merged", run / "final", ".safetensors")


@pytest.mark.slow  # a `longfit train` run with its preflight check, and an export: 66 s bf16 (load 13, 2 cores)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_of_a_checkpoint_writes_the_trained_tower_as_the_run_did(qwen_images, tmp_path, dtype: str) -> None:
    run = tmp_path / "run"
    assert main(["train", *image_run(qwen_images, tmp_path, f"train.dtype={dtype}")]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "model")]) == 0
    same_files(tmp_path / "model", run / "final", ".safetensors")
