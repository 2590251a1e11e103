"""apply_memory_techniques: "auto" resolution, and every technique together is exact (plain and LoRA)."""

import functools

import pytest
import torch
from memory_helpers import loss_sum, packed_batch
from memory_helpers import tiny_llama as build_tiny_llama
from torch import nn

from longfit.config import Config, ConfigError, load_config
from longfit.memory.apply import apply_memory_techniques, offloaders, release_offload_stores
from longfit.memory.switches import resolve_memory_switches

B, L, H, LAYERS, VOCAB = 2, 48, 64, 4, 384
tiny_llama = functools.partial(build_tiny_llama, layers=LAYERS)


def lora(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                                "gate_proj", "up_proj", "down_proj"]))
    for name, param in model.named_parameters():  # non-zero B so every adapter gets a gradient
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(4))
    return model


def loss_and_grads(model, loss_chunk, autocast: torch.dtype | None = None):
    model.zero_grad(set_to_none=True)
    inputs, labels = packed_batch()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = loss_sum(model, labels, loss_chunk, **inputs) / (labels != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def everything_on(seq_len: int = 64) -> Config:
    return load_config(overrides=[
        f"seq_len={seq_len}", "memory.activation_checkpointing=true", "memory.checkpoint_fraction=1.0",
        "memory.offload_activations=true", "memory.tiled_mlp=true", "memory.mlp_tiles=3",
        "memory.chunked_loss=true", "memory.loss_chunk=20",
    ])


@pytest.mark.parametrize("with_lora", [False, True])
def test_all_techniques_together_are_exact(with_lora):
    wrap = lora if with_lora else (lambda m: m)
    reference = loss_and_grads(wrap(tiny_llama()), None)
    model = wrap(tiny_llama())
    applied = apply_memory_techniques(model, everything_on(), "cpu")
    assert (applied.checkpointed_layers, applied.total_layers) == (LAYERS, LAYERS)
    assert applied.switches.loss_chunk == 20 and applied.switches.mlp_tiles == 3
    applied.offloader.min_offload_bytes = 1024  # the tiny model's layer inputs are below the 1 MiB default
    result = loss_and_grads(model, applied.switches.loss_chunk)
    torch.testing.assert_close(result[0], reference[0])
    assert result[1].keys() == reference[1].keys()
    expected_count = sum(p.requires_grad for p in model.parameters())
    assert len(result[1]) == expected_count and (not with_lora or all("lora_" in n for n in result[1]))
    for name, grad in reference[1].items():
        torch.testing.assert_close(result[1][name], grad, msg=name)
    assert applied.offloader.stats.offloaded_bytes == LAYERS * B * L * H * 4
    assert applied.summary() == (
        "checkpointing 4/4 layers + offload (GPU 0, host 4, disk 0 layers), tiled MLP (3 tiles), chunked loss "
        "(20 tokens/chunk), optimizer adamw"
    )


@pytest.mark.parametrize("with_lora", [False, True])
def test_tiled_layers_with_every_other_technique_are_exact(with_lora):
    """Half the layers tiled (their inputs offloaded), the other half plain with a tiled MLP, chunked loss."""
    from longfit.memory.tiled_layers import TILED_LAYER_ATTR
    from longfit.memory.tiled_mlp import TILED_MLP_ATTR
    from longfit.models.structure import decoder_layers
    from longfit.parallel.tiled_attention import LocalTileAttention

    wrap = lora if with_lora else (lambda m: m)
    reference = loss_and_grads(wrap(tiny_llama()), None)
    model = wrap(tiny_llama())
    cfg = load_config(overrides=["seq_len=64", "memory.checkpoint_fraction=0.5",
                                 "memory.offload_activations=true", "memory.tiled_mlp=true", "memory.mlp_tiles=3",
                                 "memory.loss_chunk=20", "memory.tiled_layers=true", "memory.layer_tiles=3"])
    with pytest.raises(ValueError, match="tile_attention"):
        apply_memory_techniques(wrap(tiny_llama()), cfg, "cpu")
    applied = apply_memory_techniques(model, cfg, "cpu", tile_attention=LocalTileAttention.for_sequence)
    layers = decoder_layers(model)
    assert [hasattr(layer, TILED_LAYER_ATTR) for layer in layers] == [True, True, False, False]
    assert [hasattr(layer.mlp, TILED_MLP_ATTR) for layer in layers] == [False, False, True, True]
    applied.offloader.min_offload_bytes = 1024
    result = loss_and_grads(model, applied.switches.loss_chunk)
    torch.testing.assert_close(result[0], reference[0])
    assert result[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(result[1][name], grad, msg=name)
    assert applied.offloader.stats.offloaded_bytes == B * L * H * 4  # the first layer looks its input up again
    assert applied.summary().startswith("tiled layers 2/4 (3 tiles) + offload (GPU 0, host 1, disk 0 layers), tiled MLP")


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tiled", [False, True], ids=["checkpointed", "tiled"])
def test_release_offload_stores_reaches_the_store_behind_the_trainers_wrapper(tiled, autocast):
    """Through `CausalLMLoss` (what the trainer holds), `release_offload_stores` finds the checkpointed or tiled
    layers' store and gives its host arena back; the next step allocates it again and gives the same loss and
    gradients bit for bit."""
    from longfit.memory.loss import CausalLMLoss
    from longfit.parallel.tiled_attention import LocalTileAttention

    model = tiny_llama()
    cfg = load_config(overrides=["seq_len=64", "memory.offload_activations=true",
                                 f"memory.tiled_layers={str(tiled).lower()}", "memory.layer_tiles=2"])
    applied = apply_memory_techniques(model, cfg, "cpu", tile_attention=LocalTileAttention.for_sequence)
    applied.offloader.min_offload_bytes = 1024
    wrapper = CausalLMLoss(model)
    assert offloaders(wrapper) == [applied.offloader]
    store = applied.offloader.store
    first = loss_and_grads(model, None, autocast)
    assert store.allocated_host_bytes == (LAYERS - tiled) * B * L * H * 4  # the first tiled layer stores nothing
    release_offload_stores(wrapper)
    assert store.allocated_host_bytes == 0
    again = loss_and_grads(model, None, autocast)
    assert store.allocated_host_bytes == (LAYERS - tiled) * B * L * H * 4
    release_offload_stores(wrapper)
    assert torch.equal(again[0], first[0]) and again[1].keys() == first[1].keys()
    for name, grad in first[1].items():
        assert torch.equal(again[1][name], grad), name


def test_evaluation_without_grad_gives_the_same_logits():
    inputs, _ = packed_batch()
    reference, model = tiny_llama().eval(), tiny_llama().eval()
    apply_memory_techniques(model, everything_on(), "cpu")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits)


def test_auto_switches_follow_device_and_sequence_length():
    def switches(seq_len, device, *overrides):
        return resolve_memory_switches(load_config(overrides=[f"seq_len={seq_len}", *overrides]), device, 128256)

    assert switches(32768, "cuda").offload_activations
    assert not switches(32767, "cuda").offload_activations
    assert not switches(65536, "cpu").offload_activations
    assert not switches(65536, "cuda", "memory.activation_checkpointing=false").offload_activations
    assert switches(8192, "cuda").tiled_mlp and not switches(8191, "cuda").tiled_mlp
    assert not switches(65536, "cpu").tiled_mlp and switches(1024, "cpu", "memory.tiled_mlp=true").tiled_mlp
    assert not switches(65536, "cuda", "memory.tiled_mlp=false").tiled_mlp
    default = switches(8192, "cpu")
    assert default.loss_chunk == 256 and default.mlp_tiles is None and default.optimizer == "adamw"
    assert switches(8192, "cpu", "memory.chunked_loss=false").loss_chunk is None
    assert switches(8192, "cpu", "memory.loss_chunk=100").loss_chunk == 100


def test_tiled_layers_auto_from_64k_tokens_per_gpu_and_never_with_tensor_parallelism():
    def switches(seq_len, *overrides):
        return resolve_memory_switches(load_config(overrides=[f"seq_len={seq_len}", *overrides]), "cuda", 128256)

    assert switches(65536).tiled_layers and not switches(65535).tiled_layers
    assert not switches(131072, "parallel.cp=4").tiled_layers and switches(262144, "parallel.cp=4").tiled_layers
    assert not resolve_memory_switches(load_config(overrides=["seq_len=262144"]), "cpu", 128256).tiled_layers
    # tensor parallelism: auto leaves them off, true is refused naming the fix
    assert not switches(1 << 20, "parallel.tp=2").tiled_layers
    with pytest.raises(ConfigError, match=r"memory.tiled_layers=true does not compose with tensor parallelism "
                                          r"\(parallel.tp=2\): set memory.tiled_layers=auto"):
        switches(4096, "parallel.tp=2", "memory.tiled_layers=true")
    with pytest.raises(ConfigError, match="set memory.activation_checkpointing=true"):
        switches(4096, "memory.tiled_layers=true", "memory.activation_checkpointing=false")


def test_nothing_applied_when_switched_off():
    model = tiny_llama()
    cfg = load_config(overrides=["memory.activation_checkpointing=false", "memory.tiled_mlp=false",
                                 "memory.chunked_loss=false"])
    applied = apply_memory_techniques(model, cfg, "cpu")
    assert applied.checkpointed_layers == 0 and applied.offloader is None and applied.switches.loss_chunk is None
    assert all("forward" not in vars(m) for m in model.modules())  # no layer or MLP forward replaced


def test_bad_memory_settings_name_the_key():
    cfg = Config()
    cfg.memory.activation_checkpointing = False
    cfg.memory.offload_activations = True
    with pytest.raises(ConfigError, match="memory.activation_checkpointing=true"):
        resolve_memory_switches(cfg, "cuda", 1000)
    for override in ("memory.mlp_tiles=-1", "memory.loss_chunk=-5"):
        with pytest.raises(ConfigError, match=override):
            load_config(None, [override])


@pytest.mark.parametrize("asked", ["memory.offload_activations=true", "memory.tiled_layers=true"])
def test_a_technique_on_no_checkpointed_layer_is_refused_before_the_model_is_built(asked):
    """0.1 of llama-tiny's 4 layers rounds to none: offload or tiled layers asked for would silently not run."""
    from longfit.plan.setup import resolve

    cfg = load_config(None, ["model=llama-tiny", "memory.checkpoint_fraction=0.1", asked])
    with pytest.raises(ConfigError, match=rf"checkpoints none of the 4 decoder layers, and {asked.split('=')[0]} "
                                          r"act on the checkpointed ones: raise memory.checkpoint_fraction to 0.25"):
        resolve(cfg, 1, "cuda")
    with pytest.raises(ConfigError, match="checkpoints none of the 4 decoder layers"):
        apply_memory_techniques(tiny_llama(), cfg, "cpu")
    automatic = load_config(None, ["model=llama-tiny", "memory.checkpoint_fraction=0.1", "seq_len=65536"])
    assert not resolve(automatic, 1, "cuda").offload_activations  # auto: simply off
