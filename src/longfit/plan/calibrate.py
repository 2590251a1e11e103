"""Derive the per-layer activation coefficients of `layer_costs.py` from one-layer traces.

    python -m longfit.plan.calibrate > src/longfit/plan/layer_costs.py
    python -m longfit.plan.calibrate --tp > src/longfit/plan/layer_costs_tp.py
    python -m longfit.plan.calibrate --tiled > src/longfit/plan/tiled_costs.py

The analytic planner needs, for one decoder layer, how many bytes per token its forward keeps for
backward and how high its forward and backward working sets rise. Those are sums over the tensors the
transformers implementation saves (e.g. for Llama in bf16: the fp32 input copy and two bf16 tensors of
each RMSNorm, q and k after RoPE, v, the attention output and its fp32 log-sum-exp, the four MLP
intermediates), so each is a linear form in the layer's widths: hidden h, intermediate f, query width
q = heads*head_dim, key/value width kv, heads nh (per-head fp32 statistics), LoRA rank r times the
number of adapted projections, and the tokens of one MLP tile (the tile count longfit.memory derives). This script traces ONE layer of each
family, precision regime and technique combination with the real modules (peft, longfit.memory's tiled
MLP and checkpointing) on fake tensors at a dozen made-up widths, and solves for those coefficients
by least squares. They come out as (near-)integers -- bytes per element of the saved tensors -- and the
residual of each fit is printed, so a transformers release that changes what a layer saves shows up as
a bad fit here and a failing accuracy test in tests/test_plan_accuracy.py.

Families: "llama" (also Mistral and Qwen2), "gemma3" (a global Gemma 3 layer) and "gemma3_local" (a
Gemma 3 sliding-window layer, traced with a window of LOCAL_WINDOW tokens, far below the calibration's
cp chunks, so that ring attention takes its halo path: no visiting K/V shards, only the window's halo).

Regimes: "bf16" is FSDP2 mixed precision (parameters gathered in bf16, activations bf16), "autocast"
the single-GPU path (fp32 parameters under bf16 autocast: fp32 residual stream and norms, a bf16 copy
of each projection's input), "fp32" no mixed precision. Context parallelism (ring or Ulysses, which
only multi-GPU runs use, so never with autocast) is traced on a fake process group of CP ranks; its
K/V buffers scale with the local tokens, and Ulysses' with kv_rep, the key/value width after it
repeats heads up to a multiple of cp.

Tensor parallelism (`--tp`, written to layer_costs_tp.py): the layer runs with longfit.parallel.tp's plan on a
fake process group, at tp = 2 and 4 alternately, fed its (T/tp, h) sequence shard of the T tokens of a cp rank.
Its tensors are then of two kinds, told apart by the two degrees: sequence-parallel ones (norms, residual: the
terms h_sp = h/tp and one_sp = 1/tp) and ones on all T tokens at this rank's widths (the gathered inputs of
attention and MLP: h; q, kv, kv_rep, nh, f, tile_f taken per rank, i.e. divided by tp, kv one head when tp
exceeds the key/value heads, and kv_out the width the k/v projections compute: kv, or every head when they are
replicated). Costs stay bytes per token of T. Llama-style layers only (what tp plans); bf16 for
every technique and CP method, fp32 without CP, as for the entries without tp.
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import sys
import weakref

import torch

from longfit.plan.tracker import WEIGHT_LIKE, ActivationBytes

TOKENS = 16384  # long enough for the tile count that longfit.memory derives (tiles of >= 1024 tokens)
LORA_TARGETS = 7  # the default lora.target_modules: every projection
# Widths where one MLP tile dominates the layer's working set (intermediate 8-16 x hidden, few tiles)
TILE_WIDTHS = [
    (256, 3072, 4, 2, 64, 8),
    (256, 2048, 4, 1, 64, 16),
    (192, 2304, 4, 2, 48, 32),
    (320, 3840, 4, 2, 80, 8),
    (256, 4096, 2, 1, 128, 16),
    (384, 3072, 6, 2, 64, 32),
    (128, 1536, 2, 1, 64, 8),
    (256, 2560, 8, 2, 32, 16),
    (320, 2560, 10, 2, 32, 32),
    (192, 3072, 6, 3, 32, 8),
    (384, 4608, 4, 2, 96, 16),
    (224, 2688, 4, 1, 56, 32),
]
TILE_TOKENS = 4096
TILE_COUNTS = (1, 2, 4)
CP = 2  # context-parallel degree of the calibration (per-rank buffers scale with the local tokens)
TERMS = ("h", "f", "q", "kv", "kv_rep", "nh", "lora", "tile_f", "one")
LOCAL_WINDOW = 512  # the sliding window of "gemma3_local" layers (W - 1 <= TILE_TOKENS / (2 CP) and TOKENS / (2 CP))
TP_TERMS = ("h", "h_sp", "f", "q", "kv", "kv_out", "kv_rep", "nh", "lora", "tile_f", "one", "one_sp")
TP_DEGREES = (2, 4)
TP_WORLD = 8  # fake ranks: (dp_shard, cp, tp) meshes of every calibrated cp x tp
# Widths for tp: heads divisible by cp x tp = 8 (Ulysses), key/value heads a divisor or a multiple of every tp,
# query width nh x d apart from h (a separate term per rank: q / tp against h_sp = h / tp)
TP_WIDTHS = [
    (512, 1536, 8, 2, 48, 8),
    (512, 2048, 8, 1, 80, 16),
    (384, 1536, 8, 4, 64, 32),
    (640, 1920, 16, 2, 32, 8),
    (256, 1280, 8, 8, 48, 16),
    (448, 1344, 16, 4, 24, 32),
    (512, 2560, 16, 4, 40, 8),
    (576, 2304, 8, 8, 64, 16),
    (320, 1024, 8, 1, 48, 32),
    (480, 1920, 8, 2, 64, 8),
    (512, 1792, 16, 8, 24, 16),
    (384, 1152, 8, 1, 40, 32),
]
TP_TILE_WIDTHS = [
    (256, 3072, 8, 2, 24, 8),
    (256, 2048, 8, 1, 40, 16),
    (192, 2304, 8, 4, 32, 32),
    (320, 3840, 8, 2, 32, 8),
    (256, 4096, 8, 8, 24, 16),
    (384, 3072, 16, 2, 32, 32),
    (128, 1536, 8, 1, 24, 8),
    (256, 2560, 8, 2, 48, 16),
    (320, 2560, 16, 4, 16, 32),
    (192, 3072, 8, 8, 16, 8),
    (384, 4608, 8, 2, 40, 16),
    (224, 2688, 8, 1, 32, 32),
]
# (hidden, intermediate, heads, kv_heads, head_dim, lora rank): widths in the ratios of real models, even
# head counts (Ulysses splits heads over CP ranks)
WIDTHS = [
    (512, 1536, 8, 2, 64, 8),
    (512, 2048, 8, 1, 64, 16),
    (384, 1536, 6, 2, 64, 32),
    (640, 1920, 10, 2, 64, 8),
    (256, 1280, 2, 1, 128, 16),
    (448, 1344, 14, 2, 32, 32),
    (512, 2560, 16, 4, 32, 8),
    (576, 2304, 6, 3, 96, 16),
    (320, 1024, 10, 1, 32, 32),
    (480, 1920, 4, 2, 128, 8),
    (512, 1792, 4, 1, 128, 16),
    (384, 1152, 6, 1, 64, 32),
]


def _model(
    family: str,
    widths: tuple,
    lora: bool,
    ac: bool,
    tiled: bool,
    regime: str,
    tiles: int,
    cp_method: str | None,
    tp: int = 1,
    layer_tiles: int = 0,
):
    """A one-layer model (two under tiled layers) on the meta device; with tp > 1 its techniques come after
    `_tensor_parallel`.

    `layer_tiles` > 0: tiled decoder layers of that many tiles (longfit.memory.tiled_layers) instead of
    checkpointing and the tiled MLP, two of them: the first looks its input up again from the token ids,
    the second is the one every other layer is (`profiled_layer`)."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.models.attention import register_attention
    from longfit.models.presets import PRESETS

    h, f, nh, nkv, d, rank = widths
    values = copy.deepcopy(PRESETS["gemma-3-12b" if family.startswith("gemma3") else "llama-3.1-8b"])
    model_type = values.pop("model_type")
    values.update(
        hidden_size=h,
        intermediate_size=f,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=d,
        num_hidden_layers=profiled_layer(layer_tiles) + 1,
        vocab_size=1000,
    )
    layers = values["num_hidden_layers"]
    if family == "gemma3":
        values.update(layer_types=["full_attention"] * layers, sliding_window=None, query_pre_attn_scalar=d)
    if family == "gemma3_local":
        values.update(layer_types=["sliding_attention"] * layers, sliding_window=LOCAL_WINDOW, query_pre_attn_scalar=d)
    config = AutoConfig.for_model(model_type, **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention(), dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, task_type="CAUSAL_LM")
        )
    if tp == 1:
        _techniques(model, ac, tiled, tiles, cp_method, dist.group.WORLD, 1, layer_tiles)
    if regime == "bf16":
        model.to(torch.bfloat16)
    return model


