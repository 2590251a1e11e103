"""A model's configuration, read once through transformers' own config objects: for the trainer, the planner and
`longfit check`.

A model is a preset name, a local Hugging Face directory, a GGUF file (its converted directory) or, for planning
only, a config.json file. Its config is what transformers reads (`AutoConfig.from_pretrained`, `AutoConfig.for_model`
for presets and loose config.json files), so every architecture question is an attribute of a transformers config:
attribute maps answer `num_hidden_layers` on GPT-2's `n_layer`, defaults fill what a config.json leaves out.

A checkpoint whose config has a language model inside (an image-text wrapper: `Qwen3_5ForConditionalGeneration`,
`Gemma3ForConditionalGeneration`, `Mistral3ForConditionalGeneration`, ...) trains as that language model:
`ModelConfig.text` is its config (`get_text_config()`), `ModelConfig.config` the wrapper's, which the export
writes back. Whether lm_head shares the embedding is the checkpoint class's decision, not a key of the text config:
Mistral 3 ties through the wrapper's top-level `tie_word_embeddings` while its text config says false. The wrapper
class is built on the meta device and asked (`tied_embeddings`); the text config longfit trains gets that answer.

transformers is imported inside the functions: `longfit plan --help` imports no torch.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from longfit.config import ConfigError

NOT_ARCHITECTURE = ("quantization_config", "auto_map")
"""Config keys that describe how weights are stored or where code lives, not the model's shape."""


@dataclass(frozen=True)
class ModelConfig:
    """A model's transformers configs."""

    config: object
    """The checkpoint's own config: the wrapper's for an image-text checkpoint, else the causal LM's (`text`)."""
    text: object
    """The language model's config, which longfit trains: `config.get_text_config()`, a copy whose
    `tie_word_embeddings` says whether the checkpoint's class ties lm_head to the embeddings."""
    architecture: str
    """The transformers class the checkpoint is saved for (`architectures[0]`, else transformers' class for its type)."""

    @property
    def is_wrapper(self) -> bool:
        """The language model sits inside another model (an image-text wrapper) that the export writes back."""
        return self.text is not self.config

    @property
    def tied_embeddings(self) -> bool:
        return bool(getattr(self.text, "tie_word_embeddings", False))

    def model_class(self):
        """The transformers class of the checkpoint (the wrapper's for an image-text checkpoint)."""
        return checkpoint_class(self.config)

    def to_json(self) -> str:
        """The language model's config as transformers' `for_model` takes it back (model_type included), keys sorted:
        an identity for caches and the planner's traces."""
        values = {k: v for k, v in self.text.to_diff_dict().items() if k not in NOT_ARCHITECTURE}
        values.pop("transformers_version", None)
        return json.dumps({**values, "model_type": self.text.model_type}, sort_keys=True)


def config_from_values(values: dict) -> ModelConfig:
    """The configs of a config.json's values (a preset's, or a config file's): `AutoConfig.for_model(model_type)`."""
    from transformers import AutoConfig

    values = {k: v for k, v in copy.deepcopy(values).items() if k not in NOT_ARCHITECTURE}
    if "model_type" not in values:
        raise ConfigError("the config names no model_type: transformers cannot tell which architecture it describes")
    try:
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"transformers cannot read the config ({e})") from e
    return of_config(config)


def of_config(config) -> ModelConfig:
    """The configs of a transformers config (a wrapper's or a causal LM's)."""
    text = config.get_text_config(decoder=True)
    architecture = (getattr(config, "architectures", None) or [None])[0] or checkpoint_class(config).__name__
    if text is config:
        return ModelConfig(config, config, architecture)
    text = copy.deepcopy(text)
    text.tie_word_embeddings = tied_embeddings(config)
    return ModelConfig(config, text, architecture)


def read_config(model: str) -> ModelConfig:
    """The configs of `model`: a preset name, a local directory with config.json, a GGUF file (its converted
    directory), or for planning only a config.json file."""
    from longfit.models.presets import PRESETS
    from longfit.models.source import gguf_file, local_model_dir

    if model in PRESETS:
        return config_from_values(PRESETS[model])
    path = Path(model).expanduser()
    if path.is_file() and gguf_file(model) is None:  # a loose config.json: read as from_pretrained reads one
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"model={model!r}: {path} is not valid JSON ({e})") from e
        try:
            return config_from_values(values)
        except ConfigError as e:
            raise ConfigError(f"model={model!r}: {e}") from e
    directory = local_model_dir(model)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model={model!r}: transformers cannot read {directory / 'config.json'} ({e})") from e
    return of_config(config)


def checkpoint_class(config):
    """The transformers class a config's checkpoint is for: its `architectures[0]` when transformers has that class,
    else transformers' image-text class of its type, else its causal-LM class."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    named = (getattr(config, "architectures", None) or [None])[0]
    if named and hasattr(transformers, named):
        return getattr(transformers, named)
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise ConfigError(f"transformers has no model class for a {config.model_type} config that longfit could train")


def tied_embeddings(config) -> bool:
    """Whether the checkpoint's class ties its output embedding (lm_head) to the input embedding, as transformers
    decides it: the class built on the meta device (its `_tied_weights_keys` under the config's own
    `tie_word_embeddings`, every sub-model's included)."""
    return _tied(checkpoint_class(config).__name__, config.to_json_string(use_diff=False))


@functools.cache
def _tied(class_name: str, config_json: str) -> bool:
    import torch
    import transformers

    values = json.loads(config_json)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    try:
        with torch.device("meta"):
            model = getattr(transformers, class_name)._from_config(config)
    except Exception as e:  # noqa: BLE001 -- e.g. Emu3's default config, without the vocabulary map its class reads
        raise ConfigError(f"transformers cannot build the {config.model_type} model of this config ({class_name}: "
                          f"{type(e).__name__}: {e})") from e
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return output is not None and embedding is not None and output.weight is embedding.weight


def attribute(config, name: str, default=None):
    """`config.name` read as transformers reads it (attribute maps: GPT-2's `n_layer` answers `num_hidden_layers`);
    for an attribute a heterogeneous config varies by layer (Gemma 4's `per_layer_config`), the value of the layers
    that do not override it. `default` where the config has no such attribute or it is None."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        value = config._getattr_without_heterogeneous_validation(name, None)
    else:
        value = getattr(config, name, None)
    return default if value is None else value


def layer_values(config, name: str) -> tuple | None:
    """Each decoder layer's `name` where the config varies it by layer (`per_layer_config`), else None."""
    if name not in (getattr(config, "per_layer_attributes", None) or ()):
        return None
    return tuple(getattr(layer, name) for layer in config.per_layer_config)
