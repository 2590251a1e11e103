"""LoRA's frozen base in the compute dtype, and QLoRA's 4-bit base (bitsandbytes, which also runs on CPU)."""

import importlib.util

import pytest
import torch
from test_train import exported_weights, metric_rows, run_config

from longfit.config import ConfigError, load_config
from longfit.memory.loss import CausalLMLoss
from longfit.models.build import build_model
from longfit.train.loop import train


def model_config(model_dir, *extra):
    return load_config(None, [f"model={model_dir}", "lora.enabled=true", "lora.r=4", *extra])


def packed_batch(vocab: int, length: int = 96):
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, vocab, (1, length), generator=g)
    labels = torch.randint(0, vocab, (1, length), generator=g)
    position_ids = torch.cat([torch.arange(40), torch.arange(length - 40)]).view(1, length)
    return input_ids, labels, position_ids, torch.tensor([0, 40, length], dtype=torch.int32)


def randomize_lora_b(model, seed: int = 5):
    """peft starts lora_B at zero, which would make every lora_A gradient zero."""
    g = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=g) * 0.1


def test_lora_stores_the_frozen_base_in_the_compute_dtype(tiny_model_dir):
    model = build_model(model_config(tiny_model_dir), torch.bfloat16, "cpu")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}
    full = build_model(load_config(None, [f"model={tiny_model_dir}"]), torch.bfloat16, "cpu")
    assert {p.dtype for p in full.parameters()} == {torch.float32}  # master weights of full fine-tuning


def test_lora_on_a_bf16_base_resumes_exactly(tiny_model_dir, corpus, tmp_path):
    extra = ("lora.enabled=true", "lora.r=4", "train.dtype=bf16", "train.steps=3")
    train(run_config(tiny_model_dir, corpus, tmp_path / "straight", *extra))
    interrupted = run_config(tiny_model_dir, corpus, tmp_path / "interrupted", *extra)
    train(interrupted, stop_after_steps=1)
    train(interrupted)
    losses = [[row["loss"] for row in metric_rows(tmp_path / run)] for run in ("straight", "interrupted")]
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]


def test_qlora_matches_lora_on_the_dequantized_base(tiny_model_dir):
    """The 4-bit base changes the weights (by the NF4 rounding), never the math on them: loss and every
    adapter gradient equal those of plain LoRA on the dequantized weights (fp32 compute, CPU kernels)."""
    pytest.importorskip("bitsandbytes")
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from longfit.models.build import lora_config, use_lora_storage
    from longfit.models.quantize import dequantized_state_dict

    cfg = model_config(tiny_model_dir, "lora.quantize_base=true", "lora.target_modules=[q_proj,v_proj,down_proj]")
    quantized = build_model(cfg, torch.float32, "cpu")
    randomize_lora_b(quantized)
    packed_bytes = {n: p.numel() * p.element_size() for n, p in quantized.named_parameters() if "base_layer" in n}
    assert len(packed_bytes) == 3 * 2  # three projections in each of the two layers
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_config(cfg))
    adapted_weights = sum(p.numel() for n, p in reference.named_parameters() if "base_layer" in n)
    assert sum(packed_bytes.values()) == adapted_weights // 2  # 4 bits per weight (statistics kept apart)
    reference.load_state_dict(dequantized_state_dict(quantized), strict=True)
    use_lora_storage(reference, torch.float32)
    base_q = reference.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    original_q = AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(base_q, original_q) and torch.allclose(base_q, original_q, atol=0.05)

    batch = packed_batch(quantized.config.vocab_size)
    losses, grads = [], []
    for model in (quantized, reference):
        loss = CausalLMLoss(model)(*batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 3 * 2
    for name in grads[0]:
        assert grads[0][name].abs().sum() > 0, name
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("merge", [False, True])
def test_qlora_trains_and_exports(tiny_model_dir, corpus, tmp_path, merge):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "qlora"
    summary = train(run_config(tiny_model_dir, corpus, out, "lora.enabled=true", "lora.r=4", "lora.quantize_base=true",
                               f"lora.merge_on_export={str(merge).lower()}"))
    losses = [row["loss"] for row in metric_rows(out)]
    assert losses[-1] < losses[0] and summary.export_dir == out / "final"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    if merge:
        merged = AutoModelForCausalLM.from_pretrained(out / "final")
        weights = exported_weights(out)
        assert not any("absmax" in k or "quant" in k or "lora" in k for k in weights)
        q_trained, q_base = merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight
        assert not torch.equal(q_trained, q_base) and torch.allclose(q_trained, q_base, atol=0.1)
    else:
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, out / "final")
        assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_qlora_refuses_sharding_and_a_missing_bitsandbytes(tiny_model_dir, monkeypatch):
    cfg = model_config(tiny_model_dir, "lora.quantize_base=true")
    with pytest.raises(ConfigError, match="lora.quantize_base=false"):
        build_model(cfg, torch.bfloat16, "cpu", fsdp=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install bitsandbytes"):
        build_model(cfg, torch.bfloat16, "cpu")
