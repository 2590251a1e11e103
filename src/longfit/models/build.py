"""The model the trainer trains (and `longfit plan --trace` measures): weights, adapters, storage dtypes.

Storage dtype of each parameter, for compute dtype `dtype` (bf16 on GPUs, fp32 by default on CPU):
- full fine-tuning: fp32, the optimizer's master weights; bf16 compute comes from autocast (one rank)
  or FSDP2's MixedPrecisionPolicy (several).
- LoRA: the frozen base in `dtype` (half the bytes of fp32 under bf16: its only use is the matmul, which
  runs in `dtype` anyway), the trainable adapters in fp32. peft's cast of each adapter's input to the
  adapter's dtype is switched off: the adapters then see the bf16 activations as under FSDP2, autocast
  runs their matmuls in bf16, and no fp32 copy of the input is made per adapted projection.
- QLoRA (lora.quantize_base): as LoRA, with the adapted projections 4-bit NF4 (longfit.models.quantize).
"""

from __future__ import annotations

import logging
import sys
import warnings
from contextlib import contextmanager

import torch

from longfit.config import Config, ConfigError

# bitsandbytes (which peft imports when it is installed) looks for an optional CPU kernel package when it is
# imported and logs its absence; longfit's CPU runs never use that kernel.
_BNB_CPU_KERNEL_NOTE = "Failed to load CPU gemm_4bit_forward"


class _WithoutMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextmanager
def peft_quietly(unquantized: bool = False):
    """Import and call peft without the notes that concern peft's own code, not the user's run. `unquantized`: the
    models it wraps inside hold no 4-bit or 8-bit layer (`longfit check`'s copies: QLoRA's base is checked as a
    bf16 one), so peft wraps them as where bitsandbytes is not installed (`_without_bitsandbytes`).

    peft is imported without bitsandbytes (`_import_peft`). peft 0.21 reads transformers' deprecated
    `is_gradient_checkpointing` property whenever it wraps a model (a FutureWarning per wrap), and bitsandbytes,
    imported for QLoRA, logs a note about an optional CPU kernel (`_BNB_CPU_KERNEL_NOTE`). On a mixture-of-experts
    model peft turns the gate_proj/up_proj targets into the fused `gate_up_proj` parameter with rank and alpha
    doubled by a pattern, then warns that the pattern "did not match any targeted module" (it checks modules, and
    the fused experts are a parameter) although it applied it. Each is silenced by message, nothing else.
    """
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _WithoutMessage) for f in logger.filters):
        logger.addFilter(_WithoutMessage(_BNB_CPU_KERNEL_NOTE))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any targeted "
                                r"module and were ignored: \['\.\*\\\\\.gate_up_proj'\]", category=RuntimeWarning)
        _import_peft()
        if unquantized:
            with _without_bitsandbytes():
                yield
        else:
            yield


@contextmanager
def _without_bitsandbytes():
    """peft's wrapping of a model without importing bitsandbytes (#52: 1.5 CPU s of a cold LoRA check): its LoRA
    dispatch imports it to recognise 4-bit and 8-bit layers wherever it is installed. peft's cached answers to
    whether it is installed are asked again afterwards, so a QLoRA model wrapped later finds it."""
    if "bitsandbytes" in sys.modules:
        yield
        return
    try:
        with _bitsandbytes_hidden():
            yield
    finally:
        from peft.import_utils import is_bnb_4bit_available, is_bnb_available

        is_bnb_available.cache_clear()
        is_bnb_4bit_available.cache_clear()


def _import_peft() -> None:
    """Import peft, the first time, without importing bitsandbytes (#52: 1.5 of the 1.9 CPU s of importing peft, in
    every `longfit check` and LoRA run). peft's package imports it for `find_kappa_target_modules` alone, which
    longfit never calls, and takes its absence; its LoRA layers ask whether bitsandbytes is installed when they
    wrap a model, after this import, and then import it (QLoRA's 4-bit projections)."""
    if "peft" in sys.modules or "bitsandbytes" in sys.modules:
        return
    with _bitsandbytes_hidden():
        import peft  # noqa: F401


@contextmanager
def _bitsandbytes_hidden():
    sys.modules["bitsandbytes"] = None  # its import raises ImportError, as where it is not installed
    try:
        yield
    finally:
        del sys.modules["bitsandbytes"]


def lora_config(cfg: Config):
    with peft_quietly():
        from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type="CAUSAL_LM",
    )


def build_model(cfg: Config, dtype: torch.dtype, device: torch.device | str, fsdp: bool = False) -> torch.nn.Module:
    """`cfg.model` with peft adapters when cfg.lora.enabled, in the storage dtypes above, on the meta device.

    Its values come once it is where it will train: `parallelize` materialises it (each rank its own
    part, `longfit.models.loading.materialize_model`). QLoRA is the exception: its base is loaded on the
    CPU, quantized and put on `device` here, whole. `fsdp`: FSDP2 will wrap the model
    (ParallelDims.fsdp_enabled), which QLoRA's 4-bit weights cannot take.
    """
    from longfit.models.loading import load_model, meta_model

    device = torch.device(device)
    storage_dtype = dtype if cfg.lora.enabled else torch.float32  # frozen LoRA base; else fp32 master weights
    if cfg.lora.quantize_base:
        from longfit.models.quantize import quantize_base_4bit, require_bitsandbytes

        if fsdp:
            raise ConfigError(
                "lora.quantize_base=true (QLoRA) runs without FSDP2, which cannot wrap 4-bit weights: train on one "
                "rank with parallel.cpu_offload=false, or set lora.quantize_base=false to shard a bf16 base"
            )
        require_bitsandbytes()  # before loading a base that could not be quantized
        model = load_model(cfg.model, dtype=storage_dtype, device="cpu", seed=cfg.train.seed, run=cfg)
        quantize_base_4bit(model, lora_config(cfg), dtype, device)
        model.to(device)
    else:
        model = meta_model(cfg.model, dtype=storage_dtype, run=cfg)
    if not cfg.lora.enabled:
        return model
    with peft_quietly():
        from peft import get_peft_model

        return use_lora_storage(get_peft_model(model, lora_config(cfg)), dtype)


def use_lora_storage(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Frozen (non-quantized) parameters of a peft `model` in `dtype`, trainable ones in fp32, input casts off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
        elif param.is_floating_point():
            param.data = param.data.to(dtype)
    return model
