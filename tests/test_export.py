"""Exports that load outside longfit: an adapter on a preset with its base beside it (transformers + peft alone, in a
process that cannot reach the hub), `longfit export` of any intact checkpoint, and a finished run exporting again
when only its export keys change."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longfit.cli import main
from longfit.config import load_config
from longfit.train.export_command import checkpoint_config, rebuild_model
from longfit.train.loop import train

IDS = [[256, 104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]]  # <|bos|>hello world in the byte tokenizer


def train_preset_lora(out: Path, *extra: str) -> Path:
    train(load_config(None, [
        "model=llama-tiny", f"output_dir={out}", "seq_len=64", "train.device=cpu", "train.steps=2", "train.lr=1e-2",
        "train.warmup_steps=0", "data.synthetic_samples=8", "eval.retrieval=false", "lora.enabled=true", "lora.r=4",
        "memory.tiled_mlp=false", *extra,
    ]))
    return out


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> dict[str, Path]:
    """A LoRA run on the preset per train.dtype, with checkpoints of steps 1 and 2."""
    return {dtype: train_preset_lora(tmp_path_factory.mktemp(f"lora-{dtype}") / "run", f"train.dtype={dtype}",
                                     "train.save_every=1") for dtype in ("fp32", "bf16")}


@pytest.fixture
def lora_run(lora_runs) -> Path:
    return lora_runs["fp32"]


def longfit_logits(checkpoint: Path, merge: bool | None = None) -> torch.Tensor:
    """The logits of the model longfit trained, rebuilt from its checkpoint and computed in fp32."""
    model = rebuild_model(checkpoint, checkpoint_config(checkpoint, merge)).float().eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits


PLAIN_LOADER = """
import sys, torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
ids, results = torch.tensor({ids}), {{}}
for adapter in sys.argv[2:]:
    with torch.no_grad():
        auto = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(adapter + "/base", dtype=torch.float32)
        base_only = base(input_ids=ids).logits
        explicit = PeftModel.from_pretrained(base, adapter)(input_ids=ids).logits
    encoded = AutoTokenizer.from_pretrained(adapter)("<|bos|>hello world")["input_ids"]
    results[adapter] = {{"auto": auto, "explicit": explicit, "base": base_only, "encoded": encoded}}
