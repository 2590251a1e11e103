"""Expert parallelism on pipeline stages (parallel.pp x parallel.ep): each stage's experts split over the ep ranks
of that stage's dp_shard x cp ranks (its all-to-alls among them), FSDP2 sharding them over the stage's ranks holding
the same experts; against one process, loss and every gradient, the router loss's counts gathered over the stages."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402
from test_parallel_pipeline import L, micro_batch_rows, one_process_step, tiny_qwen3_moe_config  # noqa: E402

from longfit.config import ConfigError, load_config
from longfit.memory.loss import CausalLMLoss
from longfit.models.loading import compute_dtype
from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
from longfit.parallel.comm import all_reduce_sum
from longfit.parallel.dims import ParallelDims, splits_backward
from longfit.parallel.expert import expert_count
from longfit.parallel.parallelize import parallelize
from longfit.parallel.pipeline import Pipeline

LAYERS = 3  # stage 0: layer 0 and the embeddings; stage 1: layers 1-2, the norm, lm_head and the loss
# "aux": transformers' default Qwen3-MoE shrunk (tests/test_parallel_pipeline.py), top-2 of 4 experts, the router
# loss weighted 0.5. "every-expert": top-4 of 4 and no router loss, the bf16 case: under bf16 a top-k router flips
# near-tied routes in any implementation, so tests/test_bf16.py's bound holds with every expert chosen (as the
# ep=2 bf16 case of tests/test_families_moe.py).
VARIANTS = {"aux": {}, "every-expert": dict(num_experts_per_tok=4, output_router_logits=False)}


def moe_model(variant: str, layers: int = LAYERS):
    from transformers import AutoModelForCausalLM

    config = tiny_qwen3_moe_config(layers)
    config.update(VARIANTS[variant])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=config._attn_implementation)
    model.config.use_cache = False
    return model


def reference_step(batches, variant: str, layers: int = LAYERS, bf16_parameters: bool = False, held_out=()):
    """One process: the step's mean loss (router loss included) and every gradient, and with `held_out` batches the
    eval's summed loss of them before the step. `bf16_parameters`: FSDP2's bf16 regime on one process (parameters in
    bf16, buffers fp32, no autocast)."""
    model = moe_model(variant, layers)
    if bf16_parameters:
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    loss, grads, held_out_sum = one_process_step(model, batches, held_out)
    grads = {n: grad.float() for n, grad in grads.items()}
    return (loss.float(), grads, held_out_sum) if held_out else (loss.float(), grads)


def config(schedule: str, dtype: str, micro_batches: int, cp: int = 1):
    zero_bubble = splits_backward(schedule)  # needs the layers gathered from forward to backward
    return load_config(None, [*(["parallel.reshard_after_forward=false"] if zero_bubble else []),
        f"seq_len={L}", "parallel.pp=2", "parallel.dp_shard=2", f"parallel.cp={cp}", "parallel.ep=2",
        f"parallel.pp_schedule={schedule}",
        f"train.grad_accum={micro_batches}", f"train.dtype={dtype}", "memory.tiled_mlp=false",
        "memory.activation_checkpointing=true", "memory.chunked_loss=true", "memory.loss_chunk=24",
    ])


def pipeline_step(mesh, cfg, batches, variant: str, layers: int):
    """This rank's stage with its experts split over the stage's ep ranks: the step's mean loss, every gradient of
    the stage (whole tensors), and (local experts, the experts module's count) of a layer the stage holds."""
    model = moe_model(variant, layers)
    text = model.config
    dims = ParallelDims.from_config(cfg, mesh.dims.world_size, text.num_attention_heads,
                                    num_key_value_heads=text.num_key_value_heads,
                                    num_experts=expert_count(model), text_config=text)
    dtype = compute_dtype(cfg.train.dtype, torch.device("cpu"))
    stage = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh, param_dtype=dtype)
    pipeline = Pipeline(stage, cfg, mesh, torch.device("cpu"), dtype)
    batches = [shard_batch(b, mesh.cp_rank, dims.cp, cp_layout(cfg.parallel.cp_method)) for b in batches]
    held_out = all_reduce_sum(pipeline.batch_loss(batches[0]).clone(), mesh.world_group)  # the eval's forward
    valid = global_valid_tokens([b.labels for b in batches], mesh.world_group)
    loss = all_reduce_sum(pipeline.step(batches, valid), mesh.world_group) / valid
    grads, local_experts = {}, None
    for name, param in stage.model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not sharded by FSDP"
        if ".experts." in name:  # split over the stage's ep ranks, sharded by FSDP2 over the rest of its ranks
            assert param.device_mesh.mesh_dim_names == ("efsdp", "ep"), f"{name}: {param.device_mesh}"
            layer = stage.model.get_submodule(name.rsplit(".", 1)[0])
            local_experts = (param.to_local().shape[0], layer.num_experts)
        grads[name] = param.grad.full_tensor().float()
    return loss, grads, local_experts, held_out


