"""Issue #33 item 6: does the offload store's prefetch make the CUDA allocator reserve more than the plan counts?

The plan counts a prefetched layer input once, as allocated bytes. Before the fix, the copy back to the GPU was
allocated on the store's side stream, whose blocks the caching allocator keeps in that stream's own pool: the
forward's inputs, freed into the compute stream's pool, were not reused, and reserved memory grew during the
backward by two layer inputs (measured on an H200: 4.0 GiB reserved before the backward, 5.0 GiB at its peak,
with 512 MiB inputs). The store now allocates the copy on the compute stream. This runs the store's backward
order (prefetch the next input, load this one, recompute with a layer-sized tensor on the compute stream) and
prints, in layer inputs, `backward_growth_layers` (peak reserved during the backward minus reserved before it:
~0 says the prefetch reuses the cached blocks, 2 was the bug), reserved minus allocated at the peak and after
each load.

    PYTHONPATH=src python3 benchmarks/offload_prefetch_memory.py [--device cpu]   (cpu: the sequence, no figures)
"""

from __future__ import annotations

import argparse
import json

import torch

from longfit.memory.offload import OffloadStore
from longfit.memory.switches import CheckpointPlacement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--mib", type=int, default=512, help="MiB of one layer input")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    numel = args.mib << 18  # fp32 elements
    layer_bytes = numel * 4
    store = OffloadStore(CheckpointPlacement(0, args.layers, 0, layer_bytes))

    def memory() -> dict:
        if not cuda:
            return {}
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        return dict(allocated_gib=allocated / 2**30, reserved_gib=reserved / 2**30,
                    gap_layers=(reserved - allocated) / layer_bytes)

    stored = []
    for i in range(args.layers):
        value = torch.full((numel,), float(i), device=args.device)
        stored.append(store.put(i, value))
        del value
    before = memory()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for i in reversed(range(args.layers)):
        if i > 0:
            store.prefetch(stored[i - 1])
        back = store.load(stored[i])
        recompute = back * 2  # the layer's recomputation, on the compute stream
        assert torch.equal(recompute, torch.full_like(back, 2.0 * i)), i
        del back, recompute
        stored[i] = None
        rows.append(dict(layer=i, **memory()))
    peaks = {}
    if cuda:
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        peaks = dict(peak_allocated_gib=allocated / 2**30, peak_reserved_gib=reserved / 2**30,
                     peak_gap_layers=(reserved - allocated) / layer_bytes,
                     backward_growth_layers=(reserved - before["reserved_gib"] * 2**30) / layer_bytes)
    store.close()
    if peaks:
        print(f"reserved growth during the backward: {peaks['backward_growth_layers']:.2f} layer inputs "
              f"({before['reserved_gib']:.2f} GiB before, {peaks['peak_reserved_gib']:.2f} GiB peak)")
    print(json.dumps(dict(device=args.device, layer_input_mib=args.mib, layers=args.layers, before_backward=before,
                          **peaks, after_each_load=rows), indent=1))


if __name__ == "__main__":
    main()
