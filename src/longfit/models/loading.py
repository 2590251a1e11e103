"""Build a causal LM and its tokenizer from a preset name, a local Hugging Face directory or a GGUF file
(its converted directory, `longfit.models.source.local_model_dir`).

No network at run time: a name that is neither a preset nor a directory is an error that says how to
point `model` at a local copy, and transformers reads a directory with `local_files_only` (it would
otherwise ask the hub about a name it does not find locally).

A model is built on the meta device (`meta_model`: shapes only) and receives its values where it will
live (`materialize_model`), after `parallelize` has sharded it when it runs on several ranks: no process
ever holds more of the weights than its own part, in host or device memory. An image-text checkpoint (a
config with a `text_config`: Qwen3.5, Gemma 3 4B-27B, Gemma 4, Llama 4, Mistral 3) is trained as its language
model alone: its text config (`longfit.models.model_config`, tied as the wrapper class ties) builds the causal LM
(Gemma3ForCausalLM) and `weights.LANGUAGE_MODEL_KEYS` maps the language model's weights onto it; the vision and
audio towers are not loaded here: rows with images, videos or audio build them from the checkpoint
(`longfit.models.media.build_media_encoder`: Gemma 4's audio tower and embedder beside its vision tower), and the
export writes what of them trained and copies the rest (`longfit.train.export`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from longfit.config import Config, ConfigError
from longfit.models.attention import refuse_alibi, register_attention
from longfit.models.dropout import disable_dropout, disable_dropout_modules
from longfit.models.linear_attention import prepare_linear_attention
from longfit.models.sparse_attention import prepare_sparse_attention
from longfit.models.init import initialize_weights, lora_parameters, reset_lora
from longfit.models.model_config import read_config
from longfit.models.presets import PRESETS
from longfit.models.progress import announced
from longfit.models.rope import apply_rope
from longfit.models.source import check_weights, gguf_file, local_model_dir, missing_tokenizer
from longfit.models.structure import unwrap_peft
from longfit.models.weights import checkpoint_sources, read_local_slices


def resolve_model_config(model: str, run: Config | None = None):
    """The transformers config of the language model of `model` (a preset name, a local directory with config.json,
    a GGUF file): `longfit.models.model_config.read_config(model).text`, tied as the checkpoint's class ties. With the
    `run`'s config, its RoPE (`rope.*`, `longfit.models.rope.apply_rope`) and, under `train.disable_dropout`, every
    dropout probability at 0 (`longfit.models.dropout`)."""
    config = read_config(model).text
    if local_model_dir(model) is None:
        from longfit.data.tokenizer import byte_tokenizer_special_ids

        for name, token_id in byte_tokenizer_special_ids().items():
            setattr(config, name, token_id)
    config._attn_implementation = register_attention()
    if run is not None:
        apply_rope(config, run.rope, run.seq_len)
        if run.train.disable_dropout:
            disable_dropout(config)
    return config


def load_tokenizer(model: str):
    """The tokenizer saved with a local model (a GGUF file's: in its converted directory), or longfit's
    byte-level tokenizer for presets. `model` may also be a directory with a tokenizer only (an adapter's)."""
    from longfit.data.tokenizer import byte_tokenizer

    if model in PRESETS:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    source = local_model_dir(model) if gguf_file(model) else Path(model)
    problem = source.is_dir() and missing_tokenizer(source)
    if problem:
        raise ConfigError(f"model={model!r}: {problem}")
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model={model!r}: no tokenizer could be loaded from the directory ({e})") from e


def compute_dtype(train_dtype: str, device: torch.device) -> torch.dtype:
    """`train.dtype` resolved: bf16 where asked or (auto) on GPUs that support it; fp32 otherwise."""
    if train_dtype == "bf16":
        return torch.bfloat16
    if train_dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def meta_model(model: str, dtype: torch.dtype = torch.float32, run: Config | None = None):
    """`model`'s architecture on the meta device in `dtype`: no memory, no values (`materialize_model` gives them).
    With the `run`'s config, its RoPE and dropout (`resolve_model_config`; every dropout module at p=0 too under
    `train.disable_dropout`)."""
    from transformers import AutoModelForCausalLM

    config = resolve_model_config(model, run)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation, dtype=dtype)
    net.config.use_cache = False
    if run is not None and run.train.disable_dropout:
        disable_dropout_modules(net)
    refuse_alibi(net)
    prepare_linear_attention(net)
    prepare_sparse_attention(net)
    return net


def materialize_model(
    model: torch.nn.Module,
    device: torch.device | str,
    seed: int = 0,
    checkpoint: Path | None = None,
    params_device: torch.device | str | None = None,
) -> None:
    """Give `model` (from `meta_model`, peft adapters possibly attached, possibly sharded since) its values.

    Every tensor gets storage on `device` (parameters on `params_device` when given: FSDP2's CPU offload
    keeps them in host memory), each process for the part it holds. The parameters are read slice by
    slice from the safetensors of the `checkpoint` directory (`longfit.models.weights`), or without one
    initialised from `seed` (`longfit.models.init`: the same values on every rank, in every run, for any
    sharding); buffers are recomputed, LoRA adapters get peft's initialisation. A model with no tensor
    on the meta device (QLoRA's, built on a device) is left as it is.
    """
    if not any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        return
    device = torch.device(device)
    base = unwrap_peft(model)
    lora = model is not base
    sources = {}
    if checkpoint is not None:  # refused before anything is allocated
        check_weights(checkpoint, str(checkpoint))
        sources = checkpoint_sources(base, checkpoint)
        adapters = {id(p) for p in lora_parameters(model)} if lora else set()
        missing = [n for n, p in base.named_parameters() if n not in sources and id(p) not in adapters]
        if missing:
            raise ConfigError(
                f"model={str(checkpoint)!r}: the checkpoint has no weights for {', '.join(missing[:5])}"
                f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}; longfit trains only what was "
                f"loaded. Point `model` at the complete checkpoint"
            )
    ties = _shared_parameters(base)
    model.to_empty(device=params_device or device)
    if params_device is not None:
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, torch.empty_like(buffer, device=device))
    if _shared_parameters(base) != ties:  # unsharded, to_empty made one new Parameter per module
        base.tie_weights()
    loaded = read_local_slices(base, sources)
    adapters = {id(p) for p in lora_parameters(model)} if lora else set()
    # drawn on the compute device also where the parameters live on the host: the run's values either way
    initialize_weights(base, seed, skip=loaded | adapters, draw_device=device)
    if lora:
        reset_lora(model, seed, draw_device=device)


def _shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Names of each parameter registered under several names (tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return sorted(group for group in names.values() if len(group) > 1)


def load_model(model: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0,
               run: Config | None = None):
    """A trainable causal LM on `device` in one process, using longfit attention.

    Built on the meta device, then given its values on `device` (`materialize_model`): a preset
    initialised from `seed`, a local directory's (or a GGUF file's converted) safetensors weights, announced
    with the time it took (importing the architecture's code and reading the weights: 10-14 s for SmolLM2-135M on
    a busy 2-core machine). device="meta" keeps the shapes only (planning). With the `run`'s config, its RoPE.
    """
    checkpoint = local_model_dir(model)
    if checkpoint is None or torch.device(device).type == "meta":  # no weights to read: a second at most
        net = meta_model(model, dtype, run)
        if torch.device(device).type != "meta":
            materialize_model(net, device, seed)
        return net
    with announced(f"loading {checkpoint}"):
        net = meta_model(model, dtype, run)
        materialize_model(net, device, seed, checkpoint=checkpoint)
    return net
