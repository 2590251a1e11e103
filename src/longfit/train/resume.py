"""Resuming with a changed config: what may change, what must be allowed on purpose, and its record.

A resumed run continues the run in its checkpoint, so the new resolved config is compared key by key
with the config saved in that checkpoint:
- `SAFE_KEYS` say how long the run goes and what it writes, not what it trains: applied and printed.
- `STRUCTURAL_KEYS` decide which parameters train and the layout of the optimizer state: the
  checkpoint cannot be loaded into such a model, so a change is refused with the way to start over.
- `LAYOUT_KEYS` and the number of ranks say how a step is computed, not what it computes: DCP reshards
  the model and optimizer state onto any layout and the data position is one for all ranks, so they may
  change (applied and printed) as long as the global batch stays the same: the rows of `seq_len` tokens
  per optimizer step, micro_batch x grad_accum x the data-parallel degree. A resume on other ranks that
  changes it is refused, naming the grad_accum that keeps it, unless `--allow-changes global_batch`.
- Every other change (learning rate, data, sequence length, parallel layout, memory techniques, ...)
  is refused before anything is built, naming each key with its old and new value, unless it is listed
  in `longfit train --allow-changes KEY,...`. An allowed change takes effect from the resumed step and
  is recorded, with the safe ones, in the history comment at the end of OUTPUT_DIR/config.yaml (a
  comment, so the file stays a config that `longfit train` reads), and as an event row of metrics.jsonl.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import yaml

from longfit.config import Config, ConfigError, RopeSection, config_reference

SAFE_KEYS = frozenset({
    "output_dir", "train.steps", "train.log_every", "train.save_every", "train.keep_checkpoints",
    "train.export", "train.max_bad_steps", "lora.merge_on_export", "eval.retrieval", "eval.samples",
    "eval.retrieval_media", "eval.pages", "train.report_to", "train.epochs", "train.eval_every", "data.eval_path",
    "data.eval_rows",
})
STRUCTURAL_KEYS = frozenset({"lora.enabled", "lora.r", "lora.target_modules", "memory.optimizer"})
LAYOUT_KEYS = frozenset({
    "train.micro_batch", "train.grad_accum", "parallel.dp_shard", "parallel.cp", "parallel.cp_method", "parallel.tp",
    "parallel.reshard_after_forward", "parallel.cpu_offload", "parallel.pp", "parallel.pp_schedule",
    "parallel.pp_stages_per_rank", "parallel.pp_layers", "parallel.ep",
})
GLOBAL_BATCH = "global_batch"  # what `--allow-changes` names to change the rows per optimizer step on purpose
HISTORY_HEADER = "# Changes made when resuming (newest last):"


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {json.dumps(self.old)} -> {json.dumps(self.new)}"


def parse_allowed(text: str | None) -> frozenset[str]:
    """`--allow-changes train.lr,seq_len` -> the keys; an unknown key is an error naming the valid ones' help."""
    keys = frozenset(k.strip() for k in (text or "").split(",") if k.strip())
    known = {key for key, _, _ in config_reference()} | {GLOBAL_BATCH}
    unknown = sorted(keys - known)
    if unknown:
        raise ConfigError(f"--allow-changes {','.join(unknown)}: not a config key (see `longfit train --help`)")
    return keys


