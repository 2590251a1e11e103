"""The numbers of a decoder-only model that memory depends on, read without torch or transformers.

A preset's numbers come from `longfit.models.presets.PRESETS`; a local model from its config.json
(multimodal checkpoints keep the language model under `text_config`; keys a Gemma 3 config leaves out
take Gemma3TextConfig's defaults). Parameter counts follow the transformers implementations of the
preset families (llama, mistral, qwen2, gemma3_text), torch-free and equal to transformers' count
(tests/test_plan_analytic.py); any other architecture's are counted on its model built on the meta device
by transformers (`counted_parameters`: experts, linear-attention and latent-attention layers included; a
few seconds, for the torch import), and its activations are traced off one decoder layer of each kind at its real
widths (plan/layer_trace.py). Local (sliding-window) layers are read the way
transformers assigns them: `layer_types` when the config lists them, else Gemma 3's every
`sliding_window_pattern`-th layer global, Qwen2's layers from `max_window_layers` on when
`use_sliding_window`, and every layer for other models with a `sliding_window`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from longfit.config import ConfigError

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma3_text": "gemma3", "gemma3": "gemma3"}
# Gemma3TextConfig's defaults, which the released multimodal checkpoints rely on in their text_config.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    sliding_window: int | None = None
    """Keys a local layer attends to (transformers' sliding_window, counting the query); None: no local layers."""
    local_layers: tuple[int, ...] = ()
    """Indices of the decoder layers that attend through the sliding window; the others are global."""
    counted: "CountedParameters | None" = None
    """Outside the preset families: the parameters of the model built on the meta device."""
    layer_kv_heads: tuple[int, ...] = ()
    """Each layer's key/value heads where the config varies them by layer (transformers' `per_layer_config`, Gemma 4's
    global layers); (): `kv_heads` in every layer."""
    layer_head_dims: tuple[int, ...] = ()
    """Each layer's head size where the config varies it by layer; (): `head_dim` in every layer. The memory model
    still plans every layer with `head_dim` (an approximation until the planner reads layers one by one)."""
    linear_value_heads: int | None = None
    """Value heads of the linear-attention (Gated DeltaNet) layers of a hybrid model; None: no such layers."""
    config_json: str = ""
    """The (text) config it was read from, model_type included: plan/layer_trace.py builds the model of it to trace
    its layers."""

    @property
    def family(self) -> str:
        """ "gemma3" (sandwich norms, q/k norms) or "llama" (one norm before attention and MLP; everything else)."""
        return FAMILIES.get(self.model_type, "llama")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one decoder layer, by module name."""
        h, f = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (counted: the largest, which FSDP2 gathers)."""
        if self.counted is not None:
            return self.counted.largest_layer
        weights = sum(i * o for i, o in self.linear_shapes().values())
        if self.model_type == "qwen2":  # q/k/v biases
            weights += self.q_dim + 2 * self.kv_dim
        if self.family == "gemma3":  # 4 sandwich norms + q_norm, k_norm
            return weights + 4 * self.hidden + 2 * self.head_dim
        return weights + 2 * self.hidden

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """lm_head parameters not shared with the embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """Everything outside the decoder layers: embeddings, final norm, untied lm_head."""
        if self.counted is not None:
            return self.counted.root
        return self.embed_params + self.head_params + self.hidden

    @property
    def params(self) -> int:
        if self.counted is not None:
            return self.counted.total
        return self.layers * self.layer_params + self.root_params

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters of `targets` in every layer: A (r x in) + B (out x r)."""
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (i + o) for name, (i, o) in shapes.items() if name in targets)

    def lora_base_linear_params(self, targets: list[str]) -> int:
        """Frozen base weights of the projections that receive adapters (what QLoRA quantizes)."""
        shapes = self.linear_shapes()
        return self.layers * sum(i * o for name, (i, o) in shapes.items() if name in targets)


@dataclass(frozen=True)
class CountedParameters:
    """A model's parameters as transformers builds it (each tied parameter once)."""

    total: int
    largest_layer: int
    """Of the decoder layers (MoE and dense layers differ)."""
    root: int
    """Outside the decoder layers."""
    largest_mlp: int = 0
    """Of the decoder layers' `mlp` modules (experts included): the gradients FSDP2 holds unsharded at a layer's
    backward peak."""


