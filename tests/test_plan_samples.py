"""The lengths the planner traces a model's layers at (plan/layer_trace.py: `base_length`, `samples_for`), where a
layer's costs are not linear at the usual ones: sparse indexed attention below its index_topk (#57), and the
linear-attention layers' chunked scan, which pads a sequence, a ring's half and a tile to whole chunks (#52); and the
trace of such a layer at any length holding what it holds traced alone (`linear_attention.forget_layouts`)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from longfit.config import load_config
from longfit.plan import layer_trace
from longfit.plan.setup import resolve
from longfit.plan.shapes import model_shape
from longfit.plan.tiled import tile_fraction

CHECKPOINT_CONFIGS = Path(__file__).parent / "data" / "checkpoint_configs"
QWEN3_5_SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16)
"""transformers' default Qwen3.5 text config shrunk (tests/test_families_hybrid.py's widths): three linear-attention
layers and a full-attention one."""


@pytest.fixture
def qwen3_5(tmp_path) -> Path:
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3_5_text", **QWEN3_5_SMALL).save_pretrained(tmp_path)
    return tmp_path


def _is_power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def test_indexed_attention_is_traced_from_its_index_topk_up(tmp_path):
    """index_topk read through transformers' config (DeepSeek-V3.2's published 2,048): every traced length selects
    index_topk keys for its later queries, so the costs are linear in it; the lengths stay multiples of BASE_LENGTH
    (off power-of-two widths), and a plan of fewer tokens than the base is traced at its own length."""
    from transformers import AutoConfig

    values = json.loads((CHECKPOINT_CONFIGS / "deepseek-ai--DeepSeek-V3.2" / "config.json").read_text())
    assert values["index_topk"] == 2048
    small = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                 first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                 num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=64, q_lora_rank=96, vocab_size=512)
    AutoConfig.for_model(values.pop("model_type"), **{**values, **small}).save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    assert shape.index_topk == 2048
    for tiles, chunks in ((0, 1), (5, 1), (5, 2)):
        samples = layer_trace.samples_for(131072, shape, tiles, chunks)
        assert all(tokens >= 2048 and tokens % layer_trace.BASE_LENGTH == 0 for tokens, _ in samples), samples
    assert layer_trace.samples_for(2100, shape, 0, 1) == ((2100, 0),)
    assert model_shape("llama-tiny").index_topk is None


@pytest.mark.parametrize("tiles", [0, 2, 5, 8, 29, 32, 57])
@pytest.mark.parametrize("chunks", [1, 2])
def test_linear_attention_is_traced_in_whole_chunks(qwen3_5, tiles: int, chunks: int):
    """Every traced length of a model with linear-attention layers (`ModelShape.scan_chunk`, 64 tokens), each ring
    half and each tile (as longfit cuts them: `tile_fraction`) is whole chunks, at the plane's samples and at a plan's
    own tile count, none a power of two; without such layers the lengths are BASE_LENGTH's multiples as before."""
    shape = model_shape(str(qwen3_5))
    assert shape.scan_chunk == 64 and model_shape("llama-tiny").scan_chunk is None
    samples = [*layer_trace.samples_for(10**6, shape, tiles, chunks),
               *layer_trace.three_lengths(layer_trace.base_length(shape, tiles, chunks), tiles)]
    for tokens, count in samples:
        tile = tile_fraction(tokens, count, "ring" if chunks == 2 else None) * tokens if count else tokens / chunks
        assert tile == pytest.approx(round(tile)) and round(tile) % 64 == 0 and tokens % (64 * chunks) == 0, \
            (tokens, count)
        assert tokens >= layer_trace.BASE_LENGTH and not _is_power_of_two(tokens), tokens
    assert layer_trace.samples_for(10**6, model_shape("llama-tiny"), 0, 1) == \
        layer_trace.three_lengths(layer_trace.BASE_LENGTH, 0)


@pytest.mark.slow  # its three lengths' trace alone took 225 s on the shared 2-core machine (load 11)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("regime", ["train.dtype=fp32", "train.dtype=bf16"])
def test_a_linear_attention_layer_traced_at_three_lengths_holds_what_it_holds_traced_alone(qwen3_5, regime: str):
    """The tiled linear-attention layer at a plan's own tile count, traced at its three lengths in one trace (two
    processes, one after another in each), holds at the longest what a trace of that length alone holds: the layouts
    kept from a shorter length (the models' caches) are not found or evicted in the middle of a traced layer."""
    s = resolve(load_config(None, [f"model={qwen3_5}", "seq_len=16384", "memory.tiled_layers=true",
                                   "memory.layer_tiles=29", regime]), 1)
    key = layer_trace._key(s, True)
    samples = layer_trace.three_lengths(layer_trace.base_length(s.shape, 29, 1), 29)
    together = layer_trace._trace(dataclasses.replace(key, samples=samples), s.config)
    longest = samples[-1][0]
    alone = layer_trace._trace(dataclasses.replace(key, samples=samples[-1:]), s.config)
    for i, costs in together.costs.items():
        for quantity in layer_trace.QUANTITIES:
            assert costs.at(longest)[quantity] == pytest.approx(alone.costs[i].at(longest)[quantity], rel=1e-6), \
                (i, quantity)


UNDER_IN_PART_CHUNKS = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "#52: the plan answers (it refused before), but 7.6% under its traced step in fp32: analytic 54,395,892 bytes, "
    "its peak at the loss forward (band -1%..+3%)"))


@pytest.mark.slow  # fp32: about 20 min on the shared 2-core machine (load 10-16); bf16 not finished within 22 min
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("regime", [pytest.param("train.dtype=fp32", marks=UNDER_IN_PART_CHUNKS), "train.dtype=bf16"])
def test_a_shrunken_qwen3_5_in_tiles_of_part_chunks_plans_within_the_safe_band(qwen3_5, regime: str):
    """Qwen3.5 shrunk, its layers tiled in 29 tiles of 565 tokens (8 whole chunks and part of a ninth) at 16,384
    tokens: the analytic plan within plan/accuracy.py's band of the traced step (refused before: its tiles traced in
    37, 74 and 111 tokens, padded to 64, 128 and 128)."""
    from longfit.plan.accuracy import SAFE_BAND, compare

    row = compare(str(qwen3_5), 1, ("seq_len=16384", "memory.tiled_layers=true", "memory.layer_tiles=29", regime))
    assert SAFE_BAND[0] <= row["error"] <= SAFE_BAND[1], row
    assert math.ceil(16384 / 29) % 64 != 0  # the plan's tiles are not whole chunks
