"""The run's rotary position embedding (`rope.*`) as transformers' `rope_parameters` on the model's config.

`apply_rope` edits the config `resolve_model_config` reads, so the trainer, `longfit check`, `longfit plan`'s
traces, `longfit eval` and the export all build the same model, and the export's config.json carries the
scaling (transformers, vLLM and llama.cpp read `rope_parameters` / `rope_scaling` from it).

What it writes, per RoPE parameter dict the scaling applies to (the config's one dict, or on a model whose layer
types have their own -- Gemma 3's `sliding_attention` / `full_attention` -- each one but the sliding-window
layers', which never see a distance past their window):
- `rope_theta`: `rope.theta`, else the checkpoint's (transformers v5 falls back to 10,000 for a dict without one);
- `original_max_position_embeddings` (YaRN, llama3, LongRoPE): the original window, `rope.original_window` or the
  checkpoint's (its `original_max_position_embeddings`, else its `max_position_embeddings`): v5 silently takes
  `max_position_embeddings` where it is missing, wrong once an extension has raised it;
- `max_position_embeddings`: the original window times the factor (Llama 3.1's, Phi-3's and Gemma 3's configs'
  rule), at least seq_len for plain RoPE. A checkpoint that already scales is extended only by its own type, the
  factor counted from its original window.

Two of transformers' types choose their frequencies per forward from the largest position id it sees: `dynamic`
(NTK) and `longrope` (its short factors up to the original window, its long ones past it). Under context
parallelism each rank sees other positions, and a packed row's largest position is its longest document's, so the
same document would train under other frequencies on another rank or beside other documents. Both are therefore
made static for the run's seq_len, the frequencies a full row of seq_len tokens gets on one process: `dynamic`
becomes plain RoPE with the base dynamic NTK computes for seq_len, and LongRoPE past the original window uses its
long factors at every position (its short factors set to them). The export carries those frequencies, so a model
runs as it trained at every length.
"""

from __future__ import annotations

import math

import torch

from longfit.config import Config, ConfigError, RopeSection

ORIGINAL = "original_max_position_embeddings"
WINDOWED_TYPES = ("yarn", "llama3", "longrope")
"""The types whose parameters name the original window (`ORIGINAL`)."""
SCALING_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", ORIGINAL, "attention_factor", "beta_fast",
                          "beta_slow", "mscale", "mscale_all_dim", "truncate", "low_freq_factor", "high_freq_factor",
                          "short_factor", "long_factor"})
"""The keys of a RoPE parameter dict that say how it scales; the others (partial_rotary_factor, mrope_section) stay."""


def scaled_groups(config) -> dict[str | None, dict]:
    """The RoPE parameter dicts the run scales: the config's own (key None), or per layer type those of the layers
    that are not sliding-window ones."""
    parameters = config.rope_parameters
    nested = _nested_keys(config, parameters)
    if not nested:
        return {None: parameters}
    return {key: parameters[key] for key in nested if parameters[key] is not None and "sliding" not in key}


def _nested_keys(config, parameters: dict) -> list[str]:
    """The layer types `parameters` is nested under ([] for one flat dict): transformers' own
    `nested_rope_parameter_keys` (5.24 has it, 5.17 does not), else its rule, which 5.17 applies when it standardizes
    the parameters: the keys that are the config's RoPE labels (`_rope_type_labels`) or layer types."""
    if hasattr(config, "nested_rope_parameter_keys"):
        return config.nested_rope_parameter_keys(parameters)
    labels = getattr(config, "_rope_type_labels", None) or getattr(config, "layer_types", None) or ()
    return [key for key in parameters if key in labels]


def original_window(config, parameters: dict, rope: RopeSection | None = None) -> int:
    """The positions the model was pretrained on: `rope.original_window`, else the checkpoint's
    `original_max_position_embeddings` (in its RoPE parameters, or beside them: Phi-3), else, under linear scaling,
    `max_position_embeddings` over its factor (Gemma 3's convention, which longfit's exports follow), else
    `max_position_embeddings`."""
    if rope is not None and rope.original_window:
        return rope.original_window
    given = parameters.get(ORIGINAL) or getattr(config, ORIGINAL, None)
    if given:
        return int(given)
    if parameters.get("rope_type") == "linear":
        return round(config.max_position_embeddings / parameters["factor"])
    return config.max_position_embeddings


