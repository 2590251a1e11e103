"""Final export: a plain Hugging Face directory, whatever wrappers (FSDP2, CP, checkpointing) trained it.

Every rank takes part in gathering the full state dict; rank 0 then loads it into a fresh, unwrapped
model built on the meta device (no second random init) and writes sharded safetensors + config +
tokenizer, or the PEFT adapter for LoRA (merged into the base weights when asked).

An image-text checkpoint (`longfit.models.model_config`: Qwen3.5, Gemma 3, Gemma 4, Llama 4, Mistral 3) comes out as
it came in: its own config and class, each safetensors file of the source written again, shard by shard (one shard in
memory at a time, the towers never built), with the language model's tensors as trained under the checkpoint's own
key names (per-expert weights split back by transformers' reverse conversion, a tied lm_head left out as the source
left it out) and every other tensor (vision, audio, projector) byte for byte; the processor, tokenizer, chat template
and generation files copied. Its LoRA adapter names the wrapper's modules (a target pattern that leaves the towers
alone) and the wrapper directory as its base, so `PeftModel.from_pretrained(AutoModelForImageTextToText...)`
attaches it; merged, it is the wrapper again. `text_only` exports the language model alone, as a causal LM.

An adapter names its base in adapter_config.json (`base_model_name_or_path`), which
`AutoPeftModelForCausalLM.from_pretrained` loads. A local Hugging Face directory is recorded by its
absolute path. Any other base (a preset's seeded weights, a GGUF file's dequantized ones) exists nowhere
transformers can read it, so it is saved beside the adapter, in `base/` (config, weights as trained,
tokenizer), and that directory's absolute path is recorded. So is a local base whose RoPE the run scaled (`rope.*`): its own config.json would run the
adapter unscaled.
"""

from __future__ import annotations

import json
import re
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
                 stage_group=None, text_only: bool = False, media_encoder: torch.nn.Module | None = None) -> Path | None:
    """Write the trained model to `destination` (atomically: staged, then renamed). Collective: a failure to
    write (a full disk) removes the staging directory and raises the same CheckpointError on every rank.
    `stage_group`: under pipeline parallelism (`ParallelMesh.pp_group`) `model` is one stage, gathered over it.
    `text_only`: an image-text checkpoint's language model alone, as a causal LM (module docstring).
    `media_encoder`: the run's vision side (#54, `longfit.models.media.MediaEncoder`); what of it trained
    (`train.vision`) goes into the wrapper under the checkpoint's names, the rest stays the source's; its LoRA
    adapters into the adapter under the wrapper's module names (merged into its weights with the language model's)."""
    from longfit.models.media import vision_adapter_parameters

    merge = cfg.lora.enabled and cfg.lora.merge_on_export
    vision_state = trained_vision(media_encoder, merge)
    vision_adapters = {} if merge else vision_adapter_state(media_encoder)
    vision_weights = vision_adapter_parameters(media_encoder) if vision_adapters else []
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
            _write(cfg, full_state, tokenizer, staging, destination, text_only, vision_state, vision_adapters,
                   vision_weights)
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


def wrapper_source(cfg: Config, text_only: bool = False) -> Path | None:
    """The image-text checkpoint directory the export writes back (module docstring), or None: a causal LM."""
    from longfit.models.model_config import read_config
    from longfit.models.source import gguf_file, local_model_dir

    directory = local_model_dir(cfg.model)
    if text_only or directory is None or gguf_file(cfg.model) is not None:
        return None
    return directory if read_config(cfg.model).is_wrapper else None


def _whole(param: torch.Tensor) -> torch.Tensor:
    """`param` whole on the CPU (gathered from its FSDP2 shards: collective)."""
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().cpu()


