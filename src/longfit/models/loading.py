"""Build a causal LM and its tokenizer from a preset name or a local Hugging Face directory.

No network at run time: a name that is neither a preset nor a directory is an error that says how to
point `model` at a local copy. A multimodal checkpoint (a config with a `text_config`, e.g. Gemma 3
4B-27B) is trained as its language model alone: its text config builds the causal LM (Gemma3ForCausalLM)
and LANGUAGE_MODEL_KEYS maps the language model's weights onto it; the vision tower is not loaded.
"""

from __future__ import annotations

import torch

from longfit.config import ConfigError
from longfit.models.attention import register_attention
from longfit.models.presets import PRESETS, preset_config
from longfit.models.source import local_model_dir

# Where a multimodal checkpoint keeps its language model: transformers' legacy layout (which
# save_pretrained still writes) and its current one, mapped onto the causal LM's own names. No key of a
# text-only checkpoint matches.
LANGUAGE_MODEL_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",
}


def resolve_model_config(model: str):
    """The transformers config for `model` (a preset name or a local directory with config.json).

    For a multimodal checkpoint, the config of its language model.
    """
    path = local_model_dir(model)
    if path is None:
        from longfit.data.tokenizer import byte_tokenizer_special_ids

        config = preset_config(model)
        for name, token_id in byte_tokenizer_special_ids().items():
            setattr(config, name, token_id)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path).get_text_config()
    config._attn_implementation = register_attention()
    return config


def load_tokenizer(model: str):
    """The tokenizer saved with a local model, or longfit's byte-level tokenizer for presets."""
    from longfit.data.tokenizer import byte_tokenizer

    if model in PRESETS:
        return byte_tokenizer()
    from transformers import AutoTokenizer

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
        net = AutoModelForCausalLM.from_pretrained(
            model, config=config, attn_implementation=attn, dtype=dtype, key_mapping=LANGUAGE_MODEL_KEYS
        )
    if device.type != "meta":
        net = net.to(device)
    net.config.use_cache = False
    return net