def model_window(config) -> int | None:
    """The original window of `config`'s RoPE (its first scaled layer type's); None without RoPE."""
    if not getattr(config, "rope_parameters", None):
        return None
    groups = scaled_groups(config)
    return original_window(config, next(iter(groups.values()))) if groups else config.max_position_embeddings


def reach(config) -> int:
    """How far the positions of `config`'s RoPE reach: the original window times the factor where it scales, else
    `max_position_embeddings`; the least over the layer types the run scales."""
    reaches = []
    for parameters in scaled_groups(config).values():
        kind, factor = parameters.get("rope_type", "default"), parameters.get("factor") or 1.0
        reaches.append(original_window(config, parameters) * factor if kind != "default" else
                       config.max_position_embeddings)
    return int(min(reaches)) if reaches else config.max_position_embeddings


def rotary_dim(config, parameters: dict) -> int:
    """The rotated dimensions of a head, as transformers' RoPE functions count them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * parameters.get("partial_rotary_factor", 1.0))


def apply_rope(config, rope: RopeSection, seq_len: int) -> None:
    """`rope` on the transformers `config` (in place) for rows of `seq_len` tokens (module docstring); ConfigError
    naming the fix where the scaling cannot be built: no RoPE in the model, a factor `auto` below 1, LongRoPE
    without its factors."""
    if not getattr(config, "rope_parameters", None):
        if rope.type != "checkpoint":
            raise ConfigError(f"rope.type={rope.type}: {config.model_type} has no rotary position embedding (its "
                              f"config has no rope_parameters); remove the rope.* settings")
        return
    config.standardize_rope_params()  # every dict with its rope_type and rope_theta
    groups = scaled_groups(config)
    lengths = []
    for key, parameters in groups.items():
        if rope.type != "checkpoint":
            parameters = _scaled(config, parameters, rope, seq_len, key)
        parameters = _static(config, parameters, seq_len)
        if key is None:
            config.rope_parameters = parameters
        else:
            config.rope_parameters[key] = parameters
        if parameters is groups[key]:  # the checkpoint's, as it was
            continue
        if parameters["rope_type"] == "default":  # a raised base, or dynamic NTK made static
            lengths.append(max(config.max_position_embeddings, seq_len))
        elif rope.type != "checkpoint":
            lengths.append(round(original_window(config, groups[key], rope) * parameters["factor"]))
            if parameters["rope_type"] in WINDOWED_TYPES and getattr(config, ORIGINAL, None) is not None:
                config.original_max_position_embeddings = parameters[ORIGINAL]  # Phi-3's: transformers prefers it
    if lengths:
        config.max_position_embeddings = max(lengths)
    try:
        config.validate_rope()
    except (KeyError, ValueError) as e:
        raise ConfigError(f"rope.type={rope.type}: transformers refuses the RoPE parameters {config.rope_parameters} "
                          f"({e}); fix the rope.* settings") from e


def apply_rope_to_model(model, run: Config) -> None:
    """`apply_rope` on a model built elsewhere (a Trainer's), its rotary embedding modules rebuilt from the scaled
    config: the model then computes what `resolve_model_config(run.model, run)` builds, which `longfit check` checks."""
    from copy import deepcopy

    from longfit.models.structure import unwrap_peft

    config = unwrap_peft(model).config.get_text_config()
    before = (deepcopy(getattr(config, "rope_parameters", None)), config.max_position_embeddings)
    apply_rope(config, run.rope, run.seq_len)
    if (config.rope_parameters, config.max_position_embeddings) == before:
        return
    for name, module in list(model.named_modules()):
        if getattr(module, "config", None) is config and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, type(module)(config).to(module.inv_freq.device))


def _carried(parameters: dict) -> dict:
    return {k: v for k, v in parameters.items() if k not in SCALING_KEYS}


def _scaled(config, old: dict, rope: RopeSection, seq_len: int, key: str | None) -> dict:
    """One RoPE parameter dict as `rope` asks, from the checkpoint's `old`."""
    where = f" (layer type {key})" if key else ""
    window = original_window(config, old, rope)
    if old["rope_type"] not in ("default", rope.type):
        raise ConfigError(f"rope.type={rope.type}: {config.model_type}'s checkpoint already scales its RoPE{where} "
                          f"({old['rope_type']}, factor {old.get('factor')}, from {window} positions), which another "
                          f"type cannot continue: extend it with rope.type={old['rope_type']} (rope.factor counts from "
                          f"those {window} positions), or keep it with rope.type=checkpoint")
    new = {"rope_type": rope.type, "rope_theta": rope.theta or old["rope_theta"], **_carried(old)}
    if rope.type == "default":
        return new
    factor = seq_len / window if rope.factor == "auto" else rope.factor
    if factor < 1:
        raise ConfigError(f"rope.factor=auto: seq_len={seq_len} is within {config.model_type}'s original window of "
                          f"{window} positions{where} (factor {factor:.3g}): nothing to extend; set rope.type="
                          f"checkpoint, or a rope.factor >= 1")
    if rope.type == "dynamic":
        return _ntk_static(config, {**new, "factor": float(factor)}, window, seq_len)
    new["factor"] = float(factor)
    if rope.type in WINDOWED_TYPES:
        new[ORIGINAL] = window
    if rope.type in ("yarn", "longrope") and rope.attention_factor:
        new["attention_factor"] = rope.attention_factor
    if rope.type == "yarn":
        new.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow)
    elif rope.type == "llama3":
        new.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    elif rope.type == "longrope":
        short, long = rope.short_factor, rope.long_factor
        if not short and old.get("rope_type") == "longrope":
            short, long = old["short_factor"], old["long_factor"]
        half = rotary_dim(config, new) // 2
        if not short:
            raise ConfigError(f"rope.type=longrope needs its per-frequency factors: rope.short_factor=[...] and "
                              f"rope.long_factor=[...], {half} numbers each (a LongRoPE search's), or a checkpoint "
                              f"that has them")
        if len(short) != half or len(long) != half:
            raise ConfigError(f"rope.short_factor and rope.long_factor have {len(short)} and {len(long)} numbers: "
                              f"{config.model_type}'s heads rotate {2 * half} dimensions{where}, so give {half} each")
        new.update(short_factor=list(short), long_factor=list(long))
    return new


