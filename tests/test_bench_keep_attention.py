"""`longfit bench keep-attention` (#53): a real step's counted FLOPs with memory.keep_attention on and off, the kept
run's loss and gradients against the recomputing run's, and the same counts on fake tensors."""

from __future__ import annotations

import argparse

import pytest

from longfit.bench.keep_attention import failed_checks, measure, predicted, report
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
    # counted inside longfit's attention function over the whole step: twice without keeping it, once with it
    assert recomputed["attention_forward"] == 2 * model["attention_forward"] == 2 * kept["attention_forward"]
    assert failed_checks(real) == []
    assert kept["difference"] == 0 and kept["gradients"] == 39  # loss and every gradient bit for bit
    fake = measure(bench_args(fake_tensors=True))
    for run in ("model", "recomputed", "kept"):
        assert fake[run]["flops"] == real[run]["flops"], run
    assert fake["model"]["attention_forward"] == model["attention_forward"]
    assert "difference" not in fake["kept"]
    text = report(fake, bench_args(fake_tensors=True))
    assert "on fake tensors" in text and "Checks (within 2%):" in text and "FAIL" not in text
    assert "model + recompute - attention's forward: " in text and "= 1.0000, pass" in text


def test_the_checks_fail_a_step_that_still_recomputes_attention():
    """#53's 2% band: a kept step whose recompute ran attention again fails both the FLOP sum and the count inside
    attention, and the report says FAIL."""
    attention, recompute, model = 60, 80, 300
    results = dict(model=dict(flops=model, attention_forward=attention, layers_forward=100, layers=2, seconds=None),
                   recomputed=dict(flops=model + recompute, attention_forward=2 * attention, seconds=None),
                   kept=dict(flops=model + recompute, attention_forward=2 * attention, seconds=None))
    assert len(failed_checks(results)) == 2
    assert report(results, bench_args()).count("FAIL") == 2
    results["kept"].update(flops=model + recompute - attention, attention_forward=attention)
    assert failed_checks(results) == []


def test_fake_tensors_count_one_process_without_times():
    with pytest.raises(ConfigError, match="--fake-tensors"):
        measure(bench_args(fake_tensors=True, cp=2))
    with pytest.raises(ConfigError, match="--steps 0"):
        measure(bench_args(fake_tensors=True, steps=1))
