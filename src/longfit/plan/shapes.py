"""The numbers of a decoder-only model that memory depends on, read through transformers' config objects
(`longfit.models.model_config`: attribute maps, defaults, an image-text checkpoint's language model, the tie its
class decides).

Parameter counts follow the transformers implementations of the preset families (llama, mistral, qwen2,
gemma3_text), equal to transformers' count (tests/test_plan_analytic.py); any other architecture's are counted on
its model built on the meta device by transformers (`counted_parameters`: experts, linear-attention and
latent-attention layers included; a few seconds, for the torch import; the one build its layer traces read too,
`meta_model`), which also gives the widths a config leaves ambiguous (a mixture of experts' MLP: Qwen3.5-MoE has
no `intermediate_size`) and whether every layer has an MLP the tiled MLP can run. Its activations are traced off
one decoder layer of each kind at its real widths (plan/layer_trace.py). Local (sliding-window) layers are the
config's `layer_types` as transformers assigns them (Gemma 3's every `sliding_window_pattern`-th layer global,
Qwen2's from `max_window_layers` on), every layer for a config with a `sliding_window` and no such list (Mistral).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from longfit.config import ConfigError

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma3_text": "gemma3"}


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
    untileable_mlp: str | None = None
    """Why the tiled MLP cannot run this model (a decoder layer without one MLP module); None: it can."""
    untileable_layers: str | None = None
    """Why tiled decoder layers cannot run this model (`longfit.models.linear_attention.untileable_layers`); None:
    they can."""
    layer_kv_heads: tuple[int, ...] = ()
    """Each layer's key/value heads where the config varies them by layer (transformers' `per_layer_config`, Gemma 4's
    global layers); (): `kv_heads` in every layer."""
    layer_head_dims: tuple[int, ...] = ()
    """Each layer's head size where the config varies it by layer; (): `head_dim` in every layer."""
    linear_value_heads: int | None = None
    """Value heads of the linear-attention (Gated DeltaNet) layers of a hybrid model; None: no such layers."""
    scan_chunk: int | None = None
    """Tokens of the chunks the linear-attention layers scan a sequence (and each tile of a tiled layer) in, padded
    to a whole number of them (models/linear_attention.CHUNK); None: no such layers."""
    index_topk: int | None = None
    """Keys a sparse indexed-attention layer selects per query (transformers' index_topk); None: dense attention."""
    kv_storing_layers: tuple[int, ...] = ()
    """The layers that store their keys and values for later layers (Gemma 3n's and Gemma 4's `kv_sharing_modes`: the
    last layer of each attention type before the shared ones, with or without shared ones); (): none."""
    per_layer_input_width: int | None = None
    """The width of each layer's slice of the per-layer inputs (Gemma 3n's and Gemma 4's
    `hidden_size_per_layer_input`); None: no per-layer inputs."""
    value_head_dim: int | None = None
    """The attention's value head width where it is not the head size (multi-head latent attention's v_head_dim,
    `longfit.models.attention.layer_widths`; DeepSeek's `head_dim` is its rotary part); None: the head size."""
    config_json: str = ""
    """The (text) config it was read from, model_type included: plan/layer_trace.py builds the model of it to trace
    its layers."""

    def value_width(self, layer: int | None = None) -> int:
        """The head width of `layer`'s attention output (None: the widest layer's): its value heads' width."""
        if self.value_head_dim:
            return self.value_head_dim
        if layer is None:
            return max((self.head_dim, *self.layer_head_dims))
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

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

    def stage_params(self, layers: range, first: bool, last: bool) -> int:
        """Parameters of a pipeline stage: its decoder `layers`, the embeddings on the `first` stage, the final norm
        and lm_head on the `last`."""
        if self.counted is not None:
            held = sum(self.counted.layer_params[i] for i in layers)
        else:
            held = len(layers) * self.layer_params
        return held + (self.embed_params if first else 0) + (self.root_params - self.embed_params if last else 0)

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
    intermediate: int = 0
    """The widest intermediate of the decoder layers' MLPs (a module's `intermediate_size` or `intermediate_dim`:
    an expert's, a shared expert's), for configs without an `intermediate_size`."""
    untileable_mlp: str | None = None
    """`longfit.memory.tiled_mlp.untileable_mlp` of the model."""
    layer_params: tuple[int, ...] = ()
    """Of each decoder layer, in order (a pipeline stage holds some of them)."""
    layer_experts: tuple[int, ...] = ()
    """Of each decoder layer, in order, the experts' weights that transformers' expert-parallel plan splits
    (parallel/expert.py; 0 in a dense layer, () for a model without a plan)."""
    untileable_layers: str | None = None
    """`longfit.models.linear_attention.untileable_layers` of the model."""

    def gathered(self, index: int, ep: int) -> int:
        """Parameters of decoder layer `index` that FSDP2 gathers under parallel.ep: its experts are split over ep
        ranks first, so it gathers 1/ep of them (`layer_params[index]` at ep = 1)."""
        experts = self.layer_experts[index] if self.layer_experts else 0
        return self.layer_params[index] - experts + experts // ep

    def gathered_layer(self, ep: int) -> int:
        """Parameters of the decoder layer that FSDP2 gathers most of under parallel.ep (`gathered`; `largest_layer`
        at ep = 1)."""
        if ep == 1 or not self.layer_experts:
            return self.largest_layer
        return max(self.gathered(index, ep) for index in range(len(self.layer_params)))

    def gathered_mlp(self, ep: int) -> int:
        """`largest_mlp` under parallel.ep: 1/ep of its experts (their gradients FSDP2 holds unsharded)."""
        experts = max(self.layer_experts, default=0)
        return self.largest_mlp - experts + experts // ep