torch.save(results, sys.argv[1])
"""


def load_outside_longfit(adapters: list[Path], workdir: Path) -> dict:
    """Load each exported adapter with transformers + peft in a fresh process, offline, from another directory: with
    AutoPeftModelForCausalLM (its recorded base) and with PeftModel on adapter/base."""
    result = workdir / "logits.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", PLAIN_LOADER.format(ids=IDS), str(result), *map(str, adapters)],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {Path(adapter): logits for adapter, logits in torch.load(result).items()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_adapter_on_a_preset_loads_with_transformers_and_peft_alone(lora_runs, tmp_path):
    finals = [run / "final" for run in lora_runs.values()]
    loaded = load_outside_longfit(finals, tmp_path)
    for run, final in zip(lora_runs.values(), finals):
        recorded = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert recorded == str((final / "base").resolve())
        expected = longfit_logits(run / "checkpoints" / "step_00000002")
        assert loaded[final]["encoded"] == IDS[0]
        effect = relative(expected, loaded[final]["base"])  # the adapter changes the logits: comparing them means something
        assert effect > 1e-3
        for way in ("auto", "explicit"):  # eager attention there, longfit's SDPA here: fp32 summation order only
            assert relative(loaded[final][way], expected) < 1e-5, (final, way, relative(loaded[final][way], expected), effect)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_saved_base_is_the_base_the_adapter_trained_on(lora_runs, dtype):
    """Bit for bit, in its training dtype (bf16 under train.dtype=bf16): the base is what the adapter saw."""
    lora_run = lora_runs[dtype]
    checkpoint = lora_run / "checkpoints" / "step_00000002"
    cfg = checkpoint_config(checkpoint, None)
    trained = rebuild_model(checkpoint, cfg).get_base_model()
    saved = load_file(lora_run / "final" / "base" / "model.safetensors")
    expected_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
    plain = {name.replace(".base_layer", ""): p for name, p in trained.state_dict().items() if "lora_" not in name}
    assert saved.keys() == plain.keys()
    for name, tensor in saved.items():
        assert tensor.dtype == plain[name].dtype and torch.equal(tensor, plain[name]), name
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == expected_dtype


def test_export_command_writes_what_the_trainer_wrote_and_merges(lora_run, tmp_path, capsys):
    assert main(["export", str(lora_run), "--out", str(tmp_path / "adapter")]) == 0
    assert f"exported step 2 to {tmp_path / 'adapter'}" in capsys.readouterr().out
    ours, trainers = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "adapter", lora_run / "final"))
    assert ours.keys() == trainers.keys() and all(torch.equal(ours[k], trainers[k]) for k in ours)

    from transformers import AutoModelForCausalLM

    assert main(["export", str(lora_run), "--step", "1", "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        merged_logits = merged(input_ids=torch.tensor(IDS)).logits
    step_one = longfit_logits(lora_run / "checkpoints" / "step_00000001")
    assert relative(merged_logits, step_one) < 1e-5  # W + s B A rounded once per weight, in fp32
    assert relative(merged_logits, longfit_logits(lora_run / "checkpoints" / "step_00000002")) > relative(merged_logits, step_one)


def test_export_command_names_the_steps_available(lora_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("final"))
    newest = run / "checkpoints" / "step_00000002"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size, other bytes: only the checksum tells
    assert main(["export", str(run), "--step", "7"]) == 2
    assert "--step 7: " in (err := capsys.readouterr().err) and "steps available: 2, 1" in err
    assert main(["export", str(run), "--step", "2"]) == 2
    assert "is damaged" in (err := capsys.readouterr().err) and "does not match its checksum" in err
    assert "other steps available: 1" in err
    assert main(["export", str(run)]) == 0  # the newest intact one
    assert (run / "exports" / "step_00000001" / "adapter_config.json").is_file()
    assert main(["export", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_full_fine_tune_export_command_equals_the_trainers_export(tmp_path, capsys):
    out = tmp_path / "full"
    train(load_config(None, [
        "model=llama-tiny", f"output_dir={out}", "seq_len=64", "train.device=cpu", "train.steps=1",
        "data.synthetic_samples=4", "eval.retrieval=false", "memory.tiled_mlp=false",
    ]))
    assert main(["export", str(out), "--merge"]) == 2
    assert "full fine-tune" in capsys.readouterr().err
    assert main(["export", str(out)]) == 0
    ours, trainers = (load_file(d / "model.safetensors") for d in (out / "exports" / "step_00000001", out / "final"))
    assert ours.keys() == trainers.keys() and all(torch.equal(ours[k], trainers[k]) for k in ours)


def test_a_finished_run_exports_again_when_only_export_keys_change(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "model=llama-tiny", f"output_dir={out}", "seq_len=64", "train.device=cpu", "train.steps=1",
            "data.synthetic_samples=4", "eval.retrieval=false", "lora.enabled=true", "lora.r=4", "memory.tiled_mlp=false"]
    assert main(args) == 0 and (out / "final" / "adapter_config.json").is_file()
    capsys.readouterr()
    assert main([*args, "lora.merge_on_export=true"]) == 0
    assert "exported its last checkpoint to" in capsys.readouterr().out
    assert (out / "final" / "config.json").is_file() and not (out / "final" / "adapter_config.json").exists()
    assert main([*args, "lora.merge_on_export=true"]) == 0
    assert "nothing to do" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.tp=2", "parallel.dp_shard=1"]],
                         ids=["fsdp2", "tp2"])
def test_export_command_reads_a_checkpoint_of_two_ranks_on_one_process(tiny_model_dir, corpus, tmp_path, layout):
    """FSDP2 shards or tensor-parallel slices written by 2 ranks, read by DCP into one process: the same weights as
    the trainer's own export, gathered from the 2 ranks."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "longfit", "train", "--nproc", "2", f"model={tiny_model_dir}",
                           f"data.path={corpus}", f"output_dir={out}", "seq_len=128", "train.device=cpu", "train.steps=2",
                           "train.lr=1e-2", "memory.tiled_mlp=false", "eval.retrieval=false", *layout],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "checkpoints" / "step_00000002" / "manifest.json").read_text())["world_size"] == 2
    assert main(["export", str(out)]) == 0
    ours, trainers = (load_file(d / "model.safetensors") for d in (out / "exports" / "step_00000002", out / "final"))
    assert ours.keys() == trainers.keys()
    for name in ours:
        assert torch.equal(ours[name], trainers[name]), name
