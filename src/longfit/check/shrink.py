"""A shrunken copy of a model's architecture: one decoder layer of each kind it has, small widths, the same structure.

What stays: the model type and its code, the head structure (the query heads per key/value head, up to
MAX_GROUP), the kinds of layers and their order, windows shorter than the check's rows, softcaps, norms, rotary
settings (with the checkpoint's head_dim where RoPE parameters are sized by its rotated frequencies: LongRoPE's
factors, mRoPE's sections), biases, tied embeddings, experts (fewer of them), every flag of the config, the
relations between widths the model relies on (hidden_size = heads x head_dim where the config has it, widths equal
in the config stay equal, fields the config class derives from another left for it to derive). What shrinks: the
widths (`WIDTHS`, also where the config gives one per layer: Gemma 3n's intermediate sizes; a layer's own query
heads as the config's), the number of experts and of experts per token (`COUNTS`), the vocabulary (token ids beyond
it are dropped), windows as long as the rows or longer (`CHECK_WINDOW`), sub-configs (BLT's stacks: their widths,
all their layers), and the number of layers: the field that counts the layers the model builds
(`num_hidden_layers`, LongCat-Flash's `num_layers`), with the parts that must sum to it (Dory's input, recurrent and
output layers) cut alike; where no field counts them (BLT's stacks sit in sub-configs), the copy keeps every layer.

A layer's kind is read off the model itself, built on the meta device from the full config: the modules of the
layer (names and classes, so a dense MLP and a mixture of experts differ, and their boolean switches: Gemma 4's layers
that store keys and values for later ones differ from those that do not) and the layer's entry in every
per-layer list of the config (`layer_types`: sliding, full, chunked or linear attention; SmolLM3's
`no_rope_layers`; ...), in every list of layer indices (`mlp_only_layers`, Bamba's `attn_layer_indices`) and in
every setting keyed by layer index (Gemma 4's `per_layer_config`, its widths shrunk by the same factor as the config's own). The copy keeps
the first layer of each kind, in order, with those lists and settings cut to its layers. Where the config places kinds by index instead (DeepSeek's `first_k_dense_replace`, Qwen-MoE's
`decoder_sparse_step`), the copy keeps the shortest prefix of the layers that holds every kind. A count of the
model's last layers (Gemma 3n's and 4's `num_kv_shared_layers`) counts the copy's layers among them. Either way the
copy is built and its kinds compared with the ones asked for before anything runs.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from dataclasses import dataclass

import torch

# Widths of the copy: small enough that a step of every check takes well under a second on one CPU core, and
# unequal so that a transposed weight or a swapped dimension cannot go unnoticed.
WIDTHS = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "hidden_size_per_layer_input": 16,
    "d_head": 16,
    "ffn_hidden_size": 96,
    "index_head_dim": 24,
}
COUNTS = {  # at most this many (a count of one or none stays as it is)
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "zero_expert_num": 2,
    "index_n_heads": 4,
    "index_topk": 12,  # keys each query keeps (#57): fewer than the check's documents have, so the selection counts
}
ROUTED_BESIDE = ("zero_expert_num",)  # experts chosen among the routed ones: LongCat-Flash's, which output zero
ROUTED_GROUPS = ("n_group", "topk_group")  # None there: no grouped routing, not a count left unset
ROUTING = {  # experts chosen per token: the counts of experts they choose among
    "num_experts_per_tok": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_top_k": ("moe_num_experts",),
}
READ_KEYS = {"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "layer_types",
             *WIDTHS, *COUNTS, *ROUTING}
"""The config keys the copy is made of, read under these standard names (attribute maps name a config's own)."""
WINDOW_KEYS = ("sliding_window", "attention_chunk_size")
PART = "(part of the layers)"  # not a config key: which of the config's consecutive parts of the layers a layer is in
VOCAB = 512
MAX_KV_HEADS = 2  # two key/value heads: Ulysses over two cp ranks splits them
MAX_GROUP = 8  # query heads per key/value head
MAX_WHOLE_LAYERS = 128  # a copy of every layer, where fewer are not the same model (BLT's stacks): a step of 128
# layers of the copy's widths still takes seconds
CHECK_WINDOW = 21  # wider than a cp=2 ring chunk of 64-token rows (16), shorter than the longer documents (37, 40)
DROPPED = ("quantization_config", "auto_map", "architectures", "_name_or_path", "name_or_path")


@dataclass(frozen=True)
class LayerKind:
    """One decoder layer of the copy: what it stands for in the full model."""

    index: int
    """Its index in the copy."""
    name: str
    """Its `layer_types` entry, or the class of its mixer (e.g. `dense` or the MoE block's class)."""
    layers: tuple[int, ...]
    """The full model's layers of this kind."""

    def describe(self) -> str:
        return f"{self.name} (as {len(self.layers)} of the model's layers: {_ranges(self.layers)})"


@dataclass
class ShrunkConfig:
    config: object
    """The transformers config of the copy."""
    kinds: list[LayerKind]
    """Per layer of the copy (by index; under a prefix several layers may share a kind)."""
    full_layers: int
    notes: list[str]


def _ranges(indices: tuple[int, ...]) -> str:
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ", ".join(parts)


INDEX_LIST = re.compile(r"(layers|layer_(indices|ids|idxs)|attn_(indices|idxs))$")
"""The names of config lists of layer indices: `mlp_only_layers`, Llama 4's `moe_layers`, Bamba's
`attn_layer_indices`, LFM2's `full_attn_idxs`."""


def _index_list(key: str, value, layers: int) -> bool:
    """A config list of layer indices (`INDEX_LIST`): distinct ints below `layers`, in order."""
    return (bool(INDEX_LIST.search(key)) and isinstance(value, list) and all(isinstance(i, int) for i in value)
            and len(set(value)) == len(value) and all(0 <= i < layers for i in value) and value == sorted(value))


def _per_layer_lists(values: dict, layers: int) -> list[str]:
    """Config keys holding one entry per decoder layer (not a list of indices)."""
    return sorted(key for key, value in values.items() if isinstance(value, list) and len(value) == layers
                  and layers > 1 and not _index_list(key, value, layers))


def _per_layer_ints(value, layers: int) -> bool:
    return (isinstance(value, list) and len(value) == layers > 1
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))


