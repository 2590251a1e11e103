"""`longfit bench checkpoint-dtype`: compressed layer inputs leave the forward (the step's loss) exact and
perturb the gradients, fp8 more than bf16, and the later losses drift; the exact run has no error."""

import argparse

import pytest

from longfit.bench.checkpoint_dtype import measure
from longfit.config import ConfigError


def options(model, seq_len, **extra):
    return argparse.Namespace(model=str(model), seq_len=seq_len, steps=2, lr=1e-2, dtypes="bf16,fp8", overrides=[],
                              argv=[], **extra)


def test_compression_keeps_the_step_loss_and_perturbs_the_gradient(tiny_model_dir):
    # 4096 tokens x 64 hidden x 4 bytes: each layer input is exactly the offloader's 1 MiB threshold
    rows = measure(options(tiny_model_dir, 4096))
    (exact, exact_losses, *exact_errors), (bf16, bf16_losses, *bf16_errors), (fp8, fp8_losses, *fp8_errors) = rows
    assert (exact, bf16, fp8) == ("none (exact)", "bf16", "fp8") and exact_errors == [0.0, 0.0]
    # forward runs on the exact inputs: the first step's loss is the same; its backward is not
    assert bf16_losses[0] == exact_losses[0] == fp8_losses[0]
    assert 0 < bf16_errors[0] < fp8_errors[0] < 0.1 and bf16_errors[0] <= bf16_errors[1]
    assert fp8_losses[1] != exact_losses[1]  # the perturbed step moves the weights elsewhere


def test_too_short_rows_are_refused_naming_the_fix(tiny_model_dir):
    with pytest.raises(ConfigError, match="use a longer --seq-len"):
        measure(options(tiny_model_dir, 1024))
