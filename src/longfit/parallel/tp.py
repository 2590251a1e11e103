"""Tensor parallelism with sequence parallelism over the mesh's tp axis, for decoders of attention and gated MLPs.

Derivation (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti et al. 2022). A decoder layer is
y = x + attn(norm1(x)), then out = y + mlp(norm2(y)) (Gemma's norm the blocks' outputs too). Between those blocks each
of the T tp ranks holds 1/T of the tokens of the residual stream, (B, L/T, H): norms and residual adds are token-wise,
so they run on the local tokens with replicated weights ("sequence parallel"). Entering attention or the MLP, the
normalized tokens are all-gathered to (B, L, H). Then
- q, k, v, gate and up are column-parallel: rank r holds output rows [r o/T, (r+1) o/T) of W (o, i), and x W_r^T
  is its slice of the outputs -- query heads [r H/T, (r+1) H/T) and the key/value heads they use (groups of GQA stay
  on one rank), a slice of the intermediate width for gate and up. Attention is per head and act(gate) * up per
  element, so both run on the local slice without communication; so do norms over one head's width (Qwen3's and
  Gemma 3's q_norm / k_norm: replicated, each rank's weight gradient a partial sum over its heads). A norm over all
  heads' width (OLMo 2's q_norm) would need the other ranks' heads: refused (`tensor_parallel_refusal`).
- o and down are row-parallel: rank r holds the matching input columns, and sum_r x_r W_r^T is the output. That
  sum is a reduce-scatter along the sequence, which puts it straight into each rank's tokens of the residual stream.
Per layer and direction that is 2 all-gathers and 2 reduce-scatters of B x L x H elements (the backward of an
all-gather is a reduce-scatter and vice versa): the bytes of Megatron's 2 all-reduces, with activations 1/T.
- A Gated DeltaNet (linear attention: Qwen3.5's; models.linear_attention) splits by key head group, as GQA: rank r
  keeps key heads [r Hk/T, (r+1) Hk/T) and the value heads they serve, [r Hv/T, (r+1) Hv/T) (each key head serves
  Hv/Hk consecutive ones); the convolution is per channel and the delta rule per value head, so both run on the
  local heads without communication. z, b and a and the per-value-head A_log and dt_bias are split by value head
  (contiguous), out_proj is row-parallel like o_proj, and the gated norm over one value head's width runs like the
  q/k norms. The fused q/k/v projection and the convolution's channels hold this rank's heads in each of three
  segments (q, k, v), which no DTensor placement describes (_StridedShard cuts equal segments only, and v is Hv/Hk
  times q's width): both are replicated, and each rank computes with its channels' rows of their weights
  (`_ReplicatedColumns`, `TensorParallelLinearAttention`), their gradients a Partial sum. Checkpoints, the export
  and FSDP2 see them whole, in their own layout; the cost is their weights, gradients and optimizer state not
  divided by T, and one all-reduce of their gradients over tp. Under cp the local heads are split again over the
  cp ranks (parallel/linear.py), so Hv/T must divide by cp.
  Qwen3-Next's Gated DeltaNet fuses otherwise: in_proj_qkvz holds each key head's q, k, v and z rows together, and
  in_proj_ba each key head's b and a rows (transformers' `fix_query_key_value_ordering` views their outputs per key
  head), so rank r's key heads are one contiguous block of rows of each: both are column-parallel as they are, a
  real split. Its module's head counts and widths are set to the local ones (that view reads them); the local a meets
  A_log and dt_bias as plain tensors, so those two are read through their local shards (`_split_parameters`). The
  convolution runs on the local q, k and v concatenated, so it is replicated and cut to the same channels as
  Qwen3.5's.
- A mixture of experts (`TensorParallelExperts`): every expert, and a shared expert, split as the MLP (its slice
  of the intermediate width on each rank), the routers replicated; the routing weights scale each rank's part of an
  expert's output, which is linear in the pending sum over the ranks, so the same reduce-scatter ends the block.
  Gemma 4's layers call their experts and router themselves beside the dense MLP, on the tokens flattened
  (`TensorParallelOwnExperts`): the router and those norms run on this rank's tokens, and the experts' call is
  all-gathered and reduce-scattered along the flattened rows instead.
- Embedding: vocabulary-parallel. Rank r holds rows of the table, a token outside them contributes 0, and the sum
  over ranks is reduce-scattered along the sequence.
- lm_head: vocabulary-parallel too, and its (tokens, V) output is never formed: the chunked loss combines the
  logsumexp across the ranks (`VocabParallel`, derivation in longfit.memory.chunked_loss).
- Fewer key/value heads than T (T a multiple of them): k_proj and v_proj are replicated and rank r keeps the one
  head its query heads use. Each rank's gradients then cover only its head, so they are summed over the ranks.
- Context parallelism: attention sees this rank's L/cp tokens with the heads of its tp slice, so ring and Ulysses
  run unchanged on the local heads (the ring moves 1/T of the K/V bytes; Ulysses needs cp | H/T, ParallelDims).
- A wrapper's vision side (#54, `replicate_media`): the tower and projector are replicated on the tp ranks, as
  DTensors whose calls read their local tensors (`_replicate_locally`). The tp ranks of a cp rank hold the same rows,
  so the rows' images are dealt over the cp x tp ranks (`longfit.parallel.media.DealtMedia`): each rank runs the tower
  on its share, the embeddings are all-gathered, and each rank's sequence-parallel embedding places those its L/T
  tokens take. The backward sums the embeddings' gradient over those ranks and runs the tower on this rank's images:
  its weights' gradients are a Partial sum over tp (and over cp, FSDP2's reduction), as the other replicated weights'.

Implementation: torch's DTensor styles (`parallelize_module`) addressed by Hugging Face's module names. The
residual stream between the styles is a plain (B, L/T, H) tensor; parameters become DTensors on the tp mesh, which
FSDP2 then shards over dp_shard x cp (2-D). What the styles alone would get wrong, each handled below:
- transformers passes `hidden_states` to self_attn by keyword and to the MLP positionally;
- the tiled MLP (memory.tiled_mlp) runs token tiles of shape (t, H), where a reduce-scatter on dim 1 would split
  H: down_proj's output stays Partial (a pending sum over ranks) and one reduce-scatter at the MLP's output does it;
- SequenceParallel re-creates the norm weights without their requires_grad (frozen under LoRA);
- parallelize_module replaces the embedding's Parameter, which unties a tied lm_head;
- LoRA adapters (peft, applied before) must give the local layout their base gives (`_projection_plan`);
- transformers builds attention masks from the sequence-sharded embeddings, with the wrong key length: longfit's
  attention takes none (cu_seqlens describe packed documents);
- transformers reads a Gated DeltaNet's A_log, dt_bias and convolution weight off the module, not through a module
  call (`_split_linear_attention`), and splits its q/k/v by the module's key_dim and value_dim (set to the local
  widths);
- which models the styles fit is read from the model's structure (`tensor_parallel_refusal`, asked by ParallelDims
  before anything is built): a part outside them (another linear attention's fused projections, experts in another
  layout, sinks, a layer's parts that are neither norms nor linear maps of its tokens) is refused;
- Gemma 4's per-layer inputs: its per-layer embeddings are looked up for this rank's tokens only
  (`_per_layer_inputs_of_local_tokens`: transformers reshapes the lookup by the ids' shape), and they, the
  projection of the embeddings beside them and each layer's gate and projection run on this rank's tokens with
  replicated weights (`_LocalReplicated`); a layer reusing an earlier layer's keys and values reads, on each rank,
  those of its own heads, which that layer stored there.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from longfit.memory.chunked_loss import linear_cross_entropy
from longfit.models.attention import layer_configs, layer_head_shape
from longfit.models.linear_attention import LOCAL, linear_attention_layers
from longfit.models.structure import decoder, decoder_and_head, decoder_layers, unwrap_peft

if TYPE_CHECKING:
    from longfit.memory.loss import CausalLMLoss

# torch 2.13 renamed these (the old names warn); same arguments, and the old names are all torch 2.6 has.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_ATTENTION_COLUMNS = ("q_proj", "k_proj", "v_proj")
_KEY_VALUE = ("k_proj", "v_proj")
_MLP_COLUMNS = ("gate_proj", "up_proj")
_LINEAR_ATTENTION_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj")
_GROUPED_LINEAR_ATTENTION_PARTS = ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj")  # Qwen3-Next's
_PER_VALUE_HEAD = ("A_log", "dt_bias")
_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
_FIX = "set parallel.tp=1 (parallel.cp and parallel.dp_shard split it instead)"


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        replicated = distribute_tensor(param.detach(), mesh, [Replicate()])
        module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    # Every replicated module here reads a DTensor made by the style before it (PrepareModuleInput, or LoRA's A),
    # whose layout it keeps; a plain tensor would be a plan error, not a layout to guess.
    assert isinstance(inputs[0], DTensor), type(module).__name__
    return inputs


class _Replicated(ParallelStyle):
    """A module replicated over tp (LoRA's A on a column-parallel base, its B on a row-parallel one).

    Its parameters become Replicate DTensors: each rank's gradient is a partial sum over its tokens or heads, and
    DTensor sums them over tp when they accumulate. The output keeps its input's layout (Replicate, or Partial:
    a linear map of a pending sum is a pending sum) or is cut from Replicate to `output_layout` = Shard(1), a
    local slice; no communication either way.
    """

    def __init__(self, output_layout=Replicate(), use_local_output: bool = True):
        super().__init__()
        self.output_layout, self.use_local_output = output_layout, use_local_output

    def _output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh):
        assert output.placements in ((self.output_layout,), (Replicate(),)), (output.placements, self.output_layout)
        if output.placements != (self.output_layout,):
            output = output.redistribute(placements=[self.output_layout])
        return output.to_local() if self.use_local_output else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_parameters, _replicated_input, self._output)


def _columns(tensor: torch.Tensor, columns: tuple[slice, ...]) -> torch.Tensor:
    return torch.cat([tensor[part] for part in columns]) if len(columns) > 1 else tensor[columns[0]]


class _ReplicatedColumns(ParallelStyle):
    """A projection replicated over tp of which each rank computes `columns` of the output (slices, concatenated):
    k_proj / v_proj (or LoRA's B on them) with fewer key/value heads than tp ranks (the one head its query heads
    use), and a Gated DeltaNet's fused q/k/v projection (its heads in each of the three segments,
    `_linear_attention_channels`). The call multiplies the input's local tensor by the weight's rows of those
    columns; the gradients of both cover these columns only, Partial sums."""

    def __init__(self, columns: tuple[slice, ...]):
        super().__init__()
        self.columns = columns

    def _forward(self, module: nn.Linear, x: DTensor) -> torch.Tensor:
        weight = _columns(module.weight.to_local(grad_placements=[Partial()]), self.columns)
        bias = None if module.bias is None else _columns(module.bias.to_local(grad_placements=[Partial()]),
                                                         self.columns)
        return F.linear(x.to_local(grad_placements=[Partial()]), weight, bias)  # (B, L, D)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_parameters("", module, device_mesh)
        module.forward = functools.partial(self._forward, module)
        return module


def _projection_plan(projection: nn.Module, name: str, base: ParallelStyle, adapter_a: ParallelStyle,
                     adapter_b: ParallelStyle) -> dict[str, ParallelStyle]:
    """`base` on a plain projection; on a peft LoRA layer, base on base_layer and the adapters' styles on A and B.

    LoRA adds lora_B(lora_A(x)) * scale to base_layer(x), so both branches must end in the same local layout:
    - column-parallel base (input Replicate, output the local slice): A replicated, its (B, L, r) output kept a
      Replicate DTensor; B column-parallel like the base. No communication; A's gradient is summed over tp.
    - row-parallel base (input the local slice): A row-parallel, its (B, L, r) output a pending sum (Partial), B
      replicated. Into o_proj's sequence shards A's output is all-reduced first (r wide: cheap) and B's output cut
      locally; next to down_proj's pending sum B's output simply stays one, summed by the MLP's reduce-scatter.
    """
    lora_a = getattr(projection, "lora_A", None)
    if lora_a is None:
        return {name: base}
    plan = {f"{name}.base_layer": base}
    for adapter in lora_a:
        plan[f"{name}.lora_A.{adapter}"] = adapter_a
        plan[f"{name}.lora_B.{adapter}"] = adapter_b
    return plan


def _key_value_columns(layer_config, tp_rank: int, tp: int) -> slice | None:
    """Columns of k_proj / v_proj this rank keeps in a layer of `layer_config` (models.attention.layer_configs) when
    tp exceeds its key/value heads; None when tp divides them."""
    heads, kv_heads, head_dim = layer_head_shape(layer_config)
    if kv_heads % tp == 0:
        return None
    # ParallelDims: tp is a multiple of kv_heads, so a rank's H/tp query heads lie in one group of H/kv_heads.
    kv_head = tp_rank * (heads // tp) // (heads // kv_heads)
    return slice(kv_head * head_dim, (kv_head + 1) * head_dim)


class _LocalReplicated(ParallelStyle):
    """A module acting on each head or token alone, on this rank's heads or tokens: a norm over each head's width
    (Qwen3's and Gemma 3's q_norm / k_norm, a Gated DeltaNet's gated norm with its gate), a router, or a norm or
    linear map called on this rank's tokens in a layout SequenceParallel does not describe (Gemma 4's experts' path
    on the tokens flattened, its per-layer inputs). Its weights are replicated (Replicate DTensors, as checkpoints and
    FSDP2 see them). Each call runs on this rank's local tensors with the weights' local tensors in their place, whose
    gradients cover this rank's heads or tokens only, Partial sums (`_replicate_locally`). Nothing of the call is a
    DTensor: DTensor's backward of the gate's activation would sum the ranks' gradients, which belong to different
    heads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_locally(module, device_mesh)
        return module


