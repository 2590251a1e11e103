"""Text tables, JSON and the PNG plot of `longfit plan`."""

from __future__ import annotations

from longfit.config import ConfigError
from longfit.plan.result import CATEGORIES, GiB, PlanResult
from longfit.plan.search import best_per_family, family_of, suggest_fix
from longfit.plan.storage import HOST_RESERVE_BYTES, ranks_per_node
from longfit.plan.tiled import layer_tiles, looks_up_first_input


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def tokens(n: int | None) -> str:
    """A length in one unit, K = 1,024 tokens: 131072 -> '128K', 1048576 -> '1,024K', None -> '-'."""
    if not n:
        return "-"
    return f"{n // 1024:,}K" if n % 1024 == 0 else f"{n / 1024:,.1f}K"


def plan_text(result: PlanResult, label: str | None, device_type: str = "cuda") -> str:
    s = result.setup
    rank = "GPU" if device_type == "cuda" else "rank"
    lines = [
        f"{s.shape.name}, seq_len {s.seq_len} ({s.tokens} tokens per {rank}"
        + (f", {s.sequence_tokens} between layers" if s.tp > 1 else "")
        + (f"), {s.world} GPU(s)" if device_type == "cuda" else f"), CPU, {s.world} rank(s)")
        + ": " + (f"pp {s.dims.pp} ({s.config.parallel.pp_schedule}) x " if s.dims.pp > 1 else "")
        + f"dp_shard {s.dp_shard} x cp {s.cp}"
        + (f" ({s.cp_method})" if s.cp > 1 else "")
        + (f" x tp {s.tp}" if s.tp > 1 else "")
        + (f", experts split over ep {s.dims.ep}" if s.dims.ep > 1 else "")
        + f", {'LoRA' if s.lora else 'full fine-tuning'}{' (QLoRA)' if s.qlora else ''}, {s.regime}",
        f"  checkpointed layers {s.checkpointed}/{s.shape.layers}"
        + (f" (tiled: {layer_tiles(s)} sequence tiles)" if s.tiled_layers else "")
        + (", inputs offloaded" if s.offload_activations else "")
        + f"; tiled MLP {'on' if s.tiled_mlp else 'off'}; loss {'chunks of ' + str(s.loss_chunk) + ' tokens' if s.loss_chunk else 'full logits'}"
        + f"; optimizer {s.optimizer}"
        + ("; FSDP2 CPU offload" if s.fsdp_offload else ""),
        *([f"  {result.stages_text()}"] if result.stages else []),
        "",
        f"  per-{rank} peak{'' if device_type == 'cuda' else ' (host memory)'}, at {result.peak_event}"
        + (f" of stage {result.stage.index} (the heaviest)" if result.stage else "") + ":",
    ]
    for name in CATEGORIES:
        value = result.breakdown.get(name, 0)
        lines.append(f"    {name:<16} {value / GiB:9.2f} GiB  {value / result.peak_bytes:6.1%}")
    lines.append(f"    {'total':<16} {result.peak_bytes / GiB:9.2f} GiB")
    lines += storage_lines(result)
    lines += attention_lines(result)
    lines += objective_lines(result)
    lines.append(f"  dominant term: {result.dominant()}")
    if result.capacity is not None:
        verdict = "fits" if result.fits_gpu else "does NOT fit"
        lines.append(f"  {verdict} {label or gib(result.capacity)}: {gib(result.peak_bytes)} of {gib(result.capacity)}")
    for ok, what, need, share in (
        (result.fits_host, "host memory", result.host_bytes, result.host_share),
        (result.fits_disk, "disk", result.disk_bytes, result.disk_share),
    ):
        if share is not None and (need or not ok):
            lines.append(f"  {what}: {'fits' if ok else 'does NOT fit'}, {gib(need)} of {gib(share)} per rank")
    if not result.fits:
        lines.append(f"  {suggest_fix(result)}")
    return "\n".join(lines)


def storage_lines(result: PlanResult) -> list[str]:
    """Where the checkpointed layer inputs go, and the host memory and disk a rank needs (plan/storage.py)."""
    s, lines = result.setup, []
    for plan in result.stages or [result]:
        placement = plan.placement
        if placement is None:
            continue
        stored = f", stored as {s.checkpoint_dtype}" if s.checkpoint_dtype else ""
        in_flight = f" x {placement.in_flight} micro-batch(es) in flight" if plan.stage is not None else ""
        lines.append(
            (f"  stage {plan.stage.index}:" if plan.stage is not None else " ")
            + f" checkpointed layer inputs{' and their kept attention' if s.keep_attention else ''}{in_flight} "
            f"({gib(placement.slot_bytes)} each{stored}): {placement.device} "
            f"kept on the GPU, {placement.host} in host memory, {placement.disk} on disk"
            + (f" ({s.offload_dir})" if placement.disk else "")
            + (f"; the first tiled layer's is {'looked up again' if looks_up_first_input(s) else 'kept on the GPU'}"
               if s.tiled_layers and (plan.stage is None or plan.stage.first) else "")
            + (f"; host {gib(plan.host_bytes)}, disk {gib(plan.disk_bytes)}" if plan.stage is not None else "")
        )
    most = " (the stage needing the most)" if result.stages else ""
    if result.host_bytes or result.host_capacity is not None:
        machine = ""
        if result.host_capacity is not None:
            machine = (f" (machine {gib(result.host_capacity)}, {ranks_per_node(s)} rank(s) on it, "
                       f"{gib(HOST_RESERVE_BYTES)} each kept for the process)")
        lines.append(f"  host memory per rank{most}: {gib(result.host_bytes)}{machine}")
    if result.disk_bytes:
        lines.append(f"  disk per rank{most}: {gib(result.disk_bytes)}")
    return lines


