"""Optimizers by state precision and the CUDA allocator setting."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from longfit.config import ConfigError
from longfit.memory.optim import (
    BF16StateAdamW,
    build_optimizer,
)
from longfit.models.loading import resolve_model_config


def tiny_llama():
    config = resolve_model_config("llama-tiny")
    config.update(dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=config._attn_implementation)


def train(model, optimizer, steps: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        input_ids = torch.randint(0, 384, (2, 32), generator=g)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_fp32_adamw_is_torch_adamw():
    optimizer = build_optimizer(tiny_llama().parameters(), lr=1e-3, weight_decay=0.1, kind="adamw")
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["lr"] == 1e-3 and optimizer.defaults["weight_decay"] == 0.1


def test_bf16_state_adamw_tracks_fp32_adamw():
    lr, steps = 2e-3, 6
    start = tiny_llama()
    reference, candidate = copy.deepcopy(start), copy.deepcopy(start)
    train(reference, build_optimizer(reference.parameters(), lr, 0.1, "adamw"), steps)
    optimizer = build_optimizer(candidate.parameters(), lr, 0.1, "adamw_bf16")
    assert isinstance(optimizer, BF16StateAdamW)
    train(candidate, optimizer, steps)
    for (name, want), got, initial in zip(reference.named_parameters(), candidate.parameters(), start.parameters()):
        moved = (want - initial).abs().max()
        assert moved > lr / 2, name  # the reference really trained this parameter
        # bf16 moments (8-bit mantissa): updates within a few percent of each step size
        torch.testing.assert_close(got, want, rtol=0, atol=0.05 * lr * steps, msg=name)
    state = optimizer.state[next(candidate.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_bf16_state_adamw_resumes_from_its_state_dict():
    model = tiny_llama()
    optimizer = BF16StateAdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    train(model, optimizer, 2)
    resumed_model = copy.deepcopy(model)
    resumed = BF16StateAdamW(resumed_model.parameters(), lr=1e-3, weight_decay=0.0)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in resumed.state.values())
    train(model, optimizer, 2, seed=9)
    train(resumed_model, resumed, 2, seed=9)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_8bit_without_cuda_or_library_names_the_key_and_the_install():
    with pytest.raises(ConfigError, match=r"memory\.optimizer=adamw8bit.*pip install torchao"):
        build_optimizer(tiny_llama().parameters(), 1e-3, 0.0, "adamw8bit")
    with pytest.raises(ConfigError, match="memory.optimizer='sgd'"):
        build_optimizer(tiny_llama().parameters(), 1e-3, 0.0, "sgd")


ALLOCATOR_SETTING = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from longfit.memory.optim import allocator_settings, configure_cuda_allocator

    name, user = sys.argv[1:]
    if user:
        os.environ[name] = user
    print(json.dumps([configure_cuda_allocator(), os.environ.get(name), allocator_settings(),
                      torch._C._accelerator_getAllocatorSettings()]))
    """
)


@pytest.mark.parametrize("name, user, applied, variable", [
    ("PYTORCH_CUDA_ALLOC_CONF", "", True, "expandable_segments:True"),
    # a user's other settings no longer turn it off, and under torch 2.9's name it goes through the API too
    ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128", True, "max_split_size_mb:128,expandable_segments:True"),
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128", True, "max_split_size_mb:128,expandable_segments:True"),
    ("PYTORCH_ALLOC_CONF", "expandable_segments:False", False, "expandable_segments:False"),
])
def test_cuda_allocator_setting_respects_the_user(name, user, applied, variable):
    """In a fresh process: the variable only counts before CUDA is initialised, which other tests do on a GPU
    machine. The allocator API (torch >= 2.9) holds the setting whatever the variable's name."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    done = subprocess.run([sys.executable, "-c", ALLOCATOR_SETTING, name, user], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result[:2] == [applied, variable]
    assert f"{name}={variable}" in result[2]
    assert ("expandable_segments:True" in result[3]) == applied
