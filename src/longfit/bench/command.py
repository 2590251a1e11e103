"""`longfit bench memory|cp`: side-by-side measurements; each benchmark parses its own flags."""

from __future__ import annotations

import sys

BENCHMARKS = {
    "memory": "peak memory and step time: plain transformers vs longfit techniques added one by one",
    "cp": "per-rank peak memory and step time for context-parallel degrees 1, 2, 4 (gloo on CPU)",
}


def run_bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: longfit bench {memory,cp} [--help]\n")
        for name, text in BENCHMARKS.items():
            print(f"  {name:8s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "memory":
        from longfit.bench.memory import run_memory_bench

        return run_memory_bench(argv[1:])
    from longfit.bench.cp import run_cp_bench

    return run_cp_bench(argv[1:])


if __name__ == "__main__":
    sys.exit(run_bench(sys.argv[1:]))
