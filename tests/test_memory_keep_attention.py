"""Attention kept through the checkpointed recompute (#53): one attention kernel per layer and step, loss and every
gradient those of the run that recomputes it.

A checkpointed layer with memory.keep_attention keeps its attention's output and logsumexp beside its input, in the
offload store (host, disk, GPU) or on the device, and its recompute takes them back instead of running the kernel:
the CPU attention kernel (aten's flash kernel for CPU, which the block engine and SDPA both run) is counted, forward
and backward, on a tiny Llama over packed documents; the attention variants (softcap and windows, sinks, latent
widths, chunked layers, Gemma 4's per-layer heads and shared keys) against the same run without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from memory_helpers import loss_sum, packed_batch, tiny_llama  # noqa: E402
from parallel_harness import run_distributed  # noqa: E402

from longfit.config import ConfigError, load_config
from longfit.memory.apply import apply_memory_techniques
from longfit.memory.switches import kept_attention_bytes, resolve_memory_switches
from longfit.parallel.tiled_attention import LocalTileAttention

LAYERS, B, L, HEADS, HEAD_DIM, DOCUMENTS = 4, 2, 48, 4, 16, 3  # packed_batch: 20 + 28 tokens, 48
ATTENTION_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class KernelCalls(TorchDispatchMode):
    """How many times the CPU attention kernel ran, forward and backward."""

    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forward += func is ATTENTION_FORWARD
        self.backward += func is ATTENTION_BACKWARD
        return func(*args, **(kwargs or {}))


def memory_config(keep: bool, offload: str | None, tmp_path: Path):
    overrides = [f"seq_len={L}", f"train.micro_batch={B}", "memory.tiled_mlp=false", "memory.tiled_layers=false",
                 f"memory.keep_attention={str(keep).lower()}",
                 f"memory.offload_activations={str(offload is not None).lower()}"]
    if offload == "disk":
        overrides.append(f"memory.offload_dir={tmp_path}")
    return load_config(None, overrides)


def step(keep: bool, offload: str | None, dtype: torch.dtype, tmp_path: Path):
    model = tiny_llama(layers=LAYERS).to(dtype)
    applied = apply_memory_techniques(model, memory_config(keep, offload, tmp_path), "cpu")
    if applied.offloader is not None:
        applied.offloader.min_offload_bytes = 1024  # the tiny layer inputs go to the store too
    inputs, labels = packed_batch()
    with KernelCalls() as calls:
        loss = loss_sum(model, labels, None, **inputs)
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, calls, applied


SLOW = pytest.mark.slow  # the rest of the matrix: 5 s each on the 2-core machine


@pytest.mark.parametrize("offload, dtype", [
    (None, torch.float32), ("host", torch.bfloat16), ("disk", torch.float32),
    pytest.param(None, torch.bfloat16, marks=SLOW), pytest.param("host", torch.float32, marks=SLOW),
    pytest.param("disk", torch.bfloat16, marks=SLOW),
], ids=["device-fp32", "host-bf16", "disk-fp32", "device-bf16", "host-fp32", "disk-bf16"])
def test_kept_attention_runs_once_and_changes_no_gradient(tmp_path, offload, dtype):
    loss, grads, calls, _ = step(False, offload, dtype, tmp_path)
    kept_loss, kept_grads, kept_calls, applied = step(True, offload, dtype, tmp_path)
    # without it the recompute runs attention's forward a second time; with it, once (the backward runs once in both):
    # one kernel call per document
    assert (calls.forward, calls.backward) == (2 * LAYERS * DOCUMENTS, LAYERS * DOCUMENTS)
    assert (kept_calls.forward, kept_calls.backward) == (LAYERS * DOCUMENTS, LAYERS * DOCUMENTS)
    # the same kernels on the same inputs: bit for bit
    assert torch.equal(kept_loss, loss)
    assert kept_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(kept_grads[name], grad), name
    if offload is not None:
        store, stats = applied.offloader.store, applied.offloader.stats
        kept = B * HEADS * L * (4 + HEAD_DIM * dtype.itemsize)  # lse fp32, then the output
        inputs = B * L * HEADS * HEAD_DIM * dtype.itemsize
        assert stats.offloaded_tensors == 2 * LAYERS and stats.offloaded_bytes == LAYERS * (inputs + kept)
        assert stats.reloaded_bytes == stats.offloaded_bytes
        assert stats.prefetched_tensors == 2 * (LAYERS - 1)  # each layer's input and attention, the last on demand
        assert store.stats.unplanned_bytes == 0  # slots sized for the larger of the two
        assert store.placement.slot_bytes == kept_attention_bytes(B * L, HEADS, HEAD_DIM, dtype.itemsize)
        tier = "disk_written_bytes" if offload == "disk" else "host_bytes"
        assert getattr(store.stats, tier) == LAYERS * (inputs + kept)


@pytest.mark.usefixtures("one_thread")
def test_a_second_backward_of_a_retained_graph_takes_the_kept_attention_again(tmp_path):
    """Each recompute of a kept layer (a retained graph backward twice, as zero bubble's weight gradient after its
    input gradient) takes the layer's attention results from the first call again: the same gradients as the
    recomputing run, and no attention kernel in either recompute."""
    def twice(keep: bool):
        model = tiny_llama(layers=2)
        applied = apply_memory_techniques(model, memory_config(keep, "host", tmp_path), "cpu")
        applied.offloader.min_offload_bytes = 1024
        inputs, labels = packed_batch()
        with KernelCalls() as calls:
            loss = loss_sum(model, labels, None, **inputs)
            loss.backward(retain_graph=True)
            loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}, calls

    grads, calls = twice(False)
    kept_grads, kept_calls = twice(True)
    assert (calls.forward, calls.backward) == (3 * 2 * DOCUMENTS, 2 * 2 * DOCUMENTS)  # two recomputes, two backwards
    assert (kept_calls.forward, kept_calls.backward) == (2 * DOCUMENTS, 2 * 2 * DOCUMENTS)
    for name, grad in grads.items():
        assert torch.equal(kept_grads[name], grad), name


def test_the_setting_is_resolved_and_refused_where_it_cannot_apply():
    def resolve(device, *overrides, fits=True):
        cfg = load_config(None, ["seq_len=131072", "memory.tiled_layers=false", *overrides])
        return resolve_memory_switches(cfg, device, 32000, keep_attention_fits=fits).keep_attention

    assert resolve("cuda") and not resolve("cpu")  # auto: on CUDA, the recomputation trades stay off on CPU
    assert not resolve("cuda", fits=False)  # the plan says it would shorten the longest context that fits
    assert resolve("cpu", "memory.keep_attention=true") and not resolve("cuda", "memory.keep_attention=false")
    assert not resolve("cuda", "memory.tiled_layers=true")  # tiled layers recompute attention tile by tile
    with pytest.raises(ConfigError, match="memory.activation_checkpointing=true"):
        resolve("cuda", "memory.keep_attention=true", "memory.activation_checkpointing=false",
                "memory.offload_activations=false", "memory.tiled_layers=false")
    with pytest.raises(ConfigError, match="memory.tiled_layers=false"):
        resolve("cuda", "memory.keep_attention=true", "memory.tiled_layers=true")


def family_step(variant: str, keep: bool, tmp_path: Path):
    """longfit's objective on the attention variant `variant` (tests/test_families_attention.py) with every layer
    checkpointed and its input on disk, attention kept or not."""
    from test_families import L as FAMILY_L
    from test_families import make_batch
    from test_families_attention import build

    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.attention import register_attention

    model = build(variant, register_attention())
    cfg = load_config(None, [f"seq_len={FAMILY_L}", "memory.tiled_mlp=false", "memory.tiled_layers=false",
                             "memory.offload_activations=true", f"memory.offload_dir={tmp_path}",
                             f"memory.keep_attention={str(keep).lower()}"])
    apply_memory_techniques(model, cfg, "cpu", None, tile_attention=LocalTileAttention.for_sequence)
    batch = make_batch(packed=True)
    with KernelCalls() as calls:
        loss = batch_loss_sum(CausalLMLoss(model, chunked_loss=True, loss_chunk=24), batch) / batch.num_label_tokens
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, calls


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", ["gemma2-softcap", "gpt-oss-sinks", "deepseek-v3-mla", "gemma4-per-layer",
                                     "llama4-chunked"])
def test_every_attention_variant_keeps_its_attention_exactly(tmp_path, variant):
    loss, grads, calls = family_step(variant, False, tmp_path)
    kept_loss, kept_grads, kept_calls = family_step(variant, True, tmp_path)
    assert kept_calls.backward == calls.backward
    # the capped block kernel is no aten kernel: Gemma 2's softcapped layers are counted by the loss alone
    assert kept_calls.forward == calls.forward - calls.backward
    assert torch.equal(kept_loss, loss)
    assert kept_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert (grad is None) == (kept_grads[name] is None), name
        if grad is not None:
            assert torch.equal(kept_grads[name], grad), f"{variant}: {name}"


CP_CASES = {  # name: (model, cp method, documents of the row, config overrides)
    "ring": ("llama", "ring", [17, 47], ()),
    "ring-bf16-host": ("llama", "ring", [30, 34], ("train.dtype=bf16", "memory.offload_activations=true")),
    "ulysses-host": ("llama", "ulysses", [33, 31], ("memory.offload_activations=true",)),
    # softcap and the sliding window's halo exchange, which the recompute runs again (its backward reads the halo)
    "ring-gemma2-window": ("gemma2-softcap", "ring", [30, 34], ()),
    "ulysses-gemma2-window": ("gemma2-softcap", "ulysses", [64], ()),
}


def cp_step(mesh, variant: str, method: str, docs: list[int], overrides: tuple[str, ...], keep: bool):
    """One cp=2 step through `parallelize` of test_parallel_model's tiny Llama or a tiny attention variant of
    test_families_attention, every layer checkpointed: loss, every gradient (full tensors), the attention kernel's
    calls, the step's counted FLOPs on this rank and those run inside the attention function."""
    from test_families_attention import build
    from test_parallel_model import L as CP_L
    from test_parallel_model import make_batch, tiny_llama

    from longfit.bench.keep_attention import AttentionFlops, flop_counter
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.attention import register_attention
    from longfit.models.loading import compute_dtype
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.comm import all_reduce_sum
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    cfg = load_config(None, [f"seq_len={CP_L}", "parallel.cp=2", f"parallel.cp_method={method}", "train.dtype=fp32",
                             "memory.tiled_mlp=false", "memory.tiled_layers=false", "memory.chunked_loss=false",
                             f"memory.keep_attention={str(keep).lower()}", *overrides])
    model = tiny_llama() if variant == "llama" else build(variant, register_attention())
    if cfg.train.dtype == "bf16":
        model = model.to(compute_dtype("bf16", torch.device("cpu")))
    dims = ParallelDims.from_config(cfg, 2, model.config.num_attention_heads)
    loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh)
    shard = shard_batch(make_batch(1, [docs], seed=10), mesh.cp_rank, dims.cp, cp_layout(method))
    count = global_valid_tokens(shard.labels, mesh.world_group)
    with KernelCalls() as calls, flop_counter() as flops, AttentionFlops() as attention:
        local_sum = batch_loss_sum(loss_module, shard)
        (local_sum / count).backward()
    loss = all_reduce_sum(local_sum.detach().clone(), mesh.world_group) / count
    grads = {name: p.grad.full_tensor() for name, p in loss_module.model.named_parameters() if p.grad is not None}
    return loss, grads, (calls.forward, calls.backward), flops.get_total_flops(), attention.flops


