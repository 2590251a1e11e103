"""Tiled MLP: exact alone and nested in layer checkpointing; the (tokens, intermediate) tensor never exists."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from longfit.memory.checkpointing import apply_activation_checkpointing, decoder_layers
from longfit.memory.chunked_loss import chunked_cross_entropy, full_cross_entropy
from longfit.memory.tiled_mlp import apply_tiled_mlp, mlp_tile_count
from longfit.models.loading import resolve_model_config

B, L, H, INTERMEDIATE, LAYERS, VOCAB = 2, 50, 64, 256, 2, 384


def tiny_llama(seed: int = 0):
    config = resolve_model_config("llama-tiny")
    config.update(dict(hidden_size=H, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=config._attn_implementation)
    model.config.use_cache = False
    return model


def loss_sum(model, labels, chunk, **inputs):
    """Summed token loss the trainer's way: decoder body, then full logits (chunk None) or chunked loss."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.get_decoder()(**inputs).last_hidden_state  # (B, L, H)
    head = causal_lm.get_output_embeddings()
    return full_cross_entropy(hidden, head, labels) if chunk is None else chunked_cross_entropy(hidden, head, labels, chunk)


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


class LargestAllocation(TorchDispatchMode):
    """Bytes of the largest new storage any aten op (forward or backward) produced; views are not new."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


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
