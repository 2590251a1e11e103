"""Dropout off while training (`train.disable_dropout`, the default), as TRL's `disable_dropout` and as torchtune and
torchtitan build their models.

Dropout draws random masks, so no step with it can be compared with another implementation's: `longfit check`
proves a step exact only without it. `disable_dropout` zeroes every dropout probability of a model's (text) config --
read off the config object, a number whose field name says dropout: `attention_dropout`, Seed-OSS's
`residual_dropout`, GPT-2's `attn_pdrop` / `resid_pdrop` / `embd_pdrop`, BERT-style `hidden_dropout_prob`,
`layerdrop`, `drop_path_rate` -- where the run's model config is resolved (`longfit.models.loading
.resolve_model_config`), so the trainer, `longfit check`, eval and the verdict's key build the same model.
`disable_dropout_modules` then sets p=0 on every dropout module of a built model and zeroes the dropout numbers its
modules keep (a model built elsewhere: apply_longfit's), so a dropout the config does not drive is off too; peft's
LoRA dropout is `lora.dropout`'s and stays. The export writes the checkpoint's own values (`dropout_values` of the
config as read).

Not dropout, and left alone: a router's `router_jitter_noise`. PhiMoE's sparsemixer reads it as the margin within
which it samples an expert (in eval too); at 0 its router gets no gradient at all (measured on a tiny copy), so its
randomness is its method, which `longfit check` refuses as a module random in training.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop|drop_path|drop_rate")
"""A config field or module attribute holding a dropout probability."""



def dropout_modules() -> tuple[type, ...]:
    """torch's dropout module classes (torch imported here: the planner reads `dropout_fields` without it)."""
    import torch

    return (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)


def _probability(name: str, value) -> bool:
    return (DROPOUT_NAME.search(name) is not None and isinstance(value, (int, float)) and not isinstance(value, bool)
            and value != 0)


def dropout_fields(values: dict) -> dict[str, float]:
    """The dropout probabilities that are not 0 among a config's `values` (its `to_dict()`, a config.json's)."""
    return {name: value for name, value in values.items() if _probability(name, value)}


def dropout_values(config) -> dict[str, float]:
    """The dropout probabilities of a transformers `config` that are not 0, under the config's own field names."""
    return dropout_fields(config.to_dict())


def disable_dropout(config) -> dict[str, float]:
    """Every dropout probability of `config` set to 0 (in place); returns the values they had."""
    values = dropout_values(config)
    for name in values:
        setattr(config, name, 0.0)
    return values


def disable_dropout_modules(model: torch.nn.Module) -> list[str]:
    """p=0 on every dropout module of `model` and every dropout number its modules keep (Seed-OSS's
    `self.residual_dropout`, an attention's `self.attention_dropout`), LoRA adapters' dropout excepted; returns the
    names of those that were not 0."""
    import torch

    adapters = {id(m) for module in model.modules()
                if isinstance(getattr(module, "lora_dropout", None), torch.nn.ModuleDict)
                for m in module.lora_dropout.values()}
    changed = []
    for name, module in model.named_modules():
        if id(module) in adapters:
            continue
        if isinstance(module, dropout_modules()) and module.p:
            module.p = 0.0
            changed.append(name)
        for attribute, value in list(vars(module).items()):
            if _probability(attribute, value):
                setattr(module, attribute, 0.0)
                changed.append(f"{name}.{attribute}" if name else attribute)
    return changed


def dropout_note(values: dict[str, float]) -> str | None:
    """The line a run prints once at its start naming the dropout `train.disable_dropout` turned off (None: none)."""
    if not values:
        return None
    listed = ", ".join(f"{name}={value:g}" for name, value in values.items())
    return f"note: dropout off while training (train.disable_dropout): {listed}"
