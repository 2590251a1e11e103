"""The planner's parameter counts equal transformers' for architectures outside the preset families: counted on
the model built on the meta device (experts, linear-attention and latent-attention layers included), from
config.json alone. The presets' torch-free counts: tests/test_plan_analytic.py."""

from __future__ import annotations

import copy

import pytest
import torch

from longfit.plan.shapes import model_shape

# The published configs' widths (config.json only, no weights) of the new families.
NEW_FAMILIES = {
    "qwen3-30b-a3b": (30.53e9, dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False)),
    "gpt-oss-20b": (20.91e9, dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, tie_word_embeddings=False)),
    "deepseek-v2-lite": (15.71e9, dict(
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400, tie_word_embeddings=False)),
    "qwen3.5 (defaults, multimodal config)": (None, dict(model_type="qwen3_5")),
    "gemma-4 (defaults, multimodal config)": (None, dict(model_type="gemma4")),
}


def transformers_count(config) -> tuple[int, int]:
    """(all parameters, the largest decoder layer's) of transformers' causal LM of `config`, on the meta device."""
    from transformers import AutoModelForCausalLM

    from longfit.models.structure import decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config.get_text_config())
    return (sum(p.numel() for p in model.parameters()),
            max(sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)))


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_other_architectures_are_counted_on_the_meta_model(tmp_path, name: str) -> None:
    from transformers import AutoConfig

    published, values = copy.deepcopy(NEW_FAMILIES[name])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    assert shape.counted is not None
    assert (shape.params, shape.layer_params) == transformers_count(AutoConfig.from_pretrained(tmp_path))
    if published:
        assert shape.params == pytest.approx(published, rel=2e-3)  # the released checkpoints' sizes


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_longfit_plan_counts_the_experts(tmp_path, capsys) -> None:
    """An MoE plan's model states are those of all its experts: 4 + 8 bytes per parameter of weights and AdamW
    state (fp32), sharded over the 8 GPUs."""
    import json

    from transformers import AutoConfig

    from longfit.cli import main

    _, values = copy.deepcopy(NEW_FAMILIES["qwen3-30b-a3b"])
    AutoConfig.for_model(values.pop("model_type"), **values).save_pretrained(tmp_path)
    assert main(["plan", f"model={tmp_path}", "seq_len=32768", "parallel.cp=8", "memory.tiled_mlp=false", "--gpu",
                 "h100-80gb", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    params = model_shape(str(tmp_path)).params
    assert plan["breakdown"]["weights"] == 4 * params // 8
    assert plan["breakdown"]["optimizer state"] == 8 * params // 8
    assert plan["notes"] == ["qwen3_moe: parameters counted on the model transformers builds on the meta device "
                             "(30.53B, every layer kind and expert)"]


def test_an_moe_on_one_gpu_is_planned_under_autocast(tmp_path) -> None:
    """One GPU, full fine-tuning, bf16: autocast with fp32 weights. The experts' grouped matmul has no autocast
    rule, so its operands stay fp32 as in the real step (plan/trace.py's _GroupedMatmulInItsDtype). Before: refused,
    fake tensors' grouped_mm took only bf16. Measured: +0.2% against the whole-step trace."""
    from transformers import AutoConfig

    from longfit.config import load_config
    from longfit.plan.analytic import plan_config
    from longfit.plan.trace import trace_step

    AutoConfig.for_model("qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                         num_experts_per_tok=2, vocab_size=512).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model={tmp_path}", "seq_len=4096", "train.dtype=bf16", "memory.tiled_mlp=false"])
    analytic, traced = plan_config(cfg, 1).tensor_bytes, trace_step(cfg, 1).peak_bytes
    assert abs(analytic / traced - 1) <= 0.03, f"analytic {analytic} vs traced {traced}"


def test_tiled_layers_are_left_off_a_model_sharing_keys_between_layers(tmp_path) -> None:
    """Gemma 4's last layers attend to an earlier layer's keys and values (num_kv_shared_layers), which a tile does not
    compute: the planner reads the trainer's rule (`untileable_layers`) off the counted model, so that `auto` leaves
    tiled layers off (Gemma-4-E2B at 128K was planned tiled and then refused, #52)."""
    from transformers import AutoConfig

    from longfit.config import load_config
    from longfit.plan.setup import resolve

    AutoConfig.for_model("gemma4_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=32,
                         hidden_size_per_layer_input=16, vocab_size=256, vocab_size_per_layer_input=256,
                         layer_types=["sliding_attention", "full_attention"] * 2,
                         num_kv_shared_layers=2).save_pretrained(tmp_path / "shared")
    shape = model_shape(str(tmp_path / "shared"))
    assert "num_kv_shared_layers" in shape.untileable_layers
    assert model_shape("llama-tiny").untileable_layers is None
    cfg = load_config(None, [f"model={tmp_path / 'shared'}", "seq_len=131072", "memory.tiled_layers=auto"])
    assert not resolve(cfg, 1, "cuda", 80 << 30).tiled_layers
