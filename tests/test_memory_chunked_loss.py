"""Chunked lm_head + cross-entropy: same loss sum and gradients as full logits; the logits never exist whole."""

import copy

import pytest
import torch
from memory_helpers import LargestAllocation, loss_sum, packed_batch, tiny_llama
from torch import nn

from longfit.memory.chunked_loss import (
    chunked_cross_entropy,
    full_cross_entropy,
    liger_available,
)
from longfit.memory.switches import LOSS_LOGIT_BYTES, loss_chunk_tokens

B, L, H, VOCAB = 2, 50, 64, 384


def labels_with_ignored(length: int = L) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (B, length), generator=torch.Generator().manual_seed(2))
    labels[0, :20] = -100  # a whole chunk of ignored tokens for chunk sizes <= 20
    labels[1, ::3] = -100
    return labels


def head_case(bias: bool = False, length: int = L):
    torch.manual_seed(0)
    hidden = torch.randn(B, length, H, requires_grad=True)
    head = nn.Linear(H, VOCAB, bias=bias)
    return hidden, head, labels_with_ignored(length)


def grads_of(loss, *tensors):
    loss.backward()
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("chunk", [1, 7, 32, 100, 1000])
def test_chunked_matches_full_logits(chunk):
    hidden, head, labels = head_case()
    reference = full_cross_entropy(hidden, head, labels)
    expected = grads_of(reference, hidden, head.weight)
    hidden.grad = head.weight.grad = None
    loss = chunked_cross_entropy(hidden, head, labels, chunk)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference)
    for got, want in zip(grads_of(loss, hidden, head.weight), expected):
        torch.testing.assert_close(got, want)


