"""Where things are inside a transformers causal LM, with or without a peft wrapper."""

from __future__ import annotations

from torch import nn


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or `model` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers of a transformers causal LM, also through a peft wrapper.

    Found generically: the first ModuleList whose entries are all of a class named in the model's
    `_no_split_modules` (transformers' "one transformer block" marker), else `get_decoder().layers`.
    """
    base = unwrap_peft(model)
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    for module in base.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and all(
            any(cls.__name__ in block_names for cls in type(layer).__mro__) for layer in module
        ):
            return module
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise ValueError(
        f"could not find the decoder layers of {type(base).__name__}: expected a ModuleList of the blocks "
        f"named in _no_split_modules ({sorted(block_names)}) or get_decoder().layers"
    )


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder body (returning hidden states) of a causal LM, also through a peft wrapper."""
    causal_lm = unwrap_peft(model)
    decoder = causal_lm.get_decoder()
    if decoder is causal_lm:
        # transformers' lookup fell back on the model itself: Llama4ForCausalLM declares base_model_prefix
        # "language_model" but holds its decoder as `model`, the attribute of every other causal LM.
        decoder = causal_lm.model
    return decoder


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder body returning hidden states, lm_head) of a causal LM."""
    return decoder_body(model), unwrap_peft(model).get_output_embeddings()
