"""The offload store under pipeline parallelism: a slot per checkpointed layer and micro-batch in flight.

A pipelined step with memory.offload_activations (host slots, the disk tier, a GPU / host / disk mix) against the
plain one-process step (loss and every gradient) and against the same pipelined step without offload (bit for bit:
the store's round trips are raw bytes), on real gloo ranks, fp32 and train.dtype=bf16, with more micro-batches than
stages so that slots are reused; the store allocating exactly its placement and nothing beyond it; a backward reading
its own micro-batch's input whatever order the backwards run in; the planner's host and disk bytes per stage."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from memory_helpers import loss_sum, packed_batch  # noqa: E402
from memory_helpers import tiny_llama as memory_tiny_llama  # noqa: E402
from parallel_harness import run_distributed  # noqa: E402
from test_parallel_pipeline import micro_batch_rows, reference_step, tiny_llama  # noqa: E402

from longfit.config import Config, load_config
from longfit.memory.checkpointing import ActivationOffloader, apply_activation_checkpointing
from longfit.memory.offload import OffloadStore
from longfit.memory.switches import CheckpointPlacement, place_checkpoints, stored_input_bytes
from longfit.parallel.pipeline import micro_batches_in_flight

L, HIDDEN = 64, 64  # test_parallel_pipeline's rows and tiny Llama
MIN_OFFLOAD_BYTES = 1024  # a (1, 64, 64) layer input is 8-16 KiB, below the 1 MiB default


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str = "1f1b"
    micro_batches: int = 4
    layers: int = 4
    tiers: tuple[int, int, int] | None = None  # (device, host, disk) layers of each rank's placement; None: host only
    disk: bool = False  # memory.offload_dir (every input on disk when `tiers` is None)
    dtype: str = "fp32"
    overrides: tuple[str, ...] = ()

    def config(self, offload: bool, offload_dir: str) -> Config:
        return load_config(None, [
            f"seq_len={L}", "parallel.pp=2", f"parallel.pp_schedule={self.schedule}",
            f"train.grad_accum={self.micro_batches}", f"train.dtype={self.dtype}", "memory.tiled_mlp=false",
            "memory.activation_checkpointing=true", "memory.chunked_loss=true", "memory.loss_chunk=24",
            f"memory.offload_activations={str(offload).lower()}",
            *([f"memory.offload_dir={offload_dir}"] if self.disk and offload else []), *self.overrides,
        ])

    @property
    def tolerance(self) -> tuple[float, float]:
        return (1e-4, 1e-6) if self.dtype == "fp32" else (5e-2, 5e-3)


def _cases(name: str, **kwargs) -> list[Case]:
    return [Case(f"{name}-{dtype}", dtype=dtype, **kwargs) for dtype in ("fp32", "bf16")]


CASES = {
    # every stored input in host slots; 1F1B keeps 2 micro-batches in flight on stage 0, 1 on stage 1, of 4
    "1f1b-host": _cases("1f1b-host"),
    # every stored input on disk; GPipe keeps all 3 in flight
    "gpipe-disk": _cases("gpipe-disk", schedule="gpipe", micro_batches=3, disk=True),
    # the last layer kept on the GPU, the middle one in host slots, the first on disk: 3 layers per stage
    "1f1b-mixed": _cases("1f1b-mixed", layers=6, tiers=(1, 1, 1), disk=True),
    # a rank holding two stages: a layer's backward prefetches its own stage's and micro-batch's previous layer
    "interleaved-1f1b-host": _cases("interleaved-1f1b-host", schedule="interleaved_1f1b", layers=4),
    # zero bubble: each input loaded twice (the input gradient, later the weight gradient)
    "zbv-mixed": _cases("zbv-mixed", schedule="zbv", layers=8, tiers=(1, 1, 2), disk=True,
                        overrides=("parallel.reshard_after_forward=false",)),
}


def _placement(case: Case, stored: int, in_flight: int, itemsize: int) -> CheckpointPlacement | None:
    if case.tiers is None:
        return None
    device, host, disk = case.tiers
    assert device + host + disk == stored, (case.tiers, stored)
    return CheckpointPlacement(device, host, disk, stored_input_bytes(L, HIDDEN, itemsize, None), in_flight)


def pipelined_step(mesh, case: Case, batches, offload: bool, offload_dir: str):
    """Loss, full gradients and (with offload) the rank's offload store after one pipelined step of `case`."""
    from longfit.memory import apply
    from longfit.memory.loss import CausalLMLoss
    from longfit.models.loading import compute_dtype
    from longfit.models.structure import decoder_layers
    from longfit.parallel.batch import global_valid_tokens
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import PIPELINE_SCHEDULES, ParallelDims
    from longfit.parallel.parallelize import parallelize
    from longfit.parallel.pipeline import Pipeline, rank_stages, stage_layers

    cfg = case.config(offload, offload_dir)
    model = tiny_llama(layers=case.layers)
    config = model.config
    dims = ParallelDims.from_config(cfg, 2, config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                                    intermediate_size=config.intermediate_size, text_config=config)
    dtype = compute_dtype(cfg.train.dtype, torch.device("cpu"))
    cut = stage_layers(case.layers, dims.pipeline_stages)
    held = rank_stages(mesh.pp_rank, 2, dims.pp_stages_per_rank, PIPELINE_SCHEDULES[case.schedule][1])
    stored = sum(len(cut[s]) for s in held)
    in_flight = micro_batches_in_flight(case.schedule, 2, mesh.pp_rank, case.micro_batches)
    placement = _placement(case, stored, in_flight, dtype.itemsize) if offload else None
    stage = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh, checkpoint_placement=placement)
    assert len(decoder_layers(stage.model)) == stored
    pipeline = Pipeline(stage, cfg, mesh, torch.device("cpu"), dtype)
    valid = global_valid_tokens([b.labels for b in batches], mesh.world_group)
    loss = all_reduce_sum(pipeline.step(batches, valid), mesh.world_group) / valid
    grads = {name: param.grad.full_tensor() for name, param in stage.model.named_parameters() if param.grad is not None}
    offloaders = apply.offloaders(stage.model)
    assert len(offloaders) == (1 if offload else 0)
    return loss, grads, offloaders[0] if offload else None, in_flight


