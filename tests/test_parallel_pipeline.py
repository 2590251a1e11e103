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
from longfit.models.build import use_lora_storage
from longfit.models.loading import compute_dtype, resolve_model_config
from longfit.models.structure import decoder_layers
from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
from longfit.parallel.comm import all_reduce_sum
from longfit.parallel.dims import ParallelDims
from longfit.parallel.parallelize import parallelize
from longfit.parallel.pipeline import Pipeline, StageLayers, stage_layers

L, VOCAB, LAYERS = 64, 384, 3


def tiny_llama_config():
    config = resolve_model_config("llama-tiny")
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    return config


def tiny_qwen3_moe_config():
    """transformers' default Qwen3-MoE config shrunk, its routers trained with a load-balancing loss weighted enough
    to matter in the comparison."""
    from transformers import AutoConfig

    from longfit.models.attention import register_attention

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.5,
    )
    config._attn_implementation = register_attention()
    return config


CONFIGS = {"llama": tiny_llama_config, "qwen3_moe": tiny_qwen3_moe_config}


def tiny_llama(seed: int = 0, family: str = "llama", lora: bool = False):
    from transformers import AutoModelForCausalLM

    config = CONFIGS[family]()
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

    def config(self, pp: int, cp: int) -> Config:
        return load_config(None, [
            f"seq_len={L}", f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.pp_schedule={self.schedule}",
            f"train.grad_accum={self.micro_batches}", "train.dtype=fp32", "memory.tiled_mlp=false",
            f"memory.activation_checkpointing={str(self.checkpointing).lower()}", "memory.chunked_loss=true",
            "memory.loss_chunk=24", *self.overrides,
        ])


def micro_batch_rows(dp_rank: int, count: int):
    """The micro-batches of one dp rank: packed rows of several documents, different on every rank."""
    docs = [[10, 23, 31], [40, 24], [64], [5, 59]]
    return [packed_rows([docs[(dp_rank + m) % len(docs)]], L, VOCAB, seed=100 * dp_rank + m) for m in range(count)]


def reference_step(batches, family: str, lora: bool, held_out):
    """One process, no parallelism, no memory techniques: the step's mean loss (with the router loss), every
    gradient, and the summed loss of the `held_out` batches without gradient (the eval loss: no router term)."""
    model = tiny_llama(family=family, lora=lora)
    loss_module = CausalLMLoss(model)
    with torch.no_grad():
        held_out_sum = sum(batch_loss_sum(loss_module, b) for b in held_out)
    valid = torch.tensor(sum(b.num_label_tokens for b in batches))
    counts = step_router_counts(loss_module, batches)
    loss = sum(batch_loss_sum(loss_module, b, valid, counts) for b in batches) / valid
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, held_out_sum


def pipeline_step(mesh, cfg: Config, batches, family: str, lora: bool):
    model = tiny_llama(family=family, lora=lora)
    dims = ParallelDims.from_config(cfg, mesh.dims.world_size, model.config.num_attention_heads,
                                    text_config=model.config)
    dtype = compute_dtype(cfg.train.dtype, torch.device("cpu"))
    if lora:  # the trainer's storage: frozen base in the compute dtype, fp32 adapters
        model = use_lora_storage(model, dtype)
    stage = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh)
    layers = decoder_layers(stage.model)
    assert isinstance(layers, StageLayers)
    assert list(layers._modules) == [str(i) for i in stage_layers(LAYERS, dims.pp)[mesh.pp_rank]]
    assert (stage.router_loss is not None) == (family == "qwen3_moe")
    pipeline = Pipeline(stage, cfg, mesh, torch.device("cpu"), dtype)
    shards = [shard_batch(b, mesh.cp_rank, dims.cp, cp_layout(cfg.parallel.cp_method)) for b in batches]
    valid = global_valid_tokens([s.labels for s in shards], mesh.world_group)
    loss_sum = pipeline.step(shards, valid)
    loss = all_reduce_sum(loss_sum, mesh.world_group) / valid
    grads = {}
    for name, param in stage.model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not sharded by FSDP"
        if param.requires_grad:
            grads[name] = param.grad.full_tensor()
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
]
# run: (world size, [(pp, cp, cases)]); dp_shard = world / (pp x cp)
RUNS = {
    "pp2": (2, [(2, 1, [CASES[0], CASES[2], CASES[3]])]),
    "pp2-gpipe-lora": (2, [(2, 1, [CASES[1], CASES[4]])]),
    "pp2xcp2-and-pp2xdp2": (4, [(2, 2, CASES[:2] + CASES[3:4]), (2, 1, CASES[1:2] + CASES[4:])]),
}