def _rope_dicts(values: dict) -> list[dict]:
    """The config's RoPE parameter dicts: its one dict, or one per layer type (Gemma 3's)."""
    parameters = values.get("rope_parameters") or values.get("rope_scaling")
    if not isinstance(parameters, dict):
        return []
    nested = [p for p in parameters.values() if isinstance(p, dict)]
    return nested or [parameters]


def _rotary_sized(values: dict, head_dim: int | None) -> list[str]:
    """The RoPE parameters sized by the rotated dimensions of a head (transformers' int(head_dim x
    partial_rotary_factor)): lists of one number per rotated frequency (LongRoPE's `short_factor`, `long_factor`) and
    lists of sections summing to those frequencies (mRoPE's `mrope_section`)."""
    found = []
    for parameters in _rope_dicts(values) if head_dim else []:
        factor = parameters.get("partial_rotary_factor", values.get("partial_rotary_factor")) or 1.0
        frequencies = int(head_dim * factor) // 2
        for key, value in parameters.items():
            if (isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value)
                    and frequencies in (len(value), sum(value)) and key not in found):
                found.append(key)
    return found


def _layer_dicts(values: dict, layers: int) -> list[str]:
    """Config keys holding settings by layer index (Gemma 4's `per_layer_config`: {"05": {"head_dim": 512}})."""
    def by_layer(value) -> bool:
        return (isinstance(value, dict) and bool(value)
                and all(str(k).isdigit() and int(k) < layers and isinstance(v, dict) for k, v in value.items()))

    return sorted(key for key, value in values.items() if by_layer(value))


def _index_lists(values: dict, layers: int) -> list[str]:
    return sorted(key for key, value in values.items() if value and _index_list(key, value, layers))


