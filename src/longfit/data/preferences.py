"""Preference pairs (train.objective: dpo, ipo, simpo, orpo; #56): rows of `prompt`, `chosen`, `rejected`, each pair's
prompt laid out once for both answers.

A pair is read as TRL's DPOTrainer reads it. Conversational (the prompt a list of {role, content} messages): the
prompt through the chat template with its generation prompt, each answer (a string, or a list of assistant messages)
as the rest of the template's rendering of prompt + answer, up to and including its end-of-turn token (the last
special token, `documents.end_at_terminator`'s rule); the rendering must begin with the prompt's, else the row is an
error. Plain text: BOS + the prompt, and each answer + EOS.

The layout (longfit.memory.preference, models/blockwise.py's shared prompts). A pair of prompt P, chosen C and
rejected R takes |P| + |C| + |R| tokens of a row: P + C as one causal document, then R as a document whose prefix is P
(`DocumentLayout.prefixes`), its positions continuing from P's end as C's do, so every token of R computes what it
computes in P + R alone. The prompt's last token predicts both answers' first tokens: `labels` holds C's there,
`branch_labels` R's. `sequences` (`branch_sequences`) give each target's answer: 2p for pair p's chosen, 2p + 1 for
its rejected, -1 where none. `copies` counts each token's copies in the separate sequences prompt + chosen and
prompt + rejected (2 in P, 1 in an answer, 0 in padding): a MoE router loss's weights (memory/router_loss.py). Pairs
are packed greedily in data order (a pair that does not fit the rest of a row starts the next, the rest is one
padding document); a pair longer than seq_len is an error naming its row.

Every row of the data is read, checked and tokenised when the loader is made, before the first step; the pairs' ids
are held on the host (8 bytes a token). Data parallelism, epochs and resuming follow longfit.data.packing: every rank
builds the same global rows and keeps rows i % dp_size == dp_rank; the state is the next pair and the epoch. Each
batch names its pairs' places in the data (`pair_ids`), where a full fine-tune's stored reference log-probabilities are
read (longfit.train.reference); `pairs_digest` identifies the data they were computed for.

Held-out pairs (the eval's reward accuracy and margins): data.eval_path, a second pairs file, or data.eval_fraction, the
rows of data.path whose place (longfit.data.heldout's hash of the row number) falls below the fraction, the same rows
every run; training reads the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longfit.data.documents import DataError, DocumentEncoder, Position, validate_messages
from longfit.data.heldout import is_held_out
from longfit.data.packing import (IGNORE_INDEX, DocumentLayout, EpochCount, PackedBatch, PackingStats, pad_token_id,
                                  this_ranks_rows)

STATE_VERSION = 1
FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class Pair:
    prompt: np.ndarray  # (|P|,) int64
    chosen: np.ndarray  # (|C|,)
    rejected: np.ndarray  # (|R|,)

    def __len__(self) -> int:
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


@dataclass
class PairBatch(PackedBatch):
    """Rows of preference pairs (module docstring): PackedBatch's tensors (labels: the targets of the prompt + chosen
    documents and of the rejected answers), and the per-position (B, L) tensors of the second target and of each
    target's answer, which context parallelism shards with the tokens."""

    branch_labels: torch.Tensor | None = None  # (B, L): the rejected answer's first token at its prompt's last
    sequences: torch.Tensor | None = None  # (B, L): the answer of labels' target, -1 where none
    branch_sequences: torch.Tensor | None = None  # (B, L): the answer of branch_labels' target, -1 where none
    copies: torch.Tensor | None = None  # (B, L): the token's copies in prompt + chosen and prompt + rejected (2, 1, 0)
    answer_lengths: torch.Tensor | None = None  # (2 P,): every answer's tokens (chosen, rejected of each pair)
    pair_ids: torch.Tensor | None = None  # (P,): each pair's place in the data (`read_pairs`' order)
    pairs: int = 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PairBatch:
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking)
                 for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "branch_labels", "sequences",
                              "branch_sequences", "copies", "pair_ids")}
        return dataclasses.replace(self, **moved)


def _answer_messages(answer: Any, key: str) -> list[dict[str, str]]:
    if isinstance(answer, str):
        return [{"role": "assistant", "content": answer}]
    return validate_messages(answer, key)