def test_bias_softcap_and_scaled_loss_match():
    hidden, head, labels = head_case(bias=True)
    scale = 1 / (labels != -100).sum()  # the trainer divides the sum by the valid-token count
    reference = full_cross_entropy(hidden, head, labels, softcap=3.0) * scale
    expected = grads_of(reference, hidden, head.weight, head.bias)
    hidden.grad = head.weight.grad = head.bias.grad = None
    loss = chunked_cross_entropy(hidden, head, labels, 13, softcap=3.0) * scale
    torch.testing.assert_close(loss, reference)
    for got, want in zip(grads_of(loss, hidden, head.weight, head.bias), expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
def test_bf16_is_as_accurate_as_full_logits(mode):
    """bf16 GEMMs round differently per chunk; both paths must be about equally close to the fp32 result."""
    hidden, head, labels = head_case()
    exact_loss = full_cross_entropy(hidden, head, labels)
    exact = grads_of(exact_loss, hidden, head.weight)
    if mode == "bf16_weights":
        hidden = hidden.detach().bfloat16().requires_grad_()
        head = copy.deepcopy(head).bfloat16()
    results = {}
    for name, fn in [("full", lambda: full_cross_entropy(hidden, head, labels)),
                     ("chunked", lambda: chunked_cross_entropy(hidden, head, labels, 16))]:
        hidden.grad = head.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            loss = fn()
        results[name] = (loss.detach(), grads_of(loss / 1234.5, hidden, head.weight))  # a non-trivial scale
    got = results["chunked"][1]
    assert got[0].dtype == hidden.dtype and got[1].dtype == head.weight.dtype
    for i in range(2):
        full_error = (results["full"][1][i].float() * 1234.5 - exact[i]).abs().max()
        chunked_error = (got[i].float() * 1234.5 - exact[i]).abs().max()
        assert 0 < chunked_error <= 2 * full_error  # 0 < : bf16 really was used
    assert (results["chunked"][0] - exact_loss).abs() <= 2 * (results["full"][0] - exact_loss).abs() + 1e-3


def test_all_labels_ignored_gives_zero_and_zero_gradients():
    hidden, head, labels = head_case()
    loss = chunked_cross_entropy(hidden, head, torch.full_like(labels, -100), 16)
    assert loss.item() == 0.0
    grad_hidden, grad_weight = grads_of(loss, hidden, head.weight)
    assert not grad_hidden.any() and not grad_weight.any()


def test_second_backward_from_the_same_gradient_repeats_it_another_is_refused():
    """A zero-bubble pipeline schedule runs the loss's backward twice from one gradient (the hidden states', then
    the weights'): under backward_twice the second returns the same gradients; any other second backward is refused,
    and without backward_twice every second backward (the gradients are not kept past the first: they would be held
    through the rest of the step's backward)."""
    hidden, head, labels = head_case()
    once_only = chunked_cross_entropy(hidden, head, labels, 16)
    once_only.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        once_only.backward(retain_graph=True)
    hidden.grad = head.weight.grad = None
    loss = chunked_cross_entropy(hidden, head, labels, 16, backward_twice=True)
    loss.backward(retain_graph=True)
    once = hidden.grad.clone(), head.weight.grad.clone()
    loss.backward(retain_graph=True)
    torch.testing.assert_close(hidden.grad, 2 * once[0], rtol=0, atol=0)
    torch.testing.assert_close(head.weight.grad, 2 * once[1], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward(torch.tensor(0.5))


def model_loss_and_grads(model, chunk):
    input_ids = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(3))
    loss = loss_sum(model, labels_with_ignored(), chunk, input_ids=input_ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(reference, other):
    torch.testing.assert_close(other[0], reference[0])
    assert other[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(other[1][name], grad, msg=name)


def test_tied_embeddings_model_matches_full_logits():
    model = tiny_llama(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = model_loss_and_grads(model, None)
    model.zero_grad(set_to_none=True)
    chunked = model_loss_and_grads(model, 17)
    assert len(chunked[1]) == sum(1 for _ in model.parameters())
    assert_same(reference, chunked)
    # the shared matrix got the output-projection gradient too, not only the embedding rows used
    assert (chunked[1]["model.embed_tokens.weight"] != 0).all(dim=1).sum() == VOCAB


def lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in model.named_parameters():  # non-zero B so every adapter gets a gradient
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(4))
    return model


def test_frozen_lm_head_under_lora_matches_full_logits():
    reference = model_loss_and_grads(lora_model(), None)
    chunked_model = lora_model()
    chunked = model_loss_and_grads(chunked_model, 32)
    assert_same(reference, chunked)
    assert chunked_model.base_model.model.lm_head.weight.grad is None
    assert chunked[1] and all("lora_" in name for name in chunked[1])


def test_lora_wrapped_lm_head_is_refused_with_the_fix():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(TypeError, match="memory.chunked_loss=false"):
        model_loss_and_grads(model, 32)
    with pytest.raises(ValueError, match="memory.loss_chunk"):
        chunked_cross_entropy(*head_case()[:2], labels_with_ignored(), 0)


def saved_for_backward_bytes(fn) -> tuple[int, int]:
    """(total, largest) bytes autograd saved for backward while running fn."""
    sizes = []

    def pack(t):
        sizes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(sizes), max(sizes)


def test_full_logits_never_exist_and_are_never_saved():
    length = 200
    hidden, head, labels = head_case(length=length)
    logits_bytes = B * length * VOCAB * 4  # 614400 bytes; weight: 98304, hidden: 102400
    with LargestAllocation() as full_probe:
        loss, full_total, full_largest = saved_for_backward_bytes(lambda: full_cross_entropy(hidden, head, labels))
        loss.backward()
    with LargestAllocation() as chunked_probe:
        loss, chunked_total, chunked_largest = saved_for_backward_bytes(
            lambda: chunked_cross_entropy(hidden, head, labels, 16)
        )
        loss.backward()
    assert full_probe.largest >= logits_bytes and full_largest >= logits_bytes  # the probes see them when they exist
    assert chunked_probe.largest < logits_bytes / 4
    # saved: the hidden gradient (B*L, H) and the fp32 weight gradient (V, H), nothing of size (B*L, V)
    assert chunked_largest < logits_bytes / 4 and chunked_total == (B * length * H + VOCAB * H) * 4 < full_total


def test_no_gradient_work_without_grad_mode():
    hidden, head, labels = head_case(length=200)
    reference = full_cross_entropy(hidden, head, labels)
    with torch.no_grad(), LargestAllocation() as probe:
        loss = chunked_cross_entropy(hidden, head, labels, 16)
    torch.testing.assert_close(loss, reference)
    assert probe.largest < VOCAB * H * 4  # no weight-gradient accumulator, no (N, H) hidden gradient


def test_chunk_rule_without_device_memory_keeps_the_host_budget():
    assert loss_chunk_tokens(128256) == 256  # 256 x 128256 fp32 logits = 125 MiB
    assert loss_chunk_tokens(32000) == 1024
    assert loss_chunk_tokens(384) == 1 << 16
    assert loss_chunk_tokens(10**9) == 64
    assert not liger_available(torch.device("cpu"))


def test_chunk_rule_from_free_device_memory():
    GiB = 1 << 30
    assert loss_chunk_tokens(128256, 80 * GiB) == 2048  # 2.5 GiB / (8 B x 128256) = 2616 tokens, rounded down
    assert loss_chunk_tokens(128256, 140 * GiB) == 4096
    assert loss_chunk_tokens(32000, 80 * GiB) == 8192
    assert loss_chunk_tokens(128256, 4 * GiB) == 256  # never below 256 tokens
    assert loss_chunk_tokens(384, 80 * GiB) == 16384  # nor above 16K
    previous = 0
    for free in range(0, 200 * GiB, 7 * GiB):
        chunk = loss_chunk_tokens(151936, free)
        assert chunk & (chunk - 1) == 0 and 256 <= chunk <= 16384 and chunk >= previous
        assert chunk == 256 or chunk * LOSS_LOGIT_BYTES * 151936 <= free / 32  # the chunk's logits fit the fraction
        previous = chunk


def test_plan_trace_and_trainer_share_the_chunk_rule():
    from longfit.config import load_config
    from longfit.plan.analytic import CUDA_CONTEXT_BYTES, plan_config
    from longfit.plan.setup import resolve
    from longfit.plan.trace import gpu_config

    cfg = load_config(None, ["model=llama-3.2-1b", "seq_len=32768"])
    capacity = 81559 << 20  # an H100's
    assert resolve(cfg, 1, "cuda", 60 << 30).loss_chunk == loss_chunk_tokens(128256, 60 << 30) == 1024
    assert plan_config(cfg, 1, capacity).setup.loss_chunk == loss_chunk_tokens(128256, capacity - CUDA_CONTEXT_BYTES)
    assert gpu_config(cfg, 60 << 30).memory.loss_chunk == 1024  # what the trace builds its CausalLMLoss with
    assert resolve(cfg, 1, "cpu").loss_chunk == loss_chunk_tokens(128256) == 256
    assert resolve(load_config(None, ["model=llama-3.2-1b", "memory.loss_chunk=300"]), 1, "cuda", capacity).loss_chunk == 300


def test_automatic_chunk_is_resolved_at_the_first_forward_and_exact():
    from longfit.memory.loss import CausalLMLoss

    model = tiny_llama()
    inputs, labels = packed_batch()
    args = (inputs["input_ids"], labels, inputs["position_ids"], inputs["cu_seq_lens_q"])
    auto = CausalLMLoss(model, chunked_loss=True)
    assert auto.loss_chunk == 0
    loss = auto(*args)
    assert auto.loss_chunk == loss_chunk_tokens(model.config.vocab_size)  # CPU: no device memory to size it by
    torch.testing.assert_close(loss, CausalLMLoss(model, chunked_loss=False)(*args))
    torch.testing.assert_close(loss, CausalLMLoss(model, chunked_loss=True, loss_chunk=7)(*args))