def _static(config, parameters: dict, seq_len: int) -> dict:
    """`parameters` with the frequencies a full row of `seq_len` tokens gets, where transformers would choose them
    per forward (module docstring)."""
    if parameters["rope_type"] == "dynamic":
        return _ntk_static(config, parameters, config.max_position_embeddings, seq_len)
    if parameters["rope_type"] == "longrope" and seq_len > parameters[ORIGINAL]:
        return {**parameters, "short_factor": list(parameters["long_factor"])}
    return parameters


def _ntk_static(config, parameters: dict, window: int, seq_len: int) -> dict:
    """Dynamic NTK `parameters` over a `window` as plain RoPE with the base transformers'
    `_compute_dynamic_ntk_parameters` computes for a row of `seq_len` tokens."""
    factor, dim = parameters["factor"], rotary_dim(config, parameters)
    length = max(seq_len, window)
    base = parameters["rope_theta"] * ((factor * length / window) - (factor - 1)) ** (dim / (dim - 2))
    return {"rope_type": "default", "rope_theta": base, **_carried(parameters)}


def window_note(run: Config, config) -> str | None:
    """The line a run prints once at its start when seq_len passes the positions the RoPE of `config` (the run's
    model config, `resolve_model_config(run.model, run)`) reaches, naming the settings that scale; None when it does
    not pass them."""
    if not getattr(config, "rope_parameters", None):
        return None
    reached = reach(config)
    if run.seq_len <= reached:
        return None
    how = (f"it is the checkpoint's RoPE: to scale it, rope.type=yarn (rope.factor=auto: "
           f"{run.seq_len / reached:.3g}), rope.type=llama3 or linear, or raise its base with rope.type=default "
           f"rope.theta=..." if run.rope.type == "checkpoint" else f"raise rope.factor to at least "
           f"{run.seq_len / original_window(config, next(iter(scaled_groups(config).values())), run.rope):.3g}")
    return (f"note: seq_len={run.seq_len} is {run.seq_len / reached:.3g}x the {reached} positions {run.model}'s RoPE "
            f"reaches: positions past {reached} train with rotations the model never saw; {how} "
            f"(docs/jobs/context-extension.md)")
