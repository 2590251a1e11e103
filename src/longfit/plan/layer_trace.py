"""Activation costs of an architecture outside the preset families, traced off its own decoder layers.

The analytic planner needs, per decoder layer, the bytes per token its forward keeps for the backward
(`saved`, without its input), whether autograd keeps the input (`input_kept`), and how high its forward and
backward working sets rise (`forward_peak`, `backward_peak`). For a model outside the preset families (whose
costs are still read from plan/layer_costs.py) they are measured here on the model itself:
transformers builds it on the meta device at its real widths (every layer kind: MoE and dense, sliding and
full, linear and softmax attention), longfit applies the run's regime and techniques in `parallelize`'s order
(LoRA, context parallelism on a fake process group, checkpointing, tiled MLP; tensor parallelism admits only
preset families), and ONE layer of each kind runs forward and backward on fake tensors (no memory, no
compute), fed the arguments the model's own forward gives it (rotary tables, masks, per-layer inputs),
captured by running the model with its layers skipped.

Nothing in a layer is quadratic in the sequence (longfit's attention is blockwise, windows are bounded), so
each quantity is a + b L in the tokens L of a rank. Each kind is traced at three lengths; the line through
the outer two must meet the middle one within `LINEAR_TOLERANCE`, else the plan is refused in one line naming
the layer: a cost that is not linear would be extrapolated wrongly. A plan of fewer tokens than the three
lengths need is traced at its own length instead.

The costs are cached by (architecture, regime, techniques, traced lengths): in this process, and on disk
under `$XDG_CACHE_HOME/longfit/layer_costs` (`~/.cache/...`), keyed also by the versions of torch,
transformers and peft and by a digest of longfit's own sources, so that any change to what runs in a layer
traces again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from longfit.config import ConfigError

# The shortest traced length, unless the plan's own tokens are fewer: 16 x 67 tokens. 16 divides it into a ring's
# chunks; the prime 67 keeps every token dimension of the traced lengths (chunks) off the model's widths,
# which are multiples of powers of two: a tensor shaped like a parameter is counted as one (`ActivationBytes`),
# and at 3,072 tokens a (3072, 256) activation of llama-tiny (intermediate 3,072) would be taken for a weight.
BASE_LENGTH = 16 * 67
LINEAR_TOLERANCE = 0.01  # of the quantity at the longest length
QUANTITIES = ("saved", "forward_peak", "backward_peak")


@dataclass(frozen=True)
class LayerCosts:
    """One layer kind's costs: bytes = per_token x L + fixed, at L tokens of a rank."""

    per_token: dict[str, float]
    fixed: dict[str, float]
    input_kept: bool

    def at(self, tokens: int) -> dict:
        """The analytic planner's entry (bytes per token) at `tokens` tokens of a rank."""
        return {"input_kept": self.input_kept,
                **{q: self.per_token[q] + self.fixed[q] / tokens for q in QUANTITIES}}


@dataclass(frozen=True)
class TraceKey:
    """What a layer's costs depend on besides the tokens: the architecture, the regime and the techniques."""

    config_json: str
    regime: str
    lora_rank: int  # 0: no LoRA
    lora_dropout: float  # peft's dropout keeps a dropped copy of each adapted input
    lora_targets: tuple[str, ...]
    checkpointed: int  # the first layers
    tiles: int  # 0: no tiled MLP
    cp: int
    cp_method: str | None
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class Traced:
    """The costs of one TraceKey: the kind (its traced layer's index) of each decoder layer, each kind's costs, and
    why the layers were traced as a Llama-style decoder's of the same widths (None: they were not)."""

    kind_of: list[int]
    costs: dict[int, LayerCosts]
    untraced: str | None = None


_CACHE: dict[TraceKey, Traced] = {}


