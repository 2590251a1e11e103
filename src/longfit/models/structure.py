"""Where things are inside a transformers causal LM, with or without a peft wrapper."""

from __future__ import annotations

from torch import nn

from longfit.config import ConfigError


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or `model` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers of a transformers causal LM, also through a peft wrapper.

    Found generically: the first ModuleList whose entries are all of a class named in the model's
    `_no_split_modules` (transformers' "one transformer block" marker), else `get_decoder().layers`, else the one
    ModuleList of `num_hidden_layers` blocks of one class (CTRL's and GPT-1's `h`, which name no such marker).
    """
    base = unwrap_peft(model)
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    for module in base.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and all(
            any(cls.__name__ in block_names for cls in type(layer).__mro__) for layer in module
        ):
            return module
    body = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(body, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    count = getattr(getattr(base, "config", None), "num_hidden_layers", None)
    blocks = [module for module in base.modules() if isinstance(module, nn.ModuleList) and len(module) == count
              and len({type(layer) for layer in module}) == 1 and len(list(module[0].children())) > 1]
    if len(blocks) == 1:
        return blocks[0]
    raise ConfigError(
        f"could not find the decoder layers of {type(base).__name__}: expected a ModuleList of the blocks "
        f"named in _no_split_modules ({sorted(block_names)}) or get_decoder().layers, so longfit cannot apply its "
        "attention and memory techniques to them"
    )


def feed_forward(layer: nn.Module) -> nn.Module | None:
    """The MLP (dense or mixture-of-experts) of a decoder layer: its one direct child, other than the token mixer,
    with a parameter of more than one dimension (norms hold vectors only). The token mixer is the attention
    (`self_attn`) or a linear-attention layer's mixer, the child owning its short convolution (`conv1d`: Qwen3.5's
    `linear_attn`). Most families call the MLP `mlp`, Llama 4 `feed_forward`. None when there is no such single
    child."""
    found = [
        module for name, module in layer.named_children()
        if name != "self_attn" and not isinstance(getattr(module, "conv1d", None), nn.Conv1d)
        and any(p.dim() > 1 for p in module.parameters())
    ]
    return found[0] if len(found) == 1 else None


def decoder(model: nn.Module) -> nn.Module:
    """The decoder body of a causal LM (also through a peft wrapper): the module returning the last hidden states.

    transformers' `get_decoder()`, unless it returns the causal LM itself or a module without the decoder layers:
    Llama 4's causal LM names its `base_model_prefix` "language_model" but keeps the body under `model`, so
    `get_decoder()` falls back to the whole model (whose output has logits, no last_hidden_state); ModernBERT's
    decoder calls its output projection `decoder`. The body is then the module that holds the decoder layers.
    """
    causal_lm = unwrap_peft(model)
    body = causal_lm.get_decoder()
    layers = decoder_layers(causal_lm)
    if body is not causal_lm and any(module is layers for module in body.modules()):
        return body
    return next(module for module in causal_lm.modules() if any(child is layers for child in module.children()))


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder body returning hidden states, lm_head) of a causal LM."""
    return decoder(model), unwrap_peft(model).get_output_embeddings()


def prediction_head(model: nn.Module) -> nn.Module | None:
    """The module a causal LM applies to the last hidden states before its output projection, or None: a child of the
    causal LM with parameters that is neither its body nor its output embeddings (ModernBERT-decoder's `lm_head`:
    dense, activation, norm, before the projection it calls `decoder`). No other decoder-only type of transformers
    5.24 has one; a model with more than one such child is left to `longfit check`, which names the parameters it
    leaves without a gradient."""
    causal_lm = unwrap_peft(model)
    body, head = decoder_and_head(model)
    others = [child for child in causal_lm.children() if child is not body and child is not head
              and any(True for _ in child.parameters()) and not any(module is body for module in child.modules())]
    return others[0] if len(others) == 1 else None


def logit_multiplier(config) -> float:
    """The factor a causal LM's forward multiplies its logits by outside any module (HF text `config`), which
    longfit's loss, computing the logits from the last hidden states itself, must apply too: Cohere's `logit_scale`
    (logits * logit_scale); `logits_scaling`, which Granite's forward divides the logits by and MiniCPM3's the last
    hidden states (the same for a head without bias), and HyperCLOVA X's multiplies them by -- the one family whose
    config key means the opposite, read by its model type (transformers' modeling code)."""
    multiplier = 1.0
    if getattr(config, "logit_scale", None) is not None:
        multiplier *= float(config.logit_scale)
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        multiplier *= float(scaling) if config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return multiplier


def logit_softcap(config) -> float | None:
    """The cap c of the causal LM's logits, c tanh(logits / c), or None: Gemma 2/3's `final_logit_softcapping`,
    RecurrentGemma's `logits_soft_cap` (the same cap under its own name, applied in its causal LM's forward)."""
    for key in ("final_logit_softcapping", "logits_soft_cap"):
        cap = getattr(config, key, None)
        if cap:
            return cap
    return None
