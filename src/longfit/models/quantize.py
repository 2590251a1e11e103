"""QLoRA's frozen base: the projections that receive adapters, stored as 4-bit NF4 (bitsandbytes).

Each `nn.Linear` that the LoRA config adapts (peft's own matching rule) becomes a `bitsandbytes.nn.Linear4bit` with NF4
weights and double quantization (the absmax of every 64 weights, itself quantized per 256 blocks), the
QLoRA recipe (Dettmers et al. 2023, sec. 3). The matmul dequantizes to `compute_dtype` on the fly, so
the base costs about 0.5 byte per weight instead of 2 (bf16) or 4 (fp32). peft then wraps these modules
with its bitsandbytes LoRA layers. Embeddings, norms and lm_head keep their dtype, as in transformers'
own bitsandbytes loading.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from longfit.config import ConfigError


def require_bitsandbytes() -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "lora.quantize_base=true (QLoRA) needs bitsandbytes: `pip install bitsandbytes`, "
            "or set lora.quantize_base=false (LoRA on a bf16 base)"
        )


def quantize_base_4bit(model: nn.Module, lora_config, compute_dtype: torch.dtype, device: torch.device) -> int:
    """Replace the `nn.Linear` modules that peft will adapt under `lora_config` by NF4 `Linear4bit` on `device`.

    The model may live on the CPU: each weight is quantized as it moves to `device`, so the device never
    holds the unquantized base. Returns the number of projections quantized.
    """
    import bitsandbytes as bnb
    from peft.tuners.tuners_utils import check_target_module_exists

    replaced = 0
    for name, module in list(model.named_modules()):
        if not (isinstance(module, nn.Linear) and check_target_module_exists(lora_config, name)):
            continue
        quantized = bnb.nn.Linear4bit(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
        )
        quantized.weight = bnb.nn.Params4bit(
            module.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4"
        )
        if module.bias is not None:
            quantized.bias = nn.Parameter(module.bias.data.to(compute_dtype), requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, quantized.to(device))
        replaced += 1
    if replaced == 0:
        raise ConfigError(
            f"lora.quantize_base=true found no nn.Linear matching lora.target_modules={lora_config.target_modules}"
        )
    return replaced


def dequantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` on the CPU with every 4-bit weight dequantized to its compute dtype.

    These are exactly the weights the adapters were trained against, so merging into them (and loading
    the exported model in bf16) reproduces the trained model up to the merge's rounding.
    """
    import bitsandbytes as bnb

    quantized = {name: module for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)}
    state = {}
    for key, tensor in model.state_dict().items():
        owner = next((name for name in quantized if key.startswith(f"{name}.weight")), None)
        if owner is not None:
            if key != f"{owner}.weight":  # quantization statistics (absmax, quant_map, ...) beside the packed weight
                continue
            module = quantized[owner]
            tensor = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).to(module.compute_dtype)
        state[key] = tensor.detach().cpu()
    return state
