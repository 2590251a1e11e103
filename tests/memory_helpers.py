"""Shared by the memory tests: a tiny real Llama with longfit attention, the trainer's loss, an allocation probe."""

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from longfit.memory.chunked_loss import chunked_cross_entropy, full_cross_entropy
from longfit.models.loading import resolve_model_config
from longfit.models.structure import decoder_and_head


def tiny_llama(hidden: int = 64, intermediate: int | None = None, layers: int = 2, tied: bool = False, seed: int = 0):
    config = resolve_model_config("llama-tiny")
    config.update(dict(hidden_size=hidden, intermediate_size=intermediate or 4 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=tied))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=config._attn_implementation)
    model.config.use_cache = False
    return model


def packed_batch(vocab: int = 384):
    """Two rows of 48 tokens: row 0 holds two documents (20 + 28 tokens), row 1 one; -100 at document ends."""
    batch, length = 2, 48
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (batch, length), generator=g)
    labels = torch.randint(0, vocab, (batch, length), generator=g)
    labels[0, 19] = labels[0, -1] = labels[1, -1] = -100
    position_ids = torch.cat([torch.arange(20), torch.arange(28), torch.arange(length)]).view(batch, length)
    cu_seqlens = torch.tensor([0, 20, length, 2 * length], dtype=torch.int32)
    return dict(input_ids=input_ids, position_ids=position_ids, cu_seq_lens_q=cu_seqlens), labels


def loss_sum(model, labels, chunk, **inputs):
    """Summed token loss the trainer's way: decoder body, then full logits (chunk None) or chunked loss."""
    body, head = decoder_and_head(model)
    hidden = body(**inputs).last_hidden_state  # (B, L, H)
    return full_cross_entropy(hidden, head, labels) if chunk is None else chunked_cross_entropy(hidden, head, labels, chunk)


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
