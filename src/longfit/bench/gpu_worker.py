"""One `longfit bench gpu` row in a process of its own: a system (plain transformers or longfit) at one length.

Run as `python -m longfit.bench.gpu_worker MODE SPEC.json RESULT.json` by `longfit.bench.gpu`, MODE one of
- `probe`: the device, its memory and the library versions (no model);
- `measure`: build the row's model, run one warm-up step at the row's length under the profiler (which
  attention kernel ran), then the timed steps; peak memory, step time, loss;
- `trace`: the traced plan of a longfit row (`longfit.plan.trace`, fake tensors on the CPU), from the memory
  the measured row found free.

The two systems train the same weights (a preset's seeded initialisation or a local model's safetensors,
loaded by longfit for both) on the same one-document row, with the same AdamW at lr 0 (it does all its
arithmetic but leaves the weights as they were, so every loss is comparable) and gradient clipping at 1.0:
- plain: what a transformers user writes, as the Trainer does with bf16: fp32 weights under bf16 autocast
  (LoRA: a bf16 base and peft's fp32 adapters), sdpa attention, transformers' own gradient checkpointing
  (non-reentrant), `model(input_ids, labels=input_ids).loss` over the full logits;
- longfit: the trainer's path on one device: `build_model`, `CausalLMLoss` with the planned loss chunk,
  `parallelize` (every memory technique as the row sets it), the trainer's autocast. Its analytic plan is
  computed here, from the memory free before anything was built, as the trainer's preflight does, and its
  placement of the offloaded layer inputs (on the GPU where they fit) is the one the row runs and traces; a
  longfit-host row (`inputs_on_host`) is planned for a GPU with no room for them: every one in host memory.
Peak memory: CUDA `max_memory_allocated` over the timed steps (every live tensor: weights, optimizer state,
gradients, activations -- what the plan predicts), and `max_memory_reserved` (what the caching allocator held:
the offload store's side-stream copies are cached in that stream's own blocks, issue #33 item 6); CPU the peak
RSS above the RSS before the model existed.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

STARTED = time.perf_counter()


def _device_info(device) -> dict:
    import torch
    import transformers

    info = dict(device_type=device.type, torch=torch.__version__, transformers=transformers.__version__)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        info.update(device_name=torch.cuda.get_device_name(device), total_bytes=total, free_bytes=free,
                    cudnn=torch.backends.cudnn.version(), cuda=torch.version.cuda)
    else:
        info.update(device_name="cpu", threads=torch.get_num_threads())
    return info


def _row_config(spec: dict):
    from longfit.config import load_config

    return load_config(None, [f"model={spec['model']}", f"seq_len={spec['length']}", f"train.seed={spec['seed']}",
                              *spec["overrides"]])


def _plain(cfg, device, dtype):
    """(loss of a batch, trainable parameters) of plain transformers (+ peft) on the run's weights."""
    import torch

    from longfit.models.build import lora_config
    from longfit.models.loading import load_model

    model = load_model(cfg.model, dtype=dtype if cfg.lora.enabled else torch.float32, device=device, seed=cfg.train.seed)
    model.set_attn_implementation("sdpa")
    non_reentrant = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name; older 5.x only has the other
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
    if cfg.lora.enabled:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(cfg))
    model.train()

    def loss(batch):
        return model(input_ids=batch.input_ids, labels=batch.input_ids, use_cache=False).loss

    return model, loss


def _longfit(cfg, setup, device, dtype, placement):
    """(the trainer's loss module, the mean loss of a batch) on one device, the offload store's layer inputs where
    the analytic plan's `placement` puts them (as the trainer runs them)."""
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.models.build import build_model
    from longfit.parallel.parallelize import parallelize

    model = build_model(cfg, dtype, device, setup.dims.fsdp_enabled)
    loss_module = CausalLMLoss(model, chunked_loss=cfg.memory.chunked_loss, loss_chunk=setup.loss_chunk or 0)
    loss_module = parallelize(loss_module, setup.dims, cfg, setup.dims.build_mesh(device.type), param_dtype=dtype,
                              device=device, checkpoint_placement=placement)
    loss_module.train()
    return loss_module, lambda batch: batch_loss_sum(loss_module, batch) / batch.num_label_tokens


def _phase(text: str) -> None:
    """Where a row is, on stderr: a row killed at the time budget names the last one reached (bench.gpu.run_worker)."""
    print(f"longfit-bench: {text}", file=sys.stderr, flush=True)


