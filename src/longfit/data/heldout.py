"""`data.eval_fraction`: documents of data.path held out of training for the eval loss.

A document is held out when a hash of its place in the data (file index and record number, not its byte
offset, so that editing an earlier line moves no other line across) falls below the fraction: the same
documents every run and on every rank, spread over the whole data, decided one document at a time so a
streaming source stays streaming. Training reads the others (`HeldOut(..., held_out=False)`), the eval the
held-out ones; positions are the source's own, so resuming reopens the source exactly as without a split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from longfit.data.documents import START, Document, Position
from longfit.data.sources import DocumentSource


def is_held_out(position: Position, fraction: float) -> bool:
    digest = hashlib.blake2b(f"{position.file}:{position.record}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


class HeldOut:
    """The documents of `source` that `data.eval_fraction` holds out (`held_out=True`) or leaves for training."""

    def __init__(self, source: DocumentSource, fraction: float, held_out: bool):
        self.source, self.fraction, self.held_out = source, fraction, held_out
        part = "the held-out" if held_out else "all but the held-out"
        self.description = f"{source.description} ({part} {fraction:g} of its documents, data.eval_fraction)"

    def documents(self, start: Position = START) -> Iterator[Document]:
        for doc in self.source.documents(start):
            if is_held_out(doc.position, self.fraction) == self.held_out:
                yield doc

    def read(self, position: Position) -> Document:
        return self.source.read(position)
