"""What `longfit check` and the preflight of `longfit train` leave out to answer in seconds (#52): bitsandbytes, which
importing peft would import, and the check of a model directory that cannot be trained anyway."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_peft_wraps_the_checks_copies_without_bitsandbytes_which_qlora_still_finds():
    """peft through `peft_quietly` (the check's LoRA copies, the trainer's LoRA config) is imported, and wraps the
    check's unquantized copies, without importing bitsandbytes; peft and transformers still see it installed
    afterwards, and peft's 4-bit LoRA layers import it (QLoRA)."""
    pytest.importorskip("bitsandbytes")
    script = """
import sys
from transformers import LlamaConfig, LlamaForCausalLM
from longfit.models.build import peft_quietly
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=64))
with peft_quietly(unquantized=True):
    from peft import LoraConfig, get_peft_model
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
assert "peft" in sys.modules and "bitsandbytes" not in sys.modules, [m for m in sys.modules if "bitsandbytes" in m]
from peft.import_utils import is_bnb_4bit_available, is_bnb_available
from transformers.utils import is_bitsandbytes_available
assert is_bnb_available() and is_bnb_4bit_available() and is_bitsandbytes_available()
with peft_quietly():
    from peft.tuners.lora.bnb import Linear4bit
assert "bitsandbytes" in sys.modules
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=SRC)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
