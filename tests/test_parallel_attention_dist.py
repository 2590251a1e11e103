"""Context-parallel attention on real gloo process groups vs a one-process reference.

One spawn per world size (2 and 4) runs every case; each rank returns the outputs and q/k/v gradients
gathered over its cp group and unsharded, and the tests compare them here with plain per-document
causal SDPA on the full tensors (a sliding window as an explicit mask on these short rows). Subgroups
cover cp=1 (one rank per group) and cp=2 inside a world of 4 with strided members {0, 2}, {1, 3}, so
ring peers are not consecutive global ranks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402

from longfit.data.packing import DocumentLayout
from longfit.models.attention import longfit_attention_forward
from longfit.parallel.context import ContextParallelAttention
from longfit.parallel.sharding import gather_sequence, shard_sequence


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    cp: int
    docs: tuple[tuple[int, ...], ...] | None = None  # document lengths per row; None: one document per row
    dtype: torch.dtype = torch.float64
    heads: int = 4
    kv_heads: int = 2
    seq_len: int = 64
    scale: float | None = None
    via_model_attention: bool = False  # call through models.attention's routing to longfit_context_parallel
    window: int | None = None  # sliding window (keys i - window < j <= i); None: a global layer


# Documents shorter than a chunk, several per chunk, a one-token document, documents spanning many chunks.
UNEVEN = ((5, 20, 3, 36), (1, 30, 17, 16))
SAME_ROWS = ((10, 22, 32), (10, 22, 32))
# Documents of at most 12 tokens (rows cut into Llama 4's chunks of 12): with C = 16 the ring exchanges their halo.
SHORT = ((12, 12, 12, 12, 12, 4), (7, 12, 12, 12, 12, 9))
ONE_PER_ROW = ((64,), (64,))

CASES = {
    2: [
        Case("ring-causal", "ring", 2),
        Case("ring-packed", "ring", 2, UNEVEN, scale=0.3),
        Case("ring-packed-fp32", "ring", 2, SAME_ROWS, dtype=torch.float32),
        Case("ring-rows-as-documents", "ring", 2, ONE_PER_ROW),
        Case("ring-packed-mha", "ring", 2, UNEVEN, kv_heads=4),
        Case("ring-packed-model-routing", "ring", 2, UNEVEN, via_model_attention=True),
        Case("ulysses-causal", "ulysses", 2),
        Case("ulysses-packed", "ulysses", 2, UNEVEN, scale=0.3),
        Case("ulysses-packed-fp32", "ulysses", 2, UNEVEN, dtype=torch.float32),
        Case("ulysses-causal-bf16", "ulysses", 2, dtype=torch.bfloat16),
        Case("ring-causal-cp1", "ring", 1),
        Case("ring-packed-cp1", "ring", 1, UNEVEN),
        Case("ulysses-packed-cp1", "ulysses", 1, UNEVEN),
        # Sliding windows: chunks of C = 16 tokens; W - 1 <= C exchanges a halo, W = 24 takes ring hops.
        Case("ring-window-halo", "ring", 2, window=8),
        Case("ring-window-halo-packed", "ring", 2, UNEVEN, window=17, scale=0.3),
        Case("ring-window-hops-packed", "ring", 2, UNEVEN, window=24),
        Case("ring-window-halo-packed-model-routing", "ring", 2, UNEVEN, window=5, via_model_attention=True),
        Case("ulysses-window", "ulysses", 2, window=8),
        Case("ulysses-window-packed-model-routing", "ulysses", 2, UNEVEN, window=13, via_model_attention=True),
        Case("ring-window-packed-cp1", "ring", 1, UNEVEN, window=8),
        Case("ring-short-documents-halo", "ring", 2, SHORT),
        Case("ring-short-documents-halo-bf16", "ring", 2, SHORT, dtype=torch.bfloat16),
    ],
    4: [
        Case("ring-causal", "ring", 4),
        Case("ring-packed", "ring", 4, UNEVEN),
        Case("ring-packed-fp32", "ring", 4, UNEVEN, dtype=torch.float32),
        Case("ring-packed-bf16", "ring", 4, UNEVEN, dtype=torch.bfloat16),
        Case("ring-packed-strided-cp2", "ring", 2, UNEVEN),
        Case("ring-packed-128", "ring", 4, ((40, 50, 38), (7, 100, 21)), seq_len=128),
        Case("ulysses-packed-128", "ulysses", 4, ((40, 50, 38), (7, 100, 21)), seq_len=128),
        Case("ulysses-causal-replicated-kv", "ulysses", 4),
        Case("ulysses-packed-replicated-kv", "ulysses", 4, UNEVEN),
        Case("ulysses-packed-mqa", "ulysses", 4, UNEVEN, kv_heads=1),
        Case("ulysses-packed-strided-cp2", "ulysses", 2, UNEVEN),
        # C = 8: the halo for W <= 9, ring hops skipping far shards beyond.
        Case("ring-window-halo-packed", "ring", 4, UNEVEN, window=9),
        Case("ring-window-hops-packed", "ring", 4, UNEVEN, window=12, dtype=torch.float32),
        Case("ring-window-halo-bf16", "ring", 4, window=6, dtype=torch.bfloat16),
        Case("ring-window-halo-packed-strided-cp2", "ring", 2, UNEVEN, window=16),
        Case("ulysses-window-packed-replicated-kv", "ulysses", 4, UNEVEN, window=7),
    ],
}


def make_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """Full (unsharded) q, k, v and the upstream gradient, identical in every process."""
    gen = torch.Generator().manual_seed(sum(map(ord, case.name)))
    B, D = 2, 16

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(B, heads, case.seq_len, D, generator=gen, dtype=torch.float64).to(case.dtype)

    return rand(case.heads), rand(case.kv_heads), rand(case.kv_heads), rand(case.heads)


def row_documents(case: Case) -> tuple[tuple[int, ...], ...]:
    return case.docs if case.docs is not None else ((case.seq_len,),) * 2


def cu_seqlens(case: Case) -> torch.Tensor | None:
    if case.docs is None:
        return None
    lengths = [n for row in case.docs for n in row]
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)


def reference(case: Case) -> dict[str, torch.Tensor]:
    """Per-document causal SDPA on the full tensors, K/V heads repeated for GQA; autograd gradients.

    bf16 cases are referenced in fp64 (on the same bf16-rounded inputs)."""
    compute_dtype = torch.float64 if case.dtype == torch.bfloat16 else case.dtype
    q, k, v, dout = (t.to(compute_dtype).requires_grad_() for t in make_inputs(case))
    groups = case.heads // case.kv_heads
    k_full, v_full = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    rows = []
    for b, lengths in enumerate(row_documents(case)):
        pieces, start = [], 0
        for n in lengths:
            span = slice(start, start + n)
            position = torch.arange(n)
            visible = position.unsqueeze(1) >= position.unsqueeze(0)
            if case.window is not None:
                visible &= position.unsqueeze(1) - position.unsqueeze(0) < case.window
            pieces.append(
                F.scaled_dot_product_attention(
                    q[b : b + 1, :, span], k_full[b : b + 1, :, span], v_full[b : b + 1, :, span],
                    attn_mask=visible, scale=case.scale,
                )
            )
            start += n
        rows.append(torch.cat(pieces, dim=2))
    out = torch.cat(rows, dim=0)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.detach())
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def _run_case(case: Case, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    attention = ContextParallelAttention(group, case.method)
    cp_rank, cp = attention.cp_rank, attention.cp_size
    q, k, v, dout = make_inputs(case)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, 2, cp_rank, cp, attention.layout).clone()

    q_local, k_local, v_local = (shard(t).requires_grad_() for t in (q, k, v))
    if case.via_model_attention:
        module = torch.nn.Module()
        module.longfit_context_parallel = attention
        out, _ = longfit_attention_forward(
            module, q_local, k_local, v_local, None, scaling=case.scale, sliding_window=case.window,
            cu_seq_lens_q=cu_seqlens(case),
        )
        out = out.transpose(1, 2)  # (B, L, H, D) -> (B, H, L, D)
    else:
        documents = None if case.docs is None else DocumentLayout.from_cu_seqlens(cu_seqlens(case), len(case.docs))
        out = attention(q_local, k_local, v_local, scale=case.scale, documents=documents, window=case.window)
    out.backward(shard(dout))
    tensors = {"out": out, "dq": q_local.grad, "dk": k_local.grad, "dv": v_local.grad}
    return {name: gather_sequence(t.detach(), 2, group, attention.layout) for name, t in tensors.items()}


def _errors(group: dist.ProcessGroup) -> dict[str, str]:
    """Messages of the rejected inputs (all raised before any communication, on every rank).

    Degree rules (heads divisible by cp, two equal zigzag chunks) are ParallelDims' and tested there.
    """
    x = torch.zeros(2, 4, 8, 16, dtype=torch.float64)
    attempts = {
        "ring-local-cu-seqlens": lambda: ContextParallelAttention(group, "ring")(
            x, x, x, documents=DocumentLayout.from_cu_seqlens([0, 8, 16], 2)
        ),
        "ulysses-local-cu-seqlens": lambda: ContextParallelAttention(group, "ulysses")(
            x, x, x, documents=DocumentLayout.from_cu_seqlens([0, 8, 16], 2)
        ),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    return messages


def _worker(rank: int, world_size: int, cases: list[Case]) -> dict[str, object]:
    groups = {}
    for cp in sorted({case.cp for case in cases}):
        if cp == world_size:
            groups[cp] = dist.group.WORLD
            continue
        stride = world_size // cp
        for first in range(stride):  # every rank creates every subgroup, in the same order
            members = list(range(first, world_size, stride))
            subgroup = dist.new_group(members)
            if rank in members:
                groups[cp] = subgroup
    results: dict[str, object] = {case.name: _run_case(case, groups[case.cp]) for case in cases}
    results["errors"] = _errors(dist.group.WORLD)
    return results


@pytest.fixture(scope="module")
def world_results() -> dict[int, list[dict[str, object]]]:
    return {world: run_distributed(_worker, world, cases) for world, cases in CASES.items()}


@pytest.mark.parametrize(
    "world,case",
    [(world, case) for world, cases in CASES.items() for case in cases],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_matches_single_process_reference(world_results, world: int, case: Case) -> None:
    expected = reference(case)
    # bf16: inputs and results are rounded to 8 bits of mantissa; accumulation is fp32 throughout.
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if case.dtype == torch.bfloat16 else {}
    for rank, results in enumerate(world_results[world]):
        for name, tensor in expected.items():
            got = results[case.name][name]
            assert got.dtype == case.dtype
            assert_close(got.to(tensor.dtype), tensor, **tolerance, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("world", sorted(CASES))
def test_bad_inputs_raise_errors_naming_the_fix(world_results, world: int) -> None:
    for results in world_results[world]:
        errors = results["errors"]
        for name in ("ring-local-cu-seqlens", "ulysses-local-cu-seqlens"):
            assert "GLOBAL" in errors[name] and f"2 x {8 * world}" in errors[name]