def step_worker(rank: int, world_size: int, run: str) -> dict:
    results = {}
    for pp, cp, cases in RUNS[run][1]:
        dims = ParallelDims(dp_shard=-1, cp=cp, world_size=world_size, pp=pp)
        mesh = dims.build_mesh("cpu")
        for case in cases:
            name = f"pp{pp}-cp{cp}-dp{dims.dp_shard}-{case.name}"
            every_dp = [micro_batch_rows(d, case.micro_batches) for d in range(dims.dp_size)]
            ref_loss, ref_grads, ref_held_out = reference_step([b for rows in every_dp for b in rows], case.family,
                                                               case.lora, [rows[0] for rows in every_dp])
            loss, grads, held_out = pipeline_step(mesh, case.config(pp, cp), every_dp[mesh.dp_rank], case.family,
                                                  case.lora)
            rtol, atol = case.tolerance
            torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=f"{name}: loss")
            torch.testing.assert_close(held_out, ref_held_out, rtol=rtol, atol=atol * 1e3, msg=f"{name}: eval loss sum")
            for param, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[param], rtol=rtol, atol=atol, msg=f"{name}: grad {param}")
            results[name] = (float(loss), sorted(grads), sorted(ref_grads))
    return results


@pytest.mark.timeout(600)
# slow: GPipe and LoRA on 2 ranks, and the 4-rank layouts (CI runs this file's slow cases)
@pytest.mark.parametrize("run", ["pp2", pytest.param("pp2-gpipe-lora", marks=pytest.mark.slow),
                                 pytest.param("pp2xcp2-and-pp2xdp2", marks=pytest.mark.slow)])
def test_pipeline_step_matches_single_process(run):
    world_size = RUNS[run][0]
    results = run_distributed(step_worker, world_size, run)
    for name in results[0]:
        assert len({r[name][0] for r in results}) == 1, f"{name}: ranks disagree on the loss"
        # Every parameter has its gradient on some stage, none on two.
        held = [p for r in results for p in r[name][1]]
        assert sorted(set(held)) == results[0][name][2], name
        assert len(held) == len(set(held)) * (world_size // 2), name


def test_stage_layers_are_consecutive_and_balanced():
    assert stage_layers(3, 2) == [range(0, 1), range(1, 3)]
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]


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
    (("parallel.pp=2", "parallel.tp=2"), {}, r"parallel.pp=2 with parallel.tp=2: not implemented"),
])
def test_what_a_stage_cut_cannot_split_is_refused(overrides, change, message):
    config = tiny_llama_config()
    config.update(change)
    with pytest.raises(ConfigError, match=message):
        dims_of(*overrides, config=config, world=4)


def test_memory_techniques_a_stage_cannot_hold_are_refused_before_any_rank_starts():
    from longfit.plan.setup import resolve

    cfg = load_config(None, ["model=llama-tiny", "seq_len=64", "train.grad_accum=2", "parallel.pp=2",
                             "memory.offload_activations=true"])
    with pytest.raises(ConfigError, match=r"memory.offload_activations with parallel.pp=2: not implemented"):
        resolve(cfg, 2, "cpu")


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
