"""The planner under tensor parallelism: a tp rank's slices, the TP rows of --max-context, the pipeline rows."""

from pathlib import Path

import pytest

from longfit.config import ConfigError, load_config
from longfit.plan import plan_config
from longfit.plan.report import max_context_text, plan_text
from longfit.plan.result import GiB
from longfit.plan.search import STRATEGIES, max_context_table
from longfit.plan.shapes import model_shape


@pytest.mark.parametrize("preset,gpus,overrides", [
    ("llama-60m", 2, ("seq_len=4096", "parallel.tp=2")),
    ("llama-tiny", 4, ("seq_len=4096", "parallel.tp=4", "lora.enabled=true")),  # 2 key/value heads: replicated
])
def test_weights_are_the_slices_the_trainer_shards(preset, gpus, overrides):
    """The planner's weights against the parameters of the model `parallelize` built (traced, fake tensors)."""
    from longfit.plan.trace import trace_step

    cfg = load_config(None, [f"model={preset}", *overrides])
    traced = trace_step(cfg, gpus)
    assert plan_config(cfg, gpus).breakdown["weights"] == pytest.approx(traced.breakdown["weights"], rel=0.01)


@pytest.mark.slow  # 25 s of an 8B's layer traces on a cold cache (the suite's 15 minutes); .ci/run runs it
def test_tensor_parallelism_splits_weights_and_the_residual_stream():
    base = ["model=llama-3.1-8b", "seq_len=65536"]
    fsdp = plan_config(load_config(None, base), 8)
    tp = plan_config(load_config(None, [*base, "parallel.tp=8"]), 8)
    assert (tp.setup.dp_shard, tp.setup.tp, tp.setup.tokens, tp.setup.sequence_tokens) == (1, 8, 65536, 8192)
    P = model_shape("llama-3.1-8b").params
    # every weight matrix split 8 ways (FSDP's 8 shards of everything, plus the whole norms on every rank)
    assert fsdp.breakdown["weights"] < tp.breakdown["weights"] < 1.001 * fsdp.breakdown["weights"]
    assert tp.breakdown["weights"] == pytest.approx(4 * P / 8, rel=1e-3)
    assert tp.tensor_bytes < fsdp.tensor_bytes
    assert "dp_shard 1 x cp 1 x tp 8" in plan_text(tp, None) and "8192 between layers" in plan_text(tp, None)
    # with tp > key/value heads every rank holds k_proj and v_proj whole
    replicated = plan_config(load_config(None, ["model=llama-tiny", "seq_len=4096", "parallel.tp=4"]), 4)
    shape = model_shape("llama-tiny")
    kv_weights = 2 * shape.layers * shape.hidden * shape.kv_dim
    assert replicated.breakdown["weights"] > 4 * (shape.params - kv_weights) / 4 + 4 * kv_weights * 0.99


def test_tensor_parallel_layouts_are_checked_by_parallel_dims():
    with pytest.raises(ConfigError, match="parallel.tp=3 splits the 32 attention heads"):
        plan_config(load_config(None, ["model=llama-3.1-8b", "parallel.tp=3", "seq_len=6144"]), 3)
    # which models tp splits is read from their structure: Gemma 3's per-head q/k norms and Qwen3-MoE's experts are
    # split, gpt-oss's attention sinks are not
    assert plan_config(load_config(None, ["model=gemma-3-tiny", "parallel.tp=2", "seq_len=4096"]), 2).setup.dims.tp == 2
    configs = Path(__file__).parents[1] / "benchmarks" / "configs"
    moe = load_config(None, [f"model={configs / 'qwen3-30b-a3b'}", "parallel.tp=2", "seq_len=4096"])
    assert plan_config(moe, 2).setup.dims.tp == 2
    with pytest.raises(ConfigError, match=r"parallel.tp=2: layer 0's self_attn.sinks \(one value per head"):
        plan_config(load_config(None, [f"model={configs / 'gpt-oss-20b'}", "parallel.tp=2"]), 2)