def flat_config(values: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted keys: {"train": {"lr": 1}} -> {"train.lr": 1}."""
    flat = {}
    for name, value in values.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def saved_values(saved_yaml: str) -> dict[str, Any]:
    """A checkpoint's config, flattened (`train.lr`: value); a key it lacks had its default."""
    values = flat_config(Config().to_dict())
    values.update(flat_config(yaml.safe_load(saved_yaml) or {}))
    return values


def config_changes(saved_yaml: str, cfg: Config) -> list[Change]:
    """Keys whose value in `cfg` differs from the saved config."""
    old = saved_values(saved_yaml)
    new = flat_config(cfg.to_dict())
    return [Change(key, old.get(key), value) for key, value in new.items() if old.get(key) != value]


@dataclass(frozen=True)
class BatchLayout:
    """Rows of seq_len tokens per optimizer step: micro_batch x grad_accum on each of dp data-parallel ranks."""

    micro_batch: int
    grad_accum: int
    dp: int

    @classmethod
    def of(cls, values: dict[str, Any], world_size: int) -> BatchLayout:
        """The layout of a flattened config (`flat_config`) on `world_size` ranks."""
        from longfit.parallel.dims import ParallelDims

        dims = ParallelDims(dp_shard=values["parallel.dp_shard"], cp=values["parallel.cp"], world_size=world_size,
                            tp=values["parallel.tp"], pp=values["parallel.pp"])
        return cls(values["train.micro_batch"], values["train.grad_accum"], dims.dp_size)

    @property
    def rows(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def __str__(self) -> str:
        return f"micro_batch {self.micro_batch} x grad_accum {self.grad_accum} x dp {self.dp}"


def check_global_batch(saved_yaml: str, saved_world: int, cfg: Config, world: int, allowed: frozenset[str], checkpoint: str) -> None:
    """Refuse a resume whose rows per optimizer step differ from the checkpoint's, unless allowed on purpose."""
    before, now = BatchLayout.of(saved_values(saved_yaml), saved_world), BatchLayout.of(flat_config(cfg.to_dict()), world)
    if before.rows == now.rows or GLOBAL_BATCH in allowed:
        return
    per_accum = now.micro_batch * now.dp
    keep = (f"keep it with train.grad_accum={before.rows // per_accum}, or " if before.rows % per_accum == 0 else "")
    raise ConfigError(
        f"output_dir={cfg.output_dir} holds a run to resume from {checkpoint}, trained on {saved_world} ranks with a global "
        f"batch of {before.rows} rows of {cfg.seq_len} tokens per step ({before}); on {world} rank{'s' if world > 1 else ''} "
        f"this config makes it "
        f"{now.rows} ({now}): {keep}change it from here on with --allow-changes {GLOBAL_BATCH}"
    )


def check_resume_changes(
    saved_yaml: str, cfg: Config, allowed: frozenset[str], checkpoint: str, saved_world: int, world: int
) -> list[Change]:
    """The changes to apply when resuming from `checkpoint`, written by `saved_world` ranks, on `world` ranks
    (the number of ranks is one of them when it differs); ConfigError naming every change that is refused."""
    changes = config_changes(saved_yaml, cfg)
    structural = [c for c in changes if c.key in STRUCTURAL_KEYS]
    if structural:
        raise ConfigError(
            f"output_dir={cfg.output_dir} holds a run to resume from {checkpoint}, trained with other "
            f"{' and '.join(c.key for c in structural)} ({'; '.join(map(str, structural))}); its weights and optimizer "
            f"state cannot be loaded into this model. Resume with the old value, or start a new run with a new "
            f"output_dir (from its exported model: model=OUTPUT_DIR/final)."
        )
    refused = [c for c in changes if c.key not in SAFE_KEYS | LAYOUT_KEYS and c.key not in allowed]
    if refused:
        lines = "\n".join(f"  {c}" for c in refused)
        raise ConfigError(
            f"output_dir={cfg.output_dir} holds a run to resume from {checkpoint}, and this config differs from "
            f"the one it was trained with:\n{lines}\nA resumed run continues the same training. To change "
            f"{'this' if len(refused) == 1 else 'these'} from here on, on purpose: --allow-changes "
            f"{','.join(c.key for c in refused)}; to train something else, choose a new output_dir."
        )
    check_global_batch(saved_yaml, saved_world, cfg, world, allowed, checkpoint)
    if any(c.key.startswith("rope.") or c.key in ("seq_len", "model") for c in changes):
        check_same_rope(saved_yaml, cfg, checkpoint)
    return changes + ([Change("ranks", saved_world, world)] if saved_world != world else [])


def check_same_rope(saved_yaml: str, cfg: Config, checkpoint: str) -> None:
    """Refuse a resume whose RoPE differs from the one the checkpoint trained with, whatever --allow-changes says: its
    weights learned those positions' rotations (a changed seq_len changes the scaling of `rope.factor=auto`)."""
    from longfit.models.loading import resolve_model_config

    old = saved_values(saved_yaml)
    before = Config(model=cfg.model, seq_len=old["seq_len"],
                    rope=RopeSection(**{k.split(".", 1)[1]: v for k, v in old.items() if k.startswith("rope.")}))
    trained = resolve_model_config(cfg.model, before).rope_parameters
    now = resolve_model_config(cfg.model, cfg).rope_parameters
    if trained != now:
        pin = (f"; rope.factor=auto follows seq_len, so keep the old scaling with rope.factor="
               f"{_factor(trained)} (and --allow-changes rope.factor)" if cfg.rope.factor == "auto" and _factor(trained) else "")
        raise ConfigError(
            f"output_dir={cfg.output_dir} holds a run to resume from {checkpoint}, trained with the RoPE {trained}; "
            f"this config makes it {now}. A resumed run keeps the positions its weights learned{pin}. To extend "
            f"further, start a new run from its export (model=OUTPUT_DIR/final) with a new output_dir."
        )


def _factor(parameters: dict):
    """The factor of a RoPE parameter dict (its first layer type's, when nested), or None."""
    if "rope_type" not in parameters:
        return next((_factor(p) for p in parameters.values() if isinstance(p, dict) and _factor(p)), None)
    return parameters.get("factor")


def history_entries(changes: list[Change], step: int, allowed: frozenset[str]) -> list[str]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return [
        f"# - {stamp} at step {step}: {change}" + (" (--allow-changes)" if change.key in allowed else "")
        for change in changes
        if change.key != "output_dir"
    ]


def config_file_text(cfg: Config, previous_text: str | None, new_entries: list[str]) -> str:
    """OUTPUT_DIR/config.yaml: the resolved config, then the history comment (kept from `previous_text`)."""
    history = []
    if previous_text and HISTORY_HEADER in previous_text:
        history = [line for line in previous_text.split(HISTORY_HEADER, 1)[1].splitlines() if line.startswith("# - ")]
    history += new_entries
    return cfg.to_yaml() + (f"\n{HISTORY_HEADER}\n" + "\n".join(history) + "\n" if history else "")


def change_event(changes: list[Change], step: int, allowed: frozenset[str]) -> dict | None:
    """The metrics.jsonl row recording the changes applied on purpose, or None."""
    applied = {c.key: [c.old, c.new] for c in changes if c.key in allowed}
    return {"step": step, "event": "config_change", "changes": applied} if applied else None
