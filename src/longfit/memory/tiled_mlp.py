"""Tiled MLP: each decoder layer's MLP runs over token tiles, each tile recomputed in its own backward.

(`apply_tiled_final_norm` tiles the model's final norm, which tiled decoder layers need, in the tiled
layers' way: see there.)

The MLP is token-wise, so splitting the flattened (B*L, H) tokens into tiles changes nothing but the order
of floating-point sums in the weight gradients. A mixture-of-experts block too: its router picks each
token's experts from that token alone, so a tile's experts compute exactly what they would for the whole
sequence (only the capacity-free routing of transformers' MoE blocks is supported, which all of them use). Each tile runs under a non-reentrant checkpoint, which saves
only the tile's input (a view of the layer's (B*L, H) input, no copy), so the (tokens, intermediate)
activations (gate, up, act(gate) * up) exist for one tile at a time, in forward and in backward, and never
for the whole sequence. `split` gives one backward node that concatenates the tile gradients once.

Cost: one extra MLP forward per tile in backward. Nested inside a checkpointed layer, the layer recompute
runs the tiles once more except the last (checkpoint's early stop ends the recompute once the last tile's
input is saved): about 3 - 1/tiles MLP forwards per step instead of 2. That nesting is what keeps both the
layer's and the MLP's activations out of memory at long L.

Like activation checkpointing, the MLP is wrapped in place by overriding the instance's `forward` (same
parameter names, any order with peft, FSDP2 hooks of the enclosing layer stay outside). MLP dropout (none in
the supported models) would draw different masks per tile than untiled.
"""

from __future__ import annotations

import contextlib

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longfit.memory.switches import layer_tile_count, mlp_tile_count
from longfit.models.structure import decoder, decoder_layers, feed_forward, unwrap_peft

TILED_MLP_ATTR = "longfit_tiled_mlp"
TILED_NORM_ATTR = "longfit_tiled_norm"


@dataclass
class _MLPTiling:
    tiles: int | None
    hidden: int
    intermediate: int
    derive: Callable[[int, int, int], int] = mlp_tile_count
    """(tokens, hidden, intermediate) -> tiles, when `tiles` is None."""

    def sizes(self, n_tokens: int) -> list[int]:
        """Tokens of each tile, differing by at most one."""
        tiles = min(self.tiles or self.derive(n_tokens, self.hidden, self.intermediate), n_tokens)
        base, extra = divmod(n_tokens, tiles)
        return [base + 1] * extra + [base] * (tiles - extra)


def _tiled_mlp_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP over tiles of the flattened tokens, each checkpointed."""
    spec: _MLPTiling = getattr(module, TILED_MLP_ATTR)
    tokens = x.reshape(-1, x.shape[-1])  # (B*L, H)
    if tokens.shape[0] == 0:
        return type(module).forward(module, x)
    run = functools.partial(type(module).forward, module)
    # Each tile as one row of t tokens (1, t, H): a mixture-of-experts block reads (batch, length, hidden) from
    # its input's shape, and routes every token alone, so a tile of tokens is exact for it too.
    tiles = tokens.split(spec.sizes(tokens.shape[0]))
    outs = [checkpoint(run, tile.unsqueeze(0), use_reentrant=False) for tile in tiles]
    if isinstance(outs[0], torch.Tensor):
        return _joined(outs).reshape(*x.shape[:-1], -1)
    # A tuple (Llama 4's MoE block: its output, flat (t, H), and the router's logits (t, E)): each part joined.
    first, *rest = zip(*outs)
    return (_joined(first).reshape(*x.shape[:-1], -1), *(_joined(part) for part in rest))


def _joined(tiles) -> torch.Tensor:
    """The tiles' per-token outputs ((1, t, W) or (t, W)) as one (B*L, W) tensor, in token order."""
    return torch.cat([tile.reshape(-1, tile.shape[-1]) for tile in tiles])


@dataclass(frozen=True)
class RecordedAutocast:
    """The autocast in force in a forward, re-entered by its recomputes so that they compute in the same dtypes."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def now(cls, device_type: str) -> RecordedAutocast:
        if not torch.amp.autocast_mode.is_autocast_available(device_type):  # the meta device (the planner's traces)
            return cls(device_type, False, torch.float32)
        return cls(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))

    def __call__(self) -> contextlib.AbstractContextManager:
        if not torch.amp.autocast_mode.is_autocast_available(self.device_type):
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


def caller_owned(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is (a view of) a leaf the caller made, whose storage a backward must not write its
    gradient over; anything else an autograd op produced (FSDP2 passes module inputs on as views)."""
    return (tensor if tensor._base is None else tensor._base).is_leaf


