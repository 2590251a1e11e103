"""Resumable checkpoints: atomic, verified on resume, rotated only once the new one is complete.

Layout: OUTPUT_DIR/checkpoints/step_00000010/ holds the model and optimizer as a DCP checkpoint
(sharded under FSDP2, one file per rank; resumable with the same number of ranks), one
`trainer_rank{r}.pt` per rank (step, data position, RNG states), `config.yaml` (the resolved config
that trained up to this step) and, written last, `manifest.json`: the step, the number of ranks and
the size and sha256 of every other file.

Writing: every rank writes into `.tmp-step_...`; the ranks agree on success after each phase, so a
failure on one rank (a full disk, an I/O error) makes every rank remove the staging directory and
raise the same `CheckpointError`. Then each rank reads back a share of the files for the manifest's
checksums, rank 0 writes the manifest and renames the directory, and only then are checkpoints
beyond `train.keep_checkpoints` deleted: a crash at any point leaves the last complete checkpoint.

Reading: the checkpoints are tried newest first. One whose manifest is missing or whose files differ
from it is damaged: it is moved aside (`step_....damaged`) with a warning and the next older one is
tried; none valid is an error. A checkpoint written by a different number of ranks is not damaged:
that is an error naming the number to resume with.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from longfit.config import ConfigError

STEP_DIR = re.compile(r"^step_(\d{8})$")
STAGING_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
DAMAGED_SUFFIX = ".damaged"
DISK_FULL_FREE_BYTES = 1 << 20  # a failed write with less than this left free is blamed on the full disk


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or resumed from; the message names the directory and the fix."""


class AgreedError(ConfigError):
    """The error rank 0 reported and printed, raised again on every other rank so that all of them stop."""

    reported_by_rank_zero = True  # `longfit` prints it once, from rank 0


# ---- collectives on the default group (a no-op on one process) ---------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _gather(value: Any) -> list[Any]:
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_every_rank(error: ConfigError) -> ConfigError:
    """`error`, met by every rank at once: rank 0 raises it, the others raise its quiet copy."""
    return error if _rank_and_world()[0] == 0 else AgreedError(str(error))


def rank_zero_decides(decide: Callable[[], Any]) -> Any:
    """Run `decide` on rank 0 only and return its result on every rank; a ConfigError it raises is
    raised on every rank (rank 0's own, an `AgreedError` elsewhere), so no rank is left waiting."""
    result, refusal = None, None
    if _rank_and_world()[0] == 0:
        try:
            result = decide()
        except ConfigError as e:
            refusal = e
    result, message = _broadcast((result, None if refusal is None else str(refusal)))
    if refusal is not None:
        raise refusal
    if message is not None:
        raise AgreedError(message)
    return result


