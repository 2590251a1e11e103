"""Build a causal LM and its tokenizer from a preset name or a local Hugging Face directory.

No network at run time: a name that is neither a preset nor a directory is an error that says how to
point `model` at a local copy.
"""

from __future__ import annotations

from pathlib import Path

import torch

from longfit.config import ConfigError
from longfit.models.attention import register_attention
from longfit.models.presets import PRESETS, preset_config
from longfit.models.source import check_weights, local_model_dir, missing_tokenizer


def resolve_model_config(model: str):
    """The transformers config for `model` (a preset name or a local directory with config.json)."""
    path = local_model_dir(model)
    if path is None:
        from longfit.data.tokenizer import byte_tokenizer_special_ids

        config = preset_config(model)
        for name, token_id in byte_tokenizer_special_ids().items():
            setattr(config, name, token_id)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    config._attn_implementation = register_attention()
    return config


def load_tokenizer(model: str):
    """The tokenizer saved with a local model, or longfit's byte-level tokenizer for presets."""
    from longfit.data.tokenizer import byte_tokenizer

    if model in PRESETS:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    problem = Path(model).is_dir() and missing_tokenizer(Path(model))
    if problem:
        raise ConfigError(f"model={model!r}: {problem}")
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model={model!r}: no tokenizer could be loaded from the directory ({e})") from e


def compute_dtype(train_dtype: str, device: torch.device) -> torch.dtype:
    """`train.dtype` resolved: bf16 where asked or (auto) on GPUs that support it; fp32 otherwise."""
    if train_dtype == "bf16":
        return torch.bfloat16
    if train_dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_model(model: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0):
    """A trainable causal LM on `device` using longfit attention.

    Presets are randomly initialised from `seed` (the same weights on every rank); local directories
    load their safetensors weights. Use device="meta" for shape-only models (planning).
    """
    from transformers import AutoModelForCausalLM

    config = resolve_model_config(model)
    attn = config._attn_implementation
    device = torch.device(device)
    if model in PRESETS or device.type == "meta":
        torch.manual_seed(seed)
        with device if device.type == "meta" else torch.device("cpu"):
            net = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    else:
        check_weights(local_model_dir(model), model)
        net = AutoModelForCausalLM.from_pretrained(model, config=config, attn_implementation=attn, dtype=dtype)
    if device.type != "meta":
        net = net.to(device)
    net.config.use_cache = False
    return net