@functools.cache
def counted_parameters(name: str, config_json: str) -> CountedParameters | None:
    """The parameters of the causal LM of a config (`ModelShape.config_json`), built by transformers on the meta
    device; None when this transformers does not know its model_type (it is then planned as a Llama-style decoder).
    Counted once per config in a process: a plan's search for the longest seq_len reads the shape dozens of times
    (Qwen3-30B-A3B's 48 layers of 128 experts take 0.2 s to build)."""
    from longfit.memory.tiled_mlp import untileable_mlp
    from longfit.models.linear_attention import untileable_layers

    try:
        config = text_config_of(config_json)
    except (ValueError, KeyError):
        return None
    try:
        model, _ = meta_model(config_json)
    except ValueError:  # its class refuses longfit's attention (the trace then takes a Llama-style decoder's layers)
        model = meta_model_of(name, config)
    return dataclasses.replace(count_parameters(model, lambda p: p.numel()), untileable_mlp=untileable_mlp(model),
                               untileable_layers=untileable_layers(model))


def text_config_of(config_json: str):
    """transformers' text config of a config (`ModelShape.config_json`). Raises ValueError or KeyError where this
    transformers does not know its model_type."""
    from transformers import AutoConfig

    values = json.loads(config_json)
    config = AutoConfig.for_model(values["model_type"], **{k: v for k, v in values.items() if k != "model_type"})
    return config.get_text_config()


def meta_model_of(name: str, config):
    """The causal LM transformers builds of a text `config` on the meta device, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ConfigError(f"model={name!r}: transformers cannot build a causal LM of its config ({e})") from e


_META_MODELS: dict[tuple[str, int | None], tuple] = {}


def meta_model(config_json: str, window: int | None = None):
    """(the causal LM, its text config) of a config (`ModelShape.config_json`), built by transformers on the meta
    device in fp32 and routed as loading routes it (models/loading.meta_model): longfit's attention, the
    linear-attention layers through longfit's kernels, which tiled decoder layers run (#52: Qwen3.5-27B's plan at
    32K), the indexer's blocks and selected keys (#57); `window`: its sliding window in place of the config's
    (plan/layer_trace.py `TraceKey.window`). Built once per process for every reader that leaves it as it is: the
    parameters counted here and the layer traces, which copy what they change (a cold plan built a 48-layer mixture
    of experts twice, #52). Raises ValueError where this transformers cannot build it or its class refuses
    longfit's attention."""
    if (config_json, window) not in _META_MODELS:
        _META_MODELS[config_json, window] = built_meta_model(config_json, window)
    return _META_MODELS[config_json, window]


def built_meta_model(config_json: str, window: int | None = None):
    """`meta_model`, built anew: for a reader that changes it (peft adds its adapters in place)."""
    import torch
    from transformers import AutoModelForCausalLM

    from longfit.models.attention import register_attention
    from longfit.models.linear_attention import prepare_linear_attention
    from longfit.models.sparse_attention import prepare_sparse_attention

    config = text_config_of(config_json)
    if window:  # through the config object, as ModelShape read it (its attribute map)
        config.sliding_window = window
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention(), dtype=torch.float32)
    prepare_linear_attention(model)
    prepare_sparse_attention(model)
    return model, config


