"""train.epochs: the run reads the data exactly that many times, its steps derived from the rows of an epoch; the
summary states what an epoch holds and where the run ends; a wrap-around into a new epoch is said."""

import json
import math

import pytest
import torch

from longfit.cli import main
from longfit.config import ConfigError, load_config
from longfit.data.packing import EpochCount, count_epoch
from longfit.data.sources import open_source
from longfit.models.loading import load_tokenizer
from longfit.train.console import epoch_text
from longfit.train.loop import train

SEQ_LEN = 64


@pytest.fixture
def small_corpus(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}: " + "lorem ipsum dolor sit amet. " * (i % 4 + 1)}) + "\n"
                            for i in range(13)))
    return path


def run_config(model_dir, data, out, *extra):
    return load_config(None, [
        f"model={model_dir}", f"data.path={data}", f"output_dir={out}", f"seq_len={SEQ_LEN}", "train.device=cpu",
        "train.warmup_steps=1", "train.lr=1e-2", "train.micro_batch=2", "train.grad_accum=2", "memory.tiled_mlp=false",
        "train.export=false", *extra,
    ])


def data_tokens(cfg) -> tuple[int, int]:
    """(documents, tokens) of the data, read straight from its source: plain text packs into ceil(tokens / seq_len)
    rows, every row full but the last."""
    lengths = [len(doc) for doc in open_source(cfg, load_tokenizer(cfg.model)).documents()]
    return len(lengths), sum(lengths)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_epochs_decide_the_steps_and_the_data_is_read_exactly_that_often(tiny_model_dir, small_corpus, tmp_path, dtype,
                                                                         one_thread):
    out = tmp_path / "run"
    cfg = run_config(tiny_model_dir, small_corpus, out, "train.epochs=2", f"train.dtype={dtype}")
    documents, tokens = data_tokens(cfg)
    rows = math.ceil(tokens / SEQ_LEN)
    # An epoch ends early in its last row, so packing the second epoch on into it would take one row fewer.
    assert 0 < tokens % SEQ_LEN <= SEQ_LEN // 2
    steps = math.ceil(2 * rows / 4)  # micro_batch 2 x grad_accum 2 rows per step
    logged = []
    summary = train(cfg, log=logged.append)
    text = "\n".join(logged)
    assert summary.steps == steps and math.isfinite(summary.last_loss)
    assert f"{steps} steps, lr 0.01; an epoch is {documents} documents, {tokens:,} tokens, {rows} rows: 2 epochs" in text
    assert text.count("began it again") == 1 and "began it again: epoch 2 of 2" in text
    # Every document twice and no third epoch: the last step holds what is left (padding completes its last batch).
    assert f"data    {2 * rows} rows, {2 * documents} documents" in text
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == list(range(1, steps + 1))
    state = torch.load(out / "checkpoints" / f"step_{steps:08d}" / "trainer_rank0.pt", weights_only=False)
    assert state["data"]["epoch"] == 1 and state["data"]["finished"]


def test_steps_past_the_data_say_where_the_run_ends_and_when_it_wraps(tiny_model_dir, small_corpus, tmp_path):
    cfg = run_config(tiny_model_dir, small_corpus, tmp_path / "run", "train.steps=6")
    documents, tokens = data_tokens(cfg)
    rows = math.ceil(tokens / SEQ_LEN)
    logged = []
    train(cfg, log=logged.append)
    text = "\n".join(logged)
    assert f"an epoch is {documents} documents, {tokens:,} tokens, {rows} rows: the run ends in epoch {math.ceil(24 / rows)}" in text
    assert "began it again: epoch 2 (" in text


def test_a_large_dataset_is_not_counted_past_what_the_run_reads(tiny_model_dir, corpus):
    cfg = load_config(None, [f"model={tiny_model_dir}", f"data.path={corpus}", f"seq_len={SEQ_LEN}"])
    whole = count_epoch(cfg, load_tokenizer(cfg.model))
    part = count_epoch(cfg, load_tokenizer(cfg.model), max_tokens=500)
    assert whole.complete and not part.complete
    assert 500 < part.tokens <= 500 + SEQ_LEN and part.rows == math.ceil(part.tokens / SEQ_LEN) < whole.rows
    cfg = load_config(None, ["train.steps=3", "train.micro_batch=2"])
    assert epoch_text(cfg, EpochCount(5000, 4_200_000, 520, complete=False), 2) == (
        "; the data holds over 4.2M tokens, counted no further: the run's 6 rows lie in its first epoch")


@pytest.mark.slow  # ~45 s wall at load 5: two runs of two epochs (CI runs it)
def test_a_run_of_epochs_resumes_to_the_same_end(tiny_model_dir, small_corpus, tmp_path):
    cfg = run_config(tiny_model_dir, small_corpus, tmp_path / "run", "train.epochs=2", "train.steps=0")
    first = train(cfg, stop_after_steps=2)
    second = train(cfg)
    assert (first.steps, second.resumed_from) == (2, 2)
    straight = train(run_config(tiny_model_dir, small_corpus, tmp_path / "straight", "train.epochs=2"))
    assert second.steps == straight.steps and second.last_loss == pytest.approx(straight.last_loss, rel=1e-5)


def test_steps_that_contradict_the_epochs_are_refused_before_anything_is_written(tiny_model_dir, small_corpus, tmp_path,
                                                                                capfd):
    out = tmp_path / "run"
    argv = [f"model={tiny_model_dir}", f"data.path={small_corpus}", f"output_dir={out}", f"seq_len={SEQ_LEN}",
            "train.device=cpu", "train.epochs=2", "train.steps=100"]
    assert main(["train", *argv]) == 2
    err = capfd.readouterr().err
    assert "train.steps=100 and train.epochs=2 disagree" in err and "train.steps=0 lets train.epochs decide" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    with pytest.raises(ConfigError, match=r"train.steps=0: must be >= 1 \(or 0 with train.epochs"):
        load_config(None, ["train.steps=0"])
    assert load_config(None, ["train.steps=0", "train.epochs=1"]).train.steps == 0
