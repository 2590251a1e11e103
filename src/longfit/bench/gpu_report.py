"""The numbers `longfit bench gpu` derives from its measured rows, its goals, and its tables (text and markdown)."""

from __future__ import annotations

import itertools
import platform

GiB = 2**30
SYSTEM_LABELS = {  # in table order
    "plain": "transformers sdpa + GC",
    "longfit": "longfit, all techniques",
    "longfit-no-offload": "longfit without offload",
    "longfit-host": "longfit, layer inputs in host memory",
    "longfit-kept": "longfit, attention kept",
    "longfit-recomputed": "longfit, attention recomputed",
}
KIND_LABELS = {"full": "full", "lora": "LoRA"}
TIME_GOAL_LENGTH = 32768
TIME_GOAL_RATIO = 1.10
PLAN_GOAL = 0.05
# (model, fine-tuning kind, length, least model MFU): the goals for the default models
MFU_GOALS = (("llama-3.2-1b", "full", 65536, 0.35), ("llama-3.1-8b", "lora", 131072, 0.40))
OFFLOAD_GOAL = 0.10  # issue 46: the offload store adds at most this share of a step where the inputs are on the host


def _row(outcome, peak_tflops: float | None) -> dict:
    row = outcome.row
    entry = dict(model=row.model, kind=row.kind, system=row.system, length=row.length, longest=row.longest,
                 status=outcome.status, detail=outcome.detail, wall_s=outcome.wall_s, **outcome.result)
    if outcome.status != "ok":
        return entry
    entry.update(tokens_per_s=row.length / entry["step_s"], model_tflops=entry["model_flops"] / entry["step_s"] / 1e12)
    if peak_tflops:
        entry["mfu"] = entry["model_tflops"] / peak_tflops
        entry["hfu"] = entry["hardware_flops"] / entry["step_s"] / 1e12 / peak_tflops
    for key, plan in (("peak_vs_analytic", "planned_bytes"), ("peak_vs_traced", "traced_bytes")):
        if entry.get(plan):
            entry[key] = entry["peak_bytes"] / entry[plan]
    entry["attention"] = ", ".join(entry["kernels"]) or f"{entry.get('predicted_kernel', 'unknown')} (predicted)"
    return entry


