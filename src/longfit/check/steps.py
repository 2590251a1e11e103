"""What `longfit check` records of a step and how it compares it with the reference: the bounds
(`longfit.check.parity`'s module docstring says why these), and one rank's context-parallel step of a copy; shared
by the text check (`longfit.check.parity`) and the image check (`longfit.check.media`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from longfit.config import Config

CHECK_CP = 2
CHECK_TP = 2  # tp ranks of the rehearsal of a run under parallel.tp > 1 (text and image rows)
FP32_RTOL, FP32_ATOL = 1e-5, 1e-8
FP32_FACTOR = 3.0  # x transformers' own fp32 error against float64, as BF16_FACTOR for bf16
BF16_FACTOR = 3.0
BF16_GRAD_FLOOR, BF16_LOSS_FLOOR = 2.0**-9, 2.0**-11
AUTOCAST_CEILING, FSDP_CEILING = 2.0**-4, 2.0**-3
NOISE_FALSE_ALARM = 1e-3
"""How often a correct bf16 implementation may exceed the bound of a tensor that is bf16 noise (`noise_factor`)."""
BF16 = torch.bfloat16
VISION_GRADS = "vision:"
"""The prefix of a vision module's gradients in a rank's Step of image rows (`cp_step`)."""


@dataclass
class Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    modules: dict[str, tuple[list[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    """Per module (first call, in call order): its floating-point tensor inputs and its output."""
    offloaded_bytes: int = 0
    """Layer inputs the offload store took (the technique really ran)."""
    attention_calls: set[str] = field(default_factory=set)
    """The modules longfit's attention function was called with (recorded steps only)."""


@dataclass
class Comparison:
    name: str
    loss_error: float
    grad_error: float
    grad_name: str
    bound: str
    worst: tuple[str, float]
    """The tensor furthest beyond its bound and how far (<= 1: within it)."""
    offloaded_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.worst[1] <= 1.0

    def line(self) -> str:
        name = self.name + (f" ({self.offloaded_bytes // 1024} KiB offloaded)" if self.offloaded_bytes else "")
        return (f"  {name + ':':46} loss error {self.loss_error:.1e}, largest gradient error {self.grad_error:.1e}"
                f" ({self.grad_name}); bound {self.bound}  {'ok' if self.ok else 'DIFFERS'}")


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits for the cross-entropy; float64 ones (`float64_step`) as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    def full(grad):
        return grad.full_tensor() if hasattr(grad, "full_tensor") else grad

    return {name: (full(p.grad).float() if p.grad is not None else None)
            for name, p in model.named_parameters() if p.requires_grad}


def cp_step(world_size: int, model: torch.nn.Module, cfg: Config, batch, param_dtype: torch.dtype,
            media_encoder=None) -> Step:
    """One rank of the context-parallel step of `model` (built with longfit's attention) under `cfg`: `parallelize` as
    the trainer calls it, this rank's shard of `batch`, the global mean loss; every gradient gathered whole. With
    `media_encoder` (image rows, `longfit.check.media`): the rows' positions computed whole before the split, as the
    trainer does, and the vision module's gradients too, under `VISION_GRADS` + their names."""
    from longfit.memory.apply import offloaders, release_offload_stores
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum, positioned
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    from longfit.models.attention import layer_configs, layer_head_shape

    text = model.config
    kv_heads = tuple(layer_head_shape(layer)[1] for layer in layer_configs(text))  # per layer: Gemma 4's differ
    dims = ParallelDims.from_config(cfg, world_size, text.num_attention_heads, num_key_value_heads=kv_heads,
                                    intermediate_size=getattr(text, "intermediate_size", None), text_config=text)
    mesh = dims.build_mesh("cpu")
    loss_module = CausalLMLoss(model, chunked_loss=cfg.memory.chunked_loss, loss_chunk=cfg.memory.loss_chunk,
                               media_encoder=media_encoder, indexer_loss=cfg.train.indexer_loss)
    loss_module = parallelize(loss_module, dims, cfg, mesh, param_dtype=param_dtype)
    for offloader in offloaders(loss_module):
        offloader.min_offload_bytes = 1024
    shard = shard_batch(positioned(loss_module, batch), mesh.cp_rank, dims.cp, cp_layout(dims.cp_method))
    count = global_valid_tokens(shard.labels, mesh.world_group)
    local_sum = batch_loss_sum(loss_module, shard)
    (local_sum / count).backward()
    loss = all_reduce_sum(local_sum.detach().float().clone(), mesh.world_group) / count
    offloaded = sum(o.stats.offloaded_bytes for o in offloaders(loss_module))
    release_offload_stores(loss_module)
    grads = _grads(loss_module.model)
    if media_encoder is not None:
        grads |= {VISION_GRADS + n: g for n, g in _grads(loss_module.media_encoder.vision).items()}
    return Step(loss, grads, offloaded_bytes=offloaded)