def offload_worker(rank: int, world_size: int, run: str, offload_dir: str) -> dict:
    from longfit.memory import apply
    from longfit.parallel.dims import ParallelDims

    apply.ActivationOffloader = functools.partial(ActivationOffloader, min_offload_bytes=MIN_OFFLOAD_BYTES)
    mesh = ParallelDims(dp_shard=1, cp=1, world_size=world_size, pp=2).build_mesh("cpu")
    results = {}
    for case in CASES[run]:
        batches = micro_batch_rows(0, case.micro_batches)
        ref_loss, ref_grads, _ = reference_step(batches, "llama", False, [], case.layers)
        plain_loss, plain_grads, _, _ = pipelined_step(mesh, case, batches, False, offload_dir)
        loss, grads, offloader, in_flight = pipelined_step(mesh, case, batches, True, f"{offload_dir}/{rank}")
        rtol, atol = case.tolerance
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=f"{case.name}: loss")
        assert torch.equal(loss, plain_loss), f"{case.name}: loss {loss} != {plain_loss} without offload"
        assert sorted(grads) == sorted(plain_grads) and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=rtol, atol=atol, msg=f"{case.name}: grad {name}")
            assert torch.equal(grad, plain_grads[name]), f"{case.name}: grad {name} differs without offload"
        store, stats = offloader.store, offloader.store.stats
        placement = store.placement
        results[case.name] = dict(
            grads=sorted(grads), in_flight=in_flight, placement=placement, unplanned=stats.unplanned_bytes,
            host=stats.host_bytes, disk=stats.disk_written_bytes, device=offloader.stats.device_tensors,
            offloaded=offloader.stats.offloaded_tensors, allocated=store.allocated_host_bytes,
            disk_file=store.disk.fd is not None if store.disk is not None else False,
        )
        store.close()
    return results


