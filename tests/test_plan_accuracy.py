"""Analytic plan vs traced step within SAFE_BAND (#52: at most 1% under, 3% over) on every preset at three lengths
(small presets by default) and on the new families' published configs (benchmarks/configs: Qwen3-30B-A3B,
gpt-oss-20b, Qwen3.5-27B, Gemma 4 E2B, DeepSeek-V2-Lite; slow, 15 s to 7 min a case on 2 CPU cores).

The traced step runs longfit's real training code on fake tensors (see longfit.plan.trace); the cases
and the recorded table live in longfit.plan.accuracy / benchmarks/results/plan_accuracy.md.
"""

import pytest

from longfit.plan.accuracy import CASES, CONFIGS, FAMILY_CASES, H100_HOST, SAFE_BAND, compare


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


# Rows measured outside SAFE_BAND (open): below its 1% (#52) the analytic plan misses part of what the traced step
# holds; above its 3% it would count more than the step holds.
# strict: a fix that brings one into the band fails here until its entry goes.
OUTSIDE_THE_BAND: dict[tuple, str] = {}


def _params():
    for preset, gpus, overrides, machine in CASES:
        marks = () if (preset, gpus, tuple(overrides)) in DEFAULT_ROWS else (pytest.mark.slow,)
        outside = OUTSIDE_THE_BAND.get((preset, gpus, tuple(overrides)))
        if outside:
            marks = (*marks, pytest.mark.xfail(reason=outside, strict=True, raises=AssertionError))
        yield pytest.param(preset, gpus, overrides, machine, marks=marks,
                           id=f"{preset}-{gpus}gpu-{'-'.join(overrides)}" + ("-machine" if machine else ""))
    for model, gpus, overrides, machine in FAMILY_CASES:  # real widths: a whole-step trace of 15 s to 7 min
        yield pytest.param(model, gpus, overrides, machine, marks=(pytest.mark.slow,),
                           id=f"{model}-{gpus}gpu-{'-'.join(overrides)}")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("preset,gpus,overrides,machine", list(_params()))
def test_analytic_matches_trace(preset, gpus, overrides, machine):
    row = compare(preset, gpus, overrides, machine)
    # activation offload: the host arena and disk file the analytic plan predicts are the ones the trace made
    assert row["host_analytic"] == pytest.approx(row["host_traced"], rel=0.01, abs=2**20)
    assert row["disk_analytic"] == row["disk_traced"]
    assert_in_safe_band(row)  # last: a row OUTSIDE_THE_BAND fails here alone


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


# #52: transformers' default config of each 2026 family, full fine-tuning at 8K on one H100 (the issue's layout). The
# analytic peak may be above the traced step's by SAFE_BAND's 3%, below it by 1% at most: under, a run the plan says
# fits may not. Slow: a whole-step trace at the model's real widths, 2-10 min each on a shared 2-core machine.
DEFAULT_CONFIG_FAMILIES = ("gemma4_text", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "gpt_oss", "llama4_text",
                           "glm4", "glm4_moe", "smollm3", "olmo3", "deepseek_v3")


def default_config_dir(path, model_type: str, **overrides):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **overrides).save_pretrained(path)
    return path