def fp32_excess(x: torch.Tensor, ref: torch.Tensor) -> float:
    """How far the worst element is beyond the fp32 bound (<= 1: within)."""
    ref = ref.double()
    scale = ref.abs().max() if ref.numel() else 0.0
    return float(((x.double() - ref).abs() / (FP32_ATOL + FP32_RTOL * (ref.abs() + scale))).max())


def _distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm())


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    norm = ref.double().norm()
    diff = (x.double() - ref.double()).norm()
    return float(diff / norm) if norm > 0 else float(diff)


def _missing(got: Step, truth: Step) -> str | None:
    for name, ref in truth.grads.items():
        if got.grads.get(name) is None and ref is not None:
            return f"longfit's step left {name} without a gradient"
    return None


def rounding_excess(x: torch.Tensor, refs: list[torch.Tensor], exact: torch.Tensor) -> float:
    """How far x's largest error against `exact` (the float64 run) is beyond FP32_FACTOR x the largest of transformers'
    fp32 implementations `refs` (<= 1: within)."""
    error = float((x.double() - exact.double()).abs().max())
    own = max(float((ref.double() - exact.double()).abs().max()) for ref in refs)
    if own == 0.0:
        return 0.0 if error == 0.0 else float("inf")
    return error / (FP32_FACTOR * own)


def compare_fp32(name: str, got: Step, truth: Step, exact: Step | None = None, others: list[Step] = ()) -> Comparison:
    """got against transformers' fp32 `truth`, every tensor within the fp32 bound or, with `exact` (the reference run
    in float64), within FP32_FACTOR x the largest error against it of transformers' fp32 runs: `truth` and `others`
    (its SDPA run) (module docstring)."""
    grads = {n: (got.grads[n], ref) for n, ref in truth.grads.items() if ref is not None and got.grads.get(n) is not None}
    errors = {n: float((g.double() - r.double()).abs().max()) for n, (g, r) in grads.items()}
    excess = {"loss": fp32_excess(got.loss, truth.loss), **{n: fp32_excess(g, r) for n, (g, r) in grads.items()}}
    bound = f"{FP32_RTOL:g} (|ref| + max |ref|) + {FP32_ATOL:g}"
    if exact is not None:
        excess["loss"] = min(excess["loss"], rounding_excess(got.loss, [truth.loss, *(o.loss for o in others)],
                                                             exact.loss))
        for n, (g, r) in grads.items():
            excess[n] = min(excess[n], rounding_excess(g, [r, *(o.grads[n] for o in others)], exact.grads[n]))
        bound += f", or {FP32_FACTOR:g}x transformers' own fp32 error against float64"
    worst_grad = max(errors, key=errors.get)
    return Comparison(name, float((got.loss - truth.loss).abs()), errors[worst_grad], worst_grad, bound,
                      max(excess.items(), key=lambda kv: kv[1]))


