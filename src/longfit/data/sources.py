"""Streaming document sources behind `data.path`.

Every source is read lazily, one document at a time, so a corpus larger than memory trains; a single
document must fit in memory. Each document carries its `Position` (file, byte offset or row, record),
so a resumed run reopens the source exactly there (`documents(start)`, `read(position)`) instead of
re-reading what it already trained on.

- `.jsonl`: one JSON object per line with a string `data.text_field`, a `data.messages_field` chat
  (list of {role, content}; loss on assistant turns only), a ShareGPT `conversations` chat or an Alpaca
  instruction/input/output row, per `data.format` (`record_payload`). Blank lines are skipped.
- `.txt`: the whole file is ONE document. Long-context training wants whole books and articles, not
  the paragraphs a blank-line split would produce; put one document per file.
- a directory: every .txt / .jsonl file below it, in sorted path order.
- a local Hugging Face `datasets` directory (`save_to_disk`): memory-mapped Arrow read in row slices,
  each row read as a .jsonl line is; a DatasetDict uses its `train` split.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from longfit.data.documents import (
    START,
    DataError,
    Document,
    DocumentEncoder,
    Position,
    alpaca_messages,
    sharegpt_messages,
    validate_messages,
)
from longfit.data.media import MediaChatEncoder, MediaReader, has_media

SHAREGPT_FIELD = "conversations"
ALPACA_FIELDS = ("instruction", "input", "output")
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
TEXTS_PER_ENCODE = 64  # documents tokenized per call: the fast tokenizer batches in Rust
CHARS_PER_ENCODE = 1 << 20  # ... or fewer, so that the tokenizer's per-token bookkeeping of one batch stays small


class DocumentSource(Protocol):
    description: str

    def documents(self, start: Position = START) -> Iterator[Document]:
        """One pass over the source in order, beginning with the document at `start`."""

    def read(self, position: Position) -> Document:
        """The document at `position` (one that `documents` yielded before)."""


def _null_error(where: str, name: str, key: str, value: Any) -> DataError:
    got = "null" if value is None else type(value).__name__
    return DataError(f"{where}: '{name}' ({key}) is {got}, not {'a string' if key == 'data.text_field' else 'a list of messages'}; "
                     f"fix or drop that line")


def _field_error(where: str, cfg_data, found: Any) -> DataError:
    keys = sorted(found) if isinstance(found, dict) else type(found).__name__
    return DataError(
        f"{where}: no string field '{cfg_data.text_field}' (data.text_field), no '{cfg_data.messages_field}' "
        f"(data.messages_field) list, no ShareGPT '{SHAREGPT_FIELD}' and no Alpaca 'instruction' and 'output'; found "
        f"{keys}. Set data.text_field / data.messages_field to the field names of your data."
    )


def record_format(record: dict, cfg_data) -> str | None:
    """The format of one row under data.format=auto (its docstring is the rule), None when it matches none."""
    if isinstance(record.get(cfg_data.text_field), str):
        return "text"
    if cfg_data.messages_field in record:
        return "messages"
    if SHAREGPT_FIELD in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return "text" if cfg_data.text_field in record else None  # a null or non-string text: its own error


def record_payload(record: dict, cfg_data, where: str) -> tuple[str, Any]:
    """("text", the text) or ("chat", its messages) for one JSON row, per data.format."""
    fmt = record_format(record, cfg_data) if cfg_data.format == "auto" else cfg_data.format
    field = {"text": cfg_data.text_field, "messages": cfg_data.messages_field, "sharegpt": SHAREGPT_FIELD}.get(fmt)
    if fmt is None or (field is not None and field not in record):
        raise _field_error(where, cfg_data, record)
    if fmt == "text" and not isinstance(record[field], str):
        raise _null_error(where, field, "data.text_field", record[field])
    if fmt == "text":
        return "text", record[field]
    if fmt == "messages" and record[field] is None:
        raise _null_error(where, field, "data.messages_field", None)
    try:
        if fmt == "messages":
            return "chat", validate_messages(record[field], f"'{field}' (data.messages_field)")
        if fmt == "sharegpt":
            return "chat", sharegpt_messages(record[field], f"'{field}' (ShareGPT)")
        return "chat", alpaca_messages(record)
    except DataError as e:
        raise DataError(f"{where}: {e}") from e


class FileSource:
    """A list of .jsonl / .txt files read in order; positions are (file index, byte offset, line)."""

    def __init__(self, files: list[Path], encoder: DocumentEncoder, cfg_data, description: str):
        self.files = files
        self.encoder = encoder
        self.cfg_data = cfg_data
        self.description = description

    def documents(self, start: Position = START) -> Iterator[Document]:
        for index in range(start.file, len(self.files)):
            offset, line = (start.offset, start.record) if index == start.file else (0, 0)
            if self.files[index].suffix in TEXT_SUFFIXES:
                if offset == 0:
                    doc = self._text_file(index)
                    if doc is not None:
                        yield doc
            else:
                yield from self._jsonl(index, offset, line)

    def read(self, position: Position) -> Document:
        if not 0 <= position.file < len(self.files):
            raise DataError(f"{self.description}: no file {position.file}; did the data change since the checkpoint?")
        if self.files[position.file].suffix in TEXT_SUFFIXES:
            doc = self._text_file(position.file) if position.offset == 0 else None
        else:
            doc = next(self._jsonl(position.file, position.offset, position.record, batch=1), None)
        if doc is None or doc.position != position:
            raise DataError(f"{self.description}: no document at {position}; did the data change since the checkpoint?")
        return doc

    def _text_file(self, index: int) -> Document | None:
        path = self.files[index]
        try:
            text = path.read_bytes().decode("utf-8")  # bytes as written: no newline translation
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 text ({e}); data.path must hold UTF-8 text files") from e
        if not text.strip():
            return None
        (ids, mask), = self.encoder.texts([text])
        return Document(ids, mask, Position(index, 0, 0), Position(index + 1, 0, 0))

    def _jsonl(self, index: int, offset: int, line_number: int, batch: int = TEXTS_PER_ENCODE) -> Iterator[Document]:
        path = self.files[index]
        pending: list[tuple[Position, Position, str, Any]] = []  # (position, next, kind, payload)
        pending_chars = 0
        with path.open("rb") as f:
            f.seek(offset)
            for raw in f:
                position = Position(index, offset, line_number)
                offset += len(raw)
                line_number += 1
                if not raw.strip():
                    continue
                kind, payload = self._parse_line(raw, path, line_number)
                del raw  # a long line's bytes are not kept while its text is tokenised
                pending.append((position, Position(index, offset, line_number), kind, payload))
                pending_chars += len(payload) if kind == "text" else 0
                if len(pending) == batch or pending_chars >= CHARS_PER_ENCODE:
                    yield from self._encode(pending, path)
                    pending, pending_chars = [], 0
        yield from self._encode(pending, path)

    def _parse_line(self, raw: bytes, path: Path, line_number: int) -> tuple[str, Any]:
        where = f"{path}, line {line_number}"
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{where}: malformed JSON ({e}); every line of a .jsonl file (data.path) must be one JSON "
                            f"object: fix or drop that line") from e
        if not isinstance(record, dict):
            raise _field_error(where, self.cfg_data, record)
        return record_payload(record, self.cfg_data, where)

    def _encode(self, pending: list[tuple[Position, Position, str, Any]], path: Path) -> Iterator[Document]:
        texts = [payload for _, _, kind, payload in pending if kind == "text"]
        encoded_texts = iter(self.encoder.texts(texts) if texts else [])
        for position, following, kind, payload in pending:
            if kind == "text":
                ids, mask = next(encoded_texts)
            else:
                try:
                    ids, mask, media = encode_chat(self.encoder, payload, path.parent)
                except DataError as e:
                    raise DataError(f"{path}, line {position.record + 1}: {e}") from e
            yield Document(ids, mask, position, following, chat=kind == "chat", media=media if kind == "chat" else ())

    def media_rows(self) -> Iterator[tuple[str, Path, list]]:
        """(where, folder, messages) of every chat row with image or video parts, in order (JSON parsed, nothing
        rendered or decoded)."""
        for path in self.files:
            if path.suffix in TEXT_SUFFIXES:
                continue
            with path.open("rb") as f:
                for line_number, raw in enumerate(f, 1):
                    if raw.strip():
                        kind, payload = self._parse_line(raw, path, line_number)
                        if kind == "chat" and has_media(payload):
                            yield f"{path}, line {line_number}", path.parent, payload


class DatasetSource:
    """A local `datasets` directory; positions are (0, row, row)."""

    ROWS_PER_READ = 256

    def __init__(self, path: Path, encoder: DocumentEncoder, cfg_data):
        try:
            from datasets import DatasetDict, load_from_disk
        except ImportError as e:
            raise DataError(f"data.path={str(path)!r} is a `datasets` directory: install datasets "
                            f"(pip install 'longfit[data]')") from e

        self.description = f"datasets directory {path}"
        dataset = load_from_disk(str(path))
        if isinstance(dataset, DatasetDict):
            if "train" not in dataset and len(dataset) != 1:
                raise DataError(f"{path}: a DatasetDict with splits {list(dataset)} and no 'train' split; save the split to train on")
            dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
        fields = (cfg_data.text_field, cfg_data.messages_field, SHAREGPT_FIELD, *ALPACA_FIELDS)
        self.columns = [name for name in dict.fromkeys(fields) if name in dataset.column_names]
        if not self.columns:
            raise _field_error(f"{path} (columns)", cfg_data, dict.fromkeys(dataset.column_names))
        self.dataset = dataset.select_columns(self.columns)
        self.encoder = encoder
        self.cfg_data = cfg_data
        self.path = path

    def documents(self, start: Position = START) -> Iterator[Document]:
        for first in range(start.offset, len(self.dataset), self.ROWS_PER_READ):
            yield from self._encode(first, self._records(first, first + self.ROWS_PER_READ))

    def read(self, position: Position) -> Document:
        if not 0 <= position.offset < len(self.dataset):
            raise DataError(f"{self.description}: no row {position.offset}; did the data change since the checkpoint?")
        return next(self._encode(position.offset, self._records(position.offset, position.offset + 1)))

    def _records(self, first: int, end: int) -> list[dict[str, Any]]:
        """Rows first..end as JSON-like records (a column a row lacks holds None)."""
        values = self.dataset[first:end]
        return [dict(zip(self.columns, row)) for row in zip(*(values[name] for name in self.columns))]

    def _encode(self, first: int, records: list[dict[str, Any]]) -> Iterator[Document]:
        """One row at a time as a .jsonl line is read (`record_payload`, data.format), texts tokenised together."""
        payloads = [record_payload(record, self.cfg_data, f"{self.path}, row {row}") for row, record in enumerate(records, first)]
        texts = [payload for kind, payload in payloads if kind == "text"]
        encoded_texts = iter(self.encoder.texts(texts) if texts else [])
        for row, (kind, payload) in enumerate(payloads, first):
            if kind == "text":
                ids, mask = next(encoded_texts)
            else:
                try:
                    ids, mask, media = encode_chat(self.encoder, payload, self.path)
                except DataError as e:
                    raise DataError(f"{self.path}, row {row}: {e}") from e
            yield Document(ids, mask, Position(0, row, row), Position(0, row + 1, row + 1), chat=kind == "chat",
                           media=media if kind == "chat" else ())

    def media_rows(self) -> Iterator[tuple[str, Path, list]]:
        """(where, folder, messages) of every chat row with image or video parts (relative to the dataset's folder)."""
        for first in range(0, len(self.dataset), self.ROWS_PER_READ):
            for row, record in enumerate(self._records(first, first + self.ROWS_PER_READ), first):
                where = f"{self.path}, row {row}"
                kind, payload = record_payload(record, self.cfg_data, where)
                if kind == "chat" and has_media(payload):
                    yield where, self.path, payload


def encode_chat(encoder: DocumentEncoder, messages: list, folder: Path) -> tuple[Any, Any, tuple]:
    """(ids, loss_mask, images) of a chat: through the run's media encoder when its contents hold image or video
    parts (#54), relative paths from `folder`; one error line when the run has none."""
    if not has_media(messages):
        return (*encoder.chat(messages), ())
    if encoder.media is None:
        raise DataError("this chat has image or video parts, which this run cannot read: images train on a local "
                        "Qwen3.5, Qwen3.5-MoE, Gemma 3, Gemma 4, Mistral 3 or Llama 4 wrapper checkpoint with its "
                        "preprocessor_config.json (not yet: other families; #54); drop "
                        "the parts to train on the text")
    ids, mask, items = encoder.media.encode(messages, folder)
    return ids, mask, tuple(items)


def _is_dataset_dir(path: Path) -> bool:
    return any((path / marker).is_file() for marker in DATASET_MARKERS)


def open_source(cfg, tokenizer, media: MediaReader | None = None) -> DocumentSource:
    """The document source for `cfg.data.path` (the synthetic retrieval task when it is empty); `media`: how the
    run's checkpoint reads image parts (#54), None for a causal LM."""
    encoder = DocumentEncoder(tokenizer)
    if media is not None:
        encoder.media = MediaChatEncoder(encoder.chat, media, tokenizer)
    if not cfg.data.path:
        from longfit.data.synthetic import SyntheticSource

        return SyntheticSource(tokenizer, cfg.data.synthetic_samples, cfg.seq_len, cfg.train.seed)
    path = Path(cfg.data.path).expanduser()
    if not path.exists():
        raise DataError(f"data.path={cfg.data.path!r}: no such file or directory. Point data.path at a .jsonl/.txt "
                        f"file, a directory of them or a `datasets` save_to_disk directory (empty: synthetic task)")
    if path.is_dir():
        if _is_dataset_dir(path):
            return DatasetSource(path, encoder, cfg.data)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
        if not files:
            raise DataError(f"data.path={cfg.data.path!r}: the directory holds no .txt or .jsonl files and is not a "
                            f"`datasets` directory")
        return FileSource(files, encoder, cfg.data, f"directory {path}")
    if path.suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES:
        raise DataError(f"data.path={cfg.data.path!r}: unsupported file type {path.suffix!r}; use .jsonl or .txt, "
                        f"a directory of them or a `datasets` directory")
    return FileSource([path], encoder, cfg.data, f"file {path}")
