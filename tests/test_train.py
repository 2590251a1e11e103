"""The single-process trainer end to end: resume exactness, export, LoRA, bad input."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from longfit.config import ConfigError, load_config
from longfit.train.loop import train


def run_config(model_dir, data, out, *extra):
    return load_config(None, [
        f"model={model_dir}", f"data.path={data}", f"output_dir={out}", "seq_len=128", "train.device=cpu",
        "train.steps=4", "train.warmup_steps=1", "train.lr=1e-2", "train.micro_batch=2", "train.grad_accum=2",
        "memory.tiled_mlp=false", *extra,
    ])


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def exported_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted((out / "final").glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def test_resume_continues_exactly(tiny_model_dir, corpus, tmp_path):
    straight = run_config(tiny_model_dir, corpus, tmp_path / "straight")
    train(straight)
    interrupted = run_config(tiny_model_dir, corpus, tmp_path / "interrupted")
    first = train(interrupted, stop_after_steps=2)
    assert first.steps == 2 and first.export_dir is None
    assert (tmp_path / "interrupted" / "checkpoints" / "step_00000002").is_dir()
    second = train(interrupted)
    assert second.resumed_from == 2

    rows_a, rows_b = metric_rows(tmp_path / "straight"), metric_rows(tmp_path / "interrupted")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for a, b in zip(rows_a, rows_b):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)
        assert a["lr"] == pytest.approx(b["lr"])
    weights_a, weights_b = exported_weights(tmp_path / "straight"), exported_weights(tmp_path / "interrupted")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], msg=lambda m: f"{name}: {m}")


def test_metrics_checkpoints_and_export_load_in_transformers(tiny_model_dir, corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    logged = []
    summary = train(run_config(tiny_model_dir, corpus, out), log=logged.append)
    assert "attention kernel: SDPA CPU flash (rows of several documents: SDPA CPU flash, one call per document)" in logged
    rows = metric_rows(out)
    assert len(rows) == 4
    for key in ["step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes"]:
        assert all(key in row for row in rows)
    assert summary.peak_mem_bytes > 0 and (out / "config.yaml").is_file()
    assert not (out / "tensorboard").exists()
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    ids = tokenizer("hello", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size
    trained = exported_weights(out)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(trained[k], original[k]) for k in trained)


def test_tensorboard_events_hold_the_metrics(tiny_model_dir, corpus, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(run_config(tiny_model_dir, corpus, out, "train.steps=2", "train.report_to=[tensorboard]", "train.export=false"))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert logged == [(row["step"], pytest.approx(row["loss"])) for row in metric_rows(out)]


@pytest.mark.parametrize("merge", [False, True])
def test_lora_exports_an_adapter_or_a_merged_model(tiny_model_dir, corpus, tmp_path, merge):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    train(run_config(tiny_model_dir, corpus, out, "lora.enabled=true", "lora.r=4", f"lora.merge_on_export={str(merge).lower()}"))
    final = out / "final"
    if merge:
        model = AutoModelForCausalLM.from_pretrained(final)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    else:
        from peft import PeftModel

        assert (final / "adapter_config.json").is_file()
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final)
        lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert lora_b and any(p.abs().sum() > 0 for p in lora_b)


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture
def previous_run(tmp_path) -> Path:
    out = tmp_path / "previous"
    (out / "final").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (out / "final" / "model.safetensors").write_bytes(b"weights")
    return out


def bad_data_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"text": "fine"}\n{"text": "broken\n')
    fieldless = tmp_path / "fieldless.jsonl"
    fieldless.write_text('{"body": "no text here"}\n')
    return {
        "empty": (empty, "empty"),
        "malformed": (malformed, r"malformed\.jsonl, line 2: malformed JSON.*\(data\.path\)"),
        "missing field": (fieldless, "data.text_field"),
        "missing file": (tmp_path / "absent.jsonl", "absent.jsonl"),
    }


@pytest.mark.parametrize("case", ["empty", "malformed", "missing field", "missing file"])
def test_bad_data_is_a_clear_error_and_writes_nothing(tiny_model_dir, tmp_path, case):
    path, message = bad_data_cases(tmp_path)[case]
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        train(run_config(tiny_model_dir, path, out), stop_after_steps=1)
    assert not out.exists()


def test_missing_model_directory_names_the_fix(corpus, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="local directory"):
        train(run_config(tmp_path / "no-such-model", corpus, out))
    with pytest.raises(ConfigError, match="meta-llama/Llama-3.1-8B.*model="):
        train(run_config("meta-llama/Llama-3.1-8B", corpus, out))
    assert not out.exists()


def test_refuses_to_overwrite_a_finished_run(tiny_model_dir, corpus, previous_run):
    before = snapshot(previous_run)
    with pytest.raises(ConfigError, match="new output_dir"):
        train(run_config(tiny_model_dir, corpus, previous_run))
    assert snapshot(previous_run) == before


def test_cpu_offload_on_one_rank_runs_fsdp2_and_trains_as_the_plain_run(tiny_model_dir, corpus, tmp_path, monkeypatch):
    """parallel.cpu_offload on one process wraps the model in FSDP2 over a one-rank group (on a GPU the
    model states then live in host memory); the run is the same computation as without it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from longfit.launch import shutdown_distributed
    from longfit.models.structure import decoder_layers
    from longfit.train import export

    train(run_config(tiny_model_dir, corpus, tmp_path / "plain"))
    wrapped, export_model = [], export.export_model

    def recording_export(cfg, model, *args, **kwargs):  # train() imports export_model when called: sees this one
        wrapped.append(all(isinstance(layer, FSDPModule) for layer in decoder_layers(model)))
        return export_model(cfg, model, *args, **kwargs)

    monkeypatch.setattr(export, "export_model", recording_export)
    try:
        train(run_config(tiny_model_dir, corpus, tmp_path / "offload", "parallel.cpu_offload=true"))
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        shutdown_distributed()
    assert wrapped == [True]
    plain, offloaded = metric_rows(tmp_path / "plain"), metric_rows(tmp_path / "offload")
    for a, b in zip(plain, offloaded, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    weights_a, weights_b = exported_weights(tmp_path / "plain"), exported_weights(tmp_path / "offload")
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---- rows without a target --------------------------------------------------------------------------------------------
LONG_QUESTION = {"messages": [{"role": "user", "content": "u" * 600}, {"role": "assistant", "content": "a" * 50}]}  # 655 tokens
SHORT_CHAT = {"messages": [{"role": "user", "content": "q" * 20}, {"role": "assistant", "content": "b" * 40}]}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rows_without_a_target_are_no_bad_steps_and_the_run_trains_on(tiny_model_dir, tmp_path, dtype):
    """data.long_chats=split cuts the long question into rows of 128 user tokens: steps 1-4 have no target. With
    train.max_bad_steps=1 they once stopped the run as 0 / 0 faults; now each makes no update (no loss, no gradient
    norm), is recorded as such, and step 5, which holds the answer, trains."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(chat) + "\n" for chat in [LONG_QUESTION, *[SHORT_CHAT] * 4]))
    out = tmp_path / "run"
    summary = train(run_config(tiny_model_dir, data, out, "data.long_chats=split", "train.max_bad_steps=1",
                               "train.micro_batch=1", "train.grad_accum=1", "train.steps=6", f"train.dtype={dtype}"))
    assert (summary.steps, summary.no_target_steps, summary.skipped_steps) == (6, 4, 0)
    rows = metric_rows(out)
    assert [(r["skipped"], r.get("skip_reason"), r["loss"], r["grad_norm"], r["tokens_per_s"]) for r in rows[:4]] == [
        (True, "no_target", None, None, None)] * 4  # no forward ran: no loss, gradient or throughput
    assert all(not r["skipped"] and "skip_reason" not in r and r["loss"] > 0 and r["grad_norm"] > 0 for r in rows[4:])
    assert summary.first_loss == rows[4]["loss"]


@pytest.mark.slow
def test_under_data_parallelism_the_global_target_count_decides(tiny_model_dir, tmp_path):
    """`--nproc 2`, dp_shard 2, one row per rank: a 707-token question (data.long_chats=split) fills global rows 0-4
    with user tokens. Steps 1-2 have no target on either rank: both skip the forward together (no collective left
    waiting). Step 3 pairs rank 0's target-less row 4 with rank 1's row 5, which holds the answer: a normal step."""
    import subprocess
    import sys

    data = tmp_path / "chats.jsonl"
    question = {"messages": [{"role": "user", "content": "u" * 700}, {"role": "assistant", "content": "a" * 50}]}
    data.write_text("".join(json.dumps(chat) + "\n" for chat in [question, *[SHORT_CHAT] * 4]))
    out = tmp_path / "run"
    argv = [f"model={tiny_model_dir}", f"data.path={data}", f"output_dir={out}", "seq_len=128", "train.device=cpu",
            "train.steps=3", "train.micro_batch=1", "train.lr=1e-2", "memory.tiled_mlp=false", "parallel.dp_shard=2",
            "data.long_chats=split", "train.max_bad_steps=1"]
    done = subprocess.run([sys.executable, "-m", "longfit", "train", "--nproc", "2", *argv], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metric_rows(out)
    assert [r.get("skip_reason") for r in rows] == ["no_target", "no_target", None]
    assert rows[2]["loss"] > 0 and "2 steps without a target" in done.stdout


def test_a_checkpoint_holds_and_restores_this_ranks_own_gpu_generator(monkeypatch):
    """rng_state saves the generator of this process's GPU only and set_rng_state restores it there (issue #33:
    every visible GPU's were saved and `set_rng_state_all` restored them by index, which fails where another
    number is visible and never restored rank r's own). CUDA's generator calls are recorded here (a CPU test)."""
    from longfit.train.checkpoint import rng_state, set_rng_state

    calls = []

    def refuse(*args):
        raise AssertionError("every visible GPU's generators")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", device)) or torch.tensor([device]))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append(("set", state.tolist(), device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", refuse)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", refuse)
    state = rng_state()
    set_rng_state(state)
    assert calls == [("get", 3), ("set", [3], 3)]
