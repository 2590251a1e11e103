"""Tiled MLP: exact alone and nested in layer checkpointing; the (tokens, intermediate) tensor never exists."""

import functools

import pytest
import torch
from memory_helpers import LargestAllocation, loss_sum
from memory_helpers import tiny_llama as build_tiny_llama

from longfit.memory.checkpointing import apply_activation_checkpointing, decoder_layers
from longfit.memory.switches import mlp_tile_count
from longfit.memory.tiled_mlp import apply_tiled_final_norm, apply_tiled_mlp
from longfit.plan.tracker import LiveBytes

B, L, H, INTERMEDIATE, LAYERS, VOCAB = 2, 50, 64, 256, 2, 384
tiny_llama = functools.partial(build_tiny_llama, intermediate=INTERMEDIATE, layers=LAYERS)


def batch(length: int = L):
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, VOCAB, (B, length), generator=g)
    labels[:, -1] = -100
    return torch.randint(0, VOCAB, (B, length), generator=g), labels


def loss_and_grads(model):
    input_ids, labels = batch()
    loss = loss_sum(model, labels, None, input_ids=input_ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(reference, other):
    torch.testing.assert_close(other[0], reference[0])
    assert other[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(other[1][name], grad, msg=name)


def count_gate_calls(model) -> list[int]:
    calls = [0] * LAYERS
    for i, layer in enumerate(decoder_layers(model)):
        layer.mlp.gate_proj.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def test_tiled_mlp_is_exact():
    reference = loss_and_grads(tiny_llama())
    model = tiny_llama()
    keys = list(model.state_dict())
    assert apply_tiled_mlp(model, tiles=3).tiles == 3  # 100 tokens: tiles of 34, 33, 33
    assert list(model.state_dict()) == keys
    calls = count_gate_calls(model)
    assert_same(reference, loss_and_grads(model))
    assert calls == [2 * 3] * LAYERS  # every tile ran in forward and once more in its backward


def test_tiled_mlp_nested_in_checkpointing_with_offload_is_exact():
    reference = loss_and_grads(tiny_llama())
    model = tiny_llama()
    apply_tiled_mlp(model, tiles=4)
    offloader = apply_activation_checkpointing(model, 1.0, offload=True, min_offload_bytes=1024).offloader
    calls = count_gate_calls(model)
    assert_same(reference, loss_and_grads(model))
    # forward, layer recompute (which stops once the last tile's input is saved), then each tile's recompute
    assert calls == [4 + 3 + 4] * LAYERS
    # the offload hooks see the layer inputs only, not the tiles saved inside the checkpoint
    assert offloader.stats.offloaded_tensors == LAYERS


def test_derived_tile_count_runs_and_follows_the_formula():
    # tiles of t tokens with 4 live (t, I) tensors fit in one (L, H) tensor: ceil(4 * I / H), >= 1024 tokens each
    assert mlp_tile_count(131072, 4096, 14336) == 14
    assert mlp_tile_count(131072, 3584, 18944) == 22
    assert mlp_tile_count(4096, 4096, 14336) == 4  # capped by the minimum tile length
    assert mlp_tile_count(100, 4096, 14336) == 1
    assert mlp_tile_count(8192, 64, 256, min_tile_tokens=16) == 16
    with pytest.raises(ValueError, match="seq_len"):
        mlp_tile_count(0, 64, 256)
    model = tiny_llama()
    assert apply_tiled_mlp(model, tiles=None).tiles is None
    assert_same(loss_and_grads(tiny_llama()), loss_and_grads(model))
    with pytest.raises(RuntimeError, match="already tiled"):
        apply_tiled_mlp(model, tiles=2)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_no_tensor_of_all_tokens_by_intermediate_exists(checkpointing):
    length = 128  # B*L*I = 65536 elements, more than any other tensor of the decoder (embedding grad: 24576)
    input_ids, _ = batch(length)
    full_mlp_bytes = B * length * INTERMEDIATE * 4

    def largest_allocation(model):
        if checkpointing:
            apply_activation_checkpointing(model, 1.0)
        with LargestAllocation() as probe:
            model.model(input_ids=input_ids).last_hidden_state.square().sum().backward()
        return probe.largest

    assert largest_allocation(tiny_llama()) >= full_mlp_bytes  # the probe sees it when it exists
    tiled = tiny_llama()
    apply_tiled_mlp(tiled, tiles=4)
    assert largest_allocation(tiled) < full_mlp_bytes / 2


def test_tiled_final_norm_holds_one_output_in_forward():
    """The tiles are written into one output as they finish: live bytes above the input peak at that output
    plus one tile's temporaries, never at the tiles and their concatenation (two outputs)."""
    model = tiny_llama()
    apply_tiled_final_norm(model, tiles=16)
    norm = model.model.norm
    x = torch.randn(1, 4096, H, requires_grad=True)
    output_bytes = x.numel() * 4  # = the input's
    with LiveBytes() as live:
        live.adopt([x], "input")
        live.reset_peak()
        y = norm(x)
    assert y.shape == x.shape and live.live - output_bytes == output_bytes
    assert live.peak - output_bytes < output_bytes * (1 + 4 / 16)  # an RMSNorm tile: a few fp32 temporaries of its rows
    y.square().sum().backward()
    reference = x.detach().clone().requires_grad_(True)
    type(norm).forward(norm, reference).square().sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)


@pytest.mark.parametrize("view", [False, True])
def test_tiled_final_norm_leaves_a_callers_leaf_alone(view):
    """Its backward writes the input gradient over an input the graph produced, never over a caller's leaf,
    also when the norm sees a view of that leaf."""
    model = tiny_llama()
    apply_tiled_final_norm(model, tiles=4)
    leaf = torch.randn(2, 64, H, requires_grad=True)
    original = leaf.detach().clone()
    model.model.norm(leaf[:, :] if view else leaf).square().sum().backward()
    assert torch.equal(leaf.detach(), original)
    reference = original.clone().requires_grad_(True)
    type(model.model.norm).forward(model.model.norm, reference).square().sum().backward()
    torch.testing.assert_close(leaf.grad, reference.grad)