def trained_vision(media_encoder: torch.nn.Module | None, merge: bool = False) -> dict[str, torch.Tensor]:
    """The vision side's trained parameters (whole: collective) under the wrapper's checkpoint keys; with `merge`,
    the weights its LoRA adapters adapt with the adapters merged in (W + scale B A, as peft's merge); empty when
    none trained."""
    if media_encoder is None:
        return {}
    from peft.tuners.lora import LoraLayer

    state = {media_encoder.checkpoint_keys[name]: _whole(p) for name, p in media_encoder.vision.named_parameters()
             if p.requires_grad and ".lora_" not in name}
    if merge:
        for name, module in media_encoder.vision.named_modules():
            if isinstance(module, LoraLayer):
                leaf = getattr(module, "parameter_name", "weight")  # a weight without a linear layer: its own name
                delta = _whole(module.lora_B["default"].weight) @ _whole(module.lora_A["default"].weight)
                weight = _whole(getattr(module.get_base_layer(), leaf))
                state[media_encoder.checkpoint_keys[f"{name}.{leaf}"]] = (
                    weight.float() + module.scaling["default"] * delta).to(weight.dtype)
    return state


def vision_adapter_state(media_encoder: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """The vision side's LoRA adapters (whole: collective) under the keys peft saves for the wrapper
    (`base_model.model.<the wrapper's module>.lora_A.weight`); empty without them."""
    if media_encoder is None:
        return {}
    from longfit.models.media import vision_adapter_modules

    modules = vision_adapter_modules(media_encoder)
    state = {}
    for name, param in media_encoder.vision.named_parameters():
        module, adapter = name.split(".lora_", 1) if ".lora_" in name else (None, None)
        if module in modules:  # "blocks.0.attn.qkv", "A.default.weight"
            part, _, leaf = adapter.split(".", 2)
            state[f"base_model.model.{modules[module]}.lora_{part}.{leaf}"] = _whole(param)
    return state


def _write(cfg: Config, full_state: dict, tokenizer, staging: Path, destination: Path, text_only: bool = False,
           vision_state: dict | None = None, vision_adapters: dict | None = None,
           vision_weights: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from longfit.models.dropout import dropout_values
    from longfit.models.loading import resolve_model_config

    config = resolve_model_config(cfg.model, cfg)  # the run's RoPE in config.json: the model runs as it trained
    config.update(dropout_values(resolve_model_config(cfg.model)))  # the checkpoint's dropout, off only in training
    base_beside = saves_base(cfg)
    wrapper = wrapper_source(cfg, text_only)
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
    if wrapper is not None and not (cfg.lora.enabled and not cfg.lora.merge_on_export):
        _write_wrapper(cfg, fresh, wrapper, staging, vision_state or {})
    else:
        # An adapter never carries the base embeddings: longfit does not resize the vocabulary. Saying so also keeps
        # peft from asking the hub whether the base model's vocabulary differs (its "auto" does, by the base's name).
        adapter_only = {"save_embedding_layers": False} if cfg.lora.enabled and not cfg.lora.merge_on_export else {}
        with without_library_bars():
            fresh.save_pretrained(staging, max_shard_size="2GB", **adapter_only)
            if base_beside and wrapper is not None:  # the wrapper, its RoPE as the run scaled it
                _write_wrapper(cfg, fresh.unload(), wrapper, staging / BASE_DIR)
            elif base_beside:
                base = fresh.unload()
                base.save_pretrained(staging / BASE_DIR, max_shard_size="2GB")
                tokenizer.save_pretrained(staging / BASE_DIR)
        tokenizer.save_pretrained(staging)
        if wrapper is not None:
            _attach_to_wrapper(cfg, fresh.get_base_model(), wrapper, staging,
                               base=destination / BASE_DIR if base_beside else wrapper,
                               vision_adapters=vision_adapters or {}, vision_weights=vision_weights or [])
    if destination.exists():
        shutil.rmtree(destination)
    staging.rename(destination)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pth", "*.pt", "model.safetensors.index.json",
                "pytorch_model.bin.index.json", "config.json")
"""A source checkpoint's files that the wrapper export writes itself, not copies."""


def _write_wrapper(cfg: Config, causal_lm: torch.nn.Module, source: Path, staging: Path,
                   vision_state: dict | None = None) -> None:
    """The image-text checkpoint `source` with `causal_lm`'s trained language model in it (module docstring), and the
    vision side's trained tensors `vision_state` (the wrapper's keys) where it trained."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from longfit.models.model_config import read_config
    from longfit.models.rope import apply_rope
    from longfit.models.weights import INDEX, checkpoint_files, tensors_as_saved

    files = checkpoint_files(source)
    trained = tensors_as_saved(causal_lm, causal_lm.state_dict(), files) | (vision_state or {})
    staging.mkdir(parents=True)
    total = 0
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {"format": "pt"}
            shard = {key: trained[key].detach().contiguous() if key in trained else f.get_tensor(key) for key in f.keys()}
        save_file(shard, staging / file.name, metadata=metadata)
        total += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    if (source / INDEX).is_file():  # the same files; the size is the trained tensors' (their dtype may differ)
        index = json.loads((source / INDEX).read_text())
        index["metadata"] = {**index.get("metadata", {}), "total_size": total}
        (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    wrapper_config = read_config(cfg.model).config
    apply_rope(wrapper_config.get_text_config(decoder=True), cfg.rope, cfg.seq_len)  # the run's RoPE, as trained
    wrapper_config.save_pretrained(staging)
    for path in sorted(source.iterdir()):
        if path.is_file() and not any(path.match(pattern) for pattern in WEIGHT_FILES):
            shutil.copyfile(path, staging / path.name)


def _attach_to_wrapper(cfg: Config, causal_lm: torch.nn.Module, source: Path, staging: Path, base: Path,
                       vision_adapters: dict | None = None, vision_weights: list[str] | None = None) -> None:
    """Rename the adapter peft saved for `causal_lm` to the modules of the wrapper class of `source` (the same
    layers inside it), its target modules to a pattern that matches those modules only (the towers have projections
    of the same names), its base to the wrapper directory `base` (`source`, or the wrapper saved beside the adapter
    with the run's RoPE). `vision_adapters`: the vision side's adapters (`vision_adapter_state`, the wrapper's keys),
    added with their modules to the pattern; those on `vision_weights` (weights without a linear layer, the wrapper's
    names: `vision_adapter_parameters`) as peft's `target_parameters` instead."""
    from safetensors.torch import load_file, save_file

    from longfit.models.model_config import read_config
    from longfit.models.weights import source_names

    model_config = read_config(cfg.model)
    with torch.device("meta"):
        wrapper = model_config.model_class()._from_config(model_config.config)
    to_causal = source_names(causal_lm, wrapper.state_dict())
    modules = {name.rsplit(".", 1)[0]: key.rsplit(".", 1)[0] for key, (name, pattern) in to_causal.items()
               if pattern is None and "." in name}
    weights = staging / "adapter_model.safetensors"
    prefix = "base_model.model."
    adapted, renamed = set(), {}
    for key, tensor in load_file(weights).items():
        path = key.removeprefix(prefix)
        parts = path.split(".")
        module = next((m for i in range(len(parts) - 1, 0, -1) if (m := ".".join(parts[:i])) in modules), None)
        if module is None:
            raise RuntimeError(f"export: adapter tensor {key} belongs to no module of {model_config.architecture}")
        adapted.add(modules[module])
        renamed[prefix + modules[module] + path[len(module):]] = tensor
    vision_weights = vision_weights or []
    vision_modules = ({key.removeprefix(prefix).split(".lora_", 1)[0] for key in vision_adapters or {}}
                      - {weight.rsplit(".", 1)[0] for weight in vision_weights})
    save_file(renamed | (vision_adapters or {}), weights, metadata={"format": "pt"})
    adapter_config = json.loads((staging / "adapter_config.json").read_text())
    targets = set(adapter_config["target_modules"])  # a mixture of experts' fused weights: target_parameters
    layer_index = re.compile(r"\\\.\d+\\\.")  # re.escape's "\.0\." of a layer's index
    patterns = {layer_index.sub(lambda _: r"\.\d+\.", re.escape(module)) for module in adapted
                if module.rsplit(".", 1)[-1] in targets} | {re.escape(module) for module in vision_modules}
    adapter_config["target_modules"] = "|".join(sorted(patterns))
    if vision_weights:
        adapter_config["target_parameters"] = sorted({*(adapter_config.get("target_parameters") or []),
                                                      *vision_weights})
    adapter_config["base_model_name_or_path"] = str(base.resolve())
    (staging / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