def measure(spec: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from longfit.bench.memory_worker import single_document_batch
    from longfit.bench.meter import MemoryMeter, return_freed_memory_to_os
    from longfit.memory.apply import offloaders
    from longfit.memory.loss import free_device_bytes
    from longfit.memory.optim import build_optimizer, configure_cuda_allocator
    from longfit.models.attention import attention_kernel_name, attention_sink_layers, kernels_in_profile
    from longfit.models.loading import compute_dtype
    from longfit.models.structure import unwrap_peft
    from longfit.parallel.parallelize import autocast_dtype
    from longfit.plan.analytic import plan_setup
    from longfit.plan.setup import mlp_tiles, resolve

    device = torch.device(spec["device"])
    if device.type == "cuda":
        configure_cuda_allocator()  # what the trainer sets, for both systems (only whether a length fits changes)
    else:
        return_freed_memory_to_os()
    meter = MemoryMeter(device)
    meter.start()  # before anything is built: nothing allocated on CUDA; on CPU the peak is above this RSS
    free = free_device_bytes(device)
    cfg = _row_config(spec)
    setup = resolve(cfg, 1, device.type, free)
    dtype = compute_dtype(cfg.train.dtype, device)
    result = dict(free_at_start_bytes=free)
    if spec["system"] == "longfit":
        # longfit-host rows: planned for a GPU with no room for the layer inputs, which the plan puts in host memory
        capacity = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
        capacity = 0 if spec.get("inputs_on_host") else capacity
        plan = plan_setup(setup, capacity)
        module, loss_fn = _longfit(cfg, setup, device, dtype, plan.placement)
        autocast = autocast_dtype(setup.dims, dtype)
        text = unwrap_peft(module.model).config.get_text_config()
        result.update(planned_bytes=plan.tensor_bytes, planned_event=plan.peak_event, loss_chunk=setup.loss_chunk,
                      mlp_tiles=mlp_tiles(setup) if setup.tiled_mlp else 1, offload=setup.offload_activations,
                      keep_attention=setup.keep_attention, tiled_layers=setup.tiled_layers,
                      placement=None if plan.placement is None else dataclasses.asdict(plan.placement),
                      predicted_kernel=attention_kernel_name(text, device, dtype,
                                                             sink_layers=attention_sink_layers(module.model)))
    else:
        module, loss_fn = _plain(cfg, device, dtype)
        autocast = None if dtype == torch.float32 else dtype
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, lr=0.0, weight_decay=0.0, kind=cfg.memory.optimizer)
    batch = single_document_batch(spec["length"], setup.shape.vocab).to(device)
    _phase(f"model built in {time.perf_counter() - STARTED:.0f} s")

    def step() -> float:
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = loss_fn(batch)
        value = loss.item()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return value

    result["setup_s"] = time.perf_counter() - STARTED
    _phase(f"set up in {result['setup_s']:.0f} s, warm-up step started")
    warm_started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()  # the warm-up: kernels' plans, allocator segments, pinned host buffers, optimizer state
    result["warmup_s"] = time.perf_counter() - warm_started
    _phase(f"set up in {result['setup_s']:.0f} s, warm-up step {result['warmup_s']:.0f} s, timed steps started")
    result["kernels"] = kernels_in_profile(prof.events())
    del prof
    meter.reset_peak()
    stores = offloaders(module.model) if spec["system"] == "longfit" else []
    moved_before = sum(o.stats.offloaded_bytes + o.stats.reloaded_bytes for o in stores)
    times, losses = [], []
    for _ in range(spec["steps"]):
        started = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - started)
    result.update(peak_bytes=meter.peak(), peak_reserved_bytes=meter.peak_reserved(), step_s=statistics.median(times), step_times_s=times, loss=losses[0])
    if stores:  # what the offload store copied off the device and back, per timed step
        moved = sum(o.stats.offloaded_bytes + o.stats.reloaded_bytes for o in stores) - moved_before
        result["host_bytes_moved"] = moved // max(1, spec["steps"])
    return result


def trace(spec: dict) -> dict:
    """The traced plan of a measured longfit row: its free memory, its layer inputs placed as the row placed them."""
    from longfit.memory.switches import CheckpointPlacement
    from longfit.plan.trace import trace_step

    placement = spec.get("placement") and CheckpointPlacement(**spec["placement"])
    traced = trace_step(_row_config(spec), 1, free_bytes=spec.get("free_bytes"), placement=placement)
    return dict(traced_bytes=traced.peak_bytes, traced_phase=traced.peak_phase, trace_s=traced.seconds,
                trace_notes=traced.notes)


def main(argv: list[str]) -> int:
    mode, spec_path, result_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    if mode == "probe":
        import torch

        result = _device_info(torch.device(spec["device"]))
    elif mode == "trace":
        result = trace(spec)
    else:
        import torch

        try:
            result = measure(spec)
        except torch.OutOfMemoryError as e:
            result = dict(error=f"out of memory: {str(e).splitlines()[0]}", oom=True)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
