"""`longfit bench keep-attention` (#53): a real step's counted FLOPs with memory.keep_attention on and off, the kept
run's loss and gradients against the recomputing run's, and the same counts on fake tensors."""

from __future__ import annotations

import argparse

import pytest

from longfit.bench.keep_attention import measure, predicted, report
from longfit.config import ConfigError


def bench_args(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{**dict(model="llama-tiny", seq_len=512, cp=1, steps=0, out=None, overrides=[],
                                        fake_tensors=False), **changes})


@pytest.mark.slow  # six llama-tiny steps at 512 tokens, three on fake tensors: 29 s of CPU (163 s at load 13)
def test_the_kept_step_counts_attentions_forward_once_and_fake_tensors_count_the_same():
    real = measure(bench_args())
    model, recomputed, kept = real["model"], real["recomputed"], real["kept"]
    # checkpointing recomputes attention's forward; keeping it takes exactly that out, and nothing else
    assert recomputed["flops"] - kept["flops"] == model["attention_forward"] > 0
    assert kept["flops"] == predicted(real)["kept"] and model["flops"] < kept["flops"]
    assert kept["difference"] == 0 and kept["gradients"] == 39  # loss and every gradient bit for bit
    fake = measure(bench_args(fake_tensors=True))
    for run in ("model", "recomputed", "kept"):
        assert fake[run]["flops"] == real[run]["flops"], run
    assert fake["model"]["attention_forward"] == model["attention_forward"]
    assert "difference" not in fake["kept"]
    text = report(fake, bench_args(fake_tensors=True))
    assert "on fake tensors" in text and "model + recompute - attention's forward" in text and ": 1.0000;" in text


def test_fake_tensors_count_one_process_without_times():
    with pytest.raises(ConfigError, match="--fake-tensors"):
        measure(bench_args(fake_tensors=True, cp=2))
    with pytest.raises(ConfigError, match="--steps 0"):
        measure(bench_args(fake_tensors=True, steps=1))