def check_offload_run(run: str, tmp_path) -> None:
    results = run_distributed(offload_worker, 2, run, str(tmp_path))
    for case in CASES[run]:
        per_rank = [r[case.name] for r in results]
        assert sorted(p for r in per_rank for p in r["grads"]) == sorted(set(p for r in per_rank for p in r["grads"]))
        for rank, got in enumerate(per_rank):
            placement = got["placement"]
            where = f"{case.name} rank {rank}"
            assert placement.in_flight == got["in_flight"], where
            assert got["unplanned"] == 0, f"{where}: {got['unplanned']} bytes beyond the planned slots"
            assert got["allocated"] == placement.host_bytes, where  # exactly the placement's arena
            # every micro-batch's input of every layer was stored, each in its layer's tier
            assert got["device"] == placement.device * case.micro_batches, where
            assert got["offloaded"] == (placement.host + placement.disk) * case.micro_batches, where
            assert (got["host"] > 0) == (placement.host > 0) and (got["disk"] > 0) == (placement.disk > 0), where
        in_flight = [r["in_flight"] for r in per_rank]
        if case.schedule == "1f1b":
            assert in_flight == [2, 1], case.name
        else:
            assert in_flight == [case.micro_batches] * 2, case.name


@pytest.mark.slow  # 2 gloo ranks, a pipelined step of each case with and without offload (20-45 s each run)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["1f1b-host", "gpipe-disk", "1f1b-mixed", "interleaved-1f1b-host", "zbv-mixed"])
def test_a_pipelined_step_with_offload_matches_one_process(run, tmp_path):
    check_offload_run(run, tmp_path)


# -- the store on one process ------------------------------------------------------------------------------------


def _micro_batch(seed: int):
    """memory_helpers' packed rows with the token ids and labels of `seed`."""
    inputs, labels = packed_batch()
    g = torch.Generator().manual_seed(seed)
    inputs["input_ids"] = torch.randint(0, 384, labels.shape, generator=g)
    labels = torch.where(labels == -100, labels, torch.randint(0, 384, labels.shape, generator=g))
    return inputs, labels