def cp_worker(rank: int, world_size: int) -> dict:
    from longfit.parallel.dims import ParallelDims

    mesh = ParallelDims(dp_shard=1, cp=2, world_size=world_size).build_mesh("cpu")
    results = {}
    for name, case in CP_CASES.items():
        loss, grads, calls, flops, attention = cp_step(mesh, *case, keep=False)
        kept_loss, kept_grads, kept_calls, kept_flops, kept_attention = cp_step(mesh, *case, keep=True)
        assert torch.equal(kept_loss, loss), name
        assert kept_grads.keys() == grads.keys(), name
        for param, grad in grads.items():
            assert torch.equal(kept_grads[param], grad), f"{name}: {param}"
        results[name] = (calls, kept_calls, flops, kept_flops, attention, kept_attention)
    return results


@pytest.mark.slow  # 60-115 s on the 2-core machine (two spawned ranks, ten steps)
@pytest.mark.timeout(600)
def test_ring_and_ulysses_keep_attention_exactly():
    """cp=2 on gloo ranks (the ring over zigzag shards, with a sliding window's halo exchange and softcap; Ulysses), fp32
    and bf16, on the device and offloaded to the host: the kept run's loss and every gradient are the recomputing
    run's, bit for bit; its recompute runs no attention kernel, and its step counts exactly attention's forward fewer
    FLOPs (what the attention function ran in forward, which the recomputing run ran twice)."""
    for rank in run_distributed(cp_worker, 2):
        for name, (calls, kept_calls, flops, kept_flops, attention, kept_attention) in rank.items():
            assert calls[0] == 2 * kept_calls[0] and kept_calls[1] == calls[1], (name, calls, kept_calls)
            assert attention == 2 * kept_attention > 0, name  # forward and recompute; kept: forward only
            assert flops - kept_flops == kept_attention, name


