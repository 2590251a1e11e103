"""The padding a row's linear-attention scans hold beyond its tokens (#52), which the plan counts on top of the layer
traces' one document a row.

A Gated DeltaNet layer's torch kernel lays each document of a packed row on whole chunks of C tokens
(`longfit.models.linear_attention`: a document of d tokens takes ceil(d / C) C slots), so a row of L tokens scans
sum ceil(d / C) C >= L slots, and every tensor of the scan (its laid-out q, k, v, the chunks' C x C products and
their saved copies) grows with the slots, not the tokens. How many depends on the documents' lengths:
- with `data.path` and a local checkpoint, on the data as the trainer packs it: the first epoch's rows, and under
  data.shuffle_buffer every epoch's the run trains on (each its own draw: `longfit.data.packing.trained_epochs`), up
  to COUNT_TOKENS tokens, the row with the most slots;
- else an assumed row: documents one token past a chunk boundary (C + 1 tokens, the synthetic task's shortest
  documents, seq_len / 16 tokens, rounded up to one past a boundary), as many as fill the row; a row of shorter
  documents pads more (one-token documents C - 1 slots each), which only the data tells.
`RowPadding.slots` is the most any row of a micro-batch holds: the rows of a batch are scanned side by side on the
longest row's chunks. Layers of other kinds hold what one document holds (the blockwise attention's memory does not
grow with a row's document boundaries).

Tiled decoder layers (memory.tiled_layers) scan a row tile by tile (memory/tiled_layers.py: `span_gated_delta_rule`
of the tile's span): each tile lays the pieces of documents inside it, cut at its edges, on whole chunks, and holds
one tile's scan at a time. So what a tiled layer holds beyond one document a row is the most padded tile's slots
(`tile_padding`, over every row read), not the row's."""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass

from longfit.config import Config


@dataclass(frozen=True)
class RowPadding:
    slots: int
    """Slots past a row's tokens its linear-attention scans hold (0: no such layers, or none padded)."""
    documents: tuple[int, ...]
    """The document lengths of that row, in order (the row the traced step runs: `plan.trace.trace_step`)."""
    source: str
    """Which row, for the plan's notes."""
    rows: tuple[tuple[int, ...], ...] = ()
    """The document lengths of every row read (the data's epochs the run trains on, or the assumed row): the tiles'
    padding is the most any of them holds (`tile_padding`)."""


