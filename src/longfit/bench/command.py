"""`longfit bench memory|cp|gpu|checkpoint-dtype|trl`: side-by-side measurements, one subcommand per benchmark."""

from __future__ import annotations

from longfit.bench import checkpoint_dtype, cp, gpu, memory, trl


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="side-by-side measurements: `longfit bench memory|cp|gpu|checkpoint-dtype|trl --help`",
        description="Side-by-side measurements printed as ratios from one run.",
    )
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="{memory,cp,gpu,checkpoint-dtype,trl}")
    memory.register(benchmarks)
    cp.register(benchmarks)
    gpu.register(benchmarks)
    checkpoint_dtype.register(benchmarks)
    trl.register(benchmarks)
