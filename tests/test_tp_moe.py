"""Tensor parallelism over mixtures of experts (parallel.tp's `TensorParallelExperts`, #54): Qwen3.5-MoE.

Each tp rank computes its slice of every expert's intermediate width and of the shared expert's, the routers and
the shared expert's sigmoid gate replicated (parallel/tp.py). The families' one-step proofs at tp=2 (fp32 exact,
bf16 within the bound, packed rows) are tests/test_tp_families.py's (`qwen3_5_moe`, `qwen3_moe`, `mixtral`); here
the rest on Qwen3.5-MoE's tiny model from transformers' default config shrunk: tp=2 x cp=2 ring and Ulysses (one
document per row too), `longfit check` and `longfit train` on a checkpoint transformers wrote (what stays refused in
one line: tests/test_tp_families.py, tests/test_parallel_dims.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_tp_families import (  # noqa: E402
    assert_ranks_equal_one_process,
    assert_trains_under_tp2_like_one_process,
    family_model,
    tp_rank_steps,
)

from longfit.config import load_config  # noqa: E402


# slow: one spawn of four gloo ranks, two steps a row layout, and three reference steps (~45 s CPU a row layout)
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("method,layouts", [("ring", (True,)), ("ulysses", (True, False))], ids=["ring", "ulysses"])
def test_qwen3_5_moe_under_tp2_and_cp2_equals_one_process(method: str, layouts: tuple[bool, ...]) -> None:
    """Each cp rank's tokens routed on its tp ranks alike, the experts' slices summed over tp: packed rows under the
    ring; under Ulysses (each rank's heads of the whole row, its tp rank's heads split again over cp) packed rows and
    one document per row (the Gated DeltaNet's state and convolution across the whole row)."""
    from parallel_harness import run_distributed

    cases = [("qwen3_5_moe", dtype, packed) for packed in layouts for dtype in ("fp32", "bf16")]
    results = run_distributed(tp_rank_steps, 4, cases, method)
    print(assert_ranks_equal_one_process(results, f"tp=2 x cp=2 {method}"))


# slow: the check's reference steps and two gloo ranks (~15 s CPU)
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_longfit_check_on_qwen3_5_moe_under_tp2_is_exact(tmp_path) -> None:
    from longfit.check.parity import check_run
    from longfit.data.tokenizer import byte_tokenizer

    model_dir = tmp_path / "qwen3_5_moe-tiny"
    family_model("qwen3_5_moe", "eager").save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    report = check_run(load_config(None, [f"model={model_dir}", "parallel.tp=2"]), "cpu")
    assert report.exact, report.refusal
    assert [c.name for c in report.comparisons if c.name.startswith("rank ")] == [
        f"rank {r} of 2, tp=2, techniques, packed" for r in (0, 1)]


# slow: one process and two gloo ranks, three steps each (~65 s CPU)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_longfit_train_on_qwen3_5_moe_under_tp2_logs_the_one_process_losses(corpus, tmp_path) -> None:
    """The experts' fused gate_up_proj (replicated over tp) and down_proj (sharded on its intermediate width) and
    the shared expert's slices return to the export in the checkpoint's per-expert layout."""
    assert_trains_under_tp2_like_one_process("qwen3_5_moe", corpus, tmp_path)
