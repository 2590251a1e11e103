"""Context extension on the CPU: a tiny Qwen3 pretrained at a 64-token window, extended 4x (to 256) with and
without RoPE scaling; the loss by position across and past the window (`longfit eval --positions`).

    PYTHONPATH=src python benchmarks/context_extension_cpu.py OUT_DIR [--pretrain-steps 150] [--extend-steps 60]

Everything it writes goes under OUT_DIR: the corpus (Python's own standard library sources, byte-tokenized, as
long documents: CORPUS_BYTES of them for training, an eighth as many held out), the base model, the runs and a
markdown table (OUT_DIR/context_extension.md). The runs use one torch thread each (OMP_NUM_THREADS=1): on a
shared 2-core machine OpenMP threads spinning on such small kernels made a step 20x slower.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

WINDOW, EXTENDED = 64, 256
CORPUS_BYTES = 1_000_000
EXTENSIONS = {  # label -> rope.* settings of the extension run (and of the zero-shot eval of the base)
    "no scaling": [],
    "yarn (factor auto = 4)": ["rope.type=yarn"],
    "linear (factor 4)": ["rope.type=linear"],
    "raised base (theta 1e5)": ["rope.type=default", "rope.theta=1e5"],
}


def copy_corpus(out: Path, name: str, pieces: tuple[int, int], seed: int, documents: int) -> Path:
    """Documents that repeat a piece of standard library source: the second copy is predictable only by looking back
    one piece's length, which for pieces longer than WINDOW is past the window."""
    source = "".join(p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40])
    draw = random.Random(seed)
    path = out / f"{name}.jsonl"
    with path.open("w") as f:
        for _ in range(documents):
            length = draw.randint(*pieces)
            start = draw.randrange(len(source) - length)
            piece = source[start:start + length]
            f.write(json.dumps({"text": piece + piece}) + "\n")
    return path


def corpus(out: Path) -> tuple[Path, Path]:
    """Training and held-out documents: the standard library's .py files of at least 2 KiB, 1/8 held out."""
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size >= 2048)
    random.Random(0).shuffle(files)
    train, held = out / "train.jsonl", out / "heldout.jsonl"
    written = 0
    with train.open("w") as t, held.open("w") as h:
        for i, path in enumerate(files):
            if written > CORPUS_BYTES:
                break
            text = path.read_text(errors="replace")
            (h if i % 8 == 0 else t).write(json.dumps({"text": text}) + "\n")
            written += len(text) if i % 8 else 0
    return train, held


def base_model(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longfit.data.tokenizer import byte_tokenizer

    path = out / "base-init"
    config = AutoConfig.for_model("qwen3", vocab_size=384, hidden_size=128, intermediate_size=384,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=WINDOW)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def longfit(*argv: str) -> str:
    command = [sys.executable, "-m", "longfit", *argv]
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(done.stdout[-2000:] + done.stderr[-3000:])
    print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return done.stdout


def train(model: Path, data: Path, out: Path, seq_len: int, steps: int, rows: int, settings: list[str]) -> Path:
    longfit("train", f"model={model}", f"data.path={data}", f"output_dir={out}", f"seq_len={seq_len}",
            f"train.steps={steps}", f"train.micro_batch={rows}", "train.lr=3e-3", "train.warmup_steps=10",
            "train.device=cpu", "eval.retrieval=false", "memory.activation_checkpointing=false", *settings)
    return out / "final"


def positions(model: Path, held: Path, out: Path, rows: int, settings: list[str]) -> dict:
    report = out / f"positions-{len(list(out.glob('positions-*.json')))}.json"
    longfit("eval", "--model", str(model), "--data", str(held), "--seq-len", str(EXTENDED), "--rows", str(rows),
            "--positions", "--window", str(WINDOW), "--device", "cpu", "--json", str(report), *settings)
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--extend-steps", type=int, default=60)
    parser.add_argument("--eval-rows", type=int, default=48)
    parser.add_argument("--copy", action="store_true",
                        help="documents that repeat a piece of source (`copy_corpus`): pretrained on pieces of 12-30 "
                        "bytes, extended and scored on pieces of 70-125 (copied from past the window)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.copy:
        pretrain_data = copy_corpus(args.out, "pretrain", (12, 30), 0, 4000)
        train_data = copy_corpus(args.out, "extend", (70, 125), 1, 2000)
        held = copy_corpus(args.out, "heldout", (70, 125), 2, 200)
    else:
        train_data, held = corpus(args.out)
        pretrain_data = train_data
    base = train(base_model(args.out), pretrain_data, args.out / "pretrain", WINDOW, args.pretrain_steps, 16, [])
    results = {"base, no scaling": positions(base, held, args.out, args.eval_rows, [])}
    results["base, yarn zero-shot"] = positions(base, held, args.out, args.eval_rows, EXTENSIONS["yarn (factor auto = 4)"])
    for label, settings in EXTENSIONS.items():
        extended = train(base, train_data, args.out / f"extend-{len(results)}", EXTENDED, args.extend_steps, 4, settings)
        results[f"extended {args.extend_steps} steps, {label}"] = positions(extended, held, args.out, args.eval_rows, [])
    buckets = next(iter(results.values()))["positions"]
    header = "| model | " + " | ".join(f"{b['start']}-{b['end'] - 1}" for b in buckets) + " |"
    lines = [header, "|---" * (len(buckets) + 1) + "|"]
    for label, report in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{b['loss']:.3f}" for b in report["positions"]) + " |")
    tokens = " | ".join(f"{b['tokens']:,}" for b in buckets)
    lines.append(f"| target tokens | {tokens} |")
    table = "\n".join(lines)
    (args.out / "context_extension.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