def _replicate_locally(module: nn.Module, mesh: DeviceMesh) -> None:
    """`module`'s weights replicated over tp, each of its parts with weights reading their local tensors in its own
    calls (`_split_parameters`), their gradients this rank's part (Partial sums)."""
    for part in module.modules():
        own = [name for name, _ in part.named_parameters(recurse=False)]
        if own:
            _split_parameters(part, mesh, {name: (Replicate(), _replicated_local) for name in own})


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _token_wise(module: nn.Module, hidden: int) -> bool:
    """A norm of the residual stream (or any module holding only (H,) vectors and no submodules with weights): it
    acts on each token alone, so it runs on this rank's tokens of the sequence."""
    return not any(_has_parameters(child) for child in module.children()) and all(
        p.shape == (hidden,) for p in module.parameters())


def _head_norms(attention: nn.Module) -> list[str]:
    return [name for name, child in attention.named_children() if name not in _ATTENTION_COLUMNS + ("o_proj",)
            and _has_parameters(child)]


def _parts(module: nn.Module) -> set[str]:
    return {name for name, child in module.named_children() if _has_parameters(child)}


def _linear(module: nn.Module | None) -> bool:
    """A linear projection, also under a peft LoRA layer (its `base_layer`)."""
    return isinstance(getattr(module, "base_layer", module), nn.Linear)


