"""The memory planner against a real training step on one GPU: llama-3.2-1b at 16K tokens.

The step is the trainer's (`longfit.train.loop`): the model built on the meta device and materialised on the
GPU by `parallelize` (the default memory techniques as `auto` decides them on CUDA at 16K: checkpointing,
chunked loss, tiled MLP), bf16 autocast over fp32 master weights, fused AdamW, gradient clipping. The
measured peak is torch.cuda.max_memory_allocated over the second step (the optimizer state exists from
the first) above what was allocated before the model; the analytic plan and the fake-tensor trace predict
the same quantity (`tensor_bytes`, without the reserve for the CUDA context and allocator slack) and must
be within 5% of it, the tolerance the analytic plan is held to against the trace on the CPU
(tests/test_plan_accuracy.py). `python -m pytest -m gpu`; skipped without CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch

from longfit.config import load_config

pytestmark = pytest.mark.gpu
OVERRIDES = ["model=llama-3.2-1b", "seq_len=16384", "train.device=cuda"]
TOLERANCE = 0.05
GiB = 2**30


def trainer_step_peak(cfg) -> int:
    """Bytes the second training step of `cfg` on this GPU allocates at its peak, model states included."""
    from longfit.bench.memory_worker import single_document_batch
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum
    from longfit.memory.optim import build_optimizer
    from longfit.models.build import build_model
    from longfit.models.loading import compute_dtype
    from longfit.parallel.parallelize import autocast_dtype, parallelize
    from longfit.plan.setup import resolve
    from longfit.train.loop import clip_and_measure

    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    dims = resolve(cfg, 1, "cuda").dims
    dtype = compute_dtype(cfg.train.dtype, device)
    model = build_model(cfg, dtype, device, dims.fsdp_enabled)
    loss_module = parallelize(CausalLMLoss.from_config(model, cfg), dims, cfg, dims.build_mesh("cuda"),
                              param_dtype=dtype, device=device)
    autocast = autocast_dtype(dims, dtype)
    trainable = [p for p in loss_module.parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, kind=cfg.memory.optimizer)
    batch = single_document_batch(cfg.seq_len, model.config.get_text_config().vocab_size).to(device)

    def step() -> None:
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = batch_loss_sum(loss_module, batch)
        (loss / batch.num_label_tokens).backward()
        clip_and_measure(loss_module, cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


@pytest.fixture(scope="module")
def measured() -> int:
    peak = trainer_step_peak(load_config(None, OVERRIDES))
    gc.collect()
    torch.cuda.empty_cache()
    return peak


@pytest.mark.parametrize("mode", ["analytic", "traced"])
def test_planner_predicts_the_measured_peak(measured, mode):
    from longfit.plan.analytic import plan_config
    from longfit.plan.trace import trace_step

    cfg = load_config(None, OVERRIDES)
    predicted = plan_config(cfg, 1).tensor_bytes if mode == "analytic" else trace_step(cfg, 1).peak_bytes
    error = predicted / measured - 1
    assert abs(error) <= TOLERANCE, (
        f"{mode} plan {predicted / GiB:.2f} GiB vs max_memory_allocated {measured / GiB:.2f} GiB ({error:+.1%}) "
        f"on {torch.cuda.get_device_name()}"
    )
