"""Tables (text and markdown) and the plot of `longfit bench memory`, from the measured rows."""

from __future__ import annotations

import argparse
import math
import platform
from pathlib import Path

# The configurations `longfit bench memory` compares, in order, and their labels in tables and plots.
CONFIG_LABELS = {
    "hf-sdpa": "(a) transformers sdpa + GC",
    "lf-ckpt": "(b1) longfit attn + ckpt",
    "lf-chunked-loss": "(b2) + chunked loss",
    "lf-tiled-mlp": "(b3) + tiled MLP",
    "lf-offload": "(b4) + offload",
    "lf-tiled-layers": "(b5) tiled layers",
}

GiB = 2**30


def loss_agreement(rows: list[dict]) -> float | None:
    """max |loss - loss(a)| over the runs with a baseline at their length (NaN counts as infinite)."""
    diffs = [r["loss_diff"] for r in rows if "loss_diff" in r and r["config"] != "hf-sdpa"]
    return max((math.inf if math.isnan(d) else d for d in diffs), default=None)


def _ratio(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "n/a"


def _measurement_cells(rows: list[dict], device: str) -> tuple[list[str], list[list[str]]]:
    with_mfu = any(r.get("mfu") is not None for r in rows)
    with_cpu = device == "cpu"
    header = ["configuration", "L", "peak (GiB)", "peak in", "peak / (a)", "total (GiB)", "total / (a)", "step (s)",
              "step / (a)", *(["step CPU (s)", "CPU / (a)"] if with_cpu else []), "tokens/s", "model TFLOP/s",
              *(["MFU"] if with_mfu else []), "loss", "abs(loss - (a))"]
    cells = []
    for r in rows:
        label = CONFIG_LABELS[r["config"]]
        if "error" in r:
            cells.append([label, str(r["length"]), "failed: " + r["error"].splitlines()[0], *[""] * (len(header) - 3)])
            continue
        mfu = [f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"] if with_mfu else []
        cpu = [f"{r['cpu_s']:.2f}", _ratio(r, "cpu_ratio")] if with_cpu else []
        diff = f"{r['loss_diff']:.2e}" if "loss_diff" in r else "n/a"
        cells.append([
            label, str(r["length"]), f"{r['peak_bytes'] / GiB:.3f}", r["peak_phase"], _ratio(r, "memory_ratio"),
            f"{r['total_bytes'] / GiB:.3f}", _ratio(r, "total_ratio"), f"{r['step_s']:.2f}", _ratio(r, "time_ratio"),
            *cpu, f"{r['tokens_per_s']:.0f}", f"{r['model_tflops']:.3f}", *mfu, f"{r['loss']:.6f}", diff,
        ])
    return header, cells


def _largest_cells(largest: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["configuration", "largest L within budget", "how", "fit: total GiB = a + b x L/1K", "max fit error"]
    cells = []
    for entry in largest:
        line = entry["line"]
        fit = f"{line[0] / GiB:.3f} + {line[1] * 1024 / GiB:.4f} x L/1K" if line else "n/a"
        error = f"{entry['fit_error']:.1%}" if "fit_error" in entry else "n/a"
        found = str(entry["largest"]) if entry["largest"] else "none"
        cells.append([CONFIG_LABELS[entry["config"]], found, entry["how"], fit, error])
    return header, cells


def _summary_lines(rows: list[dict], largest: list[dict], args: argparse.Namespace) -> list[str]:
    lines = []
    agreement = loss_agreement(rows)
    if agreement is not None:
        lines.append(f"Loss agreement with (a): max |loss - loss(a)| = {agreement:.2e} over every longfit run "
                     f"(same weights, same batch; {args.dtype}).")
    longest = max((r["length"] for r in rows if "memory_ratio" in r), default=None)
    for r in rows:
        if r["length"] == longest and r["config"] != "hf-sdpa" and "memory_ratio" in r:
            cpu = f", step CPU time {r['cpu_ratio']:.2f} x (a)" if args.device == "cpu" else ""
            lines.append(f"At L={longest}, {CONFIG_LABELS[r['config']]}: peak {r['memory_ratio']:.3f} x (a) "
                         f"(= 1/{1 / r['memory_ratio']:.2f}), total {r['total_ratio']:.3f} x (a), "
                         f"step time {r['time_ratio']:.2f} x (a){cpu}.")
    return lines


def _text(header: list[str], cells: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, cells)])


def _markdown(header: list[str], cells: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
                      *("| " + " | ".join(row) + " |" for row in cells)])


