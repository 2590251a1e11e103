"""The tiles of a tiled decoder layer as the planner counts them: their number and the largest one's share of a row.

A tiled layer (longfit.memory.tiled_layers) holds sequence-long tensors -- its output in forward; K/V
and their fp32 gradient in backward, and its input gradient, which on one rank takes the storage of its
input and under context parallelism is a tensor of its own, as are the exchange buffers of ring.py /
ulysses.py's layout -- plus the working set of ONE tile. So its costs are a + b L + c t in the tokens L of
the row and t of its largest tile, traced off the layer itself (plan/layer_trace.py); `setup_fraction`
gives t / L for the plan's rows.

`tile_fraction` mirrors how longfit.parallel.tiled_attention cuts a row (a test checks that they agree);
written out here, torch-free, like the other rules of plan/setup.py.
"""

from __future__ import annotations

import math

from longfit.memory.switches import layer_tile_count
from longfit.plan.setup import Setup, mlp_tiles


def tile_fraction(row_tokens: int, tiles: int, cp_method: str | None) -> float:
    """Tokens of the largest tile / tokens of the local row: ring tiles stay inside its two zigzag chunks."""
    if cp_method == "ring":
        chunk = row_tokens // 2
        per_chunk = max(1, min(math.ceil(tiles / 2), chunk))
        return math.ceil(chunk / per_chunk) / row_tokens
    return math.ceil(row_tokens / min(tiles, row_tokens)) / row_tokens


def looks_up_first_input(s: Setup) -> bool:
    """Whether the first tiled layer's backward looks its input up again from the token ids (memory/tiled_layers.py),
    keeping nothing from its forward. Not on image rows (#54): the input holds the images' embeddings written over
    their placeholders, and the layer keeps it on the device as a checkpointed layer keeps its input (not in the
    offload store, whose first layer is the second tiled layer either way)."""
    return s.tiled_layers and (s.images is None or not s.images.count)


def layer_tiles(s: Setup) -> int:
    """memory.layer_tiles, or the tile count a tiled layer derives for this rank's tokens."""
    return s.layer_tiles or layer_tile_count(s.tokens, s.shape.hidden, s.shape.intermediate)


def setup_fraction(s: Setup) -> float:
    """The tile fraction of this rank's tiled layers (rows of seq_len / cp tokens)."""
    return tile_fraction(s.seq_len // s.cp, layer_tiles(s), s.cp_method if s.cp > 1 else None)


def tile_count(s: Setup, tiling: str | None) -> int:
    """The plan's tile count of `tiling`: "layers" (its tiled decoder layers), "mlp" (its tiled MLP); None: 0."""
    return layer_tiles(s) if tiling == "layers" else mlp_tiles(s) if tiling == "mlp" else 0


def tile_tokens(s: Setup, tiling: str | None) -> int:
    """Tokens of the plan's largest tile of `tiling` (as `tile_count`)."""
    if tiling == "layers":
        return round(setup_fraction(s) * s.tokens)
    return -(-s.tokens // mlp_tiles(s)) if tiling == "mlp" else 0
