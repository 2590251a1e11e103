"""Activation costs of a model's decoder layers, traced off its own layers: what the analytic planner reads.

The analytic planner needs, per decoder layer, the bytes per token its forward keeps for the backward
(`saved`, without its input), whether autograd keeps the input (`input_kept`), and how high its forward and
backward working sets rise (`forward_peak`; `backward_peak`, the incoming gradient inside for as long as the layer
holds it, and `reloaded_backward_peak`, the same with the input brought back by the offload store: `_measure`),
and what it hands the next layer besides the hidden states that nothing of its own keeps (`passed`: GLM-5's key
selection, #57).
Checkpointed layers that keep attention through their recompute (memory.keep_attention, #53) are traced keeping it.
They are measured here on the model itself, for
every family alike (no table of fitted constants): transformers builds it on the meta device at its real
widths (every layer kind: MoE and dense, sliding and full, linear and softmax attention), longfit applies the
run's regime and techniques in `parallelize`'s order (LoRA, tensor parallelism and context parallelism on a fake
process group, then tiled decoder layers or checkpointing, and the tiled MLP),
and ONE layer of each kind runs forward and backward on fake tensors (no memory, no compute), fed the arguments
the model's own forward gives it (rotary tables, masks, per-layer inputs), captured by running the model with
its layers skipped. What the model holds when it calls its first layer, the token ids and hidden states aside, is
its tables (`Traced.tables`), which the planner counts once for the whole stack.

Nothing in a layer is quadratic in the sequence (longfit's attention is blockwise, windows are bounded), so
each quantity is a + b L in the tokens L of a rank. Each kind is traced at three lengths; the line through the
outer two must meet the middle one within `LINEAR_TOLERANCE`, else the plan is refused in one line naming the
layer: a cost that is not linear would be extrapolated wrongly. A plan of fewer tokens than the shortest length is
traced at its own length instead. Tiled decoder layers and the tiled MLP hold their sequence-long tensors plus one
tile's working set: a + b L + c t with tiles of t tokens, traced in a few short tiles (`TILE_SAMPLES`), and at least
what the layer holds outside its tiles (its floor), so one trace serves every tile count (`_fit_plane`); off
that plane, a line at the plan's tile count, or at tiles of the longest length where they stopped growing
(`_capped_tile_lengths`).

A plan that checkpoints its first k layers reads them off a trace of the model with every layer checkpointed, and
the others off one with none (`layer_costs`). What a rank holds under ring attention does not depend on the ring's
size: its two zigzag chunks, the K/V block in flight and the fp32 accumulators are all of its own T tokens
(ring.py), and whether a sliding window exchanges a halo depends on T / 2 alone; so every ring is traced as a ring
of two. Ulysses holds heads / cp of cp T tokens, and repeats key/value heads to lcm(heads, cp): it is traced at the
smallest degree that repeats them alike (`_traced_cp`;
`test_what_a_rank_holds_depends_on_cp_only_through_ulysses_head_repetition`).

The costs are cached by (architecture, regime, techniques, traced samples): in this process, and on disk
under `$XDG_CACHE_HOME/longfit/layer_costs` (`~/.cache/...`), keyed also by the versions of torch,
transformers and peft and by a digest of longfit's own sources, so that any change to what runs in a layer
traces again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from longfit.config import ConfigError
from longfit.models.cache import cache_dir, code_digest, store_json
from longfit.plan.padding import RowPadding, padded, row_padding, tile_padding
from longfit.plan.tiled import tile_count

# The shortest traced length, unless the plan's own tokens are fewer: 16 x 67 tokens. 16 divides it into a ring's
# chunks; the prime 67 keeps every token dimension of the traced lengths (chunks) off the model's widths,
# which are multiples of powers of two: a tensor shaped like a parameter is counted as one (`ActivationBytes`),
# and at 3,072 tokens a (3072, 256) activation of llama-tiny (intermediate 3,072) would be taken for a weight.
BASE_LENGTH = 16 * 67
LINEAR_TOLERANCE = 0.01  # of the quantity at the longest length
QUANTITIES = ("saved", "forward_peak", "backward_peak", "reloaded_backward_peak", "passed")
FRESH_TRACE_TIMEOUT_S = 1200  # a rank's trace in a process of its own: a real 9B config's took minutes (#52)
# Tiled samples: (tiles per chunk, tokens per tile in sixteenths of the base length). The first three (two tiles
# per chunk, so tiles half the chunk: the tiles' own events dominate) give a line in L along t = L / (2 chunks), the
# fourth (as long as the third, tiles half as long) the slope in t, the fifth checks that plane; the last three, at
# the first three's lengths in tiles of an eighth of the base (134 tokens: shorter than any tile longfit derives,
# 512 tokens at least), give the floor: what the layer holds outside its tiles (`_fit_plane`).
TILE_SAMPLES = ((2, 8), (2, 12), (2, 16), (4, 8), (4, 12), (8, 2), (12, 2), (16, 2))


@dataclass(frozen=True)
class LayerCosts:
    """One layer kind's costs: bytes = fixed + per_token x L + per_tile_token x t, at L tokens of a rank whose
    largest tile (`tiling`: of the tiled decoder layer, or of the tiled MLP; None: untiled) has t tokens, and at
    least the floor's line (what a tiled layer holds outside its tiles: its peak is the larger of the two)."""

    per_token: dict[str, float]
    fixed: dict[str, float]
    input_kept: bool
    per_tile_token: dict[str, float] | None = None
    tiling: str | None = None  # "layers" | "mlp" | None
    floor_per_token: dict[str, float] | None = None
    floor_fixed: dict[str, float] | None = None
    per_padded_slot: dict[str, float] | None = None
    """A linear-attention layer's bytes per padded slot of its scan (`padded_slots`): each document of a row is laid
    on whole chunks (models/linear_attention.py), whose padding the one-document samples do not hold; None: none."""

    def at(self, tokens: int, tile_tokens: int = 0, padded: float = 0.0) -> dict:
        """The analytic planner's entry (bytes per token) at `tokens` tokens of a rank, tiles of `tile_tokens`, and
        `padded` slots of a rank's scans beyond its tokens (`padded_slots`)."""
        tile = self.per_tile_token or dict.fromkeys(QUANTITIES, 0.0)
        costs = {q: self.per_token[q] + (self.fixed[q] + tile[q] * tile_tokens) / tokens for q in QUANTITIES}
        if self.floor_per_token is not None:
            costs = {q: max(costs[q], self.floor_per_token[q] + self.floor_fixed[q] / tokens) for q in QUANTITIES}
        if self.per_padded_slot is not None:
            costs = {q: costs[q] + self.per_padded_slot[q] * padded / tokens for q in QUANTITIES}
        return {"input_kept": self.input_kept, **costs}


@dataclass(frozen=True)
class TraceKey:
    """What a layer's costs depend on besides the tokens: the architecture, the regime and the techniques."""

    config_json: str
    regime: str
    lora_rank: int  # 0: no LoRA
    lora_dropout: float  # peft's dropout keeps a dropped copy of each adapted input
    lora_targets: tuple[str, ...]
    checkpointed: bool  # every layer (a plan that checkpoints the first k layers reads two traces: `layer_costs`)
    mlp_tiled: bool
    layers_tiled: bool  # every layer a tiled decoder layer
    cp: int  # the smallest degree whose rank holds what the run's holds (`_traced_cp`)
    cp_method: str | None
    tp: int
    samples: tuple[tuple[int, int], ...]
    """(tokens, tile count) of each traced sample: `samples_for`."""
    documents: tuple[int, ...] = ()
    """The document lengths of the row whose linear-attention scans' padding the plan counts (plan/padding.py), which
    a packed sample repeats (`_packed_samples`); (): no such layers."""
    keep_attention: bool = False
    """The checkpointed layers keep attention's output and logsumexp through the recompute (memory.keep_attention,
    #53): their saved bytes hold it, and their recompute holds it in place of the attention kernel's output and the
    output projection's copy of it."""
    window: int | None = None
    """The sliding window the traced model attends with in place of its own (`_unwindowed`); None: its own."""
    lora_autocast: bool = False
    """A one-rank LoRA run in bf16: its bf16 base and fp32 adapters (`use_lora_storage`) run under autocast
    (`longfit.parallel.parallelize.autocast_dtype`), which also runs a layer's fp32 matmuls (a Gated DeltaNet's
    chunked scan) in bf16; FSDP2 gathers the adapters in bf16 instead, without autocast."""

    @property
    def tiling(self) -> str | None:
        """What the traced layers tile (`plan.tiled.tile_count`): "layers", "mlp" or None."""
        return "layers" if self.layers_tiled else "mlp" if self.mlp_tiled else None