def derive(outcomes: list, device: dict) -> dict:
    """The report: every row with its derived numbers, the offload cost per length, the goals."""
    from longfit.bench.flops import peak_bf16_tflops

    peak_tflops = peak_bf16_tflops(device["device_name"]) if device.get("device_type") == "cuda" else None
    order = {name: i for i, name in enumerate(SYSTEM_LABELS)}
    runs = sorted(outcomes, key=lambda o: (o.row.model, o.row.kind, o.row.length, order[o.row.system]))
    rows = [_row(o, peak_tflops) for o in runs]
    ok = {(r["model"], r["kind"], r["system"], r["length"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        plain = ok.get((r["model"], r["kind"], "plain", r["length"]))
        if r["status"] == "ok" and plain is not None and r["system"] != "plain":
            r["time_vs_plain"] = r["step_s"] / plain["step_s"]
            r["loss_diff"] = abs(r["loss"] - plain["loss"])
    offload = []
    for (model, kind, system, length), r in ok.items():
        without = ok.get((model, kind, "longfit-no-offload", length))
        if system in ("longfit", "longfit-host") and without is not None:
            added = r["step_s"] - without["step_s"]
            offload.append(dict(model=model, kind=kind, length=length, with_s=r["step_s"], without_s=without["step_s"],
                                added_s=added, added_fraction=added / without["step_s"], placement=r.get("placement"),
                                cached_with_bytes=_cached(r), cached_without_bytes=_cached(without)))
    kept = []
    for (model, kind, system, length), r in ok.items():
        recomputed = ok.get((model, kind, "longfit-recomputed", length))
        if system == "longfit-kept" and recomputed is not None:
            kept.append(dict(model=model, kind=kind, length=length, kept=r, recomputed=recomputed,
                             time_ratio=r["step_s"] / recomputed["step_s"]))
    return dict(rows=rows, offload=offload, kept_attention=kept, goals=_goals(rows, ok, offload),
                peak_bf16_tflops=peak_tflops)


def _cached(row: dict) -> int | None:
    """Bytes the CUDA allocator held above the live tensors at its peaks (reserved - allocated); None off CUDA."""
    reserved = row.get("peak_reserved_bytes")
    return None if reserved is None else reserved - row["peak_bytes"]


def _worst_plan_goals(rows: list[dict]) -> list[dict]:
    goals = []
    for key, label in (("peak_vs_analytic", "analytic"), ("peak_vs_traced", "traced")):
        planned = [r for r in rows if key in r]
        if planned:
            worst = max(planned, key=lambda r: abs(r[key] - 1))
            goals.append(dict(
                goal=f"measured peak within {PLAN_GOAL:.0%} of the {label} plan at every length ({len(planned)} rows)",
                value=f"worst {worst[key] - 1:+.1%} ({worst['model']} {worst['kind']} {worst['system']} at {worst['length']})",
                met=abs(worst[key] - 1) <= PLAN_GOAL))
    return goals


def _goals(rows: list[dict], ok: dict, offload: list[dict]) -> list[dict]:
    goals = []
    for r in rows:
        if r["system"] == "longfit" and r["length"] == TIME_GOAL_LENGTH and "time_vs_plain" in r:
            goals.append(dict(goal=f"step time <= {TIME_GOAL_RATIO:.2f} x plain at {TIME_GOAL_LENGTH}: {r['model']} {r['kind']}",
                              value=f"{r['time_vs_plain']:.2f} x", met=r["time_vs_plain"] <= TIME_GOAL_RATIO))
    for (model, kind, length, least), system in itertools.product(MFU_GOALS, ("longfit", "longfit-kept")):
        r = ok.get((model, kind, system, length))
        if r is not None and "mfu" in r:
            goals.append(dict(goal=f"model MFU >= {least:.0%}: {model} {kind} at {length}"
                              + ("" if system == "longfit" else f" ({SYSTEM_LABELS[system]})"),
                              value=f"{r['mfu']:.1%}", met=r["mfu"] >= least))
    for o in offload:
        if o["placement"] and o["placement"]["host"] + o["placement"]["disk"] > 0:
            goals.append(dict(
                goal=f"the offload store adds <= {OFFLOAD_GOAL:.0%} of the step with layer inputs off the GPU: "
                     f"{o['model']} {o['kind']} at {o['length']} ({_placement(o['placement'])})",
                value=f"{o['added_fraction']:+.1%}", met=o["added_fraction"] <= OFFLOAD_GOAL))
    return goals + _worst_plan_goals(rows)


def _gib(value) -> str:
    return f"{value / GiB:.2f}" if value else "n/a"


def _ratio(row: dict, key: str, fmt: str = "{:.3f}") -> str:
    return fmt.format(row[key]) if key in row else "n/a"


HEADER = ["model", "fine-tune", "system", "L", "layer inputs GPU / host / disk", "peak (GiB)", "reserved (GiB)", "plan (GiB)", "peak / plan", "traced (GiB)",
          "peak / traced", "step (s)", "step / plain", "tokens/s", "model TFLOP/s", "MFU", "HFU", "attention kernel",
          "attention kept", "host GiB moved / step", "loss chunk, MLP tiles", "loss", "abs(loss - plain)"]


def _cells(r: dict) -> list[str]:
    label = SYSTEM_LABELS[r["system"]] + (" (longest)" if r["longest"] else "")
    head = [r["model"], KIND_LABELS[r["kind"]], label, str(r["length"])]
    if r["status"] != "ok":
        return head + [f"{r['status']}: {r['detail']}"] + [""] * (len(HEADER) - 5)
    traced = _gib(r.get("traced_bytes")) if "trace_error" not in r else "not traced"
    return head + [
        _placement(r.get("placement")), _gib(r["peak_bytes"]), _gib(r.get("peak_reserved_bytes")), _gib(r.get("planned_bytes")), _ratio(r, "peak_vs_analytic"), traced,
        _ratio(r, "peak_vs_traced"), f"{r['step_s']:.2f}", _ratio(r, "time_vs_plain"), f"{r['tokens_per_s']:.0f}",
        f"{r['model_tflops']:.3g}", _ratio(r, "mfu", "{:.1%}"), _ratio(r, "hfu", "{:.1%}"), r["attention"],
        _kept(r), _moved(r.get("host_bytes_moved")),
        f"{r['loss_chunk']}, {r['mlp_tiles']}" if "loss_chunk" in r else "n/a", f"{r['loss']:.6f}",
        _ratio(r, "loss_diff", "{:.2e}"),
    ]


def _offload_cells(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["model", "fine-tune", "L", "layer inputs on GPU / host / disk", "step with offload (s)", "without (s)",
              "offload adds (s)", "adds (% of step)", "reserved - peak with offload (GiB)", "without (GiB)"]
    cells = [[o["model"], KIND_LABELS[o["kind"]], str(o["length"]), _placement(o.get("placement")),
              f"{o['with_s']:.2f}", f"{o['without_s']:.2f}",
              f"{o['added_s']:+.2f}", f"{o['added_fraction']:+.1%}", _gib(o.get("cached_with_bytes")),
              _gib(o.get("cached_without_bytes"))] for o in report["offload"]]
    return header, cells


def _moved(value: int | None) -> str:
    """Bytes the offload store moved (0 where every item stayed on the GPU); n/a without a store."""
    return "n/a" if value is None else f"{value / GiB:.2f}"


def _kept(r: dict) -> str:
    """Whether the row's checkpointed layers kept attention through their recompute (memory.keep_attention, #53)."""
    if "keep_attention" not in r:
        return "n/a"
    return "yes" if r["keep_attention"] else "no (tiled layers)" if r.get("tiled_layers") else "no"


def _kept_cells(report: dict) -> tuple[list[str], list[list[str]]]:
    header = ["model", "fine-tune", "L", "step kept / recomputed (s)", "kept / recomputed", "MFU kept / recomputed",
              "HFU kept / recomputed", "peak kept / recomputed (GiB)", "plan kept / recomputed (GiB)",
              "host GiB moved / step, kept / recomputed"]

    def pair(row_kept: dict, row_recomputed: dict, key: str, cell) -> str:
        return " / ".join(cell(r[key]) if key in r else "n/a" for r in (row_kept, row_recomputed))

    cells = [[o["model"], KIND_LABELS[o["kind"]], str(o["length"]),
              pair(o["kept"], o["recomputed"], "step_s", "{:.2f}".format), f"{o['time_ratio']:.3f}",
              pair(o["kept"], o["recomputed"], "mfu", "{:.1%}".format),
              pair(o["kept"], o["recomputed"], "hfu", "{:.1%}".format),
              pair(o["kept"], o["recomputed"], "peak_bytes", _gib),
              pair(o["kept"], o["recomputed"], "planned_bytes", _gib),
              pair(o["kept"], o["recomputed"], "host_bytes_moved", _moved)] for o in report["kept_attention"]]
    return header, cells


def _placement(placement: dict | None) -> str:
    return "n/a" if placement is None else f"{placement['device']} / {placement['host']} / {placement['disk']}"


def _markdown(header: list[str], cells: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
                      *("| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells)])


def _text(header: list[str], cells: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in [header, ["-" * w for w in widths], *cells])


def _goal_lines(report: dict) -> list[str]:
    return [f"{g['goal']}: {g['value']} ({'met' if g['met'] else 'not met'})" for g in report["goals"]]


def text_table(report: dict) -> str:
    return "\n".join(["", _text(HEADER, [_cells(r) for r in report["rows"]]), "", _text(*_offload_cells(report)), "",
                      _text(*_kept_cells(report)), "", *_goal_lines(report)])


def markdown_report(report: dict) -> str:
    device = report["device"]
    cuda = device["device_type"] == "cuda"
    if cuda:
        hardware = (f"{device['device_name']}, {device['total_bytes'] / GiB:.1f} GiB, CUDA {device['cuda']}, "
                    f"cuDNN {device['cudnn']}")
    else:
        hardware = f"CPU ({platform.machine()}, {device['threads']} torch threads)"
    peak = report["peak_bf16_tflops"]
    return "\n".join([
        f"# longfit bench gpu: {device['device_name']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Date: {report['date']}. Device: {hardware}. torch {device['torch']}, transformers {device['transformers']}, "
        f"Python {platform.python_version()}. Time: {report['elapsed_s']:.0f} s of a {report['time_budget_s']:.0f} s budget.",
        "",
        "Each row is one process: the model built (the same weights for both systems), one warm-up step at L, "
        "then the timed step(s) of one L-token document: forward, backward, gradient clipping, AdamW at lr 0 "
        "(so every loss is the loss of the same weights). **plain**: transformers with sdpa, its own gradient "
        "checkpointing and full logits (peft for LoRA)"
        + ("; fp32 weights under bf16 autocast (a LoRA base in bf16), as the Trainer with bf16. " if cuda
           else "; fp32 throughout. ")
        + "**longfit**: the trainer's own step with activation checkpointing, chunked loss, tiled MLP and, "
        "unless said otherwise, the offload store for the checkpointed layer inputs (each on the GPU where the "
        "analytic plan finds room for it, then host memory, as the trainer places them; **layer inputs**: how many "
        "it kept on the GPU, in host memory and on disk; *layer inputs in host memory*: planned for a GPU without "
        "room for them, so all of them in host memory). **peak**: "
        + ("`torch.cuda.max_memory_allocated` over the timed steps (every live tensor)" if cuda
           else "peak RSS above the RSS before the model existed (libraries and allocator included)")
        + "; **reserved**: `torch.cuda.max_memory_reserved` over the same steps (the caching allocator's blocks)"
        + "; **plan**: the analytic plan's tensor peak (`longfit plan`) from the memory free before the row built "
        "anything, as the trainer's preflight; **traced**: the same step traced on fake tensors (`longfit plan "
        "--trace`). **step**: median wall-clock seconds of the timed steps. **model TFLOP/s** counts the step's "
        "own FLOPs (6 per weight and token for trained weights, 4 for frozen ones, causal attention; "
        "`longfit.plan.flops`); **MFU** divides them by the device's dense bf16 peak"
        + (f" ({peak:.0f} TFLOP/s)" if peak else " (unknown for this device: not shown)")
        + ", **HFU** adds the recomputation (checkpointing, MLP tiles; attention's forward again unless the layers "
        "keep it). **attention kernel**: the attention operators the profiler saw in the warm-up step. **attention "
        "kept**: whether the checkpointed layers kept attention's output through their recompute "
        "(memory.keep_attention, #53; *attention kept / recomputed* rows: whole layers, forced on / off); **host GiB "
        "moved / step**: what the offload store copied off the GPU and back in a timed step. A row that ran out of "
        "memory or did not fit in the time budget says so.",
        "",
        _markdown(HEADER, [_cells(r) for r in report["rows"]]),
        "",
        "What the offload store adds to the step (longfit with and without it; the inputs it kept on the GPU, "
        "moved to host memory and to disk):",
        "",
        _markdown(*_offload_cells(report)),
        "",
        "What keeping attention through the recompute changes (#53; whole layers, attention kept and recomputed):",
        "",
        _markdown(*_kept_cells(report)),
        "",
        "Goals (issues #10 and #46), from the rows above:",
        "",
        *(f"- {line}" for line in _goal_lines(report)),
        "",
    ])
