"""Named model presets: Hugging Face config numbers, no weights (random init, or meta device for planning).

`llama-tiny` is the embedded default (byte-level vocabulary, trains on CPU in minutes); `llama-60m` is
the CPU benchmark model; `gemma-3-tiny` is a CPU-sized Gemma 3 (byte-level vocabulary, a 32-token
sliding window on four of its six layers, global attention on every third); the others reproduce the
architecture of released checkpoints so that `longfit plan` and GPU benchmarks can use them without a
download (the Gemma 3 ones: the language model of the multimodal 4B/12B/27B checkpoints, 1024-token
windows on five layers out of six, linear RoPE scaling x8 on the global layers).
"""

from __future__ import annotations

import copy
from typing import Any

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
# Gemma 3: local layers rotate with base 10K, global layers with base 1M (scaled x8 from 4B up).
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
GEMMA3 = dict(model_type="gemma3_text", vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
              sliding_window_pattern=6, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=GEMMA3_ROPE)

PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(
        model_type="llama", hidden_size=256, intermediate_size=3072, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=384, max_position_embeddings=1 << 20,
        rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-60m": dict(
        model_type="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1 << 20,
        rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={**LLAMA3_ROPE, "factor": 32.0},
    ),
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=LLAMA3_ROPE,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "gemma-3-tiny": dict(
        model_type="gemma3_text", hidden_size=128, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, vocab_size=384,
        max_position_embeddings=1 << 20, sliding_window=32, sliding_window_pattern=3, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={**GEMMA3_ROPE, "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
    "gemma-3-4b": dict(
        GEMMA3, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
    ),
    "gemma-3-12b": dict(
        GEMMA3, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
    ),
    "gemma-3-27b": dict(
        GEMMA3, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
        num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
    ),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
    ),
    "yi-34b": dict(
        model_type="llama", hidden_size=7168, intermediate_size=20480, num_hidden_layers=60,
        num_attention_heads=56, num_key_value_heads=8, vocab_size=64000, max_position_embeddings=200000,
        rope_theta=5e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}

MODEL_TYPES = frozenset(values["model_type"] for values in PRESETS.values())
"""The architectures longfit trains: its presets' families, each tested against transformers' eager attention
(tests/test_families.py). A GGUF file of another architecture is refused before its conversion."""


def preset_config(name: str):
    """The transformers `PretrainedConfig` of a preset."""
    from transformers import AutoConfig

    values = copy.deepcopy(PRESETS[name])  # transformers edits nested rope dicts in place
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)