@dataclass(frozen=True)
class Traced:
    """The costs of one TraceKey: the kind (its traced layer's index) of each decoder layer, each kind's costs, and
    why the layers were traced as a Llama-style decoder's of the same widths (None: they were not). `planar`
    False: a tiled layer's costs are not a plane in (L, t), and the plan traces its own tile count instead."""

    kind_of: list[int]
    costs: dict[int, LayerCosts]
    untraced: str | None = None
    planar: bool = True
    tables: tuple[float, float] = (0.0, 0.0)
    """(bytes per token, fixed bytes) of what the model's forward holds besides the hidden states when it calls its
    first layer (`_captured_calls`: rotary tables of each layer kind, per-layer inputs and what autograd saved to
    differentiate them), which lives until the layers' backward has run."""

    def table_bytes(self, tokens: int) -> float:
        return self.tables[0] * tokens + self.tables[1]


_CACHE: dict[TraceKey, Traced] = {}


def base_length(shape, tiles: int = 0, chunks: int = 1) -> int:
    """The shortest traced length of `shape`'s layers (a ModelShape), each tile of `tiles` per row (0: untiled) in
    `chunks` (2: a ring's zigzag halves, each cut into tiles of its own). BASE_LENGTH, or the first multiple from
    it on of
    - 6 W, with a sliding window of W: a window's blockwise tiling (models/blockwise.py) then has no shorter last
      tile at any traced length, in a ring's chunks (halves) too, and the window fits a chunk as at the plan's
      lengths. Gemma 3's local layers at 2,144-token multiples measured 205, 352 and 515 MB forward peaks: the last
      tile's share varies;
    - 2 C with linear-attention layers that scan in chunks of C tokens (`ModelShape.scan_chunk`), and every tile
      whole chunks: a sequence, a ring's half and a tile are padded to whole chunks, so a length or tile that is
      not one pads by an amount that varies with it. Qwen3.5-27B's tiled layers in 29 tiles a row saved 10,995,
      21,998 and 31,462 bytes at 1,072, 2,144 and 3,216 tokens: tiles of 37, 74 and 111 tokens padded to 64, 128
      and 128 (#52). Times 3 where that is a power of two, and tiles of two chunks at least (the shrunken Qwen3.5's
      tiled layer in tiles of one, two and three chunks: forward peaks 993,822, 1,921,076 and 2,911,818 bytes);
    the factor 3 keeps the lengths off power-of-two widths (BASE_LENGTH's comment). Sparse indexed attention starts
    at the first multiple of BASE_LENGTH from its index_topk on: a query selects all its earlier keys until it has
    index_topk of them, so below that length the selection grows as L^2 (DeepSeek-V3.2's backward peak at 1,072,
    2,144 and 3,216 tokens: 1.256e9, 2.453e9 and 3.576e9 bytes, #57), and from it on it is index_topk keys a query."""
    start = BASE_LENGTH * -(-(shape.index_topk or 1) // BASE_LENGTH)
    step = 6 * shape.sliding_window if shape.sliding_window else 1
    if shape.scan_chunk:
        row_tiles = chunks * -(-tiles // chunks)
        whole = (row_tiles if tiles else 2) * shape.scan_chunk  # every half or tile whole chunks
        step = math.lcm(step, 3 * whole if whole & (whole - 1) == 0 else whole)
        start = max(start, 2 * whole if tiles else 0)  # tiles of one chunk are not on the line of longer ones
    return step * -(-start // step)


def samples_for(tokens: int, shape, tiles: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """The (tokens, tile count) samples traced for a plan of `tokens` tokens per rank of `shape` (a ModelShape).

    Untiled (`tiles` 0): three lengths, multiples of the base (`base_length`). Tiled (`tiles`: the plan's count):
    TILE_SAMPLES, j tiles of t sixteenths of the base per chunk (`chunks`: 2 under ring attention, whose tiles stay
    inside its two zigzag chunks), so that one trace serves every tile count the plan's length gives; the base's
    eighth (its shortest tiles, 2 sixteenths) whole scan chunks. Fewer tokens than the base: the plan's own tokens
    and tiles alone, traced where they are and nothing extrapolated (at a few hundred tokens the attention's blocks
    make the costs uneven in L: a gpt-oss layer's forward peak measured 365,056, 730,112 and 508,416 bytes at 64,
    128 and 192 tokens)."""
    base = base_length(shape, 8 if tiles else 0)
    if tokens < base:
        return ((tokens, tiles),)
    if not tiles:
        return three_lengths(base, 0)
    sixteenth = base // 16
    return tuple((chunks * j * t * sixteenth, chunks * j) for j, t in TILE_SAMPLES)


def three_lengths(base: int, tiles: int) -> tuple[tuple[int, int], ...]:
    """1, 2 and 3 times the base, each in `tiles` tiles (0: untiled): a line in L at a fixed tile count."""
    return tuple((k * base, tiles) for k in (1, 2, 3))


def layer_costs(s, checkpointed_layers: range | None = None) -> Traced:
    """The traced costs of `s` (a plan Setup): from this process's cache, the disk cache, or traced now. Layers
    fake tensors cannot run are traced as a Llama-style decoder's of the same widths (`Traced.untraced` says why,
    the plan's note repeats it). Tiled layers whose costs are not a plane in (L, t) are traced at the plan's own
    tile count, at three lengths. A plan that checkpoints its first k layers of n reads the checkpointed layers'
    costs off a trace of the model with every layer checkpointed and the others' off one with none: a layer's costs
    do not depend on its neighbours', and the two traces serve every k (pipeline stages, checkpoint fractions).
    `checkpointed_layers`: the checkpointed layers' indices (a pipeline stage's first ones); None: the first
    `s.checkpointed`."""
    if checkpointed_layers is None:
        checkpointed_layers = range(s.checkpointed)
    parts = [(checkpointed, _part(s, _key(s, checkpointed)))
             for checkpointed in (True, False) if (len(checkpointed_layers) > 0 if checkpointed else len(checkpointed_layers) < s.shape.layers)]
    if len(parts) == 1:
        return parts[0][1]
    (_, checkpointed), (_, plain) = parts
    offset = s.shape.layers  # the plain trace's kinds numbered after the checkpointed one's
    kind_of = [checkpointed.kind_of[i] if i in checkpointed_layers else offset + plain.kind_of[i] for i in range(s.shape.layers)]
    costs = {**checkpointed.costs, **{offset + kind: c for kind, c in plain.costs.items()}}
    return Traced(kind_of, costs, checkpointed.untraced or plain.untraced, tables=checkpointed.tables)


def _part(s, key: TraceKey) -> Traced:
    """The costs of `key`'s layers for the plan `s`: off the plane of its tiled samples, or off a line where they are
    not a plane or where the plan's tiles, stopped growing (`_capped_tile_lengths`), are shorter than every tile of
    the plane's samples: the plane would be extrapolated to them in the tile's length. A window of W tokens makes
    those samples' tiles 3 W / 4 and more (`base_length`), so the plane of a long window is not the plan's there:
    Phi-4-mini's (W = 262,144) was off the plane in every search past its window, traced to be refused (#52)."""
    from longfit.memory.switches import MAX_LAYER_TILE_TOKENS

    tiles = tile_count(s, key.tiling)
    chunks = 2 if key.cp_method == "ring" else 1
    base = base_length(s.shape, tiles, chunks)
    capped = _capped_tile_lengths(s, key, base, chunks)
    if capped and key.window is None and len(key.samples) == len(TILE_SAMPLES) and \
            min(tokens // count for tokens, count in key.samples) > MAX_LAYER_TILE_TOKENS:
        return _cached(replace(key, samples=capped), s)
    traced = _cached(key, s)
    if not traced.planar:
        own = replace(key, window=None)  # the model's own window, not `key`'s clamp
        windowless = three_lengths(base_length(_windowless(s.shape), tiles, chunks), tiles)
        lengths = capped or three_lengths(base, tiles)
        traced = _cached(_unwindowed(s, replace(own, samples=windowless)) or replace(own, samples=lengths), s)
    return traced


def _capped_tile_lengths(s, key: TraceKey, base: int, chunks: int) -> tuple[tuple[int, int], ...] | None:
    """The three lengths of a line at tiles of MAX_LAYER_TILE_TOKENS, where the plan's tiled layers cut its rows into
    tiles that stopped growing there (memory/switches.py `layer_tile_count`: ceil(L / max) tiles) and the base is
    whole such tiles (in each of a ring's chunks); None elsewhere. Every such plan's tile t lies in (max n / (n + 1),
    max] for its n tiles, so its costs a + b L + c t are the line's a + c max + b L, over by c (max - t) < c max / n
    (Phi-4-mini's 285 tiles: 29 tokens of a tile's 151,720 backward bytes a token, 4.4 MB a layer), and one trace
    serves every point of a search past the point where tiles stop growing. Traced at each point's own tile count,
    Phi-4-mini's search past its 262,144-token window traced its layers ten times, at 1.6M to 4.7M tokens each (7 of
    its 17 cold CPU s, #52). Its plan at 2,336,768 tokens: 85,424,639,349 B off this line, 85,449,273,936 B off one
    sample at that length and tile count (nothing extrapolated), 85,509,955,439 B off the line at that count."""
    from longfit.memory.switches import MAX_LAYER_TILE_TOKENS

    capped = -(-s.tokens // MAX_LAYER_TILE_TOKENS)
    if key.tiling != "layers" or s.layer_tiles or tile_count(s, "layers") != capped or capped < 2 \
            or base % (chunks * MAX_LAYER_TILE_TOKENS):
        return None
    return tuple((k * base, k * base // MAX_LAYER_TILE_TOKENS) for k in (1, 2, 3))


def _cached(key: TraceKey, s) -> Traced:
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
        traced = _trace(replace(key, config_json=json.dumps(llama, sort_keys=True), window=None), s.config)
        return Traced(traced.kind_of, traced.costs, str(e), traced.planar, traced.tables)


def _traced_cp(s) -> int:
    """The context-parallel degree a layer is traced at: a ring of two for any ring (module docstring); under Ulysses
    the smallest degree at which every layer's key/value heads are repeated to as many heads as at the run's (a rank
    holds heads / cp of cp T tokens: all that varies with cp is that repetition, to lcm(key/value heads, cp)) and
    that splits the query and linear-attention value heads too."""
    if s.cp == 1 or s.cp_method == "ring":
        return min(s.cp, 2)
    kv_heads = set(s.shape.layer_kv_heads or (s.shape.kv_heads,))
    splits = [s.shape.heads, *([s.shape.linear_value_heads] if s.shape.linear_value_heads else [])]
    return next(c for c in range(2, s.cp + 1)
                if all(math.lcm(kv, c) == math.lcm(kv, s.cp) for kv in kv_heads) and all(n % c == 0 for n in splits))


def _trained_config_json(s) -> str:
    """The architecture `s`'s run trains: its dropout at 0 under train.disable_dropout (`longfit.models.dropout`)."""
    from longfit.models.dropout import dropout_fields

    values = json.loads(s.shape.config_json)
    if not s.config.train.disable_dropout or not dropout_fields(values):
        return s.shape.config_json
    return json.dumps({**values, **dict.fromkeys(dropout_fields(values), 0.0)}, sort_keys=True)


def _key(s, checkpointed: bool) -> TraceKey:
    """The trace of `s`'s checkpointed layers (as tiled layers where it tiles them), or of its other layers."""
    layers_tiled = bool(s.tiled_layers) and checkpointed
    mlp_tiled = bool(s.tiled_mlp) and not layers_tiled
    cp_method = s.cp_method if s.cp > 1 else None
    key = TraceKey(
        config_json=_trained_config_json(s),
        regime=s.regime,
        lora_rank=s.lora_rank if s.lora else 0,
        lora_dropout=s.config.lora.dropout if s.lora else 0.0,
        lora_targets=tuple(s.lora_targets) if s.lora else (),
        checkpointed=checkpointed,
        mlp_tiled=mlp_tiled,
        layers_tiled=layers_tiled,
        cp=_traced_cp(s),
        cp_method=cp_method,
        tp=s.tp,
        samples=(),
        keep_attention=s.keep_attention and checkpointed,
        lora_autocast=s.lora and s.regime == "bf16" and not s.fsdp,
    )
    chunks = 2 if cp_method == "ring" else 1
    tiles = tile_count(s, key.tiling)
    key = _unwindowed(s, replace(key, samples=samples_for(s.tokens, _windowless(s.shape), tiles, chunks))) or \
        replace(key, samples=samples_for(s.tokens, s.shape, tiles, chunks))
    if not s.shape.scan_chunk:
        return key
    documents = row_padding(s.config, s.shape.scan_chunk, s.dims.dp_size).documents
    return replace(key, documents=_traced_documents(key, documents, s.shape.scan_chunk))


def _windowless(shape):
    """`shape` (a ModelShape) without its sliding window."""
    return replace(shape, sliding_window=None, local_layers=())


def _unwindowed(s, key: TraceKey) -> TraceKey | None:
    """`key` (its samples those of `s`'s shape without a window) with the sliding window clamped to the longest
    sequence its samples trace, where the window cuts no sequence of the run nor of the samples; None where it does.
    A query then sees every earlier key of its document either way: the blockwise window runs one causal block
    (models/blockwise.py), the same blocks as without a window, so the layers hold the same bytes and the costs are
    the windowless line. The clamp makes the trace independent of the plan's length: a window as long as Phi-4-mini's
    262,144 tokens put the traced lengths at six windows (`base_length`), beyond every length the search tried, and
    each point traced at its own length (#52)."""
    window = s.shape.sliding_window
    longest = (key.cp if key.cp_method else 1) * max(tokens for tokens, *_ in key.samples)
    if not window or s.seq_len > window or longest > window:
        return None
    return replace(key, window=longest)


def _traced_documents(key: TraceKey, documents: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """`TraceKey.documents` of a plan whose row holds documents of the lengths `documents`: the documents its packed
    sample's row holds (`_packed_samples`: the row cut at that sample's tokens), all a trace reads of them; () where
    the row is one document or the packed row holds nothing but whole chunks of one document, whose padding is none
    (`_with_padding`). The assumed row's documents grow with seq_len (plan/padding.py),
    and the points of the search for the longest seq_len share a trace where they differ past that sample: Qwen3.5-27B
    's search traced its layers once a point, 17 times (#52)."""
    if len(documents) < 2:
        return ()
    cp = key.cp if key.cp_method else 1
    row = _row_documents(cp * key.samples[0][0], documents)
    return () if len(row) == 1 and not padded(row, chunk) else row


# -- the disk cache ---------------------------------------------------------------------------------------------


def _cache_file(key: TraceKey) -> Path:
    name = hashlib.sha256(json.dumps([code_digest(), asdict(key)], sort_keys=True).encode()).hexdigest()
    return cache_dir("layer_costs") / f"{name}.json"


def _load(key: TraceKey) -> Traced | None:
    try:
        values = json.loads(_cache_file(key).read_text())
    except (OSError, ValueError):  # not traced yet, or unreadable: trace again
        return None
    return Traced(values["kind_of"], {int(i): LayerCosts(**c) for i, c in values["costs"].items()}, values["untraced"],
                  values["planar"], tuple(values["tables"]))


def _store(key: TraceKey, traced: Traced) -> Traced:
    store_json(_cache_file(key), {"kind_of": traced.kind_of, "untraced": traced.untraced, "planar": traced.planar,
                                  "tables": traced.tables, "costs": {i: asdict(c) for i, c in traced.costs.items()}})
    return traced


# -- tracing ----------------------------------------------------------------------------------------------------


def _kinds(layers, layer_types) -> list[int]:
    """Per layer, the index of the first layer of its kind: the same modules (names and classes; experts count
    once), parameters of the same shapes (the adapters of a kind's layers are alike: `_counted_lora`) and the same
    `layer_types` entry."""
    import re

    def named(items):
        return tuple(dict.fromkeys((re.sub(r"\.\d+(?=\.|$)", ".#", n), item) for n, item in items))

    first: dict[tuple, int] = {}
    kinds = []
    for i, layer in enumerate(layers):
        structure = (named((n, type(m).__name__) for n, m in layer.named_modules()),
                     named((n, tuple(p.shape)) for n, p in layer.named_parameters()))
        kind = (structure, layer_types[i] if isinstance(layer_types, list) and len(layer_types) == len(layers) else None)
        kinds.append(first.setdefault(kind, i))
    return kinds


_BUILT: dict[tuple, tuple] = {}


def _model(config_json: str, lora_rank: int = 0, lora_dropout: float = 0.0, lora_targets: tuple[str, ...] = (),
           cfg=None, window: int | None = None):
    """The run's model on the meta device in fp32 and its text config: built once per process for everything the
    plan reads off it (the adapters' counts, every trace of a plan's checkpointed and plain layers, its tilings, the
    searches' other switches), each trace copying its first layers (`_first_layers_adapted`) and casting the copy to
    its regime's storage dtype. Without LoRA where its copies take it (`_lora_on_copies`), else with LoRA as
    build_model adapts it (`cfg`'s lora settings; rank 0: none). `window`: `TraceKey.window`."""
    whole = lora_rank and not _lora_on_copies(lora_targets)
    built = (config_json, window, lora_dropout, lora_targets) if whole else (config_json, window)
    if built not in _BUILT:
        _BUILT[built] = _built_model(config_json, lora_rank if whole else 0, cfg, window)
    return _BUILT[built]


def _lora_on_copies(lora_targets: tuple[str, ...]) -> bool:
    """Whether the adapters go on the copies of the model's first layers rather than on the whole model: peft adapts
    a module whose name is a target or ends in "." + a target, so bare module names (q_proj, down_proj) adapt every
    layer alike and the copy holds the adapters the whole model's first layers hold, at a fraction of the cost
    (Llama 3.1 8B: 1 s of a cold plan for its 224 adapters). A dotted target may name one layer (layers.20.mlp)."""
    return all("." not in target for target in lora_targets)


_ADAPTED: dict[tuple, object] = {}


def _first_layers_adapted(model, count: int, lora_rank: int, lora_targets: tuple[str, ...], cfg):
    """`_first_layers(model, count)`, with LoRA as build_model adapts it where `_model` left it to the copies: made
    once per process for every trace of a model that copies as many layers with the same adapters (a plan's search
    for the longest seq_len traces a Phi-3.5 layer at a dozen lengths, #52); a trace copies it again before applying
    its techniques (`_trace`), so it is never changed. Keyed by the model's identity: `_BUILT` holds every model."""
    adapted = bool(lora_rank) and _lora_on_copies(lora_targets)
    key = (id(model), count, repr(cfg.lora) if adapted else None)
    if key not in _ADAPTED:
        copied = _first_layers(model, count)
        _ADAPTED[key] = _with_lora(copied, cfg) if adapted else copied
    return _ADAPTED[key]


def _first_layers(model, count: int):
    """A deep copy of `model` holding its first `count` decoder layers, every traced layer among them (the first of
    each kind): what a layer holds depends on its own modules and on what the model's forward gives it before it
    (embeddings, rotary tables, masks, per-layer inputs, keys and values shared from an earlier layer), never on the
    layers after it. The copy, its fake parameters and its techniques then cost a few layers, not a whole model
    (Llama 3.1 8B: 2 of 32). A model whose layers are found only by their count (`decoder_layers`' last resort) is
    copied whole."""
    import copy

    from longfit.models.structure import decoder_layers

    layers = decoder_layers(model)
    later = list(layers[count:])
    del layers[count:]
    try:
        copied = copy.deepcopy(model)
    finally:
        layers.extend(later)
    try:
        if len(decoder_layers(copied)) == count:
            return copied
    except ConfigError:
        pass
    return copy.deepcopy(model)


def _built_model(config_json: str, lora_rank: int, cfg=None, window: int | None = None):
    """The model `_model` keeps: without LoRA, the one built for every reader (`shapes.meta_model`: the shape's
    parameter count built it first); with LoRA, which peft adds in place, a build of its own."""
    from longfit.plan.shapes import built_meta_model, meta_model

    if not lora_rank:
        return meta_model(config_json, window)
    model, config = built_meta_model(config_json, window)
    return _with_lora(model, cfg), config


def _with_lora(model, cfg):
    """`model` (meta device) with peft's adapters of `cfg`'s lora settings, as build_model adapts it."""
    import torch

    from longfit.models.build import lora_config, peft_quietly

    # the adapters on the meta device too (peft made them on the CPU, then moved them); the traced model holds no
    # 4-bit or 8-bit layer, so peft goes without bitsandbytes (1.3 s of a cold plan's imports)
    with peft_quietly(unquantized=True), torch.device("meta"):
        from peft import get_peft_model

        return get_peft_model(model, lora_config(cfg))


def _techniques(model, key: TraceKey, mesh, tiles: int) -> None:
    """parallelize's order (its steps 1, 3 and 4): tensor parallelism and context parallelism over the fake process
    group's `mesh` (None: one rank), then the memory techniques as longfit.memory.apply_memory_techniques applies
    them, their tiles `tiles` to a layer or MLP."""
    import torch.distributed as dist

    from longfit.models.structure import decoder_layers

    if key.tp > 1:
        from longfit.memory.loss import CausalLMLoss
        from longfit.parallel.tp import apply_tensor_parallel

        apply_tensor_parallel(CausalLMLoss(model), mesh.tp_mesh)
    if key.cp_method:
        from longfit.parallel.parallelize import apply_context_parallel

        apply_context_parallel(model, mesh.cp_group if mesh is not None else dist.group.WORLD, key.cp_method)
    if key.layers_tiled:
        from longfit.memory.tiled_layers import apply_tiled_layers
        from longfit.parallel.tiled_attention import LocalTileAttention

        apply_tiled_layers(model, LocalTileAttention.for_sequence, len(decoder_layers(model)), tiles)
        return
    if key.mlp_tiled:
        from longfit.memory.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, tiles, intermediate_shards=key.tp)
    if key.checkpointed:
        from longfit.memory.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, 1.0, keep_attention=key.keep_attention)


class _Captured(Exception):
    pass


def _captured_calls(model, layers, wanted: set[int], tokens: int, activations, kind_of: list[int],
                    run_layers: bool = False, documents=None) -> tuple[dict[int, tuple[tuple, dict]], int]:
    """The (args, kwargs) the model's forward gives each wanted layer on `tokens` token ids, every layer skipped
    (its output is its input) so that only the embedding and the model's own tables run; and the model's tables:
    the activation bytes (`activations()`, the tracker's count) its forward holds when it calls its first layer,
    besides the token ids and the hidden states (rotary tables of every layer kind, Gemma 3n's and Gemma 4's
    per-layer inputs, and what autograd saved to differentiate them: their projection and norm under full
    fine-tuning).

    A layer handed a mapping that layers share (Gemma 4's `shared_kv_states`: the last layers attend to the keys and
    values an earlier layer of their kind wrote there) runs instead, without autograd, so that the layers reading it
    find what they read; each wanted layer gets a copy of it, its tensors autograd leaves (the keys and values of
    the real step require their gradient). So do all layers (`run_layers`) of a model whose forward takes more than
    the hidden states back from a layer, which a skipped layer's output cannot be unpacked into (GLM-5's layers pass
    their key selection on to the next one, #57): the first layer of each kind (`kind_of`: the traced layer of each)
    runs, and a later one hands on its input with what the first handed on besides it, the same shapes (the
    published GLM-5's first MoE layer, its fourth, is captured after one dense layer's run, not three)."""
    from collections.abc import MutableMapping

    import torch
    from torch.utils._pytree import tree_map

    from longfit.models.structure import unwrap_peft

    calls: dict[int, tuple[tuple, dict]] = {}

    def leaf(t):
        return t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t

    def detached(v):
        """A layer's backward ends at its own inputs, those the step differentiates leaves that take their gradient:
        Gemma 4's per-layer inputs under full fine-tuning (#52: without theirs a tiny Gemma 4 planned 6.2% under its
        step)."""
        if isinstance(v, MutableMapping) and not isinstance(v, dict):  # not a pytree node: copied here
            return type(v)(tree_map(leaf, dict(v)))
        return v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v

    def skipped(index: int):
        def forward(*args, **kwargs):
            if index == 0:
                hidden = args[0] if args else kwargs["hidden_states"]
                hidden = getattr(hidden, "_local_tensor", hidden)  # a DTensor under sequence parallelism
                tables.append(activations() - before - hidden.untyped_storage().nbytes())
            if index in wanted:
                calls[index] = tree_map(detached, (args, kwargs))
                if len(calls) == len(wanted):
                    raise _Captured
            hidden = args[0] if args else kwargs["hidden_states"]
            if any(isinstance(v, MutableMapping) and not isinstance(v, dict) for v in kwargs.values()):
                run = True
            elif run_layers:
                run = kind_of[index] not in handed_on
            else:
                return hidden
            if not run:
                return (hidden, *handed_on[kind_of[index]])
            with torch.no_grad():
                out = (own[index] or type(layers[index]).forward.__get__(layers[index]))(*args, **kwargs)
            handed_on.setdefault(kind_of[index], out[1:] if isinstance(out, tuple) else ())
            return out
        return forward

    handed_on: dict[int, tuple] = {}  # what the first run layer of each kind returned besides the hidden states

    own = [layer.__dict__.get("forward") for layer in layers]  # checkpointing sets its forward on the instance
    for i, layer in enumerate(layers):
        layer.forward = skipped(i)
    tables: list[int] = []
    try:
        # positions given, as the trainer gives them: under sequence parallelism the embedding's output is this
        # rank's shard, from which the model would count too few
        ids, positions = torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens)[None]
        before = activations()
        with _adapters_off(model):
            unwrap_peft(model).model(input_ids=ids, position_ids=positions, use_cache=False,
                                     longfit_documents=documents)
    except _Captured:
        pass
    except (TypeError, ValueError):  # the model unpacks more than a skipped layer returns
        if run_layers:
            raise
        run_layers = True
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
    if run_layers and len(calls) < len(wanted):
        return _captured_calls(model, layers, wanted, tokens, activations, kind_of, run_layers=True,
                               documents=documents)
    return calls, tables[0]


def _adapters_off(model):
    """peft's adapters turned off (`PeftModel.disable_adapter`) while `_captured_calls` runs the model for its layers'
    inputs: an adapter changes no shape or dtype of what a layer hands on (peft casts its sum to the base layer's
    dtype), and the layers a capture runs (Gemma 4's that write the keys and values its last layers share, every
    layer of GLM-5's kinds) run on every sample, their adapters a third of each run (Gemma 4 E2B's plan at 128K:
    0.54 of 2.06 CPU s of captures, #52)."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()


def _measure(layer, call: tuple[tuple, dict], tracker, residual, offloadable: bool) -> dict[str, float]:
    """Bytes of one layer's forward and backward on the captured call, its input a fresh autograd tensor.
    `offloadable`: the layer saves its input through saved-tensor hooks (a checkpointed or tiled layer), where the
    offload store takes it. Its backward is then measured with the input brought back as the store brings it, a
    fresh copy at the recompute that lives as long as the recomputed layer refers to it (`reloaded_backward_peak`;
    a bf16 layer whose norm reads it into fp32 lets it go at once), and with the input on the device, read in place
    (`backward_peak`: the copy left out, `ActivationBytes.resident_peak`). Otherwise a copy of the input is counted
    through the whole backward (a bound: `_trace` says where).
    `passed`: the bytes of the layer's outputs besides the hidden states that die with the output (nothing the layer
    saved refers to them), which the next layer takes as an input and holds (GLM-5's key selection, `passed` in the
    analytic planner).

    Every sample starts as the step's first micro-batch reaches the layer, its parameters without gradients, and a
    gradient is counted as a weight once autograd has accumulated it (the analytic plan counts the model's gradients:
    `gradients`, FSDP2's unsharded `layer_grads`). A gradient made in another shape than its parameter's (peft's
    adapters of fused experts: (experts, r, in) then flattened) would otherwise stay an activation in the first
    sample measured on a copy of the layers and be added in place in the next ones, so a sample's bytes depended on
    which ran first in its process (Qwen3-30B-A3B's backward peak: 41 MB more in the first, `_on_two_cores`)."""
    import gc
    import weakref

    import torch
    from torch.autograd.graph import _engine_run_backward

    from longfit.plan.tracker import RELOADED, WEIGHT_LIKE

    args, kwargs = call
    hidden = args[0] if args else kwargs["hidden_states"]
    source = torch.empty(hidden.shape, dtype=residual, requires_grad=True)
    x = source * 1  # owned by autograd like a real layer input
    args, kwargs = ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def pack(tensor):
        return (tensor.shape, tensor.dtype, tensor.device) if tensor is x else tensor

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        with tracker.region(RELOADED):
            return torch.empty(packed[0], dtype=packed[1], device=packed[2])

    trainable = [p for p in layer.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = None
    accumulated = [p.register_post_accumulate_grad_hook(lambda p: tracker.retag([p.grad], WEIGHT_LIKE))
                   for p in trainable]
    start = tracker.activations
    tracker.activation_peak = start
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack) if offloadable else contextlib.nullcontext():
        out = layer(*args, **kwargs)
    out, *handed = out if isinstance(out, tuple) else (out,)
    forward_peak = tracker.activation_peak - start
    input_storage = weakref.ref(x.untyped_storage())
    on_the_device = x if offloadable else None  # the input the hooks took, where the layer keeps it
    del x, args, kwargs
    gc.collect()  # settle reference cycles (checkpoint frames) before reading the live bytes (`_objects_before_frozen`)
    input_kept = input_storage() is not None
    with_handed = tracker.activations
    del handed  # what the next layer would hold: freed here unless saved for this layer's backward
    passed = with_handed - tracker.activations
    saved = tracker.activations - start - out.untyped_storage().nbytes()
    saved += 0 if input_kept else source.numel() * source.element_size()
    # The incoming gradient made inside the measured backward (mul's backward of sum's expanded scalar), as the next
    # layer's backward makes it, and freed where this layer's backward lets it go; mul by a number saves nothing.
    arriving = (out * 1).sum()
    backward_start = tracker.activations
    tracker.activation_peak = tracker.resident_peak = backward_start
    # Tensor.backward is a torch function, inside which the trace's function modes are off: the engine, called
    # directly, keeps them on through the recomputes' forwards (`_autocast_products_on_meta`)
    _engine_run_backward((arriving,), (torch.ones_like(arriving),), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)
    del on_the_device
    for hook in accumulated:
        hook.remove()
    reloaded = tracker.activation_peak - backward_start if offloadable else \
        tracker.resident_peak - backward_start + source.numel() * source.element_size()
    return {"saved": saved, "input_kept": float(input_kept), "forward_peak": forward_peak,
            "backward_peak": tracker.resident_peak - backward_start, "reloaded_backward_peak": reloaded,
            "passed": passed}


def _traced_layers(kinds: list[int], tiled: bool) -> tuple[list[int], list[int]]:
    """(the traced layer of each layer, the traced layers): the first of each kind. The first tiled layer is not what
    the others are (its backward looks its input up again from the token ids, which the planner counts itself): a
    later layer of its kind is traced where there is one."""
    first: dict[int, int] = {}
    for i, kind in enumerate(kinds):
        if kind not in first or (tiled and first[kind] == 0):
            first[kind] = i
    return [first[kind] for kind in kinds], sorted(set(first.values()))


@functools.cache
def _layer_bytes():
    """The tracker of `_trace`'s samples: `tracker.ActivationBytes` running aten._grouped_mm in any floating dtype
    itself (plan/trace.py's `_GroupedMatmulInItsDtype`). As a dispatch mode of its own below the tracker, that rule
    saw every operator the meta kernels decompose into, a Python call each: a quarter of a tiny Gemma 2's tiled trace
    (12.2 against 9.2 CPU s on one core, #52)."""
    from torch.distributed.tensor import DTensor

    from longfit.plan.trace import _grouped_mm_in_its_dtype
    from longfit.plan.tracker import ActivationBytes

    class LayerBytes(ActivationBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = None if any(issubclass(t, DTensor) for t in types) else \
                _grouped_mm_in_its_dtype(func, args, kwargs or {})
            if out is None:
                return super().__torch_dispatch__(func, types, args, kwargs)
            self._count_output(out)
            return out

    return LayerBytes


@functools.cache
def _meta_results():
    """The operators' outputs on meta tensors remembered for every trace of this process (`tracker.MetaResults`):
    they run under the same modes (`_trace`), and traces of a plan's other techniques, regimes and layouts run
    many of the same operators at the same lengths (the base's multiples, `samples_for`)."""
    from longfit.plan.tracker import MetaResults

    return MetaResults()


def _on_meta(key: TraceKey) -> bool:
    """Whether `key`'s layers are traced on meta tensors rather than fake ones. A fake tensor computes its shapes,
    dtypes and storages with the operators' meta kernels, so a meta tensor holds the same bytes after every operator,
    at a third of the cost (the fake mode's dispatch and cache key: 60% of a cold plan). Fake tensors stay where the
    step needs what meta tensors lack: autocast (none on the meta device) and DTensor, whose sharding propagation
    runs on meta tensors that are no memory (`LiveBytes`). An operator without a meta kernel, which a fake tensor runs
    on a CPU stand-in, sends the trace back to fake tensors (`_trace`). A one-rank LoRA run in bf16 takes autocast's
    casts of its products on meta tensors (`_autocast_products_on_meta`); a float32 product they miss sends it back
    (`_float32_matmuls_refused`).
    `test_a_layer_traced_on_meta_tensors_holds_what_it_holds_on_fake_ones` compares the two."""
    return key.tp == 1 and key.cp_method is None and key.regime != "autocast"


@contextlib.contextmanager
def _kernels_chosen_by_device(on_meta: bool):
    """On meta tensors, refuse an operator whose kernel is chosen by the device type inside a composite operator, where
    the meta device takes another kernel than the CPU would, with other tensors: scaled_dot_product_attention, whose
    math kernel on the meta device holds the (L, L) scores its CPU flash kernel does not (a checkpointed Qwen3 layer
    in fp32: 19,968 bytes a token against 2,048). The trace then runs on fake CPU tensors (`_trace`). longfit's own
    attention kernels call the CPU's operators by name (models/kernels.py), which meta tensors run as the CPU's, and
    so does its causal attention where the CPU would run SDPA's flash kernel (`attention.causal_attention`, #52):
    what reaches SDPA here is what the CPU would run otherwise, or a model's own call."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Refused(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.scaled_dot_product_attention:
                raise NotImplementedError("scaled_dot_product_attention chooses its kernel by the device")
            return func(*args, **(kwargs or {}))

    with Refused() if on_meta else contextlib.nullcontext():
        yield


def _autocast_products_on_meta():
    """CPU autocast's bf16 casts of a matrix product's operands, made on meta tensors, which have no autocast of their
    own. A one-rank LoRA run in bf16 runs its layers under autocast (`TraceKey.lora_autocast`); the meta trace holds
    the model in bf16, so a layer computes as under autocast except where it multiplies in float32 on purpose, as
    Qwen3.5's and Qwen3-Next's Gated DeltaNet scans do (the chunks' products of fp32 q, k, v), which autocast runs in
    bf16 (traced in float32: the plan 5.6% over the step). The products are CPU autocast's lower-precision list as
    Python calls them (aten/src/ATen/autocast_mode.cpp; matmul and `@`, linear, the convolutions); the casts are made
    where autocast makes them, above autograd, so the product saves the bf16 copies, and not inside a kernel that
    turned autocast off (`models.kernels.without_autocast`). The mode's `autocast` is the CPU's autocast at the torch
    function it runs, which `_float32_matmuls_refused` reads: inside a dispatch mode autocast reads as off. Without
    these casts every such key was traced on fake tensors (Qwen3.5-27B's LoRA plan at 128K: 91 cold CPU s)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    products = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm,
                torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm,
                torch.Tensor.baddbmm, torch.addbmm, torch.Tensor.addbmm, torch.linalg.vecdot, F.linear, F.prelu,
                F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}

    def in_bf16(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype not in (torch.bfloat16, torch.float64):
            return a.to(torch.bfloat16)
        return a

    backward = {torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward}

    class Casts(TorchFunctionMode):
        autocast = False  # outside any torch function: the autograd engine's backward, which the run runs without

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            enabled = torch.is_autocast_enabled("cpu")
            if enabled and func in products and "out" not in kwargs:
                args, kwargs = [in_bf16(a) for a in args], {k: in_bf16(v) for k, v in kwargs.items()}
            # a backward run inside a layer's own backward (a tiled layer's tile) runs without the mode, which is off
            # inside its own calls, as the run runs it, outside autocast: nothing in it is cast, or refused
            outer, self.autocast = self.autocast, enabled and func not in backward
            try:
                return func(*args, **kwargs)
            finally:
                self.autocast = outer

    return Casts()


@contextlib.contextmanager
def _float32_matmuls_refused(casts):
    """Where `casts` (`_autocast_products_on_meta`'s mode) is given, a matrix product reaching the dispatcher with a
    float32 operand while autocast is on raises NotImplementedError, and the trace runs on fake tensors under torch's
    autocast instead (`_trace`): one the casts did not see, as a composite makes it (einsum's bmm). The operators are
    CPU autocast's lower-precision list as they reach the dispatcher (linear and matmul as mm, addmm, bmm). A trace's
    first sample is watched: its layers take the same dtypes at every length, and the tracker's memo of meta results
    answers later ones without calling them."""
    import torch

    from longfit.plan.tracker import UncompiledDispatchMode

    aten = torch.ops.aten
    products = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default,
                aten.convolution.default}

    class Refused(UncompiledDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in products and casts.autocast and any(
                    isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
                raise NotImplementedError(f"{func}: a float32 matrix product, which autocast runs in bf16")
            return func(*args, **(kwargs or {}))

    with Refused() if casts is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _autocast_off_on_meta_turns_off_the_cpus(on_meta: bool):
    """On meta tensors, autocast turned off on the meta device turns off the CPU's, under which the trace runs in the
    meta device's place (`_autocast_products_on_meta`), as the run turns off its device's: torch has no autocast on
    the meta device and refuses the context ("unsupported scalarType"), which peft's adapters of a parameter
    (`ParamWrapper`: fused experts) and transformers' rotary embeddings enter on their tensors' device (the trace went
    back to fake tensors: Qwen3-Coder-Next's cold plan 226 CPU s, #52). Any other autocast is torch's own."""
    import torch

    if not on_meta:
        yield
        return
    original = torch.autocast

    class OffOnTheCpu(original):
        def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            super().__init__("cpu" if device_type == "meta" and not enabled else device_type, dtype, enabled,
                             cache_enabled)

    torch.autocast = OffOnTheCpu
    try:
        yield
    finally:
        torch.autocast = original


def _trace(key: TraceKey, cfg=None, on_meta: bool | None = None) -> Traced:
    """`cfg`: the run's Config, whose LoRA settings build_model applies (`key` holds those the costs depend on).
    The model is built once (`_model`), its first layers through the last traced one copied and adapted
    (`_first_layers_adapted`), and that copy copied again for each sample (the techniques take its tile count when
    applied). `on_meta`: the tensors the layers run on (None: `_on_meta`)."""
    import copy
    import traceback

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    from longfit.models.build import use_lora_storage
    from longfit.models.linear_attention import forget_layouts
    from longfit.models.structure import decoder_layers
    from longfit.parallel.dims import ParallelDims
    from longfit.plan.trace import TraceUnsupported, fake_process_group, real_meshes, separate_sharding_propagation
    from longfit.plan.tracker import WEIGHT_LIKE

    cp = key.cp if key.cp_method else 1
    if cp * key.tp > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        return _in_a_fresh_process(key, cfg)
    if on_meta is None:
        on_meta = _on_meta(key)
    residual = torch.bfloat16 if key.regime == "bf16" else torch.float32

    def tiled_copy(tiles: int) -> tuple:
        """(model, its decoder layers, parameters, their shapes, fake mode) of a copy of the first layers with the
        techniques applied at `tiles` tiles."""
        model = copy.deepcopy(first)
        if key.lora_autocast:
            use_lora_storage(model, torch.bfloat16)
        elif key.regime == "bf16":
            model.to(torch.bfloat16)
        layers = list(decoder_layers(model))
        mode = None if on_meta else FakeTensorMode(allow_non_fake_inputs=True)
        with torch.device("meta") if on_meta else mode:  # built on the meta device, where it stays
            if not on_meta:
                model.to_empty(device="cpu")
            _techniques(model, key, mesh, tiles)
        parameters = list(model.parameters())
        shapes = {tuple(p.shape) for p in parameters}  # under tp also each rank's slice
        shapes |= {tuple(p.to_local().shape) for p in parameters if isinstance(p, DTensor)}
        shapes |= {tuple(reversed(shape)) for shape in shapes}
        return model, layers, parameters, shapes, mode

    def measure(samples) -> dict[tuple[int, int], tuple[int, dict[int, dict]]]:
        """(tokens, tiles) -> (the model's tables (`_captured_calls`), traced layer -> its sample), `samples` (an
        iterable, which `_on_two_cores` deals as they are taken) measured in turn, each on a copy of its own: a
        model's first call can leave tensors that its later ones reuse (LongRoPE's long frequencies, 192 bytes of
        Phi-3.5-mini's rotary tables), which every sample then holds as the step's first micro-batch does, whichever
        process measures it after whichever other sample (with a copy a tile count, Phi-3.5-mini's plan at 128K came
        out 11,991 bytes apart in two runs)."""
        measured = {}
        results = _meta_results() if on_meta else None
        casts = _autocast_products_on_meta() if on_meta and key.lora_autocast else None
        for sample in samples:
            model, layers, parameters, shapes, mode = tiled_copy(sample[1])
            tokens, documents = sample[0], (_packed_row(cp * sample[0], sample[2]) if len(sample) > 2 else None)
            with torch.device("meta") if on_meta else mode, separate_sharding_propagation(), torch.autocast(
                    "cpu", dtype=torch.bfloat16, enabled=key.regime == "autocast" or key.lora_autocast), \
                    casts or contextlib.nullcontext():
                tracker = _layer_bytes()(mode, shapes, on_meta=on_meta, meta_results=results)
                forget_layouts()  # each length's layouts made and counted in its own layers (forget_layouts)
                # the first sample's operators seen before the tracker's memo of meta results answers them
                with tracker, _float32_matmuls_refused(None if measured else casts):
                    tracker.adopt(parameters, WEIGHT_LIKE)
                    calls, tables = _captured_calls(model, layers, set(wanted), tokens,
                                                    lambda: tracker.activations, kind_of, documents=documents)
                    # Under tensor parallelism the layer gathers its input's sequence shard first: its copy
                    # brought back showed at one tiled sample's floor alone (llama-tiny's tiled MLP at tp=2,
                    # 2,144 tokens in 16 tiles), which no plane describes; it is counted as a bound.
                    measured[sample] = tables, {
                        i: _measure(layers[i], calls[i], tracker, residual, key.checkpointed and key.tp == 1)
                        for i in wanted}
        return measured

    try:
        with fake_process_group(cp * key.tp), real_meshes(), _kernels_chosen_by_device(on_meta), \
                _autocast_off_on_meta_turns_off_the_cpus(on_meta):
            mesh = None
            if key.tp > 1:  # ParallelDims' mesh of a tp run (it has FSDP2's axes too, of one rank here)
                mesh = ParallelDims(1, cp, cp * key.tp, key.cp_method or "ring", tp=key.tp).build_mesh("cpu")
            built, config = _model(key.config_json, key.lora_rank, key.lora_dropout, key.lora_targets, cfg, key.window)
            kind_of, wanted = _traced_layers(_kinds(decoder_layers(built), getattr(config, "layer_types", None)),
                                             key.layers_tiled)
            first = _first_layers_adapted(built, max(wanted) + 1, key.lora_rank, key.lora_targets, cfg)
            scans = [i for i in wanted if _scans(config, i)]
            packed = _packed_samples(key) if scans else []
            with _objects_before_frozen():
                measured = _on_two_cores(measure, list(key.samples) + packed)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        if on_meta:  # an operator without a meta kernel: fake tensors run it on a CPU stand-in (`_on_meta`)
            return _trace(key, cfg, on_meta=False)
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        if key.mlp_tiled and any(frame.f_code.co_filename.endswith("tiled_mlp.py") for frame, _ in traceback.walk_tb(e.__traceback__)):
            raise ConfigError(f"{config.model_type}: the tiled MLP (memory.tiled_mlp) cannot run this model's MLP "
                              f"({type(e).__name__}: {line[:120]}); set memory.tiled_mlp=false") from e
        raise TraceUnsupported(f"{config.model_type}: its decoder layers cannot be traced on fake tensors "
                               f"({type(e).__name__}: {line[:200]})") from e
    tables = {tokens: measured[tokens, tiles][0] for tokens, tiles in key.samples}
    layers = decoder_layers(first)
    costs = {}
    for i in wanted:
        points = [(tokens, tiles, measured[tokens, tiles][1][i]) for tokens, tiles in key.samples]
        name = f"{config.model_type}: layer {i} ({type(layers[i]).__name__})'s"
        if len(points) == len(TILE_SAMPLES):  # else a line at one tile count or tile length (`_part`)
            costs[i] = _fit_plane(points, name)
            if costs[i] is None:
                return Traced(kind_of, {}, planar=False, tables=_table_line(tables))
            costs[i] = replace(costs[i], tiling=key.tiling)
        else:
            costs[i] = _fit_line([(tokens, sample) for tokens, _, sample in points], name)
        if packed and i in scans:
            costs[i] = _with_padding(costs[i], packed[0], measured[packed[0]][1][i], measured[packed[0][:2]][1][i], cp)
    return Traced(kind_of, costs, tables=_table_line(tables))


def _scans(config, i: int) -> bool:
    """Whether decoder layer i of `config` is a linear-attention layer, which scans each document on whole chunks."""
    types = getattr(config, "layer_types", None) or ()
    return i < len(types) and types[i] == "linear_attention"


def padded_slots(row_padding: int, rows: int, cp: int) -> float:
    """The slots a rank's linear-attention scans hold beyond its tokens, `LayerCosts.per_padded_slot`'s unit: `rows`
    rows of a micro-batch, each `row_padding` slots past its tokens (the rows side by side on the longest row's
    chunks), the whole rows scanned with their heads split over the cp ranks (parallel/linear.py)."""
    return rows * row_padding / cp


def _packed_samples(key: TraceKey) -> list[tuple[int, int, tuple[int, ...]]]:
    """An untiled trace's shortest sample again, its row packed with the plan's row's documents over and over
    (`_packed_row`): what its linear-attention layers hold above the one document's is their scans' padding
    (`_with_padding`), at the plan's row's share of padding (a layer's peak is the largest of its events, so a share
    measured elsewhere would misplace it: the shrunken Qwen3.5's rows of 257-token documents planned at the bytes a
    slot of documents one token past a chunk came out 2.9% over the traced step, a row of 30-token chats 1.3% under).
    Tiled layers: the first sample's tiles, whose pieces of documents pad per tile (`_with_padding`)."""
    return [(*key.samples[0], key.documents)] if key.documents else []


def _row_documents(length: int, documents: tuple[int, ...]) -> tuple[int, ...]:
    """The document lengths of a row of `length` tokens packed with documents of the lengths `documents`, repeated
    (the last one cut)."""
    row, start = [], 0
    while start < length:
        for n in documents:
            row.append(min(n, length - start))
            start += n
            if start >= length:
                break
    return tuple(row)


def _packed_row(length: int, documents: tuple[int, ...]):
    """One row of `length` tokens packed with documents of the lengths `documents` (`_row_documents`), as the trainer
    hands it to the model (`longfit_documents`)."""
    import itertools

    from longfit.data.packing import DocumentLayout

    ends = list(itertools.accumulate(_row_documents(length, documents)))
    return DocumentLayout((tuple(zip([0, *ends[:-1]], ends)),), length)


def _with_padding(costs: LayerCosts, sample: tuple, packed: dict, single: dict, cp: int) -> LayerCosts:
    """`costs` with the bytes per padded slot: what the `packed` row's sample (`sample`: tokens a rank, tiles, its
    documents) holds above the `single` document's at the same tokens, over its `padded_slots` (tiled: over its
    most padded tile's slots beyond one document's, plan/padding.py's `tile_padding`)."""
    from longfit.models.linear_attention import CHUNK

    row = _row_documents(cp * sample[0], sample[2])
    slots = padded_slots(padded(row, CHUNK), 1, cp) if not sample[1] else \
        tile_padding(RowPadding(0, row, ""), sample[0], sample[1], CHUNK)
    if not slots:
        return costs
    return replace(costs, per_padded_slot={q: max(0.0, packed[q] - single[q]) / slots for q in QUANTITIES})


def _on_two_cores(measure, samples: list) -> dict:
    """`measure(samples)` on two cores: this process and a forked copy of it each take the next sample as they finish
    one, the costliest first (`_traced_cost`), from a pipe holding the samples' indices, one byte each (a byte read
    from a pipe is gone for every other reader of it). A sample's cost is known only as it runs: shares made before
    (each tile count's samples in one process, about the same tokens each) left one process waiting 2.5 s of Gemma 2
    9B's 6.1 s trace. Each sample is measured with its own tracker, from the same state of the layers (`_measure`),
    so which process takes it changes no byte (`test_a_trace_split_across_two_processes_holds_what_one_process_traces`).
    A sample the copy could not measure (it raised, or died) is measured here, where its error is raised as in one
    process. Split on Linux only (macOS's system libraries are not safe to fork: multiprocessing spawns there), not on
    one core, and not on a rank of a torchrun job (RANK set: the fork would share the job's sockets and devices)."""
    import pickle
    import signal

    linux = hasattr(os, "sched_getaffinity")  # the cores this process may run on
    if len(samples) < 2 or not linux or len(os.sched_getaffinity(0)) < 2 or "RANK" in os.environ:
        return measure(samples)
    order = sorted(samples, key=_traced_cost, reverse=True)
    deal, dealt = os.pipe()
    os.write(dealt, bytes(range(len(order))))  # fewer samples than a byte counts: TILE_SAMPLES and a packed one
    os.close(dealt)  # before the fork, so that an empty pipe reads as its end in both processes

    def taken():
        while index := os.read(deal, 1):
            yield order[index[0]]

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: its answer down the pipe, then gone without running this process's exit handlers
        os.close(read)
        status = 1
        try:
            import torch

            torch.set_num_threads(1)  # the parent's thread pool is not the copy's (fork copies one thread)
            answer = pickle.dumps(measure(taken()))
            with os.fdopen(write, "wb") as pipe:
                pipe.write(answer)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    try:
        measured = measure(taken())
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(deal)
        with os.fdopen(read, "rb") as pipe:
            answer = pipe.read()
        _, status = os.waitpid(pid, 0)
    measured |= pickle.loads(answer) if status == 0 else {}
    left = [sample for sample in samples if sample not in measured]  # the copy's, where it failed
    return measured | (measure(left) if left else {})


def _traced_cost(sample: tuple) -> tuple[int, int]:
    """How a sample (tokens, tiles, ...) ranks by what it costs to trace: the operators it dispatches, each at the same
    cost at any length of meta tensors. First the layers' passes it runs, one a tile (`tiled_layers.traced_tiles`):
    Gemma 2 9B's samples running four tiles took 1.2-1.8 s each at 24,576-73,728 tokens, those running two 0.5-0.8 s;
    then its tokens (the attention's key blocks, the linear-attention scans' chunks)."""
    from longfit.memory.tiled_layers import traced_tiles

    tokens, tiles = sample[:2]
    return (len(traced_tiles(tiles)) if tiles else 1), tokens


def _table_line(tables: dict[int, int]) -> tuple[float, float]:
    """(bytes per token, fixed bytes) of the model's tables through the shortest and longest traced lengths."""
    (l0, b0), (l1, b1) = min(tables.items()), max(tables.items())
    per_token = (b1 - b0) / (l1 - l0) if l1 > l0 else b0 / l0
    return per_token, b0 - per_token * l0


@contextlib.contextmanager
def _objects_before_frozen():
    """The objects that exist before the layers are measured (the model built, its modeling code and peft imported)
    left out of `_measure`'s collections: a full collection walks every object of the process (torch's and
    transformers' modules, a test session's), 0.3 s each in a fresh process on a 2-core machine, eight or more per
    trace; the cycles `_measure` settles are the trace's own."""
    import gc

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _in_a_fresh_process(key: TraceKey, cfg) -> Traced:
    """`_trace` in a process of its own: this one is a rank of a run (its default process group is taken: the
    preflight of `longfit train`'s ranks, the Trainer's `apply_longfit` in a user's script), and the trace needs a
    fake one. A fresh interpreter of longfit's, never a spawn of the user's script (launch's module docstring)."""
    from longfit.launch import run_in_fresh_interpreters

    model_type = json.loads(key.config_json).get("model_type", "the model")
    try:
        (traced,) = run_in_fresh_interpreters(_trace, [(key, cfg)], f"tracing {model_type}'s decoder layers for the "
                                              "memory plan", FRESH_TRACE_TIMEOUT_S)
    except TimeoutError as error:
        raise ConfigError(f"{error}; run `longfit plan` with this run's settings first (it caches the traces the "
                          "run then reads), then start the run again") from None
    return traced


def _fit_line(points: list[tuple[int, dict]], name: str) -> LayerCosts:
    """The line through the outer lengths, checked at the middle one (module docstring), or a peak's kink (below);
    at one length, that length's own costs."""
    kept = all(sample["input_kept"] for _, sample in points)
    if len(points) == 1:
        ((tokens, sample),) = points
        return LayerCosts({q: sample[q] / tokens for q in QUANTITIES}, dict.fromkeys(QUANTITIES, 0.0), kept)
    (l0, s0), (l1, s1), (l2, s2) = points
    per_token, fixed, floors = {}, {}, {}
    for q in QUANTITIES:
        y0, y1, y2 = s0[q], s1[q], s2[q]
        slope = (y2 - y0) / (l2 - l0)
        off = abs(y0 + slope * (l1 - l0) - y1)
        longer = (y2 - y1) / (l2 - l1)  # the line through the longer two lengths
        if off > LINEAR_TOLERANCE * max(abs(y2), 1.0) and q != "saved" and y1 < y0 + slope * (l1 - l0) \
                and y1 - longer * l1 >= -LINEAR_TOLERANCE * abs(y2):
            # A peak is the largest of the layer's events, each a + b L with a >= 0: below the chord, an event of
            # fixed size tops the others at the shortest length only; the longer two lengths lie on the others' line (a quadratic's line through them
            # would start below zero), and the fixed event is the floor.
            per_token[q], fixed[q] = longer, y1 - longer * l1
            floors[q] = (0.0, y0)
            continue
        if off > LINEAR_TOLERANCE * max(abs(y2), 1.0):
            raise ConfigError(
                f"{name} {q.replace('_', ' ')} is not linear in the sequence length ({y0:.0f}, {y1:.0f}, {y2:.0f} "
                f"bytes at {l0}, {l1}, {l2} tokens); longfit cannot plan it"
            )
        per_token[q], fixed[q] = slope, y0 - slope * l0
    if not floors:
        return LayerCosts(per_token, fixed, kept)
    floor = {q: floors.get(q, (per_token[q], fixed[q])) for q in QUANTITIES}
    return LayerCosts(per_token, fixed, kept, floor_per_token={q: f[0] for q, f in floor.items()},
                      floor_fixed={q: f[1] for q, f in floor.items()})


def _fit_plane(points: list[tuple[int, int, dict]], name: str) -> LayerCosts | None:
    """bytes = max(fixed + per_token L + per_tile_token t, the floor's line) over TILE_SAMPLES' points (L tokens, tiles
    of t tokens; the comment there), per quantity. The floor is the line through the last three samples that lie
    above the plane (what the layer holds outside its tiles overtakes them there): it matters at long rows, where
    llama-tiny's ring backward at 16,384 tokens in tiles of 1,024 held 10,260 bytes per token and the plane alone,
    fitted at 2,144-6,432 tokens, gave 8,952. A quantity the tiles do not change, or whose floor samples all lie on
    the plane (the tiles' events dominate even in tiles of 134 tokens), is its plane alone.

    None where the first three are not a line, the fifth is off the plane, the fourth or fifth lies on the floor
    (the slope in t would not be the tiles'), or one floor sample alone lies above the plane: the peak moves
    between events in ways two lines do not describe (a small Qwen3-MoE's tiled backward: the attention's
    sequence-long tensors against the tile's experts), and the plan traces its own tile count instead, where every
    event grows with L."""
    try:
        line = _fit_line([(tokens, sample) for tokens, _, sample in points[:3]], name)
    except ConfigError:
        return None
    (l2, n2, s2), (l3, n3, s3), (l4, n4, s4) = points[2:5]

    def near(a: float, b: float) -> bool:
        return abs(a - b) <= LINEAR_TOLERANCE * max(abs(a), abs(b), 1.0)

    per_token, per_tile, floor_per_token, floor_fixed = {}, {}, {}, {}

    def plane(q: str, tokens: int, tiles: int) -> float:
        return line.fixed[q] + per_token[q] * tokens + per_tile[q] * (tokens // tiles)

    for q in QUANTITIES:
        per_tile[q] = (s2[q] - s3[q]) / (l2 // n2 - l3 // n3)
        per_token[q] = line.per_token[q] - per_tile[q] / n2  # along the first three, t = L / n2
        if not near(plane(q, l4, n4), s4[q]):
            return None
        above = [(tokens, sample[q]) for tokens, tiles, sample in points[5:] if not near(plane(q, tokens, tiles), sample[q])]
        if near(s2[q], s3[q]) or not above:  # the tiles do not change it, or nothing outside them shows
            floor_per_token[q], floor_fixed[q] = per_token[q], line.fixed[q]
            continue
        if len(above) < 2:
            return None
        (la, ya), (lb, yb) = above[0], above[-1]
        floor_per_token[q] = (yb - ya) / (lb - la)
        floor_fixed[q] = ya - floor_per_token[q] * la
        if len(above) == 3 and not near(floor_fixed[q] + floor_per_token[q] * above[1][0], above[1][1]):
            return None
        if any(near(y, floor_fixed[q] + floor_per_token[q] * tokens) for tokens, y in ((l3, s3[q]), (l4, s4[q]))):
            return None  # the shorter tiles' samples are the floor's, not the tiles'
    kept = all(sample["input_kept"] for _, _, sample in points)
    return LayerCosts(per_token, line.fixed, kept, per_tile, floor_per_token=floor_per_token, floor_fixed=floor_fixed)


@dataclass(frozen=True)
class LoraCounts:
    """The adapters' parameters of a model outside the preset families, counted on its peft model (meta device)."""

    total: int
    largest_layer: int
    """Of one decoder layer: what FSDP2 reduce-scatters per layer."""
    largest_mlp: int
    """Of one decoder layer's `mlp` (experts included): its unsharded gradients at the layer's backward peak."""
    largest_merged: int
    """Of one decoder layer: the parameters peft adapts as parameters (`ParamWrapper`: fused experts), whose forward
    and recompute make the merged weight W + B A, held until the layer's backward has used it."""


_LORA_CACHE: dict[tuple, LoraCounts] = {}


def lora_counts(s) -> LoraCounts:
    """The trainable parameters of `s`'s LoRA run, as longfit's build_model adapts the model (its lora_config)."""
    key = (s.shape.config_json, s.lora_rank, tuple(s.lora_targets))
    if key not in _LORA_CACHE:
        _LORA_CACHE[key] = _load_lora_counts(key) or _store_lora_counts(key, _counted_lora(s))
    return _LORA_CACHE[key]


def _lora_counts_file(key: tuple) -> Path:
    """On disk beside the layer costs (the module docstring's key: the code digest), under `lora_counts`."""
    name = hashlib.sha256(json.dumps([code_digest(), key]).encode()).hexdigest()
    return cache_dir("lora_counts") / f"{name}.json"


def _load_lora_counts(key: tuple) -> LoraCounts | None:
    try:
        return LoraCounts(**json.loads(_lora_counts_file(key).read_text()))
    except (OSError, ValueError, TypeError):  # not counted yet, or unreadable: count again
        return None


def _store_lora_counts(key: tuple, counts: LoraCounts) -> LoraCounts:
    store_json(_lora_counts_file(key), asdict(counts))
    return counts


def _counted_lora(s) -> LoraCounts:
    """The adapters' parameters counted on the peft model of `s`'s config, built on the meta device: the copy of its
    first layers the layer traces adapt (`_first_layers_adapted`), every layer counted as the first of its kind
    (`_kinds`: the same modules and parameter shapes, so the same adapters where `_lora_on_copies`), what is outside
    the layers once; or the whole peft model, where `_model` adapted it."""
    from longfit.models.structure import decoder_layers

    targets = tuple(s.lora_targets)
    built, config = _model(_trained_config_json(s), s.lora_rank, s.config.lora.dropout, targets, s.config)
    kinds = _kinds(decoder_layers(built), getattr(config, "layer_types", None))
    model = built if not _lora_on_copies(targets) else \
        _first_layers_adapted(built, max(kinds) + 1, s.lora_rank, targets, s.config)

    from peft.tuners.lora.layer import ParamWrapper

    def trainable(module) -> int:
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def merged(layer) -> int:
        return sum(wrapper.get_param().numel() for wrapper in layer.modules() if isinstance(wrapper, ParamWrapper))

    layers = decoder_layers(model)
    outside = trainable(model) - sum(trainable(layer) for layer in layers)
    return LoraCounts(
        outside + sum(trainable(layers[kind]) for kind in kinds), max(trainable(layers[kind]) for kind in kinds),
        max((trainable(layers[kind].mlp) for kind in kinds if hasattr(layers[kind], "mlp")), default=0),
        max(merged(layers[kind]) for kind in kinds))
