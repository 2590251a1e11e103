"""Tiled layers and the tiled MLP in the planner: one trace of a few short tiles (plan/layer_trace.py: the plane
a + b L + c t of the tiles' events and the floor of the others) predicts the layer at lengths and tile counts it was
not traced at, and costs that are not such a plane are traced at the plan's own tile count instead."""

import dataclasses
import math

import pytest

from longfit.config import load_config
from longfit.plan import layer_trace
from longfit.plan.setup import resolve
from longfit.plan.shapes import model_shape
from longfit.plan.tiled import tile_fraction

# (overrides, GPUs, tokens per rank, tile count): the plane's samples are 1,072-3,216 tokens, 2-4 tiles. The default
# suite holds one tiled-MLP layout (11 s on 2 CPU cores); the others (12-44 s) are slow, run by `.ci/run`. The tiled-MLP
# layouts recompute attention: a layer that keeps it (memory.keep_attention, #53) holds it from its attention's forward
# on, which tops the tiles' events at every traced tile (the plane's floor), and its plan traces its own tile count.
HELD_OUT = [
    pytest.param(("model=llama-tiny", "memory.tiled_layers=true", "lora.enabled=true"), 1, 5360, 10, marks=pytest.mark.slow),
    pytest.param(("model=llama-tiny", "memory.tiled_layers=true", "train.dtype=fp32"), 1, 4020, 6, marks=pytest.mark.slow),
    pytest.param(("model=llama-tiny", "memory.tiled_layers=true", "parallel.cp=2"), 2, 4288, 8, marks=pytest.mark.slow),
    (("model=llama-tiny", "memory.tiled_mlp=true", "memory.keep_attention=false", "parallel.cp=2",
      "parallel.cp_method=ulysses"), 2, 4020, 5),
    pytest.param(("model=llama-tiny", "memory.tiled_mlp=true", "memory.keep_attention=false", "parallel.tp=2"), 2, 4020,
                 12, marks=pytest.mark.slow),
]


def _setup(overrides, gpus: int, tokens: int):
    cp = next((int(o.split("=")[1]) for o in overrides if o.startswith("parallel.cp=")), 1)
    return resolve(load_config(None, [*overrides, f"seq_len={tokens * cp}"]), gpus)


@pytest.mark.parametrize("overrides,gpus,tokens,tiles", HELD_OUT)
def test_the_tile_plane_predicts_held_out_lengths_and_tile_counts(overrides, gpus, tokens, tiles):
    s = _setup(overrides, gpus, tokens)
    key = layer_trace._key(s, s.checkpointed > 0)
    planned = layer_trace._part(s, key)
    assert planned.planar and len(key.samples) == len(layer_trace.TILE_SAMPLES)
    measured = layer_trace._trace(dataclasses.replace(key, samples=((tokens, tiles),)), s.config)
    for i, costs in planned.costs.items():
        method = s.cp_method if costs.tiling == "layers" and s.cp > 1 else None  # ring layer tiles stay in its chunks
        tile = math.ceil(tile_fraction(tokens, tiles, method) * tokens)
        predicted, actual = costs.at(tokens, tile), measured.costs[i].at(tokens)
        for quantity in layer_trace.QUANTITIES:
            assert predicted[quantity] == pytest.approx(actual[quantity], rel=0.01, abs=1.0), (i, quantity)


def _synthetic(tokens: int, tiles: int, moved: float = 0.0) -> tuple[int, int, dict]:
    """A layer whose tiles hold 100 + 3 L + 9 t bytes and whose sequence-long events hold 4.5 L (the floor)."""
    value = max(100.0 + 3.0 * tokens + 9.0 * (tokens // tiles), 4.5 * tokens) + moved
    return tokens, tiles, {"input_kept": 1.0, "saved": 0.0, "forward_peak": value, "backward_peak": 2 * value,
                           "reloaded_backward_peak": 2 * value, "passed": 0.0}


def test_the_plane_and_its_floor_are_fitted_through_the_samples():
    """The first five samples give 100 + 3 L + 9 t, the last three the floor 4.5 L; a plan is the larger of the two."""
    samples = layer_trace.samples_for(10**6, model_shape("llama-tiny"), 5, 1)
    costs = layer_trace._fit_plane([_synthetic(*sample) for sample in samples], "layer 0's")
    assert costs.per_token["forward_peak"] == pytest.approx(3.0)
    assert costs.per_tile_token["backward_peak"] == pytest.approx(18.0)
    assert costs.floor_per_token["forward_peak"] == pytest.approx(4.5)
    for tokens, tile in ((4096, 2048), (65536, 1024), (10**6, 8192)):  # the tiles' events, then the floor
        expected = max(100 + 3 * tokens + 9 * tile, 4.5 * tokens) / tokens
        assert costs.at(tokens, tile)["forward_peak"] == pytest.approx(expected)


def test_samples_off_the_plane_or_its_floor_give_no_plane():
    samples = layer_trace.samples_for(10**6, model_shape("llama-tiny"), 5, 1)
    points = [_synthetic(*sample) for sample in samples]
    assert layer_trace._fit_plane([*points[:4], _synthetic(*samples[4], moved=5000.0), *points[5:]], "") is None
    assert layer_trace._fit_plane([*points[:6], _synthetic(*samples[6], moved=5000.0), points[7]], "") is None
    assert layer_trace._fit_plane([points[0], _synthetic(*samples[1], moved=5000.0), *points[2:]], "") is None
    # tiles a quarter of the chunk already at the floor: the slope in t is not the tiles'
    floor_high = [(t, n, {q: (max(v, 5.3 * t) if q != "input_kept" else v) for q, v in sample.items()}) for t, n, sample in points]
    assert layer_trace._fit_plane(floor_high, "") is None


def test_costs_off_the_plane_are_traced_at_the_plans_tile_count(monkeypatch):
    """A trace whose samples are off the plane (`_fit_plane` None, tested above) gives no costs; the plan then traces
    its own tile count at three lengths."""
    s = _setup(("model=llama-tiny", "memory.tiled_layers=true", "memory.layer_tiles=4"), 1, 16384)
    monkeypatch.setattr(layer_trace, "_CACHE", {})
    monkeypatch.setattr(layer_trace, "_load", lambda key: None)
    monkeypatch.setattr(layer_trace, "_store", lambda key, traced: traced)
    traced = []
    trace = layer_trace._trace

    def off_the_plane(key, cfg=None):
        traced.append(key.samples)
        return layer_trace.Traced([], {}, planar=False) if len(traced) == 1 else trace(key, cfg)

    monkeypatch.setattr(layer_trace, "_trace", off_the_plane)
    costs = layer_trace.layer_costs(s)
    base = layer_trace.BASE_LENGTH
    assert traced == [layer_trace._key(s, True).samples, ((base, 4), (2 * base, 4), (3 * base, 4))]
    assert costs.planar and all(c.per_tile_token is None for c in costs.costs.values())
