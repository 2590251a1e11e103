"""Pipeline parallelism (parallel/pipeline.py) against one process: loss and every gradient of a step of several
micro-batches of packed rows, on real gloo ranks, pp alone and with context parallelism / FSDP2 sharding."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from batch_helpers import packed_rows  # noqa: E402
from parallel_harness import run_distributed  # noqa: E402

from longfit.config import Config, ConfigError, load_config
from longfit.memory.loss import CausalLMLoss, batch_loss_sum, step_router_counts
from longfit.memory.tiled_layers import TILED_LAYER_ATTR
from longfit.models.build import use_lora_storage
from longfit.models.loading import compute_dtype, resolve_model_config
from longfit.models.structure import decoder_layers
from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
from longfit.parallel.comm import all_reduce_sum
from longfit.parallel.dims import PIPELINE_SCHEDULES, ParallelDims
from longfit.parallel.parallelize import parallelize
from longfit.parallel.pipeline import Pipeline, StageLayers, rank_stages, stage_layers, stage_rank

L, VOCAB, LAYERS = 64, 384, 3


def tiny_llama_config(layers: int = LAYERS):
    config = resolve_model_config("llama-tiny")
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    return config


def tiny_qwen3_moe_config(layers: int = LAYERS):
    """transformers' default Qwen3-MoE config shrunk, its routers trained with a load-balancing loss weighted enough
    to matter in the comparison."""
    from transformers import AutoConfig

    from longfit.models.attention import register_attention

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.5,
    )
    config._attn_implementation = register_attention()
    return config


CONFIGS = {"llama": tiny_llama_config, "qwen3_moe": tiny_qwen3_moe_config}


def tiny_llama(seed: int = 0, family: str = "llama", lora: bool = False, layers: int = LAYERS):
    from transformers import AutoModelForCausalLM

    config = CONFIGS[family](layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=config._attn_implementation)
    model.config.use_cache = False
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        # Random A and B (init_lora_weights=False): with peft's zero B every lora_A gradient would be 0.
        adapters = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
        model = get_peft_model(model, adapters)
    return model


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str = "1f1b"
    micro_batches: int = 2
    checkpointing: bool = True
    family: str = "llama"
    lora: bool = False
    overrides: tuple[str, ...] = ()
    tolerance: tuple[float, float] = (1e-4, 1e-6)  # (rtol, atol) of loss and gradients
    layers: int = LAYERS

    def config(self, pp: int, cp: int, tp: int = 1) -> Config:
        return load_config(None, [
            f"seq_len={L}", f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.tp={tp}",
            f"parallel.pp_schedule={self.schedule}",
            f"train.grad_accum={self.micro_batches}", "train.dtype=fp32", "memory.tiled_mlp=false",
            f"memory.activation_checkpointing={str(self.checkpointing).lower()}", "memory.chunked_loss=true",
            "memory.loss_chunk=24", *self.overrides,
        ])


def micro_batch_rows(dp_rank: int, count: int):
    """The micro-batches of one dp rank: packed rows of several documents, different on every rank."""
    docs = [[10, 23, 31], [40, 24], [64], [5, 59]]
    return [packed_rows([docs[(dp_rank + m) % len(docs)]], L, VOCAB, seed=100 * dp_rank + m) for m in range(count)]


def reference_step(batches, family: str, lora: bool, held_out, layers: int = LAYERS):
    """`one_process_step` of the family's tiny model."""
    return one_process_step(tiny_llama(family=family, lora=lora, layers=layers), batches, held_out)


def one_process_step(model, batches, held_out):
    """One process, no parallelism, no memory techniques: the step's mean loss (with the router loss), every
    gradient, and the summed loss of the `held_out` batches without gradient (the eval loss: no router term)."""
    loss_module = CausalLMLoss(model)
    with torch.no_grad():
        held_out_sum = sum(batch_loss_sum(loss_module, b) for b in held_out)
    valid = torch.tensor(sum(b.num_label_tokens for b in batches))
    counts = step_router_counts(loss_module, batches)
    loss = sum(batch_loss_sum(loss_module, b, valid, counts) for b in batches) / valid
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, held_out_sum


