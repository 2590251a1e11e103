"""`longfit bench media`: per-rank peak memory of an image-heavy row at context-parallel degrees 1 and 2 (#54).

The row is a conversation of `--images` page-sized images (made here with Pillow from seeded arrays, written under
`--out`) and a question, read, tokenised and packed by longfit's own reader with the checkpoint's own image processor,
one row of `--seq-len` tokens. Each cp degree runs in a fresh group of cp processes (gloo on CPU) that trains the
wrapper as `longfit train` does: its language model through `parallelize` (CP + the default memory techniques +
FSDP2 over the cp ranks) and its vision side (`train.vision`, default `all`) with the images dealt over the ranks
(`longfit.parallel.media`); forward, backward of local_sum / global valid tokens, FSDP's gradient reduce, no optimizer
step. `--tower-checkpointing on,off` runs each degree with the trained tower's blocks checkpointed as the run does
(memory.activation_checkpointing, `longfit.memory.apply.checkpoint_tower`: each block keeps its input alone) and with
them un-checkpointed (every block's activations kept for the backward), the language model's settings the same.

Memory is `longfit bench cp`'s (peak RSS above the rank's baseline, the kernel's high-water mark reset before each
measured step, freed tensors returned to the OS), the maximum over ranks, of three steps on each rank:
- the image row (its positions computed on the whole row, then cut to the rank's shard);
- the same tokens without their images (every placeholder an ordinary token, no tower): the language model alone;
- a text row of `--short-len` tokens: what does not grow with the row (gradient shards, a gathered layer, buffers).
The towers' share is the first minus the second: the tower's and projector's activations of this rank's images,
their pixels and the embeddings exchanged. Every rank holds the batch's pixels before the step (in its baseline); at
cp > 1 a rank's tower takes a copy of its own images' pixels (kept for its backward when the tower trains), which one
rank alone does not need: the towers' share at cp > 1 carries that copy, about 1 / cp of the batch's pixels. The
language model's activations are the second minus the third, scaled by L / (L - L0) (`longfit bench cp`'s
definition). Per-rank activations = both; the target is activations x cp / activations(cp=1) <= 1.15, for the
towers' share and the language model's each.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from longfit.config import ConfigError

REPORT = "media_memory.md"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "media", help="per-rank peak memory of an image-heavy row at cp = 1, 2: the towers' share and the language "
                      "model's (gloo on CPU)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", required=True, help="local image-text wrapper checkpoint directory (with its "
                        "image processor)")
    parser.add_argument("--images", type=int, default=32, help="images in the benchmarked row")
    parser.add_argument("--image-size", default="448x448", help="HEIGHTxWIDTH of each image before the checkpoint's "
                        "processor resizes it")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens of the benchmarked row (L)")
    parser.add_argument("--short-len", type=int, default=1024, help="L0, the short text row that measures the "
                        "memory not growing with the row")
    parser.add_argument("--cp", default="1,2", help="comma-separated context-parallel degrees")
    parser.add_argument("--method", choices=["ring", "ulysses"], default="ring", help="parallel.cp_method")
    parser.add_argument("--vision", default="all", help="train.vision: what of the vision side trains")
    parser.add_argument("--tower-checkpointing", default="on", help="comma-separated: on (the tower's blocks "
                        "checkpointed, as memory.activation_checkpointing does), off (their activations kept); "
                        "on,off measures both")
    parser.add_argument("--out", required=True, help="directory the images, the row and the report "
                        f"{REPORT} (and its JSON) are written under")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every run, e.g. --set memory.tiled_mlp=false")
    parser.set_defaults(run=run)


def write_image_row(folder: Path, images: int, height: int, width: int) -> Path:
    """One conversation of `images` seeded noise images and a question, as a chat JSONL file in `folder`."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    parts = []
    for index in range(images):
        name = f"images/page{index:03d}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / name)
        parts.append({"type": "image", "path": name})
    parts.append({"type": "text", "text": "Which page holds the key?"})
    row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Page 1."}]}
    path = folder / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def _run_overrides(options: dict, cp: int) -> list[str]:
    return [f"model={options['model']}", f"data.path={options['rows']}", f"seq_len={options['seq_len']}",
            f"parallel.cp={cp}", f"parallel.cp_method={options['method']}", f"train.vision={options['vision']}",
            "train.dtype=fp32", "eval.retrieval=false", *options["overrides"]]