@pytest.mark.slow  # 35-45 s on the 2-core machine: eight plans, their layer traces
def test_the_plan_counts_kept_attention_per_tier_and_its_flops():
    """llama-tiny at 16K on one GPU, inputs offloaded: each checkpointed layer stores two items (its input, its kept
    attention) in slots sized for the larger; the step's hardware FLOPs drop by attention's forward; and where only
    dropping it fits, auto drops it (and preflight's config says so)."""
    import dataclasses

    from longfit.plan.analytic import plan_config, plan_run
    from longfit.plan.flops import attended_keys, step_flops
    from longfit.plan.report import plan_text
    from longfit.plan.storage import attention_item_bytes

    def planned(keep: str, capacity=None):
        cfg = load_config(None, ["model=llama-tiny", "seq_len=16384", "memory.offload_activations=true",
                                 "memory.tiled_layers=false", "memory.tiled_mlp=false", f"memory.keep_attention={keep}"])
        return plan_config(cfg, 1, capacity)

    kept, recomputed = planned("true"), planned("false")
    s = kept.setup
    assert s.keep_attention and not recomputed.setup.keep_attention
    item = attention_item_bytes(s)
    assert item == kept_attention_bytes(16384, 4, 64, 2)  # autocast: bf16 output of 4 heads of 64, fp32 lse
    assert kept.placement.layers == 2 * recomputed.placement.layers == 2 * s.checkpointed
    assert kept.placement.slot_bytes == max(item, recomputed.placement.slot_bytes)
    assert kept.host_bytes > recomputed.host_bytes  # every item on the host: no GPU memory given
    flops = [step_flops(s.shape, 16384, keep_attention=keep) for keep in (True, False)]
    attention = 4.0 * s.shape.q_dim * attended_keys(16384, None) * s.shape.layers
    assert flops[0].model == flops[1].model and flops[1].hardware - flops[0].hardware == pytest.approx(attention)
    text = plan_text(kept, None)
    assert "attention kept through the recompute" in text and f"hardware {flops[0].hardware:.3g}" in text
    # a GPU that holds the step only without the kept attention on it: auto drops it, true keeps it (and fails)
    on_gpu = dataclasses.replace(planned("auto").setup, offload_activations=False)
    with_it, without = plan_run(on_gpu), plan_run(dataclasses.replace(on_gpu, keep_attention=False))
    capacity = (with_it.peak_bytes + without.peak_bytes) // 2
    assert without.peak_bytes < capacity < with_it.peak_bytes
    assert not plan_run(on_gpu, capacity).setup.keep_attention
    forced = dataclasses.replace(on_gpu, config=load_config(None, ["memory.keep_attention=true"]))
    assert plan_run(forced, capacity).setup.keep_attention