def pipeline_step(mesh, cfg: Config, batches, family: str, lora: bool, layers: int = LAYERS):
    model = tiny_llama(family=family, lora=lora, layers=layers)
    config = model.config
    dims = ParallelDims.from_config(cfg, mesh.dims.world_size, config.num_attention_heads,
                                    num_key_value_heads=config.num_key_value_heads,
                                    intermediate_size=config.intermediate_size, text_config=config)
    dtype = compute_dtype(cfg.train.dtype, torch.device("cpu"))
    if lora:  # the trainer's storage: frozen base in the compute dtype, fp32 adapters
        model = use_lora_storage(model, dtype)
    stage = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh)
    held = decoder_layers(stage.model)
    assert isinstance(held, StageLayers)
    assert all(hasattr(layer, TILED_LAYER_ATTR) == (cfg.memory.tiled_layers is True) for layer in held)
    cut = stage_layers(layers, dims.pipeline_stages, cfg.parallel.pp_layers)
    stages = rank_stages(mesh.pp_rank, dims.pp, dims.pp_stages_per_rank, PIPELINE_SCHEDULES[cfg.parallel.pp_schedule][1])
    assert list(held._modules) == [str(i) for i in sorted(i for s in stages for i in cut[s])]
    assert (stage.router_loss is not None) == (family == "qwen3_moe")
    pipeline = Pipeline(stage, cfg, mesh, torch.device("cpu"), dtype)
    shards = [shard_batch(b, mesh.cp_rank, dims.cp, cp_layout(cfg.parallel.cp_method)) for b in batches]
    valid = global_valid_tokens([s.labels for s in shards], mesh.world_group)
    loss_sum = pipeline.step(shards, valid)
    loss = all_reduce_sum(loss_sum, mesh.world_group) / valid
    grads = {}
    for name, param in stage.model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not sharded by FSDP"
        assert ("tp" in param.device_mesh.mesh_dim_names) == (dims.tp > 1), f"{name}: {param.device_mesh}"
        if param.requires_grad:
            grads[name] = None if param.grad is None else param.grad.full_tensor()
    held_out_sum = all_reduce_sum(pipeline.batch_loss(shards[0]).clone(), mesh.world_group)  # the eval's forward
    return loss, grads, held_out_sum