def profiled_layer(layer_tiles: int) -> int:
    """The layer `profile_layer` traces: the first, or under tiled layers the second (the first keeps no input)."""
    return 1 if layer_tiles else 0


def _techniques(
    model, ac: bool, tiled: bool, tiles: int, cp_method: str | None, cp_group, tp: int, layer_tiles: int = 0
) -> None:
    """parallelize's order after tensor parallelism: context parallelism, then tiled decoder layers, or the
    tiled MLP and activation checkpointing."""
    from longfit.memory.checkpointing import apply_activation_checkpointing
    from longfit.memory.tiled_mlp import apply_tiled_mlp

    if cp_method:
        from longfit.parallel.parallelize import apply_context_parallel

        apply_context_parallel(model, cp_group, cp_method)
    if layer_tiles:
        from longfit.memory.tiled_layers import apply_tiled_layers
        from longfit.parallel.tiled_attention import LocalTileAttention

        apply_tiled_layers(model, LocalTileAttention.for_sequence, tiles=layer_tiles)
        return
    if tiled:
        apply_tiled_mlp(model, tiles, intermediate_shards=tp)
    if ac:
        apply_activation_checkpointing(model, 1.0)


def _tp_mesh(cp_method: str | None, tp: int):
    """A (dp_shard, cp, tp) mesh over the TP_WORLD fake ranks; built outside the fake mode (real rank tensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    cp = CP if cp_method else 1
    return init_device_mesh("cpu", (TP_WORLD // (cp * tp), cp, tp), mesh_dim_names=("dp_shard", "cp", "tp"))


def profile_layer(
    family: str,
    widths: tuple,
    regime: str,
    lora: bool,
    ac: bool,
    tiled: bool,
    tiles: int = 4,
    cp_method: str | None = None,
    tokens: int = TOKENS,
    tp: int = 1,
    layer_tiles: int = 0,
) -> dict[str, float]:
    """Bytes per token of one decoder layer: saved, input_kept, forward_peak, backward_peak (see module doc).

    `tokens` are a cp rank's; with tp > 1 the layer is tensor-parallel and its input their (tokens / tp) shard.
    `layer_tiles` > 0 traces a tiled decoder layer of that many tiles (longfit.memory.tiled_layers).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    from longfit.models.structure import decoder_layers, unwrap_peft
    from longfit.plan.trace import _separate_sharding_propagation

    model = _model(family, widths, lora, ac, tiled, regime, tiles, cp_method, tp, layer_tiles)
    mesh = _tp_mesh(cp_method, tp) if tp > 1 else None
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model.to_empty(device="cpu")
        if mesh is not None:
            from longfit.memory.loss import CausalLMLoss
            from longfit.parallel.tp import apply_tensor_parallel

            apply_tensor_parallel(CausalLMLoss(model), mesh["tp"])
            _techniques(model, ac, tiled, tiles, cp_method, mesh.get_group("cp"), tp)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    shapes = {tuple(p.shape) for p in [*model.parameters(), *local]}
    shapes |= {tuple(reversed(shape)) for shape in shapes}
    base = unwrap_peft(model).model
    layer = decoder_layers(model)[profiled_layer(layer_tiles)]
    h = widths[0]
    residual = torch.bfloat16 if regime == "bf16" else torch.float32
    tracker = ActivationBytes(mode, shapes)
    with (
        mode,
        _separate_sharding_propagation(),
        tracker,
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"),
    ):
        tracker.adopt(model.parameters(), WEIGHT_LIKE)
        positions = torch.arange(tokens)[None]
        source = torch.empty(1, tokens // tp, h, dtype=residual, requires_grad=True)
        if family.startswith("gemma3"):
            layer_type = "sliding_attention" if family == "gemma3_local" else "full_attention"
            rotary = base.rotary_emb(source, positions, layer_type)
        else:
            rotary = base.rotary_emb(source, positions)
        x = source * 1  # owned by autograd like a real layer input
        start = tracker.activations
        tracker.activation_peak = start
        out = layer(x, position_embeddings=rotary, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        forward_peak = tracker.activation_peak - start
        input_storage = weakref.ref(x.untyped_storage())
        del x
        gc.collect()  # settle reference cycles (checkpoint frames) before reading the live bytes
        input_kept = input_storage() is not None
        out_bytes = out.untyped_storage().nbytes()
        saved = tracker.activations - start - out_bytes + (0 if input_kept else source.numel() * residual.itemsize)
        grad = torch.empty_like(out)
        backward_start = tracker.activations
        tracker.activation_peak = backward_start
        out.backward(grad)
        backward_peak = tracker.activation_peak - backward_start
    return {
        "saved": saved / tokens,
        "input_kept": float(input_kept),
        "forward_peak": forward_peak / tokens,
        "backward_peak": backward_peak / tokens,
    }


def _row(widths: tuple, lora: bool, tiled: bool, tiles: int, tokens: int, cp_method: str | None, tp: int) -> list:
    """The terms (TERMS, or TP_TERMS when tp > 1) of one sample: widths per rank, per token of a cp rank."""
    h, f, nh, nkv, d, rank = widths
    tile_tokens = -(-tokens // tiles)
    kv_heads = nkv // tp if nkv % tp == 0 else 1  # tp > kv heads: each rank computes the one its queries use
    kv_rep = d * math.lcm(kv_heads, CP) if cp_method == "ulysses" else 0
    row = {
        "h": h,
        "h_sp": h / tp,
        "f": f / tp,
        "q": nh * d / tp,
        "kv": kv_heads * d,
        "kv_out": (nkv if nkv % tp else kv_heads) * d,  # replicated k/v projections compute every head
        "kv_rep": kv_rep,
        "nh": nh / tp,
        "lora": rank * LORA_TARGETS if lora else 0,
        "tile_f": f / tp * tile_tokens / tokens if tiled else 0,
        "one": 1,
        "one_sp": 1 / tp,
    }
    return [row[term] for term in (TP_TERMS if tp > 1 else TERMS)]


def _least_squares(key: tuple, samples: list[tuple[tuple, int, int, int]], quantities: tuple[str, ...]):
    """Coefficients of `quantities` over `samples` (widths, tiles, tokens, tp); input_kept; worst relative residual."""
    import numpy as np

    family, regime, trainable, ac, tiled, cp_method = key
    terms = TP_TERMS if samples[0][3] > 1 else TERMS
    rows, values, kept = [], [], set()
    for widths, tiles, tokens, tp in samples:
        measured = profile_layer(family, widths, regime, trainable == "lora", ac, tiled, tiles, cp_method, tokens, tp)
        kept.add(bool(measured["input_kept"]))
        rows.append(_row(widths, trainable == "lora", tiled, tiles, tokens, cp_method, tp))
        values.append([measured[q] for q in quantities])
    A, Y = np.array(rows), np.array(values)
    used = [j for j in range(A.shape[1]) if A[:, j].any()]
    coefficients, worst = {}, 0.0
    for k, name in enumerate(quantities):
        solution, *_ = np.linalg.lstsq(A[:, used], Y[:, k], rcond=None)
        residual = float(np.max(np.abs(A[:, used] @ solution - Y[:, k]) / np.maximum(Y[:, k], 1)))
        print(f"  {key} {name}: residual {residual:.1e}", file=sys.stderr)
        worst = max(worst, residual)
        coefficients[name] = {terms[j]: round(float(c), 2) for j, c in zip(used, solution) if abs(c) >= 0.005}
    if len(kept) != 1:
        raise RuntimeError(f"{key}: whether the layer input is kept depends on the widths")
    return coefficients, kept.pop(), worst


def fit_entry(key: tuple, tensor_parallel: bool = False) -> dict:
    """One LAYER_COSTS (or TP_LAYER_COSTS) entry: the fits at real widths, for a tiled MLP also the tile-dominated fits."""
    from longfit.memory.switches import mlp_tile_count

    widths, tile_widths = (TP_WIDTHS, TP_TILE_WIDTHS) if tensor_parallel else (WIDTHS, TILE_WIDTHS)

    def tp(i: int) -> int:
        return TP_DEGREES[i % len(TP_DEGREES)] if tensor_parallel else 1

    # Under tp the derived tile count is small (the intermediate slice is narrow), and the peak can sit inside a
    # tile at real widths: those samples take the most tiles there are, so that the real-width fit is that of the
    # rest of the layer and the *_tile fit alone is the tiles'.
    samples = [
        (w, TOKENS // 1024 if tensor_parallel else mlp_tile_count(TOKENS, w[0], w[1]), TOKENS, tp(i))
        for i, w in enumerate(widths)
    ]
    coefficients, kept, worst = _least_squares(key, samples, ("saved", "forward_peak", "backward_peak"))
    entry = {"input_kept": kept, **coefficients}
    if key[4]:  # tiled MLP
        samples = [(w, TILE_COUNTS[i % len(TILE_COUNTS)], TILE_TOKENS, tp(i // len(TILE_COUNTS)))
                   for i, w in enumerate(tile_widths)]
        tile, _, tile_worst = _least_squares(key, samples, ("forward_peak", "backward_peak"))
        entry.update(forward_peak_tile=tile["forward_peak"], backward_peak_tile=tile["backward_peak"])
        worst = max(worst, tile_worst)
    entry["residual"] = worst
    return entry


def keys() -> list[tuple]:
    """(family, regime, trainable, checkpointed, tiled MLP, cp method); CP only in bf16 (multi-GPU runs)."""
    return [
        (family, regime, trainable, ac, tiled, cp_method)
        for family, regime, trainable, ac, tiled, cp_method in itertools.product(
            ("llama", "gemma3", "gemma3_local"),
            ("bf16", "autocast", "fp32"),
            ("full", "lora"),
            (False, True),
            (False, True),
            (None, "ring", "ulysses"),
        )
        if cp_method is None or regime == "bf16"
    ]


def tp_keys() -> list[tuple]:
    """The keys of TP_LAYER_COSTS: Llama-style layers (what tp plans), never under autocast (FSDP2 always runs)."""
    return [key for key in keys() if key[0] == "llama" and key[1] != "autocast"]


def render(table: dict[tuple, dict], tensor_parallel: bool = False) -> str:
    """The source of layer_costs.py (or, tensor_parallel, of layer_costs_tp.py)."""
    if tensor_parallel:
        header = [
            '"""Per-layer activation bytes per token under tensor parallelism, generated by',
            "`python -m longfit.plan.calibrate --tp` (see there).",
            "",
            "Keys as in layer_costs.py; the tokens are a cp rank's T. Terms per rank: h (tensors of all T tokens at",
            "full width: the gathered inputs of attention and MLP), h_sp = h / tp and one_sp = 1 / tp",
            "(sequence-parallel tensors: norms, residual), f, q, kv, kv_rep, nh and tile_f divided by tp (kv: one head",
            "when tp exceeds the key/value heads; kv_out: what the k/v projections compute, every head when they are",
            "replicated), lora and one as in layer_costs.py.",
            '"""',
            "",
            "TP_LAYER_COSTS = {",
        ]
    else:
        header = [
            '"""Per-layer activation bytes per token, generated by `python -m longfit.plan.calibrate` (see there).',
            "",
            "Key: (family, regime, trainable, checkpointed, tiled MLP, context-parallel method or None); family",
            "gemma3_local is a Gemma 3 sliding-window layer (under ring attention, one whose window fits a cp",
            "chunk: it exchanges a halo instead of visiting K/V shards). Each quantity is a linear form over the",
            "terms h, f, q, kv, nh (widths), kv_rep (Ulysses' key/value width after head repetition), lora (rank",
            "x adapted projections), tile_f (intermediate x tokens of one MLP tile / tokens), one; input_kept:",
            "autograd keeps the layer's input alive (fp32 residual). With a tiled MLP the peaks are the larger of",
            "the fits at real widths and the *_tile fits (few, long tiles).",
            '"""',
            "",
            "LAYER_COSTS = {",
        ]
    lines = list(header)
    for key, entry in table.items():
        lines.append(f"    {key!r}: {{  # worst relative residual {entry['residual']:.1e}")
        lines.extend(f"        {name!r}: {value!r}," for name, value in entry.items() if name != "residual")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


# -- tiled decoder layers (plan/tiled.py): tiled_costs.py ---------------------------------------------------

# Tiles of 500, 250 and 167 tokens: no activation of a tile or of the row has the shape of a weight (which
# ActivationBytes would count as one); real runs use 8 + 6 f / h tiles or more (switches.layer_tile_count), the
# forms are linear in the tile fraction.
TILED_TOKENS = 2000
TILED_TILE_COUNTS = (4, 8, 12)
# Query width != hidden in most rows (they would be collinear otherwise), even head counts (Ulysses, cp=2)
TILED_WIDTHS = [
    (512, 1536, 8, 2, 64, 8),
    (512, 2048, 4, 1, 96, 16),
    (384, 1536, 6, 2, 64, 32),
    (640, 1920, 8, 2, 96, 8),
    (256, 1280, 2, 1, 128, 16),
    (448, 1344, 14, 2, 48, 32),
    (576, 2304, 6, 3, 64, 8),
]


def _tiled_row(widths: tuple, lora: bool, tiles: int, tokens: int, cp_method: str | None) -> dict[str, float]:
    from longfit.plan.tiled import tile_fraction, tiled_terms

    h, f, nh, nkv, d, rank = widths
    kv_rep = nkv * d * math.lcm(nkv, CP) // nkv if cp_method == "ulysses" else 0
    base = dict(h=h, f=f, q=nh * d, kv=nkv * d, kv_rep=kv_rep, nh=nh, lora=rank * LORA_TARGETS if lora else 0, one=1)
    return tiled_terms(base, tile_fraction(tokens, tiles, cp_method))


def fit_tiled_entry(key: tuple) -> dict:
    """One TILED_LAYER_COSTS entry: forward and backward peaks over the sequence and per-tile terms."""
    import numpy as np

    from longfit.plan.tiled import SEQUENCE_TERMS, TILE_TERMS

    family, regime, trainable, cp_method = key
    names = SEQUENCE_TERMS + TILE_TERMS
    rows, values = [], []
    for widths in TILED_WIDTHS:
        for tiles in TILED_TILE_COUNTS:
            measured = profile_layer(family, widths, regime, trainable == "lora", True, False, cp_method=cp_method,
                                     tokens=TILED_TOKENS, layer_tiles=tiles)
            assert measured["saved"] == 0 and measured["input_kept"], (key, measured)
            terms = _tiled_row(widths, trainable == "lora", tiles, TILED_TOKENS, cp_method)
            rows.append([terms[name] for name in names])
            values.append([measured["forward_peak"], measured["backward_peak"]])
    A, Y = np.array(rows), np.array(values)
    used = [j for j in range(A.shape[1]) if A[:, j].any()]
    entry, worst = {"input_kept": True, "saved": {}}, 0.0
    for k, quantity in enumerate(("forward_peak", "backward_peak")):
        solution, *_ = np.linalg.lstsq(A[:, used], Y[:, k], rcond=None)
        residual = float(np.max(np.abs(A[:, used] @ solution - Y[:, k]) / np.maximum(Y[:, k], 1)))
        print(f"  {key} {quantity}: residual {residual:.1e}", file=sys.stderr)
        worst = max(worst, residual)
        entry[quantity] = {names[j]: round(float(c), 2) for j, c in zip(used, solution) if abs(c) >= 0.005}
    entry["residual"] = worst
    return entry


def tiled_keys() -> list[tuple]:
    """(family, regime, trainable, cp method); context parallelism only in bf16 (multi-GPU runs)."""
    return [
        (family, regime, trainable, cp_method)
        for family, regime, trainable, cp_method in itertools.product(
            ("llama", "gemma3"), ("bf16", "autocast", "fp32"), ("full", "lora"), (None, "ring", "ulysses")
        )
        if cp_method is None or regime == "bf16"
    ]


def render_tiled(table: dict[tuple, dict]) -> str:
    """The source of tiled_costs.py."""
    lines = [
        '"""Tiled decoder layers\' bytes per token, generated by `python -m longfit.plan.calibrate --tiled` (see there).',
        "",
        "Key: (family, regime, trainable, context-parallel method or None). Each peak is a linear form over the",
        "sequence terms (h, q, kv, kv_rep, nh, lora, one) and the tile terms (the same widths, and f, times the",
        "tile fraction; longfit.plan.tiled). A tiled layer saves nothing but its input.",
        '"""',
        "",
        "TILED_LAYER_COSTS = {",
    ]
    for key, entry in table.items():
        lines.append(f"    {key!r}: {{  # worst relative residual {entry['residual']:.1e}")
        lines.extend(f"        {name!r}: {value!r}," for name, value in entry.items() if name != "residual")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def main() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tensor_parallel = "--tp" in sys.argv[1:]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP_WORLD if tensor_parallel else CP)
    if "--tiled" in sys.argv[1:]:
        table = {key: fit_tiled_entry(key) for key in tiled_keys()}
        print(render_tiled(table))
    else:
        table = {key: fit_entry(key, tensor_parallel) for key in (tp_keys() if tensor_parallel else keys())}
        print(render(table, tensor_parallel))
    print(f"worst relative residual of all fits: {max(e['residual'] for e in table.values()):.1e}", file=sys.stderr)


if __name__ == "__main__":
    main()
