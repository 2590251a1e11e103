"""Planning pipeline parallelism from traces (plan/analytic.py `plan_pipeline`, plan/stage_cut.py): each stage's plan
against a real pipelined step on gloo ranks, the balanced cut against the even one and against every cut, the cut the
trainer's preflight fixes, the search's pp rows."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402

from longfit.config import load_config
from longfit.plan.accuracy import TOLERANCE
from longfit.plan.analytic import plan_config
from longfit.plan.stage_cut import balanced_cut


def every_cut(layers: int, stages: int):
    for starts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *starts, layers)
        yield [b - a for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(20))
def test_balanced_cut_is_the_best_contiguous_cut(seed):
    """Against every cut, on stage peaks of uneven layers (sliding/global, MoE/dense), per-stage extras and in-flight
    micro-batches: a peak that is a stage's largest event, not a sum."""
    rng = random.Random(seed)
    layers, stages = rng.randint(2, 11), rng.randint(1, 4)
    stages = min(stages, layers)
    states = [rng.uniform(1, 5) for _ in range(layers)]
    kept = [rng.uniform(0.5, 3) for _ in range(layers)]
    working = [rng.uniform(1, 8) for _ in range(layers)]
    extras = [rng.uniform(0, 20) for _ in range(stages)]

    def peak(index: int, held: range) -> float:
        in_flight = stages - index
        return (extras[index] + sum(states[i] for i in held) + in_flight * sum(kept[i] for i in held)
                + max(working[i] for i in held))

    def heaviest(sizes):
        bounds = [0, *itertools.accumulate(sizes)]
        return max(peak(k, range(bounds[k], bounds[k + 1])) for k in range(stages))

    cut = balanced_cut(layers, stages, peak)
    assert sum(cut) == layers and len(cut) == stages and min(cut) >= 1
    assert heaviest(cut) == pytest.approx(min(heaviest(sizes) for sizes in every_cut(layers, stages)))


@pytest.fixture(scope="module")
def big_vocabulary(tmp_path_factory) -> str:
    """transformers' default Llama config shrunk to narrow layers under a 32,000-token vocabulary: the last stage's
    lm_head and loss outweigh a layer (layer traces of a second)."""
    from transformers import AutoConfig

    path = tmp_path_factory.mktemp("big-vocabulary")
    AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False).save_pretrained(path)
    return str(path)


def test_stage_layers_follow_the_given_sizes():
    from longfit.parallel.pipeline import stage_layers

    assert stage_layers(5, 2, [4, 1]) == [range(0, 4), range(4, 5)]
    assert stage_layers(5, 2) == [range(0, 2), range(2, 5)]


def test_balanced_cut_refuses_more_stages_than_layers():
    with pytest.raises(ValueError):
        balanced_cut(2, 3, lambda index, held: 0.0)


def test_the_balanced_cut_beats_the_even_cut_where_the_last_stage_holds_a_large_vocabulary(big_vocabulary):
    base = [f"model={big_vocabulary}", "seq_len=2048", "parallel.pp=2", "train.grad_accum=4", "memory.tiled_mlp=false"]
    balanced = plan_config(load_config(None, base), 2)
    even = plan_config(load_config(None, [*base, "parallel.pp_layers=[4,4]"]), 2)
    sizes = [len(stage.stage.layers) for stage in balanced.stages]
    assert sum(sizes) == 8 and sizes != [4, 4] and sizes[-1] < sizes[0]
    assert balanced.peak_bytes < even.peak_bytes
    last = f"{sizes[0]}-7" if sizes[0] < 7 else "7"
    assert balanced.stages_text().startswith(f"stages: layers 0-{sizes[0] - 1} | {last}, peaks ")