def _gated_mlp(layer: nn.Module) -> str | None:
    """The name of the layer's one dense gate/up/down MLP (Llama's `mlp`, Llama 4's `feed_forward`), None without."""
    found = [name for name, child in layer.named_children() if _parts(child) == set(_MLP_COLUMNS + ("down_proj",))
             and all(_linear(getattr(child, part)) for part in _parts(child))]
    return found[0] if len(found) == 1 else None


def _routed_experts(module: nn.Module) -> bool:
    """Routed experts as transformers fuses them: every expert's gate and up rows stacked in one 3-D `gate_up_proj`
    (E, 2I, H) and `down_proj` (E, H, I), or transposed (E, H, 2I) and (E, I, H) (`_transposed_experts`)."""
    own = dict(module.named_parameters(recurse=False))
    return (set(own) == set(_EXPERT_WEIGHTS) and not _has_parameters(nn.ModuleList(module.children()))
            and own["gate_up_proj"].dim() == own["down_proj"].dim() == 3)


def _transposed_experts(experts: nn.Module, hidden: int) -> bool | None:
    """Whether fused experts hold `gate_up_proj` as (E, H, 2I) and `down_proj` as (E, I, H) (Llama 4's, which the
    tokens multiply from the left) rather than (E, 2I, H) and (E, H, I); read from the shapes, which tell the two apart
    (both would need I = H = 2I). None: neither, or gate and up not stacked gate first without biases, as transformers'
    `use_experts_implementation` flags them (`is_concatenated`, `has_bias`; Llama 4's own experts module carries no
    flags and chunks its gate_up product in two halves, gate first)."""
    flags = {flag: getattr(experts, flag) for flag in ("is_concatenated", "has_bias") if hasattr(experts, flag)}
    if flags and flags != {"is_concatenated": True, "has_bias": False}:
        return None
    (_, a, b), (_, c, d) = experts.gate_up_proj.shape, experts.down_proj.shape
    if a == 2 * d and b == hidden == c:
        return False
    if b == 2 * c and a == hidden == d:
        return True
    return None


def _experts_block(layer: nn.Module) -> str | None:
    """The name of the layer's mixture-of-experts block, the child holding routed experts (`_routed_experts`); None
    without one."""
    found = [name for name, child in layer.named_children() if any(_routed_experts(part) for part in child.children())]
    return found[0] if len(found) == 1 else None


def _own_experts(layer: nn.Module) -> bool:
    """Whether the layer holds routed experts as its own child beside its dense MLP, with its router, and calls them
    itself (Gemma 4's mixture-of-experts layers, `enable_moe_block`)."""
    return any(_routed_experts(child) for child in layer.children())


def _experts_refusal(index: int, block: str, parts: list[tuple[str, nn.Module]], own: list[str], hidden: int,
                     text_config, tp: int, lora: bool) -> str | None:
    """What of the mixture of experts of layer `index` tp cannot split (`block`: the child holding it, as
    "mlp.", or "" where the layer holds its `parts` itself, Gemma 4's): parts other than routed experts (their layout
    `TensorParallelExperts` splits), gated MLPs (a shared expert) and routers (every parameter a (k, H) matrix of
    the tokens, or a vector of scales: the routers and a shared expert's gate); parameters of the block's own
    (`own`); widths tp does not divide; a router drawing noise, or a load-balancing loss, which the tp ranks would
    each draw or count on the same tokens; LoRA."""
    widths, named = [], block.rstrip(".") or "mixture of experts"
    for part, child in parts:
        if _routed_experts(child):
            transposed = _transposed_experts(child, hidden)
            if transposed is None:
                flags = {flag: getattr(child, flag, None) for flag in ("is_concatenated", "is_transposed", "has_bias")}
                return (f"layer {index}'s {block}{part} store their gate and up rows otherwise than stacked gate "
                        f"first without biases ({flags}), which tensor parallelism does not split: {_FIX}")
            widths.append((f"{part}' intermediate size", child.down_proj.shape[1 if transposed else 2]))
        elif _parts(child) == set(_MLP_COLUMNS + ("down_proj",)) and all(
                _linear(getattr(child, p)) and getattr(child, p).bias is None for p in _parts(child)):
            widths.append((f"{part}'s intermediate size", child.down_proj.in_features))
        elif any(p.dim() > 2 or (p.dim() == 2 and p.shape[1] != hidden) for p in child.parameters()):
            return (f"layer {index}'s {block}{part} is neither routed experts, a gated MLP without biases nor a router "
                    f"of the tokens, which tensor parallelism splits: {_FIX}")
    if own:
        return f"layer {index}'s {block}{own[0]} is not split by tensor parallelism: {_FIX}"
    for part, width in widths:
        if width % tp:
            fits = [d for d in range(2, width + 1) if width % d == 0]
            return (f"layer {index}'s {block}{part} {width} is split over tensor parallelism's {tp} ranks: use "
                    f"parallel.tp in {fits}, or {_FIX}")
    if getattr(text_config, "router_jitter_noise", 0):
        return (f"layer {index}'s {named}: the router draws noise (router_jitter_noise="
                f"{text_config.router_jitter_noise}) that each tp rank would draw apart: {_FIX}")
    if getattr(text_config, "output_router_logits", False):
        return (f"layer {index}'s {named}: the routers' load-balancing loss (output_router_logits) would count every "
                f"token on each tp rank: {_FIX}")
    if lora:
        return (f"layer {index}'s {named}: LoRA on a mixture of experts under tensor parallelism is not implemented: "
                f"{_FIX}")
    return None