def lengths_for(tokens: int, window: int | None) -> tuple[int, ...]:
    """Three traced lengths, multiples of a base, or the plan's own tokens alone when they are fewer than three
    times it: traced where they are, nothing is extrapolated (at a few hundred tokens the attention's blocks make
    the costs uneven in L: a gpt-oss layer's forward peak measured 365,056, 730,112 and 508,416 bytes at 64, 128
    and 192 tokens).

    The base is BASE_LENGTH, or with a sliding window of W the first multiple of 6 W from BASE_LENGTH on: a
    window's blockwise tiling (models/blockwise.py) then has no shorter last tile at any traced length, in a
    ring's chunks (halves) too, and the window fits a chunk as at the plan's lengths; the factor 3 keeps the
    lengths off power-of-two widths (BASE_LENGTH's comment). Gemma 3's local layers at 2,144-token multiples
    measured 205, 352 and 515 MB forward peaks: the last tile's share varies."""
    base = 6 * window * -(-BASE_LENGTH // (6 * window)) if window else BASE_LENGTH
    if tokens < 3 * base:
        return (tokens,)
    return (base, 2 * base, 3 * base)


def layer_costs(s) -> Traced:
    """The traced costs of `s` (a plan Setup): from this process's cache, the disk cache, or traced now. Layers
    fake tensors cannot run are traced as a Llama-style decoder's of the same widths (`Traced.untraced` says why,
    the plan's note repeats it)."""
    key = _key(s)
    if key not in _CACHE:
        _CACHE[key] = _load(key) or _store(key, _traced(key, s))
    return _CACHE[key]


def _traced(key: TraceKey, s) -> Traced:
    from longfit.plan.trace import TraceUnsupported

    try:
        return _trace(key, s.config)
    except TraceUnsupported as e:
        llama = dict(model_type="llama", hidden_size=s.shape.hidden, intermediate_size=s.shape.intermediate,
                     num_hidden_layers=s.shape.layers, num_attention_heads=s.shape.heads,
                     num_key_value_heads=s.shape.kv_heads, head_dim=s.shape.head_dim, vocab_size=s.shape.vocab)
        traced = _trace(replace(key, config_json=json.dumps(llama, sort_keys=True)), s.config)
        return Traced(traced.kind_of, traced.costs, str(e))


def _key(s) -> TraceKey:
    from longfit.plan.setup import mlp_tiles

    return TraceKey(
        config_json=s.shape.config_json,
        regime=s.regime,
        lora_rank=s.lora_rank if s.lora else 0,
        lora_dropout=s.config.lora.dropout if s.lora else 0.0,
        lora_targets=tuple(s.lora_targets) if s.lora else (),
        checkpointed=s.checkpointed,
        tiles=mlp_tiles(s) if s.tiled_mlp else 0,
        cp=s.cp,
        cp_method=s.cp_method if s.cp > 1 else None,
        lengths=lengths_for(s.tokens, s.shape.sliding_window),
    )


# -- the disk cache ---------------------------------------------------------------------------------------------


@functools.cache
def _code_digest() -> str:
    """The versions of what runs in a traced layer and a digest of longfit's sources."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for package in ("torch", "transformers", "peft"):
        try:
            digest.update(f"{package}={version(package)};".encode())
        except PackageNotFoundError:
            digest.update(f"{package}=none;".encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cache_file(key: TraceKey) -> Path:
    name = hashlib.sha256(json.dumps([_code_digest(), asdict(key)], sort_keys=True).encode()).hexdigest()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "longfit" / "layer_costs" / f"{name}.json"


def _load(key: TraceKey) -> Traced | None:
    try:
        values = json.loads(_cache_file(key).read_text())
    except (OSError, ValueError):  # not traced yet, or unreadable: trace again
        return None
    return Traced(values["kind_of"], {int(i): LayerCosts(**c) for i, c in values["costs"].items()}, values["untraced"])


def _store(key: TraceKey, traced: Traced) -> Traced:
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"kind_of": traced.kind_of, "untraced": traced.untraced,
                                       "costs": {i: asdict(c) for i, c in traced.costs.items()}}))
        partial.replace(path)  # atomic: a concurrent plan reads the old file or the new one
    except OSError:  # a read-only home: the plan is traced again next time
        pass
    return traced


# -- tracing ----------------------------------------------------------------------------------------------------


def _kinds(layers, layer_types) -> list[int]:
    """Per layer, the index of the first layer of its kind: the same modules (names and classes; experts count
    once) and the same `layer_types` entry."""
    import re

    first: dict[tuple, int] = {}
    kinds = []
    for i, layer in enumerate(layers):
        structure = tuple(dict.fromkeys((re.sub(r"\.\d+(?=\.|$)", ".#", n), type(m).__name__)
                                        for n, m in layer.named_modules()))
        kind = (structure, layer_types[i] if isinstance(layer_types, list) and len(layer_types) == len(layers) else None)
        kinds.append(first.setdefault(kind, i))
    return kinds


def _model(key: TraceKey, cfg=None):
    """The run's model on the meta device in the run's storage dtype, with LoRA as build_model adapts it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.models.attention import register_attention

    values = json.loads(key.config_json)
    config = AutoConfig.for_model(values.pop("model_type"), **values).get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention(), dtype=torch.float32)
    if key.lora_rank:
        from peft import get_peft_model

        from longfit.models.build import lora_config, peft_quietly

        with peft_quietly():
            model = get_peft_model(model, lora_config(cfg))
    if key.regime == "bf16":
        model.to(torch.bfloat16)
    return model, config