CASES = [
    Case("1f1b"),
    Case("gpipe", schedule="gpipe", micro_batches=3, checkpointing=False),
    # bf16 parameters gathered by FSDP, bf16 activations between stages: at bf16 accuracy against the fp32 reference.
    Case("1f1b-bf16", overrides=("train.dtype=bf16",), tolerance=(5e-2, 5e-3)),
    # Qwen3-MoE with its router loss: each stage adds its layers' term over the step's counts of all stages.
    Case("qwen3-moe-router-loss", family="qwen3_moe"),
    Case("lora-bf16", lora=True, overrides=("train.dtype=bf16", "lora.enabled=true"), tolerance=(5e-2, 5e-3)),
    # parallel.pp_layers: a cut other than the even one ([1, 2] for three layers).
    Case("1f1b-uneven", overrides=("parallel.pp_layers=[2,1]",)),
    Case("1f1b-uneven-bf16", overrides=("parallel.pp_layers=[2,1]", "train.dtype=bf16"), tolerance=(5e-2, 5e-3)),
    # Two stages per rank (rank 0: stages 0 and 2, rank 1: 1 and 3), an uneven cut of five layers.
    Case("interleaved-1f1b-uneven", schedule="interleaved_1f1b", micro_batches=4, layers=5,
         overrides=("parallel.pp_layers=[1,1,2,1]",)),
    Case("interleaved-1f1b-bf16", schedule="interleaved_1f1b", micro_batches=4, layers=5,
         overrides=("parallel.pp_layers=[1,1,2,1]", "train.dtype=bf16"), tolerance=(5e-2, 5e-3)),
    # Zero bubble: each backward split into the input gradient and, later, the weight gradient; the layers stay
    # gathered from forward to backward (parallel.reshard_after_forward=false, which these schedules need).
    Case("interleaved-zb", schedule="interleaved_zb", micro_batches=4, layers=4,
         overrides=("parallel.reshard_after_forward=false",)),
    Case("interleaved-zb-bf16", schedule="interleaved_zb", micro_batches=4, layers=4,
         overrides=("parallel.reshard_after_forward=false", "train.dtype=bf16"), tolerance=(5e-2, 5e-3)),
    # The V: rank 0 holds stages 0 and 3 (the embeddings and the loss), rank 1 stages 1 and 2.
    Case("zbv", schedule="zbv", micro_batches=4, layers=4, overrides=("parallel.reshard_after_forward=false",)),
    Case("zbv-bf16", schedule="zbv", micro_batches=4, layers=4, tolerance=(5e-2, 5e-3),
         overrides=("parallel.reshard_after_forward=false", "train.dtype=bf16")),
    # The router loss with the last stage and another on one rank (its term in the loss, the other's on the hidden
    # states), and an odd micro-batch count (looped BFS runs it: interleaved rounds of 2 do not divide 3).
    Case("zbv-qwen3-moe", schedule="zbv", family="qwen3_moe", micro_batches=4, layers=4,
         overrides=("parallel.reshard_after_forward=false",)),
    Case("interleaved-1f1b-qwen3-moe-3", schedule="interleaved_1f1b", family="qwen3_moe", micro_batches=3, layers=4),
    # Tiled layers on each stage: the first stage's first layer looks its input up again, the others save theirs;
    # several micro-batches in flight each keep their own (memory/tiled_layers.py).
    Case("1f1b-tiled-layers", micro_batches=3, overrides=("memory.tiled_layers=true", "memory.layer_tiles=3")),
    Case("1f1b-tiled-layers-bf16", micro_batches=3, tolerance=(5e-2, 5e-3),
         overrides=("memory.tiled_layers=true", "memory.layer_tiles=3", "train.dtype=bf16")),
    Case("interleaved-1f1b-tiled-layers", schedule="interleaved_1f1b", micro_batches=4, layers=4,
         overrides=("memory.tiled_layers=true", "memory.layer_tiles=2")),
    Case("interleaved-1f1b-tiled-layers-bf16", schedule="interleaved_1f1b", micro_batches=4, layers=4,
         overrides=("memory.tiled_layers=true", "memory.layer_tiles=2", "train.dtype=bf16"), tolerance=(5e-2, 5e-3)),
    # DualPipeV: ZBV's V, one micro-batch's forward beside another's backward; a micro-batch per stage
    Case("dualpipev", schedule="dualpipev", micro_batches=4, layers=4, overrides=("parallel.reshard_after_forward=false",)),
    Case("dualpipev-bf16", schedule="dualpipev", micro_batches=4, layers=4, tolerance=(5e-2, 5e-3),
         overrides=("parallel.reshard_after_forward=false", "train.dtype=bf16")),
    # a step of fewer micro-batches than stages (the last of train.epochs) under train.grad_accum=4: run as ZBV
    Case("dualpipev-short-step", schedule="dualpipev", micro_batches=2, layers=4,
         overrides=("parallel.reshard_after_forward=false", "train.grad_accum=4")),
]
# Tensor parallelism on each stage (pp outermost: each tp rank sends its sequence shard of the residual stream to the
# same tp rank of the next stage), under every schedule.
TP_CASES = [
    Case("1f1b"),
    Case("1f1b-bf16", overrides=("train.dtype=bf16",), tolerance=(5e-2, 5e-3)),
    Case("gpipe", schedule="gpipe", micro_batches=3, checkpointing=False),
    # LoRA on the split projections, and the tiled MLP (its tiles' pending sums reduce-scattered at the MLP's output)
    Case("lora-tiled-mlp", lora=True, overrides=("lora.enabled=true", "memory.tiled_mlp=true", "memory.mlp_tiles=2")),
    Case("lora-tiled-mlp-bf16", lora=True, tolerance=(5e-2, 5e-3),
         overrides=("train.dtype=bf16", "lora.enabled=true", "memory.tiled_mlp=true", "memory.mlp_tiles=2")),
    Case("interleaved-1f1b-uneven", schedule="interleaved_1f1b", micro_batches=4, layers=5,
         overrides=("parallel.pp_layers=[1,1,2,1]",)),
    Case("interleaved-1f1b-bf16", schedule="interleaved_1f1b", micro_batches=4, layers=5,
         overrides=("parallel.pp_layers=[1,1,2,1]", "train.dtype=bf16"), tolerance=(5e-2, 5e-3)),
    *CASES[9:13],  # interleaved zero bubble and ZBV, fp32 and bf16: the weight gradients of the split layers deferred
]
# run: (world size, [(pp, cp, tp, cases)]); dp_shard = world / (pp x cp x tp)
RUNS = {
    "pp2": (2, [(2, 1, 1, [CASES[0], CASES[2], CASES[3], CASES[7], CASES[11]])]),
    "pp2-gpipe-lora": (2, [(2, 1, 1, [CASES[1], CASES[4]])]),
    "pp2-cuts-and-schedules": (2, [(2, 1, 1, CASES[5:7] + CASES[8:11] + CASES[12:])]),
    "pp2xcp2-and-pp2xdp2": (4, [(2, 2, 1, CASES[:2] + CASES[3:4] + CASES[7:8] + CASES[11:12]),
                                (2, 1, 1, CASES[1:2] + CASES[4:5] + CASES[9:10])]),
    "pp2xtp2": (4, [(2, 1, 2, TP_CASES)]),
    # all four axes: ring attention on each tp rank's heads, FSDP2's 2-D shards on ("dp_shard_cp", "tp")
    "pp2xcp2xtp2-and-pp2xdp2xtp2": (8, [(2, 2, 2, TP_CASES[:2]), (2, 1, 2, TP_CASES[:2])]),
}


