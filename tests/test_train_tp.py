"""`longfit train` with parallel.tp on gloo ranks: the losses of one process, bit-identical resume, plain export."""

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from longfit.config import load_config
from longfit.train.loop import train


def common_args(model_dir, data, out, *extra: str) -> list[str]:
    return [
        f"model={model_dir}", f"data.path={data}", f"output_dir={out}", "seq_len=128", "train.device=cpu", "train.steps=3",
        "train.warmup_steps=1", "train.lr=1e-2", "train.micro_batch=2", "train.dtype=fp32", "memory.tiled_mlp=false",
        *extra,
    ]


def longfit_train(nproc: int, args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "longfit", "train", "--nproc", str(nproc), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def single_process_losses(args: list[str]) -> list[float]:
    summary = train(load_config(None, args))
    return [row["loss"] for row in rows(summary.output_dir)]


def exported(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted((out / "final").glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


# Stops after `argv[1]` steps with a checkpoint, as a time-limited job would (train's stop_after_steps).
STOPPING_WORKER = textwrap.dedent(
    """
    import sys
    from longfit.config import load_config
    from longfit.launch import shutdown_distributed
    from longfit.train.loop import train

    train(load_config(None, sys.argv[2:]), stop_after_steps=int(sys.argv[1]))
    shutdown_distributed()
    """
)


def assert_resumes_like_the_straight_run(args: list[str], straight, tmp_path) -> None:
    """`longfit train --nproc 2` with `args` stopped after its first step with a checkpoint, then resumed: every
    logged step (loss, gradient norm, learning rate) and every exported weight equal the `straight` run's, bit for
    bit."""
    interrupted = Path(load_config(None, args).output_dir)
    script = tmp_path / "stop.py"
    script.write_text(STOPPING_WORKER)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
                    "1", *args], check=True, capture_output=True, timeout=600)
    assert [row["step"] for row in rows(interrupted)] == [1] and not (interrupted / "final").exists()
    longfit_train(2, args)
    for a, b in zip(rows(straight), rows(interrupted), strict=True):
        assert (a["step"], a["loss"], a["grad_norm"], a["lr"]) == (b["step"], b["loss"], b["grad_norm"], b["lr"])
    weights, resumed = exported(straight), exported(interrupted)
    assert weights.keys() == resumed.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, resumed[name]), name


@pytest.mark.slow  # 30 s; the default suite's 15 minutes (2026-11-27)
@pytest.mark.timeout(600)
def test_tp2_trains_like_one_process_and_resumes_bit_identically(tiny_model_dir, corpus, tmp_path):
    reference = single_process_losses(common_args(tiny_model_dir, corpus, tmp_path / "single"))

    straight = tmp_path / "tp2"
    longfit_train(2, common_args(tiny_model_dir, corpus, straight, "parallel.tp=2"))
    assert [row["loss"] for row in rows(straight)] == pytest.approx(reference, rel=1e-5)

    assert_resumes_like_the_straight_run(common_args(tiny_model_dir, corpus, tmp_path / "tp2-interrupted",
                                                     "parallel.tp=2"), straight, tmp_path)

    # The export is a plain transformers directory: every weight whole, the same as the one-process run's names.
    from transformers import AutoModelForCausalLM

    assert exported(straight).keys() == exported(tmp_path / "single").keys()
    model = AutoModelForCausalLM.from_pretrained(straight / "final")
    assert torch.isfinite(model(input_ids=torch.tensor([[256, 104, 105]])).logits).all()


