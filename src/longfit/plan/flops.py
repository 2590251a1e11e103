"""FLOPs of one training step over one document of L tokens: model FLOPs and the recomputation the memory techniques add.

Model FLOPs (what the step needs, the convention of PaLM's MFU): a matmul with a weight of P entries costs
2 P per token forward and 4 P backward (input and weight gradients) when the weight trains, 2 P when it is
frozen (input gradient only: LoRA's base, whose weights get no gradient); a LoRA adapter of rank r on an
(in, out) projection trains r (in + out) entries. Causal attention over one document: query i meets
min(i + 1, W) keys (W the sliding window; L for a global layer), and each (query, key) pair costs 4 x
heads x head_dim FLOPs forward (QK^T and PV), twice that backward. lm_head counts like a projection; the
input embedding is a lookup.

Hardware FLOPs add what recomputation runs again: activation checkpointing repeats the forward of every
checkpointed decoder layer, attention included unless the layer keeps it (memory.keep_attention, #53); a tiled MLP
recomputes each tile in its own backward, and nested in a checkpointed layer runs its tiles once more in the layer's
recomputation except the last (longfit.memory.tiled_mlp): (1 - 1 / tiles) more MLP forwards than checkpointing
alone. The attention kernels' own recomputation inside their backward is not counted (an implementation detail of
every fused kernel alike), nor is torch's checkpoint stopping its recompute after the last tensor a layer's backward
needs (a Llama layer's down projection): `longfit bench keep-attention` counts a real step's FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from longfit.plan.shapes import ModelShape

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def attended_keys(length: int, window: int | None) -> int:
    """sum over queries i < length of the keys query i attends to causally: min(i + 1, window)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


@dataclass(frozen=True)
class StepFlops:
    model: float
    """The step's own FLOPs (module docstring)."""
    hardware: float
    """Model FLOPs plus the recomputation the memory techniques add."""


def step_flops(
    shape: ModelShape,
    length: int,
    lora_targets: tuple[str, ...] = (),
    lora_rank: int = 0,
    checkpointed: bool = True,
    mlp_tiles: int = 1,
    keep_attention: bool = False,
) -> StepFlops:
    """FLOPs of forward + backward over one document of `length` tokens (the optimizer step is not counted).

    `lora_targets` empty: full fine-tuning; else the adapted projections (frozen base, rank `lora_rank`).
    `checkpointed`: every decoder layer recomputed in backward; `mlp_tiles` > 1: its MLP tiled inside it;
    `keep_attention`: the recompute runs no attention (memory.keep_attention).
    """
    lora = bool(lora_targets)
    per_weight = 4 if lora else 6  # forward 2, backward 4 (trainable) or 2 (frozen)
    layer_forward = mlp_forward = 0.0  # per token
    layer_total = 0.0  # per token, forward + backward
    for name, (fan_in, fan_out) in shape.linear_shapes().items():
        adapter = lora_rank * (fan_in + fan_out) if name in lora_targets else 0
        forward = 2.0 * (fan_in * fan_out + adapter)
        layer_forward += forward
        layer_total += per_weight * fan_in * fan_out + 6.0 * adapter
        if name in MLP_PROJECTIONS:
            mlp_forward += forward
    head = per_weight * shape.vocab * shape.hidden * length
    attention_forward = _attention_forward(shape, length)
    model = shape.layers * layer_total * length + 3 * attention_forward + head
    recompute = shape.layers * layer_forward * length if checkpointed else 0.0
    if checkpointed and not keep_attention:
        recompute += attention_forward
    if mlp_tiles > 1:  # each tile recomputed in its own backward; nested, the layer's recomputation skips the last
        recompute += shape.layers * ((1 - 1 / mlp_tiles) if checkpointed else 1.0) * mlp_forward * length
    return StepFlops(model, model + recompute)


def _attention_forward(shape: ModelShape, length: int) -> float:
    """Every layer's causal attention over one document of `length` tokens, forward (module docstring)."""
    total = 0.0
    for index in range(shape.layers):
        window = shape.sliding_window if index in shape.local_layers else None
        total += 4.0 * shape.q_dim * attended_keys(length, window)
    return total


def forward_flops(shape: ModelShape, length: int, lora_targets: tuple[str, ...] = (), lora_rank: int = 0) -> float:
    """FLOPs of a forward without gradient over one document of `length` tokens, lm_head at every token: a preference
    objective's reference (#56), with the LoRA adapters it turns off counted (an upper bound then)."""
    per_token = sum(2.0 * (fan_in * fan_out + (lora_rank * (fan_in + fan_out) if name in lora_targets else 0))
                    for name, (fan_in, fan_out) in shape.linear_shapes().items())
    return shape.layers * per_token * length + _attention_forward(shape, length) + 2.0 * shape.vocab * shape.hidden * length
