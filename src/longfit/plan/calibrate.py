"""Derive the per-layer activation coefficients of `layer_costs.py` from one-layer traces.

    python -m longfit.plan.calibrate > src/longfit/plan/layer_costs.py

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

Regimes: "bf16" is FSDP2 mixed precision (parameters gathered in bf16, activations bf16), "autocast"
the single-GPU path (fp32 parameters under bf16 autocast: fp32 residual stream and norms, a bf16 copy
of each projection's input), "fp32" no mixed precision. Context parallelism (ring or Ulysses, which
only multi-GPU runs use, so never with autocast) is traced on a fake process group of CP ranks; its
K/V buffers scale with the local tokens, and Ulysses' with kv_rep, the key/value width after it
repeats heads up to a multiple of cp.
"""

from __future__ import annotations

import gc
import itertools
import math
import sys
import weakref

import torch

from longfit.plan.tracker import LiveBytes

TOKENS = 16384  # long enough for the tile count that longfit.memory derives (tiles of >= 1024 tokens)
LORA_TARGETS = 7  # the default lora.target_modules: every projection
CP = 2  # context-parallel degree of the calibration (per-rank buffers scale with the local tokens)
TERMS = ("h", "f", "q", "kv", "kv_rep", "nh", "lora", "tile_f", "one")
# (hidden, intermediate, heads, kv_heads, head_dim, lora rank): widths in the ratios of real models, even
# head counts (Ulysses splits heads over CP ranks)
WIDTHS = [
    (512, 1536, 8, 2, 64, 8), (512, 2048, 8, 1, 64, 16), (384, 1536, 6, 2, 64, 32), (640, 1920, 10, 2, 64, 8),
    (256, 1280, 2, 1, 128, 16), (448, 1344, 14, 2, 32, 32), (512, 2560, 16, 4, 32, 8), (576, 2304, 6, 3, 96, 16),
    (320, 1024, 10, 1, 32, 32), (480, 1920, 4, 2, 128, 8), (512, 1792, 4, 1, 128, 16), (384, 1152, 6, 1, 64, 32),
]


class _LayerBytes(LiveBytes):
    """LiveBytes that also follows the activation bytes alone (tensors not shaped like a parameter)."""

    def __init__(self, fake_mode, weight_shapes: set[tuple[int, ...]]):
        super().__init__(fake_mode)
        self.weight_shapes = weight_shapes
        self.activations = 0
        self.activation_peak = 0
        self._activation_keys: set[int] = set()

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


def _model(family: str, widths: tuple, lora: bool, ac: bool, tiled: bool, regime: str, tiles: int, cp_method: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.memory.checkpointing import apply_activation_checkpointing
    from longfit.memory.tiled_mlp import apply_tiled_mlp
    from longfit.models.presets import PRESETS
    from longfit.plan.trace import _plan_attention

    h, f, nh, nkv, d, rank = widths
    values = dict(PRESETS["gemma-3-12b" if family == "gemma3" else "llama-3.1-8b"])
    model_type = values.pop("model_type")
    values.update(hidden_size=h, intermediate_size=f, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=d,
                  num_hidden_layers=1, vocab_size=1000)
    if family == "gemma3":
        values.update(layer_types=["full_attention"], sliding_window=None, query_pre_attn_scalar=d)
    config = AutoConfig.for_model(model_type, **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=_plan_attention(), dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, task_type="CAUSAL_LM"))
    if cp_method:
        import torch.distributed as dist

        from longfit.parallel.parallelize import apply_context_parallel

        apply_context_parallel(model, dist.group.WORLD, cp_method)
    if tiled:
        apply_tiled_mlp(model, tiles)
    if ac:
        apply_activation_checkpointing(model, 1.0)
    if regime == "bf16":
        model.to(torch.bfloat16)
    return model