def step_worker(rank: int, world_size: int, run: str) -> dict:
    results = {}
    for pp, cp, tp, cases in RUNS[run][1]:
        dims = ParallelDims(dp_shard=-1, cp=cp, world_size=world_size, pp=pp, tp=tp)
        mesh = dims.build_mesh("cpu")
        for case in cases:
            name = f"pp{pp}-cp{cp}-dp{dims.dp_shard}-tp{tp}-{case.name}"
            every_dp = [micro_batch_rows(d, case.micro_batches) for d in range(dims.dp_size)]
            ref_loss, ref_grads, ref_held_out = reference_step([b for rows in every_dp for b in rows], case.family,
                                                               case.lora, [rows[0] for rows in every_dp], case.layers)
            loss, grads, held_out = pipeline_step(mesh, case.config(pp, cp, tp), every_dp[mesh.dp_rank], case.family,
                                                  case.lora, case.layers)
            rtol, atol = case.tolerance
            torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=f"{name}: loss")
            torch.testing.assert_close(held_out, ref_held_out, rtol=rtol, atol=atol * 1e3, msg=f"{name}: eval loss sum")
            for param, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[param], rtol=rtol, atol=atol, msg=f"{name}: grad {param}")
            worst = max((grad - ref_grads[param]).abs().max().item() for param, grad in grads.items())
            results[name] = (float(loss), sorted(grads), sorted(ref_grads), worst)
    return results


