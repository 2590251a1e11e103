"""flash-linear-attention older than 0.5.0 is refused where a model with linear-attention layers is prepared on a CUDA
machine (issue 46, fix 1): its 0.4.x releases read grouped value heads (Qwen3.5: 16 key, 48 value heads) with the
wrong stride, silently. The installed release is faked here (no GPU, no package needed); tests/test_gpu_hybrid.py
runs the real kernel against the torch one with Hk != Hv under `-m gpu`."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

from longfit.config import ConfigError
from longfit.models import linear_attention
from longfit.models.linear_attention import prepare_linear_attention

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
             linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def qwen3_5():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_5_text", **SMALL)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def installed(monkeypatch, version: str | None, cuda: bool = True) -> None:
    """Make flash-linear-attention `version` look installed (None: not installed) on a machine with(out) CUDA."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if version else None) if name == "fla" else find_spec(name, *a))
    metadata_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: version if name == "flash-linear-attention" else metadata_version(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


@pytest.mark.parametrize("version", ["0.4.0", "0.4.2", "0.3.2"])
def test_an_older_release_is_refused_where_the_model_is_prepared(monkeypatch, qwen3_5, version):
    installed(monkeypatch, version)
    with pytest.raises(ConfigError, match=rf"flash-linear-attention {version} is installed: .*>=0\.5\.0") as refused:
        prepare_linear_attention(qwen3_5)
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError):  # and where the kernel would be chosen
        linear_attention._fla_chunk_gated_delta_rule.__wrapped__()


@pytest.mark.parametrize("version,cuda", [("0.5.0", True), ("0.5.2", True), ("1.0.0", True), (None, True),
                                          ("0.4.2", False)])
def test_a_release_with_grouped_value_heads_or_no_cuda_passes(monkeypatch, qwen3_5, version, cuda):
    """0.5.0 and later, no package, or a machine without CUDA (the torch kernel runs there whatever is installed)."""
    installed(monkeypatch, version, cuda)
    assert prepare_linear_attention(qwen3_5) == 1

