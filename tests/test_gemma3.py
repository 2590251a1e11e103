"""Gemma 3 end to end: the gemma-3-tiny preset through `longfit train` on one process and on two with
ring and Ulysses context parallelism, and the language model of a multimodal checkpoint (loaded from the
Gemma3ForConditionalGeneration weights, trained, exported as the Gemma3ForConditionalGeneration it came from)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from longfit.config import load_config
from longfit.models.attention import longfit_attention_forward
from longfit.models.loading import load_model, resolve_model_config
from longfit.train.loop import train


def longfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longfit", *args], capture_output=True, text=True, timeout=600)


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 26 s; Gemma 3 under cp=2 stays in the default suite through test_families (2026-11-27)
@pytest.mark.timeout(900)
def test_gemma_3_tiny_trains_with_the_same_losses_on_one_and_two_ranks(tmp_path):
    """seq_len 128 on cp=2: chunks of 32 tokens, so the 32-token window of the local layers goes through the halo."""
    common = ["model=gemma-3-tiny", "seq_len=128", "train.device=cpu", "train.steps=2", "train.micro_batch=2", "data.synthetic_samples=64",
              "train.export=false"]
    single = longfit("train", *common, f"output_dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr[-3000:]
    for method in ("ring", "ulysses"):
        out = tmp_path / method
        parallel = ["parallel.cp=2", f"parallel.cp_method={method}"]
        done = longfit("train", "--nproc", "2", *common, f"output_dir={out}", *parallel)
        assert done.returncode == 0, done.stderr[-3000:]
        assert losses(out) == pytest.approx(losses(tmp_path / "single"), rel=1e-4), method


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration checkpoint (SigLIP tower + language model) with longfit's tokenizer."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    from longfit.data.tokenizer import byte_tokenizer

    path = tmp_path_factory.mktemp("gemma3-multimodal")
    text = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=16, sliding_window_pattern=2,
                query_pre_attn_scalar=16, max_position_embeddings=1024)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=380,
                          eoi_token_index=381, image_token_index=382)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def language_model_weights(path) -> dict[str, torch.Tensor]:
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(path).model.language_model.state_dict()


def test_multimodal_checkpoint_loads_its_language_model_exactly(multimodal_dir):
    model = load_model(str(multimodal_dir))
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert resolve_model_config(str(multimodal_dir)).model_type == "gemma3_text"
    want, got = language_model_weights(multimodal_dir), model.model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_multimodal_checkpoint_trains_and_exports_the_multimodal_model(multimodal_dir, corpus, tmp_path):
    """The export is the Gemma3ForConditionalGeneration that came in, its language model trained (the export in
    full: tests/test_wrappers.py)."""
    from transformers import Gemma3ForConditionalGeneration

    cfg = load_config(None, [f"model={multimodal_dir}", f"data.path={corpus}", f"output_dir={tmp_path / 'run'}",
                             "seq_len=64", "train.device=cpu", "train.steps=2", "train.micro_batch=2", "memory.tiled_mlp=false"])
    summary = train(cfg)
    exported = Gemma3ForConditionalGeneration.from_pretrained(summary.export_dir)
    original, trained = language_model_weights(multimodal_dir), exported.model.language_model.state_dict()
    assert trained.keys() == original.keys()
    assert all(not torch.equal(trained[name], original[name]) for name in original)
    ids = torch.tensor([[256, 104, 105, 33]])
    assert torch.isfinite(exported(input_ids=ids).logits).all()


class _Module(torch.nn.Module):
    is_causal = True


def test_attention_refuses_bidirectional_layers():
    """Bidirectional layers (Llama 4's chunked layers are computed, and its temperature tuning refused where it is not
    exact: tests/test_families_attention.py)."""
    module = _Module()
    module.is_causal = False
    q = torch.zeros(1, 4, 8, 16)
    with pytest.raises(ValueError, match="bidirectionally"):
        longfit_attention_forward(module, q, q[:, :2], q[:, :2], None, sliding_window=4)