PP_CASES = {  # name: (test_pipeline_offload's Case fields, offload): 2 stages, more micro-batches than stages
    "1f1b-device-fp32": (dict(), False),  # the keeper holds the results on the device, no store
    "1f1b-host-bf16": (dict(dtype="bf16"), True),  # 2 micro-batches in flight on stage 0: a slot pair each
    "gpipe-disk-fp32": (dict(schedule="gpipe", micro_batches=3, disk=True), True),
    # zero bubble: the input gradient, later the weight gradient, each reading the layer's kept results
    "zbv-host-fp32": (dict(schedule="zbv", layers=8, overrides=("parallel.reshard_after_forward=false",)), True),
}


def pp_worker(rank: int, world_size: int, offload_dir: str) -> dict:
    import dataclasses
    import functools

    from test_pipeline_offload import MIN_OFFLOAD_BYTES, Case, micro_batch_rows, pipelined_step

    from longfit.memory import apply
    from longfit.memory.checkpointing import ActivationOffloader
    from longfit.parallel.dims import ParallelDims

    apply.ActivationOffloader = functools.partial(ActivationOffloader, min_offload_bytes=MIN_OFFLOAD_BYTES)
    mesh = ParallelDims(dp_shard=1, cp=1, world_size=world_size, pp=2).build_mesh("cpu")
    results = {}
    for name, (fields, offload) in PP_CASES.items():
        case = Case(name, **fields)
        batches = micro_batch_rows(0, case.micro_batches)
        runs = {}
        for keep in (False, True):
            run = dataclasses.replace(case, overrides=(*case.overrides, f"memory.keep_attention={str(keep).lower()}"))
            with KernelCalls() as calls:
                loss, grads, offloader, _ = pipelined_step(mesh, run, batches, offload, f"{offload_dir}/{rank}-{keep}")
            stored = None if offloader is None else offloader.stats.offloaded_tensors
            if offloader is not None:
                assert offloader.store.stats.unplanned_bytes == 0, name  # every item in its planned slot
                offloader.store.close()
            runs[keep] = (loss, grads, (calls.forward, calls.backward), stored)
        (loss, grads, calls, stored), (kept_loss, kept_grads, kept_calls, kept_stored) = runs[False], runs[True]
        assert torch.equal(kept_loss, loss), name
        assert kept_grads.keys() == grads.keys() and grads, name
        for param, grad in grads.items():
            assert torch.equal(kept_grads[param], grad), f"{name}: {param}"
        results[name] = (calls, kept_calls, stored, kept_stored)
    return results