def encode_pair(record: Any, encoder: DocumentEncoder, where: str) -> Pair:
    """One row as a Pair (module docstring); a bad row is a DataError naming `where`."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a preference row is an object with `prompt`, `chosen` and `rejected`, got "
                        f"{type(record).__name__}")
    missing = [name for name in FIELDS if record.get(name) in (None, "", [])]
    if missing:
        raise DataError(f"{where}: the preference row has no {', '.join(f'`{m}`' for m in missing)} (each row needs "
                        "a `prompt`, text or chat messages, and `chosen` and `rejected` answers): fix or drop it")
    prompt = record["prompt"]
    try:
        if isinstance(prompt, str):
            if not all(isinstance(record[name], str) for name in ("chosen", "rejected")):
                raise DataError("a text `prompt` takes text answers: give `chosen` and `rejected` as strings, or the "
                                "prompt as chat messages")
            head = [] if encoder.bos is None else [encoder.bos]
            tail = [] if encoder.eos is None else [encoder.eos]
            ids = encoder._encode([prompt, record["chosen"], record["rejected"]])
            return Pair(np.asarray(head + ids[0].tolist(), dtype=np.int64),
                        *(np.asarray(answer.tolist() + tail, dtype=np.int64) for answer in ids[1:]))
        messages = validate_messages(prompt, "`prompt`")
        if not encoder.chat_template:
            raise DataError("the tokenizer has no chat template to render chat messages: give the prompt as text")
        prompt_ids = list(encoder._render(messages, add_generation_prompt=True)["input_ids"])
        answers = []
        for name in ("chosen", "rejected"):
            full = list(encoder._render(messages + _answer_messages(record[name], f"`{name}`"))["input_ids"])
            if full[: len(prompt_ids)] != prompt_ids:
                raise DataError(f"the chat template renders prompt + `{name}` with a beginning other than the prompt's "
                                "own rendering, so the answer cannot be told apart")
            answer = full[len(prompt_ids):]
            last = max((i for i, token in enumerate(answer) if token in encoder.special), default=None)
            answers.append(answer if last is None else answer[: last + 1])
        if encoder.bos is not None and (not prompt_ids or prompt_ids[0] != encoder.bos):
            prompt_ids = [encoder.bos, *prompt_ids]
    except DataError as e:
        raise DataError(f"{where}: {e}") from e
    if not all(answers):
        raise DataError(f"{where}: an answer renders as no token")
    return Pair(*(np.asarray(ids, dtype=np.int64) for ids in (prompt_ids, *answers)))


def _records(path: Path) -> list[tuple[str, int, Any]]:
    """(where, record number from 0, record) of every row of a JSONL file or a `datasets` directory."""
    if path.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError as e:
            raise DataError(f"data.path={path} is a `datasets` directory: pip install datasets") from e
        return [(f"{path}, row {i}", i, row) for i, row in enumerate(load_from_disk(str(path)))]
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rows.append((f"{path}, line {number}", number - 1, json.loads(raw)))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path}, line {number}: malformed JSON ({e}): fix or drop that line") from e
    return rows


def read_pairs(cfg, tokenizer, key: str = "data.path", held_out: bool | None = None) -> list[Pair]:
    """Every pair of the file `key` names (data.path or data.eval_path), checked (module docstring): a missing field,
    a wrong type, a pair longer than seq_len is one error naming its row. `held_out`: only the rows data.eval_fraction
    holds out (True) or leaves for training (False)."""
    name = getattr(cfg.data, key.split(".")[1])
    path = Path(name).expanduser()
    if not path.exists() or (path.is_file() and path.suffix != ".jsonl"):
        raise DataError(f"{key}={name!r}: train.objective={cfg.train.objective} reads a .jsonl file or "
                        "a `datasets` directory of `prompt`, `chosen`, `rejected` rows")
    encoder = DocumentEncoder(tokenizer)
    pairs = []
    for where, record_number, record in _records(path):
        if held_out is not None and is_held_out(Position(0, record_number, record_number),
                                                cfg.data.eval_fraction) != held_out:
            continue
        pair = encode_pair(record, encoder, where)
        if len(pair) > cfg.seq_len:
            raise DataError(f"{where}: the pair takes {len(pair)} tokens (prompt {len(pair.prompt)}, chosen "
                            f"{len(pair.chosen)}, rejected {len(pair.rejected)}), more than a row of seq_len="
                            f"{cfg.seq_len}: raise seq_len or shorten the row")
        pairs.append(pair)
    if not pairs:
        part = {None: "", True: " that data.eval_fraction holds out", False: " left for training by data.eval_fraction"}
        raise DataError(f"{key}={name!r} holds no preference rows{part[held_out]}")
    return pairs


def training_pairs(cfg, tokenizer) -> list[Pair]:
    """The pairs training reads: data.path, less the rows data.eval_fraction holds out."""
    return read_pairs(cfg, tokenizer, held_out=False if cfg.data.eval_fraction else None)


def eval_pairs(cfg, tokenizer) -> list[Pair] | None:
    """The held-out pairs (module docstring), checked; None without data.eval_path or data.eval_fraction."""
    if cfg.data.eval_path:
        return read_pairs(cfg, tokenizer, "data.eval_path")
    return read_pairs(cfg, tokenizer, held_out=True) if cfg.data.eval_fraction else None


def pairs_digest(pairs: list[Pair]) -> str:
    """sha256 of every pair's token ids in order, each part's length first: what identifies the data of stored
    reference log-probabilities."""
    digest = hashlib.sha256()
    for pair in pairs:
        for part in (pair.prompt, pair.chosen, pair.rejected):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
    return digest.hexdigest()


@dataclass
class _Row:
    ids: np.ndarray
    labels: np.ndarray
    branch_labels: np.ndarray
    positions: np.ndarray
    sequences: np.ndarray  # pair-local answer index within the row (2 i, 2 i + 1), -1 where none
    branch_sequences: np.ndarray
    copies: np.ndarray  # a prompt token is in both separate sequences, an answer's in one, padding in none
    documents: list[tuple[int, int]]
    prefixes: list[tuple[int, int] | None]
    lengths: list[int]  # answers' token counts, in the row's order
    pair_ids: list[int]  # the row's pairs' places in the data


def _empty_row(length: int, pad_id: int) -> _Row:
    none = np.full(length, IGNORE_INDEX, dtype=np.int64)
    zeros, no_answer = np.zeros(length, dtype=np.int64), np.full(length, -1, dtype=np.int64)
    return _Row(np.full(length, pad_id, dtype=np.int64), none.copy(), none.copy(), zeros.copy(), no_answer.copy(),
                no_answer.copy(), zeros.copy(), [], [], [], [])


def _place(row: _Row, at: int, pair: Pair, index: int, pair_id: int) -> int:
    """Lay `pair` (the data's `pair_id`-th) out at offset `at` of the row as its `index`-th pair (module docstring);
    returns where it ends."""
    P, C, R = len(pair.prompt), len(pair.chosen), len(pair.rejected)
    chosen, rejected = 2 * index, 2 * index + 1
    end = at + P + C + R
    row.ids[at:end] = np.concatenate([pair.prompt, pair.chosen, pair.rejected])
    row.positions[at : at + P + C] = np.arange(P + C)
    row.positions[at + P + C : end] = np.arange(P, P + R)
    row.copies[at:end] = 1
    row.copies[at : at + P] = 2
    # prompt + chosen: position t predicts token t + 1 where it is chosen's; the last token predicts nothing
    row.labels[at + P - 1 : at + P + C - 1] = pair.chosen
    row.sequences[at + P - 1 : at + P + C - 1] = chosen
    row.branch_labels[at + P - 1] = pair.rejected[0]
    row.branch_sequences[at + P - 1] = rejected
    row.labels[at + P + C : end - 1] = pair.rejected[1:]
    row.sequences[at + P + C : end - 1] = rejected
    row.documents += [(at, at + P + C), (at + P + C, end)]
    row.prefixes += [None, (at, at + P)]
    row.lengths += [C, R]
    row.pair_ids.append(pair_id)
    return end


class PairLoader:
    """Iterator of PairBatch (micro_batch rows of seq_len tokens for this dp rank) with state_dict / load_state_dict,
    as longfit.data.packing.PackedLoader. `epochs` None repeats forever; `shuffle` reorders the pairs every epoch from
    (seed, epoch)."""

    def __init__(self, pairs: list[Pair], description: str, seq_len: int, micro_batch: int, pad_id: int, seed: int = 0,
                 shuffle: bool = False, dp_rank: int = 0, dp_size: int = 1, epochs: int | None = None):
        self.pairs, self.description = pairs, description
        self.seq_len, self.micro_batch, self.pad_id = seq_len, micro_batch, pad_id
        self.seed, self.shuffle, self.dp_rank, self.dp_size, self.epochs = seed, shuffle, dp_rank, dp_size, epochs
        self._epoch, self._next, self._rows, self._finished = 0, 0, 0, False
        self.stats = PackingStats()
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.pairs)))
        if self.shuffle:
            random.Random(f"{self.seed}:{self._epoch}").shuffle(order)
        return order

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def pairs_read(self) -> int:
        """The pairs of this epoch laid out so far, over every dp rank."""
        return self._next

    def _fill_row(self, keep: bool) -> _Row | None:
        row, filled = _empty_row(self.seq_len, self.pad_id), 0
        while not self._finished:
            if self._next == len(self.pairs):
                if filled:
                    break  # an epoch starts on a row of its own
                if self.epochs is not None and self._epoch + 1 >= self.epochs:
                    self._finished = True
                    break
                self._epoch, self._next = self._epoch + 1, 0
                self._order = self._epoch_order()
            pair_id = self._order[self._next]
            pair = self.pairs[pair_id]
            if filled + len(pair) > self.seq_len:
                break
            filled = _place(row, filled, pair, len(row.pair_ids), pair_id)
            self._next += 1
            if keep:
                self.stats.documents += 1
        if filled == 0 and self._finished and self._rows % (self.dp_size * self.micro_batch) == 0:
            return None
        if filled < self.seq_len:  # the rest: one padding document without targets
            row.positions[filled:] = np.arange(self.seq_len - filled)
            row.documents.append((filled, self.seq_len))
            row.prefixes.append(None)
        self._rows += 1
        if keep:
            self.stats.rows += 1
            self.stats.tokens += filled
            self.stats.padding_tokens += self.seq_len - filled
            self.stats.label_tokens += sum(row.lengths)
        return row

    def __iter__(self) -> PairLoader:
        return self

    def __next__(self) -> PairBatch:
        return collate(this_ranks_rows(self._fill_row, self.micro_batch, self.dp_rank, self.dp_size), self.seq_len)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "source": self.description, "epoch": self._epoch, "next": self._next,
                "rows": self._rows, "finished": self._finished, "stats": dataclasses.asdict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION or "next" not in state or not isinstance(state["next"], int):
            raise DataError("the checkpoint's data position is not a preference loader's: resume with the "
                            "train.objective it was trained with")
        if state["source"] != self.description:
            raise DataError(f"the checkpoint's data position belongs to {state['source']}, but data.path now gives "
                            f"{self.description}; resume with the same data.path")
        self._epoch, self._next = state["epoch"], state["next"]
        self._rows, self._finished = state["rows"], state["finished"]
        self._order = self._epoch_order()
        self.stats = PackingStats(**state["stats"])


def collate(rows: list[_Row], seq_len: int) -> PairBatch:
    """The batch of `rows`: answer indices renumbered over the batch, pair p's answers at 2p and 2p + 1."""
    offsets = np.cumsum([0] + [len(row.lengths) for row in rows])
    sequences = [np.where(row.sequences >= 0, row.sequences + offset, -1) for row, offset in zip(rows, offsets)]
    branch = [np.where(row.branch_sequences >= 0, row.branch_sequences + offset, -1)
              for row, offset in zip(rows, offsets)]
    stack = lambda arrays: torch.from_numpy(np.stack(arrays))  # noqa: E731
    labels = stack([row.labels for row in rows])
    branch_labels = stack([row.branch_labels for row in rows])
    layout = DocumentLayout(tuple(tuple(row.documents) for row in rows), seq_len,
                            tuple(tuple(row.prefixes) for row in rows))
    return PairBatch(
        input_ids=stack([row.ids for row in rows]), labels=labels, position_ids=stack([row.positions for row in rows]),
        cu_seqlens=torch.tensor(layout.cu_seqlens(), dtype=torch.int32),
        num_label_tokens=int((labels != IGNORE_INDEX).sum() + (branch_labels != IGNORE_INDEX).sum()),
        documents=layout, branch_labels=branch_labels, sequences=stack(sequences), branch_sequences=stack(branch),
        copies=stack([row.copies for row in rows]),
        answer_lengths=torch.tensor([n for row in rows for n in row.lengths], dtype=torch.int64),
        pair_ids=torch.tensor([i for row in rows for i in row.pair_ids], dtype=torch.int64),
        pairs=int(offsets[-1]) // 2,
    )


def build_pair_loader(cfg, tokenizer, dp_rank: int = 0, dp_size: int = 1, epochs: int | None = None) -> PairLoader:
    """The training pairs of `cfg` (every row checked here), batches of train.micro_batch rows for this dp rank."""
    split = f" (all but the held-out {cfg.data.eval_fraction:g}, data.eval_fraction)" if cfg.data.eval_fraction else ""
    return PairLoader(training_pairs(cfg, tokenizer), f"preference pairs {cfg.data.path}{split}", cfg.seq_len,
                      cfg.train.micro_batch, pad_token_id(tokenizer), seed=cfg.train.seed,
                      shuffle=cfg.data.shuffle_buffer > 0, dp_rank=dp_rank, dp_size=dp_size, epochs=epochs)


def count_pair_epoch(cfg, tokenizer) -> EpochCount:
    """One epoch of the pairs as the trainer packs them: its pairs, tokens and rows."""
    loader = build_pair_loader(cfg, tokenizer, epochs=1)
    for _ in loader:
        pass
    return EpochCount(loader.stats.documents, loader.stats.tokens, loader.stats.rows, True)
