"""Resumable checkpoints: atomic, verified on resume, rotated only once the new one is complete.

Layout: OUTPUT_DIR/checkpoints/step_00000010/ holds the model and optimizer as a DCP checkpoint
(sharded under FSDP2, one file per rank; DCP reshards it onto any number of ranks and any layout), one
`trainer_rank{r}.pt` per rank (step, data position, RNG states), `config.yaml` (the resolved config
that trained up to this step) and, written last, `manifest.json`: the step, the number of ranks and
the size and sha256 of every other file.

Writing: every rank writes into `.tmp-step_...`; the ranks agree on success after each phase, so a
failure on one rank (a full disk, an I/O error) makes every rank remove the staging directory and
raise the same `CheckpointError`. Then each rank reads back a share of the files for the manifest's
checksums, rank 0 writes the manifest and renames the directory, and only then are checkpoints
beyond `train.keep_checkpoints` deleted: a crash at any point leaves the last complete checkpoint.

Asynchronous writing (`CheckpointWriter`, what the trainer uses): the same phases, but training goes on
while the disk works. In the training thread: the staging directory, the model and optimizer state
copied to host memory (DCP's `BlockingAsyncStager`; the weights may change as soon as it returns), the
trainer state file, and agreement on all of it. Then DCP's `async_save` writes the shards from a thread
of its own, and a thread of ours waits for it and runs the rest (checksums, manifest, rename, rotation)
with every collective on a gloo group of its own, so it never interleaves with the training's
collectives. A failure there is raised, as the same `CheckpointError`, by `wait`: before the next save
starts, before the export, and when the run ends (the trainer also waits when it stops on a signal or
an error; a second signal exits at once and the staging directory is removed at the next start).

Reading: the checkpoints are tried newest first. One whose manifest is missing or whose files differ
from it is damaged: it is moved aside (`step_....damaged`) with a warning and the next older one is
tried; none valid is an error. A checkpoint written by another number of ranks resumes like any other
(what may change with the ranks is `train.resume`'s rule): the data position is the same in every rank's
trainer state, and a rank the checkpoint did not have takes rank 0's RNG states.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from longfit.config import ConfigError

STEP_DIR = re.compile(r"^step_(\d{8})$")
STAGING_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
OPTIMIZER_PER_PARAMETER = "optimizer_per_parameter"  # the manifest's mark of the optimizer state's layout (_state_options)
DAMAGED_SUFFIX = ".damaged"
DISK_FULL_FREE_BYTES = 1 << 20  # a failed write with less than this left free is blamed on the full disk


# A single process saves without torch.distributed by design; DCP warns about it from its own writer thread
# under async_save, where a `catch_warnings` around the call cannot reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or resumed from; the message names the directory and the fix."""


class AgreedError(ConfigError):
    """The error rank 0 reported and printed, raised again on every other rank so that all of them stop."""

    reported_by_rank_zero = True  # `longfit` prints it once, from rank 0
    met_by_every_rank = True


def _on_every_rank(error: ConfigError) -> ConfigError:
    """Mark rank 0's error as raised by every rank at the same point: they may leave the process group together."""
    error.met_by_every_rank = True
    return error


# ---- collectives on the default group (a no-op on one process) ---------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


# `group`: a group over all ranks (None: the default one), whose rank 0 is global rank 0.
def _gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def _broadcast(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `value` on every rank."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if _distributed():
        dist.barrier(group=group)


def on_every_rank(error: ConfigError) -> ConfigError:
    """`error`, met by every rank at once: rank 0 raises it, the others raise its quiet copy."""
    return _on_every_rank(error) if _rank_and_world()[0] == 0 else AgreedError(str(error))


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
        raise _on_every_rank(refusal)
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


def _describe_files(directory: Path, names: list[str], group: dist.ProcessGroup | None = None) -> dict[str, dict]:
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
    for part in _gather(mine, group):
        described.update(part)
    return described


# ---- writing --------------------------------------------------------------------------------------------
def _state_options(model: torch.nn.Module, per_parameter_optimizer: bool = True) -> StateDictOptions:
    # With LoRA the frozen base weights come from the model source again on resume; only the
    # trainable parameters (and their optimizer state) change. Loading them back is then not strict
    # (the frozen keys are absent by design); dcp.load already fails on any trainable key it lacks.
    # The optimizer's hyperparameters are stored per parameter name (flatten_optimizer_state_dict, as torchtitan):
    # one param_groups list per rank would be one DCP key with different values on the stages of a pipeline, of
    # which DCP keeps rank 0's. Checkpoints written before have the list (`OPTIMIZER_PER_PARAMETER`).
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen,
                            flatten_optimizer_state_dict=per_parameter_optimizer)


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


