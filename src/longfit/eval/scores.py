"""A training run's retrieval score before and after training (`eval.retrieval`).

The score is `longfit eval`'s metric (teacher-forced exact match of the needle's value) at the run's
seq_len, over `eval.samples` examples at each needle depth, drawn from the evaluation's own seeds (no
training document among them). It is computed by one process on a whole, unwrapped copy of the model,
whatever the run's layout: before training the model as the trainer initialises it (a preset drawn
from train.seed, a local directory's weights), after training the exported OUTPUT_DIR/final, which is
what a user evaluates with `longfit eval --model OUTPUT_DIR/final`.
"""

from __future__ import annotations

from dataclasses import dataclass

from longfit.config import Config

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
AUTO_MIN_SEQ_LEN = 256  # room for a needle, its question and some prose with any tokenizer


@dataclass(frozen=True)
class RetrievalScore:
    accuracy: float
    length: int
    examples: int


def retrieval_enabled(cfg: Config) -> bool:
    """eval.retrieval resolved: `auto` scores runs on the built-in synthetic task that export their model, from
    seq_len AUTO_MIN_SEQ_LEN on."""
    if cfg.eval.retrieval == "auto":
        return cfg.data.path is None and cfg.train.export and cfg.seq_len >= AUTO_MIN_SEQ_LEN
    return bool(cfg.eval.retrieval)


def retrieval_score(model: str, cfg: Config, device) -> RetrievalScore:
    """Retrieval accuracy of `model` (a preset, a model or adapter directory) at cfg.seq_len on `device`."""
    from longfit.eval.command import load_eval_model
    from longfit.eval.retrieval import evaluate_retrieval, mean_accuracy
    from longfit.models.loading import compute_dtype

    net, tokenizer = load_eval_model(model, compute_dtype(cfg.train.dtype, device), device, cfg.train.seed)
    results = evaluate_retrieval(net, tokenizer, [cfg.seq_len], list(DEPTHS), cfg.eval.samples, cfg.train.seed, device)
    return RetrievalScore(mean_accuracy(results), cfg.seq_len, sum(r.samples for r in results))
