"""`longfit eval`: synthetic key-value retrieval accuracy by context length and needle depth, or with `--data FILE`
the mean token loss and perplexity on a dataset (`longfit.eval.loss`, the trainer's eval loss).

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
        help="synthetic retrieval accuracy per context length and depth, or the loss on a dataset (--data)",
        description="Retrieval accuracy of a model on the synthetic long-context task: a key-value needle at "
        "each depth of a prompt of each length; an example is correct when the model's greedy prediction of "
        "every answer token is right (teacher-forced exact match). With --data FILE: the mean token loss and "
        "perplexity on the first --rows rows of FILE packed as training packs them (the trainer's eval loss).",
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
    parser.add_argument("--data", metavar="FILE",
                        help="score the loss and perplexity on this data (any format data.path takes) instead of retrieval")
    parser.add_argument("--seq-len", type=int, default=2048, help="with --data: tokens per packed row (default 2048)")
    parser.add_argument("--rows", type=int, default=32, help="with --data: packed rows to read, at most (default 32)")
    parser.add_argument("--positions", action="store_true",
                        help="with --data: the loss by position in the documents, in buckets across and past the "
                        "model's original RoPE window (a quarter and a half of it, the window, then doublings)")
    parser.add_argument("--window", type=int, default=0,
                        help="with --positions: the original window the buckets are counted from (default: the "
                        "model's, read from its config; a raised RoPE base leaves none, so name it to compare)")
    parser.add_argument("--media", choices=["images", "video"],
                        help="score finding a key among --pages rendered pages (images) or frames of a clip (video) "
                        "instead, with a wrapper checkpoint directory whose images or videos train (#54): --samples "
                        "examples per place of the key's page, each fitting in --seq-len tokens")
    parser.add_argument("--pages", type=int, default=8, help="with --media: pages or frames an example (default 8)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
    parser.add_argument("settings", nargs="*", metavar="rope.KEY=VALUE",
                        help="the RoPE to evaluate the model with, as `longfit train` applies it (e.g. rope.type=yarn; "
                        "rope.factor=auto counts --seq-len with --data, else the longest of --lengths); an exported "
                        "model carries its own")
    parser.set_defaults(run=run)


def _has_tokenizer(model: str) -> bool:
    return Path(model).is_dir() and any((Path(model) / name).is_file() for name in TOKENIZER_FILES)


def load_eval_model(model: str, dtype, device, init_seed: int, run=None):
    """(model, tokenizer): a preset, a full model directory or a PEFT adapter directory on its base; with the RoPE of
    `run` (a Config) when given."""
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
        base_model = load_model(base, dtype=dtype, device=device, seed=init_seed, run=run)
        with peft_quietly():
            from peft import PeftModel

            net = PeftModel.from_pretrained(base_model, model, local_files_only=True)
        tokenizer_source = model if _has_tokenizer(model) else base
    else:
        net = load_model(model, dtype=dtype, device=device, seed=init_seed, run=run)
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


def load_media_model(model: str, checkpoint: str, dtype, device, init_seed: int, run=None):
    """(loss module, tokenizer) of `model` (a wrapper checkpoint or its export) with the wrapper's vision side (#54):
    its own, or for an adapter directory (a LoRA export: the language model's adapters only, the vision side frozen)
    that of `checkpoint`, the wrapper it was trained from."""
    from longfit.memory.loss import CausalLMLoss
    from longfit.models.media import build_media_encoder

    net, tokenizer = load_eval_model(model, dtype, device, init_seed, run)
    wrapper = model if (Path(model) / "config.json").is_file() else checkpoint
    return CausalLMLoss(net, chunked_loss=True, media_encoder=build_media_encoder(wrapper, device)), tokenizer


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


def eval_dtype(name: str, device):
    """`--dtype` on `device`: bf16 asked, or auto on a GPU that supports it; else fp32."""
    import torch

    use_bf16 = name == "bf16" or (name == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    return torch.bfloat16 if use_bf16 else torch.float32


def write_json(report: dict, where: str) -> None:
    text = json.dumps(report, indent=2)
    if where == "-":
        print(text)
    else:
        Path(where).write_text(text + "\n")


def rope_run(args: argparse.Namespace, seq_len: int):
    """The Config whose RoPE the model is evaluated with (`settings`: rope.* only), or None without settings."""
    from longfit.config import ConfigError, load_config, parse_override

    if not args.settings:
        return None
    for text in args.settings:
        if not parse_override(text)[0].startswith("rope."):
            raise ConfigError(f"longfit eval {text}: only rope.* settings apply to an evaluated model")
    return load_config(None, [f"seq_len={seq_len}", *args.settings])


def window_of(model) -> int | None:
    from longfit.models.rope import model_window
    from longfit.models.structure import unwrap_peft

    return model_window(unwrap_peft(model).config.get_text_config())


def run_loss(args: argparse.Namespace) -> int:
    """`longfit eval --data FILE`: the mean token loss and perplexity of --model on FILE's first --rows rows."""
    from longfit.config import Config, ConfigError, validate

    if args.rows < 1 or args.seq_len < 2:
        raise ConfigError(f"--rows {args.rows} --seq-len {args.seq_len}: read at least 1 row of at least 2 tokens")
    if not Path(args.data).expanduser().exists():
        raise ConfigError(f"--data {Path(args.data).expanduser().resolve()}: no such file or directory")
    cfg = Config(model=args.model, seq_len=args.seq_len)
    cfg.data.eval_path = str(Path(args.data).expanduser().resolve())
    cfg.train.seed = args.init_seed
    validate(cfg)

    import time

    from longfit.data.packing import EvalData
    from longfit.eval.loss import evaluate_loss
    from longfit.memory.loss import CausalLMLoss
    from longfit.models.media import build_media_encoder, image_reader

    device = eval_device(args.device)
    dtype = eval_dtype(args.dtype, device)
    model, tokenizer = load_eval_model(args.model, dtype, device, args.init_seed, rope_run(args, args.seq_len))
    data = EvalData(cfg, tokenizer, image_reader(args.model))  # image and video rows as training reads them (#54)
    loss_module = CausalLMLoss(model, chunked_loss=True,
                               media_encoder=build_media_encoder(args.model, device) if data.images else None)
    print(f"loss of {args.model} on {args.data}: up to {args.rows} rows of {args.seq_len} tokens", file=sys.stderr)
    started = time.perf_counter()
    result = evaluate_loss(loss_module, data.loader(1), args.rows, device,
                           known_rows=data.count.rows if data.count.complete else None)
    elapsed = time.perf_counter() - started
    print(f"loss {result.loss:.4f}, perplexity {result.perplexity:.2f} ({result.rows} rows of {args.seq_len} tokens, "
          f"{result.tokens:,} target tokens, {elapsed:.1f} s)")
    report = {"model": args.model, "data": args.data, "seq_len": args.seq_len, "rows": result.rows,
              "tokens": result.tokens, "loss": result.loss, "perplexity": result.perplexity, "rope": args.settings}
    if args.positions:
        from dataclasses import asdict

        from longfit.eval.positions import format_positions, loss_by_position, position_edges

        window = args.window or window_of(model) or args.seq_len
        buckets = loss_by_position(model, data.loader(1), args.rows, device, position_edges(args.seq_len, window),
                                   loss_module=loss_module)
        print(f"loss by position (original window {window} positions)")
        print(format_positions(buckets, window))
        report.update(window=window, positions=[asdict(b) for b in buckets])
    if args.json:
        write_json(report, args.json)
    return 0


def run_media(args: argparse.Namespace) -> int:
    """`longfit eval --media images|video`: the image or video retrieval score of --model (`eval.retrieval_media`)."""
    from longfit.config import Config, ConfigError, validate

    cfg = Config(model=args.model, seq_len=args.seq_len)
    cfg.eval.retrieval_media, cfg.eval.pages, cfg.eval.samples = args.media, args.pages, args.samples
    validate(cfg)
    if args.positions or args.settings:
        raise ConfigError("--media scores the model as it is: drop --positions and rope.* settings")

    from longfit.eval.media_retrieval import evaluate_media_retrieval
    from longfit.eval.retrieval import format_table, results_json
    from longfit.models.media import media_reader

    device = eval_device(args.device)
    loss_module, tokenizer = load_media_model(args.model, args.model, eval_dtype(args.dtype, device), device,
                                              args.init_seed)
    score = evaluate_media_retrieval(loss_module, tokenizer, media_reader(args.model), cfg, args.media, args.pages,
                                     args.samples, args.seed, device)
    print(f"{args.media} retrieval of {args.model}: {score.line()}, seed {args.seed}")
    print(format_table(list(score.cells)).replace("length", " pages"))
    if args.json:
        write_json(results_json(list(score.cells), model=args.model, media=args.media, pages=args.pages,
                                samples=args.samples, seed=args.seed, log_likelihood=score.log_likelihood), args.json)
    return 0


def run(args: argparse.Namespace) -> int:
    from longfit.config import ConfigError

    if args.data and args.media:
        raise ConfigError("--data scores the loss on a dataset, --media the image or video retrieval: give one")
    if args.data:
        return run_loss(args)
    if args.media:
        return run_media(args)
    if args.positions:
        raise ConfigError("--positions scores the loss by position on a dataset: add --data FILE")
    if args.samples < 1:
        raise ConfigError(f"--samples {args.samples}: evaluate at least 1 example per cell")

    from longfit.eval.retrieval import evaluate_retrieval, format_table, results_json

    device = eval_device(args.device)
    dtype = eval_dtype(args.dtype, device)
    model, tokenizer = load_eval_model(args.model, dtype, device, args.init_seed, rope_run(args, max(args.lengths)))
    window = window_of(model)
    past = [length for length in args.lengths if window and length > window]
    if past:
        print(f"note: {', '.join(map(str, past))} tokens pass the model's original RoPE window of {window} positions",
              file=sys.stderr)
    results = evaluate_retrieval(model, tokenizer, args.lengths, args.depths, args.samples, args.seed, device)
    print(f"retrieval accuracy of {args.model} (teacher-forced exact match, {args.samples} samples per cell, "
          f"seed {args.seed})")
    print(format_table(results))
    if args.json:
        write_json(results_json(results, model=args.model, samples=args.samples, seed=args.seed, window=window,
                                rope=args.settings), args.json)
    return 0