@pytest.mark.slow  # every strategy's layer traces: minutes on a cold trace cache
def test_max_context_has_tp_and_pipeline_rows():
    cfg = load_config(None, ["model=qwen2.5-7b"])
    table = max_context_table(cfg, [1, 8], 80 * GiB)
    assert {s.name for s in STRATEGIES} == set(table)
    assert table["FSDP + TP"][1] == (None, None) and table["TP + ring CP"][1] == (None, None)  # need 2 and 4 GPUs
    best, result = table["FSDP + TP"][8]
    assert best and result.setup.tp == 4 and result.setup.dp_shard == 2  # 28 heads: tp=8 does not divide them
    best, result = table["TP + ring CP"][8]
    assert best and (result.setup.tp, result.setup.cp) == (4, 2)
    assert best > table["FSDP + TP"][8][0]
    assert table["PP + FSDP"][1] == (None, None) and table["PP + ring CP"][1] == (None, None)  # need 2 and 4 GPUs
    best, result = table["PP + FSDP"][8]
    assert best and (result.setup.dims.pp, result.setup.dp_shard) == (8, 1)  # the most stages, at most 8
    assert len(result.stages) == 8 and result in result.stages
    best, result = table["PP + ring CP"][8]
    assert best and (result.setup.dims.pp, result.setup.cp) == (2, 4)
    text = max_context_text(table, [1, 8])
    assert "PP + FSDP" in text and "estimate" not in text and "tensor parallelism over 4 GPUs" in text


@pytest.mark.slow  # 19 s of an 8B's layer traces on a cold cache (the suite's 15 minutes); .ci/run runs it
def test_a_pipeline_splits_model_states_not_the_activations_of_its_micro_batches():
    base = ["model=llama-3.1-8b", "seq_len=65536", "train.grad_accum=8", "memory.offload_activations=false"]
    one = plan_config(load_config(None, base), 1)
    stages = plan_config(load_config(None, [*base, "parallel.pp=8", "parallel.pp_layers=[4,4,4,4,4,4,4,4]"]), 8)
    first = stages.stages[0]
    assert len(first.stage.layers) == 4 and first.stage.in_flight == 8
    assert first.breakdown["weights"] < one.breakdown["weights"] / 4
    # the first stage holds 8 micro-batches' activations of its 4 layers: those of all 32 for one micro-batch
    assert first.breakdown["activations"] >= 0.9 * one.breakdown["activations"]


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_tensor_parallel_plans_and_rows_never_tile_the_layers():
    """Tiled decoder layers are off under tp (memory.switches): the plan and the --max-context TP rows."""
    base = ["model=llama-3.1-8b", "seq_len=524288", "lora.enabled=true"]
    assert plan_config(load_config(None, base), 8).setup.tiled_layers
    assert not plan_config(load_config(None, [*base, "parallel.tp=8"]), 8).setup.tiled_layers
    strategies = [s for s in STRATEGIES if s.name in ("FSDP + TP, LoRA + offload", "FSDP, LoRA + offload")]
    table = max_context_table(load_config(None, ["model=llama-3.1-8b"]), [8], 80 * GiB, strategies)
    tp_best, tp_plan = table["FSDP + TP, LoRA + offload"][8]
    assert tp_plan.setup.tp == 8 and not tp_plan.setup.tiled_layers
    assert table["FSDP, LoRA + offload"][8][1].setup.tiled_layers


# #52: a small model's plan under tp at its own tokens (fewer than the layer traces' base length), which can be one of
# the model's widths: 2 rows of 96 tokens are the 192 rows of the vocabulary half of this Mistral's tp-split embedding,
# and the layer trace took its (192, 64) activations for weights (before: fp32 -2.75%, bf16 -1.70%, fp32 without
# checkpointing -11.2%).
TINY_MISTRAL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=1024)


@pytest.mark.parametrize("overrides", [
    ("train.dtype=fp32",),
    ("train.dtype=bf16",),
    pytest.param(("train.dtype=fp32", "memory.activation_checkpointing=false"), marks=pytest.mark.slow),
], ids=["fp32", "bf16", "fp32-without-checkpointing"])
def test_a_tiny_models_tp_plan_counts_activations_shaped_like_its_weights(tmp_path, overrides):
    from transformers import AutoConfig

    from longfit.plan.accuracy import SAFE_BAND, compare

    AutoConfig.for_model("mistral", **TINY_MISTRAL).save_pretrained(tmp_path)
    row = compare(str(tmp_path), 2, ("parallel.tp=2", "seq_len=96", "train.micro_batch=2", *overrides))
    under, over = SAFE_BAND
    assert under <= row["error"] <= over, (row["analytic"], row["traced"], row["analytic_event"], row["traced_phase"])