# ---- where checkpoints are ----------------------------------------------------------------------------
def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_dirs(output_dir: Path) -> list[Path]:
    """Checkpoint directories, newest first (complete or damaged: `verify_checkpoint` tells)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), reverse=True)


def damaged_dirs(output_dir: Path) -> list[Path]:
    root = checkpoint_root(output_dir)
    return sorted(p for p in root.iterdir() if DAMAGED_SUFFIX in p.name) if root.is_dir() else []


def remove_staging(output_dir: Path) -> list[Path]:
    """Delete the staging directories a crashed save or export left behind (call under the run lock)."""
    leftovers = [p for p in (checkpoint_root(output_dir), output_dir) if p.is_dir()]
    removed = [p for root in leftovers for p in root.iterdir() if p.is_dir() and p.name.startswith(STAGING_PREFIX)]
    for path in removed:
        shutil.rmtree(path)
    return removed


def move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the way (kept for inspection); returns its new path."""
    target = path.with_name(path.name + DAMAGED_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}{n}")
    path.rename(target)
    return target


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---- checksums ------------------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def _describe_files(directory: Path, names: list[str]) -> dict[str, dict]:
    """{name: {bytes, sha256}} of `names`, each rank reading its share (collective)."""
    rank, world = _rank_and_world()
    mine: dict[str, dict] = {}
    for name in names[rank::world]:
        path = directory / name
        try:
            mine[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        except FileNotFoundError:
            mine[name] = None
    described: dict[str, dict] = {}
    for part in _gather(mine):
        described.update(part)
    return described


# ---- writing --------------------------------------------------------------------------------------------
def _state_options(model: torch.nn.Module) -> StateDictOptions:
    # With LoRA the frozen base weights come from the model source again on resume; only the
    # trainable parameters (and their optimizer state) change. Loading them back is then not strict
    # (the frozen keys are absent by design); dcp.load already fails on any trainable key it lacks.
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _causes(error: BaseException) -> list[BaseException]:
    """`error`, the exceptions it wraps (DCP's per-rank failures) and their causes."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return seen


def _failure(phase: str, error: BaseException | None, directory: Path) -> dict | None:
    """A picklable description of a failed write phase on this rank."""
    if error is None:
        return None
    full = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _causes(error))
    try:
        full = full or shutil.disk_usage(directory).free < DISK_FULL_FREE_BYTES
    except OSError:
        pass
    cause = next((e for e in _causes(error) if isinstance(e, OSError)), error)
    return {"phase": phase, "disk_full": full, "error": f"{type(cause).__name__}: {cause}".splitlines()[0]}


def agree_on_failure(phase: str, error: BaseException | None, directory: Path) -> dict | None:
    """The first failure of `phase` over all ranks (with its rank), or None when every rank succeeded."""
    for rank, failed in enumerate(_gather(_failure(phase, error, directory))):
        if failed is not None:
            return {**failed, "rank": rank}
    return None


def _save_failed(failure: dict, staging: Path, final: Path, output_dir: Path) -> CheckpointError:
    rank, world = _rank_and_world()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    if _distributed():
        dist.barrier()
    complete = [p for p in step_dirs(output_dir) if (p / MANIFEST).is_file() and p != final]
    last = f"the last complete checkpoint is {complete[0]}" if complete else "no checkpoint of this run is complete yet"
    where = f" on rank {failure['rank']}" if world > 1 else ""
    if failure["disk_full"]:
        size = f"; a checkpoint takes about {checkpoint_bytes(complete[0]) / 2**20:.0f} MiB" if complete else ""
        return on_every_rank(CheckpointError(
            f"no space left on the disk of {output_dir} while writing checkpoint {final.name}{where} "
            f"({failure['error']}). The partial checkpoint was removed and {last}{size}. Free disk space "
            f"(or lower train.keep_checkpoints, or move output_dir), then run the same command to resume."
        ))
    return on_every_rank(CheckpointError(
        f"writing checkpoint {final.name} to {output_dir} failed{where} while {failure['phase']}: {failure['error']}. "
        f"The partial checkpoint was removed and {last}; fix the cause, then run the same command to resume."
    ))


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    config_yaml: str,
    keep: int,
) -> Path:
    """Write checkpoint `step` (collective); raise CheckpointError on every rank if any rank fails."""
    rank, world = _rank_and_world()
    root = checkpoint_root(output_dir)
    final = root / f"step_{step:08d}"
    staging = root / f"{STAGING_PREFIX}{final.name}"

    error = None
    if rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            _write_synced(staging / "config.yaml", config_yaml.encode())
        except OSError as e:
            error = e
    failure = agree_on_failure("creating the staging directory", error, root)
    if failure is None:
        error = None
        try:
            model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(model))
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: expected
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging))
            buffer = io.BytesIO()
            torch.save(trainer_state, buffer)
            _write_synced(staging / f"trainer_rank{rank}.pt", buffer.getvalue())
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = e
        failure = agree_on_failure("writing the model and optimizer state", error, staging)
    if failure is None:
        names = _broadcast(sorted(p.name for p in staging.iterdir()) if rank == 0 else None)
        files = _describe_files(staging, names)
        error = None
        if rank == 0:
            try:
                manifest = {
                    "format": MANIFEST_FORMAT, "step": step, "world_size": world,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
                }
                _write_synced(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
                if final.exists():  # a checkpoint of this step from a run that was resumed from an earlier one
                    shutil.rmtree(final)
                staging.rename(final)
                _sync_dir(root)
            except OSError as e:
                error = e
        failure = agree_on_failure("writing the manifest", error, root)
    if failure is not None:
        raise _save_failed(failure, staging, final, output_dir) from error
    if rank == 0:
        complete = [p for p in step_dirs(output_dir) if (p / MANIFEST).is_file()]
        for old in complete[keep:]:
            shutil.rmtree(old)
    if _distributed():
        dist.barrier()
    return final


# ---- reading --------------------------------------------------------------------------------------------
def _read_manifest(path: Path) -> dict | str:
    """The manifest of checkpoint `path`, or why it cannot be used."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the checkpoint was not completed, or was copied partially)"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
        return f"{MANIFEST} is not a longfit manifest (format {MANIFEST_FORMAT})"
    if manifest.get("step") != int(STEP_DIR.match(path.name).group(1)):
        return f"{MANIFEST} describes step {manifest.get('step')}, not {path.name}"
    for name, entry in manifest["files"].items():
        if entry is None:
            return f"{MANIFEST} lists {name} without a checksum"
        actual = path / name
        if not actual.is_file():
            return f"{name} is missing"
        if actual.stat().st_size != entry["bytes"]:
            return f"{name} has {actual.stat().st_size} bytes, the manifest says {entry['bytes']}"
    return manifest


def verify_checkpoint(path: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) if every file of checkpoint `path` matches its manifest, else (None, why). Collective.

    A checkpoint of another number of ranks is a CheckpointError: it is intact, the launch differs.
    """
    rank, world = _rank_and_world()
    manifest = _broadcast(_read_manifest(path) if rank == 0 else None)
    if isinstance(manifest, str):
        return None, manifest
    if manifest["world_size"] != world:
        raise on_every_rank(CheckpointError(
            f"{path} was written by {manifest['world_size']} ranks and this run has {world}: resume with "
            f"--nproc {manifest['world_size']} (the same torchrun layout), or choose a new output_dir"
        ))
    actual = _describe_files(path, sorted(manifest["files"]))
    for name, entry in sorted(manifest["files"].items()):
        if actual.get(name) is None:
            return None, f"{name} is missing"
        if actual[name]["sha256"] != entry["sha256"]:
            return None, f"{name} does not match its checksum (the file was changed or damaged)"
    return manifest, None


def find_resumable(output_dir: Path, exclude: frozenset[Path] = frozenset()) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint not in `exclude` that verifies, and the newer ones that did not, with why. Collective."""
    damaged = []
    for path in rank_zero_decides(lambda: step_dirs(output_dir)):
        if path in exclude:
            continue
        manifest, why = verify_checkpoint(path)
        if manifest is not None:
            return path, damaged
        damaged.append((path, why))
    return None, damaged


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict:
    """Restore model and optimizer in place from a verified checkpoint; return this rank's trainer state."""
    options = _state_options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:
        detail = next((str(c) for c in _causes(e) if c is not e), str(e)).splitlines()[0]
        raise on_every_rank(CheckpointError(
            f"{path} does not fit the model as configured ({detail}); resume with the model and LoRA settings "
            f"that wrote it, or start a new output_dir"
        )) from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    return torch.load(path / f"trainer_rank{rank}.pt", weights_only=False)


def parameters_finite(model: torch.nn.Module) -> bool:
    """Whether every trainable parameter is finite on every rank (collective)."""
    local = True
    for param in model.parameters():
        if param.requires_grad:
            data = param.to_local() if hasattr(param, "to_local") else param
            if not torch.isfinite(data).all():
                local = False
                break
    return all(_gather(local))


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