def attention_lines(result: PlanResult) -> list[str]:
    """memory.keep_attention (#53): the choice, its bytes per layer and where they wait, and a step's FLOPs (one row of
    seq_len tokens, longfit.plan.flops) as model FLOPs and what checkpointing recomputes, with the choice taken."""
    s = result.setup
    if not s.checkpointed:
        return []
    from longfit.plan.flops import step_flops
    from longfit.plan.setup import mlp_tiles
    from longfit.plan.storage import attention_item_bytes

    flops = step_flops(s.shape, s.seq_len, s.lora_targets if s.lora else (), s.lora_rank, checkpointed=True,
                       mlp_tiles=mlp_tiles(s) if s.tiled_mlp else 1, keep_attention=s.keep_attention)
    if s.keep_attention:
        placement = result.placement
        where = ("kept on the GPU" if placement is None
                 else "in the offload store beside each layer input (the placement above counts both)")
        choice = f"attention kept through the recompute: {gib(attention_item_bytes(s))} per layer, {where}"
    elif result.kept_attention is not None:
        kept = result.kept_attention
        need = ", ".join(f"{what} {gib(value)}" for ok, what, value in (
            (kept.fits_gpu, "peak", kept.peak_bytes), (kept.fits_host, "host", kept.host_bytes),
            (kept.fits_disk, "disk", kept.disk_bytes)) if not ok)
        choice = (f"attention recomputed in backward: keeping it ({gib(attention_item_bytes(kept.setup))} per layer) "
                  f"does not fit at this length ({need}); memory.keep_attention=auto keeps the longer context")
    else:
        asked = s.config.memory.keep_attention
        why = ("memory.keep_attention=false" if asked is False else "tiled layers recompute it tile by tile"
               if s.tiled_layers else "memory.keep_attention=auto: kept on CUDA where the run fits with it")
        choice = f"attention recomputed in backward ({why})"
    return [f"  {choice}",
            f"  step FLOPs per row: model {flops.model:.3g}, hardware {flops.hardware:.3g} "
            f"(recomputed {flops.hardware - flops.model:.3g}, {flops.hardware / flops.model:.3f} x model)"]


def objective_lines(result: PlanResult) -> list[str]:
    """A preference objective (train.objective, #56): how its rows of pairs are counted, and its reference's cost."""
    s = result.setup
    objective = s.config.train.objective
    if objective == "causal_lm":
        return []
    from longfit.plan.flops import forward_flops

    forward = forward_flops(s.shape, s.seq_len, s.lora_targets if s.lora else (), s.lora_rank)
    lines = [f"  train.objective={objective}: a row of pairs (each prompt once, both answers after it) is counted as a "
             f"packed row of {s.seq_len} tokens, its attention as at most one document of that length"]
    if objective in ("simpo", "orpo"):
        return lines + ["  no reference model"]
    if s.lora:
        return lines + [f"  reference: the weights with the adapter off, a forward without gradient per row before "
                        f"its step ({forward:.3g} FLOPs per row, at most; no activations kept)"]
    return lines + [f"  reference: log-probabilities stored before step 1 (OUTPUT_DIR/reference_logps.safetensors, "
                    f"8 bytes a pair), a forward without gradient over every row of pairs once ({forward:.3g} FLOPs "
                    f"per row, at most; no activations kept, below a step's peak)"]


FSDP_OFFLOAD_MARK = "*"


def _offloads_model_states(result: PlanResult | None) -> bool:
    return result is not None and result.setup.fsdp_offload


def _cell(best: int | None, result: PlanResult | None) -> str:
    """A max-context cell: the length, marked where the plan offloads the model states."""
    return tokens(best) + (FSDP_OFFLOAD_MARK if _offloads_model_states(result) else "")


