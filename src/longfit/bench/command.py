"""`longfit bench memory|cp|media|gpu|checkpoint-dtype|keep-attention|trl`: side-by-side measurements, one subcommand per benchmark."""

from __future__ import annotations

from longfit.bench import checkpoint_dtype, cp, gpu, keep_attention, media, memory, trl


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="side-by-side measurements: `longfit bench memory|cp|media|gpu|checkpoint-dtype|keep-attention|trl --help`",
        description="Side-by-side measurements printed as ratios from one run.",
    )
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="{memory,cp,media,gpu,checkpoint-dtype,keep-attention,trl}")
    memory.register(benchmarks)
    cp.register(benchmarks)
    media.register(benchmarks)
    gpu.register(benchmarks)
    checkpoint_dtype.register(benchmarks)
    keep_attention.register(benchmarks)
    trl.register(benchmarks)