def _attention_refusal(index: int, attention: nn.Module, layer_config) -> str | None:
    # a layer reusing an earlier layer's keys and values (Gemma 4's `is_kv_shared_layer`) has no k_proj or v_proj:
    # on each tp rank it reads the keys and values of this rank's heads, which that layer stored
    shared = getattr(attention, "is_kv_shared_layer", False)
    needed = ("q_proj", "o_proj", *(() if shared else _KEY_VALUE))
    if not all(_linear(getattr(attention, name, None)) for name in needed):
        return f"layer {index}'s self_attn lacks separate q_proj, k_proj, v_proj and o_proj: {_FIX}"
    own = [name for name, _ in attention.named_parameters(recurse=False)]
    if own:
        return f"layer {index}'s self_attn.{own[0]} (one value per head, e.g. attention sinks) is not split: {_FIX}"
    if getattr(layer_config, "clip_qkv", None):
        # OLMo's attention clamps its projections' outputs in place; tp's are views of the DTensors' local shards
        return (f"layer {index}'s self_attn clips q, k and v in place (clip_qkv={layer_config.clip_qkv}), which tensor "
                f"parallelism's split projections cannot take: {_FIX}")
    head_dim = layer_head_shape(layer_config)[2]
    for name in _head_norms(attention):
        widths = {tuple(p.shape) for p in getattr(attention, name).parameters()}
        if widths != {(head_dim,)}:
            return (f"layer {index}'s self_attn.{name} normalizes across the heads (weights {sorted(widths)}, not one "
                    f"head's {head_dim}), which tensor parallelism splits over its ranks: {_FIX}")
    return None


def _grouped_by_key_head(mixer: nn.Module) -> bool:
    """Whether a Gated DeltaNet fuses its projections key head by key head (Qwen3-Next's, module docstring)."""
    return _parts(mixer) >= {"in_proj_qkvz", "in_proj_ba"}


def _linear_attention_refusal(index: int, name: str, mixer: nn.Module, tp: int) -> str | None:
    """What of a Gated DeltaNet layer `mixer` (models.linear_attention) tp cannot split by head: parts other than
    a fused q/k/v projection and z, b and a projections (or Qwen3-Next's q/k/v/z and b/a projections fused by key
    head), the depthwise convolution, the gated norm over one value head's width, out_proj and one A_log and dt_bias
    per value head; or key heads tp does not divide."""
    parts = _parts(mixer) | {part for part, _ in mixer.named_parameters(recurse=False)}
    layout = _GROUPED_LINEAR_ATTENTION_PARTS if _grouped_by_key_head(mixer) else _LINEAR_ATTENTION_PARTS
    known = set(layout + _PER_VALUE_HEAD)
    odd = sorted(parts - known) or sorted(known - parts)
    if odd:
        grouped = ", ".join(_GROUPED_LINEAR_ATTENTION_PARTS)
        return (f"layer {index}'s {name}.{odd[0]}: tensor parallelism splits a linear-attention layer of "
                f"{', '.join(_LINEAR_ATTENTION_PARTS + _PER_VALUE_HEAD)} (or {grouped}) by head, not this one: {_FIX}")
    widths = {tuple(p.shape) for p in mixer.norm.parameters()}
    if widths != {(mixer.head_v_dim,)}:
        return (f"layer {index}'s {name}.norm normalizes across the value heads (weights {sorted(widths)}), which "
                f"tensor parallelism splits over its ranks: {_FIX}")
    if mixer.num_k_heads % tp:
        fits = [d for d in range(2, mixer.num_k_heads + 1) if mixer.num_k_heads % d == 0]
        return (f"layer {index}'s {name} has {mixer.num_k_heads} key heads, which tensor parallelism splits with "
                f"their value heads over its {tp} ranks: {f'use parallel.tp in {fits}, or ' if fits else ''}{_FIX}")
    return None


def _token_map(module: nn.Module) -> bool:
    """A linear map a layer or the model calls on this rank's tokens itself, outside attention and the MLP (Gemma 4's
    per-layer input gate and projection, its per-layer model projection): it runs there, on `_LocalReplicated`
    weights, peft's LoRA adapters on it too (`_replicate_locally` replicates every part's weights)."""
    return _linear(module)


def _layer_refusal(index: int, layer: nn.Module, layer_config, hidden: int, linear_mixer: nn.Module | None,
                   tp: int, text_config, lora: bool) -> str | None:
    """What of decoder layer `index` tensor parallelism cannot split, in words naming the part and the fix; None when
    every parameter has a place in `_layer_plan`. `linear_mixer`: the layer's Gated DeltaNet, if it is one."""
    attention, mlp = linear_mixer or getattr(layer, "self_attn", None), _gated_mlp(layer) or _experts_block(layer)
    others = [name for name, child in layer.named_children() if child is not attention and name != mlp
              and _has_parameters(child) and not _token_wise(child, hidden) and not _token_map(child)]
    if attention is None:
        mixer = next((name for name in others if name != mlp), "?")
        return (f"layer {index}'s {mixer} is neither attention with q/k/v/o projections nor a Gated DeltaNet "
                f"linear-attention layer: {_FIX}")
    if linear_mixer is not None:
        refusal = _linear_attention_refusal(index, _child_name(layer, linear_mixer), linear_mixer, tp)
    else:
        refusal = _attention_refusal(index, attention, layer_config)
    if refusal:
        return refusal
    if mlp is not None and mlp == _experts_block(layer):
        block = getattr(layer, mlp)
        refusal = _experts_refusal(index, f"{mlp}.", list(block.named_children()),
                                   [part for part, _ in block.named_parameters(recurse=False)], hidden, text_config,
                                   tp, lora)
        if refusal:
            return refusal
    if mlp is not None and _own_experts(layer):  # Gemma 4's: every other part of the layer is one of the experts'
        refusal = _experts_refusal(index, "", [(name, getattr(layer, name)) for name in others], [], hidden,
                                   text_config, tp, lora)
        if refusal:
            return refusal
        others = []
    if mlp is None:
        named = ", ".join(f"{name} ({', '.join(sorted(_parts(getattr(layer, name))))})" for name in others)
        return (f"layer {index}'s {named or 'MLP'}: neither one gate_proj, up_proj and down_proj MLP nor a "
                f"mixture of routed experts: {_FIX}")
    others += [name for name, _ in layer.named_parameters(recurse=False)]
    if others:
        return (f"layer {index}'s {others[0]} (outside attention, the MLP, the norms and linear maps of the tokens) is "
                f"not split: {_FIX}")
    return None


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    return next(name for name, module in parent.named_children() if module is child)