def text_table(rows: list[dict], largest: list[dict], args: argparse.Namespace) -> str:
    """The stdout report: measurements with ratios against (a), the largest L within the budget, a summary."""
    return "\n".join([
        "", _text(*_measurement_cells(rows, args.device)), "",
        f"Largest L with total peak <= {args.budget_bytes / GiB:.2f} GiB:", _text(*_largest_cells(largest)), "",
        *_summary_lines(rows, largest, args),
    ])


def markdown_report(rows: list[dict], largest: list[dict], args: argparse.Namespace, command: str) -> str:
    """memory.md: the command, the setup, what each column means, both tables and the summary."""
    ok = [r for r in rows if "error" not in r]
    device = ok[0]["device_name"] if ok else args.device
    threads = f", {ok[0]['threads']} torch threads" if ok else ""
    memory_kind = ("peak RSS above the baseline RSS" if args.device == "cpu"
                   else "torch.cuda.max_memory_allocated above memory_allocated at the baseline")
    versions = f"torch {ok[0]['torch']}, transformers {ok[0]['transformers']}" if ok else ""
    return "\n".join([
        f"# longfit bench memory: {args.model}, {args.device}, {args.dtype}",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {device}{threads}; {versions}; Python {platform.python_version()}; {platform.machine()}.",
        "",
        f"Each (configuration, L) ran in a fresh process: model built (seed {args.seed}), optimizer "
        f"`{args.optimizer}` (lr 0: the weights stay the same, so every loss is comparable), one warm-up step "
        f"at a short length, then {args.steps} timed step(s) of one L-token document (forward, backward, "
        f"optimizer step, gradients freed). "
        f"**peak** = {memory_kind} during the timed steps; the baseline holds the weights and the optimizer "
        f"state (the same in every configuration), so peak = gradients + activations + loss + transients. "
        "**peak in** = the phase holding the peak (forward includes the loss). "
        f"**total** = baseline + peak (the budget is compared with it). **step** = median wall-clock step time"
        + ("; **step CPU** = median CPU seconds of the process (all threads), far less sensitive than the wall "
           "clock to other processes competing for the cores. " if args.device == "cpu" else ". ")
        + "Ratios are against (a) at the same L. Model TFLOP/s counts 6 x matmul parameters x tokens + "
        "6 x layers x attention width x L^2 (causal attention, forward + backward, no recompute)"
        + ("; MFU divides it by the device peak." if any(r.get("mfu") is not None for r in ok) else "."),
        "",
        _markdown(*_measurement_cells(rows, args.device)),
        "",
        f"Largest L with total peak <= {args.budget_bytes / GiB:.2f} GiB "
        + ("(found by real runs, `--search`):" if args.search else
           "(from the least-squares line through the measured totals; 'extrapolated' = beyond the measured lengths):"),
        "",
        _markdown(*_largest_cells(largest)),
        "",
        *(f"- {line}" for line in _summary_lines(rows, largest, args)),
        "",
    ])


def plot_report(rows: list[dict], largest: list[dict], args: argparse.Namespace, path: Path) -> None:
    """memory.png: peak memory vs L and step time vs L (on CPU: CPU seconds), one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # On a CPU shared with other processes the wall clock mostly measures them; CPU seconds measure the step.
    time_key, time_label = ("cpu_s", "step CPU time (s, all threads)") if args.device == "cpu" else ("step_s", "step time (s)")
    fig, (memory_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in CONFIG_LABELS:
        points = sorted((r["length"], r["peak_bytes"] / GiB, r[time_key]) for r in rows
                        if r["config"] == config and "error" not in r)
        if not points:
            continue
        lengths = [p[0] for p in points]
        memory_ax.plot(lengths, [p[1] for p in points], marker="o", label=CONFIG_LABELS[config])
        time_ax.plot(lengths, [p[2] for p in points], marker="o", label=CONFIG_LABELS[config])
    for ax, ylabel in ((memory_ax, "peak above baseline (GiB)"), (time_ax, time_label)):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    memory_ax.legend(fontsize=8)
    fig.suptitle(f"longfit bench memory: {args.model}, {args.device}, {args.dtype}, optimizer {args.optimizer}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