def profile_layer(
    family: str, widths: tuple, regime: str, lora: bool, ac: bool, tiled: bool, tiles: int = 4, cp_method: str | None = None
) -> dict[str, float]:
    """Bytes per token of one decoder layer: saved, input_kept, forward_peak, backward_peak (see module doc)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longfit.memory.checkpointing import decoder_layers, unwrap_peft

    model = _model(family, widths, lora, ac, tiled, regime, tiles, cp_method)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model.to_empty(device="cpu")
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(reversed(p.shape)) for p in model.parameters()}
    base = unwrap_peft(model).model
    layer = decoder_layers(model)[0]
    h = widths[0]
    residual = torch.bfloat16 if regime == "bf16" else torch.float32
    tracker = _LayerBytes(mode, shapes)
    with mode, tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
        tracker.adopt(model.parameters(), "weight-like")
        positions = torch.arange(TOKENS)[None]
        source = torch.empty(1, TOKENS, h, dtype=residual, requires_grad=True)
        rotary = (base.rotary_emb(source, positions, "full_attention") if family == "gemma3"
                  else base.rotary_emb(source, positions))
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
        saved = tracker.activations - start - out_bytes + (0 if input_kept else TOKENS * h * residual.itemsize)
        grad = torch.empty_like(out)
        backward_start = tracker.activations
        tracker.activation_peak = backward_start
        out.backward(grad)
        backward_peak = tracker.activation_peak - backward_start
    return {"saved": saved / TOKENS, "input_kept": float(input_kept), "forward_peak": forward_peak / TOKENS,
            "backward_peak": backward_peak / TOKENS}


def _row(widths: tuple, lora: bool, tiled: bool, tiles: int, cp_method: str | None) -> list[float]:
    h, f, nh, nkv, d, rank = widths
    tile_tokens = -(-TOKENS // tiles)
    kv_rep = nkv * d * math.lcm(nkv, CP) // nkv if cp_method == "ulysses" else 0
    return [h, f, nh * d, nkv * d, kv_rep, nh, rank * LORA_TARGETS if lora else 0, f * tile_tokens / TOKENS if tiled else 0, 1]


def fit(
    family: str, regime: str, lora: bool, ac: bool, tiled: bool, cp_method: str | None
) -> tuple[dict[str, dict[str, float]], bool, float]:
    """Least-squares coefficients of each quantity over WIDTHS, whether the input is kept, and the worst residual."""
    import numpy as np

    rows, values = [], []
    kept = set()
    from longfit.memory.tiled_mlp import mlp_tile_count

    for widths in WIDTHS:
        tiles = mlp_tile_count(TOKENS, widths[0], widths[1])
        measured = profile_layer(family, widths, regime, lora, ac, tiled, tiles, cp_method)
        kept.add(measured.pop("input_kept"))
        rows.append(_row(widths, lora, tiled, tiles, cp_method))
        values.append([measured[k] for k in ("saved", "forward_peak", "backward_peak")])
    A, Y = np.array(rows), np.array(values)
    used = [j for j in range(A.shape[1]) if A[:, j].any()]
    coefficients, worst = {}, 0.0
    for k, name in enumerate(("saved", "forward_peak", "backward_peak")):
        solution, *_ = np.linalg.lstsq(A[:, used], Y[:, k], rcond=None)
        residual = float(np.max(np.abs(A[:, used] @ solution - Y[:, k]) / np.maximum(Y[:, k], 1)))
        print(f"  {family} {regime} {'lora' if lora else 'full'} ac={ac} tiled={tiled} cp={cp_method} {name}: {residual:.1e}", file=sys.stderr)
        worst = max(worst, residual)
        coefficients[name] = {TERMS[j]: round(float(c), 2) for j, c in zip(used, solution) if abs(c) >= 0.005}
    if len(kept) != 1:
        raise RuntimeError(f"{family} {regime}: whether the layer input is kept depends on the widths")
    return coefficients, bool(kept.pop()), worst


def main() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=CP)
    print('"""Per-layer activation bytes per token, generated by `python -m longfit.plan.calibrate` (see there).')
    print()
    print("Key: (family, regime, trainable, checkpointed, tiled MLP, context-parallel method or None). Each")
    print("quantity is a linear form over the terms h, f, q, kv, nh (widths), kv_rep (Ulysses' key/value width")
    print("after head repetition), lora (rank x adapted projections), tile_f (intermediate x tokens of one MLP")
    print("tile / tokens), one; input_kept: autograd keeps the layer's input alive (fp32 residual).")
    print('"""')
    print()
    print("LAYER_COSTS = {")
    worst_all = 0.0
    for family, regime, lora, ac, tiled, cp_method in itertools.product(
        ("llama", "gemma3"), ("bf16", "autocast", "fp32"), (False, True), (False, True), (False, True), (None, "ring", "ulysses")
    ):
        if cp_method and regime != "bf16":
            continue  # CP runs on several GPUs: bf16 mixed precision (fp32 runs use the table without CP)
        coefficients, kept, worst = fit(family, regime, lora, ac, tiled, cp_method)
        worst_all = max(worst_all, worst)
        key = (family, regime, "lora" if lora else "full", ac, tiled, cp_method)
        print(f"    {key!r}: {{  # worst relative residual {worst:.1e}")
        print(f"        'input_kept': {kept},")
        for name, terms in coefficients.items():
            print(f"        {name!r}: {terms!r},")
        print("    },")
        print(f"{key} residual {worst:.1e}", file=sys.stderr)
    print("}")
    print(f"worst relative residual of all fits: {worst_all:.1e}", file=sys.stderr)


if __name__ == "__main__":
    main()