def noise_factor(elements: int) -> float:
    """How many times one correct bf16 implementation's noise on a tensor of `elements` values may be another's: the
    norm ratio two such noises exceed with probability NOISE_FALSE_ALARM, at least BF16_FACTOR. Independent noises of
    one scale per value: their squared norm ratio is F(n, n)-distributed and U = F / (1 + F) is Beta(a, a), a = n / 2,
    whose tail for an integer a is the binomial sum P(U > u) = sum_{j<a} C(2a-1, j) u^j (1-u)^(2a-1-j) (n rounded down
    to even: fewer values, a wider bound). Only a few values need more than BF16_FACTOR: 7.3x at 4 values (a gated
    DeltaNet's per-head A_log of a shrunken copy), 3.5x at 8, BF16_FACTOR from 10 on."""
    a = max(1, elements // 2)
    if a >= 5:  # the ratio falls as the values grow: 2.96 at 10 values
        return BF16_FACTOR

    def tail(u: float) -> float:
        return sum(math.comb(2 * a - 1, j) * u**j * (1 - u) ** (2 * a - 1 - j) for j in range(a))

    low, high = 0.5, 1.0
    for _ in range(60):  # bisection: the tail falls from 1/2 at u = 1/2 to 0 at u = 1
        low, high = ((low + high) / 2, high) if tail((low + high) / 2) > NOISE_FALSE_ALARM else (low, (low + high) / 2)
    return max(BF16_FACTOR, math.sqrt(low / (1 - low)))


def compare_bf16(name: str, got: Step, references: list[Step], truth: Step, ceiling: float) -> Comparison:
    """got's relative error against the fp32 truth, per tensor, over the bound of BF16_FACTOR x the references' (more
    for a tensor of a few values, `noise_factor`)."""
    tensors = {"loss": (got.loss, [r.loss for r in references], truth.loss)}
    for n, ref in truth.grads.items():
        if ref is not None and got.grads.get(n) is not None:
            tensors[n] = (got.grads[n], [r.grads[n] for r in references], ref)
    errors, excess = {}, {}
    for n, (g, refs, t) in tensors.items():
        errors[n] = _relative(g, t)
        if min(_relative(r, t) for r in refs) >= ceiling:
            # Every correct bf16 implementation errs by more than a bf16-sized error: a gradient that is zero in exact
            # arithmetic (OPT's key bias: softmax ignores a shift of every logit), or one of differences that cancel
            # (Gemma 3n's AltUp correction coefficients: transformers' eager and SDPA gradients 53% and 71% off the
            # fp32 ones, longfit's 86%), which bf16 leaves as noise. Its bound is BF16_FACTOR x their error, in
            # absolute terms, or more for a tensor of a few values, whose noises' norms scatter widely (`noise_factor`).
            noise = max(_distance(r, t) for r in refs)
            excess[n] = _distance(g, t) / (noise_factor(t.numel()) * noise) if noise > 0 else 0.0
            continue
        # a tensor of a few values gets the wider ratio its noises' norms reach (`noise_factor`) here too: relative
        # errors against the same truth are its distances over one norm (Qwen3.5's A_log of four value heads on
        # video rows: transformers' bf16 gradient 2.4% off the fp32 one, longfit's 4.8x as far)
        yardstick = min(max(_relative(r, t) for r in refs), ceiling)
        factor = noise_factor(t.numel()) if n != "loss" else BF16_FACTOR
        excess[n] = errors[n] / (factor * yardstick + (BF16_LOSS_FLOOR if n == "loss" else BF16_GRAD_FLOOR))
    grads = {n: e for n, e in errors.items() if n != "loss"}
    worst_grad = max(grads, key=grads.get)
    return Comparison(name, errors["loss"], grads[worst_grad], worst_grad,
                      f"relative, {BF16_FACTOR:g}x transformers' own bf16 error", max(excess.items(), key=lambda kv: kv[1]))


def _close(x: torch.Tensor, ref: torch.Tensor) -> bool:
    return x.shape == ref.shape and fp32_excess(x, ref) <= 1.0


def _in_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """The FSDP2 regime on one process: parameters in bf16 (buffers such as rotary's stay fp32), no autocast."""
    for param in model.parameters():
        param.data = param.data.to(BF16)
    return model
