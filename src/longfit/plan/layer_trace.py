"""Activation costs of an architecture outside the preset families, traced off its own decoder layers.

The analytic planner needs, per decoder layer, the bytes per token its forward keeps for the backward
(`saved`, without its input), whether autograd keeps the input (`input_kept`), and how high its forward and
backward working sets rise (`forward_peak`, `backward_peak`). For a model outside the preset families these
are measured here on the model itself: transformers builds it on the meta device at its real widths (every
layer kind: MoE and dense, sliding and full, linear and softmax attention), longfit applies the run's
techniques (LoRA, context parallelism, tiled MLP, checkpointing) and regime, and ONE layer of each kind runs
forward and backward on fake tensors (no memory, no compute), fed the arguments the model's own forward
gives it (rotary tables, masks, per-layer inputs), captured by running the model with its layers skipped.

Nothing in a layer is quadratic in the sequence (longfit's attention is blockwise, windows are bounded), so
each quantity is a + b L in the tokens L of a rank. Each kind is traced at three lengths; the line through
the outer two must meet the middle one within `LINEAR_TOLERANCE`, else the plan is refused in one line naming
the layer: a cost that is not linear would be extrapolated wrongly. A plan of fewer tokens than the three
lengths need is traced at its own length instead. The result is cached by (architecture,
regime, techniques), so a max-context search traces each layer kind once per tile count.
"""

from __future__ import annotations

import gc
import json
import traceback
import weakref
from dataclasses import dataclass

import torch

from longfit.config import ConfigError
from longfit.plan.tracker import LiveBytes

BASE_LENGTH = 1024  # the shortest traced length, unless the plan's own tokens are fewer
LINEAR_TOLERANCE = 0.01  # of the quantity at the longest length
QUANTITIES = ("saved", "forward_peak", "backward_peak")


class _LayerBytes(LiveBytes):
    """LiveBytes that also follows the activation bytes alone (tensors not shaped like a parameter)."""

    def __init__(self, fake_mode, weight_shapes: set[tuple[int, ...]]):
        super().__init__(fake_mode)
        self.weight_shapes = weight_shapes
        self.activations = 0
        self.activation_peak = 0

    def _count_output(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) in self.weight_shapes:
            self.phase, previous = "weight-like", self.phase
            try:
                super()._count_output(tensor)
            finally:
                self.phase = previous
        else:
            super()._count_output(tensor)

    def _add(self, nbytes: int, tag: str) -> None:
        super()._add(nbytes, tag)
        if tag != "weight-like":
            self.activations += nbytes
            self.activation_peak = max(self.activation_peak, self.activations)


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
    lora_targets: tuple[str, ...]
    checkpointed: bool
    tiles: int  # 0: no tiled MLP
    cp: int
    cp_method: str | None
    lengths: tuple[int, ...]


_CACHE: dict[TraceKey, tuple[list[int], dict[int, LayerCosts]] | str] = {}  # str: why it was not traced


def lengths_for(tokens: int, window: int | None) -> tuple[int, ...]:
    """Three traced lengths from BASE_LENGTH (at least twice a sliding window, so that a ring's windowed layer
    takes the same path as at the plan's length), or the plan's own tokens alone when they are fewer than three
    times that: traced where they are, nothing is extrapolated (at a few hundred tokens the attention's blocks
    make the costs uneven in L: a gpt-oss layer's forward peak measured 365,056, 730,112 and 508,416 bytes at 64,
    128 and 192 tokens)."""
    base = max(BASE_LENGTH, 2 * (window or 0))
    if tokens < 3 * base:
        return (tokens,)
    return (base, 2 * base, 3 * base)


def layer_costs(s) -> tuple[list[int], dict[int, LayerCosts]] | None:
    """(the kind of each decoder layer, the costs of each kind) of `s` (a plan Setup) whose shape was counted;
    None where its layers cannot run on fake tensors (`untraced_reason` says why: the planner then plans them as
    a Llama-style decoder's of the same widths, and the plan's note says so).

    A kind is named by its first layer's index."""
    from longfit.plan.trace import TraceUnsupported

    key = _key(s)
    if key not in _CACHE:
        try:
            _CACHE[key] = _trace(key, s.checkpointed, s.shape.layers, s.config)
        except TraceUnsupported as e:
            _CACHE[key] = str(e)
    return None if isinstance(_CACHE[key], str) else _CACHE[key]


def untraced_reason(s) -> str | None:
    """Why `layer_costs(s)` found no costs (the first line of what failed), None where it did or was not asked."""
    reason = _CACHE.get(_key(s))
    return reason if isinstance(reason, str) else None


def _key(s) -> TraceKey:
    from longfit.plan.setup import mlp_tiles

    return TraceKey(
        config_json=s.shape.counted.config_json,
        regime=s.regime,
        lora_rank=s.lora_rank if s.lora else 0,
        lora_targets=tuple(s.lora_targets) if s.lora else (),
        checkpointed=s.checkpointed > 0,
        tiles=mlp_tiles(s) if s.tiled_mlp else 0,
        cp=s.cp,
        cp_method=s.cp_method if s.cp > 1 else None,
        lengths=lengths_for(s.tokens, s.shape.sliding_window),
    )


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


