"""Boundary-aware packing of documents into rows of exactly seq_len tokens, resumable.

Rows are filled greedily: a text document that does not fit the rest of a row is split there and goes
on at the start of the next row (and the next, if it is longer than seq_len), so no text is dropped and
no row is padded while text remains. Each piece is its own attention segment: positions restart at 0,
cu_seqlens marks its start, and labels are shifted inside the piece only (the last token of a piece
has no target; the piece after a split starts without the context before it).

A chat's target is an answer to what comes before it, so split chats would train answers without their
question, and give rows with no target at all. Unless `data.long_chats=split`, a chat is kept in one row:
one longer than seq_len is first cut to seq_len or dropped (`fit_chat`), and one that does not fit the
rest of a row starts the next row, the rest being padding. `PackingStats` counts what this did.

Data parallelism: every rank runs the same deterministic pipeline, builds each group of
dp_size x micro_batch rows and keeps rows i % dp_size == dp_rank, so ranks get disjoint rows without
talking to each other and all ranks hold the same state after every batch. Context-parallel ranks of
one dp group must share a dp_rank.

The stream repeats epochs forever (or `epochs` times), each starting on a new row (the last row of an epoch
is padded), each optionally shuffled through a streaming buffer of `data.shuffle_buffer` documents; draw n of epoch e picks a buffer slot from a
generator seeded by (train.seed, e, n), so a resumed run makes the same draws. The state is small:
source positions of the buffered documents and of the document in progress, never token data.

The document layout of a batch (`DocumentLayout`: per row, where its documents lie) is made here, on the host,
once per batch, from the same segment starts as `cu_seqlens`; attention reads it at every layer, and reading
it from the device tensor there would synchronise with the device at every layer.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from longfit.data.documents import START, DataError, Document, Position
from longfit.data.heldout import HeldOut
from longfit.data.media import AUDIO, IMAGE, VIDEO, MediaBatch, MediaReader, check_media_rows, fit_media_chat
from longfit.data.sources import DocumentSource, open_source

IGNORE_INDEX = -100
STATE_VERSION = 1
TARGET_SCAN_DOCUMENTS = 10_000  # documents read up front, at most, looking for one with a training target
# Tokens read up front, at most, to describe an epoch that train.epochs does not need counted whole: SmolLM2's
# tokenizer packed 0.15M tokens/s on a loaded 2-core CPU (byte-level: 0.73M), so at most about 30 s.
COUNT_TOKENS = 1 << 22


Spans = tuple[tuple[tuple[int, int], ...], ...]  # per row, its documents' [start, end) positions in the row


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor's copy on `device`, which does not wait for the device: on CUDA through pinned memory,
    asynchronously (torch keeps the pinned buffer until the copy has run); a copy from pageable memory waits for the
    stream, i.e. stalls the host inside a step. Elsewhere a plain copy."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def under_fake_tensors() -> bool:
    """Whether a fake tensor mode is active (longfit.plan's traces): what is made now holds no values."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def device_cache(maxsize: int):
    """`functools.lru_cache(maxsize)` for a function making device tensors from a host description (a batch's
    layout), which keeps nothing made under fake tensors: a plan's trace of the layers would otherwise hand its fake
    tensors to the real step of the same layout after it, whose loss and gradients then hold no values (#54)."""

    def wrap(make):
        cached = functools.lru_cache(maxsize)(make)

        @functools.wraps(make)
        def call(*args):
            return make(*args) if under_fake_tensors() else cached(*args)

        call.cache_clear = cached.cache_clear
        return call

    return wrap


class DocumentLayout:
    """Where the documents of a packed batch lie, on the host: `rows[b]` are the [start, end) positions (row
    coordinates, in order, tiling the row) of row b's documents, over whole rows of `length` tokens.

    It describes the same documents as `cu_seqlens` (their starts over the flattened B x length tokens), in the
    form attention needs: every attention path (per-document kernels, sliding windows, the ring's and the tiled
    layers' block plans) decides on the host which queries see which keys, at every layer and again in
    recomputation. Read from a device tensor each time, that would be a device-to-host synchronisation per layer
    call. So a batch carries it from where it is made (`PackedBatch.documents`), and the model call passes it
    down as `longfit_documents` (longfit.models.attention). Rows are the global, unsharded rows: every
    context-parallel rank holds the same layout.

    A plain object (its layout never changes) rather than a dataclass or tuples: FSDP2 casts a layer's keyword
    arguments through `torch.distributed.utils._apply_to_tensors`, which rebuilds every dataclass, tuple and list
    it meets, at every layer; this object is passed on as it is.

    `prefixes` (preference pairs, #56; None elsewhere): per row, per document, None or the [start, end) of an earlier
    span of the row that the document's queries also see, all of it, before their own causal keys: the shared prompt
    of a rejected answer laid out after prompt + chosen answer (longfit.data.preferences). Only the attention paths
    that plan blocks (models/blockwise.py: one device, Ulysses, the ring) compute such layouts; `document_rows` and
    `starts_on` refuse them to every other path.

    `bidirectional` (Gemma 3's images, #54; None elsewhere): per row, the [start, end) spans (inside one document each)
    whose tokens also see the later tokens of their own span: an image's tokens, which transformers' Gemma 3 lets
    attend to each other both ways (`longfit.models.media_gemma3`). Computed by the same block-planning paths only.
    `global_layout` (Gemma 4's images; None elsewhere): where the spans hold on the sliding-window layers only, the
    layout the global layers compute (this one without its spans; `longfit.models.attention.layer_documents`).
    """

    __slots__ = ("rows", "length", "prefixes", "bidirectional", "global_layout", "_device_starts", "_chunked")

    def __init__(self, rows: Spans, length: int, prefixes: tuple | None = None, bidirectional: Spans | None = None,
                 global_layout: DocumentLayout | None = None):
        self.rows = rows
        self.length = length
        self.prefixes = prefixes
        self.bidirectional = bidirectional
        self.global_layout = global_layout
        self._device_starts: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._chunked: dict[int, DocumentLayout] = {}

    @classmethod
    @functools.lru_cache(maxsize=8)
    def one_document_per_row(cls, batch: int, length: int) -> DocumentLayout:
        """The layout of `batch` rows of one document each; one object per shape, so its device copy of the starts
        (`starts_on`) is made once, not at every layer that asks for it."""
        return cls((((0, length),),) * batch, length)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor | Sequence[int], batch: int) -> DocumentLayout:
        """The layout of `batch` rows from document starts over the flattened rows (the GLOBAL, unsharded
        cu_seqlens: 0 first, batch x row length last); a tensor is read on the host here, once.

        Every row boundary must be a document boundary; raises ValueError naming the mismatch otherwise.
        Empty documents (repeated starts) are dropped.
        """
        starts = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(s) for s in cu_seqlens]
        if not starts or starts[0] != 0 or starts[-1] % batch:
            raise ValueError(
                f"cu_seqlens must run from 0 to batch x seq_len over the GLOBAL (unsharded) rows of the batch's "
                f"{batch} rows, got {starts[:1]}..{starts[-1:]}: pass the batch's unsharded cu_seqlens"
            )
        length = starts[-1] // batch
        rows: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
        for start, end in zip(starts[:-1], starts[1:]):
            if end < start:
                raise ValueError(f"cu_seqlens must be non-decreasing, got {start} then {end}")
            if end == start:
                continue
            row = start // length
            if end > (row + 1) * length:
                raise ValueError(
                    f"cu_seqlens: document [{start}, {end}) crosses the end of row {row} (seq_len={length}); "
                    "every row boundary must also be a document boundary"
                )
            rows[row].append((start - row * length, end - row * length))
        return cls(tuple(map(tuple, rows)), length)

    @property
    def one_per_row(self) -> bool:
        """Whether every row is a single document (the dense kernels apply)."""
        return all(docs == ((0, self.length),) for docs in self.rows)

    @property
    def longest(self) -> int:
        """Tokens of the longest document; with `prefixes`, from its prefix's start: how far back a query sees."""
        prefixes = self.prefixes or [[None] * len(docs) for docs in self.rows]
        return max(end - (start if prefix is None else prefix[0])
                   for docs, row_prefixes in zip(self.rows, prefixes) for (start, end), prefix in zip(docs, row_prefixes))

    def chunked(self, chunk: int) -> DocumentLayout:
        """Every document cut into chunks of `chunk` tokens counted from its own start (the last one shorter): the
        layout of chunked attention (Llama 4), where a token sees the earlier tokens of its chunk only. Made once per
        chunk size and kept, so every chunked layer of a step shares one layout (and its device copy)."""
        if self.prefixes is not None:
            raise _shared_prompt_error("chunked attention (Llama 4's attention_chunk_size)")
        if self.bidirectional is not None:
            raise _bidirectional_error("chunked attention (Llama 4's attention_chunk_size)")
        layout = self._chunked.get(chunk)
        if layout is None:
            rows = tuple(
                tuple((s, min(s + chunk, end)) for start, end in docs for s in range(start, end, chunk))
                for docs in self.rows
            )
            layout = self._chunked[chunk] = DocumentLayout(rows, self.length)
        return layout

    def cu_seqlens(self) -> list[int]:
        """Document starts over the flattened rows, 0 first and batch x length last (empty documents dropped)."""
        return [0] + [b * self.length + end for b, docs in enumerate(self.rows) for _, end in docs]

    def starts_on(self, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """`cu_seqlens()` as a `dtype` tensor on `device` (flash-attn's varlen kernels read int32 starts there,
        flash-linear-attention int64 ones, on the device and on the host), made once per layout and kept: every layer
        gets the same tensor (flash-linear-attention caches what it derives from it by identity), copied without
        waiting for the device (`host_to_device`)."""
        if self.prefixes is not None:
            raise _shared_prompt_error("flash-attn's and flash-linear-attention's varlen kernels")
        if self.bidirectional is not None:
            raise _bidirectional_error("flash-attn's and flash-linear-attention's varlen kernels")
        key = (torch.device(device), dtype)
        starts = self._device_starts.get(key)
        if starts is None:
            starts = host_to_device(torch.tensor(self.cu_seqlens(), dtype=dtype), device)
            if not under_fake_tensors():  # kept for the real steps only (`device_cache`)
                self._device_starts[key] = starts
        return starts

    def with_bidirectional(self, spans: Spans, sliding_layers_only: bool = False) -> DocumentLayout:
        """This layout with `spans` (per row) attending both ways inside each span (`bidirectional`), on every layer
        or on the sliding-window layers only (the global ones then compute this layout, `global_layout`); itself
        when no row has one."""
        if not any(spans):
            return self
        return DocumentLayout(self.rows, self.length, self.prefixes, tuple(map(tuple, spans)),
                              self if sliding_layers_only else None)

    def __repr__(self) -> str:
        return f"DocumentLayout(rows={self.rows!r}, length={self.length})"


def _shared_prompt_error(part: str):
    from longfit.config import ConfigError

    return ConfigError(f"{part} cannot compute answers that share their prompt (train.objective, #56): train the "
                       "preference objectives on a model and memory techniques without it")


def _bidirectional_error(part: str):
    from longfit.config import ConfigError

    return ConfigError(f"{part} cannot compute the bidirectional attention inside Gemma 3's images (#54): train its "
                       "image rows without it (one device, the ring or Ulysses, tiled layers or not)")


def document_rows(documents: DocumentLayout | None, batch: int, length: int, shared_prompts: bool = False) -> Spans:
    """`documents`' rows, which must be `batch` whole rows of `length` tokens (attention's q is (B, H, length, D)
    on one rank, a shard of it under context parallelism); None: one document per row. `shared_prompts`: the caller
    plans blocks (models/blockwise.py), so also computes `documents.prefixes` and `documents.bidirectional`; every
    other caller refuses a layout that has them."""
    if documents is None:
        return (((0, length),),) * batch
    if documents.prefixes is not None and not shared_prompts:
        raise _shared_prompt_error("memory.tiled_layers, linear-attention and token-mixer layers")
    if documents.bidirectional is not None and not shared_prompts:
        raise _bidirectional_error("linear-attention and token-mixer layers")
    if (len(documents.rows), documents.length) != (batch, length):
        raise ValueError(
            f"cu_seqlens describe {len(documents.rows)} rows of {documents.length} tokens, but attention runs over "
            f"batch x seq_len = {batch} x {length} = {batch * length} tokens: pass the batch's GLOBAL (unsharded) "
            f"cu_seqlens, from 0 to {batch * length}"
        )
    return documents.rows


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (B, L) long
    labels: torch.Tensor  # (B, L) long, already shifted: the target of position t, -100 where none
    position_ids: torch.Tensor  # (B, L) long, restarting at 0 in every segment
    cu_seqlens: torch.Tensor | None  # (n_segments + 1,) int32 segment starts over the flattened B*L tokens
    num_label_tokens: int  # labels != -100, counted on the host so the trainer needs no device sync
    documents: DocumentLayout | None = None
    """cu_seqlens' layout on the host, for attention (no device sync per layer); derived from cu_seqlens when not
    given. Kept whole by `.to()` and by context-parallel sharding (the rows stay global). None, like cu_seqlens:
    one document per row."""
    media: MediaBatch | None = None
    """The rows' images (#54: `longfit.data.media`); None: text rows."""

    def __post_init__(self):
        if self.documents is None and self.cu_seqlens is not None:
            self.documents = DocumentLayout.from_cu_seqlens(self.cu_seqlens, self.input_ids.shape[0])

    @classmethod
    def of_documents(cls, input_ids: torch.Tensor, doc_lengths: list[list[int]]) -> PackedBatch:
        """Rows of token ids (B, L), row b packing documents of doc_lengths[b] tokens, laid out as the packer lays
        them out: position_ids restart in every document, each label is the next token of its document (-100 at the
        document's end, so nothing is predicted across a boundary), cu_seqlens the document starts over the
        flattened rows."""
        rows, length = input_ids.shape
        labels = torch.full_like(input_ids, -100)
        position_ids = torch.empty_like(input_ids)
        starts = [0]
        for b, lengths in enumerate(doc_lengths):
            if sum(lengths) != length:
                raise ValueError(f"row {b}'s documents {lengths} do not fill its {length} tokens")
            offset = 0
            for n in lengths:
                position_ids[b, offset : offset + n] = torch.arange(n)
                labels[b, offset : offset + n - 1] = input_ids[b, offset + 1 : offset + n]
                offset += n
                starts.append(b * length + offset)
        return cls(input_ids, labels, position_ids, torch.tensor(starts, dtype=torch.int32),
                   int((labels != -100).sum()))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(
            self.input_ids.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.position_ids.to(device, non_blocking=non_blocking),
            None if self.cu_seqlens is None else self.cu_seqlens.to(device, non_blocking=non_blocking),
            self.num_label_tokens,
            self.documents,
            None if self.media is None else self.media.to(device, non_blocking=non_blocking),
        )


@dataclass
class PackingStats:
    """Counts over the rows THIS rank received (sum over dp ranks for the global numbers)."""

    rows: int = 0
    documents: int = 0  # documents whose first token landed in these rows
    split_documents: int = 0  # of those, documents continued in a later row
    long_documents: int = 0  # of those, documents longer than seq_len (always split)
    tokens: int = 0  # data tokens (not padding)
    padding_tokens: int = 0
    label_tokens: int = 0  # tokens with a target
    long_chats: int = 0  # chats longer than seq_len, before data.long_chats applied
    long_chats_cut: int = 0  # of those, cut to seq_len tokens (keep_end, truncate)
    long_chats_dropped: int = 0  # of those, dropped (drop; keep_end: a chat without an assistant turn)
    chat_tokens_cut: int = 0  # tokens of those chats that no row holds
    split_chats: int = 0  # chats split across rows (data.long_chats=split)


def fit_chat(doc: Document, seq_len: int, policy: str) -> Document | None:
    """A chat as `data.long_chats` keeps it: within seq_len tokens, or None (dropped). Shorter chats and
    `split` are unchanged. `keep_end` ends the window at the last target: tokens after it (a trailing user
    turn, the separator after the last answer) teach nothing and would push context out. A chat with images is
    never cut inside one: the window moves inward to the image's edge and leaves it out (`fit_media_chat`)."""
    if len(doc) <= seq_len or policy == "split":
        return doc
    if policy == "drop":
        return None
    if policy == "truncate":
        start, end = 0, seq_len
    else:
        targets = np.flatnonzero(doc.loss_mask)
        if not targets.size:
            return None
        end = int(targets[-1]) + 1
        start = max(0, end - seq_len)
    if doc.media:  # the window shrinks to leave every image whole (#54)
        fitted = fit_media_chat(doc.ids, doc.loss_mask, list(doc.media), start, end)
        if fitted is None:
            return None
        ids, mask, media = fitted
        return Document(ids, mask, doc.position, doc.next, chat=True, media=tuple(media))
    return Document(doc.ids[start:end], doc.loss_mask[start:end], doc.position, doc.next, chat=True)


@dataclass
class _Row:
    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    segments: list[int] = field(default_factory=list)  # segment lengths in row order
    media: list = field(default_factory=list)  # its images (MediaItem), their tokens in row coordinates


def this_ranks_rows(fill_row, micro_batch: int, dp_rank: int, dp_size: int) -> list:
    """This rank's micro_batch rows of the next group of dp_size x micro_batch: the whole group is built (`fill_row(keep)`
    returns a row, or None at the data's end: StopIteration), keeping this rank's, so that every rank stops at the same
    position: one state for all ranks, and dp_size may change on resume."""
    rows = []
    for index in range(dp_size * micro_batch):
        row = fill_row(keep=index % dp_size == dp_rank)
        if row is None:
            raise StopIteration
        if index % dp_size == dp_rank:
            rows.append(row)
    return rows


class PackedLoader:
    """Iterator of `PackedBatch` (micro_batch rows of seq_len tokens) with `state_dict` / `load_state_dict`.

    Use `build_dataloader` to make one. `epochs=None` repeats forever; with a number, the last row is
    padded (padding is its own segment with no targets) and all-padding rows complete the last batch
    of every rank, so all ranks stop after the same number of batches.
    """

    def __init__(self, source: DocumentSource, seq_len: int, micro_batch: int, pad_id: int, seed: int = 0,
                 shuffle_buffer: int = 0, dp_rank: int = 0, dp_size: int = 1, epochs: int | None = None, *,
                 long_chats: str):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        if seq_len < 2 or micro_batch < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 2 and micro_batch={micro_batch} >= 1")
        self.source = source
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epochs = epochs
        self.long_chats = long_chats
        self.stats = PackingStats()
        self._epoch = 0
        self._next = START  # next unread source position in this epoch
        self._exhausted = False  # the source has no documents left in this epoch
        self._epoch_documents = 0
        self._buffer: list[Document] = []
        self._draws = 0
        self._current: Document | None = None  # document in progress
        self._offset = 0  # tokens of `_current` already packed
        self._rows = 0  # global rows produced, all ranks
        self._finished = False
        self._reader = None

    # ---- document stream -------------------------------------------------------------------------
    def _read_source(self) -> Document | None:
        """The next non-empty document in source order, None at the end of the epoch."""
        while not self._exhausted:
            if self._reader is None:
                self._reader = self.source.documents(self._next)
            doc = next(self._reader, None)
            if doc is None:
                self._exhausted = True
                self._reader = None
                return None
            self._next = doc.next
            if len(doc) > 0:
                self._epoch_documents += 1
                return doc
        return None

    def _draw(self) -> Document | None:
        """The next document of this epoch: in source order, or from the shuffle buffer."""
        if self.shuffle_buffer <= 0:
            return self._read_source()
        while len(self._buffer) < self.shuffle_buffer and (doc := self._read_source()) is not None:
            self._buffer.append(doc)
        if not self._buffer:
            return None
        slot = random.Random(f"{self.seed}:{self._epoch}:{self._draws}").randrange(len(self._buffer))
        self._draws += 1
        doc = self._buffer[slot]
        self._buffer[slot] = self._buffer[-1]
        self._buffer.pop()
        return doc

    def _next_document(self, keep: bool) -> Document | None:
        """The next document to pack (a chat as data.long_chats keeps it), starting a new epoch when one ends;
        None after the last epoch. `keep`: count a long chat in this rank's stats."""
        while True:
            doc = self._draw()
            if doc is not None:
                fitted = fit_chat(doc, self.seq_len, self.long_chats) if doc.chat else doc
                if keep and doc.chat and len(doc) > self.seq_len:
                    self.stats.long_chats += 1
                    self.stats.long_chats_cut += fitted is not None and len(fitted) < len(doc)
                    self.stats.long_chats_dropped += fitted is None
                    self.stats.chat_tokens_cut += len(doc) - (0 if fitted is None else len(fitted))
                if fitted is not None:
                    return fitted
                continue
            if self._epoch_documents == 0:
                raise DataError(f"{self.source.description} contains no documents (data.path)")
            if self.epochs is not None and self._epoch + 1 >= self.epochs:
                return None
            self._epoch += 1
            self._next, self._exhausted, self._epoch_documents, self._draws = START, False, 0, 0

    # ---- rows ----------------------------------------------------------------------------------------
    def _fill_row(self, keep: bool) -> _Row | None:
        """The next global row, or None when the data has ended and the last batch is complete."""
        L = self.seq_len
        row = _Row(np.full(L, self.pad_id, dtype=np.int64), np.full(L, IGNORE_INDEX, dtype=np.int64), np.zeros(L, dtype=np.int64))
        filled = 0
        while filled < L and not self._finished:
            if self._current is None:
                epoch = self._epoch
                self._current, self._offset = self._next_document(keep), 0
                if self._current is None:
                    self._finished = True
                    break
                if self._epoch != epoch and filled:
                    break  # an epoch starts on a row of its own, so that every epoch is the rows `count_epoch` counts
            doc, start = self._current, self._offset
            if doc.chat and self.long_chats != "split" and filled and len(doc) > L - filled:
                break  # the chat starts the next row, whole
            take = min(L - filled, len(doc) - start)
            row.media += [item.shifted(filled) for item in doc.media]  # never split: the whole chat is in this row
            span = slice(filled, filled + take)
            row.ids[span] = doc.ids[start : start + take]
            # Shift inside the piece: position t predicts token t + 1 when that token is a target.
            targets = doc.ids[start + 1 : start + take]
            row.labels[filled : filled + take - 1] = np.where(doc.loss_mask[start + 1 : start + take], targets, IGNORE_INDEX)
            row.positions[span] = np.arange(take)
            row.segments.append(take)
            if keep and start == 0:
                self.stats.documents += 1
                self.stats.split_documents += take < len(doc)
                self.stats.long_documents += len(doc) > L
                self.stats.split_chats += doc.chat and take < len(doc)
            filled += take
            self._offset += take
            if self._offset == len(doc):
                self._current = None
        if filled == 0 and self._finished and self._rows % (self.dp_size * self.micro_batch) == 0:
            return None
        if filled < L:  # data ended, or a chat did not fit: the rest is one padding segment without targets
            row.positions[filled:] = np.arange(L - filled)
            row.segments.append(L - filled)
        self._rows += 1
        if keep:
            self.stats.rows += 1
            self.stats.tokens += filled
            self.stats.padding_tokens += L - filled
            self.stats.label_tokens += int((row.labels != IGNORE_INDEX).sum())
        return row

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> PackedBatch:
        return self._collate(this_ranks_rows(self._fill_row, self.micro_batch, self.dp_rank, self.dp_size))

    def _collate(self, rows: list[_Row]) -> PackedBatch:
        L = self.seq_len
        starts = [0]
        for b, row in enumerate(rows):
            starts.extend((b * L + np.cumsum(row.segments)).tolist())
        labels = torch.from_numpy(np.stack([row.labels for row in rows]))
        documents = DocumentLayout.from_cu_seqlens(starts, len(rows))
        return PackedBatch(
            input_ids=torch.from_numpy(np.stack([row.ids for row in rows])),
            labels=labels,
            position_ids=torch.from_numpy(np.stack([row.positions for row in rows])),
            cu_seqlens=torch.tensor(starts, dtype=torch.int32),
            num_label_tokens=int((labels != IGNORE_INDEX).sum()),
            documents=documents,
            media=MediaBatch.of_rows([row.media for row in rows], L, documents) if any(r.media for r in rows) else None,
        )

    @property
    def epoch(self) -> int:
        """The epoch (from 0) of the document being packed: it moves on when the data has been read to its end."""
        return self._epoch

    # ---- resuming ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The data position after the last batch returned: plain Python values (JSON-safe)."""
        return {
            "version": STATE_VERSION,
            "source": self.source.description,
            "epoch": self._epoch,
            "next": list(self._next),
            "exhausted": self._exhausted,
            "epoch_documents": self._epoch_documents,
            "buffer": [list(doc.position) for doc in self._buffer],
            "draws": self._draws,
            "current": None if self._current is None else list(self._current.position),
            "offset": self._offset,
            "rows": self._rows,
            "finished": self._finished,
            "stats": asdict(self.stats),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken: the same next batches (with the same data and rank
        layout; seq_len, micro_batch and dp_size may change, the document order stays)."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data loader state version {state.get('version')} is not {STATE_VERSION}")
        if state["source"] != self.source.description:
            raise DataError(f"the checkpoint's data position belongs to {state['source']}, but data.path now gives "
                            f"{self.source.description}; resume with the same data.path")
        self._epoch = state["epoch"]
        self._next = Position(*state["next"])
        self._exhausted = state["exhausted"]
        self._epoch_documents = state["epoch_documents"]
        self._buffer = [self.source.read(Position(*p)) for p in state["buffer"]]
        self._draws = state["draws"]
        # A chat in progress was fitted before it started; seq_len may have changed since (no count: counted then).
        current = None if state["current"] is None else self.source.read(Position(*state["current"]))
        if current is not None and current.chat:
            current = fit_chat(current, self.seq_len, self.long_chats)
        self._current = current
        self._offset = 0 if current is None else state["offset"]
        self._rows = state["rows"]
        self._finished = state["finished"]
        self.stats = PackingStats(**state["stats"])
        self._reader = None


def pad_token_id(tokenizer) -> int:
    """Padding never reaches the loss, but it is a real token id: pad, else EOS, else 0."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


def check_has_targets(source: DocumentSource, data_path: str | None, seq_len: int, long_chats: str) -> None:
    """The source starts with a document, and one of its first TARGET_SCAN_DOCUMENTS has a training target,
    as data.long_chats keeps it.

    Only chats can lack targets (the loss covers assistant turns only); data in which no chat has an
    assistant turn, or in which data.long_chats drops every chat or truncates away every answer, would
    otherwise train on nothing without a word. Every epoch keeps the document found here, so dropping
    long chats can never leave an epoch empty.
    """
    read = answered = 0
    for doc in source.documents(START):
        if doc.loss_mask[1:].any():
            kept = fit_chat(doc, seq_len, long_chats) if doc.chat else doc
            if kept is not None and kept.loss_mask[1:].any():
                return
            answered += 1
        read += 1
        if read == TARGET_SCAN_DOCUMENTS:
            break
    if read == 0:
        raise DataError(f"{source.description} contains no documents (data.path={data_path!r})")
    which = f"none of its {read} rows" if read < TARGET_SCAN_DOCUMENTS else f"none of its first {read} rows"
    if answered:
        raise DataError(
            f"{source.description}: {which} keeps a training target within seq_len={seq_len}: the chats are longer "
            f"than a row and data.long_chats={long_chats} "
            f"{'drops them' if long_chats == 'drop' else 'cuts off their answers'}. "
            f"Use data.long_chats=keep_end (the answer with the end of its context) or raise seq_len"
        )
    raise DataError(
        f"{source.description}: {which} has a training target. The loss covers the assistant turns of chat "
        f"`messages` only, and these chats have no 'assistant' message: add the assistant replies, or give the "
        f"whole text as plain text (data.text_field) to train on all of it"
    )


def media_source(cfg, tokenizer, media: MediaReader | None) -> tuple[DocumentSource, int]:
    """(the source of cfg.data.path, the images and videos its rows hold): with the checkpoint's `media` reader (#54),
    every row's images and videos checked (`check_media_rows`) and data.long_chats=split refused for them."""
    media = None if media is None else media.sampled(cfg.data)  # the run's video frames a second (#54)
    source = open_source(cfg, tokenizer, media)
    images = 0
    if media is not None and hasattr(source, "media_rows"):
        images = check_media_rows(source.media_rows(), media, cfg.seq_len)
    if images and cfg.data.long_chats == "split":
        raise DataError(f"{source.description}: data.long_chats=split would cut chats with images between rows, "
                        "and an image is never cut: use keep_end (the default), truncate or drop")
    return source, images


def training_source(cfg, tokenizer, media: MediaReader | None = None) -> DocumentSource:
    """The documents training reads: data.path (less those data.eval_fraction holds out), its start checked; with the
    checkpoint's `media` reader (#54), every row's images too (`check_media_rows`)."""
    if cfg.data.shuffle_buffer < 0:
        raise DataError(f"data.shuffle_buffer={cfg.data.shuffle_buffer}: use 0 (data order) or a buffer size >= 1")
    source, images = media_source(cfg, tokenizer, media)
    if cfg.data.eval_fraction:
        source = HeldOut(source, cfg.data.eval_fraction, held_out=False)
    check_has_targets(source, cfg.data.path, cfg.seq_len, cfg.data.long_chats)
    source.images = images  # the trainer builds the vision side only for data that holds images
    return source


@dataclass(frozen=True)
class EpochCount:
    """What one epoch of the training data holds, packed: counted by `count_epoch`."""

    documents: int
    tokens: int  # data tokens, not padding
    rows: int
    complete: bool  # False: the count stopped before the epoch ended, and these are only the rows it read


def count_epoch(cfg, tokenizer, max_tokens: int | None = None, media: MediaReader | None = None) -> EpochCount:
    """Pack the first epoch of the training data as the trainer does (its seed's shuffle, data.long_chats, `media`:
    the checkpoint's image reader), counting its documents, tokens and rows; stop early, incomplete, once more than
    `max_tokens` tokens are packed. Packing gives every rank the same global rows, so the count is that of any
    layout."""
    return _count(_first_epoch(cfg, tokenizer, media), max_tokens)


def _first_epoch(cfg, tokenizer, media: MediaReader | None, epochs: int = 1) -> PackedLoader:
    """The first `epochs` epochs' global rows, one a batch, as the trainer packs them; images and videos counted from
    their headers (no pixels)."""
    media = None if media is None else replace(media, pixels=False)
    return PackedLoader(training_source(cfg, tokenizer, media), cfg.seq_len, 1, pad_token_id(tokenizer),
                        seed=cfg.train.seed, shuffle_buffer=cfg.data.shuffle_buffer, epochs=epochs,
                        long_chats=cfg.data.long_chats)


def trained_epochs(cfg, tokenizer, media: MediaReader | None, rows: int) -> int:
    """The epochs whose packing differs among those the run trains on, `rows` global rows (train.steps x rows a
    step): one without data.shuffle_buffer (each epoch the data in its order, from a row of its own: the first
    epoch's rows again); under it, each epoch its own draw of the shuffle, train.epochs of them, or as many as `rows`
    reach of the first epoch's rows (one where the first epoch is longer than COUNT_TOKENS: only its start is
    read)."""
    if not cfg.data.shuffle_buffer:
        return 1
    if cfg.train.epochs:
        return cfg.train.epochs
    count = count_epoch(cfg, tokenizer, COUNT_TOKENS, media)
    return max(1, -(-rows // count.rows)) if count.complete else 1


@dataclass(frozen=True)
class MediaRow:
    """The packed row of an epoch that holds the most tower inputs (`heaviest_media_row`)."""

    index: int
    """Its place among the epoch's rows, from 0."""
    documents: int
    """Documents (chats) that start in it."""
    images: int
    video_patches: int
    """Temporal patches of its videos: each one input of the tower, as an image is (`longfit.data.video`)."""
    tokens: int
    """Its tokens that take image, video or audio embeddings."""
    rows: int
    """Rows read to find it."""
    complete: bool
    """False: the epochs were read only up to `max_tokens`, and this is the heaviest of their first `rows` rows."""
    epochs: int = 1
    """The epochs read (`trained_epochs`)."""
    batch_tokens: tuple[int, ...] = ()
    """The tokens of each vision tower input of the micro-batch (a dp rank's rows, as `this_ranks_rows` deals them)
    whose inputs (images, videos' temporal patches and audios) take the most: the tower's work of the step, as the
    headers count it (Pixtral's row breaks included)."""
    audios: int = 0
    """Its audios (Gemma 4's audio tower's inputs)."""
    batch_audio_tokens: tuple[int, ...] = ()
    """The tokens of each audio of that micro-batch: the audio tower's work of the step."""
    batch_audio: tuple[bool, ...] = ()
    """Whether each input of that micro-batch, in the step's order, is an audio (else a vision tower input): under
    context parallelism the run deals them over the ranks together (`longfit.parallel.media.deal`)."""


def _input_tokens(media: MediaBatch) -> list[list[tuple[bool, int]]]:
    """Per row, (whether an audio, the tokens that take embeddings) of each of its tower inputs in order (all of its
    tokens where only the headers were read); a row's inputs' tokens lie between their starts."""
    starts = [[] for _ in range(media.embedding_index.shape[0])]
    for row, start in media.item_starts:
        starts[row].append(start)
    ends = [row_starts[1:] + [media.embedding_index.shape[1]] for row_starts in starts]
    return [[(int(media.token_types[row, start]) == AUDIO, int((media.embedding_index[row, start:end] >= 0).sum()))
             for start, end in zip(row_starts, ends[row])] for row, row_starts in enumerate(starts)]


def _heaviest_batch(rows: list[list[tuple[bool, int]]], micro_batch: int, dp_size: int) -> tuple[tuple[bool, int], ...]:
    """The inputs of the micro-batch whose inputs take the most tokens, each dp rank's `micro_batch` rows of every
    group of dp_size x micro_batch (`this_ranks_rows`) from `rows` (each row's inputs, `_input_tokens`)."""
    group = micro_batch * dp_size
    batches = [[item for row in rows[first + rank : first + group : dp_size] for item in row]
               for first in range(0, len(rows), group) for rank in range(dp_size)]
    return tuple(max(batches, key=lambda batch: sum(tokens for _, tokens in batch), default=[]))


def heaviest_media_row(cfg, tokenizer, media: MediaReader, max_tokens: int | None = None,
                       epochs: int = 1, dp_size: int = 1) -> MediaRow | None:
    """The row of the training data's first `epochs` epochs (`trained_epochs`), packed as the trainer packs them
    (`count_epoch`'s rows: its seed's shuffle, each epoch its own draw, data.long_chats, chats kept whole and sharing
    rows), with the most images, video temporal patches and audios (then the most of their tokens), and the inputs of
    the heaviest micro-batch of cfg.train.micro_batch rows on `dp_size` ranks (`MediaRow.batch_tokens`): the vision
    tower's and the audios' tokens, and their order; headers only, nothing decoded but audios (their tokens follow
    their samples). Stops,
    incomplete, once more than `max_tokens` tokens are packed. None: no row holds media."""
    loader = _first_epoch(cfg, tokenizer, media, epochs)
    heaviest, documents, index, inputs = None, 0, -1, []
    for index, batch in enumerate(loader):
        started, documents = loader.stats.documents - documents, loader.stats.documents
        inputs += _input_tokens(batch.media) if batch.media is not None else [[]]
        if batch.media is not None:
            kinds = [int(batch.media.token_types[row, start]) for row, start in batch.media.item_starts]
            row = MediaRow(index, started, kinds.count(IMAGE), kinds.count(VIDEO),
                           int((batch.media.embedding_index >= 0).sum()), 0, True, audios=kinds.count(AUDIO))
            if heaviest is None or (len(kinds), row.tokens) > \
                    (heaviest.images + heaviest.video_patches + heaviest.audios, heaviest.tokens):
                heaviest = row
        if max_tokens is not None and loader.stats.tokens > max_tokens:
            break
    complete = max_tokens is None or loader.stats.tokens <= max_tokens
    if heaviest is None:
        return None
    step = _heaviest_batch(inputs, cfg.train.micro_batch, dp_size)
    return replace(heaviest, rows=index + 1, complete=complete, epochs=epochs,
                   batch_tokens=tuple(tokens for audio, tokens in step if not audio),
                   batch_audio_tokens=tuple(tokens for audio, tokens in step if audio),
                   batch_audio=tuple(audio for audio, _ in step))


def _count(loader: PackedLoader, max_tokens: int | None) -> EpochCount:
    stats, complete = loader.stats, True
    for _ in loader:
        if max_tokens is not None and stats.tokens > max_tokens:
            complete = False
            break
    return EpochCount(stats.documents, stats.tokens, stats.rows, complete)


def build_dataloader(cfg, tokenizer, dp_rank: int = 0, dp_size: int = 1, epochs: int | None = None,
                     media: MediaReader | None = None) -> PackedLoader:
    """The training stream of `cfg`: rows of cfg.seq_len, batches of cfg.train.micro_batch rows for this
    dp rank. Checks the data up front: a missing, empty or malformed start fails here, not mid-run. `media`: the
    checkpoint's reader of image parts (#54)."""
    return PackedLoader(
        training_source(cfg, tokenizer, media), cfg.seq_len, cfg.train.micro_batch, pad_token_id(tokenizer), seed=cfg.train.seed,
        shuffle_buffer=cfg.data.shuffle_buffer, dp_rank=dp_rank, dp_size=dp_size, epochs=epochs,
        long_chats=cfg.data.long_chats,
    )


class EvalData:
    """The eval rows of a run (`data.eval_path`, or the documents `data.eval_fraction` holds out of data.path), packed
    as training packs, in the data's order; opened and checked once, read from its start at every evaluation. With
    the checkpoint's `media` reader, its image and video rows are read as training reads them (#54): `images` counts
    them (the trainer builds the vision side for them too)."""

    def __init__(self, cfg, tokenizer, media: MediaReader | None = None):
        self.cfg, self.pad_id = cfg, pad_token_id(tokenizer)
        if cfg.data.eval_path:
            eval_cfg = replace(cfg, data=replace(cfg.data, path=cfg.data.eval_path))
            self.source, self.images = media_source(eval_cfg, tokenizer, media)
        else:
            source, self.images = media_source(cfg, tokenizer, media)
            self.source = HeldOut(source, cfg.data.eval_fraction, held_out=True)
            if next(self.source.documents(), None) is None:
                raise DataError(f"data.eval_fraction={cfg.data.eval_fraction} holds out none of the documents of "
                                f"{cfg.data.path or 'the synthetic task'}: raise it, or name eval data with data.eval_path")
        check_has_targets(self.source, cfg.data.eval_path or cfg.data.path, cfg.seq_len, cfg.data.long_chats)
        self.count = _count(self.loader(1), COUNT_TOKENS)  # its rows, for the progress an evaluation shows

    def loader(self, micro_batch: int, dp_rank: int = 0, dp_size: int = 1) -> PackedLoader:
        """The eval rows from the first, `micro_batch` rows per batch for this dp rank; they end after one pass."""
        return PackedLoader(self.source, self.cfg.seq_len, micro_batch, self.pad_id, dp_rank=dp_rank, dp_size=dp_size,
                            epochs=1, long_chats=self.cfg.data.long_chats)


def eval_data(cfg, tokenizer, media: MediaReader | None = None) -> EvalData | None:
    """The run's eval data, checked (None without data.eval_path or data.eval_fraction); `media`: as `EvalData`."""
    return EvalData(cfg, tokenizer, media) if cfg.data.eval_path or cfg.data.eval_fraction else None
