"""Resumable checkpoints, written atomically.

Layout: OUTPUT_DIR/checkpoints/step_00000010/ holds the model and optimizer as a DCP checkpoint
(sharded under FSDP2, one file per rank; resumable with the same mesh) and one
`trainer_rank{r}.pt` per rank (step, scheduler, data position, RNG states). Everything is written
into a `.tmp-step_...` directory that rank 0 renames once every rank has finished: a crash mid-write
leaves the last complete checkpoint untouched, and half-written directories are never read.
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

STEP_DIR = re.compile(r"^step_(\d{8})$")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_name(name: str) -> str:
    if dist.is_available() and dist.is_initialized():
        box = [name]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return name


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint directory, if any."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    steps = sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))
    return steps[-1] if steps else None


def _state_options(model: torch.nn.Module) -> StateDictOptions:
    # With LoRA the frozen base weights come from the model source again on resume; only the
    # trainable parameters (and their optimizer state) change. Loading them back is then not strict
    # (the frozen keys are absent by design); dcp.load already fails on any trainable key it lacks.
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    rank: int,
    keep: int,
) -> Path:
    root = checkpoint_root(output_dir)
    final = root / f"step_{step:08d}"
    staging = root / _broadcast_name(f".tmp-{final.name}")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(model))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: expected
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging))
    torch.save(trainer_state, staging / f"trainer_rank{rank}.pt")
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        complete = sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))
        for old in complete[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict:
    """Restore model and optimizer in place; return this rank's trainer state."""
    trainer_file = path / f"trainer_rank{rank}.pt"
    if not trainer_file.is_file():
        raise FileNotFoundError(
            f"{trainer_file} is missing: {path} was written by a run with a different number of ranks; "
            f"resume with the same torchrun --nproc-per-node or choose a new output_dir"
        )
    options = _state_options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    return torch.load(trainer_file, weights_only=False)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