@pytest.mark.timeout(600)
# slow: GPipe and LoRA, the other cuts and schedules on 2 ranks, and the 4-rank layouts (CI runs this file's slow cases)
@pytest.mark.parametrize("run", ["pp2", pytest.param("pp2-cuts-and-schedules", marks=pytest.mark.slow), pytest.param("pp2-gpipe-lora", marks=pytest.mark.slow),
                                 pytest.param("pp2xcp2-and-pp2xdp2", marks=pytest.mark.slow),
                                 pytest.param("pp2xtp2", marks=pytest.mark.slow),
                                 pytest.param("pp2xcp2xtp2-and-pp2xdp2xtp2", marks=pytest.mark.slow)])
def test_pipeline_step_matches_single_process(run):
    world_size = RUNS[run][0]
    results = run_distributed(step_worker, world_size, run)
    for name in results[0]:
        assert len({r[name][0] for r in results}) == 1, f"{name}: ranks disagree on the loss"
        # Every parameter has its gradient on some stage, none on two.
        held = [p for r in results for p in r[name][1]]
        assert sorted(set(held)) == results[0][name][2], name
        assert len(held) == len(set(held)) * (world_size // 2), name
        print(f"{name}: loss {results[0][name][0]:.6f}, max |grad - reference| {max(r[name][3] for r in results):.3g}")


def test_stage_layers_are_consecutive_and_balanced():
    assert stage_layers(3, 2) == [range(0, 1), range(1, 3)]
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]
    assert stage_layers(5, 4, [1, 1, 2, 1]) == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]