@pytest.mark.slow  # 2 gloo ranks, eight pipelined steps
@pytest.mark.timeout(900)
def test_pipeline_stages_keep_attention_exactly(tmp_path):
    """pp=2 on gloo ranks (1F1B with the results on the device or in host slots, GPipe on disk, zero bubble's split
    backward), fp32 and bf16: the kept run's loss and every gradient are the recomputing run's, bit for bit; its
    recompute runs no attention kernel (zero bubble recomputes a layer for its input gradient and again for its
    weight gradients: 208 attention forwards on rank 0 against the kept run's 32), and the store holds each layer's kept
    attention beside its input for every micro-batch."""
    for rank, result in enumerate(run_distributed(pp_worker, 2, str(tmp_path))):
        for name, (calls, kept_calls, stored, kept_stored) in result.items():
            where = f"{name} rank {rank}: {calls} recomputed, {kept_calls} kept"
            assert kept_calls == (calls[1], calls[1]) and calls[1] > 0, where  # kept: one forward per backward
            if name.startswith("zbv"):  # zero bubble recomputes a layer for each of its backward passes
                assert calls[0] > 2 * calls[1], where
            else:
                assert calls[0] == 2 * calls[1], where  # forward and recompute
            assert kept_stored == (None if stored is None else 2 * stored), where