def _techniques(model, key: TraceKey) -> None:
    """parallelize's order: context parallelism (on the fake process group), then the memory techniques (as
    longfit.memory.apply_memory_techniques applies them)."""
    if key.cp_method:
        import torch.distributed as dist

        from longfit.parallel.parallelize import apply_context_parallel

        apply_context_parallel(model, dist.group.WORLD, key.cp_method)
    if key.tiles:
        from longfit.memory.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, key.tiles)
    if key.checkpointed:
        from longfit.memory.checkpointing import apply_activation_checkpointing
        from longfit.models.structure import decoder_layers

        apply_activation_checkpointing(model, key.checkpointed / len(decoder_layers(model)))


class _Captured(Exception):
    pass


def _captured_calls(model, layers, wanted: set[int], tokens: int) -> dict[int, tuple[tuple, dict]]:
    """The (args, kwargs) the model's forward gives each wanted layer on `tokens` token ids, every layer skipped
    (its output is its input) so that only the embedding and the model's own tables run.

    A layer handed a mapping that layers share (Gemma 4's `shared_kv_states`: the last layers attend to the keys and
    values an earlier layer of their kind wrote there) runs instead, without autograd, so that the layers reading it
    find what they read; each wanted layer gets a copy of it, its tensors autograd leaves (the keys and values of
    the real step require their gradient)."""
    from collections.abc import MutableMapping

    import torch
    from torch.utils._pytree import tree_map

    from longfit.models.structure import unwrap_peft

    calls: dict[int, tuple[tuple, dict]] = {}

    def detached(v):  # a layer's backward ends at its own inputs (Gemma 4's per-layer inputs)
        if isinstance(v, MutableMapping) and not isinstance(v, dict):  # not a pytree node: copied here
            leaf = lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t  # noqa: E731
            return type(v)(tree_map(leaf, dict(v)))
        return v.detach() if isinstance(v, torch.Tensor) else v

    def skipped(index: int):
        def forward(*args, **kwargs):
            if index in wanted:
                calls[index] = tree_map(detached, (args, kwargs))
                if len(calls) == len(wanted):
                    raise _Captured
            if any(isinstance(v, MutableMapping) and not isinstance(v, dict) for v in kwargs.values()):
                with torch.no_grad():
                    return (own[index] or type(layers[index]).forward.__get__(layers[index]))(*args, **kwargs)
            return args[0] if args else kwargs["hidden_states"]
        return forward

    own = [layer.__dict__.get("forward") for layer in layers]  # checkpointing sets its forward on the instance
    for i, layer in enumerate(layers):
        layer.forward = skipped(i)
    try:
        unwrap_peft(model).model(input_ids=torch.zeros(1, tokens, dtype=torch.long), use_cache=False)
    except _Captured:
        pass
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
    return calls