def test_stage_plans_hold_their_part_of_the_model(big_vocabulary):
    """Each stage's model states are its layers' and its end's (the embeddings first, the norm and lm_head last), as
    transformers counts them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = load_config(None, [f"model={big_vocabulary}", "seq_len=2048", "parallel.pp=2", "parallel.pp_layers=[4,4]",
                             "train.grad_accum=4", "memory.tiled_mlp=false"])
    plan = plan_config(cfg, 2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(big_vocabulary))
    counts = {name: p.numel() for name, p in model.named_parameters()}

    def held(*prefixes: str) -> int:
        return sum(n for name, n in counts.items() if name.startswith(prefixes))

    first, last = plan.stages
    assert (first.stage.first, first.stage.last, last.stage.first, last.stage.last) == (True, False, False, True)
    layers = [tuple(f"model.layers.{i}." for i in stage.stage.layers) for stage in plan.stages]
    assert first.breakdown["weights"] == 4 * held("model.embed_tokens.", *layers[0])
    assert last.breakdown["weights"] == 4 * held("model.norm.", "lm_head.", *layers[1])
    heaviest = max(plan.stages, key=lambda p: p.peak_bytes)  # the plan is its, host and disk those of the neediest
    assert (plan.stage, plan.breakdown, plan.placement) == (heaviest.stage, heaviest.breakdown, heaviest.placement)
    assert plan.to_dict()["pp_layers"] == [4, 4]


def test_stage_plans_under_tensor_parallelism_hold_their_tp_slice(big_vocabulary):
    """pp x tp: each stage's weights are its part of the model as one tp rank holds it (parallel/tp.py: every
    projection, the embeddings and lm_head split over tp, the norms whole), and its stream between layers 1/tp of
    its tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = [f"model={big_vocabulary}", "seq_len=2048", "parallel.pp=2", "parallel.pp_layers=[4,4]",
            "train.grad_accum=4", "memory.tiled_mlp=false"]
    plan = plan_config(load_config(None, [*base, "parallel.tp=2"]), 4)
    whole = plan_config(load_config(None, base), 2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(big_vocabulary))
    tp_slice = {name: p.numel() if name.endswith("norm.weight") else p.numel() // 2
                for name, p in model.named_parameters()}

    def held(*prefixes: str) -> int:
        return sum(n for name, n in tp_slice.items() if name.startswith(prefixes))

    first, last = plan.stages
    layers = [tuple(f"model.layers.{i}." for i in stage.stage.layers) for stage in plan.stages]
    assert first.breakdown["weights"] == 4 * held("model.embed_tokens.", *layers[0])
    assert last.breakdown["weights"] == 4 * held("model.norm.", "lm_head.", *layers[1])
    for split, stage in zip(plan.stages, whole.stages):
        assert split.breakdown["weights"] < stage.breakdown["weights"] / 1.9
        assert split.breakdown["activations"] < stage.breakdown["activations"]
    assert plan.setup.dims.tp == 2 and plan.setup.sequence_tokens == 1024


def test_one_f_one_b_stages_hold_fewer_micro_batches_down_the_pipeline():
    from longfit.plan.setup import pipeline_stage, resolve

    s = resolve(load_config(None, ["model=llama-tiny", "parallel.pp=4", "train.grad_accum=8"]), 4)
    stages = [pipeline_stage(s, k, range(k, k + 1)) for k in range(4)]
    assert [stage.in_flight for stage in stages] == [4, 3, 2, 1]
    assert [stage.in_flight_later for stage in stages] == [4, 3, 2, 1]  # forwards remain after each first backward
    gpipe = resolve(load_config(None, ["model=llama-tiny", "parallel.pp=4", "train.grad_accum=8",
                                       "parallel.pp_schedule=gpipe"]), 4)
    assert [pipeline_stage(gpipe, k, range(k, k + 1)).in_flight for k in range(4)] == [8] * 4
    assert pipeline_stage(gpipe, 0, range(1)).in_flight_later == 7  # each backward leaves one fewer
    few = resolve(load_config(None, ["model=llama-tiny", "parallel.pp=4", "train.grad_accum=2"]), 4)
    assert [pipeline_stage(few, k, range(k, k + 1)).in_flight for k in range(4)] == [2] * 4  # run as GPipe


