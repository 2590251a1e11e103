"""Host memory and disk in the plan: the store allocates what the plan says, GPU first, and the trainer refuses
a configuration whose host or disk need exceeds what this machine has, before building the model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from longfit.config import ConfigError, load_config
from longfit.plan.analytic import plan_config, plan_setup
from longfit.plan.setup import resolve
from longfit.plan.storage import HOST_RESERVE_BYTES, kept_on_device_bytes
from longfit.plan.tiled import layer_tiles, tile_fraction

preflight_module = sys.modules["longfit.plan.preflight"]  # the package exports the function under the same name
GiB = 1 << 30
SEQ_LEN = 4096  # one fp32 (1, 4096, 64) layer input is exactly 1 MiB: offloaded (not below min_offload_bytes)


def offload_config(model_dir, *extra):
    return load_config(None, [f"model={model_dir}", f"seq_len={SEQ_LEN}", "memory.offload_activations=true",
                              "memory.tiled_mlp=false", "train.dtype=fp32", *extra])


def one_step(cfg, placement):
    """The trainer's model and step on CPU with the planner's placement; the offload store afterwards."""
    from longfit.memory.checkpointing import CHECKPOINT_ATTR
    from longfit.memory.loss import CausalLMLoss
    from longfit.models.build import build_model
    from longfit.models.structure import decoder_layers
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    dims = ParallelDims.from_config(cfg, 1, 4)
    model = build_model(cfg, torch.float32, "cpu", False)
    loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, dims.build_mesh("cpu"),
                              device="cpu", checkpoint_placement=placement)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ_LEN), generator=g)
    loss_module(ids, ids, torch.arange(SEQ_LEN)[None], None).backward()
    offloader = getattr(decoder_layers(model)[0], CHECKPOINT_ATTR).offloader
    return offloader


def test_store_allocates_exactly_the_planned_host_bytes(tiny_model_dir):
    cfg = offload_config(tiny_model_dir)
    plan = plan_config(cfg, 1, device_type="cpu", host_memory_bytes=64 * GiB)
    assert (plan.placement.device, plan.placement.host, plan.placement.disk) == (0, 2, 0)
    offloader = one_step(cfg, plan.placement)
    assert offloader.store.allocated_host_bytes == plan.host_bytes == 2 * SEQ_LEN * 64 * 4  # no rounding up
    assert offloader.stats.offloaded_tensors == 2


def test_gpu_first_keeps_what_the_planned_device_budget_holds(tiny_model_dir):
    """A made-up device capacity with room for one layer input beyond the plan's peak: the last layer's stays."""
    cfg = offload_config(tiny_model_dir)
    s = resolve(cfg, 1, "cpu")
    everything_out = plan_setup(s)
    slot = everything_out.placement.slot_bytes
    plan = plan_setup(s, capacity=everything_out.peak_bytes + int(1.5 * slot))
    assert (plan.placement.device, plan.placement.host) == (1, 1) and plan.fits
    # the kept input waits on the GPU between forward and backward (in backward every input is back on it)
    assert dict(plan.events)["loss forward"] == dict(everything_out.events)["loss forward"] + kept_on_device_bytes(s)
    offloader = one_step(cfg, plan.placement)
    assert (offloader.stats.device_tensors, offloader.stats.offloaded_tensors) == (1, 1)
    assert offloader.store.allocated_host_bytes == plan.host_bytes == slot


def test_plan_places_beyond_host_memory_on_disk():
    """llama-60m (8 layers): host room for five slots -> three layers in host memory (plus the two staging
    slots of the disk tier), the first five on disk (the layer inputs alone: no kept attention, #53)."""
    cfg = load_config(None, ["model=llama-60m", f"seq_len={SEQ_LEN}", "memory.offload_activations=true",
                             "memory.offload_dir=/nonexistent/offload", "memory.keep_attention=false"])
    slot = plan_config(cfg, 1).placement.slot_bytes
    assert slot == SEQ_LEN * 512 * 4  # one GPU without FSDP: fp32 residual stream under bf16 autocast
    plan = plan_config(cfg, 1, host_memory_bytes=HOST_RESERVE_BYTES + 5 * slot, disk_bytes=GiB)
    assert (plan.placement.device, plan.placement.host, plan.placement.disk) == (0, 3, 5) and plan.fits
    assert plan.disk_bytes == 5 * slot and plan.host_bytes == 5 * slot
    assert not plan_config(cfg, 1, host_memory_bytes=HOST_RESERVE_BYTES + 5 * slot, disk_bytes=4 * slot).fits
    # the staging slots need host memory too: with room for one slot, nothing fits
    assert not plan_config(cfg, 1, host_memory_bytes=HOST_RESERVE_BYTES + slot, disk_bytes=GiB).fits_host


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_offload_rows_keep_the_model_states_on_the_gpu_where_the_host_cannot_hold_them():
    """8B full fine-tuning: FSDP2's CPU offload needs ~126 GiB of host for its fp32 parameters, gradients and Adam
    state, more than a 128 GiB machine leaves, so the offload rows run activation offload alone and reach past
    plain FSDP; with 1 TiB of host, one GPU fits only with the model states on the host."""
    from longfit.plan.report import FSDP_OFFLOAD_MARK, max_context_text
    from longfit.plan.search import STRATEGIES, max_context_table

    cfg = load_config(None, ["model=llama-3.1-8b"])
    rows = [s for s in STRATEGIES if s.name in ("FSDP", "FSDP + offload")]
    with_states = load_config(None, ["model=llama-3.1-8b", "seq_len=65536", "memory.offload_activations=true",
                                     "parallel.cpu_offload=true"])
    assert not plan_config(with_states, 2, 80 * GiB, host_memory_bytes=128 * GiB).fits_host
    small = max_context_table(cfg, [1, 2], 80 * GiB, rows, host_capacity=128 * GiB)
    assert small["FSDP + offload"][1] == (None, None)
    best, plan = small["FSDP + offload"][2]
    assert best > small["FSDP"][2][0] and plan.fits and not plan.setup.fsdp_offload
    assert FSDP_OFFLOAD_MARK not in max_context_text(small, [1, 2])
    large = max_context_table(cfg, [1], 80 * GiB, rows, host_capacity=1024 * GiB)
    best, plan = large["FSDP + offload"][1]
    assert best and plan.fits and plan.setup.fsdp_offload
    assert f"{FSDP_OFFLOAD_MARK} with parallel.cpu_offload=true" in max_context_text(large, [1])


def test_trainer_refuses_when_host_memory_is_short_before_building_the_model(tiny_model_dir, corpus, tmp_path,
                                                                               monkeypatch):
    """Room for one and a half of the two fp32 layer inputs: refused, naming fp8 storage (which fits)."""
    from longfit.models import build
    from longfit.train.loop import train

    monkeypatch.setattr(preflight_module, "host_memory_bytes", lambda: HOST_RESERVE_BYTES + 3 * SEQ_LEN * 64 * 2)
    monkeypatch.setattr(build, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    cfg = offload_config(tiny_model_dir, f"data.path={corpus}", f"output_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=r"needs 2\.0 MiB of host memory per rank .* 1\.5 MiB per rank\. "
                                          r"Set memory\.checkpoint_dtype=fp8"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_preflight_refuses_a_disk_too_small_for_the_offloaded_inputs(monkeypatch):
    cfg = load_config(None, ["model=llama-60m", f"seq_len={SEQ_LEN}", "memory.offload_activations=true",
                             "memory.offload_dir=/nonexistent/offload"])
    slot = plan_config(cfg, 1).placement.slot_bytes
    monkeypatch.setattr(preflight_module, "host_memory_bytes", lambda: HOST_RESERVE_BYTES + 5 * slot)
    monkeypatch.setattr(preflight_module, "disk_free_bytes", lambda path: 4 * slot)
    with pytest.raises(ConfigError, match=r"memory\.offload_dir=/nonexistent/offload: the offloaded layer inputs "
                                          r"need 40\.0 MiB per rank there but it has 32\.0 MiB free, 32\.0 MiB per "
                                          r"rank\. Set memory"):
        preflight_module.preflight(cfg, 1, torch.device("cpu"))
    monkeypatch.setattr(preflight_module, "disk_free_bytes", lambda path: 5 * slot)
    assert preflight_module.preflight(cfg, 1, torch.device("cpu")).placement.disk == 5


def test_a_rank_shares_its_machine_with_the_ranks_launched_on_it(monkeypatch):
    """8 ranks on two machines of 4: each rank gets a quarter of its machine's host memory, not an eighth."""
    cfg = offload_config("llama-60m")
    assert plan_config(cfg, 8, host_memory_bytes=64 * GiB).host_share == 8 * GiB - HOST_RESERVE_BYTES  # 8 per machine
    assert plan_config(cfg, 8, host_memory_bytes=64 * GiB, ranks_on_node=4).host_share == 16 * GiB - HOST_RESERVE_BYTES
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # what torchrun tells each rank
    monkeypatch.setattr(preflight_module, "host_memory_bytes", lambda: 64 * GiB)
    assert preflight_module.preflight(cfg, 8, torch.device("cpu")).host_share == 16 * GiB - HOST_RESERVE_BYTES


def preflight_with_host_memory_per_rank(rank: int, world_size: int, host_by_rank: list[int]) -> str:
    preflight_module.host_memory_bytes = lambda: host_by_rank[rank]
    try:
        preflight_module.preflight(offload_config("llama-60m"), world_size, torch.device("cpu"))
    except ConfigError as e:
        return str(e)
    return "fits"


@pytest.mark.slow  # plans many layouts: minutes of layer traces on a cold trace cache
def test_ranks_that_measure_different_host_memory_decide_alike():
    """Each rank measures the available host memory (and the offload disk's free space) itself; they must
    agree on the least, or the rank that refuses exits while the others wait in the next collective."""
    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_harness import run_distributed

    results = run_distributed(preflight_with_host_memory_per_rank, 2, [64 * GiB, HOST_RESERVE_BYTES + (1 << 20)])
    assert all("of host memory per rank" in r for r in results), results


def test_tile_fraction_and_count_follow_the_runtime(tiny_model_dir):
    from longfit.parallel.tiled_attention import LocalTileAttention, RingTileAttention

    for tokens, tiles in ((4000, 24), (4096, 29), (100, 7), (64, 64)):
        cut = LocalTileAttention([[(0, tokens)]], tokens).tiles(tiles)
        assert tile_fraction(tokens, tiles, None) == max(e - s for s, e in cut) / tokens
        ring = RingTileAttention(None, [[(0, tokens)]], tokens).tiles(tiles)
        assert tile_fraction(tokens, tiles, "ring") == max(e - s for s, e in ring) / tokens
    cfg = load_config(None, ["model=llama-3.1-8b", "seq_len=1048576", "memory.tiled_layers=true"])
    from longfit.memory.switches import layer_tile_count

    # about one hidden row of the whole sequence per tile (29 for Llama-3.1-8B's widths), tiles of at most 8K
    # tokens on longer rows, of at least 512 tokens on shorter ones
    assert layer_tiles(resolve(cfg, 1)) == layer_tile_count(1048576, 4096, 14336) == 128
    assert layer_tile_count(131072, 4096, 14336) == 29 and layer_tile_count(4096, 4096, 14336) == 8


@pytest.mark.parametrize(
    "checkpoint_dtype,placement,extra",
    [
        ("fp8", (2, 0, 0), ()),
        # host placements, plain and compressed: slow (3-14 s each), for the default suite's 15 minutes
        pytest.param(None, (1, 1, 0), (), marks=pytest.mark.slow),
        pytest.param("fp8", (0, 2, 0), (), marks=pytest.mark.slow),
        pytest.param("bf16", (1, 1, 0), (), marks=pytest.mark.slow),
        (None, (0, 1, 1), ("memory.offload_dir=unused",)),  # a disk input reaches the GPU once read, one layer ahead
        # a layer without checkpointing prefetches nothing (slow, 14 s: a second trace key; .ci/run runs it)
        pytest.param(None, (0, 1, 0), ("memory.checkpoint_fraction=0.67",), marks=pytest.mark.slow),
    ],
)
def test_analytic_follows_the_placement_of_tiled_layer_inputs(monkeypatch, checkpoint_dtype, placement, extra):
    """In backward a layer's input is back on the GPU as a tensor of its own when it was offloaded or kept
    compressed, and a host or disk input is copied in one layer ahead (a checkpointed layer's prefetch): the analytic
    peak counts both, as the trace of the real step holds them. Three Llama-3.1-8B layers with a small vocabulary,
    so that the layer inputs (512 MiB each in bf16) are what the peak is made of; the first layer looks its
    input up again, so the placements are of the other two."""
    from longfit.memory.switches import CheckpointPlacement, stored_input_bytes
    from longfit.models.presets import PRESETS
    from longfit.plan.analytic import _simulate
    from longfit.plan.trace import trace_step

    monkeypatch.setitem(PRESETS, "llama-8b-layers", dict(PRESETS["llama-3.1-8b"], num_hidden_layers=3, vocab_size=1024))
    cfg = load_config(None, ["model=llama-8b-layers", "seq_len=65536", "lora.enabled=true", "memory.tiled_layers=true",
                             "memory.layer_tiles=4", "memory.offload_activations=true", *extra]
                      + ([f"memory.checkpoint_dtype={checkpoint_dtype}"] if checkpoint_dtype else []))
    s = resolve(cfg, 1)
    placement = CheckpointPlacement(*placement, stored_input_bytes(65536, 4096, 2, checkpoint_dtype))
    analytic = _simulate(s, None, placement, 0, None)
    traced = trace_step(cfg, 1, placement=placement)
    assert analytic.peak_event.startswith("backward") and traced.peak_phase == "backward"
    assert analytic.tensor_bytes == pytest.approx(traced.peak_bytes, rel=0.005)


@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_tiled_layers_store_every_input_but_the_first():
    """The plan places the items the offload store will be given: each checkpointed layer's input, one fewer under
    tiled layers, and beside each input its attention's output where memory.keep_attention keeps it (#53)."""
    overrides = ["model=llama-60m", "seq_len=16384", "memory.offload_activations=true"]
    assert plan_config(load_config(None, [*overrides, "memory.keep_attention=false"]), 1).placement.layers == 8
    assert plan_config(load_config(None, [*overrides, "memory.keep_attention=true"]), 1).placement.layers == 16
    assert plan_config(load_config(None, [*overrides, "memory.tiled_layers=true"]), 1).placement.layers == 7


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_planned_context_reaches_the_issue_targets():
    """Llama-3.1-8B on 80 GB H100s, analytic plan: LoRA on one GPU with 128 GiB of RAM past 1M tokens (fp8 inputs
    in host memory), full fine-tuning on one GPU with a 1 TiB host past 1M, ring CP on 8 GPUs past 8M (LoRA, fp8
    inputs on a 2 TiB disk); README's figures."""
    from longfit.plan.gpus import gpu_capacity
    from longfit.plan.search import STRATEGIES, max_context_table

    capacity = gpu_capacity("h100-80gb", None)[0]

    def longest(strategy: str, gpus: int, host: int, disk: int, *overrides: str) -> int:
        cfg = load_config(None, ["model=llama-3.1-8b", *overrides])
        chosen = [s for s in STRATEGIES if s.name == strategy]
        return max_context_table(cfg, [gpus], capacity, chosen, host, disk)[strategy][gpus][0]

    assert longest("FSDP, LoRA + offload fp8", 1, 128 * GiB, 2048 * GiB, "lora.enabled=true") == 1_181_696
    assert longest("FSDP + offload", 1, 1024 * GiB, 2048 * GiB) >= 1_000_000
    assert longest("FSDP + ring CP, LoRA + offload + disk fp8", 8, 128 * GiB, 2048 * GiB, "lora.enabled=true") >= 8_000_000


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kept_attention_is_planned_at_the_value_heads_width_the_run_keeps(tmp_path, dtype):
    """Multi-head latent attention keeps an output as wide as its value heads (v_head_dim), neither its query heads'
    (qk_nope + qk_rope) nor DeepSeek's `head_dim` (its rotary part): the plan's slot for a layer's kept attention
    (`attention_item_bytes`) is at the width the store's own slot takes (`memory.apply.kept_attention_slot`). Read at the head size, DeepSeek-V2-Lite's published config kept 66 MiB a layer at 32K where
    its layers keep 130 MiB (the plan's host memory 6.75 GiB, the traced step's 10.18)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.memory.apply import kept_attention_slot
    from longfit.memory.switches import kept_attention_bytes
    from longfit.plan.storage import attention_item_bytes

    AutoConfig.for_model("deepseek_v2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                         kv_lora_rank=16, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
                         n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                         vocab_size=384).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model={tmp_path}", "seq_len=4096", f"train.dtype={dtype}", "train.device=cuda",
                             "memory.activation_checkpointing=true", "memory.offload_activations=true",
                             "memory.keep_attention=true"])
    s = resolve(cfg, 1)
    assert s.shape.head_dim == 16 and s.shape.value_width() == 24
    itemsize = 4 if s.regime == "fp32" else 2
    assert attention_item_bytes(s) == kept_attention_bytes(4096, 4, 24, itemsize)
    with torch.device("meta"):  # the store's slot without a plan: its parameters' width (fp32) for the kernel's
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert kept_attention_slot(model, cfg) == kept_attention_bytes(4096, 4, s.shape.value_width(), 4)