@functools.cache
def counted_parameters(name: str, config_json: str) -> CountedParameters | None:
    """The parameters of the causal LM of a config (`ModelShape.config_json`), built by transformers on the meta
    device; None when this transformers does not know its model_type (it is then planned as a Llama-style decoder).
    Counted once per config in a process: a plan's search for the longest seq_len reads the shape dozens of times
    (Qwen3-30B-A3B's 48 layers of 128 experts take 0.2 s to build)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.models.structure import decoder_layers

    values = json.loads(config_json)
    try:
        config = AutoConfig.for_model(values["model_type"], **{k: v for k, v in values.items() if k != "model_type"})
        config = config.get_text_config()
    except (ValueError, KeyError):
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ConfigError(f"model={name!r}: transformers cannot build a causal LM of its config ({e})") from e
    layers = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    total = sum(p.numel() for p in model.parameters())
    mlps = [sum(p.numel() for p in layer.mlp.parameters()) for layer in decoder_layers(model) if hasattr(layer, "mlp")]
    return CountedParameters(total, max(layers), total - sum(layers), max(mlps, default=0))


def _local_layers(model_type: str, values: dict, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding window, indices of the local layers) as transformers assigns them (module docstring)."""
    window = values.get("sliding_window")
    if model_type == "qwen2" and not values.get("use_sliding_window"):
        window = None
    if not window:
        return None, ()
    types = values.get("layer_types")
    if types is None and model_type == "gemma3_text":
        pattern = int(values["sliding_window_pattern"])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    elif types is None and model_type == "qwen2":
        first = int(values.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif types is None:
        types = ["sliding_attention"] * layers
    local = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return (int(window), local) if local else (None, ())


def _per_layer(values: dict, key: str, default: int, layers: int) -> tuple[int, ...]:
    """Each layer's `key` where transformers' `per_layer_config` ({"layer index": {key: value}}) overrides it in some
    layer, else ()."""
    overrides = {int(index): layer[key] for index, layer in (values.get("per_layer_config") or {}).items() if key in layer}
    return tuple(int(overrides.get(i, default)) for i in range(layers)) if overrides else ()


def shape_from_values(name: str, values: dict) -> ModelShape:
    values = values.get("text_config", values) if values.get("model_type") == "gemma3" else values
    if values.get("model_type") in ("gemma3", "gemma3_text"):
        values = {**GEMMA3_TEXT_DEFAULTS, **values, "model_type": "gemma3_text"}
    elif "hidden_size" not in values and isinstance(values.get("text_config"), dict):  # multimodal: its language model
        values = values["text_config"]
    values = {k: v for k, v in values.items() if k not in ("quantization_config", "auto_map")}  # not the architecture
    model_type = values.get("model_type", "")
    try:
        hidden = int(values["hidden_size"])
        heads = int(values["num_attention_heads"])
        layers = int(values["num_hidden_layers"])
        window, local_layers = _local_layers(model_type, values, layers)
        kv_heads = int(values.get("num_key_value_heads") or heads)
        head_dim = int(values.get("head_dim") or hidden // heads)
        config_json = json.dumps(values, sort_keys=True)
        return ModelShape(
            name=name,
            model_type=model_type,
            hidden=hidden,
            intermediate=int(values["intermediate_size"]),
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=int(values["vocab_size"]),
            tied_embeddings=bool(values.get("tie_word_embeddings", model_type.startswith("gemma"))),
            sliding_window=window,
            local_layers=local_layers,
            counted=None if model_type in FAMILIES else counted_parameters(name, config_json),
            layer_kv_heads=_per_layer(values, "num_key_value_heads", kv_heads, layers),
            layer_head_dims=_per_layer(values, "head_dim", head_dim, layers),
            linear_value_heads=(int(values["linear_num_value_heads"])
                                if "linear_attention" in (values.get("layer_types") or ()) else None),
            config_json=config_json,
        )
    except KeyError as e:
        raise ConfigError(f"model={name!r}: its config lacks {e.args[0]!r}") from e


def model_shape(model: str) -> ModelShape:
    """The shape of a preset name, a local Hugging Face directory, a GGUF file (its converted directory's), or
    (for planning only) a config.json file."""
    from longfit.models.presets import PRESETS
    from longfit.models.source import gguf_file, local_model_dir

    if model in PRESETS:
        return shape_from_values(model, PRESETS[model])
    plain_file = Path(model).is_file() and gguf_file(model) is None
    config = Path(model) if plain_file else local_model_dir(model) / "config.json"
    try:
        values = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model={model!r}: {config} is not valid JSON ({e})") from e
    return shape_from_values(model, values)
