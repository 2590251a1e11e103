"""A full fine-tune's reference log-probabilities (train.objective dpo or ipo without LoRA, #56): what the initial
weights give every answer, computed in a pass before the first step, kept in the run directory, read by every step.

The pass runs the training pairs (then the held-out pairs, when the run has them) in data order, packed into the same
shared-prompt rows training reads (longfit.data.preferences.PairLoader: one epoch, no shuffle), each dp rank its
rows and each cp rank its shard, under the run's autocast: `PreferenceLoss.reference_sums` without gradient, completed
over the cp ranks exactly as the policy's sums are. Each pair is computed by one dp rank, its row of the others' tables
left zero, and the tables are summed over the dp ranks. The model is the one the steps train (no second copy): its
activations are not kept, so the pass peaks below a training step.

The file, OUTPUT_DIR/reference_logps.safetensors: `train` (pairs, 2) and `eval` (held-out pairs, 2), float32 (chosen,
rejected per pair), and in its metadata what they were computed for, the data (`pairs_digest` of each set) and the
model (`model_identity`), and the sha256 of the tables' bytes. Rank 0 writes it to a temporary name, syncs it and
renames it over: a crash leaves the old file or none, never part of one. Then:
- a fresh run (step 0) reuses a file that verifies and was computed for its data and model (a run stopped before its
  first checkpoint starts again without the pass), and otherwise computes the tables and writes them (again);
- a resumed run holds weights that are no longer the initial ones: it reads the file, and refuses in one line when it
  is missing, damaged, or computed for other data or another model.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from longfit.config import Config, ConfigError

FILE = "reference_logps.safetensors"
VERSION = "1"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".gguf")  # what the initial weights come from


def needs_stored_reference(cfg: Config) -> bool:
    """A reference model's objective without the LoRA adapter that would give it: the stored log-probabilities."""
    from longfit.memory.preference import REFERENCE_FREE

    return cfg.train.objective not in ("causal_lm", *REFERENCE_FREE) and not cfg.lora.enabled


def model_identity(cfg: Config) -> str:
    """sha256 of what decides the initial weights and their forward: `model` with its directory's weight and config
    files (name, bytes, modification time; a preset's random weights: train.seed), train.dtype and the RoPE keys."""
    from longfit.models.source import local_model_dir

    parts: dict = {"model": cfg.model, "seed": cfg.train.seed, "dtype": cfg.train.dtype, "rope": asdict(cfg.rope)}
    directory = local_model_dir(cfg.model)
    if directory is not None:
        parts["files"] = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()
                                if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _tables_sha256(tables: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tables):
        digest.update(name.encode())
        digest.update(tables[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def write_reference(path: Path, tables: dict[str, torch.Tensor], identity: dict[str, str]) -> None:
    """`tables` (float32, on the host) with `identity` and their checksum, atomically (module docstring)."""
    from safetensors.torch import save

    from longfit.train.checkpoint import _sync_dir, _write_synced

    metadata = {"version": VERSION, **identity, "sha256": _tables_sha256(tables)}
    staging = path.with_name(path.name + ".tmp")
    _write_synced(staging, save(tables, metadata=metadata))
    os.replace(staging, path)
    _sync_dir(path.parent)


def read_reference(path: Path, identity: dict[str, str]) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(the tables, '') when `path` verifies and was computed for `identity`; else (None, why not)."""
    from safetensors import safe_open

    if not path.is_file():
        return None, f"there is no {path.name}"
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            tables = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own errors for a torn or foreign file
        return None, f"{path.name} cannot be read ({type(e).__name__}: {e})"
    if metadata.get("version") != VERSION or metadata.get("sha256") != _tables_sha256(tables):
        return None, f"{path.name} is damaged (its checksum does not match its tables)"
    for key, what in (("data", "other data"), ("model", "another model")):
        if metadata.get(key) != identity[key]:
            return None, f"{path.name} was computed for {what}"
    return tables, ""


def reference_pass(loss_module, pairs: list, cfg: Config, mesh, device: torch.device, autocast, pad_id: int,
                   show_progress: bool) -> torch.Tensor:
    """(len(pairs), 2) float32 on the host: every pair's summed answer log-probabilities from `loss_module`'s model as
    it is now, each over the cp ranks and summed over the dp ranks (module docstring). Every rank calls it."""
    from longfit.data.preferences import PairLoader
    from longfit.models.progress import progress
    from longfit.parallel.batch import cp_layout, shard_batch
    from longfit.parallel.comm import all_reduce_sum

    dims = mesh.dims
    loader = PairLoader(pairs, "the reference pass", cfg.seq_len, cfg.train.micro_batch, pad_id,
                        dp_rank=mesh.dp_rank, dp_size=dims.dp_size, epochs=1)
    table = torch.zeros(len(pairs), 2, dtype=torch.float32, device=device)
    bar = progress(len(pairs), "reference log-probabilities", "pairs", every=max(1, len(pairs) // 4),
                   enabled=show_progress)
    for batch in loader:
        local = shard_batch(batch, mesh.cp_rank, dims.cp, cp_layout(cfg.parallel.cp_method)).to(device)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            sums = loss_module.reference_sums(local)  # (P, 2), whole over the cp ranks
        table[local.pair_ids] = sums.float()
        bar.update(loader.pairs_read - bar.n)
    bar.close()
    return all_reduce_sum(table, mesh.dp_group).cpu()


def stored_reference(loss_module, pair_sets: dict[str, list], cfg: Config, mesh, device: torch.device, autocast,
                     pad_id: int, resumed: bool, say, show_progress: bool) -> dict[str, torch.Tensor]:
    """The reference tables of `pair_sets` ({"train": pairs, "eval": held-out pairs}) on `device`: read from
    OUTPUT_DIR/FILE, or computed by `reference_pass` on a fresh run and written there (module docstring)."""
    from longfit.data.preferences import pairs_digest
    from longfit.train.checkpoint import rank_zero_decides

    path = Path(cfg.output_dir) / FILE
    identity = {"data": json.dumps({name: pairs_digest(pairs) for name, pairs in sorted(pair_sets.items())}),
                "model": model_identity(cfg)}

    def decide() -> tuple[dict | None, str]:
        tables, why = read_reference(path, identity)
        if tables is None and resumed:
            raise ConfigError(f"train.objective={cfg.train.objective} resumes against the reference log-probabilities "
                              f"of the initial weights, but {why} in {path.parent}: restore that file, or train "
                              "from step 0 in a new output_dir (the pass computes it again)")
        return tables, why

    tables, why = rank_zero_decides(decide)
    if tables is not None:
        say(f"reference log-probabilities: read from {path} ({', '.join(f'{len(t):,} {n} pairs' for n, t in tables.items())})")
        return {name: table.to(device) for name, table in tables.items()}
    started = time.perf_counter()
    tables = {name: reference_pass(loss_module, pairs, cfg, mesh, device, autocast, pad_id, show_progress)
              for name, pairs in pair_sets.items()}
    rank_zero_decides(lambda: write_reference(path, tables, identity))
    count = sum(len(pairs) for pairs in pair_sets.values())
    say(f"reference log-probabilities: {count:,} pairs through the initial weights in "
        f"{time.perf_counter() - started:.1f} s ({why}), written to {path}")
    return {name: table.to(device) for name, table in tables.items()}
