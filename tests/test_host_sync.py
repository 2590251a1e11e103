"""No host read of a tensor per decoder layer: one forward and backward reads the same tensors for 2 layers as for 4.

On CUDA, reading a device tensor's value on the host (`.tolist()`, `.item()`, `int()`, `bool()`, ...) waits for
every kernel queued before it. A packed batch's document layout is read on the host once, where the batch is made
(`PackedBatch.documents`), and passed down to every attention path; a path that read `cu_seqlens` again -- at
every layer, again in recomputation and in a tiled layer's tile runs -- would stall the GPU that often (issue 24).
The CPU cannot see a stall, so the test counts the reads themselves: a TorchFunctionMode sees every call of the
Tensor methods in HOST_READS (it intercepts each of them, `int()`, `bool()`, `float()` and `__index__` included),
wherever it happens (forward, checkpoint recomputation, custom autograd backward), and records its call site.
`.to()` is not counted: on the CPU every `.to(x.device)` targets the host (transformers' rotary embedding makes
one per forward), so the CPU cannot tell a device-to-host copy from a no-op.

The counts with 2 and with 4 decoder layers must be equal on every attention path: local (dense, per document,
sliding window), activation checkpointing, tiled layers, and ring and Ulysses context parallelism (one process:
group None runs the same code as cp ranks, without the exchanges), in fp32 and under bf16 autocast over fp32
weights. They are in fact 0: transformers' Llama and Gemma 3 bodies read nothing either.
"""

from __future__ import annotations

import copy
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from batch_helpers import packed_rows
from torch.overrides import TorchFunctionMode

from longfit.data.packing import PackedBatch
from longfit.memory.checkpointing import apply_activation_checkpointing
from longfit.memory.loss import CausalLMLoss, batch_loss_sum
from longfit.memory.tiled_layers import apply_tiled_layers
from longfit.models.attention import register_attention
from longfit.parallel.parallelize import apply_context_parallel
from longfit.parallel.tiled_attention import LocalTileAttention

HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
}
SOURCE_ROOT = str(Path(torch.__file__).parent)