def _model(key: TraceKey, checkpointed_layers: int, cfg=None):
    """The run's model on the meta device, its techniques applied in parallelize's order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.models.attention import register_attention

    values = json.loads(key.config_json)
    config = AutoConfig.for_model(values.pop("model_type"), **values).get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention(), dtype=torch.float32)
    if key.lora_rank:  # as build_model adapts it
        from peft import get_peft_model

        from longfit.models.build import lora_config, peft_quietly

        with peft_quietly():
            model = get_peft_model(model, lora_config(cfg))
    if key.cp_method:
        import torch.distributed as dist

        from longfit.parallel.parallelize import apply_context_parallel

        apply_context_parallel(model, dist.group.WORLD, key.cp_method)
    if key.tiles:
        from longfit.memory.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, key.tiles)
    if key.checkpointed:
        from longfit.memory.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, checkpointed_layers / config.num_hidden_layers)
    if key.regime == "bf16":
        model.to(torch.bfloat16)
    return model, config


class _Captured(Exception):
    pass


def _captured_calls(model, layers, wanted: set[int], tokens: int) -> dict[int, tuple[tuple, dict]]:
    """The (args, kwargs) the model's forward gives each wanted layer on `tokens` token ids, every layer skipped
    (its output is its input) so that only the embedding and the model's own tables run."""
    from torch.utils._pytree import tree_map

    from longfit.models.structure import unwrap_peft

    calls: dict[int, tuple[tuple, dict]] = {}

    def skipped(index: int):
        def forward(*args, **kwargs):
            if index in wanted:  # detached: a layer's backward ends at its own inputs (Gemma 4's per-layer inputs)
                calls[index] = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kwargs))
                if len(calls) == len(wanted):
                    raise _Captured
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


def _measure(layer, call: tuple[tuple, dict], tracker: _LayerBytes, residual: torch.dtype) -> dict[str, float]:
    """Bytes of one layer's forward and backward on the captured call, its input a fresh autograd tensor."""
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


def _trace(key: TraceKey, checkpointed: int, n_layers: int, cfg=None) -> tuple[list[int], dict[int, LayerCosts]]:
    """`cfg`: the run's Config, whose LoRA settings build_model applies (`key` holds those the costs depend on)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longfit.models.structure import decoder_layers
    from longfit.plan.trace import (
        TraceUnsupported,
        _GroupedMatmulInItsDtype,
        _process_group,
        _separate_sharding_propagation,
    )

    model, config = _model(key, checkpointed, cfg)
    layers = list(decoder_layers(model))
    kinds = _kinds(layers, getattr(config, "layer_types", None))
    # a kind's checkpointed and plain layers differ: one of each where the run has both
    first: dict[tuple[int, bool], int] = {}
    kind_of = [first.setdefault((kinds[i], i < checkpointed), i) for i in range(n_layers)]
    wanted = sorted(first.values())
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model.to_empty(device="cpu")
    shapes = {tuple(p.shape) for p in model.parameters()}
    shapes |= {tuple(reversed(shape)) for shape in shapes}
    residual = torch.bfloat16 if key.regime == "bf16" else torch.float32
    samples: dict[int, list[dict]] = {i: [] for i in wanted}
    try:
        with _process_group(key.cp if key.cp_method else 1):
            for tokens in key.lengths:
                with mode, _GroupedMatmulInItsDtype(), _separate_sharding_propagation(), torch.autocast(
                    "cpu", dtype=torch.bfloat16, enabled=key.regime == "autocast"
                ):
                    tracker = _LayerBytes(mode, shapes)
                    with tracker:  # the model's tables are live before any layer runs, as in a whole step
                        tracker.adopt(model.parameters(), "weight-like")
                        calls = _captured_calls(model, layers, set(wanted), tokens)
                        for i in wanted:
                            samples[i].append(_measure(layers[i], calls[i], tracker, residual))
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if key.tiles and any(frame.f_code.co_filename.endswith("tiled_mlp.py") for frame, _ in traceback.walk_tb(e.__traceback__)):
            raise ConfigError(f"{config.model_type}: the tiled MLP (memory.tiled_mlp) cannot run this model's MLP "
                              f"({type(e).__name__}: {first[:120]}); set memory.tiled_mlp=false") from e
        raise TraceUnsupported(f"{config.model_type}: its decoder layers cannot be traced on fake tensors "
                               f"({type(e).__name__}: {first[:200]})") from e
    return kind_of, {i: _fit(samples[i], key.lengths, i, layers[i], config) for i in wanted}


def _fit(samples: list[dict], lengths: tuple[int, ...], index: int, layer, config) -> LayerCosts:
    """The line through the outer lengths, checked at the middle one (module docstring); at one length, that
    length's own costs."""
    if len(lengths) == 1:
        (sample,), (tokens,) = samples, lengths
        return LayerCosts({q: sample[q] / tokens for q in QUANTITIES}, dict.fromkeys(QUANTITIES, 0.0),
                          sample["input_kept"])
    (l0, l1, l2), per_token, fixed = lengths, {}, {}
    for q in QUANTITIES:
        y0, y1, y2 = (sample[q] for sample in samples)
        slope = (y2 - y0) / (l2 - l0)
        off = abs(y0 + slope * (l1 - l0) - y1)
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
    key = (s.shape.counted.config_json, s.lora_rank, tuple(s.lora_targets))
    if key not in _LORA_CACHE:
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
