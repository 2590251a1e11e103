"""`longfit eval`: synthetic key-value retrieval accuracy by context length and needle depth.

Heavy imports live inside functions so that `longfit --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give token lengths >= 2, e.g. 1024,2048,4096")
    return values


def _depth_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: depths are fractions of the context in [0, 1], e.g. 0,0.5,1")
    return values


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="synthetic retrieval accuracy per context length and depth",
        description="Retrieval accuracy of a model on the synthetic long-context task: a key-value needle at "
        "each depth of a prompt of each length; an example is correct when the model's greedy prediction of "
        "every answer token is right (teacher-forced exact match).",
    )
    parser.add_argument("--model", default="llama-tiny",
                        help="a preset name, a local Hugging Face model directory (e.g. OUTPUT_DIR/final) or a "
                        "PEFT adapter directory; a directory's own tokenizer is used when it has one")
    parser.add_argument("--lengths", type=_int_list, default=[1024, 2048, 4096],
                        help="comma-separated prompt+answer lengths in tokens (default 1024,2048,4096)")
    parser.add_argument("--depths", type=_depth_list, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                        help="comma-separated needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
    parser.add_argument("--samples", type=int, default=5, help="examples per (length, depth) cell (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the examples (default 0)")
    parser.add_argument("--init-seed", type=int, default=0,
                        help="seed of a preset's random weights, also a preset base under a LoRA adapter: "
                        "use the run's train.seed (default 0)")
    parser.add_argument("--device", default="auto",
                        help="auto, cpu, cuda, cuda:1, ... (default auto: cuda when this machine has a GPU, as train.device)")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help="weights dtype (auto: bf16 on GPUs that support it, else fp32)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
    parser.set_defaults(run=run)


def _has_tokenizer(model: str) -> bool:
    return Path(model).is_dir() and any((Path(model) / name).is_file() for name in TOKENIZER_FILES)


def load_eval_model(model: str, dtype, device, init_seed: int):
    """(model, tokenizer): a preset, a full model directory or a PEFT adapter directory on its base."""
    from longfit.config import ConfigError
    from longfit.data.tokenizer import byte_tokenizer
    from longfit.models.loading import load_model, load_tokenizer

    adapter_config = Path(model) / "adapter_config.json"
    if adapter_config.is_file() and not (Path(model) / "config.json").is_file():
        from longfit.models.build import peft_quietly

        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"{adapter_config} names no base model (base_model_name_or_path); "
                              f"export the adapter with its base recorded, or merge it (lora.merge_on_export=true)")
        base_model = load_model(base, dtype=dtype, device=device, seed=init_seed)
        with peft_quietly():
            from peft import PeftModel

            net = PeftModel.from_pretrained(base_model, model, local_files_only=True)
        tokenizer_source = model if _has_tokenizer(model) else base
    else:
        net = load_model(model, dtype=dtype, device=device, seed=init_seed)
        tokenizer_source = model
    if _has_tokenizer(tokenizer_source) or not Path(tokenizer_source).is_dir():
        tokenizer = load_tokenizer(tokenizer_source)
    else:  # a directory without tokenizer files, e.g. a preset trained and exported with longfit
        tokenizer = byte_tokenizer()
    vocab = net.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ConfigError(f"--model {model}: the tokenizer has {len(tokenizer)} tokens but the model only {vocab} "
                          f"embeddings; save the training tokenizer next to the model")
    return net, tokenizer


def eval_device(name: str):
    """`--device` as a torch.device this machine has; a ConfigError naming the choices otherwise."""
    import torch

    from longfit.config import ConfigError
    from longfit.launch import DEVICE_CHOICES, choose_device_type, visible_gpus

    gpus = visible_gpus()
    if name in DEVICE_CHOICES:  # one process: train.device's rule
        return torch.device(choose_device_type(name, 1, gpus, "--device"))
    choices = "cpu" + (f", cuda, cuda:0 .. cuda:{gpus - 1}" if gpus else " (this machine has no CUDA GPU)")
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:  # an unknown device type, or a backend torch was built without
        raise ConfigError(f"--device {name}: not a device of this machine ({str(e).splitlines()[0]}); use {choices}") from e
    return device


def run(args: argparse.Namespace) -> int:
    from longfit.config import ConfigError

    if args.samples < 1:
        raise ConfigError(f"--samples {args.samples}: evaluate at least 1 example per cell")

    import torch

    from longfit.eval.retrieval import evaluate_retrieval, format_table, results_json

    device = eval_device(args.device)
    use_bf16 = args.dtype == "bf16" or (
        args.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    model, tokenizer = load_eval_model(args.model, dtype, device, args.init_seed)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and max(args.lengths) > max_positions:
        print(f"note: lengths beyond max_position_embeddings={max_positions} test extrapolation", file=sys.stderr)
    results = evaluate_retrieval(model, tokenizer, args.lengths, args.depths, args.samples, args.seed, device)
    print(f"retrieval accuracy of {args.model} (teacher-forced exact match, {args.samples} samples per cell, "
          f"seed {args.seed})")
    print(format_table(results))
    if args.json:
        report = json.dumps(results_json(results, model=args.model, samples=args.samples, seed=args.seed), indent=2)
        if args.json == "-":
            print(report)
        else:
            Path(args.json).write_text(report + "\n")
    return 0