def padded(lengths, chunk: int) -> int:
    """Slots past the tokens of documents of `lengths` tokens, each on whole chunks of `chunk` tokens."""
    return sum(-(-n // chunk) * chunk - n for n in lengths)


def row_tiles(length: int, count: int) -> list[tuple[int, int]]:
    """A row of `length` tokens cut into `count` tiles as a tiled layer cuts it (parallel/tiled_attention.py's
    `even_tiles`: sizes differing by at most one token), written torch-free for the plan."""
    count = min(count, length)
    base, extra = divmod(length, count)
    ends = [0]
    for index in range(count):
        ends.append(ends[-1] + base + (index < extra))
    return list(zip(ends, ends[1:]))


def tile_slots(lengths, tiles: list[tuple[int, int]], chunk: int) -> int:
    """The most slots a tile of a row of documents of `lengths` tokens scans past the largest tile's tokens: each
    document's piece inside the tile on whole chunks."""
    edges = list(itertools.accumulate(lengths, initial=0))  # document j is [edges[j], edges[j + 1])

    def slots(start: int, end: int) -> int:
        first, last = bisect.bisect_right(edges, start) - 1, bisect.bisect_left(edges, end)
        return sum(-(-(min(edges[j + 1], end) - max(edges[j], start)) // chunk) * chunk for j in range(first, last))

    return max(slots(start, end) for start, end in tiles) - max(end - start for start, end in tiles)


def tile_padding(row: RowPadding, length: int, count: int, chunk: int) -> int:
    """Slots past a tile's tokens that a tiled linear-attention layer's scan holds beyond one document a row's (whose
    tile edges pad too when a tile is not whole chunks): the most padded tile of any row of `row`, rows of `length`
    tokens in `count` tiles."""
    tiles = row_tiles(length, count)
    return max(tile_slots(lengths, tiles, chunk) for lengths in row.rows or (row.documents,)) - \
        tile_slots((length,), tiles, chunk)


def row_padding(cfg: Config, chunk: int | None, dp_size: int = 1) -> RowPadding:
    """The padding of `cfg`'s most padded row on `dp_size` data-parallel ranks (module docstring); `chunk`: the scan's
    chunk (`ModelShape.scan_chunk`, None: no linear-attention layers)."""
    from longfit.models.source import local_model_dir
    from longfit.plan.media import trained_rows

    if not chunk:
        return RowPadding(0, (cfg.seq_len,), "")
    if cfg.data.path and local_model_dir(cfg.model) is not None:
        data = tuple(vars(cfg.data).items())  # the reader's and the packer's settings, hashable for the cache
        return _packed(cfg.model, cfg.seq_len, cfg.train.seed, data, chunk, cfg.train.epochs,
                       trained_rows(cfg, dp_size))
    shortest = max(cfg.seq_len // 16, 1) if not cfg.data.path else chunk + 1
    document = chunk * -(-(shortest - 1) // chunk) + 1  # the first length from `shortest` on one past a boundary
    lengths = [document] * (cfg.seq_len // document)
    rest = cfg.seq_len - sum(lengths)
    lengths += [rest] * bool(rest)
    data = "data.path (not packed here: the model is not a local checkpoint)" if cfg.data.path else \
        "the synthetic task (no data.path)"
    return RowPadding(padded(lengths, chunk), tuple(lengths),
                      f"{data}: assumed rows of {document}-token documents, one token past a chunk of the "
                      f"linear-attention scan ({chunk} tokens): {padded(lengths, chunk)} padded slots a row",
                      (tuple(lengths),))


@functools.lru_cache(maxsize=8)
def _packed(model: str, seq_len: int, seed: int, data: tuple, chunk: int, epochs: int, rows: int) -> RowPadding:
    """The most padded row of the epochs the run trains on (`trained_epochs`: train.epochs `epochs`, else train.steps'
    `rows` global rows) as the trainer packs them; `data`: the run's `DataConfig` as pairs."""
    from longfit.config import DataConfig, TrainSection
    from longfit.data.packing import COUNT_TOKENS, _first_epoch, trained_epochs
    from longfit.models.loading import load_tokenizer
    from longfit.models.media import image_reader

    cfg = Config(model=model, seq_len=seq_len, data=DataConfig(**dict(data)),
                 train=TrainSection(seed=seed, epochs=epochs))
    tokenizer, reader = load_tokenizer(model), image_reader(model)
    read_epochs = trained_epochs(cfg, tokenizer, reader, rows)
    loader = _first_epoch(cfg, tokenizer, reader, read_epochs)
    most, lengths, index, which, read_rows = -1, (seq_len,), 0, 0, []
    for index, batch in enumerate(loader):
        spans = batch.documents.rows[0] if batch.documents is not None else ((0, seq_len),)
        row = tuple(end - start for start, end in spans)
        read_rows.append(row)
        if padded(row, chunk) > most:
            most, lengths, which = padded(row, chunk), row, index
        if loader.stats.tokens > COUNT_TOKENS:
            break
    read = "" if loader.stats.tokens <= COUNT_TOKENS else f" (of the first {index + 1} rows, {COUNT_TOKENS} tokens)"
    epochs_read = "the first epoch" if read_epochs == 1 else f"the {read_epochs} epochs the run trains on"
    return RowPadding(max(most, 0), lengths,
                      f"data.path: its packed row with the most padding of the linear-attention scan ({chunk}-token "
                      f"chunks), row {which + 1} of {epochs_read}{read}: {len(lengths)} documents, "
                      f"{max(most, 0)} padded slots", tuple(dict.fromkeys(read_rows)))


def padding_notes(s) -> list[str]:
    """The plan's note of the row whose scans' padding it counts (`s`: a plan Setup); none without linear-attention
    layers."""
    row = row_padding(s.config, s.shape.scan_chunk, s.dims.dp_size)
    return [f"linear-attention scans planned with each document padded to whole chunks, on {row.source}"] \
        if s.shape.scan_chunk else []
