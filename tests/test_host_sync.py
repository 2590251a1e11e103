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