def assert_in_safe_band(row: dict) -> None:
    under, over = SAFE_BAND
    assert under <= row["error"] <= over, (
        f"analytic {row['analytic'] / 2**30:.3f} GiB vs traced {row['traced'] / 2**30:.3f} GiB ({row['error']:+.2%}, "
        f"band {under:+.0%}..{over:+.0%}); analytic peak at {row['analytic_event']}, traced in {row['traced_phase']}"
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model_type", DEFAULT_CONFIG_FAMILIES)
def test_default_config_plans_within_the_safe_band(tmp_path, model_type):
    assert_in_safe_band(compare(str(default_config_dir(tmp_path, model_type)), 1, ("seq_len=8192",), H100_HOST))


# #52's Gemma 4 parts at a small width, each missing from the analytic peak before (-5.6% on the default config at 8K).
# Full fine-tuning: a tied 262,144-token embedding (its gradient and the lm_head's, which waits in autograd's input
# buffer, are summed into a third (V, h) tensor at the embedding's backward) and per-layer input embeddings (root
# parameters whose gradients are complete before the input embedding's): -10.7% before. LoRA at a longer length: the
# per-layer inputs every layer reads, a (T, layers x 256) tensor the checkpointed layers keep until their backward:
# -4.8% before.
GEMMA4_SMALL = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                    sliding_window=64, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.slow  # 124 s and 140 s on the shared 2-core machine (load 12-17), cold trace cache
@pytest.mark.parametrize("widths,overrides", [
    (dict(hidden_size=256, intermediate_size=512), ("seq_len=256",)),
    (dict(hidden_size=64, intermediate_size=128, vocab_size=4096, vocab_size_per_layer_input=4096),
     ("seq_len=16384", "lora.enabled=true")),
], ids=["full-fine-tuning", "lora"])
def test_gemma4_root_gradients_and_per_layer_inputs_are_planned(tmp_path, widths, overrides):
    model = default_config_dir(tmp_path, "gemma4_text", **widths, **GEMMA4_SMALL)
    assert_in_safe_band(compare(str(model), 1, overrides, H100_HOST))


def test_the_kv_storing_layers_are_read_with_or_without_kv_sharing_modes() -> None:
    """Gemma 4's "store" layers from its kv_sharing_modes; a config without them (transformers 5.17's, whose layers
    store as the modes say: `store_full_length_kv`) stores from the last layer of each attention type before its
    num_kv_shared_layers, also when there are none (read as none there, the plan of 5.17's Gemma 4 was 3.0% (fp32)
    and 4.6% (bf16) under its traced step); a config without KV sharing stores nothing."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from longfit.plan.shapes import _kv_storing_layers

    for shared in (2, 0):  # both kinds shared; none
        text = AutoConfig.for_model("gemma4_text", num_hidden_layers=12, num_kv_shared_layers=shared)
        expected = tuple(i for i, mode in enumerate(text.kv_sharing_modes) if mode == "store")
        assert len(expected) == 2 and _kv_storing_layers(text) == expected
        older = SimpleNamespace(layer_types=list(text.layer_types), num_kv_shared_layers=shared)
        assert _kv_storing_layers(older) == expected
    assert _kv_storing_layers(SimpleNamespace(layer_types=list(text.layer_types))) == ()


# #52: transformers' Gemma 4 config marks the last layer of each attention type "store" (kv_sharing_modes) also
# without KV-shared layers: each one's recompute writes its keys and values, with the graph that made them, into the
# mapping the checkpoints hold until the first layer's backward has run. 3.0% (fp32) and 4.6% (bf16) under before.
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gemma4_stored_keys_and_values_are_planned(tmp_path, dtype):
    model = default_config_dir(tmp_path, "gemma4_text", hidden_size=64, intermediate_size=128, vocab_size=512,
                               vocab_size_per_layer_input=512, **GEMMA4_SMALL)
    assert_in_safe_band(compare(str(model), 1, ("seq_len=256", f"train.dtype={dtype}"), H100_HOST))


# #52: Gemma 4's sliding layers keep half the attention its global layers keep (head_dim against global_head_dim); the
# plan took every layer's kept attention at the widest layer's bytes, so each sliding layer whose kept attention the
# offload store moved to host memory counted less than nothing on the device (Gemma-4-E2B, 2 GPUs, 32K: -3.6% with the
# per-layer inputs' gradient and the KV-storing layers' input norms, now -0.6%: the gemma-4-e2b row of FAMILY_CASES).
def test_a_layer_kept_attention_at_its_own_head_width(tmp_path):
    from longfit.config import load_config
    from longfit.plan.analytic import plan_config

    model = default_config_dir(tmp_path, "gemma4_text", hidden_size=64, intermediate_size=128, vocab_size=512,
                               vocab_size_per_layer_input=512, **{**GEMMA4_SMALL, "global_head_dim": 256})
    cfg = load_config(None, [f"model={model}", "seq_len=4096", "memory.offload_activations=true",
                             "memory.keep_attention=true", "memory.tiled_mlp=false"])
    plan = plan_config(cfg, 2)
    gathering = [total for event, total in plan.events if event.startswith("forward, gathering layer")]
    # each layer's forward keeps what it saves on the device, its input and kept attention in host slots: never less
    assert all(later >= earlier for earlier, later in zip(gathering, gathering[1:])), gathering


def test_the_accuracy_table_reads_its_options_and_refuses_unknown_models(capsys):
    from longfit.plan.accuracy import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0 and "usage: python -m longfit.plan.accuracy" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["families", "llama-tiny"])
    assert exited.value.code == 2 and "no case of llama-tiny" in capsys.readouterr().err