def causal_lm(config, **kwargs) -> torch.nn.Module:
    """transformers' causal LM of `config`: AutoModelForCausalLM's, or for a multimodal model's text config that
    the mapping does not name (Emu3's, Mllama's), the mapping's class built on that config's class."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    for model_class in MODEL_FOR_CAUSAL_LM_MAPPING.values():
        if getattr(model_class, "config_class", None) is type(config):
            return model_class._from_config(config, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)  # raises transformers' own "Unrecognized" error


def _meta_layers(config) -> list[torch.nn.Module]:
    from longfit.models.structure import decoder_layers

    with torch.device("meta"):
        model = causal_lm(config, attn_implementation="eager")
    return list(decoder_layers(model))


def _structure(layer: torch.nn.Module) -> tuple:
    """The modules of a decoder layer, by name and class, with their switches: what makes a layer of one kind or
    another. Numbered entries (experts in a ModuleList) count once: the copy has fewer of them."""
    return tuple(dict.fromkeys((re.sub(r"\.\d+(?=\.|$)", ".#", name), type(module).__name__, _switches(module))
                               for name, module in layer.named_modules()))


def _switches(module: torch.nn.Module) -> tuple:
    """A module's boolean attributes, which its forward branches on: Gemma 4's `store_full_length_kv` marks the last
    layer of each attention type before the shared ones, whose keys and values they reuse (its modules are those
    of any other layer of its type)."""
    return tuple(sorted((key, value) for key, value in vars(module).items()
                        if isinstance(value, bool) and key != "training"))


def _layer_entries(values: dict, layers: int, lists: list[str], indices: list[str], dicts: list[str]) -> list[tuple]:
    """Per layer: its entry in each per-layer list, index list and layer-keyed dict of the config."""
    by_index = {key: {int(k): v for k, v in values[key].items()} for key in dicts}
    return [(tuple(repr(values[key][i]) for key in lists), tuple(i in values[key] for key in indices),
             tuple(repr(by_index[key].get(i)) for key in dicts)) for i in range(layers)]


def _signatures(config, values: dict, lists: list[str], indices: list[str], dicts: list[str],
                layers: list[torch.nn.Module] | None = None) -> list[tuple]:
    layers = _meta_layers(config) if layers is None else layers
    entries = _layer_entries(values, len(layers), lists, indices, dicts)
    return [(_structure(layer), *entries[i]) for i, layer in enumerate(layers)]


def _kind_name(layer_signature: tuple, values: dict, layers: int, index: int) -> str:
    """The layer's `layer_types` entry (with "experts" when it has them), else "experts" or "dense"."""
    experts = any("experts" in name for name, *_ in layer_signature[0])
    types = values.get("layer_types")
    kind = types[index] if isinstance(types, list) and len(types) == layers else None
    if kind is None:
        return "experts" if experts else "dense"
    return f"{kind}, experts" if experts else str(kind)


def _dropout(key: str) -> bool:
    return "dropout" in key or "pdrop" in key


def _attention_dropout(key: str) -> bool:
    """A dropout of the attention probabilities (attention_dropout, attn_pdrop, attention_probs_dropout_prob)."""
    return _dropout(key) and ("attention" in key or "attn" in key)


def _shrunk_values(values: dict, length: int, layers: int, notes: list[str]) -> dict:
    """`values` with the copy's widths, counts, windows and vocabulary, its sub-configs too (BLT's encoder,
    global and decoder stacks, whole); a field naming another config's hidden size (BLT's `hidden_size_global`)
    follows that config's."""
    widths: dict = {}
    values = _shrunk_level(values, length, layers, notes, widths)
    _follow_hidden_sizes(values, widths)
    return values


