"""`longfit export OUTPUT_DIR`: export a checkpoint of a run after the fact, as the trainer's own export does.

The checkpoint (the newest intact one, or `--step N`) is verified against its manifest, its config.yaml
rebuilds the model on one process on the CPU, and DCP reads the model's state into it from the files of
however many ranks wrote it (FSDP2 shards, tensor-parallel slices); the optimizer state is not read. The
export itself is the trainer's (`longfit.train.export`): a model, a merged model or an adapter with its base; an
image-text checkpoint's is that checkpoint again, with the vision side the run trained (its tower or projector, or
their adapters, read from the checkpoint as the language model's), or with `--text-only` its language model alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from longfit.config import ConfigError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a checkpoint of a run as a Hugging Face model or PEFT adapter",
        description="Export a checkpoint of OUTPUT_DIR (the newest intact one, or --step N) as the trainer's export "
        "does: a Hugging Face model directory, or for LoRA a PEFT adapter (with its base beside it when the base is "
        "not a local model directory) or the merged model. Runs on one process on the CPU, whatever number of ranks "
        "wrote the checkpoint.",
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's output_dir (it holds checkpoints/)")
    parser.add_argument("--step", type=int, help="export the checkpoint of this step (default: the newest intact one)")
    parser.add_argument("--merge", action=argparse.BooleanOptionalAction, default=None,
                        help="LoRA: merge the adapters into the base weights, or (--no-merge) write the adapter "
                        "(default: the run's lora.merge_on_export)")
    parser.add_argument("--text-only", action="store_true",
                        help="an image-text checkpoint (Qwen3.5, Gemma 3, Gemma 4, Llama 4, Mistral 3): export its "
                        "language model alone as a causal LM (default: the image-text model that came in, its other "
                        "towers copied unchanged)")
    parser.add_argument("--out", metavar="DIR",
                        help="where to write the export (default OUTPUT_DIR/exports/step_N, with -merged when merged); "
                        "an existing export there is replaced")
    parser.set_defaults(run=run)


def choose_checkpoint(output_dir: Path, step: int | None) -> Path:
    """The checkpoint to export, verified: `step`'s, or the newest intact one (a checkpoint's checksums are read only
    until one verifies). A ConfigError naming the other steps otherwise."""
    from longfit.train.checkpoint import checkpoint_root, step_dirs, verify_checkpoint

    if not output_dir.is_dir():
        raise ConfigError(f"{output_dir} does not exist; give the output_dir of a run (the directory holding checkpoints/)")
    candidates = step_dirs(output_dir)
    if not candidates:
        raise ConfigError(f"{output_dir} holds no checkpoint ({checkpoint_root(output_dir)} has no step_* directory); "
                          f"give the output_dir of a run that saved one")
    if step is None:
        damaged = []
        for path in candidates:
            why = verify_checkpoint(path)[1]
            if why is None:
                return path
            damaged.append(f"{path.name}: {why}")
        raise ConfigError(f"{output_dir} holds no intact checkpoint ({'; '.join(damaged)}); nothing can be exported")
    chosen = next((p for p in candidates if step_number(p) == step), None)
    others = ", ".join(str(step_number(p)) for p in candidates if p != chosen) or "none"
    if chosen is None:
        raise ConfigError(f"--step {step}: {output_dir} has no checkpoint of step {step}; steps available: {others}")
    why = verify_checkpoint(chosen)[1]
    if why is not None:
        raise ConfigError(f"--step {step}: checkpoint {chosen} is damaged ({why}); other steps available: {others}")
    return chosen


def step_number(checkpoint: Path) -> int:
    return int(checkpoint.name.split("_")[1])


def checkpoint_config(checkpoint: Path, merge: bool | None):
    """The config that trained up to `checkpoint`, with `merge` (when given) as lora.merge_on_export."""
    from longfit.config import load_config

    overrides = [] if merge is None else [f"lora.merge_on_export={str(merge).lower()}"]
    cfg = load_config(checkpoint / "config.yaml", overrides)
    if merge and not cfg.lora.enabled:
        raise ConfigError(f"--merge: {checkpoint} is a full fine-tune (lora.enabled=false), which has no adapter to "
                          f"merge; export it without --merge")
    return cfg


def rebuild_model(checkpoint: Path, cfg, media_encoder=None):
    """`cfg`'s model on the CPU, as the trainer built it, with the model state of `checkpoint` (and `media_encoder`'s,
    the trained vision side `rebuild_vision` built, where given)."""
    import torch

    from longfit.memory.loss import CausalLMLoss
    from longfit.models.build import build_model
    from longfit.models.loading import compute_dtype, materialize_model
    from longfit.models.source import local_model_dir
    from longfit.train.checkpoint import load_model_state

    device = torch.device("cpu")
    model = build_model(cfg, compute_dtype(cfg.train.dtype, device), device)
    # The frozen base is not in a LoRA checkpoint: it comes from the model source as the trainer built it.
    materialize_model(model, device, cfg.train.seed, checkpoint=local_model_dir(cfg.model))
    # The module the trainer checkpointed: its state dict names the model's parameters under `model.`, the vision
    # side's under `media_encoder.`.
    load_model_state(checkpoint, CausalLMLoss(model, media_encoder=media_encoder))
    return model


def rebuild_vision(checkpoint: Path, cfg):
    """The run's vision side (#54) as the trainer built it (`train.vision`, its LoRA adapters drawn from the run's
    seed), for its trained tensors to be read from `checkpoint`; None where the checkpoint holds none (the run's
    rows had no images, or its vision side was frozen: the export copies the source's)."""
    from longfit.train.checkpoint import holds_trained_vision

    if not holds_trained_vision(checkpoint):
        return None
    from longfit.models.media import build_media_encoder, trainable_parts

    encoder = build_media_encoder(cfg.model)
    trainable_parts(encoder, cfg.train.vision, cfg.lora, cfg.train.seed)
    return encoder


def export_checkpoint(checkpoint: Path, cfg, destination: Path, text_only: bool = False) -> Path:
    """Export the model state of `checkpoint` (trained per `cfg`) to `destination` (`text_only`: an image-text
    checkpoint's language model alone; else with the vision side the run trained, as the trainer's own export)."""
    from longfit.models.loading import load_tokenizer
    from longfit.train.export import export_model

    vision = None if text_only else rebuild_vision(checkpoint, cfg)
    return export_model(cfg, rebuild_model(checkpoint, cfg, vision), load_tokenizer(cfg.model), destination, rank=0,
                        text_only=text_only, media_encoder=vision)


def default_destination(output_dir: Path, checkpoint: Path, cfg) -> Path:
    merged = cfg.lora.enabled and cfg.lora.merge_on_export
    return output_dir / "exports" / (checkpoint.name + ("-merged" if merged else ""))


def run(args: argparse.Namespace) -> int:
    output_dir = Path(args.output_dir)
    checkpoint = choose_checkpoint(output_dir, args.step)
    cfg = checkpoint_config(checkpoint, args.merge)
    destination = Path(args.out) if args.out else default_destination(output_dir, checkpoint, cfg)
    what = ("merged model" if cfg.lora.merge_on_export else "adapter") if cfg.lora.enabled else "model"
    print(f"exporting {checkpoint} ({what}, model={cfg.model}) to {destination}", flush=True)
    export_checkpoint(checkpoint, cfg, destination, args.text_only)
    print(f"exported step {step_number(checkpoint)} to {destination}")
    return 0