# test_parallel_pipeline's cases against its one-process reference: 1F1B and the V of zero bubble, fp32 and bf16
PP_REFERENCE_CASES = ("1f1b", "1f1b-bf16", "zbv", "zbv-bf16")


def pp_reference_worker(rank: int, world_size: int) -> dict:
    import dataclasses

    from test_parallel_pipeline import CASES, micro_batch_rows, pipeline_step, reference_step

    from longfit.parallel.dims import ParallelDims

    mesh = ParallelDims(dp_shard=1, cp=1, world_size=world_size, pp=2).build_mesh("cpu")
    results = {}
    for case in (case for case in CASES if case.name in PP_REFERENCE_CASES):
        kept = dataclasses.replace(case, overrides=(*case.overrides, "memory.keep_attention=true"))
        batches = micro_batch_rows(0, case.micro_batches)
        ref_loss, ref_grads, ref_held_out = reference_step(batches, case.family, case.lora, batches[:1], case.layers)
        with KernelCalls() as calls:
            loss, grads, held_out = pipeline_step(mesh, kept.config(2, 1), batches, case.family, case.lora,
                                                  case.layers)
        rtol, atol = case.tolerance
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=f"{case.name}: loss")
        torch.testing.assert_close(held_out, ref_held_out, rtol=rtol, atol=atol * 1e3, msg=f"{case.name}: eval loss")
        assert grads, case.name
        for param, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[param], rtol=rtol, atol=atol, msg=f"{case.name}: {param}")
        documents = [sum(len(row) for row in batch.documents.rows) for batch in batches]
        results[case.name] = (sum(documents), documents[0], calls.forward, calls.backward)
    return results


@pytest.mark.slow  # 2 gloo ranks, four pipelined steps and their one-process references
@pytest.mark.timeout(600)
def test_pipeline_stages_keeping_attention_match_one_process():
    """pp=2 with memory.keep_attention=true (1F1B and ZBV, fp32 and bf16): loss, eval loss and every gradient of each
    stage against one process without pipeline or memory techniques (test_parallel_pipeline's bounds); no recompute
    ran attention: on each rank the kernel (one call per layer and document) ran forward once per backward, and for
    the eval's forward of the first micro-batch."""
    for rank, result in enumerate(run_distributed(pp_reference_worker, 2)):
        assert set(result) == set(PP_REFERENCE_CASES)
        for name, (documents, eval_documents, forward, backward) in result.items():
            layers, left = divmod(backward, documents)
            where = f"{name} rank {rank}: {forward} forward, {backward} backward calls"
            assert layers > 0 and left == 0 and forward == backward + layers * eval_documents, where