def agree_on_failure(
    phase: str, error: BaseException | None, directory: Path, group: dist.ProcessGroup | None = None
) -> dict | None:
    """The first failure of `phase` over all ranks (with its rank), or None when every rank succeeded."""
    for rank, failed in enumerate(_gather(_failure(phase, error, directory), group)):
        if failed is not None:
            return {**failed, "rank": rank}
    return None


def _save_failed(
    failure: dict, staging: Path, final: Path, output_dir: Path, group: dist.ProcessGroup | None = None
) -> CheckpointError:
    rank, world = _rank_and_world()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier(group)
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


@dataclass
class _Save:
    """One checkpoint being written."""

    output_dir: Path
    step: int
    keep: int

    @property
    def final(self) -> Path:
        return checkpoint_root(self.output_dir) / f"step_{self.step:08d}"

    @property
    def staging(self) -> Path:
        return checkpoint_root(self.output_dir) / f"{STAGING_PREFIX}{self.final.name}"


def _begin(save: _Save, config_yaml: str) -> None:
    """The staging directory with the config in it (collective; raises CheckpointError on every rank)."""
    error = None
    if _rank_and_world()[0] == 0:
        try:
            shutil.rmtree(save.staging, ignore_errors=True)
            save.staging.mkdir(parents=True)
            _write_synced(save.staging / "config.yaml", config_yaml.encode())
        except OSError as e:
            error = e
    failure = agree_on_failure("creating the staging directory", error, checkpoint_root(save.output_dir))
    if failure is not None:
        raise _save_failed(failure, save.staging, save.final, save.output_dir) from error


def _write_trainer_state(save: _Save, trainer_state: dict) -> None:
    buffer = io.BytesIO()
    torch.save(trainer_state, buffer)
    _write_synced(save.staging / f"trainer_rank{_rank_and_world()[0]}.pt", buffer.getvalue())


def _finish(save: _Save, error: BaseException | None, group: dist.ProcessGroup | None = None) -> Path:
    """After the state was written (or failed with `error` on this rank): agree, manifest, rename, rotate."""
    rank, world = _rank_and_world()
    root, staging, final = checkpoint_root(save.output_dir), save.staging, save.final
    failure = agree_on_failure("writing the model and optimizer state", error, staging, group)
    if failure is None:
        names = _broadcast(sorted(p.name for p in staging.iterdir()) if rank == 0 else None, group)
        files = _describe_files(staging, names, group)
        error = None
        if rank == 0:
            try:
                manifest = {
                    "format": MANIFEST_FORMAT, "step": save.step, "world_size": world, OPTIMIZER_PER_PARAMETER: True,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
                }
                _write_synced(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
                if final.exists():  # a checkpoint of this step from a run that was resumed from an earlier one
                    shutil.rmtree(final)
                staging.rename(final)
                _sync_dir(root)
            except OSError as e:
                error = e
        failure = agree_on_failure("writing the manifest", error, root, group)
    if failure is not None:
        raise _save_failed(failure, staging, final, save.output_dir, group) from error
    if rank == 0:
        complete = [p for p in step_dirs(save.output_dir) if (p / MANIFEST).is_file()]
        for old in complete[save.keep:]:
            shutil.rmtree(old)
    _barrier(group)
    return final


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    config_yaml: str,
    keep: int,
) -> Path:
    """Write checkpoint `step` (collective) and return it; raise CheckpointError on every rank if any rank fails."""
    save = _Save(output_dir, step, keep)
    _begin(save, config_yaml)
    error = None
    try:
        model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(model))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process: expected
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(save.staging))
        _write_trainer_state(save, trainer_state)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = e
    return _finish(save, error)


class _HostStateWriter(dcp.FileSystemWriter):
    """DCP's file writer for a state dict that is already a copy in host memory: its `stage` would copy it again."""

    def stage(self, state_dict):
        self.per_thread_copy_ahead = 0  # what FileSystemWriter.stage sets: the tensors are on the host
        return state_dict


