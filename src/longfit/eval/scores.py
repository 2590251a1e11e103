"""A training run's retrieval score before and after training (`eval.retrieval`), and its size.

The score is `longfit eval`'s metric (teacher-forced exact match of the needle's value) at one length,
over a number of examples at each needle depth, drawn from the evaluation's own seeds (no training
document among them). It is computed by one process on a whole, unwrapped copy of the model, whatever
the run's layout: before training the model as the trainer initialises it (a preset drawn from
train.seed, a local directory's weights), after training the exported OUTPUT_DIR/final, which is what a
user evaluates with `longfit eval --model OUTPUT_DIR/final`.

How big the automatic eval is (`eval.retrieval=auto`; `true` scores eval.samples per depth at seq_len, as
asked) is decided here and only here, by `retrieval_size`: see its docstring for the rule and the
measurements behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from longfit.config import Config
from longfit.eval.retrieval import DEPTHS

if TYPE_CHECKING:
    from longfit.eval.media_retrieval import MediaRetrievalScore

AUTO_MIN_SEQ_LEN = 256  # room for a needle, its question and some prose with any tokenizer
# Tokens one automatic evaluation may read, as a fraction of the tokens one rank trains on (the rule: see
# `retrieval_size`). Two evaluations then read a quarter of the training tokens.
EVAL_TOKEN_SHARE = 1 / 8


@dataclass(frozen=True)
class RetrievalSize:
    length: int  # tokens per example (prompt + answer)
    samples: int  # examples per needle depth

    @property
    def examples(self) -> int:
        return self.samples * len(DEPTHS)


@dataclass(frozen=True)
class RetrievalScore:
    accuracy: float
    length: int
    examples: int


def training_tokens_per_rank(cfg: Config) -> float:
    """Tokens of the whole run (train.steps, also when it resumes) one rank computes, counted in whole-model
    tokens: context parallelism splits each row across cp ranks and tensor parallelism each layer across tp,
    so a rank does 1/(cp x tp) of a row's work; data-parallel ranks each train rows of their own."""
    row_tokens = cfg.train.steps * cfg.train.grad_accum * cfg.train.micro_batch * cfg.seq_len
    return row_tokens / (max(cfg.parallel.cp, 1) * max(cfg.parallel.tp, 1))


def retrieval_size(cfg: Config) -> RetrievalSize | None:
    """The examples eval.retrieval scores, before and after training alike (they must be the same examples
    for the two scores to compare); None when `auto` cannot afford even one short example per depth.

    `true`: eval.samples per depth at seq_len, whatever it costs (the user asked for it).

    `auto`: each of the two evaluations reads at most EVAL_TOKEN_SHARE (1/8) of the tokens one rank trains
    on (`training_tokens_per_rank`), so the two read a quarter. An evaluated token costs one forward of the
    whole model on one process, with logits only at the answer; a trained token costs a forward, a backward
    and usually a recomputation, with logits everywhere, so it costs less: measured on 2 shared CPU cores
    (benchmarks/results/real_model.md) an evaluated token took 0.2-0.4x the time of a trained one for
    SmolLM2-135M (1,024-token examples; LoRA training at 1,024 with checkpointing, at 512 without) and
    0.37-0.53x for the default run (llama-tiny, 1,024-token examples, training at 8,192; the eval builds its
    byte-level examples in Python). Evaluations that read a quarter of the training tokens thus take at most a quarter of the
    training time, i.e. at most a fifth of the run. The size is computed from the config, not
    from a measured step time, because the first evaluation runs before any step and the second must score
    the same examples.

    Within that budget, eval.samples per depth are kept and the length shrinks from seq_len (never past
    AUTO_MIN_SEQ_LEN); when even AUTO_MIN_SEQ_LEN is too long, the examples per depth shrink (never below
    one); when one example per depth at AUTO_MIN_SEQ_LEN does not fit, the run is not scored. Lengths are
    whole multiples of 64 below seq_len, so the printed length reads as a round number."""
    mode = cfg.eval.retrieval
    if not mode or (mode == "auto" and (cfg.data.path is not None or not cfg.train.export)):
        return None
    if mode is True:
        return RetrievalSize(cfg.seq_len, cfg.eval.samples)
    if cfg.seq_len < AUTO_MIN_SEQ_LEN:
        return None
    budget = training_tokens_per_rank(cfg) * EVAL_TOKEN_SHARE  # tokens one evaluation may read
    samples = cfg.eval.samples
    length = min(cfg.seq_len, int(budget // (samples * len(DEPTHS))))
    if length < cfg.seq_len:
        length = max(length // 64 * 64, AUTO_MIN_SEQ_LEN)
    samples = min(samples, int(budget // (length * len(DEPTHS))))
    return RetrievalSize(length, samples) if samples >= 1 else None


def retrieval_score(model: str, cfg: Config, device) -> RetrievalScore:
    """Retrieval accuracy of `model` (a preset, a model or adapter directory) on `device`, over the examples
    `retrieval_size` chooses for this run; the run's own model with the run's RoPE (an export carries it)."""
    from longfit.eval.command import load_eval_model
    from longfit.eval.retrieval import evaluate_retrieval, mean_accuracy
    from longfit.models.loading import compute_dtype

    size = retrieval_size(cfg)
    if size is None:
        raise ValueError("retrieval_score on a run that eval.retrieval does not score (check retrieval_size)")
    net, tokenizer = load_eval_model(model, compute_dtype(cfg.train.dtype, device), device, cfg.train.seed,
                                     run=cfg if model == cfg.model else None)
    results = evaluate_retrieval(net, tokenizer, [size.length], list(DEPTHS), size.samples, cfg.train.seed, device)
    return RetrievalScore(mean_accuracy(results), size.length, sum(r.samples for r in results))


def media_retrieval_score(model: str, cfg: Config, device) -> "MediaRetrievalScore":
    """eval.retrieval_media's score of `model` (the run's wrapper checkpoint, or its export) on `device`
    (`longfit.eval.media_retrieval`): its vision side is its own, or the run's checkpoint's for an adapter (a LoRA
    export holds the language model's adapters only, the vision side frozen); its pages are read by the run's
    checkpoint's processors (they do not train)."""
    from longfit.eval.command import load_media_model
    from longfit.eval.media_retrieval import evaluate_media_retrieval
    from longfit.models.loading import compute_dtype
    from longfit.models.media import media_reader

    loss_module, tokenizer = load_media_model(model, cfg.model, compute_dtype(cfg.train.dtype, device), device,
                                              cfg.train.seed, run=cfg if model == cfg.model else None)
    return evaluate_media_retrieval(loss_module, tokenizer, media_reader(cfg.model), cfg, cfg.eval.retrieval_media,
                                    cfg.eval.pages, cfg.eval.samples, cfg.train.seed, device)
