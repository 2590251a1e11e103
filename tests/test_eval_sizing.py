"""The automatic retrieval eval's size (`longfit.eval.scores.retrieval_size`): the rule on given configs."""

import pytest

from longfit.config import load_config
from longfit.eval.scores import DEPTHS, EVAL_TOKEN_SHARE, RetrievalSize, retrieval_size


def size(*overrides: str) -> RetrievalSize | None:
    return retrieval_size(load_config(None, list(overrides)))


def evaluated_tokens(s: RetrievalSize) -> int:
    return s.length * s.samples * len(DEPTHS)


def test_the_default_run_scores_twenty_examples_at_an_eighth_of_its_tokens():
    # 20 steps x 8192 tokens = 163,840; an eighth is 20,480 = 20 examples x 1024 tokens.
    assert size() == RetrievalSize(1024, 4)
    assert size().examples == 20


def test_a_run_that_affords_it_is_scored_at_seq_len():
    assert size("seq_len=1024", "train.steps=400") == RetrievalSize(1024, 4)
    assert size("seq_len=1024", "train.steps=400", "eval.samples=10") == RetrievalSize(1024, 10)


@pytest.mark.parametrize("overrides", [
    (), ("seq_len=16384", "train.steps=1"), ("seq_len=2048", "train.steps=3"), ("seq_len=4096", "train.steps=7"),
    ("seq_len=65536", "train.steps=30", "eval.samples=50"), ("seq_len=300", "train.steps=1000"),
    ("seq_len=8192", "train.steps=5", "train.grad_accum=4", "train.micro_batch=2"),
])
def test_auto_never_reads_more_than_its_share_of_the_training_tokens(overrides):
    cfg = load_config(None, list(overrides))
    s = retrieval_size(cfg)
    tokens = cfg.train.steps * cfg.train.grad_accum * cfg.train.micro_batch * cfg.seq_len
    if s is not None:
        assert evaluated_tokens(s) <= tokens * EVAL_TOKEN_SHARE
        assert 256 <= s.length <= cfg.seq_len and 1 <= s.samples <= cfg.eval.samples
        assert s.length == cfg.seq_len or s.length % 64 == 0


def test_the_one_step_16k_run_of_issue_26_scores_one_short_example_per_depth():
    # 16,384 training tokens: 2,048 for one evaluation, i.e. one example of 256 tokens at each of 5 depths
    # (before the rule: 2 x 20 examples at 16,384 tokens, 40 times the training tokens).
    assert size("seq_len=16384", "train.steps=1") == RetrievalSize(256, 1)


def test_length_shrinks_before_the_examples_do():
    assert size("seq_len=8192", "train.steps=10") == RetrievalSize(512, 4)  # 10,240 tokens: 20 x 512
    assert size("seq_len=4096", "train.steps=5") == RetrievalSize(256, 2)  # 2,560 tokens: 10 x 256
    assert size("seq_len=4096", "train.steps=2") is None  # 1,024 tokens: less than 5 x 256


def test_too_few_training_tokens_skip_auto_but_not_true():
    assert size("seq_len=1024", "train.steps=1") is None  # 128 tokens: not one 256-token example per depth
    assert size("seq_len=1024", "train.steps=1", "eval.retrieval=true") == RetrievalSize(1024, 4)


def test_context_and_tensor_parallel_ranks_each_train_a_share_of_a_row():
    assert size("seq_len=8192", "train.steps=20", "parallel.cp=2") == RetrievalSize(512, 4)
    assert size("seq_len=8192", "train.steps=20", "parallel.cp=2", "parallel.tp=2") == RetrievalSize(256, 4)


def test_when_auto_does_not_score():
    assert size("seq_len=128", "train.steps=10000") is None  # shorter than a retrieval example needs
    assert size("data.path=some.jsonl") is None  # not the synthetic task
    assert size("train.export=false") is None  # nothing exported to score after training
    assert size("eval.retrieval=false") is None