def count_parameters(model, held) -> CountedParameters:
    """The parameters of `model` (a causal LM, or the peft model around one) that `held(parameter)` says one rank
    holds (its elements; 0: none), each tied parameter once; `untileable_mlp` and `untileable_layers` left unset."""
    from longfit.models.structure import decoder_layers
    from longfit.parallel.expert import expert_parallel_plan

    config = model.config.get_text_config()
    layers = [sum(held(p) for p in layer.parameters()) for layer in decoder_layers(model)]
    split = {id(model.get_parameter(name)) for name, style in expert_parallel_plan(model).items() if style == "grouped_gemm"}
    experts = [sum(held(p) for p in layer.parameters() if id(p) in split) for layer in decoder_layers(model)]
    total = sum(held(p) for p in model.parameters())
    mlps = [layer.mlp for layer in decoder_layers(model) if hasattr(layer, "mlp")]
    widths = [w for mlp in mlps for module in mlp.modules() for attribute in ("intermediate_size", "intermediate_dim")
              if isinstance(w := getattr(module, attribute, None), int)]
    if not widths:  # no module names it (GPT-2's MLP): the matrices' dimension other than the hidden size
        widths = [n for mlp in mlps for p in mlp.parameters() if p.dim() == 2 for n in p.shape if n != config.hidden_size]
    return CountedParameters(total, max(layers), total - sum(layers),
                             max((sum(held(p) for p in mlp.parameters()) for mlp in mlps), default=0),
                             max(widths, default=0), None, tuple(layers), tuple(experts) if any(experts) else ())


