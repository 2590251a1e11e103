"""`longfit bench memory|cp|gpu`: side-by-side measurements, one subcommand per benchmark."""

from __future__ import annotations

from longfit.bench import cp, gpu, memory


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="side-by-side measurements: `longfit bench memory|cp|gpu --help`",
        description="Side-by-side measurements printed as ratios from one run.",
    )
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="{memory,cp,gpu}")
    memory.register(benchmarks)
    cp.register(benchmarks)
    gpu.register(benchmarks)
