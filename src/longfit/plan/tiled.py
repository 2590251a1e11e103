"""What a tiled decoder layer costs the planner: the tile fraction and the terms of its calibrated forms.

A tiled layer (longfit.memory.tiled_layers) holds sequence-long tensors -- its output in forward; K/V
and their fp32 gradient in backward, and its input gradient, which on one rank takes the storage of its
input and under context parallelism is a tensor of its own, as are the exchange buffers of ring.py /
ulysses.py's layout -- plus the working set of ONE tile, which is the untiled
layer's per-token working set times the tile's tokens. So each peak is a linear form over the widths
(the sequence-long part) plus a linear form over the widths times `fraction` = tokens of the largest
tile / tokens of the row: `tiled_terms` gives both sets of term values, `plan/calibrate.py --tiled`
fits the coefficients on traces of the real layer (TILED_LAYER_COSTS in tiled_costs.py), and
tests/test_plan_tiled.py checks them against the trace at other widths and lengths.

`tile_fraction` mirrors how longfit.parallel.tiled_attention cuts a row (a test checks that they agree);
it is written out here because the planner does not import torch.
"""

from __future__ import annotations

import math

from longfit.memory.switches import layer_tile_count
from longfit.plan.setup import Setup

SEQUENCE_TERMS = ("h", "q", "kv", "kv_rep", "nh", "lora", "one")
TILE_TERMS = ("h_tile", "f_tile", "q_tile", "kv_tile", "kv_rep_tile", "nh_tile", "lora_tile", "one_tile")


def tile_fraction(row_tokens: int, tiles: int, cp_method: str | None) -> float:
    """Tokens of the largest tile / tokens of the local row: ring tiles stay inside its two zigzag chunks."""
    if cp_method == "ring":
        chunk = row_tokens // 2
        per_chunk = max(1, min(math.ceil(tiles / 2), chunk))
        return math.ceil(chunk / per_chunk) / row_tokens
    return math.ceil(row_tokens / min(tiles, row_tokens)) / row_tokens


def tiled_terms(widths: dict[str, float], fraction: float) -> dict[str, float]:
    """Term values of the tiled forms from the untiled ones (h, f, q, kv, kv_rep, nh, lora, one) and the tile fraction."""
    values = {name: widths[name] for name in SEQUENCE_TERMS}
    values.update({f"{name}_tile": widths[name] * fraction for name in ("h", "f", "q", "kv", "kv_rep", "nh", "lora", "one")})
    return values


def layer_tiles(s: Setup) -> int:
    """memory.layer_tiles, or the tile count a tiled layer derives for this rank's tokens."""
    return s.layer_tiles or layer_tile_count(s.tokens, s.shape.hidden, s.shape.intermediate)


def setup_fraction(s: Setup) -> float:
    """The tile fraction of this rank's tiled layers (rows of seq_len / cp tokens)."""
    return tile_fraction(s.seq_len // s.cp, layer_tiles(s), s.cp_method if s.cp > 1 else None)