def _worker(rank: int, world: int, workdir: str, options: dict) -> None:
    import dataclasses
    import datetime

    import torch
    import torch.distributed as dist

    from longfit.bench.cp import _parallel_dims, _single_document_batch, write_rank_result
    from longfit.bench.meter import MemoryMeter, return_freed_memory_to_os
    from longfit.config import load_config
    from longfit.data.packing import build_dataloader
    from longfit.memory.checkpointing import remove_tower_checkpointing
    from longfit.memory.loss import CausalLMLoss, batch_loss_sum, positioned
    from longfit.models.build import build_model
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import build_media_encoder, media_reader, trainable_parts
    from longfit.parallel.batch import cp_layout, global_valid_tokens, shard_batch
    from longfit.parallel.media import deal
    from longfit.parallel.parallelize import parallelize

    return_freed_memory_to_os()
    torch.set_num_threads(1)  # a rank stands for one device
    device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30))
    try:
        cfg = load_config(None, _run_overrides(options, world))
        batch = next(build_dataloader(cfg, load_tokenizer(cfg.model), epochs=1, media=media_reader(cfg.model)))
        model = build_model(cfg, torch.float32, device, fsdp=world > 1)
        dims = _parallel_dims(cfg, world, model)
        mesh = dims.build_mesh(device.type)
        encoder = build_media_encoder(cfg.model, device)
        trainable_parts(encoder, cfg.train.vision, cfg.lora)
        loss_module = CausalLMLoss(model, chunked_loss=cfg.memory.chunked_loss, loss_chunk=cfg.memory.loss_chunk,
                                   media_encoder=encoder)
        loss_module = parallelize(loss_module, dims, cfg, mesh, param_dtype=torch.float32, device=device)
        if not options["tower_checkpointing"]:
            for tower, depth in encoder.towers():
                remove_tower_checkpointing(tower, depth)
        layout = cp_layout(cfg.parallel.cp_method)
        batch = positioned(loss_module, batch)
        rows = {"image": batch, "text": dataclasses.replace(batch, media=None),
                "short": _single_document_batch(options["short_len"], model.config.get_text_config().vocab_size)}
        meter = MemoryMeter(device)

        def peak(row) -> int:
            shard = shard_batch(row, mesh.cp_rank, dims.cp, layout)
            meter.start()
            (batch_loss_sum(loss_module, shard) / global_valid_tokens(shard.labels, mesh.world_group)).backward()
            loss_module.zero_grad(set_to_none=True)
            return meter.peak()

        peak(rows["image"])  # warm-up: FSDP's lazy init, first allocations
        result = {name: peak(row) for name, row in rows.items()}
        patches = encoder.pixel_rows(batch.media.grid_thw)
        own = deal(patches, world)[mesh.cp_rank] if len(patches) >= world else range(len(patches))
        result |= dict(images=len(own), patches=sum(patches[i] for i in own), row_images=batch.media.images,
                       image_tokens=int((batch.media.embedding_index >= 0).sum()),
                       row_tokens=int(batch.input_ids.shape[1]))
        write_rank_result(workdir, rank, world, result)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _check(args: argparse.Namespace, degrees: list[int]) -> tuple[int, int]:
    """The image size, after every argument and the checkpoint are checked (before any rank starts)."""
    from longfit.bench.cp import check_lengths
    from longfit.models.media import media_reader

    try:
        height, width = (int(x) for x in args.image_size.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--image-size {args.image_size!r}: give HEIGHTxWIDTH, e.g. 448x448") from None
    if args.images < max(degrees):
        raise ConfigError(f"--images {args.images}: give at least one image per rank of --cp {args.cp}")
    check_lengths(args, degrees)
    media_reader(args.model)  # an image-text wrapper of a family whose images train, with its image processor
    return height, width


def run(args: argparse.Namespace) -> int:
    from longfit.bench.cp import run_degree

    degrees = [int(x) for x in args.cp.split(",") if x.strip()]
    height, width = _check(args, degrees)
    towers = [x.strip() for x in args.tower_checkpointing.split(",") if x.strip()]
    if not towers or set(towers) - {"on", "off"}:
        raise ConfigError(f"--tower-checkpointing {args.tower_checkpointing!r}: give on, off or on,off")
    out = Path(args.out)
    rows = write_image_row(out / "data", args.images, height, width)
    options = dict(model=args.model, rows=str(rows), seq_len=args.seq_len, short_len=args.short_len,
                   method=args.method, vision=args.vision, overrides=args.overrides)
    MB = 2**20
    results = []
    for checkpointed in towers:
        for cp in degrees:
            ranks = run_degree(_worker, cp, dict(options, tower_checkpointing=checkpointed == "on"))
            if ranks[0]["image_tokens"] == 0:
                raise ConfigError(f"--seq-len {args.seq_len} holds none of the {args.images} images: raise --seq-len "
                                  "or lower --images")
            worst = {name: max(r[name] for r in ranks) for name in ("image", "text", "short")}
            share = max(r["image"] - r["text"] for r in ranks)
            language = (worst["text"] - worst["short"]) * args.seq_len / (args.seq_len - args.short_len)
            results.append(dict(cp=cp, tower_checkpointing=checkpointed, peak=worst["image"], towers=share,
                                language=language, ranks=ranks))
            print(f"cp={cp}, tower checkpointing {checkpointed}: peak {worst['image'] / MB:.1f} MB, towers' share "
                  f"{share / MB:.1f} MB, language model's activations {language / MB:.1f} MB per rank", flush=True)
    report = _markdown(results, args)
    print(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT).write_text(report)
    (out / REPORT.replace(".md", ".json")).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _markdown(results: list[dict], args: argparse.Namespace) -> str:
    MB = 2**20
    def ratio(r: dict, key: str) -> str:
        base = next((b for b in results if b["cp"] == 1 and b["tower_checkpointing"] == r["tower_checkpointing"]), None)
        return f"{r[key] * r['cp'] / base[key]:.3f}" if base and base[key] > 0 else "n/a"

    first = results[0]["ranks"][0]
    lines = [
        "| cp | tower checkpointed | images / patches on the worst rank | per-rank peak (MB) | towers' share (MB) "
        "| towers x cp / cp=1 | language model's activations (MB) | LM x cp / cp=1 | activations (MB) "
        "| activations x cp / cp=1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        r["activations"] = r["towers"] + r["language"]
        busiest = max(r["ranks"], key=lambda rank: rank["patches"])
        lines.append(f"| {r['cp']} | {r['tower_checkpointing']} | {busiest['images']} / {busiest['patches']} "
                     f"| {r['peak'] / MB:.1f} "
                     f"| {r['towers'] / MB:.1f} | {ratio(r, 'towers')} | {r['language'] / MB:.1f} "
                     f"| {ratio(r, 'language')} | {r['activations'] / MB:.1f} | {ratio(r, 'activations')} |")
    return "\n".join([
        "# Image rows under context parallelism: per-rank memory (cpu, #54)",
        "",
        f"Command: `{shlex.join(['longfit', *args.argv])}`",
        "",
        f"Model {args.model}; one row of {first['row_tokens']} tokens holding {first['row_images']} images of "
        f"{args.image_size} ({first['image_tokens']} image tokens), cp_method={args.method}, fp32, "
        f"train.vision={args.vision}, default memory settings"
        f"{' + ' + ', '.join(args.overrides) if args.overrides else ''}. Memory: peak RSS above the loaded baseline, "
        f"maximum over ranks. Towers' share: the image row's peak minus the same tokens' without their images "
        f"(tower and projector activations of the rank's images, pixels, embeddings). Language model's activations: "
        f"the text row's peak minus a {args.short_len}-token row's, scaled by L/(L-L0). Target: x cp / cp=1 <= 1.15.",
        "",
        *lines,
        "",
    ])