def _measure(layer, call: tuple[tuple, dict], tracker, residual) -> dict[str, float]:
    """Bytes of one layer's forward and backward on the captured call, its input a fresh autograd tensor."""
    import gc
    import weakref

    import torch

    args, kwargs = call
    hidden = args[0] if args else kwargs["hidden_states"]
    source = torch.empty(hidden.shape, dtype=residual, requires_grad=True)
    x = source * 1  # owned by autograd like a real layer input
    args, kwargs = ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
    start = tracker.activations
    tracker.activation_peak = start
    out = layer(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    forward_peak = tracker.activation_peak - start
    input_storage = weakref.ref(x.untyped_storage())
    del x, args, kwargs
    gc.collect()  # settle reference cycles (checkpoint frames) before reading the live bytes
    input_kept = input_storage() is not None
    saved = tracker.activations - start - out.untyped_storage().nbytes()
    saved += 0 if input_kept else source.numel() * source.element_size()
    grad = torch.empty_like(out)  # the analytic plan counts the incoming gradient itself
    backward_start = tracker.activations
    tracker.activation_peak = backward_start
    out.backward(grad)
    return {"saved": saved, "input_kept": float(input_kept), "forward_peak": forward_peak,
            "backward_peak": tracker.activation_peak - backward_start}


def _traced_layers(kinds: list[int], checkpointed: int) -> tuple[list[int], list[int]]:
    """(the traced layer of each layer, the traced layers): one per kind, checkpointed and plain apart."""
    first: dict[tuple[int, bool], int] = {}
    for i in range(len(kinds)):
        first.setdefault((kinds[i], i < checkpointed), i)
    return [first[(kinds[i], i < checkpointed)] for i in range(len(kinds))], sorted(set(first.values()))


def _trace(key: TraceKey, cfg=None) -> Traced:
    """`cfg`: the run's Config, whose LoRA settings build_model applies (`key` holds those the costs depend on)."""
    import traceback

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longfit.models.structure import decoder_layers
    from longfit.plan.trace import (
        TraceUnsupported,
        _GroupedMatmulInItsDtype,
        _process_group,
        _separate_sharding_propagation,
    )
    from longfit.plan.tracker import WEIGHT_LIKE, ActivationBytes

    model, config = _model(key, cfg)
    kinds = _kinds(list(decoder_layers(model)), getattr(config, "layer_types", None))
    kind_of, wanted = _traced_layers(kinds, key.checkpointed)
    residual = torch.bfloat16 if key.regime == "bf16" else torch.float32
    samples: dict[int, list[dict]] = {i: [] for i in wanted}
    try:
        with _process_group(key.cp if key.cp_method else 1):
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode:
                model.to_empty(device="cpu")
                _techniques(model, key)
            layers = list(decoder_layers(model))
            shapes = {tuple(p.shape) for p in model.parameters()}
            shapes |= {tuple(reversed(shape)) for shape in shapes}
            for tokens in key.lengths:
                with mode, _GroupedMatmulInItsDtype(), _separate_sharding_propagation(), torch.autocast(
                    "cpu", dtype=torch.bfloat16, enabled=key.regime == "autocast"
                ):
                    tracker = ActivationBytes(mode, shapes)
                    with tracker:  # the model's tables are live before any layer runs, as in a whole step
                        tracker.adopt(model.parameters(), WEIGHT_LIKE)
                        calls = _captured_calls(model, layers, set(wanted), tokens)
                        for i in wanted:
                            samples[i].append(_measure(layers[i], calls[i], tracker, residual))
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if key.tiles and any(frame.f_code.co_filename.endswith("tiled_mlp.py") for frame, _ in traceback.walk_tb(e.__traceback__)):
            raise ConfigError(f"{config.model_type}: the tiled MLP (memory.tiled_mlp) cannot run this model's MLP "
                              f"({type(e).__name__}: {first[:120]}); set memory.tiled_mlp=false") from e
        raise TraceUnsupported(f"{config.model_type}: its decoder layers cannot be traced on fake tensors "
                               f"({type(e).__name__}: {first[:200]})") from e
    return Traced(kind_of, {i: _fit(samples[i], key.lengths, i, layers[i], config) for i in wanted})


def _fit(samples: list[dict], lengths: tuple[int, ...], index: int, layer, config) -> LayerCosts:
    """The line through the outer lengths, checked at the middle one (module docstring); at one length, that
    length's own costs."""
    if len(lengths) == 1:
        (sample,), (tokens,) = samples, lengths
        return LayerCosts({q: sample[q] / tokens for q in QUANTITIES}, dict.fromkeys(QUANTITIES, 0.0),
                          bool(sample["input_kept"]))
    (l0, l1, l2), per_token, fixed = lengths, {}, {}
    for q in QUANTITIES:
        y0, y1, y2 = (sample[q] for sample in samples)
        slope = (y2 - y0) / (l2 - l0)
        off = abs(y0 + slope * (l1 - l0) - y1)
        longer = (y2 - y1) / (l2 - l1)  # the line through the longer two lengths
        if off > LINEAR_TOLERANCE * max(abs(y2), 1.0) and q != "saved" and y1 < y0 + slope * (l1 - l0) \
                and y1 - longer * l1 >= -LINEAR_TOLERANCE * abs(y2):
            # A peak is the largest of the layer's events, each a + b L with a >= 0: below the chord, an event of
            # fixed size (LoRA on experts: Qwen3-30B-A3B's backward, 168 MB at 1,072 tokens) tops the others at the
            # shortest length only, and the longer two lengths lie on the line of the plan's lengths (a quadratic's
            # line through them would start below zero).
            per_token[q], fixed[q] = longer, y1 - longer * l1
            continue
        if off > LINEAR_TOLERANCE * max(abs(y2), 1.0):
            raise ConfigError(
                f"{config.model_type}: layer {index} ({type(layer).__name__})'s {q.replace('_', ' ')} is not linear "
                f"in the sequence length ({y0:.0f}, {y1:.0f}, {y2:.0f} bytes at {l0}, {l1}, {l2} tokens); longfit "
                "cannot plan it"
            )
        per_token[q], fixed[q] = slope, y0 - slope * l0
    return LayerCosts(per_token, fixed, all(sample["input_kept"] for sample in samples))


@dataclass(frozen=True)
class LoraCounts:
    """The adapters' parameters of a model outside the preset families, counted on its peft model (meta device)."""

    total: int
    largest_layer: int
    """Of one decoder layer: what FSDP2 reduce-scatters per layer."""
    largest_mlp: int
    """Of one decoder layer's `mlp` (experts included): its unsharded gradients at the layer's backward peak."""


_LORA_CACHE: dict[tuple, LoraCounts] = {}


def lora_counts(s) -> LoraCounts:
    """The trainable parameters of `s`'s LoRA run, as longfit's build_model adapts the model (its lora_config)."""
    key = (s.shape.config_json, s.lora_rank, tuple(s.lora_targets))
    if key not in _LORA_CACHE:
        import torch
        from peft import get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        from longfit.models.build import lora_config, peft_quietly
        from longfit.models.structure import decoder_layers

        values = json.loads(key[0])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        with peft_quietly():
            model = get_peft_model(model, lora_config(s.config))

        def trainable(module) -> int:
            return sum(p.numel() for p in module.parameters() if p.requires_grad)

        layers = decoder_layers(model)
        _LORA_CACHE[key] = LoraCounts(
            trainable(model), max(trainable(layer) for layer in layers),
            max((trainable(layer.mlp) for layer in layers if hasattr(layer, "mlp")), default=0))
    return _LORA_CACHE[key]