def tensor_parallel_refusal(text_config, tp: int, lora: bool = False) -> str | None:
    """What of the causal LM of HF `text_config` tensor parallelism over `tp` ranks cannot split, naming the part
    and the fix; None when it can split every part. Read from the model's structure (built on the meta device):
    decoder layers of attention with q/k/v/o projections (biases allowed; norms over one head's width) or of Gated
    DeltaNet linear attention (`_linear_attention_refusal`), a gate/up/down MLP or a mixture of routed experts
    (`_experts_refusal`; `lora`: adapters will be attached) and norms of the residual stream; the embeddings,
    a final norm and lm_head around them. Sliding windows, softcaps, scaled embeddings, output gates and the like are
    arithmetic on whole heads or tokens, which tp keeps whole."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config)
    hidden = text_config.hidden_size
    layers = decoder_layers(model)
    configs = layer_configs(text_config)
    linear_mixers = linear_attention_layers(model)
    for index, layer in enumerate(layers):
        refusal = _layer_refusal(index, layer, configs[index], hidden, linear_mixers.get(index), tp, text_config, lora)
        if refusal:
            return refusal
    body = decoder(model)
    around = [name for name, child in body.named_children() if child is not layers and _has_parameters(child)
              and child is not model.get_input_embeddings() and not (name == "norm" and _token_wise(child, hidden))
              and _around_style(child, body) is None]
    if around:
        return (f"the model's {around[0]} (outside the decoder layers, the embeddings and the final norm) is not "
                f"split: {_FIX}")
    return None


def replicated_linear_maps(text_config) -> set[str]:
    """The names of the linear maps of the causal LM of HF `text_config` that tensor parallelism replicates, each rank
    running them on its tokens (`_token_map`: Gemma 4's per-layer input gates and projections), where LoRA adapters
    can go beside the projections it splits."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config)
    body, layers = decoder(model), decoder_layers(model)
    children = [*body.named_children(), *(pair for layer in layers for pair in layer.named_children())]
    return {name for name, child in children if _token_map(child)}


def _around_style(module: nn.Module, body: nn.Module) -> ParallelStyle | None:
    """How a part of the decoder `body` beside its input embeddings, layers and final norm is split, None where it
    is not (`tensor_parallel_refusal`). Only Gemma's per-layer inputs are: its per-layer embeddings, looked up for
    this rank's tokens only (`_per_layer_inputs_of_local_tokens`), and the linear map and the norm (weights of one
    dimension) it projects the embeddings' tokens with, replicated, each rank computing its tokens'."""
    if getattr(body, "embed_tokens_per_layer", None) is None:
        return None
    if module is body.embed_tokens_per_layer or _token_map(module) or (
            not _has_parameters(nn.ModuleList(module.children())) and all(p.dim() == 1 for p in module.parameters())):
        return _LocalReplicated()
    return None


def _per_layer_inputs_of_local_tokens(per_layer_inputs, mesh: DeviceMesh, input_ids: torch.Tensor | None,
                                      *args, **kwargs) -> torch.Tensor:
    """Gemma's `get_per_layer_inputs` on this tp rank's tokens of `input_ids` (B, L): the embeddings it adds them to
    are this rank's slice of the sequence (RowwiseParallel's Shard(1): torch.chunk's), and it reshapes its lookup
    by the ids' shape, so the ids are cut before the lookup (which then reads only these tokens' rows)."""
    rank, ranks = mesh.get_local_rank(), mesh.size()
    if input_ids is not None:
        input_ids = input_ids.chunk(ranks, dim=1)[rank]  # (B, L/T)
    return per_layer_inputs(input_ids, *args, **kwargs)


def _attention_plan(attention: nn.Module, kv_columns: slice | None) -> dict[str, ParallelStyle]:
    """The styles of softmax attention (`self_attn`): q/k/v column-parallel by head, o_proj row-parallel."""
    plan: dict[str, ParallelStyle] = {"self_attn": PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()})}
    plan.update({f"self_attn.{name}": _LocalReplicated() for name in _head_norms(attention)})
    replicated_a = _Replicated(use_local_output=False)
    for name in _ATTENTION_COLUMNS:
        if getattr(attention, name, None) is None:  # a layer reusing another's keys and values
            continue
        if kv_columns is not None and name in _KEY_VALUE:
            head = _ReplicatedColumns((kv_columns,))
            plan.update(_projection_plan(getattr(attention, name), f"self_attn.{name}", head, replicated_a, head))
        else:
            plan.update(_projection_plan(getattr(attention, name), f"self_attn.{name}", ColwiseParallel(),
                                         replicated_a, ColwiseParallel()))
    plan.update(_projection_plan(attention.o_proj, "self_attn.o_proj", RowwiseParallel(output_layouts=Shard(1)),
                                 RowwiseParallel(output_layouts=Replicate(), use_local_output=False),
                                 _Replicated(output_layout=Shard(1))))
    return plan


def _linear_attention_channels(mixer: nn.Module, tp_rank: int, tp: int) -> tuple[slice, ...]:
    """This rank's rows of a Gated DeltaNet's fused q/k/v projection, the same channels of its convolution: its key
    heads [r Hk/T, (r+1) Hk/T) in the q and in the k segment, their value heads [r Hv/T, (r+1) Hv/T) in the v
    segment (each key head serves Hv/Hk consecutive value heads)."""
    keys, values = mixer.key_dim // tp, mixer.value_dim // tp
    return (slice(tp_rank * keys, (tp_rank + 1) * keys),
            slice(mixer.key_dim + tp_rank * keys, mixer.key_dim + (tp_rank + 1) * keys),
            slice(2 * mixer.key_dim + tp_rank * values, 2 * mixer.key_dim + (tp_rank + 1) * values))


