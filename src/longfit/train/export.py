"""Final export: a plain Hugging Face directory, whatever wrappers (FSDP2, CP, checkpointing) trained it.

Every rank takes part in gathering the full state dict; rank 0 then loads it into a fresh, unwrapped
model built on the meta device (no second random init) and writes sharded safetensors + config +
tokenizer, or the PEFT adapter for LoRA (merged into the base weights when asked).

An adapter names its base in adapter_config.json (`base_model_name_or_path`), which
`AutoPeftModelForCausalLM.from_pretrained` loads. A local Hugging Face directory is recorded by its
absolute path. Any other base (a preset's seeded weights, a GGUF file's dequantized ones) exists nowhere
transformers can read it, so it is saved beside the adapter, in `base/` (config, weights as trained,
tokenizer), and that directory's absolute path is recorded. So is a local base whose RoPE the run scaled (`rope.*`): its own config.json would run the
adapter unscaled.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from longfit.config import Config
from longfit.models.progress import without_library_bars


BASE_DIR = "base"


def saves_base(cfg: Config) -> bool:
    """Whether the export is an adapter whose base is saved beside it: its model is not a local Hugging Face directory."""
    from longfit.models.source import gguf_file, local_model_dir

    adapter = cfg.lora.enabled and not cfg.lora.merge_on_export
    return adapter and (local_model_dir(cfg.model) is None or gguf_file(cfg.model) is not None or rescales_rope(cfg))


def rescales_rope(cfg: Config) -> bool:
    """Whether the run's RoPE (`rope.*`, `longfit.models.rope`) differs from its checkpoint's."""
    from longfit.models.loading import resolve_model_config

    before, run = resolve_model_config(cfg.model), resolve_model_config(cfg.model, cfg)
    return ((getattr(before, "rope_parameters", None), before.max_position_embeddings)
            != (getattr(run, "rope_parameters", None), run.max_position_embeddings))


def export_is_current(cfg: Config, destination: Path) -> bool:
    """Whether `destination` holds the export `cfg` asks for: a model, a merged model or an adapter, with its base
    beside it when `saves_base` (an adapter exported before bases were saved has none)."""
    adapter = cfg.lora.enabled and not cfg.lora.merge_on_export
    if not destination.is_dir() or adapter != (destination / "adapter_config.json").is_file():
        return False
    return not saves_base(cfg) or (destination / BASE_DIR / "config.json").is_file()


def export_model(cfg: Config, model: torch.nn.Module, tokenizer, destination: Path, rank: int,
                 stage_group=None) -> Path | None:
    """Write the trained model to `destination` (atomically: staged, then renamed). Collective: a failure to
    write (a full disk) removes the staging directory and raises the same CheckpointError on every rank.
    `stage_group`: under pipeline parallelism (`ParallelMesh.pp_group`) `model` is one stage, gathered over it."""
    from longfit.train.checkpoint import (
        CheckpointError,
        agree_on_failure,
        on_every_rank,
    )

    if cfg.lora.quantize_base:  # one rank (no FSDP): the adapters merge into the dequantized base
        from longfit.models.quantize import dequantized_state_dict

        full_state = dequantized_state_dict(model)
    elif stage_group is not None:  # every rank its stage's whole tensors (cpu_offload would keep them on rank 0 only)
        from longfit.parallel.pipeline import gather_stage_states

        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        full_state = gather_stage_states({name: value.cpu() for name, value in full_state.items()}, stage_group)
    else:
        full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    staging = destination.with_name(f".tmp-{destination.name}")
    error = None
    if rank == 0:
        try:
            _write(cfg, full_state, tokenizer, staging, destination)
        except Exception as e:  # a full disk surfaces as OSError, or as safetensors' or torch's own error
            shutil.rmtree(staging, ignore_errors=True)
            error = e
    failure = agree_on_failure("exporting the model", error, destination.parent)
    if failure is not None:
        full = "the disk is full: " if failure["disk_full"] else ""
        raise on_every_rank(CheckpointError(
            f"exporting the final model to {destination} failed ({full}{failure['error']}); the partial export was "
            f"removed and the last checkpoint is intact. Fix that, then run the same command: it exports again"
        )) from error
    return destination if rank == 0 else None


def _write(cfg: Config, full_state: dict, tokenizer, staging: Path, destination: Path) -> None:
    from transformers import AutoModelForCausalLM

    from longfit.models.loading import resolve_model_config

    config = resolve_model_config(cfg.model, cfg)  # the run's RoPE in config.json: the model runs as it trained
    base_beside = saves_base(cfg)
    # Recorded as the adapter's base_model_name_or_path: where its base will be once the staging is renamed, or the
    # absolute model directory.
    model_dir = Path(cfg.model).expanduser()
    config._name_or_path = str((destination / BASE_DIR).resolve()) if base_beside else (
        str(model_dir.resolve()) if model_dir.is_dir() else cfg.model)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    if cfg.lora.enabled:
        from longfit.models.build import lora_config, peft_quietly

        with peft_quietly():
            from peft import get_peft_model

            fresh = get_peft_model(fresh, lora_config(cfg))
    fresh.load_state_dict(full_state, assign=True, strict=False)
    missing = [n for n, p in fresh.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"export: parameters absent from the trained state dict: {missing[:5]}")
    shutil.rmtree(staging, ignore_errors=True)
    if cfg.lora.enabled and cfg.lora.merge_on_export:
        fresh = fresh.merge_and_unload()
    fresh.config.use_cache = True
    # An adapter never carries the base embeddings: longfit does not resize the vocabulary. Saying so also keeps
    # peft from asking the hub whether the base model's vocabulary differs (its "auto" does, by the base's name).
    adapter_only = {"save_embedding_layers": False} if cfg.lora.enabled and not cfg.lora.merge_on_export else {}
    with without_library_bars():
        fresh.save_pretrained(staging, max_shard_size="2GB", **adapter_only)
        if base_beside:
            base = fresh.unload()
            base.save_pretrained(staging / BASE_DIR, max_shard_size="2GB")
            tokenizer.save_pretrained(staging / BASE_DIR)
    tokenizer.save_pretrained(staging)
    if destination.exists():
        shutil.rmtree(destination)
    staging.rename(destination)
