"""The gated delta rule on CUDA (`-m gpu`): flash-linear-attention's varlen kernel, where it is installed, against
longfit's torch kernel on the same bf16-rounded inputs, on packed documents and on a span entering with a state.

Without a GPU, or without flash-linear-attention (`pip install flash-linear-attention`), these skip; the CPU-side
contract of the call (documents as cu_seqlens, the state in and out per row) is tested in
tests/test_families_hybrid.py against a stand-in following the package's documented interface.

Tolerance: bf16 inputs, fp32 accumulation in both kernels, so the outputs and gradients differ by the rounding of
the kernel's bf16 intermediates (its output, its chunk products), about 2^-8 relative per element and smaller in
norm: gpu_helpers.TOLERANCE[bf16] (2e-2) in norm, per tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import TOLERANCE, randn, relative_error

from longfit.data.packing import DocumentLayout, document_rows
from longfit.models import linear_attention
from longfit.models.linear_attention import (
    gated_delta_rule,
    linear_kernel_name,
    span_gated_delta_rule,
    torch_gated_delta_rule,
)

pytestmark = pytest.mark.gpu

B, L, HK, HV, D = 2, 256, 2, 4, 64  # grouped value heads: flash-linear-attention >= 0.5 serves HV != HK itself
DOCUMENTS = [0, 10, 150, 256, 356, 512]  # row 0: 10 + 140 + 106 tokens; row 1: 100 + 156


@pytest.fixture(autouse=True)
def flash_linear_attention():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("fla")
    linear_attention.check_flash_linear_attention()  # an older release fails here, naming itself


def inputs(length: int, seed: int) -> list[torch.Tensor]:
    """q, k (B, n, HK, D), v (B, n, HV, D) in bf16; g (log decay < 0) and beta in (0, 1), (B, n, HV) fp32: as
    transformers' Gated DeltaNet layer hands them to the kernel under bf16 autocast."""
    q, k = (randn(B, length, HK, D, seed=seed + i, dtype=torch.bfloat16, device="cuda") for i in (0, 1))
    v = randn(B, length, HV, D, seed=seed + 2, dtype=torch.bfloat16, device="cuda")
    g = -F.softplus(randn(B, length, HV, seed=seed + 3, dtype=torch.float32, device="cuda"))
    beta = torch.sigmoid(randn(B, length, HV, seed=seed + 4, dtype=torch.float32, device="cuda"))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def output_and_grads(run, tensors: list[torch.Tensor], grad_out: torch.Tensor) -> list[torch.Tensor]:
    out, state = run(*tensors)
    (out.float() * grad_out).sum().add(state.sum()).backward()
    return [out, state, *(t.grad for t in tensors)]


def assert_within_bf16(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    names = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "dstate"]
    errors = {name: relative_error(x, y) for name, x, y in zip(names, got, want)}
    assert max(errors.values()) <= TOLERANCE[torch.bfloat16], (what, errors)


def test_the_kernel_chosen_for_cuda_bf16_is_flash_linear_attention() -> None:
    assert linear_kernel_name("cuda", torch.bfloat16).startswith("flash-linear-attention")
    assert linear_kernel_name("cuda", torch.float32) == "torch chunked gated delta rule"


def test_packed_documents_match_the_torch_kernel() -> None:
    documents = DocumentLayout.from_cu_seqlens(DOCUMENTS, B)
    fla_inputs = inputs(L, seed=0)
    torch_inputs = [t.detach().clone().requires_grad_() for t in fla_inputs]
    grad_out = randn(B, L, HV, D, seed=9, dtype=torch.float32, device="cuda")
    got = output_and_grads(lambda *t: gated_delta_rule(*t, documents, True), fla_inputs, grad_out)
    rows = document_rows(documents, B, L)
    want = output_and_grads(lambda *t: torch_gated_delta_rule(*t, rows, True), torch_inputs, grad_out)
    assert_within_bf16(got, want, "packed rows")


def test_a_span_entering_with_a_state_matches_the_torch_kernel(monkeypatch) -> None:
    """The span [100, 200) of the packed rows (a tile of tiled layers): row 0 continues its second document from
    the state it gets, row 1 starts a document at 100 and must ignore it."""
    documents = DocumentLayout.from_cu_seqlens(DOCUMENTS, B)
    fla_inputs = inputs(100, seed=20)
    torch_inputs = [t.detach().clone().requires_grad_() for t in fla_inputs]
    grad_out = randn(B, 100, HV, D, seed=8, dtype=torch.float32, device="cuda")
    states = [randn(B, HV, D, D, seed=7, dtype=torch.float32, device="cuda").requires_grad_() for _ in range(2)]
    got = output_and_grads(lambda *t: span_gated_delta_rule(*t, documents, L, 100, True, states[0]), fla_inputs,
                           grad_out)
    monkeypatch.setattr(linear_attention, "_fla_chunk_gated_delta_rule", lambda: None)  # the torch kernel, on CUDA
    want = output_and_grads(lambda *t: span_gated_delta_rule(*t, documents, L, 100, True, states[1]), torch_inputs,
                            grad_out)
    assert_within_bf16(got + [states[0].grad], want + [states[1].grad], "span with a state")


def test_rows_of_one_document_entering_with_a_state_match_the_torch_kernel(monkeypatch) -> None:
    """The dense call (one document per row, no cu_seqlens) of a span [100, 200): row 0 continues its document from
    the state it gets; the state of a first span (start 0) is not read."""
    documents = DocumentLayout.one_document_per_row(B, L)
    for start in (100, 0):
        fla_inputs = inputs(100, seed=30 + start)
        torch_inputs = [t.detach().clone().requires_grad_() for t in fla_inputs]
        grad_out = randn(B, 100, HV, D, seed=6, dtype=torch.float32, device="cuda")
        states = [randn(B, HV, D, D, seed=5, dtype=torch.float32, device="cuda").requires_grad_() for _ in range(2)]
        got = output_and_grads(lambda *t: span_gated_delta_rule(*t, documents, L, start, True, states[0]), fla_inputs,
                               grad_out)
        with monkeypatch.context() as patch:
            patch.setattr(linear_attention, "_fla_chunk_gated_delta_rule", lambda: None)  # the torch kernel, on CUDA
            want = output_and_grads(lambda *t: span_gated_delta_rule(*t, documents, L, start, True, states[1]),
                                    torch_inputs, grad_out)
        if start == 0:  # the incoming state is not read: no gradient reaches it
            assert not states[0].grad.any() and not states[1].grad.any()
            assert_within_bf16(got, want, "one document per row, first span")
        else:
            assert_within_bf16(got + [states[0].grad], want + [states[1].grad], "one document per row from 100")