@pytest.mark.parametrize(("schedule", "spans"), [("interleaved_1f1b", "0 + 2 | 1 + 3"), ("zbv", "0 + 3 | 1-2")])
def test_a_rank_holding_several_stages_is_planned_with_all_their_layers(schedule, spans):
    """Interleaved and V schedules: each pp rank planned once, holding every layer of its stages (rank_stages), every
    micro-batch of the step in flight on it (the most these schedules keep), receiving and sending per stage; the
    preflight leaves the cut even (the planner balances one stage per rank only)."""
    from longfit.plan import preflight
    from longfit.plan.setup import resolve

    overrides = ["model=llama-tiny", "seq_len=2048", "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                 "parallel.reshard_after_forward=false", "train.grad_accum=4"]
    cfg = load_config(None, overrides)
    result = preflight(cfg, 2)
    assert cfg.parallel.pp_layers == []
    assert result.stages_text().startswith(f"stages: layers {spans}, peaks ")
    assert [p.stage.in_flight for p in result.stages] == [4, 4]
    assert [p.stage.held for p in result.stages] == [2, 2]
    one_f_one_b = plan_config(load_config(None, [*overrides[:3], "train.grad_accum=4"]), 2)
    assert result.peak_bytes > one_f_one_b.peak_bytes  # all four micro-batches against 1F1B's two on the first stage


def test_the_trainers_preflight_fixes_the_balanced_cut(big_vocabulary):
    """An empty parallel.pp_layers becomes the balanced cut of the run's plan (rank 0's config is every rank's); one
    given is kept."""
    from longfit.plan import preflight

    base = [f"model={big_vocabulary}", "seq_len=2048", "parallel.pp=2", "train.grad_accum=4", "memory.tiled_mlp=false"]
    cfg = load_config(None, base)
    result = preflight(cfg, 2)
    assert cfg.parallel.pp_layers == [len(p.stage.layers) for p in result.stages] != [4, 4]
    assert result.peak_bytes == max(p.peak_bytes for p in result.stages)
    kept = load_config(None, [*base, "parallel.pp_layers=[4,4]"])
    preflight(kept, 2)
    assert kept.parallel.pp_layers == [4, 4]


def stage_peak_worker(rank: int, world_size: int, overrides: list[str]) -> tuple[int, str]:
    from longfit.plan.trace import trace_pipeline_step

    traced = trace_pipeline_step(load_config(None, overrides))
    return traced.peak_bytes, traced.peak_phase


def assert_each_stage_is_planned_within_tolerance(given: list[str], world: int) -> None:
    """`longfit plan`'s per-stage peaks of the run `given` on `world` ranks against each stage's in a real step of the
    same run and stage cut on as many gloo ranks (`stage_peak_worker`), within TOLERANCE."""
    plan = plan_config(load_config(None, given), world)
    cut = [len(p.stage.layers) for p in plan.stages]
    measured = run_distributed(stage_peak_worker, world, [*given, f"parallel.pp_layers={cut}".replace(" ", "")])
    # pp is the outermost mesh axis: ranks [s tp, (s + 1) tp) hold stage s; its first tp rank's step
    rows = [(stage, traced, stage.tensor_bytes / traced - 1, phase)
            for stage, (traced, phase) in zip(plan.stages, measured[::world // len(plan.stages)], strict=True)]
    report = "; ".join(
        f"stage {stage.stage.index} (layers {stage.stage.layers.start}-{stage.stage.layers.stop - 1}): planned "
        f"{stage.tensor_bytes / 2**20:.2f} MiB at {stage.peak_event}, traced {traced / 2**20:.2f} MiB in {phase} "
        f"({error:+.1%})" for stage, traced, error, phase in rows)
    print(report)
    assert all(abs(error) <= TOLERANCE for _, _, error, _ in rows), report


PIPELINE_ACCURACY_CASES = [
    ("llama-tiny", ("seq_len=2048", "train.grad_accum=4", "train.dtype=fp32", "memory.tiled_mlp=false")),
    ("llama-tiny", ("seq_len=4096", "train.grad_accum=4", "train.dtype=bf16", "memory.tiled_mlp=false")),
    ("llama-tiny", ("seq_len=4096", "train.grad_accum=3", "train.dtype=fp32", "parallel.pp_schedule=gpipe")),
    # llama-60m: a 32,000-token vocabulary on the last stage, an uneven balanced cut
    ("llama-60m", ("seq_len=2048", "train.grad_accum=4", "train.dtype=fp32", "memory.tiled_mlp=false")),
    # tensor parallelism on each stage: 4 ranks, each stage's tp slice and 1/tp of its tokens between layers
    ("llama-tiny", ("seq_len=4096", "train.grad_accum=4", "train.dtype=bf16", "memory.tiled_mlp=false",
                    "parallel.tp=2")),
]


@pytest.mark.slow  # real pipelined steps on 2 gloo ranks, 40-120 s each on 2 CPU cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,overrides", PIPELINE_ACCURACY_CASES, ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_each_stage_is_planned_within_tolerance_of_a_pipelined_step(model, overrides):
    """`longfit plan`'s per-stage peaks (live tensor bytes) against each rank's in a real step of the same run: the
    trainer's stage, FSDP2, torch.distributed.pipelining's schedule, the optimizer step (plan/trace.py)."""
    given = [f"model={model}", "parallel.pp=2", *overrides]
    assert_each_stage_is_planned_within_tolerance(given, 2 * load_config(None, given).parallel.tp)


@pytest.fixture
def moe_and_dense(tmp_path) -> list[str]:
    """A checkpoint written by transformers from its default Qwen3-MoE config shrunk: its first two layers dense
    (mlp_only_layers) and light, its last two mixtures of 32 experts; a pp=2 run of it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_moe", hidden_size=128, intermediate_size=128, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4,
        mlp_only_layers=[0, 1], vocab_size=384, tie_word_embeddings=False,
    )).save_pretrained(tmp_path)
    return [f"model={tmp_path}", "parallel.pp=2", "seq_len=2048", "train.grad_accum=4", "train.dtype=fp32",
            "memory.tiled_mlp=false"]


@pytest.mark.slow  # layer traces of a mixture of experts (about 20 s)
def test_the_balanced_cut_gives_light_dense_layers_to_one_stage_and_heavy_experts_to_the_other(moe_and_dense):
    plan = plan_config(load_config(None, moe_and_dense), 2)
    even = plan_config(load_config(None, [*moe_and_dense, "parallel.pp_layers=[2,2]"]), 2)
    assert [len(p.stage.layers) for p in plan.stages] == [3, 1]
    assert plan.tensor_bytes < 0.85 * even.tensor_bytes


@pytest.mark.slow  # layer traces of a mixture of experts, then a real pipelined step on 2 gloo ranks
@pytest.mark.timeout(900)
@pytest.mark.xfail(strict=True, reason="a counted model's FSDP2 terms (gathered layer, reduce-scatter input, unsharded "
                   "gradients) take the largest layer's parameters for every layer: a stage of two dense layers and an "
                   "MoE layer is planned +12.7% over its measured peak")
def test_a_moe_and_dense_mix_is_planned_within_tolerance(moe_and_dense):
    plan = plan_config(load_config(None, moe_and_dense), 2)
    cut = [len(p.stage.layers) for p in plan.stages]
    measured = run_distributed(stage_peak_worker, 2, [*moe_and_dense, f"parallel.pp_layers={cut}".replace(" ", "")])
    errors = [stage.tensor_bytes / traced - 1 for stage, (traced, _) in zip(plan.stages, measured, strict=True)]
    print(f"cut {cut}: planned {[round(p.tensor_bytes / 2**20, 1) for p in plan.stages]} MiB, traced "
          f"{[round(t / 2**20, 1) for t, _ in measured]} MiB ({', '.join(f'{e:+.1%}' for e in errors)})")
    assert all(abs(error) <= TOLERANCE for error in errors), errors
