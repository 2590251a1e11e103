"""Loading at scale, measured: 4 gloo ranks load a 1.24B-parameter local checkpoint (llama-3.2-1b's
architecture with random weights, one bf16 safetensors file of 2.5 GB) into fp32 FSDP2 shards through
the trainer's path (`build_model` on the meta device, then `parallelize`). Each rank reads only its
slices, so its peak RSS while loading, above what the process held before, stays within 1/3 of one full
fp32 copy of the model (4.94 GB): its shard is 1/4 of it, plus one tensor's slice in flight.

Slow (about 10 GB of RAM and 2.5 GB of disk for a few minutes): `python -m pytest -m slow -s
tests/test_loading_memory.py`; the figures it prints are in benchmarks/results/loading_cpu.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import run_distributed  # noqa: E402

from longfit.bench.meter import MemoryMeter, return_freed_memory_to_os

WORLD = 4
GB = 1e9


def load_worker(rank: int, world: int, directory: str) -> dict:
    from safetensors import safe_open

    from longfit.config import load_config
    from longfit.memory.loss import CausalLMLoss
    from longfit.models.build import build_model
    from longfit.models.init import local_region
    from longfit.parallel.dims import ParallelDims
    from longfit.parallel.parallelize import parallelize

    return_freed_memory_to_os()
    cfg = load_config(None, [f"model={directory}"])
    dims = ParallelDims.from_config(cfg, world, 32)
    mesh = dims.build_mesh("cpu")
    model = build_model(cfg, torch.float32, "cpu", dims.fsdp_enabled)
    loss_module = CausalLMLoss.from_config(model, cfg)
    meter = MemoryMeter(torch.device("cpu"))
    baseline = meter.start()
    started = time.perf_counter()
    parallelize(loss_module, dims, cfg, mesh, device="cpu")
    seconds = time.perf_counter() - started
    peak = meter.peak()
    held = sum(local_region(p)[0].numel() * p.element_size() for p in model.parameters())
    embedding, offset = local_region(model.get_input_embeddings().weight)
    with safe_open(f"{directory}/model.safetensors", framework="pt") as f:
        stored = f.get_slice("model.embed_tokens.weight")[offset[0] : offset[0] + embedding.shape[0]]
    return dict(baseline=baseline, peak=peak, held=held, seconds=seconds, rows_equal=torch.equal(embedding, stored.float()))


@pytest.mark.slow
def test_each_rank_holds_at_most_a_third_of_the_model_while_loading(tmp_path):
    from longfit.models.loading import load_model

    return_freed_memory_to_os()  # the checkpoint's tensors leave this process's RSS once saved
    model = load_model("llama-3.2-1b", dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path, max_shard_size="8GB")
    del model
    full_fp32 = params * 4
    results = run_distributed(load_worker, WORLD, str(tmp_path))
    print(f"\nllama-3.2-1b architecture, {params / 1e9:.3f}B parameters, bf16 checkpoint "
          f"{(tmp_path / 'model.safetensors').stat().st_size / GB:.2f} GB, fp32 parameters, {WORLD} gloo ranks; "
          f"full fp32 copy {full_fp32 / GB:.2f} GB")
    for rank, r in enumerate(results):
        print(f"rank {rank}: RSS before {r['baseline'] / GB:.3f} GB, peak above it {r['peak'] / GB:.3f} GB "
              f"({r['peak'] / full_fp32:.3f} of the full copy), absolute peak {(r['baseline'] + r['peak']) / GB:.3f} GB, "
              f"shard held {r['held'] / GB:.3f} GB, {r['seconds']:.1f} s")
    assert all(r["rows_equal"] for r in results)
    assert all(r["peak"] <= full_fp32 / 3 for r in results)