def max_context_text(table: dict, gpu_counts: list[int], *, every_row: bool = False) -> str:
    """The --max-context table: the best row of each strategy family (`best_per_family`), or `every_row`."""
    shown = table if every_row else best_per_family(table, gpu_counts)
    width = max(len(name) for name in shown) + 2
    which = ("every strategy" if every_row else "the exact variant of each strategy that reaches furthest on the most "
             "GPUs (--all: every variant, with the layer inputs in fp8 too)")
    lines = [f"largest seq_len, in K = 1,024 tokens, by number of GPUs; {which}:", ""]
    lines.append(" " * width + "".join(f"{g:>10}" for g in gpu_counts) + "  GPUs")
    for name, row in shown.items():
        lines.append(f"{name:<{width}}" + "".join(f"{_cell(*row[g]):>10}" for g in gpu_counts))
    lines.append("")
    if any(_offloads_model_states(result) for row in shown.values() for _, result in row.values()):
        lines.append(f"{FSDP_OFFLOAD_MARK} with parallel.cpu_offload=true (FSDP2 keeps the model states in host memory), "
                     "where that reaches further than keeping them on the GPU.")
    lines.append(explain(shown, gpu_counts))
    return "\n".join(lines)


def explain(table: dict, gpu_counts: list[int]) -> str:
    """Why context grows (or not) with GPUs: the dominant term at the longest context of each strategy."""
    few, most = min(gpu_counts), max(gpu_counts)
    sentences = []
    fsdp_rows = [name for name in table if family_of(name) in ("FSDP", "FSDP, LoRA")]
    name = next((n for n in fsdp_rows if table[n][few][0] and table[n][most][0]), None)
    if name and most > few:
        (short, _), (long, at_most) = table[name][few], table[name][most]
        states = sum(at_most.breakdown[k] for k in ("weights", "gradients", "optimizer state"))
        sentences.append(
            f"{name}: {few} -> {most} GPUs takes the context from {tokens(short)} to {tokens(long)} ({long / short - 1:+.0%}). "
            f"FSDP shards only the model states ({gib(states)} per GPU at {most} GPUs); every GPU still holds the "
            f"activations of a whole sequence, and at the limit the peak is dominated by {at_most.dominant()}."
        )
    ring = next((n for n in table if family_of(n) in ("FSDP + ring CP", "FSDP + ring CP, LoRA") and table[n][most][1]), None)
    if ring and most > 1:
        best, result = table[ring][most]
        sentences.append(
            f"{ring}: context parallelism splits the sequence itself (each GPU holds 1/{most} of its tokens), "
            f"{tokens(best)} at {most} GPUs, where the peak is dominated by {result.dominant()}."
        )
    tp = next((n for n in table if family_of(n) in ("FSDP + TP", "FSDP + TP, LoRA") and table[n][most][1]), None)
    if tp and most > 1:
        best, result = table[tp][most]
        sentences.append(
            f"{tp}: tensor parallelism over {result.setup.tp} GPUs splits every weight matrix and, with sequence "
            f"parallelism, the activations between the layers; each GPU still computes attention and the MLP on "
            f"all {tokens(result.setup.tokens)} tokens of its rows, so it reaches {tokens(best)} at {most} GPUs "
            f"(peak dominated by {result.dominant()}). It pays where the model states are the problem; context "
            f"parallelism is what divides a long sequence."
        )
    pipeline = next((n for n in table if family_of(n) in ("PP + FSDP", "PP + FSDP, LoRA") and table[n][most][1]), None)
    if pipeline and most > 1:
        best, result = table[pipeline][most]
        sentences.append(
            f"{pipeline}: {tokens(best)} at {most} GPUs in {result.setup.dims.pp} stages ({result.stages_text()}); "
            f"a pipeline splits the model states and the layers over its stages, but under 1F1B its first stage holds "
            f"the activations of up to one micro-batch per stage (train.grad_accum of them at most)."
        )
    return "\n".join(sentences)


def max_context_json(table: dict, gpu_counts: list[int], capacity: int) -> dict:
    return {
        "capacity_bytes": capacity,
        "gpus": gpu_counts,
        "strategies": {
            name: {
                str(g): {
                    "max_seq_len": row[g][0],
                    "peak_bytes": row[g][1].peak_bytes if row[g][1] else None,
                    "plan": row[g][1].to_dict() if row[g][1] else None,
                }
                for g in gpu_counts
            }
            for name, row in table.items()
        },
    }


def require_matplotlib() -> None:
    """--plot needs matplotlib, an optional dependency."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'longfit[plot]' (or pip install matplotlib)") from e


def plot(curves: dict[str, list[tuple[int, int]]], capacity: int | None, title: str, path: str) -> None:
    """PNG of peak memory per GPU vs context length, one line per strategy."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, points in curves.items():
        if points:
            ax.plot([p[0] for p in points], [p[1] / GiB for p in points], marker=".", label=name)
    if capacity:
        ax.axhline(capacity / GiB, color="black", linestyle="--", linewidth=1, label="GPU memory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
