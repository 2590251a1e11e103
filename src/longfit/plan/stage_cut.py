"""The pipeline stage cut whose heaviest stage is lightest: consecutive stage sizes from each stage's planned peak.

A stage's peak is not a sum of per-layer costs: it is the largest event of its step (plan/analytic.py), and its
layers differ (Gemma 3's sliding and global layers, MoE and dense layers, linear and softmax attention), the first
stage holds the embeddings and, under 1F1B, the most micro-batches in flight, the last the final norm, lm_head and
the loss. What holds for every stage is that its peak grows with the layers it holds. So for k stages over the first
j layers, the lightest heaviest peak is

    best(k, j) = min over i of max(best(k - 1, i), peak(stage k - 1 holding layers i .. j - 1))

whose first term grows with i and whose second shrinks: the minimum is where they cross, found by bisection. Exact
under that monotonicity, with O(stages x layers x log layers) stage plans at most (each memoised).
"""

from __future__ import annotations

import functools
from collections.abc import Callable


def balanced_cut(layers: int, stages: int, peak: Callable[[int, range], float]) -> list[int]:
    """Decoder layers per stage, first to last (each at least one, summing to `layers`), that minimise the largest
    `peak(stage index, its layers)`."""
    if not 1 <= stages <= layers:
        raise ValueError(f"{stages} stages of at least one of {layers} layers")
    stage_peak = functools.cache(lambda index, start, end: peak(index, range(start, end)))

    @functools.cache
    def best(k: int, j: int) -> tuple[float, int]:
        """(the lightest heaviest peak of layers 0 .. j - 1 in stages 0 .. k - 1, where stage k - 1 starts)."""
        if k == 1:
            return stage_peak(0, 0, j), 0
        lo, hi = k - 1, j - 1  # stage k - 1 starts at i in [lo, hi]: every stage keeps a layer
        while lo < hi:  # the first i where the earlier stages weigh at least as much as stage k - 1
            mid = (lo + hi) // 2
            if best(k - 1, mid)[0] >= stage_peak(k - 1, mid, j):
                hi = mid
            else:
                lo = mid + 1
        candidates = [i for i in (lo - 1, lo) if k - 1 <= i <= j - 1]
        return min((max(best(k - 1, i)[0], stage_peak(k - 1, i, j)), i) for i in candidates)

    sizes, end = [], layers
    for k in range(stages, 0, -1):
        start = best(k, end)[1]
        sizes.append(end - start)
        end = start
    return sizes[::-1]