@pytest.mark.timeout(600)
@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_tp2_lora_trains_like_one_process(tiny_model_dir, corpus, tmp_path):
    lora = ("lora.enabled=true", "lora.r=4", "memory.tiled_mlp=true", "memory.mlp_tiles=2")
    reference = single_process_losses(common_args(tiny_model_dir, corpus, tmp_path / "single", *lora))
    out = tmp_path / "tp2-lora"
    longfit_train(2, common_args(tiny_model_dir, corpus, out, "parallel.tp=2", *lora))
    assert [row["loss"] for row in rows(out)] == pytest.approx(reference, rel=1e-5)
    assert (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.timeout(600)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_check_after_the_launchers_plan_finds_tp2_lora_with_the_tiled_mlp_exact(tiny_model_dir, corpus, tmp_path,
                                                                                     monkeypatch, dtype):
    """`longfit train --nproc 2`'s launcher in one process: the memory plan on a cold cache (it traces the tp layers
    here, on a fake process group), then `longfit check`, whose tp ranks are forks of this process: loss and every
    gradient of the step on 2 tp ranks against transformers' one process (#54: the plan's DTensor caches made the
    forked ranks' step wrong, and the run was refused)."""
    from longfit.check.parity import check_run
    from longfit.plan import preflight

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = load_config(None, common_args(tiny_model_dir, corpus, tmp_path / "out", "parallel.tp=2", "lora.enabled=true",
                                        "lora.r=4", "memory.tiled_mlp=true", "memory.mlp_tiles=2",
                                        f"train.dtype={dtype}"))
    preflight(copy.deepcopy(cfg), 2, "cpu", check_fit=False)
    report = check_run(cfg, "cpu")
    assert report.exact, report.refusal
    assert [c.name for c in report.comparisons if "tp=2" in c.name] == [
        f"rank {rank} of 2, tp=2, techniques, packed" for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_tp2_with_cp2_on_four_ranks_trains_like_one_process(tiny_model_dir, corpus, tmp_path, method):
    reference = single_process_losses(common_args(tiny_model_dir, corpus, tmp_path / "single"))
    out = tmp_path / "tp2-cp2"
    longfit_train(4, common_args(tiny_model_dir, corpus, out, "parallel.tp=2", "parallel.cp=2",
                                 f"parallel.cp_method={method}"))
    assert [row["loss"] for row in rows(out)] == pytest.approx(reference, rel=1e-5)
    assert len(list((out / "checkpoints" / "step_00000003").glob("*.distcp"))) == 4


# slow: three runs of two gloo ranks, the first with its cold check: 240 CPU s for both cases (667 s wall at load 5-9)
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tp2_on_qwen3_5_resumes_bit_identically(corpus, tmp_path, dtype):
    """A Gated DeltaNet under tp=2 (its fused q/k/v projection and convolution replicated, A_log and dt_bias sharded
    by value head) stopped after a step and resumed from its checkpoint: the uninterrupted run, bit for bit."""
    from test_tp_families import family_model

    from longfit.data.tokenizer import byte_tokenizer

    model_dir = tmp_path / "qwen3_5-tiny"
    family_model("qwen3_5", "eager").save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    straight = tmp_path / "tp2"
    longfit_train(2, common_args(model_dir, corpus, straight, "parallel.tp=2", f"train.dtype={dtype}"))
    assert [row["step"] for row in rows(straight)] == [1, 2, 3]
    assert_resumes_like_the_straight_run(common_args(model_dir, corpus, tmp_path / "tp2-interrupted", "parallel.tp=2",
                                                     f"train.dtype={dtype}"), straight, tmp_path)


@pytest.mark.slow  # about a minute a family
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen3_next", "llama4_moe", "gemma4_moe", "gemma4_ple"])
def test_tp2_on_the_fused_and_per_layer_families_resumes_bit_identically(corpus, tmp_path, family):
    """`longfit train --nproc 2 parallel.tp=2` on Qwen3-Next (its projections split by key head), Llama 4's transposed
    experts, Gemma 4's experts called by its layers, and its per-layer inputs with layers reusing keys and values,
    stopped after a step and resumed from its checkpoint: the uninterrupted run, bit for bit (losses, gradient norms,
    learning rates, every exported weight)."""
    from test_tp_families import family_model

    from longfit.data.tokenizer import byte_tokenizer

    model_dir = tmp_path / f"{family}-tiny"
    family_model(family, "eager").save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    straight = tmp_path / "tp2"
    longfit_train(2, common_args(model_dir, corpus, straight, "parallel.tp=2"))
    assert [row["step"] for row in rows(straight)] == [1, 2, 3]
    assert_resumes_like_the_straight_run(common_args(model_dir, corpus, tmp_path / "tp2-interrupted", "parallel.tp=2"),
                                         straight, tmp_path)
