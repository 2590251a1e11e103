"""Analytic plan vs traced step within TOLERANCE on every preset at three lengths (small presets by default) and on the
new families' published configs (benchmarks/configs: Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-27B, Gemma 4 E2B,
DeepSeek-V2-Lite; slow, 15 s to 7 min a case on 2 CPU cores).

The traced step runs longfit's real training code on fake tensors (see longfit.plan.trace); the cases
and the recorded table live in longfit.plan.accuracy / benchmarks/results/plan_accuracy.md.
"""

import pytest

from longfit.plan.accuracy import CASES, CONFIGS, FAMILY_CASES, TOLERANCE, compare


# The default suite's rows: one per layout (one GPU in each family, tensor parallelism, a ring), the cheapest, 3-16 s
# each on 2 CPU cores from a cold trace cache. The other small presets' rows (12-43 s each) are slow, and `.ci/run`
# runs them (`-k "tiny or 60m"`); the large presets' rows are run by hand (the suite's 15 minutes).
DEFAULT_ROWS = {
    ("llama-tiny", 1, ("seq_len=2048",)),
    ("llama-tiny", 2, ("seq_len=32768", "parallel.cp=2")),
    ("llama-60m", 1, ("seq_len=4096", "memory.chunked_loss=false")),
    ("llama-60m", 2, ("seq_len=4096", "parallel.tp=2", "memory.chunked_loss=false")),
    ("gemma-3-tiny", 1, ("seq_len=4096",)),
}


def _params():
    for preset, gpus, overrides, machine in CASES:
        marks = () if (preset, gpus, tuple(overrides)) in DEFAULT_ROWS else (pytest.mark.slow,)
        yield pytest.param(preset, gpus, overrides, machine, marks=marks,
                           id=f"{preset}-{gpus}gpu-{'-'.join(overrides)}" + ("-machine" if machine else ""))
    for model, gpus, overrides, machine in FAMILY_CASES:  # real widths: a whole-step trace of 15 s to 7 min
        yield pytest.param(model, gpus, overrides, machine, marks=(pytest.mark.slow,),
                           id=f"{model}-{gpus}gpu-{'-'.join(overrides)}")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("preset,gpus,overrides,machine", list(_params()))
def test_analytic_matches_trace(preset, gpus, overrides, machine):
    row = compare(preset, gpus, overrides, machine)
    assert abs(row["error"]) <= TOLERANCE, (
        f"analytic {row['analytic'] / 2**30:.3f} GiB vs traced {row['traced'] / 2**30:.3f} GiB "
        f"({row['error']:+.1%}); analytic peak at {row['analytic_event']}, traced in {row['traced_phase']}"
    )
    # activation offload: the host arena and disk file the analytic plan predicts are the ones the trace made
    assert row["host_analytic"] == pytest.approx(row["host_traced"], rel=0.01, abs=2**20)
    assert row["disk_analytic"] == row["disk_traced"]


def test_the_default_rows_are_cases():
    assert DEFAULT_ROWS <= {(preset, gpus, tuple(overrides)) for preset, gpus, overrides, _ in CASES}


def test_every_preset_has_three_lengths():
    from longfit.models.presets import PRESETS

    for preset in PRESETS:
        lengths = {o for p, _, overrides, _ in CASES if p == preset for o in overrides if o.startswith("seq_len=")}
        assert len(lengths) >= 3, preset


def test_every_family_config_has_a_case_at_two_lengths():
    """Each config under benchmarks/configs is planned in FAMILY_CASES, at two lengths at least."""
    models = sorted(path.parent.name for path in CONFIGS.glob("*/config.json"))
    assert models == sorted({model for model, *_ in FAMILY_CASES})
    for model in models:
        lengths = {o for m, _, overrides, _ in FAMILY_CASES if m == model for o in overrides if o.startswith("seq_len=")}
        assert len(lengths) >= 2, model