@pytest.mark.slow  # the layer traces of the plan test above (about 90 s cold, seconds after it)
def test_auto_keeps_the_longer_context_and_the_plan_says_so(capsys):
    """llama-tiny on a 3,008 MiB GPU, inputs on the GPU: kept attention shortens the longest context that fits (40K
    against 42K; on 3 GiB both reach 42K: the traced step and the plan with it kept at 42K, 2,338,288,040 and
    2,338,286,596 bytes, #53), so auto plans 42K without it, and `longfit plan` says why and how far keeping it
    reaches."""
    import json

    from longfit.cli import main
    from longfit.plan.analytic import plan_config
    from longfit.plan.report import plan_text
    from longfit.plan.search import max_seq_len

    capacity, longest, kept_longest = 3008 << 20, 43008, 40960
    items = ["model=llama-tiny", "memory.offload_activations=false", "memory.tiled_layers=false",
             "memory.tiled_mlp=false"]

    def config(keep: str, seq_len: int = 16384):
        return load_config(None, [*items, f"seq_len={seq_len}", f"memory.keep_attention={keep}"])

    assert [max_seq_len(config(keep), 1, capacity) for keep in ("auto", "false", "true")] == [longest, longest,
                                                                                              kept_longest]
    auto, forced = plan_config(config("auto", longest), 1, capacity), plan_config(config("true", longest), 1, capacity)
    assert auto.fits and not auto.setup.keep_attention and auto.kept_attention is not None
    assert not forced.fits and forced.setup.keep_attention
    assert auto.kept_attention.peak_bytes == forced.peak_bytes > capacity
    assert "keeping it (0.02 GiB per layer) does not fit at this length (peak 2.99 GiB)" in plan_text(auto, None)
    assert plan_config(config("auto", kept_longest), 1, capacity).setup.keep_attention  # kept where it fits
    argv = ["plan", *items, f"seq_len={longest}", "--gpu-mem", "3008MiB", "--host-mem", "16GiB", "--disk", "1TiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "longest seq_len that fits as configured: 42K" in out
    assert "memory.keep_attention=true) fits up to 40K: memory.keep_attention=auto recomputes it beyond" in out
    assert "step FLOPs per row: model" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert plan["keep_attention"] is False and plan["kept_attention_peak_bytes"] == forced.peak_bytes
    assert (plan["max_seq_len"], plan["max_seq_len_keeping_attention"]) == (longest, kept_longest)


KEPT_PLANS = {  # preset, overrides: the layers keep attention (auto on a GPU), against the same with it recomputed
    "on-the-gpu": ("llama-60m", ("seq_len=16384",)),
    # the layer inputs and kept attention in host slots: the peak in layer 1's backward, where its kept output is the
    # output projection's saved input too (memory/checkpointing.py's _KeptAttention keeps it in (B, L, H, Dv) order;
    # kept in (B, H, L, Dv) order it was copied once more there: traced 8.4 MB above the plan, -2.43%)
    "in-host-slots": ("llama-tiny", ("seq_len=16384", "memory.offload_activations=true", "memory.tiled_layers=false")),
}


@pytest.mark.slow  # two traced steps at 16K: 30-75 s each on 2 cores under load
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(KEPT_PLANS))
def test_the_planned_peak_with_attention_kept_is_the_traced_steps(case):
    """#53 done-when: the analytic peak with attention kept within plan/accuracy's SAFE_BAND (1% under, 3% over) of the
    traced step (fake tensors, the trainer's code), and against the same run recomputing it, the plan and the trace add
    the same bytes (on the GPU: llama-60m 16K, -0.07% kept, -0.08% recomputed, 138.4 MB added by both; in host
    slots: llama-tiny 16K, -0.39% kept, -0.40% recomputed, 8.65 MB added by both: the previous layer's kept
    attention, prefetched)."""
    from longfit.plan.accuracy import SAFE_BAND, compare

    preset, overrides = KEPT_PLANS[case]
    under, over = SAFE_BAND
    recomputed = compare(preset, 1, (*overrides, "memory.keep_attention=false"))
    kept = compare(preset, 1, overrides)
    rows = f"{preset}: kept {kept}, recomputed {recomputed}"
    assert kept["keep_attention"] and not recomputed["keep_attention"], rows
    assert kept["host_analytic"] == kept["host_traced"], rows  # the host arena: slots for both items
    assert under <= recomputed["error"] <= over, rows
    assert under <= kept["error"] <= over, rows
    added = (kept["analytic"] - recomputed["analytic"], kept["traced"] - recomputed["traced"])
    assert added[0] > 0 and abs(added[0] / added[1] - 1) <= over, rows