def expert_worker(rank: int, world_size: int, cases: list[tuple[str, str, str, int, int]]) -> dict:
    """pp=2 x dp_shard=2 x ep=2, with cp = world_size / 4 (each row split over the cp ranks)."""
    cp = world_size // 4
    dims = ParallelDims(dp_shard=2, cp=cp, world_size=world_size, pp=2, ep=2)
    mesh = dims.build_mesh("cpu")
    expert_ranks = sorted(torch.distributed.get_process_group_ranks(mesh.expert_mesh["ep"].get_group()))
    results = {"ep_ranks": expert_ranks}
    for name, schedule, dtype, micro_batches, layers in cases:
        variant = "every-expert" if dtype == "bf16" else "aux"
        every_dp = [micro_batch_rows(d, micro_batches) for d in range(dims.dp_size)]
        loss, grads, local, held_out = pipeline_step(mesh, config(schedule, dtype, micro_batches, cp),
                                                     every_dp[mesh.dp_rank], variant, layers)
        results[name] = dict(loss=loss, grads=grads, local_experts=local, pp_rank=mesh.pp_rank, held_out=held_out)
    return results


# name: (schedule, train.dtype, micro-batches, decoder layers)
CASES = {"1f1b": ("1f1b", "fp32", 2, LAYERS), "gpipe": ("gpipe", "fp32", 3, LAYERS),
         "1f1b-bf16": ("1f1b", "bf16", 2, LAYERS), "gpipe-bf16": ("gpipe", "bf16", 3, LAYERS)}
# Two stages per rank (4 layers): interleaved 1F1B and interleaved zero bubble (rank 0 stages 0 and 2), zero bubble in
# a V (rank 0 stages 0 and 3); zero bubble computes the weight gradients apart from the input gradients, which the
# all-to-all's backward carries.
SCHEDULE_CASES = {"interleaved-1f1b": ("interleaved_1f1b", "fp32", 4, 4),
                  "interleaved-zb": ("interleaved_zb", "fp32", 4, 4), "zbv": ("zbv", "fp32", 4, 4)}


@pytest.fixture(scope="module")
def pp2_dp2_ep2() -> list[dict]:
    return run_distributed(expert_worker, 4, [(name, *case) for name, case in CASES.items()])


def stage_results(results: list[dict], name: str) -> dict[str, torch.Tensor]:
    """Every parameter's gradient from the rank holding it (each stage's on its two ranks, which must agree)."""
    merged = {}
    for result in results:
        for param, grad in result[name]["grads"].items():
            if param in merged:
                torch.testing.assert_close(grad, merged[param], rtol=0, atol=0, msg=f"{name}: {param} differs")
            merged[param] = grad
    return merged


