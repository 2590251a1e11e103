"""Every memory technique under FSDP2 (2 gloo ranks) gives the single-process plain loss and gradients."""

import copy
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402

from longfit.config import load_config
from longfit.memory.apply import apply_memory_techniques
from longfit.memory.chunked_loss import chunked_cross_entropy, full_cross_entropy
from longfit.models.loading import resolve_model_config
from longfit.models.structure import decoder_layers

B, L, H, LAYERS, VOCAB, WORLD = 2, 48, 64, 3, 384, 2


def tiny_llama():
    config = resolve_model_config("llama-tiny")
    config.update(dict(hidden_size=H, intermediate_size=4 * H, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=config._attn_implementation)
    model.config.use_cache = False
    return model


class LossRoot(nn.Module):
    """Root FSDP unit whose forward returns the summed loss, so embeddings/norm/lm_head are gathered for it."""

    def __init__(self, model, loss_chunk):
        super().__init__()
        self.model, self.loss_chunk = model, loss_chunk

    def forward(self, input_ids, labels, position_ids, cu_seqlens):
        hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                          cu_seq_lens_q=cu_seqlens).last_hidden_state  # (B, L, H)
        head = self.model.get_output_embeddings()
        if self.loss_chunk is None:
            return full_cross_entropy(hidden, head, labels)
        return chunked_cross_entropy(hidden, head, labels, self.loss_chunk)


def batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (B, L), generator=g)
    labels = torch.randint(0, VOCAB, (B, L), generator=g)
    labels[0, 19] = labels[:, -1] = -100
    position_ids = torch.cat([torch.arange(20), torch.arange(28), torch.arange(L)]).view(B, L)
    return input_ids, labels, position_ids, torch.tensor([0, 20, L, 2 * L], dtype=torch.int32)


def sharded_run(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_llama()
    cfg = load_config(overrides=["seq_len=64", "memory.offload_activations=true", "memory.tiled_mlp=true",
                                 "memory.mlp_tiles=3", "memory.chunked_loss=true", "memory.loss_chunk=20"])
    applied = apply_memory_techniques(model, cfg, "cpu")
    applied.offloader.min_offload_bytes = 1024  # the tiny layer inputs are below the 1 MiB default
    root = LossRoot(model, applied.switches.loss_chunk)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    loss = root(*batch())  # the same batch on both ranks: the averaged gradient is the one-process one
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return loss.detach(), grads, applied.offloader.stats.offloaded_bytes


def test_memory_techniques_under_fsdp2_match_one_process_plain():
    loss, grads, offloaded_bytes = run_distributed(sharded_run, WORLD)[0]

    model = tiny_llama()
    reference = LossRoot(model, None)(*batch())
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    assert grads.keys() == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)
    assert offloaded_bytes == LAYERS * B * L * H * 4