class _TiledNorm(torch.autograd.Function):
    """The final norm over token tiles as one node that saves only its input (see `apply_tiled_final_norm`)."""

    @staticmethod
    def forward(ctx, x, norm: nn.Module, sizes: list[int], *params):
        # The trainable parameters are inputs only so that backward runs when x needs no gradient.
        ctx.norm, ctx.sizes, ctx.input_caller_owned = norm, sizes, caller_owned(x)
        ctx.autocast = RecordedAutocast.now(x.device.type)
        ctx.save_for_backward(x)
        tokens = x.reshape(-1, x.shape[-1])  # (B*L, H)
        output = None  # written tile by tile: one (B*L, H) tensor, not the tiles and their concatenation
        for index, tile in enumerate(tokens.split(sizes)):
            out = type(norm).forward(norm, tile)
            if output is None:  # the first tile's dtype (autocast decides it) and width size the output
                output = out.new_empty((tokens.shape[0], out.shape[-1]))
                output_tiles = output.split(sizes)
            output_tiles[index].copy_(out)
        return output.reshape(*x.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        tokens, grads = x.detach().reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        params = [p for p in ctx.norm.parameters() if p.requires_grad]
        needs_grad = ctx.needs_input_grad[0]
        # Each tile's input rows are read once, by its own recompute: its gradient can go over them (not over
        # a leaf tensor the caller made).
        grad_in = None
        if needs_grad:
            grad_in = torch.empty_like(tokens) if ctx.input_caller_owned else tokens
        grad_in_tiles = grad_in.split(ctx.sizes) if needs_grad else [None] * len(ctx.sizes)
        for tile, tile_grad_out, tile_grad_in in zip(tokens.split(ctx.sizes), grads.split(ctx.sizes), grad_in_tiles):
            tile.requires_grad_(needs_grad)  # a leaf: `tokens` is detached
            with torch.enable_grad(), ctx.autocast():
                out = type(ctx.norm).forward(ctx.norm, tile)
            torch.autograd.backward(out, tile_grad_out, inputs=([tile] if needs_grad else []) + params)
            if needs_grad:
                tile_grad_in.copy_(tile.grad)
        return (grad_in.view(x.shape) if needs_grad else None, None, None) + (None,) * len(params)


def _tiled_norm_forward(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    spec: _MLPTiling = getattr(norm, TILED_NORM_ATTR)
    n_tokens = x.numel() // x.shape[-1]
    if n_tokens == 0:
        return type(norm).forward(norm, x)
    params = [p for p in norm.parameters() if p.requires_grad]
    return _TiledNorm.apply(x, norm, spec.sizes(n_tokens), *params)


@dataclass
class TiledMLP:
    """What `apply_tiled_mlp` did."""

    layers: int
    """Decoder layers whose MLP is tiled (all of them but the tiled decoder layers)."""
    tiles: int | None
    """Fixed tile count, or None: `mlp_tile_count` of the tokens each call sees (local length under CP)."""


def untileable_mlp(model: nn.Module, start: int = 0) -> str | None:
    """Why the tiled MLP cannot run `model` (from decoder layer `start` on): the first layer without exactly one
    MLP module (`models.structure.feed_forward`: Gemma 4's layers also feed a per-layer input through projections of
    their own); None when it can. `memory.switches.resolve_memory_switches` decides `auto` with it."""
    for index, layer in enumerate(decoder_layers(model)[start:], start):
        if feed_forward(layer) is None:
            return f"decoder layer {index} ({type(layer).__name__}) has no single MLP module to tile"
    return None


def apply_tiled_mlp(model: nn.Module, tiles: int | None = None, start: int = 0, intermediate_shards: int = 1) -> TiledMLP:
    """Tile the MLP (`models.structure.feed_forward`) of the decoder layers from `start` on, in place; `tiles` None or 0 derives
    the count per call. Layers before `start` are tiled decoder layers, whose MLP already runs per tile.

    `intermediate_shards`: ranks the intermediate width is split over (tensor parallelism): a tile's
    intermediates are that much narrower, so the derived count is sized with the local width.
    """
    assert tiles is None or tiles >= 0, f"tile count {tiles} < 0 (config.validate)"
    config = unwrap_peft(model).config.get_text_config()
    problem = untileable_mlp(model, start)
    if problem:
        raise ValueError(f"{problem}: set memory.tiled_mlp=false")
    layers = decoder_layers(model)[start:]
    mlps = [feed_forward(layer) for layer in layers]
    for index, mlp in enumerate(mlps, start):
        if hasattr(mlp, TILED_MLP_ATTR):
            raise RuntimeError(f"the MLP of decoder layer {index} is already tiled: apply the tiled MLP once")
    for mlp in mlps:
        intermediate = (getattr(mlp, "intermediate_size", None) or config.intermediate_size) // intermediate_shards
        setattr(mlp, TILED_MLP_ATTR, _MLPTiling(tiles or None, config.hidden_size, intermediate))
        mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)
    return TiledMLP(len(layers), tiles or None)


def apply_tiled_final_norm(model: nn.Module, tiles: int | None = None) -> None:
    """Run the decoder's final norm (`get_decoder().norm`) over token tiles, recomputed per tile.

    With tiled decoder layers the whole-sequence norm would set the peak: an RMSNorm computes in fp32,
    about 24 bytes per token and hidden unit in backward. Tiled, it is one autograd node that keeps only
    its input (the last layer's output, alive anyway), runs the tiles without grad in forward and
    recomputes each in backward, and writes the input gradient over the input's rows as their tile
    finishes, as tiled decoder layers do: the last layer's output gradient then needs no memory of its
    own. `tiles` None derives the count like the tiled layers (layer_tile_count).
    """
    config = unwrap_peft(model).config.get_text_config()
    norm = getattr(decoder(model), "norm", None)
    if isinstance(norm, nn.Identity):  # a pipeline stage before the last (parallel/pipeline.py): no final norm
        return
    if not isinstance(norm, nn.Module):
        raise ValueError(f"{type(unwrap_peft(model)).__name__} has no final `norm` to tile: set memory.tiled_layers=false")
    if hasattr(norm, TILED_NORM_ATTR):
        raise RuntimeError("the final norm is already tiled: apply it once")
    setattr(norm, TILED_NORM_ATTR, _MLPTiling(tiles or None, config.hidden_size, config.intermediate_size, layer_tile_count))
    norm.forward = types.MethodType(_tiled_norm_forward, norm)