L, VOCAB = 32, 256
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=128)
FAMILIES = {
    "llama": dict(SMALL, model_type="llama"),
    # Local layers with a window narrower than the documents, and global layers.
    "gemma3": dict(SMALL, model_type="gemma3_text", sliding_window=6, sliding_window_pattern=2),
}
DOCS = [[7, 19, 6], [12, 20]]  # per row


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest.one_thread)


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values by call site (file:line outside torch)."""

    def __init__(self):
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if not f.filename.startswith(SOURCE_ROOT))
            self.sites[f"{func.__name__} at {frame.filename}:{frame.lineno}"] += 1
        return func(*args, **(kwargs or {}))


def build(family: str, layers: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    values = copy.deepcopy(FAMILIES[family])
    config = AutoConfig.for_model(values.pop("model_type"), num_hidden_layers=layers, **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
    model.config.use_cache = False
    return model


def packed_batch() -> PackedBatch:
    """Two rows of DOCS, made on the host as the packer makes them (their layout read here, once)."""
    return packed_rows(DOCS, L, VOCAB, seed=1)


PATHS = {
    "local": lambda model: None,
    "checkpointed": lambda model: apply_activation_checkpointing(model),
    "tiled": lambda model: apply_tiled_layers(model, LocalTileAttention.for_sequence, tiles=2),
    "ring": lambda model: apply_context_parallel(model, None, "ring"),
    "ulysses": lambda model: apply_context_parallel(model, None, "ulysses"),
    "ring-tiled": lambda model: (apply_context_parallel(model, None, "ring"),
                                 apply_tiled_layers(model, LocalTileAttention.for_sequence, tiles=2)),
    "ulysses-tiled": lambda model: (apply_context_parallel(model, None, "ulysses"),
                                    apply_tiled_layers(model, LocalTileAttention.for_sequence, tiles=2)),
}


def host_reads(family: str, layers: int, path: str, autocast: bool, pass_layout: bool = True) -> Counter[str]:
    """The host reads of one forward and backward of the loss on the packed batch, by call site.

    `pass_layout` False: the loss gets cu_seqlens alone, as a caller without a PackedBatch would pass it."""
    model = build(family, layers)
    PATHS[path](model)
    loss_module = CausalLMLoss(model, chunked_loss=True, loss_chunk=16)
    batch = packed_batch()
    with HostReads() as reads, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if pass_layout:
            loss = batch_loss_sum(loss_module, batch)
        else:
            loss = loss_module(batch.input_ids, batch.labels, batch.position_ids, batch.cu_seqlens)
    with reads:
        loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    return reads.sites


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_host_reads_do_not_grow_with_the_layers(family: str, path: str, autocast: bool) -> None:
    two, four = (host_reads(family, layers, path, autocast) for layers in (2, 4))
    assert two == four, f"host reads with 2 layers: {dict(two)}; with 4 layers: {dict(four)}"


def test_cu_seqlens_alone_is_read_once_per_forward() -> None:
    """Without the batch's layout the loss reads cu_seqlens once, before the model body (and the counter does see
    reads: the test above cannot pass for want of seeing them)."""
    for layers in (2, 4):
        sites = host_reads("gemma3", layers, "tiled", autocast=False, pass_layout=False)
        assert sum(sites.values()) == 1 and all("packing.py" in site for site in sites), dict(sites)


def test_router_counts_are_the_assignments_per_expert() -> None:
    """RouterLoss.counts (scatter_add into E bins: no host read of the indices' range, which bincount makes on CUDA)
    counts every top-k assignment: the bincount of the chosen experts over every router call, then the rows."""
    from longfit.memory.router_loss import RouterLoss

    router = RouterLoss(coef=0.01, experts=6, top_k=2)
    generator = torch.Generator().manual_seed(0)
    calls = [torch.randn(rows, 6, generator=generator) for rows in (5, 11, 1)]
    chosen = torch.cat([torch.topk(logits.softmax(-1), 2, dim=-1).indices.flatten() for logits in calls])
    want = torch.cat([torch.bincount(chosen, minlength=6).float(), torch.tensor([17.0])])
    assert torch.equal(router.counts(tuple(calls)), want)


# ---- on CUDA: no synchronisation at all inside a packed step ---------------------------------------------------

GPU_FAMILIES = {
    # Gated DeltaNet layers with grouped value heads (flash-linear-attention in bf16, the torch kernel in fp32)
    "qwen3_5": dict(SMALL, model_type="qwen3_5_text", head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=64, linear_value_head_dim=64,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    # softcapped scores (the capped block kernel, or flash-attn's softcap) and sliding windows
    "gemma2": dict(SMALL, model_type="gemma2", head_dim=16, sliding_window=40),
    # routed experts with the router loss (memory/router_loss.py)
    "qwen3_moe": dict(SMALL, model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=1, output_router_logits=True),
}
GPU_L = 256
GPU_DOCS = ([[100, 90, 66], [GPU_L]], [[30, 170, 56], [128, 128]])  # the warm-up's layout, then the measured one


def packed_step(family: str, device: str, autocast: bool):
    """(the model, a function running the forward and backward of a PackedBatch already on `device`) of a tiny model
    of `family` (GPU_FAMILIES) with longfit's attention and linear-attention kernels, the step's loss as the trainer
    sums it (label tokens given: the router loss included)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.models.linear_attention import prepare_linear_attention

    values = copy.deepcopy(GPU_FAMILIES[family])
    config = AutoConfig.for_model(values.pop("model_type"), num_hidden_layers=4, **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).to(device)
    model.config.use_cache = False
    prepare_linear_attention(model)
    loss_module = CausalLMLoss(model, chunked_loss=True, loss_chunk=64)

    def step(batch: PackedBatch, tokens: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = batch_loss_sum(loss_module, batch, tokens)
        loss.backward()

    return model, step


def step_batches(device: str) -> list[tuple[PackedBatch, torch.Tensor]]:
    """The warm-up's and the measured step's batches on `device`, with their label-token counts there."""
    batches = [packed_rows(docs, GPU_L, VOCAB, seed=seed).to(device) for seed, docs in enumerate(GPU_DOCS)]
    return [(batch, torch.tensor(batch.num_label_tokens, device=device)) for batch in batches]


@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_the_models_of_the_cuda_sync_test_run_their_packed_step(family: str) -> None:
    """The CUDA test below on the CPU (fp32): its models build and train on packed rows, the router loss included."""
    model, step = packed_step(family, "cpu", autocast=False)
    assert (CausalLMLoss(model).router_loss is not None) == (family == "qwen3_moe")
    step(*step_batches("cpu")[1])
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_a_packed_step_on_cuda_never_waits_for_the_device(family: str, autocast: bool) -> None:
    """`torch.cuda.set_sync_debug_mode("error")` around the forward and backward of a packed batch (after a warm-up
    step on another layout: cuBLAS handles, Triton's autotuning): any device-to-host read or copy from pageable memory
    inside the step raises, naming its call site. Issue 46: the linear-attention layers' cu_seqlens and row indices,
    the capped flash path's layout, the router loss's bincount each synchronised."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, step = packed_step(family, "cuda", autocast)
    warm, measured = step_batches("cuda")
    step(*warm)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*measured)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