def test_a_rank_holds_its_stages_in_the_schedules_placement():
    assert [rank_stages(r, 2, 1, "single") for r in range(2)] == [[0], [1]]
    assert [rank_stages(r, 2, 3, "loop") for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [rank_stages(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for placement, per_rank in (("loop", 3), ("v", 2)):
        for stage in range(4 * per_rank):
            assert stage in rank_stages(stage_rank(stage, 4, placement), 4, per_rank, placement)


def dims_of(*overrides: str, config=None, world: int = 2) -> ParallelDims:
    cfg = load_config(None, ["seq_len=64", "train.grad_accum=2", *overrides])
    config = config or tiny_llama_config()
    return ParallelDims.from_config(cfg, world, config.num_attention_heads, text_config=config)


def test_pipeline_degree_is_outermost_and_fits_the_world():
    dims = dims_of("parallel.pp=2", "parallel.cp=2", world=8)
    assert (dims.pp, dims.dp_shard, dims.cp) == (2, 2, 2) and dims.dp_size == 2 and dims.fsdp_enabled
    with pytest.raises(ConfigError, match=r"parallel.pp x parallel.cp = 2 x 2 = 4 does not divide the world size 6"):
        dims_of("parallel.pp=2", "parallel.cp=2", world=6)


@pytest.mark.parametrize("overrides, change, message", [
    (("parallel.pp=4",), {}, r"parallel.pp=4 stages need at least one decoder layer each; the model has 3"),
    (("parallel.pp=2",), {"tie_word_embeddings": True}, r"ties lm_head to the input embeddings"),
    (("parallel.pp=2",), {"num_kv_shared_layers": 1}, r"reuse the keys and values of earlier layers"),
    # parallel.pp_layers: one size per stage, each >= 1, summing to the layers (the fix shows the even cut)
    # parallel.ep composes with parallel.pp (tests/test_pipeline_expert.py); a dense model still has no experts to split
    (("parallel.pp=2", "parallel.ep=2"), {}, r"parallel.ep=2: the model has no experts that transformers can split"),
    (("parallel.pp=2", "parallel.pp_layers=[1,1]"), {},
     r"parallel.pp_layers=\[1, 1\]: must list 2 stage sizes \(parallel.pp=2\), each >= 1, summing to the model's 3 "
     r"decoder layers, e.g. parallel.pp_layers=\[1, 2\]"),
    (("parallel.pp=2", "parallel.pp_layers=[3,0]"), {}, r"each >= 1"),
    (("parallel.pp=2", "parallel.pp_layers=[1,1,1]"), {}, r"must list 2 stage sizes"),
    (("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_layers=[1,2]"), {"num_hidden_layers": 5},
     r"must list 4 stage sizes \(parallel.pp=2 x parallel.pp_stages_per_rank=2\)"),
    (("parallel.pp_layers=[1,2]",), {}, r"parallel.pp_layers=\[1, 2\] cuts pipeline stages, which parallel.pp=1"),
    # the schedules' stages per rank, their layers, and what zero bubble needs of FSDP2
    (("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"), {},
     r"parallel.pp=2 x parallel.pp_stages_per_rank=2 stages need at least one decoder layer each; the model has 3: use "
     r"parallel.pp x parallel.pp_stages_per_rank <= 3"),
    (("parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_stages_per_rank=2"), {},
     r"parallel.pp_stages_per_rank=2 with parallel.pp_schedule=1f1b: must be 1"),
    (("parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=3"), {}, r"must be 2"),
    (("parallel.pp=2", "parallel.pp_schedule=zbv"), {}, r"needs parallel.reshard_after_forward=false"),
    (("parallel.pp=2", "parallel.pp_schedule=dualpipev"), {}, r"needs parallel.reshard_after_forward=false"),
    (("parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.reshard_after_forward=false", "train.grad_accum=3"),
     {"num_hidden_layers": 4}, r"parallel.pp_schedule=dualpipev needs train.grad_accum >= 4, a micro-batch per stage"),
])
def test_what_a_stage_cut_cannot_split_is_refused(overrides, change, message):
    config = tiny_llama_config()
    config.update(change)
    with pytest.raises(ConfigError, match=message):
        dims_of(*overrides, config=config, world=4)


def test_memory_techniques_a_stage_cannot_hold_are_refused_before_any_rank_starts():
    from longfit.plan.setup import resolve

    zero_bubble = load_config(None, ["model=llama-tiny", "seq_len=64", "train.grad_accum=2", "parallel.pp=2",
                                     "parallel.pp_schedule=zbv", "parallel.reshard_after_forward=false",
                                     "memory.tiled_layers=true"])
    with pytest.raises(ConfigError, match=r"memory.tiled_layers with parallel.pp_schedule=zbv: a tiled layer computes"):
        resolve(zero_bubble, 2, "cpu")
    cut = load_config(None, ["model=llama-tiny", "seq_len=64", "train.grad_accum=2", "parallel.pp=2",
                             "parallel.pp_layers=[1,2]"])
    with pytest.raises(ConfigError, match=r"parallel.pp_layers=\[1, 2\]: must list 2 stage sizes .* summing to the "
                                          r"model's 4 decoder layers"):
        resolve(cut, 2, "cpu")


def test_unproven_families_are_refused():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=2, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=r"proven for llama, .* not model_type 'gemma3_text'"):
        dims_of("parallel.pp=2", config=config)


@pytest.mark.slow  # layer traces of three plans (about 15 s of CPU on a cold trace cache)
def test_a_pipelined_run_is_planned_by_its_heaviest_stage():
    from longfit.plan.analytic import plan_config

    base = ["model=llama-tiny", "seq_len=1024", "train.grad_accum=4", "memory.tiled_mlp=false"]
    whole = plan_config(load_config(None, base), 1)
    stage = plan_config(load_config(None, [*base, "parallel.pp=4"]), 4)
    assert [len(p.stage.layers) for p in stage.stages] == [1, 1, 1, 1] and whole.stage is None
    assert stage.peak_bytes == max(p.peak_bytes for p in stage.stages)
    assert stage.breakdown["weights"] < whole.breakdown["weights"]
    gpipe = plan_config(load_config(None, [*base, "parallel.pp=4", "parallel.pp_schedule=gpipe"]), 4)
    assert gpipe.peak_bytes >= stage.peak_bytes
