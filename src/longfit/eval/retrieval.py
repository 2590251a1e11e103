"""Synthetic retrieval accuracy across context lengths and needle depths.

Metric: teacher-forced exact match. One forward pass over prompt + answer[:-1]; an example counts as
correct when the argmax prediction at every answer position equals the answer token. This is exactly
"greedy decoding reproduces the answer" (each greedy step would see the same prefix), at the cost of a
single forward and without a KV cache, and only the answer positions' logits are computed
(`logits_to_keep`), so long contexts with large vocabularies fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from longfit.data.synthetic import retrieval_example

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the needle depths a run's retrieval scores (`longfit.eval.scores`)


@dataclass
class CellResult:
    length: int
    depth: float
    correct: int
    samples: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.samples


def answer_is_predicted(model, prompt_ids: list[int], answer_ids: list[int], device) -> bool:
    """Teacher-forced exact match of all answer tokens (see the module docstring)."""
    import torch

    inputs = torch.tensor([prompt_ids + answer_ids[:-1]], device=device)  # (1, P + A - 1)
    with torch.no_grad():
        logits = model(input_ids=inputs, logits_to_keep=len(answer_ids)).logits  # (1, A, V)
    return logits[0].argmax(-1).tolist() == answer_ids


def evaluate_retrieval(model, tokenizer, lengths: list[int], depths: list[float], samples: int, seed: int = 0,
                       device="cpu") -> list[CellResult]:
    """Accuracy per (length, depth) cell over `samples` examples each; example i of a cell is the
    same for every model given the same tokenizer and seed. Shows its progress (`longfit.models.progress`):
    a bar over the examples on a terminal, else a line per cell with its score."""
    from longfit.models.progress import progress

    was_training = model.training
    model.eval()
    results = []
    shown = progress(len(lengths) * len(depths) * samples, "retrieval", "examples", every=samples)
    try:
        for length in lengths:
            for depth in depths:
                correct = 0
                for sample in range(samples):
                    example = retrieval_example(tokenizer, length, depth, f"{seed}:{length}:{depth}:{sample}")
                    correct += answer_is_predicted(model, example.prompt_ids, example.answer_ids, device)
                    shown.set_postfix_str(f"{length} tokens, depth {depth:.2f}: {correct}/{sample + 1} correct")
                    shown.update(1)
                results.append(CellResult(length, depth, correct, samples))
    finally:
        shown.close()
        model.train(was_training)
    return results


def mean_accuracy(results: list[CellResult]) -> float:
    return sum(r.correct for r in results) / sum(r.samples for r in results)


def format_table(results: list[CellResult]) -> str:
    """Rows = lengths, columns = depths, plus row and column means."""
    lengths = list(dict.fromkeys(r.length for r in results))
    depths = list(dict.fromkeys(r.depth for r in results))
    cell = {(r.length, r.depth): r for r in results}
    corner = "length \\ depth"
    header = f"{corner:>14}" + "".join(f"{d:>8.2f}" for d in depths) + f"{'mean':>8}"
    lines = [header]
    for length in lengths:
        row = [cell[length, d] for d in depths]
        lines.append(f"{length:>14}" + "".join(f"{r.accuracy:>8.2f}" for r in row) + f"{mean_accuracy(row):>8.2f}")
    column_means = [mean_accuracy([cell[length, d] for length in lengths]) for d in depths]
    lines.append(f"{'mean':>14}" + "".join(f"{m:>8.2f}" for m in column_means) + f"{mean_accuracy(results):>8.2f}")
    return "\n".join(lines)


def results_json(results: list[CellResult], **meta) -> dict:
    return {
        **meta,
        "metric": "teacher_forced_exact_match",
        "mean_accuracy": mean_accuracy(results),
        "cells": [{**asdict(r), "accuracy": r.accuracy} for r in results],
    }
