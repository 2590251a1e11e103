"""What `longfit check` and the preflight of `longfit train` leave out to answer in seconds (#52): bitsandbytes, which
importing peft would import, and the check of a model directory that cannot be trained anyway."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_peft_is_imported_without_bitsandbytes_which_qlora_still_finds():
    """peft through `peft_quietly` (the check's LoRA copies, the trainer's LoRA config) leaves bitsandbytes unimported;
    peft and transformers still see it installed, and it imports afterwards (QLoRA's 4-bit projections)."""
    pytest.importorskip("bitsandbytes")
    script = """
import sys
from longfit.models.build import peft_quietly
with peft_quietly():
    from peft import LoraConfig, get_peft_model
assert "peft" in sys.modules and "bitsandbytes" not in sys.modules, sorted(m for m in sys.modules if "bitsandbytes" in m)
from peft.import_utils import is_bnb_4bit_available, is_bnb_available
from transformers.utils import is_bitsandbytes_available
import bitsandbytes
assert is_bnb_available() and is_bnb_4bit_available() and is_bitsandbytes_available()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=SRC)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