def _follow_hidden_sizes(values: dict, widths: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:
            _follow_hidden_sizes(value, widths)
        elif key not in WIDTHS and "hidden_size" in key and ("hidden_size", value) in widths:
            values[key] = widths["hidden_size", value]
        elif key not in WIDTHS and "hidden_size" in key and isinstance(value, int):  # a multiple of the hidden
            # size (Zamba's attention_hidden_size = 2 x hidden_size: its attention reads the concatenated embeddings)
            for entry, small in list(widths.items()):
                full = entry[1] if isinstance(entry, tuple) and entry[0] == "hidden_size" else None
                if full and value % full == 0 and value > full:
                    values[key] = value // full * small
                    break


def _shrunk_level(values: dict, length: int, layers: int, notes: list[str], widths: dict, prefix: str = "") -> dict:
    """One config's values shrunk (`_shrunk_values`); `widths`: the copy's width of each width of the config tree,
    so that widths equal in the config stay equal (DeepSeek-V3's head_dim and qk_rope_head_dim); `prefix`: where a
    sub-config sits, for the notes (`encoder_config.`)."""
    values = copy.deepcopy(values)
    for key in DROPPED:
        values.pop(key, None)
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    head_dim = values.get("head_dim")
    if heads:
        kv_heads = kv_heads or heads
        group = max(1, heads // kv_heads)
        values["num_key_value_heads"] = min(kv_heads, MAX_KV_HEADS)
        values["num_attention_heads"] = values["num_key_value_heads"] * min(group, MAX_GROUP)
        if group > MAX_GROUP:
            where = f" ({prefix.rstrip('.')})" if prefix else ""
            notes.append(f"{group} query heads per key/value head{where} checked as {MAX_GROUP}")
    original = dict(values)
    full_head = head_dim or (original.get("hidden_size") // heads if heads and original.get("hidden_size") else None)
    per_frequency = _rotary_sized(original, full_head)
    for key, width in WIDTHS.items():
        if isinstance(original.get(key), int) and original[key] > 0:  # a width of 0 turns its part off (Gemma 4's
            # hidden_size_per_layer_input in a config without per-layer inputs): it stays off
            values[key] = widths.setdefault(original[key], width)
        elif _per_layer_ints(original.get(key), layers):  # one width per layer (Gemma 3n's intermediate_size): the
            # layers' widths in the config's proportions
            largest = max(original[key])
            values[key] = [max(1, round(w * width / largest)) for w in original[key]]
    # The rotary width: LongRoPE's short and long factors hold one number per rotated frequency of the checkpoint's
    # heads, mRoPE's sections split those frequencies among time, height and width. Resampling them to a narrower
    # head would give the copy other frequencies than the run's (inv_freq_i = 1 / (factor_i * theta^(2i / rotated
    # dims)): both the factors and the exponents change), so the copy would check another RoPE. The copy keeps the
    # checkpoint's head_dim instead, and with it every frequency and factor as published: exact, at the cost of
    # wider heads (Phi-3.5-mini: 2 heads of 96, hidden 192 instead of 32).
    small_head = full_head if per_frequency else WIDTHS["head_dim"]
    if per_frequency:
        if isinstance(original.get("head_dim"), int):
            values["head_dim"] = full_head
        notes.append(f"{prefix}head_dim={full_head} kept: the RoPE's {', '.join(per_frequency)} are sized by the "
                     "rotated frequencies of its heads")
    for key in _per_layer_lists(original, layers):  # a layer's own query heads (Laguna): as many per key/value head
        # as the config's, up to MAX_GROUP, over the copy's key/value heads
        if key.startswith("num_attention_heads") and heads and _per_layer_ints(original[key], layers):
            values[key] = [values["num_key_value_heads"] * min(max(1, n // kv_heads), MAX_GROUP) for n in original[key]]
    for key in _layer_dicts(original, layers):
        for settings in values[key].values():  # a layer's own width: scaled as the config's own width of that name
            for name, width in settings.items():
                if name in WIDTHS and isinstance(width, int) and isinstance(original.get(name), int):
                    settings[name] = max(1, round(width * values[name] / original[name]))
    if isinstance(values.get("rotary_dim"), int) and full_head:  # GPT-J's, CodeGen's rotary part of each head
        values["rotary_dim"] = max(2, 2 * round(values["rotary_dim"] * small_head / full_head / 2))
    if isinstance(original.get("qk_nope_head_dim"), int) and isinstance(original.get("qk_rope_head_dim"), int):
        query_head = original["qk_nope_head_dim"] + original["qk_rope_head_dim"]  # a query head of MLA attention
        for key in [k for k, v in original.items() if k.endswith("head_dim") and v == query_head]:
            values[key] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]  # Dots3's head_dim, LongCat's
            # qk_head_dim
    if head_dim and values.get("query_pre_attn_scalar"):  # Gemma's attention scale: kept relative to head_dim
        values["query_pre_attn_scalar"] = max(1, round(values["query_pre_attn_scalar"] * small_head / head_dim))
    if heads and (not head_dim or heads * head_dim == original.get("hidden_size")):
        # hidden_size = heads x head_dim as in the config (head_dim derived from it, or Helium's o_proj mapping
        # hidden_size to hidden_size)
        values["hidden_size"] = values["num_attention_heads"] * values.get("head_dim", small_head)
    elif heads:  # configs check that the heads divide the hidden size, whatever head_dim is; rows of a multiple of
        # 8 values: torch's grouped matmul of the experts takes rows of 16 bytes only (Inkling 2's 6 heads: not 66)
        multiple = math.lcm(values["num_attention_heads"], 8)
        values["hidden_size"] = -(-values["hidden_size"] // multiple) * multiple
    if isinstance(original.get("hidden_size"), int):
        widths["hidden_size", original["hidden_size"]] = values["hidden_size"]
    for key, sub in values.items():  # a sub-config: its own layers, all of them
        if isinstance(sub, dict) and "model_type" in sub:
            values[key] = _shrunk_level(sub, length, sub.get("num_hidden_layers") or 0, notes, widths, f"{key}.")
    if values.get("linear_num_key_heads") and values.get("linear_num_value_heads"):
        ratio = max(1, values["linear_num_value_heads"] // values["linear_num_key_heads"])
        values["linear_num_key_heads"] = min(values["linear_num_key_heads"], MAX_KV_HEADS)
        values["linear_num_value_heads"] = values["linear_num_key_heads"] * min(ratio, MAX_GROUP)
    _shrink_state_space(original, values)
    for key, most in COUNTS.items():
        if isinstance(values.get(key), int) and values[key] > most:
            values[key] = most
    for key in WINDOW_KEYS:
        window = values.get(key)
        if isinstance(window, int) and window >= length // 2:
            values[key] = CHECK_WINDOW
            notes.append(f"{prefix}{key}={window} checked as {CHECK_WINDOW} (shorter than the check's rows of {length})")
    for key in [k for k in values if k.startswith("vocab_size") or k.endswith("_vocab")]:  # Gemma 4's
        # vocab_size_per_layer_input too, BLT's vocabulary of hashed byte n-grams (encoder_hash_byte_group_vocab)
        if isinstance(values[key], int):
            values[key] = VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids beyond the vocabulary: its last token
        token = values.get(key)
        if isinstance(token, list):
            values[key] = [min(t, VOCAB - 1) if isinstance(t, int) else t for t in token]
        elif isinstance(token, int):
            values[key] = min(token, VOCAB - 1)
    for key, value in list(values.items()):  # the attention's dropout stays: longfit's attention refuses it
        if (_dropout(key) and not _attention_dropout(key) and isinstance(value, (int, float))
                and not isinstance(value, bool) and value):
            values[key] = 0.0
            notes.append(f"{prefix}{key}={value} checked as 0 (dropout draws random masks; transformers' own modules apply "
                         "it in training, as without longfit)")
    values["use_cache"] = False
    return values


STATE_SPACE = {"heads": 4, "groups": 2, "state": 16, "chunk": 16, "rank": 8}
"""A Mamba layer's sizes in the copy: 4 heads in 2 groups (each group serves 2 heads), state 16, SSD chunks of 16
tokens (shorter than the check's documents: the chunk boundaries and the state carried over them are crossed), a
time-step projection of rank 8."""


def _state_space_key(key: str) -> bool:
    return "mamba" in key or "ssm" in key


def _shrink_state_space(original: dict, values: dict) -> None:
    """The sizes of a config's Mamba (state-space) layers, shrunk consistently (`STATE_SPACE`), read generically: a
    state-space config names its keys `mamba_*` / `*ssm*` or, for a pure Mamba model, has `state_size`. The inner width
    is heads x head_dim = expand x hidden_size (or the config's `*d_ssm` width where it sets one): a pair of int keys
    (`...heads`, `...head_dim` / `...d_head` / `...headdim`) whose product is that width keeps it in the copy."""
    if not any(_state_space_key(k) for k in original) and "state_size" not in original:
        return
    expand = next((original[k] for k in original if k.endswith("expand") and isinstance(original[k], int)), None)
    hidden, small_hidden = original.get("hidden_size"), values.get("hidden_size")
    d_ssm = next((k for k in original if k.endswith("d_ssm") and isinstance(original[k], int)), None)
    width = original[d_ssm] if d_ssm else expand * hidden if expand and isinstance(hidden, int) else None
    small_width = (expand or 2) * small_hidden if isinstance(small_hidden, int) else None
    if d_ssm and small_width:
        values[d_ssm] = small_width
    heads_keys = [k for k in original if k.endswith("heads") and isinstance(original[k], int) and "attention" not in k
                  and "key_value" not in k]
    dim_keys = [k for k in original if re.search(r"head_?dim$|d_head$", k) and isinstance(original[k], int)]
    for heads in heads_keys:
        for dim in dim_keys:
            if width and small_width and original[heads] * original[dim] == width and original[heads] > 1:
                values[heads] = min(original[heads], STATE_SPACE["heads"])
                values[dim] = small_width // values[heads]
    for key, value in original.items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if key.endswith("groups") and (_state_space_key(key) or key == "n_groups") and value > 1:
            values[key] = STATE_SPACE["groups"]
        elif key.endswith(("d_state", "state_size")) and value > STATE_SPACE["state"]:
            values[key] = STATE_SPACE["state"]
        elif key.endswith("chunk_size") and key != "chunk_size_feed_forward" and value > STATE_SPACE["chunk"]:
            values[key] = STATE_SPACE["chunk"]
        elif key.endswith(("dt_rank", "time_step_rank")) and value > STATE_SPACE["rank"]:
            values[key] = STATE_SPACE["rank"]


def _attribute_map(model_type: str) -> dict[str, str]:
    """transformers' names for the config's own keys: {"num_hidden_layers": "n_layer", ...} (GPT-2 style configs)."""
    from transformers import CONFIG_MAPPING

    return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", {}))


@functools.lru_cache(maxsize=None)
def _derived_fields(config_class: type) -> dict[str, str]:
    """Fields the config class fills from a standard one when they are left unset: {"embedding_dim": "hidden_size",
    "num_blocks": "num_hidden_layers"} for xLSTM. Found by building the class with the standard field doubled:
    a field that followed it is derived from it."""
    try:
        defaults = config_class().to_dict()
    except Exception:  # noqa: BLE001 -- a config class that needs arguments derives nothing we can find
        return {}
    derived = {}
    for standard in ("num_hidden_layers", "hidden_size"):
        value = defaults.get(standard)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        try:
            doubled = config_class(**{standard: 2 * value}).to_dict()
        except Exception:  # noqa: BLE001 -- the doubled value is invalid for this class: nothing found
            continue
        derived.update({key: standard for key, own in defaults.items()
                        if key != standard and own == value and doubled.get(key) == 2 * value})
    return derived


def _standard_values(config) -> dict:
    """The config's values under transformers' standard names (`num_hidden_layers`, not GPT-2's `n_layer`: the
    config class's attribute map), each read through the config object: a field the default config leaves None
    (Ministral's head_dim) is what the model code reads. A field the class derives from a standard one and that
    still equals it (xLSTM's `embedding_dim`) is left out: the copy's class derives it from the copy's value."""
    values = config.to_dict()
    for standard, own in _attribute_map(config.model_type).items():
        if own in values and standard in READ_KEYS:  # not the other way round (Exaone maps num_layers to its field)
            values[standard] = values.pop(own)
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size"):
        try:
            value = getattr(config, key, None)
        except Exception:  # noqa: BLE001 -- a per-layer attribute of a heterogeneous config (Dots3): its own entry
            continue
        if values.get(key, 0) is None and isinstance(value, int) and not isinstance(value, bool):
            values[key] = value
    for key, value in list(values.items()):  # a count or list serialized otherwise than the model reads it
        # (Dory writes an attention and an MLP block per layer: its layer counts and layer_types doubled)
        if not isinstance(value, (int, list)) or isinstance(value, bool):
            continue
        try:
            own = getattr(config, key, None)
        except Exception:  # noqa: BLE001 -- a per-layer attribute of a heterogeneous config (Dots3): its own entry
            continue
        if isinstance(own, type(value)) and not isinstance(own, bool) and own != value:
            values[key] = own
    for key, standard in _derived_fields(type(config)).items():
        if key in values and values[key] == values.get(standard):
            del values[key]
    return values


def _layer_parts(values: dict, layers: int) -> list[str]:
    """Fields that split the layers into consecutive parts, in the config's order, and sum to them (Dory's
    `n_input_layers`, `n_recurrent_layers`, `n_output_layers`: its config's validator checks the sum)."""
    fields = [key for key, value in values.items() if "layers" in key and key != "num_hidden_layers"
              and isinstance(value, int) and not isinstance(value, bool) and 0 < value < layers]
    return fields if len(fields) > 1 and sum(values[key] for key in fields) == layers else []


def _with_parts(values: dict, parts: list[str]) -> dict:
    """`values` with the part of each layer as one more per-layer list (`PART`): a layer's kind includes its part."""
    return {**values, PART: [p for p, key in enumerate(parts) for _ in range(values[key])]} if parts else values


def _without_parts(values: dict, parts: list[str]) -> dict:
    """The copy's values: each part as many layers as the copy keeps of it."""
    if not parts:
        return values
    values = dict(values)
    kept = values.pop(PART)
    return {**values, **{key: kept.count(p) for p, key in enumerate(parts)}}


def _layer_count_field(values: dict, layers: int) -> str | None:
    """The config field that sets the number of decoder layers the model builds: `num_hidden_layers`, else the one
    field named for layers that holds that number (LongCat-Flash's `num_layers`, HRM's `num_layers_per_stack`).
    None where no field holds it (BLT: its stacks are sub-configs)."""
    if values.get("num_hidden_layers") == layers:
        return "num_hidden_layers"
    fields = [key for key, value in values.items() if "layers" in key and value == layers
              and isinstance(value, int) and not isinstance(value, bool)]
    return fields[0] if len(fields) == 1 else None


def _make(values: dict):
    from transformers import AutoConfig

    values = copy.deepcopy(values)  # transformers edits nested rope dicts in place
    model_type = values.pop("model_type")
    for standard, own in _attribute_map(model_type).items():
        if standard in values and standard in READ_KEYS:
            values[own] = values.pop(standard)
    for key in _computed_attributes(model_type, values):
        del values[key]
    return AutoConfig.for_model(model_type, **values)


def _computed_attributes(model_type: str, values: dict) -> list[str]:
    """Keys of `values` that the config class computes itself from its fields, in __post_init__ (Zamba2's
    hybrid_layer_ids from layers_block_type, its mamba_headdim): given back, such a key would keep the full model's
    value, since the class sets the keyword arguments it does not know after computing its own. Found as the keys
    that are not fields of the (dataclass) config class, that the class builds without being given, and whose value
    the shrink left as the class's default config has it (a value the shrink chose -- Gemma 4's layer_types with one
    layer of each kind, a MoE's expert count -- stays)."""
    import dataclasses

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    if not dataclasses.is_dataclass(config_class):
        return []
    fields = {field.name for field in dataclasses.fields(config_class)}
    default = AutoConfig.for_model(model_type).to_dict()
    others = [key for key in values if key not in fields and not key.startswith("_") and values[key] == default.get(key)]
    if not others:
        return []
    try:
        built = AutoConfig.for_model(model_type, **{k: v for k, v in values.items() if k not in others})
    except Exception:  # noqa: BLE001 -- the class needs them: they are its arguments
        return []
    return [key for key in others if key in built.to_dict()]


def _tail_counts(values: dict, layer_field: str | None, parts: list[str], layers: int) -> list[str]:
    """Config fields that may count the model's last layers (Gemma 3n's and 4's `num_kv_shared_layers`: the last N
    layers reuse the keys and values of an earlier one): ints named for layers, more than none and fewer than all,
    other than the layer count and its parts. A copy keeping fewer layers tries them as such counts only where they
    as they are do not give its layers their kinds: the kinds of the copy's layers, built, decide."""
    return [key for key, value in values.items() if "layers" in key and type(value) is int and 0 < value < layers
            and key != layer_field and key not in parts]


def _tail_counted(values: dict, counts: list[str], layers: int, keep: list[int]) -> dict:
    """`values` with each of `counts` the number of the kept layers `keep` among the model's last that many."""
    return {**values, **{key: sum(i >= layers - values[key] for i in keep) for key in counts}}


def _select(values: dict, layer_field: str | None, lists: list[str], indices: list[str], dicts: list[str],
            keep: list[int]) -> dict:
    values = dict(values, **{layer_field: len(keep)}) if layer_field else dict(values)
    for key in dicts:
        width = max(len(str(k)) for k in values[key])  # "05": keys written with leading zeros keep them
        entries = {int(k): v for k, v in values[key].items()}
        values[key] = {str(j).zfill(width): entries[i] for j, i in enumerate(keep) if i in entries}
    for key in lists:
        values[key] = [values[key][i] for i in keep]
    for key in indices:
        values[key] = [j for j, i in enumerate(keep) if i in values[key]]
    return values


class ModelFails(ValueError):
    """transformers cannot build the model of the config itself (before any shrinking)."""

    def __init__(self, error: Exception, model_type: str | None = None):
        model = f"the {model_type} model" if model_type else "the model"
        super().__init__(f"transformers cannot build {model} of this config as it is, unshrunk "
                         f"({first_line(error)}): its own from_config fails before longfit changes anything")


def first_line(error: Exception) -> str:
    """The error's first line, and the one after it where the first announces it (pydantic-style validation)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(error).__name__}: {text}"


def shrink_config(config, length: int) -> ShrunkConfig:
    """The copy of `config` (a transformers text config) for rows of `length` tokens (module docstring).

    A config whose model transformers cannot build is ModelFails; one longfit refuses (its decoder layers cannot
    be found) a ConfigError; one whose copy cannot be built a ValueError saying so."""
    from longfit.config import ConfigError

    notes: list[str] = []
    try:
        config = _completed(config, notes)
        config, layers = _built(config, notes)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever transformers raises: its own model of the config fails
        raise ModelFails(e, config.model_type) from e
    try:
        return _shrink(config, layers, length, notes)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever transformers raises on the smaller config
        raise ValueError(f"longfit check cannot build a shrunken copy of this {config.model_type} config: "
                         f"{first_line(e)}") from e


def _completed(config, notes: list[str]):
    """`config` with the widths a default config leaves None (Ministral's and Hunyuan's head_dim, Nemotron's
    num_key_value_heads) derived as the model code of most families derives them: head_dim = hidden_size / heads,
    as many key/value heads as query heads; expert counts left None (DeepSeek-V2's experts per token), the copy's
    (`COUNTS`). A checkpoint's config sets them."""
    values = _standard_values(config)
    heads = values.get("num_attention_heads")
    filled = {}
    if heads and "head_dim" in values and values["head_dim"] is None:
        filled["head_dim"] = values["hidden_size"] // heads
    if heads and "num_key_value_heads" in values and values["num_key_value_heads"] is None:
        filled["num_key_value_heads"] = heads
    for key in ("n_routed_experts", "num_experts_per_tok"):  # DeepSeek-V2's and dots1's default configs: experts
        if key in values and values[key] is None:
            filled[key] = COUNTS[key]
    if not filled:
        return config
    notes.append(f"the config leaves {', '.join(filled)} None: checked as {', '.join(f'{k}={v}' for k, v in filled.items())}")
    return _make({**values, **filled})


def _built(config, notes: list[str]) -> tuple[object, list[torch.nn.Module]]:
    """`config` once transformers builds its model (on the meta device), and that model's decoder layers: as it is,
    or, where that fails and it leaves counts of experts None (dots1's default config: experts, experts per token,
    shared experts), with the copy's counts (`COUNTS`) for them. A None count the model builds without (Gemma 4's
    `num_experts`: no mixture of experts) stays None."""
    try:
        return config, _meta_layers(config)
    except Exception:
        values = _standard_values(config)
        unset = {key: COUNTS[key] for key in COUNTS if key in values and values[key] is None and key not in ROUTED_GROUPS}
        if not unset:
            raise
    counted = _make({**values, **unset})
    try:
        layers = _meta_layers(counted)
    except Exception:  # noqa: BLE001 -- the counts were not what failed: the first error is the one to tell
        _meta_layers(config)
        raise
    notes.append(f"the config leaves {', '.join(unset)} None: checked as "
                 f"{', '.join(f'{k}={v}' for k, v in unset.items())}")
    return counted, layers


def _shrink(config, layers: list[torch.nn.Module], length: int, notes: list[str]) -> ShrunkConfig:
    """The copy of `config`, whose model's decoder layers are `layers` (built once: a meta-device model of the
    whole depth costs up to a third of a second)."""
    values = _standard_values(config)
    full_layers = len(layers)
    layer_field = _layer_count_field(values, full_layers)
    if layer_field is None:  # no field counts the model's layers: only a copy of every layer can be written
        lists, indices, dicts = [], [], []
    parts = _layer_parts(values, full_layers) if layer_field == "num_hidden_layers" else []
    values = _with_parts(values, parts)
    if layer_field is not None:
        lists, indices = _per_layer_lists(values, full_layers), _index_lists(values, full_layers)
        dicts = _layer_dicts(values, full_layers)
    signatures = _signatures(config, values, lists, indices, dicts, layers)
    first: dict[tuple, int] = {}
    for index, signature in enumerate(signatures):
        first.setdefault(signature, index)
    members = {sig: tuple(i for i, s in enumerate(signatures) if s == sig) for sig in first}
    small = _shrunk_values(values, length, full_layers, notes)
    wanted = list(first)

    candidates = [list(first.values()), list(range(max(first.values()) + 1))] if layer_field else []
    if full_layers <= MAX_WHOLE_LAYERS:
        candidates.append(list(range(full_layers)))
    failure = None
    tails = _tail_counts(small, layer_field, parts, full_layers)
    for keep in dict.fromkeys(map(tuple, candidates)):
        keep = list(keep)
        selected = _select(small, layer_field, lists, indices, dicts, keep)
        # the config's counts as they are, else each a count of the model's last layers (`_tail_counts`)
        for chosen in [selected, _tail_counted(selected, tails, full_layers, keep)][:1 + bool(tails)]:
            try:
                candidate = _make(_without_parts(chosen, parts))
                got = _signatures(candidate, _with_parts(_standard_values(candidate), parts), lists, indices, dicts)
            except Exception as e:  # noqa: BLE001 -- a config that ties its layers together (a validator)
                failure = e
                continue
            small_entries = _layer_entries(small, full_layers, lists, indices, dicts)  # widths in them shrunk
            expected = [(signatures[i][0], *small_entries[i]) for i in keep]
            if got != expected:
                continue
            kinds = [LayerKind(j, _kind_name(signatures[i], values, full_layers, i), members[signatures[i]])
                     for j, i in enumerate(keep)]
            if len(keep) == full_layers:
                why = "" if layer_field else " (no field of the config counts the layers the model builds)"
                notes.append(f"a copy with fewer layers is not the same model{why}: all {full_layers} layers are "
                             "checked")
            elif len(keep) > len(wanted):
                notes.append(f"the config places its layer kinds by index: the first {len(keep)} layers are checked")
            notes.extend(f"{key}={small[key]} checked as {chosen[key]}, the copy's layers among the model's last "
                         f"{small[key]}" for key in tails if chosen[key] != small[key])
            return ShrunkConfig(candidate, kinds, full_layers, notes)
    if failure is not None:
        raise failure
    raise ValueError(
        f"{values.get('model_type')}: a copy with fewer layers does not have the same kinds of layers "
        f"({len(wanted)} kinds among {full_layers} layers); longfit check cannot shrink this config"
    )


def every_expert(config) -> dict | None:
    """The values of `config` (a copy) with every expert chosen for every token (`ROUTING`), None where it has no
    mixture of experts choosing fewer, or where its config class refuses more (Zaya's validation: one expert per
    token only): compared under its own routing then."""
    values = _standard_values(config)
    changed = False
    for per_token, counts in ROUTING.items():
        count = next((values[key] for key in counts if isinstance(values.get(key), int)), None)
        if count:
            count += sum(values.get(key) or 0 for key in ROUTED_BESIDE)
        if isinstance(values.get(per_token), int) and count and values[per_token] < count:
            values[per_token] = count
            changed = True
    if not changed:
        return None
    try:
        return _make(values).to_dict()
    except Exception:  # noqa: BLE001 -- the class's own validation of its routing (huggingface_hub's strict dataclass)
        return None

