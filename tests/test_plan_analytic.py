"""The analytic planner: model shapes, model states, monotonicity, the search, the trainer's check."""

import json

import pytest
import torch

from longfit.config import ConfigError, load_config
from longfit.models.presets import PRESETS, preset_config
from longfit.plan import plan_config, suggest_fix
from longfit.plan.result import GiB
from longfit.plan.search import STRATEGIES, max_context_table, max_seq_len
from longfit.plan.setup import mlp_tiles, resolve
from longfit.plan.shapes import model_shape


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_counts_match_transformers(name):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name))
    assert model_shape(name).params == sum(p.numel() for p in model.parameters())


def test_lora_parameter_count_matches_peft():
    from peft import get_peft_model

    from longfit.models.build import lora_config

    cfg = load_config(None, ["model=llama-60m", "lora.enabled=true", "lora.r=8"])
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(preset_config("llama-60m")), lora_config(cfg))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_shape("llama-60m").lora_params(8, cfg.lora.target_modules) == trainable


def test_config_json_directory(tmp_path):
    values = {k: v for k, v in PRESETS["qwen2.5-7b"].items()}
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert model_shape(str(tmp_path)).params == model_shape("qwen2.5-7b").params
    multimodal = {"model_type": "gemma3", "text_config": dict(PRESETS["gemma-3-12b"])}
    (tmp_path / "config.json").write_text(json.dumps(multimodal))
    assert model_shape(str(tmp_path / "config.json")).params == model_shape("gemma-3-12b").params
    with pytest.raises(ConfigError, match="neither a preset"):
        model_shape(str(tmp_path / "missing"))


def test_tile_count_mirrors_longfit_memory():
    from longfit.memory.switches import mlp_tile_count

    for seq_len in (1024, 8192, 131072):
        s = resolve(load_config(None, ["model=llama-3.1-8b", f"seq_len={seq_len}"]), 1)
        assert mlp_tiles(s) == mlp_tile_count(seq_len, 4096, 14336)


def test_model_states_full_and_sharded():
    P = model_shape("llama-3.1-8b").params
    cfg = load_config(None, ["model=llama-3.1-8b", "seq_len=4096"])
    one = plan_config(cfg, 1)
    assert one.breakdown["weights"] == pytest.approx(4 * P, rel=1e-6)
    assert one.breakdown["optimizer state"] == pytest.approx(8 * P, rel=1e-6)
    eight = plan_config(cfg, 8)
    assert eight.breakdown["weights"] == pytest.approx(4 * P / 8, rel=1e-6)
    bf16 = plan_config(load_config(None, ["model=llama-3.1-8b", "seq_len=4096", "memory.optimizer=adamw_bf16"]), 8)
    assert bf16.breakdown["optimizer state"] == pytest.approx(4 * P / 8, rel=1e-6)
    offloaded = plan_config(load_config(None, ["model=llama-3.1-8b", "seq_len=4096", "parallel.cpu_offload=true"]), 8)
    assert offloaded.breakdown["weights"] == offloaded.breakdown["optimizer state"] == 0
    assert offloaded.host_bytes >= 16 * P / 8


@pytest.mark.parametrize("quantize", [False, True], ids=["lora-bf16-base", "qlora"])
def test_lora_weights_are_the_bytes_the_trainer_allocates(quantize):
    """The planner's weights term against the state of the model that longfit.models.build builds."""
    if quantize:
        pytest.importorskip("bitsandbytes")
    from longfit.models.build import build_model
    from longfit.models.loading import materialize_model

    cfg = load_config(None, ["model=llama-60m", "train.dtype=bf16", "lora.enabled=true",
                             f"lora.quantize_base={str(quantize).lower()}"])
    model = build_model(cfg, torch.bfloat16, "cpu")
    materialize_model(model, "cpu")  # what parallelize does in the trainer (QLoRA's is already there)
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights once
    allocated = sum(t.numel() * t.element_size() for t in tensors.values())
    assert plan_config(cfg, 1).breakdown["weights"] == pytest.approx(allocated, rel=0.01)


@pytest.mark.slow  # 27 s of an 8B's layer traces on a cold cache (the suite's 15 minutes); .ci/run runs it
def test_peak_grows_with_length_and_context_parallelism_divides_activations():
    peaks = [
        plan_config(
            load_config(
                None, ["model=llama-3.1-8b", f"seq_len={n}", "memory.tiled_mlp=true", "memory.offload_activations=true",
                       "memory.tiled_layers=false"]  # fixed techniques: `auto` would tile the layers from 64K per GPU
            ),
            8,
        ).tensor_bytes
        for n in (16384, 32768, 65536, 131072)
    ]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]
    base = ["model=llama-3.1-8b", "seq_len=131072"]
    fsdp_only = plan_config(load_config(None, base), 8)
    ring = plan_config(load_config(None, base + ["parallel.cp=8"]), 8)
    assert ring.breakdown["weights"] == fsdp_only.breakdown["weights"]  # FSDP shards over dp_shard x cp either way
    assert ring.tensor_bytes < fsdp_only.tensor_bytes
    assert ring.setup.tokens == 131072 // 8


def test_full_logits_dominate_without_chunked_loss():
    cfg = load_config(None, ["model=llama-3.1-8b", "seq_len=32768", "memory.chunked_loss=false"])
    result = plan_config(cfg, 8)
    assert result.peak_event == "loss backward"
    # log-softmax saved + its gradient + the gradient of the logits: 12 bytes per vocabulary entry per token
    assert result.breakdown["working set"] >= 8 * 128256 * 32768


