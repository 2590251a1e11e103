"""The eval loss (`data.eval_path` / `data.eval_fraction`, `train.eval_every`, `longfit eval --data`): the mean token
loss over packed eval rows, equal to plain transformers' loss on the same rows, the same under context and data
parallelism on 2 gloo ranks, logged by the trainer at the right steps, on documents training never reads."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402

from longfit.cli import main  # noqa: E402
from longfit.config import ConfigError, load_config  # noqa: E402
from longfit.data.heldout import HeldOut  # noqa: E402
from longfit.data.packing import IGNORE_INDEX, EvalData  # noqa: E402
from longfit.data.sources import open_source  # noqa: E402
from longfit.eval.loss import evaluate_loss  # noqa: E402
from longfit.memory.loss import CausalLMLoss  # noqa: E402
from longfit.models.loading import load_model, load_tokenizer  # noqa: E402
from longfit.train.loop import train  # noqa: E402

SEQ_LEN, ROWS = 64, 8  # rows: whole batches of 2 rows on one rank and of 2 x 2 under dp=2


def eval_config(model_dir, data, *extra):
    return load_config(None, [f"model={model_dir}", f"data.eval_path={data}", f"seq_len={SEQ_LEN}", "train.device=cpu",
                              "train.micro_batch=2", "memory.tiled_mlp=false", "memory.loss_chunk=40", *extra])


def transformers_loss(model_dir, cfg) -> tuple[float, int]:
    """Plain transformers (eager attention, one document at a time) on the same packed rows: (mean loss, targets)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    loss_sum, tokens = 0.0, 0
    batches = EvalData(cfg, load_tokenizer(cfg.model)).loader(cfg.train.micro_batch)
    with torch.no_grad():
        for _, batch in zip(range(math.ceil(ROWS / cfg.train.micro_batch)), batches):
            for row, documents in enumerate(batch.documents.rows):
                for start, end in documents:
                    labels = batch.labels[row, start:end]
                    logits = model(input_ids=batch.input_ids[row, start:end][None]).logits[0].double()
                    loss_sum += torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX,
                                                                  reduction="sum").item()
                    tokens += int((labels != IGNORE_INDEX).sum())
    return loss_sum / tokens, tokens


def one_process_loss(cfg, autocast=None):
    model = load_model(cfg.model)
    loader = EvalData(cfg, load_tokenizer(cfg.model)).loader(cfg.train.micro_batch)
    return evaluate_loss(CausalLMLoss.from_config(model, cfg), loader, ROWS, torch.device("cpu"), autocast,
                         show_progress=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eval_loss_is_transformers_loss_on_the_same_rows(tiny_model_dir, corpus, dtype, one_thread):
    cfg = eval_config(tiny_model_dir, corpus, f"train.dtype={dtype}")
    expected, tokens = transformers_loss(tiny_model_dir, cfg)
    result = one_process_loss(cfg, torch.bfloat16 if dtype == "bf16" else None)
    assert (result.rows, result.tokens) == (ROWS, tokens)
    tolerance = dict(rtol=2e-2, atol=0) if dtype == "bf16" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.loss, expected, **tolerance)
    assert result.perplexity == pytest.approx(math.exp(result.loss))


def parallel_eval_worker(rank: int, world_size: int, model_dir: str, data: str) -> dict:
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import autocast_dtype, parallelize

    results = {}
    for cp, dtype in ((2, "fp32"), (2, "bf16"), (1, "fp32")):  # cp=1: the 2 ranks split the rows (dp_shard 2)
        cfg = eval_config(model_dir, data, f"parallel.cp={cp}", f"train.dtype={dtype}")
        model = load_model(cfg.model)
        dims = ParallelDims.from_config(cfg, world_size, model.config.num_attention_heads)
        mesh = dims.build_mesh("cpu")
        param_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, mesh, param_dtype=param_dtype)
        loader = EvalData(cfg, load_tokenizer(cfg.model)).loader(cfg.train.micro_batch, mesh.dp_rank, dims.dp_size)
        results[f"cp{cp}-{dtype}"] = evaluate_loss(loss_module, loader, ROWS, torch.device("cpu"),
                                                   autocast_dtype(dims, param_dtype), mesh, show_progress=False)
    return results


@pytest.mark.timeout(300)
@pytest.mark.slow  # moved out of the default suite for its 15 minutes; .ci/run runs it
def test_eval_loss_under_context_and_data_parallelism_is_the_one_process_loss(tiny_model_dir, corpus, one_thread):
    results = run_distributed(parallel_eval_worker, 2, str(tiny_model_dir), str(corpus))
    assert results[0] == results[1]  # every rank returns the global result
    reference = one_process_loss(eval_config(tiny_model_dir, corpus))
    for name, result in results[0].items():
        assert (result.rows, result.tokens) == (reference.rows, reference.tokens), name
        tolerance = dict(rtol=2e-2, atol=0) if name.endswith("bf16") else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result.loss, reference.loss, **tolerance, msg=name)