class CheckpointWriter:
    """Writes a run's checkpoints while it trains on (module docstring): `start` returns once the state is
    copied to host memory, `wait` returns the completed checkpoint or raises its CheckpointError."""

    def __init__(self):
        self._pending: Path | None = None  # the checkpoint being written
        self._thread: threading.Thread | None = None
        self._outcome: BaseException | None = None
        self._group: dist.ProcessGroup | None = None

    def start(
        self,
        output_dir: Path,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict,
        config_yaml: str,
        keep: int,
    ) -> None:
        """Begin checkpoint `step` (collective), after the previous one completed; failures before the
        background write raise CheckpointError on every rank here."""
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        self.wait()
        save = _Save(output_dir, step, keep)
        _begin(save, config_yaml)
        error = None
        try:
            model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(model))
            staged = BlockingAsyncStager().stage({"model": model_state, "optim": optim_state})
            _write_trainer_state(save, trainer_state)
        except (Exception, CheckpointException) as e:
            error = e
        failure = agree_on_failure("copying the model and optimizer state", error, save.staging)
        if failure is not None:
            raise _save_failed(failure, save.staging, save.final, output_dir) from error
        group = self._checkpoint_group()
        future = dcp.async_save(staged, storage_writer=_HostStateWriter(str(save.staging)), process_group=group)
        self._pending, self._outcome = save.final, None
        self._thread = threading.Thread(target=self._complete, args=(save, future, group), daemon=True,
                                        name=f"longfit-checkpoint-{step}")
        self._thread.start()

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """A gloo group over all ranks for the background collectives (created once, collectively)."""
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _complete(self, save: _Save, future, group: dist.ProcessGroup | None) -> None:
        error = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            error = e
        try:
            _finish(save, error, group)
        except BaseException as e:  # handed to the training thread by `wait`
            self._outcome = e

    def wait(self) -> Path | None:
        """Wait for the checkpoint being written; return it (None if there was none) or raise why it failed."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        done, self._pending = self._pending, None
        if self._outcome is not None:
            raise self._outcome
        return done


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
    """(manifest, None) if every file of checkpoint `path` matches its manifest, else (None, why). Collective."""
    manifest = _broadcast(_read_manifest(path) if _rank_and_world()[0] == 0 else None)
    if isinstance(manifest, str):
        return None, manifest
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


def _read_into(state: dict, path: Path) -> str | None:
    """DCP-load `state` in place from checkpoint `path`; None, or the first line of why it does not fit."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:
        return next((str(c) for c in _causes(e) if c is not e), str(e)).splitlines()[0]
    return None


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict:
    """Restore model and optimizer in place from a verified checkpoint; return this rank's trainer state."""
    options = _state_options(model, json.loads((path / MANIFEST).read_text()).get(OPTIMIZER_PER_PARAMETER, False))
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    mismatch = _read_into(state, path)
    if mismatch:
        raise on_every_rank(CheckpointError(
            f"{path} does not fit the model as configured ({mismatch}); resume with the model and LoRA settings "
            f"that wrote it, or start a new output_dir"
        ))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    own = path / f"trainer_rank{rank}.pt"
    return torch.load(own if own.is_file() else path / "trainer_rank0.pt", weights_only=False)


def written_by_ranks(path: Path) -> int:
    """The number of ranks that wrote verified checkpoint `path`."""
    return json.loads((path / MANIFEST).read_text())["world_size"]


def load_model_state(path: Path, model: torch.nn.Module) -> None:
    """Restore the model alone, in place, from verified checkpoint `path`, whatever number of ranks wrote it: DCP
    reads each tensor's saved shards into `model`'s own layout (one process: whole tensors)."""
    options = _state_options(model)
    state = {"model": get_model_state_dict(model, options=options)}
    mismatch = _read_into(state, path)
    if mismatch:
        raise CheckpointError(f"{path} does not fit the model its config.yaml describes ({mismatch})")
    set_model_state_dict(model, state["model"], options=options)


def holds_trained_vision(path: Path) -> bool:
    """Whether checkpoint `path` holds a trained vision side (#54): the trainer's loss module saves it under
    `media_encoder.` where the run's rows held images and `train.vision` trained a part of it."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(key.startswith("model.media_encoder.") for key in keys)


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
    """This process's generators: the CPU's and its own GPU's. Not every visible GPU's (`get_rng_state_all`): with
    one GPU per rank the others are other ranks' and unused here, and a resume that sees another number of GPUs
    would index past them, while this rank's own generator went unrestored (issue #33)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