def _input_gradients(model, inputs: list, order: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Each micro-batch's gradients, its forward run first for all of them, its backward in `order`."""
    losses = []
    for batch in inputs:
        ids, labels = batch
        losses.append(loss_sum(model, labels, None, **ids) / (labels != -100).sum())
    grads = {}
    for m in order:
        model.zero_grad(set_to_none=True)
        losses[m].backward()
        grads[m] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads


@pytest.mark.parametrize("offload_dir", [False, True], ids=["host", "disk"])
def test_each_backward_reads_its_own_micro_batchs_input_in_any_order(tmp_path, offload_dir, one_thread):
    """Three forwards, then their backwards out of order: each backward's gradients are those of its own micro-batch
    (a slot per layer and micro-batch in flight, the handle remembering its slot; the previous layer prefetched from
    the same forward pass), and nothing goes beyond the planned slots."""
    layers, in_flight = 3, 3
    inputs = [_micro_batch(seed) for seed in range(in_flight)]
    model = memory_tiny_llama(layers=layers)
    apply_activation_checkpointing(model, 1.0)
    reference = _input_gradients(model, inputs, [0, 1, 2])

    model = memory_tiny_llama(layers=layers)
    slot = stored_input_bytes(inputs[0][0]["input_ids"].numel(), model.config.hidden_size, 4, None)
    placement = place_checkpoints(layers, slot, device_budget=0, host_budget=None, in_flight=in_flight)
    if offload_dir:
        placement = CheckpointPlacement(0, 1, 2, slot, in_flight)  # the first two layers on disk, the last on the host
    store = OffloadStore(placement, offload_dir=str(tmp_path) if offload_dir else None)
    offloader = ActivationOffloader(min_offload_bytes=MIN_OFFLOAD_BYTES, store=store)
    apply_activation_checkpointing(model, 1.0, offloader=offloader)
    got = _input_gradients(model, inputs, [2, 0, 1])
    for m in range(in_flight):
        for name, grad in reference[m].items():
            assert torch.equal(got[m][name], grad), f"micro-batch {m}: {name}"
    assert store.stats.unplanned_bytes == 0
    assert offloader.stats.offloaded_tensors == layers * in_flight
    assert store.allocated_host_bytes == placement.host_bytes
    store.close()


def test_inputs_beyond_the_slots_in_flight_go_to_unplanned_buffers_never_over_a_stored_one(one_thread):
    """One slot per layer (in_flight=1) and two forwards before their backwards: the second micro-batch's inputs go
    to plain host tensors, and both backwards still read their own."""
    layers = 2
    inputs = [_micro_batch(seed) for seed in range(2)]
    model = memory_tiny_llama(layers=layers)
    apply_activation_checkpointing(model, 1.0)
    reference = _input_gradients(model, inputs, [1, 0])
    model = memory_tiny_llama(layers=layers)
    slot = stored_input_bytes(inputs[0][0]["input_ids"].numel(), model.config.hidden_size, 4, None)
    store = OffloadStore(CheckpointPlacement(0, layers, 0, slot))
    offloader = ActivationOffloader(min_offload_bytes=MIN_OFFLOAD_BYTES, store=store)
    apply_activation_checkpointing(model, 1.0, offloader=offloader)
    got = _input_gradients(model, inputs, [1, 0])
    assert all(torch.equal(got[m][n], reference[m][n]) for m in (0, 1) for n in reference[m])
    assert store.stats.unplanned_bytes == store.stats.host_bytes > 0  # one micro-batch in slots, one beyond them
    store.close()


def test_placement_gives_each_layer_a_slot_per_micro_batch_in_flight():
    assert place_checkpoints(4, 100, device_budget=250, host_budget=None, in_flight=2) == CheckpointPlacement(1, 3, 0, 100, 2)
    placement = place_checkpoints(4, 100, host_budget=600, disk=True, in_flight=2)
    # 6 slots of host budget: 2 staging, then 2 layers x 2 micro-batches; the other 2 layers on disk
    assert placement == CheckpointPlacement(0, 2, 2, 100, 2)
    assert (placement.host_bytes, placement.disk_bytes) == (600, 400)
    assert CheckpointPlacement(1, 0, 0, 100, 3).device_bytes == 300


@pytest.mark.parametrize("schedule, accum, expected", [
    ("1f1b", 4, [4, 3, 2, 1]), ("1f1b", 8, [4, 3, 2, 1]), ("1f1b", 3, [3] * 4),  # 3 < pp: run as GPipe
    ("gpipe", 3, [3] * 4), ("interleaved_1f1b", 8, [8] * 4), ("zbv", 8, [8] * 4),
])
def test_micro_batches_in_flight_follow_the_schedule(schedule, accum, expected):
    assert [micro_batches_in_flight(schedule, 4, stage, accum) for stage in range(4)] == expected


# -- the planner and the trainer ---------------------------------------------------------------------------------

WIDE_SEQ_LEN = 1024  # a (1, 1024, 256) fp32 layer input is 1 MiB: offloaded at the default min_offload_bytes


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama of width 256 written by transformers, with the byte tokenizer: 1 MiB layer inputs at 1K tokens."""
    from transformers import AutoModelForCausalLM

    from longfit.data.tokenizer import byte_tokenizer
    from longfit.models.presets import preset_config

    path = tmp_path_factory.mktemp("wide-llama")
    config = preset_config("llama-tiny")
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 256, 512, 2
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def planned_store_worker(rank: int, world_size: int, overrides: list[str], placements: list) -> dict:
    """The trainer's stage of this rank with its stage's planned placement, one pipelined step: the store afterwards."""
    import os

    from longfit.data.packing import PackedBatch
    from longfit.memory.apply import offloaders
    from longfit.memory.loss import CausalLMLoss
    from longfit.models.build import build_model
    from longfit.parallel.batch import global_valid_tokens
    from longfit.parallel.parallelize import parallelize
    from longfit.parallel.pipeline import Pipeline
    from longfit.plan.setup import resolve

    cfg = load_config(None, overrides)
    dims = resolve(cfg, world_size, "cpu").dims
    mesh = dims.build_mesh("cpu")
    model = build_model(cfg, torch.float32, "meta", dims.fsdp_enabled)
    stage = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh, device="cpu",
                        checkpoint_placement=placements[mesh.pp_rank])
    pipeline = Pipeline(stage, cfg, mesh, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    batches = [PackedBatch(torch.randint(0, 256, (1, WIDE_SEQ_LEN), generator=g),
                           torch.randint(0, 256, (1, WIDE_SEQ_LEN), generator=g),
                           torch.arange(WIDE_SEQ_LEN)[None], None, WIDE_SEQ_LEN) for _ in range(cfg.train.grad_accum)]
    store = offloaders(stage.model)[0].store
    allocated = []
    original = store._plan

    def planned(tensor):  # the arena and the file as allocated, before `close` gives them back
        placement = original(tensor)
        allocated.append((store.allocated_host_bytes, os.fstat(store.disk.fd).st_size if store.disk else 0))
        return placement

    store._plan = planned
    pipeline.step(batches, global_valid_tokens([b.labels for b in batches], mesh.world_group))
    result = dict(allocated=allocated[0], unplanned=store.stats.unplanned_bytes, placement=store.placement,
                  host=store.stats.host_bytes, disk=store.stats.disk_written_bytes)
    store.close()
    return result


@pytest.mark.slow  # 2 gloo ranks, a pipelined step of 3 micro-batches of 1K tokens (about 15 s)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_stage_allocates_the_host_and_disk_its_plan_reports(wide_model_dir, tmp_path, schedule):
    """Host memory for 2 slots per rank beyond its reserve: under 1F1B stage 0 keeps its layer's input of 2
    micro-batches in flight in 2 host slots, stage 1 of 1 in 1; under GPipe each holds 3 micro-batches, which go to
    disk (3 regions, the 2 staging slots in the arena). Each rank's store allocates exactly its stage's planned bytes."""
    from longfit.plan.analytic import plan_config
    from longfit.plan.storage import HOST_RESERVE_BYTES

    slot = stored_input_bytes(WIDE_SEQ_LEN, 256, 4, None)
    overrides = [f"model={wide_model_dir}", f"seq_len={WIDE_SEQ_LEN}", "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                 "train.grad_accum=3", "train.dtype=fp32", "memory.tiled_mlp=false", "memory.offload_activations=true",
                 f"memory.offload_dir={tmp_path}"]
    plan = plan_config(load_config(None, overrides), 2, device_type="cpu",
                       host_memory_bytes=2 * (HOST_RESERVE_BYTES + 2 * slot), disk_bytes=1 << 40)
    placements = [stage.placement for stage in plan.stages]
    if schedule == "1f1b":
        assert placements == [CheckpointPlacement(0, 1, 0, slot, 2), CheckpointPlacement(0, 1, 0, slot, 1)]
        assert [stage.host_bytes for stage in plan.stages] == [2 * slot, slot]
    else:
        assert placements == [CheckpointPlacement(0, 0, 1, slot, 3)] * 2
        assert [(stage.host_bytes, stage.disk_bytes) for stage in plan.stages] == [(2 * slot, 3 * slot)] * 2
    assert plan.host_bytes == max(stage.host_bytes for stage in plan.stages) and plan.fits
    assert plan.disk_bytes == max(stage.disk_bytes for stage in plan.stages)
    results = run_distributed(planned_store_worker, 2, overrides, placements)
    for rank, (result, stage) in enumerate(zip(results, plan.stages, strict=True)):
        assert result["placement"] == stage.placement, rank
        assert result["allocated"] == (stage.host_bytes, stage.disk_bytes), rank
        assert result["unplanned"] == 0, rank
        assert result["host"] + result["disk"] == 3 * WIDE_SEQ_LEN * 256 * 4, rank  # each micro-batch's input stored


def longfit(*args: str):
    import subprocess

    return subprocess.run([sys.executable, "-m", "longfit", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # two `longfit train` runs, one of them on 2 torchrun ranks (about a minute on 2 cores)
@pytest.mark.timeout(900)
def test_longfit_train_pp2_with_offload_logs_the_one_process_losses(wide_model_dir, corpus, tmp_path):
    import json

    common = [f"model={wide_model_dir}", f"data.path={corpus}", f"seq_len={WIDE_SEQ_LEN}", "train.device=cpu",
              "train.steps=3", "train.warmup_steps=1", "train.lr=1e-2", "train.micro_batch=1", "train.grad_accum=3",
              "train.dtype=fp32", "memory.tiled_mlp=false", "train.export=false"]
    single = longfit("train", *common, f"output_dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr[-3000:]
    piped = longfit("train", "--nproc", "2", *common, f"output_dir={tmp_path / 'pp2'}", "parallel.pp=2",
                    "memory.offload_activations=true", f"memory.offload_dir={tmp_path / 'offload'}")
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert "checkpointing 2/2 layers offloaded to host" in piped.stdout and "pp 2 (1f1b)" in piped.stdout

    def losses(out):
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert len(losses(tmp_path / "pp2")) == 3
    assert losses(tmp_path / "pp2") == pytest.approx(losses(tmp_path / "single"), rel=1e-4, abs=1e-4)


def test_a_layer_prefetches_the_previous_layer_of_its_own_forward_pass():
    """A rank holding two stages runs stage 2's layers (positions 2, 3) for micro-batch 1 right after stage 0's
    (0, 1) for micro-batch 0; each stage forward starts a pass (`start_pass`, as PipelineStageLoss.forward does), so
    stage 2's backward prefetches its layer 2 only, never micro-batch 0's layer 1, which stage 0's backward needs
    later."""
    from torch.utils.checkpoint import checkpoint

    offloader = ActivationOffloader(min_offload_bytes=0, store=OffloadStore(layers=4, in_flight=2))

    def layer(index: int, hidden: torch.Tensor) -> torch.Tensor:
        with offloader.layer_scope(index):
            return checkpoint(torch.sin, hidden, use_reentrant=False)

    inputs = [torch.randn(32, 64, requires_grad=True) for _ in range(2)]
    offloader.start_pass()
    stage_0 = layer(1, layer(0, inputs[0]))
    offloader.start_pass()
    stage_2 = layer(3, layer(2, inputs[1]))
    stage_2.sum().backward()
    assert offloader.stats.prefetched_tensors == 1  # layer 2's input, by layer 3
    stage_0.sum().backward()
    assert offloader.stats.prefetched_tensors == 2  # layer 0's, by layer 1
    for x in inputs:
        torch.testing.assert_close(x.grad, torch.cos(torch.sin(x)) * torch.cos(x), rtol=0, atol=0)
    assert offloader.store.stats.unplanned_bytes == 0
    offloader.store.close()


def traced_stage_worker(rank: int, world_size: int, overrides: list[str], placements: list) -> tuple:
    from longfit.plan.trace import trace_pipeline_step

    # with pp ranks only, rank r holds stage r
    traced = trace_pipeline_step(load_config(None, overrides), placement=placements[rank])
    return traced.peak_bytes, traced.peak_phase, traced.host_peak_bytes, traced.disk_bytes


@pytest.mark.slow  # real pipelined steps on 2 gloo ranks, about a minute each on 2 CPU cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("extra", [(), ("memory.offload_dir=.", "train.dtype=bf16")], ids=["host-fp32", "disk-bf16"])
def test_each_stage_with_offload_is_planned_within_tolerance_of_a_pipelined_step(extra):
    """`longfit plan`'s stage peaks with the offload store (every in-flight micro-batch's layer inputs in host memory,
    or with a host memory of 2 slots per rank on disk) against each rank's traced step with its stage's placement:
    the GPU peak within the planner's tolerance, the host arena and the disk file exactly the plan's."""
    from longfit.plan.accuracy import TOLERANCE
    from longfit.plan.analytic import plan_config
    from longfit.plan.storage import HOST_RESERVE_BYTES, slot_bytes

    overrides = ["model=llama-tiny", "seq_len=4096", "parallel.pp=2", "train.grad_accum=4", "train.dtype=fp32",
                 "memory.tiled_mlp=false", "memory.offload_activations=true", *extra]
    cfg = load_config(None, overrides)
    host = None
    if extra:
        from longfit.plan.setup import resolve

        host = 2 * (HOST_RESERVE_BYTES + 2 * slot_bytes(resolve(cfg, 2)))
    plan = plan_config(cfg, 2, host_memory_bytes=host, disk_bytes=1 << 40)
    cut = [len(p.stage.layers) for p in plan.stages]
    placements = [p.placement for p in plan.stages]
    assert all(p.host + p.disk == p.layers and p.layers for p in placements)
    if extra:
        assert placements[0].disk and placements[0].in_flight == 2
    measured = run_distributed(traced_stage_worker, 2, [*overrides, f"parallel.pp_layers={cut}".replace(" ", "")],
                               placements)
    rows = []
    for stage, (traced, phase, host_peak, disk) in zip(plan.stages, measured, strict=True):
        rows.append(f"stage {stage.stage.index}: planned {stage.tensor_bytes / 2**20:.1f} MiB at {stage.peak_event}, "
                    f"traced {traced / 2**20:.1f} MiB in {phase} ({stage.tensor_bytes / traced - 1:+.1%}); host "
                    f"{stage.host_bytes} planned, {host_peak} traced; disk {stage.disk_bytes} planned, {disk} traced")
        assert (host_peak, disk) == (stage.host_bytes, stage.disk_bytes), rows[-1]
        assert abs(stage.tensor_bytes / traced - 1) <= TOLERANCE, rows[-1]
    print("; ".join(rows))
