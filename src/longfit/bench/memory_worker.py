"""One `longfit bench memory` measurement: one configuration at one length, in a process of its own.

Run as `python -m longfit.bench.memory_worker SPEC.json RESULT.json` by `longfit.bench.memory`; a fresh
process per (configuration, L) means no allocator state, cached buffer or high-water mark carries over.

The step is a full training step: forward, backward of the mean token loss, AdamW step (lr = 0: the
optimizer does all its arithmetic, but the weights stay the ones every configuration starts from, so
the losses of all configurations and steps are directly comparable), gradients freed.

Memory:
- CPU: peak resident set size during the timed steps above the baseline, the RSS after the model, the
  optimizer and one warm-up step at a short length (so the optimizer state exists and gradients are
  freed). The kernel's high-water mark is reset at the baseline (/proc/self/clear_refs "5") and glibc's
  mmap threshold is pinned to 64 KiB so that freed tensors are returned to the OS instead of a malloc
  arena: the RSS then follows the live tensor bytes.
- CUDA: torch.cuda.max_memory_allocated above torch.cuda.memory_allocated at the same baseline.
The high-water mark is read and reset at the end of each phase (forward with the loss, backward,
optimizer step): the peak is the largest phase peak, and the phase it occurred in is reported.
"total" adds the baseline back (weights, optimizer state, and on CPU the libraries): what must fit.

Time: wall-clock seconds per step, and on CPU also the process's CPU seconds (all threads), which other
processes competing for the cores inflate far less than the wall clock.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import transformers

from longfit.bench.flops import peak_bf16_tflops
from longfit.bench.meter import MemoryMeter, return_freed_memory_to_os

WARMUP_TOKENS = 256

# memory.* switches of each longfit configuration; every technique is set explicitly (no "auto").
LONGFIT_SWITCHES = {
    "lf-ckpt": dict(activation_checkpointing=True, chunked_loss=False, tiled_mlp=False, offload_activations=False, tiled_layers=False),
    "lf-chunked-loss": dict(activation_checkpointing=True, chunked_loss=True, tiled_mlp=False, offload_activations=False, tiled_layers=False),
    "lf-tiled-mlp": dict(activation_checkpointing=True, chunked_loss=True, tiled_mlp=True, offload_activations=False, tiled_layers=False),
    "lf-offload": dict(activation_checkpointing=True, chunked_loss=True, tiled_mlp=True, offload_activations=True, tiled_layers=False),
    # Tiled decoder layers replace checkpointing and the tiled MLP; offload as (b4) on CUDA, none on CPU, where
    # the "host copy" would be a second CPU tensor.
    "lf-tiled-layers": dict(activation_checkpointing=True, chunked_loss=True, tiled_mlp=True, tiled_layers=True),
}
BASELINE = "hf-sdpa"



def single_document_batch(length: int, vocab: int):
    """One row holding one document of random tokens (seeded by its length: the same for every configuration)."""
    from longfit.data.packing import PackedBatch

    g = torch.Generator().manual_seed(length)
    input_ids = torch.randint(0, vocab, (1, length), generator=g)
    labels = torch.roll(input_ids, -1, dims=1)  # already shifted: labels[t] is the target of position t
    labels[:, -1] = -100
    position_ids = torch.arange(length).view(1, length)
    cu_seqlens = torch.tensor([0, length], dtype=torch.int32)
    return PackedBatch(input_ids, labels, position_ids, cu_seqlens, length - 1)


def build_loss_fn(name: str, model: torch.nn.Module, spec: dict, device: torch.device, free_bytes: int | None):
    """(batch -> mean token loss) for configuration `name`, set up on `model` in place; `free_bytes`: the device
    memory free before the model was built, which sizes the loss chunk as in the trainer."""
    if name == BASELINE:
        # What a transformers user writes: sdpa attention, its own gradient checkpointing, and the built-in
        # loss from labels = input_ids (shifted inside the model) over the full (B, L, V) logits.
        model.set_attn_implementation("sdpa")
        non_reentrant = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the newer name; older 5.x only has the other
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
        return lambda batch: model(input_ids=batch.input_ids, labels=batch.input_ids, use_cache=False).loss

    from longfit.config import load_config
    from longfit.memory.apply import apply_memory_techniques
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.memory.switches import resolve_memory_switches
    from longfit.parallel.tiled_attention import LocalTileAttention

    switches = dict(LONGFIT_SWITCHES[name])
    switches.setdefault("offload_activations", device.type == "cuda")
    overrides = [f"model={spec['model']}", f"seq_len={spec['length']}", *spec["overrides"]]
    overrides += [f"memory.{key}={str(value).lower()}" for key, value in switches.items()]
    cfg = load_config(None, overrides)
    applied = apply_memory_techniques(model, cfg, device, tile_attention=LocalTileAttention.for_sequence)
    vocab = model.config.get_text_config().vocab_size
    chunk = resolve_memory_switches(cfg, device.type, vocab, free_bytes).loss_chunk
    loss_module = CausalLMLoss(model, chunked_loss=applied.switches.chunked_loss, loss_chunk=chunk or 0)
    return lambda batch: batch_loss_sum(loss_module, batch) / batch.num_label_tokens


def model_flops_per_step(model: torch.nn.Module, length: int) -> float:
    """Model FLOPs of one forward + backward over one row of `length` tokens (recompute not counted).

    6 N T for the matmul weights N (every parameter but the input embedding, a lookup; with tied
    embeddings the shared matrix counts once, as lm_head) plus causal attention: per layer QK^T and PV
    are 2 x 2 L^2 d_attn FLOPs forward, halved by causality, times 3 for forward + backward:
    6 n_layers d_attn L^2 (d_attn = heads x head_dim, summed layer by layer where head sizes vary by layer),
    the PaLM formula 12 n_layers d_attn L^2 halved.
    """
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    matmul_params = sum(p.numel() for p in model.parameters()) - (0 if tied else embedding.numel())
    from longfit.models.attention import layer_configs, layer_head_shape

    d_attn = sum(heads * head_dim for heads, _, head_dim in map(layer_head_shape, layer_configs(config)))
    attention = 6 * d_attn * length**2
    return 6 * matmul_params * length + attention


def measure(spec: dict) -> dict:
    """Build, warm up and time one configuration at spec["length"]; the result dict of RESULT.json."""
    from longfit.memory.loss import free_device_bytes
    from longfit.memory.optim import build_optimizer, configure_cuda_allocator
    from longfit.models.loading import load_model

    device = torch.device(spec["device"])
    if device.type == "cpu":
        return_freed_memory_to_os()
    else:
        # The same allocator for every configuration (what PyTorch's OOM message advises a transformers user
        # too); it changes reserved, not allocated, bytes, so only whether a length fits at all.
        configure_cuda_allocator()
    free = free_device_bytes(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    model = load_model(spec["model"], dtype=dtype, device=device, seed=spec["seed"])
    model.train()
    loss_fn = build_loss_fn(spec["config"], model, spec, device, free)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, lr=0.0, weight_decay=0.0, kind=spec["optimizer"]) if spec["optimizer"] != "none" else None
    vocab = model.config.get_text_config().vocab_size

    def step(batch, meter: MemoryMeter | None = None) -> tuple[float, dict[str, int]]:
        """One training step; its loss and, with a meter, the peak of each phase above the baseline."""
        peaks = {}

        def phase_done(name: str) -> None:
            if meter is not None:
                peaks[name] = meter.peak()
                meter.reset_peak()

        loss = loss_fn(batch)
        loss_value = loss.item()  # also waits for the device
        phase_done("forward")
        loss.backward()
        phase_done("backward")
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        phase_done("optimizer")
        return loss_value, peaks

    step(single_document_batch(min(WARMUP_TOKENS, spec["length"]), vocab).to(device))
    batch = single_document_batch(spec["length"], vocab).to(device)
    meter = MemoryMeter(device)
    baseline = meter.start()
    wall, cpu, losses, phase_peaks = [], [], [], {}
    for _ in range(spec["steps"]):
        wall_started, cpu_started = time.perf_counter(), time.process_time()
        loss, peaks = step(batch, meter)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall.append(time.perf_counter() - wall_started)
        cpu.append(time.process_time() - cpu_started)
        losses.append(loss)
        for name, value in peaks.items():
            phase_peaks[name] = max(value, phase_peaks.get(name, value))
    peak = max(phase_peaks.values())
    result = dict(
        peak_bytes=peak,
        baseline_bytes=baseline,
        total_bytes=baseline + peak,
        peak_phase=max(phase_peaks, key=phase_peaks.get),
        phase_peak_bytes=phase_peaks,
        step_s=statistics.median(wall),
        step_times_s=wall,
        cpu_s=statistics.median(cpu),
        cpu_times_s=cpu,
        loss=losses[0],
        model_flops=model_flops_per_step(model, spec["length"]),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=transformers.__version__,
    )
    if device.type == "cuda":
        result["device_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
        result["peak_bf16_tflops"] = peak_bf16_tflops(result["device_name"])
    return result


def main(argv: list[str]) -> int:
    spec_path, result_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = measure(spec)
    except torch.OutOfMemoryError as e:
        result = dict(error=f"out of memory: {str(e).splitlines()[0]}", oom=True)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