def assert_matches_one_process(results: list[dict], name: str, micro_batches: int, layers: int = LAYERS) -> None:
    """fp32, router loss on: the step's loss on every rank, the eval's summed loss (before the step) and every gradient
    (experts gathered) equal one process's on all rows, the micro-batches of both dp ranks."""
    ref_loss, ref_grads, ref_held_out = reference_step(
        [b for d in range(2) for b in micro_batch_rows(d, micro_batches)], "aux", layers,
        held_out=[micro_batch_rows(d, micro_batches)[0] for d in range(2)])
    grads = stage_results(results, name)
    assert sorted(grads) == sorted(ref_grads)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result[name]["loss"], ref_loss, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank}")
        torch.testing.assert_close(result[name]["held_out"], ref_held_out, rtol=1e-5, atol=1e-3,
                                   msg=f"{name} rank {rank}: eval loss sum")
    for param, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[param], rtol=1e-4, atol=1e-6, msg=f"{name}: grad {param}")
    worst = max((grad - ref_grads[param]).abs().max().item() for param, grad in grads.items())
    print(f"{name}: loss {float(results[0][name]['loss']):.6f}, max |grad - one process| {worst:.3g}")


@pytest.mark.slow  # 4 gloo ranks, four steps each (about a minute on 2 cores)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_pp2_dp2_ep2_matches_one_process(pp2_dp2_ep2, name) -> None:
    """pp=2 x dp_shard=2 x ep=2 on 4 ranks, 1F1B and GPipe (`assert_matches_one_process`)."""
    results = pp2_dp2_ep2
    # the ep groups are the ranks of one stage (pp outermost): {0, 1} stage 0, {2, 3} stage 1
    assert [r["ep_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[name]["pp_rank"] for r in results] == [0, 0, 1, 1]
    assert all(r[name]["local_experts"] == (2, 2) for r in results)  # 2 of the 4 experts on each ep rank
    assert_matches_one_process(results, name, CASES[name][2])


@pytest.mark.slow  # 4 gloo ranks, 3 steps (about 2 minutes on 2 cores)
@pytest.mark.timeout(900)
def test_interleaved_and_zero_bubble_schedules_match_one_process() -> None:
    """Two stages per rank under pp=2 x dp_shard=2 x ep=2: interleaved 1F1B, interleaved zero bubble and ZBV
    (`assert_matches_one_process`; zero bubble: the experts kept gathered from forward to backward as the layers are,
    else the last stage's experts got no gradient)."""
    results = run_distributed(expert_worker, 4, [(name, *case) for name, case in SCHEDULE_CASES.items()])
    for name, (_, _, micro_batches, layers) in SCHEDULE_CASES.items():
        assert_matches_one_process(results, name, micro_batches, layers)


@pytest.mark.slow  # 8 gloo ranks
@pytest.mark.timeout(1200)
def test_pp2_dp2_cp2_ep2_on_eight_ranks_matches_one_process() -> None:
    """pp=2 x dp_shard=2 x cp=2 x ep=2: each stage's ep groups are its cp pairs (ring attention between them, the
    experts' all-to-all too), and FSDP2 shards each stage's experts over its two ranks holding the same ones (efsdp=2,
    the reduction that sums and divides by N = 4), against one process (`assert_matches_one_process`)."""
    results = run_distributed(expert_worker, 8, [("1f1b", *CASES["1f1b"])])
    assert [r["ep_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]
    assert all(r["1f1b"]["local_experts"] == (1, 2) for r in results)  # 2 experts per ep rank, FSDP2 halves them
    assert_matches_one_process(results, "1f1b", CASES["1f1b"][2])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["1f1b-bf16", "gpipe-bf16"])
def test_pp2_dp2_ep2_bf16_within_the_bound_of_test_bf16(pp2_dp2_ep2, name) -> None:
    """train.dtype=bf16 (FSDP2's bf16 gathers and fp32 reduction, bf16 hidden states between stages, tokens
    all-to-all'd in bf16), every expert chosen: against the fp32 truth, within tests/test_bf16.py's bound of the
    same regime on one process, as the ep=2 bf16 case of tests/test_families_moe.py."""
    from test_bf16 import FACTOR, GRAD_FLOOR, LOSS_FLOOR, REFERENCE_CEILING, relative_error

    _, _, micro_batches, _ = CASES[name]
    rows = [b for d in range(2) for b in micro_batch_rows(d, micro_batches)]
    truth = reference_step(rows, "every-expert")
    reference = reference_step(rows, "every-expert", bf16_parameters=True)
    grads = stage_results(pp2_dp2_ep2, name)
    tensors = {"loss": (truth[0], pp2_dp2_ep2[-1][name]["loss"].float(), reference[0])}
    tensors.update({n: (exact, grads[n], reference[1][n]) for n, exact in truth[1].items()})
    for param, (exact, value, ref) in tensors.items():
        ceiling = 2 * REFERENCE_CEILING  # the residual stream is bf16 too (tests/test_bf16_dist.py)
        assert 0 < relative_error(ref, exact) < ceiling, f"{param}: the reference's bf16 error"
        floor = LOSS_FLOOR if param == "loss" else GRAD_FLOOR
        assert relative_error(value, exact) <= FACTOR * relative_error(ref, exact) + floor, (
            f"{name} {param}: {relative_error(value, exact):.2e}, reference {relative_error(ref, exact):.2e}")


def dims_of(world: int, *overrides: str) -> ParallelDims:
    text = tiny_qwen3_moe_config(LAYERS)
    cfg = load_config(None, [f"seq_len={L}", "train.grad_accum=2", *overrides])
    return ParallelDims.from_config(cfg, world, text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                                    num_experts=text.num_experts, text_config=text)


def test_expert_degree_divides_each_stages_ranks() -> None:
    """ep takes its ranks from one stage's dp_shard x cp (the experts a stage holds live on its ranks alone): pp=2 x
    dp_shard=2 x ep=2 on 4 ranks is one efsdp rank per stage; ep=4 on a stage of 2 ranks is refused, naming the
    stage's ranks."""
    dims = dims_of(4, "parallel.pp=2", "parallel.ep=2")
    assert (dims.pp, dims.dp_shard, dims.ep, dims.expert_fsdp_size) == (2, 2, 2, 1)
    assert dims_of(8, "parallel.pp=2", "parallel.cp=2", "parallel.ep=2").expert_fsdp_size == 2
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide parallel.dp_shard x parallel.cp = 2"):
        dims_of(4, "parallel.pp=2", "parallel.ep=4")
    with pytest.raises(ConfigError, match=r"parallel.ep=2 with parallel.tp=2: expert parallelism takes its ranks"):
        dims_of(8, "parallel.pp=2", "parallel.tp=2", "parallel.ep=2")


# -- the trainer ----------------------------------------------------------------------------------------------

def longfit(*args: str):
    import subprocess

    return subprocess.run([sys.executable, "-m", "longfit", *args], capture_output=True, text=True, timeout=900)


def logged(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def exported(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


@pytest.mark.slow  # four runs: one process twice, 4 processes twice (about 4 minutes on 2 cores)
@pytest.mark.timeout(1800)
def test_longfit_train_pp2_dp2_ep2_matches_one_process_resumes_and_exports(corpus, tmp_path) -> None:
    """`longfit train --nproc 4 parallel.pp=2 parallel.dp_shard=2 parallel.ep=2` on the per-expert Qwen3-MoE checkpoint
    transformers wrote (2 layers of 4 experts, router loss on): the losses of one process reading the same rows
    (train.grad_accum=4), resumed from step 2 bit for bit (and by one process, with one process's losses), and the
    export (the stages' whole tensors, the experts gathered from their ep ranks and written back per expert) that of
    one process."""
    from test_families_moe import write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "qwen3_moe-aux", "qwen3_moe-aux")
    common = [f"model={checkpoint}", f"data.path={corpus}", "seq_len=128", "train.device=cpu", "train.steps=3",
              "train.warmup_steps=1", "train.lr=1e-2", "train.micro_batch=1", "memory.tiled_mlp=false",
              "train.save_every=2"]
    reference = tmp_path / "one"
    done = longfit("train", *common, f"output_dir={reference}", "train.grad_accum=4")
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "pp2-dp2-ep2"
    args = [*common, f"output_dir={out}", "train.grad_accum=2", "parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"]
    done = longfit("train", "--nproc", "4", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layout  4 ranks: pp 2 (1f1b) x dp_shard 2 x cp 1 x tp 1, experts split over ep 2" in done.stdout
    got, want = logged(out), logged(reference)
    assert [row["step"] for row in got] == [1, 2, 3]
    assert [row["loss"] for row in got] == pytest.approx([row["loss"] for row in want], rel=1e-4, abs=0)
    weights = exported(out / "final")
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in weights  # per expert, as transformers saved it
    reference_weights = exported(reference / "final")
    assert sorted(weights) == sorted(reference_weights)
    for name, value in reference_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
    print(f"losses {[row['loss'] for row in got]}, one process {[row['loss'] for row in want]}; max |export - one "
          f"process| {max((weights[n] - v).abs().max().item() for n, v in reference_weights.items()):.3g}")

    # Resume from step 2 (DCP: each rank reads its stage's experts by their whole-model names): step 3 and the
    # export bit for bit those of the run that did not stop.
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_00000003")
    shutil.rmtree(out / "final")
    resumed = longfit("train", "--nproc", "4", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
    assert [row["loss"] for row in logged(out)] == [row["loss"] for row in got]
    again = exported(out / "final")
    assert all(torch.equal(again[name], weights[name]) for name in weights)

    # The pp=2 x ep=2 checkpoint onto one process: DCP reads every expert, whole, by the same names.
    one = tmp_path / "onto-one"
    shutil.copytree(out, one, ignore=shutil.ignore_patterns("step_00000003", "final"))
    done = longfit("train", *common, f"output_dir={one}", "train.grad_accum=4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout + done.stderr
    assert [row["loss"] for row in logged(one)] == pytest.approx([row["loss"] for row in want], rel=1e-4, abs=0)


# -- the planner ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    from test_families_moe import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe-aux", "qwen3_moe-aux")


def test_plan_counts_each_stages_experts_over_ep(moe_checkpoint) -> None:
    """`longfit plan` of pp=2 x dp_shard=2 x ep=2: each stage's model states are its layers' share over its 2 ranks
    as without ep (the experts split over ep, then sharded over the rest: 1/N of them either way), and FSDP2 gathers
    a layer with 1/ep of its experts (what the stage's ranks hold after the split), so the gathered bytes are
    smaller."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.shapes import model_shape

    counted = model_shape(str(moe_checkpoint)).counted
    experts = 3 * 4 * 64 * 32  # per layer: gate, up and down of 4 experts, hidden 64, expert width 32
    assert counted.layer_experts == (experts, experts)
    assert counted.gathered_layer(2) == counted.largest_layer - experts // 2
    assert counted.gathered_mlp(2) == counted.largest_mlp - experts // 2
    base = [f"model={moe_checkpoint}", "seq_len=256", "train.grad_accum=2", "parallel.pp=2", "train.dtype=bf16"]
    plans = {ep: plan_config(load_config(None, [*base, f"parallel.ep={ep}"]), 4) for ep in (1, 2)}
    for ep, plan in plans.items():
        assert [list(p.stage.layers) for p in plan.stages] == [[0], [1]], ep
        assert plan.setup.dims.ep == ep and plan.peak_bytes == max(p.peak_bytes for p in plan.stages)
    for one, split in zip(plans[1].stages, plans[2].stages):
        assert split.breakdown["weights"] == one.breakdown["weights"]
        assert split.breakdown["optimizer state"] == one.breakdown["optimizer state"]
        assert split.breakdown["communication"] < one.breakdown["communication"]
