"""Issue #57: peak memory of one DeepSeek-V3.2 sparse attention layer on the CPU, longfit's against transformers'
eager layer, by length.

The layer is the first of the check's shrunken deepseek_v32 copy (hidden 64, 2 heads, kv_lora_rank 32, 4 index heads of
24... as `longfit.check.shrink` makes it) with the real index_topk of 2,048 keys per query. Each (implementation,
length) runs in a fresh interpreter: forward and backward of the layer on one row of L random hidden states, the
process's peak RSS above its baseline (longfit.bench.meter). longfit's selection keeps (L, 2,048) int32 indices
and a block's running top-k, its attention a block's gathered latents: linear in L. transformers' indexer scores
an (L, index heads, L) fp32 matrix and its eager attention an (heads, L, L) one: quadratic. So longfit's peak
should about double per doubling of L, eager's about quadruple; eager is run up to --eager-max (its 16K needs
~10 GiB). Prints and writes OUT/sparse_attention_memory.json and .md.

    PYTHONPATH=src nice -n 10 python benchmarks/sparse_attention_memory.py --out /tmp/sparse_memory
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LENGTHS = (4096, 8192, 16384, 32768)
TOPK = 2048  # DeepSeek-V3.2's and GLM-5's index_topk


def measure(implementation: str, length: int) -> dict:
    """In this interpreter: one forward and backward of the layer on `length` tokens; peak bytes above the baseline."""
    import copy

    import torch
    from transformers import AutoConfig

    from longfit.bench.meter import MemoryMeter, return_freed_memory_to_os
    from longfit.check.shrink import causal_lm, shrink_config
    from longfit.models.attention import register_attention
    from longfit.models.sparse_attention import prepare_sparse_attention

    return_freed_memory_to_os()
    torch.manual_seed(0)
    config = copy.deepcopy(shrink_config(AutoConfig.for_model("deepseek_v32"), 64).config)
    config.index_topk = TOPK
    model = causal_lm(config, attn_implementation="eager" if implementation == "eager" else register_attention(),
                      dtype=torch.float32)
    if implementation == "longfit":
        prepare_sparse_attention(model)
    layer = model.model.layers[0].self_attn
    hidden = torch.randn(1, length, config.hidden_size, requires_grad=True)
    positions = torch.arange(length)[None]
    position_embeddings = model.model.rotary_emb(hidden, positions)
    mask = None
    if implementation == "eager":
        from transformers.masking_utils import create_causal_mask

        mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions, allow_is_causal_skip=False)
    meter = MemoryMeter(torch.device("cpu"))
    meter.start()
    start = time.perf_counter()
    out = layer(hidden, position_embeddings=position_embeddings, attention_mask=mask, position_ids=positions)[0]
    out.square().sum().backward()
    seconds = time.perf_counter() - start
    return {"implementation": implementation, "length": length, "peak_bytes": meter.peak(), "seconds": seconds,
            "mask_bytes": 0 if mask is None else mask.numel() * mask.element_size()}


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lengths", type=int, nargs="*", default=list(LENGTHS))
    parser.add_argument("--eager-max", type=int, default=8192, help="the longest length the eager layer runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for length in args.lengths:
        for implementation in ("longfit", "eager"):
            if implementation == "eager" and length > args.eager_max:
                continue
            done = subprocess.run([sys.executable, __file__, "--one", implementation, str(length)], check=True,
                                  capture_output=True, text=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
            write(rows, args.out)  # after each row: the longest lengths take long on a CPU
    print((args.out / "sparse_attention_memory.md").read_text())


def write(rows: list[dict], out: Path) -> None:
    """OUT/sparse_attention_memory.json and .md: each row's peak, and its ratio to the same implementation's at the
    length before."""
    (out / "sparse_attention_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| implementation | L | peak MiB | x the previous length's | seconds |", "| --- | --- | --- | --- | --- |"]
    previous: dict[str, int] = {}
    for row in rows:
        ratio = row["peak_bytes"] / previous[row["implementation"]] if row["implementation"] in previous else None
        previous[row["implementation"]] = row["peak_bytes"]
        lines.append(f"| {row['implementation']} | {row['length']} | {row['peak_bytes'] / 2**20:.0f} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} | {row['seconds']:.1f} |")
    (out / "sparse_attention_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
