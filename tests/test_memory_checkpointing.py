"""Activation checkpointing and host offload: exact loss and gradients on a tiny real Llama."""

import functools

import pytest
import torch
from memory_helpers import loss_sum, packed_batch
from memory_helpers import tiny_llama as build_tiny_llama

from longfit.memory.checkpointing import apply_activation_checkpointing, decoder_layers

B, L, H, LAYERS, VOCAB = 2, 48, 64, 4, 384
HIDDEN_BYTES = B * L * H * 4  # one fp32 (B, L, H) layer input
tiny_llama = functools.partial(build_tiny_llama, layers=LAYERS)


def loss_and_grads(model, backwards: int = 1):
    inputs, labels = packed_batch()
    loss = loss_sum(model, labels, None, **inputs)
    for i in range(backwards):
        loss.backward(retain_graph=i < backwards - 1)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(reference, other):
    (ref_loss, ref_grads), (loss, grads) = reference, other
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == sum(1 for _ in tiny_llama().parameters())
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def count_attention_calls(model) -> list[int]:
    calls = [0] * LAYERS
    for i, layer in enumerate(decoder_layers(model)):
        layer.self_attn.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def test_decoder_layers_are_found_plain_and_through_peft():
    from peft import LoraConfig, get_peft_model

    model = tiny_llama()
    assert decoder_layers(model) is model.model.layers
    wrapped = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"]))
    assert decoder_layers(wrapped) is wrapped.base_model.model.model.layers


@pytest.mark.parametrize("fraction, checkpointed", [(1.0, 4), (0.5, 2)])
def test_checkpointing_is_exact(fraction, checkpointed):
    reference = loss_and_grads(tiny_llama())
    model = tiny_llama()
    keys = list(model.state_dict())
    applied = apply_activation_checkpointing(model, fraction)
    assert applied.layer_indices == list(range(checkpointed)) and applied.offloader is None
    assert list(model.state_dict()) == keys  # same names: DCP checkpoints and adapters load either way
    calls = count_attention_calls(model)
    assert_same(reference, loss_and_grads(model))
    # checkpointed layers ran forward twice (the recompute in backward), the others once
    assert calls == [2] * checkpointed + [1] * (LAYERS - checkpointed)


def test_offload_is_exact_and_moves_every_layer_input():
    reference = loss_and_grads(tiny_llama())
    model = tiny_llama()
    offloader = apply_activation_checkpointing(model, 1.0, offload=True, min_offload_bytes=1024).offloader
    assert_same(reference, loss_and_grads(model))
    stats = offloader.stats
    # exactly the residual-stream input of each layer; the rotary cos/sin (keyword arguments) never
    assert stats.offloaded_tensors == LAYERS and stats.offloaded_bytes == LAYERS * HIDDEN_BYTES
    assert stats.reloaded_bytes == stats.offloaded_bytes
    assert stats.prefetched_tensors == LAYERS - 1  # all but the last layer, which backward reaches first


def test_offload_leaves_small_tensors_in_place():
    model = tiny_llama()
    offloader = apply_activation_checkpointing(model, 1.0, offload=True, min_offload_bytes=HIDDEN_BYTES + 1).offloader
    assert_same(loss_and_grads(tiny_llama()), loss_and_grads(model))
    # >=: older torch (_NoopSaveInputs) also saves an empty placeholder tensor through the hooks
    assert offloader.stats.offloaded_bytes == 0 and offloader.stats.kept_tensors >= LAYERS


def test_offload_copies_a_tensor_shared_by_all_layers_once():
    """A tensor handed positionally to every layer is offloaded once, then kept by reference."""
    inputs, _ = packed_batch()
    plain, model = tiny_llama(), tiny_llama()
    offloader = apply_activation_checkpointing(model, 1.0, offload=True, min_offload_bytes=512).offloader

    def run(net):
        decoder = net.model
        hidden = decoder.embed_tokens(inputs["input_ids"])
        position_embeddings = decoder.rotary_emb(hidden, position_ids=inputs["position_ids"])
        for layer in decoder.layers:
            # position_ids (B, L) int64 = 768 bytes, positional: saved by every checkpoint
            hidden = layer(hidden, None, inputs["position_ids"], position_embeddings=position_embeddings,
                           cu_seq_lens_q=inputs["cu_seq_lens_q"])
        hidden.square().sum().backward()
        return {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

    reference, grads = run(plain), run(model)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    stats = offloader.stats
    assert stats.deduplicated_tensors == LAYERS - 1
    assert stats.offloaded_tensors == LAYERS + 1
    assert stats.offloaded_bytes == LAYERS * HIDDEN_BYTES + B * L * 8


def test_offload_with_two_forwards_before_backward_and_retained_graph():
    model = tiny_llama()
    offloader = apply_activation_checkpointing(model, 1.0, offload=True, min_offload_bytes=1024).offloader
    # retained graph: the second backward reloads every layer input from its host copy again
    assert_same(loss_and_grads(tiny_llama(), backwards=2), loss_and_grads(model, backwards=2))
    assert offloader.stats.reloaded_bytes == 2 * offloader.stats.offloaded_bytes

    # gradient accumulation over two micro-batches forwarded before one backward
    inputs, labels = packed_batch()
    results = []
    for net in (tiny_llama(), model):
        net.zero_grad(set_to_none=True)
        first = loss_sum(net, labels, None, **inputs)
        second = loss_sum(net, labels.flip(1), None, **inputs)
        (first + second).backward()
        results.append((first + second, {n: p.grad.clone() for n, p in net.named_parameters()}))
    assert_same(*results)


def test_applying_twice_is_refused():
    model = tiny_llama()
    apply_activation_checkpointing(model, 0.5)
    with pytest.raises(RuntimeError, match="already checkpointed"):
        apply_activation_checkpointing(model, 1.0)
    hf_checkpointed = tiny_llama()
    hf_checkpointed.gradient_checkpointing_enable()
    with pytest.raises(RuntimeError, match="gradient_checkpointing_disable"):
        apply_activation_checkpointing(hf_checkpointed)
