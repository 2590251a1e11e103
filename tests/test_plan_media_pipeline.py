"""`longfit plan` of image rows under pipeline parallelism (#54, plan/analytic.py, plan/media.py): the vision side on
the first stage alone -- its weights, gradients and optimizer state, its forward and backward, its kept tensors once
per micro-batch in flight as the stage's layers' are, an evaluation's tower --, every micro-batch's pixels on every
stage, and the balanced stage cut weighing the tower on the first stage. Held to real pipelined steps of a tiny
Mistral 3 wrapper (its decoder is one pipeline stages take) on 2 gloo ranks (`trace_pipeline_step`, slow)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_media_mistral3 import untied_mistral3  # noqa: E402,F401 -- the session fixture

from longfit.config import load_config  # noqa: E402

GRAD_ACCUM, SEQ_LEN = 3, 512


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """Rows all alike: chats of the wrapper's largest image twice (40 image tokens with their breaks) and a question,
    256 tokens each, two whole chats a row of SEQ_LEN, eight images a micro-batch of two rows. (With dozens of images
    a micro-batch Pixtral's tower, one sequence of them all, is planned well over its traced backward, on one process
    too: 49% at 48 images.)"""
    from test_media import write_rows

    parts = [*[{"type": "image", "path": "im1.png"}] * 2, {"type": "text", "text": "w" * 206}]
    chat = [{"role": "user", "content": parts}, {"role": "assistant", "content": "noise"}]
    return write_rows(tmp_path_factory.mktemp("mistral3-rows"), [chat] * 4 * GRAD_ACCUM)


def overrides(checkpoint: Path, rows: Path | None, vision: str, dtype: str, *more: str) -> list[str]:
    data = [f"data.path={rows}"] if rows else []
    return [f"model={checkpoint}", *data, f"seq_len={SEQ_LEN}", "train.micro_batch=2", "parallel.pp=2",
            f"train.grad_accum={GRAD_ACCUM}", f"train.vision={vision}", f"train.dtype={dtype}", "eval.retrieval=false",
            *more]


def batch_media_bytes(cfg) -> int:
    """Bytes of the image tensors of the data's first micro-batch as the trainer's loader makes it (pixels, token
    types, embedding rows; the rows are alike, so every micro-batch's)."""
    from longfit.data.packing import build_dataloader
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import media_reader

    media = next(build_dataloader(cfg, load_tokenizer(cfg.model), epochs=1, media=media_reader(cfg.model))).media
    return sum(t.numel() * t.element_size() for t in (media.pixel_values, media.token_types, media.embedding_index))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_tower_is_planned_on_the_first_stage_alone(untied_mistral3, rows, dtype: str) -> None:
    """Against the same run on text rows, stages cut alike: the first stage holds the tower's weights (and what
    train.vision trains of them: gradients, optimizer state) and runs its forward and, trained, its backward; the
    second holds no vision weights and runs no tower, and every point of its step up to the optimizer's holds the
    step's micro-batches' image tensors beside the text run's, GRAD_ACCUM micro-batches of them."""
    from longfit.plan.analytic import model_states, plan_config
    from longfit.plan.media import tower_costs

    cut = "parallel.pp_layers=[2,2]"
    text = plan_config(load_config(None, overrides(untied_mistral3, None, "frozen", dtype, cut)), 2)
    media = batch_media_bytes(load_config(None, overrides(untied_mistral3, rows, "all", dtype)))
    for vision in ("all", "frozen"):
        plan = plan_config(load_config(None, overrides(untied_mistral3, rows, vision, dtype, cut)), 2)
        towers = tower_costs(plan.setup)
        assert towers.params > 0 and towers.trained == (towers.params if vision == "all" else 0)
        (first, text_first), (last, text_last) = (
            [model_states(p.setup, p.stage) for p in pair] for pair in zip(plan.stages, text.stages, strict=True))
        trained = towers.trained / plan.setup.shards
        assert first == (text_first[0] + 4 * towers.params / plan.setup.shards, text_first[1] + 4 * trained,
                         text_first[2] + 8 * trained)  # adamw
        assert last == text_last
        events = [{event: total for event, total in p.events} for p in plan.stages]
        text_events = [{event: total for event, total in p.events} for p in text.stages]
        tower_points = {"vision tower forward", "image embeddings into the sequence"}
        assert tower_points <= events[0].keys() and not tower_points & events[1].keys()
        assert ("vision tower backward" in events[0]) == (vision == "all")
        assert "vision tower backward" not in events[1]
        assert events[1].keys() == text_events[1].keys()
        for event, total in events[1].items():  # truncated to whole bytes each
            if event == "optimizer step":  # the plan counts no batch there, of text rows or images
                continue
            assert total - text_events[1][event] == pytest.approx(GRAD_ACCUM * media, abs=1), event


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_trained_towers_kept_tensors_are_held_per_micro_batch_in_flight(untied_mistral3, rows, dtype: str) -> None:
    """On the first stage a micro-batch more in flight adds its layers' kept tensors and, the tower trained, the
    tower's kept tensors (`TowerCosts.kept` beyond its output): the image run's step grows by those over the text
    run's at every point of the first layer's forward; a frozen tower keeps nothing to add."""
    from longfit.plan.analytic import _simulate, _tower_kept, plan_config
    from longfit.plan.media import tower_costs

    cut = "parallel.pp_layers=[2,2]"
    text = plan_config(load_config(None, overrides(untied_mistral3, None, "frozen", dtype, cut)), 2)
    stage = text.stages[0].stage
    assert stage.first and stage.in_flight == 2

    def forward_layer_0(setup, in_flight: int) -> int:
        simulated = _simulate(setup, None, None, 0, dataclasses.replace(stage, in_flight=in_flight))
        return dict(simulated.events)["forward, layer 0"]

    added = {}
    for vision in ("all", "frozen"):
        setup = plan_config(load_config(None, overrides(untied_mistral3, rows, vision, dtype, cut)), 2).setup
        grown = [forward_layer_0(setup, k) - forward_layer_0(text.setup, k) for k in (1, 2)]
        added[vision] = (grown[1] - grown[0], _tower_kept(setup, tower_costs(setup)))
    (trained, kept), (frozen, _) = added["all"], added["frozen"]
    assert trained == pytest.approx(kept, abs=2) and kept > 0
    assert frozen == pytest.approx(0, abs=2)


def test_the_towers_store_holds_a_slot_of_each_micro_batch_in_flight(untied_mistral3) -> None:
    """The tower's offloaded block inputs (`longfit.memory.apply.checkpoint_tower`) are stored for each micro-batch
    the first stage holds in flight, as its layers' are: host memory of the store as `CheckpointPlacement` counts the
    slots of `in_flight` micro-batches."""
    from longfit.memory.switches import CheckpointPlacement
    from longfit.plan.media import _tower_store
    from longfit.plan.setup import resolve

    s = resolve(load_config(None, [f"model={untied_mistral3}", f"seq_len={SEQ_LEN}"]), 1)
    traced = {(1, 1): {"block_input": 3 << 20}, "depth": 4}  # a block's input of an image: 3 MiB, offloaded
    one, two = (_tower_store(s, traced, 1.0, in_flight) for in_flight in (1, 2))
    assert one["slot"] == two["slot"] == 3 << 20
    assert two["host"] == 2 * one["host"] == CheckpointPlacement(0, 4, 0, 3 << 20, 2).host_bytes


def test_an_evaluations_tower_runs_on_the_first_stage_alone(untied_mistral3, rows) -> None:
    """Text training rows, eval rows with images: the vision side is the first stage's (its weights, its
    evaluation's forward); the second stage's plan is the text run's."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.media import eval_tower_costs

    cut = "parallel.pp_layers=[2,2]"
    text = plan_config(load_config(None, overrides(untied_mistral3, None, "frozen", "fp32", cut)), 2)
    plan = plan_config(load_config(None, overrides(untied_mistral3, None, "frozen", "fp32", cut,
                                                   f"data.eval_path={rows}")), 2)
    towers = eval_tower_costs(plan.setup)
    assert towers is not None and towers.trained == 0
    first, last = plan.stages
    assert first.breakdown["weights"] == text.stages[0].breakdown["weights"] + 4 * towers.params
    assert "eval: vision tower forward" in dict(first.events) and "eval: vision tower forward" not in dict(last.events)
    assert (last.tensor_bytes, last.events) == (text.stages[1].tensor_bytes, text.stages[1].events)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_balanced_cut_weighs_the_tower_on_the_first_stage(untied_mistral3, rows, dtype: str) -> None:
    """The stage cut the trainer's preflight fixes (plan/stage_cut.py) plans each candidate stage with its share of
    the vision side. Under GPipe, every stage holding every micro-batch, the text rows' cut is even; a trained tower
    (its gradients, optimizer state and kept tensors of each micro-batch) moves a decoder layer off the first stage,
    and the plan's heaviest stage is lighter than at the text rows' cut."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.preflight import preflight

    gpipe = "parallel.pp_schedule=gpipe"
    text = load_config(None, overrides(untied_mistral3, None, "all", dtype, gpipe))
    images = load_config(None, overrides(untied_mistral3, rows, "all", dtype, gpipe))
    preflight(text, 2)
    planned = preflight(images, 2)
    assert text.parallel.pp_layers == [2, 2] and images.parallel.pp_layers == [1, 3]
    at_text_cut = plan_config(load_config(None, overrides(untied_mistral3, rows, "all", dtype, gpipe,
                                                          "parallel.pp_layers=[2,2]")), 2)
    assert planned.peak_bytes < at_text_cut.peak_bytes

ACCURACY_CASES = [(vision, dtype, ()) for dtype in ("fp32", "bf16") for vision in ("all", "frozen")] + [
    ("all", dtype, more) for more in (("parallel.pp_schedule=gpipe",), ("lora.enabled=true",))
    for dtype in ("fp32", "bf16")]
"""(train.vision, train.dtype, more settings) of a pp=2 run of the image rows, GRAD_ACCUM micro-batches a step: under
1F1B the first stage holds two of them in flight, under GPipe all three; with LoRA the tower trains as adapters."""


@pytest.mark.slow  # real pipelined steps with images on 2 gloo ranks
@pytest.mark.timeout(900)
@pytest.mark.parametrize("vision, dtype, more", ACCURACY_CASES,
                         ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_each_stage_of_an_image_run_is_planned_within_tolerance_of_a_pipelined_step(untied_mistral3, rows, vision: str,
                                                                                   dtype: str, more: tuple) -> None:
    """`longfit plan`'s per-stage peaks of image rows against each rank's in a real step of the same run
    (`trace_pipeline_step`: the trainer's loader, the vision side on the first stage, FSDP2, torch's schedule, the
    optimizer step)."""
    from test_plan_pipeline import assert_each_stage_is_planned_within_tolerance

    assert_each_stage_is_planned_within_tolerance(overrides(untied_mistral3, rows, vision, dtype, *more), 2)