def _linear_attention_plan(name: str, channels: tuple[slice, ...], grouped: bool) -> dict[str, ParallelStyle]:
    """The styles of Gated DeltaNet `name` (module docstring): the fused q/k/v projection replicated, each rank
    keeping its heads' `channels`; z and b column-parallel by value head, a too but left a DTensor (Shard(-1)) to
    meet A_log and dt_bias (sharded by value head, `_split_linear_attention`) in transformers' arithmetic of the
    log decay; the gated norm on this rank's value heads; out_proj row-parallel. `grouped` (Qwen3-Next's): the
    q/k/v/z and b/a projections column-parallel by key head."""
    projections: dict[str, ParallelStyle] = {
        f"{name}.in_proj_qkvz": ColwiseParallel(), f"{name}.in_proj_ba": ColwiseParallel()} if grouped else {
        f"{name}.in_proj_qkv": _ReplicatedColumns(channels), f"{name}.in_proj_z": ColwiseParallel(),
        f"{name}.in_proj_b": ColwiseParallel(), f"{name}.in_proj_a": ColwiseParallel(use_local_output=False)}
    return {
        name: PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                 desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        **projections,
        f"{name}.norm": _LocalReplicated(),
        f"{name}.out_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def _split_linear_attention(mixer: nn.Module, mesh: DeviceMesh, channels: tuple[slice, ...]) -> None:
    """What of a Gated DeltaNet the styles do not reach: transformers reads A_log, dt_bias and the convolution's
    weight off the module, not through a module call. A_log and dt_bias are sharded by value head; the convolution
    is replicated and its kernels (`TensorParallelLinearAttention`, around cp's when set) cut this rank's channels.
    transformers splits the local q/k/v by the module's key_dim and value_dim: set to this rank's widths (and, for
    Qwen3-Next's view of its fused outputs by key head, its head counts; its A_log and dt_bias meet the plain local
    a, so its calls read their local shards)."""
    if _grouped_by_key_head(mixer):
        _split_parameters(mixer, mesh, {name: (Shard(0), _sharded_local) for name in _PER_VALUE_HEAD})
        mixer.num_k_heads //= mesh.size()
        mixer.num_v_heads //= mesh.size()
    else:
        for name in _PER_VALUE_HEAD:
            param = getattr(mixer, name)
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
            mixer.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    _replicate_parameters("conv1d", mixer.conv1d, mesh)
    mixer.key_dim //= mesh.size()
    mixer.value_dim //= mesh.size()
    inner = getattr(mixer, "longfit_context_parallel", None) or LOCAL
    mixer.longfit_context_parallel = TensorParallelLinearAttention(channels, inner)


class TensorParallelLinearAttention:
    """The kernels of a Gated DeltaNet on this tp rank's heads (models.linear_attention's kernels object): the
    convolution's replicated weight (and bias) cut to this rank's `channels`, their gradient a Partial sum over tp
    as `_ReplicatedColumns`'; the log decay g, a DTensor sharded by value head, made this rank's (Qwen3-Next's is
    computed from local shards already); then `inner`'s kernels (one rank's whole rows, or cp's: parallel/linear.py)
    on the local heads."""

    def __init__(self, channels: tuple[slice, ...], inner):
        self.channels, self.inner = channels, inner

    def _local(self, weight: DTensor | None) -> torch.Tensor | None:
        if weight is None:
            return None
        local = weight.to_local(grad_placements=[Partial()])
        return torch.cat([local[channels] for channels in self.channels])  # (C/T, ...)

    def conv(self, x, weight, bias, activation, documents) -> torch.Tensor:
        return self.inner.conv(x, self._local(weight), self._local(bias), activation, documents)

    def delta_rule(self, q, k, v, g, beta, documents, use_qk_l2norm: bool) -> torch.Tensor:
        g = g.to_local() if isinstance(g, DTensor) else g
        return self.inner.delta_rule(q, k, v, g, beta, documents, use_qk_l2norm)

    def __deepcopy__(self, memo: dict) -> "TensorParallelLinearAttention":
        return self  # cp's kernels hold a process group, which cannot be copied

    def __repr__(self) -> str:
        return f"TensorParallelLinearAttention(channels={self.channels}, inner={self.inner!r})"


def _layer_plan(layer: nn.Module, hidden: int, mixer: nn.Module, mixer_plan: dict[str, ParallelStyle]
                ) -> dict[str, ParallelStyle]:
    """The styles of a layer `tensor_parallel_refusal` accepts: its token `mixer`'s (`mixer_plan`), the MLP's (or
    the mixture of experts', `TensorParallelExperts`), and its norms of the residual stream on this rank's tokens
    (their outputs plain sequence shards, whether the mixer, the MLP or a residual add reads them next)."""
    mlp_name = _gated_mlp(layer) or _experts_block(layer)
    mlp = getattr(layer, mlp_name)
    own_experts = _own_experts(layer)
    plan: dict[str, ParallelStyle] = {}
    for name, child in layer.named_children():
        if child is mixer or child is mlp or not _has_parameters(child):
            continue
        if _token_wise(child, hidden):
            # Gemma 4's norms of the experts' path read the tokens flattened, (B L/T, H), which SequenceParallel
            # would take as sharded on H: there they run on the local tensors as the head norms do
            plan[name] = _LocalReplicated() if own_experts else SequenceParallel(use_local_output=True)
        elif _token_map(child):
            plan[name] = _LocalReplicated()
        elif own_experts:
            plan[name] = TensorParallelOwnExperts(hidden) if _routed_experts(child) else _LocalReplicated()
    plan.update(mixer_plan)
    if mlp_name == _experts_block(layer):
        plan[mlp_name] = TensorParallelExperts(hidden)
        return plan
    plan[mlp_name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    replicated_a = _Replicated(use_local_output=False)
    for name in _MLP_COLUMNS:
        plan.update(_projection_plan(getattr(mlp, name), f"{mlp_name}.{name}", ColwiseParallel(), replicated_a,
                                     ColwiseParallel()))
    pending = RowwiseParallel(output_layouts=Partial(), use_local_output=False)
    plan.update(_projection_plan(mlp.down_proj, f"{mlp_name}.down_proj", pending, pending,
                                 _Replicated(output_layout=Partial(), use_local_output=False)))
    return plan


def _expert_rows(gate_up: torch.Tensor, rank: int, tp: int, dim: int) -> torch.Tensor:
    """This rank's rows of fused experts' `gate_up_proj` (E, 2I, H), or columns of a transposed one (E, H, 2I), along
    `dim`: its gate rows [r I/T, (r+1) I/T) and the same up rows, which transformers' experts split in two halves
    (gate first)."""
    half = gate_up.shape[dim] // 2
    width = half // tp
    return torch.cat([gate_up.narrow(dim, rank * width, width), gate_up.narrow(dim, half + rank * width, width)],
                     dim=dim)  # (E, 2I/T, H) or (E, H, 2I/T)


def _replicated_local(param: DTensor) -> torch.Tensor:
    return param.to_local(grad_placements=[Partial()])


def _sharded_local(param: DTensor) -> torch.Tensor:
    return param.to_local()


def _with_local_parameters(module: nn.Module, forward, local: dict, *args, **kwargs):
    # The DTensors come back in `finally`: a checkpoint's recomputation stops early by raising inside a forward
    # once it saved what backward needs, which would skip a forward hook.
    split = dict(module._parameters)
    module._parameters.update({name: to_local(split[name]) for name, to_local in local.items()})
    try:
        return forward(*args, **kwargs)
    finally:
        module._parameters.update(split)


def _split_parameters(module: nn.Module, mesh: DeviceMesh, layout: dict) -> None:
    """`module`'s parameters by name -> (placement over tp, the local tensor its calls read), the local tensors
    swapped in for each call (`_with_local_parameters`)."""
    for name, (placement, _) in layout.items():
        param = module._parameters[name]
        split = distribute_tensor(param.detach(), mesh, [placement])
        module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
    module.forward = functools.partial(_with_local_parameters, module, module.forward,
                                       {name: local for name, (_, local) in layout.items()})


def _gathered(local: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Every tp rank's `local` concatenated along `dim`; its gradient this rank's part (summed over the ranks by the
    all-gather's backward, a reduce-scatter)."""
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False).redistribute(
        placements=[Replicate()]).to_local(grad_placements=[Partial()])


def _summed(pending: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """This rank's slice along `dim` of the sum over the tp ranks of `pending` (a reduce-scatter)."""
    summed = DTensor.from_local(pending, mesh, [Partial()], run_check=False)
    return summed.redistribute(placements=[Shard(dim)]).to_local()


def _gathered_tokens(mesh: DeviceMesh, module: nn.Module, args: tuple) -> tuple:
    return (_gathered(args[0], mesh, 1), *args[1:])  # (B, L, H), its gradient this rank's part


def _summed_tokens(mesh: DeviceMesh, module: nn.Module, args: tuple, output):
    """The block's output tokens summed over tp into this rank's sequence shard (B, L/T, H). A block may return them
    flattened, (B L, H), beside its router logits (Llama 4's: replicated, the same on every rank, which the layer
    drops): they are summed in the shape of the gathered input, `args[0]` (B, L, H)."""
    tokens, *rest = output if isinstance(output, tuple) else (output,)
    summed = _summed(tokens.view(args[0].shape), mesh, 1)
    return (summed, *rest) if isinstance(output, tuple) else summed


class TensorParallelExperts(ParallelStyle):
    """A mixture-of-experts block (`_experts_refusal` admits its parts) over tp, Megatron's split of every
    expert: each rank computes the slice [r I/T, (r+1) I/T) of every expert's intermediate width, and of the shared
    expert's (a gated MLP): gate and up column-parallel, down row-parallel, so the block's output is a pending sum
    over the ranks. The routers (and the shared expert's sigmoid gate) are replicated: every rank routes all tokens
    of the row alike, and the routing weights scale its part of each expert's output, linear in the pending sum (or,
    as Llama 4's, the tokens entering the experts: replicated, so each rank's part is scaled alike).

    The block runs on local tensors: its input is all-gathered along the sequence (backward: the ranks' partial
    input gradients reduce-scattered), its output reduce-scattered (backward: all-gathered), and each part reads its
    parameters' local tensors in its own forward (so the tiled MLP's recomputed tiles read them too).
    The gradients of the replicated parameters are this rank's part (Partial sums, as `_LocalReplicated`'s); the gate
    and up halves of the fused `gate_up_proj` hold a rank's rows in two segments, which no box-shaped placement
    describes (loading, DCP and the export read one box a rank, `models.init.local_region`): it is replicated as
    Gated DeltaNet's fused projection is (`_ReplicatedColumns`), each rank computing with its rows; `down_proj` is
    sharded on its intermediate dim (Shard(2)). Transposed experts (Llama 4's, `_transposed_experts`) are split the
    same way on their own intermediate dims (gate_up_proj's columns, down_proj's Shard(1)). The cost: gate_up_proj's
    weights, gradients and optimizer state not divided by T, and one all-reduce of its gradient over tp."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden  # the model's width, which tells transposed experts apart

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for child in module.children():
            if _routed_experts(child):
                _split_experts(child, device_mesh, self.hidden)
            elif _parts(child) == set(_MLP_COLUMNS + ("down_proj",)):
                for part, placement in (("gate_proj", Shard(0)), ("up_proj", Shard(0)), ("down_proj", Shard(1))):
                    _split_parameters(getattr(child, part), device_mesh, {"weight": (placement, _sharded_local)})
            else:  # a router
                _replicate_locally(child, device_mesh)
        module.register_forward_pre_hook(functools.partial(_gathered_tokens, device_mesh))
        module.register_forward_hook(functools.partial(_summed_tokens, device_mesh))
        return module


def _split_experts(experts: nn.Module, mesh: DeviceMesh, hidden: int) -> None:
    """Every expert's intermediate width split over tp (`TensorParallelExperts`): gate_up_proj replicated, each rank
    reading its rows (`_expert_rows`), down_proj sharded; on their intermediate dims, gate_up_proj's 1 and
    down_proj's 2, or 2 and 1 where transposed."""
    rank, tp = mesh.get_local_rank(), mesh.size()
    inner = 2 if _transposed_experts(experts, hidden) else 1
    _split_parameters(experts, mesh, {
        "gate_up_proj": (Replicate(), lambda p: _expert_rows(_replicated_local(p), rank, tp, inner)),
        "down_proj": (Shard(3 - inner), _sharded_local)})


def _gathered_rows(mesh: DeviceMesh, module: nn.Module, args: tuple) -> tuple:
    return tuple(_gathered(arg, mesh, 0) if isinstance(arg, torch.Tensor) else arg for arg in args)


def _summed_rows(mesh: DeviceMesh, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return _summed(output, mesh, 0)


class TensorParallelOwnExperts(TensorParallelExperts):
    """Routed experts a layer calls itself beside its dense MLP (Gemma 4's), on this rank's tokens flattened,
    (B L/T, H), with its router's top-k indices and weights of them, (B L/T, k). The call's tensors are all-gathered
    over tp along those rows (in any order of the tokens: the experts act on each alone, and the reduce-scatter of
    the output returns each rank's rows in the order they came), every expert split as in `TensorParallelExperts`,
    and the output, a pending sum over the ranks, reduce-scattered back to this rank's rows."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _split_experts(module, device_mesh, self.hidden)
        module.register_forward_pre_hook(functools.partial(_gathered_rows, device_mesh))
        module.register_forward_hook(functools.partial(_summed_rows, device_mesh))
        return module


def apply_tensor_parallel(loss_module: "CausalLMLoss", mesh: DeviceMesh) -> None:
    """Shard `loss_module.model` (peft adapters already attached) over the 1-D tp `mesh` in place, and give the
    loss its vocabulary-parallel collectives. Module and parameter names do not change.

    A pipeline stage's model (parallel/pipeline.py `cut_stage`) holds only some decoder layers, the embeddings on the
    first stage, the final norm and lm_head on the last: each part is planned where it is held, a layer by its index
    in the whole model. The residual stream leaves and enters a stage as it passes between layers, this tp rank's
    tokens (B, L/T, H), so no collective is added at the cut."""
    causal_lm = unwrap_peft(loss_module.model)
    body, lm_head = decoder_and_head(loss_module.model)
    embedding = causal_lm.get_input_embeddings()
    tied = lm_head is not None and embedding is not None and lm_head.weight is embedding.weight
    requires_grad = {name: p.requires_grad for name, p in causal_lm.named_parameters()}
    configs = layer_configs(causal_lm.config.get_text_config())

    if embedding is not None:
        parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
        # image rows place their embeddings in this rank's slice of the tokens (models.media.input_embeddings)
        embedding.longfit_sequence_part = (mesh.get_local_rank(), mesh.size())
    hidden = causal_lm.config.get_text_config().hidden_size
    layers = decoder_layers(causal_lm)
    for name, child in body.named_children():  # Gemma 4's per-layer inputs, computed beside the embeddings
        if child is not embedding and name != "norm" and child is not layers and _has_parameters(child):
            parallelize_module(child, mesh, _around_style(child, body))
    if getattr(body, "embed_tokens_per_layer", None) is not None:
        body.get_per_layer_inputs = functools.partial(_per_layer_inputs_of_local_tokens, body.get_per_layer_inputs,
                                                      mesh)
    linear_mixers = linear_attention_layers(causal_lm)
    rank = mesh.get_local_rank()
    for index, layer in layers.named_children():
        mixer = linear_mixers.get(int(index))
        if mixer is None:
            kv_columns = _key_value_columns(configs[int(index)], rank, mesh.size())
            parallelize_module(layer, mesh, _layer_plan(layer, hidden, layer.self_attn,
                                                        _attention_plan(layer.self_attn, kv_columns)))
        else:
            channels = _linear_attention_channels(mixer, rank, mesh.size())
            plan = _linear_attention_plan(_child_name(layer, mixer), channels, _grouped_by_key_head(mixer))
            parallelize_module(layer, mesh, _layer_plan(layer, hidden, mixer, plan))
            _split_linear_attention(mixer, mesh, channels)
        # down_proj's output is a pending sum (Partial): reduce-scatter it once, at the MLP's output
        if _gated_mlp(layer) is not None:
            parallelize_module(getattr(layer, _gated_mlp(layer)), mesh, PrepareModuleOutput(
                output_layouts=(Partial(),), desired_output_layouts=(Shard(1),), use_local_output=True))
    if lm_head is not None:
        parallelize_module(body.norm, mesh, SequenceParallel())
        # The loss reads lm_head's vocabulary rows (Shard(0)) and never calls it; called directly, it returns logits
        # sharded on the vocabulary.
        parallelize_module(lm_head, mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                          use_local_output=False))
        loss_module.vocab_parallel = VocabParallel(mesh, lm_head.weight.shape[0])
    if tied:
        lm_head.weight = embedding.weight
    for name, param in causal_lm.named_parameters():
        param.requires_grad_(requires_grad[name])
    left = [name for name, param in causal_lm.named_parameters() if not isinstance(param, DTensor)]
    if left:
        raise TypeError(
            f"tensor parallelism left parameters of {type(causal_lm).__name__} unplanned: {left[:4]} "
            "(ParallelDims.check_tensor_parallel admits only models tensor_parallel_refusal finds nothing in)"
        )


def replicate_media(media_encoder: nn.Module, mesh: DeviceMesh) -> None:
    """The vision side's weights replicated over the tp `mesh`, their gradients Partial sums (module docstring): each
    tp rank runs the tower on its share of the rows' images (`longfit.parallel.media.DealtMedia`).

    A tower's module may read a child's weights without calling it (torch's MultiheadAttention, SigLIP's pooling
    head, reads its out_proj's), so every module's call reads local tensors for all the weights below it
    (`_with_local_subtree`); the outermost call swaps them, the calls inside it find nothing left to swap, and a
    checkpointed block's recomputation, called on its own in the backward, swaps its own."""
    for part in media_encoder.modules():
        _replicate_parameters("", part, mesh)
    for part in media_encoder.modules():
        if _has_parameters(part):
            part.forward = functools.partial(_with_local_subtree, part, part.forward)


def _with_local_subtree(module: nn.Module, forward, *args, **kwargs):
    # As `_with_local_parameters`, for every weight below `module` still a DTensor; restored in `finally` likewise.
    split = [(part, name, param) for part in module.modules() for name, param in part._parameters.items()
             if isinstance(param, DTensor)]
    for part, name, param in split:
        part._parameters[name] = _replicated_local(param)
    try:
        return forward(*args, **kwargs)
    finally:
        for part, name, param in split:
            part._parameters[name] = param


class VocabParallel:
    """The loss under tensor parallelism: lm_head's rows and the final tokens of each row split over the tp ranks.

    Implements longfit.memory.chunked_loss.VocabularySplit with collectives over the tp group. Rank r holds
    vocabulary rows [r ceil(V/T), ...) (torch.chunk's split, which Shard(0) uses; the last slice may be shorter).
    """

    def __init__(self, mesh: DeviceMesh, vocab_size: int):
        self.group = mesh.get_group()
        self.ranks = mesh.size()
        rows = -(-vocab_size // self.ranks)
        self.vocab_start = min(vocab_size, mesh.get_local_rank() * rows)
        self.vocab_rows = min(vocab_size, self.vocab_start + rows) - self.vocab_start

    def loss(self, hidden: DTensor, lm_head: nn.Module, labels: torch.Tensor, chunk_tokens: int | None,
             softcap: float | None, backward_twice: bool = False) -> torch.Tensor:
        """Summed token loss of `lm_head` on `hidden` (the final norm's (B, L, H) DTensor, sharded on L) against
        `labels` (B, L); chunk_tokens None: one chunk of all tokens (memory.chunked_loss=false)."""
        assert isinstance(hidden, DTensor) and hidden.placements == (Shard(1),), "the final norm is sequence-parallel"
        weight = lm_head.weight.to_local()  # (V_r, H)
        assert weight.shape[0] == self.vocab_rows, (weight.shape, self.vocab_rows)
        bias = lm_head.bias.to_local() if lm_head.bias is not None else None
        return linear_cross_entropy(hidden.to_local(), weight, bias, labels, chunk_tokens or labels.numel(), softcap,
                                    use_liger=False, vocab=self, backward_twice=backward_twice)

    def gather_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        B, n, H = hidden.shape
        gathered = torch.empty((self.ranks * B, n, H), dtype=hidden.dtype, device=hidden.device)
        _all_gather(gathered, hidden.contiguous(), group=self.group)  # rank-major: (T, B, n, H)
        return gathered.view(self.ranks, B, n, H).transpose(0, 1).reshape(B, self.ranks * n, H)  # a view when B = 1

    def scatter_sum_sequence(self, grad: torch.Tensor) -> torch.Tensor:
        B, L, H = grad.shape
        n = L // self.ranks
        send = grad.view(B, self.ranks, n, H).transpose(0, 1).reshape(self.ranks * B, n, H)  # a view when B = 1
        out = torch.empty((B, n, H), dtype=grad.dtype, device=grad.device)
        _reduce_scatter(out, send, group=self.group)
        return out

    def all_reduce_max_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