def test_held_out_documents_are_disjoint_from_training_and_the_same_every_time(tiny_model_dir, corpus):
    cfg = load_config(None, [f"model={tiny_model_dir}", f"data.path={corpus}", "data.eval_fraction=0.25"])
    source = open_source(cfg, load_tokenizer(cfg.model))
    everything = [doc.position for doc in source.documents()]
    held_out = [doc.position for doc in HeldOut(source, 0.25, held_out=True).documents()]
    trained = [doc.position for doc in HeldOut(source, 0.25, held_out=False).documents()]
    assert sorted(held_out + trained) == sorted(everything) and not set(held_out) & set(trained)
    assert 0.1 < len(held_out) / len(everything) < 0.4  # 60 documents: a hash split, not an exact count
    assert held_out == [doc.position for doc in HeldOut(open_source(cfg, load_tokenizer(cfg.model)), 0.25, True).documents()]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_evaluates_every_n_steps_and_after_the_last(tiny_model_dir, corpus, tmp_path, dtype, one_thread):
    out = tmp_path / "run"
    logged = []
    cfg = load_config(None, [
        f"model={tiny_model_dir}", f"data.path={corpus}", f"output_dir={out}", f"seq_len={SEQ_LEN}", "train.device=cpu",
        "train.steps=3", "train.warmup_steps=1", "train.lr=1e-2", "train.micro_batch=2", "memory.tiled_mlp=false",
        "data.eval_fraction=0.25", "train.eval_every=2", "data.eval_rows=4", f"train.dtype={dtype}",
    ])
    summary = train(cfg, log=logged.append)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval_loss" in row]
    assert [row["step"] for row in evals] == [2, 3]
    assert [row["eval_rows"] for row in evals] == [4, 4]
    assert summary.last_eval.loss == evals[-1]["eval_loss"] and evals[-1]["eval_ppl"] == pytest.approx(
        math.exp(evals[-1]["eval_loss"]))
    assert any(line.strip().startswith("eval after step 2: loss ") for line in logged)
    # The last evaluation is the exported model's loss on the held-out rows (eval mode: no dropout, no grad).
    exported = load_model(str(out / "final"))
    loader = EvalData(cfg, load_tokenizer(cfg.model)).loader(cfg.train.micro_batch)
    autocast = torch.bfloat16 if dtype == "bf16" else None
    again = evaluate_loss(CausalLMLoss.from_config(exported, cfg), loader, 4, torch.device("cpu"), autocast,
                          show_progress=False)
    torch.testing.assert_close(evals[-1]["eval_loss"], again.loss, rtol=1e-5, atol=1e-6)
    assert evals[-1]["eval_tokens"] == again.tokens


def test_eval_command_reports_loss_and_perplexity_on_a_file(tiny_model_dir, corpus, tmp_path, capfd):
    report = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(corpus), "--seq-len", str(SEQ_LEN),
                 "--rows", str(ROWS), "--device", "cpu", "--json", str(report)]) == 0
    out, _ = capfd.readouterr()
    result = json.loads(report.read_text())
    reference = one_process_loss(eval_config(tiny_model_dir, corpus, "train.micro_batch=1"))
    assert (result["rows"], result["tokens"]) == (reference.rows, reference.tokens)
    torch.testing.assert_close(result["loss"], reference.loss, rtol=1e-5, atol=1e-6)
    assert f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}" in out


def test_an_evaluation_reads_a_quarter_of_the_rows_trained_since_the_last(corpus):
    from longfit.eval.loss import eval_row_count

    def rows(*overrides, dp_size=1):
        return eval_row_count(load_config(None, [f"data.eval_path={corpus}", *overrides]), dp_size)

    assert rows("train.eval_every=8", "train.micro_batch=2", dp_size=2) == 8
    assert rows("train.steps=40", "train.grad_accum=2") == 20  # evaluated at the end only: all the steps
    assert rows("train.eval_every=1") == 1 and rows("train.eval_every=8", "data.eval_rows=3") == 3


def test_eval_settings_are_checked_before_the_run(tiny_model_dir, corpus, tmp_path):
    with pytest.raises(ConfigError, match="needs eval data: set data.eval_path"):
        load_config(None, ["train.eval_every=10"])
    with pytest.raises(ConfigError, match="keep one"):
        load_config(None, [f"data.eval_path={corpus}", "data.eval_fraction=0.1"])
    cfg = load_config(None, [f"model={tiny_model_dir}", f"data.path={corpus}", "data.eval_fraction=0.001"])
    with pytest.raises(ConfigError, match="holds out none of the documents"):
        EvalData(cfg, load_tokenizer(cfg.model))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_eval_under_context_parallelism_matches_one_process(tiny_model_dir, corpus, tmp_path):
    """`longfit train --nproc 2 parallel.cp=2` logs the eval loss of the one-process run (torchrun, gloo), and only
    rank 0 reports to the trackers."""
    import subprocess

    def eval_rows(out, *extra):
        args = [f"model={tiny_model_dir}", f"data.path={corpus}", f"output_dir={out}", f"seq_len={SEQ_LEN}",
                "train.device=cpu", "train.steps=2", "train.micro_batch=2", "memory.tiled_mlp=false", "train.export=false",
                "data.eval_fraction=0.25", "train.eval_every=1", "data.eval_rows=4", *extra]
        done = subprocess.run([sys.executable, "-m", "longfit", "train", *args], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(row["step"], row["eval_loss"], row["eval_tokens"]) for row in rows if "eval_loss" in row]

    single = eval_rows(tmp_path / "single")
    parallel = eval_rows(tmp_path / "cp2", "--nproc", "2", "parallel.cp=2", "train.report_to=[tensorboard]")
    assert len(list((tmp_path / "cp2" / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0's alone
    assert [(step, tokens) for step, _, tokens in parallel] == [(step, tokens) for step, _, tokens in single]
    assert [loss for _, loss, _ in parallel] == pytest.approx([loss for _, loss, _ in single], rel=1e-4)