def test_invalid_parallel_layouts_name_the_key():
    with pytest.raises(ConfigError, match="parallel.cp"):
        plan_config(load_config(None, ["model=llama-3.1-8b", "parallel.cp=3", "seq_len=6144"]), 8)
    with pytest.raises(ConfigError, match="dp_shard"):
        plan_config(load_config(None, ["model=llama-3.1-8b", "parallel.dp_shard=3"]), 8)
    with pytest.raises(ConfigError, match="ulysses"):
        plan_config(
            load_config(None, ["model=gemma-3-12b", "parallel.cp=32", "parallel.cp_method=ulysses", "seq_len=65536"]),
            32,
        )


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_trainer_check_refuses_and_names_a_fix_that_fits():
    capacity = 80 * GiB
    cfg = load_config(
        None, ["model=llama-3.1-8b", "seq_len=131072", "memory.offload_activations=false", "memory.chunked_loss=false"]
    )
    result = plan_config(cfg, 8, capacity)
    assert not result.fits
    fix = suggest_fix(result)
    assert fix.startswith("Set ") and "=" in fix
    key_value = fix.split()[1].rstrip(":")
    fixed = load_config(
        None,
        [
            "model=llama-3.1-8b",
            "seq_len=131072",
            "memory.offload_activations=false",
            "memory.chunked_loss=false",
            key_value,
        ],
    )
    assert plan_config(fixed, 8, capacity).fits
    assert plan_config(fixed, 8, None).fits  # no device memory (CPU): nothing to refuse


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_nothing_fits_says_so():
    result = plan_config(load_config(None, ["model=yi-34b", "seq_len=4096", "lora.enabled=false"]), 1, 24 * GiB)
    assert not result.fits
    assert "Nothing fits" in suggest_fix(result) or suggest_fix(result).startswith("Set ")


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_fixes_include_moving_model_states_to_and_from_host_memory():
    """FSDP2's CPU offload runs on one GPU too, and is the change to undo when it is what overfills the host."""
    full = load_config(None, ["model=llama-3.1-8b", "seq_len=8192"])
    fix = suggest_fix(plan_config(full, 1, 80 * GiB, host_memory_bytes=1024 * GiB))
    assert fix.startswith("Set parallel.cpu_offload=true"), fix
    offloaded = load_config(None, ["model=llama-3.1-8b", "seq_len=8192", "lora.enabled=true", "parallel.cpu_offload=true"])
    result = plan_config(offloaded, 1, 80 * GiB, host_memory_bytes=8 * GiB)
    assert result.fits_gpu and not result.fits_host
    assert suggest_fix(result).startswith("Set parallel.cpu_offload=false"), suggest_fix(result)


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_nothing_fits_names_only_changes_not_made_yet():
    cfg = load_config(None, ["model=llama-3.1-8b", "seq_len=8192", "lora.enabled=true", "parallel.cpu_offload=true"])
    fix = suggest_fix(plan_config(cfg, 1, 3 * GiB, host_memory_bytes=512 * GiB))
    assert fix.startswith("Nothing fits 3.0 GiB per GPU") and fix.endswith("use more GPUs."), fix


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_an_offload_dir_is_suggested_only_if_the_given_disk_holds_it():
    cfg = load_config(None, ["model=llama-3.1-8b", "seq_len=1048576", "lora.enabled=true",
                             "memory.offload_activations=true"])
    unbounded = suggest_fix(plan_config(cfg, 1, 80 * GiB, host_memory_bytes=64 * GiB))
    assert unbounded.startswith("Set memory.offload_dir=PATH"), unbounded
    small_disk = suggest_fix(plan_config(cfg, 1, 80 * GiB, host_memory_bytes=64 * GiB, disk_bytes=10 * GiB))
    assert "offload_dir" not in small_disk, small_disk


@pytest.mark.parametrize("text", ["0", "0GiB", "1e400", "1e400GiB"])
def test_sizes_must_be_finite_and_positive(text):
    from longfit.plan.gpus import parse_size

    with pytest.raises(ConfigError, match="--host-mem"):
        parse_size(text, "--host-mem")


@pytest.mark.slow  # plans many layouts: minutes of layer traces on a cold trace cache
def test_max_seq_len_is_the_boundary():
    cfg = load_config(
        None, ["model=llama-3.2-1b", "parallel.cp=4", "memory.offload_activations=true", "memory.tiled_mlp=true"]
    )
    capacity = 48 * GiB
    best = max_seq_len(cfg, 4, capacity)
    granule = 1024 * 2 * 4
    assert best and best % granule == 0

    def planned(n):
        cfg.seq_len = n
        return plan_config(cfg, 4, capacity)

    assert planned(best).fits and not planned(best + granule).fits


@pytest.mark.slow  # plans many layouts or fixes: minutes of layer traces on a cold trace cache
def test_context_parallelism_scales_context_more_than_fsdp_alone():
    cfg = load_config(None, ["model=llama-3.1-8b"])
    rows = [s for s in STRATEGIES if s.name in ("FSDP", "FSDP, LoRA", "FSDP + ring CP, LoRA")]
    table = max_context_table(cfg, [1, 8], 80 * GiB, rows)
    fsdp, ring = table["FSDP, LoRA"], table["FSDP + ring CP, LoRA"]
    # FSDP alone: more GPUs shard the model states, but each GPU still holds a whole sequence's activations
    fsdp_gain, ring_gain = fsdp[8][0] / fsdp[1][0], ring[8][0] / ring[1][0]
    assert 1 <= fsdp_gain < ring_gain and ring_gain > 4
    assert table["FSDP"][1][0] is None  # full fine-tuning of 8B needs more than 80 GiB of model states alone
    for name, row in table.items():
        for gpus, (best, result) in row.items():
            assert best is None or result.fits, (name, gpus)