def _local_layers(text, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding window, indices of the local layers) as transformers assigns them (module docstring)."""
    from longfit.models.model_config import attribute

    window = attribute(text, "sliding_window")
    if not window:
        return None, ()
    types = getattr(text, "layer_types", None) or ["sliding_attention"] * layers
    local = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return (int(window), local) if local else (None, ())


def _per_layer(text, key: str, default: int) -> tuple[int, ...]:
    """Each layer's `key` where the config varies it by layer (transformers' `per_layer_config`), else ()."""
    from longfit.models.model_config import layer_values

    values = layer_values(text, key)
    return tuple(int(v or default) for v in values) if values else ()


def _scan_chunk(layer_types) -> int | None:
    """`ModelShape.scan_chunk` of a config whose `layer_types` are these."""
    if "linear_attention" not in layer_types:
        return None
    from longfit.models.linear_attention import CHUNK

    return CHUNK


def shape_from_values(name: str, values: dict) -> ModelShape:
    """The shape of a config.json's values (a preset's, a config file's; an image-text checkpoint's language model)."""
    from longfit.models.model_config import config_from_values

    try:
        return shape_from_config(name, config_from_values(values))
    except ConfigError as e:
        raise ConfigError(f"model={name!r}: {e}") from e


def shape_from_config(name: str, model_config) -> ModelShape:
    """The shape of a `longfit.models.model_config.ModelConfig`: its language model's, read by attribute."""
    from longfit.models.attention import layer_widths
    from longfit.models.model_config import attribute

    text = model_config.text
    model_type = text.model_type
    try:
        hidden, heads, layers, vocab = (int(attribute(text, key)) for key in
                                        ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"))
    except TypeError as e:
        raise ConfigError(f"model={name!r}: its {model_type} config lacks one of hidden_size, num_attention_heads, "
                          f"num_hidden_layers, vocab_size ({e})") from e
    window, local_layers = _local_layers(text, layers)
    kv_heads = int(attribute(text, "num_key_value_heads", heads))
    head_dim = int(attribute(text, "head_dim", hidden // heads))
    _, value_head_dim = layer_widths(text, head_dim)
    config_json = model_config.to_json()
    counted = None if model_type in FAMILIES else counted_parameters(name, config_json)
    intermediate = attribute(text, "intermediate_size") or (counted.intermediate if counted else None)
    if isinstance(intermediate, (list, tuple)):  # one per layer (Gemma 3n): the widest
        intermediate = max(intermediate)
    if not intermediate:
        raise ConfigError(f"model={name!r}: neither its {model_type} config nor the model transformers builds of it "
                          f"names an MLP width (intermediate_size)")
    types = getattr(text, "layer_types", None) or ()
    return ModelShape(
        name=name,
        model_type=model_type,
        hidden=hidden,
        intermediate=int(intermediate),
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        tied_embeddings=model_config.tied_embeddings,
        sliding_window=window,
        local_layers=local_layers,
        counted=counted,
        untileable_mlp=counted.untileable_mlp if counted else None,
        untileable_layers=counted.untileable_layers if counted else None,
        layer_kv_heads=_per_layer(text, "num_key_value_heads", kv_heads),
        layer_head_dims=_per_layer(text, "head_dim", head_dim),
        linear_value_heads=int(text.linear_num_value_heads) if "linear_attention" in types else None,
        scan_chunk=_scan_chunk(types),
        index_topk=int(index_topk) if (index_topk := attribute(text, "index_topk")) else None,
        kv_storing_layers=_kv_storing_layers(text),
        per_layer_input_width=int(width) if (width := attribute(text, "hidden_size_per_layer_input")) else None,
        value_head_dim=int(value_head_dim) if value_head_dim != head_dim else None,
        config_json=config_json,
    )


def _kv_storing_layers(text) -> tuple[int, ...]:
    """The layers that write their keys and values into the mapping the model hands every layer: Gemma 4's
    `kv_sharing_modes` "store" (the last layer of each attention type before the KV-shared ones, also when there are
    none, for an assistant model to read; Gemma 3n likewise); where a config has no such modes (an older
    transformers: 5.17's layers compute the same, `store_full_length_kv`), the last layer of each attention type
    before its `num_kv_shared_layers`."""
    modes = getattr(text, "kv_sharing_modes", None)
    if modes is not None:
        return tuple(i for i, mode in enumerate(modes) if mode == "store")
    shared = getattr(text, "num_kv_shared_layers", None)
    types = getattr(text, "layer_types", None)
    if shared is None or not types:
        return ()
    last = {kind: i for i, kind in enumerate(types[:len(types) - shared])}
    return tuple(sorted(last.values()))


def model_shape(model: str) -> ModelShape:
    """The shape of a preset name, a local Hugging Face directory, a GGUF file (its converted directory's), or
    (for planning only) a config.json file.

    Read once per config: a preset's or config.json's shape is kept in this process and on disk under
    `$XDG_CACHE_HOME/longfit/model_shapes`, keyed by the config's bytes (a preset: its name) and longfit's code digest
    (`longfit.models.cache.code_digest`: the library versions, whose config defaults fill what a file leaves out, and
    longfit's sources, presets included). Reading it imports transformers (and torch to count a model outside the
    preset families on the meta device), seconds that a plan read again (every `longfit plan`, `longfit train`'s
    preflight) would spend before any arithmetic; a GGUF file is read as it is."""
    source = _config_source(model)
    if source is None:
        return _read_shape(model)
    return dataclasses.replace(_cached_shape(model, source), name=model)


def _read_shape(model: str) -> ModelShape:
    from longfit.models.model_config import read_config

    return shape_from_config(model, read_config(model))


def _config_source(model: str) -> bytes | None:
    """What `read_config` reads of `model`, as bytes that identify it: a preset's name, a config.json's contents
    (a directory's or a loose file's); None for a GGUF file, read through its conversion."""
    from longfit.models.presets import PRESETS
    from longfit.models.source import PACKAGED_MODELS, gguf_file

    if model in PRESETS:
        return b"preset:" + model.encode()
    if model in PACKAGED_MODELS or gguf_file(model) is not None:
        return None
    path = Path(model).expanduser()
    try:
        if path.is_dir():
            return b"directory:" + (path / "config.json").read_bytes()
        if path.is_file():
            return b"file:" + path.read_bytes()
    except OSError:  # no config.json: read_config says what is missing
        return None
    return None


_SHAPES: dict[bytes, ModelShape] = {}


def _cached_shape(model: str, source: bytes) -> ModelShape:
    """The shape of `model`, whose config `source` identifies (`_config_source`): from this process, the disk cache,
    or read now."""
    from longfit.models.cache import cache_dir, code_digest, store_json

    if source in _SHAPES:
        return _SHAPES[source]
    path = cache_dir("model_shapes") / f"{hashlib.sha256(code_digest().encode() + source).hexdigest()}.json"
    try:
        shape = _shape_of_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # not read yet, or unreadable: read it again
        shape = _read_shape(model)
        store_json(path, dataclasses.asdict(shape))
    _SHAPES[source] = shape
    return shape


def _shape_of_json(values: dict) -> ModelShape:
    """A ModelShape from its `dataclasses.asdict` JSON (lists back to tuples)."""
    counted = values.pop("counted")
    return ModelShape(**_fields(values), counted=counted_of_json(counted) if counted else None)


def counted_of_json(values: dict) -> CountedParameters:
    """CountedParameters from its `dataclasses.asdict` JSON (lists back to tuples)."""
    return CountedParameters(**_fields(values))


def _fields(values: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
